//! Ranks that srun drives without a launcher (`srun --ntasks-per-node=2 vrtspike
//! train --config C`, one task per rank) under a fake `srun` (the tests' own, see
//! `common/fake_srun.py`): the ranks come from srun's variables, rank 0 publishes
//! its rendezvous port in the run directory (`runs/slurm-<job>`), local rank 0
//! starts the node's cache server and the other rank attaches; the job trains
//! through the cache to the end. SIGUSR2 to srun, which reaches every process of
//! the step, makes the ranks checkpoint and exit 0.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use vrtspike_contract::rundir::RunLayout;
use vrtspike_contract::summary::{RunSummary, TrainStatus};

use common::{
    fake_slurm, signal, synth_tiny, texts, trained_a_step, vrtspike, wait_until, write_tiny_config,
    TinyTrain,
};

const LIMIT: Duration = Duration::from_secs(180);
/// Each test its own job id: the job names the node's cache address (an abstract
/// socket, one namespace for the whole machine), and tests run at once.
const JOB: &str = "31337";
const JOB_SIGNALLED: &str = "31338";

/// The fake srun running two `vrtspike train` tasks of job `job` on `config` in `dir`.
fn srun(dir: &Path, config: &Path, job: &str) -> Command {
    let (_, path) = fake_slurm(dir);
    let mut command = Command::new("srun");
    command
        .arg("--ntasks-per-node=2")
        .arg(vrtspike())
        .args(["train", "--config"])
        .arg(config)
        .current_dir(dir)
        .env("PATH", path)
        .env("SLURM_JOB_ID", job)
        .env("OMP_NUM_THREADS", "1")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, _) in std::env::vars().filter(|(name, _)| {
        (name.starts_with("SLURM_") && name != "SLURM_JOB_ID")
            || name.starts_with("VRTSPIKE_")
            || name.starts_with("MASTER_")
            || name == "RANK"
            || name == "WORLD_SIZE"
    }) {
        command.env_remove(name);
    }
    command
}

fn tiny(dir: &Path, total_steps: u64) -> std::path::PathBuf {
    let data = synth_tiny(dir);
    let train = TinyTrain {
        total_steps,
        ckpt_every: 1000,
        timeout_s: 60,
    };
    write_tiny_config(dir, &data, &train)
}

#[test]
fn srun_tasks_train_through_the_node_cache_without_a_launcher() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let config = tiny(tmp.path(), 12);
    let output = common::run_with_limit(srun(tmp.path(), &config, JOB), LIMIT);
    let (stdout, stderr) = texts(&output);
    let layout = RunLayout::new(tmp.path().join(format!("runs/slurm-{JOB}")));
    let cache_log = std::fs::read_to_string(layout.cache_log(0))
        .unwrap_or_else(|e| format!("(no cache log: {e})"));
    let context = format!("stdout:\n{stdout}\nstderr:\n{stderr}\ncache server log:\n{cache_log}");
    assert!(output.status.success(), "{context}");
    let ranks = RunSummary::read(&layout.train_summary()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((ranks.status, ranks.steps), (TrainStatus::Completed, 12));
    assert_eq!(ranks.world_size, 2);
    let hit_rate = ranks.cache_hit_rate.unwrap_or(0.0);
    assert!(hit_rate > 0.5, "through the cache: {ranks:?}");
    assert!(!context.contains("no cache server"), "{context}");
    // Rank 0's port, published for the other ranks (not derived from the job id).
    let port = std::fs::read_to_string(layout.rendezvous_port(&format!("slurm-{JOB}.0-r0")))
        .unwrap_or_else(|e| panic!("no published port: {e}\n{context}"));
    assert!(port.trim().parse::<u16>().is_ok_and(|p| p > 0), "{port}");
    assert!(layout.cache_log(0).is_file());
    println!(
        "launch_srun: 2 srun tasks, port {} published, cache hit rate {hit_rate:.2}",
        port.trim()
    );
}

#[test]
fn sigusr2_to_srun_reaches_every_task_and_they_checkpoint() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let config = tiny(tmp.path(), 400);
    let child = srun(tmp.path(), &config, JOB_SIGNALLED)
        .spawn()
        .unwrap_or_else(|e| panic!("starting srun: {e}"));
    let run = tmp.path().join(format!("runs/slurm-{JOB_SIGNALLED}"));
    assert!(
        wait_until(LIMIT, || trained_a_step(&run)),
        "no training step"
    );
    let asked = Instant::now();
    signal(child.id(), Signal::SIGUSR2);
    let output = common::wait_with_limit(child, LIMIT);
    let exit_s = asked.elapsed().as_secs_f64();
    let (stdout, stderr) = texts(&output);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let layout = RunLayout::new(&run);
    let ranks = RunSummary::read(&layout.train_summary()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ranks.status, TrainStatus::Preempted, "{ranks:?}");
    assert_eq!(
        layout.latest_checkpoint().map(|c| c.step),
        Some(ranks.steps)
    );
    println!(
        "launch_srun: SIGUSR2 to srun -> checkpoint at step {}, exit 0 in {exit_s:.2} s",
        ranks.steps
    );
}
