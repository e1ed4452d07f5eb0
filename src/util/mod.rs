//! Small helpers shared by every part of the trainer: logging set-up, the heap policy
//! of processes that run the model, the machine's memory figures, byte-size parsing
//! and printing, and the seeded generator of shuffles, crops and synthetic data.
//! Imports nothing of the crate.

pub mod bytes;
pub mod heap;
pub mod logging;
pub mod meminfo;
pub mod rng;
