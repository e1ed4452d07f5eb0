//! `vrtspike synth`: write a synthetic GoPro-Spike dataset (folder layout, or HDF5
//! sessions with `--h5`) with a progress bar.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use vrtspike::synth::{self, BlurLengths, SynthOptions};

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
    /// Sharp frames averaged per blur, per sequence in turn (e.g.
    /// `7,7,7,7,7,7,7,13`: records of two sizes); default: drawn from 7, 11, 13 by
    /// the seed, per sequence.
    #[arg(long, value_delimiter = ',', value_name = "N,...")]
    pub blur_frames: Vec<u32>,
    /// Also write precomputed voxel grids of this many bins beside the spikes
    /// (`spike_vox/*.npy`, read with `DATA.USE_PRECOMPUTED_VOXELS: true`).
    #[arg(long, value_name = "BINS", conflicts_with = "h5")]
    pub voxels: Option<u32>,
}

/// Runs `vrtspike synth`.
pub fn run(args: SynthArgs) -> Result<()> {
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
    let blur = match args.blur_frames.is_empty() {
        true => BlurLengths::Drawn,
        false => BlurLengths::cycle(args.blur_frames.clone()).context("--blur-frames")?,
    };
    let layout = match args.h5 {
        true => synth::Layout::H5,
        false => synth::Layout::Folder,
    };
    let meta = synth::generate(&args.out, &options, &blur, &progress, layout)
        .with_context(|| format!("writing a synthetic dataset to {}", args.out.display()))?;
    bar.finish_and_clear();
    if let Some(bins) = args.voxels {
        let written = synth::write_precomputed_voxels(&args.out, bins)
            .with_context(|| format!("writing spike_vox/ grids under {}", args.out.display()))?;
        println!("wrote {written} precomputed voxel grids of {bins} bins (spike_vox/*.npy)");
    }
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
