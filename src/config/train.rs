//! `TRAIN`: optimisation settings (batch, accumulation, learning-rate schedule,
//! AdamW, clipping, precision, seed and the cross-rank parameter check).

use serde::Deserialize;

use super::invalid;

/// Floating-point type of mixed precision (`TRAIN.AMP_DTYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
pub enum AmpDtype {
    /// bfloat16 autocast (no loss scaling needed).
    #[default]
    #[serde(rename = "bf16")]
    Bf16,
    /// float16 autocast with a dynamic loss scaler that skips steps on inf/NaN.
    #[serde(rename = "fp16")]
    Fp16,
}

/// The `TRAIN` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Samples per rank per micro-batch.
    #[serde(rename = "BATCH_SIZE")]
    pub batch_size: u32,
    /// Micro-batches per optimizer step.
    #[serde(rename = "GRADIENT_ACCUMULATION_STEPS")]
    pub gradient_accumulation_steps: u32,
    /// Mixed precision on CUDA (ignored on CPU).
    #[serde(rename = "AMP_ENABLED")]
    pub amp_enabled: bool,
    /// Mixed-precision type: `bf16` or `fp16`.
    #[serde(rename = "AMP_DTYPE")]
    pub amp_dtype: AmpDtype,
    /// Seed of samplers, crops and initialisation.
    #[serde(rename = "SEED")]
    pub seed: u64,
    /// Peak learning rate (after warm-up).
    #[serde(rename = "LR")]
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    #[serde(rename = "MIN_LR")]
    pub min_lr: f64,
    /// Linear warm-up length in optimizer steps.
    #[serde(rename = "WARMUP_STEPS")]
    pub warmup_steps: u64,
    /// Optimizer steps of the whole run.
    #[serde(rename = "TOTAL_STEPS")]
    pub total_steps: u64,
    /// AdamW decoupled weight decay.
    #[serde(rename = "WEIGHT_DECAY")]
    pub weight_decay: f64,
    /// AdamW (beta1, beta2).
    #[serde(rename = "BETAS")]
    pub betas: [f64; 2],
    /// AdamW epsilon.
    #[serde(rename = "EPS")]
    pub eps: f64,
    /// Clip the global gradient norm to this; `null` or 0 disables clipping.
    #[serde(rename = "MAX_GRAD_NORM")]
    pub max_grad_norm: Option<f64>,
    /// Epsilon of the Charbonnier loss sqrt((x - y)^2 + eps^2).
    #[serde(rename = "CHARBONNIER_EPS")]
    pub charbonnier_eps: f64,
    /// Compare a parameter hash across ranks every this many steps (0: never).
    #[serde(rename = "PARAM_CHECK_EVERY")]
    pub param_check_every: u64,
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
        }
    }
}

impl TrainConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        let bad = |key: &str, message: String| Err(invalid("TRAIN", key, message));
        if self.batch_size == 0 {
            return bad("BATCH_SIZE", "expected at least 1".into());
        }
        if self.gradient_accumulation_steps == 0 {
            return bad("GRADIENT_ACCUMULATION_STEPS", "expected at least 1".into());
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(
                "LR",
                format!("expected a positive learning rate, got {}", self.lr),
            );
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return bad(
                "MIN_LR",
                format!("expected 0 <= MIN_LR <= LR, got {}", self.min_lr),
            );
        }
        if self.total_steps == 0 {
            return bad("TOTAL_STEPS", "expected at least 1".into());
        }
        if self.warmup_steps > self.total_steps {
            return bad(
                "WARMUP_STEPS",
                format!(
                    "expected at most TOTAL_STEPS ({}), got {}",
                    self.total_steps, self.warmup_steps
                ),
            );
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(
                "WEIGHT_DECAY",
                format!("expected >= 0, got {}", self.weight_decay),
            );
        }
        if self.betas.iter().any(|b| !(0.0..1.0).contains(b)) {
            return bad(
                "BETAS",
                format!("expected two values in [0, 1), got {:?}", self.betas),
            );
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad(
                "EPS",
                format!("expected a positive epsilon, got {}", self.eps),
            );
        }
        if let Some(norm) = self.max_grad_norm {
            if !(norm.is_finite() && norm >= 0.0) {
                return bad(
                    "MAX_GRAD_NORM",
                    format!("expected >= 0 or null, got {norm}"),
                );
            }
        }
        if !(self.charbonnier_eps.is_finite() && self.charbonnier_eps > 0.0) {
            return bad(
                "CHARBONNIER_EPS",
                format!("expected a positive epsilon, got {}", self.charbonnier_eps),
            );
        }
        Ok(())
    }

    /// The clipping threshold, `None` when clipping is off.
    pub fn grad_clip(&self) -> Option<f64> {
        self.max_grad_norm.filter(|n| *n > 0.0)
    }
}
