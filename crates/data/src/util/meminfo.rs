//! The machine's memory as shared memory sees it: MemAvailable and Shmem from
//! /proc/meminfo, and the cgroup v2 limit when one applies, so the cache can refuse
//! a cap that does not fit before it allocates anything.

use std::path::Path;

/// Memory that a new shared-memory segment may take, and which limit binds.
#[derive(Debug, Clone)]
pub struct Available {
    /// Bytes that may be taken.
    pub bytes: u64,
    /// What limits it (for messages).
    pub limit: String,
}

/// Could not read the memory figures.
#[derive(Debug, thiserror::Error)]
#[error("cannot read memory figures from {path}: {message}")]
pub struct MeminfoError {
    path: String,
    message: String,
}

/// A field of /proc/meminfo in bytes (`MemAvailable`, `Shmem`, ...).
pub fn meminfo_bytes(field: &str) -> Result<u64, MeminfoError> {
    let path = "/proc/meminfo";
    let text = std::fs::read_to_string(path).map_err(|e| MeminfoError {
        path: path.into(),
        message: e.to_string(),
    })?;
    parse_meminfo(&text, field).ok_or_else(|| MeminfoError {
        path: path.into(),
        message: format!("no field {field}"),
    })
}

fn parse_meminfo(text: &str, field: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        let kb: u64 = rest.split_whitespace().next()?.parse().ok()?;
        Some(kb * 1024)
    })
}

/// Room left under this process's cgroup v2 memory limit, if it has one.
fn cgroup_room() -> Option<(u64, String)> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?.trim();
    let dir = Path::new("/sys/fs/cgroup").join(rel.trim_start_matches('/'));
    let max = std::fs::read_to_string(dir.join("memory.max")).ok()?;
    let max: u64 = max.trim().parse().ok()?; // "max" means no limit
    let current: u64 = std::fs::read_to_string(dir.join("memory.current"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some((
        max.saturating_sub(current),
        format!("cgroup memory.max of {}", dir.display()),
    ))
}

/// What a new memfd segment may take: MemAvailable, or less under a cgroup limit.
pub fn shared_memory_available() -> Result<Available, MeminfoError> {
    let mem = meminfo_bytes("MemAvailable")?;
    let mut best = Available {
        bytes: mem,
        limit: "MemAvailable in /proc/meminfo".into(),
    };
    if let Some((room, limit)) = cgroup_room() {
        if room < best.bytes {
            best = Available { bytes: room, limit };
        }
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fields_in_bytes() {
        let text = "MemTotal:       24000000 kB\nShmem:             1024 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(parse_meminfo(text, "Shmem"), Some(1024 * 1024));
        assert_eq!(parse_meminfo(text, "MemAvailable"), Some(20_000_000 * 1024));
        assert_eq!(parse_meminfo(text, "Mem"), None);
    }

    #[test]
    fn this_machine_has_some_memory() {
        let a = shared_memory_available().unwrap();
        assert!(a.bytes > 0, "{a:?}");
    }
}
