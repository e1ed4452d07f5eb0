//! Rank 0's progress line in the form researchers know from BasicSR/mmagic:
//! `[epoch:  3, iter:   1,200, lr:(1.000e-04)] [eta: 1 day, 2:03:04, time (data): 0.412 (0.003)] l_pix: 1.2345e-02`,
//! with `[cache bypass: N]` before the losses when N reads of the window were taken
//! from disk because the cache could not take them, and the ETA estimate behind it.

use std::fmt::Write;

/// The figures of one log line.
#[derive(Debug, Clone, PartialEq)]
pub struct LogLine<'a> {
    /// Epoch of the sampler.
    pub epoch: u64,
    /// Optimizer step just done.
    pub iter: u64,
    /// Learning rate of that step.
    pub lr: f64,
    /// Seconds left, if known.
    pub eta_s: Option<f64>,
    /// Seconds per step (mean over the logging window).
    pub iter_time_s: f64,
    /// Seconds per step waiting for data.
    pub data_time_s: f64,
    /// Reads of the window the cache could not take (read from disk instead).
    pub cache_bypass: u64,
    /// `(name, value)` of each loss (e.g. `l_pix`).
    pub losses: &'a [(&'a str, f64)],
}

/// `1,234,567`.
pub fn group_thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `H:MM:SS`, with `N day(s), ` in front past a day (Python's `timedelta` form).
pub fn format_eta(seconds: f64) -> String {
    if !seconds.is_finite() || seconds < 0.0 {
        return "?".into();
    }
    let total = seconds.round() as u64;
    let (days, rest) = (total / 86_400, total % 86_400);
    let hms = format!("{}:{:02}:{:02}", rest / 3600, rest % 3600 / 60, rest % 60);
    match days {
        0 => hms,
        1 => format!("1 day, {hms}"),
        d => format!("{d} days, {hms}"),
    }
}

/// Seconds left for `total - done` steps at `seconds_per_step`.
pub fn eta_seconds(done: u64, total: u64, seconds_per_step: f64) -> Option<f64> {
    (seconds_per_step.is_finite() && seconds_per_step > 0.0)
        .then(|| total.saturating_sub(done) as f64 * seconds_per_step)
}

/// `value` in Python's `{:.Ne}` form: `1.000e-04`, `2.5e+00` (sign and two digits).
pub fn sci(value: f64, digits: usize) -> String {
    let rust = format!("{value:.digits$e}");
    match rust.split_once('e') {
        Some((mantissa, exp)) => {
            let (sign, magnitude) = match exp.strip_prefix('-') {
                Some(m) => ('-', m),
                None => ('+', exp),
            };
            format!("{mantissa}e{sign}{magnitude:0>2}")
        }
        None => rust,
    }
}

/// The line, without a trailing newline.
pub fn format_log_line(line: &LogLine) -> String {
    let eta = line.eta_s.map_or_else(|| "?".to_string(), format_eta);
    let mut out = format!(
        "[epoch:{:3}, iter:{:>9}, lr:({})] [eta: {eta}, time (data): {:.3} ({:.3})]",
        line.epoch,
        group_thousands(line.iter),
        sci(line.lr, 3),
        line.iter_time_s,
        line.data_time_s
    );
    if line.cache_bypass > 0 {
        // Writing to a String cannot fail.
        let _ = write!(
            out,
            " [cache bypass: {}]",
            group_thousands(line.cache_bypass)
        );
    }
    for (name, value) in line.losses {
        // Writing to a String cannot fail.
        let _ = write!(out, " {name}: {}", sci(*value, 4));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_has_the_known_shape() {
        let losses = [("l_pix", 0.012345), ("l_input", 0.05)];
        let line = LogLine {
            epoch: 3,
            iter: 1200,
            lr: 1e-4,
            eta_s: Some(93_784.0),
            iter_time_s: 0.41234,
            data_time_s: 0.0031,
            cache_bypass: 0,
            losses: &losses,
        };
        assert_eq!(
            format_log_line(&line),
            "[epoch:  3, iter:    1,200, lr:(1.000e-04)] [eta: 1 day, 2:03:04, time (data): 0.412 (0.003)] \
             l_pix: 1.2345e-02 l_input: 5.0000e-02"
        );
        let unknown = LogLine {
            eta_s: None,
            losses: &[],
            ..line
        };
        assert!(format_log_line(&unknown).contains("[eta: ?, time"));
        let bypassed = LogLine {
            cache_bypass: 1234,
            ..line
        };
        assert!(
            format_log_line(&bypassed)
                .contains("time (data): 0.412 (0.003)] [cache bypass: 1,234] l_pix: 1.2345e-02"),
            "{}",
            format_log_line(&bypassed)
        );
    }

    #[test]
    fn eta_and_grouping() {
        assert_eq!(format_eta(59.6), "0:01:00");
        assert_eq!(format_eta(3.0 * 86_400.0 + 61.0), "3 days, 0:01:01");
        assert_eq!(format_eta(f64::NAN), "?");
        assert_eq!(eta_seconds(90, 100, 0.5), Some(5.0));
        assert_eq!(eta_seconds(100, 100, 0.5), Some(0.0));
        assert_eq!(eta_seconds(1, 100, 0.0), None);
        assert_eq!(sci(2.5, 1), "2.5e+00");
        assert_eq!(sci(-1.5e-123, 2), "-1.50e-123");
        assert_eq!(group_thousands(0), "0");
        assert_eq!(group_thousands(999), "999");
        assert_eq!(group_thousands(1_234_567), "1,234,567");
    }
}
