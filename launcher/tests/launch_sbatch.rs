//! The sbatch template without SLURM: a fake `srun` (runs the launcher as a
//! one-node SLURM step, and like slurmstepd delivers a signal it gets to every
//! process of the step: launcher, cache server, ranks) and `scontrol` (records a
//! requeue) on PATH. SIGUSR2 to the batch script must reach every process, none
//! may die of it, and the preempted job must be requeued; SIGTERM stops the job in
//! order without a requeue.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;

use common::{fake_slurm, launcher, signal, texts, wait_until, Job};

/// Stand-in ranks that stop in order (a marker, exit 0) on SIGUSR2 or SIGTERM.
const STOPPABLE: &str = r#"
trap 'touch "$VRTSPIKE_RUN_DIR/checkpoints/preempt.rank$RANK"; exit 0' USR2 TERM
while :; do sleep 0.05; done
"#;

/// Runs the template on the stand-in ranks, sends the batch script `sig` once both
/// ranks run, and returns its output.
fn batch_job_signalled(job: &Job, sig: Signal) -> Output {
    let (_, path) = fake_slurm(job.tmp.path());
    let template = Path::new(env!("CARGO_MANIFEST_DIR")).join("slurm/vrtspike.sbatch");
    let mut command = Command::new("bash");
    command
        .arg(&template)
        .args(["--gpus", "0", "--ranks", "2", "--cache-size", "16M"])
        .arg("--rank-cmd")
        .arg(&job.rank_cmd)
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
    let ranks_up = wait_until(Duration::from_secs(30), || {
        job.rank_pid(0, 0).is_some() && job.rank_pid(1, 0).is_some()
    });
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

fn assert_stopped_in_order(job: &Job, output: &Output) {
    let (stdout, stderr) = texts(output);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(job.run_dir.join("checkpoints/preempt.rank0").exists());
    assert!(job.run_dir.join("checkpoints/preempt.rank1").exists());
    let summary = job.summary(0);
    assert_eq!(summary["exit"], "preempted", "{summary}");
    assert!(summary["failure"].is_null(), "no process died: {summary}");
}

#[test]
fn sbatch_template_survives_preemption_at_every_process_and_requeues() {
    let job = Job::new(STOPPABLE);
    let output = batch_job_signalled(&job, Signal::SIGUSR2);
    assert_stopped_in_order(&job, &output);
    let (stdout, _) = texts(&output);
    let requeue = std::fs::read_to_string(job.tmp.path().join("scontrol.called"))
        .unwrap_or_else(|e| panic!("scontrol was not called: {e}\n{stdout}"));
    assert_eq!(requeue.trim(), "requeue 77");
    // The cache server got the warning too and kept serving (it ignores it).
    let cache_log =
        std::fs::read_to_string(job.run_dir.join("logs/cache.node0.log")).unwrap_or_default();
    assert!(!cache_log.contains("panicked"), "{cache_log}");
    // Under SLURM the port is no longer 20000 + job id: a free one.
    let port = job.rank_env(0, 0).get("MASTER_PORT").cloned();
    assert!(port.is_some_and(|p| p != "20077"));
}

#[test]
fn sbatch_template_stops_in_order_on_sigterm_without_a_requeue() {
    let job = Job::new(STOPPABLE);
    let output = batch_job_signalled(&job, Signal::SIGTERM);
    assert_stopped_in_order(&job, &output);
    assert!(
        !job.tmp.path().join("scontrol.called").exists(),
        "scancel or the time limit is no preemption to requeue"
    );
}
