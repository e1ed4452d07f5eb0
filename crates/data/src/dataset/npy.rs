//! Legacy precomputed voxel grids (format page, section 6): `.npy` files holding
//! f32 (K, H, W) arrays. Only the header is read when indexing; a frame is read
//! whole and stored as little-endian f16 (half the bytes, never f32 in the cache).

use std::io::Read;
use std::path::Path;

use super::error::{DataError, Result};

const MAGIC: &[u8; 6] = b"\x93NUMPY";

/// Shape and data offset of an `.npy` file of little-endian f32 in C order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpyHeader {
    /// Array shape.
    pub shape: Vec<usize>,
    /// Byte offset of the data.
    pub data_offset: usize,
}

/// The value text of `'key':` in a header dict (up to the next top-level comma).
fn dict_value<'a>(dict: &'a str, key: &str) -> Option<&'a str> {
    let start = dict.find(&format!("'{key}'"))? + key.len() + 2;
    let rest = dict[start..].trim_start().strip_prefix(':')?.trim_start();
    let end = if rest.starts_with('(') {
        rest.find(')')? + 1
    } else {
        rest.find([',', '}']).unwrap_or(rest.len())
    };
    Some(rest[..end].trim())
}

/// Parses the header at the start of `bytes` (at least the whole header).
pub fn parse_header(path: &Path, bytes: &[u8]) -> Result<NpyHeader> {
    let bad = |m: String| DataError::format(path, format!("bad .npy header: {m}"));
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err(bad("no \\x93NUMPY magic".into()));
    }
    let (len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        v => return Err(bad(format!("unsupported version {v}"))),
    };
    let dict = bytes
        .get(start..start + len)
        .and_then(|b| std::str::from_utf8(b).ok())
        .ok_or_else(|| bad(format!("header of {len} bytes is truncated or not text")))?;
    let descr = dict_value(dict, "descr").ok_or_else(|| bad("no 'descr'".into()))?;
    if descr.trim_matches(['\'', '"']) != "<f4" {
        return Err(DataError::format(
            path,
            format!("dtype {descr}, expected float32 '<f4' (little-endian)"),
        ));
    }
    if dict_value(dict, "fortran_order") != Some("False") {
        return Err(DataError::format(
            path,
            "fortran_order must be False (C order)",
        ));
    }
    let shape_text = dict_value(dict, "shape").ok_or_else(|| bad("no 'shape'".into()))?;
    let shape = shape_text
        .trim_matches(['(', ')'])
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| bad(format!("shape {shape_text}")))?;
    Ok(NpyHeader {
        shape,
        data_offset: start + len,
    })
}

/// Reads the header of `path` and checks it is a non-empty (K, H, W) f32 grid
/// whose file size matches.
pub fn voxel_header(path: &Path) -> Result<(u32, u32, u32)> {
    let mut file = std::fs::File::open(path).map_err(|e| DataError::io(path, e))?;
    let mut head = vec![0u8; 4096];
    let mut got = 0;
    while got < head.len() {
        let n = file
            .read(&mut head[got..])
            .map_err(|e| DataError::io(path, e))?;
        if n == 0 {
            break;
        }
        got += n;
    }
    let header = parse_header(path, &head[..got])?;
    let file_len = file.metadata().map_err(|e| DataError::io(path, e))?.len();
    check_grid(path, &header, file_len)
}

fn check_grid(path: &Path, header: &NpyHeader, file_len: u64) -> Result<(u32, u32, u32)> {
    let [k, h, w] = header.shape[..] else {
        return Err(DataError::format(
            path,
            format!("shape {:?}, expected a (K, H, W) voxel grid", header.shape),
        ));
    };
    let dims = [k, h, w].map(|v| u32::try_from(v).unwrap_or(0));
    if dims.contains(&0) {
        return Err(DataError::format(
            path,
            format!("shape {:?} has an empty or huge axis", header.shape),
        ));
    }
    // Checked: three axes of up to 2^32 overflow u64 (a forged header).
    let want = [k as u64, h as u64, w as u64, 4]
        .iter()
        .try_fold(1u64, |n, v| n.checked_mul(*v))
        .and_then(|data| data.checked_add(header.data_offset as u64));
    if want != Some(file_len) {
        let want = want.map_or_else(|| "more than 2^64".to_string(), |v| v.to_string());
        return Err(DataError::format(
            path,
            format!("{file_len} bytes, but its header describes {want}"),
        ));
    }
    Ok((dims[0], dims[1], dims[2]))
}

/// Reads the (K, H, W) f32 grid of `path` into `dst` as little-endian f16
/// (`dst` is `2 * K * H * W` bytes); the shape must be `expected`.
pub fn read_voxels_f16_into(path: &Path, expected: (u32, u32, u32), dst: &mut [u8]) -> Result<()> {
    let bytes = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
    let header = parse_header(path, &bytes)?;
    let shape = check_grid(path, &header, bytes.len() as u64)?;
    if shape != expected {
        return Err(DataError::format(
            path,
            format!("voxel grid is {shape:?}, but its sequence's grids are {expected:?}"),
        ));
    }
    let data = &bytes[header.data_offset..];
    if dst.len() * 2 != data.len() {
        return Err(DataError::Request(format!(
            "{}: record space of {} bytes for {} f32 bytes",
            path.display(),
            dst.len(),
            data.len()
        )));
    }
    for (out, v) in dst.chunks_exact_mut(2).zip(data.chunks_exact(4)) {
        let x = f32::from_le_bytes([v[0], v[1], v[2], v[3]]);
        out.copy_from_slice(&half::f16::from_f32(x).to_le_bytes());
    }
    Ok(())
}

/// Writes `values` as an `.npy` f32 array of `shape` (version 1, C order).
pub fn write_f32(path: &Path, shape: &[usize], values: &[f32]) -> Result<()> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_text = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_text}, }}");
    // Pad so that magic + version + length + dict + newline is a multiple of 64.
    while (10 + dict.len() + 1) % 64 != 0 {
        dict.push(' ');
    }
    dict.push('\n');
    let mut out = Vec::with_capacity(10 + dict.len() + 4 * values.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, out).map_err(|e| DataError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_to_f16() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.npy");
        let values: Vec<f32> = (0..2 * 3 * 4).map(|i| i as f32 * 0.25).collect();
        write_f32(&path, &[2, 3, 4], &values).unwrap();
        assert_eq!(voxel_header(&path).unwrap(), (2, 3, 4));
        let mut dst = vec![0u8; 2 * values.len()];
        read_voxels_f16_into(&path, (2, 3, 4), &mut dst).unwrap();
        for (b, v) in dst.chunks_exact(2).zip(&values) {
            assert_eq!(half::f16::from_le_bytes([b[0], b[1]]).to_f32(), *v);
        }
        let err = read_voxels_f16_into(&path, (2, 4, 3), &mut dst)
            .unwrap_err()
            .to_string();
        assert!(err.contains("v.npy") && err.contains("(2, 3, 4)"), "{err}");
    }

    #[test]
    fn bad_files_name_the_file_and_fault() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.npy");
        let check = |bytes: &[u8], needle: &str| {
            std::fs::write(&path, bytes).unwrap();
            let err = voxel_header(&path).unwrap_err().to_string();
            assert!(err.contains("bad.npy") && err.contains(needle), "{err}");
        };
        check(b"not an npy file at all", "magic");
        // Wrong dtype and wrong rank, through the writer's header then edited.
        write_f32(&path, &[2, 2], &[0.0; 4]).unwrap();
        let good2d = std::fs::read(&path).unwrap();
        check(&good2d, "(K, H, W)");
        write_f32(&path, &[1, 2, 2], &[0.0; 4]).unwrap();
        let mut f8 = std::fs::read(&path).unwrap();
        let at = f8.windows(3).position(|w| w == b"<f4").unwrap();
        f8[at + 2] = b'8';
        check(&f8, "float32");
        // Truncated data.
        write_f32(&path, &[1, 2, 2], &[0.0; 4]).unwrap();
        let full = std::fs::read(&path).unwrap();
        check(&full[..full.len() - 4], "bytes");
    }

    #[test]
    fn a_shape_whose_size_overflows_is_an_error() {
        // Found by tests/parsers_prop: three axes just under 2^32 made the size
        // computation overflow (a panic in debug builds, a wrong size in release).
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("huge.npy");
        write_f32(&path, &[4_294_967_295, 4_294_967_295, 4_294_967_295], &[]).unwrap();
        let err = voxel_header(&path).unwrap_err().to_string();
        assert!(err.contains("huge.npy") && err.contains("2^64"), "{err}");
        let mut dst = [0u8; 2];
        assert!(read_voxels_f16_into(&path, (1, 1, 1), &mut dst).is_err());
    }
}
