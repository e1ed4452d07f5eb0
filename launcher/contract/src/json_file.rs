//! A JSON record file, written atomically (a temporary file beside it, then a
//! rename, so a reader never sees half a record) and read back typed. The run
//! summary and the rank failure record are two such files; a [`JsonFileError`]
//! says which record it is.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

/// A record file that cannot be written or read.
#[derive(Debug, thiserror::Error)]
#[error("{what} {path}: {message}")]
pub struct JsonFileError {
    /// Which record (`run summary`, `rank failure record`).
    pub what: &'static str,
    /// The file (the temporary one when writing it failed).
    pub path: PathBuf,
    /// What failed.
    pub message: String,
}

impl JsonFileError {
    fn new(what: &'static str, path: &Path, e: &dyn std::fmt::Display) -> JsonFileError {
        JsonFileError {
            what,
            path: path.to_path_buf(),
            message: e.to_string(),
        }
    }
}

/// Writes `value`, the record `what`, to `path` as pretty JSON, atomically.
pub(crate) fn write_atomic<T: Serialize>(
    what: &'static str,
    value: &T,
    path: &Path,
) -> Result<(), JsonFileError> {
    let error = |path: &Path, e: &dyn std::fmt::Display| JsonFileError::new(what, path, e);
    let text = serde_json::to_string_pretty(value).map_err(|e| error(path, &e))?;
    let tmp = path.with_extension(format!("json.tmp-{}", std::process::id()));
    std::fs::write(&tmp, text + "\n").map_err(|e| error(&tmp, &e))?;
    std::fs::rename(&tmp, path).map_err(|e| error(path, &e))
}

/// Reads the record `what` at `path`.
pub(crate) fn read<T: DeserializeOwned>(
    what: &'static str,
    path: &Path,
) -> Result<T, JsonFileError> {
    let bytes = std::fs::read(path).map_err(|e| JsonFileError::new(what, path, &e))?;
    serde_json::from_slice(&bytes).map_err(|e| JsonFileError::new(what, path, &e))
}
