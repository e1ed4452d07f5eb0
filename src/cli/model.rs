//! The model tools of the `vrtspike` binary: `model summary` (parameters per part),
//! `model run` (the model on a safetensors tensor file, for debugging and comparing
//! implementations) and `profile` (forward/backward time per stage, share, memory).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde::Serialize;
use tch::{nn, Device, Kind, Tensor};

use super::{build, load_safetensors, summarize, Restorer};
use crate::config::{Config, ModelConfig};

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

/// `vrtspike profile`
#[derive(Debug, Args)]
pub struct ProfileArgs {
    /// Run config (its `MODEL` section is used).
    #[arg(long)]
    pub config: PathBuf,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Clips per batch.
    #[arg(long, default_value_t = 1)]
    pub batch: i64,
    /// Frames per clip.
    #[arg(long, default_value_t = 6)]
    pub frames: i64,
    /// Square crop side in RGB pixels.
    #[arg(long, default_value_t = 256)]
    pub size: i64,
    /// Spike voxel side over the RGB side (GoPro-Spike: 0.5).
    #[arg(long, default_value_t = 0.5)]
    pub spike_scale: f64,
    /// Timed iterations (after one warm-up).
    #[arg(long, default_value_t = 3)]
    pub iters: usize,
    /// Forward only (no backward pass).
    #[arg(long)]
    pub no_backward: bool,
    /// Run in bfloat16 (weights and inputs cast; the trainer's AMP is close to this).
    #[arg(long)]
    pub bf16: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `vrtspike infer`
#[derive(Debug, Args)]
pub struct InferArgs {
    /// Weights: a checkpoint directory (`runs/<run>/checkpoints/step_N`), a run
    /// directory (its newest checkpoint) or a `.safetensors` file.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Run config the checkpoint was trained with (its `MODEL` and `DATA` sections;
    /// checkpoints do not record it).
    #[arg(long)]
    pub config: PathBuf,
    /// Dataset root in the folder layout (or HDF5 sessions).
    #[arg(long)]
    pub input: PathBuf,
    /// Split folder under the root.
    #[arg(long, default_value = "test")]
    pub split: String,
    /// Output root: `<out>/<SEQ>/<FRAME>.png`.
    #[arg(long)]
    pub out: PathBuf,
    /// Frames per temporal clip.
    #[arg(long, default_value_t = 18)]
    pub clip: usize,
    /// Frames shared by consecutive clips.
    #[arg(long, default_value_t = 2)]
    pub clip_overlap: usize,
    /// Spatial tile side, RGB pixels.
    #[arg(long, default_value_t = 192)]
    pub tile: i64,
    /// Pixels shared by neighbouring tiles.
    #[arg(long, default_value_t = 20)]
    pub tile_overlap: i64,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Parses `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(i)) => Ok(Device::Cuda(i)),
            _ => bail!("--device {other:?}: expected cpu, cuda or cuda:N"),
        },
    }
}

fn load_model_config(path: &std::path::Path) -> Result<ModelConfig> {
    Ok(Config::load(path)?.model)
}

fn build_model(
    vs: &nn::VarStore,
    cfg: &ModelConfig,
    path: &std::path::Path,
) -> Result<Box<dyn Restorer>> {
    build(&vs.root(), cfg).with_context(|| format!("building the model of {}", path.display()))
}

/// Runs `vrtspike model ...`.
pub fn run(cmd: ModelCommand) -> Result<()> {
    match cmd {
        ModelCommand::Summary(args) => summary(args),
        ModelCommand::Run(args) => run_file(args),
    }
}

fn summary(args: SummaryArgs) -> Result<()> {
    let cfg = load_model_config(&args.config)?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = tch::no_grad(|| build_model(&vs, &cfg, &args.config))?;
    let summary = summarize(&vs, net.arch(), &net.parts());
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
    let cfg = load_model_config(&args.config)?;
    let vs = nn::VarStore::new(device);
    let net = build_model(&vs, &cfg, &args.config)?;
    load_safetensors(&vs, &args.weights)?;
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

/// One row of the profile table.
#[derive(Debug, Serialize)]
struct ProfileRow {
    part: String,
    forward_ms: f64,
    share: f64,
    params: i64,
}

/// The whole profile.
#[derive(Debug, Serialize)]
struct Profile {
    arch: String,
    device: String,
    input: Vec<i64>,
    dtype: String,
    parts: Vec<ProfileRow>,
    forward_ms: f64,
    backward_ms: Option<f64>,
    total_params: i64,
    /// Peak resident memory of this process (CPU runs), bytes.
    peak_rss_bytes: Option<u64>,
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Peak resident set size of this process, from getrusage.
fn peak_rss() -> Option<u64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a plain-data struct into memory we own and sized for it.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: getrusage returned 0, so it initialised the struct.
    let usage = unsafe { usage.assume_init() };
    Some(usage.ru_maxrss as u64 * 1024)
}

/// Runs `vrtspike profile`.
pub fn profile(args: ProfileArgs) -> Result<()> {
    let device = parse_device(&args.device)?;
    if args.iters == 0 {
        bail!("--iters must be at least 1");
    }
    let cfg = load_model_config(&args.config)?;
    let mut vs = nn::VarStore::new(device);
    let net = build_model(&vs, &cfg, &args.config)?;
    let kind = if args.bf16 {
        Kind::BFloat16
    } else {
        Kind::Float
    };
    if args.bf16 {
        vs.bfloat16();
    }
    let summary = summarize(&vs, net.arch(), &net.parts());
    let x = Tensor::rand(
        [args.batch, args.frames, cfg.in_chans, args.size, args.size],
        (kind, device),
    );
    let spike_side = ((args.size as f64 * args.spike_scale) as i64 / 8 * 8).max(8);
    let voxels = net.uses_voxels().then(|| {
        Tensor::rand(
            [
                args.batch,
                args.frames,
                cfg.spike.voxel_bins,
                spike_side,
                spike_side,
            ],
            (kind, device),
        )
    });
    let mut order: Vec<String> = Vec::new();
    let mut totals: Vec<f64> = Vec::new();
    let mut backward_total = 0.0;
    let mut forward_total = 0.0;
    for iter in 0..=args.iters {
        let timed = iter > 0;
        sync(device);
        let start = Instant::now();
        let mut last = start;
        let mut marks: Vec<(String, f64)> = Vec::new();
        let mut mark = |name: &str| {
            sync(device);
            let now = Instant::now();
            marks.push((name.to_string(), (now - last).as_secs_f64() * 1e3));
            last = now;
        };
        let run = |mark: &mut dyn FnMut(&str)| {
            net.forward_marked(&x, voxels.as_ref(), !args.no_backward, mark)
        };
        let out = if args.no_backward {
            tch::no_grad(|| run(&mut mark))
        } else {
            run(&mut mark)
        }?;
        let forward_ms = start.elapsed().as_secs_f64() * 1e3;
        let back_start = Instant::now();
        if !args.no_backward {
            out.to_kind(Kind::Float)
                .square()
                .mean(Kind::Float)
                .backward();
            sync(device);
            vs.trainable_variables().iter().for_each(|t| {
                let mut g = t.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            });
        }
        let backward_ms = back_start.elapsed().as_secs_f64() * 1e3;
        if timed {
            if order.is_empty() {
                order = marks.iter().map(|(n, _)| n.clone()).collect();
                totals = vec![0.0; order.len()];
            }
            for (i, (_, ms)) in marks.iter().enumerate() {
                if let Some(t) = totals.get_mut(i) {
                    *t += ms;
                }
            }
            forward_total += forward_ms;
            backward_total += backward_ms;
        }
    }
    let n = args.iters as f64;
    let forward_ms = forward_total / n;
    let parts = order
        .iter()
        .zip(&totals)
        .map(|(name, total)| {
            let params = summary
                .parts
                .iter()
                .filter(|p| &p.prefix == name)
                .map(|p| p.params)
                .sum();
            ProfileRow {
                part: name.clone(),
                forward_ms: total / n,
                share: total / n / forward_ms.max(1e-9),
                params,
            }
        })
        .collect();
    let profile = Profile {
        arch: summary.arch.clone(),
        device: args.device.clone(),
        input: x.size(),
        dtype: format!("{kind:?}"),
        parts,
        forward_ms,
        backward_ms: (!args.no_backward).then_some(backward_total / n),
        total_params: summary.total_params,
        peak_rss_bytes: if device == Device::Cpu {
            peak_rss()
        } else {
            None
        },
    };
    if args.json {
        println!("{}", serde_json::to_string(&profile)?);
        return Ok(());
    }
    println!(
        "{} on {} input {:?} {}: forward {:.1} ms{}",
        profile.arch,
        profile.device,
        profile.input,
        profile.dtype,
        profile.forward_ms,
        profile
            .backward_ms
            .map(|b| format!(", backward {b:.1} ms"))
            .unwrap_or_default()
    );
    println!(
        "{:<16} {:>12} {:>8} {:>14}",
        "part", "forward ms", "share", "parameters"
    );
    for row in &profile.parts {
        println!(
            "{:<16} {:>12.2} {:>7.1}% {:>14}",
            row.part,
            row.forward_ms,
            100.0 * row.share,
            group_digits(row.params)
        );
    }
    println!("total parameters: {}", group_digits(profile.total_params));
    if let Some(rss) = profile.peak_rss_bytes {
        println!("peak RSS: {:.1} MiB", rss as f64 / (1 << 20) as f64);
    }
    Ok(())
}

/// Runs `vrtspike infer`: restores every sequence of a split, writes PNGs and
/// prints PSNR/SSIM per sequence and overall.
pub fn infer(args: InferArgs) -> Result<()> {
    use crate::data::{DatasetIndex, IndexOptions};
    use crate::train::infer::{infer_dataset, resolve_weights, InferOptions};

    let device = parse_device(&args.device)?;
    let config = Config::load(&args.config)?;
    let weights = resolve_weights(&args.checkpoint).context("--checkpoint")?;
    let vs = nn::VarStore::new(device);
    let net = build_model(&vs, &config.model, &args.config)?;
    load_safetensors(&vs, &weights).with_context(|| {
        format!(
            "loading {} into the model of {}",
            weights.display(),
            args.config.display()
        )
    })?;
    let options = InferOptions {
        clip: args.clip,
        clip_overlap: args.clip_overlap,
        tile: args.tile,
        tile_overlap: args.tile_overlap,
        bins: u32::try_from(config.model.spike.voxel_bins).context("MODEL.SPIKE.VOXEL_BINS")?,
    };
    options.check(net.size_multiple())?;
    if !args.input.is_dir() {
        bail!("--input {}: not a directory", args.input.display());
    }
    let index = DatasetIndex::open(
        &args.input,
        &args.split,
        IndexOptions::from_config(&config.data),
    )
    .with_context(|| format!("--input {} (split {})", args.input.display(), args.split))?;
    let progress = if args.json {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(index.frame_count() as u64)
    };
    let start = Instant::now();
    let report = infer_dataset(net.as_ref(), device, &index, &options, &args.out, &progress)?;
    progress.finish_and_clear();
    let seconds = start.elapsed().as_secs_f64();
    if args.json {
        let json = serde_json::json!({
            "checkpoint": args.checkpoint,
            "weights": weights,
            "input": args.input,
            "split": args.split,
            "out": args.out,
            "clip": args.clip,
            "clip_overlap": args.clip_overlap,
            "tile": args.tile,
            "tile_overlap": args.tile_overlap,
            "seconds": seconds,
            "sequences": report.sequences,
            "overall": report.overall,
        });
        println!("{json}");
        return Ok(());
    }
    println!(
        "{} on {} ({} frames, {:.1} s); PNGs in {}",
        net.arch(),
        args.input.join(&args.split).display(),
        report.overall.frames,
        seconds,
        args.out.display()
    );
    println!(
        "{:<24} {:>7} {:>10} {:>8} {:>10}",
        "sequence", "frames", "PSNR", "SSIM", "input PSNR"
    );
    for q in report.sequences.iter().chain([&report.overall]) {
        println!(
            "{:<24} {:>7} {:>10.3} {:>8.4} {:>10.3}",
            q.name, q.frames, q.psnr, q.ssim, q.input_psnr
        );
    }
    Ok(())
}

/// 18320007 -> "18,320,007".
fn group_digits(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digits_are_grouped() {
        assert_eq!(group_digits(18_320_007), "18,320,007");
        assert_eq!(group_digits(300), "300");
        assert_eq!(group_digits(1000), "1,000");
    }

    #[test]
    fn devices_parse() {
        assert_eq!(parse_device("cpu").unwrap(), Device::Cpu);
        assert_eq!(parse_device("cuda:1").unwrap(), Device::Cuda(1));
        assert!(parse_device("gpu").is_err());
    }
}
