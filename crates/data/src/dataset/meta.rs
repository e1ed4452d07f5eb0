//! `dataset.yaml`: the metadata every dataset root carries (spike resolution, row
//! order, sub-frames per blur). Read strictly: a missing file or a bad value is an
//! error naming the file and the key.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::{DataError, Result};

/// The file name under a dataset root.
pub const META_FILE: &str = "dataset.yaml";

/// Contents of `dataset.yaml` (format page, section 1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetMeta {
    /// Spike rows `H_s`.
    pub spike_height: u32,
    /// Spike columns `W_s`.
    pub spike_width: u32,
    /// Rows stored bottom-up in `.dat` files (the reader flips them).
    #[serde(default = "default_flipped")]
    pub spike_flipped: bool,
    /// Sharp sub-frames averaged into each blur, per sequence (optional).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub blur_frames: BTreeMap<String, u32>,
}

fn default_flipped() -> bool {
    true
}

impl DatasetMeta {
    /// Reads `<root>/dataset.yaml`.
    pub fn load(root: &Path) -> Result<DatasetMeta> {
        let path = root.join(META_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                DataError::Missing {
                    path: path.clone(),
                    why: "every dataset root needs its metadata file".into(),
                }
            } else {
                DataError::io(&path, e)
            }
        })?;
        Self::parse(&text, &path)
    }

    /// Parses metadata text; `path` names the source in errors.
    pub fn parse(text: &str, path: &Path) -> Result<DatasetMeta> {
        let de = serde_yaml_ng::Deserializer::from_str(text);
        let meta: DatasetMeta = serde_path_to_error::deserialize(de).map_err(|err| {
            let key = err.path().to_string();
            DataError::format(path, format!("{key}: {}", err.into_inner()))
        })?;
        meta.validate(path)?;
        Ok(meta)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        if self.spike_height == 0 || self.spike_width == 0 {
            return Err(DataError::format(
                path,
                format!(
                    "spike_height/spike_width: expected positive sizes, got {}x{}",
                    self.spike_height, self.spike_width
                ),
            ));
        }
        if (self.spike_height as u64 * self.spike_width as u64) % 8 != 0 {
            return Err(DataError::format(
                path,
                format!(
                    "spike_height x spike_width = {}x{} is not a multiple of 8 bits",
                    self.spike_height, self.spike_width
                ),
            ));
        }
        if let Some((seq, n)) = self.blur_frames.iter().find(|(_, n)| **n == 0) {
            return Err(DataError::format(
                path,
                format!("blur_frames.{seq}: expected at least 1, got {n}"),
            ));
        }
        Ok(())
    }

    /// Writes `<root>/dataset.yaml`.
    pub fn save(&self, root: &Path) -> Result<()> {
        let path = root.join(META_FILE);
        let text = serde_yaml_ng::to_string(self)
            .map_err(|e| DataError::format(&path, format!("cannot serialise: {e}")))?;
        std::fs::write(&path, text).map_err(|e| DataError::io(&path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let mut meta = DatasetMeta {
            spike_height: 32,
            spike_width: 48,
            spike_flipped: false,
            blur_frames: BTreeMap::new(),
        };
        meta.blur_frames.insert("seq0".into(), 7);
        meta.save(dir.path()).unwrap();
        assert_eq!(DatasetMeta::load(dir.path()).unwrap(), meta);
        let m = DatasetMeta::parse("spike_height: 360\nspike_width: 640\n", Path::new("d.yaml"))
            .unwrap();
        assert!(m.spike_flipped);
        assert_eq!((m.spike_height, m.spike_width), (360, 640));
    }

    #[test]
    fn bad_metadata_names_file_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let err = DatasetMeta::load(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("dataset.yaml") && err.contains("missing"),
            "{err}"
        );
        let err = DatasetMeta::parse("spike_height: tall\nspike_width: 8\n", Path::new("d.yaml"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("d.yaml") && err.contains("spike_height"),
            "{err}"
        );
        let err = DatasetMeta::parse("spike_height: 3\nspike_width: 3\n", Path::new("d.yaml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("multiple of 8"), "{err}");
        let err = DatasetMeta::parse(
            "spike_height: 8\nspike_width: 8\nspike_hieght: 3\n",
            Path::new("d.yaml"),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("spike_hieght"), "{err}");
    }
}
