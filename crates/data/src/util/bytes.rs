//! Byte sizes for people: parse `512M`, `2G`, `1.5GiB` and print `1.50 GiB`.

/// A size that could not be parsed.
#[derive(Debug, thiserror::Error)]
#[error("bad size {text:?}: expected a number of bytes with an optional K, M, G or T suffix")]
pub struct ParseSizeError {
    text: String,
}

/// Parses a byte count with an optional binary suffix (K, M, G, T; `B`/`iB`
/// allowed): `vrtspike_contract::size::parse_size`, with an error naming the text.
pub fn parse_size(text: &str) -> Result<u64, ParseSizeError> {
    vrtspike_contract::size::parse_size(text).ok_or_else(|| ParseSizeError {
        text: text.to_string(),
    })
}

/// `1536` -> `1.50 KiB`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_suffixes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("8M").unwrap(), 8 << 20);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("2gb").unwrap(), 2 << 30);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("-1M").is_err());
        // The forms `vrtspike plan --ram/--cache` documents.
        assert_eq!(parse_size("256G").unwrap(), 256 << 30);
        assert_eq!(parse_size("48GiB").unwrap(), 48 << 30);
        assert_eq!(parse_size("512m").unwrap(), 512 << 20);
        assert!(parse_size("3X").is_err());
    }

    #[test]
    fn prints_binary_units() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(1536), "1.50 KiB");
        assert_eq!(human(3 << 30), "3.00 GiB");
    }
}
