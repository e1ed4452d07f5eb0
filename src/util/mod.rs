//! Small helpers of the trainer: those without libtorch (logging set-up, the
//! machine's memory figures, byte sizes, the seeded generator) from `vrtspike-data`,
//! and the trainer's own: the heap policy of processes that run the model, the
//! libraries mapped into this process, every read of tensor values back to the host
//! (counted: `readback`), and (in test builds) running one unit test alone in a
//! fresh process. Imports nothing of the crate.

pub use vrtspike_data::util::{bytes, logging, meminfo, rng};

#[cfg(test)]
pub(crate) mod alone;
pub mod heap;
pub mod maps;
pub mod readback;
