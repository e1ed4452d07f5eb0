//! Synthetic records shaped like cached frames (rows of pixels) that prove their own
//! integrity: a header with the key id and a CRC-32 of the body, and every row tagged
//! with the key id and row number, so a torn or misplaced read is always detected.

/// Header bytes: magic, key id, body length, CRC-32 of the body.
pub const HEADER: usize = 32;
const MAGIC: u64 = 0x5652_5453_5049_4b45; // "VRTSPIKE"

/// The shape of a synthetic frame record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameShape {
    /// Rows.
    pub height: usize,
    /// Columns.
    pub width: usize,
    /// Bytes per pixel.
    pub channels: usize,
}

impl FrameShape {
    /// An RGB frame of `height` x `width` (3 bytes a pixel).
    pub fn rgb(height: usize, width: usize) -> FrameShape {
        let channels = 3;
        FrameShape {
            height,
            width,
            channels,
        }
    }

    /// Bytes in one row.
    pub fn row_bytes(&self) -> usize {
        self.width * self.channels
    }

    /// Bytes in the whole record, header included.
    pub fn record_bytes(&self) -> usize {
        HEADER + self.height * self.row_bytes()
    }
}

/// What is wrong with a record that failed its check.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// Wrong length.
    #[error("record of {got} bytes, expected {expected}")]
    Length {
        /// Bytes found.
        got: usize,
        /// Bytes expected.
        expected: usize,
    },
    /// Header of another record, or none.
    #[error("header says key {found:#x}, expected {expected:#x}")]
    Header {
        /// Key id found.
        found: u64,
        /// Key id expected.
        expected: u64,
    },
    /// A row belongs to another record.
    #[error("row {row} is tagged {found:#x}, expected {expected:#x}")]
    Row {
        /// The row.
        row: usize,
        /// Tag found.
        found: u64,
        /// Tag expected.
        expected: u64,
    },
    /// The body's checksum does not match.
    #[error("body checksum {found:#010x}, header says {expected:#010x}")]
    Checksum {
        /// CRC computed.
        found: u32,
        /// CRC in the header.
        expected: u32,
    },
}

fn row_tag(key_id: u64, row: usize) -> u64 {
    key_id.rotate_left(17) ^ (row as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn read_u64(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

/// Pixel bytes shared by every record of a shape (pseudo-random, made once);
/// a record is this body with its own row tags, so writing one is a copy.
pub fn template(shape: FrameShape) -> Vec<u8> {
    let mut body = vec![0u8; shape.height * shape.row_bytes()];
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    for chunk in body.chunks_mut(8) {
        // xorshift64: cheap and deterministic.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
    }
    body
}

/// Writes the record of `key_id` into `out` (exactly `shape.record_bytes()` long):
/// `template`'s pixels, each row tagged with the key and row, and the header.
pub fn write_record(
    shape: FrameShape,
    key_id: u64,
    template: &[u8],
    out: &mut [u8],
) -> Result<(), RecordError> {
    if out.len() != shape.record_bytes() || template.len() + HEADER != out.len() {
        return Err(RecordError::Length {
            got: out.len(),
            expected: shape.record_bytes(),
        });
    }
    let (header, body) = out.split_at_mut(HEADER);
    body.copy_from_slice(template);
    for (row, line) in body.chunks_exact_mut(shape.row_bytes()).enumerate() {
        let tag = line.len().min(8);
        line[..tag].copy_from_slice(&row_tag(key_id, row).to_le_bytes()[..tag]);
    }
    let crc = crc32fast::hash(body);
    header[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    header[8..16].copy_from_slice(&key_id.to_le_bytes());
    header[16..24].copy_from_slice(&(body.len() as u64).to_le_bytes());
    header[24..28].copy_from_slice(&crc.to_le_bytes());
    header[28..32].fill(0);
    Ok(())
}

/// Cheap check: length, header and the tags of `rows`.
pub fn check_rows(
    shape: FrameShape,
    key_id: u64,
    record: &[u8],
    rows: std::ops::Range<usize>,
) -> Result<(), RecordError> {
    if record.len() != shape.record_bytes() {
        return Err(RecordError::Length {
            got: record.len(),
            expected: shape.record_bytes(),
        });
    }
    let found = read_u64(record, 8);
    if read_u64(record, 0) != MAGIC || found != key_id {
        return Err(RecordError::Header {
            found,
            expected: key_id,
        });
    }
    let row_bytes = shape.row_bytes();
    for row in rows {
        let at = HEADER + row * row_bytes;
        let found = read_u64(record, at);
        let expected = row_tag(key_id, row);
        if found != expected {
            return Err(RecordError::Row {
                row,
                found,
                expected,
            });
        }
    }
    Ok(())
}

/// Full check: header, every row tag and the body's CRC-32.
pub fn verify_record(shape: FrameShape, key_id: u64, record: &[u8]) -> Result<(), RecordError> {
    check_rows(shape, key_id, record, 0..shape.height)?;
    let expected = u32::from_le_bytes([record[24], record[25], record[26], record[27]]);
    let found = crc32fast::hash(&record[HEADER..]);
    if found != expected {
        return Err(RecordError::Checksum { found, expected });
    }
    Ok(())
}

/// Copies the `size` x `size` crop at (`y`, `x`) (pixels) out of a record into `out`.
pub fn copy_crop(
    shape: FrameShape,
    record: &[u8],
    y: usize,
    x: usize,
    size: usize,
    out: &mut [u8],
) {
    let row_bytes = shape.row_bytes();
    let crop_row = size * shape.channels;
    for (i, dst) in out.chunks_exact_mut(crop_row).take(size).enumerate() {
        let at = HEADER + (y + i) * row_bytes + x * shape.channels;
        dst.copy_from_slice(&record[at..at + crop_row]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: FrameShape = FrameShape {
        height: 16,
        width: 20,
        channels: 3,
    };

    #[test]
    fn written_records_verify() {
        let mut buf = vec![0u8; SMALL.record_bytes()];
        write_record(SMALL, 42, &template(SMALL), &mut buf).unwrap();
        verify_record(SMALL, 42, &buf).unwrap();
        assert!(matches!(
            verify_record(SMALL, 43, &buf),
            Err(RecordError::Header { .. })
        ));
    }

    #[test]
    fn corruption_is_detected() {
        let mut buf = vec![0u8; SMALL.record_bytes()];
        let body = template(SMALL);
        write_record(SMALL, 7, &body, &mut buf).unwrap();
        buf[HEADER + 5 * SMALL.row_bytes() + 20] ^= 1;
        assert!(matches!(
            verify_record(SMALL, 7, &buf),
            Err(RecordError::Checksum { .. })
        ));
        // A row of another record spliced in is caught by the cheap check too.
        let mut other = vec![0u8; SMALL.record_bytes()];
        write_record(SMALL, 8, &body, &mut other).unwrap();
        let row = HEADER + 3 * SMALL.row_bytes();
        buf[row..row + SMALL.row_bytes()].copy_from_slice(&other[row..row + SMALL.row_bytes()]);
        assert!(matches!(
            check_rows(SMALL, 7, &buf, 0..16),
            Err(RecordError::Row { row: 3, .. })
        ));
    }

    #[test]
    fn crop_copies_the_right_pixels() {
        let mut buf = vec![0u8; SMALL.record_bytes()];
        write_record(SMALL, 1, &template(SMALL), &mut buf).unwrap();
        let mut crop = vec![0u8; 4 * 4 * 3];
        copy_crop(SMALL, &buf, 2, 5, 4, &mut crop);
        let at = HEADER + 3 * SMALL.row_bytes() + 5 * 3;
        assert_eq!(&crop[12..24], &buf[at..at + 12]);
    }
}
