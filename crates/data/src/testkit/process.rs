//! Child processes of the tests and benchmarks: a guard that kills a child when
//! dropped, and a cache server started from the `vrtspike` binary and waited for
//! until it accepts.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::cache::{CacheClient, CacheError};

/// A child process killed (and reaped) when dropped, on every error path too.
pub struct ChildGuard(pub Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A cache server that could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ServerStartError {
    /// The binary did not run.
    #[error("starting the cache server {exe}: {source}")]
    Spawn {
        /// The binary.
        exe: String,
        /// Why it did not run.
        source: std::io::Error,
    },
    /// It exited before it accepted a connection.
    #[error("the cache server at {address} exited before accepting: {status}")]
    Exited {
        /// Its address.
        address: String,
        /// How it ended.
        status: std::process::ExitStatus,
    },
    /// It ran but never accepted.
    #[error(transparent)]
    Cache(#[from] CacheError),
}

/// Waits until the server `child` accepts at `address`, failing at once if the
/// child exits first; returns a connection to it.
pub fn wait_for_child_server(
    child: &mut Child,
    address: &str,
    timeout: Duration,
) -> Result<CacheClient, ServerStartError> {
    let started = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(ServerStartError::Exited {
                address: address.to_owned(),
                status,
            });
        }
        match CacheClient::connect(address, "testkit") {
            Ok(client) => return Ok(client),
            Err(CacheError::Connect { .. }) if started.elapsed() < timeout => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Starts `exe cache serve` at `address` with a store of `cap_bytes` (sized for
/// records of `record_bytes`, if given), exiting with this process; returns it with
/// a connection to it.
pub fn spawn_cache_server(
    exe: &Path,
    address: &str,
    cap_bytes: u64,
    record_bytes: Option<u64>,
) -> Result<(ChildGuard, CacheClient), ServerStartError> {
    let mut command = Command::new(exe);
    command
        .args(["cache", "serve", "--exit-with-parent", "--address", address])
        .args(["--cap", &cap_bytes.to_string()]);
    if let Some(record) = record_bytes {
        command.args(["--record-bytes", &record.to_string()]);
    }
    let child =
        command
            .stdout(Stdio::null())
            .spawn()
            .map_err(|source| ServerStartError::Spawn {
                exe: exe.display().to_string(),
                source,
            })?;
    let mut guard = ChildGuard(child);
    let client = wait_for_child_server(&mut guard.0, address, Duration::from_secs(60))?;
    Ok((guard, client))
}
