//! 8-bit RGB PNG frames: header-only size probes (for indexing), decoding straight
//! into a caller's buffer (a cache slot), and writing (the synthetic generator).
//! Grey, palette, alpha and 16-bit PNGs are converted to 8-bit RGB on read.

use std::io::BufReader;
use std::path::Path;

use png::{ColorType, Transformations};

use super::error::{DataError, Result};

/// An 8-bit RGB image, rows top-down, pixels interleaved (H, W, 3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    /// Rows.
    pub height: u32,
    /// Columns.
    pub width: u32,
    /// `height * width * 3` bytes.
    pub data: Vec<u8>,
}

impl RgbImage {
    /// Bytes of an RGB image of this size.
    pub fn byte_len(height: u32, width: u32) -> usize {
        height as usize * width as usize * 3
    }
}

/// The most image bytes one byte of compressed PNG data can expand to (deflate's
/// limit is about 1032:1).
const MAX_INFLATE: u128 = 1032;

/// A decoder of `path`, and the file's length.
fn open(path: &Path) -> Result<(png::Decoder<BufReader<std::fs::File>>, u64)> {
    let file = std::fs::File::open(path).map_err(|e| DataError::io(path, e))?;
    let len = file.metadata().map_err(|e| DataError::io(path, e))?.len();
    let mut decoder = png::Decoder::new(BufReader::new(file));
    decoder.set_transformations(Transformations::normalize_to_color8());
    Ok((decoder, len))
}

/// Refuses a header whose size a file of `file_len` bytes cannot hold even at
/// deflate's best ratio, so that no buffer is sized by a forged width or height.
fn check_claimed_size(path: &Path, info: &png::Info, file_len: u64) -> Result<()> {
    let row_bytes = info.raw_row_length().saturating_sub(1) as u128;
    let claimed = row_bytes * info.height as u128;
    if claimed > MAX_INFLATE * file_len as u128 {
        return Err(DataError::format(
            path,
            format!(
                "PNG header claims {}x{} pixels ({claimed} bytes of image data), more than a file of {file_len} bytes can hold",
                info.height, info.width
            ),
        ));
    }
    Ok(())
}

fn bad_png(path: &Path, err: png::DecodingError) -> DataError {
    DataError::format(path, format!("PNG does not decode: {err}"))
}

/// The (height, width) of a PNG, reading only its header.
pub fn png_size(path: &Path) -> Result<(u32, u32)> {
    let (mut decoder, file_len) = open(path)?;
    let info = decoder.read_header_info().map_err(|e| bad_png(path, e))?;
    check_claimed_size(path, info, file_len)?;
    Ok((info.height, info.width))
}

/// Decodes a PNG straight into `dst` as 8-bit RGB; its size must be `expected`
/// (height, width), else an error names the file and both sizes.
pub fn read_png_rgb_into(path: &Path, expected: (u32, u32), dst: &mut [u8]) -> Result<()> {
    let (decoder, file_len) = open(path)?;
    let mut reader = decoder.read_info().map_err(|e| bad_png(path, e))?;
    check_claimed_size(path, reader.info(), file_len)?;
    let (width, height) = reader.info().size();
    if (height, width) != expected {
        return Err(DataError::format(
            path,
            format!(
                "image is {height}x{width} but its sequence is {}x{}",
                expected.0, expected.1
            ),
        ));
    }
    let pixels = height as usize * width as usize;
    if dst.len() != pixels * 3 {
        return Err(DataError::Request(format!(
            "{}: buffer of {} bytes for a {height}x{width} RGB image",
            path.display(),
            dst.len()
        )));
    }
    let (color, _) = reader.output_color_type();
    if color == ColorType::Rgb {
        reader.next_frame(dst).map_err(|e| bad_png(path, e))?;
        return Ok(());
    }
    let size = reader
        .output_buffer_size()
        .ok_or_else(|| DataError::format(path, "PNG too large for this machine"))?;
    let mut raw = vec![0u8; size];
    reader.next_frame(&mut raw).map_err(|e| bad_png(path, e))?;
    let channels = match color {
        ColorType::Grayscale => 1,
        ColorType::GrayscaleAlpha => 2,
        ColorType::Rgba => 4,
        other => {
            return Err(DataError::format(
                path,
                format!("unsupported PNG colour type {other:?}"),
            ))
        }
    };
    for (out, px) in dst.chunks_exact_mut(3).zip(raw.chunks_exact(channels)) {
        if channels <= 2 {
            out.fill(px[0]);
        } else {
            out.copy_from_slice(&px[..3]);
        }
    }
    Ok(())
}

/// Decodes a whole PNG as 8-bit RGB.
pub fn read_png_rgb(path: &Path) -> Result<RgbImage> {
    let (height, width) = png_size(path)?;
    let mut data = vec![0u8; RgbImage::byte_len(height, width)];
    read_png_rgb_into(path, (height, width), &mut data)?;
    Ok(RgbImage {
        height,
        width,
        data,
    })
}

/// Writes an 8-bit RGB PNG (fast compression: the generator writes many).
pub fn write_png_rgb(path: &Path, image: &RgbImage) -> Result<()> {
    if image.data.len() != RgbImage::byte_len(image.height, image.width) {
        return Err(DataError::Request(format!(
            "{}: {} bytes for a {}x{} RGB image",
            path.display(),
            image.data.len(),
            image.height,
            image.width
        )));
    }
    let file = std::fs::File::create(path).map_err(|e| DataError::io(path, e))?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), image.width, image.height);
    encoder.set_color(ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::Fast);
    let to_err = |e: png::EncodingError| DataError::format(path, format!("PNG encode: {e}"));
    let mut writer = encoder.write_header().map_err(to_err)?;
    writer.write_image_data(&image.data).map_err(to_err)?;
    writer.finish().map_err(to_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rgb_round_trip_and_size_probe() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.png");
        let image = RgbImage {
            height: 5,
            width: 7,
            data: (0..105u32).map(|v| (v * 37 % 256) as u8).collect(),
        };
        write_png_rgb(&path, &image).unwrap();
        assert_eq!(png_size(&path).unwrap(), (5, 7));
        assert_eq!(read_png_rgb(&path).unwrap(), image);
        let mut dst = vec![0u8; 105];
        let err = read_png_rgb_into(&path, (7, 5), &mut dst)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("a.png") && err.contains("5x7") && err.contains("7x5"),
            "{err}"
        );
    }

    #[test]
    fn grey_png_becomes_rgb() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("g.png");
        let file = std::fs::File::create(&path).unwrap();
        let mut enc = png::Encoder::new(file, 2, 1);
        enc.set_color(ColorType::Grayscale);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc.write_header().unwrap();
        w.write_image_data(&[10, 200]).unwrap();
        w.finish().unwrap();
        assert_eq!(
            read_png_rgb(&path).unwrap().data,
            vec![10, 10, 10, 200, 200, 200]
        );
    }

    #[test]
    fn a_forged_huge_size_is_refused_before_allocating() {
        // Found by tests/parsers_prop: a 70-byte PNG whose IHDR (CRC fixed) claims
        // 2^31-1 x 2^31-1 pixels made `read_png_rgb` allocate for that size.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("forged.png");
        let image = RgbImage {
            height: 2,
            width: 2,
            data: vec![7; 12],
        };
        write_png_rgb(&path, &image).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        for (at, value) in [(16, 0x7fff_ffffu32), (20, 0x7fff_ffff)] {
            bytes[at..at + 4].copy_from_slice(&value.to_be_bytes());
        }
        let crc = crc32fast::hash(&bytes[12..29]);
        bytes[29..33].copy_from_slice(&crc.to_be_bytes());
        std::fs::write(&path, &bytes).unwrap();
        for err in [
            png_size(&path).unwrap_err(),
            read_png_rgb(&path).unwrap_err(),
        ] {
            let err = err.to_string();
            assert!(
                err.contains("forged.png") && err.contains("2147483647x2147483647"),
                "{err}"
            );
        }
        // Decoding into a caller's buffer: refused too (here by the decoder's limits).
        let err = read_png_rgb_into(&path, (0x7fff_ffff, 0x7fff_ffff), &mut [])
            .unwrap_err()
            .to_string();
        assert!(err.contains("forged.png"), "{err}");
    }

    #[test]
    fn garbage_png_names_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("junk.png");
        std::fs::write(&path, b"not a png at all").unwrap();
        let err = read_png_rgb(&path).unwrap_err().to_string();
        assert!(
            err.contains("junk.png") && err.contains("does not decode"),
            "{err}"
        );
    }
}
