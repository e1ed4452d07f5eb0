//! `TRAIN`: optimisation settings (batch, accumulation, learning-rate schedule,
//! AdamW, clipping, precision, seed, the cross-rank parameter check, and the VRT recipe's
//! frozen-then-slow parameter groups `FIX_ITER` / `FIX_LR_MUL` / `FIX_KEYS`).

use serde::{Deserialize, Serialize};

use super::{at_least, non_negative, positive, Checks};

/// Floating-point type of mixed precision (`TRAIN.AMP_DTYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
pub enum AmpDtype {
    /// bfloat16 autocast (no loss scaling needed).
    #[default]
    #[serde(rename = "bf16")]
    Bf16,
    /// float16 autocast with a dynamic loss scaler that skips steps on inf/NaN.
    #[serde(rename = "fp16")]
    Fp16,
}

/// apex-style mixed-precision level (`TRAIN.AMP_OPT_LEVEL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
pub enum AmpOptLevel {
    /// Autocast: weights in fp32, eligible ops in `AMP_DTYPE`.
    #[default]
    O1,
    /// Half weights with fp32 master copies; runs as `O1` here (with a notice).
    O2,
}

/// The `TRAIN` section. `TRAIN.NUM_WORKERS` / `TRAIN.PREFETCH_FACTOR` are older
/// spellings of `DATALOADER` keys (see [`super::Config`]).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE", deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Samples per rank per micro-batch.
    pub batch_size: u32,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: u32,
    /// Mixed precision on CUDA (ignored on CPU).
    pub amp_enabled: bool,
    /// Mixed-precision type: `bf16` or `fp16`.
    pub amp_dtype: AmpDtype,
    /// Seed of samplers, crops and initialisation.
    pub seed: u64,
    /// Peak learning rate (after warm-up).
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    pub min_lr: f64,
    /// Linear warm-up length in optimizer steps.
    pub warmup_steps: u64,
    /// Optimizer steps of the whole run.
    pub total_steps: u64,
    /// AdamW decoupled weight decay.
    pub weight_decay: f64,
    /// AdamW (beta1, beta2).
    pub betas: [f64; 2],
    /// AdamW epsilon.
    pub eps: f64,
    /// Clip the global gradient norm to this; `null` or 0 disables clipping.
    pub max_grad_norm: Option<f64>,
    /// Epsilon of the Charbonnier loss sqrt((x - y)^2 + eps^2).
    pub charbonnier_eps: f64,
    /// Compare a parameter hash across ranks every this many steps (0: never).
    pub param_check_every: u64,
    /// Mixed-precision level: `O1` (autocast) or `O2` (runs as `O1`, with a notice).
    pub amp_opt_level: AmpOptLevel,
    /// `torch.compile` the model; libtorch has none, so accepted with a notice.
    pub compile_model: bool,
    /// Optimizer steps during which parameters named by `FIX_KEYS` stay frozen.
    pub fix_iter: u64,
    /// After `FIX_ITER`, the `FIX_KEYS` parameters train at `LR` x this.
    pub fix_lr_mul: f64,
    /// Substrings of parameter names in the fixed group (VRT: `spynet`, `deform`).
    pub fix_keys: Vec<String>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            batch_size: 1,
            gradient_accumulation_steps: 1,
            amp_enabled: false,
            amp_dtype: AmpDtype::Bf16,
            seed: 0,
            lr: 4e-4,
            min_lr: 1e-7,
            warmup_steps: 0,
            total_steps: 300_000,
            weight_decay: 0.0,
            betas: [0.9, 0.99],
            eps: 1e-8,
            max_grad_norm: None,
            charbonnier_eps: 1e-3,
            param_check_every: 1000,
            amp_opt_level: AmpOptLevel::O1,
            compile_model: false,
            fix_iter: 0,
            fix_lr_mul: 1.0,
            fix_keys: Vec::new(),
        }
    }
}

impl TrainConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        let t = Checks("TRAIN");
        at_least(
            "TRAIN",
            1,
            [
                ("BATCH_SIZE", self.batch_size),
                (
                    "GRADIENT_ACCUMULATION_STEPS",
                    self.gradient_accumulation_steps,
                ),
            ],
        )?;
        t.expect(positive(self.lr), "LR", "a positive learning rate", self.lr)?;
        let min_lr_ok = non_negative(self.min_lr) && self.min_lr <= self.lr;
        t.expect(min_lr_ok, "MIN_LR", "0 <= MIN_LR <= LR", self.min_lr)?;
        at_least("TRAIN", 1, [("TOTAL_STEPS", self.total_steps)])?;
        let most = format!("at most TOTAL_STEPS ({})", self.total_steps);
        t.expect(
            self.warmup_steps <= self.total_steps,
            "WARMUP_STEPS",
            most,
            self.warmup_steps,
        )?;
        t.expect(
            non_negative(self.weight_decay),
            "WEIGHT_DECAY",
            ">= 0",
            self.weight_decay,
        )?;
        let betas_ok = self.betas.iter().all(|b| (0.0..1.0).contains(b));
        let betas = format!("{:?}", self.betas);
        t.expect(betas_ok, "BETAS", "two values in [0, 1)", betas)?;
        t.expect(positive(self.eps), "EPS", "a positive epsilon", self.eps)?;
        if let Some(norm) = self.max_grad_norm {
            t.expect(non_negative(norm), "MAX_GRAD_NORM", ">= 0 or null", norm)?;
        }
        let eps = self.charbonnier_eps;
        t.expect(positive(eps), "CHARBONNIER_EPS", "a positive epsilon", eps)?;
        self.validate_fix(&t)
    }

    fn validate_fix(&self, t: &Checks) -> Result<(), (String, String)> {
        let mul = self.fix_lr_mul;
        t.expect(positive(mul), "FIX_LR_MUL", "a positive multiplier", mul)?;
        if let Some(key) = self.fix_keys.iter().find(|k| k.is_empty()) {
            t.expect(
                false,
                "FIX_KEYS",
                "non-empty name parts",
                format!("{key:?}"),
            )?;
        }
        let fixes_something = self.fix_iter > 0 || self.fix_lr_mul != 1.0;
        t.check(
            !fixes_something || !self.fix_keys.is_empty(),
            "FIX_KEYS",
            "FIX_ITER / FIX_LR_MUL are set but FIX_KEYS names no parameters \
             (the VRT recipe: [spynet, deform])",
        )?;
        let fewer = format!("fewer than TOTAL_STEPS ({})", self.total_steps);
        let fix_ok = self.fix_iter < self.total_steps || self.fix_iter == 0;
        t.expect(fix_ok, "FIX_ITER", fewer, self.fix_iter)
    }

    /// One-line notices for keys accepted without an equivalent here.
    pub(super) fn notices(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.amp_enabled && self.amp_opt_level == AmpOptLevel::O2 {
            out.push(
                "TRAIN.AMP_OPT_LEVEL: O2 (half weights, fp32 master copies) is not implemented; \
                 training runs as O1 (fp32 weights, autocast)"
                    .to_string(),
            );
        }
        if self.compile_model {
            out.push(
                "TRAIN.COMPILE_MODEL: true is accepted; libtorch has no torch.compile, the model \
                 runs eagerly"
                    .to_string(),
            );
        }
        out
    }

    /// The clipping threshold, `None` when clipping is off.
    pub fn grad_clip(&self) -> Option<f64> {
        self.max_grad_norm.filter(|n| *n > 0.0)
    }
}
