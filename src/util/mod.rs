//! Small helpers shared by every part of the trainer: logging set-up, the heap policy
//! of processes that run the model, the libraries mapped into this process, the
//! machine's memory figures, byte-size parsing
//! and printing, the seeded generator of shuffles, crops and synthetic data, every
//! read of tensor values back to the host (counted: `readback`), and (in
//! test builds) running one unit test alone in a fresh process. Imports nothing of
//! the crate.

#[cfg(test)]
pub(crate) mod alone;
pub mod bytes;
pub mod heap;
pub mod logging;
pub mod maps;
pub mod meminfo;
pub mod readback;
pub mod rng;
