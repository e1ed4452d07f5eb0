//! Run configuration: the YAML files of the original trainer (`DATA`, `DATALOADER`,
//! `TRAIN`, `MODEL`, `LOG`, `DIST` sections), read unchanged, with `BASE: other.yaml`
//! inheritance and `KEY.PATH=VALUE` overrides. Unknown keys and bad values are errors
//! that name the file or override and the key path (`DATA.CACHE_SIZE_GB`); so is a
//! given key that the chosen architecture does not read (`reads.rs`); keys that are
//! accepted without an equivalent here give one-line [`Config::notices`].

mod data;
mod dist;
mod layers;
mod loader;
mod log;
mod model;
mod reads;
mod show;
mod train;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_yaml_ng::Value;

pub use data::{
    Augment, BlurDir, CacheConnections, CachePolicy, CacheSharing, DataConfig,
    MAX_CACHE_CONNECTIONS,
};
pub use dist::{DistBackend, DistConfig, GradCompressionMode, GradSyncMode};
use layers::Stack;
pub use layers::{Origin, Source, ALIASES};
pub use loader::{auto_workers, DataLoaderConfig, Workers};
pub use log::LogConfig;
pub use model::{
    Arch, ChunkShape, Chunking, FuseConfig, ModelConfig, SpikeConfig, SpikeTsaConfig, UnetConfig,
};
pub use show::{Resolved, ResolvedKey};
pub use train::{AmpDtype, AmpOptLevel, TrainConfig};

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
    /// A `--set KEY.PATH=VALUE` override that is malformed, unknown or mistyped.
    #[error("override --set {spec}: {key}: {message}")]
    Override {
        /// The override as given.
        spec: String,
        /// Key path at fault.
        key: String,
        /// What was wrong and what was expected.
        message: String,
    },
    /// `BASE` files include each other.
    #[error("config {path}: BASE: the files include each other: {chain}")]
    BaseCycle {
        /// The file whose `BASE` closes the cycle.
        path: PathBuf,
        /// The files of the cycle, `a -> b -> a`.
        chain: String,
    },
    /// A key given in a file, a `BASE` file or a `--set` that the chosen `MODEL.ARCH`
    /// does not read (`MODEL.VRT_DEPTHS is not used by MODEL.ARCH unet_spike`).
    #[error("{}", reads::describe_not_read(.given, .key, *.arch, .arch_from, .also))]
    NotRead {
        /// Where the key was given.
        given: Source,
        /// The key path, as written.
        key: String,
        /// The architecture that runs.
        arch: Arch,
        /// Where `MODEL.ARCH` came from.
        arch_from: Source,
        /// The other given keys it does not read.
        also: Vec<String>,
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
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE", deny_unknown_fields, default)]
pub struct Config {
    /// Dataset, crops, cache.
    pub data: DataConfig,
    /// Loader threads and prefetch.
    pub dataloader: DataLoaderConfig,
    /// Optimisation.
    pub train: TrainConfig,
    /// Architecture.
    pub model: ModelConfig,
    /// Logging, checkpoints, validation cadence.
    pub log: LogConfig,
    /// Process group settings.
    pub dist: DistConfig,
}

impl Config {
    /// Reads and validates a YAML config file (and the `BASE` files it names).
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Ok(Config::resolve(path, &[])?.config)
    }

    /// Parses and validates YAML text; `path` names the source in errors and is the
    /// directory `BASE` is relative to.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        Ok(Config::from_stack(&Stack::file(path, Some(text))?)?.config)
    }

    /// Reads `path` (with its `BASE` chain), applies `overrides` (`KEY.PATH=VALUE`, in
    /// order) and validates the result, keeping where every key came from.
    pub fn resolve(path: &Path, overrides: &[String]) -> Result<Resolved, ConfigError> {
        Config::from_stack(&Stack::file(path, None)?.with_overrides(overrides)?)
    }

    /// This config with `overrides` (`KEY.PATH=VALUE`) applied, typed and validated
    /// like a file; errors name the override and the key path. This config's own
    /// values count as defaults: only an override can give a key its architecture
    /// does not read.
    pub fn with_overrides(&self, overrides: &[String]) -> Result<Config, ConfigError> {
        let name = Path::new("<resolved config>");
        let value = serde_yaml_ng::to_value(self).map_err(|err| ConfigError::Parse {
            path: name.to_path_buf(),
            key: ".".into(),
            message: err.to_string(),
        })?;
        let stack = Stack::defaults(name, value)?.with_overrides(overrides)?;
        Ok(Config::from_stack(&stack)?.config)
    }

    /// The resolved config as YAML (what a run directory keeps), with only the `MODEL`
    /// keys its architecture reads, so that it loads back.
    pub fn to_yaml(&self) -> String {
        self.to_value()
            .and_then(|value| serde_yaml_ng::to_string(&value))
            .unwrap_or_else(|err| format!("# unserializable: {err}\n"))
    }

    /// The config as a YAML mapping of the keys that run: every section, and the
    /// `MODEL` keys its architecture reads.
    fn to_value(&self) -> Result<Value, serde_yaml_ng::Error> {
        let mut value = serde_yaml_ng::to_value(self)?;
        reads::keep_read_keys(&mut value, self.model.arch);
        Ok(value)
    }

    /// One line per key that is accepted but has no equivalent here, saying what
    /// happens instead; binaries print these at start.
    pub fn notices(&self) -> Vec<String> {
        // `MODEL` gives none: every key, the activation-checkpointing flags
        // included, is implemented.
        let mut out = self.dataloader.notices();
        out.extend(self.train.notices());
        out
    }

    /// Checks each layer's keys and types, merges them, and validates the result.
    fn from_stack(stack: &Stack) -> Result<Resolved, ConfigError> {
        for layer in stack.layers() {
            typed(layer.value.clone()).map_err(|(key, message)| layer.error(&key, message))?;
        }
        let (merged, origins) = stack.merged();
        let config = typed(merged).map_err(|(key, message)| ConfigError::Parse {
            path: stack.top().to_path_buf(),
            key,
            message,
        })?;
        reads::check_given_keys_are_read(&config, &origins, stack.layers())?;
        if let Err((key, mut message)) = config.validate() {
            let origin = show::origin_of(&origins, &key);
            let path = stack.path_of(&origin);
            match &origin.source {
                Source::Override(spec) => message.push_str(&format!(" (set by --set {spec})")),
                // A rule across keys: name the overrides that may have broken it.
                _ => {
                    let specs = stack.override_specs();
                    if !specs.is_empty() {
                        message.push_str(&format!(" (with --set {})", specs.join(", --set ")));
                    }
                }
            }
            return Err(ConfigError::Invalid { path, key, message });
        }
        Ok(Resolved::new(config, stack.top().to_path_buf(), origins))
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

/// Deserializes a YAML mapping into a config (types and key names only); errors give
/// the key path, an unknown key's own name included.
fn typed(value: Value) -> Result<Config, (String, String)> {
    serde_path_to_error::deserialize(value).map_err(|err| {
        let mut key = err.path().to_string();
        let message = err.inner().to_string();
        if let Some(name) = message
            .strip_prefix("unknown field `")
            .and_then(|rest| rest.split('`').next())
        {
            // serde_path_to_error's path already ends at the unknown key in a nested
            // section; at the top level it is ".".
            let last = key.rsplit('.').next().unwrap_or_default();
            key = if key == "." {
                name.to_string()
            } else if last == name {
                key
            } else {
                format!("{key}.{name}")
            };
        }
        (key, message)
    })
}

/// A failed check: the key path under `section` and what was expected.
pub(crate) fn invalid(section: &str, key: &str, message: impl Into<String>) -> (String, String) {
    (format!("{section}.{key}"), message.into())
}

/// A section's checks: each fails naming the key path under the section.
pub(crate) struct Checks(pub &'static str);

impl Checks {
    /// Fails `key` with `message` unless `ok`.
    pub fn check(
        &self,
        ok: bool,
        key: &str,
        message: impl Into<String>,
    ) -> Result<(), (String, String)> {
        match ok {
            true => Ok(()),
            false => Err(invalid(self.0, key, message)),
        }
    }

    /// Fails `key` unless `ok`, saying `expected {expected}, got {got}`.
    pub fn expect(
        &self,
        ok: bool,
        key: &str,
        expected: impl std::fmt::Display,
        got: impl std::fmt::Display,
    ) -> Result<(), (String, String)> {
        self.check(ok, key, format!("expected {expected}, got {got}"))
    }
}

/// Whether `x` is a finite number above 0.
pub(crate) fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

/// Whether `x` is a finite number of 0 or more.
pub(crate) fn non_negative(x: f64) -> bool {
    x.is_finite() && x >= 0.0
}

/// The first of the `(key, value)` counts under `section` below `min`, as a failed
/// check (`expected at least 1`, or `expected 0 or more`).
pub(crate) fn at_least<T: PartialOrd + From<u8>>(
    section: &str,
    min: u8,
    counts: impl IntoIterator<Item = (&'static str, T)>,
) -> Result<(), (String, String)> {
    match counts.into_iter().find(|(_, value)| *value < T::from(min)) {
        Some((key, _)) if min == 0 => Err(invalid(section, key, "expected 0 or more")),
        Some((key, _)) => Err(invalid(section, key, format!("expected at least {min}"))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error `result` carries, as printed.
    fn error_of<T: std::fmt::Debug>(result: Result<T, ConfigError>) -> String {
        result.unwrap_err().to_string()
    }

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
        let err = error_of(parse("DATA:\n  CROP_SIZ: 128\n"));
        assert!(err.contains("test.yaml"), "{err}");
        assert!(err.contains("DATA.CROP_SIZ:"), "{err}");
        assert!(
            !err.contains("CROP_SIZ.CROP_SIZ"),
            "the key named once: {err}"
        );
        let err = error_of(parse("MODEL:\n  SPIKE:\n    BINZ: 4\n"));
        assert!(err.contains("MODEL.SPIKE.BINZ:"), "{err}");
        assert!(!err.contains("BINZ.BINZ"), "{err}");
    }

    #[test]
    fn unknown_section_is_an_error() {
        let err = error_of(parse("DATAA: {}\n"));
        assert!(err.contains("DATAA"), "{err}");
    }

    #[test]
    fn wrong_type_names_key_path() {
        let err = error_of(parse("DATA:\n  CACHE_SIZE_GB: lots\n"));
        assert!(err.contains("DATA.CACHE_SIZE_GB"), "{err}");
    }

    #[test]
    fn bad_value_names_key_path() {
        let err = error_of(parse("DATA:\n  CACHE_SIZE_GB: -1\n"));
        assert!(err.contains("DATA.CACHE_SIZE_GB"), "{err}");
        let err = error_of(parse("DATALOADER:\n  TOTAL_WORKERS: some\n"));
        assert!(err.contains("DATALOADER.TOTAL_WORKERS"), "{err}");
    }

    #[test]
    fn gradient_sync_and_compression_parse_and_conflicts_are_named() {
        let c = parse("DIST:\n  GRAD_COMPRESSION: bf16\n").unwrap();
        assert_eq!(
            c.dist.grad_sync,
            GradSyncMode::Reducer,
            "the Reducer by default"
        );
        assert_eq!(c.dist.grad_compression, GradCompressionMode::Bf16);
        let c = parse("DIST:\n  GRAD_SYNC: after_backward\n").unwrap();
        assert_eq!(c.dist.grad_sync, GradSyncMode::AfterBackward);
        let err = error_of(parse(
            "DIST:\n  GRAD_SYNC: after_backward\n  GRAD_COMPRESSION: fp16\n",
        ));
        assert!(
            err.contains("DIST.GRAD_COMPRESSION") && err.contains("reducer"),
            "{err}"
        );
        let err = error_of(parse("DIST:\n  GRAD_COMPRESSION: int8\n"));
        assert!(err.contains("DIST.GRAD_COMPRESSION"), "{err}");
    }

    #[test]
    fn workers_auto_or_count() {
        let config = parse("DATALOADER:\n  TOTAL_WORKERS: auto\n").unwrap();
        assert_eq!(config.dataloader.total_workers, Workers::Auto);
        let config = parse("DATALOADER:\n  TOTAL_WORKERS: 12\n").unwrap();
        assert_eq!(config.dataloader.total_workers, Workers::Count(12));
    }

    #[test]
    fn cache_connections_are_auto_or_a_count_in_range() {
        let config = parse("{}").unwrap();
        assert_eq!(config.data.cache_connections, CacheConnections::Auto);
        let config = parse("DATA:\n  CACHE_CONNECTIONS: 2048\n").unwrap();
        assert_eq!(config.data.cache_connections, CacheConnections::Count(2048));
        assert_eq!(config.data.cache_connections.count(), Some(2048));
        let config = parse("DATA:\n  CACHE_CONNECTIONS: auto\n").unwrap();
        assert_eq!(config.data.cache_connections.count(), None);
        for bad in ["0", "65537", "many", "-3"] {
            let err = error_of(parse(&format!("DATA:\n  CACHE_CONNECTIONS: {bad}\n")));
            assert!(err.contains("DATA.CACHE_CONNECTIONS"), "{bad}: {err}");
        }
        let err = error_of(parse("DATA:\n  CACHE_CONNECTIONS: 0\n"));
        assert!(
            err.contains("expected 1 to 65536 or \"auto\", got 0"),
            "{err}"
        );
    }

    #[test]
    fn user_keys_parse_with_their_meaning() {
        let c = parse(
            "MODEL:\n  WINDOW_SIZE: 7\n  USE_CHECKPOINT_ATTN: true\n  USE_CHECKPOINT_FFN: false\n  \
             SPIKE_TSA: {HEADS: 2, ADAPTIVE_CHUNK: false, MAX_BATCH_TOKENS: 512, CHUNK_SIZE: 80, CHUNK_SHAPE: row}\n\
             DATA:\n  USE_PRECOMPUTED_VOXELS: true\n  TRAIN_CROP_SIZE: 128\n  USE_RAM_CACHE: false\n\
             DATALOADER:\n  VAL_PREFETCH_FACTOR: 3\n  PIN_MEMORY: false\n  PERSISTENT_WORKERS: true\n  DROP_LAST: false\n\
             TRAIN:\n  NUM_WORKERS: 12\n  PREFETCH_FACTOR: 5\n  AMP_ENABLED: true\n  AMP_OPT_LEVEL: O2\n  \
             BATCH_SIZE: 2\n  GRADIENT_ACCUMULATION_STEPS: 4\n  COMPILE_MODEL: true\n  \
             FIX_ITER: 20000\n  FIX_LR_MUL: 0.125\n  FIX_KEYS: [spynet, deform]\n",
        )
        .unwrap();
        assert_eq!(c.model.window_size, [6, 7, 7]);
        assert!(c.model.use_checkpoint_attn && !c.model.use_checkpoint_ffn);
        let tsa = c.model.tsa_chunking();
        assert!(!tsa.adaptive_chunk);
        assert_eq!(
            (tsa.max_batch_tokens, tsa.chunk_size, tsa.chunk_shape),
            (512, 80, ChunkShape::Row)
        );
        assert_eq!(c.model.spike_tsa.heads, 2);
        assert_eq!(c.data.use_precomputed_voxels, Some(true));
        assert_eq!(c.data.crop_size, 128);
        assert!(!c.data.use_ram_cache);
        let dl = &c.dataloader;
        assert_eq!(dl.total_workers, Workers::Count(12));
        assert_eq!(dl.train_prefetch_factor, 5);
        assert_eq!(dl.val_prefetch_factor, 3);
        assert!(!dl.pin_memory && dl.persistent_workers && !dl.drop_last);
        let t = &c.train;
        assert!(t.amp_enabled && t.compile_model);
        assert_eq!(t.amp_opt_level, AmpOptLevel::O2);
        assert_eq!((t.batch_size, t.gradient_accumulation_steps), (2, 4));
        assert_eq!((t.fix_iter, t.fix_lr_mul), (20000, 0.125));
        assert_eq!(t.fix_keys, vec!["spynet".to_string(), "deform".to_string()]);
        let notices = c.notices();
        for key in [
            "DATALOADER.PIN_MEMORY",
            "TRAIN.AMP_OPT_LEVEL",
            "TRAIN.COMPILE_MODEL",
        ] {
            assert!(
                notices.iter().any(|n| n.starts_with(key)),
                "{key}: {notices:?}"
            );
        }
        assert_eq!(notices.len(), 3, "{notices:?}");
        assert!(parse("{}").unwrap().notices().is_empty());
    }

    #[test]
    fn window_size_forms_and_errors() {
        let c = parse("MODEL:\n  WINDOW_SIZE: [2, 4, 4]\n").unwrap();
        assert_eq!(c.model.window_size, [2, 4, 4]);
        let err = error_of(parse("MODEL:\n  WINDOW_SIZE: [4, 4]\n"));
        assert!(err.contains("MODEL.WINDOW_SIZE"), "{err}");
        let err = error_of(parse("MODEL:\n  ARCH: vrt_spike\n  WINDOW_SIZE: 0\n"));
        assert!(err.contains("MODEL.WINDOW_SIZE"), "{err}");
    }

    #[test]
    fn both_spellings_differing_is_an_error_naming_both() {
        let err = error_of(parse("DATA:\n  CROP_SIZE: 256\n  TRAIN_CROP_SIZE: 128\n"));
        assert!(
            err.contains("DATA.CROP_SIZE") && err.contains("DATA.TRAIN_CROP_SIZE"),
            "{err}"
        );
        let err = error_of(parse(
            "TRAIN:\n  PREFETCH_FACTOR: 2\nDATALOADER:\n  TRAIN_PREFETCH_FACTOR: 4\n",
        ));
        assert!(
            err.contains("TRAIN.PREFETCH_FACTOR")
                && err.contains("DATALOADER.TRAIN_PREFETCH_FACTOR"),
            "{err}"
        );
        let c = parse("DATA:\n  CROP_SIZE: 128\n  TRAIN_CROP_SIZE: 128\n").unwrap();
        assert_eq!(c.data.crop_size, 128);
    }

    /// A head count of 0 was a division by zero in the check that heads divide the
    /// widths.
    #[test]
    fn zero_heads_are_refused_naming_the_key() {
        for key in ["FUSE", "SPIKE_TSA"] {
            let text = format!("MODEL:\n  ARCH: vrt_spike\n  {key}:\n    HEADS: 0\n");
            let err = error_of(parse(&text));
            assert!(err.contains(&format!("MODEL.{key}.HEADS")), "{err}");
        }
    }

    #[test]
    fn bad_new_values_name_the_key() {
        for (text, key) in [
            ("TRAIN:\n  AMP_OPT_LEVEL: O3\n", "TRAIN.AMP_OPT_LEVEL"),
            ("TRAIN:\n  FIX_ITER: 10\n", "TRAIN.FIX_KEYS"),
            (
                "TRAIN:\n  FIX_LR_MUL: 0\n  FIX_KEYS: [spynet]\n",
                "TRAIN.FIX_LR_MUL",
            ),
            (
                "DATALOADER:\n  VAL_PREFETCH_FACTOR: 0\n",
                "DATALOADER.VAL_PREFETCH_FACTOR",
            ),
            (
                "MODEL:\n  SPIKE_TSA:\n    CHUNK_SIZE: 0\n",
                "MODEL.SPIKE_TSA.CHUNK_SIZE",
            ),
            (
                "MODEL:\n  SPIKE_TSA:\n    CHUNK_SHAPE: hex\n",
                "MODEL.SPIKE_TSA.CHUNK_SHAPE",
            ),
            (
                "DATA:\n  USE_PRECOMPUTED_VOXELS: maybe\n",
                "DATA.USE_PRECOMPUTED_VOXELS",
            ),
        ] {
            let err = error_of(parse(text));
            assert!(err.contains(key), "{text}: {err}");
        }
    }

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn base_chains_merge_and_record_origins() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        write(
            dir.path(),
            "root.yaml",
            "DATA:\n  CLIP_LEN: 4\n  CROP_SIZE: 64\nTRAIN:\n  LR: 0.001\n",
        );
        write(
            &dir.path().join("sub"),
            "mid.yaml",
            "BASE: ../root.yaml\nDATA:\n  CROP_SIZE: 96\n",
        );
        let top = write(
            dir.path(),
            "top.yaml",
            "BASE: sub/mid.yaml\nTRAIN:\n  NUM_WORKERS: 3\n",
        );
        let overrides = vec!["DATA.CLIP_LEN=5".to_string()];
        let r = Config::resolve(&top, &overrides).unwrap();
        assert_eq!(r.config.data.clip_len, 5);
        assert_eq!(r.config.data.crop_size, 96);
        assert_eq!(r.config.train.lr, 0.001);
        assert_eq!(r.config.dataloader.total_workers, Workers::Count(3));
        assert_eq!(r.origin("DATA.CLIP_LEN").source.kind(), "override");
        assert_eq!(
            r.origin("DATA.CROP_SIZE").source,
            Source::Base(dir.path().join("sub/mid.yaml"))
        );
        assert_eq!(
            r.origin("TRAIN.LR").source,
            Source::Base(dir.path().join("sub").join("../root.yaml"))
        );
        let workers = r.origin("DATALOADER.TOTAL_WORKERS");
        assert_eq!(workers.source, Source::File(top.clone()));
        assert_eq!(workers.alias, Some("TRAIN.NUM_WORKERS"));
        assert_eq!(r.origin("LOG.VAL_EVERY_STEPS").source, Source::Default);
        let text = r.render_text();
        assert!(text.contains("DATA.CLIP_LEN: 5"), "{text}");
        assert!(text.contains("override --set DATA.CLIP_LEN=5"), "{text}");
        assert!(text.contains("(as TRAIN.NUM_WORKERS)"), "{text}");
        let json = r.render_json();
        assert_eq!(json["keys"]["DATA.CROP_SIZE"]["value"], 96);
        assert_eq!(json["keys"]["DATA.CROP_SIZE"]["source"], "base");
        assert_eq!(json["keys"]["LOG.VAL_EVERY_STEPS"]["source"], "default");
        assert_eq!(json["keys"]["DATALOADER.TOTAL_WORKERS"]["source"], "file");
    }

    #[test]
    fn base_cycles_and_missing_bases_name_the_files() {
        let dir = tempfile::tempdir().unwrap();
        let a = write(dir.path(), "a.yaml", "BASE: b.yaml\n");
        write(dir.path(), "b.yaml", "BASE: a.yaml\n");
        let err = Config::load(&a).unwrap_err().to_string();
        assert!(err.contains("a.yaml") && err.contains("b.yaml"), "{err}");
        assert!(err.contains("include each other"), "{err}");
        let own = write(dir.path(), "self.yaml", "BASE: self.yaml\n");
        assert!(Config::load(&own).is_err());
        let c = write(dir.path(), "c.yaml", "BASE: nowhere.yaml\n");
        let err = Config::load(&c).unwrap_err().to_string();
        assert!(err.contains("nowhere.yaml"), "{err}");
        // An error inside a base file names that file and the key.
        write(dir.path(), "bad.yaml", "DATA:\n  CROP_SIZ: 1\n");
        let d = write(dir.path(), "d.yaml", "BASE: bad.yaml\n");
        let err = Config::load(&d).unwrap_err().to_string();
        assert!(
            err.contains("bad.yaml") && err.contains("DATA.CROP_SIZ"),
            "{err}"
        );
    }

    #[test]
    fn overrides_are_typed_and_name_the_key_path() {
        let base = parse("{}").unwrap();
        let set = |specs: &[&str]| {
            let specs: Vec<String> = specs.iter().map(|s| s.to_string()).collect();
            base.with_overrides(&specs).map_err(|e| e.to_string())
        };
        let c = set(&[
            "MODEL.WINDOW_SIZE=5",
            "DATALOADER.TOTAL_WORKERS=auto",
            "TRAIN.LR=2.0e-4",
        ])
        .unwrap();
        assert_eq!(c.model.window_size, [6, 5, 5]);
        assert_eq!(c.dataloader.total_workers, Workers::Auto);
        assert_eq!(c.train.lr, 2.0e-4);
        let c = set(&["DATA.VAL_CROP_SIZE=null", "TRAIN.NUM_WORKERS=7"]).unwrap();
        assert_eq!(c.data.val_crop_size, None);
        assert_eq!(c.dataloader.total_workers, Workers::Count(7));
        for (spec, key) in [
            ("DATA.CROP_SIZE=big", "DATA.CROP_SIZE"),
            ("DATA.CROP_SIZ=3", "DATA.CROP_SIZ"),
            ("DATA.CROP_SIZE.X=3", "DATA.CROP_SIZE"),
            ("NOPE.X=1", "NOPE"),
            ("TRAIN.BATCH_SIZE=0", "TRAIN.BATCH_SIZE"),
            // A rule across keys names the override that broke it (found by proptest).
            ("TRAIN.FIX_ITER=1", "--set TRAIN.FIX_ITER=1"),
        ] {
            let err = set(&[spec]).unwrap_err();
            assert!(err.contains(key), "{spec}: {err}");
            assert!(err.contains(spec) || err.contains("--set"), "{spec}: {err}");
        }
    }

    #[test]
    fn the_resolved_yaml_reads_back_the_same() {
        let c = parse("MODEL:\n  WINDOW_SIZE: 7\nDATA:\n  AUGMENT: {HFLIP: true}\n").unwrap();
        let again = parse(&c.to_yaml()).unwrap();
        assert_eq!(again.to_yaml(), c.to_yaml());
        assert_eq!(again.model.window_size, [6, 7, 7]);
        assert!(again.data.augment.hflip && !again.data.augment.vflip);
    }
}
