//! Rank 0's log on the terminal: a thread follows the log file as it grows and
//! prints each new line with a `[rank0] ` prefix. Following the file (not a pipe)
//! means a slow terminal can never block the rank.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Follows one log until dropped (then prints what is left).
pub struct LogEcho {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl LogEcho {
    /// Follows `path` from byte `offset`, writing lines to stdout after `prefix`.
    pub fn start(path: PathBuf, offset: u64, prefix: String) -> LogEcho {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("rank0-echo".into())
                .spawn(move || follow(&path, offset, &prefix, &stop))
                .ok()
        };
        LogEcho { stop, thread }
    }
}

impl Drop for LogEcho {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn follow(path: &PathBuf, offset: u64, prefix: &str, stop: &AtomicBool) {
    let Ok(mut file) = std::fs::File::open(path) else {
        return;
    };
    if file.seek(SeekFrom::Start(offset)).is_err() {
        return;
    }
    let mut pending = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        // Read the stop flag first so the last pass drains everything written.
        let stopping = stop.load(Ordering::SeqCst);
        loop {
            match file.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => pending.extend_from_slice(&chunk[..n]),
            }
        }
        let mut out = std::io::stdout().lock();
        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let _ = out.write_all(prefix.as_bytes());
            let _ = out.write_all(&line);
        }
        if stopping {
            if !pending.is_empty() {
                let _ = out.write_all(prefix.as_bytes());
                let _ = out.write_all(&pending);
                let _ = out.write_all(b"\n");
            }
            let _ = out.flush();
            return;
        }
        let _ = out.flush();
        drop(out);
        std::thread::sleep(Duration::from_millis(100));
    }
}
