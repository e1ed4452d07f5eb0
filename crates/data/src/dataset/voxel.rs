//! The voxel grid (format page, section 4) computed straight from packed spike
//! bits, for one crop region only: step `t` goes to bin `floor(t * K / T)` and a bin
//! holds its spike count divided by its number of steps. Counts are exact integers,
//! so the result equals a plain full-frame voxelization cropped afterwards.

use std::ops::Range;

use rayon::prelude::*;

use super::error::{DataError, Result};

/// A region at spike resolution (`y`, `x` top-left; `h` x `w`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpikeRect {
    /// Top row.
    pub y: u32,
    /// Left column.
    pub x: u32,
    /// Rows.
    pub h: u32,
    /// Columns.
    pub w: u32,
}

/// Shape of a packed spike stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpikeShape {
    /// Rows `H_s`.
    pub height: u32,
    /// Columns `W_s`.
    pub width: u32,
    /// Steps `T`.
    pub steps: u32,
}

/// Regions with at least this many step-pixels are split over rayon's pool
/// (smaller crops stay on the calling loader thread, which is already parallel).
const PARALLEL_MIN_WORK: usize = 1 << 23;

/// The steps of bin `k` of `bins` over `steps` steps.
pub fn bin_steps(k: u32, bins: u32, steps: u32) -> Range<u32> {
    let (k, bins, steps) = (k as u64, bins as u64, steps as u64);
    let start = (k * steps).div_ceil(bins);
    let end = ((k + 1) * steps).div_ceil(bins);
    start as u32..end as u32
}

/// Adds 1.0 to `out[c]` for each set bit `c` in `bits[start .. start + out.len()]`.
fn add_row_bits(bits: &[u8], start: usize, out: &mut [f32]) {
    let len = out.len();
    let mut c = 0;
    while c < len {
        let pos = start + c;
        let shift = pos & 7;
        let take = (8 - shift).min(len - c);
        let mut byte = (bits[pos >> 3] >> shift) as u32 & ((1u32 << take) - 1);
        while byte != 0 {
            let tz = byte.trailing_zeros() as usize;
            out[c + tz] += 1.0;
            byte &= byte - 1;
        }
        c += take;
    }
}

fn voxelize_plane(
    bits: &[u8],
    shape: SpikeShape,
    region: SpikeRect,
    steps: Range<u32>,
    out: &mut [f32],
) {
    out.fill(0.0);
    let plane_bits = shape.height as usize * shape.width as usize;
    let w = region.w as usize;
    let n = steps.len();
    for t in steps {
        for r in 0..region.h as usize {
            let start = t as usize * plane_bits
                + (region.y as usize + r) * shape.width as usize
                + region.x as usize;
            add_row_bits(bits, start, &mut out[r * w..(r + 1) * w]);
        }
    }
    if n > 1 {
        let n = n as f32;
        for v in out.iter_mut() {
            *v /= n;
        }
    }
}

/// Voxelizes `region` of a packed stream into `dst` (`bins` x `region.h` x
/// `region.w` f32, bin-major). Errors on a region outside the stream, a short
/// `bits` slice or a wrong `dst` length.
pub fn voxelize_region(
    bits: &[u8],
    shape: SpikeShape,
    bins: u32,
    region: SpikeRect,
    dst: &mut [f32],
) -> Result<()> {
    let plane_bits = shape.height as usize * shape.width as usize;
    if bins == 0
        || region.h == 0
        || region.w == 0
        || region.y as u64 + region.h as u64 > shape.height as u64
        || region.x as u64 + region.w as u64 > shape.width as u64
    {
        return Err(DataError::Request(format!(
            "voxel region {region:?} with {bins} bins does not fit a {}x{} spike frame",
            shape.height, shape.width
        )));
    }
    if bits.len() * 8 < shape.steps as usize * plane_bits {
        return Err(DataError::Request(format!(
            "{} spike bytes for {} steps of {}x{}",
            bits.len(),
            shape.steps,
            shape.height,
            shape.width
        )));
    }
    let plane = region.h as usize * region.w as usize;
    if dst.len() != bins as usize * plane {
        return Err(DataError::Request(format!(
            "voxel buffer of {} floats for {bins}x{}x{}",
            dst.len(),
            region.h,
            region.w
        )));
    }
    let work = shape.steps as usize * plane;
    let plane_of = |(k, out): (usize, &mut [f32])| {
        let steps = bin_steps(k as u32, bins, shape.steps);
        voxelize_plane(bits, shape, region, steps, out);
    };
    if work >= PARALLEL_MIN_WORK {
        dst.par_chunks_mut(plane).enumerate().for_each(plane_of);
    } else {
        dst.chunks_mut(plane).enumerate().for_each(plane_of);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Plain reference: unpack every bit, voxelize the whole frame, then crop.
    fn reference(bits: &[u8], s: SpikeShape, bins: u32, r: SpikeRect) -> Vec<f32> {
        let (h, w, t) = (s.height as usize, s.width as usize, s.steps as usize);
        let k = bins as usize;
        let mut sums = vec![0f32; k * h * w];
        let mut width = vec![0u32; k];
        for step in 0..t {
            let bin = step * k / t;
            width[bin] += 1;
            for i in 0..h * w {
                let bit = step * h * w + i;
                if (bits[bit / 8] >> (bit % 8)) & 1 == 1 {
                    sums[bin * h * w + i] += 1.0;
                }
            }
        }
        let mut out = Vec::new();
        for b in 0..k {
            for y in r.y as usize..(r.y + r.h) as usize {
                for x in r.x as usize..(r.x + r.w) as usize {
                    out.push(sums[b * h * w + y * w + x] / width[b].max(1) as f32);
                }
            }
        }
        out
    }

    fn check(shape: SpikeShape, bins: u32, region: SpikeRect, seed: u64, density: f64) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let n = shape.steps as usize * shape.height as usize * shape.width as usize / 8;
        let bits: Vec<u8> = (0..n)
            .map(|_| (0..8).fold(0u8, |b, i| b | ((rng.random_bool(density) as u8) << i)))
            .collect();
        let mut got = vec![f32::NAN; (bins * region.h * region.w) as usize];
        voxelize_region(&bits, shape, bins, region, &mut got).unwrap();
        assert_eq!(
            got,
            reference(&bits, shape, bins, region),
            "{shape:?} {bins} {region:?}"
        );
    }

    #[test]
    fn bins_partition_the_steps() {
        for (t, k) in [(56, 32), (88, 32), (104, 32), (5, 8), (32, 32)] {
            let mut next = 0;
            for b in 0..k {
                let r = bin_steps(b, k, t);
                assert_eq!(r.start, next);
                for s in r.clone() {
                    assert_eq!(s * k / t, b);
                }
                next = r.end;
            }
            assert_eq!(next, t);
        }
        // T = 56, K = 32: widths of 1 and 2 steps.
        let widths: Vec<usize> = (0..32).map(|b| bin_steps(b, 32, 56).len()).collect();
        assert!(widths.contains(&1) && widths.contains(&2));
    }

    #[test]
    fn matches_reference_on_random_streams() {
        let shape = |h, w, t| SpikeShape {
            height: h,
            width: w,
            steps: t,
        };
        let rect = |y, x, h, w| SpikeRect { y, x, h, w };
        // Uneven bins (T = 56), GoPro's T = 88, unaligned crops and widths.
        check(shape(16, 24, 56), 32, rect(3, 5, 9, 13), 1, 0.3);
        check(shape(16, 24, 88), 32, rect(0, 0, 16, 24), 2, 0.5);
        check(shape(10, 20, 56), 32, rect(1, 7, 8, 11), 3, 0.9);
        check(shape(6, 12, 104), 16, rect(2, 1, 3, 10), 4, 0.1);
        // Fewer steps than bins: empty bins are zero.
        check(shape(8, 8, 5), 8, rect(0, 0, 8, 8), 5, 0.5);
        // Unaligned width (rows not byte-aligned).
        check(shape(8, 5, 24), 8, rect(1, 1, 6, 4), 6, 0.5);
    }

    #[test]
    fn parallel_path_matches_reference() {
        // 56 steps x 384 x 400 pixels is above the parallel threshold.
        let shape = SpikeShape {
            height: 400,
            width: 384,
            steps: 56,
        };
        const { assert!(56 * 384 * 400 >= PARALLEL_MIN_WORK) };
        check(
            shape,
            32,
            SpikeRect {
                y: 0,
                x: 0,
                h: 400,
                w: 384,
            },
            7,
            0.25,
        );
    }

    #[test]
    fn bad_regions_are_errors() {
        let shape = SpikeShape {
            height: 8,
            width: 8,
            steps: 4,
        };
        let bits = vec![0u8; 32];
        let mut dst = vec![0f32; 4 * 16];
        let region = SpikeRect {
            y: 6,
            x: 0,
            h: 4,
            w: 4,
        };
        assert!(voxelize_region(&bits, shape, 4, region, &mut dst).is_err());
        let region = SpikeRect {
            y: 0,
            x: 0,
            h: 4,
            w: 4,
        };
        assert!(voxelize_region(&bits[..8], shape, 4, region, &mut dst).is_err());
        assert!(voxelize_region(&bits, shape, 4, region, &mut dst[..10]).is_err());
        voxelize_region(&bits, shape, 4, region, &mut dst).unwrap();
    }
}
