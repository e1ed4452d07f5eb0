//! A stopped rank is named, not its victim. Two real `vrtspike train` CPU ranks;
//! rank 1 is stopped (SIGSTOP: alive, holding its sockets, doing nothing, as a rank
//! stuck in a driver call, a D-state read or a debugger looks) and rank 0 waits for
//! it in the all-reduce. The launcher must tell the two apart by the liveness tick
//! (rank 0 keeps ticking, rank 1 does not), name rank 1 with its phase, step and
//! collective, report rank 0 as waiting for it, save both ranks' stacks, restart
//! from the last checkpoint, all well before the collective timeout; and when the
//! collective timeout does fire first (every watch off), the rank that timed out is
//! still reported as waiting for the stopped one.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::Value;
use vrtspike_contract::heartbeat::{self, Phase};
use vrtspike_contract::rundir::RunLayout;

use common::{
    cmdline, launcher_command, process_tree, read_json, signal, synth_tiny, texts, wait_until,
    write_tiny_config, TinyTrain,
};

const TOTAL_STEPS: u64 = 12;
const LIMIT: Duration = Duration::from_secs(180);
/// The ranks' collective timeout: a verdict must come well before it.
const COLLECTIVE_TIMEOUT_S: u64 = 60;

struct Stopped {
    tmp: tempfile::TempDir,
    run: PathBuf,
}

impl Stopped {
    fn new(timeout_s: u64) -> (Stopped, PathBuf) {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let data = synth_tiny(tmp.path());
        let train = TinyTrain {
            total_steps: TOTAL_STEPS,
            ckpt_every: 2,
            timeout_s,
        };
        let config = write_tiny_config(tmp.path(), &data, &train);
        let run = tmp.path().join("run");
        (Stopped { tmp, run }, config)
    }

    fn layout(&self) -> RunLayout {
        RunLayout::new(&self.run)
    }

    /// The launcher on two CPU ranks with `extra` arguments. No stack tool on
    /// PATH: gdb on a debug build takes half a minute on a busy machine; the
    /// /proc part of the stacks is what these tests check.
    fn launcher(&self, config: &Path, extra: &[&str]) -> Command {
        let mut command = launcher_command(config, &self.run);
        command
            .args(["--gpus", "0", "--ranks", "2", "--grace-s", "2"])
            .args(["--restart-delay-s", "0", "--cache-size", "64M"])
            .args(extra)
            .env("PATH", self.tmp.path().join("no-tools"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command
    }

    fn context(&self, output: &Output) -> String {
        let (stdout, stderr) = texts(output);
        format!(
            "stdout:\n{stdout}\nstderr:\n{stderr}\nrank 1:\n{}",
            std::fs::read_to_string(self.layout().rank_log(1)).unwrap_or_default()
        )
    }

    fn summary(&self) -> Value {
        read_json(&self.layout().launcher_summary(0))
    }
}

/// Rank `rank`'s training process under the launcher `launcher` (its heartbeat
/// names its pid).
fn rank_pid(run: &Path, rank: u32, launcher: &Child) -> Option<u32> {
    let pid = heartbeat::read(run, rank).ok().flatten()?.pid;
    let ours = process_tree(launcher.id()).contains(&pid) && cmdline(pid).contains(" train ");
    ours.then_some(pid)
}

/// The stacks of attempt 0 of `ranks` were saved, each listing its threads.
fn assert_stacks_saved(run: &Path, ranks: &[u32]) {
    for &rank in ranks {
        let path = heartbeat::stacks_path(run, 0, rank);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(text.contains(&format!("rank {rank}, pid")), "{text}");
        assert!(text.contains("thread ") && text.contains("wchan"), "{text}");
    }
}

/// The first attempt's failure names rank 1 as stopped and the job restarted from
/// a checkpoint and completed.
fn assert_named_and_restarted(job: &Stopped, output: &Output) -> String {
    let context = job.context(output);
    assert!(output.status.success(), "{context}");
    let summary = job.summary();
    assert_eq!(summary["exit"], "completed", "{summary}");
    assert_eq!(summary["restarts"], 1, "{summary}");
    let failure = &summary["attempts"][0]["failure"];
    assert_eq!(
        failure["rank"], 1,
        "rank 1 is the cause, not rank 0: {summary}"
    );
    let cause = failure["cause"].as_str().unwrap_or("").to_string();
    assert!(
        cause.starts_with("stopped: rank 1 (node 0) in phase "),
        "{cause}"
    );
    assert!(cause.contains("no liveness tick for"), "{cause}");
    assert!(
        summary["attempts"][1]["resumed_from"]
            .as_str()
            .is_some_and(|c| c.starts_with("step_")),
        "restarted from a checkpoint: {summary}"
    );
    assert_stacks_saved(&job.run, &[0, 1]);
    cause
}

#[test]
fn a_rank_stopped_mid_step_is_named_before_the_collective_timeout() {
    let (job, config) = Stopped::new(COLLECTIVE_TIMEOUT_S);
    let mut launcher = job
        .launcher(&config, &["--max-restarts", "1", "--stall-timeout-s", "5"])
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    // After the first checkpoint, once rank 1 is inside a step.
    let layout = job.layout();
    let mid_step = wait_until(LIMIT, || {
        let beat = heartbeat::read(&job.run, 1).ok().flatten();
        layout.latest_checkpoint().is_some()
            && beat.is_some_and(|b| b.progress.phase >= Phase::Data && b.attempt == 0)
    });
    assert!(mid_step, "no step after a checkpoint");
    let pid = rank_pid(&job.run, 1, &launcher).unwrap_or_else(|| panic!("no rank 1 process"));
    signal(pid, Signal::SIGSTOP);
    let stopped_at = Instant::now();
    let stacks = heartbeat::stacks_path(&job.run, 0, 1);
    let named = wait_until(LIMIT, || {
        stacks.exists() || launcher.try_wait().ok().flatten().is_some()
    });
    let named_s = stopped_at.elapsed().as_secs_f64();
    let output = common::wait_with_limit(launcher, LIMIT);
    assert!(named, "{}", job.context(&output));
    let cause = assert_named_and_restarted(&job, &output);
    assert!(
        named_s < COLLECTIVE_TIMEOUT_S as f64 / 2.0,
        "named after {named_s:.1} s"
    );
    let (_, stderr) = texts(&output);
    assert!(
        stderr.contains("has not ticked for") && stderr.contains("process state T, stopped"),
        "{stderr}"
    );
    println!("launch_stopped: SIGSTOP of rank 1 mid-step -> named in {named_s:.1} s: {cause}");
}

#[test]
fn a_rank_stopped_inside_the_all_reduce_is_named_not_the_one_waiting_in_it() {
    let (job, config) = Stopped::new(COLLECTIVE_TIMEOUT_S);
    let mut command = job.launcher(&config, &["--max-restarts", "1", "--stall-timeout-s", "5"]);
    command
        .env("VRTSPIKE_TEST_HANG_AT_STEP", "5")
        .env("VRTSPIKE_TEST_HANG_RANK", "1")
        .env("VRTSPIKE_TEST_HANG_PHASE", "allreduce")
        .env("VRTSPIKE_TEST_HANG_HOW", "stop");
    let output = common::run_with_limit(command, LIMIT);
    let cause = assert_named_and_restarted(&job, &output);
    assert!(
        cause.contains("in phase allreduce at step 5, inside all_reduce #"),
        "{cause}"
    );
    let (_, stderr) = texts(&output);
    assert!(
        stderr.contains("waiting for it: rank 0 inside all_reduce #"),
        "{}",
        job.context(&output)
    );
    println!("launch_stopped: rank 1 stopped inside the all-reduce -> {cause}");
}

#[test]
fn a_rank_that_times_out_waiting_for_a_stopped_one_is_not_the_cause() {
    // Every watch off: rank 0's collective times out first (after 10 s).
    let (job, config) = Stopped::new(10);
    let mut command = job.launcher(
        &config,
        &[
            "--max-restarts",
            "0",
            "--stall-timeout-s",
            "0",
            "--hang-timeout-s",
            "0",
        ],
    );
    command
        .env("VRTSPIKE_TEST_HANG_AT_STEP", "3")
        .env("VRTSPIKE_TEST_HANG_RANK", "1")
        .env("VRTSPIKE_TEST_HANG_PHASE", "forward")
        .env("VRTSPIKE_TEST_HANG_HOW", "stop");
    let output = common::run_with_limit(command, LIMIT);
    let context = job.context(&output);
    assert_eq!(output.status.code(), Some(1), "{context}");
    let summary = job.summary();
    assert_eq!(summary["exit"], "failed", "{summary}");
    let failure = &summary["failure"];
    assert_eq!(failure["rank"], 1, "{summary}");
    let cause = failure["cause"].as_str().unwrap_or("");
    assert!(
        cause.starts_with("stopped: rank 1 (node 0) in phase forward at step 3"),
        "{cause}"
    );
    assert!(
        cause.contains("rank 0 (pid") && cause.ends_with("waiting for it"),
        "rank 0's time-out is reported as waiting for rank 1: {cause}"
    );
    // Rank 0 has exited by then; the stopped rank's stacks are what matter.
    assert_stacks_saved(&job.run, &[1]);
}
