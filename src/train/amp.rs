//! Mixed precision: which autocast a step runs under (bf16 or fp16 on CUDA, none on
//! CPU) and the fp16 dynamic loss scaler, which multiplies the loss, unscales the
//! gradients, skips a step whose gradients are inf/NaN and adapts the scale.

use tch::Tensor;

use crate::config::{AmpDtype, TrainConfig};
use crate::model::precision::{cuda_autocast, AutocastDtype};

/// The precision a run trains in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AmpMode {
    /// Full f32.
    Off,
    /// bf16 autocast (CUDA).
    Bf16,
    /// fp16 autocast (CUDA) with loss scaling.
    Fp16,
}

impl AmpMode {
    /// From `TRAIN.AMP_ENABLED`/`AMP_DTYPE`; always `Off` on CPU (libtorch's CPU
    /// autocast gains nothing for these convolutions).
    pub fn from_config(cfg: &TrainConfig, device: tch::Device) -> AmpMode {
        match (cfg.amp_enabled && device.is_cuda(), cfg.amp_dtype) {
            (false, _) => AmpMode::Off,
            (true, AmpDtype::Bf16) => AmpMode::Bf16,
            (true, AmpDtype::Fp16) => AmpMode::Fp16,
        }
    }

    /// Runs `f` under this mode's autocast.
    pub fn run<T>(self, f: impl FnOnce() -> T) -> T {
        match self {
            AmpMode::Off => f(),
            AmpMode::Fp16 => cuda_autocast(AutocastDtype::Fp16, f),
            AmpMode::Bf16 => cuda_autocast(AutocastDtype::Bf16, f),
        }
    }

    /// Name for logs and metrics.
    pub fn name(self) -> &'static str {
        match self {
            AmpMode::Off => "fp32",
            AmpMode::Bf16 => "bf16",
            AmpMode::Fp16 => "fp16",
        }
    }
}

/// PyTorch's GradScaler: the loss is multiplied by `scale` before backward; after
/// backward the gradients are divided by it; a step with inf/NaN gradients is
/// skipped and the scale halved; after `growth_interval` good steps it doubles.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GradScaler {
    /// Whether scaling is on (fp16 only); off, it is the identity and never skips.
    pub enabled: bool,
    /// Current loss scale.
    pub scale: f64,
    /// Factor on growth.
    pub growth_factor: f64,
    /// Factor on an inf/NaN step.
    pub backoff_factor: f64,
    /// Good steps between growths.
    pub growth_interval: u64,
    /// Good steps since the last growth or backoff.
    pub good_steps: u64,
}

impl GradScaler {
    /// A scaler with PyTorch's defaults (scale 65536, x2 every 2000 good steps, /2 on overflow).
    pub fn new(enabled: bool) -> GradScaler {
        GradScaler {
            enabled,
            scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            good_steps: 0,
        }
    }

    /// The loss to call backward on.
    pub fn scale_loss(&self, loss: &Tensor) -> Tensor {
        if self.enabled {
            loss * self.scale
        } else {
            loss.shallow_clone()
        }
    }

    /// Divides the gradients by the scale (no-op when disabled).
    pub fn unscale(&self, params: &[Tensor]) {
        if !self.enabled {
            return;
        }
        let inv = 1.0 / self.scale;
        tch::no_grad(|| {
            for p in params {
                let mut g = p.grad();
                if g.defined() {
                    let _ = g.g_mul_scalar_(inv);
                }
            }
        });
    }

    /// Records the outcome of a step: `found_inf` backs the scale off, otherwise it
    /// grows after `growth_interval` good steps.
    pub fn update(&mut self, found_inf: bool) {
        if !self.enabled {
            return;
        }
        if found_inf {
            self.scale *= self.backoff_factor;
            self.good_steps = 0;
        } else {
            self.good_steps += 1;
            if self.good_steps >= self.growth_interval {
                self.scale *= self.growth_factor;
                self.good_steps = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaler_backs_off_on_overflow_and_grows_after_good_steps() {
        let mut s = GradScaler::new(true);
        s.growth_interval = 3;
        let start = s.scale;
        s.update(true);
        assert_eq!(s.scale, start / 2.0);
        for _ in 0..2 {
            s.update(false);
        }
        assert_eq!(s.scale, start / 2.0, "no growth before the interval");
        s.update(false);
        assert_eq!(s.scale, start);
        assert_eq!(s.good_steps, 0);
        // Scaling then unscaling gives the unscaled gradient back.
        let p = Tensor::from_slice(&[2.0f32]).set_requires_grad(true);
        s.scale_loss(&(&p * 3.0).sum(tch::Kind::Float)).backward();
        assert_eq!(p.grad().double_value(&[0]), 3.0 * s.scale);
        s.unscale(&[p.shallow_clone()]);
        assert_eq!(p.grad().double_value(&[0]), 3.0);
        // Disabled: identity, never changes.
        let mut off = GradScaler::new(false);
        off.update(true);
        assert_eq!(off.scale, 65536.0);
    }
}
