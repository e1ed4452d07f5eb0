//! The memory monitor: this process's Pss and Rss (smaps_rollup, read by
//! `vrtspike_contract::pss` as the launcher reads it), the
//! system's used/total memory (`sysinfo`), the CUDA caching allocator's
//! allocated/reserved bytes (the ddp shim) and the device's used memory and
//! utilisation (NVML, skipped when there is no NVIDIA driver; the utilisation is the
//! mean of NVML's samples since the previous memory sample, polled every step, see
//! [`super::utilisation`]). Past 90% of host or device memory it warns and names the
//! knobs that reduce use.

use serde::Serialize;

use super::utilisation::UtilisationWindow;

/// One sample of the figures, in MiB (and percent).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct MemorySample {
    /// This process's proportional set size.
    pub pss_mb: f64,
    /// This process's resident set size (double-counts shared memory).
    pub rss_mb: f64,
    /// Memory used on the host (total minus available).
    pub sys_used_mb: f64,
    /// Host memory.
    pub sys_total_mb: f64,
    /// CUDA caching allocator: allocated now.
    pub gpu_allocated_mb: Option<f64>,
    /// CUDA caching allocator: reserved now.
    pub gpu_reserved_mb: Option<f64>,
    /// Device memory used (all processes), from NVML.
    pub gpu_used_mb: Option<f64>,
    /// Device memory, from NVML.
    pub gpu_total_mb: Option<f64>,
    /// Device utilisation in percent since the previous sample: the mean of NVML's
    /// utilisation samples over that window.
    pub gpu_util_pct: Option<f64>,
}

const MB: f64 = 1024.0 * 1024.0;

/// Samples the figures; keeps the NVML handle and the peak Pss.
pub struct MemoryMonitor {
    system: sysinfo::System,
    nvml: Option<nvml_wrapper::Nvml>,
    device: Option<usize>,
    utilisation: UtilisationWindow,
    warned: bool,
    /// Largest Pss seen, in MiB.
    pub peak_pss_mb: f64,
}

impl MemoryMonitor {
    /// A monitor for this process; `cuda_device` is its GPU, if any.
    pub fn new(cuda_device: Option<usize>) -> MemoryMonitor {
        let nvml = match cuda_device {
            Some(_) => match nvml_wrapper::Nvml::init() {
                Ok(n) => Some(n),
                Err(e) => {
                    tracing::debug!(error = %e, "NVML unavailable: device figures skipped");
                    None
                }
            },
            None => None,
        };
        MemoryMonitor {
            system: sysinfo::System::new(),
            nvml,
            device: cuda_device,
            utilisation: UtilisationWindow::default(),
            warned: false,
            peak_pss_mb: 0.0,
        }
    }

    /// Reads the device's utilisation samples since the last poll into the window
    /// (a no-op without a GPU or NVML); the trainer calls it every step.
    pub fn poll(&mut self) {
        if let (Some(nvml), Some(device)) = (&self.nvml, self.device) {
            if let Ok(dev) = nvml.device_by_index(device as u32) {
                super::utilisation::poll(&dev, &mut self.utilisation);
            }
        }
    }

    /// Takes one sample (and warns once past 90% of host or device memory).
    pub fn sample(&mut self) -> MemorySample {
        let rollup = vrtspike_contract::pss::read_rollup(None).unwrap_or_default();
        let (pss, rss) = (rollup.pss_kb * 1024, rollup.rss_kb * 1024);
        self.system.refresh_memory();
        let total = self.system.total_memory();
        let used = total.saturating_sub(self.system.available_memory());
        let mut sample = MemorySample {
            pss_mb: pss as f64 / MB,
            rss_mb: rss as f64 / MB,
            sys_used_mb: used as f64 / MB,
            sys_total_mb: total as f64 / MB,
            ..MemorySample::default()
        };
        if let Some(device) = self.device {
            if let Ok(Some(stats)) = crate::ddp::cuda_memory_stats(device) {
                sample.gpu_allocated_mb = Some(stats.allocated_current as f64 / MB);
                sample.gpu_reserved_mb = Some(stats.reserved_current as f64 / MB);
            }
            if let Some(nvml) = &self.nvml {
                if let Ok(dev) = nvml.device_by_index(device as u32) {
                    if let Ok(info) = dev.memory_info() {
                        sample.gpu_used_mb = Some(info.used as f64 / MB);
                        sample.gpu_total_mb = Some(info.total as f64 / MB);
                    }
                    super::utilisation::poll(&dev, &mut self.utilisation);
                    sample.gpu_util_pct = self.utilisation.take_mean();
                }
            }
        }
        self.peak_pss_mb = self.peak_pss_mb.max(sample.pss_mb);
        if let Some(message) = pressure_warning(&sample) {
            if !self.warned {
                tracing::warn!("{message}");
                self.warned = true;
            }
        } else {
            self.warned = false;
        }
        sample
    }
}

/// The warning for a sample past 90% of host or device memory, naming the knobs.
pub fn pressure_warning(s: &MemorySample) -> Option<String> {
    let mut parts = Vec::new();
    if s.sys_total_mb > 0.0 && s.sys_used_mb >= 0.9 * s.sys_total_mb {
        parts.push(format!(
            "host memory {:.0}% used ({:.0} of {:.0} MiB): lower DATA.CACHE_SIZE_GB, \
             DATALOADER.TOTAL_WORKERS or DATALOADER.TRAIN_PREFETCH_FACTOR",
            100.0 * s.sys_used_mb / s.sys_total_mb,
            s.sys_used_mb,
            s.sys_total_mb
        ));
    }
    if let (Some(used), Some(total)) = (s.gpu_used_mb, s.gpu_total_mb) {
        if total > 0.0 && used >= 0.9 * total {
            parts.push(format!(
                "GPU memory {:.0}% used ({used:.0} of {total:.0} MiB): lower TRAIN.BATCH_SIZE \
                 (raise GRADIENT_ACCUMULATION_STEPS to keep the effective batch), DATA.CROP_SIZE, \
                 or enable TRAIN.AMP_ENABLED; for validation set DATA.VAL_TILE",
                100.0 * used / total
            ));
        }
    }
    (!parts.is_empty()).then(|| parts.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_and_warning() {
        let mut monitor = MemoryMonitor::new(None);
        let s = monitor.sample();
        assert!(s.pss_mb > 0.0 && s.rss_mb >= s.pss_mb * 0.5, "{s:?}");
        assert!(s.sys_total_mb > 0.0 && s.sys_used_mb > 0.0);
        assert_eq!(s.gpu_used_mb, None);
        let full = MemorySample {
            sys_used_mb: 95.0,
            sys_total_mb: 100.0,
            ..s.clone()
        };
        let warning = pressure_warning(&full).unwrap();
        assert!(
            warning.contains("CACHE_SIZE_GB") && warning.contains("TOTAL_WORKERS"),
            "{warning}"
        );
        let gpu = MemorySample {
            sys_used_mb: 1.0,
            gpu_used_mb: Some(79.0),
            gpu_total_mb: Some(80.0),
            ..s
        };
        assert!(pressure_warning(&gpu).unwrap().contains("BATCH_SIZE"));
    }
}
