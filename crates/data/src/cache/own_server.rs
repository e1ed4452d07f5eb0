//! A job's own cache server process (`DATA.CACHE_SHARING: job`), started by the
//! process that runs the job's reads on the node (local rank 0 of a trainer with
//! no launcher, or a Python process of the `vrtspike` package) as its child: when
//! dropped it is asked to shut down, given five seconds, then killed and reaped.
//! The job's other processes wait for it to accept ([`wait_for_server`]).

use std::process::Child;
use std::time::{Duration, Instant};

use super::{CacheClient, CacheError};

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

/// Connects to the server at `address` (as `who`) once it accepts, trying every
/// 100 ms for up to `timeout`: how the job's other local processes wait for the
/// one that starts it. The last connection error after `timeout`, or at once any
/// error but a refused connection.
pub fn wait_for_server(
    address: &str,
    who: &str,
    timeout: Duration,
) -> Result<CacheClient, CacheError> {
    let started = Instant::now();
    loop {
        match CacheClient::connect(address, who) {
            Err(CacheError::Connect { .. }) if started.elapsed() < timeout => {
                std::thread::sleep(Duration::from_millis(100));
            }
            result => return result,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{spawn_server, ServerConfig};

    fn test_address(what: &str) -> String {
        crate::cache::default_address(&format!(
            "own-server-{what}-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ))
    }

    #[test]
    fn waiting_connects_once_the_server_starts_and_gives_up_after_the_timeout() {
        let address = test_address("wait");
        let started = Instant::now();
        let none = wait_for_server(&address, "waiter", Duration::from_millis(300));
        match none {
            Err(CacheError::Connect { .. }) => {}
            Err(e) => panic!("not a refused connection: {e}"),
            Ok(_) => panic!("connected where no server runs"),
        }
        assert!(started.elapsed() >= Duration::from_millis(300));
        let late = address.clone();
        let starter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            spawn_server(ServerConfig::new(&late, 16 << 20)).unwrap()
        });
        let client = wait_for_server(&address, "waiter", Duration::from_secs(20));
        assert!(client.is_ok(), "{:?}", client.err());
        drop(client);
        drop(starter.join().unwrap());
    }

    #[test]
    fn dropping_it_asks_the_server_to_stop_and_reaps_the_process() {
        let address = test_address("test");
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
