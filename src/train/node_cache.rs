//! The node's cache server when no launcher started one (torchrun, srun, a rank
//! alone): local rank 0 starts it with the launcher's own command and readiness
//! pipe (`vrtspike_contract::cache_serve`), as its child with a parent-death
//! signal, so it ends with that rank (and with the job: nothing is left after
//! `kill -9` of any rank, since the others then fail and rank 0 with them); the
//! other local ranks wait until it accepts and attach. All of them attach to
//! `VRTSPIKE_CACHE_ADDR` instead when it is set, and `DATA.USE_RAM_CACHE: false`
//! means no server at all.
//!
//! The address names the job, the node and the attempt (a restarted attempt
//! starts a fresh server: the old one ended with its rank 0). It comes from
//! `cache::default_address`.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use vrtspike_contract::cache_serve::{self, CacheServe};

use super::env::RankEnv;
use super::TrainError;
use crate::cache::{self, CacheClient, CacheError};
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

/// The server local rank 0 started; asked to shut down when dropped.
#[derive(Debug)]
pub struct NodeCache {
    address: String,
    child: Child,
}

impl Drop for NodeCache {
    fn drop(&mut self) {
        let asked = CacheClient::connect(&self.address, "rank 0 (ending the node's cache server)")
            .and_then(|client| client.shutdown_server());
        if let Err(e) = asked {
            tracing::debug!(error = %e, "the node's cache server did not take the shutdown");
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Attaches this rank to its node's cache server, starting it on local rank 0 when
/// no launcher did (see the module doc); sets the rank's cache address. Returns
/// the server when this rank started it: keep it for the run.
pub fn start_or_attach(
    env: &mut RankEnv,
    config: &Config,
    from: &ServeFrom,
) -> Result<Option<NodeCache>, TrainError> {
    if !config.data.use_ram_cache || env.cache_addr.is_some() {
        return Ok(None);
    }
    let address = cache::default_address(&job_name(env));
    let started = Instant::now();
    let server = if env.local_rank == 0 {
        Some(start(env, &address, from)?)
    } else {
        wait_for(&address, env.rank)?;
        None
    };
    tracing::info!(
        rank = env.rank,
        address,
        "node cache server {} in {:.2} s (no launcher started one)",
        if server.is_some() {
            "started"
        } else {
            "attached"
        },
        started.elapsed().as_secs_f64()
    );
    env.cache_addr = Some(address.clone());
    env.contract.cache_addr = Some(address);
    Ok(server)
}

/// The job, node and attempt, as every local rank names them alike: the job from
/// torchrun's run id or srun's job and step, else from the rendezvous port (ranks
/// of one job share it), else this process (a rank alone).
fn job_name(env: &RankEnv) -> String {
    let job = match (env.contract.job_tag(), &env.contract.master) {
        (Some(tag), _) => tag,
        (None, Some(master)) if env.distributed() => format!("port{}", master.port),
        _ => format!("pid{}", std::process::id()),
    };
    format!("{job}-n{}-a{}", env.contract.node_rank, env.restart_count)
}

/// Local rank 0: starts the server and waits for its word.
fn start(env: &RankEnv, address: &str, from: &ServeFrom) -> Result<NodeCache, TrainError> {
    let log = env.layout().cache_log(env.contract.node_rank);
    let out = open_log(&log)?;
    let err = out.try_clone().map_err(|e| TrainError::io(&log, e))?;
    let spec = CacheServe {
        vrtspike: from.vrtspike,
        address,
        config: from.config,
        cap: None,
        overrides: from.overrides,
        lifetime: cache_serve::Lifetime::WithParent,
    };
    let (mut command, mut pipe) = spec
        .command()
        .map_err(|e| TrainError::io(&log, format!("the cache server's readiness pipe: {e}")))?;
    command.stdin(Stdio::null()).stdout(out).stderr(err);
    let parent = std::process::id() as i32;
    // SAFETY: the hook runs in the forked child before exec; it only makes the
    // prctl and getppid system calls, which are async-signal-safe, and allocates
    // nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    let spawned = command.spawn();
    pipe.close_child_end();
    let mut child = spawned.map_err(|e| {
        TrainError::io(
            from.vrtspike,
            format!("starting the node's cache server: {e}"),
        )
    })?;
    let waited =
        cache_serve::wait_ready(&mut pipe, START_TIMEOUT, &mut || child.try_wait(), &|| {
            false
        });
    match waited {
        Ok(_) => Ok(NodeCache {
            address: address.to_string(),
            child,
        }),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(TrainError::io(
                &log,
                format!("{e}: the node's cache server at {address:?} (its log)"),
            ))
        }
    }
}

/// Other local ranks: waits until local rank 0's server accepts.
fn wait_for(address: &str, rank: usize) -> Result<(), TrainError> {
    let started = Instant::now();
    let who = format!("rank {rank} (waiting for the node's cache server)");
    loop {
        match CacheClient::connect(address, &who) {
            Ok(_) => return Ok(()),
            Err(CacheError::Connect { .. }) if started.elapsed() < START_TIMEOUT => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(TrainError::Env {
                    var: vrtspike_contract::env::CACHE_ADDR.to_string(),
                    message: format!(
                        "not set, and local rank 0 did not start the node's cache server at \
                         {address:?} within {:.0} s: {e}",
                        START_TIMEOUT.as_secs_f64()
                    ),
                })
            }
        }
    }
}

fn open_log(path: &PathBuf) -> Result<std::fs::File, TrainError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| TrainError::io(path, e))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env_of(pairs: &[(&str, &str)]) -> RankEnv {
        let vars: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RankEnv::from_vars(
            &|k| vars.get(k).cloned(),
            Some(Path::new("/r")),
            Some("cpu"),
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn every_local_rank_names_the_same_server_per_job_node_and_attempt() {
        let torchrun = |rank: &'static str, restart: &'static str| {
            env_of(&[
                ("RANK", rank),
                ("LOCAL_RANK", rank),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29500"),
                ("TORCHELASTIC_RUN_ID", "abc"),
                ("TORCHELASTIC_RESTART_COUNT", restart),
            ])
        };
        assert_eq!(job_name(&torchrun("0", "0")), "torchrun-abc-n0-a0");
        assert_eq!(job_name(&torchrun("1", "0")), job_name(&torchrun("0", "0")));
        assert_eq!(job_name(&torchrun("1", "1")), "torchrun-abc-n0-a1");
        let homemade = env_of(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]);
        assert_eq!(job_name(&homemade), "port29500-n0-a0");
        let alone = env_of(&[]);
        assert_eq!(job_name(&alone), format!("pid{}-n0-a0", std::process::id()));
    }
}
