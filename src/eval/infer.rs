//! Full-sequence inference by VRT's test protocol: each sequence is cut into
//! temporal clips (`clip` frames overlapping `clip_overlap`, the last aligned to the
//! end), each clip run by overlapping spatial tiles; every output frame is taken
//! from the one clip where it lies farthest from an inner clip edge (no averaging).
//! Writes 8-bit PNGs and sums PSNR/SSIM (VRT protocol) against the sharp frames.

use std::path::{Path, PathBuf};

use indicatif::ProgressBar;
use serde::Serialize;
use tch::{Device, Kind, Tensor};

use crate::config::ModelConfig;
use crate::dataset::image::{write_png_rgb, RgbImage};
use crate::dataset::index::gcd;
use crate::dataset::record::Rect;
use crate::dataset::voxel::SpikeRect;
use crate::dataset::{DataError, DatasetIndex};
use crate::model::{device_name, first_line, is_out_of_memory, ModelError, Restorer};
use crate::pipeline::sample::crop_voxels;
use crate::pipeline::{DiskSource, PipelineError, RecordSource};

use super::quality::{quantize_u8, QualityAccumulator, QualitySums};
use super::tiles::{tile_spans, tiled_forward, Tiling};

/// Why inference could not run.
#[derive(Debug, thiserror::Error)]
pub enum InferError {
    /// A bad command-line option (named).
    #[error("{option}: {message}")]
    Option {
        /// The option, e.g. `--tile`.
        option: String,
        /// What was wrong.
        message: String,
    },
    /// The input data cannot be run (the file or folder at fault named).
    #[error("{path}: {message}")]
    Input {
        /// The file or folder.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
    /// Reading the dataset failed.
    #[error(transparent)]
    Data(#[from] DataError),
    /// Reading a clip's records failed.
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Inference ran out of memory (the message names what to change).
    #[error(
        "out of memory in inference{} on {device}, input (B, T, C, H, W) = {shape:?}: \
         {detail}. To fit: a smaller --tile (now {tile}) or --clip (now {clip})",
        stage.as_ref().map(|s| format!(" ({s})")).unwrap_or_default()
    )]
    OutOfMemory {
        /// The model part that ran out, if the model did.
        stage: Option<String>,
        /// The clip's input shape.
        shape: Vec<i64>,
        /// The device.
        device: String,
        /// libtorch's message.
        detail: String,
        /// `--tile`.
        tile: i64,
        /// `--clip`.
        clip: usize,
    },
    /// libtorch failed outside the model (tiling, copies).
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

fn option_err(option: &str, message: impl Into<String>) -> InferError {
    InferError::Option {
        option: option.into(),
        message: message.into(),
    }
}

/// `error` as [`InferError::OutOfMemory`] when it is an allocation failure on `blur`.
fn out_of_memory(error: InferError, blur: &Tensor, options: &InferOptions) -> InferError {
    let (stage, detail) = match &error {
        InferError::Model(e) if e.is_out_of_memory() => {
            (e.stage().map(str::to_string), e.libtorch_message())
        }
        InferError::Torch(e) if is_out_of_memory(e) => (None, first_line(&e.to_string())),
        _ => return error,
    };
    InferError::OutOfMemory {
        stage,
        shape: blur.size(),
        device: device_name(blur.device()),
        detail,
        tile: options.tile,
        clip: options.clip,
    }
}

fn input_err(path: &Path, message: impl Into<String>) -> InferError {
    InferError::Input {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Clip and tile settings (VRT's GoPro protocol: 18 / 2 and 192 / 20).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InferOptions {
    /// Frames per temporal clip (at least 2).
    pub clip: usize,
    /// Frames shared by consecutive clips (less than `clip`).
    pub clip_overlap: usize,
    /// Spatial tile side in RGB pixels (a multiple of the model's size multiple).
    pub tile: i64,
    /// Pixels shared by neighbouring tiles (less than `tile`).
    pub tile_overlap: i64,
    /// Voxel bins the model takes (`MODEL.SPIKE.VOXEL_BINS`).
    pub bins: u32,
}

impl Default for InferOptions {
    fn default() -> Self {
        InferOptions {
            clip: 18,
            clip_overlap: 2,
            tile: 192,
            tile_overlap: 20,
            bins: 32,
        }
    }
}

impl InferOptions {
    /// VRT's protocol for the model of `cfg` (its `MODEL.SPIKE.VOXEL_BINS`).
    pub fn for_model(cfg: &ModelConfig) -> InferOptions {
        InferOptions {
            bins: u32::try_from(cfg.spike.voxel_bins).unwrap_or(u32::MAX),
            ..InferOptions::default()
        }
    }

    /// Checks the options against a model needing sizes in multiples of `multiple`.
    pub fn check(&self, multiple: i64) -> Result<(), InferError> {
        if self.clip < 2 {
            return Err(option_err(
                "--clip",
                format!("{} frames; a clip needs at least 2", self.clip),
            ));
        }
        if self.clip_overlap >= self.clip {
            return Err(option_err(
                "--clip-overlap",
                format!(
                    "{} must be less than --clip {}",
                    self.clip_overlap, self.clip
                ),
            ));
        }
        if self.tile < multiple || self.tile % multiple != 0 {
            return Err(option_err(
                "--tile",
                format!(
                    "{} pixels; the model needs a positive multiple of {multiple}",
                    self.tile
                ),
            ));
        }
        if self.tile_overlap < 0 || self.tile_overlap >= self.tile {
            return Err(option_err(
                "--tile-overlap",
                format!(
                    "{} must be in 0..{} (less than --tile)",
                    self.tile_overlap, self.tile
                ),
            ));
        }
        Ok(())
    }
}

/// Quality of one sequence (means per frame).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SequenceQuality {
    /// Sequence folder name.
    pub name: String,
    /// Frames restored.
    pub frames: u64,
    /// Mean PSNR of the output against the sharp frames, dB.
    pub psnr: f64,
    /// Mean SSIM of the output.
    pub ssim: f64,
    /// Mean PSNR of the blurred input, dB.
    pub input_psnr: f64,
}

impl SequenceQuality {
    fn from_sums(name: &str, sums: &QualitySums) -> SequenceQuality {
        let (psnr, ssim, input_psnr) = sums.means();
        SequenceQuality {
            name: name.to_owned(),
            frames: sums.frames,
            psnr,
            ssim,
            input_psnr,
        }
    }
}

/// What an inference run measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InferReport {
    /// Per sequence, in name order.
    pub sequences: Vec<SequenceQuality>,
    /// Overall: the mean of the sequences' means (VRT's protocol), `frames` summed.
    pub overall: SequenceQuality,
}

fn lcm(a: i64, b: i64) -> i64 {
    a / gcd(a.unsigned_abs(), b.unsigned_abs()).max(1) as i64 * b
}

/// One clip of a sequence on `device`: blur and sharp (1, D, 3, H, W), voxels
/// (1, D, K, Hs, Ws) when the model takes them.
fn load_clip(
    index: &DatasetIndex,
    seq: usize,
    frames: std::ops::Range<usize>,
    bins: Option<u32>,
    source: &mut DiskSource,
) -> Result<(Tensor, Tensor, Option<Tensor>), InferError> {
    let s = &index.sequences[seq];
    let (h, w) = (s.height as usize, s.width as usize);
    let (hs, ws) = (s.spike_height as usize, s.spike_width as usize);
    let d = frames.len();
    let rgb_len = 3 * h * w;
    let vox_len = bins.map_or(0, |k| k as usize * hs * ws);
    let mut blur = vec![0f32; d * rgb_len];
    let mut sharp = vec![0f32; d * rgb_len];
    let mut voxels = vec![0f32; d * vox_len];
    let rect = Rect {
        y: 0,
        x: 0,
        h: s.height,
        w: s.width,
    };
    let region = SpikeRect {
        y: 0,
        x: 0,
        h: s.spike_height,
        w: s.spike_width,
    };
    for (j, frame) in frames.enumerate() {
        let blur_out = &mut blur[j * rgb_len..(j + 1) * rgb_len];
        let sharp_out = &mut sharp[j * rgb_len..(j + 1) * rgb_len];
        let vox_out = &mut voxels[j * vox_len..(j + 1) * vox_len];
        source.with_record(index, seq, frame, &mut |view| {
            view.crop_rgb_f32(view.blur(), rect, blur_out)?;
            view.crop_rgb_f32(view.sharp(), rect, sharp_out)?;
            match bins {
                Some(k) => crop_voxels(&view, k, region, vox_out),
                None => Ok(()),
            }
        })?;
    }
    let shape = [1, d as i64, 3, h as i64, w as i64];
    let blur = Tensor::from_slice(&blur).view(shape);
    let sharp = Tensor::from_slice(&sharp).view(shape);
    let voxels = bins
        .map(|k| Tensor::from_slice(&voxels).view([1, d as i64, k as i64, hs as i64, ws as i64]));
    Ok((blur, sharp, voxels))
}

/// Writes a (3, H, W) frame in [0, 1] as an 8-bit RGB PNG, quantised exactly as
/// the metrics quantise it.
fn write_frame(path: &Path, frame: &Tensor) -> Result<(), InferError> {
    let s = frame.size();
    let levels = quantize_u8(frame)
        .permute([1, 2, 0])
        .to_kind(Kind::Uint8)
        .contiguous()
        .view([-1]);
    let data = crate::util::readback::values::<u8>(&levels)
        .map_err(|e| input_err(path, format!("cannot read the output frame: {e}")))?;
    let image = RgbImage {
        height: s[1] as u32,
        width: s[2] as u32,
        data,
    };
    write_png_rgb(path, &image)?;
    Ok(())
}

/// Runs `model` over every sequence of `index`, writing `<out>/<SEQ>/<FRAME>.png`.
pub fn infer_dataset(
    model: &dyn Restorer,
    device: Device,
    index: &DatasetIndex,
    options: &InferOptions,
    out: &Path,
    progress: &ProgressBar,
) -> Result<InferReport, InferError> {
    let multiple = model.size_multiple();
    options.check(multiple)?;
    let bins = model.uses_voxels().then_some(options.bins);
    // Check every sequence before running any.
    for s in &index.sequences {
        if s.frames.len() < 2 {
            return Err(input_err(
                &s.dir,
                format!(
                    "{} usable frame(s); a sequence needs at least 2",
                    s.frames.len()
                ),
            ));
        }
        if s.height as i64 % multiple != 0 || s.width as i64 % multiple != 0 {
            return Err(input_err(
                &s.dir,
                format!(
                    "frames are {}x{}; the model ({}) needs multiples of {multiple}",
                    s.height,
                    s.width,
                    model.arch()
                ),
            ));
        }
        if s.height < 11 || s.width < 11 {
            return Err(input_err(&s.dir, "frames smaller than SSIM's 11x11 window"));
        }
        let tiled = options.tile < s.height as i64 || options.tile < s.width as i64;
        if tiled && bins.is_some() {
            let ratio = s.height / s.spike_height.max(1);
            if s.height % s.spike_height.max(1) != 0 || s.width != s.spike_width * ratio {
                return Err(input_err(
                    &s.dir,
                    format!(
                        "tiling needs the {}x{} frames to be a whole multiple of the {}x{} \
                         spike grid, equal in both directions; use --tile >= the frame size",
                        s.height, s.width, s.spike_height, s.spike_width
                    ),
                ));
            }
        }
    }
    let out_err = |path: &Path, e: std::io::Error| input_err(path, e.to_string());
    std::fs::create_dir_all(out).map_err(|e| out_err(out, e))?;
    let mut source = DiskSource::default();
    let mut sequences = Vec::with_capacity(index.sequences.len());
    for (seq, s) in index.sequences.iter().enumerate() {
        let seq_out = out.join(&s.name);
        std::fs::create_dir_all(&seq_out).map_err(|e| out_err(&seq_out, e))?;
        let ratio = (s.height / s.spike_height.max(1)).max(1) as i64;
        let align = lcm(multiple, ratio);
        let tiled = options.tile < s.height as i64 || options.tile < s.width as i64;
        let mut sums = QualityAccumulator::default();
        let n = s.frames.len() as i64;
        for clip in tile_spans(n, options.clip as i64, options.clip_overlap as i64, 1) {
            let frames = clip.start as usize..clip.end as usize;
            let (blur, sharp, voxels) = load_clip(index, seq, frames, bins, &mut source)?;
            let (blur_dev, vox_dev) = (
                blur.to_device(device),
                voxels.as_ref().map(|v| v.to_device(device)),
            );
            let output = tch::no_grad(|| -> Result<Tensor, InferError> {
                let mut forward = |b: &Tensor, v: Option<&Tensor>| {
                    model
                        .forward(b, v, false)
                        .map(|y| y.to_kind(Kind::Float))
                        .map_err(InferError::from)
                };
                if tiled {
                    let tiling = Tiling {
                        tile: options.tile,
                        overlap: options.tile_overlap,
                        align,
                        batch: 1,
                    };
                    tiled_forward(&mut forward, &blur_dev, vox_dev.as_ref(), tiling)
                } else {
                    forward(&blur_dev, vox_dev.as_ref())
                }
            })
            .map_err(|e| out_of_memory(e, &blur_dev, options))?
            .to_device(Device::Cpu);
            let keep = clip.keep_end - clip.keep_start;
            let offset = clip.keep_start - clip.start;
            let kept = output.get(0).narrow(0, offset, keep);
            for j in 0..keep {
                let name = &s.frames[(clip.keep_start + j) as usize].name;
                write_frame(&seq_out.join(format!("{name}.png")), &kept.get(j))?;
            }
            sums.add_clip(
                &kept,
                &blur.get(0).narrow(0, offset, keep),
                &sharp.get(0).narrow(0, offset, keep),
            )?;
            progress.inc(keep as u64);
        }
        let quality = SequenceQuality::from_sums(&s.name, &sums.read()?);
        tracing::info!(
            sequence = %s.name,
            frames = quality.frames,
            psnr = quality.psnr,
            ssim = quality.ssim,
            input_psnr = quality.input_psnr,
            "sequence done"
        );
        sequences.push(quality);
    }
    let count = sequences.len().max(1) as f64;
    let mean = |f: fn(&SequenceQuality) -> f64| sequences.iter().map(f).sum::<f64>() / count;
    let overall = SequenceQuality {
        name: "overall".into(),
        frames: sequences.iter().map(|q| q.frames).sum(),
        psnr: mean(|q| q.psnr),
        ssim: mean(|q| q.ssim),
        input_psnr: mean(|q| q.input_psnr),
    };
    Ok(InferReport { sequences, overall })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_out_of_memory_names_the_stage_shape_and_tile() {
        let refused = Tensor::f_empty([1i64 << 60], (Kind::Float, Device::Cpu));
        let Err(source) = refused else {
            panic!("2^62 bytes were allocated");
        };
        let error = InferError::Model(ModelError::Op {
            stage: "stage 2, TMSA group 1".into(),
            source,
        });
        let blur = Tensor::zeros([1, 18, 3, 64, 96], (Kind::Float, Device::Cpu));
        let text = out_of_memory(error, &blur, &InferOptions::default()).to_string();
        for part in [
            "out of memory in inference (stage 2, TMSA group 1) on cpu",
            "input (B, T, C, H, W) = [1, 18, 3, 64, 96]",
            "DefaultCPUAllocator",
            "a smaller --tile (now 192) or --clip (now 18)",
        ] {
            assert!(text.contains(part), "{part:?} not in {text}");
        }
        let other = out_of_memory(
            InferError::Model(ModelError::Shape("odd".into())),
            &blur,
            &InferOptions::default(),
        );
        assert!(matches!(other, InferError::Model(ModelError::Shape(_))));
    }

    #[test]
    fn options_are_checked_by_name() {
        let ok = InferOptions::default();
        ok.check(8).unwrap();
        let bad = |o: InferOptions, name: &str| {
            let e = o.check(8).unwrap_err().to_string();
            assert!(e.starts_with(name), "{e}");
        };
        bad(InferOptions { clip: 1, ..ok }, "--clip");
        bad(
            InferOptions {
                clip_overlap: 18,
                ..ok
            },
            "--clip-overlap",
        );
        bad(InferOptions { tile: 4, ..ok }, "--tile");
        bad(InferOptions { tile: 100, ..ok }, "--tile");
        bad(
            InferOptions {
                tile_overlap: 192,
                ..ok
            },
            "--tile-overlap",
        );
    }

    #[test]
    fn clips_follow_vrt_and_keep_frames_far_from_edges() {
        // 40 frames, 18-frame clips overlapping 2: starts 0, 16, 22 (end-aligned).
        let spans = tile_spans(40, 18, 2, 1);
        let starts: Vec<i64> = spans.iter().map(|s| s.start).collect();
        assert_eq!(starts, vec![0, 16, 22]);
        assert_eq!(spans.last().map(|s| s.end), Some(40));
        for pair in spans.windows(2) {
            assert_eq!(pair[0].keep_end, pair[1].keep_start);
        }
        // Shorter than a clip: one clip.
        assert_eq!(tile_spans(5, 18, 2, 1).len(), 1);
    }
}
