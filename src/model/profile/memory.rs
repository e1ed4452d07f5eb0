//! Memory figures for a profile: what is in use now and the most in use since the
//! last look, per device. On CPU the resident set, its peak kept by a sampling
//! thread (reading the kernel's high-water mark would need resetting it, and that
//! would hide the process's real peak from `time` and `getrusage`); on a GPU the
//! caching allocator's figures, which the layer that owns them supplies.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Memory of the device a profile runs on.
pub trait MemoryProbe: Send + Sync {
    /// Bytes in use now.
    fn current(&self) -> Option<u64>;
    /// The most bytes in use since the previous call (or the probe's start); the
    /// next window starts now.
    fn take_peak(&self) -> Option<u64>;
}

/// The resident set of this process now, from /proc/self/statm.
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}

/// Peak resident set size of this process over its life, from getrusage.
pub fn lifetime_peak_rss() -> Option<u64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a plain-data struct into memory we own and sized for it.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: getrusage returned 0, so it initialised the struct.
    let usage = unsafe { usage.assume_init() };
    u64::try_from(usage.ru_maxrss).ok().map(|kib| kib * 1024)
}

/// The resident set, sampled every `interval` by a thread of its own for the peaks.
pub struct RssProbe {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    sampler: Option<JoinHandle<()>>,
}

impl RssProbe {
    /// Starts sampling; the thread stops when the probe is dropped.
    pub fn start(interval: Duration) -> RssProbe {
        let peak = Arc::new(AtomicU64::new(resident_bytes().unwrap_or(0)));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (Arc::clone(&peak), Arc::clone(&stop));
        let sampler = std::thread::Builder::new()
            .name("rss-sampler".into())
            .spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    if let Some(now) = resident_bytes() {
                        p.fetch_max(now, Ordering::Relaxed);
                    }
                    std::thread::sleep(interval);
                }
            })
            .ok();
        RssProbe {
            peak,
            stop,
            sampler,
        }
    }
}

impl MemoryProbe for RssProbe {
    fn current(&self) -> Option<u64> {
        resident_bytes()
    }

    fn take_peak(&self) -> Option<u64> {
        let now = resident_bytes()?;
        let before = self.peak.swap(now, Ordering::Relaxed);
        Some(before.max(now))
    }
}

impl Drop for RssProbe {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(sampler) = self.sampler.take() {
            let _ = sampler.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The check itself, alone in a process: other tests' allocations would move the
    /// resident set it measures.
    #[test]
    #[ignore = "run in a fresh process by the_sampler_sees_a_peak_that_is_gone_by_the_next_look"]
    fn sampler_probe() {
        let probe = RssProbe::start(Duration::from_millis(1));
        let _ = probe.take_peak();
        let before = probe.current().unwrap();
        // 256 MiB touched, held for a while, then freed (its own mapping).
        let block = vec![1u8; 256 << 20];
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(block.iter().map(|&b| u64::from(b)).sum::<u64>(), 256 << 20);
        drop(block);
        let peak = probe.take_peak().unwrap();
        assert!(peak >= before + (200 << 20), "peak {peak}, before {before}");
        // A new window starts from what is in use now.
        let next = probe.take_peak().unwrap();
        assert!(next < peak - (100 << 20), "next {next}, peak {peak}");
    }

    #[test]
    fn the_sampler_sees_a_peak_that_is_gone_by_the_next_look() {
        let probe = "model::profile::memory::tests::sampler_probe";
        if let Err(e) = crate::util::alone::run_ignored_test_alone(probe, &[]) {
            panic!("{e}");
        }
    }
}
