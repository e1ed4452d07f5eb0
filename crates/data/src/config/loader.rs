//! `DATALOADER`: loader threads per node, prefetch depths and the batch options the
//! user's PyTorch configs carry (`PIN_MEMORY`, `PERSISTENT_WORKERS`, `DROP_LAST`).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{at_least, Checks};

/// `TOTAL_WORKERS`: a count for the whole node, or `auto` (80% of the cores).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Workers {
    /// 80% of the node's cores and at least 4 per GPU, split over its ranks.
    #[default]
    Auto,
    /// This many loader threads on the node, split over its ranks.
    Count(u32),
}

/// Loader threads of a node for `TOTAL_WORKERS: auto`, as the user's trainer chose
/// them: 80% of `cores`, but at least 4 per GPU (`gpus`), and at least 1.
pub fn auto_workers(cores: usize, gpus: usize) -> u32 {
    let share = cores * 4 / 5;
    let floor = 4 * gpus;
    u32::try_from(share.max(floor).max(1)).unwrap_or(u32::MAX)
}

impl Workers {
    /// Loader threads of the node with `cores` cores and `gpus` GPUs.
    pub fn resolve(self, cores: usize, gpus: usize) -> u32 {
        match self {
            Workers::Count(n) => n,
            Workers::Auto => auto_workers(cores, gpus),
        }
    }
}

/// A count or `auto`, as a config key reads it (`None` for `auto`); the error
/// names `what` is counted.
pub(super) fn auto_or_count<'de, D: Deserializer<'de>>(
    de: D,
    what: &str,
) -> Result<Option<u32>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Count(u32),
        Word(String),
    }
    match Raw::deserialize(de) {
        Ok(Raw::Count(n)) => Ok(Some(n)),
        Ok(Raw::Word(w)) if w == "auto" => Ok(None),
        _ => Err(serde::de::Error::custom(format!(
            "expected a {what} count or \"auto\""
        ))),
    }
}

/// Writes a count, or `auto` for `None` ([`auto_or_count`] reads it back).
pub(super) fn write_auto_or_count<S: Serializer>(
    count: Option<u32>,
    ser: S,
) -> Result<S::Ok, S::Error> {
    match count {
        None => ser.serialize_str("auto"),
        Some(n) => ser.serialize_u32(n),
    }
}

impl<'de> Deserialize<'de> for Workers {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        Ok(match auto_or_count(de, "worker")? {
            Some(n) => Workers::Count(n),
            None => Workers::Auto,
        })
    }
}

impl Serialize for Workers {
    fn serialize<S: Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        let count = match self {
            Workers::Auto => None,
            Workers::Count(n) => Some(*n),
        };
        write_auto_or_count(count, ser)
    }
}

/// The `DATALOADER` section. `TRAIN.NUM_WORKERS` and `TRAIN.PREFETCH_FACTOR` are read
/// as `TOTAL_WORKERS` and `TRAIN_PREFETCH_FACTOR`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE", deny_unknown_fields, default)]
pub struct DataLoaderConfig {
    /// Loader threads on the node (all ranks together).
    pub total_workers: Workers,
    /// Training batches queued ahead per worker.
    pub train_prefetch_factor: u32,
    /// Validation batches queued ahead per worker.
    pub val_prefetch_factor: u32,
    /// Copy batches to the GPU from page-locked host memory. The loader always does
    /// on a GPU, so `false` is accepted with a notice; nothing is pinned on a CPU rank.
    pub pin_memory: bool,
    /// Keep loader workers between epochs (they are threads that always persist here).
    pub persistent_workers: bool,
    /// Drop the last incomplete training batch of an epoch.
    pub drop_last: bool,
}

impl Default for DataLoaderConfig {
    fn default() -> Self {
        DataLoaderConfig {
            total_workers: Workers::Auto,
            train_prefetch_factor: 2,
            val_prefetch_factor: 2,
            pin_memory: true,
            persistent_workers: true,
            drop_last: true,
        }
    }
}

impl DataLoaderConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        at_least(
            "DATALOADER",
            1,
            [
                ("TRAIN_PREFETCH_FACTOR", self.train_prefetch_factor),
                ("VAL_PREFETCH_FACTOR", self.val_prefetch_factor),
            ],
        )?;
        let workers_ok = self.total_workers != Workers::Count(0);
        let d = Checks("DATALOADER");
        d.check(
            workers_ok,
            "TOTAL_WORKERS",
            "expected at least 1 or \"auto\"",
        )
    }

    /// One-line notices for keys accepted without an equivalent here.
    pub(super) fn notices(&self) -> Vec<String> {
        let mut out = Vec::new();
        if !self.pin_memory {
            out.push(
                "DATALOADER.PIN_MEMORY: false is accepted; batches for a GPU are still copied \
                 through page-locked host memory"
                    .to_string(),
            );
        }
        if !self.persistent_workers {
            out.push(
                "DATALOADER.PERSISTENT_WORKERS: false is accepted; loader workers are threads \
                 that live for the whole run"
                    .to_string(),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_is_80_percent_of_cores_with_4_per_gpu() {
        assert_eq!(auto_workers(40, 4), 32);
        assert_eq!(auto_workers(10, 4), 16);
        assert_eq!(auto_workers(2, 0), 1);
        assert_eq!(auto_workers(5, 0), 4);
        assert_eq!(Workers::Auto.resolve(40, 8), 32);
        assert_eq!(Workers::Auto.resolve(40, 9), 36);
        assert_eq!(Workers::Count(6).resolve(40, 9), 6);
    }
}
