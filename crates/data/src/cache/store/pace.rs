//! How fast each job reads, so read orders of jobs that step at different rates
//! compare by time, not steps: a use 100 steps ahead of a job that takes 3 steps a
//! second comes after one 100 steps ahead of a job that takes 10. The server
//! measures each job's step rate from the progress its readers write into their
//! pin pages (no message), over a sliding window, and maps a step of the job to the
//! time it is expected: `anchor time + (step - anchor step) / rate`.
//!
//! The mapping is re-anchored only when the job's real progress strays from it
//! (by more than a second's steps) or its rate changes by a quarter: each
//! re-anchoring makes the store re-rank the cached records the job reads, so it
//! is kept rare (at most once a second a job) once the rate is known. Until the
//! window holds a second of progress the rate is not known: the job is taken to
//! read at the rate of the jobs that are known (or one step a second), and the
//! mapping follows every change of progress, so uses compare by steps ahead of
//! each job's own progress, as between ranks of one job.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// A point on the store's clock, in microseconds since the store started.
pub type Micros = u64;

/// Observations older than this leave the rate's window.
const WINDOW_US: Micros = 120_000_000;
/// The window must span this much before the rate counts as known.
const MIN_SPAN_US: Micros = 1_000_000;
/// Observations closer than this to the last one kept are not kept.
const SAMPLE_EVERY_US: Micros = 250_000;
/// Progress may stray this long from the mapping before it is re-anchored.
const TOLERANCE_US: f64 = 1_000_000.0;
/// A rate change of this share re-anchors the mapping.
const RATE_CHANGE: f64 = 0.25;
/// At most one re-anchoring a job in this long once its rate is known.
const MIN_REANCHOR_US: Micros = 1_000_000;
/// The slowest rate a job is taken to read at (steps a second).
const MIN_RATE: f64 = 1e-3;
/// The rate of a job when no job's is known (steps a second).
pub const DEFAULT_RATE: f64 = 1.0;

/// The store's clock: real time, or a hand-moved one (tests and simulations).
#[derive(Debug, Clone)]
pub enum Clock {
    /// Microseconds since this instant.
    Real(Instant),
    /// What the handle says.
    Manual(Arc<AtomicU64>),
}

impl Clock {
    /// Real time from now.
    pub fn real() -> Clock {
        Clock::Real(Instant::now())
    }

    /// A clock that stands at 0 until its handle moves it.
    pub fn manual() -> (Clock, Arc<AtomicU64>) {
        let handle = Arc::new(AtomicU64::new(0));
        (Clock::Manual(Arc::clone(&handle)), handle)
    }

    /// The time now.
    pub fn now(&self) -> Micros {
        match self {
            Clock::Real(start) => start.elapsed().as_micros() as Micros,
            Clock::Manual(at) => at.load(Ordering::Relaxed),
        }
    }
}

/// One job's pace: its measured rate and the mapping from its steps to times.
#[derive(Debug, Clone)]
pub struct Pace {
    /// (time, progress) observations, oldest first.
    window: VecDeque<(Micros, u64)>,
    /// The measured rate, once the window spans enough (steps a second).
    measured: Option<f64>,
    /// The mapping: the step at `anchor_time` and the rate since.
    anchor_step: u64,
    anchor_time: Micros,
    rate: f64,
    /// Whether the mapping was ever set.
    anchored: bool,
    /// Whether the mapping's rate is the job's measured one.
    rate_measured: bool,
}

impl Default for Pace {
    fn default() -> Self {
        Pace {
            window: VecDeque::new(),
            measured: None,
            anchor_step: 0,
            anchor_time: 0,
            rate: DEFAULT_RATE,
            anchored: false,
            rate_measured: false,
        }
    }
}

impl Pace {
    /// The measured rate, if the window spans enough.
    pub fn measured(&self) -> Option<f64> {
        self.measured
    }

    /// The rate the mapping uses (steps a second).
    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// The job's progress was `step` at `now`; `fallback` is the rate to assume
    /// while its own is not known. Returns whether the mapping was re-anchored
    /// (the times of its uses changed).
    pub fn observe(&mut self, now: Micros, step: u64, fallback: f64) -> bool {
        self.record(now, step);
        let rate = self.measured.unwrap_or(fallback).max(MIN_RATE);
        let newly_measured = self.measured.is_some() && !self.rate_measured;
        if !self.anchored || step < self.anchor_step || newly_measured {
            return self.anchor(now, step, rate);
        }
        if self.measured.is_none() {
            // Not known yet: follow every step, so uses compare by steps ahead.
            let moved = step != self.anchor_step || rate != self.rate;
            return moved && self.anchor(now, step, rate);
        }
        let expected = self.rate * now.saturating_sub(self.anchor_time) as f64 / 1e6;
        let strayed_us = ((step - self.anchor_step) as f64 - expected).abs() / self.rate * 1e6;
        let rate_changed = (rate - self.rate).abs() > RATE_CHANGE * self.rate;
        let due = now.saturating_sub(self.anchor_time) >= MIN_REANCHOR_US;
        (strayed_us > TOLERANCE_US || rate_changed) && due && self.anchor(now, step, rate)
    }

    fn anchor(&mut self, now: Micros, step: u64, rate: f64) -> bool {
        self.anchor_time = now;
        self.anchor_step = step;
        self.rate = rate;
        self.anchored = true;
        self.rate_measured = self.measured.is_some();
        true
    }

    /// Keeps the observation in the window and measures the rate over it.
    fn record(&mut self, now: Micros, step: u64) {
        if self.window.back().is_some_and(|&(_, s)| step < s) {
            // Progress went back (a new read order): the old window says nothing.
            self.window.clear();
            self.measured = None;
        }
        let sparse = self
            .window
            .back()
            .is_none_or(|&(t, _)| now.saturating_sub(t) >= SAMPLE_EVERY_US);
        if sparse {
            self.window.push_back((now, step));
        }
        while self.window.len() > 2
            && self
                .window
                .front()
                .is_some_and(|&(t, _)| now.saturating_sub(t) > WINDOW_US)
        {
            self.window.pop_front();
        }
        let (Some(&(t0, s0)), Some(&(t1, s1))) = (self.window.front(), self.window.back()) else {
            return;
        };
        let span = t1.saturating_sub(t0);
        if span >= MIN_SPAN_US {
            self.measured =
                Some((s1.saturating_sub(s0) as f64 / (span as f64 / 1e6)).max(MIN_RATE));
        }
    }

    /// When the job is expected at `step`.
    pub fn time_of(&self, step: u64) -> Micros {
        let steps = step as f64 - self.anchor_step as f64;
        let at = self.anchor_time as f64 + steps / self.rate * 1e6;
        if at <= 0.0 {
            0
        } else if at >= (u64::MAX >> 2) as f64 {
            u64::MAX >> 2
        } else {
            at as Micros
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_rate_follows_every_step() {
        let mut pace = Pace::default();
        assert!(pace.observe(0, 10, DEFAULT_RATE));
        assert_eq!(pace.time_of(13), 3_000_000, "3 steps at the default rate");
        assert!(
            !pace.observe(0, 10, DEFAULT_RATE),
            "no change: no re-anchoring"
        );
        assert!(pace.observe(10, 12, DEFAULT_RATE));
        assert_eq!(
            pace.time_of(13),
            10 + 1_000_000,
            "one step ahead of the progress"
        );
    }

    #[test]
    fn a_measured_rate_maps_steps_to_times_and_stays_put_while_it_holds() {
        let mut pace = Pace::default();
        // 10 steps a second for 3 seconds.
        let mut reanchored = 0;
        for i in 0..=30u64 {
            reanchored += usize::from(pace.observe(i * 100_000, i, DEFAULT_RATE));
        }
        let rate = pace.measured().unwrap();
        assert!((rate - 10.0).abs() < 0.01, "{rate}");
        // Once known, on pace: the mapping is not moved at every step.
        let before = reanchored;
        for i in 31..=60u64 {
            reanchored += usize::from(pace.observe(i * 100_000, i, DEFAULT_RATE));
        }
        assert!(
            reanchored - before <= 1,
            "{} re-anchorings on pace",
            reanchored - before
        );
        let at = pace.time_of(70);
        assert!((at as i64 - 7_000_000).abs() < 20_000, "{at}");
    }

    #[test]
    fn a_stalled_job_is_re_anchored_and_its_uses_move_away() {
        let mut pace = Pace::default();
        for i in 0..=20u64 {
            pace.observe(i * 100_000, i, DEFAULT_RATE);
        }
        let before = pace.time_of(30);
        // It stops at step 20 for 5 seconds.
        let mut moved = false;
        for t in 21..=70u64 {
            moved |= pace.observe(t * 100_000, 20, DEFAULT_RATE);
        }
        assert!(moved);
        assert!(
            pace.time_of(30) > before + 4_000_000,
            "{} vs {before}",
            pace.time_of(30)
        );
    }

    #[test]
    fn times_saturate_instead_of_overflowing() {
        let mut pace = Pace::default();
        pace.observe(5, 1000, MIN_RATE);
        assert_eq!(pace.time_of(0), 0);
        assert_eq!(pace.time_of(u64::MAX), u64::MAX >> 2);
    }
}
