//! The resolved view of a config (`vrtspike config show`): every key with its value and
//! where it came from (default, base file, file, override), as text or JSON.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::json;

use super::layers::{leaf_paths, Origin, Source};
use super::Config;

/// A validated config and the origin of each of its keys.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The config that runs.
    pub config: Config,
    /// The config file given.
    pub file: PathBuf,
    origins: BTreeMap<String, Origin>,
}

/// One resolved key of [`Resolved::keys`].
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedKey {
    /// Dotted key path, `DATA.CROP_SIZE`.
    pub key: String,
    /// The value in effect.
    pub value: serde_json::Value,
    /// Where it came from.
    pub origin: Origin,
}

/// The origin of `key`: its own entry, or that of the closest section that was set as
/// a whole (`DATA.AUGMENT: true` for `DATA.AUGMENT.HFLIP`); `default` if none.
pub(super) fn origin_of(origins: &BTreeMap<String, Origin>, key: &str) -> Origin {
    let mut probe = key;
    loop {
        if let Some(origin) = origins.get(probe) {
            return origin.clone();
        }
        match probe.rsplit_once('.') {
            Some((parent, _)) => probe = parent,
            None => {
                return Origin {
                    source: Source::Default,
                    alias: None,
                }
            }
        }
    }
}

impl Resolved {
    pub(super) fn new(config: Config, file: PathBuf, origins: BTreeMap<String, Origin>) -> Self {
        Resolved {
            config,
            file,
            origins,
        }
    }

    /// Where `key` (a dotted path) came from.
    pub fn origin(&self, key: &str) -> Origin {
        origin_of(&self.origins, key)
    }

    /// Every key that runs (the `MODEL` keys of the chosen architecture), in file
    /// order, with its value and origin.
    pub fn keys(&self) -> Vec<ResolvedKey> {
        let Ok(value) = self.config.to_value() else {
            return Vec::new();
        };
        let mut paths = Vec::new();
        leaf_paths(&value, "", &mut paths);
        paths
            .into_iter()
            .map(|key| {
                let leaf = super::layers::get(&value, &key)
                    .and_then(|v| serde_json::to_value(v).ok())
                    .unwrap_or(serde_json::Value::Null);
                let origin = self.origin(&key);
                ResolvedKey {
                    key,
                    value: leaf,
                    origin,
                }
            })
            .collect()
    }

    /// `KEY: value  # origin` lines, then the notices.
    pub fn render_text(&self) -> String {
        let keys = self.keys();
        let rows: Vec<(String, String)> = keys
            .iter()
            .map(|k| {
                let mut origin = describe(&k.origin);
                if k.value.is_null() && k.key.starts_with("MODEL.SPIKE_TSA.") {
                    origin.push_str("; null follows MODEL.FUSE");
                }
                (format!("{}: {}", k.key, k.value), origin)
            })
            .collect();
        let width = rows.iter().map(|(left, _)| left.len()).max().unwrap_or(0);
        let mut out = format!("# resolved config of {}\n", self.file.display());
        for (left, origin) in rows {
            out.push_str(&format!("{left:width$}  # {origin}\n"));
        }
        for notice in self.config.notices() {
            out.push_str(&format!("# notice: {notice}\n"));
        }
        out
    }

    /// `{"file", "keys": {KEY: {"value", "source", "from", "alias"}}, "notices"}`.
    pub fn render_json(&self) -> serde_json::Value {
        let keys: serde_json::Map<String, serde_json::Value> = self
            .keys()
            .into_iter()
            .map(|k| {
                let from = match &k.origin.source {
                    Source::Default => serde_json::Value::Null,
                    Source::Base(p) | Source::File(p) => json!(p.display().to_string()),
                    Source::Override(spec) => json!(spec),
                };
                let entry = json!({
                    "value": k.value,
                    "source": k.origin.source.kind(),
                    "from": from,
                    "alias": k.origin.alias,
                });
                (k.key, entry)
            })
            .collect();
        json!({
            "file": self.file.display().to_string(),
            "keys": keys,
            "notices": self.config.notices(),
        })
    }
}

fn describe(origin: &Origin) -> String {
    match origin.alias {
        Some(alias) => format!("{} (as {alias})", origin.source),
        None => origin.source.to_string(),
    }
}
