//! Byte sizes as people write them (`512M`, `2G`, `1.5GiB`, `4096`), read one way
//! by every binary: the cache server's `--cap`, the launcher's `--cache-size`,
//! `vrtspike plan --ram`.

/// Bytes of `text`: a number with an optional binary suffix (K, M, G, T; `B` or
/// `iB` after it allowed, any case); `None` if it is not one (negative, not finite,
/// an unknown unit).
pub fn parse_size(text: &str) -> Option<u64> {
    let upper = text.trim().to_ascii_uppercase();
    let unit = upper
        .strip_suffix("IB")
        .or_else(|| upper.strip_suffix('B'))
        .unwrap_or(&upper);
    let (number, shift) = match unit.chars().last() {
        Some('K') => (&unit[..unit.len() - 1], 10),
        Some('M') => (&unit[..unit.len() - 1], 20),
        Some('G') => (&unit[..unit.len() - 1], 30),
        Some('T') => (&unit[..unit.len() - 1], 40),
        _ => (unit, 0),
    };
    let value: f64 = number.trim().parse().ok()?;
    (value.is_finite() && value >= 0.0).then(|| (value * (1u64 << shift) as f64).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_with_binary_units() {
        assert_eq!(parse_size("64M"), Some(64 << 20));
        assert_eq!(parse_size("1.5g"), Some(3 << 29));
        assert_eq!(parse_size("2GiB"), Some(2 << 30));
        assert_eq!(parse_size("2gb"), Some(2 << 30));
        assert_eq!(parse_size(" 4096 "), Some(4096));
        assert_eq!(parse_size("lots"), None);
        assert_eq!(parse_size("3X"), None);
        assert_eq!(parse_size("-1G"), None);
        assert_eq!(parse_size("NaN"), None);
    }
}
