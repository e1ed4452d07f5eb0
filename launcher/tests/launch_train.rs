//! End to end: the real `vrtspike-launch` with two real `vrtspike train` CPU ranks
//! on a tiny config and synthetic data. A preemption request (SIGUSR2 to the
//! launcher) makes the ranks checkpoint and exit 0; a second launch with the same
//! run directory resumes from that checkpoint and completes. Both sides are read
//! through the contract (`vrtspike_contract`): the layout, the latest checkpoint
//! and rank 0's typed run summary.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{
    launcher_command, read_json, run_with_limit, signal, synth_tiny, texts, trained_a_step,
    wait_until, write_tiny_config, TinyTrain,
};
use nix::sys::signal::Signal;
use vrtspike_contract::rundir::RunLayout;
use vrtspike_contract::summary::{RunSummary, TrainStatus};

const TOTAL_STEPS: u64 = 40;
const LIMIT: Duration = Duration::from_secs(90);

/// The tiny U-Net run of these tests on `data`.
fn write_config(dir: &Path, data: &Path) -> PathBuf {
    let run = TinyTrain {
        total_steps: TOTAL_STEPS,
        ckpt_every: 1000,
        timeout_s: 60,
    };
    write_tiny_config(dir, data, &run)
}

fn launch(config: &Path, run: &Path) -> Command {
    let mut command = launcher_command(config, run);
    command
        .args(["--gpus", "0", "--ranks", "2", "--max-restarts", "0"])
        .args(["--cache-size", "64M", "--preempt-timeout-s", "60"]);
    command
}

#[test]
fn preempted_real_ranks_checkpoint_and_a_relaunch_resumes_to_the_end() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let data = synth_tiny(tmp.path());
    let config = write_config(tmp.path(), &data);
    let run = tmp.path().join("run");
    let layout = RunLayout::new(&run);

    // Launch 1: SIGUSR2 to the launcher once a step is done.
    let mut first = launch(&config, &run)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting the launcher: {e}"));
    let started = wait_until(LIMIT, || {
        trained_a_step(&run) || first.try_wait().ok().flatten().is_some()
    });
    assert!(started, "no training step within {LIMIT:?}");
    signal(first.id(), Signal::SIGUSR2);
    let output = common::wait_with_limit(first, LIMIT);
    let (stdout, stderr) = texts(&output);
    assert!(
        output.status.success(),
        "launch 1: stdout:\n{stdout}\nstderr:\n{stderr}\nrank 0:\n{}",
        std::fs::read_to_string(layout.rank_log(0)).unwrap_or_default()
    );
    let launched = read_json(&layout.launcher_summary(0));
    assert_eq!(launched["exit"], "preempted", "{launched}");
    let ranks = RunSummary::read(&layout.train_summary()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ranks.status, TrainStatus::Preempted, "{ranks:?}");
    assert_eq!((ranks.world_size, ranks.total_steps), (2, TOTAL_STEPS));
    let stopped_at = ranks.steps;
    println!("launch_train: preempted at step {stopped_at} of {TOTAL_STEPS}");
    assert!(
        (1..TOTAL_STEPS).contains(&stopped_at),
        "preempted mid-run: {ranks:?}"
    );
    let checkpoint = layout
        .latest_checkpoint()
        .unwrap_or_else(|| panic!("no checkpoint after the preemption"));
    assert_eq!(checkpoint.step, stopped_at);

    // Launch 2: the same run directory resumes from that checkpoint and completes.
    let output = run_with_limit(launch(&config, &run), LIMIT);
    let (stdout, stderr) = texts(&output);
    assert!(
        output.status.success(),
        "launch 2: stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let launched = read_json(&layout.launcher_summary(0));
    assert_eq!(launched["exit"], "completed", "{launched}");
    assert_eq!(launched["attempts"][0]["resumed_from"], checkpoint.name());
    assert_eq!(
        launched["status"], "completed",
        "rank 0's summary merged in"
    );
    let ranks = RunSummary::read(&layout.train_summary()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ranks.status, TrainStatus::Completed, "{ranks:?}");
    assert_eq!(ranks.steps, TOTAL_STEPS);
    assert!(ranks.val_psnr.is_some_and(|p| p > 5.0), "{ranks:?}");
    assert_eq!(ranks.samples_seen, TOTAL_STEPS * 2 * 2, "2 ranks x batch 2");
    assert_eq!(
        layout.latest_checkpoint().map(|c| c.step),
        Some(TOTAL_STEPS)
    );
    // The second start began at the checkpoint's step, not from scratch.
    let starts = common::start_events(&layout);
    assert_eq!(starts.len(), 2, "{starts:?}");
    assert_eq!(starts[1]["step"], stopped_at);
    let resumed_from = starts[1]["resumed_from"].as_str().unwrap_or("");
    assert!(resumed_from.ends_with(&checkpoint.name()), "{resumed_from}");
}
