//! Node 0's control file (`<run dir>/control.json`, mode 0600): where its
//! launcher listens (the port it bound, port 0 unless `--control-port` fixed one)
//! and the job's secret. The other nodes read it from the shared run directory,
//! so no port is derived from the job id (two jobs cannot meet on one port) and
//! only the job's user can join. A stale file from an earlier launch with the same
//! run directory is harmless: its port refuses, or fails the handshake, and the
//! other nodes read again until node 0 has replaced it.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// What node 0 publishes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Control {
    /// The address node 0 listens on (as it resolved `--master-addr`).
    pub addr: String,
    /// Its port.
    pub port: u16,
    /// The job's secret (hex).
    pub secret: String,
    /// Node 0's launcher.
    pub pid: u32,
}

impl Control {
    /// Writes the file atomically, readable by its owner only.
    pub fn write(&self, path: &Path) -> Result<()> {
        let tmp = path.with_extension(format!("json.tmp-{}", std::process::id()));
        let text = serde_json::to_string_pretty(self).context("encoding the control file")?;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| format!("writing {}", tmp.display()))?;
        file.write_all(text.as_bytes())
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
    }

    /// Reads the file (an error names it and what is wrong).
    pub fn read(path: &Path) -> Result<Control> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_slice(&bytes).with_context(|| format!("reading {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn written_for_the_owner_only_and_read_back() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = tmp.path().join("control.json");
        let control = Control {
            addr: "10.0.0.1".into(),
            port: 41000,
            secret: "ab".repeat(32),
            pid: 7,
        };
        control.write(&path).unwrap_or_else(|e| panic!("{e:#}"));
        let mode = std::fs::metadata(&path)
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or(0);
        assert_eq!(mode, 0o600);
        assert_eq!(Control::read(&path).ok(), Some(control));
        std::fs::write(&path, "{").unwrap_or_else(|e| panic!("{e}"));
        let err = Control::read(&path).map_err(|e| format!("{e:#}"));
        assert!(err.is_err_and(|e| e.contains("control.json")));
    }
}
