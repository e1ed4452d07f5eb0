//! FNV-1a, the project's one stable hash: the same bytes give the same value in
//! every process, build and machine (the std hashers are seeded per process). The
//! cache's key table, the dataset signature, the heartbeat record's checksum and
//! the cache server's build id all use it. Not for anything an adversary chooses
//! to collide.

const OFFSET_64: u64 = 0xcbf2_9ce4_8422_2325;
const PRIME_64: u64 = 0x0000_0100_0000_01b3;
const OFFSET_32: u32 = 0x811c_9dc5;
const PRIME_32: u32 = 0x0100_0193;

/// FNV-1a over 64 bits, fed piece by piece.
#[derive(Debug, Clone, Copy)]
pub struct Fnv64(u64);

impl Default for Fnv64 {
    fn default() -> Self {
        Fnv64(OFFSET_64)
    }
}

impl Fnv64 {
    /// Feeds `bytes`.
    pub fn bytes(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(PRIME_64);
        }
    }

    /// Feeds a field with its length first, so `ab`+`c` and `a`+`bc` differ.
    pub fn field(&mut self, bytes: &[u8]) {
        self.bytes(&(bytes.len() as u64).to_le_bytes());
        self.bytes(bytes);
    }

    /// The hash so far.
    pub fn finish(&self) -> u64 {
        self.0
    }
}

/// FNV-1a (64 bits) of `bytes`.
pub fn fnv1a_64(bytes: &[u8]) -> u64 {
    let mut hash = Fnv64::default();
    hash.bytes(bytes);
    hash.finish()
}

/// FNV-1a (32 bits) of `bytes`.
pub fn fnv1a_32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(OFFSET_32, |hash, &b| {
        (hash ^ u32::from(b)).wrapping_mul(PRIME_32)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // The published test vectors of FNV-1a.
    #[test]
    fn matches_the_published_vectors() {
        assert_eq!(fnv1a_64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_64(b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(fnv1a_32(b""), 0x811c_9dc5);
        assert_eq!(fnv1a_32(b"a"), 0xe40c_292c);
        assert_eq!(fnv1a_32(b"foobar"), 0xbf9c_f968);
    }

    #[test]
    fn fields_are_length_prefixed() {
        let mut ab_c = Fnv64::default();
        ab_c.field(b"ab");
        ab_c.field(b"c");
        let mut a_bc = Fnv64::default();
        a_bc.field(b"a");
        a_bc.field(b"bc");
        assert_ne!(ab_c.finish(), a_bc.finish());
    }
}
