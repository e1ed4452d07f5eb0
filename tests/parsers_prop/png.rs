//! PNG frames: valid images of every colour type and depth, with the header's size
//! rewritten (CRC fixed, so the decoder believes it) and bytes mutated or cut, probe
//! and decode to an image of the probed size or to an error naming the file, and
//! never allocate what a forged header claims.

use std::time::Instant;

use png::{BitDepth, ColorType};
use proptest::prelude::*;

use vrtspike::dataset::image::{png_size, read_png_rgb};

use super::{accepted, bounded_by_input, check, largest_allocation, mutated, names};

/// Bytes per input byte a decode may allocate: deflate expands at most ~1032x and
/// one bit of a 1-bit grey pixel becomes 3 RGB bytes (24x).
const PER_BYTE: usize = 1032 * 24;

/// A colour type with a depth the PNG spec allows for it.
fn format() -> impl Strategy<Value = (ColorType, BitDepth)> {
    use BitDepth::*;
    prop_oneof![
        prop::sample::select(vec![One, Two, Four, Eight, Sixteen])
            .prop_map(|d| (ColorType::Grayscale, d)),
        prop::sample::select(vec![One, Two, Four, Eight]).prop_map(|d| (ColorType::Indexed, d)),
        prop::sample::select(vec![Eight, Sixteen]).prop_map(|d| (ColorType::Rgb, d)),
        prop::sample::select(vec![Eight, Sixteen]).prop_map(|d| (ColorType::Rgba, d)),
        prop::sample::select(vec![Eight, Sixteen]).prop_map(|d| (ColorType::GrayscaleAlpha, d)),
    ]
}

/// A small valid PNG of `format`, `width` x `height`, pixels from `seed`.
fn encode(format: (ColorType, BitDepth), width: u32, height: u32, seed: u8) -> Vec<u8> {
    let (color, depth) = format;
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, width, height);
    enc.set_color(color);
    enc.set_depth(depth);
    if color == ColorType::Indexed {
        enc.set_palette((0..768u32).map(|v| v as u8).collect::<Vec<_>>());
    }
    let bits = color.samples() * depth as usize;
    let row = (width as usize * bits).div_ceil(8);
    let data: Vec<u8> = (0..row * height as usize)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    let mut writer = enc.write_header().unwrap();
    writer.write_image_data(&data).unwrap();
    writer.finish().unwrap();
    out
}

/// Rewrites the IHDR width and height (bytes 16..24) and its CRC.
fn forge_size(png: &mut [u8], width: u32, height: u32) {
    png[16..20].copy_from_slice(&width.to_be_bytes());
    png[20..24].copy_from_slice(&height.to_be_bytes());
    let crc = crc32fast::hash(&png[12..29]);
    png[29..33].copy_from_slice(&crc.to_be_bytes());
}

/// A claimed side: mostly the true one, sometimes anything up to `u32::MAX`.
fn claimed() -> impl Strategy<Value = Option<u32>> {
    prop_oneof![
        3 => Just(None),
        1 => (0..64u32).prop_map(Some),
        1 => (1u32 << 16..1u32 << 31).prop_map(Some),
        1 => any::<u32>().prop_map(Some),
    ]
}

fn png_file() -> impl Strategy<Value = Vec<u8>> {
    (
        format(),
        1..7u32,
        1..7u32,
        any::<u8>(),
        claimed(),
        claimed(),
    )
        .prop_flat_map(|(format, w, h, seed, cw, ch)| {
            let mut png = encode(format, w, h, seed);
            if cw.is_some() || ch.is_some() {
                forge_size(&mut png, cw.unwrap_or(w), ch.unwrap_or(h));
            }
            prop_oneof![1 => Just(png.clone()), 1 => mutated(png)]
        })
}

#[test]
fn any_png_decodes_to_its_probed_size_or_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("case.png");
    check("png", 2500, png_file(), |bytes| {
        std::fs::write(&path, &bytes).unwrap();
        let start = Instant::now();
        let (size, largest) = largest_allocation(|| png_size(&path));
        bounded_by_input(largest, bytes.len(), PER_BYTE)?;
        let (image, largest) = largest_allocation(|| read_png_rgb(&path));
        bounded_by_input(largest, bytes.len(), PER_BYTE)?;
        match (size, image) {
            (Ok(size), Ok(image)) => {
                accepted();
                prop_assert_eq!((image.height, image.width), size);
                prop_assert_eq!(image.data.len(), 3 * size.0 as usize * size.1 as usize);
            }
            (Ok(_), Err(err)) => names(&err.to_string(), "case.png")?,
            (Err(probe), Err(err)) => {
                names(&probe.to_string(), "case.png")?;
                names(&err.to_string(), "case.png")?;
            }
            (Err(probe), Ok(_)) => {
                return Err(TestCaseError::fail(format!(
                    "the probe failed ({probe}) but the decode worked"
                )))
            }
        }
        prop_assert!(start.elapsed() < crate::HANG_GUARD, "slow decode");
        Ok(())
    });
}
