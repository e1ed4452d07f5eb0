//! The gradients of an optimizer step as a whole: their global L2 norm as one
//! multi-tensor reduction that stays on the device, and clipping to a maximum norm
//! applied on the device (every gradient times min(1, max / norm), nothing read
//! back); and the per-parameter forms these replace (a read back for every
//! parameter), kept for `vrtspike profile --optimizer loop` and as the tests'
//! reference.

use tch::{Device, Kind, TchError, Tensor};

use super::kernels;
use crate::util::readback;

/// The global L2 norm of `grads` as a 0-dim float32 tensor on `device` (0 without
/// gradients); non-finite when a gradient is.
pub fn total_norm(grads: &[Tensor], device: Device) -> Result<Tensor, TchError> {
    match kernels::total_norm(grads)? {
        Some(norm) => norm.f_to_kind(Kind::Float),
        None => Tensor::f_zeros([], (Kind::Float, device)),
    }
}

/// Scales `grads` so that their global norm `norm` (from [`total_norm`]) is at most
/// `max_norm`: by `max_norm / (norm + 1e-6)` where `norm` is finite and above it,
/// else by 1 (a non-finite norm leaves them alone: that step is skipped).
pub fn clip_(grads: &[Tensor], norm: &Tensor, max_norm: f64) -> Result<(), TchError> {
    if grads.is_empty() {
        return Ok(());
    }
    let over = norm.f_gt(max_norm)?.f_logical_and(&norm.f_isfinite()?)?;
    let scaled = norm
        .f_add_scalar(1e-6)?
        .f_reciprocal()?
        .f_mul_scalar(max_norm)?;
    let factor = scaled.f_where_self(&over, &scaled.f_ones_like()?)?;
    kernels::mul_(grads, &factor)
}

/// The global L2 norm of the parameters' gradients, one parameter at a time in
/// float64 with a read back each (the form before the multi-tensor one).
pub fn norm_per_parameter(params: &[Tensor]) -> Result<f64, TchError> {
    let mut sum = 0.0f64;
    for p in params {
        let g = p.f_grad()?;
        if g.defined() {
            let n = readback::scalar(&g.f_to_kind(Kind::Double)?.f_norm()?)?;
            sum += n * n;
        }
    }
    Ok(sum.sqrt())
}

/// Clipping one parameter at a time after [`norm_per_parameter`]; returns the norm
/// before clipping (non-finite gradients are left alone).
pub fn clip_per_parameter(params: &[Tensor], max_norm: f64) -> Result<f64, TchError> {
    let norm = norm_per_parameter(params)?;
    if norm.is_finite() && norm > max_norm {
        let factor = max_norm / (norm + 1e-6);
        tch::no_grad(|| -> Result<(), TchError> {
            for p in params {
                let mut g = p.f_grad()?;
                if g.defined() {
                    let _ = g.f_mul_scalar_(factor)?;
                }
            }
            Ok(())
        })?;
    }
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parameters with gradients `values[i] * scale` of a few shapes.
    fn with_grads(scale: f64) -> Vec<Tensor> {
        tch::manual_seed(5);
        [vec![3i64], vec![4, 5], vec![2, 3, 3], vec![1]]
            .iter()
            .map(|shape| {
                let p = Tensor::zeros(shape.as_slice(), (Kind::Float, Device::Cpu))
                    .set_requires_grad(true);
                let g = Tensor::randn(shape.as_slice(), (Kind::Float, Device::Cpu)) * scale;
                (&p * &g).sum(Kind::Float).backward();
                p
            })
            .collect()
    }

    fn grads(params: &[Tensor]) -> Vec<Tensor> {
        params.iter().map(|p| p.grad()).collect()
    }

    fn flat(params: &[Tensor]) -> Vec<f64> {
        let all: Vec<Tensor> = params.iter().map(|p| p.grad().flatten(0, -1)).collect();
        readback::values::<f64>(&Tensor::cat(&all, 0)).unwrap()
    }

    /// Clipping on the device equals the per-parameter clipping before it, above and
    /// below the maximum, and both leave non-finite gradients alone.
    #[test]
    fn device_clipping_equals_per_parameter_clipping() {
        for (scale, max) in [(1.0, 0.5), (1.0, 100.0), (30.0, 1.0), (1e-3, 1e-4)] {
            let (a, b) = (with_grads(scale), with_grads(scale));
            let reference = clip_per_parameter(&a, max).unwrap();
            let norm = total_norm(&grads(&b), Device::Cpu).unwrap();
            let got = readback::scalar(&norm).unwrap();
            assert!(
                (got - reference).abs() <= 1e-6 * reference,
                "norm {got} vs {reference}"
            );
            clip_(&grads(&b), &norm, max).unwrap();
            for (x, y) in flat(&a).iter().zip(flat(&b)) {
                assert!(
                    (x - y).abs() <= 1e-6 * x.abs().max(1e-30),
                    "{x} vs {y} (scale {scale}, max {max})"
                );
            }
            let after = norm_per_parameter(&b).unwrap();
            assert!(
                after <= max * (1.0 + 1e-6) || reference <= max,
                "{after} > {max}"
            );
        }
        let params = with_grads(1.0);
        let g = params[1].grad();
        let _ = g.get(0).get(0).fill_(f64::NAN);
        let before = flat(&params);
        let norm = total_norm(&grads(&params), Device::Cpu).unwrap();
        assert!(readback::scalar(&norm).unwrap().is_nan());
        clip_(&grads(&params), &norm, 1e-3).unwrap();
        let after = flat(&params);
        for (x, y) in before.iter().zip(&after) {
            assert!(
                x == y || (x.is_nan() && y.is_nan()),
                "a NaN norm scaled {x} to {y}"
            );
        }
        assert_eq!(
            readback::scalar(&total_norm(&[], Device::Cpu).unwrap()).unwrap(),
            0.0
        );
    }
}
