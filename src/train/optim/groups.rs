//! The optimizer's parameter groups (the VRT recipe's `TRAIN.FIX_ITER` /
//! `FIX_LR_MUL` / `FIX_KEYS`: the "fixed" group is frozen for the first steps, then
//! trains at a multiple of the rate) and the fixed group as a checkpoint saves it.

use serde::{Deserialize, Serialize};

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
    pub(super) groups: Vec<ParamGroup>,
    pub(super) fixed_names: Vec<String>,
    pub(super) policy: FixPolicy,
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
