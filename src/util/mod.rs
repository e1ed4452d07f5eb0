//! Small helpers shared by every part of the trainer: logging set-up, the machine's
//! memory figures, and byte-size parsing and printing.

pub mod bytes;
pub mod logging;
pub mod meminfo;
