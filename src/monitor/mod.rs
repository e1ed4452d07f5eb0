//! Watching a run: the memory monitor of a rank ([`memory`], with the device's
//! utilisation over each window from NVML's samples, [`utilisation`]), TensorBoard event files fed from the metrics records
//! ([`tb_sink`], [`tensorboard`], [`tfrecord`]), the researcher's log line
//! ([`logline`]), and, from a finished or running run directory, one figure
//! ([`plot`]) and a bottleneck diagnosis ([`analyze`]) read through [`run`].
//!
//! The writers ([`tensorboard`], [`tb_sink`], [`logline`]) depend on nothing of the
//! trainer, so `train::metrics` can feed them; the readers ([`run`], [`plot`],
//! [`analyze`]) only read files.

pub mod analyze;
pub mod logline;
pub mod memory;
pub mod plot;
pub mod run;
pub mod tb_sink;
pub mod tensorboard;
pub mod tfrecord;
pub mod utilisation;

use std::path::{Path, PathBuf};

pub use tb_sink::TensorBoardSink;

/// Errors of the monitor: always the file (or tag) at fault.
#[derive(Debug, thiserror::Error)]
pub enum MonitorError {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file is not what it should be.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// An image could not be encoded.
    #[error("image {0}: {1}")]
    Image(String, String),
    /// Drawing the figure failed.
    #[error("plot {path}: {message}")]
    Plot {
        /// The figure's file.
        path: PathBuf,
        /// What failed.
        message: String,
    },
}

impl MonitorError {
    /// An I/O error on `path`.
    pub fn io(path: &Path, source: std::io::Error) -> MonitorError {
        MonitorError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    /// A format error in `path`.
    pub fn format(path: &Path, message: impl Into<String>) -> MonitorError {
        MonitorError::Format {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }
}
