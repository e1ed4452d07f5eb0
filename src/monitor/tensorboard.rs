//! A TensorBoard event-file writer: `<dir>/events.out.tfevents.<unix time>.<host>`
//! holding scalars and PNG images, readable by the `tensorboard` Python package.
//!
//! Crate decision (issue 12): `tfrecord` 0.15 (license unstated, pins tch 0.13,
//! image 0.24, ndarray 0.15, prost 0.12), `tboard` 0.1.1 (one release, needs the
//! `protoc` binary at build time through prost-build 0.12, `anyhow` in a library) and
//! `tensorboard-rs` 0.5.9 (protobuf 2.x, which has the RUSTSEC-2024-0437 advisory,
//! image 0.23, no release in years) are all unmaintained or heavy for what is used:
//! two protobuf messages and a record framing. The framing and encoding are written
//! here ([`super::tfrecord`], about a hundred lines) and tested against the Python
//! reader (`tests/tensorboard_reader.rs`).

use std::io::Write;
use std::path::{Path, PathBuf};

use super::tfrecord::{fields, frame_record, Proto};
use super::MonitorError;

/// The `file_version` TensorBoard expects in the first event.
const FILE_VERSION: &str = "brain.Event:2";

/// An 8-bit RGB image (rows of `width * 3` bytes).
#[derive(Debug, Clone, PartialEq)]
pub struct RgbImage {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// `height * width * 3` bytes, row-major.
    pub pixels: Vec<u8>,
}

impl RgbImage {
    /// Panels of the same height placed left to right with a `gap`-pixel white
    /// border between them (e.g. blur | output | sharp); `None` if heights differ
    /// or there is no panel.
    pub fn side_by_side(panels: &[&RgbImage], gap: u32) -> Option<RgbImage> {
        let height = panels.first()?.height;
        if panels.iter().any(|p| p.height != height) {
            return None;
        }
        let width = panels.iter().map(|p| p.width).sum::<u32>()
            + gap * (panels.len() as u32).saturating_sub(1);
        let row_bytes = width as usize * 3;
        let mut pixels = vec![255u8; row_bytes * height as usize];
        let mut x0 = 0usize;
        for panel in panels {
            let panel_row = panel.width as usize * 3;
            for y in 0..height as usize {
                let src = &panel.pixels[y * panel_row..(y + 1) * panel_row];
                let start = y * row_bytes + x0 * 3;
                pixels[start..start + panel_row].copy_from_slice(src);
            }
            x0 += panel.width as usize + gap as usize;
        }
        Some(RgbImage {
            width,
            height,
            pixels,
        })
    }

    /// An image from planar CHW floats in [0, 1] (1 or 3 channels), clamped.
    pub fn from_chw(data: &[f32], channels: usize, height: u32, width: u32) -> Option<RgbImage> {
        let plane = height as usize * width as usize;
        if !(channels == 1 || channels == 3) || data.len() != channels * plane {
            return None;
        }
        let mut pixels = Vec::with_capacity(plane * 3);
        for i in 0..plane {
            for c in 0..3 {
                let v = data[(c % channels) * plane + i];
                pixels.push((v.clamp(0.0, 1.0) * 255.0).round() as u8);
            }
        }
        Some(RgbImage {
            width,
            height,
            pixels,
        })
    }

    /// The PNG file bytes.
    pub fn to_png(&self) -> Result<Vec<u8>, png::EncodingError> {
        let mut out = Vec::new();
        let mut encoder = png::Encoder::new(&mut out, self.width, self.height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        encoder.set_compression(png::Compression::Fast);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(&self.pixels)?;
        writer.finish()?;
        Ok(out)
    }
}

/// One summary value of an event.
pub enum SummaryValue<'a> {
    /// A scalar (`simple_value`).
    Scalar(&'a str, f32),
    /// A PNG image.
    Image(&'a str, &'a RgbImage),
}

/// Appends events to one event file; every call writes and flushes whole records,
/// so a reader (or a crash) never sees half an event.
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
    buffer: Vec<u8>,
}

/// This machine's host name (for the event file name), `localhost` if unknown.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty() && !h.contains('/'))
        .unwrap_or_else(|| "localhost".into())
}

fn unix_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl EventWriter {
    /// Creates `dir` and a new event file in it (the first event is the version).
    pub fn create(dir: &Path) -> Result<EventWriter, MonitorError> {
        std::fs::create_dir_all(dir).map_err(|e| MonitorError::io(dir, e))?;
        let now = unix_time();
        let base = format!("events.out.tfevents.{}.{}", now as u64, host_name());
        // A restart within the same second must not append to the previous file.
        let mut path = dir.join(&base);
        let mut n = 1;
        while path.exists() {
            path = dir.join(format!("{base}.{n}"));
            n += 1;
        }
        let file = std::fs::OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&path)
            .map_err(|e| MonitorError::io(&path, e))?;
        let mut writer = EventWriter {
            path,
            file,
            buffer: Vec::new(),
        };
        let version = Proto::default()
            .double(fields::EVENT_WALL_TIME, now)
            .bytes(fields::EVENT_FILE_VERSION, FILE_VERSION.as_bytes());
        frame_record(&version.into_bytes(), &mut writer.buffer);
        writer.flush()?;
        Ok(writer)
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Queues one event at `step` holding `values` (written by [`Self::flush`]).
    pub fn push(&mut self, step: i64, values: &[SummaryValue]) -> Result<(), MonitorError> {
        let mut summary = Proto::default();
        for value in values {
            let encoded = match value {
                SummaryValue::Scalar(tag, v) => Proto::default()
                    .bytes(fields::VALUE_TAG, tag.as_bytes())
                    .float(fields::VALUE_SIMPLE, *v),
                SummaryValue::Image(tag, image) => {
                    let png = image
                        .to_png()
                        .map_err(|e| MonitorError::Image(tag.to_string(), e.to_string()))?;
                    let message = Proto::default()
                        .int(fields::IMAGE_HEIGHT, i64::from(image.height))
                        .int(fields::IMAGE_WIDTH, i64::from(image.width))
                        .int(fields::IMAGE_COLORSPACE, 3)
                        .bytes(fields::IMAGE_ENCODED, &png);
                    Proto::default()
                        .bytes(fields::VALUE_TAG, tag.as_bytes())
                        .message(fields::VALUE_IMAGE, &message)
                }
            };
            summary = summary.message(fields::SUMMARY_VALUE, &encoded);
        }
        let event = Proto::default()
            .double(fields::EVENT_WALL_TIME, unix_time())
            .int(fields::EVENT_STEP, step)
            .message(fields::EVENT_SUMMARY, &summary);
        frame_record(&event.into_bytes(), &mut self.buffer);
        Ok(())
    }

    /// Writes the queued events in one `write` call.
    pub fn flush(&mut self) -> Result<(), MonitorError> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let result = self.file.write_all(&self.buffer);
        self.buffer.clear();
        result.map_err(|e| MonitorError::io(&self.path, e))
    }

    /// One event with `values` at `step`, written now.
    pub fn write(&mut self, step: i64, values: &[SummaryValue]) -> Result<(), MonitorError> {
        self.push(step, values)?;
        self.flush()
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            tracing::warn!(error = %e, "cannot write the last TensorBoard events");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn solid(width: u32, height: u32, v: u8) -> RgbImage {
        RgbImage {
            width,
            height,
            pixels: vec![v; (width * height * 3) as usize],
        }
    }

    #[test]
    fn side_by_side_places_panels_with_gaps() {
        let (a, b) = (solid(2, 2, 10), solid(3, 2, 20));
        let both = RgbImage::side_by_side(&[&a, &b], 1).unwrap();
        assert_eq!((both.width, both.height), (6, 2));
        let row: Vec<u8> = both.pixels[..18].iter().step_by(3).copied().collect();
        assert_eq!(row, vec![10, 10, 255, 20, 20, 20]);
        assert!(RgbImage::side_by_side(&[&a, &solid(2, 3, 0)], 1).is_none());
        assert!(RgbImage::side_by_side(&[], 1).is_none());
    }

    #[test]
    fn chw_to_rgb_clamps_and_expands_grey() {
        let img = RgbImage::from_chw(&[0.0, 1.0, 2.0, -1.0], 1, 2, 2).unwrap();
        assert_eq!(
            img.pixels,
            vec![0, 0, 0, 255, 255, 255, 255, 255, 255, 0, 0, 0]
        );
        assert!(RgbImage::from_chw(&[0.0; 5], 1, 2, 2).is_none());
        let png = img.to_png().unwrap();
        assert_eq!(&png[1..4], b"PNG");
    }

    #[test]
    fn files_are_named_and_framed() {
        let dir = tempfile::tempdir().unwrap();
        let first = EventWriter::create(dir.path()).unwrap();
        let mut second = EventWriter::create(dir.path()).unwrap();
        assert_ne!(first.path(), second.path());
        let name = second
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        second
            .write(3, &[SummaryValue::Scalar("a/b", 1.5)])
            .unwrap();
        let bytes = std::fs::read(second.path()).unwrap();
        // Two records: each 8 + 4 + payload + 4 bytes, lengths as written.
        let len0 = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let at = 16 + len0;
        let len1 = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
        assert_eq!(bytes.len(), at + 16 + len1);
    }
}
