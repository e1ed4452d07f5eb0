//! `TRAIN`: optimisation settings (batch, accumulation, precision).

use serde::Deserialize;

use super::invalid;

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
    /// Mixed precision (bf16 autocast on CUDA).
    #[serde(rename = "AMP_ENABLED")]
    pub amp_enabled: bool,
    /// Seed of samplers, crops and initialisation.
    #[serde(rename = "SEED")]
    pub seed: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            batch_size: 1,
            gradient_accumulation_steps: 1,
            amp_enabled: false,
            seed: 0,
        }
    }
}

impl TrainConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        if self.batch_size == 0 {
            return Err(invalid("TRAIN", "BATCH_SIZE", "expected at least 1"));
        }
        if self.gradient_accumulation_steps == 0 {
            return Err(invalid(
                "TRAIN",
                "GRADIENT_ACCUMULATION_STEPS",
                "expected at least 1",
            ));
        }
        Ok(())
    }
}
