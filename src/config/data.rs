//! `DATA`: where the dataset is, how samples are cut from it, and the node cache.

use serde::Deserialize;

use super::invalid;

/// The `DATA` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Dataset root (folder layout or HDF5 sessions).
    #[serde(rename = "ROOT")]
    pub root: Option<std::path::PathBuf>,
    /// Square training crop, in RGB pixels.
    #[serde(rename = "CROP_SIZE")]
    pub crop_size: u32,
    /// Validation centre crop; `null` validates on the full frame.
    #[serde(rename = "VAL_CROP_SIZE")]
    pub val_crop_size: Option<u32>,
    /// Byte cap of the node's shared-memory cache, in GiB.
    #[serde(rename = "CACHE_SIZE_GB")]
    pub cache_size_gb: f64,
    /// Read through the node cache (`false`: every read goes to disk).
    #[serde(rename = "USE_RAM_CACHE")]
    pub use_ram_cache: bool,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            root: None,
            crop_size: 256,
            val_crop_size: Some(256),
            cache_size_gb: 20.0,
            use_ram_cache: true,
        }
    }
}

impl DataConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        if !(self.cache_size_gb.is_finite() && self.cache_size_gb > 0.0) {
            return Err(invalid(
                "DATA",
                "CACHE_SIZE_GB",
                format!(
                    "expected a positive size in GiB, got {}",
                    self.cache_size_gb
                ),
            ));
        }
        if self.crop_size == 0 {
            return Err(invalid(
                "DATA",
                "CROP_SIZE",
                "expected a positive crop size",
            ));
        }
        if self.val_crop_size == Some(0) {
            return Err(invalid(
                "DATA",
                "VAL_CROP_SIZE",
                "expected a positive crop size, or null for the full frame",
            ));
        }
        Ok(())
    }

    /// The cache cap in bytes.
    pub fn cache_bytes(&self) -> u64 {
        (self.cache_size_gb * (1u64 << 30) as f64) as u64
    }
}
