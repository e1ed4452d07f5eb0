//! Samples: clips of `DATA.CLIP_LEN` consecutive frames of one sequence, cut to one
//! crop that is aligned between RGB and spike resolution, expanded to f32 (blur and
//! sharp (L,3,h,w) in [0,1], voxels (L,K,h_s,w_s)) and augmented. Records are read
//! through a [`RecordSource`] (the node cache, or the disk directly).

use crate::config::Augment;
use crate::dataset::index::{crop_alignment, DatasetIndex};
use crate::dataset::record::{RecordView, Rect, SpikePayload};
use crate::dataset::voxel::{self, SpikeRect, SpikeShape};
use crate::util::rng::SplitMix64;

use super::error::{PipelineError, Result};
use super::source::RecordSource;
use super::transform::Dihedral;

/// A clip: frames `start .. start + len` of sequence `seq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClipRef {
    /// Sequence position in the index.
    pub seq: usize,
    /// First frame position in the sequence.
    pub start: usize,
}

/// The clips of an index: every window of `len` frames, `stride` frames apart.
#[derive(Debug, Clone)]
pub struct ClipIndex {
    /// Frames per clip.
    pub len: usize,
    /// The clips, sequence by sequence.
    pub clips: Vec<ClipRef>,
}

/// How a [`ClipIndex`] cuts sequences into clips.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClipWindows {
    /// Frames per clip.
    pub len: usize,
    /// Frames between the starts of consecutive clips.
    pub stride: usize,
    /// Add a last window ending on the last frame when the stride skips it.
    pub cover_tail: bool,
}

impl ClipWindows {
    /// Every window of `len` frames, one frame apart (training).
    pub fn sliding(len: usize) -> ClipWindows {
        ClipWindows {
            len,
            stride: 1,
            cover_tail: false,
        }
    }

    /// Windows of `len` frames side by side, the last one ending on the last
    /// frame, so every frame is covered (validation).
    pub fn covering(len: usize) -> ClipWindows {
        ClipWindows {
            len,
            stride: len,
            cover_tail: true,
        }
    }
}

impl ClipIndex {
    /// Windows of `len` frames every `stride` frames; with `cover_tail`, a last
    /// window ending on the last frame is added when the stride skips it
    /// (validation covers every frame). Sequences shorter than `len` give no clip.
    pub fn new(index: &DatasetIndex, windows: ClipWindows) -> ClipIndex {
        let ClipWindows {
            len,
            stride,
            cover_tail,
        } = windows;
        let stride = stride.max(1);
        let mut clips = Vec::new();
        for (seq, s) in index.sequences.iter().enumerate() {
            let n = s.frames.len();
            if n < len || len == 0 {
                tracing::warn!(sequence = %s.name, frames = n, clip_len = len, "sequence shorter than a clip: not sampled");
                continue;
            }
            let mut start = 0;
            while start + len <= n {
                clips.push(ClipRef { seq, start });
                start += stride;
            }
            let last = n - len;
            if cover_tail && clips.last().is_some_and(|c| c.start != last) {
                clips.push(ClipRef { seq, start: last });
            }
        }
        ClipIndex { len, clips }
    }
}

/// Where the crop of a sample comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CropMode {
    /// A random square crop of this many RGB pixels (training).
    Random(u32),
    /// A centred square crop (`DATA.VAL_CROP_SIZE`).
    Center(u32),
    /// The whole frame (`DATA.VAL_CROP_SIZE: null`).
    Full,
    /// A given square crop at (`y`, `x`) of `size` RGB pixels (`vrtspike inspect`).
    Fixed {
        /// Top row.
        y: u32,
        /// Left column.
        x: u32,
        /// Side.
        size: u32,
    },
}

/// How samples are cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleSpec {
    /// Crop choice.
    pub crop: CropMode,
    /// Augmentation (training only; validation passes `Augment::all(false)`).
    pub augment: Augment,
    /// Voxel bins `K`.
    pub bins: u32,
}

/// One sample, ready for the model: plain f32 buffers in (L, C, h, w) order.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Frames `L`.
    pub clip_len: usize,
    /// RGB crop rows (after augmentation).
    pub height: usize,
    /// RGB crop columns (after augmentation).
    pub width: usize,
    /// Voxel bins `K`.
    pub bins: usize,
    /// Voxel rows (after augmentation).
    pub spike_height: usize,
    /// Voxel columns (after augmentation).
    pub spike_width: usize,
    /// (L, 3, h, w) in [0, 1].
    pub blur: Vec<f32>,
    /// (L, 3, h, w) in [0, 1].
    pub sharp: Vec<f32>,
    /// (L, K, h_s, w_s).
    pub voxel: Vec<f32>,
    /// Sequence name.
    pub sequence: String,
    /// Frame names of the clip.
    pub frames: Vec<String>,
    /// Crop in RGB pixels of the original frame (before augmentation).
    pub crop: Rect,
    /// Augmentation applied after cropping.
    pub transform: Dihedral,
}

impl Sample {
    /// Shape of `blur` and `sharp`.
    pub fn rgb_shape(&self) -> [usize; 4] {
        [self.clip_len, 3, self.height, self.width]
    }

    /// Shape of `voxel`.
    pub fn voxel_shape(&self) -> [usize; 4] {
        [
            self.clip_len,
            self.bins,
            self.spike_height,
            self.spike_width,
        ]
    }
}

/// The crop of a sample in RGB pixels and the matching spike region.
pub fn choose_crop(
    mode: CropMode,
    (height, width): (u32, u32),
    (spike_h, spike_w): (u32, u32),
    rng: &mut SplitMix64,
) -> Result<(Rect, SpikeRect)> {
    let (step_y, step_x) = crop_alignment(height, width, spike_h, spike_w);
    let pick = |size: u32, extent: u32, step: u32, key: &str| -> Result<u32> {
        if size > extent {
            return Err(PipelineError::Request(format!(
                "{key} = {size} is larger than the {height}x{width} frames"
            )));
        }
        if size % step != 0 {
            return Err(PipelineError::Request(format!(
                "{key} = {size} is not a multiple of {step}, the RGB step that lines up with the {spike_h}x{spike_w} spike grid"
            )));
        }
        Ok(size)
    };
    let rect = match mode {
        CropMode::Full => Rect {
            y: 0,
            x: 0,
            h: height,
            w: width,
        },
        CropMode::Random(s) | CropMode::Center(s) => {
            let key = if matches!(mode, CropMode::Random(_)) {
                "DATA.CROP_SIZE"
            } else {
                "DATA.VAL_CROP_SIZE"
            };
            let h = pick(s, height, step_y, key)?;
            let w = pick(s, width, step_x, key)?;
            let (ny, nx) = ((height - h) / step_y, (width - w) / step_x);
            let (y, x) = if matches!(mode, CropMode::Random(_)) {
                (
                    rng.below(ny as u64 + 1) as u32,
                    rng.below(nx as u64 + 1) as u32,
                )
            } else {
                (ny / 2, nx / 2)
            };
            Rect {
                y: y * step_y,
                x: x * step_x,
                h,
                w,
            }
        }
        CropMode::Fixed { y, x, size } => {
            let fixed = Rect {
                y,
                x,
                h: size,
                w: size,
            };
            let aligned =
                y % step_y == 0 && x % step_x == 0 && size % step_y == 0 && size % step_x == 0;
            if !fixed.fits(height, width) || !aligned {
                return Err(PipelineError::Request(format!(
                    "crop {y},{x},{size} must lie inside the {height}x{width} frame with y, x and size multiples of {step_y}x{step_x} (the spike grid is {spike_h}x{spike_w})"
                )));
            }
            fixed
        }
    };
    let scale = |v: u32, s: u32, full: u32| (v as u64 * s as u64 / full as u64) as u32;
    let spike = SpikeRect {
        y: scale(rect.y, spike_h, height),
        x: scale(rect.x, spike_w, width),
        h: scale(rect.h, spike_h, height),
        w: scale(rect.w, spike_w, width),
    };
    Ok((rect, spike))
}

/// Builds the sample of `clip`: crop and augmentation drawn from `rng`.
pub fn build_sample<S: RecordSource>(
    index: &DatasetIndex,
    clip: ClipRef,
    clip_len: usize,
    spec: &SampleSpec,
    rng: &mut SplitMix64,
    source: &mut S,
) -> Result<Sample> {
    let seq = index
        .sequences
        .get(clip.seq)
        .ok_or_else(|| PipelineError::Request(format!("clip {clip:?}: no such sequence")))?;
    if clip.start + clip_len > seq.frames.len() {
        return Err(PipelineError::Request(format!(
            "clip of {clip_len} frames from {} runs past the {} frames of {}",
            clip.start,
            seq.frames.len(),
            seq.name
        )));
    }
    let spike_size = (seq.spike_height, seq.spike_width);
    let (rect, region) = choose_crop(spec.crop, (seq.height, seq.width), spike_size, rng)?;
    let transform = Dihedral::random(spec.augment, rect.h == rect.w && region.h == region.w, rng);
    let (h, w) = (rect.h as usize, rect.w as usize);
    let (hs, ws) = (region.h as usize, region.w as usize);
    let bins = spec.bins as usize;
    let rgb_len = 3 * h * w;
    let vox_len = bins * hs * ws;
    let mut blur = vec![0f32; clip_len * rgb_len];
    let mut sharp = vec![0f32; clip_len * rgb_len];
    let mut voxel = vec![0f32; clip_len * vox_len];
    for j in 0..clip_len {
        let frame = clip.start + j;
        let blur_out = &mut blur[j * rgb_len..(j + 1) * rgb_len];
        let sharp_out = &mut sharp[j * rgb_len..(j + 1) * rgb_len];
        let vox_out = &mut voxel[j * vox_len..(j + 1) * vox_len];
        source.with_record(index, clip.seq, frame, &mut |view| {
            view.crop_rgb_f32(view.blur(), rect, blur_out)?;
            view.crop_rgb_f32(view.sharp(), rect, sharp_out)?;
            crop_voxels(&view, spec.bins, region, vox_out)
        })?;
    }
    let mut scratch = Vec::new();
    transform.apply_planes(&mut blur, h, w, &mut scratch);
    transform.apply_planes(&mut sharp, h, w, &mut scratch);
    transform.apply_planes(&mut voxel, hs, ws, &mut scratch);
    let (oh, ow) = transform.out_size(h, w);
    let (ohs, ows) = transform.out_size(hs, ws);
    Ok(Sample {
        clip_len,
        height: oh,
        width: ow,
        bins,
        spike_height: ohs,
        spike_width: ows,
        blur,
        sharp,
        voxel,
        sequence: seq.name.clone(),
        frames: seq.frames[clip.start..clip.start + clip_len]
            .iter()
            .map(|f| f.name.clone())
            .collect(),
        crop: rect,
        transform,
    })
}

/// The voxels of `region` from a record: voxelized from packed bits, or cropped
/// from a stored f16 grid.
pub fn crop_voxels(
    view: &RecordView<'_>,
    bins: u32,
    region: SpikeRect,
    dst: &mut [f32],
) -> Result<()> {
    let layout = view.layout;
    match layout.payload {
        SpikePayload::Bits { steps } => {
            let shape = SpikeShape {
                height: layout.spike_height,
                width: layout.spike_width,
                steps,
            };
            Ok(voxel::voxelize_region(
                view.spike(),
                shape,
                bins,
                region,
                dst,
            )?)
        }
        SpikePayload::VoxelF16 { bins: stored } => {
            if stored != bins {
                return Err(PipelineError::Request(format!(
                    "stored voxel grids have {stored} bins but DATA.SPIKE_BINS is {bins}"
                )));
            }
            let (vh, vw) = (layout.spike_height as usize, layout.spike_width as usize);
            if region.y + region.h > layout.spike_height || region.x + region.w > layout.spike_width
            {
                return Err(PipelineError::Request(format!(
                    "voxel region {region:?} outside {vh}x{vw} stored voxels"
                )));
            }
            let bytes = view.spike();
            let (rh, rw) = (region.h as usize, region.w as usize);
            for k in 0..bins as usize {
                for r in 0..rh {
                    let row = (k * vh + region.y as usize + r) * vw + region.x as usize;
                    let src = &bytes[row * 2..(row + rw) * 2];
                    let out = &mut dst[(k * rh + r) * rw..(k * rh + r + 1) * rw];
                    for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                        *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                    }
                }
            }
            Ok(())
        }
    }
}
