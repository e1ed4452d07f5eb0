//! A child's log file, as the launcher and a rank that starts the node's cache
//! server both keep it: opened for appending (its folder made first), with the
//! length it had, so the child's own lines are those after it, and the last lines
//! after an offset for an error report.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::Path;

/// Lines of a failed process's log kept in its failure report.
pub const TAIL_LINES: usize = 20;

/// Opens `path` for appending, creating it and its folder; returns it with its
/// length before anything is appended.
pub fn open_append(path: &Path) -> io::Result<(File, u64)> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let file = OpenOptions::new().create(true).append(true).open(path)?;
    let offset = file.metadata()?.len();
    Ok((file, offset))
}

/// The last `lines` lines of a log after byte `from` (fewer if it is shorter;
/// empty if unreadable).
pub fn tail(path: &Path, from: u64, lines: usize) -> Vec<String> {
    let Ok(bytes) = std::fs::read(path) else {
        return Vec::new();
    };
    let start = usize::try_from(from).unwrap_or(usize::MAX).min(bytes.len());
    let text = String::from_utf8_lossy(&bytes[start..]);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..]
        .iter()
        .map(|l| l.to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_lines() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let log = dir.path().join("t.log");
        let text: String = (0..30).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&log, text).unwrap_or_else(|e| panic!("{e}"));
        let last = tail(&log, 0, 20);
        assert_eq!(last.len(), 20);
        assert_eq!(last[0], "line 10");
        assert_eq!(last[19], "line 29");
        assert_eq!(tail(&log, 10 * 7 + 18 * 8, 20), ["line 28", "line 29"]);
        assert!(tail(&log, 1 << 40, 20).is_empty());
        assert!(tail(&dir.path().join("none"), 0, 5).is_empty());
    }

    #[test]
    fn a_log_is_opened_in_a_new_folder_at_its_end() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let log = dir.path().join("logs/cache.node0.log");
        let (_, offset) = open_append(&log).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(offset, 0);
        std::fs::write(&log, "earlier\n").unwrap_or_else(|e| panic!("{e}"));
        let (mut file, offset) = open_append(&log).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(offset, 8);
        std::io::Write::write_all(&mut file, b"mine\n").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(tail(&log, offset, TAIL_LINES), ["mine"]);
    }
}
