//! SLURM delivers a step's signal to every process of the step, not only to the
//! launcher. With two real `vrtspike train` ranks reading HDF5 sessions (each
//! through its `h5-probe` child) through the node's cache server, SIGUSR2 or
//! SIGTERM sent to every process of the launcher's tree (walked through /proc, the
//! way slurmstepd's process tracking reaches them), while the ranks train or while
//! they are still starting up, must end in a checkpoint, exit 0, a summary that
//! says `preempted`, and no process left. "Starting up" is checked, not assumed:
//! neither rank's heartbeat may be past `start` right after the signals went out
//! (phases only move forward, so none was when they did); a job that got past it
//! first is run again, up to [`STARTING_UP_TRIES`] times.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use vrtspike_contract::heartbeat::{self, Phase};
use vrtspike_contract::rundir::RunLayout;
use vrtspike_contract::summary::{RunSummary, TrainStatus};

use common::{
    cmdline, process_tree, signal, synth_tiny_h5, texts, trained_a_step, wait_until,
    write_tiny_config, TinyTrain,
};

const LIMIT: Duration = Duration::from_secs(180);
/// Jobs run at most to catch the ranks still starting up when the signals go out.
const STARTING_UP_TRIES: u32 = 3;

/// When the signal goes out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum When {
    /// After rank 0 logged a training step.
    Training,
    /// Once both ranks run, before either wrote a heartbeat past `start`.
    StartingUp,
}

/// The `vrtspike train` processes of a launcher's tree.
fn rank_processes(launcher: u32) -> Vec<u32> {
    process_tree(launcher)
        .into_iter()
        .filter(|pid| cmdline(*pid).contains(" train "))
        .collect()
}

/// Whether neither rank has got past its start (no heartbeat, or phase `start`).
fn still_starting(run: &Path) -> bool {
    (0..2).all(|rank| {
        heartbeat::read(run, rank)
            .ok()
            .flatten()
            .is_none_or(|beat| beat.progress.phase == Phase::Start)
    })
}

fn signal_every_process(sig: Signal, when: When) {
    for attempt in 1..=STARTING_UP_TRIES {
        let in_window = signal_every_process_once(sig, when);
        if in_window || when != When::StartingUp {
            return;
        }
        eprintln!("try {attempt}: a rank got past its start before the signals went out; again");
    }
    panic!(
        "in {STARTING_UP_TRIES} jobs the signals never went out while both ranks were \
         starting up: the test did not test that window"
    );
}

/// One job, signalled `when`; returns whether both ranks were still starting up
/// when the signals went out (see the module doc).
fn signal_every_process_once(sig: Signal, when: When) -> bool {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let data = synth_tiny_h5(tmp.path());
    let run = TinyTrain {
        total_steps: 400,
        ckpt_every: 1000,
        timeout_s: 60,
    };
    let config = write_tiny_config(tmp.path(), &data, &run);
    let run_dir = tmp.path().join("run");
    let layout = RunLayout::new(&run_dir);
    let launcher = common::preemptible_two_ranks(&config, &run_dir)
        .unwrap_or_else(|e| panic!("starting the launcher: {e}"));
    let pid = launcher.id();
    let ready = wait_until(LIMIT, || match when {
        When::Training => trained_a_step(&run_dir),
        When::StartingUp => rank_processes(pid).len() == 2,
    });
    assert!(ready, "the job never got to {when:?}");
    let mut tree = process_tree(pid);
    tree.push(pid);
    let names: Vec<String> = tree.iter().map(|p| cmdline(*p)).collect();
    let asked = Instant::now();
    for target in &tree {
        signal(*target, sig);
    }
    let starting = still_starting(&run_dir);
    let output = common::wait_with_limit(launcher, LIMIT);
    let exit_s = asked.elapsed().as_secs_f64();
    let (stdout, stderr) = texts(&output);
    let context = format!(
        "{sig} to {names:?}\nstdout:\n{stdout}\nstderr:\n{stderr}\nrank 1:\n{}",
        std::fs::read_to_string(layout.rank_log(1)).unwrap_or_default()
    );
    assert!(output.status.success(), "{context}");
    let summary = common::read_json(&layout.launcher_summary(0));
    assert_eq!(summary["exit"], "preempted", "{summary}\n{context}");
    assert!(summary["failure"].is_null(), "{summary}");
    let ranks = RunSummary::read(&layout.train_summary()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ranks.status, TrainStatus::Preempted, "{ranks:?}");
    let checkpoint = layout.latest_checkpoint().map(|c| c.step);
    assert_eq!(
        checkpoint,
        Some(ranks.steps),
        "a checkpoint at the step they stopped"
    );
    assert!(
        ranks.steps >= 1 && ranks.steps < run.total_steps,
        "{ranks:?}"
    );
    let left = common::left_behind(&tree, &names, Duration::from_secs(10));
    assert!(left.is_empty(), "left behind: {left:?}");
    let reached = |what: &str| names.iter().any(|n| n.contains(what));
    assert!(reached("cache serve"), "the cache server got it: {names:?}");
    if when == When::Training {
        assert!(
            reached("h5-probe"),
            "the ranks' h5-probe children got it: {names:?}"
        );
    }
    println!(
        "launch_job_signals: {sig} to {} processes ({when:?}{}) -> checkpoint at step {}, exit 0 in {exit_s:.2} s",
        tree.len(),
        if starting { ", no rank past start" } else { "" },
        ranks.steps
    );
    starting
}

#[test]
fn sigusr2_to_every_process_while_training_checkpoints_and_exits_0() {
    signal_every_process(Signal::SIGUSR2, When::Training);
}

#[test]
fn sigterm_to_every_process_while_training_stops_in_order() {
    signal_every_process(Signal::SIGTERM, When::Training);
}

#[test]
fn sigusr2_to_every_process_while_a_rank_starts_up() {
    signal_every_process(Signal::SIGUSR2, When::StartingUp);
}

#[test]
fn sigterm_to_every_process_while_a_rank_starts_up() {
    signal_every_process(Signal::SIGTERM, When::StartingUp);
}
