//! Signals to the launcher: `kill -9` leaves no process and no shared memory behind
//! (parent-death signals), and a preemption request (SIGUSR2, or SIGTERM) reaches
//! the ranks, which checkpoint and exit 0, and the launcher exits 0 as "preempted".

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use common::{alive, children_of, shmem_mb, signal, texts, wait_until, Job};

/// Ranks that run until told to stop; on SIGUSR2 they write a checkpoint marker
/// and exit 0.
const PREEMPTIBLE: &str = r#"
trap 'echo "rank $RANK preempted"; touch "$VRTSPIKE_RUN_DIR/checkpoints/preempt.rank$RANK"; exit 0' USR2
while :; do sleep 0.05; done
"#;

#[test]
fn kill_9_of_the_launcher_leaves_nothing() {
    const CAP_MB: f64 = 128.0;
    let job = Job::new("while :; do sleep 0.05; done");
    let shmem_before = shmem_mb();
    let mut command = job.command(&["--gpus", "0", "--ranks", "2"]);
    let cap = format!("{}M", CAP_MB as u32);
    command.args(["--cache-size", &cap]);
    let mut launcher = command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    let ranks_up = job.two_ranks_started(Duration::from_secs(20));
    assert!(ranks_up, "the ranks never started");
    let children = children_of(launcher.id());
    assert_eq!(children.len(), 3, "cache server + 2 ranks: {children:?}");
    let shmem_running = shmem_mb();

    launcher.kill().unwrap_or_else(|e| panic!("{e}")); // SIGKILL
    let killed_at = Instant::now();
    let _ = launcher.wait();
    let all_gone = wait_until(Duration::from_secs(5), || {
        !children.iter().any(|&p| alive(p))
    });
    let procs_gone_s = killed_at.elapsed().as_secs_f64();
    assert!(
        all_gone,
        "still alive 5 s after kill -9: {:?}",
        children.iter().filter(|&&p| alive(p)).collect::<Vec<_>>()
    );
    // The cache's memfd goes with its last process. Its pages are reserved only as
    // records arrive (none here: the ranks are scripts), so check that nothing near
    // the cap's size is left above the level before the job; other jobs on the machine
    // move Shmem too.
    let freed = wait_until(Duration::from_secs(5), || {
        shmem_mb() - shmem_before < 0.5 * CAP_MB
    });
    let shmem_after = shmem_mb();
    assert!(
        freed,
        "Shmem: {shmem_before:.0} MiB before, {shmem_running:.0} running, {shmem_after:.0} after kill -9"
    );
    println!(
        "launch_signals: kill -9 -> no process in {procs_gone_s:.3} s, shared memory freed in {:.3} s (Shmem {shmem_before:.0} -> {shmem_running:.0} -> {shmem_after:.0} MiB)",
        killed_at.elapsed().as_secs_f64()
    );
}

fn preempt_with(sig: Signal) {
    let job = Job::new(PREEMPTIBLE);
    let mut launcher = job
        .command(&["--gpus", "0", "--ranks", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    let ranks_up = job.two_ranks_started(Duration::from_secs(20));
    assert!(ranks_up, "the ranks never started");
    let asked = Instant::now();
    signal(launcher.id(), sig);
    let exited = wait_until(Duration::from_secs(15), || {
        matches!(launcher.try_wait(), Ok(Some(_)))
    });
    let preempt_s = asked.elapsed().as_secs_f64();
    if !exited {
        let _ = launcher.kill();
    }
    let output = launcher
        .wait_with_output()
        .unwrap_or_else(|e| panic!("{e}"));
    let (stdout, stderr) = texts(&output);
    assert!(
        exited,
        "the launcher did not exit after {sig}; stderr:\n{stderr}"
    );
    assert!(
        output.status.success(),
        "{sig}: stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    for rank in [0, 1] {
        let marker = job.run_dir.join(format!("checkpoints/preempt.rank{rank}"));
        assert!(marker.exists(), "rank {rank} did not checkpoint on {sig}");
    }
    assert!(stdout.contains("[rank0] rank 0 preempted"), "{stdout}");
    let summary = job.summary(0);
    assert_eq!(summary["exit"], "preempted", "{summary}");
    assert_eq!(summary["exit_code"], 0);
    assert_eq!(summary["restarts"], 0);
    println!("launch_signals: {sig} -> launcher exit 0 in {preempt_s:.3} s");
}

#[test]
fn sigusr2_preempts_the_job() {
    preempt_with(Signal::SIGUSR2);
}

#[test]
fn sigterm_preempts_the_job() {
    preempt_with(Signal::SIGTERM);
}

#[test]
fn sigint_interrupts_the_job() {
    let job = Job::new("while :; do sleep 0.05; done");
    let mut launcher = job
        .command(&["--gpus", "0", "--ranks", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(wait_until(Duration::from_secs(20), || job
        .rank_pid(0, 0)
        .is_some()));
    let rank0 = job.rank_pid(0, 0).unwrap_or(0);
    signal(launcher.id(), Signal::SIGINT);
    let status = launcher.wait().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(status.code(), Some(130));
    assert!(!alive(rank0));
    assert_eq!(job.summary(0)["exit"], "interrupted");
}

/// How a preempted job ended: the launcher's exit code, its summary and its log
/// (stderr).
struct Preempted {
    code: Option<i32>,
    summary: serde_json::Value,
    log: String,
}

/// Starts a 2-rank job running `body`, sends the launcher SIGUSR2 once both ranks
/// run, and returns how it ended.
fn preempt_job(body: &str, extra: &[&str]) -> Preempted {
    let job = Job::new(body);
    let mut args = vec!["--gpus", "0", "--ranks", "2", "--grace-s", "1"];
    args.extend_from_slice(extra);
    let mut launcher = job
        .command(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::from(
            std::fs::File::create(job.tmp.path().join("launcher.stderr"))
                .unwrap_or_else(|e| panic!("{e}")),
        ))
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    let ranks_up = job.two_ranks_started(Duration::from_secs(20));
    assert!(ranks_up, "the ranks never started");
    signal(launcher.id(), Signal::SIGUSR2);
    let exited = wait_until(Duration::from_secs(15), || {
        matches!(launcher.try_wait(), Ok(Some(_)))
    });
    if !exited {
        let _ = launcher.kill();
    }
    let status = launcher.wait().unwrap_or_else(|e| panic!("{e}"));
    assert!(exited, "the launcher did not exit");
    Preempted {
        code: status.code(),
        summary: job.summary(0),
        log: std::fs::read_to_string(job.tmp.path().join("launcher.stderr")).unwrap_or_default(),
    }
}

#[test]
fn rank_failing_its_preemption_checkpoint_fails_the_job() {
    let Preempted { code, summary, .. } = preempt_job(
        r#"
if [ "$RANK" = 1 ]; then trap 'echo "checkpoint write failed"; exit 4' USR2; else trap 'exit 0' USR2; fi
while :; do sleep 0.05; done
"#,
        &["--max-restarts", "3"],
    );
    assert_eq!(code, Some(1), "{summary}");
    assert_eq!(summary["exit"], "failed");
    assert_eq!(
        summary["restarts"], 0,
        "no restart after a preemption request"
    );
    assert_eq!(summary["failure"]["exit_code"], 4);
    let error = summary["error"].as_str().unwrap_or("");
    assert!(
        error.contains("rank 1") && error.contains("preemption"),
        "{summary}"
    );
}

#[test]
fn ranks_ignoring_preemption_fail_after_the_timeout() {
    let Preempted { code, summary, log } = preempt_job(
        "trap '' USR2; while :; do sleep 0.05; done",
        &["--preempt-timeout-s", "1"],
    );
    // Said once, and the SIGKILL names what the ranks ignored, and for how long.
    assert_eq!(
        log.matches("did not checkpoint and exit").count(),
        1,
        "{log}"
    );
    assert!(
        log.contains("ignored the preemption request for 1.0 s and got SIGKILL"),
        "{log}"
    );
    assert_eq!(code, Some(1), "{summary}");
    assert_eq!(summary["exit"], "failed");
    let error = summary["error"].as_str().unwrap_or("");
    assert!(
        error.contains("within 1 s of the preemption request"),
        "{summary}"
    );
}
