//! The synthetic GoPro-Spike generator (format page, section 3): periodic textured
//! scenes moving at sub-frame rate, blur = mean of N in {7, 11, 13} sub-frames,
//! sharp = the middle one, integrate-and-fire spikes at half resolution with 8
//! steps a sub-frame. Deterministic for a seed; written as the folder layout
//! ([`folder`]) or as HDF5 sessions ([`h5`]). Sits on `dataset` (its formats and
//! error) and `util`; nothing below it imports it.

pub mod folder;
pub mod h5;
pub mod voxels;

use std::collections::BTreeMap;
use std::path::Path;

use rayon::prelude::*;

use crate::dataset::dat::SpikeStream;
use crate::dataset::error::{DataError, Result};
use crate::dataset::image::RgbImage;
use crate::dataset::meta::DatasetMeta;
use crate::util::rng::SplitMix64;

pub use folder::write_sequence_folder;
pub use voxels::write_precomputed_voxels;

/// Spike steps per sharp sub-frame.
pub const STEPS_PER_SUBFRAME: u32 = 8;
/// Integrate-and-fire threshold.
pub const THETA: f32 = 2.0;
/// Sub-frames per blurred frame, as in GoPro.
pub const SUBFRAME_CHOICES: [u32; 3] = [7, 11, 13];
/// Most sub-frames a blurred frame may average.
pub const MAX_SUBFRAMES: u32 = 64;

/// How many sharp sub-frames each sequence's blurred frames average (so how many
/// spike steps, and how many bytes, its records have).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum BlurLengths {
    /// Drawn per sequence from [`SUBFRAME_CHOICES`] by its seed.
    #[default]
    Drawn,
    /// The n-th sequence of each split averages `lengths[n % lengths.len()]`: for
    /// example `[7, 7, 7, 7, 7, 7, 7, 13]`, seven short blurs and one long.
    Cycle(Vec<u32>),
}

impl BlurLengths {
    /// The lengths given in turn; each must be 1 to [`MAX_SUBFRAMES`].
    pub fn cycle(lengths: Vec<u32>) -> Result<BlurLengths> {
        if lengths.is_empty() {
            return Err(DataError::Request(
                "blur lengths: give at least one number of sub-frames".into(),
            ));
        }
        if let Some(bad) = lengths.iter().find(|&&n| n == 0 || n > MAX_SUBFRAMES) {
            return Err(DataError::Request(format!(
                "blur length {bad}: a blurred frame averages 1 to {MAX_SUBFRAMES} sharp sub-frames"
            )));
        }
        Ok(BlurLengths::Cycle(lengths))
    }

    /// The sub-frames of the `n`-th sequence of a split; `None`: drawn by its seed.
    pub fn of_sequence(&self, n: usize) -> Option<u32> {
        match self {
            BlurLengths::Drawn => None,
            BlurLengths::Cycle(lengths) => lengths.get(n % lengths.len().max(1)).copied(),
        }
    }
}

/// What to generate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SynthOptions {
    /// Training sequences.
    pub train_seqs: u32,
    /// Test sequences.
    pub test_seqs: u32,
    /// Blurred frames per sequence.
    pub frames: u32,
    /// RGB rows (even; spikes are at half resolution).
    pub height: u32,
    /// RGB columns (even).
    pub width: u32,
    /// Seed: same seed, same bytes.
    pub seed: u64,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            train_seqs: 2,
            test_seqs: 1,
            frames: 12,
            height: 128,
            width: 192,
            seed: 0,
        }
    }
}

impl SynthOptions {
    /// The small set the training tests run on: 2 training sequences and 1 test
    /// sequence of 6 frames at 64 x 96.
    pub fn small(seed: u64) -> SynthOptions {
        SynthOptions {
            train_seqs: 2,
            test_seqs: 1,
            frames: 6,
            height: 64,
            width: 96,
            seed,
        }
    }

    /// Spike grid size (half the RGB size).
    pub fn spike_size(&self) -> (u32, u32) {
        (self.height / 2, self.width / 2)
    }

    fn validate(&self) -> Result<()> {
        let (hs, ws) = self.spike_size();
        if self.height < 16 || self.width < 16 || self.height % 2 != 0 || self.width % 2 != 0 {
            return Err(DataError::Request(format!(
                "synthetic frames must be even sizes of at least 16, got {}x{}",
                self.height, self.width
            )));
        }
        if (hs as u64 * ws as u64) % 8 != 0 {
            return Err(DataError::Request(format!(
                "spike grid {hs}x{ws} (half of {}x{}) must hold a multiple of 8 pixels",
                self.height, self.width
            )));
        }
        if self.frames == 0 || self.train_seqs + self.test_seqs == 0 {
            return Err(DataError::Request(
                "need at least one frame and one sequence".into(),
            ));
        }
        Ok(())
    }
}

/// One generated sequence, in memory.
#[derive(Debug, Clone)]
pub struct SyntheticSequence {
    /// Folder name.
    pub name: String,
    /// Sharp sub-frames averaged per blur.
    pub subframes: u32,
    /// Blurred frames.
    pub blur: Vec<RgbImage>,
    /// Sharp frames (the middle sub-frame of each blur).
    pub sharp: Vec<RgbImage>,
    /// Spike streams, `8 * subframes` steps each.
    pub spikes: Vec<SpikeStream>,
}

/// A periodic RGB texture: sinusoids plus hard-edged discs, so there is detail to blur.
struct Texture {
    height: usize,
    width: usize,
    rgb: Vec<f32>,
}

impl Texture {
    fn new(height: usize, width: usize, rng: &mut SplitMix64) -> Texture {
        let tau = std::f32::consts::TAU;
        let mut waves = Vec::new();
        for _ in 0..4 {
            let fy = (1 + rng.below(6)) as f32;
            let fx = (1 + rng.below(6)) as f32;
            let phase = rng.unit_f32() * tau;
            let amp: [f32; 3] = std::array::from_fn(|_| 0.05 + 0.1 * rng.unit_f32());
            waves.push((fy, fx, phase, amp));
        }
        let discs: Vec<(f32, f32, f32, [f32; 3])> = (0..12)
            .map(|_| {
                let r = (0.04 + 0.12 * rng.unit_f32()) * height.min(width) as f32;
                let colour = std::array::from_fn(|_| rng.unit_f32());
                (
                    rng.unit_f32() * height as f32,
                    rng.unit_f32() * width as f32,
                    r,
                    colour,
                )
            })
            .collect();
        let mut rgb = vec![0f32; height * width * 3];
        rgb.par_chunks_mut(width * 3)
            .enumerate()
            .for_each(|(y, row)| {
                for x in 0..width {
                    let (v, u) = (y as f32 / height as f32, x as f32 / width as f32);
                    let mut px = [0.45f32; 3];
                    for (fy, fx, phase, amp) in &waves {
                        let s = (tau * (fy * v + fx * u) + phase).sin();
                        for c in 0..3 {
                            px[c] += amp[c] * s;
                        }
                    }
                    for (cy, cx, r, colour) in &discs {
                        // Wrap-around distance keeps the texture periodic.
                        let dy = (y as f32 - cy).abs();
                        let dx = (x as f32 - cx).abs();
                        let dy = dy.min(height as f32 - dy);
                        let dx = dx.min(width as f32 - dx);
                        if dy * dy + dx * dx < r * r {
                            px = *colour;
                        }
                    }
                    for c in 0..3 {
                        row[x * 3 + c] = px[c].clamp(0.0, 1.0);
                    }
                }
            });
        Texture { height, width, rgb }
    }

    /// Renders the texture shifted by (`dy`, `dx`) pixels (bilinear, wrapping).
    fn render(&self, dy: f32, dx: f32, out: &mut [f32]) {
        let (h, w) = (self.height, self.width);
        let fy = dy.rem_euclid(h as f32);
        let fx = dx.rem_euclid(w as f32);
        let (iy, ix) = (fy.floor() as usize, fx.floor() as usize);
        let (ty, tx) = (fy - iy as f32, fx - ix as f32);
        out.par_chunks_mut(w * 3).enumerate().for_each(|(y, row)| {
            let y0 = (y + iy) % h;
            let y1 = (y0 + 1) % h;
            for x in 0..w {
                let x0 = (x + ix) % w;
                let x1 = (x0 + 1) % w;
                for c in 0..3 {
                    let p = |yy: usize, xx: usize| self.rgb[(yy * w + xx) * 3 + c];
                    let top = p(y0, x0) * (1.0 - tx) + p(y0, x1) * tx;
                    let bottom = p(y1, x0) * (1.0 - tx) + p(y1, x1) * tx;
                    row[x * 3 + c] = top * (1.0 - ty) + bottom * ty;
                }
            }
        });
    }
}

fn to_u8(rgb: &[f32], height: u32, width: u32) -> RgbImage {
    RgbImage {
        height,
        width,
        data: rgb
            .iter()
            .map(|v| (v.clamp(0.0, 1.0) * 255.0).round() as u8)
            .collect(),
    }
}

/// Grey (0.299 R + 0.587 G + 0.114 B) area-averaged down by 2 in each direction.
fn grey_half(rgb: &[f32], height: usize, width: usize, out: &mut [f32]) {
    let ws = width / 2;
    out.par_chunks_mut(ws).enumerate().for_each(|(ys, row)| {
        for (xs, o) in row.iter_mut().enumerate() {
            let mut sum = 0.0;
            for (dy, dx) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                let i = ((2 * ys + dy) * width + 2 * xs + dx) * 3;
                sum += 0.299 * rgb[i] + 0.587 * rgb[i + 1] + 0.114 * rgb[i + 2];
            }
            *o = sum / 4.0;
        }
    });
    debug_assert_eq!(out.len(), (height / 2) * ws);
}

/// Generates one sequence (index `index` of a split seeded by `seed`): `subframes`
/// sharp sub-frames a blur when given, else a blur length drawn by the seed (the
/// scene and motion are those of the seed either way).
pub fn generate_sequence(
    name: &str,
    frames: u32,
    height: u32,
    width: u32,
    seed: u64,
    subframes: Option<u32>,
) -> SyntheticSequence {
    let mut rng = SplitMix64::new(seed);
    let drawn = SUBFRAME_CHOICES[rng.below(3) as usize];
    let subframes = subframes.unwrap_or(drawn);
    let (h, w) = (height as usize, width as usize);
    let (hs, ws) = (h / 2, w / 2);
    let texture = Texture::new(h, w, &mut rng);
    // Camera motion: a constant drift plus a slow wobble, in pixels a sub-frame.
    let vy = (rng.unit_f32() - 0.5) * 3.0;
    let vx = (rng.unit_f32() - 0.5) * 3.0 + 0.5;
    let wobble = rng.unit_f32() * 1.5;
    let position = |s: u32| {
        let t = s as f32;
        (
            vy * t + wobble * (t * 0.21).sin(),
            vx * t + wobble * (t * 0.17).cos(),
        )
    };
    let mut accumulator: Vec<f32> = (0..hs * ws).map(|_| rng.unit_f32() * THETA).collect();
    let mut current = vec![0f32; h * w * 3];
    let mut next = vec![0f32; h * w * 3];
    let mut grey_now = vec![0f32; hs * ws];
    let mut grey_next = vec![0f32; hs * ws];
    let mut blur_sum = vec![0f32; h * w * 3];
    let (y0, x0) = position(0);
    texture.render(y0, x0, &mut current);
    grey_half(&current, h, w, &mut grey_now);
    let steps = subframes * STEPS_PER_SUBFRAME;
    let step_bytes = hs * ws / 8;
    let mut seq = SyntheticSequence {
        name: name.to_owned(),
        subframes,
        blur: Vec::new(),
        sharp: Vec::new(),
        spikes: Vec::new(),
    };
    for f in 0..frames {
        blur_sum.fill(0.0);
        let mut bits = vec![0u8; steps as usize * step_bytes];
        let mut sharp = None;
        for k in 0..subframes {
            let s = f * subframes + k;
            for (acc, v) in blur_sum.iter_mut().zip(&current) {
                *acc += v;
            }
            if k == subframes / 2 {
                sharp = Some(to_u8(&current, height, width));
            }
            let (ny, nx) = position(s + 1);
            texture.render(ny, nx, &mut next);
            grey_half(&next, h, w, &mut grey_next);
            for j in 0..STEPS_PER_SUBFRAME {
                let a = j as f32 / STEPS_PER_SUBFRAME as f32;
                let step = (k * STEPS_PER_SUBFRAME + j) as usize;
                let plane = &mut bits[step * step_bytes..(step + 1) * step_bytes];
                for (i, acc) in accumulator.iter_mut().enumerate() {
                    *acc += (1.0 - a) * grey_now[i] + a * grey_next[i];
                    if *acc >= THETA {
                        *acc -= THETA;
                        plane[i / 8] |= 1 << (i % 8);
                    }
                }
            }
            std::mem::swap(&mut current, &mut next);
            std::mem::swap(&mut grey_now, &mut grey_next);
        }
        let inv = 1.0 / subframes as f32;
        blur_sum.iter_mut().for_each(|v| *v *= inv);
        seq.blur.push(to_u8(&blur_sum, height, width));
        if let Some(sharp) = sharp {
            seq.sharp.push(sharp);
        }
        seq.spikes.push(SpikeStream {
            height: hs as u32,
            width: ws as u32,
            steps,
            bits,
        });
    }
    seq
}

/// The sequences to generate: (split, name, seed, its number within the split), in
/// a fixed order.
fn sequences(options: &SynthOptions) -> Vec<(&'static str, String, u64, usize)> {
    let mut out = Vec::new();
    let splits = [
        ("train", options.train_seqs, 1u64, ""),
        ("test", options.test_seqs, 2, "T"),
    ];
    for (split, count, salt, tag) in splits {
        for i in 0..count {
            let seed = SplitMix64::from_parts(&[options.seed, salt, i as u64]).next_u64();
            // Names are unique across splits (dataset.yaml's blur_frames is keyed by name).
            out.push((
                split,
                format!("SYN{:02}_{tag}{i:03}", options.seed % 100),
                seed,
                i as usize,
            ));
        }
    }
    out
}

/// How a synthetic dataset is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// The folder layout: `<out>/<split>/<SEQ>/` with images and `.dat` spike files.
    Folder,
    /// HDF5 sessions `<out>/<split>/<SEQ>.h5` (the same data, the same bytes).
    H5,
}

/// Writes a whole synthetic dataset in the folder layout under `out`, calling
/// `progress` after each sequence. Returns the metadata written.
pub fn generate_folder(
    out: &Path,
    options: &SynthOptions,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<DatasetMeta> {
    generate(out, options, &BlurLengths::Drawn, progress, Layout::Folder)
}

/// Writes a whole synthetic dataset in `layout` under `out`, the blur length of each
/// sequence set by `blur`, calling `progress` after each sequence. Returns the
/// metadata written (with a `dataset.yaml` beside the splits).
pub fn generate(
    out: &Path,
    options: &SynthOptions,
    blur: &BlurLengths,
    progress: &(dyn Fn(&str) + Sync),
    layout: Layout,
) -> Result<DatasetMeta> {
    options.validate()?;
    let (hs, ws) = options.spike_size();
    std::fs::create_dir_all(out).map_err(|e| DataError::io(out, e))?;
    let mut blur_frames = BTreeMap::new();
    for (split, name, seed, n) in sequences(options) {
        let (frames, height, width) = (options.frames, options.height, options.width);
        let subframes = blur.of_sequence(n);
        let seq = generate_sequence(&name, frames, height, width, seed, subframes);
        let split_dir = out.join(split);
        if layout == Layout::H5 {
            std::fs::create_dir_all(&split_dir).map_err(|e| DataError::io(&split_dir, e))?;
            h5::write_session(&split_dir.join(format!("{name}.h5")), &seq)?;
        } else {
            write_sequence_folder(&split_dir, &seq, true)?;
        }
        blur_frames.insert(name.clone(), seq.subframes);
        progress(&name);
    }
    let meta = DatasetMeta {
        spike_height: hs,
        spike_width: ws,
        // Rows of `.dat` files are stored bottom-up; HDF5 sessions are top-down.
        spike_flipped: layout == Layout::Folder,
        blur_frames,
    };
    meta.save(out)?;
    Ok(meta)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_follows_the_format_page() {
        let seq = generate_sequence("s", 3, 32, 48, 11, None);
        assert!(SUBFRAME_CHOICES.contains(&seq.subframes));
        assert_eq!(seq.blur.len(), 3);
        assert_eq!(seq.sharp.len(), 3);
        for s in &seq.spikes {
            assert_eq!((s.height, s.width, s.steps), (16, 24, 8 * seq.subframes));
            // theta = 2 and intensities in [0, 1]: a pixel fires at most every 2 steps
            // and rarely never; the rate tracks mean intensity / theta.
            let fired: u32 = s.bits.iter().map(|b| b.count_ones()).sum();
            let rate = fired as f32 / (s.steps * 16 * 24) as f32;
            assert!(rate > 0.05 && rate <= 0.5 + 1e-6, "spike rate {rate}");
        }
        // Motion: blur differs from sharp; same seed, same bytes; other seed differs.
        assert_ne!(seq.blur[0], seq.sharp[0]);
        let again = generate_sequence("s", 3, 32, 48, 11, None);
        assert_eq!(again.blur, seq.blur);
        assert_eq!(again.spikes, seq.spikes);
        assert_ne!(
            generate_sequence("s", 1, 32, 48, 12, None).sharp[0],
            seq.sharp[0]
        );
    }

    #[test]
    fn blur_lengths_cycle_per_sequence_and_keep_the_scene() {
        let lengths = BlurLengths::cycle(vec![7, 7, 13]).unwrap();
        assert_eq!(
            (0..5).map(|n| lengths.of_sequence(n)).collect::<Vec<_>>(),
            vec![Some(7), Some(7), Some(13), Some(7), Some(7)]
        );
        assert_eq!(BlurLengths::Drawn.of_sequence(3), None);
        for bad in [vec![], vec![7, 0], vec![65]] {
            let err = BlurLengths::cycle(bad.clone()).unwrap_err().to_string();
            assert!(err.contains("blur length"), "{bad:?}: {err}");
        }
        // Forced to 13: 104 spike steps a frame, and the same first sub-frame of the
        // scene (the middle one differs: it is the sharp target).
        let drawn = generate_sequence("s", 1, 32, 48, 11, None);
        let forced = generate_sequence("s", 1, 32, 48, 11, Some(13));
        assert_eq!((forced.subframes, forced.spikes[0].steps), (13, 104));
        let short = generate_sequence("s", 1, 32, 48, 11, Some(1));
        assert_eq!(short.blur[0], short.sharp[0], "one sub-frame: no blur");
        let same = generate_sequence("s", 1, 32, 48, 11, Some(drawn.subframes));
        assert_eq!(
            same.blur, drawn.blur,
            "forcing the drawn length changes nothing"
        );
    }

    #[test]
    fn spike_rate_follows_brightness() {
        let seq = generate_sequence("s", 2, 32, 48, 5, None);
        let s = &seq.spikes[1];
        // Mean grey of the sharp frame vs. spike rate * theta: close on average.
        let grey: f32 = seq.sharp[1]
            .data
            .chunks_exact(3)
            .map(|p| 0.299 * p[0] as f32 + 0.587 * p[1] as f32 + 0.114 * p[2] as f32)
            .sum::<f32>()
            / (32.0 * 48.0 * 255.0);
        let fired: u32 = s.bits.iter().map(|b| b.count_ones()).sum();
        let rate = fired as f32 / (s.steps * 16 * 24) as f32;
        assert!(
            (rate * THETA - grey).abs() < 0.08,
            "rate {rate} grey {grey}"
        );
    }
}
