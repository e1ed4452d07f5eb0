//! `DATALOADER`: loader threads per node and the prefetch depth.

use serde::{Deserialize, Deserializer};

use super::invalid;

/// `TOTAL_WORKERS`: a count for the whole node, or `auto` (80% of the cores).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Workers {
    /// 80% of the node's cores, split over its ranks.
    #[default]
    Auto,
    /// This many loader threads on the node, split over its ranks.
    Count(u32),
}

impl<'de> Deserialize<'de> for Workers {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Count(u32),
            Word(String),
        }
        match Raw::deserialize(de) {
            Ok(Raw::Count(n)) => Ok(Workers::Count(n)),
            Ok(Raw::Word(w)) if w == "auto" => Ok(Workers::Auto),
            _ => Err(serde::de::Error::custom(
                "expected a worker count or \"auto\"",
            )),
        }
    }
}

/// The `DATALOADER` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataLoaderConfig {
    /// Loader threads on the node (all ranks together).
    #[serde(rename = "TOTAL_WORKERS")]
    pub total_workers: Workers,
    /// Batches queued ahead per worker.
    #[serde(rename = "TRAIN_PREFETCH_FACTOR")]
    pub train_prefetch_factor: u32,
}

impl Default for DataLoaderConfig {
    fn default() -> Self {
        DataLoaderConfig {
            total_workers: Workers::Auto,
            train_prefetch_factor: 2,
        }
    }
}

impl DataLoaderConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        if self.train_prefetch_factor == 0 {
            return Err(invalid(
                "DATALOADER",
                "TRAIN_PREFETCH_FACTOR",
                "expected at least 1",
            ));
        }
        if self.total_workers == Workers::Count(0) {
            return Err(invalid(
                "DATALOADER",
                "TOTAL_WORKERS",
                "expected at least 1 or \"auto\"",
            ));
        }
        Ok(())
    }
}
