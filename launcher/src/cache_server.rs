//! The node's cache server as a child of the launcher: started first through the
//! `vrtspike` binary (the launcher does not link libtorch), ready once it says so
//! through the contract's readiness pipe (`vrtspike_contract::ready`), kept across
//! restarts (its data stays warm), and asked for its statistics before it is stopped.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;
use vrtspike_contract::ready::{self, Readiness, ReadyPipe};

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
    /// The job's `--set KEY.PATH=VALUE` overrides of the config.
    pub overrides: &'a [String],
    /// Its log.
    pub log: PathBuf,
    /// How long it may take to accept connections.
    pub start_timeout: Duration,
}

/// Starts the server and waits until it says it is ready; an error carries the
/// server's own last log lines (e.g. a bad config key or a short /dev/shm).
pub fn start(spec: &CacheServerSpec) -> Result<Supervised> {
    let mut command = Command::new(spec.vrtspike);
    command
        .args(["cache", "serve", "--exit-with-parent", "--address"])
        .arg(spec.address)
        .arg("--config")
        .arg(spec.config);
    for override_spec in spec.overrides {
        command.arg(format!("--set={override_spec}"));
    }
    if let Some(cap) = spec.cap {
        command.args(["--cap", cap]);
    }
    let mut pipe = ReadyPipe::new().context("creating the cache server's readiness pipe")?;
    if let Some(fd) = pipe.child_fd() {
        command.env(ready::READY_FD, fd.to_string());
        // SAFETY: the hook runs in the forked child before exec and only calls
        // fcntl (async-signal-safe); it allocates nothing.
        unsafe {
            command.pre_exec(move || ready::inherit_in_child(fd));
        }
    }
    let spawned = spawn::spawn("cache server".into(), &mut command, &spec.log);
    pipe.close_child_end();
    let mut server = spawned
        .with_context(|| format!("starting the cache server ({})", spec.vrtspike.display()))?;
    let started = Instant::now();
    loop {
        if signals::interrupts() > 0 {
            spawn::stop_all(&mut [&mut server], Duration::from_secs(1));
            bail!("interrupted while the cache server was starting");
        }
        let readiness = pipe
            .wait(Duration::from_millis(100))
            .context("waiting for the cache server's readiness pipe")?;
        if readiness == Readiness::Ready {
            tracing::info!(
                address = spec.address,
                pid = server.pid(),
                "cache server ready in {:.2} s",
                started.elapsed().as_secs_f64()
            );
            return Ok(server);
        }
        if let Some(status) = server.poll().context("waiting for the cache server")? {
            bail!(
                "the cache server {} before accepting connections; the end of {}:\n{}",
                spawn::describe(status),
                spec.log.display(),
                spawn::log_tail(&spec.log, server.log_offset, 20).join("\n")
            );
        }
        if started.elapsed() > spec.start_timeout {
            spawn::stop_all(&mut [&mut server], Duration::from_secs(1));
            bail!(
                "the cache server did not say it was ready at {:?} within {:.0} s; see {}",
                spec.address,
                spec.start_timeout.as_secs_f64(),
                spec.log.display()
            );
        }
        if readiness == Readiness::Closed {
            // It closed the pipe unready, so it is exiting: look again shortly.
            std::thread::sleep(Duration::from_millis(50));
        }
    }
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

/// Whether the resolved config (with the job's overrides) reads through the node
/// cache (`DATA.USE_RAM_CACHE`), asked of `vrtspike config show --json`.
pub fn wanted(vrtspike: &Path, config: &Path, overrides: &[String]) -> Result<bool> {
    let mut command = Command::new(vrtspike);
    command
        .args(["config", "show", "--json", "--config"])
        .arg(config);
    for spec in overrides {
        command.arg(format!("--set={spec}"));
    }
    let output = command
        .stdin(Stdio::null())
        .env("RUST_LIB_BACKTRACE", "0")
        .output()
        .with_context(|| format!("running {} config show", vrtspike.display()))?;
    if !output.status.success() {
        bail!(
            "{} config show --config {}: {}",
            vrtspike.display(),
            config.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let shown: Value = serde_json::from_slice(&output.stdout)
        .with_context(|| format!("reading the JSON of config show for {}", config.display()))?;
    match shown["keys"]["DATA.USE_RAM_CACHE"]["value"].as_bool() {
        Some(wanted) => Ok(wanted),
        None => bail!(
            "config show for {} gives no boolean DATA.USE_RAM_CACHE",
            config.display()
        ),
    }
}

/// The address of this node's server for this launch: the user's, and unique per
/// node and launcher, so several jobs (or loopback "nodes", or users) on one machine
/// never share one (the contract's one default).
pub fn address(node_rank: u32) -> String {
    let job = format!("n{node_rank}-{}", std::process::id());
    vrtspike_contract::cache_addr::own_cache_address(&job)
}
