//! The bytes of a TensorBoard event file: TFRecord framing (length, masked CRC32C of
//! the length, payload, masked CRC32C of the payload) and the few protobuf messages
//! TensorBoard reads (`Event`, `Summary`, `Summary.Value`, `Summary.Image`), encoded
//! by hand: five messages do not justify a protobuf code generator at build time.

/// The reflected CRC32C (Castagnoli) polynomial.
const CASTAGNOLI: u32 = 0x82F6_3B78;

/// The byte-at-a-time CRC32C table, built at compile time.
const CRC_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ CASTAGNOLI
            } else {
                crc >> 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// CRC32C of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc = CRC_TABLE[((crc ^ u32::from(byte)) & 0xFF) as usize] ^ (crc >> 8);
    }
    !crc
}

/// The TFRecord mask of a CRC (so a CRC of data holding CRCs stays well spread).
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    crc.rotate_right(15).wrapping_add(0xA282_EAD8)
}

/// Appends one TFRecord holding `payload` to `out`.
pub fn frame_record(payload: &[u8], out: &mut Vec<u8>) {
    let length = (payload.len() as u64).to_le_bytes();
    out.extend_from_slice(&length);
    out.extend_from_slice(&masked_crc32c(&length).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&masked_crc32c(payload).to_le_bytes());
}

/// A protobuf message under construction (fields appended in any order).
#[derive(Debug, Default, Clone)]
pub struct Proto(Vec<u8>);

/// Protobuf wire types used here.
#[derive(Clone, Copy)]
enum Wire {
    Varint = 0,
    Fixed64 = 1,
    Bytes = 2,
    Fixed32 = 5,
}

impl Proto {
    fn varint(&mut self, mut value: u64) {
        while value >= 0x80 {
            self.0.push((value as u8) | 0x80);
            value >>= 7;
        }
        self.0.push(value as u8);
    }

    fn key(&mut self, field: u32, wire: Wire) {
        self.varint((u64::from(field) << 3) | wire as u64);
    }

    /// An `int32`/`int64` field (negative values take ten bytes, as protobuf does).
    pub fn int(mut self, field: u32, value: i64) -> Proto {
        self.key(field, Wire::Varint);
        self.varint(value as u64);
        self
    }

    /// A `double` field.
    pub fn double(mut self, field: u32, value: f64) -> Proto {
        self.key(field, Wire::Fixed64);
        self.0.extend_from_slice(&value.to_le_bytes());
        self
    }

    /// A `float` field.
    pub fn float(mut self, field: u32, value: f32) -> Proto {
        self.key(field, Wire::Fixed32);
        self.0.extend_from_slice(&value.to_le_bytes());
        self
    }

    /// A `bytes` or `string` field.
    pub fn bytes(mut self, field: u32, value: &[u8]) -> Proto {
        self.key(field, Wire::Bytes);
        self.varint(value.len() as u64);
        self.0.extend_from_slice(value);
        self
    }

    /// An embedded message field.
    pub fn message(self, field: u32, value: &Proto) -> Proto {
        self.bytes(field, &value.0)
    }

    /// The encoded message.
    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

/// Field numbers of tensorflow/core/util/event.proto and framework/summary.proto.
pub mod fields {
    /// `Event.wall_time` (double).
    pub const EVENT_WALL_TIME: u32 = 1;
    /// `Event.step` (int64).
    pub const EVENT_STEP: u32 = 2;
    /// `Event.file_version` (string).
    pub const EVENT_FILE_VERSION: u32 = 3;
    /// `Event.summary` (Summary).
    pub const EVENT_SUMMARY: u32 = 5;
    /// `Summary.value` (repeated Summary.Value).
    pub const SUMMARY_VALUE: u32 = 1;
    /// `Summary.Value.tag` (string).
    pub const VALUE_TAG: u32 = 1;
    /// `Summary.Value.simple_value` (float).
    pub const VALUE_SIMPLE: u32 = 2;
    /// `Summary.Value.image` (Summary.Image).
    pub const VALUE_IMAGE: u32 = 4;
    /// `Summary.Image.height` (int32).
    pub const IMAGE_HEIGHT: u32 = 1;
    /// `Summary.Image.width` (int32).
    pub const IMAGE_WIDTH: u32 = 2;
    /// `Summary.Image.colorspace` (int32: 1 grey, 3 RGB, 4 RGBA).
    pub const IMAGE_COLORSPACE: u32 = 3;
    /// `Summary.Image.encoded_image_string` (bytes, PNG here).
    pub const IMAGE_ENCODED: u32 = 4;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_known_vectors() {
        // The check value of CRC-32C (RFC 3720, appendix B.4).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn record_framing_layout() {
        let mut out = Vec::new();
        frame_record(b"abc", &mut out);
        assert_eq!(out.len(), 8 + 4 + 3 + 4);
        assert_eq!(&out[..8], &3u64.to_le_bytes());
        assert_eq!(
            &out[8..12],
            &masked_crc32c(&3u64.to_le_bytes()).to_le_bytes()
        );
        assert_eq!(&out[12..15], b"abc");
        let crc = crc32c(b"abc");
        let masked = crc.rotate_right(15).wrapping_add(0xA282_EAD8);
        assert_eq!(&out[15..], &masked.to_le_bytes());
    }

    #[test]
    fn protobuf_encoding() {
        // field 2 varint 150 -> 10 96 01 (the protobuf guide's example, field 2).
        assert_eq!(
            Proto::default().int(2, 150).into_bytes(),
            vec![0x10, 0x96, 0x01]
        );
        assert_eq!(
            Proto::default().bytes(1, b"ab").into_bytes(),
            vec![0x0A, 2, b'a', b'b']
        );
        let f = Proto::default().float(2, 1.0).into_bytes();
        assert_eq!(f, vec![0x15, 0x00, 0x00, 0x80, 0x3F]);
        let d = Proto::default().double(1, 0.0).into_bytes();
        assert_eq!(d, vec![0x09, 0, 0, 0, 0, 0, 0, 0, 0]);
        let inner = Proto::default().int(1, 1);
        assert_eq!(
            Proto::default().message(5, &inner).into_bytes(),
            vec![0x2A, 2, 0x08, 1]
        );
        assert_eq!(Proto::default().int(1, -1).into_bytes().len(), 11);
    }
}
