//! Run configuration: the YAML files of the original trainer (`DATA`, `DATALOADER`,
//! `TRAIN`, `MODEL`, `LOG`, `DIST` sections), read unchanged. Unknown keys and bad
//! values are errors that name the key path (`DATA.CACHE_SIZE_GB`) and what was expected.

mod data;
mod dist;
mod loader;
mod log;
mod model;
mod train;

use std::path::{Path, PathBuf};

use serde::Deserialize;

pub use data::{Augment, BlurDir, DataConfig};
pub use dist::{DistBackend, DistConfig};
pub use loader::{DataLoaderConfig, Workers};
pub use log::LogConfig;
pub use model::{
    ChunkShape, FuseConfig, ModelConfig, SpikeConfig, SpikeTsaConfig, UnetConfig,
    ARCHS as MODEL_ARCHS,
};
pub use train::{AmpDtype, TrainConfig};

/// A configuration file that could not be used, with the file and key path at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("config {path}: {source}")]
    Read {
        /// The config file.
        path: PathBuf,
        /// What reading it said.
        source: std::io::Error,
    },
    /// The YAML did not parse, or a key is unknown or has the wrong type.
    #[error("config {path}: {key}: {message}")]
    Parse {
        /// The config file.
        path: PathBuf,
        /// Key path such as `DATA.CROP_SIZE` (`.` for the top level).
        key: String,
        /// What was wrong and what was expected.
        message: String,
    },
    /// A key parsed but its value is out of range or inconsistent.
    #[error("config {path}: {key}: {message}")]
    Invalid {
        /// The config file.
        path: PathBuf,
        /// Key path such as `DATA.CACHE_SIZE_GB`.
        key: String,
        /// What was wrong and what was expected.
        message: String,
    },
}

/// The whole run configuration. Every section has defaults, so a file may set only
/// what it changes; a key that no section knows is an error.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Dataset, crops, cache.
    #[serde(rename = "DATA")]
    pub data: DataConfig,
    /// Loader threads and prefetch.
    #[serde(rename = "DATALOADER")]
    pub dataloader: DataLoaderConfig,
    /// Optimisation.
    #[serde(rename = "TRAIN")]
    pub train: TrainConfig,
    /// Architecture.
    #[serde(rename = "MODEL")]
    pub model: ModelConfig,
    /// Logging, checkpoints, validation cadence.
    #[serde(rename = "LOG")]
    pub log: LogConfig,
    /// Process group settings.
    #[serde(rename = "DIST")]
    pub dist: DistConfig,
}

impl Config {
    /// Reads and validates a YAML config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::parse(&text, path)
    }

    /// Parses and validates YAML text; `path` only names the source in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let parse_error = |key: String, message: String| ConfigError::Parse {
            path: path.to_path_buf(),
            key,
            message,
        };
        let de = serde_yaml_ng::Deserializer::from_str(text);
        let config: Config = serde_path_to_error::deserialize(de).map_err(|err| {
            let key = err.path().to_string();
            parse_error(key, err.into_inner().to_string())
        })?;
        config
            .validate()
            .map_err(|(key, message)| ConfigError::Invalid {
                path: path.to_path_buf(),
                key,
                message,
            })?;
        Ok(config)
    }

    /// Checks values that parse but make no sense, section by section.
    fn validate(&self) -> Result<(), (String, String)> {
        self.data.validate()?;
        self.dataloader.validate()?;
        self.train.validate()?;
        self.model.validate()?;
        self.log.validate()?;
        self.dist.validate()?;
        Ok(())
    }
}

/// A failed check: the key path under `section` and what was expected.
pub(crate) fn invalid(section: &str, key: &str, message: impl Into<String>) -> (String, String) {
    (format!("{section}.{key}"), message.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new("test.yaml"))
    }

    #[test]
    fn empty_file_gives_defaults() {
        let config = parse("{}").unwrap();
        assert!(config.data.use_ram_cache);
        assert_eq!(config.data.crop_size, 256);
    }

    #[test]
    fn unknown_key_names_its_path() {
        let err = parse("DATA:\n  CROP_SIZ: 128\n").unwrap_err().to_string();
        assert!(err.contains("test.yaml"), "{err}");
        assert!(err.contains("DATA"), "{err}");
        assert!(err.contains("CROP_SIZ"), "{err}");
    }

    #[test]
    fn unknown_section_is_an_error() {
        let err = parse("DATAA: {}\n").unwrap_err().to_string();
        assert!(err.contains("DATAA"), "{err}");
    }

    #[test]
    fn wrong_type_names_key_path() {
        let err = parse("DATA:\n  CACHE_SIZE_GB: lots\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("DATA.CACHE_SIZE_GB"), "{err}");
    }

    #[test]
    fn bad_value_names_key_path() {
        let err = parse("DATA:\n  CACHE_SIZE_GB: -1\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("DATA.CACHE_SIZE_GB"), "{err}");
        let err = parse("DATALOADER:\n  TOTAL_WORKERS: some\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("DATALOADER.TOTAL_WORKERS"), "{err}");
    }

    #[test]
    fn workers_auto_or_count() {
        let config = parse("DATALOADER:\n  TOTAL_WORKERS: auto\n").unwrap();
        assert_eq!(config.dataloader.total_workers, Workers::Auto);
        let config = parse("DATALOADER:\n  TOTAL_WORKERS: 12\n").unwrap();
        assert_eq!(config.dataloader.total_workers, Workers::Count(12));
    }
}
