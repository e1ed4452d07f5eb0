//! One job on this node, from its first attempt to its summary: the supervisor
//! behind `vrtspike-launch`. It resolves what every attempt shares (the node's place
//! in the job, the config's facts, the cache server, the links to the other nodes'
//! launchers), starts each attempt's ranks as a gang, decides after each whether to
//! restart from the last checkpoint, and writes `summary.json` at every exit. The
//! binary (`main.rs`) parses the arguments and hands over to [`Job`].

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context, Result};
use vrtspike_contract::rundir::Checkpoint;

use crate::args::Args;
use crate::cluster;
use crate::env_contract::{AttemptEnv, NodeRanks};
use crate::gang::{self, GangSettings, RankLaunch};
use crate::peers::{LinkSpec, PeerEvent, PeerLinks};
use crate::pss;
use crate::restart::{Decision, FailedAttempt, RestartPolicy};
use crate::rundir::RunDir;
use crate::signals;
use crate::spawn::{self, ChildKind};
use crate::summary::{AttemptRecord, ExitKind, Failure, Summary};
use crate::{cache_server, env_contract, hang, peers, plan_check, shared_cache};

/// What the launcher knows about the job, gathered for the summary.
pub struct Job {
    run_dir: RunDir,
    started: Instant,
    /// Wall-clock time of the launch (rank 0's figures must be newer).
    launched: SystemTime,
    nnodes: u32,
    node_rank: u32,
    world_size: u32,
    local_world_size: u32,
    attempts: Vec<AttemptRecord>,
    first_failure: Option<Failure>,
    sampler: pss::PssSampler,
    cache_stats: Option<serde_json::Value>,
    /// Links to the other nodes' launchers (multi-node jobs).
    peers: Option<PeerLinks>,
}

impl Job {
    pub fn new(run_dir: RunDir, args: &Args) -> Job {
        Job {
            run_dir,
            started: Instant::now(),
            launched: SystemTime::now(),
            nnodes: args.nnodes.unwrap_or(1),
            node_rank: args.node_rank.unwrap_or(0),
            world_size: 0,
            local_world_size: 0,
            attempts: Vec::new(),
            first_failure: None,
            sampler: pss::PssSampler::start(
                std::process::id(),
                Duration::from_secs_f64(args.pss_interval_s),
            ),
            cache_stats: None,
            peers: None,
        }
    }

    /// Runs the job to its end; `Ok` is how it ended (with the reason it gave up
    /// restarting, if it did), `Err` a failure to start it at all.
    pub fn run(&mut self, args: &Args) -> Result<Ending> {
        let setup = self.prepare(args)?;
        if setup.topology.nnodes > 1 {
            self.peers = Some(connect_peers(args, &setup.topology, &self.run_dir)?);
        }
        let mut server = match setup.ram_cache {
            true => Some(setup.hold_cache(args, &self.run_dir)?),
            false => {
                tracing::info!(
                    "DATA.USE_RAM_CACHE is false: no cache server, ranks read from disk"
                );
                None
            }
        };
        if let Some(peers) = self
            .peers
            .as_ref()
            .filter(|_| setup.topology.node_rank == 0)
        {
            let timeout = Duration::from_secs_f64(args.peer_timeout_s);
            peers.wait_for_nodes(timeout, &|| signals::requested_ending().is_some())?;
        }
        let mut last_failed_at: Option<Instant> = None;
        let ending = loop {
            // Between attempts the last checkpoint is already on disk.
            if let Some(ending) = self.ending_before_attempt() {
                break ending;
            }
            let plan = match self.next_attempt(&setup, args)? {
                Ok(plan) => plan,
                Err(ending) => break ending,
            };
            if let Some(stopped) = server.as_mut() {
                if !stopped.running() {
                    match setup.shared {
                        Some(_) => tracing::warn!(
                            "the node-shared cache server went away: attaching again \
                             (or starting one)"
                        ),
                        None => tracing::warn!("restarting the cache server"),
                    }
                    *stopped = setup.hold_cache(args, &self.run_dir)?;
                }
            }
            let attempt = self.run_attempt(&setup, args, server.as_mut(), last_failed_at, plan)?;
            match self.after_attempt(args, &setup, attempt) {
                Next::End(ending) => break ending,
                Next::Restart(failed_at) => last_failed_at = failed_at,
            }
        };
        if let Some(mut server) = server {
            self.cache_stats = cache_server::stats(&setup.vrtspike, &setup.cache_addr);
            if let (Some(shared), Some(serde_json::Value::Object(stats))) =
                (&setup.shared, self.cache_stats.as_mut())
            {
                // The figures are the whole server's, every attached job's together;
                // this job's own are its entry in `jobs` (its ranks name it by the
                // run directory).
                let label = self.run_dir.layout.job_label();
                let this_job = stats
                    .get("jobs")
                    .and_then(serde_json::Value::as_array)
                    .and_then(|jobs| jobs.iter().find(|j| j["job"] == label.as_str()))
                    .cloned();
                stats.insert(
                    "sharing".into(),
                    serde_json::json!({"mode": "node", "address": setup.cache_addr,
                        "job": shared.job, "figures": "server-wide", "this_job": this_job}),
                );
            }
            // In node mode this stops only the attach: the server lingers.
            spawn::stop_all(&mut [&mut server], Duration::from_secs(5));
        }
        Ok(ending)
    }

    /// The next attempt's number and rendezvous port: this node's own on one node;
    /// on several, node 0 picks the port and tells the others (`START`), and the
    /// others wait for it. `Err` is how the job ends instead (node 0 ended it).
    fn next_attempt(
        &self,
        setup: &JobSetup,
        args: &Args,
    ) -> Result<std::result::Result<AttemptPlan, Ending>> {
        let restart_count = self.attempts.len() as u32;
        let pick = || match setup.topology.master_port {
            Some(port) => Ok(port),
            None => free_port(),
        };
        let Some(peers) = &self.peers else {
            return Ok(Ok(AttemptPlan {
                restart_count,
                master_port: pick()?,
            }));
        };
        if setup.topology.node_rank == 0 {
            let master_port = pick()?;
            peers.announce_start(restart_count, master_port);
            return Ok(Ok(AttemptPlan {
                restart_count,
                master_port,
            }));
        }
        let timeout = Duration::from_secs_f64(args.peer_timeout_s);
        let interrupted = || signals::requested_ending().is_some();
        match peers.wait_start(restart_count, timeout, &interrupted)? {
            Some(master_port) => Ok(Ok(AttemptPlan {
                restart_count,
                master_port,
            })),
            None => Ok(Err(self.ending_without_node0(peers))),
        }
    }

    /// How this node ends when node 0 starts no next attempt.
    fn ending_without_node0(&self, peers: &PeerLinks) -> Ending {
        if let Some(ending) = signals::requested_ending() {
            return (ending, None);
        }
        if let Some(event) = peers.quit() {
            let failure = peer_failure(&event);
            return (ExitKind::Failed, Some(failure.cause));
        }
        let why = "node 0 ended the job while this node's attempt failed: no restart alone";
        (ExitKind::Failed, Some(why.to_string()))
    }

    /// Resolves what every attempt shares: the node layout, the config, the ranks,
    /// the memory plan check, the rank command line and the cache address.
    fn prepare(&mut self, args: &Args) -> Result<JobSetup> {
        let env = |name: &str| std::env::var(name).ok();
        // The node first: an error after this lands in this node's own summary.
        let topology = cluster::resolve(args, &env)?;
        self.nnodes = topology.nnodes;
        self.node_rank = topology.node_rank;
        let config = check_config(&args.config)?;
        let ranks = NodeRanks::from_args(args.gpus, args.ranks, env_contract::visible_gpus(&env))?;
        self.local_world_size = ranks.per_node;
        self.world_size = ranks.per_node * topology.nnodes;
        log_layout(&topology, ranks, self.world_size);
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
        let shared = match facts.ram_cache && facts.shared {
            true => shared_setup(args, &facts, &self.run_dir)?,
            false => None,
        };
        Ok(JobSetup {
            ram_cache: facts.ram_cache,
            cache_addr: match &shared {
                Some(shared) => shared.address.clone(),
                None => cache_server::address(topology.node_rank),
            },
            shared,
            rank_program: args.rank_cmd.clone().unwrap_or_else(|| vrtspike.clone()),
            rank_kind: match args.rank_cmd {
                Some(_) => ChildKind::Other,
                None => ChildKind::Vrtspike,
            },
            rank_args,
            topology,
            ranks,
            config,
            vrtspike,
        })
    }

    /// An ending asked for before the next attempt starts: a signal, or another
    /// node leaving the job.
    fn ending_before_attempt(&mut self) -> Option<Ending> {
        if let Some(ending) = signals::requested_ending() {
            return Some((ending, None));
        }
        let event = self.peers.as_ref().and_then(PeerLinks::quit)?;
        let failure = peer_failure(&event);
        let why = format!("{} (node {} left the job)", failure.cause, failure.node);
        self.first_failure.get_or_insert(failure);
        Some((ExitKind::Failed, Some(why)))
    }

    /// Starts the ranks of the next attempt, supervises them to the attempt's end
    /// and records it.
    fn run_attempt(
        &mut self,
        setup: &JobSetup,
        args: &Args,
        server: Option<&mut spawn::Supervised>,
        last_failed_at: Option<Instant>,
        plan: AttemptPlan,
    ) -> Result<Attempt> {
        let restart_count = plan.restart_count;
        let launches = self.launches(setup, args, plan);
        let resumed_from = self.run_dir.latest_checkpoint();
        let resumed_name = resumed_from.as_ref().map(Checkpoint::name);
        for launch in &launches {
            banner(&launch.log, restart_count, resumed_name.as_deref());
        }
        if restart_count > 0 {
            tracing::info!(
                "restart {restart_count} of {}, from checkpoint {}",
                args.max_restarts,
                resumed_name.as_deref().unwrap_or("(none yet)")
            );
        }
        let started = Instant::now();
        let restart_latency_s = last_failed_at.map(|at| at.elapsed().as_secs_f64());
        let peers = self.peers.clone();
        let peer_stop = || {
            let event = peers.as_ref()?.stop_reason(restart_count)?;
            Some(peer_failure(&event))
        };
        let mut hang = hang::HangCheck::new(
            args.hang_timeout_s,
            args.stall_timeout_s,
            self.run_dir.path.clone(),
            restart_count,
            (self.world_size, self.local_world_size),
        );
        if let Some(links) = &self.peers {
            hang = hang.with_relay(std::sync::Arc::new(links.clone()));
        }
        let timing = GangSettings {
            node_rank: setup.topology.node_rank,
            grace: Duration::from_secs_f64(args.grace_s),
            preempt_timeout: Duration::from_secs_f64(args.preempt_timeout_s),
            run_dir: &self.run_dir.path,
            attempt: restart_count,
        };
        let run_dir = &self.run_dir;
        let reattach = || setup.hold_cache(args, run_dir);
        let hold = server.map(|process| gang::CacheHold {
            process,
            reattach: setup
                .shared
                .as_ref()
                .map(|_| &reattach as &dyn Fn() -> Result<spawn::Supervised>),
        });
        let mut end = gang::run_attempt(&launches, hold, timing, &peer_stop, hang)?;
        end.failure = end
            .failure
            .map(|f| f.with_rank_account(&self.run_dir.layout));
        if let Some(failure) = end.failure.as_ref().filter(|f| f.class.is_some()) {
            tracing::error!("rank failure cause: {}", failure.cause);
        }
        self.attempts.push(AttemptRecord {
            attempt: restart_count,
            duration_s: started.elapsed().as_secs_f64(),
            outcome: end.outcome,
            resumed_from: resumed_name,
            restart_latency_s,
            failure: end.failure.clone(),
            killed_after_grace: end.killed_after_grace.clone(),
        });
        Ok(Attempt {
            restart_count,
            resumed_step: resumed_from.map(|c| c.step),
            end,
        })
    }

    /// The launch of every local rank of the attempt `plan` says.
    fn launches(&self, setup: &JobSetup, args: &Args, plan: AttemptPlan) -> Vec<RankLaunch> {
        let env = |name: &str| std::env::var(name).ok();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let attempt_env = AttemptEnv {
            topology: &setup.topology,
            ranks: setup.ranks,
            master_port: plan.master_port,
            restart_count: plan.restart_count,
            max_restarts: args.max_restarts,
            cache_addr: setup.ram_cache.then_some(setup.cache_addr.as_str()),
            run_dir: &self.run_dir.path,
            threads_per_rank: env_contract::threads_per_rank(cores, setup.ranks.per_node),
        };
        (0..setup.ranks.per_node)
            .map(|local| {
                let rank = attempt_env.global_rank(local);
                RankLaunch {
                    rank,
                    program: setup.rank_program.clone(),
                    args: setup.rank_args.clone(),
                    env: attempt_env.vars(local, &env),
                    log: self.run_dir.layout.rank_log(rank),
                    kind: setup.rank_kind,
                }
            })
            .collect()
    }

    /// After an attempt: the job's ending, or a restart (after the policy's delay).
    fn after_attempt(&mut self, args: &Args, setup: &JobSetup, attempt: Attempt) -> Next {
        let Attempt {
            restart_count,
            resumed_step,
            end,
        } = attempt;
        if end.outcome == ExitKind::Interrupted {
            return Next::End((end.outcome, end.failure.map(|f| f.cause)));
        }
        let Some(failure) = end.failure else {
            return Next::End((end.outcome, None));
        };
        if self.first_failure.is_none() {
            self.first_failure = Some(failure.clone());
        }
        let peers = self.peers.as_ref();
        if let Some(peers) = peers.filter(|_| failure.node == setup.topology.node_rank) {
            peers.report_failure(restart_count, &failure.cause, failure.stuck);
        }
        if peers.and_then(PeerLinks::quit).is_some() {
            return Next::End((ExitKind::Failed, Some("a node left the job".into())));
        }
        if end.preempting {
            let why = "it failed while checkpointing for a preemption";
            return Next::End((ExitKind::Failed, Some(why.into())));
        }
        // A request that came while the gang was being stopped: the last
        // checkpoint is on disk, so end as asked instead of restarting.
        if let Some(ending) = signals::requested_ending() {
            return Next::End((ending, None));
        }
        let previous_failure = self
            .attempts
            .iter()
            .rev()
            .nth(1)
            .and_then(|a| a.failure.as_ref());
        // Node 0 decides for the job; the others wait for its next START.
        if let Some(peers) = peers.filter(|_| setup.topology.node_rank != 0) {
            tracing::warn!("{}; waiting for node 0 to restart the job", failure.cause);
            let _ = peers;
            return Next::Restart(end.failed_at);
        }
        let ended = peers.map(PeerLinks::ended_nodes).unwrap_or_default();
        if !ended.is_empty() {
            let why = format!("node(s) {ended:?} already ended: no restart without them");
            return Next::End((ExitKind::Failed, Some(why)));
        }
        // Progress: a checkpoint of a higher step than the attempt started from.
        let made_progress = self.run_dir.latest_checkpoint().map(|c| c.step) > resumed_step;
        let policy = RestartPolicy {
            max_restarts: args.max_restarts,
            delay: Duration::from_secs_f64(args.restart_delay_s),
        };
        match policy.decide(&FailedAttempt {
            restarts_done: restart_count,
            failure: &failure,
            made_progress,
            previous_failure,
        }) {
            Decision::GiveUp(why) => Next::End((ExitKind::Failed, Some(why))),
            Decision::Restart(delay) => {
                tracing::warn!(
                    "{}; restarting in {:.1} s",
                    failure.cause,
                    delay.as_secs_f64()
                );
                interruptible_sleep(delay);
                Next::Restart(end.failed_at)
            }
        }
    }

    /// Writes the summary, reports the ending, and returns the exit status.
    pub fn finish(self, result: Result<Ending>) -> u8 {
        let (exit, error) = match result {
            Ok((kind, why)) => {
                let error = match (&self.first_failure, kind) {
                    (Some(failure), ExitKind::Failed) => Some(match why {
                        Some(why) => format!("{} ({why})", failure.cause),
                        None => failure.cause.clone(),
                    }),
                    _ => why,
                };
                (kind, error)
            }
            Err(e) => (ExitKind::Error, Some(format!("{e:#}"))),
        };
        let summary = Summary {
            exit,
            exit_code: exit.exit_code(),
            error: error.clone(),
            failure: self.first_failure.clone(),
            restarts: self.attempts.len().saturating_sub(1) as u32,
            attempts: self.attempts,
            run_dir: self.run_dir.path.display().to_string(),
            nnodes: self.nnodes,
            node_rank: self.node_rank,
            world_size: self.world_size,
            local_world_size: self.local_world_size,
            wall_s: self.started.elapsed().as_secs_f64(),
            memory: self.sampler.peaks(),
            cache: self.cache_stats,
        };
        if let Some(peers) = &self.peers {
            match exit {
                ExitKind::Completed | ExitKind::Preempted => peers.report_end(None),
                _ => peers.report_end(Some(error.as_deref().unwrap_or("failed"))),
            }
        }
        let summary_path = self.run_dir.layout.launcher_summary(self.node_rank);
        let train_summary = self.run_dir.layout.train_summary();
        if let Err(e) = summary.write(&summary_path, &train_summary, self.launched) {
            tracing::error!("{e:#}");
        }
        match (&error, &summary.failure) {
            (Some(error), Some(failure)) if exit == ExitKind::Failed => {
                tracing::error!("job failed: {error}");
                if !failure.log.is_empty() {
                    let mut report = format!(
                        "--- last {} lines of {} ---\n",
                        failure.log_tail.len(),
                        failure.log
                    );
                    for line in &failure.log_tail {
                        report.push_str(line);
                        report.push('\n');
                    }
                    report.push_str("---");
                    eprintln!("{report}");
                }
            }
            (Some(error), _) => tracing::error!("{error}"),
            (None, _) => tracing::info!("job {}", exit.name()),
        }
        for line in where_to_look(&self.run_dir.path, &summary_path) {
            say(&line);
        }
        exit.exit_code()
    }
}

/// How the job ended, with the reason it gave up restarting, if it did.
type Ending = (ExitKind, Option<String>);

/// What every attempt of the job shares, resolved once before the first.
struct JobSetup {
    topology: cluster::Topology,
    ranks: NodeRanks,
    /// The run config (checked to be a readable file).
    config: PathBuf,
    /// The `vrtspike` binary beside the launcher.
    vrtspike: PathBuf,
    /// What each rank runs (`vrtspike`, or `--rank-cmd`) and its arguments.
    rank_program: PathBuf,
    rank_args: Vec<OsString>,
    rank_kind: ChildKind,
    /// This node's cache server address.
    cache_addr: String,
    /// `DATA.USE_RAM_CACHE`: start the node's cache server.
    ram_cache: bool,
    /// `DATA.CACHE_SHARING: node`: the node-shared server this job attaches to.
    shared: Option<SharedSetup>,
}

/// The node-shared cache server of this job's dataset.
struct SharedSetup {
    /// Its address (uid and dataset signature).
    address: String,
    /// This job as the server's stats name it: the run directory and launcher.
    job: String,
    /// The cap this job asks for.
    wanted_cap: u64,
    /// Seconds a server this job starts stays after the last job detached.
    linger_s: f64,
}

/// The node-shared server's address and this job's name for it; `None` (one
/// server for this job, with a warning) when the config names no DATA.ROOT.
fn shared_setup(
    args: &Args,
    facts: &cache_server::ConfigFacts,
    run_dir: &RunDir,
) -> Result<Option<SharedSetup>> {
    let Some(root) = &facts.data_root else {
        tracing::warn!(
            "DATA.CACHE_SHARING is node but DATA.ROOT is null: this job starts a cache server \
             of its own"
        );
        return Ok(None);
    };
    let (address, signature) = vrtspike_contract::cache_addr::node_shared_address(root)?;
    tracing::info!(
        address,
        root = %signature.root.display(),
        files = signature.files,
        bytes = signature.bytes,
        "DATA.CACHE_SHARING is node: one cache server for this user's jobs on this dataset"
    );
    let wanted_cap = match args.cache_size.as_deref() {
        Some(text) => vrtspike_contract::size::parse_size(text)
            .with_context(|| format!("--cache-size {text:?} is not a size (e.g. 20G)"))?,
        None => facts.cache_bytes,
    };
    let job = format!(
        "job {} (launcher pid {})",
        run_dir.path.display(),
        std::process::id()
    );
    let linger_s =
        vrtspike_contract::shared_server::linger_s(args.cache_linger_s, &|n| std::env::var(n).ok())
            .map_err(anyhow::Error::msg)?;
    Ok(Some(SharedSetup {
        address,
        job,
        wanted_cap,
        linger_s,
    }))
}

impl JobSetup {
    /// Starts this job's cache server, or attaches to the node-shared one (starting
    /// it if none runs): what the gang watches and the job stops at its end.
    fn hold_cache(&self, args: &Args, run_dir: &RunDir) -> Result<spawn::Supervised> {
        let spec = self.cache_spec(args, run_dir);
        let Some(shared) = &self.shared else {
            return cache_server::start(&spec);
        };
        shared_cache::attach_or_start(&shared_cache::SharedSpec {
            serve: spec.serve,
            linger_s: shared.linger_s,
            job: &shared.job,
            job_label: run_dir.layout.job_label(),
            log: spec.log,
            start_timeout: spec.start_timeout,
            wanted_cap: Some(shared.wanted_cap),
        })
    }

    /// How this node's cache server is started (and restarted).
    fn cache_spec<'a>(
        &'a self,
        args: &'a Args,
        run_dir: &RunDir,
    ) -> cache_server::CacheServerSpec<'a> {
        cache_server::CacheServerSpec {
            serve: vrtspike_contract::cache_serve::CacheServe {
                vrtspike: &self.vrtspike,
                address: &self.cache_addr,
                config: &self.config,
                cap: args.cache_size.as_deref(),
                overrides: &args.set,
                lifetime: vrtspike_contract::cache_serve::Lifetime::WithParent,
            },
            log: run_dir.layout.cache_log(self.topology.node_rank),
            start_timeout: Duration::from_secs_f64(args.cache_start_timeout_s),
        }
    }
}

/// The attempt to start: its number (restart count) and rank 0's rendezvous port.
#[derive(Debug, Clone, Copy)]
struct AttemptPlan {
    restart_count: u32,
    master_port: u16,
}

/// One finished attempt, as the restart decision needs it.
struct Attempt {
    restart_count: u32,
    /// The step of the checkpoint it resumed from.
    resumed_step: Option<u64>,
    end: gang::AttemptEnd,
}

/// What follows an attempt.
enum Next {
    End(Ending),
    /// Another attempt; the failure's time measures the restart latency.
    Restart(Option<Instant>),
}

/// Links to the other nodes' launchers (multi-node jobs): node 0 listens on the
/// master address (port `--control-port`, else one the kernel picks, published in
/// the run dir with the job's secret); the others join it.
fn connect_peers(args: &Args, topology: &cluster::Topology, run_dir: &RunDir) -> Result<PeerLinks> {
    PeerLinks::start(&LinkSpec {
        node_rank: topology.node_rank,
        nnodes: topology.nnodes,
        master_addr: topology.master_addr.clone(),
        port: args.control_port,
        control_file: run_dir.layout.control_file(),
        secret: peers::auth::given_secret(std::env::var(peers::auth::SECRET_ENV).ok())?,
        timeout: Duration::from_secs_f64(args.peer_timeout_s),
    })
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

/// The failure report of something another node's launcher said.
fn peer_failure(event: &PeerEvent) -> Failure {
    let (node, cause, stuck) = match event {
        PeerEvent::Fail {
            node, cause, hung, ..
        } => (*node, cause.clone(), *hung),
        PeerEvent::Quit { node, cause } => (*node, cause.clone(), false),
        PeerEvent::Done { node } => (*node, "ended".to_string(), false),
        PeerEvent::Start { .. } => (0, "started an attempt".to_string(), false),
        PeerEvent::View(s) => (0, format!("told how rank {} stands", s.rank), false),
    };
    Failure {
        node,
        rank: None,
        process: format!("node {node}"),
        pid: 0,
        exit_code: None,
        signal: None,
        cause: format!("node {node}: {cause}"),
        log: String::new(),
        log_tail: Vec::new(),
        class: None,
        stuck,
    }
}

/// Prints one line of the launcher's real output; a closed stdout (e.g. piped into
/// `head`) must not stop the launcher, so write errors are ignored.
pub fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}

/// Where to look at the run once it ends: rank 0's TensorBoard events, the plot
/// (or how to draw it) and the summary.
fn where_to_look(run_dir: &Path, summary: &Path) -> Vec<String> {
    let mut lines = Vec::new();
    let tb = run_dir.join("tb");
    if tb.is_dir() {
        lines.push(format!(
            "tensorboard: {} (tensorboard --logdir {})",
            tb.display(),
            tb.display()
        ));
    }
    let plot = run_dir.join("plot.png");
    if plot.is_file() {
        lines.push(format!("plot: {}", plot.display()));
    } else {
        lines.push(format!("plot: vrtspike plot {}", run_dir.display()));
    }
    lines.push(format!("summary: {}", summary.display()));
    lines
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

/// A TCP port free right now (the ranks bind it moments later).
fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind(("0.0.0.0", 0)).context("finding a free port")?;
    Ok(listener.local_addr().context("finding a free port")?.port())
}

/// Marks the start of an attempt in a rank's log.
fn banner(log: &Path, restart_count: u32, resumed_from: Option<&str>) {
    use std::io::Write;
    if let Ok((mut file, _)) = vrtspike_contract::logfile::open_append(log) {
        let _ = writeln!(
            file,
            "=== vrtspike-launch: attempt {restart_count} at {} UTC, checkpoint: {} ===",
            vrtspike_contract::rundir::utc_stamp(SystemTime::now()),
            resumed_from.unwrap_or("none")
        );
    }
}

/// Sleeps, waking early on a signal the loop must handle.
fn interruptible_sleep(duration: Duration) {
    let until = Instant::now() + duration;
    while Instant::now() < until && signals::requested_ending().is_none() {
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_end_report_names_what_exists() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let summary = dir.path().join("summary.json");
        let lines = where_to_look(dir.path(), &summary);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].starts_with("plot: vrtspike plot "), "{lines:?}");
        std::fs::create_dir(dir.path().join("tb")).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(dir.path().join("plot.png"), b"png").unwrap_or_else(|e| panic!("{e}"));
        let lines = where_to_look(dir.path(), &summary);
        assert!(lines[0].starts_with("tensorboard: "), "{lines:?}");
        assert!(lines[1].ends_with("plot.png"), "{lines:?}");
        assert!(lines[2].ends_with("summary.json"), "{lines:?}");
    }
}
