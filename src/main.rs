//! `vrtspike`: the per-node tools of the trainer: the cache server and its client
//! commands, benchmarks, the demo, the model tools, inference, training and the data
//! tools. One file per subcommand under `src/cli/`; the library does the work.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use vrtspike_contract::signals::{self, Disposition};

mod cli;

// SLURM sends a step's SIGUSR2 and SIGTERM to every process of the step: count
// them from before libtorch's constructors run, until `settle_job_signals` says
// what this subcommand does with them.
vrtspike_contract::count_job_signals_from_the_first_instruction!();

/// Spike-guided video deblurring trainer on libtorch.
#[derive(Parser)]
#[command(name = "vrtspike", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The node's shared-memory cache: serve, stats, shutdown.
    #[command(subcommand)]
    Cache(cli::cache::CacheCommand),
    /// Benchmarks that print one JSON object.
    #[command(subcommand)]
    Bench(cli::bench::BenchCommand),
    /// A cache server driven by a short synthetic load, then its stats (`make cache-demo`).
    Demo(cli::demo::DemoArgs),
    /// Versions and devices this binary sees (libtorch, CUDA, NCCL, cuDNN, NVML).
    Info(cli::info::InfoArgs),
    /// Config tools: the resolved config with the origin of every key.
    #[command(subcommand)]
    Config(cli::config::ConfigCommand),
    /// Memory plan of a config: cache, loader, model states, host total, warnings.
    Plan(cli::plan::PlanArgs),
    /// Model tools: parameter summary, running the model on a tensor file.
    #[command(subcommand)]
    Model(cli::model::ModelCommand),
    /// Forward/backward time per stage, parameters and memory of a model config.
    Profile(cli::profile::ProfileArgs),
    /// Deblur a dataset split by clips and tiles; PNGs and PSNR/SSIM per sequence.
    Infer(cli::infer::InferArgs),
    /// Train a model (one rank; started by vrtspike-launch, or alone).
    Train(cli::train::TrainArgs),
    /// Write a synthetic GoPro-Spike dataset (folder layout).
    Synth(cli::synth::SynthArgs),
    /// Write one frame's model inputs (blur, sharp, voxel) as safetensors.
    Inspect(cli::inspect::InspectArgs),
    /// One figure of a run: loss, PSNR, throughput, data wait, memory, restarts.
    Plot(cli::plot::PlotArgs),
    /// Where a run's time and memory go, and what to change.
    Analyze(cli::analyze::AnalyzeArgs),
    /// Reads HDF5 session files for a parent process, which a libhdf5 crash spares.
    #[command(name = "h5-probe", hide = true)]
    H5Probe(cli::h5_probe::H5ProbeArgs),
}

fn main() -> Result<()> {
    vrtspike::util::logging::init();
    let cli = Cli::parse();
    cli.command.settle_job_signals()?;
    if cli.command.only_prints() {
        restore_sigpipe();
    }
    if cli.command.runs_model() {
        let heap = vrtspike::util::heap::apply_from_env()?;
        tracing::debug!(?heap, "heap policy for tensor memory");
    }
    match cli.command {
        Command::Cache(cmd) => cli::cache::run(cmd, cli::cache::Where::WithoutLibtorch),
        Command::Bench(cmd) => cli::bench::run(cmd, cli::cache::Where::WithoutLibtorch),
        Command::Demo(args) => cli::demo::run(args),
        Command::Info(args) => cli::info::run(args),
        Command::Config(cmd) => cli::config::run(cmd),
        Command::Plan(args) => cli::plan::run(args),
        Command::Model(cmd) => cli::model::run(cmd),
        Command::Profile(args) => cli::profile::run(args),
        Command::Infer(args) => cli::infer::run(args),
        Command::Train(args) => cli::train::run(args),
        Command::Synth(args) => cli::synth::run(args),
        Command::Inspect(args) => cli::inspect::run(args),
        Command::Plot(args) => cli::plot::run(args),
        Command::Analyze(args) => cli::analyze::run(args),
        Command::H5Probe(args) => cli::h5_probe::run(args),
    }
}

impl Command {
    /// What this process does with the job's signals (`vrtspike_contract::signals`):
    /// a rank (`train`) counts SIGUSR2 and SIGTERM as its stop request; the cache
    /// server a launcher or rank started, the HDF5 probe child and a helper the
    /// launcher runs to its end (`VRTSPIKE_JOB_HELPER=1`: plan check, config
    /// facts, cache stats) ignore both; every other subcommand ignores SIGUSR2 (it
    /// may run inside a job) and keeps SIGTERM's default.
    fn settle_job_signals(&self) -> Result<()> {
        let helper = signals::is_job_helper(&|name| std::env::var(name).ok());
        let (usr2, term) = match self {
            Command::Train(_) => (Disposition::Count, Disposition::Count),
            Command::H5Probe(_) => (Disposition::Ignore, Disposition::Ignore),
            Command::Cache(cmd) if cmd.ignores_job_signals() => {
                (Disposition::Ignore, Disposition::Ignore)
            }
            _ if helper => (Disposition::Ignore, Disposition::Ignore),
            _ => (Disposition::Ignore, Disposition::Default),
        };
        signals::settle(usr2, term).context("setting up SIGUSR2 and SIGTERM")
    }

    /// Subcommands whose tensors are large: they pin the heap's mmap threshold so
    /// freed activations go back to the kernel, with huge pages for the faults
    /// (`vrtspike::util::heap`).
    fn runs_model(&self) -> bool {
        matches!(
            self,
            Command::Train(_) | Command::Profile(_) | Command::Infer(_) | Command::Model(_)
        ) || matches!(self, Command::Plan(args) if args.measures())
    }

    /// Subcommands that only read files and print: a closed pipe on their stdout
    /// (`vrtspike config show ... | head`) ends them quietly, as it ends `cat`.
    /// The others keep Rust's ignored SIGPIPE, so a peer's closed socket is an error
    /// they report, not a silent death.
    fn only_prints(&self) -> bool {
        matches!(
            self,
            Command::Info(_) | Command::Config(_) | Command::Analyze(_) | Command::Model(_)
        ) || matches!(self, Command::Plan(args) if !args.measures())
    }
}

/// Puts SIGPIPE back to its default action (Rust's runtime ignores it, which turns
/// a closed stdout into a panic inside `println!`).
fn restore_sigpipe() {
    use nix::sys::signal::{signal, SigHandler, Signal};
    // SAFETY: SIG_DFL installs no handler code (nothing to be async-signal-safe);
    // it only changes this process's disposition of SIGPIPE.
    if let Err(e) = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) } {
        tracing::debug!(error = %e, "SIGPIPE left ignored");
    }
}
