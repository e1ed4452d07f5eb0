//! Mixed precision: which autocast a step runs under (bf16 or fp16 on CUDA, none on
//! CPU) and the fp16 dynamic loss scaler, which multiplies the loss, unscales the
//! gradients, flags a step whose gradients are inf/NaN (skipped by the optimizer)
//! and adapts the scale, all on the device ([`LossScaler`]); [`GradScaler`] is its
//! state as a checkpoint saves it.

use tch::{Device, Kind, TchError, Tensor};

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

/// PyTorch's GradScaler as a checkpoint saves it (`state.json`): the loss is
/// multiplied by `scale` before backward; after backward the gradients are divided
/// by it; a step with inf/NaN gradients is skipped and the scale halved; after
/// `growth_interval` good steps it doubles. [`LossScaler`] runs it on the device.
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
}

/// The fp16 loss scaler on the device: its scale (0-dim float32) and good-step count
/// (0-dim int32) change without a read back (libtorch's `_amp_update_scale_`, as
/// PyTorch's GradScaler does), and its unscale flags inf/NaN gradients into the
/// step's `found_inf`. Disabled, it is the identity.
#[derive(Debug)]
pub struct LossScaler {
    /// The state at the last [`LossScaler::settle`] (or creation).
    saved: GradScaler,
    scale: Tensor,
    tracker: Tensor,
}

impl LossScaler {
    /// The scaler `state` on `device`.
    pub fn new(state: GradScaler, device: Device) -> Result<LossScaler, TchError> {
        Ok(LossScaler {
            saved: state,
            scale: Tensor::f_full([], state.scale, (Kind::Float, device))?,
            tracker: Tensor::f_full([], state.good_steps as f64, (Kind::Int, device))?,
        })
    }

    /// Whether it scales (fp16).
    pub fn enabled(&self) -> bool {
        self.saved.enabled
    }

    /// The loss to call backward on (`loss` times the scale).
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor, TchError> {
        if self.enabled() {
            loss.f_mul(&self.scale)
        } else {
            Ok(loss.shallow_clone())
        }
    }

    /// Divides `grads` by the scale and sets `found_inf` (0-dim float32) to 1 where
    /// one holds an inf or a NaN (no-op when disabled).
    pub fn unscale(&self, grads: &[Tensor], found_inf: &mut Tensor) -> Result<(), TchError> {
        if !self.enabled() {
            return Ok(());
        }
        let inv = self.scale.f_reciprocal()?;
        crate::train::optim::kernels::unscale_(grads, found_inf, &inv)
    }

    /// Records a step's outcome on the device: `found_inf` (1) backs the scale off,
    /// otherwise it grows after `growth_interval` good steps.
    pub fn update(&mut self, found_inf: &Tensor) -> Result<(), TchError> {
        if !self.enabled() {
            return Ok(());
        }
        let s = self.saved;
        crate::train::optim::kernels::update_scale_(
            &mut self.scale,
            &mut self.tracker,
            &found_inf.f_to_kind(Kind::Float)?,
            s.growth_factor,
            s.backoff_factor,
            s.growth_interval as i64,
        )
    }

    /// The scale now, as a 1-element float64 tensor on the device (read with other
    /// figures).
    pub fn scale_tensor(&self) -> Result<Tensor, TchError> {
        self.scale.f_to_kind(Kind::Double)?.f_view([1])
    }

    /// The scale and the good-step count as a float64 (2,) tensor, for a caller that
    /// reads them with other figures, then [`LossScaler::settle`]s them.
    pub fn state_tensor(&self) -> Result<Tensor, TchError> {
        Tensor::f_cat(
            &[
                self.scale.f_to_kind(Kind::Double)?.f_view([1])?,
                self.tracker.f_to_kind(Kind::Double)?.f_view([1])?,
            ],
            0,
        )
    }

    /// The state for a checkpoint from `[scale, good_steps]` read off
    /// [`LossScaler::state_tensor`] (ignored when disabled: nothing changes then).
    pub fn settle(&mut self, read: [f64; 2]) -> GradScaler {
        if self.enabled() {
            self.saved.scale = read[0];
            self.saved.good_steps = read[1].round() as u64;
        }
        self.saved
    }

    /// The state for a checkpoint, read from the device (one counted read) when
    /// scaling is on.
    pub fn state(&mut self) -> Result<GradScaler, TchError> {
        if !self.enabled() {
            return Ok(self.saved);
        }
        let v = crate::util::readback::values::<f64>(&self.state_tensor()?)?;
        Ok(self.settle([v[0], v[1]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flag(on: bool) -> Tensor {
        Tensor::from(f32::from(u8::from(on)))
    }

    #[test]
    fn scaler_backs_off_on_overflow_and_grows_after_good_steps() {
        let mut saved = GradScaler::new(true);
        saved.growth_interval = 3;
        let start = saved.scale;
        let mut s = LossScaler::new(saved, Device::Cpu).unwrap();
        s.update(&flag(true)).unwrap();
        assert_eq!(s.state().unwrap().scale, start / 2.0);
        for _ in 0..2 {
            s.update(&flag(false)).unwrap();
        }
        assert_eq!(
            s.state().unwrap().scale,
            start / 2.0,
            "no growth before the interval"
        );
        assert_eq!(s.state().unwrap().good_steps, 2);
        s.update(&flag(false)).unwrap();
        let now = s.state().unwrap();
        assert_eq!((now.scale, now.good_steps), (start, 0));
        // Scaling then unscaling gives the unscaled gradient back, and flags nothing.
        let p = Tensor::from_slice(&[2.0f32]).set_requires_grad(true);
        s.scale_loss(&(&p * 3.0).sum(Kind::Float))
            .unwrap()
            .backward();
        assert_eq!(p.grad().double_value(&[0]), 3.0 * start);
        let mut found_inf = flag(false);
        s.unscale(&[p.grad()], &mut found_inf).unwrap();
        assert_eq!(p.grad().double_value(&[0]), 3.0);
        assert_eq!(found_inf.double_value(&[]), 0.0);
        let _ = p.grad().fill_(f64::INFINITY);
        s.unscale(&[p.grad()], &mut found_inf).unwrap();
        assert_eq!(
            found_inf.double_value(&[]),
            1.0,
            "an inf gradient is flagged"
        );
        // Disabled: identity, never changes.
        let mut off = LossScaler::new(GradScaler::new(false), Device::Cpu).unwrap();
        off.update(&flag(true)).unwrap();
        assert_eq!(off.state().unwrap().scale, 65536.0);
        let loss = Tensor::from(1.5f32);
        assert_eq!(off.scale_loss(&loss).unwrap().double_value(&[]), 1.5);
    }
}
