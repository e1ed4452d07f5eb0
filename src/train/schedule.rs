//! The learning-rate schedule: linear warm-up from 0 to the peak over
//! `WARMUP_STEPS`, then cosine decay to `MIN_LR` at `TOTAL_STEPS`. It is a pure
//! function of the step, so resuming needs only the step count.

/// Cosine decay with linear warm-up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CosineSchedule {
    /// Peak learning rate (reached at the end of warm-up).
    pub peak_lr: f64,
    /// Final learning rate.
    pub min_lr: f64,
    /// Warm-up steps.
    pub warmup_steps: u64,
    /// Steps of the whole run.
    pub total_steps: u64,
}

impl CosineSchedule {
    /// From the `TRAIN` section.
    pub fn from_config(cfg: &crate::config::TrainConfig) -> CosineSchedule {
        CosineSchedule {
            peak_lr: cfg.lr,
            min_lr: cfg.min_lr,
            warmup_steps: cfg.warmup_steps,
            total_steps: cfg.total_steps,
        }
    }

    /// The learning rate of optimizer step `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.peak_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let decay_steps = self.total_steps.saturating_sub(self.warmup_steps).max(1);
        let progress = ((step - self.warmup_steps) as f64 / decay_steps as f64).min(1.0);
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.min_lr + (self.peak_lr - self.min_lr) * cosine
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let s = CosineSchedule {
            peak_lr: 1e-3,
            min_lr: 1e-5,
            warmup_steps: 10,
            total_steps: 110,
        };
        assert!((s.lr_at(0) - 1e-4).abs() < 1e-12);
        assert!((s.lr_at(4) - 5e-4).abs() < 1e-12);
        assert!((s.lr_at(9) - 1e-3).abs() < 1e-12);
        assert!((s.lr_at(10) - 1e-3).abs() < 1e-12);
        // Half-way through the decay: the mean of peak and floor.
        assert!((s.lr_at(60) - (1e-3 + 1e-5) / 2.0).abs() < 1e-12);
        assert!((s.lr_at(110) - 1e-5).abs() < 1e-12);
        assert!((s.lr_at(500) - 1e-5).abs() < 1e-12);
        // Monotone decay after warm-up.
        let lrs: Vec<f64> = (10..=110).map(|t| s.lr_at(t)).collect();
        assert!(lrs.windows(2).all(|w| w[1] <= w[0]));
        let no_warmup = CosineSchedule {
            warmup_steps: 0,
            ..s
        };
        assert!((no_warmup.lr_at(0) - 1e-3).abs() < 1e-12);
    }
}
