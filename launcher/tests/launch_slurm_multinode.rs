//! `launcher/slurm/vrtspike.sbatch` with `sbatch --nodes=2` under a real
//! three-node SLURM: Debian's slurmctld on a controller host and one slurmd on
//! each of three nodes, each host a set of Linux namespaces of its own (network on
//! a private subnet through a bridge, hostname, `/run` and `/dev/shm`:
//! `common/vhosts.rs`, `common/slurm_cluster.rs`), one launcher and one CPU rank
//! per node of the tiny U-Net on `vrtspike synth` data, submitted from a fresh
//! clone (`common/slurm_bench.rs`). srun labels the job's output with each node's
//! task number (`SLURM_LABELIO=1`), so a line of node 0's launcher starts `0: `.
//!
//! - completion;
//! - SIGUSR2 to every process (`scancel --signal=USR2 --full`): checkpoint,
//!   requeue, resume from that checkpoint, COMPLETED;
//!
//! each with no process, cache server socket or /dev/shm entry left on any node.
//! It prints the figures (signal to exit, requeue to resume).
//!
//! A lost node (issue 37): node 1's link cut and every process of its host killed
//! (its slurmd too: the node is dead) at step [`LOSS_STEP`], after the checkpoint
//! at [`LOSS_CHECKPOINT`], with SLURM's default `SlurmdTimeout` of 300 s. The
//! harness ([`lose_node`], [`watch`]) records when node 0's launcher first names
//! the lost node, and what SLURM and the survivor do:
//! - without `--min-nodes`, the job ends naming node 1 as lost (never rank 0,
//!   its victim) with a code of its own (75), and SLURM requeues it; it resumes
//!   from the checkpoint on the two nodes left and completes;
//! - with `--min-nodes 1` and `sbatch --no-kill`, node 0 goes on alone from the
//!   checkpoint and the job completes without a requeue (it leaves the queue once
//!   SLURM has declared the node dead: the step holds its task until then).
//!
//! It needs root, the packages `slurm-wlm` and `munge` (`make test` installs them),
//! and util-linux's `unshare` and `nsenter` and iproute2's `ip`: without them it
//! fails, unless it was built with `VRTSPIKE_SKIP_REAL_SLURM=1` (not under `CI`),
//! which marks it ignored.

mod common;
#[path = "common/slurm_bench.rs"]
mod slurm_bench;
#[path = "common/slurm_cluster.rs"]
mod slurm_cluster;
#[path = "common/vhosts.rs"]
mod vhosts;

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use serde_json::Value;
use vrtspike_contract::heartbeat;
use vrtspike_contract::rundir::{step_dir_name, RunLayout};

use common::{read_json, TinyTrain};
use slurm_bench::{
    events, is_final_state, unix_s, Bench, ClusterShape, JobShape, Stop, Submission,
};
use slurm_cluster::{MultiNode, DEFAULT_SLURMD_TIMEOUT_S};

/// Nodes of the cluster: the job's two, and one to spare.
const NODES: usize = 3;
/// The jobs: two nodes, one CPU rank each.
const JOB: JobShape = JobShape {
    nodes: 2,
    ranks_per_node: 1,
};
/// The checkpoint the lost-node cases wait for, and the step node 1 is lost at.
const LOSS_CHECKPOINT: u64 = 10;
const LOSS_STEP: u64 = 14;
/// Steps of a lost-node run.
const LOSS_TOTAL: u64 = 30;
/// `DIST.TIMEOUT_S` of a lost-node run (what the run had).
const LOSS_DIST_TIMEOUT_S: u64 = 120;
/// How long a node may stay silent before its peers call it lost: the launcher's
/// default (issue 37 item 1), plus a margin for the polls.
const PEER_SILENCE_S: f64 = 30.0;
const NAMING_MARGIN_S: f64 = 5.0;

/// One test of this file at a time: each runs a three-node SLURM of its own (four
/// hosts, five daemons and a training job) and times what it sees against SLURM's
/// and the launchers' timeouts, which two clusters at once on a CI machine of 2
/// cores would stretch.
fn one_cluster_at_a_time() -> MutexGuard<'static, ()> {
    static ONE: Mutex<()> = Mutex::new(());
    ONE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn cluster(slurmd_timeout_s: u64) -> ClusterShape {
    ClusterShape::VirtualHosts(MultiNode {
        nodes: NODES,
        slurmd_timeout_s,
    })
}

#[test]
#[cfg_attr(
    vrtspike_skip_real_slurm,
    ignore = "VRTSPIKE_SKIP_REAL_SLURM=1: needs root, slurm-wlm and munge"
)]
fn sbatch_template_on_a_real_three_node_slurm() {
    let _one = one_cluster_at_a_time();
    slurm_bench::run_suite(
        "launch_slurm_multinode",
        cluster(DEFAULT_SLURMD_TIMEOUT_S),
        JOB,
        &[Stop::Completes, Stop::Usr2ToEvery],
    );
}

/// A node of a running job, lost: its link cut, then every process of its host
/// killed.
struct Loss {
    /// The lost node's rank in the job, and its host.
    node_rank: u32,
    host: String,
    /// When the link was cut.
    at: Instant,
    at_wall: SystemTime,
    /// The step of the lost node's first rank, and the latest checkpoint, then.
    step: u64,
    checkpoint: u64,
    /// How much of the job's output was there before.
    output_offset: usize,
    /// What was killed.
    killed: Vec<(u32, String)>,
}

/// Waits until the checkpoint of step `checkpoint` exists and node `node_rank`'s
/// first rank is at step `step` or later, then cuts that node's link and kills
/// every process of its host.
fn lose_node(bench: &Bench, job: u32, node_rank: u32, checkpoint: u64, step: u64) -> Loss {
    let run_dir = bench.run_dir(job);
    let layout = RunLayout::new(&run_dir);
    let rank = node_rank * JOB.ranks_per_node;
    let mut seen = (0, 0);
    let what = format!("checkpoint {checkpoint} and rank {rank} at step {step}");
    let mut ended = false;
    bench.wait(job, &what, || {
        let latest = layout.latest_checkpoint().map_or(0, |c| c.step);
        let at = heartbeat::read(&run_dir, rank)
            .ok()
            .flatten()
            .map_or(0, |b| b.progress.step);
        seen = (at, latest);
        ended = bench
            .slurm
            .job(job)
            .is_some_and(|j| is_final_state(j.state()));
        (latest >= checkpoint && at >= step) || ended
    });
    assert!(
        !ended,
        "{}",
        bench.failure(job, &format!("job {job} ended before {what}"))
    );
    let host = bench
        .hosts_of(job)
        .get(node_rank as usize)
        .cloned()
        .unwrap_or_else(|| panic!("job {job} has no node {node_rank}"));
    let index = bench
        .slurm
        .node_names()
        .iter()
        .position(|n| *n == host)
        .unwrap_or_else(|| panic!("{host} is not a node of the cluster"));
    let hosts = bench
        .slurm
        .hosts()
        .unwrap_or_else(|| panic!("the cluster runs on virtual hosts"));
    let output_offset = bench.output(job).len();
    let (at, at_wall) = (Instant::now(), SystemTime::now());
    hosts
        .cut_link(index)
        .unwrap_or_else(|e| panic!("cutting {host}'s link: {e}"));
    let killed = hosts.kill_processes(index);
    Loss {
        node_rank,
        host,
        at,
        at_wall,
        step: seen.0,
        checkpoint: seen.1,
        output_offset,
        killed,
    }
}

/// What happened after a [`Loss`], in seconds after the cut.
#[derive(Debug, Default)]
struct Timeline {
    /// The first line of node 0's launcher that names the lost node (its node
    /// rank or its host), and the line.
    named: Option<(f64, String)>,
    /// Node 0's launcher's lines after the cut (not its ranks'), as first seen.
    survivor_lines: Vec<(f64, String)>,
    /// srun's and slurmstepd's lines after the cut.
    slurm_lines: Vec<(f64, String)>,
    /// SLURM shows the lost node as not responding (`*`), and as down.
    node_not_responding: Option<f64>,
    node_down: Option<f64>,
    /// Node 0's launcher wrote its summary.
    summary: Option<f64>,
    /// The ranks started again (a `start` event), with the world they started in.
    restarted: Option<(f64, u64)>,
    /// A training step past the checkpoint after that start.
    past_checkpoint: Option<f64>,
    /// SLURM requeued the job.
    requeued: Option<f64>,
    /// The job's states as they changed.
    job_states: Vec<(f64, String)>,
}

impl Timeline {
    fn print(&self, test: &str, loss: &Loss) {
        let show = |v: Option<f64>| v.map_or("-".to_string(), |s| format!("+{s:.1} s"));
        println!(
            "{test}: node {} ({}) cut at step {} (checkpoint {}), {} processes killed",
            loss.node_rank,
            loss.host,
            loss.step,
            loss.checkpoint,
            loss.killed.len()
        );
        println!(
            "{test}: named by node 0's launcher {}; node not responding {}, down {}; \
             summary {}; ranks restarted {} (world {}); past the checkpoint {}; requeued {}",
            self.named
                .as_ref()
                .map_or("never".to_string(), |(s, l)| format!("+{s:.1} s: {l}")),
            show(self.node_not_responding),
            show(self.node_down),
            show(self.summary),
            show(self.restarted.map(|(s, _)| s)),
            self.restarted
                .map_or("-".to_string(), |(_, w)| w.to_string()),
            show(self.past_checkpoint),
            show(self.requeued)
        );
        for (s, state) in &self.job_states {
            println!("{test}:   +{s:.1} s job {state}");
        }
        // Its log lines (what follows them, such as a rank log's tail, is in the
        // job's output).
        let log_lines = self
            .survivor_lines
            .iter()
            .filter(|(_, l)| l.starts_with(|c: char| c.is_ascii_digit()));
        for (s, line) in log_lines {
            println!("{test}:   +{s:.1} s launcher {line}");
        }
        for (s, line) in &self.slurm_lines {
            println!("{test}:   +{s:.1} s slurm {line}");
        }
    }
}

/// Whether a line of the job's output is node 0's launcher's own (labelled `0: `,
/// not a rank's `[rankN]` line).
fn survivor_launcher_line(line: &str) -> Option<&str> {
    let own = line.strip_prefix("0: ")?;
    (!own.starts_with("[rank")).then_some(own)
}

/// Polls the job after `loss` every 100 ms until `done` says so or `limit`
/// passes; what was seen.
fn watch(
    bench: &Bench,
    job: u32,
    loss: &Loss,
    limit: Duration,
    done: impl Fn(&Timeline) -> bool,
) -> Timeline {
    let mut timeline = Timeline::default();
    let layout = RunLayout::new(bench.run_dir(job));
    let summary = layout.launcher_summary(0);
    let cut_unix = unix_s(loss.at_wall);
    let node_name = format!("node {}", loss.node_rank);
    let mut read_to = loss.output_offset;
    while loss.at.elapsed() < limit && !done(&timeline) {
        let now = loss.at.elapsed().as_secs_f64();
        let output = bench.output(job);
        let complete = output[read_to..]
            .rfind('\n')
            .map_or(read_to, |i| read_to + i + 1);
        for line in output[read_to..complete].lines() {
            if let Some(own) = survivor_launcher_line(line) {
                if timeline.named.is_none()
                    && (own.contains(&node_name) || own.contains(&loss.host))
                {
                    timeline.named = Some((now, own.to_string()));
                }
                timeline.survivor_lines.push((now, own.to_string()));
            } else if line.starts_with("srun:") || line.starts_with("slurmstepd:") {
                timeline.slurm_lines.push((now, line.to_string()));
            }
        }
        read_to = complete;
        let node = bench.slurm.node_state(&loss.host);
        if timeline.node_not_responding.is_none() && node.ends_with('*') {
            timeline.node_not_responding = Some(now);
        }
        if timeline.node_down.is_none() && node.starts_with("down") {
            timeline.node_down = Some(now);
        }
        let written = std::fs::metadata(&summary)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t > loss.at_wall);
        if timeline.summary.is_none() && written {
            timeline.summary = Some(now);
        }
        if timeline.restarted.is_none() {
            timeline.restarted = events(&layout, "start")
                .iter()
                .find(|e| e["time"].as_f64().is_some_and(|t| t > cut_unix))
                .map(|e| (now, e["world_size"].as_u64().unwrap_or(0)));
        }
        if let (Some(_), None) = (timeline.restarted, timeline.past_checkpoint) {
            let trained = train_steps_after(&layout, cut_unix)
                .iter()
                .any(|&step| step > loss.checkpoint);
            timeline.past_checkpoint = trained.then_some(now);
        }
        if let Some(info) = bench.slurm.job(job) {
            if timeline.requeued.is_none() && info.restarts() >= 1 && info.restarts() != u32::MAX {
                timeline.requeued = Some(now);
            }
            let state = info.state().to_string();
            if timeline.job_states.last().map(|(_, s)| s) != Some(&state) {
                timeline.job_states.push((now, state));
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    timeline
}

/// The steps of the `train` lines written after `since` (Unix seconds).
fn train_steps_after(layout: &RunLayout, since: f64) -> Vec<u64> {
    std::fs::read_to_string(layout.metrics())
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "train" && v["time"].as_f64().is_some_and(|t| t > since))
        .filter_map(|v| v["step"].as_u64())
        .collect()
}

/// The exit code srun reported for node 0's launcher (`task 0: Exited with exit
/// code N`), if it did.
fn survivor_exit_code(output: &str) -> Option<i32> {
    output
        .lines()
        .filter(|l| l.starts_with("srun: error:") && l.contains("task 0: Exited with exit code"))
        .filter_map(|l| l.rsplit(' ').next())
        .find_map(|code| code.trim().parse().ok())
}

/// The lost-node run: checkpoints every [`LOSS_CHECKPOINT`] steps.
fn loss_submission(sbatch_args: &[&str], script_args: &[&str]) -> Submission {
    Submission {
        train: TinyTrain {
            total_steps: LOSS_TOTAL,
            ckpt_every: LOSS_CHECKPOINT,
            timeout_s: LOSS_DIST_TIMEOUT_S,
        },
        sbatch_args: sbatch_args.iter().map(|a| a.to_string()).collect(),
        script_args: script_args.iter().map(|a| a.to_string()).collect(),
    }
}

/// Submits the lost-node run and loses node 1 at [`LOSS_STEP`].
fn start_and_lose_node_1(bench: &Bench, submission: &Submission) -> (u32, Loss) {
    let job = bench.submit_job(submission);
    bench.wait(job, "leaving PENDING", || {
        bench.slurm.queue_state(job) != "PENDING"
    });
    let loss = lose_node(bench, job, 1, LOSS_CHECKPOINT, LOSS_STEP);
    (job, loss)
}

/// The naming every lost-node case expects: node 0's launcher named node 1 as
/// lost within the liveness timeout, before SLURM had noticed anything.
fn check_named(bench: &Bench, job: u32, loss: &Loss, timeline: &Timeline) {
    let context = || bench.failure(job, &format!("{timeline:#?}"));
    let (named_s, line) = timeline
        .named
        .clone()
        .unwrap_or_else(|| panic!("node 0's launcher never named node 1\n{}", context()));
    assert!(
        line.contains("lost") && line.contains(&loss.host),
        "named, but not as lost: {line}\n{}",
        context()
    );
    assert!(
        named_s <= PEER_SILENCE_S + NAMING_MARGIN_S,
        "named only after {named_s:.1} s\n{}",
        context()
    );
    assert!(
        timeline.node_not_responding.is_none_or(|s| s > named_s),
        "SLURM noticed first\n{}",
        context()
    );
}

#[test]
fn a_lost_node_ends_the_job_naming_it_and_slurm_requeues_it() {
    let _one = one_cluster_at_a_time();
    let test = "launch_slurm_multinode (lost node)";
    let Some(bench) = Bench::set_up(test, cluster(DEFAULT_SLURMD_TIMEOUT_S), JOB) else {
        return;
    };
    let before = bench.nodes_before();
    let (job, loss) = start_and_lose_node_1(&bench, &loss_submission(&[], &[]));
    // Until SLURM requeued the job (it may take until it declares the node dead).
    let limit = Duration::from_secs(DEFAULT_SLURMD_TIMEOUT_S + 180);
    let timeline = watch(&bench, job, &loss, limit, |t| t.requeued.is_some());
    timeline.print(test, &loss);
    check_named(&bench, job, &loss, &timeline);
    let context = || bench.failure(job, &format!("{timeline:#?}"));

    // The survivor stopped instead of training on short, naming node 1, its
    // rank 0 a victim, with a code of its own.
    assert!(
        timeline.restarted.is_none(),
        "restarted short\n{}",
        context()
    );
    let summary = bench.summary(job);
    let attempts = summary["attempts"].as_array().map_or(0, Vec::len);
    assert_eq!(attempts, 1, "no restart without node 1: {summary}");
    let failure = &summary["attempts"][0]["failure"];
    assert_eq!(failure["process"], "node 1", "{summary}\n{}", context());
    assert!(
        failure["cause"]
            .as_str()
            .is_some_and(|c| c.contains("lost") && c.contains(&loss.host)),
        "{summary}"
    );
    let code = survivor_exit_code(&bench.output(job));
    assert!(
        code.is_some_and(|c| c != 0 && c != 1),
        "node 0's launcher exited with {code:?}, not a code of its own\n{}",
        context()
    );
    assert!(timeline.requeued.is_some(), "never requeued\n{}", context());

    // The requeued job resumes from the checkpoint on the nodes left.
    bench.wait_for(job, "completed after the requeue", limit, || {
        bench
            .slurm
            .job(job)
            .is_some_and(|j| is_final_state(j.state()))
    });
    let summary = bench.check_job_completed(job, 1, LOSS_TOTAL);
    let hosts = bench.hosts_of(job);
    assert!(
        !hosts.contains(&loss.host),
        "ran on the lost node again: {hosts:?}"
    );
    assert_eq!(
        summary["attempts"][0]["resumed_from"],
        step_dir_name(loss.checkpoint),
        "{summary}"
    );
    bench.check_nothing_left(job, &before);
}

#[test]
fn a_lost_node_under_min_nodes_1_trains_on_to_completion_on_the_other() {
    let _one = one_cluster_at_a_time();
    let test = "launch_slurm_multinode (lost node, --min-nodes 1)";
    let Some(bench) = Bench::set_up(test, cluster(DEFAULT_SLURMD_TIMEOUT_S), JOB) else {
        return;
    };
    // The same run uninterrupted, for its final PSNR.
    let reference = bench.submit_job(&loss_submission(&[], &[]));
    bench.wait_gone(reference);
    let reference_psnr = result_psnr(&bench, reference);

    let before = bench.nodes_before();
    let submission = loss_submission(&["--no-kill"], &["--min-nodes", "1"]);
    let (job, loss) = start_and_lose_node_1(&bench, &submission);
    let limit = Duration::from_secs(DEFAULT_SLURMD_TIMEOUT_S);
    let timeline = watch(&bench, job, &loss, limit, |t| {
        t.past_checkpoint.is_some() && t.summary.is_some()
    });
    timeline.print(test, &loss);
    check_named(&bench, job, &loss, &timeline);
    let context = || bench.failure(job, &format!("{timeline:#?}"));

    // Node 0 went on alone from the checkpoint, with no requeue.
    assert_eq!(
        timeline.restarted.map(|(_, world)| world),
        Some(u64::from(JOB.ranks_per_node)),
        "{}",
        context()
    );
    // The step holds the lost node's task until SLURM declares the node dead
    // (`SlurmdTimeout`): only then can the job leave the queue.
    let declared_dead = Duration::from_secs(DEFAULT_SLURMD_TIMEOUT_S * 2);
    bench.wait_for(job, "leaving the queue", declared_dead, || {
        bench.slurm.queue_state(job).is_empty()
    });
    let summary = bench.check_job_completed(job, 0, LOSS_TOTAL);
    let attempts = summary["attempts"].as_array().cloned().unwrap_or_default();
    assert_eq!(attempts.len(), 2, "{summary}");
    assert_eq!(attempts[0]["failure"]["process"], "node 1", "{summary}");
    assert_eq!(
        attempts[1]["resumed_from"],
        step_dir_name(loss.checkpoint),
        "{summary}"
    );
    let changes = summary["membership_changes"].to_string();
    assert!(
        changes.contains(&loss.host),
        "the summary lists no membership change naming {}: {summary}",
        loss.host
    );
    let psnr = result_psnr(&bench, job);
    println!(
        "{test}: steps lost {}, training past the checkpoint {}, final PSNR {psnr:.2} dB \
         (uninterrupted {reference_psnr:.2} dB)",
        loss.step - loss.checkpoint,
        timeline
            .past_checkpoint
            .map_or("never".to_string(), |s| format!("+{s:.1} s"))
    );
    bench.check_nothing_left(job, &before);
}

/// The final validation PSNR of a job's run (`result.json`).
fn result_psnr(bench: &Bench, job: u32) -> f64 {
    let result = read_json(&RunLayout::new(bench.run_dir(job)).result());
    result["val_psnr"].as_f64().unwrap_or(f64::NAN)
}
