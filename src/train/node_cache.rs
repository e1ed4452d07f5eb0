//! The node's cache server when no launcher started one (torchrun, srun, a rank
//! alone): local rank 0 starts it with the launcher's own command and readiness
//! pipe (`vrtspike_contract::cache_serve`); the other local ranks wait until it
//! accepts and attach. All of them attach to `VRTSPIKE_CACHE_ADDR` instead when it
//! is set, and `DATA.USE_RAM_CACHE: false` means no server at all.
//!
//! With `DATA.CACHE_SHARING: node` (the default) the server is the node-shared one
//! of this user and dataset, at the address the launcher uses too
//! (`cache_addr::node_shared_address`), signed by local rank 0 alone: local rank 0
//! attaches to it when it runs, else starts it with a linger
//! (`VRTSPIKE_CACHE_LINGER_S`, default 30 s, 0 in a SLURM allocation), detached,
//! so it serves every job that uses it and ends by itself once none has been
//! connected for the linger. The rounds, the start and the race for the address
//! are the launcher's too (`vrtspike_contract::shared_server`); the attach here is
//! a client connection. When that address is held by a server this job cannot
//! use (another user's process, another build's server, one with no connection
//! left), local rank 0 falls back to a server of the job's own as with `job`
//! below, as the launcher does. Local rank 0 then publishes which server it is
//! in the run directory; the other local ranks read it there (each warns once
//! when it is a fall-back) and connect. The run summary's `cache_sharing` says
//! which it was.
//!
//! With `job`, the server is this job's: local rank 0's child with a parent-death
//! signal, so it ends with that rank (and with the job: nothing is left after
//! `kill -9` of any rank, since the others then fail and rank 0 with them). Its
//! address names the job, the node and the attempt (a restarted attempt starts a
//! fresh server: the old one ended with its rank 0), from `cache::default_address`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vrtspike_contract::cache_serve::{self, CacheServe, Watch};
use vrtspike_contract::dataset_sig::{SignOptions, BUDGET_ENV};
use vrtspike_contract::shared_server::{self, Joined, NotOurs, SharedStart};
use vrtspike_contract::summary::{CacheSharing, SharingMode};

use super::env::RankEnv;
use super::published;
use super::TrainError;
use crate::cache::own_server::{wait_for_server, OwnServer};
use crate::cache::{self, CacheClient};
use crate::config::Config;

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
/// no launcher did (see the module doc); sets the rank's cache address and what
/// the run summary says of it. Returns the server when this rank started it, or
/// the connection that holds the node-shared one: keep it for the run.
pub fn start_or_attach(
    env: &mut RankEnv,
    config: &Config,
    from: &ServeFrom,
) -> Result<Option<NodeCache>, TrainError> {
    cache::client::set_job_label(&env.layout().job_label());
    if !config.data.use_ram_cache || env.cache_addr.is_some() {
        return Ok(None);
    }
    let own = cache::default_address(&env.contract.job_name());
    let started = Instant::now();
    let chosen = match (shared_root(config), env.local_rank) {
        (None, 0) => Chosen {
            server: Some(NodeCache::Own(start(env, &own, from)?)),
            sharing: own_sharing(&own),
            how: "started",
        },
        (None, _) => {
            wait_for(&own, env.rank)?;
            Chosen {
                server: None,
                sharing: own_sharing(&own),
                how: "attached",
            }
        }
        (Some(root), 0) => lead_shared(env, config, root, &own, from)?,
        (Some(_), _) => follow_shared(env)?,
    };
    let address = chosen.sharing.address.clone();
    tracing::info!(
        rank = env.rank,
        address,
        shared = chosen.sharing.mode == SharingMode::Node,
        "node cache server {} in {:.2} s (no launcher started one)",
        chosen.how,
        started.elapsed().as_secs_f64()
    );
    env.cache_addr = Some(address.clone());
    env.contract.cache_addr = Some(address);
    env.cache_sharing = Some(chosen.sharing);
    Ok(chosen.server)
}

/// The server a rank reads through, and how it came to it.
struct Chosen {
    /// What the rank keeps for the run.
    server: Option<NodeCache>,
    /// Which server it is (the summary's `cache_sharing`).
    sharing: CacheSharing,
    /// How the rank came to it, for the log.
    how: &'static str,
}

/// The job's own server at `address`.
fn own_sharing(address: &str) -> CacheSharing {
    CacheSharing {
        mode: SharingMode::Job,
        address: address.to_string(),
        fell_back_from: None,
        why: None,
    }
}

/// The dataset that keys the node-shared server with `DATA.CACHE_SHARING: node`;
/// `None` with `job`, or (with a warning) when no `DATA.ROOT` names one.
fn shared_root(config: &Config) -> Option<&Path> {
    if config.data.cache_sharing != crate::config::CacheSharing::Node {
        return None;
    }
    if config.data.root.is_none() {
        tracing::warn!(
            "DATA.CACHE_SHARING is node but DATA.ROOT is null: this job starts a cache server \
             of its own"
        );
    }
    config.data.root.as_deref()
}

/// Local rank 0 with `DATA.CACHE_SHARING: node`: signs the dataset, attaches to
/// the node-shared server or starts it, or, when its address is not this job's
/// to use, falls back to a server of the job's own (saying so); then publishes
/// which server it is in the run directory for the node's other ranks.
fn lead_shared(
    env: &RankEnv,
    config: &Config,
    root: &Path,
    own: &str,
    from: &ServeFrom,
) -> Result<Chosen, TrainError> {
    let (address, _) = vrtspike_contract::cache_addr::node_shared_address(root)
        .map_err(|e| TrainError::io(root, e))?;
    let chosen = match attach_or_start_shared(env, &address, from) {
        Ok((hold, how)) => {
            let have = hold.stats().ok().map(|stats| stats.connections as u64);
            let want = config.data.cache_connections.count().map(u64::from);
            shared_server::warn_fewer_connections(&address, have, want);
            Chosen {
                server: Some(NodeCache::Held(hold)),
                sharing: CacheSharing {
                    mode: SharingMode::Node,
                    address,
                    fell_back_from: None,
                    why: None,
                },
                how,
            }
        }
        Err(TrainError::NotOurs(not_ours)) => {
            let sharing = not_ours.fall_back(own).sharing();
            Chosen {
                server: Some(NodeCache::Own(start(env, own, from)?)),
                sharing,
                how: "started (fell back from the node-shared one)",
            }
        }
        Err(e) => return Err(e),
    };
    let text = serde_json::to_string(&chosen.sharing)
        .map_err(|e| TrainError::io(&published_path(env), e))?;
    published::publish(&published_path(env), &text)?;
    Ok(chosen)
}

/// The other local ranks with `DATA.CACHE_SHARING: node`: read which server local
/// rank 0 chose (waiting for it to sign, attach or start, up to a bound), say
/// so once when it fell back, and connect.
fn follow_shared(env: &RankEnv) -> Result<Chosen, TrainError> {
    let path = published_path(env);
    let budget = SignOptions::from_env()
        .map_err(|e| TrainError::Env {
            var: BUDGET_ENV.to_string(),
            message: e.to_string(),
        })?
        .budget;
    let bound = budget + START_TIMEOUT * (shared_server::ATTACH_ROUNDS as u32 + 1);
    let Some(text) = published::wait_for(&path, bound)? else {
        return Err(TrainError::io(
            &path,
            format!(
                "local rank 0 did not publish the node's cache server within {:.0} s (see its \
                 log)",
                bound.as_secs_f64()
            ),
        ));
    };
    let sharing: CacheSharing = serde_json::from_str(&text).map_err(|e| {
        TrainError::io(
            &path,
            format!("not the cache server local rank 0 publishes: {e}"),
        )
    })?;
    if let Some(shared) = &sharing.fell_back_from {
        let why = sharing.why.as_deref().unwrap_or("not this job's to use");
        let not_ours = NotOurs {
            address: shared.clone(),
            why: format!(": {why}"),
        };
        not_ours.fall_back(&sharing.address);
    }
    let hold = wait_for(&sharing.address, env.rank)?;
    let (server, how) = match sharing.mode {
        SharingMode::Node => (Some(NodeCache::Held(hold)), "attached (node-shared)"),
        SharingMode::Job => (None, "attached"),
    };
    Ok(Chosen {
        server,
        sharing,
        how,
    })
}

/// Where local rank 0 publishes which server the node's ranks use.
fn published_path(env: &RankEnv) -> PathBuf {
    env.layout().shared_cache_address(&env.contract.job_name())
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
    let mut attach = || match CacheClient::connect_with(address, &who, &quick) {
        Ok(client) => Ok(Some(client)),
        Err(e) if e.is_not_ours() => Err(TrainError::NotOurs(NotOurs {
            address: address.to_string(),
            why: format!(": {e}"),
        })),
        // None there yet (or it stopped in between): the next round.
        Err(_) => Ok(None),
    };
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
