//! The update at the end of an optimizer step, after gradients were averaged over
//! ranks: unscale (fp16), check that the loss and every trainable gradient are
//! finite, clip, apply AdamW. A frozen parameter group (`TRAIN.FIX_ITER`) counts in
//! neither the gradient norm nor clipping, as if it had no gradient. A non-finite step is skipped on every rank alike (the averaged
//! gradients and the reduced loss flag are the same everywhere), so an inf/NaN
//! never reaches the weights or the optimizer moments.

use tch::TchError;

use super::amp::GradScaler;
use super::optim::{clip_grad_norm, grad_norm, AdamW};

/// What happened to one optimizer step.
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

/// Finishes a step: `nonfinite_loss` says whether any rank's loss was inf/NaN. A
/// libtorch failure (out of memory) is returned, not a panic.
pub fn apply_update(
    optimizer: &mut AdamW,
    scaler: &mut GradScaler,
    nonfinite_loss: bool,
    options: UpdateOptions,
) -> Result<StepResult, TchError> {
    scaler.unscale(optimizer.params());
    let trainable = optimizer.trainable(options.step);
    // Clipping leaves non-finite gradients alone; a skipped step clears them anyway.
    let norm = match options.max_grad_norm {
        Some(max) => clip_grad_norm(&trainable, max)?,
        None => grad_norm(&trainable)?,
    };
    if nonfinite_loss || !norm.is_finite() {
        optimizer.zero_grad();
        scaler.update(true);
        return Ok(StepResult::Skipped { nonfinite_loss });
    }
    optimizer.step(options.lr, options.step)?;
    scaler.update(false);
    Ok(StepResult::Applied { grad_norm: norm })
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let mut scaler = GradScaler::new(true);
        let scale = scaler.scale;
        let result = apply_update(&mut opt, &mut scaler, true, options(Some(1.0))).unwrap();
        assert_eq!(
            result,
            StepResult::Skipped {
                nonfinite_loss: true
            }
        );
        assert!(w.equal(&before[0]), "weights unchanged");
        assert_eq!(opt.steps(), 0);
        for (_, m) in opt.state_tensors() {
            assert_eq!(
                m.abs().sum(Kind::Float).double_value(&[]),
                0.0,
                "moments untouched"
            );
        }
        assert_eq!(scaler.scale, scale / 2.0, "fp16 scale backs off");
        // A NaN gradient with a finite loss flag is caught too.
        let mut g = w.grad();
        let _ = g.fill_(f64::INFINITY);
        let result =
            apply_update(&mut opt, &mut GradScaler::new(false), false, options(None)).unwrap();
        assert_eq!(
            result,
            StepResult::Skipped {
                nonfinite_loss: false
            }
        );
        assert!(w.equal(&before[0]));
        // The next good step applies.
        opt.zero_grad();
        (&w * 2.0).sum(Kind::Float).backward();
        let result =
            apply_update(&mut opt, &mut GradScaler::new(false), false, options(None)).unwrap();
        assert!(
            matches!(result, StepResult::Applied { grad_norm } if (grad_norm - 12f64.sqrt()).abs() < 1e-5)
        );
        assert!(!w.equal(&before[0]));
        assert_eq!(opt.steps(), 1);
    }
}
