//! The job's memory, measured the way the design asks (decision 1): every interval,
//! Pss summed over the launcher's process tree from /proc/<pid>/smaps_rollup, so a
//! cache mapped by every rank counts once. A background thread keeps the peaks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Serialize;

/// Peaks over the samples taken so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct MemoryPeaks {
    /// Largest summed Pss of the tree, MiB.
    pub peak_pss_mb: f64,
    /// Largest summed Rss (counts shared pages once per process), MiB.
    pub peak_rss_sum_mb: f64,
    /// Most processes alive in the tree at once.
    pub peak_procs: usize,
    /// Samples taken.
    pub samples: u64,
}

/// One sample of a process tree.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TreeSample {
    /// Summed Pss, KiB.
    pub pss_kb: u64,
    /// Summed Rss, KiB.
    pub rss_kb: u64,
    /// Processes in the tree.
    pub procs: usize,
}

/// Samples the tree under `root` every `interval` on a thread until dropped.
pub struct PssSampler {
    peaks: Arc<Mutex<MemoryPeaks>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl PssSampler {
    /// Starts sampling the tree rooted at `root`.
    pub fn start(root: u32, interval: Duration) -> PssSampler {
        let peaks = Arc::new(Mutex::new(MemoryPeaks::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (peaks, stop) = (peaks.clone(), stop.clone());
            std::thread::Builder::new()
                .name("pss-sampler".into())
                .spawn(move || {
                    while !stop.load(Ordering::SeqCst) {
                        record(&peaks, sample_tree(root));
                        // Sleep in short steps so stopping is prompt.
                        let mut slept = Duration::ZERO;
                        while slept < interval && !stop.load(Ordering::SeqCst) {
                            let step = Duration::from_millis(50).min(interval - slept);
                            std::thread::sleep(step);
                            slept += step;
                        }
                    }
                })
                .ok()
        };
        if thread.is_none() {
            tracing::warn!("could not start the memory sampler thread; peak_pss_mb stays 0");
        }
        PssSampler {
            peaks,
            stop,
            thread,
        }
    }

    /// The peaks so far.
    pub fn peaks(&self) -> MemoryPeaks {
        *self.peaks.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for PssSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn record(peaks: &Mutex<MemoryPeaks>, sample: TreeSample) {
    let mut peaks = peaks.lock().unwrap_or_else(|p| p.into_inner());
    peaks.peak_pss_mb = peaks.peak_pss_mb.max(sample.pss_kb as f64 / 1024.0);
    peaks.peak_rss_sum_mb = peaks.peak_rss_sum_mb.max(sample.rss_kb as f64 / 1024.0);
    peaks.peak_procs = peaks.peak_procs.max(sample.procs);
    peaks.samples += 1;
}

/// Sums Pss and Rss over `root` and all its descendants now.
pub fn sample_tree(root: u32) -> TreeSample {
    let mut sample = TreeSample::default();
    for pid in descendants(root) {
        // A process may exit between listing and reading: skip it.
        if let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")) {
            sample.pss_kb += rollup_field_kb(&text, "Pss:").unwrap_or(0);
            sample.rss_kb += rollup_field_kb(&text, "Rss:").unwrap_or(0);
            sample.procs += 1;
        }
    }
    sample
}

/// `root` and every process descended from it, from /proc/*/stat.
pub fn descendants(root: u32) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if let Some(ppid) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| parent_of(&stat))
            {
                children.entry(ppid).or_default().push(pid);
            }
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

/// A `Name:   123 kB` field of smaps_rollup, in KiB.
fn rollup_field_kb(text: &str, field: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_and_rollup() {
        assert_eq!(parent_of("42 (a (weird) name) S 7 42 42 0"), Some(7));
        let rollup = "00400000-7fff [rollup]\nRss:   2048 kB\nPss:   1024 kB\n";
        assert_eq!(rollup_field_kb(rollup, "Pss:"), Some(1024));
        assert_eq!(rollup_field_kb(rollup, "Rss:"), Some(2048));
        assert_eq!(rollup_field_kb(rollup, "Swap:"), None);
    }

    #[test]
    fn samples_this_process_and_its_child() {
        let mut child = std::process::Command::new("sleep")
            .arg("2")
            .spawn()
            .unwrap_or_else(|e| panic!("{e}"));
        let me = std::process::id();
        assert!(descendants(me).contains(&child.id()));
        let sample = sample_tree(me);
        assert!(sample.procs >= 2, "{sample:?}");
        assert!(
            sample.pss_kb > 0 && sample.rss_kb >= sample.pss_kb,
            "{sample:?}"
        );
        let _ = child.kill();
        let _ = child.wait();
    }
}
