//! A latency histogram with 1 µs buckets up to 10 ms (then one overflow bucket): small
//! enough to send between processes as JSON, exact enough for p50/p99 in µs.

use serde::{Deserialize, Serialize};

const BUCKETS: usize = 10_000;

/// Counts of latencies by whole microsecond.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Histogram {
    counts: Vec<u64>,
    overflow: u64,
    max_us: f64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
            overflow: 0,
            max_us: 0.0,
        }
    }
}

impl Histogram {
    /// Records one latency in microseconds.
    pub fn record(&mut self, us: f64) {
        let bucket = us.max(0.0) as usize;
        match self.counts.get_mut(bucket) {
            Some(count) => *count += 1,
            None => self.overflow += 1,
        }
        self.max_us = self.max_us.max(us);
    }

    /// Adds another histogram's counts.
    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.overflow += other.overflow;
        self.max_us = self.max_us.max(other.max_us);
    }

    /// Samples recorded.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum::<u64>() + self.overflow
    }

    /// The latency under which a fraction `q` of samples fall (upper bucket edge, µs).
    pub fn percentile(&self, q: f64) -> f64 {
        let total = self.count();
        if total == 0 {
            return 0.0;
        }
        let rank = ((q * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (us, &count) in self.counts.iter().enumerate() {
            seen += count;
            if seen >= rank {
                return (us + 1) as f64;
            }
        }
        self.max_us
    }

    /// Largest latency seen.
    pub fn max(&self) -> f64 {
        self.max_us
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_merge() {
        let mut a = Histogram::default();
        for us in 0..100 {
            a.record(us as f64 + 0.5);
        }
        assert_eq!(a.percentile(0.5), 50.0);
        assert_eq!(a.percentile(0.99), 99.0);
        let mut b = Histogram::default();
        b.record(20_000.0);
        a.merge(&b);
        assert_eq!(a.count(), 101);
        assert_eq!(a.percentile(1.0), 20_000.0);
        assert_eq!(a.max(), 20_000.0);
    }
}
