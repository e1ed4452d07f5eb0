//! The compact cache record of one frame: a 64-byte header, u8 RGB blur and sharp
//! (H, W, 3), then the packed spike bits (T steps, rows top-down) or, for legacy
//! voxel inputs, f16 voxels (K, H_v, W_v). Its byte length is known before decoding
//! (so a cache slot can be reserved first); crops are read straight from the bytes.

use std::ops::Range;

use super::error::{DataError, Result};

/// Header bytes before the pixel data.
pub const HEADER_LEN: usize = 64;
const MAGIC: &[u8; 4] = b"VSR1";
/// The record format's version: in every header and every cache key, so records
/// of another format are never read as this one. Bump it when the layout changes.
pub const FORMAT_VERSION: u32 = 1;
const FLAG_SPIKE_BITS: u32 = 1;
const FLAG_VOXEL_F16: u32 = 2;

/// What the record holds for the spike branch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpikePayload {
    /// Packed spike bits of `steps` steps at spike resolution.
    Bits {
        /// Time steps `T`.
        steps: u32,
    },
    /// A precomputed voxel grid of `bins` planes, stored as little-endian f16.
    VoxelF16 {
        /// Voxel planes `K`.
        bins: u32,
    },
}

/// Shape of one record: everything needed to compute its size and offsets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordLayout {
    /// RGB rows `H`.
    pub height: u32,
    /// RGB columns `W`.
    pub width: u32,
    /// Spike (or voxel) rows.
    pub spike_height: u32,
    /// Spike (or voxel) columns.
    pub spike_width: u32,
    /// Spike bits or f16 voxels.
    pub payload: SpikePayload,
}

impl RecordLayout {
    /// Bytes of one RGB image.
    pub fn rgb_len(&self) -> usize {
        self.height as usize * self.width as usize * 3
    }

    /// Bytes of the spike payload.
    pub fn spike_len(&self) -> usize {
        let plane = self.spike_height as usize * self.spike_width as usize;
        match self.payload {
            SpikePayload::Bits { steps } => steps as usize * plane / 8,
            SpikePayload::VoxelF16 { bins } => bins as usize * plane * 2,
        }
    }

    /// Total bytes of the record (header included).
    pub fn byte_len(&self) -> usize {
        HEADER_LEN + 2 * self.rgb_len() + self.spike_len()
    }

    /// Where the blurred RGB bytes lie.
    pub fn blur_range(&self) -> Range<usize> {
        HEADER_LEN..HEADER_LEN + self.rgb_len()
    }

    /// Where the sharp RGB bytes lie.
    pub fn sharp_range(&self) -> Range<usize> {
        let start = HEADER_LEN + self.rgb_len();
        start..start + self.rgb_len()
    }

    /// Where the spike payload lies.
    pub fn spike_range(&self) -> Range<usize> {
        let start = HEADER_LEN + 2 * self.rgb_len();
        start..start + self.spike_len()
    }

    /// Writes the header into the first [`HEADER_LEN`] bytes of `record`, which must
    /// be exactly [`Self::byte_len`] long.
    pub fn write_header(&self, record: &mut [u8]) -> Result<()> {
        if record.len() != self.byte_len() {
            return Err(DataError::Request(format!(
                "record buffer is {} bytes, the layout needs {}",
                record.len(),
                self.byte_len()
            )));
        }
        let (flags, count) = match self.payload {
            SpikePayload::Bits { steps } => (FLAG_SPIKE_BITS, steps),
            SpikePayload::VoxelF16 { bins } => (FLAG_VOXEL_F16, bins),
        };
        let header = &mut record[..HEADER_LEN];
        header.fill(0);
        header[0..4].copy_from_slice(MAGIC);
        let fields = [
            FORMAT_VERSION,
            flags,
            self.height,
            self.width,
            self.spike_height,
            self.spike_width,
            count,
        ];
        for (i, v) in fields.iter().enumerate() {
            header[4 + 4 * i..8 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    }

    /// Reads a header back; anything inconsistent is an error naming `what` (the key).
    pub fn parse(record: &[u8], what: &str) -> Result<RecordLayout> {
        let bad = |m: String| DataError::Request(format!("cache record {what}: {m}"));
        if record.len() < HEADER_LEN || &record[0..4] != MAGIC {
            return Err(bad("not a vrtspike record (bad magic or too short)".into()));
        }
        let field = |i: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&record[4 + 4 * i..8 + 4 * i]);
            u32::from_le_bytes(b)
        };
        if field(0) != FORMAT_VERSION {
            return Err(bad(format!(
                "record version {} (expected {FORMAT_VERSION})",
                field(0)
            )));
        }
        let payload = match field(1) {
            FLAG_SPIKE_BITS => SpikePayload::Bits { steps: field(6) },
            FLAG_VOXEL_F16 => SpikePayload::VoxelF16 { bins: field(6) },
            f => return Err(bad(format!("unknown record flags {f:#x}"))),
        };
        let layout = RecordLayout {
            height: field(2),
            width: field(3),
            spike_height: field(4),
            spike_width: field(5),
            payload,
        };
        if layout.byte_len() != record.len() {
            return Err(bad(format!(
                "{} bytes, but its header describes {}",
                record.len(),
                layout.byte_len()
            )));
        }
        Ok(layout)
    }
}

/// A rectangle in RGB pixels (`y`, `x` top-left; `h` x `w`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rect {
    /// Top row.
    pub y: u32,
    /// Left column.
    pub x: u32,
    /// Rows.
    pub h: u32,
    /// Columns.
    pub w: u32,
}

impl Rect {
    /// Whether the rectangle lies inside a `height x width` image.
    pub fn fits(&self, height: u32, width: u32) -> bool {
        self.h > 0
            && self.w > 0
            && self.y as u64 + self.h as u64 <= height as u64
            && self.x as u64 + self.w as u64 <= width as u64
    }
}

/// `v / 255` for every byte value (exactly what `x.float() / 255` gives in torch).
fn unit_lut() -> &'static [f32; 256] {
    static LUT: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    LUT.get_or_init(|| std::array::from_fn(|v| v as f32 / 255.0))
}

/// A borrowed record: parses the header and reads crops without copying the record.
#[derive(Debug, Clone, Copy)]
pub struct RecordView<'a> {
    /// The record's shape.
    pub layout: RecordLayout,
    bytes: &'a [u8],
}

impl<'a> RecordView<'a> {
    /// Borrows `bytes` as a record; `what` names it in errors (e.g. the cache key).
    pub fn parse(bytes: &'a [u8], what: &str) -> Result<RecordView<'a>> {
        let layout = RecordLayout::parse(bytes, what)?;
        Ok(RecordView { layout, bytes })
    }

    /// Blurred RGB (H, W, 3).
    pub fn blur(&self) -> &'a [u8] {
        &self.bytes[self.layout.blur_range()]
    }

    /// Sharp RGB (H, W, 3).
    pub fn sharp(&self) -> &'a [u8] {
        &self.bytes[self.layout.sharp_range()]
    }

    /// The spike payload bytes (packed bits or f16 voxels).
    pub fn spike(&self) -> &'a [u8] {
        &self.bytes[self.layout.spike_range()]
    }

    /// Writes the crop `rect` of an RGB image (H, W, 3 bytes) as f32 in [0, 1],
    /// channel-major (3, h, w), into `dst`.
    pub fn crop_rgb_f32(&self, rgb: &[u8], rect: Rect, dst: &mut [f32]) -> Result<()> {
        let (height, width) = (self.layout.height, self.layout.width);
        if !rect.fits(height, width) {
            return Err(DataError::Request(format!(
                "crop {rect:?} outside a {height}x{width} frame"
            )));
        }
        let plane = rect.h as usize * rect.w as usize;
        if dst.len() != 3 * plane || rgb.len() != self.layout.rgb_len() {
            return Err(DataError::Request(format!(
                "crop buffer of {} floats for 3x{}x{}",
                dst.len(),
                rect.h,
                rect.w
            )));
        }
        let (r_out, rest) = dst.split_at_mut(plane);
        let (g_out, b_out) = rest.split_at_mut(plane);
        let w = rect.w as usize;
        let scale = unit_lut();
        for row in 0..rect.h as usize {
            let src_start = ((rect.y as usize + row) * width as usize + rect.x as usize) * 3;
            let src = &rgb[src_start..src_start + 3 * w];
            let o = row * w;
            for (c, px) in src.chunks_exact(3).enumerate() {
                r_out[o + c] = scale[px[0] as usize];
                g_out[o + c] = scale[px[1] as usize];
                b_out[o + c] = scale[px[2] as usize];
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gopro() -> RecordLayout {
        RecordLayout {
            height: 720,
            width: 1280,
            spike_height: 360,
            spike_width: 640,
            payload: SpikePayload::Bits { steps: 88 },
        }
    }

    #[test]
    fn gopro_frame_fits_ten_megabytes() {
        let layout = gopro();
        // 2 x 720*1280*3 RGB + 88 * 360*640/8 spike bytes + header.
        assert_eq!(layout.byte_len(), 64 + 5_529_600 + 2_534_400);
        assert!(layout.byte_len() <= 10_000_000);
        // The f32 layout it replaces: blur + sharp + 32-bin voxel at RGB size.
        let f32_bytes = (3 + 3 + 32) * 720 * 1280 * 4;
        assert!(f32_bytes / layout.byte_len() >= 16);
    }

    #[test]
    fn header_round_trip_and_ranges_tile_the_record() {
        for payload in [
            SpikePayload::Bits { steps: 56 },
            SpikePayload::VoxelF16 { bins: 32 },
        ] {
            let layout = RecordLayout {
                height: 8,
                width: 12,
                spike_height: 4,
                spike_width: 6,
                payload,
            };
            let mut buf = vec![0xAAu8; layout.byte_len()];
            layout.write_header(&mut buf).unwrap();
            assert_eq!(RecordLayout::parse(&buf, "k").unwrap(), layout);
            assert_eq!(layout.blur_range().start, HEADER_LEN);
            assert_eq!(layout.blur_range().end, layout.sharp_range().start);
            assert_eq!(layout.sharp_range().end, layout.spike_range().start);
            assert_eq!(layout.spike_range().end, layout.byte_len());
            let err = RecordLayout::parse(&buf[..buf.len() - 1], "key/1")
                .unwrap_err()
                .to_string();
            assert!(err.contains("key/1"), "{err}");
            assert!(layout.write_header(&mut buf[1..]).is_err());
        }
    }

    #[test]
    fn rgb_crop_is_channel_major_and_scaled() {
        let layout = RecordLayout {
            height: 4,
            width: 5,
            spike_height: 2,
            spike_width: 4,
            payload: SpikePayload::Bits { steps: 1 },
        };
        let mut buf = vec![0u8; layout.byte_len()];
        layout.write_header(&mut buf).unwrap();
        for (i, b) in buf[layout.blur_range()].iter_mut().enumerate() {
            *b = i as u8;
        }
        let view = RecordView::parse(&buf, "k").unwrap();
        let rect = Rect {
            y: 1,
            x: 2,
            h: 2,
            w: 3,
        };
        let mut out = vec![0f32; 18];
        view.crop_rgb_f32(view.blur(), rect, &mut out).unwrap();
        for ch in 0..3 {
            for r in 0..2 {
                for c in 0..3 {
                    let src = ((1 + r) * 5 + 2 + c) * 3 + ch;
                    assert_eq!(out[ch * 6 + r * 3 + c], src as f32 / 255.0);
                }
            }
        }
        let outside = Rect {
            y: 3,
            x: 0,
            h: 2,
            w: 1,
        };
        assert!(view
            .crop_rgb_f32(view.blur(), outside, &mut out[..6])
            .is_err());
    }
}
