//! The Vidar `.dat` spike stream (format page, section 2): headerless, T frames of
//! `H_s * W_s` bits each, LSB first, rows optionally stored bottom-up. In memory a
//! stream is always kept packed and top-down, so it can be copied into a cache slot.

use std::io::{Read, Write};
use std::path::Path;

use super::error::{DataError, Result};

/// A packed spike stream, rows top-down: step `t`, pixel `i = row * width + col` is
/// bit `i % 8` of byte `t * step_bytes + i / 8`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpikeStream {
    /// Spike rows `H_s`.
    pub height: u32,
    /// Spike columns `W_s`.
    pub width: u32,
    /// Time steps `T`.
    pub steps: u32,
    /// `steps * height * width / 8` packed bytes.
    pub bits: Vec<u8>,
}

impl SpikeStream {
    /// Bytes of one step.
    pub fn step_bytes(&self) -> usize {
        step_bytes(self.height, self.width)
    }

    /// The spike at (`step`, `row`, `col`), rows top-down.
    pub fn get(&self, step: u32, row: u32, col: u32) -> bool {
        let i = step as usize * self.step_bytes() * 8 + (row * self.width + col) as usize;
        (self.bits[i / 8] >> (i % 8)) & 1 == 1
    }
}

/// Bytes of one packed step of `height x width` pixels.
pub fn step_bytes(height: u32, width: u32) -> usize {
    height as usize * width as usize / 8
}

/// The number of steps in a `.dat` file of `file_len` bytes, or a corrupt-size error
/// that names the file and the sizes.
pub fn steps_from_len(path: &Path, file_len: u64, height: u32, width: u32) -> Result<u32> {
    let per = step_bytes(height, width) as u64;
    if per == 0 || (height as u64 * width as u64) % 8 != 0 {
        return Err(DataError::format(
            path,
            format!("spike size {height}x{width} is not a positive multiple of 8 bits"),
        ));
    }
    if file_len == 0 || file_len % per != 0 {
        return Err(DataError::format(
            path,
            format!(
                "corrupt spike stream: {file_len} bytes is not a whole number of {height}x{width} frames ({per} bytes each)"
            ),
        ));
    }
    u32::try_from(file_len / per)
        .map_err(|_| DataError::format(path, format!("{file_len} bytes: too many spike steps")))
}

/// The number of steps of the `.dat` file at `path`, from its size alone.
pub fn dat_steps(path: &Path, height: u32, width: u32) -> Result<u32> {
    let len = std::fs::metadata(path)
        .map_err(|e| DataError::io(path, e))?
        .len();
    steps_from_len(path, len, height, width)
}

/// Reads a `.dat` file straight into `dst` (exactly `steps * step_bytes` long),
/// rows top-down, and returns the number of steps. `dst` of another length is a
/// size mismatch error naming the file.
pub fn read_dat_into(
    path: &Path,
    height: u32,
    width: u32,
    flipped: bool,
    dst: &mut [u8],
) -> Result<u32> {
    let mut file = std::fs::File::open(path).map_err(|e| DataError::io(path, e))?;
    let len = file.metadata().map_err(|e| DataError::io(path, e))?.len();
    let steps = steps_from_len(path, len, height, width)?;
    if len != dst.len() as u64 {
        return Err(DataError::format(
            path,
            format!(
                "spike stream is {len} bytes but {} were expected (file changed since indexing?)",
                dst.len()
            ),
        ));
    }
    file.read_exact(dst).map_err(|e| DataError::io(path, e))?;
    if flipped {
        flip_rows_in_place(dst, height, width);
    }
    Ok(steps)
}

/// Reads a whole `.dat` file.
pub fn read_dat(path: &Path, height: u32, width: u32, flipped: bool) -> Result<SpikeStream> {
    let steps = dat_steps(path, height, width)?;
    let mut bits = vec![0u8; steps as usize * step_bytes(height, width)];
    let steps = read_dat_into(path, height, width, flipped, &mut bits)?;
    Ok(SpikeStream {
        height,
        width,
        steps,
        bits,
    })
}

/// Writes `stream` as a `.dat` file, rows bottom-up when `flipped`.
pub fn write_dat(path: &Path, stream: &SpikeStream, flipped: bool) -> Result<()> {
    let mut bytes = stream.bits.clone();
    if flipped {
        flip_rows_in_place(&mut bytes, stream.height, stream.width);
    }
    let mut file = std::fs::File::create(path).map_err(|e| DataError::io(path, e))?;
    file.write_all(&bytes).map_err(|e| DataError::io(path, e))
}

/// Reverses the row order of every packed step in `bits` (an involution).
pub fn flip_rows_in_place(bits: &mut [u8], height: u32, width: u32) {
    let per = step_bytes(height, width);
    if per == 0 {
        return;
    }
    let (h, w) = (height as usize, width as usize);
    if w % 8 == 0 {
        let row = w / 8;
        for step in bits.chunks_exact_mut(per) {
            for r in 0..h / 2 {
                let (top, bottom) = step.split_at_mut((h - 1 - r) * row);
                top[r * row..(r + 1) * row].swap_with_slice(&mut bottom[..row]);
            }
        }
    } else {
        // Rows are not byte-aligned: move them bit by bit through a scratch copy.
        let mut src = vec![0u8; per];
        for step in bits.chunks_exact_mut(per) {
            src.copy_from_slice(step);
            step.fill(0);
            for r in 0..h {
                let from = (h - 1 - r) * w;
                let to = r * w;
                for c in 0..w {
                    let bit = (src[(from + c) / 8] >> ((from + c) % 8)) & 1;
                    step[(to + c) / 8] |= bit << ((to + c) % 8);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random_stream(h: u32, w: u32, t: u32, seed: u64) -> SpikeStream {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let bits = (0..t as usize * step_bytes(h, w))
            .map(|_| rng.random())
            .collect();
        SpikeStream {
            height: h,
            width: w,
            steps: t,
            bits,
        }
    }

    #[test]
    fn bit_order_is_lsb_first_row_major() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.dat");
        // 2 x 8 pixels, 1 step: byte 0 = row 0, byte 1 = row 1.
        std::fs::write(&path, [0b0000_0101u8, 0b1000_0000]).unwrap();
        let s = read_dat(&path, 2, 8, false).unwrap();
        assert!(s.get(0, 0, 0) && !s.get(0, 0, 1) && s.get(0, 0, 2));
        assert!(s.get(0, 1, 7) && !s.get(0, 1, 0));
        // Flipped: stored row 0 is image row 1.
        let s = read_dat(&path, 2, 8, true).unwrap();
        assert!(s.get(0, 1, 0) && s.get(0, 1, 2) && s.get(0, 0, 7));
        assert!(!s.get(0, 0, 0));
    }

    #[test]
    fn write_read_round_trip_aligned_and_unaligned() {
        let dir = tempfile::tempdir().unwrap();
        for &(h, w, t) in &[(6u32, 16u32, 5u32), (4, 6, 3), (8, 5, 2)] {
            let s = random_stream(h, w, t, 7);
            for flipped in [false, true] {
                let path = dir.path().join(format!("{h}_{w}_{flipped}.dat"));
                write_dat(&path, &s, flipped).unwrap();
                let back = read_dat(&path, h, w, flipped).unwrap();
                assert_eq!(back, s, "{h}x{w} flipped={flipped}");
                assert_eq!(back.steps, t);
            }
            // The stored bytes of a flipped file really are bottom-up.
            let path = dir.path().join("raw.dat");
            write_dat(&path, &s, true).unwrap();
            let raw = read_dat(&path, h, w, false).unwrap();
            for r in 0..h {
                for c in 0..w {
                    assert_eq!(raw.get(0, h - 1 - r, c), s.get(0, r, c));
                }
            }
        }
    }

    #[test]
    fn corrupt_size_names_file_and_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.dat");
        std::fs::write(&path, vec![0u8; 12 * 3 + 5]).unwrap();
        let err = read_dat(&path, 8, 12, true).unwrap_err().to_string();
        assert!(err.contains("bad.dat"), "{err}");
        assert!(
            err.contains("41 bytes") && err.contains("12 bytes each"),
            "{err}"
        );
        std::fs::write(&path, []).unwrap();
        assert!(read_dat(&path, 8, 12, true).is_err());
        let err = read_dat(&dir.path().join("none.dat"), 8, 8, false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("none.dat"), "{err}");
    }
}
