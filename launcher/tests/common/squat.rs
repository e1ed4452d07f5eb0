//! A node-shared cache address held by something a job cannot use, for the tests
//! of the fall-back (`launch_squatted_cache`, and the root package's
//! `train_node_cache` and `cache_access`, which include this file by path): `vrtspike cache serve`
//! run as `nobody` (another user's process; needs root), or a fake server of the
//! next cache protocol version (another build's).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrtspike_contract::cache_addr::CACHE_PROTOCOL_VERSION;

/// What a job (the launcher, or each rank that no launcher started) warns,
/// once, when it falls back to a server of its own.
pub const FELL_BACK: &str = "this job starts a cache server of its own instead";

/// The uid and gid of `nobody`.
pub const NOBODY: u32 = 65534;

/// `vrtspike cache serve` run as `nobody` at an address; stopped when dropped.
pub struct Squatter(Child);

impl Squatter {
    /// Starts `vrtspike` (the binary at `vrtspike`) as `nobody` serving at
    /// `address`, and waits up to `limit` until it accepts there. Panics unless
    /// this process is root.
    pub fn start(vrtspike: &Path, address: &str, limit: Duration) -> Squatter {
        Squatter::start_with(vrtspike, address, &[], limit)
    }

    /// [`Squatter::start`] with `extra` arguments of `cache serve` (e.g.
    /// `--allow-uid`).
    pub fn start_with(vrtspike: &Path, address: &str, extra: &[&str], limit: Duration) -> Squatter {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            panic!("this test needs root, to run the squatter as nobody (CI runs as root)");
        }
        let child = Command::new(vrtspike)
            .args(["cache", "serve", "--address", address, "--cap", "1M"])
            .args(extra)
            .current_dir("/")
            .uid(NOBODY)
            .gid(NOBODY)
            .env("TMPDIR", "/tmp")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting the squatter: {e}"));
        let mut squatter = Squatter(child);
        let name =
            SocketAddr::from_abstract_name(address.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
        let deadline = Instant::now() + limit;
        while UnixStream::connect_addr(&name).is_err() {
            assert!(
                squatter.running() && Instant::now() < deadline,
                "the squatter did not bind"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        squatter
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Whether it still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(None))
    }
}

impl Drop for Squatter {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `sharing` (a summary's record of the cache server a job used) says the job
/// fell back from `address` to a server of its own, for a reason naming every one
/// of `why`.
pub fn assert_fell_back(sharing: &serde_json::Value, address: &str, why: &[&str]) {
    assert_eq!(sharing["mode"], "job", "{sharing}");
    assert_eq!(sharing["fell_back_from"], address, "{sharing}");
    let own = sharing["address"].as_str().unwrap_or_default();
    assert!(!own.is_empty() && own != address, "{sharing}");
    let reason = sharing["why"].as_str().unwrap_or_default();
    for word in why {
        assert!(reason.contains(word), "{word:?} not in {sharing}");
    }
}

/// A fake server of the next protocol version at `address`: it greets every
/// connection as a server of that version would, naming a channel that does not
/// exist; it counts the clients that went on after the greeting (none should).
pub fn other_version_at(address: &str) -> Arc<AtomicUsize> {
    let name = SocketAddr::from_abstract_name(address.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    let listener = UnixListener::bind_addr(&name).unwrap_or_else(|e| panic!("{e}"));
    let went_on = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&went_on);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut hello = [0u8; 1];
            if stream.read_exact(&mut hello).is_err() {
                continue;
            }
            let greeting = format!(
                "channel p{} /tmp/vrtspike-no-such-channel/socket",
                CACHE_PROTOCOL_VERSION + 1
            );
            let len = (greeting.len() as u32).to_le_bytes();
            let _ = stream.write_all(&len);
            let _ = stream.write_all(greeting.as_bytes());
            let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
            let mut ack = [0u8; 1];
            if matches!(stream.read(&mut ack), Ok(1)) {
                count.fetch_add(1, Ordering::SeqCst);
            }
        }
    });
    went_on
}
