//! A JSON record file, written atomically (a temporary file beside it, then a
//! rename, so a reader never sees half a record) and read back typed. The run
//! summary and the rank failure record are two such files; each wraps
//! [`JsonFileError`] in its own error, which says which record it is.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

/// A record file that cannot be written or read.
#[derive(Debug)]
pub(crate) struct JsonFileError {
    /// The file (the temporary one when writing it failed).
    pub path: PathBuf,
    /// What failed.
    pub message: String,
}

impl JsonFileError {
    fn new(path: &Path, e: &dyn std::fmt::Display) -> JsonFileError {
        JsonFileError {
            path: path.to_path_buf(),
            message: e.to_string(),
        }
    }
}

/// Writes `value` to `path` as pretty JSON, atomically.
pub(crate) fn write_atomic<T: Serialize>(value: &T, path: &Path) -> Result<(), JsonFileError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| JsonFileError::new(path, &e))?;
    let tmp = path.with_extension(format!("json.tmp-{}", std::process::id()));
    std::fs::write(&tmp, text + "\n").map_err(|e| JsonFileError::new(&tmp, &e))?;
    std::fs::rename(&tmp, path).map_err(|e| JsonFileError::new(path, &e))
}

/// Reads the record at `path`.
pub(crate) fn read<T: DeserializeOwned>(path: &Path) -> Result<T, JsonFileError> {
    let bytes = std::fs::read(path).map_err(|e| JsonFileError::new(path, &e))?;
    serde_json::from_slice(&bytes).map_err(|e| JsonFileError::new(path, &e))
}
