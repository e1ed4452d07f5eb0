//! The job's memory, measured the way the design asks (decision 1): every interval,
//! Pss summed over the launcher's process tree (`vrtspike_contract::pss`), so a
//! cache mapped by every rank counts once. A background thread keeps the peaks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Serialize;
use vrtspike_contract::pss::{sample_tree, TreeSample};

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peaks_keep_the_largest_sample() {
        let peaks = Mutex::new(MemoryPeaks::default());
        let sample = |pss_kb, rss_kb, procs| TreeSample {
            pss_kb,
            rss_kb,
            procs,
        };
        record(&peaks, sample(2048, 4096, 3));
        record(&peaks, sample(1024, 8192, 2));
        let got = *peaks.lock().unwrap_or_else(|p| p.into_inner());
        assert_eq!(got.peak_pss_mb, 2.0);
        assert_eq!(got.peak_rss_sum_mb, 8.0);
        assert_eq!((got.peak_procs, got.samples), (3, 2));
    }

    #[test]
    fn sampler_measures_this_process() {
        let sampler = PssSampler::start(std::process::id(), Duration::from_millis(10));
        let start = std::time::Instant::now();
        while sampler.peaks().samples < 2 && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let peaks = sampler.peaks();
        assert!(peaks.samples >= 2 && peaks.peak_pss_mb > 0.0, "{peaks:?}");
    }
}
