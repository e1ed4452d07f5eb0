//! The sbatch template without SLURM: a fake `srun` (runs the launcher as a
//! one-node SLURM step, and like slurmstepd delivers a signal it gets to every
//! process of the step: launcher, cache server, ranks) and `scontrol` (records a
//! requeue) on PATH. SIGUSR2 to the batch script must reach every process, none
//! may die of it, and the preempted job must be requeued; SIGTERM to the script
//! alone does the same through SIGUSR2 (a real srun turns SIGTERM into SIGKILL);
//! a job whose ranks completed before the warning could stop them is not requeued.
//! `launch_slurm_real` runs the template under a real one-node SLURM.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;

use common::{fake_slurm, launcher, signal, texts, wait_until, Job};

/// Stand-in ranks that stop in order on SIGUSR2 or SIGTERM: a marker naming the
/// signal that stopped them, exit 0.
const STOPPABLE: &str = r#"
stop() { echo "$1" > "$VRTSPIKE_RUN_DIR/checkpoints/preempt.rank$RANK"; exit 0; }
trap 'stop USR2' USR2
trap 'stop TERM' TERM
while :; do sleep 0.05; done
"#;

/// Stand-in ranks in their final validation: a stop request comes too late, rank 0
/// writes its summary (`completed`) and every rank exits 0.
const FINISHING: &str = r#"
done_() {
  if [ "$RANK" = 0 ]; then
    printf '{"status": "completed", "steps": 5, "total_steps": 5, "world_size": 2}\n' \
      > "$VRTSPIKE_RUN_DIR/train_summary.json"
  fi
  exit 0
}
trap done_ USR2 TERM
while :; do sleep 0.05; done
"#;

/// Runs the template on the stand-in ranks (with the launcher arguments `extra`),
/// sends the batch script `sig` once both ranks run, and returns its output.
fn batch_job_signalled(job: &Job, sig: Signal, extra: &[&str]) -> Output {
    let (_, path) = fake_slurm(job.tmp.path());
    let template = Path::new(env!("CARGO_MANIFEST_DIR")).join("slurm/vrtspike.sbatch");
    let mut command = Command::new("bash");
    command
        .arg(&template)
        .args(["--gpus", "0", "--ranks", "2", "--cache-size", "16M"])
        .arg("--rank-cmd")
        .arg(&job.rank_cmd)
        .args(extra)
        .current_dir(job.tmp.path())
        .env("PATH", path)
        .env("FAKE_SLURM_DIR", job.tmp.path())
        .env("CONFIG", &job.config)
        .env("LAUNCH", launcher())
        .env("RUN_DIR", &job.run_dir)
        .env("SLURM_JOB_ID", "77")
        .env("SLURM_NNODES", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, _) in
        std::env::vars().filter(|(n, _)| n.starts_with("SLURM_") && n != "SLURM_JOB_ID")
    {
        command.env_remove(name);
    }
    let mut script = command.spawn().unwrap_or_else(|e| panic!("{e}"));
    let ranks_up = job.two_ranks_started(Duration::from_secs(30));
    if !ranks_up {
        let _ = script.kill();
    }
    assert!(ranks_up, "the ranks never started");
    signal(script.id(), sig);
    let done = wait_until(Duration::from_secs(30), || {
        matches!(script.try_wait(), Ok(Some(_)))
    });
    if !done {
        let _ = script.kill();
    }
    let output = script.wait_with_output().unwrap_or_else(|e| panic!("{e}"));
    assert!(done, "the batch script did not end after {sig}");
    output
}

/// The ranks stopped in order on SIGUSR2, the job is `preempted` and was requeued.
fn assert_stopped_in_order_and_requeued(job: &Job, output: &Output) {
    let (stdout, stderr) = texts(output);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    for rank in 0..2 {
        let marker = job.run_dir.join(format!("checkpoints/preempt.rank{rank}"));
        let got = std::fs::read_to_string(&marker)
            .unwrap_or_else(|e| panic!("{}: {e}\n{stdout}\n{stderr}", marker.display()));
        assert_eq!(
            got.trim(),
            "USR2",
            "rank {rank} was stopped by SIGUSR2 only"
        );
    }
    let summary = job.summary(0);
    assert_eq!(summary["exit"], "preempted", "{summary}");
    assert!(summary["failure"].is_null(), "no process died: {summary}");
    let requeue = std::fs::read_to_string(job.tmp.path().join("scontrol.called"))
        .unwrap_or_else(|e| panic!("scontrol was not called: {e}\n{stdout}"));
    assert_eq!(requeue.trim(), "requeue 77");
}

#[test]
fn sbatch_template_survives_preemption_at_every_process_and_requeues() {
    let job = Job::new(STOPPABLE);
    let output = batch_job_signalled(&job, Signal::SIGUSR2, &[]);
    assert_stopped_in_order_and_requeued(&job, &output);
    // The cache server got the warning too and kept serving (it ignores it).
    let cache_log =
        std::fs::read_to_string(job.run_dir.join("logs/cache.node0.log")).unwrap_or_default();
    assert!(!cache_log.contains("panicked"), "{cache_log}");
    // Under SLURM the port is no longer 20000 + job id: a free one.
    let port = job.rank_env(0, 0).get("MASTER_PORT").cloned();
    assert!(port.is_some_and(|p| p != "20077"));
}

/// `scancel --signal=TERM --batch`: the script passes SIGUSR2, not SIGTERM, to srun
/// (a real srun answers SIGTERM with SIGKILL for the whole step).
#[test]
fn sbatch_template_checkpoints_and_requeues_on_sigterm_to_the_script() {
    let job = Job::new(STOPPABLE);
    let output = batch_job_signalled(&job, Signal::SIGTERM, &[]);
    assert_stopped_in_order_and_requeued(&job, &output);
}

/// A warning during the final validation: every rank completed, so the job is
/// `completed` and not requeued.
#[test]
fn sbatch_template_does_not_requeue_a_job_that_completed_under_a_warning() {
    let job = Job::new(FINISHING);
    let output = batch_job_signalled(&job, Signal::SIGUSR2, &[]);
    let (stdout, stderr) = texts(&output);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let summary = job.summary(0);
    assert_eq!(summary["exit"], "completed", "{summary}");
    assert!(
        !job.tmp.path().join("scontrol.called").exists(),
        "a completed job was requeued:\n{stdout}"
    );
}

/// The srun options the template used (the fake srun records them).
fn srun_options(job: &Job) -> Vec<String> {
    let path = job.tmp.path().join("srun.options");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines().map(str::to_string).collect()
}

/// Under `--min-nodes` the step survives a lost node (`srun --no-kill`, no
/// kill-on-bad-exit); without it one node's bad exit ends the step. Preemption
/// works the same either way.
#[test]
fn sbatch_template_runs_an_elastic_job_under_srun_no_kill() {
    let job = Job::new(STOPPABLE);
    let output = batch_job_signalled(&job, Signal::SIGUSR2, &["--min-nodes", "1"]);
    assert_stopped_in_order_and_requeued(&job, &output);
    let options = srun_options(&job);
    assert!(
        options.contains(&"--no-kill".to_string())
            && options.contains(&"--kill-on-bad-exit=0".to_string())
            && !options.contains(&"--kill-on-bad-exit=1".to_string()),
        "{options:?}"
    );
    let plain = Job::new(STOPPABLE);
    let output = batch_job_signalled(&plain, Signal::SIGUSR2, &[]);
    assert_stopped_in_order_and_requeued(&plain, &output);
    let options = srun_options(&plain);
    assert!(
        options.contains(&"--kill-on-bad-exit=1".to_string())
            && !options.contains(&"--no-kill".to_string()),
        "{options:?}"
    );
}
