//! AdamW (decoupled weight decay, PyTorch's update rule) with its moments held as
//! plain tensors, so a checkpoint saves and restores them bit-exactly, plus the
//! gradient utilities of a step: the global norm and global-norm clipping.

use tch::{Kind, Tensor};

/// AdamW over a fixed, ordered list of parameters.
#[derive(Debug)]
pub struct AdamW {
    params: Vec<Tensor>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    steps: u64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
}

/// Optimizer state that does not fit a checkpoint's parameter list.
#[derive(Debug, thiserror::Error)]
#[error("optimizer state: {0}")]
pub struct OptimStateError(pub String);

impl AdamW {
    /// AdamW over `params` (the order is the state's order).
    pub fn new(params: Vec<Tensor>, betas: [f64; 2], eps: f64, weight_decay: f64) -> AdamW {
        let zeros = |p: &Tensor| Tensor::zeros_like(p).detach();
        AdamW {
            exp_avg: params.iter().map(zeros).collect(),
            exp_avg_sq: params.iter().map(zeros).collect(),
            params,
            steps: 0,
            beta1: betas[0],
            beta2: betas[1],
            eps,
            weight_decay,
        }
    }

    /// The parameters it updates.
    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    /// Updates applied so far (the bias-correction step count).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Clears every gradient.
    pub fn zero_grad(&mut self) {
        for p in &mut self.params {
            let mut grad = p.grad();
            if grad.defined() {
                let _ = grad.detach_().zero_();
            }
        }
    }

    /// One AdamW update with learning rate `lr` from the current gradients
    /// (parameters without a gradient are left alone).
    pub fn step(&mut self, lr: f64) {
        self.steps += 1;
        let t = self.steps as i32;
        let bias1 = 1.0 - self.beta1.powi(t);
        let bias2 = 1.0 - self.beta2.powi(t);
        tch::no_grad(|| {
            for ((p, m), v) in self
                .params
                .iter_mut()
                .zip(&mut self.exp_avg)
                .zip(&mut self.exp_avg_sq)
            {
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                if self.weight_decay != 0.0 {
                    let _ = p.g_mul_scalar_(1.0 - lr * self.weight_decay);
                }
                let _ = m.g_mul_scalar_(self.beta1);
                let _ = m.g_add_(&(&g * (1.0 - self.beta1)));
                let _ = v.g_mul_scalar_(self.beta2);
                let _ = v.g_add_(&(&g * &g * (1.0 - self.beta2)));
                let denom = v.sqrt() / bias2.sqrt() + self.eps;
                let _ = p.g_sub_(&(&*m / denom * (lr / bias1)));
            }
        });
    }

    /// The moments as named tensors (`exp_avg.<i>`, `exp_avg_sq.<i>`) for a checkpoint.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(2 * self.params.len());
        for (i, (m, v)) in self.exp_avg.iter().zip(&self.exp_avg_sq).enumerate() {
            out.push((format!("exp_avg.{i}"), m.shallow_clone()));
            out.push((format!("exp_avg_sq.{i}"), v.shallow_clone()));
        }
        out
    }

    /// Restores moments saved by [`AdamW::state_tensors`] and the step count;
    /// a missing tensor or a shape mismatch is an error naming it.
    pub fn load_state(
        &mut self,
        named: &[(String, Tensor)],
        steps: u64,
    ) -> Result<(), OptimStateError> {
        let find = |name: &str| named.iter().find(|(n, _)| n == name).map(|(_, t)| t);
        tch::no_grad(|| {
            for (i, p) in self.params.iter().enumerate() {
                for (prefix, slot) in [
                    ("exp_avg", &mut self.exp_avg[i]),
                    ("exp_avg_sq", &mut self.exp_avg_sq[i]),
                ] {
                    let name = format!("{prefix}.{i}");
                    let saved =
                        find(&name).ok_or_else(|| OptimStateError(format!("{name} is missing")))?;
                    if saved.size() != p.size() {
                        return Err(OptimStateError(format!(
                            "{name} has shape {:?}, the parameter {:?}",
                            saved.size(),
                            p.size()
                        )));
                    }
                    slot.copy_(&saved.to_kind(slot.kind()).to_device(slot.device()));
                }
            }
            Ok(())
        })?;
        self.steps = steps;
        Ok(())
    }
}

/// Scales gradients so that their global L2 norm is at most `max_norm`; returns the
/// norm before clipping (non-finite when a gradient is).
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> f64 {
    let norm = grad_norm(params);
    if norm.is_finite() && norm > max_norm {
        let factor = max_norm / (norm + 1e-6);
        tch::no_grad(|| {
            for p in params {
                let mut g = p.grad();
                if g.defined() {
                    let _ = g.g_mul_scalar_(factor);
                }
            }
        });
    }
    norm
}

/// Global L2 norm of the gradients.
pub fn grad_norm(params: &[Tensor]) -> f64 {
    let mut sum = 0.0f64;
    for p in params {
        let g = p.grad();
        if g.defined() {
            let n = g.to_kind(Kind::Double).norm().double_value(&[]);
            sum += n * n;
        }
    }
    sum.sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One scalar AdamW update computed by hand from PyTorch's formula.
    #[test]
    fn adamw_matches_the_formula() {
        let p = Tensor::from_slice(&[1.0f64, -2.0]).set_requires_grad(true);
        let mut opt = AdamW::new(vec![p.shallow_clone()], [0.9, 0.99], 1e-8, 0.1);
        let (lr, g) = (0.01, [0.5f64, -1.5]);
        let mut expected = [1.0f64, -2.0];
        let (mut m, mut v) = ([0.0f64; 2], [0.0f64; 2]);
        for t in 1..=3 {
            opt.zero_grad();
            let loss = (&p * Tensor::from_slice(&g)).sum(Kind::Double);
            loss.backward();
            opt.step(lr);
            for i in 0..2 {
                expected[i] *= 1.0 - lr * 0.1;
                m[i] = 0.9 * m[i] + 0.1 * g[i];
                v[i] = 0.99 * v[i] + 0.01 * g[i] * g[i];
                let mh = m[i] / (1.0 - 0.9f64.powi(t));
                let denom = v[i].sqrt() / (1.0 - 0.99f64.powi(t)).sqrt() + 1e-8;
                expected[i] -= lr * mh / denom;
            }
        }
        let got = Vec::<f64>::try_from(&p).unwrap();
        for i in 0..2 {
            assert!(
                (got[i] - expected[i]).abs() < 1e-12,
                "{got:?} vs {expected:?}"
            );
        }
        // The state round-trips into a fresh optimizer.
        let q = p.detach().copy().set_requires_grad(true);
        let mut other = AdamW::new(vec![q], [0.9, 0.99], 1e-8, 0.1);
        other.load_state(&opt.state_tensors(), opt.steps()).unwrap();
        assert_eq!(other.steps(), 3);
        let err = other.load_state(&[], 3).unwrap_err().to_string();
        assert!(err.contains("exp_avg.0"), "{err}");
    }

    #[test]
    fn clipping_scales_to_the_max_norm() {
        let p = Tensor::from_slice(&[0.0f32, 0.0]).set_requires_grad(true);
        (&p * Tensor::from_slice(&[3.0f32, 4.0]))
            .sum(Kind::Float)
            .backward();
        let norm = clip_grad_norm(&[p.shallow_clone()], 1.0);
        assert!((norm - 5.0).abs() < 1e-6);
        assert!((grad_norm(&[p.shallow_clone()]) - 1.0).abs() < 1e-4);
        // A non-finite gradient is reported and left alone (the step is skipped).
        let q = Tensor::from_slice(&[1.0f32]).set_requires_grad(true);
        (&q * f64::NAN).sum(Kind::Float).backward();
        assert!(clip_grad_norm(&[q.shallow_clone()], 1.0).is_nan());
        assert!(q.grad().double_value(&[0]).is_nan());
    }
}
