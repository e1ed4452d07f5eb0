//! `LOG`: how often to log, validate, sample memory and checkpoint; TensorBoard on/off.

use serde::{Deserialize, Serialize};

use super::at_least;

/// The `LOG` section.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE", deny_unknown_fields, default)]
pub struct LogConfig {
    /// Validation cadence in optimizer steps (and once at the end).
    pub val_every_steps: u64,
    /// Checkpoint cadence in optimizer steps (and once at the end).
    pub ckpt_every_steps: u64,
    /// Memory monitor cadence in optimizer steps.
    pub mem_every_steps: u64,
    /// Metrics line cadence in optimizer steps.
    pub log_every_steps: u64,
    /// Checkpoints kept in `checkpoints/` (older ones are removed); 0 keeps all.
    pub keep_checkpoints: u32,
    /// TensorBoard event files in `<run dir>/tb/` (rank 0).
    pub tensorboard: bool,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            val_every_steps: 1000,
            ckpt_every_steps: 5000,
            mem_every_steps: 100,
            log_every_steps: 10,
            keep_checkpoints: 3,
            tensorboard: true,
        }
    }
}

impl LogConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        at_least(
            "LOG",
            1,
            [
                ("VAL_EVERY_STEPS", self.val_every_steps),
                ("CKPT_EVERY_STEPS", self.ckpt_every_steps),
                ("MEM_EVERY_STEPS", self.mem_every_steps),
                ("LOG_EVERY_STEPS", self.log_every_steps),
            ],
        )
    }
}
