//! The dataset layer's error type: every variant names the file (or key) at fault
//! and what was wrong, so a bad input is never a bare I/O error or a panic. It knows
//! nothing of the cache or the loader (the pipeline's error wraps it).

use std::path::PathBuf;

/// A dataset input that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file or folder could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A required file is missing (e.g. a blur frame without its spike partner).
    #[error("{path}: missing ({why})")]
    Missing {
        /// The file that should exist.
        path: PathBuf,
        /// Why it is required.
        why: String,
    },
    /// A file exists but its content is not what the format page says.
    #[error("{path}: {message}")]
    Format {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A request does not fit the data (crop out of bounds, unknown sequence, ...).
    #[error("{0}")]
    Request(String),
    /// A check of the file could not finish for a reason outside it (its probe
    /// process killed by a signal from outside, again and again): no verdict on the
    /// file, so `DATA.SKIP_BAD_FRAMES` never skips it (one rank would then train
    /// without a file the others keep).
    #[error("{path}: {why}")]
    Unjudged {
        /// The file that could not be checked.
        path: PathBuf,
        /// Why not.
        why: String,
    },
}

impl DataError {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> DataError {
        DataError::Io {
            path: path.into(),
            source,
        }
    }

    /// A format error in `path`.
    pub fn format(path: impl Into<PathBuf>, message: impl Into<String>) -> DataError {
        DataError::Format {
            path: path.into(),
            message: message.into(),
        }
    }
}

impl DataError {
    /// Whether the error says something about the data (a missing, unreadable or
    /// malformed file; a request it cannot serve), which `DATA.SKIP_BAD_FRAMES` may
    /// skip; `false` for a check that never reached a verdict.
    pub fn judges_the_data(&self) -> bool {
        !matches!(self, DataError::Unjudged { .. })
    }
}

/// Result of the dataset layer.
pub type Result<T, E = DataError> = std::result::Result<T, E>;
