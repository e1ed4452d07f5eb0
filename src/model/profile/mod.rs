//! Forward/backward time and memory per part of a model on random input: one
//! warm-up iteration, then the mean over timed ones of each part's forward time
//! (marked through [`PartMarks`]), the memory its forward leaves held for the
//! backward pass (its activations), the peak memory within it, and, when the
//! backward pass is timed, the same per part of the backward pass. The backward
//! figures come from hooks on each part's output (see [`on_backward`]): the gradient
//! of a part's output is complete when the backward pass of every later part is
//! done, so the time from that hook to the next is the part's own backward pass.
//! `vrtspike profile` prints it.

pub mod memory;

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use serde::Serialize;
use tch::{nn, Device, Kind, Tensor};

use super::checkpoint::on_backward;
use super::precision::{cuda_autocast, AutocastDtype};
use super::{build, summarize, AtStage, ModelError, PartMarks, Restorer};
use crate::config::ModelConfig;
pub use memory::{lifetime_peak_rss, resident_bytes, MemoryProbe, RssProbe};

/// What to profile.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileOptions {
    /// The random input's shape.
    pub shape: InputShape,
    /// Timed iterations (after one warm-up); at least 1.
    pub iters: usize,
    /// Time the backward pass too.
    pub backward: bool,
    /// The precision the model runs in.
    pub precision: Precision,
}

/// The precision a profile runs the model in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// float32 weights and inputs.
    Fp32,
    /// float32 weights and inputs, the forward pass under CUDA autocast in bfloat16
    /// (what training with `TRAIN.AMP_ENABLED` runs, and the reference's `--bf16`).
    AutocastBf16,
    /// Weights and inputs cast to bfloat16.
    CastBf16,
}

/// One part of the model in a profile. Memory figures are from the last timed
/// iteration; `None` where the probe has no figure.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProfileRow {
    /// The part's name (a parameter prefix).
    pub part: String,
    /// Mean forward time, ms.
    pub forward_ms: f64,
    /// Share of the whole forward time.
    pub share: f64,
    /// Parameters of the part.
    pub params: i64,
    /// Memory the part's forward added (activations kept for the backward pass, or
    /// its output without grad), bytes.
    pub held_bytes: Option<i64>,
    /// Most memory in use during the part's forward, bytes.
    pub forward_peak_bytes: Option<u64>,
    /// Mean backward time, ms; `None` for a part whose output is off the main path
    /// (SpyNet's flows, the spike features): its backward pass is counted in the
    /// first main-path part's row (conv_first), which runs last.
    pub backward_ms: Option<f64>,
    /// Most memory in use during the part's backward pass, bytes.
    pub backward_peak_bytes: Option<u64>,
}

/// The whole profile.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Profile {
    /// `MODEL.ARCH`.
    pub arch: String,
    /// The device, as `cpu` or `cuda:N`.
    pub device: String,
    /// Input shape (N, D, C, H, W).
    pub input: Vec<i64>,
    /// Element kind of weights and inputs.
    pub dtype: String,
    /// Figures per part, in forward order.
    pub parts: Vec<ProfileRow>,
    /// Mean forward time, ms.
    pub forward_ms: f64,
    /// Mean backward time, ms (when timed).
    pub backward_ms: Option<f64>,
    /// Parameters in all.
    pub total_params: i64,
    /// Peak resident memory of this process (CPU runs), bytes.
    pub peak_rss_bytes: Option<u64>,
}

/// Waits for the device's queued work (CUDA; nothing on the CPU).
pub(crate) fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// One part of a forward pass as measured.
struct ForwardMark {
    name: String,
    ms: f64,
    held_bytes: Option<i64>,
    peak_bytes: Option<u64>,
}

/// A backward hook firing: the gradient of `name`'s output is complete; `peak` is
/// the most memory in use since the previous firing.
struct BackwardMark {
    name: String,
    at: Instant,
    peak: Option<u64>,
}

/// One part's backward pass.
struct BackwardPart {
    ms: f64,
    peak_bytes: Option<u64>,
}

type BackwardLog = Arc<Mutex<Vec<BackwardMark>>>;

/// The [`PartMarks`] of a profiled forward pass: times and measures each part and,
/// when `backward` is set, hooks the backward pass at each main-path output.
struct Recorder {
    device: Device,
    probe: Arc<dyn MemoryProbe>,
    last: Instant,
    last_memory: Option<u64>,
    forward: Vec<ForwardMark>,
    backward: Option<BackwardLog>,
}

impl Recorder {
    fn start(device: Device, probe: Arc<dyn MemoryProbe>, backward: bool) -> Recorder {
        sync(device);
        let _ = probe.take_peak();
        Recorder {
            device,
            last_memory: probe.current(),
            probe,
            last: Instant::now(),
            forward: Vec::new(),
            backward: backward.then(BackwardLog::default),
        }
    }

    /// The hook that logs the backward pass reaching `part`.
    fn hook(&self, part: &str, log: &BackwardLog) -> impl Fn() + Send + Sync + 'static {
        let (device, probe, log) = (self.device, Arc::clone(&self.probe), Arc::clone(log));
        let name = part.to_string();
        move || {
            sync(device);
            let mark = BackwardMark {
                name: name.clone(),
                at: Instant::now(),
                peak: probe.take_peak(),
            };
            log.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(mark);
        }
    }
}

impl PartMarks for Recorder {
    fn part(&mut self, part: &str) {
        sync(self.device);
        let now = Instant::now();
        let memory = self.probe.current();
        let held_bytes = match (memory, self.last_memory) {
            (Some(now), Some(before)) => Some(now as i64 - before as i64),
            _ => None,
        };
        self.forward.push(ForwardMark {
            name: part.to_string(),
            ms: (now - self.last).as_secs_f64() * 1e3,
            held_bytes,
            peak_bytes: self.probe.take_peak(),
        });
        self.last = now;
        self.last_memory = memory;
    }

    fn output(&mut self, part: &str, out: Tensor) -> Result<Tensor, ModelError> {
        self.part(part);
        match &self.backward {
            Some(log) => on_backward(&out, self.hook(part, log)),
            None => Ok(out),
        }
    }
}

/// Each hooked part's backward pass from the hook firings (in firing order) and the
/// end of the pass with the peak of its last window.
fn backward_parts(
    marks: &[BackwardMark],
    end: Instant,
    end_peak: Option<u64>,
) -> Vec<(String, BackwardPart)> {
    marks
        .iter()
        .enumerate()
        .map(|(i, mark)| {
            let (until, peak) = match marks.get(i + 1) {
                Some(next) => (next.at, next.peak),
                None => (end, end_peak),
            };
            let part = BackwardPart {
                ms: (until - mark.at).as_secs_f64() * 1e3,
                peak_bytes: peak,
            };
            (mark.name.clone(), part)
        })
        .collect()
}

/// What one iteration measured.
struct Iteration {
    forward: Vec<ForwardMark>,
    backward: Vec<(String, BackwardPart)>,
    forward_ms: f64,
    backward_ms: f64,
}

/// The scalar loss of a profile's backward pass.
fn loss_of(out: &Tensor) -> Result<Tensor, tch::TchError> {
    out.f_to_kind(Kind::Float)?.f_square()?.f_mean(Kind::Float)
}

/// One iteration: the forward pass with its marks, then the backward pass.
fn iterate(
    net: &dyn Restorer,
    vs: &nn::VarStore,
    (x, voxels): (&Tensor, Option<&Tensor>),
    (device, probe): (Device, &Arc<dyn MemoryProbe>),
    options: &ProfileOptions,
) -> Result<Iteration, ModelError> {
    let backward = options.backward;
    let mut recorder = Recorder::start(device, Arc::clone(probe), backward);
    let start = recorder.last;
    let run = |marks: &mut Recorder| match options.precision {
        Precision::AutocastBf16 => cuda_autocast(AutocastDtype::Bf16, || {
            net.forward_marked(x, voxels, backward, marks)
        }),
        Precision::Fp32 | Precision::CastBf16 => net.forward_marked(x, voxels, backward, marks),
    };
    let out = if backward {
        run(&mut recorder)
    } else {
        tch::no_grad(|| run(&mut recorder))
    }?;
    let forward_ms = start.elapsed().as_secs_f64() * 1e3;
    let back_start = Instant::now();
    let mut parts = Vec::new();
    if let Some(log) = recorder.backward.take() {
        loss_of(&out)
            .and_then(|loss| loss.f_backward())
            .at_stage("backward pass")?;
        sync(device);
        let end = Instant::now();
        let end_peak = probe.take_peak();
        let marks = std::mem::take(&mut *log.lock().unwrap_or_else(PoisonError::into_inner));
        parts = backward_parts(&marks, end, end_peak);
        for t in vs.trainable_variables() {
            let mut g = t.grad();
            if g.defined() {
                let _ = g.f_zero_();
            }
        }
    }
    Ok(Iteration {
        forward: recorder.forward,
        backward: parts,
        forward_ms,
        backward_ms: back_start.elapsed().as_secs_f64() * 1e3,
    })
}

/// Sums of the timed iterations, per part in forward order; memory from the last.
#[derive(Debug, Default)]
struct Totals {
    rows: Vec<ProfileRow>,
    forward_ms: f64,
    backward_ms: f64,
}

impl Totals {
    fn add(&mut self, it: Iteration) {
        if self.rows.is_empty() {
            self.rows = it
                .forward
                .iter()
                .map(|m| ProfileRow {
                    part: m.name.clone(),
                    forward_ms: 0.0,
                    share: 0.0,
                    params: 0,
                    held_bytes: None,
                    forward_peak_bytes: None,
                    backward_ms: None,
                    backward_peak_bytes: None,
                })
                .collect();
        }
        for (row, mark) in self.rows.iter_mut().zip(&it.forward) {
            row.forward_ms += mark.ms;
            row.held_bytes = mark.held_bytes;
            row.forward_peak_bytes = mark.peak_bytes;
        }
        for (name, part) in &it.backward {
            if let Some(row) = self.rows.iter_mut().find(|r| &r.part == name) {
                row.backward_ms = Some(row.backward_ms.unwrap_or(0.0) + part.ms);
                row.backward_peak_bytes = part.peak_bytes;
            }
        }
        self.forward_ms += it.forward_ms;
        self.backward_ms += it.backward_ms;
    }
}

/// The shape of a profile's random input.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InputShape {
    /// Clips per batch.
    pub batch: i64,
    /// Frames per clip.
    pub frames: i64,
    /// Square crop side in RGB pixels.
    pub size: i64,
    /// Spike voxel side over the RGB side (GoPro-Spike: 0.5).
    pub spike_scale: f64,
}

/// Random frames (N, D, C, size, size) for the model `cfg` describes and, when it
/// reads spikes, voxels (N, D, bins, s, s) with s the side times `spike_scale`
/// rounded down to a multiple of 8 (at least 8).
pub fn random_input(
    cfg: &ModelConfig,
    uses_voxels: bool,
    shape: InputShape,
    options: (Kind, Device),
) -> Result<(Tensor, Option<Tensor>), ModelError> {
    let (n, d, side) = (shape.batch, shape.frames, shape.size);
    let x = Tensor::f_rand([n, d, cfg.in_chans, side, side], options).at_stage("input")?;
    let spike_side = ((side as f64 * shape.spike_scale) as i64 / 8 * 8).max(8);
    let voxels = match uses_voxels {
        true => {
            let dims = [n, d, cfg.spike.voxel_bins, spike_side, spike_side];
            Some(Tensor::f_rand(dims, options).at_stage("spike input")?)
        }
        false => None,
    };
    Ok((x, voxels))
}

/// Profiles the model `cfg` describes on `device` with random input; `probe` reads
/// the memory of that device.
pub fn profile(
    cfg: &ModelConfig,
    device: Device,
    options: &ProfileOptions,
    probe: Arc<dyn MemoryProbe>,
) -> Result<Profile, ModelError> {
    if options.iters == 0 {
        return Err(ModelError::Config(
            "a profile needs at least one timed iteration".into(),
        ));
    }
    let mut vs = nn::VarStore::new(device);
    let net = build(&vs.root(), cfg)?;
    if options.precision == Precision::AutocastBf16 && !device.is_cuda() {
        return Err(ModelError::Config(
            "bfloat16 autocast runs on CUDA only (cast the weights instead on CPU)".into(),
        ));
    }
    let kind = match options.precision {
        Precision::CastBf16 => {
            vs.bfloat16();
            Kind::BFloat16
        }
        Precision::Fp32 | Precision::AutocastBf16 => Kind::Float,
    };
    let summary = summarize(&vs, net.arch(), &net.parts());
    let (x, voxels) = random_input(cfg, net.uses_voxels(), options.shape, (kind, device))?;
    let mut totals = Totals::default();
    for iter in 0..=options.iters {
        let input = (&x, voxels.as_ref());
        let it = iterate(net.as_ref(), &vs, input, (device, &probe), options)?;
        if iter > 0 {
            totals.add(it);
        }
    }
    let iters = options.iters as f64;
    let forward_ms = totals.forward_ms / iters;
    for row in &mut totals.rows {
        row.forward_ms /= iters;
        row.share = row.forward_ms / forward_ms.max(1e-9);
        row.backward_ms = row.backward_ms.map(|ms| ms / iters);
        row.params = summary
            .parts
            .iter()
            .filter(|p| p.prefix == row.part)
            .map(|p| p.params)
            .sum();
    }
    Ok(Profile {
        arch: summary.arch.clone(),
        device: super::device_name(device),
        input: x.size(),
        dtype: match options.precision {
            Precision::AutocastBf16 => "Float (bfloat16 autocast)".to_string(),
            Precision::Fp32 | Precision::CastBf16 => format!("{kind:?}"),
        },
        forward_ms,
        backward_ms: options.backward.then_some(totals.backward_ms / iters),
        total_params: summary.total_params,
        peak_rss_bytes: (device == Device::Cpu)
            .then(|| process_peak(lifetime_peak_rss(), &totals.rows))
            .flatten(),
        parts: totals.rows,
    })
}

/// The process's peak resident set: the kernel's high-water mark, or a part's
/// sampled peak where that is higher. The kernel updates its mark lazily (at an
/// unmap, or when asked) from per-CPU counters it reads approximately, so a
/// sample of `/proc/self/statm` between two updates can exceed it; the process
/// held what any sample saw.
fn process_peak(kernel: Option<u64>, parts: &[ProfileRow]) -> Option<u64> {
    let sampled = parts
        .iter()
        .flat_map(|r| [r.forward_peak_bytes, r.backward_peak_bytes])
        .flatten()
        .max();
    kernel.max(sampled)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A probe with no figures: the test checks times and the hooks' order.
    struct NoMemory;

    impl MemoryProbe for NoMemory {
        fn current(&self) -> Option<u64> {
            None
        }
        fn take_peak(&self) -> Option<u64> {
            None
        }
    }

    /// One timed forward + backward pass of 2 frames of `size` x `size` pixels.
    fn options(size: i64) -> ProfileOptions {
        ProfileOptions {
            shape: InputShape {
                batch: 1,
                frames: 2,
                size,
                spike_scale: 0.5,
            },
            iters: 1,
            backward: true,
            precision: Precision::Fp32,
        }
    }

    #[test]
    fn the_backward_pass_is_split_between_the_main_path_parts() {
        let cfg = crate::model::tiny_vrt_spike().model;
        let p = profile(&cfg, Device::Cpu, &options(32), Arc::new(NoMemory)).unwrap();
        let names: Vec<&str> = p.parts.iter().map(|r| r.part.as_str()).collect();
        assert_eq!(names[..3], ["spynet", "conv_first", "spike_encoder"]);
        assert_eq!(names.last(), Some(&"reconstruction"));
        for row in &p.parts {
            let off_path = matches!(row.part.as_str(), "spynet" | "spike_encoder");
            assert_eq!(row.backward_ms.is_none(), off_path, "{}", row.part);
            assert!(row.forward_ms > 0.0, "{}", row.part);
            assert_eq!(row.forward_peak_bytes, None);
        }
        let backward = p.backward_ms.unwrap();
        let parts: f64 = p.parts.iter().filter_map(|r| r.backward_ms).sum();
        // The hooks cover the pass from the reconstruction's gradient to the end;
        // only the loss and the zeroing of the gradients are outside them.
        assert!(
            parts <= backward && parts > 0.5 * backward,
            "{parts} of {backward} ms"
        );
    }

    #[test]
    fn the_process_peak_is_never_below_a_part_s_sampled_peak() {
        let row = |forward, backward| ProfileRow {
            part: "p".into(),
            forward_ms: 1.0,
            share: 1.0,
            params: 0,
            held_bytes: None,
            forward_peak_bytes: forward,
            backward_ms: None,
            backward_peak_bytes: backward,
        };
        let parts = [row(Some(10), Some(30)), row(Some(20), None)];
        assert_eq!(process_peak(Some(100), &parts), Some(100));
        assert_eq!(process_peak(Some(25), &parts), Some(30));
        assert_eq!(process_peak(None, &parts), Some(30));
        assert_eq!(process_peak(Some(5), &[]), Some(5));
        assert_eq!(process_peak(None, &[row(None, None)]), None);
    }

    #[test]
    fn peaks_come_from_the_probe_on_every_part() {
        let mut cfg = crate::model::tiny_vrt_spike().model;
        cfg.spike.enabled = false;
        let probe = Arc::new(RssProbe::start(std::time::Duration::from_millis(1)));
        let p = profile(&cfg, Device::Cpu, &options(16), probe).unwrap();
        for row in &p.parts {
            assert!(
                row.forward_peak_bytes.is_some_and(|b| b > 0),
                "{}",
                row.part
            );
            if row.part != "spynet" {
                assert!(
                    row.backward_peak_bytes.is_some_and(|b| b > 0),
                    "{}",
                    row.part
                );
            }
        }
        let peak = p.peak_rss_bytes.unwrap();
        assert!(p
            .parts
            .iter()
            .all(|r| r.forward_peak_bytes.unwrap() <= peak));
    }
}
