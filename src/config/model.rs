//! `MODEL`: the architecture and its sizes.

use serde::Deserialize;

/// The `MODEL` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Architecture name (`unet_spike`, `vrt_spike`).
    #[serde(rename = "ARCH")]
    pub arch: String,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            arch: "unet_spike".to_string(),
        }
    }
}
