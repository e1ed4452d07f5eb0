//! End to end: a real `vrtspike train` rank that runs out of memory (the rank's
//! test hook `VRTSPIKE_TEST_OOM=<phase>` makes libtorch refuse an allocation at that
//! phase, through the same path as a real out-of-memory) exits cleanly with the
//! contract's out-of-memory code and failure record; the launcher reports the
//! rank's own cause (stage, shape, what to change) and does not restart it,
//! although restarts are left.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{
    launcher_command, read_json, run_with_limit, synth_tiny, texts, write_tiny_config, TinyTrain,
};
use vrtspike_contract::failure::{FailureClass, RankFailure, EXIT_OUT_OF_MEMORY};
use vrtspike_contract::rundir::RunLayout;

const LIMIT: Duration = Duration::from_secs(120);

/// Launches one CPU rank on `config` with the out-of-memory hook at `phase`.
fn launch(config: &Path, run: &Path, phase: &str) -> Command {
    let mut command = launcher_command(config, run);
    command
        .args(["--gpus", "0", "--ranks", "1", "--max-restarts", "3"])
        .args(["--restart-delay-s", "0", "--cache-size", "64M"])
        .env("VRTSPIKE_TEST_OOM", phase);
    command
}

/// Runs the job with the hook at `phase`; checks what every out-of-memory ending
/// shares and returns the failure's cause.
fn run_out_of_memory(dir: &Path, data: &Path, phase: &str) -> String {
    let run_config = TinyTrain {
        total_steps: 2,
        ckpt_every: 1,
        timeout_s: 60,
    };
    let config = write_tiny_config(dir, data, &run_config);
    let run = dir.join(format!("run-{phase}"));
    let output = run_with_limit(launch(&config, &run, phase), LIMIT);
    let (stdout, stderr) = texts(&output);
    assert_eq!(output.status.code(), Some(1), "{stdout}\n{stderr}");
    let summary = read_json(&run.join("summary.json"));
    assert_eq!(summary["exit"], "failed", "{summary}");
    assert_eq!(summary["restarts"], 0, "not restarted: {summary}");
    let failure = &summary["failure"];
    assert_eq!(failure["class"], "out_of_memory", "{summary}");
    assert_eq!(failure["exit_code"], EXIT_OUT_OF_MEMORY, "{summary}");
    let error = summary["error"].as_str().unwrap_or_default();
    assert!(error.contains("would hit again"), "{error}");
    assert!(
        stderr.contains("rank failure cause: rank 0"),
        "the launcher prints the cause: {stderr}"
    );
    // The rank's own record, and a clean exit: one error line, no panic.
    let layout = RunLayout::new(&run);
    let record = RankFailure::read(&layout.rank_failure(0)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(record.class, FailureClass::OutOfMemory);
    let log = std::fs::read_to_string(layout.rank_log(0)).unwrap_or_default();
    assert!(log.contains("out of memory in"), "{log}");
    assert!(!log.contains("panicked"), "no panic: {log}");
    failure["cause"].as_str().unwrap_or_default().to_string()
}

#[test]
fn an_out_of_memory_rank_names_its_cause_and_is_not_restarted() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let data = synth_tiny(tmp.path());

    let cause = run_out_of_memory(tmp.path(), &data, "forward");
    for part in [
        "rank 0 (pid",
        "exited with code 12: out of memory in training forward at step 1",
        "on cpu, input (B, T, C, H, W) = [2, 2, 3, 32, 32]",
        "DATA.CROP_SIZE (now 32)",
        "TRAIN.BATCH_SIZE (now 2)",
        "MODEL.USE_CHECKPOINT_ATTN",
    ] {
        assert!(cause.contains(part), "{part:?} not in the cause: {cause}");
    }

    let cause = run_out_of_memory(tmp.path(), &data, "optimizer");
    assert!(
        cause.contains("out of memory in the optimizer update at step 1 on cpu: "),
        "{cause}"
    );

    let cause = run_out_of_memory(tmp.path(), &data, "validation");
    for part in [
        "out of memory in validation at step 2",
        "input (B, T, C, H, W) = [1, 2, 3, 64, 96]",
        "a smaller DATA.VAL_TILE (now 32",
    ] {
        assert!(cause.contains(part), "{part:?} not in the cause: {cause}");
    }
}
