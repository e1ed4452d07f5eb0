//! The data path's subcommands: `vrtspike synth` (write a synthetic GoPro-Spike
//! dataset) and `vrtspike inspect` (write one frame's model inputs as safetensors).

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::config::{Augment, BlurDir};

use super::rng::SplitMix64;
use super::sample::{build_sample, ClipRef, CropMode, DiskSource, SampleSpec};
use super::synth::{self, SynthOptions};
use super::{DatasetIndex, IndexOptions};

/// `vrtspike synth`: a synthetic dataset in the folder layout.
#[derive(Debug, Args)]
pub struct SynthArgs {
    /// Output dataset root (created).
    #[arg(long)]
    pub out: PathBuf,
    /// Training sequences.
    #[arg(long, default_value_t = 2)]
    pub seqs: u32,
    /// Test sequences.
    #[arg(long, default_value_t = 1)]
    pub test_seqs: u32,
    /// Blurred frames per sequence.
    #[arg(long, default_value_t = 12)]
    pub frames: u32,
    /// RGB rows (spikes at half resolution).
    #[arg(long, default_value_t = 128)]
    pub height: u32,
    /// RGB columns.
    #[arg(long, default_value_t = 192)]
    pub width: u32,
    /// Seed (same seed, same files).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Full GoPro frames: 720 x 1280 (overrides --height/--width).
    #[arg(long)]
    pub gopro: bool,
    /// Write the HDF5 sessions variant (`<split>/<SEQ>.h5`) of the same data instead
    /// of the folder layout.
    #[arg(long)]
    pub h5: bool,
}

/// Runs `vrtspike synth`.
pub fn run_synth(args: SynthArgs) -> Result<()> {
    let (height, width) = if args.gopro {
        (720, 1280)
    } else {
        (args.height, args.width)
    };
    let options = SynthOptions {
        train_seqs: args.seqs,
        test_seqs: args.test_seqs,
        frames: args.frames,
        height,
        width,
        seed: args.seed,
    };
    let bar = ProgressBar::new((args.seqs + args.test_seqs) as u64);
    bar.set_style(
        ProgressStyle::with_template("synth {bar:30} {pos}/{len} sequences {msg}")
            .context("progress bar template")?,
    );
    let progress = |name: &str| {
        bar.set_message(name.to_owned());
        bar.inc(1);
    };
    let meta = if args.h5 {
        synth::generate_h5(&args.out, &options, &progress)
    } else {
        synth::generate_folder(&args.out, &options, &progress)
    }
    .with_context(|| format!("writing a synthetic dataset to {}", args.out.display()))?;
    bar.finish_and_clear();
    println!(
        "wrote {} train + {} test {} of {} frames at {height}x{width} (spikes {}x{}) to {}",
        args.seqs,
        args.test_seqs,
        if args.h5 {
            "HDF5 sessions"
        } else {
            "sequences"
        },
        args.frames,
        meta.spike_height,
        meta.spike_width,
        args.out.display()
    );
    Ok(())
}

/// `vrtspike inspect`: one frame's tensors exactly as the model gets them.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// Dataset root.
    #[arg(long)]
    pub root: PathBuf,
    /// Split folder.
    #[arg(long, default_value = "train")]
    pub split: String,
    /// Sequence folder name.
    #[arg(long)]
    pub seq: String,
    /// Frame file stem.
    #[arg(long)]
    pub frame: String,
    /// Crop `Y,X,S` in RGB pixels (default: the whole frame).
    #[arg(long)]
    pub crop: Option<String>,
    /// Voxel bins K.
    #[arg(long, default_value_t = 32)]
    pub bins: u32,
    /// Read `blur_gamma/` instead of `blur/`.
    #[arg(long)]
    pub blur_gamma: bool,
    /// Output `.safetensors` file.
    #[arg(long)]
    pub out: PathBuf,
}

fn parse_crop(text: &str) -> Result<CropMode> {
    let parts: Vec<&str> = text.split(',').map(str::trim).collect();
    let [y, x, s] = parts.as_slice() else {
        bail!("--crop {text:?}: expected Y,X,S");
    };
    let num = |v: &str| {
        v.parse::<u32>()
            .with_context(|| format!("--crop {text:?}: {v:?} is not a pixel count"))
    };
    Ok(CropMode::Fixed {
        y: num(y)?,
        x: num(x)?,
        size: num(s)?,
    })
}

/// Runs `vrtspike inspect`.
pub fn run_inspect(args: InspectArgs) -> Result<()> {
    let options = IndexOptions {
        blur_dir: if args.blur_gamma {
            BlurDir::BlurGamma
        } else {
            BlurDir::Blur
        },
        ..IndexOptions::default()
    };
    let index = DatasetIndex::open(&args.root, &args.split, options)?;
    let (seq, entry) = index.sequence(&args.seq)?;
    let frame = entry
        .frames
        .iter()
        .position(|f| f.name == args.frame)
        .with_context(|| format!("no frame '{}' in sequence {}", args.frame, args.seq))?;
    let crop = match &args.crop {
        Some(text) => parse_crop(text)?,
        None => CropMode::Full,
    };
    let spec = SampleSpec {
        crop,
        augment: Augment::all(false),
        bins: args.bins,
    };
    let sample = build_sample(
        &index,
        ClipRef { seq, start: frame },
        1,
        &spec,
        &mut SplitMix64::new(0),
        &mut DiskSource::default(),
    )?;
    let bytes = |v: &[f32]| v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
    let (blur, sharp, voxel) = (
        bytes(&sample.blur),
        bytes(&sample.sharp),
        bytes(&sample.voxel),
    );
    let rgb_shape = vec![3, sample.height, sample.width];
    let vox_shape = vec![sample.bins, sample.spike_height, sample.spike_width];
    fn view(data: &[u8], shape: Vec<usize>) -> Result<safetensors::tensor::TensorView<'_>> {
        Ok(safetensors::tensor::TensorView::new(
            safetensors::Dtype::F32,
            shape,
            data,
        )?)
    }
    let tensors = vec![
        ("blur", view(&blur, rgb_shape.clone())?),
        ("sharp", view(&sharp, rgb_shape)?),
        ("voxel", view(&voxel, vox_shape)?),
    ];
    let steps = match index.record_layout(seq, frame).payload {
        super::SpikePayload::Bits { steps } => steps,
        super::SpikePayload::VoxelF16 { bins } => bins,
    };
    let info: HashMap<String, String> = [
        ("sequence", sample.sequence.clone()),
        ("frame", args.frame.clone()),
        (
            "crop_yxhw",
            format!(
                "{},{},{},{}",
                sample.crop.y, sample.crop.x, sample.crop.h, sample.crop.w
            ),
        ),
        ("spike_steps", steps.to_string()),
        ("bins", args.bins.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    safetensors::tensor::serialize_to_file(tensors, Some(info), &args.out)
        .with_context(|| format!("writing {}", args.out.display()))?;
    println!(
        "wrote {}: blur/sharp f32 {:?}, voxel f32 {:?}",
        args.out.display(),
        [3, sample.height, sample.width],
        [sample.bins, sample.spike_height, sample.spike_width]
    );
    Ok(())
}

/// `vrtspike bench loader`: R loader processes against one cache server.
#[derive(Debug, Args)]
pub struct LoaderBenchArgs {
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Dataset root (folder layout or HDF5 sessions).
    #[arg(long)]
    pub root: PathBuf,
    /// Split folder.
    #[arg(long, default_value = "train")]
    pub split: String,
    /// Loader processes (ranks).
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// Loader threads per rank.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Batches queued ahead per worker.
    #[arg(long, default_value_t = 2)]
    pub prefetch: usize,
    /// Samples per batch.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Epochs (the last one is reported).
    #[arg(long, default_value_t = 2)]
    pub epochs: u64,
    /// Frames per clip.
    #[arg(long, default_value_t = 6)]
    pub clip: usize,
    /// Square crop in RGB pixels.
    #[arg(long, default_value_t = 256)]
    pub crop: u32,
    /// Voxel bins.
    #[arg(long, default_value_t = 32)]
    pub bins: u32,
    /// Cache size in GiB.
    #[arg(long, default_value_t = 2.0)]
    pub cache_gb: f64,
    /// Read from disk (no cache server).
    #[arg(long)]
    pub no_cache: bool,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Runs `vrtspike bench loader`.
pub fn run_loader_bench(args: LoaderBenchArgs) -> Result<()> {
    let template = super::bench::LoaderWorkerOptions {
        root: args.root.clone(),
        split: args.split.clone(),
        address: None,
        rank: 0,
        ranks: args.ranks,
        workers: args.workers,
        prefetch: args.prefetch,
        batch: args.batch,
        epochs: args.epochs,
        clip: args.clip,
        crop: args.crop,
        bins: args.bins,
        seed: args.seed,
    };
    let exe = std::env::current_exe().context("finding the vrtspike binary")?;
    let cache = (!args.no_cache).then_some(args.cache_gb);
    let report = super::bench::run(&exe, &template, cache)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "loader: {} ranks x {} workers, clip {}, crop {}: {:.2} samples/s (last epoch), hit rate {:.3}, data_time {:.1} ms",
            report.ranks, report.workers_per_rank, report.clip, report.crop, report.samples_per_s, report.hit_rate, report.data_time_ms
        );
    }
    Ok(())
}

/// Runs one hidden `bench loader-worker` process.
pub fn run_loader_worker(options: &str) -> Result<()> {
    let o: super::bench::LoaderWorkerOptions =
        serde_json::from_str(options).context("parsing the loader worker's --options")?;
    let report = super::bench::run_worker(&o)?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}
