//! End to end: the real `vrtspike-launch` with two real `vrtspike train` CPU ranks
//! where rank 1 sleeps inside its forward pass of step 5 in the first attempt (the
//! rank's test-only hook `VRTSPIKE_TEST_HANG_AT_STEP`, see `src/train/heartbeat.rs`).
//! The launcher must name rank 1 and its phase from the heartbeats, save both
//! ranks' stacks, stop the gang and restart it from the last checkpoint; the
//! second attempt completes. With no restart left, the job fails with the hang as
//! its cause.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{read_json, run_with_limit, synth_tiny, texts, write_tiny_config, TinyTrain};
use vrtspike_contract::heartbeat;
use vrtspike_contract::rundir::RunLayout;
use vrtspike_contract::summary::{RunSummary, TrainStatus};

const TOTAL_STEPS: u64 = 12;
const LIMIT: Duration = Duration::from_secs(120);
const HANG_CAUSE: &str = "hang: rank 1 in phase forward at step 5";

/// The tiny U-Net run on `data` with a checkpoint every 2 steps and a collective
/// timeout far above the hang timeout (so the hang is found, not timed out).
fn write_config(dir: &Path, data: &Path) -> PathBuf {
    let run = TinyTrain {
        total_steps: TOTAL_STEPS,
        ckpt_every: 2,
        timeout_s: 120,
    };
    write_tiny_config(dir, data, &run)
}

/// Runs the launcher with rank 1 hanging in its first attempt. Its PATH is empty:
/// gdb on a debug build of `vrtspike` takes half a minute on a busy machine, so
/// the launcher saves only the /proc part of the stacks here (the user-space part
/// is tested on a small process in `launcher/src/stacks.rs`).
fn launch_with_hang(config: &Path, run: &Path, max_restarts: &str) -> Output {
    let mut command = Command::new(common::launcher());
    command
        .arg("--config")
        .arg(config)
        .arg("--run-dir")
        .arg(run)
        .args([
            "--gpus",
            "0",
            "--ranks",
            "2",
            "--max-restarts",
            max_restarts,
        ])
        .args([
            "--hang-timeout-s",
            "3",
            "--grace-s",
            "2",
            "--restart-delay-s",
            "0",
        ])
        .args(["--cache-size", "64M"])
        .env("VRTSPIKE_TEST_HANG_AT_STEP", "5")
        .env("VRTSPIKE_TEST_HANG_RANK", "1")
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null());
    command.env("PATH", run.join("no-tools"));
    for (name, _) in std::env::vars().filter(|(name, _)| name.starts_with("SLURM_")) {
        command.env_remove(name);
    }
    run_with_limit(command, LIMIT)
}

/// Both ranks' stack files of attempt 0 exist, list threads, and say why there
/// are no user-space stacks.
fn assert_stacks_saved(run: &Path) {
    for rank in 0..2 {
        let path = heartbeat::stacks_path(run, 0, rank);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(text.contains(&format!("rank {rank}, pid")), "{text}");
        assert!(text.contains("thread ") && text.contains("wchan"), "{text}");
        assert!(text.contains("no user-space stacks"), "{text}");
    }
}

#[test]
fn a_hung_rank_is_named_its_stacks_saved_and_the_gang_restarts_to_the_end() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let config = write_config(tmp.path(), &synth_tiny(tmp.path()));
    let run = tmp.path().join("run");
    let layout = RunLayout::new(&run);
    let output = launch_with_hang(&config, &run, "1");
    let (stdout, stderr) = texts(&output);
    let context = format!(
        "stdout:\n{stdout}\nstderr:\n{stderr}\nrank 1:\n{}",
        std::fs::read_to_string(layout.rank_log(1)).unwrap_or_default()
    );
    assert!(output.status.success(), "{context}");
    assert!(
        stderr.contains("rank 1 has not moved for")
            && stderr.contains("in phase forward at step 5")
            && stderr.contains("waiting for it: rank 0 inside all_reduce #"),
        "the hung rank, its phase and the rank waiting for it are named: {context}"
    );
    assert_stacks_saved(&run);

    let summary = read_json(&layout.launcher_summary(0));
    assert_eq!(summary["exit"], "completed", "{summary}");
    assert_eq!(summary["restarts"], 1, "{summary}");
    let first = &summary["attempts"][0];
    let cause = first["failure"]["cause"].as_str().unwrap_or("");
    assert!(cause.starts_with(HANG_CAUSE), "{summary}");
    assert_eq!(first["failure"]["rank"], 1, "{summary}");
    assert_eq!(
        summary["attempts"][1]["resumed_from"], "step_00000004",
        "restarted from the checkpoint before the hang: {summary}"
    );
    let ranks = RunSummary::read(&layout.train_summary()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ranks.status, TrainStatus::Completed, "{ranks:?}");
    assert_eq!(ranks.steps, TOTAL_STEPS);
}

#[test]
fn a_hang_with_no_restart_left_fails_the_job_with_the_hang_as_cause() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let config = write_config(tmp.path(), &synth_tiny(tmp.path()));
    let run = tmp.path().join("run");
    let output = launch_with_hang(&config, &run, "0");
    let (stdout, stderr) = texts(&output);
    assert_eq!(
        output.status.code(),
        Some(1),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let summary = read_json(&RunLayout::new(&run).launcher_summary(0));
    assert_eq!(summary["exit"], "failed", "{summary}");
    let cause = summary["failure"]["cause"].as_str().unwrap_or("");
    assert!(cause.starts_with(HANG_CAUSE), "{summary}");
    let error = summary["error"].as_str().unwrap_or("");
    assert!(error.starts_with(HANG_CAUSE), "{summary}");
    assert_stacks_saved(&run);
}

/// Runs the launcher with rank 1 hanging inside its backward pass of step 5 in
/// the first attempt (`extra` environment picks where), no restart left, and a
/// collective timeout (30 s) well above the hang timeout.
fn launch_hung_in_backward(tmp: &Path, extra: &[(&str, &str)]) -> (Output, PathBuf) {
    let data = synth_tiny(tmp);
    let config = write_tiny_config(
        tmp,
        &data,
        &TinyTrain {
            total_steps: TOTAL_STEPS,
            ckpt_every: 2,
            timeout_s: 30,
        },
    );
    let run = tmp.join("run");
    let mut command = common::launcher_command(&config, &run);
    command
        .args(["--gpus", "0", "--ranks", "2", "--max-restarts", "0"])
        .args(["--hang-timeout-s", "3", "--grace-s", "2"])
        .args(["--cache-size", "64M"])
        .env("VRTSPIKE_TEST_HANG_AT_STEP", "5")
        .env("VRTSPIKE_TEST_HANG_RANK", "1")
        .env("VRTSPIKE_TEST_HANG_PHASE", "backward")
        .env("PATH", run.join("no-tools"));
    for (name, value) in extra {
        command.env(name, value);
    }
    (run_with_limit(command, LIMIT), run)
}

/// With the Reducer the whole backward pass is one collective, entered before any
/// gradient exists: rank 1 wedged inside it (ticking) and rank 0 waiting there for
/// its buckets look alike but for the buckets each launched. Rank 1 must be named
/// from them within the hang timeout; before, nobody was, and rank 0 timed out in
/// its collective and was blamed.
fn assert_rank_1_named_in_backward(output: &Output, run: &Path) {
    let (stdout, stderr) = texts(output);
    let layout = RunLayout::new(run);
    let context = format!(
        "stdout:\n{stdout}\nstderr:\n{stderr}\nrank 1:\n{}",
        std::fs::read_to_string(layout.rank_log(1)).unwrap_or_default()
    );
    assert_eq!(output.status.code(), Some(1), "{context}");
    let summary = read_json(&layout.launcher_summary(0));
    let failure = &summary["failure"];
    assert_eq!(
        failure["rank"], 1,
        "rank 1 is the cause: {summary}\n{context}"
    );
    let cause = failure["cause"].as_str().unwrap_or("");
    assert!(
        cause.starts_with("hang: rank 1 in phase backward at step 5, inside all_reduce #")
            && cause.ends_with("no gradient bucket launched"),
        "{cause}"
    );
    assert!(
        stderr.contains("waiting for it: rank 0 inside all_reduce #")
            && stderr.contains(" gradient bucket")
            && stderr.contains(" launched)"),
        "rank 0 is reported as waiting for rank 1's buckets: {context}"
    );
    assert!(
        !cause.contains("timed out"),
        "named before any collective timed out: {cause}"
    );
    assert_stacks_saved(run);
}

#[test]
fn a_rank_stalled_inside_backward_is_named_not_the_rank_waiting_for_it() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (output, run) = launch_hung_in_backward(tmp.path(), &[]);
    assert_rank_1_named_in_backward(&output, &run);
}

#[test]
fn a_rank_stalled_in_its_gradient_bucket_all_reduce_is_named() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    // Inside the Reducer's communication hook, about to launch its first bucket.
    let (output, run) = launch_hung_in_backward(tmp.path(), &[("VRTSPIKE_TEST_HANG_BUCKET", "0")]);
    assert_rank_1_named_in_backward(&output, &run);
}
