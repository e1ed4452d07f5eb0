//! A job's own cache server process (`DATA.CACHE_SHARING: job`), started by the
//! process that runs the job's reads on the node (local rank 0 of a trainer with
//! no launcher, or a Python process of the `vrtspike` package) as its child: when
//! dropped it is asked to shut down, given five seconds, then killed and reaped.

use std::process::Child;
use std::time::{Duration, Instant};

use super::CacheClient;

/// How long a server asked to stop has before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// A server this process started for its job.
#[derive(Debug)]
pub struct OwnServer {
    address: String,
    child: Child,
}

impl OwnServer {
    /// The server `child`, listening at `address`.
    pub fn new(address: &str, child: Child) -> OwnServer {
        OwnServer {
            address: address.to_string(),
            child,
        }
    }

    /// Its address.
    pub fn address(&self) -> &str {
        &self.address
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let asked = CacheClient::connect(&self.address, "the job's cache server's starter")
            .and_then(|client| client.shutdown_server());
        if let Err(e) = asked {
            tracing::debug!(error = %e, "the job's cache server did not take the shutdown");
        }
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{spawn_server, ServerConfig};

    #[test]
    fn dropping_it_asks_the_server_to_stop_and_reaps_the_process() {
        let address = crate::cache::default_address(&format!(
            "own-server-test-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        // The server runs on a thread here; the child stands for its process and
        // exits by itself once asked (a sleep that the drop must reap or kill).
        let server = spawn_server(ServerConfig::new(&address, 16 << 20)).unwrap();
        let child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = child.id();
        let started = Instant::now();
        drop(OwnServer::new(&address, child));
        assert!(
            started.elapsed() < STOP_GRACE + Duration::from_secs(2),
            "the drop waits at most its grace"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while CacheClient::connect(&address, "after").is_ok() {
            assert!(
                Instant::now() < deadline,
                "the server never took the shutdown"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(server);
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "the process was killed and reaped"
        );
    }
}
