//! `launcher/slurm/vrtspike.sbatch` under a real SLURM (`common/slurm_cluster.rs`),
//! as the SLURM tests drive it: a fresh `git clone` of this repository (its
//! uncommitted changes applied) to submit from, the way a CPU-only user would
//! (`CONFIG=tiny.yaml sbatch --cpus-per-task=2 launcher/slurm/vrtspike.sbatch`, CPU
//! ranks of the tiny U-Net on `vrtspike synth` data), the ways a test stops a job
//! ([`Stop`]), and the checks of each ending: the job's state and restart count
//! from `scontrol show job`, the run's `summary.json`, the checkpoint resumed
//! from, and that no process of the job, no cache server socket and nothing new in
//! /dev/shm is left on any node. [`Figures`] are what a case measured.
//!
//! A test includes it beside `mod common;`, the cluster and the hosts' modules
//! (`#[path = "common/slurm_bench.rs"] mod slurm_bench;`).
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use vrtspike_contract::heartbeat::{self, Phase};
use vrtspike_contract::hostlist;
use vrtspike_contract::rundir::RunLayout;

use crate::common::{
    alive, cmdline, launcher, read_json, synth, synth_tiny, trained_a_step, vrtspike, wait_until,
    write_tiny_config, TinyTrain,
};
use crate::slurm_cluster::{self, processes_under, JobInfo, MultiNode, NodeView, SlurmCluster};

/// Steps of a run that a signal stops (it never gets there).
pub const LONG_RUN: u64 = 1_000_000;
/// Steps of the completion case.
pub const SHORT_RUN: u64 = 20;
/// Steps a resumed run does after its checkpoint.
pub const RESUME_STEPS: u64 = 10;
/// Steps of the final-validation case (validation on larger frames, ~2 s).
pub const VALIDATION_RUN: u64 = 10;
/// Limit of each wait: a hang guard, not a measurement.
pub const LIMIT: Duration = Duration::from_secs(240);

/// How the test stops a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Runs to its end.
    Completes,
    /// `scancel --signal=USR2 --batch`.
    Usr2ToBatch,
    /// `scancel --signal=USR2 --full`.
    Usr2ToEvery,
    /// `scancel`.
    Cancel,
    /// `--time=1 --signal=B:USR2@30`: SLURM's own warning.
    TimeLimit,
    /// `scancel --signal=TERM --batch`.
    TermToBatch,
    /// `scancel --signal=USR2 --batch` while rank 0 runs the final validation.
    Usr2InFinalValidation,
}

/// How a case must end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// COMPLETED without a requeue.
    Completed,
    /// Checkpointed, requeued, resumed, COMPLETED.
    Requeued,
    /// Checkpointed and CANCELLED.
    Cancelled,
}

impl Stop {
    fn scancel_args(self) -> Option<&'static [&'static str]> {
        match self {
            Stop::Completes | Stop::TimeLimit => None,
            Stop::Usr2ToBatch | Stop::Usr2InFinalValidation => Some(&["--signal=USR2", "--batch"]),
            Stop::Usr2ToEvery => Some(&["--signal=USR2", "--full"]),
            Stop::Cancel => Some(&[]),
            Stop::TermToBatch => Some(&["--signal=TERM", "--batch"]),
        }
    }

    fn sbatch_args(self) -> &'static [&'static str] {
        match self {
            Stop::TimeLimit => &["--time=1", "--signal=B:USR2@30"],
            _ => &[],
        }
    }

    fn steps(self) -> u64 {
        match self {
            Stop::Completes => SHORT_RUN,
            Stop::Usr2InFinalValidation => VALIDATION_RUN,
            _ => LONG_RUN,
        }
    }

    fn ending(self) -> Ending {
        match self {
            Stop::Completes | Stop::Usr2InFinalValidation => Ending::Completed,
            Stop::Cancel => Ending::Cancelled,
            _ => Ending::Requeued,
        }
    }
}

/// What a case measured, in seconds.
#[derive(Debug, Default)]
pub struct Figures {
    /// From the signal (the job's start for the time limit) to the launcher's summary.
    pub to_summary_s: Option<f64>,
    /// From the signal to the job leaving RUNNING (requeued or ended).
    pub to_not_running_s: Option<f64>,
    /// From the requeue (seen PENDING) to RUNNING again.
    pub requeue_to_running_s: Option<f64>,
    /// From the requeue to the resumed ranks' start (their `start` event).
    pub requeue_to_resumed_s: Option<f64>,
    /// The whole case.
    pub case_s: f64,
}

impl Figures {
    /// The figures as one line.
    pub fn line(&self) -> String {
        let show = |v: Option<f64>| v.map_or("-".to_string(), |s| format!("{s:.1} s"));
        format!(
            "signal -> summary {}, signal -> not running {}, requeue -> running {}, \
             requeue -> ranks resumed {}, case {:.1} s",
            show(self.to_summary_s),
            show(self.to_not_running_s),
            show(self.requeue_to_running_s),
            show(self.requeue_to_resumed_s),
            self.case_s
        )
    }
}

/// Which cluster a bench runs on.
#[derive(Debug, Clone, Copy)]
pub enum ClusterShape {
    /// [`SlurmCluster::one_node`].
    OneNode,
    /// [`SlurmCluster::on_virtual_hosts`].
    VirtualHosts(MultiNode),
}

/// The jobs a bench submits: nodes, and CPU ranks on each.
#[derive(Debug, Clone, Copy)]
pub struct JobShape {
    /// `sbatch --nodes`.
    pub nodes: u32,
    /// `RANKS` (the script's CPU ranks per node).
    pub ranks_per_node: u32,
}

/// One submission of the sbatch template.
#[derive(Debug, Clone)]
pub struct Submission {
    /// The run's config.
    pub train: TinyTrain,
    /// sbatch options before the script.
    pub sbatch_args: Vec<String>,
    /// Arguments after the script (the launcher's).
    pub script_args: Vec<String>,
}

impl Submission {
    /// What a [`Stop`] case submits.
    fn of(stop: Stop, val_data: &Path) -> Submission {
        let mut script_args = Vec::new();
        if stop == Stop::Usr2InFinalValidation {
            script_args.push(format!("--set=DATA.ROOT={}", val_data.display()));
        }
        Submission {
            train: Bench::train(stop.steps()),
            sbatch_args: stop.sbatch_args().iter().map(|a| a.to_string()).collect(),
            script_args,
        }
    }
}

/// The cluster, the clone the jobs are submitted from, and its data.
pub struct Bench {
    /// Dropped first: cancels the jobs and stops the daemons.
    pub slurm: SlurmCluster,
    pub clone: PathBuf,
    pub data: PathBuf,
    pub val_data: PathBuf,
    pub job: JobShape,
    _tmp: tempfile::TempDir,
}

/// Whether `state` (scontrol's JobState) is one a job ends in.
pub fn is_final_state(state: &str) -> bool {
    matches!(
        state,
        "COMPLETED"
            | "CANCELLED"
            | "FAILED"
            | "TIMEOUT"
            | "NODE_FAIL"
            | "PREEMPTED"
            | "BOOT_FAIL"
            | "DEADLINE"
            | "OUT_OF_MEMORY"
    )
}

/// What is on each node before a case (to compare with after it).
pub struct NodesBefore {
    shm: BTreeMap<String, BTreeSet<String>>,
}

impl Bench {
    /// The cluster up and a clone with its data, or `None` when the test may skip:
    /// without root or the packages it fails, unless `VRTSPIKE_SKIP_REAL_SLURM=1`
    /// (refused under `CI`) makes `test` say that it skipped.
    pub fn set_up(test: &str, cluster: ClusterShape, job: JobShape) -> Option<Bench> {
        let unavailable = match cluster {
            ClusterShape::OneNode => slurm_cluster::unavailable(),
            ClusterShape::VirtualHosts(_) => slurm_cluster::unavailable_on_virtual_hosts(),
        };
        if let Some(why) = unavailable {
            let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false");
            let skip = std::env::var("VRTSPIKE_SKIP_REAL_SLURM").is_ok_and(|v| v == "1");
            assert!(
                skip && !ci,
                "{test}: a real SLURM cannot run here: {why}. `make test` installs slurm-wlm \
                 and munge (as root); outside CI, VRTSPIKE_SKIP_REAL_SLURM=1 skips this test"
            );
            eprintln!("{test}: SKIPPED (VRTSPIKE_SKIP_REAL_SLURM=1): {why}");
            return None;
        }
        let _ = vrtspike();
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let clone = tmp.path().join("clone");
        fresh_clone(&clone);
        let data = synth_tiny(&clone);
        let val_data = synth_validation(&clone);
        let dir = tmp.path().join("slurm");
        let slurm = match cluster {
            ClusterShape::OneNode => SlurmCluster::one_node(&dir, &clone),
            ClusterShape::VirtualHosts(shape) => {
                SlurmCluster::on_virtual_hosts(&dir, &clone, shape)
            }
        };
        Some(Bench {
            slurm,
            clone,
            data,
            val_data,
            job,
            _tmp: tmp,
        })
    }

    /// The run of `total_steps` the cases submit (no checkpoint before the end).
    pub fn train(total_steps: u64) -> TinyTrain {
        TinyTrain {
            total_steps,
            ckpt_every: 1000,
            timeout_s: 60,
        }
    }

    fn write_config(&self, train: &TinyTrain) {
        write_tiny_config(&self.clone, &self.data, train);
    }

    /// `CONFIG=tiny.yaml RANKS=R sbatch --cpus-per-task=2 [--nodes=N]
    /// launcher/slurm/vrtspike.sbatch`, plus the submission's options; the job id.
    /// A job of several nodes runs srun with labelled output (`SLURM_LABELIO=1`):
    /// each launcher's and rank's line starts with its node's task number (`0: `).
    pub fn submit_job(&self, submission: &Submission) -> u32 {
        self.write_config(&submission.train);
        let cpus = self.slurm.cpus().min(2);
        let mut command = self.slurm.command("sbatch");
        command
            .current_dir(&self.clone)
            .env("CONFIG", "tiny.yaml")
            .env("LAUNCH", launcher())
            .env("RANKS", self.job.ranks_per_node.to_string())
            .arg("--parsable")
            .arg(format!("--cpus-per-task={cpus}"));
        if self.job.nodes > 1 {
            command
                .env("SLURM_LABELIO", "1")
                .arg(format!("--nodes={}", self.job.nodes));
        }
        command
            .args(&submission.sbatch_args)
            .arg("launcher/slurm/vrtspike.sbatch")
            .args(&submission.script_args);
        let stdout = slurm_cluster::stdout_of(command, "sbatch");
        stdout
            .trim()
            .split(';')
            .next()
            .and_then(|id| id.parse().ok())
            .unwrap_or_else(|| panic!("sbatch --parsable said {stdout:?}"))
    }

    /// The job's run directory (the script's default).
    pub fn run_dir(&self, job: u32) -> PathBuf {
        self.clone.join(format!("runs/slurm-{job}"))
    }

    /// The job's output file so far.
    pub fn output(&self, job: u32) -> String {
        std::fs::read_to_string(self.clone.join(format!("vrtspike-{job}.out"))).unwrap_or_default()
    }

    /// `scontrol show job`, or a panic when SLURM forgot the job.
    pub fn info(&self, job: u32) -> JobInfo {
        self.slurm
            .job(job)
            .unwrap_or_else(|| panic!("scontrol does not know job {job}"))
    }

    /// The hosts of the job, in node rank order (scontrol's `NodeList`).
    pub fn hosts_of(&self, job: u32) -> Vec<String> {
        let list = self.info(job).get("NodeList").to_string();
        hostlist::expand(&list).unwrap_or_else(|e| panic!("NodeList {list:?}: {e}"))
    }

    /// Waits until `condition` holds, or panics with the job's state, its output
    /// and the daemons' logs.
    pub fn wait(&self, job: u32, what: &str, condition: impl FnMut() -> bool) -> Instant {
        self.wait_for(job, what, LIMIT, condition)
    }

    /// [`Bench::wait`] with its own limit.
    pub fn wait_for(
        &self,
        job: u32,
        what: &str,
        limit: Duration,
        condition: impl FnMut() -> bool,
    ) -> Instant {
        if wait_until(limit, condition) {
            return Instant::now();
        }
        panic!(
            "{}",
            self.failure(job, &format!("job {job}: {what}: not within {limit:?}"))
        );
    }

    /// `what`, the job's state, the end of its output and the daemons' logs.
    pub fn failure(&self, job: u32, what: &str) -> String {
        let state = self.slurm.job(job).map(|j| j.brief()).unwrap_or_default();
        let output = self.output(job);
        let lines: Vec<&str> = output.lines().collect();
        let tail = lines[lines.len().saturating_sub(40)..].join("\n");
        let layout = RunLayout::new(self.run_dir(job));
        let mut caches = String::new();
        for node in 0..self.job.nodes {
            let path = layout.cache_log(node);
            let log = std::fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(10)..].join("\n");
            caches.push_str(&format!("--- {} (end) ---\n{tail}\n", path.display()));
        }
        format!(
            "{what}\nscontrol: {state}\nsinfo: {:?}\n--- vrtspike-{job}.out (end) ---\n{tail}\n{caches}{}",
            self.slurm.node_states(),
            self.slurm.logs()
        )
    }

    /// Node 0's launcher summary.
    pub fn summary(&self, job: u32) -> Value {
        read_json(&self.run_dir(job).join("summary.json"))
    }

    /// Sends the case's signal once the job is where the case wants it.
    fn signal(&self, job: u32, stop: Stop) -> Option<(Instant, SystemTime)> {
        let args = stop.scancel_args()?;
        let run_dir = self.run_dir(job);
        if stop == Stop::Usr2InFinalValidation {
            self.wait(job, "rank 0 in the final validation", || {
                heartbeat::read(&run_dir, 0)
                    .ok()
                    .flatten()
                    .is_some_and(|beat| {
                        beat.progress.step == VALIDATION_RUN
                            && beat.progress.phase == Phase::Validation
                    })
            });
        } else {
            self.wait(job, "a training step", || trained_a_step(&run_dir));
        }
        let at = (Instant::now(), SystemTime::now());
        let id = job.to_string();
        let mut all: Vec<&str> = args.to_vec();
        all.push(&id);
        self.slurm.run("scancel", &all);
        Some(at)
    }

    /// Submits a [`Stop`] case, stops it as the case says and checks its ending
    /// and that nothing is left; what it measured.
    pub fn run_case(&self, stop: Stop) -> Figures {
        let before = self.nodes_before();
        let started = Instant::now();
        let job = self.submit_job(&Submission::of(stop, &self.val_data));
        let mut figures = Figures::default();
        let running = self.wait(job, "leaving PENDING", || {
            self.slurm.queue_state(job) != "PENDING"
        });
        let started_running = SystemTime::now();
        let signalled = self.signal(job, stop);
        let first_run = self.processes_of_job(job);
        match stop.ending() {
            Ending::Completed => self.check_completed(job, stop),
            Ending::Cancelled => self.check_cancelled(job),
            Ending::Requeued => {
                let since = signalled.map_or((running, started_running), |s| s);
                self.check_requeued(job, stop, since, &first_run, &mut figures);
            }
        }
        if let (Some((at, wall)), Ending::Completed | Ending::Cancelled) =
            (signalled, stop.ending())
        {
            figures.to_summary_s = summary_after(&self.run_dir(job), wall);
            figures.to_not_running_s = Some(at.elapsed().as_secs_f64());
        }
        self.check_nothing_left(job, &before);
        figures.case_s = started.elapsed().as_secs_f64();
        figures
    }

    /// Waits until the job has left the queue.
    pub fn wait_gone(&self, job: u32) {
        self.wait(job, "leaving the queue", || {
            self.slurm.queue_state(job).is_empty()
        });
    }

    /// Waits until the job has left the queue, and checks that it COMPLETED
    /// (exit 0) after `restarts` requeues, and node 0's summary says it completed
    /// all `steps`; the summary.
    pub fn check_job_completed(&self, job: u32, restarts: u32, steps: u64) -> Value {
        self.wait_gone(job);
        let info = self.info(job);
        let context = || self.failure(job, "");
        assert_eq!(info.state(), "COMPLETED", "{}", context());
        assert_eq!(info.restarts(), restarts, "{}", context());
        assert_eq!(info.get("ExitCode"), "0:0", "{}", context());
        let summary = self.summary(job);
        assert_eq!(summary["exit"], "completed", "{summary}\n{}", context());
        assert_eq!(summary["status"], "completed", "{summary}");
        assert_eq!(summary["steps"], steps, "{summary}");
        summary
    }

    fn check_completed(&self, job: u32, stop: Stop) {
        let summary = self.check_job_completed(job, 0, stop.steps());
        let output = self.output(job);
        let context = || self.failure(job, "");
        assert_eq!(
            summary["world_size"],
            self.job.nodes * self.job.ranks_per_node,
            "{summary}"
        );
        assert!(
            summary["attempts"][0]["resumed_from"].is_null(),
            "{summary}"
        );
        self.check_every_node_completed(job);
        let layout = RunLayout::new(self.run_dir(job));
        assert_eq!(
            layout.latest_checkpoint().map(|c| c.step),
            Some(stop.steps())
        );
        if stop == Stop::Usr2InFinalValidation {
            // The warning reached the script and the launcher while the ranks ran.
            assert!(
                output.contains("vrtspike.sbatch: SIGUSR2: asking every process"),
                "{}",
                context()
            );
            assert!(output.contains("preemption requested"), "{}", context());
        }
        assert!(!output.contains("requeueing"), "{}", context());
    }

    /// The job ran on as many hosts as it asked for, and every node's launcher
    /// completed.
    fn check_every_node_completed(&self, job: u32) {
        let hosts = self.hosts_of(job);
        assert_eq!(hosts.len(), self.job.nodes as usize, "hosts {hosts:?}");
        let layout = RunLayout::new(self.run_dir(job));
        for node in 1..self.job.nodes {
            let summary = read_json(&layout.launcher_summary(node));
            assert_eq!(summary["exit"], "completed", "node {node}: {summary}");
        }
    }

    fn check_cancelled(&self, job: u32) {
        self.wait_gone(job);
        let info = self.info(job);
        let context = || self.failure(job, "");
        assert_eq!(info.state(), "CANCELLED", "{}", context());
        assert_eq!(info.restarts(), 0, "{}", context());
        let summary = self.summary(job);
        assert_eq!(summary["exit"], "preempted", "{summary}\n{}", context());
        assert!(summary["failure"].is_null(), "no process died: {summary}");
        let steps = summary["steps"].as_u64().unwrap_or(u64::MAX);
        let layout = RunLayout::new(self.run_dir(job));
        assert_eq!(layout.latest_checkpoint().map(|c| c.step), Some(steps));
        assert!(self.output(job).contains("not requeued"), "{}", context());
    }

    /// The first run checkpointed and the job was requeued; then the resumed run
    /// (made short: the config's total is rewritten while the job waits) completes.
    fn check_requeued(
        &self,
        job: u32,
        stop: Stop,
        (since, since_wall): (Instant, SystemTime),
        first_run: &[(u32, String)],
        figures: &mut Figures,
    ) {
        // Only a base state that ends a job counts as ended: squeue and scontrol
        // show a state flag in place of the base state while it is set (SIGNALING
        // while the time limit's warning goes out, REQUEUED, COMPLETING), and
        // taking SIGNALING for an end once passed this wait on a running job.
        let ended = |j: &JobInfo| is_final_state(j.state());
        let requeued = self.wait(job, "requeued", || {
            self.slurm
                .job(job)
                .is_some_and(|j| j.restarts() >= 1 || ended(&j))
        });
        let requeued_wall = SystemTime::now();
        figures.to_not_running_s = Some(requeued.duration_since(since).as_secs_f64());
        // COMPLETING (or REQUEUED) while the batch script ends, then PENDING.
        self.wait(job, "pending after the requeue", || {
            self.slurm
                .job(job)
                .is_some_and(|j| j.state() == "PENDING" || ended(&j))
        });
        let context = || self.failure(job, "");
        let info = self.info(job);
        assert_eq!(
            (info.state(), info.restarts()),
            ("PENDING", 1),
            "{}",
            context()
        );
        figures.to_summary_s = summary_after(&self.run_dir(job), since_wall);
        let summary = self.summary(job);
        assert_eq!(summary["exit"], "preempted", "{summary}\n{}", context());
        assert_eq!(summary["status"], "preempted", "{summary}");
        assert!(summary["failure"].is_null(), "no process died: {summary}");
        let steps = summary["steps"].as_u64().unwrap_or(u64::MAX);
        let layout = RunLayout::new(self.run_dir(job));
        let checkpoint = layout
            .latest_checkpoint()
            .unwrap_or_else(|| panic!("no checkpoint\n{}", context()));
        assert_eq!(checkpoint.step, steps, "{summary}");
        let output = self.output(job);
        assert!(
            output.contains(&format!("requeueing job {job}")),
            "{}",
            context()
        );
        if stop == Stop::TermToBatch {
            // srun got SIGUSR2, never the SIGTERM it would turn into SIGKILL.
            assert!(!output.contains("forcing job termination"), "{}", context());
        }
        if stop == Stop::TimeLimit {
            assert!(output.contains("vrtspike.sbatch: SIGUSR2"), "{}", context());
        }
        self.check_first_run_gone(job, first_run);

        // While the job waits: a short rest of the run (and, after the time limit,
        // time enough to finish it without another warning).
        self.write_config(&Bench::train(steps + RESUME_STEPS));
        if stop == Stop::TimeLimit {
            self.slurm.run(
                "scontrol",
                &["update", &format!("JobId={job}"), "TimeLimit=10"],
            );
        }
        assert_eq!(
            self.slurm.queue_state(job),
            "PENDING",
            "the requeued job started before the test shortened its run: raise cred_expire\n{}",
            context()
        );
        let resumed = self.wait(job, "running again", || {
            self.slurm.queue_state(job) != "PENDING"
        });
        figures.requeue_to_running_s = Some(resumed.duration_since(requeued).as_secs_f64());
        let summary = self.check_job_completed(job, 1, steps + RESUME_STEPS);
        assert_eq!(
            summary["attempts"][0]["resumed_from"],
            checkpoint.name(),
            "{summary}"
        );
        let starts = start_events(&layout);
        assert_eq!(starts.len(), 2, "{starts:?}");
        assert_eq!(starts[1]["step"], checkpoint.step, "{starts:?}");
        let resumed_at = starts[1]["time"].as_f64().unwrap_or(f64::NAN);
        figures.requeue_to_resumed_s = Some(resumed_at - unix_s(requeued_wall));
        let requeues = self.output(job).matches("requeueing job").count();
        assert_eq!(
            requeues,
            1,
            "the completed run was requeued again\n{}",
            context()
        );
    }

    /// The job's processes now, on every node: those working in the clone, and
    /// its step daemons.
    pub fn processes_of_job(&self, job: u32) -> Vec<(u32, String)> {
        let steps = format!("slurmstepd: [{job}.");
        processes_under(&self.clone)
            .into_iter()
            .chain(
                self.slurm
                    .step_daemons()
                    .into_iter()
                    .filter(|(_, line)| line.starts_with(&steps)),
            )
            .collect()
    }

    /// Every process of the first run is gone (before the requeued run starts new
    /// ones), and so is its cache servers' sockets.
    fn check_first_run_gone(&self, job: u32, first_run: &[(u32, String)]) {
        let gone = wait_until(Duration::from_secs(60), || {
            first_run
                .iter()
                .all(|(pid, line)| cmdline(*pid) != *line || !alive(*pid))
        });
        let left: Vec<&(u32, String)> = first_run
            .iter()
            .filter(|(pid, line)| alive(*pid) && cmdline(*pid) == *line)
            .collect();
        assert!(
            gone,
            "{}",
            self.failure(job, &format!("left by the first run: {left:?}"))
        );
        let sockets = self.live_sockets(&cache_addresses(&self.output(job)));
        assert!(sockets.is_empty(), "cache sockets left: {sockets:?}");
    }

    /// What each node's /dev/shm holds now.
    pub fn nodes_before(&self) -> NodesBefore {
        NodesBefore {
            shm: self
                .slurm
                .node_views()
                .iter()
                .map(|view| (view.name.clone(), dir_entries(&view.shm_dir)))
                .collect(),
        }
    }

    /// No process of the job on any node (nor anything else but the node's slurmd
    /// on a virtual node), no cache server socket, nothing new in any /dev/shm.
    pub fn check_nothing_left(&self, job: u32, before: &NodesBefore) {
        let gone = wait_until(Duration::from_secs(60), || {
            self.processes_of_job(job).is_empty() && self.slurm.strays_on_nodes().is_empty()
        });
        let left = self.processes_of_job(job);
        let strays = self.slurm.strays_on_nodes();
        assert!(
            gone,
            "{}",
            self.failure(
                job,
                &format!("processes left: {left:?}; on the nodes: {strays:?}")
            )
        );
        let addresses = cache_addresses(&self.output(job));
        assert!(
            !addresses.is_empty(),
            "{}",
            self.failure(job, "no cache server address logged")
        );
        let sockets = self.live_sockets(&addresses);
        assert!(sockets.is_empty(), "cache sockets left: {sockets:?}");
        for view in self.slurm.node_views() {
            let empty = BTreeSet::new();
            let was = before.shm.get(&view.name).unwrap_or(&empty);
            let new: Vec<String> = dir_entries(&view.shm_dir)
                .difference(was)
                .cloned()
                .collect();
            assert!(new.is_empty(), "left in /dev/shm of {}: {new:?}", view.name);
        }
    }

    /// Which of `addresses` are still bound abstract sockets on some node, as
    /// `node: address`.
    pub fn live_sockets(&self, addresses: &BTreeSet<String>) -> Vec<String> {
        self.slurm
            .node_views()
            .iter()
            .flat_map(|view| {
                bound_sockets(view, addresses)
                    .into_iter()
                    .map(|a| format!("{}: {a}", view.name))
            })
            .collect()
    }
}

/// A whole SLURM test: the cluster up (or the skip), then each case, their
/// figures printed; fails naming the cases that failed.
pub fn run_suite(test: &str, cluster: ClusterShape, job: JobShape, cases: &[Stop]) {
    let started = Instant::now();
    let Some(bench) = Bench::set_up(test, cluster, job) else {
        return;
    };
    println!(
        "{test}: SLURM up in {:.1} s ({cluster:?}; cred_expire={} s, sched_interval={} s)",
        started.elapsed().as_secs_f64(),
        slurm_cluster::CRED_EXPIRE_S,
        slurm_cluster::SCHED_INTERVAL_S
    );
    let failed = run_cases(test, &bench, cases);
    drop(bench);
    println!(
        "{test}: all cases in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert!(failed.is_empty(), "failed cases: {failed:?}");
}

/// Runs each case on `bench`, printing its figures (or that it failed: its panic
/// is printed above, and what it left is cleared before the next case); the cases
/// that failed.
pub fn run_cases(test: &str, bench: &Bench, cases: &[Stop]) -> Vec<Stop> {
    let mut failed = Vec::new();
    for &stop in cases {
        let result =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| bench.run_case(stop)));
        match result {
            Ok(figures) => println!("{test}: {stop:?}: {}", figures.line()),
            Err(_) => {
                println!("{test}: {stop:?}: FAILED (its panic is above)");
                failed.push(stop);
                let killed = bench.slurm.clear();
                assert!(killed.is_empty(), "left after {stop:?}: {killed:?}");
            }
        }
    }
    failed
}

/// A `git clone` of this repository into `dest`, with the uncommitted changes of
/// its tracked files applied (runs/ and data/ are not there, as in a fresh clone).
fn fresh_clone(dest: &Path) {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap_or_else(|| panic!("the launcher has a parent folder"));
    let status = Command::new("git")
        .args(["clone", "--quiet"])
        .arg(repo)
        .arg(dest)
        .status()
        .unwrap_or_else(|e| panic!("git clone: {e}"));
    assert!(status.success(), "git clone {}: {status}", repo.display());
    let diff = Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(["diff", "HEAD", "--binary"])
        .output()
        .unwrap_or_else(|e| panic!("git diff: {e}"));
    assert!(diff.status.success(), "git diff HEAD in {}", repo.display());
    if diff.stdout.is_empty() {
        return;
    }
    let mut apply = Command::new("git")
        .arg("-C")
        .arg(dest)
        .args(["apply", "--binary", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("git apply: {e}"));
    if let Some(mut stdin) = apply.stdin.take() {
        stdin
            .write_all(&diff.stdout)
            .unwrap_or_else(|e| panic!("git apply: {e}"));
    }
    let status = apply.wait().unwrap_or_else(|e| panic!("git apply: {e}"));
    assert!(
        status.success(),
        "git apply of the uncommitted changes: {status}"
    );
}

/// A dataset whose validation frames are large enough for a validation of ~2 s.
fn synth_validation(dir: &Path) -> PathBuf {
    let data = dir.join("data-val");
    synth(
        &data,
        &[
            "--seqs",
            "1",
            "--test-seqs",
            "1",
            "--frames",
            "8",
            "--height",
            "192",
            "--width",
            "256",
            "--seed",
            "9",
        ],
    );
    data
}

/// Seconds from `since` to the launcher's `summary.json` written after it.
pub fn summary_after(run_dir: &Path, since: SystemTime) -> Option<f64> {
    let modified = std::fs::metadata(run_dir.join("summary.json"))
        .and_then(|m| m.modified())
        .ok()?;
    modified.duration_since(since).ok().map(|d| d.as_secs_f64())
}

/// Seconds since the Unix epoch.
pub fn unix_s(time: SystemTime) -> f64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The ranks' events of the run (`metrics.jsonl`) whose `event` is `name`.
pub fn events(layout: &RunLayout, name: &str) -> Vec<Value> {
    std::fs::read_to_string(layout.metrics())
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == name)
        .collect()
}

/// The ranks' `start` events of the run (one per start of the ranks).
pub fn start_events(layout: &RunLayout) -> Vec<Value> {
    events(layout, "start")
}

/// The cache servers' addresses the job's launchers logged (`address="..."`).
pub fn cache_addresses(output: &str) -> BTreeSet<String> {
    output
        .split("address=\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .map(str::to_string)
        .collect()
}

/// Which of `addresses` are bound abstract sockets in the node's table.
fn bound_sockets(view: &NodeView, addresses: &BTreeSet<String>) -> Vec<String> {
    let table = std::fs::read_to_string(&view.unix_table).unwrap_or_default();
    let bound: BTreeSet<&str> = table
        .lines()
        .filter_map(|l| l.split_whitespace().nth(7))
        .filter_map(|path| path.strip_prefix('@'))
        .collect();
    addresses
        .iter()
        .filter(|a| bound.contains(a.as_str()))
        .cloned()
        .collect()
}

/// The names in `dir`.
fn dir_entries(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}
