//! `LOG`: how often to log, validate and checkpoint.

use serde::Deserialize;

use super::invalid;

/// The `LOG` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// Validation cadence in optimizer steps.
    #[serde(rename = "VAL_EVERY_STEPS")]
    pub val_every_steps: u64,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            val_every_steps: 1000,
        }
    }
}

impl LogConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        if self.val_every_steps == 0 {
            return Err(invalid("LOG", "VAL_EVERY_STEPS", "expected at least 1"));
        }
        Ok(())
    }
}
