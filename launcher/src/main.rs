//! `vrtspike-launch`: runs a vrtspike training job on one node. It starts the
//! node's cache server, then one rank per GPU (or CPU ranks) with the torchrun
//! environment contract, supervises them as a gang (fail fast, restart from the last
//! checkpoint, preemption), and writes `summary.json` in the run directory at every
//! exit; the launchers of a multi-node job form one gang through links to node 0's
//! launcher. It does not link libtorch: it runs the `vrtspike` binary beside it.

mod args;
mod cache_server;
mod cluster;
mod echo;
mod env_contract;
mod gang;
mod hang;
mod job;
mod peers;
mod plan_check;
mod pss;
mod relay;
mod restart;
mod rundir;
mod shared_cache;
mod signals;
mod spawn;
mod stacks;
mod summary;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;

use args::Args;
use job::{say, Job};
use rundir::RunDir;
use summary::ExitKind;

// SLURM sends a step's SIGUSR2 and SIGTERM to every process of the step: count
// them from the first instruction (see `signals`).
vrtspike_contract::count_job_signals_from_the_first_instruction!();

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let args = Args::parse();
    if let Err(e) = signals::install(args.preempt_signal) {
        tracing::error!("{e:#}");
        return ExitCode::from(ExitKind::Error.exit_code());
    }
    let env = |name: &str| std::env::var(name).ok();
    let run_dir = match RunDir::create(args.run_dir.as_deref(), env("SLURM_JOB_ID").as_deref()) {
        Ok(run_dir) => run_dir,
        Err(e) => {
            tracing::error!("{e:#}");
            return ExitCode::from(ExitKind::Error.exit_code());
        }
    };
    say(&format!("run dir: {}", run_dir.path.display()));
    // A run dir without a checkpoint (e.g. made by the batch script) is a fresh start.
    if let Some(checkpoint) = run_dir.latest_checkpoint() {
        tracing::info!(
            "the run dir has a checkpoint: the ranks resume from {}",
            checkpoint.name()
        );
    }
    let mut job = Job::new(run_dir, &args);
    let result = job.run(&args);
    ExitCode::from(job.finish(result))
}
