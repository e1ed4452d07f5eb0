//! `vrtspike inspect`: one frame's model inputs (blur, sharp, voxels) exactly as the
//! pipeline builds them, written as a safetensors file.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use vrtspike::config::{Augment, BlurDir};
use vrtspike::dataset::{DatasetIndex, IndexOptions, SpikePayload};
use vrtspike::pipeline::sample::{build_sample, ClipRef, CropMode, SampleSpec};
use vrtspike::pipeline::DiskSource;
use vrtspike::util::rng::SplitMix64;

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
pub fn run(args: InspectArgs) -> Result<()> {
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
        SpikePayload::Bits { steps } => steps,
        SpikePayload::VoxelF16 { bins } => bins,
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
