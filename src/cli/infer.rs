//! `vrtspike infer`: restores every sequence of a split by the clip protocol
//! (`vrtspike::eval::infer`), writes PNGs and prints PSNR/SSIM per sequence.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;

use vrtspike::dataset::{DatasetIndex, IndexOptions};
use vrtspike::eval::{infer_dataset, resolve_weights, InferOptions};
use vrtspike::model::LoadedModel;

use super::parse_device;

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

/// Runs `vrtspike infer`: restores every sequence of a split, writes PNGs and
/// prints PSNR/SSIM per sequence and overall.
pub fn run(args: InferArgs) -> Result<()> {
    let device = parse_device(&args.device)?;
    let weights = resolve_weights(&args.checkpoint).context("--checkpoint")?;
    let model = LoadedModel::with_weights(&args.config, &weights, device)?;
    let (config, net) = (&model.config, &model.net);
    let options = InferOptions {
        clip: args.clip,
        clip_overlap: args.clip_overlap,
        tile: args.tile,
        tile_overlap: args.tile_overlap,
        ..InferOptions::for_model(&config.model)
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
