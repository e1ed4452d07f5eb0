//! Why a rank failed, as the rank says it: a [`RankFailure`] record the rank writes
//! next to its log (`logs/rank<R>.failure.json`) just before it exits with an error,
//! and the launcher reads back to name the rank's failure cause and to decide on a
//! restart. An out-of-memory also exits with its own code,
//! [`EXIT_OUT_OF_MEMORY`], so the class survives a record that could not be written.
//! The record carries the rank's pid: the launcher trusts only the record of the
//! process it is reporting on (a record of an earlier attempt is ignored).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::json_file::{self, JsonFileError};

/// The exit code of a rank that ran out of memory (ENOMEM's number).
pub const EXIT_OUT_OF_MEMORY: i32 = 12;

/// What kind of failure ended the rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureClass {
    /// The device (or host) ran out of memory: deterministic for the config, a
    /// restart would hit it again at the same place.
    OutOfMemory,
    /// Any other error.
    Error,
}

impl FailureClass {
    /// `out_of_memory`, `error`.
    pub fn name(self) -> &'static str {
        match self {
            FailureClass::OutOfMemory => "out_of_memory",
            FailureClass::Error => "error",
        }
    }

    /// Whether restarting the same config cannot help.
    pub fn deterministic(self) -> bool {
        self == FailureClass::OutOfMemory
    }
}

/// One rank's own account of its failure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankFailure {
    /// Global rank.
    pub rank: u32,
    /// The rank's pid (to tell this attempt's record from an older one).
    pub pid: u32,
    /// The kind of failure.
    pub class: FailureClass,
    /// The training step it happened at, when known.
    #[serde(default)]
    pub step: Option<u64>,
    /// The error, one line (for an out-of-memory: stage, shape, device, remedy).
    pub message: String,
}

/// A failure record that cannot be written or read.
pub type FailureRecordError = JsonFileError;

/// The record's name in errors.
const WHAT: &str = "rank failure record";

impl RankFailure {
    /// Writes it to `path` atomically (a temporary file, then a rename).
    pub fn write(&self, path: &Path) -> Result<(), FailureRecordError> {
        json_file::write_atomic(WHAT, self, path)
    }

    /// Reads the record at `path`.
    pub fn read(path: &Path) -> Result<RankFailure, FailureRecordError> {
        json_file::read(WHAT, path)
    }

    /// The record at `path` if it is the one process `pid` wrote (none, unreadable
    /// or another process's: `None`).
    pub fn read_for(path: &Path, pid: u32) -> Option<RankFailure> {
        RankFailure::read(path).ok().filter(|r| r.pid == pid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_read_back_and_matched_by_pid() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = tmp.path().join("rank1.failure.json");
        let record = RankFailure {
            rank: 1,
            pid: 4242,
            class: FailureClass::OutOfMemory,
            step: Some(3),
            message: "out of memory in validation".into(),
        };
        record.write(&path).unwrap_or_else(|e| panic!("{e}"));
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(text.contains("\"class\": \"out_of_memory\""), "{text}");
        assert_eq!(RankFailure::read_for(&path, 4242), Some(record));
        assert_eq!(RankFailure::read_for(&path, 4243), None, "another process");
        assert_eq!(RankFailure::read_for(&tmp.path().join("none"), 4242), None);
        assert!(FailureClass::OutOfMemory.deterministic());
        assert!(!FailureClass::Error.deterministic());
    }
}
