//! What a Dataset reads and how, from the user's run config: the config is the
//! trainer's (a YAML file with its `BASE` chain, or the defaults, then
//! `KEY.PATH=VALUE` overrides, read and checked by `vrtspike_data::config`), the
//! split is indexed by the dataset readers, and samples are cut by the training
//! loader's rules (random crops, `DATA.AUGMENT`, sliding clips) or the validation
//! loader's (centre or full-frame crops, no augmentation, clips that cover every
//! frame), exactly as `vrtspike train` cuts them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use vrtspike_data::config::Config;
use vrtspike_data::dataset::{DatasetIndex, IndexOptions};
use vrtspike_data::pipeline::draw::DrawRules;
use vrtspike_data::pipeline::loader::{LoaderBudget, LoaderOptions, Purpose};
use vrtspike_data::pipeline::sample::{ClipIndex, ClipWindows};

use crate::errors::Failure;

/// Where a Dataset's config comes from and what it reads.
#[derive(Debug, Clone)]
pub struct DatasetSpec {
    /// The run config file (`None`: the defaults).
    pub config: Option<PathBuf>,
    /// `KEY.PATH=VALUE` overrides, in order.
    pub overrides: Vec<String>,
    /// The split folder under `DATA.ROOT` (`train`, `test`).
    pub split: String,
    /// Training samples or validation samples.
    pub purpose: Purpose,
}

/// A split opened for reading.
pub struct Opened {
    /// The resolved run config.
    pub config: Config,
    /// Training or validation samples.
    pub purpose: Purpose,
    /// The split's frames.
    pub index: Arc<DatasetIndex>,
    /// Its clips.
    pub clips: Arc<ClipIndex>,
    /// The training or validation loader's options for this split (its crops,
    /// augmentation, voxel bins, seed, cache policy and prefetch; its worker counts
    /// play no part here).
    pub loader: LoaderOptions,
}

impl Opened {
    /// How samples are cut.
    pub fn rules(&self) -> DrawRules {
        self.loader.draw_rules()
    }
}

impl DatasetSpec {
    /// The resolved config: the file (with its `BASE` chain) or the defaults, then
    /// the overrides; errors name the file, override and key path.
    pub fn config(&self) -> Result<Config, Failure> {
        Ok(match &self.config {
            Some(path) => Config::resolve(path, &self.overrides)?.config,
            None => Config::default().with_overrides(&self.overrides)?,
        })
    }

    /// Resolves the config and indexes the split.
    pub fn open(&self) -> Result<Opened, Failure> {
        let config = self.config()?;
        let root = dataset_root(&config, self.config.as_deref())?;
        let index =
            DatasetIndex::open(&root, &self.split, IndexOptions::from_config(&config.data))?;
        let clip_len = config.data.clip_len as usize;
        let windows = match self.purpose {
            Purpose::Train => ClipWindows::sliding(clip_len),
            Purpose::Validate => ClipWindows::covering(clip_len),
        };
        let clips = ClipIndex::new(&index, windows);
        if clips.clips.is_empty() {
            return Err(Failure::ConfigKey(format!(
                "DATA.CLIP_LEN = {clip_len}: no sequence of {} has that many frames",
                root.join(&self.split).display()
            )));
        }
        // The loader's own options for this purpose: the same crop, augmentation
        // and voxel bins as `vrtspike train` (workers and prefetch play no part).
        let budget = LoaderBudget::new(&config, 1);
        let loader = LoaderOptions::from_config(&config, 0, &budget, self.purpose, None);
        Ok(Opened {
            config,
            purpose: self.purpose,
            index: Arc::new(index),
            clips: Arc::new(clips),
            loader,
        })
    }
}

/// `DATA.ROOT`, which must name a folder.
fn dataset_root(config: &Config, file: Option<&Path>) -> Result<PathBuf, Failure> {
    let origin = file.map_or_else(
        || "the overrides".to_string(),
        |f| format!("{} and the overrides", f.display()),
    );
    let root = config.data.root.clone().ok_or_else(|| {
        Failure::ConfigKey(format!(
            "DATA.ROOT: not set in {origin}: give the dataset root (a folder of the \
             GoPro-Spike layout or of HDF5 sessions)"
        ))
    })?;
    if !root.is_dir() {
        return Err(Failure::ConfigKey(format!(
            "DATA.ROOT: {} does not exist or is not a directory",
            root.display()
        )));
    }
    Ok(root)
}
