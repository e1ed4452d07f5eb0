//! `DIST`: process-group settings shared by every rank.

use serde::{Deserialize, Serialize};

use super::{positive, Checks};

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

/// How gradients are averaged over ranks (`DIST.GRAD_SYNC`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
pub enum GradSyncMode {
    /// PyTorch DDP's Reducer: each bucket's all-reduce starts while backward goes on.
    #[default]
    #[serde(rename = "reducer")]
    Reducer,
    /// Flat buckets all-reduced one after another once backward is done (the
    /// project's earlier path; the baseline of `make bench`'s slow-link part).
    #[serde(rename = "after_backward")]
    AfterBackward,
}

/// How gradient buckets travel (`DIST.GRAD_COMPRESSION`, with the Reducer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
pub enum GradCompressionMode {
    /// In the gradients' own dtype.
    #[default]
    #[serde(rename = "none")]
    None,
    /// Cast to bfloat16 for the all-reduce.
    #[serde(rename = "bf16")]
    Bf16,
    /// Cast to float16 for the all-reduce.
    #[serde(rename = "fp16")]
    Fp16,
}

/// The `DIST` section.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE", deny_unknown_fields, default)]
pub struct DistConfig {
    /// Seconds a collective may wait before the job fails naming the rank.
    pub timeout_s: u64,
    /// `auto`, `gloo` or `nccl`.
    pub backend: DistBackend,
    /// `reducer` or `after_backward`.
    pub grad_sync: GradSyncMode,
    /// `none`, `bf16` or `fp16` (the Reducer's communication hook).
    pub grad_compression: GradCompressionMode,
    /// Cap of a gradient bucket after the first (1 MiB), in MiB: PyTorch DDP's
    /// `bucket_cap_mb`. Smaller buckets start their all-reduce earlier in backward.
    pub bucket_cap_mb: f64,
}

impl Default for DistConfig {
    fn default() -> Self {
        DistConfig {
            timeout_s: 600,
            backend: DistBackend::Auto,
            grad_sync: GradSyncMode::Reducer,
            grad_compression: GradCompressionMode::None,
            bucket_cap_mb: 25.0,
        }
    }
}

impl DistConfig {
    /// [`Self::bucket_cap_mb`] in bytes.
    pub fn bucket_bytes(&self) -> usize {
        (self.bucket_cap_mb * (1u64 << 20) as f64) as usize
    }

    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        let d = Checks("DIST");
        d.check(
            self.timeout_s > 0,
            "TIMEOUT_S",
            "expected at least 1 second",
        )?;
        let mb = self.bucket_cap_mb;
        let mb_ok = positive(mb) && mb <= 4096.0;
        d.expect(
            mb_ok,
            "BUCKET_CAP_MB",
            "more than 0 and at most 4096 MiB",
            mb,
        )?;
        let compresses = self.grad_compression != GradCompressionMode::None;
        d.check(
            self.grad_sync != GradSyncMode::AfterBackward || !compresses,
            "GRAD_COMPRESSION",
            "compression is a hook of the Reducer: it needs DIST.GRAD_SYNC reducer, not after_backward",
        )
    }
}
