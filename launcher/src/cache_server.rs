//! The node's cache server as a child of the launcher: started first through the
//! `vrtspike` binary (the launcher does not link libtorch), ready once
//! `vrtspike cache stats` gets an answer, kept across restarts (its data stays
//! warm), and asked for its statistics before it is stopped.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::signals;
use crate::spawn::{self, Supervised};

/// How to start the server.
pub struct CacheServerSpec<'a> {
    /// The `vrtspike` binary.
    pub vrtspike: &'a Path,
    /// Abstract socket name.
    pub address: &'a str,
    /// Run config (its DATA.CACHE_SIZE_GB is the cap unless `cap` is given).
    pub config: &'a Path,
    /// Byte cap as text (`20G`), overriding the config.
    pub cap: Option<&'a str>,
    /// Its log.
    pub log: PathBuf,
    /// How long it may take to accept connections.
    pub start_timeout: Duration,
}

/// Starts the server and waits until it answers; an error carries the server's
/// own last log lines (e.g. a bad config key or a short /dev/shm).
pub fn start(spec: &CacheServerSpec) -> Result<Supervised> {
    let mut command = Command::new(spec.vrtspike);
    command
        .args(["cache", "serve", "--exit-with-parent", "--address"])
        .arg(spec.address)
        .arg("--config")
        .arg(spec.config);
    if let Some(cap) = spec.cap {
        command.args(["--cap", cap]);
    }
    let mut server = spawn::spawn("cache server".into(), &mut command, &spec.log)
        .with_context(|| format!("starting the cache server ({})", spec.vrtspike.display()))?;
    let started = Instant::now();
    loop {
        if signals::interrupts() > 0 {
            spawn::stop_all(&mut [&mut server], Duration::from_secs(1));
            bail!("interrupted while the cache server was starting");
        }
        if let Some(status) = server.poll().context("waiting for the cache server")? {
            bail!(
                "the cache server {} before accepting connections; the end of {}:\n{}",
                spawn::describe(status),
                spec.log.display(),
                spawn::log_tail(&spec.log, server.log_offset, 20).join("\n")
            );
        }
        // `cache stats` starts a process that loads libtorch, so ask only once the
        // server has said it listens (or after a while, should that line change).
        let said_ready = std::fs::read(&spec.log).is_ok_and(|log| {
            log.get(usize::try_from(server.log_offset).unwrap_or(usize::MAX)..)
                .is_some_and(|new| contains(new, READY_LINE.as_bytes()))
        });
        let may_ask = said_ready || started.elapsed() > Duration::from_secs(2);
        if may_ask && stats(spec.vrtspike, spec.address).is_some() {
            tracing::info!(
                address = spec.address,
                pid = server.pid(),
                "cache server ready in {:.2} s",
                started.elapsed().as_secs_f64()
            );
            return Ok(server);
        }
        if started.elapsed() > spec.start_timeout {
            spawn::stop_all(&mut [&mut server], Duration::from_secs(1));
            bail!(
                "the cache server did not accept connections at {:?} within {:.0} s; see {}",
                spec.address,
                spec.start_timeout.as_secs_f64(),
                spec.log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// What `vrtspike cache serve` prints once it is bound.
const READY_LINE: &str = "cache server listening at";

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// The server's statistics as JSON, or `None` if it does not answer.
pub fn stats(vrtspike: &Path, address: &str) -> Option<Value> {
    let output = Command::new(vrtspike)
        .args(["cache", "stats", "--json", "--address", address])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    serde_json::from_slice(&output.stdout).ok()
}

/// The address of this node's server for this launch: unique per node and
/// launcher, so several jobs (or loopback "nodes") on one machine never share one.
pub fn address(node_rank: u32) -> String {
    format!("vrtspike-cache-n{node_rank}-{}", std::process::id())
}
