//! `DATA`: where the dataset is, how samples are cut from it, and the node cache.

use serde::{Deserialize, Serialize};

use super::{positive, Checks};

/// The `DATA` section.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE", deny_unknown_fields, default)]
pub struct DataConfig {
    /// Dataset root (folder layout or HDF5 sessions).
    pub root: Option<std::path::PathBuf>,
    /// Square training crop, in RGB pixels (`TRAIN_CROP_SIZE` is the same key).
    pub crop_size: u32,
    /// Validation centre crop; `null` validates on the full frame.
    pub val_crop_size: Option<u32>,
    /// Full-frame validation (`VAL_CROP_SIZE: null`) runs the model on square tiles
    /// of this many RGB pixels; `null` runs the whole frame at once.
    pub val_tile: Option<u32>,
    /// Overlap of neighbouring validation tiles, in RGB pixels.
    pub val_tile_overlap: u32,
    /// Byte cap of the node's shared-memory cache, in GiB.
    pub cache_size_gb: f64,
    /// Read through the node cache (`false`: every read goes to disk).
    pub use_ram_cache: bool,
    /// What the node cache evicts when the data does not fit: `planned` (the
    /// training ranks announce their order, the record needed last goes) or `lru`.
    pub cache_policy: CachePolicy,
    /// With `planned`: each training rank's loader fills records ahead of the step
    /// that needs them (never evicting one needed sooner).
    pub cache_prefetch: bool,
    /// Who shares the node cache server: `node` (every job of this user on this
    /// node on the same dataset attaches to one server) or `job` (one per job).
    pub cache_sharing: CacheSharing,
    /// Connections the node cache server serves at once (a 4 KiB pin page each):
    /// `auto` (8 a core of the node, 512 to 65536) or a count; every server a job
    /// starts gets it.
    pub cache_connections: CacheConnections,
    /// Consecutive frames in one sample (the clip length `L`).
    pub clip_len: u32,
    /// Voxel bins `K` of the spike grid.
    pub spike_bins: u32,
    /// Folder of the blurred frames: `blur` or `blur_gamma`.
    pub blur_dir: BlurDir,
    /// Skip (count and report) bad frames instead of failing on the first one.
    pub skip_bad_frames: bool,
    /// Training augmentation: `true`/`false` for all or none, or a mapping.
    pub augment: Augment,
    /// HDF5 chunk cache per open file, in MiB.
    pub chunk_cache_mb: u32,
    /// `true`: read precomputed `spike_vox/*.npy` voxel grids instead of `spike/*.dat`;
    /// `false`: the `.dat` spike streams; `null`: whichever the sequence has.
    pub use_precomputed_voxels: Option<bool>,
}

/// How the node cache chooses what to evict (`DATA.CACHE_POLICY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
pub enum CachePolicy {
    /// Each training rank announces its sample order (a pure function of seed, epoch
    /// and sampler settings); the cache evicts the record whose next use is farthest,
    /// and reads no read order names by LRU among records no read order needs.
    #[default]
    #[serde(rename = "planned")]
    Planned,
    /// Least recently used, with no announcement (for comparison).
    #[serde(rename = "lru")]
    Lru,
}

/// Who shares a node cache server (`DATA.CACHE_SHARING`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
pub enum CacheSharing {
    /// One server per user, node and dataset (canonical root and a signature of its
    /// files): the jobs on it attach to the one already running; it lingers a
    /// little after the last one detaches, then exits.
    #[default]
    #[serde(rename = "node")]
    Node,
    /// One server per job, started and stopped with it.
    #[serde(rename = "job")]
    Job,
}

/// The most connections a cache server can be sized for (`DATA.CACHE_CONNECTIONS`,
/// `cache serve --connections`).
pub const MAX_CACHE_CONNECTIONS: u32 = 1 << 16;

/// Connections of the node cache server (`DATA.CACHE_CONNECTIONS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheConnections {
    /// Sized for the node's cores (the server's default).
    #[default]
    Auto,
    /// This many, 1 to [`MAX_CACHE_CONNECTIONS`].
    Count(u32),
}

impl CacheConnections {
    /// The count, `None` for `auto`.
    pub fn count(self) -> Option<u32> {
        match self {
            CacheConnections::Auto => None,
            CacheConnections::Count(n) => Some(n),
        }
    }
}

impl<'de> Deserialize<'de> for CacheConnections {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        Ok(match super::loader::auto_or_count(de, "connection")? {
            Some(n) => CacheConnections::Count(n),
            None => CacheConnections::Auto,
        })
    }
}

impl Serialize for CacheConnections {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        super::loader::write_auto_or_count(self.count(), ser)
    }
}

/// Which folder holds the blurred frames (GoPro ships both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
pub enum BlurDir {
    /// `blur/`: blur averaged in linear space (the default).
    #[default]
    #[serde(rename = "blur")]
    Blur,
    /// `blur_gamma/`: blur averaged after gamma.
    #[serde(rename = "blur_gamma")]
    BlurGamma,
}

impl BlurDir {
    /// The folder name under a sequence.
    pub fn folder(self) -> &'static str {
        match self {
            BlurDir::Blur => "blur",
            BlurDir::BlurGamma => "blur_gamma",
        }
    }
}

/// `DATA.AUGMENT`: random flips and 90-degree rotations of training crops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Augment {
    /// Random left-right flips.
    pub hflip: bool,
    /// Random up-down flips.
    pub vflip: bool,
    /// Random 90-degree rotations (square crops only).
    pub rot90: bool,
}

impl Default for Augment {
    fn default() -> Self {
        Augment::all(true)
    }
}

impl Augment {
    /// Every augmentation on (`true`) or off (`false`).
    pub fn all(on: bool) -> Augment {
        Augment {
            hflip: on,
            vflip: on,
            rot90: on,
        }
    }
}

impl Serialize for Augment {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut s = ser.serialize_struct("Augment", 3)?;
        s.serialize_field("HFLIP", &self.hflip)?;
        s.serialize_field("VFLIP", &self.vflip)?;
        s.serialize_field("ROT90", &self.rot90)?;
        s.end()
    }
}

impl<'de> Deserialize<'de> for Augment {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Parts {
            #[serde(rename = "HFLIP", default)]
            hflip: bool,
            #[serde(rename = "VFLIP", default)]
            vflip: bool,
            #[serde(rename = "ROT90", default)]
            rot90: bool,
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            All(bool),
            Parts(Parts),
        }
        match Raw::deserialize(de) {
            Ok(Raw::All(on)) => Ok(Augment::all(on)),
            Ok(Raw::Parts(p)) => Ok(Augment {
                hflip: p.hflip,
                vflip: p.vflip,
                rot90: p.rot90,
            }),
            Err(_) => Err(serde::de::Error::custom(
                "expected true, false, or a mapping of HFLIP, VFLIP, ROT90 to booleans",
            )),
        }
    }
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            root: None,
            crop_size: 256,
            val_crop_size: Some(256),
            val_tile: None,
            val_tile_overlap: 32,
            cache_size_gb: 20.0,
            use_ram_cache: true,
            cache_policy: CachePolicy::Planned,
            cache_prefetch: true,
            cache_sharing: CacheSharing::default(),
            cache_connections: CacheConnections::Auto,
            clip_len: 6,
            spike_bins: 32,
            blur_dir: BlurDir::Blur,
            skip_bad_frames: false,
            augment: Augment::default(),
            chunk_cache_mb: 64,
            use_precomputed_voxels: None,
        }
    }
}

impl DataConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        let d = Checks("DATA");
        let size = self.cache_size_gb;
        let size_ok = positive(size);
        d.check(
            size_ok,
            "CACHE_SIZE_GB",
            format!("expected a positive size in GiB, got {size}"),
        )?;
        if let CacheConnections::Count(n) = self.cache_connections {
            let range = format!("1 to {MAX_CACHE_CONNECTIONS} or \"auto\"");
            d.expect(
                (1..=MAX_CACHE_CONNECTIONS).contains(&n),
                "CACHE_CONNECTIONS",
                range,
                n,
            )?;
        }
        d.check(
            self.crop_size > 0,
            "CROP_SIZE",
            "expected a positive crop size",
        )?;
        let full_frame = "expected a positive crop size, or null for the full frame";
        d.check(self.val_crop_size != Some(0), "VAL_CROP_SIZE", full_frame)?;
        if let Some(tile) = self.val_tile {
            let larger = format!(
                "a tile larger than VAL_TILE_OVERLAP ({})",
                self.val_tile_overlap
            );
            d.expect(tile > self.val_tile_overlap, "VAL_TILE", larger, tile)?;
        }
        d.check(self.clip_len > 0, "CLIP_LEN", "expected at least 1 frame")?;
        d.check(self.spike_bins > 0, "SPIKE_BINS", "expected at least 1 bin")
    }

    /// The cache cap in bytes.
    pub fn cache_bytes(&self) -> u64 {
        (self.cache_size_gb * (1u64 << 30) as f64) as u64
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use std::path::Path;

    /// The error `result` carries, as printed.
    fn error_of<T: std::fmt::Debug>(result: Result<T, crate::config::ConfigError>) -> String {
        result.unwrap_err().to_string()
    }

    fn parse(text: &str) -> Result<Config, crate::config::ConfigError> {
        Config::parse(text, Path::new("t.yaml"))
    }

    #[test]
    fn data_keys_parse() {
        let c = parse(
            "DATA:\n  CLIP_LEN: 4\n  SPIKE_BINS: 16\n  BLUR_DIR: blur_gamma\n  SKIP_BAD_FRAMES: true\n  AUGMENT: {HFLIP: true}\n  CHUNK_CACHE_MB: 8\n",
        )
        .unwrap();
        assert_eq!(c.data.clip_len, 4);
        assert_eq!(c.data.spike_bins, 16);
        assert_eq!(c.data.blur_dir.folder(), "blur_gamma");
        assert!(c.data.skip_bad_frames);
        assert!(c.data.augment.hflip && !c.data.augment.vflip && !c.data.augment.rot90);
        assert_eq!(c.data.chunk_cache_mb, 8);
        assert_eq!(
            c.data.cache_policy,
            super::CachePolicy::Planned,
            "the default"
        );
        assert!(c.data.cache_prefetch);
        let c = parse("DATA:\n  CACHE_POLICY: lru\n  CACHE_PREFETCH: false\n").unwrap();
        assert_eq!(c.data.cache_policy, super::CachePolicy::Lru);
        assert!(!c.data.cache_prefetch);
        assert_eq!(
            c.data.cache_sharing,
            super::CacheSharing::Node,
            "the default"
        );
        let c = parse("DATA:\n  CACHE_SHARING: job\n").unwrap();
        assert_eq!(c.data.cache_sharing, super::CacheSharing::Job);
        let c = parse("DATA:\n  AUGMENT: false\n").unwrap();
        assert_eq!(c.data.augment, super::Augment::all(false));
    }

    #[test]
    fn bad_data_values_name_the_key() {
        let err = error_of(parse("DATA:\n  BLUR_DIR: blurry\n"));
        assert!(err.contains("DATA.BLUR_DIR"), "{err}");
        let err = error_of(parse("DATA:\n  AUGMENT: {SPIN: true}\n"));
        assert!(err.contains("DATA.AUGMENT"), "{err}");
        let err = error_of(parse("DATA:\n  CLIP_LEN: 0\n"));
        assert!(err.contains("DATA.CLIP_LEN"), "{err}");
        let err = error_of(parse("DATA:\n  CACHE_POLICY: belady\n"));
        assert!(
            err.contains("DATA.CACHE_POLICY") && err.contains("planned") && err.contains("lru"),
            "{err}"
        );
        let err = error_of(parse("DATA:\n  CACHE_SHARING: user\n"));
        assert!(
            err.contains("DATA.CACHE_SHARING") && err.contains("node") && err.contains("job"),
            "{err}"
        );
    }
}
