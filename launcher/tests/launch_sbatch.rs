//! The sbatch template without SLURM: fake `srun` (runs the launcher as a one-node
//! SLURM step) and `scontrol` (records a requeue) on PATH. SIGUSR2 to the batch
//! script must reach the ranks through the launcher, and a preempted job must be
//! requeued.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;

use common::{launcher, signal, texts, wait_until, Job};

const FAKE_SRUN: &str = r#"#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in --*) shift ;; *) break ;; esac; done
export SLURM_PROCID=0 SLURM_NODEID=0 SLURM_LOCALID=0 SLURM_NTASKS=1 SLURM_NODELIST=localhost
exec "$@"
"#;

const FAKE_SCONTROL: &str = r#"#!/bin/sh
echo "$@" > "$FAKE_SLURM_DIR/scontrol.called"
"#;

fn write_exe(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap_or_else(|e| panic!("{e}"));
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn sbatch_template_forwards_preemption_and_requeues() {
    let job = Job::new(
        r#"
trap 'touch "$VRTSPIKE_RUN_DIR/checkpoints/preempt.rank$RANK"; exit 0' USR2
while :; do sleep 0.05; done
"#,
    );
    let bin = job.tmp.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap_or_else(|e| panic!("{e}"));
    write_exe(&bin.join("srun"), FAKE_SRUN);
    write_exe(&bin.join("scontrol"), FAKE_SCONTROL);
    let template = Path::new(env!("CARGO_MANIFEST_DIR")).join("slurm/vrtspike.sbatch");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut command = Command::new("bash");
    command
        .arg(&template)
        .args([
            "--gpus",
            "0",
            "--ranks",
            "2",
            "--cache-size",
            "16M",
            "--rank-cmd",
        ])
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
    let ranks_up = wait_until(Duration::from_secs(20), || {
        job.rank_pid(0, 0).is_some() && job.rank_pid(1, 0).is_some()
    });
    if !ranks_up {
        let _ = script.kill();
    }
    assert!(ranks_up, "the ranks never started");
    signal(script.id(), Signal::SIGUSR2);
    let done = wait_until(Duration::from_secs(20), || {
        matches!(script.try_wait(), Ok(Some(_)))
    });
    if !done {
        let _ = script.kill();
    }
    let output = script.wait_with_output().unwrap_or_else(|e| panic!("{e}"));
    let (stdout, stderr) = texts(&output);
    assert!(
        done && output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(job.run_dir.join("checkpoints/preempt.rank0").exists());
    assert!(job.run_dir.join("checkpoints/preempt.rank1").exists());
    assert_eq!(job.summary(0)["exit"], "preempted");
    let requeue = std::fs::read_to_string(job.tmp.path().join("scontrol.called"))
        .unwrap_or_else(|e| panic!("scontrol was not called: {e}\n{stdout}"));
    assert_eq!(requeue.trim(), "requeue 77");
    // Under SLURM the port comes from the job id.
    assert_eq!(
        job.rank_env(0, 0).get("MASTER_PORT").map(String::as_str),
        Some("20077")
    );
}
