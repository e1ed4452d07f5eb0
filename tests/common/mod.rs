//! Helpers of the multi-process cache tests: a cache server in its own process
//! (started and waited for through `vrtspike::testkit`), unique addresses, the
//! machine's shared memory, and waiting with a deadline.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vrtspike::cache::CacheClient;
use vrtspike::testkit::process::wait_for_child_server;

/// The `vrtspike` binary under test.
pub fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_vrtspike")
}

/// An address no other test uses.
pub fn unique_address(tag: &str) -> String {
    format!(
        "vrtspike-test-{tag}-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    )
}

/// A cache server process, killed when dropped.
pub struct ServerProc {
    pub child: Child,
    pub address: String,
}

impl ServerProc {
    /// Starts `vrtspike cache serve` with extra arguments and waits until it accepts.
    pub fn start(tag: &str, args: &[&str]) -> ServerProc {
        let address = unique_address(tag);
        let child = Command::new(exe())
            .args(["cache", "serve", "--address", &address])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn cache server");
        let mut server = ServerProc { child, address };
        if let Err(e) =
            wait_for_child_server(&mut server.child, &server.address, Duration::from_secs(30))
        {
            panic!("cache server: {e}");
        }
        server
    }

    /// A new client connection.
    pub fn client(&self, name: &str) -> CacheClient {
        CacheClient::connect(&self.address, name).expect("connect")
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `vrtspike cache pin` process holding leases on `keys`, once it says so.
pub fn pin_process(address: &str, keys: &[String]) -> Child {
    let mut child = Command::new(exe())
        .args(["cache", "pin", "--address", address])
        .args(keys)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn cache pin");
    let stdout = child.stdout.take().expect("pin stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("pin output");
    assert!(line.starts_with("pinned"), "cache pin said {line:?}");
    child
}

/// System-wide Shmem (tmpfs, /dev/shm, memfd), bytes.
pub fn shmem_bytes() -> u64 {
    vrtspike::util::meminfo::meminfo_bytes("Shmem").expect("read /proc/meminfo")
}

/// Polls `check` until it holds or `timeout` passes; returns whether it held.
pub fn wait_until(timeout: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Fills `key` with a byte pattern derived from it (via `get_or_fill`), released at once.
pub fn fill_pattern(client: &CacheClient, key: &str, len: usize) {
    let lease = client
        .get_or_fill(key, len, |slot| {
            write_pattern(key, slot);
            Ok::<(), std::convert::Infallible>(())
        })
        .expect("fill");
    assert_eq!(lease.len(), len);
}

/// The pattern `fill_pattern` writes for `key`.
pub fn write_pattern(key: &str, out: &mut [u8]) {
    let seed = crc32fast::hash(key.as_bytes());
    for (i, b) in out.iter_mut().enumerate() {
        *b = (seed as usize).wrapping_add(i.wrapping_mul(31)) as u8;
    }
}

/// Whether `bytes` hold `key`'s pattern.
pub fn has_pattern(key: &str, bytes: &[u8]) -> bool {
    let mut expected = vec![0u8; bytes.len()];
    write_pattern(key, &mut expected);
    expected == bytes
}
