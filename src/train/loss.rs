//! The Charbonnier loss, a smooth L1 used by VRT for restoration:
//! mean(sqrt((pred - target)^2 + eps^2)). It is robust to outliers like L1 but
//! differentiable at zero.

use tch::{TchError, Tensor};

/// Mean Charbonnier distance between `pred` and `target` (same shape), as a scalar tensor.
pub fn charbonnier(pred: &Tensor, target: &Tensor, eps: f64) -> Tensor {
    let diff = pred - target;
    (&diff * &diff + eps * eps).sqrt().mean(diff.kind())
}

/// [`charbonnier`] returning libtorch's error instead of panicking.
pub fn f_charbonnier(pred: &Tensor, target: &Tensor, eps: f64) -> Result<Tensor, TchError> {
    let diff = pred.f_sub(target)?;
    diff.f_mul(&diff)?
        .f_add_scalar(eps * eps)?
        .f_sqrt()?
        .f_mean(diff.kind())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charbonnier_matches_hand_computed_values() {
        let pred = Tensor::from_slice(&[0.0f32, 1.0, 3.0, -2.0]);
        let target = Tensor::from_slice(&[0.0f32, 0.0, 0.0, 2.0]);
        let eps = 0.5f64;
        let expected = [0.0f64, 1.0, 3.0, -4.0]
            .iter()
            .map(|d| (d * d + eps * eps).sqrt())
            .sum::<f64>()
            / 4.0;
        let got = charbonnier(&pred, &target, eps).double_value(&[]);
        assert!((got - expected).abs() < 1e-6, "{got} vs {expected}");
        // Identical inputs give exactly eps; the gradient at zero difference is zero.
        let x = Tensor::from_slice(&[0.25f32, 0.5]).set_requires_grad(true);
        let loss = charbonnier(&x, &x.detach(), 1e-3);
        assert!((loss.double_value(&[]) - 1e-3).abs() < 1e-9);
        loss.backward();
        assert_eq!(x.grad().abs().sum(tch::Kind::Float).double_value(&[]), 0.0);
    }
}
