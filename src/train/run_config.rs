//! The config a run ran with: rank 0 keeps the resolved config (`BASE` chain and
//! `--set` overrides applied) as `config.resolved.yaml` in the run directory, written
//! atomically at start; a resumed run that resolves differently replaces it and says
//! which keys changed. Also logs the config's one-line notices once.

use std::io::Write;
use std::path::Path;

use crate::config::Config;

use super::env::RankEnv;
use super::TrainError;

/// What writing the resolved config found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResolvedWrite {
    /// There was none before.
    Fresh,
    /// The previous one (an earlier attempt's) was the same.
    Unchanged,
    /// The previous one differed on these top-level-qualified lines.
    Changed {
        /// Lines of the previous file not in the new one (`KEY: value`, indented as written).
        removed: Vec<String>,
        /// Lines of the new file not in the previous one.
        added: Vec<String>,
    },
}

/// Writes `text` to `path` through a temporary file in the same directory, so a
/// reader sees the old file or the new one, never half of one.
pub fn write_atomic(path: &Path, text: &str) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, path)
}

/// Writes `config` as YAML to `path`, comparing with what was there.
pub fn write_resolved(path: &Path, config: &Config) -> Result<ResolvedWrite, TrainError> {
    let text = config.to_yaml();
    let previous = std::fs::read_to_string(path).ok();
    write_atomic(path, &text).map_err(|e| TrainError::io(path, e))?;
    Ok(match previous {
        None => ResolvedWrite::Fresh,
        Some(old) if old == text => ResolvedWrite::Unchanged,
        Some(old) => {
            let old_lines: Vec<&str> = old.lines().collect();
            let new_lines: Vec<&str> = text.lines().collect();
            ResolvedWrite::Changed {
                removed: old_lines
                    .iter()
                    .filter(|l| !new_lines.contains(l))
                    .map(|l| l.trim().to_string())
                    .collect(),
                added: new_lines
                    .iter()
                    .filter(|l| !old_lines.contains(l))
                    .map(|l| l.trim().to_string())
                    .collect(),
            }
        }
    })
}

/// On rank 0: writes
/// `<run dir>/config.resolved.yaml`, logging when a resumed run's config differs
/// from the previous attempt's. Other ranks do nothing.
pub fn record_config(config: &Config, env: &RankEnv) -> Result<(), TrainError> {
    if env.rank != 0 {
        return Ok(());
    }
    let path = env.layout().resolved_config();
    match write_resolved(&path, config)? {
        ResolvedWrite::Fresh | ResolvedWrite::Unchanged => {}
        ResolvedWrite::Changed { removed, added } => tracing::warn!(
            file = %path.display(),
            "the resolved config differs from the previous attempt's (replaced): was [{}], now [{}]",
            removed.join("; "),
            added.join("; ")
        ),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_fresh_then_reports_changes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/config.resolved.yaml");
        let config = Config::default();
        assert_eq!(
            write_resolved(&path, &config).unwrap(),
            ResolvedWrite::Fresh
        );
        let back = Config::load(&path).unwrap();
        assert_eq!(back.to_yaml(), config.to_yaml());
        assert_eq!(
            write_resolved(&path, &config).unwrap(),
            ResolvedWrite::Unchanged
        );
        let changed = config
            .with_overrides(&["TRAIN.TOTAL_STEPS=7".to_string()])
            .unwrap();
        match write_resolved(&path, &changed).unwrap() {
            ResolvedWrite::Changed { added, .. } => {
                assert!(added.iter().any(|l| l == "TOTAL_STEPS: 7"), "{added:?}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(Config::load(&path).unwrap().train.total_steps, 7);
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path().join("run"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }
}
