//! How a config is put together, in one place: a [`Stack`] of YAML layers, a file and
//! the `BASE` files it starts from (paths relative to the including file, chains
//! allowed, cycles refused), or a resolved config's keys as defaults, then `--set`
//! overrides. Older key spellings are renamed per layer, layers are deep-merged in
//! order, and the origin of every resolved key is recorded. What the merged keys
//! mean (types, rules) is `Config`'s.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_yaml_ng::{Mapping, Value};

use super::ConfigError;

/// Where a key's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Not set anywhere: the built-in default.
    Default,
    /// A file named by `BASE` (directly or through a chain).
    Base(PathBuf),
    /// The config file itself.
    File(PathBuf),
    /// A `--set KEY.PATH=VALUE` override (the text as given).
    Override(String),
}

impl Source {
    /// `default`, `base`, `file` or `override`.
    pub fn kind(&self) -> &'static str {
        match self {
            Source::Default => "default",
            Source::Base(_) => "base",
            Source::File(_) => "file",
            Source::Override(_) => "override",
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Default => write!(f, "default"),
            Source::Base(p) => write!(f, "base {}", p.display()),
            Source::File(p) => write!(f, "file {}", p.display()),
            Source::Override(s) => write!(f, "override --set {s}"),
        }
    }
}

/// The origin of one resolved key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// The layer that set it.
    pub source: Source,
    /// The older spelling it was written as (`TRAIN.NUM_WORKERS`), if any.
    pub alias: Option<&'static str>,
}

/// Older or alternative spellings: (written as, read as).
pub const ALIASES: [(&str, &str); 3] = [
    ("TRAIN.NUM_WORKERS", "DATALOADER.TOTAL_WORKERS"),
    ("TRAIN.PREFETCH_FACTOR", "DATALOADER.TRAIN_PREFETCH_FACTOR"),
    ("DATA.TRAIN_CROP_SIZE", "DATA.CROP_SIZE"),
];

/// One source of keys: a YAML mapping and where it came from.
#[derive(Debug, Clone)]
pub struct Layer {
    /// Where the keys came from.
    pub source: Source,
    /// The keys, as a YAML mapping.
    pub value: Value,
    /// Keys renamed from an older spelling: (read as, written as).
    aliases: Vec<(String, &'static str)>,
}

impl Layer {
    /// A layer of `value` from `source`, older spellings renamed.
    pub fn new(source: Source, value: Value) -> Result<Layer, ConfigError> {
        let mut layer = Layer {
            source,
            value,
            aliases: Vec::new(),
        };
        if layer.value.is_null() {
            layer.value = Value::Mapping(Mapping::new());
        }
        if !layer.value.is_mapping() {
            return Err(layer.error(".", "expected a mapping of sections".into()));
        }
        layer.rename_aliases()?;
        Ok(layer)
    }

    /// An error at `key` of this layer, naming its file or override.
    pub fn error(&self, key: &str, message: String) -> ConfigError {
        match &self.source {
            Source::Override(spec) => ConfigError::Override {
                spec: spec.clone(),
                key: key.to_string(),
                message,
            },
            Source::Base(path) | Source::File(path) => ConfigError::Parse {
                path: path.clone(),
                key: key.to_string(),
                message,
            },
            Source::Default => ConfigError::Parse {
                path: PathBuf::from("<defaults>"),
                key: key.to_string(),
                message,
            },
        }
    }

    fn rename_aliases(&mut self) -> Result<(), ConfigError> {
        for (old, new) in ALIASES {
            let Some(value) = take(&mut self.value, old) else {
                continue;
            };
            if let Some(existing) = get(&self.value, new) {
                if existing != &value {
                    return Err(self.error(
                        old,
                        format!(
                            "{old} ({}) and {new} ({}) are the same setting with different \
                             values; keep one",
                            show(&value),
                            show(existing)
                        ),
                    ));
                }
            }
            set(&mut self.value, new, value).map_err(|(key, msg)| self.error(&key, msg))?;
            self.aliases.push((new.to_string(), old));
        }
        Ok(())
    }
}

/// A value as one line of YAML flow text.
fn show(value: &Value) -> String {
    serde_json::to_string(value).unwrap_or_else(|_| format!("{value:?}"))
}

/// The value at a dotted key path, if every step is a mapping that has it.
pub fn get<'a>(value: &'a Value, key: &str) -> Option<&'a Value> {
    key.split('.')
        .try_fold(value, |v, part| v.as_mapping()?.get(part))
}

/// Removes and returns the value at a dotted key path.
fn take(value: &mut Value, key: &str) -> Option<Value> {
    let (parent, last) = match key.rsplit_once('.') {
        Some((parent, last)) => (parent, last),
        None => ("", key),
    };
    let mut node = value;
    if !parent.is_empty() {
        for part in parent.split('.') {
            node = node.as_mapping_mut()?.get_mut(part)?;
        }
    }
    node.as_mapping_mut()?.remove(last)
}

/// Sets the value at a dotted key path, creating mappings on the way; a step that holds
/// something else than a mapping is an error naming that key path.
pub fn set(root: &mut Value, key: &str, value: Value) -> Result<(), (String, String)> {
    let parts: Vec<&str> = key.split('.').collect();
    let mut node = root;
    for (i, part) in parts.iter().enumerate() {
        let here = parts[..=i].join(".");
        if part.is_empty() {
            return Err((key.to_string(), "empty key in the path".into()));
        }
        let map = node
            .as_mapping_mut()
            .ok_or_else(|| (parts[..i].join("."), "is not a section of keys".to_string()))?;
        if i + 1 == parts.len() {
            map.insert(Value::String(part.to_string()), value);
            return Ok(());
        }
        let next = map
            .entry(Value::String(part.to_string()))
            .or_insert_with(|| Value::Mapping(Mapping::new()));
        if next.is_null() {
            *next = Value::Mapping(Mapping::new());
        }
        if !next.is_mapping() {
            return Err((here, "is a value, not a section of keys".into()));
        }
        node = next;
    }
    Ok(())
}

/// Every layer of one resolution in order, and the file it was asked for (what
/// errors about the merged keys name).
#[derive(Debug, Clone)]
pub struct Stack {
    top: PathBuf,
    layers: Vec<Layer>,
}

impl Stack {
    /// The file `path` after its `BASE` chain; `text` is the file's content when
    /// already read.
    pub fn file(path: &Path, text: Option<&str>) -> Result<Stack, ConfigError> {
        Ok(Stack {
            top: path.to_path_buf(),
            layers: file_layers(path, text)?,
        })
    }

    /// The keys of `value` (a resolved config) as defaults; `name` stands for them in
    /// errors.
    pub fn defaults(name: &Path, value: Value) -> Result<Stack, ConfigError> {
        Ok(Stack {
            top: name.to_path_buf(),
            layers: vec![Layer::new(Source::Default, value)?],
        })
    }

    /// `overrides` (`KEY.PATH=VALUE`) on top, in order.
    pub fn with_overrides(mut self, overrides: &[String]) -> Result<Stack, ConfigError> {
        for spec in overrides {
            self.layers.push(override_layer(spec)?);
        }
        Ok(self)
    }

    /// The file asked for.
    pub fn top(&self) -> &Path {
        &self.top
    }

    /// The layers, lowest first.
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// The layers deep-merged, with every key's origin.
    pub fn merged(&self) -> (Value, BTreeMap<String, Origin>) {
        merge(&self.layers)
    }

    /// The file an error at a key from `origin` names: its own file, else the file
    /// asked for.
    pub fn path_of(&self, origin: &Origin) -> PathBuf {
        match &origin.source {
            Source::File(p) | Source::Base(p) => p.clone(),
            Source::Override(_) | Source::Default => self.top.clone(),
        }
    }

    /// The `KEY.PATH=VALUE` overrides, in order.
    pub fn override_specs(&self) -> Vec<String> {
        self.layers
            .iter()
            .filter_map(|layer| match &layer.source {
                Source::Override(spec) => Some(spec.clone()),
                _ => None,
            })
            .collect()
    }
}

/// The layers of a config file: its `BASE` chain (deepest first), then the file.
/// `text` is the file's content when already read.
fn file_layers(path: &Path, text: Option<&str>) -> Result<Vec<Layer>, ConfigError> {
    let mut layers = Vec::new();
    let mut chain = Vec::new();
    collect(path, text, &mut chain, &mut layers)?;
    Ok(layers)
}

fn collect(
    path: &Path,
    text: Option<&str>,
    chain: &mut Vec<PathBuf>,
    out: &mut Vec<Layer>,
) -> Result<(), ConfigError> {
    let read_error = |source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    };
    let text = match text {
        Some(t) => t.to_string(),
        None => std::fs::read_to_string(path).map_err(read_error)?,
    };
    // A config given as text may name a file that does not exist (tests, stdin).
    let canonical = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    if let Some(pos) = chain.iter().position(|p| *p == canonical) {
        let cycle: Vec<String> = chain[pos..]
            .iter()
            .chain(std::iter::once(&canonical))
            .map(|p| p.display().to_string())
            .collect();
        return Err(ConfigError::BaseCycle {
            path: path.to_path_buf(),
            chain: cycle.join(" -> "),
        });
    }
    let mut value: Value = serde_yaml_ng::from_str(&text).map_err(|err| ConfigError::Parse {
        path: path.to_path_buf(),
        key: ".".into(),
        message: err.to_string(),
    })?;
    let base = match value.as_mapping_mut().and_then(|m| m.remove("BASE")) {
        None => None,
        Some(Value::String(name)) => Some(name),
        Some(other) => {
            return Err(ConfigError::Parse {
                path: path.to_path_buf(),
                key: "BASE".into(),
                message: format!("expected a file name, got {}", show(&other)),
            })
        }
    };
    chain.push(canonical);
    if let Some(name) = base {
        let dir = path.parent().unwrap_or(Path::new("."));
        collect(&dir.join(name), None, chain, out)?;
    }
    chain.pop();
    let source = if chain.is_empty() {
        Source::File(path.to_path_buf())
    } else {
        Source::Base(path.to_path_buf())
    };
    out.push(Layer::new(source, value)?);
    Ok(())
}

/// The most parts a `--set` key path may have: every config key is at most three
/// deep, and a deeper path would only build nesting that later passes recurse over.
const MAX_KEY_PARTS: usize = 8;

/// The layer of one `KEY.PATH=VALUE` override; VALUE is YAML (`7`, `[6, 8, 8]`,
/// `auto`, `null`).
fn override_layer(spec: &str) -> Result<Layer, ConfigError> {
    let error = |key: &str, message: String| ConfigError::Override {
        spec: spec.to_string(),
        key: key.to_string(),
        message,
    };
    let Some((key, text)) = spec.split_once('=') else {
        return Err(error(spec, "expected KEY.PATH=VALUE".into()));
    };
    let key = key.trim();
    if key.is_empty() || key == "BASE" {
        return Err(error(
            key,
            "expected a key path such as DATA.CROP_SIZE".into(),
        ));
    }
    let parts = key.split('.').count();
    if parts > MAX_KEY_PARTS {
        return Err(error(
            key,
            format!("a key path of {parts} parts; config keys have at most {MAX_KEY_PARTS}"),
        ));
    }
    let value: Value = serde_yaml_ng::from_str(text)
        .map_err(|err| error(key, format!("value {text:?} is not YAML: {err}")))?;
    let mut root = Value::Mapping(Mapping::new());
    set(&mut root, key, value).map_err(|(k, msg)| error(&k, msg))?;
    Layer::new(Source::Override(spec.to_string()), root)
}

/// Deep-merges `layers` in order (mappings merge, anything else replaces) and records
/// the origin of every key set on the way.
fn merge(layers: &[Layer]) -> (Value, BTreeMap<String, Origin>) {
    let mut merged = Value::Mapping(Mapping::new());
    let mut origins: BTreeMap<String, Origin> = BTreeMap::new();
    for layer in layers {
        deep_merge(&mut merged, layer.value.clone());
        let mut leaves = Vec::new();
        leaf_paths(&layer.value, "", &mut leaves);
        for key in leaves {
            // A value replaces whatever was recorded above or below it.
            let below = format!("{key}.");
            origins.retain(|k, _| !k.starts_with(&below) && !key.starts_with(&format!("{k}.")));
            let alias = layer
                .aliases
                .iter()
                .find(|(new, _)| *new == key)
                .map(|(_, old)| *old);
            origins.insert(
                key,
                Origin {
                    source: layer.source.clone(),
                    alias,
                },
            );
        }
    }
    (merged, origins)
}

fn deep_merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Mapping(base), Value::Mapping(over)) => {
            for (k, v) in over {
                match base.get_mut(&k) {
                    Some(slot) => deep_merge(slot, v),
                    None => {
                        base.insert(k, v);
                    }
                }
            }
        }
        (slot, over) => *slot = over,
    }
}

/// Dotted paths of the non-mapping values under `value`.
pub fn leaf_paths(value: &Value, prefix: &str, out: &mut Vec<String>) {
    match value.as_mapping() {
        Some(map) => {
            for (k, v) in map {
                let name = match k {
                    Value::String(s) => s.clone(),
                    other => show(other),
                };
                let path = if prefix.is_empty() {
                    name
                } else {
                    format!("{prefix}.{name}")
                };
                leaf_paths(v, &path, out);
            }
        }
        None => out.push(prefix.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error `result` carries, as printed.
    fn error_of<T: std::fmt::Debug>(result: Result<T, ConfigError>) -> String {
        result.unwrap_err().to_string()
    }

    fn yaml(text: &str) -> Value {
        serde_yaml_ng::from_str(text).unwrap()
    }

    #[test]
    fn merge_overrides_leaves_and_records_origins() {
        let base = Layer::new(
            Source::Base("b.yaml".into()),
            yaml("DATA: {CROP_SIZE: 256, CLIP_LEN: 6}\nTRAIN: {LR: 0.1}"),
        )
        .unwrap();
        let file = Layer::new(
            Source::File("f.yaml".into()),
            yaml("DATA: {TRAIN_CROP_SIZE: 128}"),
        )
        .unwrap();
        let over = override_layer("TRAIN.LR=0.2").unwrap();
        let (merged, origins) = merge(&[base, file, over]);
        assert_eq!(get(&merged, "DATA.CROP_SIZE"), Some(&yaml("128")));
        assert_eq!(get(&merged, "DATA.CLIP_LEN"), Some(&yaml("6")));
        assert_eq!(get(&merged, "TRAIN.LR"), Some(&yaml("0.2")));
        assert_eq!(get(&merged, "DATA.TRAIN_CROP_SIZE"), None);
        let crop = &origins["DATA.CROP_SIZE"];
        assert_eq!(crop.source, Source::File("f.yaml".into()));
        assert_eq!(crop.alias, Some("DATA.TRAIN_CROP_SIZE"));
        assert_eq!(origins["DATA.CLIP_LEN"].source.kind(), "base");
        assert_eq!(origins["TRAIN.LR"].source.kind(), "override");
    }

    #[test]
    fn a_scalar_replacing_a_mapping_drops_the_old_origins() {
        let a = Layer::new(
            Source::Base("a".into()),
            yaml("DATA: {AUGMENT: {HFLIP: true}}"),
        )
        .unwrap();
        let b = Layer::new(Source::File("b".into()), yaml("DATA: {AUGMENT: false}")).unwrap();
        let (merged, origins) = merge(&[a, b]);
        assert_eq!(get(&merged, "DATA.AUGMENT"), Some(&yaml("false")));
        assert!(!origins.contains_key("DATA.AUGMENT.HFLIP"));
        assert_eq!(origins["DATA.AUGMENT"].source.kind(), "file");
    }

    #[test]
    fn both_spellings_with_different_values_name_both_keys() {
        let err = Layer::new(
            Source::File("x.yaml".into()),
            yaml("TRAIN: {NUM_WORKERS: 8}\nDATALOADER: {TOTAL_WORKERS: 16}"),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("x.yaml"), "{err}");
        assert!(err.contains("TRAIN.NUM_WORKERS"), "{err}");
        assert!(err.contains("DATALOADER.TOTAL_WORKERS"), "{err}");
        // The same value twice is fine.
        let layer = Layer::new(
            Source::File("x.yaml".into()),
            yaml("TRAIN: {PREFETCH_FACTOR: 4}\nDATALOADER: {TRAIN_PREFETCH_FACTOR: 4}"),
        )
        .unwrap();
        assert_eq!(
            get(&layer.value, "DATALOADER.TRAIN_PREFETCH_FACTOR"),
            Some(&yaml("4"))
        );
    }

    #[test]
    fn overrides_parse_yaml_values_and_reject_bad_syntax() {
        let layer = override_layer("MODEL.VRT_DEPTHS=[8, 6, 6, 8, 4, 4, 4, 4]").unwrap();
        assert_eq!(
            get(&layer.value, "MODEL.VRT_DEPTHS")
                .and_then(|v| v.as_sequence())
                .map(|s| s.len()),
            Some(8)
        );
        let err = error_of(override_layer("DATA.CROP_SIZE"));
        assert!(err.contains("KEY.PATH=VALUE"), "{err}");
        let err = error_of(override_layer("DATA..CROP=1"));
        assert!(err.contains("empty key"), "{err}");
        let err = error_of(override_layer("DATA.CROP_SIZE=[1, 2"));
        assert!(err.contains("DATA.CROP_SIZE"), "{err}");
    }

    #[test]
    fn a_very_deep_key_path_is_refused_quickly() {
        // Found by tests/parsers_prop: 20k parts nested the layer so deep that
        // merging it overflowed the stack.
        let key = vec!["DATA"; 20_000].join(".");
        let err = error_of(override_layer(&format!("{key}=1")));
        assert!(
            err.contains("20000 parts") && err.contains("--set"),
            "{err}"
        );
        assert!(override_layer("MODEL.SPIKE_TSA.CHUNK_SIZE=80").is_ok());
    }
}
