//! Gang supervision: one rank failing stops the others, a rank that ignores SIGTERM
//! is SIGKILLed after the grace period, a rank killed once is restarted from the last
//! checkpoint, and a crash loop is not restarted forever.

mod common;

use std::time::{Duration, Instant};

use common::{alive, texts, Job};

const LIMIT: Duration = Duration::from_secs(30);

#[test]
fn one_rank_failing_stops_the_gang() {
    // Rank 1 fails after a moment; rank 0 would run for a minute.
    let job = Job::new(
        r#"
if [ "$RANK" = 1 ]; then sleep 0.3; echo "rank 1 gives up: disk on fire"; exit 3; fi
i=0; while [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done
"#,
    );
    let started = Instant::now();
    let output = job.run(
        &["--gpus", "0", "--ranks", "2", "--max-restarts", "0"],
        LIMIT,
    );
    let elapsed = started.elapsed();
    let (stdout, stderr) = texts(&output);
    assert_eq!(
        output.status.code(),
        Some(1),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(elapsed < Duration::from_secs(15), "took {elapsed:?}");
    // The message names the rank, its exit code, and shows its last log lines.
    assert!(stderr.contains("rank 1 (pid"), "{stderr}");
    assert!(stderr.contains("exited with code 3"), "{stderr}");
    assert!(stderr.contains("rank 1 gives up: disk on fire"), "{stderr}");

    let summary = job.summary(0);
    assert_eq!(summary["exit"], "failed");
    assert_eq!(summary["exit_code"], 1);
    assert_eq!(summary["failure"]["rank"], 1);
    assert_eq!(summary["failure"]["exit_code"], 3);
    let tail = summary["failure"]["log_tail"].to_string();
    assert!(tail.contains("disk on fire"), "{summary}");
    let rank0 = job
        .rank_pid(0, 0)
        .unwrap_or_else(|| panic!("rank 0 never ran"));
    assert!(!alive(rank0), "rank 0 (pid {rank0}) survived the gang stop");
    println!(
        "launch_failures: fail-fast exit after {:.2} s",
        elapsed.as_secs_f64()
    );
}

#[test]
fn rank_ignoring_sigterm_is_killed_after_grace() {
    let job = Job::new(
        r#"
if [ "$RANK" = 1 ]; then sleep 0.3; exit 1; fi
trap 'echo "rank 0 got TERM and ignores it"' TERM
while :; do sleep 0.05; done
"#,
    );
    let started = Instant::now();
    let output = job.run(
        &[
            "--gpus",
            "0",
            "--ranks",
            "2",
            "--max-restarts",
            "0",
            "--grace-s",
            "1",
        ],
        LIMIT,
    );
    let elapsed = started.elapsed();
    let (stdout, stderr) = texts(&output);
    assert_eq!(
        output.status.code(),
        Some(1),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        job.rank_log(0).contains("rank 0 got TERM"),
        "{}",
        job.rank_log(0)
    );
    let summary = job.summary(0);
    assert_eq!(summary["failure"]["rank"], 1);
    assert_eq!(
        summary["attempts"][0]["killed_after_grace"],
        serde_json::json!(["rank 0"]),
        "{summary}"
    );
    assert!(stderr.contains("got SIGKILL"), "{stderr}");
    assert!(
        elapsed >= Duration::from_secs(1),
        "no grace period: {elapsed:?}"
    );
    let rank0 = job
        .rank_pid(0, 0)
        .unwrap_or_else(|| panic!("rank 0 never ran"));
    assert!(!alive(rank0));
}

#[test]
fn rank_killed_once_is_restarted_from_the_checkpoint() {
    // Attempt 0: rank 0 writes a checkpoint, then rank 1 dies by SIGKILL.
    // Attempt 1: every rank finishes.
    let job = Job::new(
        r#"
if [ "$VRTSPIKE_RESTART_COUNT" = 0 ]; then
  if [ "$RANK" = 0 ]; then
    mkdir -p "$VRTSPIKE_RUN_DIR/checkpoints/step_00000100"
    echo '{}' > "$VRTSPIKE_RUN_DIR/checkpoints/step_00000100/state.json"
  fi
  if [ "$RANK" = 1 ]; then sleep 0.3; kill -9 $$; fi
  while :; do sleep 0.05; done
fi
echo "rank $RANK resumed"
"#,
    );
    let output = job.run(
        &["--gpus", "0", "--ranks", "2", "--max-restarts", "2"],
        LIMIT,
    );
    let (stdout, stderr) = texts(&output);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("[rank0] rank 0 resumed"), "{stdout}");
    for rank in [0, 1] {
        assert_eq!(
            job.rank_env(rank, 1)
                .get("VRTSPIKE_RESTART_COUNT")
                .map(String::as_str),
            Some("1")
        );
    }
    let summary = job.summary(0);
    assert_eq!(summary["exit"], "completed");
    assert_eq!(summary["restarts"], 1);
    assert_eq!(summary["failure"]["rank"], 1);
    assert_eq!(summary["failure"]["signal"], "SIGKILL");
    let second = &summary["attempts"][1];
    assert_eq!(second["resumed_from"], "step_00000100");
    assert_eq!(second["outcome"], "completed");
    let latency = second["restart_latency_s"].as_f64().unwrap_or(f64::NAN);
    assert!(latency > 0.0 && latency < 5.0, "{summary}");
    println!("launch_failures: restart latency {latency:.3} s (failure seen -> ranks started)");
}

#[test]
fn crash_loop_is_not_restarted_forever() {
    let job = Job::new(r#"if [ "$RANK" = 0 ]; then exit 7; fi"#);
    let output = job.run(
        &["--gpus", "0", "--ranks", "1", "--max-restarts", "5"],
        LIMIT,
    );
    let (stdout, stderr) = texts(&output);
    assert_eq!(
        output.status.code(),
        Some(1),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let summary = job.summary(0);
    // One restart, then the same failure without a new checkpoint ends it.
    assert_eq!(summary["restarts"], 1, "{summary}");
    assert!(
        summary["error"]
            .as_str()
            .is_some_and(|e| e.contains("crash loop")),
        "{summary}"
    );
}
