//! What one optimizer step reports to the periodic tasks at once ([`StepReport`]:
//! what the host knows without reading the device), its figures once read back at
//! the next settle ([`SettledStep`]: losses, gradient norm, skip), and the figures
//! the `train` log line averages since the previous one ([`LogWindow`]).

use std::time::Instant;

/// One finished optimizer step, the same on every rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Steps done, this one included.
    pub step: u64,
    /// Learning rate of the step.
    pub lr: f64,
    /// Samples of the step over all ranks.
    pub samples: u64,
    /// The step reached `TRAIN.TOTAL_STEPS`.
    pub finished: bool,
    /// The run stops after this step with a checkpoint (a preemption request on
    /// some rank, or `stop_after_steps`).
    pub preempted: bool,
}

/// A step's figures as read back from the device, the same on every rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SettledStep {
    /// The step's number (steps done, it included).
    pub step: u64,
    /// Mean loss over the ranks whose loss was finite (NaN when none was).
    pub mean_loss: f64,
    /// Mean over ranks of the loss of the blurred input against the sharp target.
    pub input_loss: f64,
    /// Global gradient norm before clipping (NaN when the step was skipped).
    pub grad_norm: f64,
    /// Whether the step was skipped (inf/NaN loss or gradients).
    pub skipped: bool,
    /// Whether some rank's loss was inf/NaN.
    pub nonfinite_loss: bool,
    /// The loss scale after the step.
    pub loss_scale: f64,
}

/// Sums of the steps since the last `train` log line.
#[derive(Debug, Clone, Copy)]
pub struct LogWindow {
    /// When the window opened.
    pub started: Instant,
    /// Samples over all ranks.
    pub samples: u64,
    /// Sum of the finite mean losses (a step without one adds 0).
    pub loss_sum: f64,
    /// Sum of the input losses.
    pub input_loss_sum: f64,
    /// Steps in the window.
    pub steps: u64,
}

impl Default for LogWindow {
    fn default() -> LogWindow {
        LogWindow {
            started: Instant::now(),
            samples: 0,
            loss_sum: 0.0,
            input_loss_sum: 0.0,
            steps: 0,
        }
    }
}

impl LogWindow {
    /// Adds a step as it ends.
    pub fn add(&mut self, report: &StepReport) {
        self.samples += report.samples;
        self.steps += 1;
    }

    /// Adds a step's figures once read back.
    pub fn add_settled(&mut self, settled: &SettledStep) {
        if settled.mean_loss.is_finite() {
            self.loss_sum += settled.mean_loss;
        }
        self.input_loss_sum += settled.input_loss;
    }

    /// Samples per second since the window opened.
    pub fn samples_per_s(&self) -> f64 {
        self.samples as f64 / self.started.elapsed().as_secs_f64().max(1e-9)
    }

    /// Mean loss per step.
    pub fn mean_loss(&self) -> f64 {
        self.loss_sum / self.steps.max(1) as f64
    }

    /// Mean input loss per step.
    pub fn mean_input_loss(&self) -> f64 {
        self.input_loss_sum / self.steps.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_averages_finite_losses_over_all_steps() {
        let report = StepReport {
            step: 1,
            lr: 1e-3,
            samples: 4,
            finished: false,
            preempted: false,
        };
        let settled = |mean_loss: f64| SettledStep {
            step: 1,
            mean_loss,
            input_loss: 0.5,
            grad_norm: 1.0,
            skipped: !mean_loss.is_finite(),
            nonfinite_loss: !mean_loss.is_finite(),
            loss_scale: 1.0,
        };
        let mut window = LogWindow::default();
        assert_eq!(
            window.mean_loss(),
            0.0,
            "an empty window is no division by 0"
        );
        for loss in [0.2, f64::NAN, 0.4] {
            window.add(&report);
            window.add_settled(&settled(loss));
        }
        assert_eq!(window.steps, 3);
        assert_eq!(window.samples, 12);
        assert!((window.mean_loss() - 0.2).abs() < 1e-12, "NaN counts as 0");
        assert!((window.mean_input_loss() - 0.5).abs() < 1e-12);
        assert!(window.samples_per_s() > 0.0);
    }
}
