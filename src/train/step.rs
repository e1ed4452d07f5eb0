//! The update at the end of an optimizer step, after gradients were averaged over
//! ranks, with nothing read back to the host: unscale (fp16), the global gradient
//! norm of the trainable parameters, clipping, and AdamW, which skips the step on
//! the device when a rank's loss or a gradient is inf/NaN (`found_inf`, as PyTorch
//! passes it to its fused optimizers). A frozen parameter group (`TRAIN.FIX_ITER`)
//! counts in neither the gradient norm nor clipping, as if it had no gradient. The
//! skip is the same on every rank (the averaged gradients and the reduced loss flag
//! are), so an inf/NaN never reaches the weights or the optimizer moments. What
//! happened ([`UpdateOutcome`]) stays on the device until the next log step reads it.

use tch::{Kind, TchError, Tensor};

use super::amp::LossScaler;
use super::optim::{grads, AdamW};
use crate::util::readback;

/// What happened to one optimizer step, as read back.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepResult {
    /// The weights were updated; the gradient norm before clipping.
    Applied {
        /// Global gradient norm before clipping.
        grad_norm: f64,
    },
    /// Nothing was applied: a loss or a gradient was inf/NaN.
    Skipped {
        /// Whether the loss (on some rank) was non-finite, rather than only a gradient.
        nonfinite_loss: bool,
    },
}

/// The update of training step `step` (0-based) at learning rate `lr`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UpdateOptions {
    /// The training step (decides whether the fixed group is frozen).
    pub step: u64,
    /// The schedule's learning rate.
    pub lr: f64,
    /// Clip the global gradient norm to this.
    pub max_grad_norm: Option<f64>,
}

/// What an update left on the device (0-dim float32 tensors).
#[derive(Debug)]
pub struct UpdateOutcome {
    /// The global gradient norm before clipping.
    pub grad_norm: Tensor,
    /// 1 when the step was skipped, else 0.
    pub skipped: Tensor,
}

impl UpdateOutcome {
    /// The outcome on the host (one counted read); `nonfinite_loss` is the step's
    /// loss flag as given to [`apply_update`].
    pub fn read(&self, nonfinite_loss: &Tensor) -> Result<StepResult, TchError> {
        let all = Tensor::f_stack(
            &[
                self.grad_norm.f_to_kind(Kind::Double)?,
                self.skipped.f_to_kind(Kind::Double)?,
                nonfinite_loss.f_to_kind(Kind::Double)?,
            ],
            0,
        )?;
        let v = readback::values::<f64>(&all)?;
        Ok(match v[1] != 0.0 {
            false => StepResult::Applied { grad_norm: v[0] },
            true => StepResult::Skipped {
                nonfinite_loss: v[2] > 0.0,
            },
        })
    }
}

/// Finishes a step: `nonfinite_loss` (0-dim, on the parameters' device) is above 0
/// when any rank's loss was inf/NaN. Nothing is read back. A libtorch failure (out
/// of memory) is returned, not a panic.
pub fn apply_update(
    optimizer: &mut AdamW,
    scaler: &mut LossScaler,
    nonfinite_loss: &Tensor,
    options: UpdateOptions,
) -> Result<UpdateOutcome, TchError> {
    let grads = optimizer.trainable_grads(options.step)?;
    let mut found_inf = nonfinite_loss.f_gt(0.0)?.f_to_kind(Kind::Float)?;
    scaler.unscale(&grads, &mut found_inf)?;
    let norm = grads::total_norm(&grads, nonfinite_loss.device())?;
    // Clipping leaves non-finite gradients alone; such a step is skipped anyway.
    if let Some(max) = options.max_grad_norm {
        grads::clip_(&grads, &norm, max)?;
    }
    let found_inf = found_inf
        .f_gt(0.0)?
        .f_logical_or(&norm.f_isfinite()?.f_logical_not()?)?
        .f_to_kind(Kind::Float)?;
    optimizer.step(options.lr, options.step, Some(&found_inf))?;
    scaler.update(&found_inf)?;
    Ok(UpdateOutcome {
        grad_norm: norm,
        skipped: found_inf,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::amp::GradScaler;
    use tch::{Device, Kind, Tensor};

    /// Copies of tensors' values (to compare before and after).
    fn snapshot(params: &[Tensor]) -> Vec<Tensor> {
        params.iter().map(|p| p.detach().copy()).collect()
    }

    fn options(max_grad_norm: Option<f64>) -> UpdateOptions {
        UpdateOptions {
            step: 0,
            lr: 0.1,
            max_grad_norm,
        }
    }

    fn setup() -> (Tensor, AdamW) {
        let w = Tensor::from_slice(&[0.5f32, -0.25, 1.0]).set_requires_grad(true);
        let opt = AdamW::new(vec![w.shallow_clone()], [0.9, 0.99], 1e-8, 0.01);
        (w, opt)
    }

    fn flag(on: bool) -> Tensor {
        Tensor::from(f32::from(u8::from(on)))
    }

    fn scaler(enabled: bool) -> LossScaler {
        LossScaler::new(GradScaler::new(enabled), Device::Cpu).unwrap()
    }

    #[test]
    fn nan_loss_never_touches_weights_or_moments() {
        let (w, mut opt) = setup();
        let before = snapshot(opt.params());
        let input = Tensor::from_slice(&[1.0f32, f32::NAN, 2.0]);
        let loss = super::super::loss::charbonnier(
            &(&w * &input),
            &Tensor::zeros([3], (Kind::Float, Device::Cpu)),
            1e-3,
        );
        assert!(loss.double_value(&[]).is_nan());
        loss.backward();
        let mut fp16 = scaler(true);
        let scale = fp16.state().unwrap().scale;
        let nonfinite = flag(true);
        let reads = readback::count();
        let outcome = apply_update(&mut opt, &mut fp16, &nonfinite, options(Some(1.0))).unwrap();
        assert_eq!(readback::count(), reads, "the update read nothing back");
        assert_eq!(
            outcome.read(&nonfinite).unwrap(),
            StepResult::Skipped {
                nonfinite_loss: true
            }
        );
        assert!(w.equal(&before[0]), "weights unchanged");
        assert_eq!(opt.steps().unwrap(), 0);
        for (_, m) in opt.state_tensors() {
            assert_eq!(
                m.abs().sum(Kind::Float).double_value(&[]),
                0.0,
                "moments untouched"
            );
        }
        assert_eq!(
            fp16.state().unwrap().scale,
            scale / 2.0,
            "fp16 scale backs off"
        );
        // An inf gradient with a finite loss flag is caught too.
        let mut g = w.grad();
        let _ = g.fill_(f64::INFINITY);
        let ok = flag(false);
        let outcome = apply_update(&mut opt, &mut scaler(false), &ok, options(None)).unwrap();
        assert_eq!(
            outcome.read(&ok).unwrap(),
            StepResult::Skipped {
                nonfinite_loss: false
            }
        );
        assert!(w.equal(&before[0]));
        // The next good step applies.
        opt.zero_grad().unwrap();
        (&w * 2.0).sum(Kind::Float).backward();
        let outcome = apply_update(&mut opt, &mut scaler(false), &ok, options(None)).unwrap();
        let result = outcome.read(&ok).unwrap();
        assert!(
            matches!(result, StepResult::Applied { grad_norm } if (grad_norm - 12f64.sqrt()).abs() < 1e-5),
            "{result:?}"
        );
        assert!(!w.equal(&before[0]));
        assert_eq!(opt.steps().unwrap(), 1);
    }

    /// The update on the device equals the one before it (per-parameter norm, host
    /// clipping, the loop kernel) step for step, clipping included.
    #[test]
    fn the_device_update_equals_the_host_update() {
        let make = || {
            let w = Tensor::from_slice(&[0.5f32, -0.25, 1.0, 2.0]).set_requires_grad(true);
            let opt = AdamW::new(vec![w.shallow_clone()], [0.9, 0.99], 1e-8, 0.01);
            (w, opt)
        };
        let ((w, mut opt), (v, old)) = (make(), make());
        let mut old = old.with_kernel(crate::train::optim::UpdateKernel::Loop);
        for step in 0..6u64 {
            let coef = Tensor::from_slice(&[3.0f32, -4.0, 0.5, 1.0]) * (step as f64 + 1.0);
            opt.zero_grad().unwrap();
            old.zero_grad().unwrap();
            (&w * &coef).sum(Kind::Float).backward();
            (&v * &coef).sum(Kind::Float).backward();
            let outcome = apply_update(
                &mut opt,
                &mut scaler(false),
                &flag(false),
                options(Some(2.0)),
            )
            .unwrap();
            let norm = grads::clip_per_parameter(&[v.shallow_clone()], 2.0).unwrap();
            old.step(0.1, step, None).unwrap();
            let got = readback::scalar(&outcome.grad_norm).unwrap();
            assert!((got - norm).abs() <= 1e-6 * norm, "{got} vs {norm}");
            let (a, b) = (
                readback::values::<f64>(&w).unwrap(),
                readback::values::<f64>(&v).unwrap(),
            );
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() < 1e-6, "step {step}: {a:?} vs {b:?}");
            }
        }
    }
}
