//! Keys that are given but not read. A `MODEL` key set in a file, a `BASE` file or a
//! `--set` that the chosen `MODEL.ARCH` does not read (`MODEL.VRT_DEPTHS` with
//! `unet_spike`, `MODEL.UNET.*` with `vrt_spike`) is an error naming the key, the
//! architecture and where each was set, never ignored. Keys of a feature the config
//! turns off (`MODEL.FUSE.*` with `SPIKE.ENABLED: false`, `DATA.VAL_TILE` with a
//! validation crop, `TRAIN.AMP_DTYPE` without AMP) are fine: the same model reads them
//! once the feature is on. The other sections hold no key that depends on the
//! architecture. A resolved config is written and shown with only the `MODEL` keys its
//! architecture reads, so a `config.resolved.yaml` loads back.

use std::collections::BTreeMap;

use serde_yaml_ng::{Mapping, Value};

use super::layers::{Layer, Origin, Source};
use super::model::Arch;
use super::show::origin_of;
use super::{Config, ConfigError};

/// The section whose keys depend on the architecture.
const MODEL: &str = "MODEL";

/// The other unread keys an error lists by name.
const ALSO_SHOWN: usize = 6;

/// Refuses a `MODEL` key that was given (not defaulted) and that `config`'s
/// architecture does not read. The error names the first such key of the latest layer
/// in `layers` (overrides, then the file, then its `BASE` files) and lists the others.
pub(super) fn check_given_keys_are_read(
    config: &Config,
    origins: &BTreeMap<String, Origin>,
    layers: &[Layer],
) -> Result<(), ConfigError> {
    let arch = config.model.arch;
    let mut unread: Vec<(&String, &Origin)> = origins
        .iter()
        .filter(|(key, origin)| {
            origin.source != Source::Default
                && model_key(key).is_some_and(|under| !arch.reads(under))
        })
        .collect();
    // Latest layer first; keys of one layer stay in name order (the sort is stable).
    let layer_of = |origin: &Origin| layers.iter().rposition(|l| l.source == origin.source);
    unread.sort_by_key(|(_, origin)| std::cmp::Reverse(layer_of(origin)));
    let Some(((key, origin), rest)) = unread.split_first() else {
        return Ok(());
    };
    Err(ConfigError::NotRead {
        given: origin.source.clone(),
        key: written(key, origin),
        arch,
        arch_from: origin_of(origins, "MODEL.ARCH").source,
        also: rest.iter().map(|(k, o)| written(k, o)).collect(),
    })
}

/// The path under `MODEL` of a `MODEL.*` key.
fn model_key(key: &str) -> Option<&str> {
    key.strip_prefix(MODEL)?.strip_prefix('.')
}

/// The key as the user wrote it (its older spelling, if any).
fn written(key: &str, origin: &Origin) -> String {
    origin.alias.map_or_else(|| key.to_string(), str::to_string)
}

/// The message of [`ConfigError::NotRead`].
pub(super) fn describe_not_read(
    given: &Source,
    key: &str,
    arch: Arch,
    arch_from: &Source,
    also: &[String],
) -> String {
    let place = match given {
        Source::File(path) => format!("config {}", path.display()),
        Source::Base(path) => format!("config {} (a BASE file)", path.display()),
        Source::Override(spec) => format!("override --set {spec}"),
        Source::Default => "defaults".to_string(),
    };
    let arch_set = match arch_from {
        Source::Default => "the default".to_string(),
        Source::File(path) | Source::Base(path) => format!("set in {}", path.display()),
        Source::Override(spec) => format!("set by --set {spec}"),
    };
    let readers: Vec<&str> = model_key(key)
        .map(|under| {
            Arch::ALL
                .iter()
                .filter(|a| a.reads(under))
                .map(|a| a.name())
        })
        .into_iter()
        .flatten()
        .collect();
    let mut text = format!(
        "{place}: {key} is not used by MODEL.ARCH {arch} ({arch_set}); remove it{}",
        match readers.as_slice() {
            [] => String::new(),
            names => format!(", or set MODEL.ARCH: {}", names.join(" or ")),
        }
    );
    if !also.is_empty() {
        let shown = also.len().min(ALSO_SHOWN);
        let more = match also.len() - shown {
            0 => String::new(),
            n => format!(" and {n} more"),
        };
        text.push_str(&format!(
            " (also given and not used by {arch}: {}{more})",
            also[..shown].join(", ")
        ));
    }
    text
}

/// Removes from a serialized config the `MODEL` keys its architecture does not read.
pub(super) fn keep_read_keys(value: &mut Value, arch: Arch) {
    if let Some(model) = value.get_mut(MODEL).and_then(Value::as_mapping_mut) {
        retain_read(model, "", arch);
    }
}

fn retain_read(map: &mut Mapping, prefix: &str, arch: Arch) {
    map.retain(|name, value| {
        let Some(name) = name.as_str() else {
            return true;
        };
        let path = if prefix.is_empty() {
            name.to_string()
        } else {
            format!("{prefix}.{name}")
        };
        if !arch.reads(&path) {
            return false;
        }
        if let Some(inner) = value.as_mapping_mut() {
            retain_read(inner, &path, arch);
        }
        true
    });
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::layers::leaf_paths;

    fn parse(text: &str) -> Result<Config, String> {
        Config::parse(text, Path::new("user.yaml")).map_err(|e| e.to_string())
    }

    #[test]
    fn every_model_key_is_read_by_some_architecture() {
        let value = serde_yaml_ng::to_value(Config::default()).unwrap();
        let mut keys = Vec::new();
        leaf_paths(&value, "", &mut keys);
        let model: Vec<&str> = keys.iter().filter_map(|k| model_key(k)).collect();
        assert!(model.len() > 20, "{model:?}");
        for key in model {
            assert!(
                Arch::ALL.iter().any(|a| a.reads(key)),
                "MODEL.{key} is read by no architecture"
            );
        }
        assert!(Arch::UnetSpike.reads("SPIKE.VOXEL_BINS"));
        assert!(!Arch::UnetSpike.reads("SPIKE.BLOCKS_PER_LEVEL"));
        assert!(!Arch::UnetSpike.reads("SPIKE_TSA.HEADS"));
        assert!(!Arch::UnetSpike.reads("USE_CHECKPOINT_ATTN"));
        assert!(!Arch::VrtSpike.reads("UNET.CHANNELS"));
        assert!(Arch::VrtSpike.reads("FUSE.CHUNK_SIZE"));
    }

    #[test]
    fn a_key_of_another_architecture_is_refused_naming_key_and_arch() {
        let err = parse("MODEL:\n  ARCH: unet_spike\n  VRT_DEPTHS: [8, 7, 8, 8, 4, 4, 4, 6]\n")
            .unwrap_err();
        assert!(
            err.contains("config user.yaml: MODEL.VRT_DEPTHS is not used by MODEL.ARCH unet_spike")
                && err.contains("set MODEL.ARCH: vrt_spike"),
            "{err}"
        );
        let err = parse("MODEL:\n  UNET: {CHANNELS: 8}\n").unwrap_err();
        assert!(
            err.contains("MODEL.UNET.CHANNELS is not used by MODEL.ARCH vrt_spike (the default)")
                && err.contains("set MODEL.ARCH: unet_spike"),
            "{err}"
        );
        // Every unread key is named; the spike encoder's depth and the checkpointing
        // flags are VRT's.
        let err = parse(
            "MODEL:\n  ARCH: unet_spike\n  USE_CHECKPOINT_ATTN: true\n  \
             SPIKE: {ENABLED: true, VOXEL_BINS: 8, BLOCKS_PER_LEVEL: 2}\n",
        )
        .unwrap_err();
        assert!(
            err.contains("MODEL.SPIKE.BLOCKS_PER_LEVEL")
                && err.contains("MODEL.USE_CHECKPOINT_ATTN"),
            "{err}"
        );
    }

    #[test]
    fn keys_of_a_disabled_feature_and_of_the_chosen_architecture_are_fine() {
        let c = parse(
            "MODEL:\n  SPIKE: {ENABLED: false}\n  SPIKE_TSA: {HEADS: 2}\n  FUSE: {CHUNK_SIZE: 80}\n",
        )
        .unwrap();
        assert_eq!(c.model.arch, Arch::VrtSpike);
        let c = parse(
            "MODEL:\n  ARCH: unet_spike\n  IN_CHANS: 3\n  UNET: {CHANNELS: 8, LEVELS: 1}\n  \
             SPIKE: {ENABLED: false, VOXEL_BINS: 4}\n",
        )
        .unwrap();
        assert_eq!(c.model.unet.channels, 8);
    }

    #[test]
    fn an_override_is_named_whether_it_sets_the_key_or_the_arch() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("unet.yaml");
        std::fs::write(&path, "MODEL:\n  ARCH: unet_spike\n").unwrap();
        let err = Config::resolve(&path, &["MODEL.WINDOW_SIZE=7".into()])
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("override --set MODEL.WINDOW_SIZE=7: MODEL.WINDOW_SIZE is not used")
                && err.contains(&format!("set in {}", path.display())),
            "{err}"
        );
        std::fs::write(&path, "MODEL:\n  WINDOW_SIZE: 7\n").unwrap();
        let err = Config::resolve(&path, &["MODEL.ARCH=unet_spike".into()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("config {}: MODEL.WINDOW_SIZE", path.display()))
                && err.contains("set by --set MODEL.ARCH=unet_spike"),
            "{err}"
        );
    }

    #[test]
    fn a_base_file_of_another_architecture_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("vrt.yaml");
        std::fs::write(
            &base,
            "MODEL:\n  EMBED_DIMS: [96, 96, 96, 96, 96, 96, 96, 120]\n",
        )
        .unwrap();
        let top = dir.path().join("top.yaml");
        std::fs::write(&top, "BASE: vrt.yaml\nMODEL:\n  ARCH: unet_spike\n").unwrap();
        let err = Config::load(&top).unwrap_err().to_string();
        assert!(
            err.contains(&format!("config {} (a BASE file)", base.display()))
                && err.contains("MODEL.EMBED_DIMS is not used by MODEL.ARCH unet_spike")
                && err.contains(&format!("set in {}", top.display())),
            "{err}"
        );
        // A whole preset of the other architecture (the workspace's `configs/`): the
        // first keys, then a count.
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let preset = workspace.join("configs/deblur/vrt_spike_opt.yaml");
        std::fs::write(
            &top,
            format!("BASE: {}\nMODEL:\n  ARCH: unet_spike\n", preset.display()),
        )
        .unwrap();
        let err = Config::load(&top).unwrap_err().to_string();
        assert!(
            err.contains("vrt_spike_opt.yaml (a BASE file): MODEL.FUSE.ADAPTIVE_CHUNK is not used")
                && err.contains(" and 15 more)"),
            "{err}"
        );
    }

    #[test]
    fn the_resolved_yaml_keeps_only_what_the_architecture_reads() {
        let unet = parse("MODEL:\n  ARCH: unet_spike\n").unwrap();
        let text = unet.to_yaml();
        assert!(
            text.contains("UNET:") && text.contains("VOXEL_BINS"),
            "{text}"
        );
        for gone in [
            "VRT_DEPTHS",
            "FUSE",
            "SPIKE_TSA",
            "BLOCKS_PER_LEVEL",
            "USE_CHECKPOINT",
        ] {
            assert!(!text.contains(gone), "{gone} in\n{text}");
        }
        assert_eq!(parse(&text).unwrap().to_yaml(), text);
        let vrt = parse("{}").unwrap().to_yaml();
        assert!(!vrt.contains("UNET") && vrt.contains("VRT_DEPTHS"), "{vrt}");
    }
}
