//! What every attempt of the job shares, resolved once before the first: the
//! node's place in the job, the config (a readable file) and its facts, the ranks
//! and their command line, the memory plan check, the node's cache server
//! ([`NodeCache`]), and the links to the other nodes' launchers.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use super::cache::NodeCache;
use super::record::JobRecord;
use crate::args::Args;
use crate::cache_server;
use crate::cluster;
use crate::env_contract::{self, NodeRanks};
use crate::peers::{self, LinkSpec, PeerLinks};
use crate::plan_check;
use crate::rundir::RunDir;
use crate::spawn::ChildKind;

/// What every attempt of the job shares.
pub struct JobSetup {
    pub topology: cluster::Topology,
    pub ranks: NodeRanks,
    /// What each rank runs (`vrtspike`, or `--rank-cmd`) and its arguments.
    pub rank_program: PathBuf,
    pub rank_args: Vec<OsString>,
    pub rank_kind: ChildKind,
    /// This node's cache server.
    pub cache: NodeCache,
}

/// What each step of the supervision reads: what every attempt shares, the
/// arguments, and the links to the other nodes' launchers (multi-node jobs).
#[derive(Clone, Copy)]
pub struct Supervision<'a> {
    pub setup: &'a JobSetup,
    pub args: &'a Args,
    pub peers: Option<&'a PeerLinks>,
}

/// Resolves what every attempt shares; the node's place and the world's size go
/// into `record` as soon as they are known (an error after them lands in this
/// node's own summary).
pub fn prepare(record: &mut JobRecord, args: &Args) -> Result<JobSetup> {
    let env = |name: &str| std::env::var(name).ok();
    let topology = cluster::resolve(args, &env)?;
    record.nnodes = topology.nnodes;
    record.node_rank = topology.node_rank;
    record.membership = super::membership::Membership::all(topology.nnodes, topology.node_rank);
    let config = check_config(&args.config)?;
    let ranks = NodeRanks::from_args(args.gpus, args.ranks, env_contract::visible_gpus(&env))?;
    record.local_world_size = ranks.per_node;
    record.world_size = ranks.per_node * topology.nnodes;
    log_layout(&topology, ranks, record.world_size);
    let vrtspike = vrtspike_exe()?;
    if args.no_plan_check {
        tracing::info!("memory plan check skipped (--no-plan-check)");
    } else {
        plan_check::check(&plan_check::PlanRequest {
            vrtspike: &vrtspike,
            config: &config,
            overrides: &args.set,
            gpus: if ranks.gpus { ranks.per_node } else { 0 },
            ranks: ranks.per_node,
            cache_size: args.cache_size.as_deref(),
        })?;
    }
    let mut rank_args: Vec<OsString> =
        vec!["train".into(), "--config".into(), config.clone().into()];
    rank_args.extend(
        args.set
            .iter()
            .map(|spec| OsString::from(format!("--set={spec}"))),
    );
    rank_args.extend(args.train_args.iter().map(OsString::from));
    let facts = cache_server::config_facts(&vrtspike, &config, &args.set)?;
    warn_if_after_collective_timeout(args, facts.collective_timeout_s);
    Ok(JobSetup {
        rank_program: args.rank_cmd.clone().unwrap_or_else(|| vrtspike.clone()),
        rank_kind: match args.rank_cmd {
            Some(_) => ChildKind::Other,
            None => ChildKind::Vrtspike,
        },
        rank_args,
        cache: NodeCache::resolve(
            args,
            &facts,
            vrtspike,
            config,
            &record.run_dir,
            topology.node_rank,
        )?,
        topology,
        ranks,
    })
}

/// Links to the other nodes' launchers (multi-node jobs): node 0 listens on the
/// master address (port `--control-port`, else one the kernel picks, published in
/// the run dir with the job's secret); the others join it.
pub fn connect_peers(
    args: &Args,
    topology: &cluster::Topology,
    run_dir: &RunDir,
) -> Result<PeerLinks> {
    let config_bytes = std::fs::read(&args.config)
        .with_context(|| format!("reading the config {}", args.config.display()))?;
    PeerLinks::start(&LinkSpec {
        node_rank: topology.node_rank,
        nnodes: topology.nnodes,
        master_addr: topology.master_addr.clone(),
        port: args.control_port,
        control_file: run_dir.layout.control_file(),
        secret: peers::auth::given_secret(std::env::var(peers::auth::SECRET_ENV).ok())?,
        timeout: Duration::from_secs_f64(args.peer_timeout_s),
        silence: Duration::from_secs_f64(args.peer_silence_s),
        run_dir: run_dir.path.clone(),
        elastic: elastic(args, topology.nnodes),
        identity: peers::auth::Identity::of(&config_bytes),
    })
}

/// Whether `--min-nodes` lets the job go on without a lost node.
pub fn elastic(args: &Args, nnodes: u32) -> bool {
    args.min_nodes.is_some_and(|min| min < nnodes)
}

/// Warns when a rank would time out in its collective (`DIST.TIMEOUT_S`) before
/// the launcher names the stopped or hung rank it waits for.
fn warn_if_after_collective_timeout(args: &Args, collective_timeout_s: f64) {
    for (flag, secs) in [
        ("--hang-timeout-s", args.hang_timeout_s),
        ("--stall-timeout-s", args.stall_timeout_s),
    ] {
        if secs > 0.0 && secs >= collective_timeout_s {
            tracing::warn!(
                "{flag} {secs:.0} is not below DIST.TIMEOUT_S {collective_timeout_s:.0}: a rank \
                 waiting for a stuck one times out first and is named instead; lower {flag}"
            );
        }
    }
}

/// Logs this node's place in the job.
fn log_layout(topology: &cluster::Topology, ranks: NodeRanks, world_size: u32) {
    tracing::info!(
        "node {} of {} ({}), ranks {}..{} of {}, {}",
        topology.node_rank,
        topology.nnodes,
        topology.source,
        topology.node_rank * ranks.per_node,
        (topology.node_rank + 1) * ranks.per_node - 1,
        world_size,
        if ranks.gpus {
            "one GPU each (NCCL)"
        } else {
            "on CPU (Gloo)"
        }
    );
}

/// The config must exist and be a readable file; returns its absolute path.
fn check_config(path: &Path) -> Result<PathBuf> {
    let meta = std::fs::metadata(path)
        .with_context(|| format!("config file {} cannot be read", path.display()))?;
    if !meta.is_file() {
        bail!("config {} is not a file", path.display());
    }
    path.canonicalize()
        .with_context(|| format!("resolving the config path {}", path.display()))
}

/// The `vrtspike` binary beside this one.
fn vrtspike_exe() -> Result<PathBuf> {
    let me = std::env::current_exe().context("locating vrtspike-launch")?;
    let exe = me.with_file_name("vrtspike");
    if !exe.is_file() {
        bail!(
            "{} not found beside {} (build it: cargo build --workspace)",
            exe.display(),
            me.display()
        );
    }
    Ok(exe)
}
