//! The device's utilisation over a window of time, from NVML's sample buffer
//! (`nvmlDeviceGetSamples`, about six samples a second of the share of time a kernel
//! ran) rather than one instantaneous reading: the samples newer than the last one
//! seen are taken at every poll (the buffer holds a limited span, so the trainer
//! polls once a step) and averaged when the window is reported.

/// The GPU utilisation samples of one window.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct UtilisationWindow {
    /// The newest sample's timestamp (NVML's CPU time, microseconds).
    last_seen: Option<u64>,
    sum: f64,
    count: u64,
}

impl UtilisationWindow {
    /// The timestamp to ask NVML for samples after (`None`: everything it holds).
    pub fn last_seen(&self) -> Option<u64> {
        self.last_seen
    }

    /// Adds `(timestamp, percent)` samples: those not newer than the last one seen
    /// are left out (a buffer read twice counts once).
    pub fn add(&mut self, samples: impl IntoIterator<Item = (u64, f64)>) {
        for (timestamp, percent) in samples {
            if self.last_seen.is_some_and(|seen| timestamp <= seen) {
                continue;
            }
            self.last_seen = Some(timestamp);
            self.sum += percent;
            self.count += 1;
        }
    }

    /// The mean of the window's samples, and a new window (after the last sample
    /// seen); `None` when it holds none.
    pub fn take_mean(&mut self) -> Option<f64> {
        let mean = (self.count > 0).then(|| self.sum / self.count as f64);
        self.sum = 0.0;
        self.count = 0;
        mean
    }
}

/// Reads the GPU utilisation samples of `device` newer than the window's last into
/// it.
pub fn poll(device: &nvml_wrapper::Device<'_>, window: &mut UtilisationWindow) {
    use nvml_wrapper::enum_wrappers::device::Sampling;
    use nvml_wrapper::enums::device::SampleValue;
    let samples = match device.samples(Sampling::GpuUtilization, window.last_seen()) {
        Ok(samples) => samples,
        Err(e) => {
            tracing::debug!(error = %e, "NVML utilisation samples unavailable");
            return;
        }
    };
    window.add(samples.into_iter().map(|s| {
        let percent = match s.value {
            SampleValue::U32(v) => f64::from(v),
            SampleValue::U64(v) => v as f64,
            SampleValue::I64(v) => v as f64,
            SampleValue::F64(v) => v,
        };
        (s.timestamp, percent)
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_averages_every_sample_once() {
        let mut window = UtilisationWindow::default();
        assert_eq!(window.take_mean(), None, "no sample, no figure");
        assert_eq!(window.last_seen(), None);
        // A busy second, then an idle half second, polled twice with an overlap.
        let busy: Vec<(u64, f64)> = (0..6).map(|i| (1_000_000 + i * 166_667, 100.0)).collect();
        let idle: Vec<(u64, f64)> = (6..9).map(|i| (1_000_000 + i * 166_667, 0.0)).collect();
        window.add(busy.iter().copied());
        window.add(busy[3..].iter().chain(&idle).copied());
        assert_eq!(window.last_seen(), Some(1_000_000 + 8 * 166_667));
        let mean = window.take_mean().unwrap();
        assert!(
            (mean - 600.0 / 9.0).abs() < 1e-9,
            "{mean}: 6 busy of 9 samples"
        );
        // The next window starts after the last sample seen.
        window.add(idle.iter().copied());
        assert_eq!(window.take_mean(), None, "old samples do not count again");
        window.add([(2_600_000, 50.0), (2_800_000, 70.0)]);
        assert_eq!(window.take_mean(), Some(60.0));
    }
}
