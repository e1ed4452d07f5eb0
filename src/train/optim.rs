//! AdamW (decoupled weight decay, PyTorch's update rule) with its moments held as
//! plain tensors, so a checkpoint saves and restores them bit-exactly, in two
//! parameter groups (the VRT recipe's `TRAIN.FIX_ITER` / `FIX_LR_MUL` / `FIX_KEYS`:
//! the "fixed" group is frozen for the first steps, then trains at a multiple of
//! the rate), plus the gradient utilities of a step: the global norm and
//! global-norm clipping.

use serde::{Deserialize, Serialize};
use tch::{Kind, TchError, Tensor};

/// The optimizer group of a parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamGroup {
    /// Trains from the first step at the schedule's rate.
    Main,
    /// Named by `TRAIN.FIX_KEYS`: frozen before `FIX_ITER`, then at `FIX_LR_MUL` x the rate.
    Fixed,
}

/// When and how fast the fixed group trains.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FixPolicy {
    /// Training steps (0-based indices below this) during which the fixed group is frozen.
    pub fix_iter: u64,
    /// Learning-rate multiplier of the fixed group once it trains.
    pub lr_mul: f64,
}

impl FixPolicy {
    /// No freezing, no multiplier.
    pub const NONE: FixPolicy = FixPolicy {
        fix_iter: 0,
        lr_mul: 1.0,
    };

    /// From `TRAIN.FIX_ITER` / `TRAIN.FIX_LR_MUL`.
    pub fn from_config(cfg: &crate::config::TrainConfig) -> FixPolicy {
        FixPolicy {
            fix_iter: cfg.fix_iter,
            lr_mul: cfg.fix_lr_mul,
        }
    }

    /// The learning-rate multiplier of `group` at training step `step` (0-based);
    /// `None` while the group is frozen (no update, no moments, no weight decay).
    pub fn lr_mul(&self, group: ParamGroup, step: u64) -> Option<f64> {
        match group {
            ParamGroup::Main => Some(1.0),
            ParamGroup::Fixed if step < self.fix_iter => None,
            ParamGroup::Fixed => Some(self.lr_mul),
        }
    }
}

/// The group of every parameter of an optimizer (in its order) and the policy.
#[derive(Debug, Clone)]
pub struct ParamGroups {
    groups: Vec<ParamGroup>,
    fixed_names: Vec<String>,
    policy: FixPolicy,
}

impl ParamGroups {
    /// `count` parameters, all in the main group.
    pub fn single(count: usize) -> ParamGroups {
        ParamGroups {
            groups: vec![ParamGroup::Main; count],
            fixed_names: Vec::new(),
            policy: FixPolicy::NONE,
        }
    }

    /// Parameters whose name contains any of `keys` form the fixed group.
    pub fn by_name(names: &[String], keys: &[String], policy: FixPolicy) -> ParamGroups {
        let fixed = |name: &str| keys.iter().any(|k| name.contains(k.as_str()));
        ParamGroups {
            groups: names
                .iter()
                .map(|n| match fixed(n) {
                    true => ParamGroup::Fixed,
                    false => ParamGroup::Main,
                })
                .collect(),
            fixed_names: names.iter().filter(|n| fixed(n)).cloned().collect(),
            policy,
        }
    }

    /// Names of the fixed group's parameters, in optimizer order.
    pub fn fixed_names(&self) -> &[String] {
        &self.fixed_names
    }

    /// The policy.
    pub fn policy(&self) -> FixPolicy {
        self.policy
    }
}

/// How many parameter tensors and elements a group holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GroupSize {
    /// Parameter tensors.
    pub tensors: usize,
    /// Scalar elements.
    pub elements: i64,
}

/// The fixed group as a checkpoint saves it (`state.json`); empty without one.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FixedGroupState {
    /// Names of its parameters (checked against the names on resume).
    pub params: Vec<String>,
    /// AdamW updates applied to it (its bias-correction count; it starts at 0
    /// when the group unfreezes, as PyTorch's per-parameter step does).
    pub steps: u64,
}

/// AdamW over a fixed, ordered list of parameters.
#[derive(Debug)]
pub struct AdamW {
    params: Vec<Tensor>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    groups: ParamGroups,
    steps: u64,
    fixed_steps: u64,
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
    /// AdamW over `params` (the order is the state's order), all in the main group.
    pub fn new(params: Vec<Tensor>, betas: [f64; 2], eps: f64, weight_decay: f64) -> AdamW {
        let zeros = |p: &Tensor| Tensor::zeros_like(p).detach();
        AdamW {
            exp_avg: params.iter().map(zeros).collect(),
            exp_avg_sq: params.iter().map(zeros).collect(),
            groups: ParamGroups::single(params.len()),
            params,
            steps: 0,
            fixed_steps: 0,
            beta1: betas[0],
            beta2: betas[1],
            eps,
            weight_decay,
        }
    }

    /// The same optimizer with `groups` (one entry a parameter, in order).
    pub fn with_groups(mut self, groups: ParamGroups) -> Result<AdamW, OptimStateError> {
        if groups.groups.len() != self.params.len() {
            return Err(OptimStateError(format!(
                "{} parameter groups for {} parameters",
                groups.groups.len(),
                self.params.len()
            )));
        }
        self.groups = groups;
        Ok(self)
    }

    /// The parameters it updates.
    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    /// The parameters that train at training step `step` (the fixed group is left
    /// out while frozen): what the gradient norm and clipping see.
    pub fn trainable(&self, step: u64) -> Vec<Tensor> {
        self.params
            .iter()
            .zip(&self.groups.groups)
            .filter(|(_, g)| self.groups.policy.lr_mul(**g, step).is_some())
            .map(|(p, _)| p.shallow_clone())
            .collect()
    }

    /// Tensors and elements of `group`.
    pub fn group_size(&self, group: ParamGroup) -> GroupSize {
        let mut size = GroupSize::default();
        for (p, g) in self.params.iter().zip(&self.groups.groups) {
            if *g == group {
                size.tensors += 1;
                size.elements += p.numel() as i64;
            }
        }
        size
    }

    /// The groups.
    pub fn groups(&self) -> &ParamGroups {
        &self.groups
    }

    /// Updates applied so far (the main group's bias-correction step count).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The fixed group for a checkpoint.
    pub fn fixed_state(&self) -> FixedGroupState {
        FixedGroupState {
            params: self.groups.fixed_names.clone(),
            steps: self.fixed_steps,
        }
    }

    /// Clears every gradient.
    pub fn zero_grad(&mut self) {
        for p in &mut self.params {
            let mut grad = p.grad();
            if grad.defined() {
                // In place, never replaced: under the Reducer a gradient is a view of
                // its bucket (which cannot be detached in place; it has no history).
                if grad.requires_grad() {
                    let _ = grad.detach_();
                }
                let _ = grad.zero_();
            }
        }
    }

    /// One AdamW update at training step `step` (0-based) with learning rate `lr`
    /// (times the group's multiplier) from the current gradients; parameters
    /// without a gradient, and the fixed group while frozen, are left alone. A libtorch
    /// failure (out of memory for a temporary) is returned, not a panic.
    pub fn step(&mut self, lr: f64, step: u64) -> Result<(), TchError> {
        let policy = self.groups.policy;
        let fixed_mul = policy.lr_mul(ParamGroup::Fixed, step);
        self.steps += 1;
        if fixed_mul.is_some() && !self.groups.fixed_names.is_empty() {
            self.fixed_steps += 1;
        }
        let (beta1, beta2, eps, wd) = (self.beta1, self.beta2, self.eps, self.weight_decay);
        let bias = |steps: u64| {
            let t = steps as i32;
            (1.0 - beta1.powi(t), 1.0 - beta2.powi(t))
        };
        let (main_bias, fixed_bias) = (bias(self.steps), bias(self.fixed_steps));
        tch::no_grad(|| {
            for (((p, m), v), group) in self
                .params
                .iter_mut()
                .zip(&mut self.exp_avg)
                .zip(&mut self.exp_avg_sq)
                .zip(&self.groups.groups)
            {
                let (mul, (bias1, bias2)) = match (group, fixed_mul) {
                    (ParamGroup::Main, _) => (1.0, main_bias),
                    (ParamGroup::Fixed, Some(mul)) => (mul, fixed_bias),
                    (ParamGroup::Fixed, None) => continue,
                };
                let g = p.f_grad()?;
                if !g.defined() {
                    continue;
                }
                let lr = lr * mul;
                if wd != 0.0 {
                    let _ = p.f_mul_scalar_(1.0 - lr * wd)?;
                }
                let _ = m.f_mul_scalar_(beta1)?;
                let _ = m.f_add_(&g.f_mul_scalar(1.0 - beta1)?)?;
                let _ = v.f_mul_scalar_(beta2)?;
                let _ = v.f_add_(&g.f_mul(&g)?.f_mul_scalar(1.0 - beta2)?)?;
                let denom = v.f_sqrt()?.f_div_scalar(bias2.sqrt())?.f_add_scalar(eps)?;
                let _ = p.f_sub_(&m.f_div(&denom)?.f_mul_scalar(lr / bias1)?)?;
            }
            Ok(())
        })
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

    /// Restores moments saved by [`AdamW::state_tensors`], the step count and the
    /// fixed group; a missing tensor, a shape mismatch or a fixed group other than
    /// this optimizer's (by parameter names) is an error naming it.
    pub fn load_state(
        &mut self,
        named: &[(String, Tensor)],
        steps: u64,
        fixed: &FixedGroupState,
    ) -> Result<(), OptimStateError> {
        self.check_fixed_group(fixed)?;
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
        self.fixed_steps = fixed.steps;
        Ok(())
    }

    /// The saved fixed group must hold the parameters `TRAIN.FIX_KEYS` selects now.
    fn check_fixed_group(&self, saved: &FixedGroupState) -> Result<(), OptimStateError> {
        let now = &self.groups.fixed_names;
        if saved.params == *now {
            return Ok(());
        }
        let only_in = |a: &[String], b: &[String]| -> String {
            let names: Vec<&str> = a
                .iter()
                .filter(|n| !b.contains(n))
                .take(3)
                .map(String::as_str)
                .collect();
            names.join(", ")
        };
        Err(OptimStateError(format!(
            "the fixed parameter group (TRAIN.FIX_KEYS) differs from the checkpoint's: \
             {} parameters saved, {} selected now; only saved: [{}]; only now: [{}]",
            saved.params.len(),
            now.len(),
            only_in(&saved.params, now),
            only_in(now, &saved.params)
        )))
    }
}

/// Scales gradients so that their global L2 norm is at most `max_norm`; returns the
/// norm before clipping (non-finite when a gradient is).
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Result<f64, TchError> {
    let norm = grad_norm(params)?;
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

/// Global L2 norm of the gradients.
pub fn grad_norm(params: &[Tensor]) -> Result<f64, TchError> {
    let mut sum = 0.0f64;
    for p in params {
        let g = p.f_grad()?;
        if g.defined() {
            let n = g.f_to_kind(Kind::Double)?.f_norm()?.f_double_value(&[])?;
            sum += n * n;
        }
    }
    Ok(sum.sqrt())
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
            opt.step(lr, t as u64).unwrap();
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
        other
            .load_state(&opt.state_tensors(), opt.steps(), &opt.fixed_state())
            .unwrap();
        assert_eq!(other.steps(), 3);
        let err = other
            .load_state(&[], 3, &FixedGroupState::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("exp_avg.0"), "{err}");
    }

    #[test]
    fn fix_policy_freezes_then_multiplies() {
        let policy = FixPolicy {
            fix_iter: 3,
            lr_mul: 0.125,
        };
        for step in 0..3 {
            assert_eq!(policy.lr_mul(ParamGroup::Fixed, step), None, "step {step}");
            assert_eq!(policy.lr_mul(ParamGroup::Main, step), Some(1.0));
        }
        assert_eq!(policy.lr_mul(ParamGroup::Fixed, 3), Some(0.125));
        assert_eq!(policy.lr_mul(ParamGroup::Fixed, 1000), Some(0.125));
        assert_eq!(FixPolicy::NONE.lr_mul(ParamGroup::Fixed, 0), Some(1.0));
    }

    /// Two one-element parameters, the second (`flow.w`) in the fixed group.
    fn grouped(policy: FixPolicy) -> (Tensor, Tensor, AdamW) {
        let a = Tensor::from_slice(&[1.0f64]).set_requires_grad(true);
        let b = Tensor::from_slice(&[1.0f64]).set_requires_grad(true);
        let names = ["body.w".to_string(), "flow.w".to_string()];
        let groups = ParamGroups::by_name(&names, &["flow".to_string()], policy);
        assert_eq!(groups.fixed_names(), ["flow.w".to_string()]);
        let opt = AdamW::new(
            vec![a.shallow_clone(), b.shallow_clone()],
            [0.9, 0.99],
            1e-8,
            0.1,
        )
        .with_groups(groups)
        .unwrap();
        (a, b, opt)
    }

    #[test]
    fn fixed_group_is_frozen_then_trains_at_the_multiplied_rate() {
        let policy = FixPolicy {
            fix_iter: 2,
            lr_mul: 0.5,
        };
        let (a, b, mut opt) = grouped(policy);
        assert_eq!(opt.group_size(ParamGroup::Fixed).tensors, 1);
        assert_eq!(opt.group_size(ParamGroup::Main).elements, 1);
        let lr = 0.01;
        let mut reference = AdamW::new(
            vec![Tensor::from_slice(&[1.0f64]).set_requires_grad(true)],
            [0.9, 0.99],
            1e-8,
            0.1,
        );
        for step in 0..4u64 {
            opt.zero_grad();
            (&a * 2.0 + &b * 3.0).sum(Kind::Double).backward();
            assert_eq!(opt.trainable(step).len(), if step < 2 { 1 } else { 2 });
            opt.step(lr, step).unwrap();
            if step < 2 {
                assert_eq!(b.double_value(&[0]), 1.0, "frozen at step {step}");
                assert_eq!(opt.fixed_state().steps, 0);
                let moments = opt.state_tensors();
                assert_eq!(moments[2].1.double_value(&[0]), 0.0, "exp_avg.1 untouched");
            } else {
                // The fixed group's update equals a fresh AdamW's at lr x 0.5: its
                // bias correction counts from the unfreezing step.
                reference.zero_grad();
                (&reference.params()[0] * 3.0).sum(Kind::Double).backward();
                reference.step(lr * 0.5, step).unwrap();
                let want = reference.params()[0].double_value(&[0]);
                assert_eq!(b.double_value(&[0]), want, "step {step}");
            }
        }
        assert_eq!((opt.steps(), opt.fixed_state().steps), (4, 2));
        assert_ne!(a.double_value(&[0]), 1.0);
        // A saved fixed group must hold the same parameter names.
        let (_, _, mut other) = grouped(policy);
        other
            .load_state(&opt.state_tensors(), 4, &opt.fixed_state())
            .unwrap();
        let wrong = FixedGroupState {
            params: vec!["body.w".into()],
            steps: 2,
        };
        let err = other
            .load_state(&opt.state_tensors(), 4, &wrong)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("TRAIN.FIX_KEYS") && err.contains("body.w"),
            "{err}"
        );
    }

    #[test]
    fn clipping_scales_to_the_max_norm() {
        let p = Tensor::from_slice(&[0.0f32, 0.0]).set_requires_grad(true);
        (&p * Tensor::from_slice(&[3.0f32, 4.0]))
            .sum(Kind::Float)
            .backward();
        let norm = clip_grad_norm(&[p.shallow_clone()], 1.0).unwrap();
        assert!((norm - 5.0).abs() < 1e-6);
        assert!((grad_norm(&[p.shallow_clone()]).unwrap() - 1.0).abs() < 1e-4);
        // A non-finite gradient is reported and left alone (the step is skipped).
        let q = Tensor::from_slice(&[1.0f32]).set_requires_grad(true);
        (&q * f64::NAN).sum(Kind::Float).backward();
        assert!(clip_grad_norm(&[q.shallow_clone()], 1.0).unwrap().is_nan());
        assert!(q.grad().double_value(&[0]).is_nan());
    }
}
