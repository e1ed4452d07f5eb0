//! The node's cache server when no launcher started one (torchrun, srun, a rank
//! alone): local rank 0 starts it with the launcher's own command and readiness
//! pipe (`vrtspike_contract::cache_serve`); the other local ranks wait until it
//! accepts and attach. All of them attach to `VRTSPIKE_CACHE_ADDR` instead when it
//! is set, and `DATA.USE_RAM_CACHE: false` means no server at all.
//!
//! With `DATA.CACHE_SHARING: node` (the default) the server is the node-shared one
//! of this user and dataset, at the address the launcher uses too
//! (`cache_addr::node_shared_address`), signed by local rank 0 alone and published
//! in the run directory for the others: local rank 0 attaches to it when it runs,
//! else starts it with a linger (`VRTSPIKE_CACHE_LINGER_S`, default 30 s, 0 in a
//! SLURM allocation), detached, so it serves every job that uses it and ends by
//! itself once none has been connected for the linger. The rounds, the start and
//! the race for the address are the launcher's too
//! (`vrtspike_contract::shared_server`); the attach here is a client connection.
//!
//! With `job`, the server is this job's: local rank 0's child with a parent-death
//! signal, so it ends with that rank (and with the job: nothing is left after
//! `kill -9` of any rank, since the others then fail and rank 0 with them). Its
//! address names the job, the node and the attempt (a restarted attempt starts a
//! fresh server: the old one ended with its rank 0), from `cache::default_address`.

use std::path::Path;
use std::time::{Duration, Instant};

use vrtspike_contract::cache_serve::{self, CacheServe, Watch};
use vrtspike_contract::dataset_sig::{SignOptions, BUDGET_ENV};
use vrtspike_contract::shared_server::{self, Joined, SharedStart};

use super::env::RankEnv;
use super::published;
use super::TrainError;
use crate::cache::own_server::{wait_for_server, OwnServer};
use crate::cache::{self, CacheClient};
use crate::config::{CacheSharing, Config};

/// How long local rank 0 waits for its server, and the others for rank 0's.
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// What the server is started with: this binary and the run's config.
#[derive(Debug, Clone, Copy)]
pub struct ServeFrom<'a> {
    /// The `vrtspike` binary.
    pub vrtspike: &'a Path,
    /// The run config file (the server reads its cap from it).
    pub config: &'a Path,
    /// The run's `--set` overrides.
    pub overrides: &'a [String],
}

/// What a rank keeps for the run (drop it at the end).
pub enum NodeCache {
    /// The job's own server, started by local rank 0: asked to shut down when
    /// dropped.
    Own(OwnServer),
    /// A connection to the node-shared server, held by every local rank while it
    /// runs: the server counts this job as attached through it (without one, a
    /// server with a short linger could stop between two of the job's
    /// connections).
    Held(CacheClient),
}

/// Attaches this rank to its node's cache server, starting it on local rank 0 when
/// no launcher did (see the module doc); sets the rank's cache address. Returns
/// the server when this rank started it: keep it for the run.
pub fn start_or_attach(
    env: &mut RankEnv,
    config: &Config,
    from: &ServeFrom,
) -> Result<Option<NodeCache>, TrainError> {
    cache::client::set_job_label(&env.layout().job_label());
    if !config.data.use_ram_cache || env.cache_addr.is_some() {
        return Ok(None);
    }
    let shared = shared_address(env, config)?;
    let address = match &shared {
        Some(address) => address.clone(),
        None => cache::default_address(&env.contract.job_name()),
    };
    let started = Instant::now();
    let (server, how) = match (env.local_rank, &shared) {
        (0, None) => (Some(NodeCache::Own(start(env, &address, from)?)), "started"),
        (0, Some(_)) => {
            let (hold, how) = attach_or_start_shared(env, &address, from)?;
            (Some(NodeCache::Held(hold)), how)
        }
        (_, None) => {
            wait_for(&address, env.rank)?;
            (None, "attached")
        }
        (_, Some(_)) => (
            Some(NodeCache::Held(wait_for(&address, env.rank)?)),
            "attached",
        ),
    };
    tracing::info!(
        rank = env.rank,
        address,
        shared = shared.is_some(),
        "node cache server {how} in {:.2} s (no launcher started one)",
        started.elapsed().as_secs_f64()
    );
    env.cache_addr = Some(address.clone());
    env.contract.cache_addr = Some(address);
    Ok(server)
}

/// The node-shared server's address with `DATA.CACHE_SHARING: node`; `None`
/// with `job`, or (with a warning) when no `DATA.ROOT` names a dataset to key it.
/// Signed once a node: local rank 0 signs the dataset and publishes the address
/// in the run directory; the other local ranks read it there.
fn shared_address(env: &RankEnv, config: &Config) -> Result<Option<String>, TrainError> {
    if config.data.cache_sharing != CacheSharing::Node {
        return Ok(None);
    }
    let Some(root) = &config.data.root else {
        tracing::warn!(
            "DATA.CACHE_SHARING is node but DATA.ROOT is null: this job starts a cache server \
             of its own"
        );
        return Ok(None);
    };
    let path = env.layout().shared_cache_address(&env.contract.job_name());
    if env.local_rank == 0 {
        let (address, _) = vrtspike_contract::cache_addr::node_shared_address(root)
            .map_err(|e| TrainError::io(root, e))?;
        published::publish(&path, &address)?;
        return Ok(Some(address));
    }
    let budget = SignOptions::from_env()
        .map_err(|e| TrainError::Env {
            var: BUDGET_ENV.to_string(),
            message: e.to_string(),
        })?
        .budget;
    match published::wait_for(&path, budget + START_TIMEOUT)? {
        Some(address) => Ok(Some(address)),
        None => Err(TrainError::io(
            &path,
            format!(
                "local rank 0 did not publish the node-shared cache server's address within \
                 {:.0} s (see its log)",
                (budget + START_TIMEOUT).as_secs_f64()
            ),
        )),
    }
}

/// Local rank 0 with a node-shared server: attaches to the one running, else
/// starts it (the contract's [`shared_server::attach_or_start`]). Returns its
/// connection to hold, and which it did.
fn attach_or_start_shared(
    env: &RankEnv,
    address: &str,
    from: &ServeFrom,
) -> Result<(CacheClient, &'static str), TrainError> {
    let who = format!(
        "rank {} (looking for the node-shared cache server)",
        env.rank
    );
    let quick = cache::ClientOptions::from_env()
        .map_err(|e| TrainError::io(from.config, format!("the cache client's options: {e}")))?
        .waiting(Duration::from_secs(2));
    let log = env.layout().cache_log(env.contract.node_rank);
    let started_by = format!("job {} (rank {})", env.layout().job_label(), env.rank);
    let linger_s =
        shared_server::linger_s(None, &|name| std::env::var(name).ok()).map_err(|message| {
            TrainError::Env {
                var: shared_server::LINGER_ENV.to_string(),
                message,
            }
        })?;
    let start = SharedStart {
        serve: serve_command(address, from),
        linger_s,
        started_by: &started_by,
        watch: Watch {
            log: &log,
            timeout: START_TIMEOUT,
            interrupted: &|| false,
        },
    };
    // Started (by this rank, or by another job that won the race): held at once,
    // since it waits for its first client longer than the linger.
    let mut attach = || Ok(CacheClient::connect_with(address, &who, &quick).ok());
    let (hold, joined) = shared_server::attach_or_start::<_, TrainError>(&start, &mut attach)?;
    let how = match joined {
        Joined::Started => "started (node-shared)",
        Joined::Attached | Joined::RaceLost => "attached (node-shared)",
    };
    Ok((hold, how))
}

/// Local rank 0: starts the job's own server (this rank's child, which dies with
/// it), logging into the node's cache log, and waits for its word.
fn start(env: &RankEnv, address: &str, from: &ServeFrom) -> Result<OwnServer, TrainError> {
    let log = env.layout().cache_log(env.contract.node_rank);
    let started = serve_command(address, from).start_logged(&Watch {
        log: &log,
        timeout: START_TIMEOUT,
        interrupted: &|| false,
    })?;
    Ok(OwnServer::new(address, started.spawned.process))
}

/// `vrtspike cache serve` at `address` with the run's config and overrides, as
/// the job's own server (a [`SharedStart`] makes it a lingering one).
fn serve_command<'a>(address: &'a str, from: &ServeFrom<'a>) -> CacheServe<'a> {
    CacheServe {
        vrtspike: from.vrtspike,
        address,
        config: from.config,
        cap: None,
        overrides: from.overrides,
        lifetime: cache_serve::Lifetime::WithParent,
    }
}

/// Other local ranks: waits until local rank 0's server accepts; returns the
/// connection.
fn wait_for(address: &str, rank: usize) -> Result<CacheClient, TrainError> {
    let who = format!("rank {rank} (waiting for the node's cache server)");
    wait_for_server(address, &who, START_TIMEOUT).map_err(|e| TrainError::Env {
        var: vrtspike_contract::env::CACHE_ADDR.to_string(),
        message: format!(
            "not set, and local rank 0 did not start the node's cache server at \
             {address:?} within {:.0} s: {e}",
            START_TIMEOUT.as_secs_f64()
        ),
    })
}
