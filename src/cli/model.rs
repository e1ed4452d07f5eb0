//! `vrtspike model summary` (parameters per part) and `vrtspike model run` (the
//! model on a safetensors tensor file, for debugging and comparing implementations).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use tch::{Device, Kind, Tensor};

use vrtspike::model::LoadedModel;

use super::{group_digits, parse_device};

/// `vrtspike model ...`
#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Parameters per stage and in total.
    Summary(SummaryArgs),
    /// Runs the model on a tensor file (`x`, and `voxels` with the spike branch) and
    /// writes `y` to a tensor file.
    Run(RunArgs),
}

/// `vrtspike model summary`
#[derive(Debug, Args)]
pub struct SummaryArgs {
    /// Run config (its `MODEL` section is used).
    #[arg(long)]
    pub config: PathBuf,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `vrtspike model run`
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Run config (its `MODEL` section is used).
    #[arg(long)]
    pub config: PathBuf,
    /// Model weights (safetensors, reference key names), loaded strictly.
    #[arg(long)]
    pub weights: PathBuf,
    /// Input safetensors with `x` (N, D, 3, H, W) and, for the spike branch, `voxels`.
    #[arg(long)]
    pub input: PathBuf,
    /// Output safetensors; holds `y` (N, D, 3, H, W), float32.
    #[arg(long)]
    pub output: PathBuf,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

/// Runs `vrtspike model ...`.
pub fn run(cmd: ModelCommand) -> Result<()> {
    match cmd {
        ModelCommand::Summary(args) => summary(args),
        ModelCommand::Run(args) => run_file(args),
    }
}

fn summary(args: SummaryArgs) -> Result<()> {
    let summary = LoadedModel::build(&args.config, Device::Cpu)?.summary();
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
        return Ok(());
    }
    println!("{} ({})", summary.arch, args.config.display());
    println!("{:<22} {:>14} {:>8}", "part", "parameters", "share");
    for part in &summary.parts {
        let share = 100.0 * part.params as f64 / summary.total_params.max(1) as f64;
        println!(
            "{:<22} {:>14} {:>7.2}%",
            part.label,
            group_digits(part.params),
            share
        );
    }
    println!("{:<22} {:>14}", "total", group_digits(summary.total_params));
    println!(
        "state_dict entries: {} ({} buffers)",
        summary.entries, summary.buffers
    );
    Ok(())
}

fn run_file(args: RunArgs) -> Result<()> {
    let device = parse_device(&args.device)?;
    let model = LoadedModel::with_weights(&args.config, &args.weights, device)?;
    let net = &model.net;
    let tensors = Tensor::read_safetensors(&args.input)
        .with_context(|| format!("reading {}", args.input.display()))?;
    let find = |name: &str| {
        tensors
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, t)| t.shallow_clone())
    };
    let x = find("x").with_context(|| format!("{}: no tensor named `x`", args.input.display()))?;
    let voxels = find("voxels");
    if net.uses_voxels() && voxels.is_none() {
        bail!(
            "{}: the spike branch is on but there is no tensor named `voxels`",
            args.input.display()
        );
    }
    let x = x.to_kind(Kind::Float).to_device(device);
    let voxels = voxels.map(|v| v.to_kind(Kind::Float).to_device(device));
    let start = Instant::now();
    let y = tch::no_grad(|| net.forward(&x, voxels.as_ref(), false))
        .with_context(|| format!("running the model on {}", args.input.display()))?;
    tracing::info!(seconds = start.elapsed().as_secs_f64(), shape = ?y.size(), "forward done");
    Tensor::write_safetensors(
        &[("y", y.to_device(Device::Cpu).contiguous())],
        &args.output,
    )
    .with_context(|| format!("writing {}", args.output.display()))?;
    Ok(())
}
