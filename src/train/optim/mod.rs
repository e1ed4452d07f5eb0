//! AdamW (decoupled weight decay, PyTorch's update rule) with its moments held as
//! plain tensors, so a checkpoint saves and restores them bit-exactly, in two
//! parameter groups ([`groups`]). An update runs as one libtorch kernel a group
//! (`_fused_adamw_`, on CUDA and on the CPU), whose step counts and skip flag
//! (`found_inf`: a non-finite loss or gradient, decided on the device) never leave
//! the device; PyTorch's multi-tensor form (`_foreach_*`) and the per-parameter
//! loop it replaced stay for `vrtspike profile --optimizer` and the tests. The
//! gradient utilities of a step (global norm, clipping) are in [`grads`], the
//! kernels in [`kernels`].

pub mod grads;
mod groups;
pub mod kernels;

use tch::{Device, Kind, TchError, Tensor};

pub use groups::{FixPolicy, FixedGroupState, GroupSize, ParamGroup, ParamGroups};

use crate::util::readback;
use kernels::{AdamWLists, AdamWRates};

/// How an update runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum UpdateKernel {
    /// libtorch's fused AdamW, one kernel a group; the step counts and the skip
    /// flag stay on the device. What training runs.
    Fused,
    /// PyTorch's multi-tensor form (`torch.optim.AdamW(foreach=True)`): about ten
    /// `_foreach_*` calls a group, the step count on the host.
    Foreach,
    /// One parameter at a time, about 13 small kernels each (the optimizer before
    /// issue 34).
    Loop,
}

impl std::str::FromStr for UpdateKernel {
    type Err = String;

    fn from_str(s: &str) -> Result<UpdateKernel, String> {
        match s {
            "fused" => Ok(UpdateKernel::Fused),
            "foreach" => Ok(UpdateKernel::Foreach),
            "loop" => Ok(UpdateKernel::Loop),
            other => Err(format!("{other:?}: expected fused, foreach or loop")),
        }
    }
}

/// AdamW updates applied to each group (their bias-correction step counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepCounts {
    /// The main group's.
    pub main: u64,
    /// The fixed group's (from its unfreezing on).
    pub fixed: u64,
}

/// The step counts on the parameters' device (0-dim float32, what the fused kernel
/// reads) and, while no update was decided on the device, on the host.
#[derive(Debug)]
struct Counters {
    main: Tensor,
    fixed: Tensor,
    host: Option<StepCounts>,
}

impl Counters {
    fn new(device: Device, counts: StepCounts) -> Counters {
        let at = |n: u64| Tensor::full([], n as f64, (Kind::Float, device));
        Counters {
            main: at(counts.main),
            fixed: at(counts.fixed),
            host: Some(counts),
        }
    }
}

/// AdamW's constants.
#[derive(Debug, Clone, Copy)]
struct Hyper {
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
}

impl Hyper {
    fn rates(&self, lr: f64) -> AdamWRates {
        AdamWRates {
            lr,
            beta1: self.beta1,
            beta2: self.beta2,
            weight_decay: self.weight_decay,
            eps: self.eps,
        }
    }
}

/// One group's parameters that have a gradient, with the gradients and moments.
#[derive(Default)]
struct GroupLists {
    params: Vec<Tensor>,
    grads: Vec<Tensor>,
    exp_avgs: Vec<Tensor>,
    exp_avg_sqs: Vec<Tensor>,
}

impl GroupLists {
    fn lists(&self) -> AdamWLists<'_> {
        AdamWLists {
            params: &self.params,
            grads: &self.grads,
            exp_avgs: &self.exp_avgs,
            exp_avg_sqs: &self.exp_avg_sqs,
        }
    }
}

/// AdamW over a fixed, ordered list of parameters.
#[derive(Debug)]
pub struct AdamW {
    params: Vec<Tensor>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    groups: ParamGroups,
    counters: Counters,
    hyper: Hyper,
    kernel: UpdateKernel,
}

/// Optimizer state that does not fit a checkpoint's parameter list.
#[derive(Debug, thiserror::Error)]
#[error("optimizer state: {0}")]
pub struct OptimStateError(pub String);

impl AdamW {
    /// AdamW over `params` (the order is the state's order), all in the main group,
    /// updated by the fused kernel.
    pub fn new(params: Vec<Tensor>, betas: [f64; 2], eps: f64, weight_decay: f64) -> AdamW {
        let zeros = |p: &Tensor| Tensor::zeros_like(p).detach();
        let device = params.first().map_or(Device::Cpu, |p| p.device());
        AdamW {
            exp_avg: params.iter().map(zeros).collect(),
            exp_avg_sq: params.iter().map(zeros).collect(),
            groups: ParamGroups::single(params.len()),
            params,
            counters: Counters::new(device, StepCounts::default()),
            hyper: Hyper {
                beta1: betas[0],
                beta2: betas[1],
                eps,
                weight_decay,
            },
            kernel: UpdateKernel::Fused,
        }
    }

    /// The same optimizer updating through `kernel`.
    pub fn with_kernel(mut self, kernel: UpdateKernel) -> AdamW {
        self.kernel = kernel;
        self
    }

    /// Updates from now on through `kernel`.
    pub fn set_kernel(&mut self, kernel: UpdateKernel) {
        self.kernel = kernel;
    }

    /// The kernel its updates run.
    pub fn kernel(&self) -> UpdateKernel {
        self.kernel
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

    /// Whether the parameter at `index` trains at training step `step` (the fixed
    /// group does not while frozen).
    fn trains(&self, index: usize, step: u64) -> bool {
        let group = self.groups.groups[index];
        self.groups.policy.lr_mul(group, step).is_some()
    }

    /// The parameters that train at training step `step` (the fixed group is left
    /// out while frozen): what the gradient norm and clipping see.
    pub fn trainable(&self, step: u64) -> Vec<Tensor> {
        (0..self.params.len())
            .filter(|&i| self.trains(i, step))
            .map(|i| self.params[i].shallow_clone())
            .collect()
    }

    /// The gradients of the parameters that train at step `step` and have one.
    pub fn trainable_grads(&self, step: u64) -> Result<Vec<Tensor>, TchError> {
        let mut grads = Vec::with_capacity(self.params.len());
        for (i, p) in self.params.iter().enumerate() {
            let g = p.f_grad()?;
            if g.defined() && self.trains(i, step) {
                grads.push(g);
            }
        }
        Ok(grads)
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

    /// Updates applied to each group, read from the device (one counted read) when
    /// an update since the last read or [`AdamW::set_counts`] was decided there.
    pub fn counts(&mut self) -> Result<StepCounts, TchError> {
        if let Some(counts) = self.counters.host {
            return Ok(counts);
        }
        let both = readback::values::<f64>(&self.count_tensor()?)?;
        let counts = StepCounts {
            main: both[0].round() as u64,
            fixed: both[1].round() as u64,
        };
        self.counters.host = Some(counts);
        Ok(counts)
    }

    /// The step counts on the device as a float64 (main, fixed) tensor, for a caller
    /// that reads them together with other figures (then [`AdamW::set_counts`]).
    pub fn count_tensor(&self) -> Result<Tensor, TchError> {
        Tensor::f_stack(&[&self.counters.main, &self.counters.fixed], 0)?.f_to_kind(Kind::Double)
    }

    /// Records counts read from [`AdamW::count_tensor`].
    pub fn set_counts(&mut self, counts: StepCounts) {
        self.counters.host = Some(counts);
    }

    /// Updates applied so far (the main group's bias-correction step count).
    pub fn steps(&mut self) -> Result<u64, TchError> {
        Ok(self.counts()?.main)
    }

    /// The fixed group for a checkpoint.
    pub fn fixed_state(&mut self) -> Result<FixedGroupState, TchError> {
        Ok(FixedGroupState {
            params: self.groups.fixed_names.clone(),
            steps: self.counts()?.fixed,
        })
    }

    /// Every defined gradient (a view of its bucket under the Reducer: zeroed in
    /// place, never replaced).
    fn defined_grads(&self) -> Result<Vec<Tensor>, TchError> {
        let mut grads = Vec::with_capacity(self.params.len());
        for p in &self.params {
            let mut grad = p.f_grad()?;
            if grad.defined() {
                if grad.requires_grad() {
                    let _ = grad.f_detach_()?;
                }
                grads.push(grad);
            }
        }
        Ok(grads)
    }

    /// Clears every gradient (in one `_foreach_zero_`, or one at a time under the
    /// loop kernel).
    pub fn zero_grad(&mut self) -> Result<(), TchError> {
        let grads = self.defined_grads()?;
        match self.kernel {
            UpdateKernel::Fused | UpdateKernel::Foreach => kernels::zero_(&grads),
            UpdateKernel::Loop => grads
                .into_iter()
                .try_for_each(|mut g| g.f_zero_().map(|_| ())),
        }
    }

    /// The parameters of `group` that have a gradient, with gradients and moments.
    fn group_lists(&self, group: ParamGroup) -> Result<GroupLists, TchError> {
        let mut lists = GroupLists::default();
        for (i, p) in self.params.iter().enumerate() {
            if self.groups.groups[i] != group {
                continue;
            }
            let g = p.f_grad()?;
            if !g.defined() {
                continue;
            }
            lists.params.push(p.shallow_clone());
            lists.grads.push(g);
            lists.exp_avgs.push(self.exp_avg[i].shallow_clone());
            lists.exp_avg_sqs.push(self.exp_avg_sq[i].shallow_clone());
        }
        Ok(lists)
    }

    /// One AdamW update at training step `step` (0-based) with learning rate `lr`
    /// (times the group's multiplier) from the current gradients; parameters
    /// without a gradient, and the fixed group while frozen, are left alone. Where
    /// `found_inf` (0-dim, 1 or 0, on the parameters' device) is 1 nothing changes
    /// and the step counts stay: the fused kernel decides that on the device, the
    /// other kernels read the flag (one counted read). A libtorch failure (out of
    /// memory for a temporary) is returned, not a panic.
    pub fn step(&mut self, lr: f64, step: u64, found_inf: Option<&Tensor>) -> Result<(), TchError> {
        let fixed_mul = self.groups.policy.lr_mul(ParamGroup::Fixed, step);
        let fixed_trains = fixed_mul.is_some() && !self.groups.fixed_names.is_empty();
        tch::no_grad(|| match self.kernel {
            UpdateKernel::Fused => self.step_fused(lr, fixed_mul, fixed_trains, found_inf),
            UpdateKernel::Foreach | UpdateKernel::Loop => {
                if let Some(flag) = found_inf {
                    if readback::scalar(flag)? != 0.0 {
                        return Ok(());
                    }
                }
                self.step_on_host(lr, fixed_mul, fixed_trains)
            }
        })
    }

    /// The fused kernel's update: the counts advance by 1 - found_inf on the device.
    fn step_fused(
        &mut self,
        lr: f64,
        fixed_mul: Option<f64>,
        fixed_trains: bool,
        found_inf: Option<&Tensor>,
    ) -> Result<(), TchError> {
        let flag = found_inf.map(|f| f.f_to_kind(Kind::Float)).transpose()?;
        let advance = |counter: &mut Tensor| -> Result<(), TchError> {
            match &flag {
                Some(f) => counter.f_add_(&f.f_neg()?.f_add_scalar(1.0)?).map(|_| ()),
                None => counter.f_add_scalar_(1.0).map(|_| ()),
            }
        };
        advance(&mut self.counters.main)?;
        if fixed_trains {
            advance(&mut self.counters.fixed)?;
        }
        self.counters.host = match (&flag, self.counters.host) {
            (None, Some(c)) => Some(StepCounts {
                main: c.main + 1,
                fixed: c.fixed + u64::from(fixed_trains),
            }),
            _ => None,
        };
        let groups = [
            (ParamGroup::Main, Some(1.0), &self.counters.main),
            (ParamGroup::Fixed, fixed_mul, &self.counters.fixed),
        ];
        for (group, mul, counter) in groups {
            let Some(mul) = mul else { continue };
            let lists = self.group_lists(group)?;
            let rates = self.hyper.rates(lr * mul);
            kernels::adamw_fused(&lists.lists(), counter, rates, flag.as_ref())?;
        }
        Ok(())
    }

    /// The foreach or loop kernel's update, with the step counts on the host.
    fn step_on_host(
        &mut self,
        lr: f64,
        fixed_mul: Option<f64>,
        fixed_trains: bool,
    ) -> Result<(), TchError> {
        let before = self.counts()?;
        let counts = StepCounts {
            main: before.main + 1,
            fixed: before.fixed + u64::from(fixed_trains),
        };
        let _ = self.counters.main.f_fill_(counts.main as f64)?;
        let _ = self.counters.fixed.f_fill_(counts.fixed as f64)?;
        self.counters.host = Some(counts);
        let groups = [
            (ParamGroup::Main, Some(1.0), counts.main),
            (ParamGroup::Fixed, fixed_mul, counts.fixed),
        ];
        for (group, mul, count) in groups {
            let Some(mul) = mul else { continue };
            let lists = self.group_lists(group)?;
            let rates = self.hyper.rates(lr * mul);
            match self.kernel {
                UpdateKernel::Foreach => kernels::adamw_foreach(&lists.lists(), count, rates)?,
                _ => loop_update(&lists, count, rates)?,
            }
        }
        Ok(())
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
        let torch = |name: &str, e: TchError| OptimStateError(format!("{name}: {e}"));
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
                    saved
                        .f_to_kind(slot.kind())
                        .and_then(|s| s.f_to_device(slot.device()))
                        .and_then(|s| slot.f_copy_(&s))
                        .map_err(|e| torch(&name, e))?;
                }
            }
            Ok(())
        })?;
        let counts = StepCounts {
            main: steps,
            fixed: fixed.steps,
        };
        let device = self.counters.main.device();
        self.counters = Counters::new(device, counts);
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

/// The per-parameter AdamW loop (the update before issue 34) over one group's lists
/// at bias-correction step `count`.
fn loop_update(lists: &GroupLists, count: u64, rates: AdamWRates) -> Result<(), TchError> {
    let AdamWRates {
        lr,
        beta1,
        beta2,
        weight_decay,
        eps,
    } = rates;
    let t = count as i32;
    let (bias1, bias2) = (1.0 - beta1.powi(t), 1.0 - beta2.powi(t));
    let per_param = lists
        .params
        .iter()
        .zip(&lists.grads)
        .zip(lists.exp_avgs.iter().zip(&lists.exp_avg_sqs));
    for ((p, g), (m, v)) in per_param {
        let (mut p, mut m, mut v) = (p.shallow_clone(), m.shallow_clone(), v.shallow_clone());
        if weight_decay != 0.0 {
            let _ = p.f_mul_scalar_(1.0 - lr * weight_decay)?;
        }
        let _ = m.f_mul_scalar_(beta1)?;
        let _ = m.f_add_(&g.f_mul_scalar(1.0 - beta1)?)?;
        let _ = v.f_mul_scalar_(beta2)?;
        let _ = v.f_add_(&g.f_mul(g)?.f_mul_scalar(1.0 - beta2)?)?;
        let denom = v.f_sqrt()?.f_div_scalar(bias2.sqrt())?.f_add_scalar(eps)?;
        let _ = p.f_sub_(&m.f_div(&denom)?.f_mul_scalar(lr / bias1)?)?;
    }
    Ok(())
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
            opt.zero_grad().unwrap();
            let loss = (&p * Tensor::from_slice(&g)).sum(Kind::Double);
            loss.backward();
            opt.step(lr, t as u64, None).unwrap();
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
            .load_state(
                &opt.state_tensors(),
                opt.steps().unwrap(),
                &opt.fixed_state().unwrap(),
            )
            .unwrap();
        assert_eq!(other.steps().unwrap(), 3);
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
            opt.zero_grad().unwrap();
            (&a * 2.0 + &b * 3.0).sum(Kind::Double).backward();
            assert_eq!(opt.trainable(step).len(), if step < 2 { 1 } else { 2 });
            opt.step(lr, step, None).unwrap();
            if step < 2 {
                assert_eq!(b.double_value(&[0]), 1.0, "frozen at step {step}");
                assert_eq!(opt.fixed_state().unwrap().steps, 0);
                let moments = opt.state_tensors();
                assert_eq!(moments[2].1.double_value(&[0]), 0.0, "exp_avg.1 untouched");
            } else {
                // The fixed group's update equals a fresh AdamW's at lr x 0.5: its
                // bias correction counts from the unfreezing step.
                reference.zero_grad().unwrap();
                (&reference.params()[0] * 3.0).sum(Kind::Double).backward();
                reference.step(lr * 0.5, step, None).unwrap();
                let want = reference.params()[0].double_value(&[0]);
                assert_eq!(b.double_value(&[0]), want, "step {step}");
            }
        }
        assert_eq!(
            (opt.steps().unwrap(), opt.fixed_state().unwrap().steps),
            (4, 2)
        );
        assert_ne!(a.double_value(&[0]), 1.0);
        // A saved fixed group must hold the same parameter names.
        let (_, _, mut other) = grouped(policy);
        other
            .load_state(&opt.state_tensors(), 4, &opt.fixed_state().unwrap())
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

    /// The gradient of parameter `index` at step `step`: deterministic, of `shape`.
    pub(crate) fn gradient_at(shape: &[i64], index: usize, step: u64) -> Tensor {
        let n: i64 = shape.iter().product();
        let x = Tensor::arange(n, (Kind::Float, Device::Cpu));
        ((x + 1.0) * (0.37 * (step + 1) as f64) + 0.1 * index as f64)
            .sin()
            .view(shape)
    }

    /// Sets every parameter's gradient to [`gradient_at`] of `step`.
    pub(crate) fn set_gradients(params: &[Tensor], step: u64) {
        for (i, p) in params.iter().enumerate() {
            let g = gradient_at(&p.size(), i, step);
            let mut grad = p.grad();
            if grad.defined() {
                grad.copy_(&g);
            } else {
                (p * &g).sum(Kind::Float).backward();
            }
        }
    }

    /// Five parameters (the last two in the fixed group, frozen 3 steps, then at
    /// 0.25 x the rate) of `kernel`, all starting from the same values.
    fn five(kernel: UpdateKernel) -> (Vec<Tensor>, AdamW) {
        let shapes: [&[i64]; 5] = [&[7], &[3, 4], &[2, 3, 5], &[4], &[6, 2]];
        let names: Vec<String> = ["a.w", "b.w", "c.w", "flow.a", "flow.b"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let params: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, shape)| gradient_at(shape, i + 10, 3).set_requires_grad(true))
            .collect();
        let policy = FixPolicy {
            fix_iter: 3,
            lr_mul: 0.25,
        };
        let groups = ParamGroups::by_name(&names, &["flow".to_string()], policy);
        let handles = params.iter().map(|p| p.shallow_clone()).collect();
        let opt = AdamW::new(handles, [0.9, 0.999], 1e-8, 0.05)
            .with_groups(groups)
            .unwrap()
            .with_kernel(kernel);
        (params, opt)
    }

    fn flat(tensors: &[Tensor]) -> Vec<f64> {
        let all: Vec<Tensor> = tensors.iter().map(|t| t.detach().flatten(0, -1)).collect();
        readback::values::<f64>(&Tensor::cat(&all, 0)).unwrap()
    }

    fn assert_close(a: &[f64], b: &[f64], tolerance: f64, what: &str) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= tolerance, "{what}[{i}]: {x} vs {y}");
        }
    }

    /// 20 steps of `kernel` at a warm-up-then-decay rate, through the fixed group's
    /// unfreezing at step 3.
    fn twenty_steps(kernel: UpdateKernel) -> (Vec<Tensor>, AdamW) {
        let (params, mut opt) = five(kernel);
        for step in 0..20u64 {
            let lr = 1e-2 * ((step + 1) as f64 / 5.0).min(1.0) * (1.0 - step as f64 / 25.0);
            opt.zero_grad().unwrap();
            set_gradients(&params, step);
            opt.step(lr, step, None).unwrap();
        }
        (params, opt)
    }

    fn moments(opt: &AdamW) -> Vec<f64> {
        let named = opt.state_tensors();
        flat(&named.into_iter().map(|(_, t)| t).collect::<Vec<_>>())
    }

    /// The fused and foreach kernels give the per-parameter loop's parameters and
    /// moments to 1e-6 over 20 steps, with weight decay and the fixed group, and the
    /// same step counts.
    #[test]
    fn multi_tensor_kernels_equal_the_loop_over_20_steps() {
        let (loop_params, mut reference) = twenty_steps(UpdateKernel::Loop);
        let start = flat(&five(UpdateKernel::Loop).0);
        let moved = flat(&loop_params)
            .iter()
            .zip(&start)
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(moved, start.len(), "every parameter trained");
        for kernel in [UpdateKernel::Fused, UpdateKernel::Foreach] {
            let (params, mut opt) = twenty_steps(kernel);
            let what = format!("{kernel:?}");
            assert_close(&flat(&params), &flat(&loop_params), 1e-6, &what);
            assert_close(&moments(&opt), &moments(&reference), 1e-6, &what);
            assert_eq!(
                opt.counts().unwrap(),
                StepCounts {
                    main: 20,
                    fixed: 17
                }
            );
            assert_eq!(reference.counts().unwrap(), opt.counts().unwrap());
        }
    }

    /// A step flagged by `found_inf` on the device changes no parameter, moment or
    /// count under the fused kernel (nothing read back: the counts are known on the
    /// host again only after a read), and the next unflagged step applies as if the
    /// flagged one never was.
    #[test]
    fn a_found_inf_step_changes_nothing_and_counts_nothing() {
        let (params, mut opt) = five(UpdateKernel::Fused);
        let (clean_params, mut clean) = five(UpdateKernel::Fused);
        let no = Tensor::zeros([], (Kind::Float, Device::Cpu));
        for step in 0..4u64 {
            for (ps, o) in [(&params, &mut opt), (&clean_params, &mut clean)] {
                o.zero_grad().unwrap();
                set_gradients(ps, step);
                o.step(1e-2, step, Some(&no)).unwrap();
            }
        }
        let before = (flat(&params), opt.state_tensors());
        opt.zero_grad().unwrap();
        set_gradients(&params, 4);
        let _ = params[2].grad().get(0).get(0).get(0).fill_(f64::NAN);
        let reads = readback::count();
        opt.step(1e-2, 4, Some(&Tensor::ones([], (Kind::Float, Device::Cpu))))
            .unwrap();
        assert_eq!(
            readback::count(),
            reads,
            "the fused kernel read nothing back"
        );
        assert_eq!(flat(&params), before.0, "parameters untouched");
        for ((_, a), (_, b)) in opt.state_tensors().iter().zip(&before.1) {
            assert!(a.equal(b), "moments untouched");
        }
        assert_eq!(opt.counts().unwrap(), StepCounts { main: 4, fixed: 1 });
        for (ps, o) in [(&params, &mut opt), (&clean_params, &mut clean)] {
            o.zero_grad().unwrap();
            set_gradients(ps, 5);
            o.step(1e-2, 5, Some(&no)).unwrap();
        }
        assert_eq!(
            flat(&params),
            flat(&clean_params),
            "as if the skipped step never was"
        );
    }

    /// A checkpoint written by the optimizer before issue 34 (per-parameter loop,
    /// `tests/fixtures/checkpoint-v1/`) resumes under the fused kernel: its steps
    /// 5-9 from `step_00000005` give the parameters, moments and counts that the old
    /// code saved in `step_00000010`, to 1e-6.
    #[test]
    fn a_checkpoint_of_the_per_parameter_loop_resumes_under_the_fused_kernel() {
        let fixture =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/checkpoint-v1");
        let load = |step: &str| {
            let dir = fixture.join(step);
            let state: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("state.json")).unwrap())
                    .unwrap();
            let mut model = Tensor::read_safetensors(dir.join("model.safetensors")).unwrap();
            model.sort_by(|a, b| a.0.cmp(&b.0));
            let moments = Tensor::read_safetensors(dir.join("optimizer.safetensors")).unwrap();
            (state, model, moments)
        };
        let (state, model, moments) = load("step_00000005");
        let names: Vec<String> = model.iter().map(|(n, _)| n.clone()).collect();
        assert_eq!(names, ["body.b", "body.w", "flow.w"]);
        let params: Vec<Tensor> = model
            .iter()
            .map(|(_, t)| t.copy().set_requires_grad(true))
            .collect();
        let policy = FixPolicy {
            fix_iter: 2,
            lr_mul: 0.5,
        };
        let groups = ParamGroups::by_name(&names, &["flow".to_string()], policy);
        let handles = params.iter().map(|p| p.shallow_clone()).collect();
        let mut opt = AdamW::new(handles, [0.9, 0.99], 1e-8, 0.05)
            .with_groups(groups)
            .unwrap();
        let fixed: FixedGroupState = serde_json::from_value(state["fixed_group"].clone()).unwrap();
        let steps = state["optimizer_steps"].as_u64().unwrap();
        opt.load_state(&moments, steps, &fixed).unwrap();
        for step in 5..10u64 {
            opt.zero_grad().unwrap();
            set_gradients(&params, step);
            let no = Tensor::zeros([], (Kind::Float, Device::Cpu));
            opt.step(1e-2 * (step + 1) as f64 / 5.0, step, Some(&no))
                .unwrap();
        }
        let (state, model, moments) = load("step_00000010");
        let saved: Vec<Tensor> = model.into_iter().map(|(_, t)| t).collect();
        assert_close(&flat(&params), &flat(&saved), 1e-6, "parameters");
        let mine = opt.state_tensors();
        for (name, t) in &mine {
            let theirs = &moments.iter().find(|(n, _)| n == name).unwrap().1;
            assert_close(
                &flat(&[t.shallow_clone()]),
                &flat(&[theirs.shallow_clone()]),
                1e-6,
                name,
            );
        }
        let counts = opt.counts().unwrap();
        assert_eq!(counts.main, state["optimizer_steps"].as_u64().unwrap());
        assert_eq!(
            counts.fixed,
            state["fixed_group"]["steps"].as_u64().unwrap()
        );
    }
}
