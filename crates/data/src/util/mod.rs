//! Small helpers shared by every layer: logging set-up, the machine's memory
//! figures, byte-size parsing and printing, and the seeded generator of shuffles,
//! crops and synthetic data. Imports nothing of the crate.

pub mod bytes;
pub mod logging;
pub mod meminfo;
pub mod rng;
