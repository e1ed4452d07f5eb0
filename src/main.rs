//! `vrtspike`: the per-node tools of the trainer: the cache server and its client
//! commands, benchmarks, and the demo. Each module brings its own subcommand.

use anyhow::Result;
use clap::{Parser, Subcommand};

mod cli;

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
    /// Versions and devices this binary sees (libtorch, CUDA).
    Info,
    /// Model tools: parameter summary, running the model on a tensor file.
    #[command(subcommand)]
    Model(vrtspike::model::cli::ModelCommand),
    /// Forward/backward time per stage, parameters and memory of a model config.
    Profile(vrtspike::model::cli::ProfileArgs),
    /// Deblur a dataset split by clips and tiles; PNGs and PSNR/SSIM per sequence.
    Infer(vrtspike::model::cli::InferArgs),
    /// Train a model (one rank; started by vrtspike-launch, or alone).
    Train(vrtspike::train::cli::TrainArgs),
    /// Write a synthetic GoPro-Spike dataset (folder layout).
    Synth(vrtspike::data::cli::SynthArgs),
    /// Write one frame's model inputs (blur, sharp, voxel) as safetensors.
    Inspect(vrtspike::data::cli::InspectArgs),
    /// One figure of a run: loss, PSNR, throughput, data wait, memory, restarts.
    Plot(cli::plot::PlotArgs),
    /// Where a run's time and memory go, and what to change.
    Analyze(cli::analyze::AnalyzeArgs),
}

fn main() -> Result<()> {
    vrtspike::util::logging::init();
    let cli = Cli::parse();
    match cli.command {
        Command::Cache(cmd) => cli::cache::run(cmd),
        Command::Bench(cmd) => cli::bench::run(cmd),
        Command::Demo(args) => cli::demo::run(args),
        Command::Info => cli::info(),
        Command::Model(cmd) => vrtspike::model::cli::run(cmd),
        Command::Profile(args) => vrtspike::model::cli::profile(args),
        Command::Infer(args) => vrtspike::model::cli::infer(args),
        Command::Train(args) => vrtspike::train::cli::run(args),
        Command::Synth(args) => vrtspike::data::cli::run_synth(args),
        Command::Inspect(args) => vrtspike::data::cli::run_inspect(args),
        Command::Plot(args) => cli::plot::run(args),
        Command::Analyze(args) => cli::analyze::run(args),
    }
}
