//! The node's cache server as a child of the launcher: started first through the
//! `vrtspike` binary (the launcher does not link libtorch) with the contract's
//! command and readiness pipe (`vrtspike_contract::cache_serve`, which a rank
//! uses too when no launcher started a server), kept across restarts (its data
//! stays warm), and asked for its statistics before it is stopped. It ignores the
//! job's SIGUSR2 and SIGTERM (SLURM sends them to every process of the job), so the
//! launcher stops it with SIGINT.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{bail, Context, Result};
use nix::sys::signal::Signal;
use serde_json::Value;
use vrtspike_contract::cache_serve::{CacheServe, Watch};

use crate::spawn::{self, Supervised};

/// Starts the server and waits until it says it is ready; an error carries the
/// server's own last log lines (e.g. a bad config key or a short /dev/shm).
pub fn start(serve: &CacheServe, watch: &Watch) -> Result<Supervised> {
    let started = serve.start_logged(watch)?;
    tracing::info!(
        address = serve.address,
        pid = started.spawned.process.id(),
        "cache server ready in {:.2} s",
        started.took.as_secs_f64()
    );
    let server = Supervised::adopt("cache server".into(), started.spawned, watch.log);
    Ok(server.with_stop_signal(Signal::SIGINT))
}

/// The server's statistics as JSON, or `None` if it does not answer.
pub fn stats(vrtspike: &Path, address: &str) -> Option<Value> {
    let output = spawn::vrtspike_helper(vrtspike)
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

/// What the launcher needs from the resolved config (with the job's overrides).
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigFacts {
    /// `DATA.USE_RAM_CACHE`: the ranks read through the node cache.
    pub ram_cache: bool,
    /// `DIST.TIMEOUT_S`: the ranks' collective timeout.
    pub collective_timeout_s: f64,
    /// `DATA.CACHE_SHARING: node`: attach to the node-shared server.
    pub shared: bool,
    /// `DATA.ROOT` (null when the config names none).
    pub data_root: Option<PathBuf>,
    /// `DATA.CACHE_SIZE_GB` in bytes.
    pub cache_bytes: u64,
    /// `DATA.CACHE_CONNECTIONS` (`None`: `auto`, sized for the node).
    pub connections: Option<u64>,
}

/// [`ConfigFacts`] of the resolved config, asked of `vrtspike config show --json`.
pub fn config_facts(vrtspike: &Path, config: &Path, overrides: &[String]) -> Result<ConfigFacts> {
    let mut command = spawn::vrtspike_helper(vrtspike);
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
    let key = |name: &str| &shown["keys"][name]["value"];
    let lacks = |what: String| format!("config show for {} gives no {what}", config.display());
    let number = |name: &str| {
        key(name)
            .as_f64()
            .with_context(|| lacks(format!("number {name}")))
    };
    let ram_cache = key("DATA.USE_RAM_CACHE")
        .as_bool()
        .with_context(|| lacks("boolean DATA.USE_RAM_CACHE".into()))?;
    let collective_timeout_s = number("DIST.TIMEOUT_S")?;
    let shared = match key("DATA.CACHE_SHARING").as_str() {
        Some("node") => true,
        Some("job") => false,
        other => bail!(
            "config show for {} gives DATA.CACHE_SHARING {other:?}, not node or job",
            config.display()
        ),
    };
    let data_root = key("DATA.ROOT").as_str().map(PathBuf::from);
    let cache_gb = number("DATA.CACHE_SIZE_GB")?;
    let connections = match key("DATA.CACHE_CONNECTIONS") {
        Value::String(word) if word == "auto" => None,
        value => Some(
            value
                .as_u64()
                .with_context(|| lacks("count or \"auto\" for DATA.CACHE_CONNECTIONS".into()))?,
        ),
    };
    Ok(ConfigFacts {
        ram_cache,
        collective_timeout_s,
        shared,
        data_root,
        cache_bytes: (cache_gb * (1u64 << 30) as f64) as u64,
        connections,
    })
}

/// The address of this node's server for this launch: the user's, and unique per
/// node and launcher, so several jobs (or loopback "nodes", or users) on one machine
/// never share one (the contract's one default).
pub fn address(node_rank: u32) -> String {
    let job = format!("n{node_rank}-{}", std::process::id());
    vrtspike_contract::cache_addr::own_cache_address(&job)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The launcher's `config show` and `cache stats` helpers start with the job's
    /// signals blocked and are told to ignore them.
    #[test]
    fn the_helpers_start_protected_from_the_job_signals() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let vrtspike = spawn::mask_reporting_vrtspike(dir.path());
        let facts =
            config_facts(&vrtspike, Path::new("c.yaml"), &[]).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(facts.ram_cache, "config show started unprotected");
        let shown = stats(&vrtspike, "some-address").unwrap_or_default();
        assert_eq!(shown["protected"], true, "cache stats: {shown}");
    }
}
