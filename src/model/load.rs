//! A model from a run config file: the config read (with its `BASE` chain and its
//! checks), the architecture it names built on a device and, for inference, a weights
//! file loaded strictly. `vrtspike model`, `vrtspike infer` and anything else given a
//! config file start here; every error names the config file (and the weights file).

use std::path::{Path, PathBuf};

use tch::{nn, Device};

use crate::config::{Config, ConfigError};

use super::{build, load_safetensors, summarize, ModelError, Restorer, Summary};

/// Why the model of a config file could not be had.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The config file cannot be used (the file and key named).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The config's `MODEL` section does not build.
    #[error("building the model of {config}: {source}")]
    Build {
        /// The config file.
        config: PathBuf,
        /// What the model said.
        source: Box<ModelError>,
    },
    /// The weights do not load into the model (the first key at fault named).
    #[error("loading {weights} into the model of {config}: {source}")]
    Weights {
        /// The config file.
        config: PathBuf,
        /// The weights file.
        weights: PathBuf,
        /// What loading said.
        source: Box<ModelError>,
    },
}

/// A model built from a run config file, with its variables.
pub struct LoadedModel {
    /// The run config it was built from (its `DATA` section tells inference how to
    /// read a dataset).
    pub config: Config,
    /// The config file.
    pub path: PathBuf,
    /// Its variables, named by the reference's state_dict keys.
    pub vs: nn::VarStore,
    /// The network.
    pub net: Box<dyn Restorer>,
}

impl LoadedModel {
    /// The model of the run config at `path` on `device`, freshly initialised (built
    /// without autograd: for summaries and inference, not training).
    pub fn build(path: &Path, device: Device) -> Result<LoadedModel, LoadError> {
        let config = Config::load(path)?;
        let vs = nn::VarStore::new(device);
        let net = tch::no_grad(|| build(&vs.root(), &config.model)).map_err(|source| {
            LoadError::Build {
                config: path.to_path_buf(),
                source: Box::new(source),
            }
        })?;
        Ok(LoadedModel {
            config,
            path: path.to_path_buf(),
            vs,
            net,
        })
    }

    /// [`LoadedModel::build`] with `weights` (safetensors) loaded strictly: every key
    /// of the model present with its shape, no other key.
    pub fn with_weights(
        path: &Path,
        weights: &Path,
        device: Device,
    ) -> Result<LoadedModel, LoadError> {
        let model = LoadedModel::build(path, device)?;
        load_safetensors(&model.vs, weights).map_err(|source| LoadError::Weights {
            config: path.to_path_buf(),
            weights: weights.to_path_buf(),
            source: Box::new(source),
        })?;
        Ok(model)
    }

    /// Parameters per part and in total.
    pub fn summary(&self) -> Summary {
        summarize(&self.vs, self.net.arch(), &self.net.parts())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    const TINY_UNET: &str = "MODEL:\n  ARCH: unet_spike\n  UNET: {CHANNELS: 4, LEVELS: 1}\n  \
                             SPIKE: {ENABLED: true, VOXEL_BINS: 2}\n";

    #[test]
    fn weights_round_trip_and_errors_name_the_files() {
        let dir = tempfile::tempdir().unwrap();
        let config = write(dir.path(), "unet.yaml", TINY_UNET);
        tch::manual_seed(3);
        let first = LoadedModel::build(&config, Device::Cpu).unwrap();
        assert_eq!(first.summary().arch, "unet_spike");
        assert!(first.summary().total_params > 0);
        let weights = dir.path().join("w.safetensors");
        crate::model::save_safetensors(&first.vs, &weights).unwrap();
        tch::manual_seed(4);
        let second = LoadedModel::with_weights(&config, &weights, Device::Cpu).unwrap();
        for (name, value) in first.vs.variables() {
            let loaded = &second.vs.variables()[&name];
            assert!(value.equal(loaded), "{name} differs after loading");
        }

        // Weights of another model: the error names both files and a key.
        let other = write(
            dir.path(),
            "wider.yaml",
            &TINY_UNET.replace("CHANNELS: 4", "CHANNELS: 6"),
        );
        let err = LoadedModel::with_weights(&other, &weights, Device::Cpu)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("wider.yaml") && err.contains("w.safetensors") && err.contains("shape"),
            "{err}"
        );
        // A config that does not load names the file.
        let bad = write(dir.path(), "bad.yaml", "MODEL:\n  ARCH: vrt\n");
        let err = LoadedModel::build(&bad, Device::Cpu)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("bad.yaml") && err.contains("MODEL.ARCH"),
            "{err}"
        );
    }
}
