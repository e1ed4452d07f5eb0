//! Memory as the design measures it: Pss and Rss from `/proc/<pid>/smaps_rollup`
//! (one parser), for one process or summed over a process tree (so memory that
//! every rank maps, such as the cache, counts once).

use std::collections::HashMap;

/// The figures of one process, KiB.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rollup {
    /// Proportional set size.
    pub pss_kb: u64,
    /// Resident set size (counts shared pages in full).
    pub rss_kb: u64,
}

/// One sample of a process tree.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TreeSample {
    /// Summed Pss, KiB.
    pub pss_kb: u64,
    /// Summed Rss, KiB.
    pub rss_kb: u64,
    /// Processes read.
    pub procs: usize,
}

/// Pss and Rss from the text of a smaps_rollup file (0 for a missing field).
pub fn parse_smaps_rollup(text: &str) -> Rollup {
    let field = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    Rollup {
        pss_kb: field("Pss:"),
        rss_kb: field("Rss:"),
    }
}

/// The figures of process `pid` (`None`: this process).
pub fn read_rollup(pid: Option<u32>) -> std::io::Result<Rollup> {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/smaps_rollup"),
        None => "/proc/self/smaps_rollup".to_string(),
    };
    std::fs::read_to_string(path).map(|text| parse_smaps_rollup(&text))
}

/// Sums Pss and Rss over `root` and all its descendants now.
pub fn sample_tree(root: u32) -> TreeSample {
    let mut sample = TreeSample::default();
    for pid in descendants(root) {
        // A process may exit between listing and reading: skip it.
        if let Ok(rollup) = read_rollup(Some(pid)) {
            sample.pss_kb += rollup.pss_kb;
            sample.rss_kb += rollup.rss_kb;
            sample.procs += 1;
        }
    }
    sample
}

/// `root` and every process descended from it, from /proc/*/stat.
pub fn descendants(root: u32) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        if let Some(ppid) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| parent_of(&stat))
        {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let mut tree = vec![root];
    let mut at = 0;
    while at < tree.len() {
        if let Some(kids) = children.get(&tree[at]) {
            tree.extend(kids);
        }
        at += 1;
    }
    tree
}

/// The parent pid from a /proc/<pid>/stat line (the command name may hold spaces
/// and parentheses, so parse after the last `)`).
fn parent_of(stat: &str) -> Option<u32> {
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_and_rollup() {
        assert_eq!(parent_of("42 (a (weird) name) S 7 42 42 0"), Some(7));
        let rollup = "00400000-7fff [rollup]\nRss:   2048 kB\nPss:   1024 kB\nPss_Anon: 5 kB\n";
        assert_eq!(
            parse_smaps_rollup(rollup),
            Rollup {
                pss_kb: 1024,
                rss_kb: 2048
            }
        );
        assert_eq!(parse_smaps_rollup("Swap: 3 kB\n"), Rollup::default());
    }

    #[test]
    fn reads_this_process_and_its_child() {
        let me = read_rollup(None).unwrap_or_else(|e| panic!("{e}"));
        assert!(me.pss_kb > 0 && me.rss_kb >= me.pss_kb, "{me:?}");
        let mut child = std::process::Command::new("sleep")
            .arg("2")
            .spawn()
            .unwrap_or_else(|e| panic!("{e}"));
        let root = std::process::id();
        assert!(descendants(root).contains(&child.id()));
        let sample = sample_tree(root);
        assert!(sample.procs >= 2, "{sample:?}");
        assert!(sample.pss_kb > 0 && sample.rss_kb >= sample.pss_kb);
        let _ = child.kill();
        let _ = child.wait();
    }
}
