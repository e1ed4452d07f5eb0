//! `DIST`: process-group settings shared by every rank.

use serde::{Deserialize, Serialize};

use super::invalid;

/// Collective backend choice (`DIST.BACKEND`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
pub enum DistBackend {
    /// NCCL on CUDA ranks, Gloo on CPU ranks.
    #[default]
    #[serde(rename = "auto")]
    Auto,
    /// Gloo (CPU tensors).
    #[serde(rename = "gloo")]
    Gloo,
    /// NCCL (CUDA tensors).
    #[serde(rename = "nccl")]
    Nccl,
}

/// The `DIST` section.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistConfig {
    /// Seconds a collective may wait before the job fails naming the rank.
    #[serde(rename = "TIMEOUT_S")]
    pub timeout_s: u64,
    /// `auto`, `gloo` or `nccl`.
    #[serde(rename = "BACKEND")]
    pub backend: DistBackend,
}

impl Default for DistConfig {
    fn default() -> Self {
        DistConfig {
            timeout_s: 600,
            backend: DistBackend::Auto,
        }
    }
}

impl DistConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        if self.timeout_s == 0 {
            return Err(invalid("DIST", "TIMEOUT_S", "expected at least 1 second"));
        }
        Ok(())
    }
}
