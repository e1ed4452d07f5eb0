//! Seconds as people write them (`30`, `0.5`), read one way by every binary: the
//! launcher's `--*-s` flags, `cache serve --linger-s`, the cache tools' `--timeout`
//! and `VRTSPIKE_CACHE_LINGER_S`. A day at the most: nothing of a job waits longer,
//! and a larger number would not fit a `Duration` (1e300 used to panic there).

/// The most seconds any of these settings takes.
pub const MAX_SECONDS: f64 = 86_400.0;

/// Seconds from 0 to [`MAX_SECONDS`]; the error says what was expected.
pub fn parse_seconds(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(s) if (0.0..=MAX_SECONDS).contains(&s) => Ok(s),
        _ => Err(format!(
            "{text:?} is not a number of seconds from 0 to {MAX_SECONDS}"
        )),
    }
}

/// [`parse_seconds`], and more than 0.
pub fn parse_positive_seconds(text: &str) -> Result<f64, String> {
    match parse_seconds(text)? {
        s if s > 0.0 => Ok(s),
        _ => Err(format!("{text:?} must be more than 0 seconds")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_are_read_from_zero_to_a_day() {
        assert_eq!(parse_seconds("0"), Ok(0.0));
        assert_eq!(parse_seconds(" 2.5 "), Ok(2.5));
        assert_eq!(parse_seconds("86400"), Ok(MAX_SECONDS));
        for bad in ["-1", "86401", "1e300", "NaN", "inf", "soon", ""] {
            let error = parse_seconds(bad).unwrap_err();
            assert!(
                error.contains(&format!("{bad:?}")) && error.contains("86400"),
                "{error}"
            );
        }
        assert_eq!(parse_positive_seconds("0.1"), Ok(0.1));
        assert!(parse_positive_seconds("0")
            .unwrap_err()
            .contains("more than 0"));
        assert!(parse_positive_seconds("x").unwrap_err().contains("86400"));
    }
}
