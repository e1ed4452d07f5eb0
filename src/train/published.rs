//! A value one rank works out and writes into the run directory for the others to
//! read, when no launcher hands it to them (torchrun, srun): srun's rendezvous port
//! (`rendezvous`), the node-shared cache server's address (`node_cache`). Written
//! atomically (a temporary file renamed), so a reader sees all of it or nothing;
//! read by polling, up to a bound.

use std::path::Path;
use std::time::{Duration, Instant};

use super::run_config::write_atomic;
use super::TrainError;

/// How often a reader looks for the file.
const POLL: Duration = Duration::from_millis(100);

/// Writes `text` to `path` (making its folder), atomically.
pub fn publish(path: &Path, text: &str) -> Result<(), TrainError> {
    write_atomic(path, &format!("{text}\n")).map_err(|e| TrainError::io(path, e))
}

/// The text published at `path` (trimmed), waiting up to `timeout`; `None` when
/// nothing was published by then.
pub fn wait_for(path: &Path, timeout: Duration) -> Result<Option<String>, TrainError> {
    let started = Instant::now();
    loop {
        match std::fs::read_to_string(path) {
            Ok(text) => return Ok(Some(text.trim().to_string())),
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(TrainError::io(path, e))
            }
            Err(_) if started.elapsed() > timeout => return Ok(None),
            Err(_) => std::thread::sleep(POLL),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_published_value_is_read_whole_and_an_absent_one_after_the_bound() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = tmp.path().join("rendezvous/x.value");
        let started = Instant::now();
        let none = wait_for(&path, Duration::from_millis(250)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(none, None);
        assert!(started.elapsed() >= Duration::from_millis(250));
        publish(&path, "vrtspike-cache-u1-ds01").unwrap_or_else(|e| panic!("{e}"));
        let read = wait_for(&path, Duration::ZERO).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(read.as_deref(), Some("vrtspike-cache-u1-ds01"));
        // No temporary file left beside it.
        let names = std::fs::read_dir(tmp.path().join("rendezvous"))
            .map(|d| d.count())
            .unwrap_or(0);
        assert_eq!(names, 1);
    }
}
