//! Small helpers shared by every layer: logging set-up, the machine's memory
//! figures, byte-size parsing and printing, the seeded generator of shuffles,
//! crops and synthetic data, and telling a socket read's timeout. Imports nothing of
//! the crate.

pub mod bytes;
pub mod logging;
pub mod meminfo;
pub mod rng;

/// Whether a socket read gave up at its timeout.
pub fn is_timeout(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{TimedOut, WouldBlock};
    matches!(e.kind(), WouldBlock | TimedOut)
}
