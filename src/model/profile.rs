//! Forward/backward time per stage of a model on random input: one warm-up
//! iteration, then the mean over timed ones of each part's forward time (marked by
//! [`Restorer::forward_marked`]), the memory each part's forward leaves held for the
//! backward pass (its activations, read from a [`MemoryProbe`]), the backward pass,
//! parameters per part and the process's peak RSS on CPU. `vrtspike profile` prints it.

use std::time::Instant;

use serde::Serialize;
use tch::{nn, Device, Kind, Tensor};

use super::{build, summarize, ModelError, Restorer};
use crate::config::ModelConfig;

/// What to profile.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileOptions {
    /// Clips per batch.
    pub batch: i64,
    /// Frames per clip.
    pub frames: i64,
    /// Square crop side in RGB pixels.
    pub size: i64,
    /// Spike voxel side over the RGB side (GoPro-Spike: 0.5).
    pub spike_scale: f64,
    /// Timed iterations (after one warm-up); at least 1.
    pub iters: usize,
    /// Time the backward pass too.
    pub backward: bool,
    /// Run in bfloat16 (weights and inputs cast).
    pub bf16: bool,
}

/// One part of the model in a profile.
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
    /// its output without grad), bytes, from the last timed iteration; `None` when
    /// the probe has no figure.
    pub held_bytes: Option<i64>,
}

/// The memory in use now: the resident set on CPU, the CUDA allocator's allocated
/// bytes on a GPU. The caller supplies it (the CUDA figures live above this layer).
pub type MemoryProbe<'a> = &'a dyn Fn() -> Option<u64>;

/// The resident set of this process now, from /proc/self/statm.
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
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
    /// Forward time per part, in forward order.
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

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Peak resident set size of this process, from getrusage.
fn peak_rss() -> Option<u64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a plain-data struct into memory we own and sized for it.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: getrusage returned 0, so it initialised the struct.
    let usage = unsafe { usage.assume_init() };
    Some(usage.ru_maxrss as u64 * 1024)
}

/// Summed times of the timed iterations.
#[derive(Debug, Default)]
struct Timings {
    order: Vec<String>,
    part_ms: Vec<f64>,
    part_held: Vec<Option<i64>>,
    forward_ms: f64,
    backward_ms: f64,
}

/// What one iteration measured.
struct Iteration {
    /// Forward time (ms) and memory added per marked part, in forward order.
    marks: Vec<Mark>,
    forward_ms: f64,
    backward_ms: f64,
}

/// One marked part of a forward pass.
struct Mark {
    name: String,
    ms: f64,
    held_bytes: Option<i64>,
}

/// One iteration: the forward pass with its marks, then the backward pass.
fn iterate(
    net: &dyn Restorer,
    vs: &nn::VarStore,
    (x, voxels): (&Tensor, Option<&Tensor>),
    (device, probe): (Device, MemoryProbe),
    backward: bool,
) -> Result<Iteration, ModelError> {
    sync(device);
    let start = Instant::now();
    let mut last = start;
    let mut last_memory = probe();
    let mut marks: Vec<Mark> = Vec::new();
    let mut mark = |name: &str| {
        sync(device);
        let now = Instant::now();
        let memory = probe();
        let held_bytes = match (memory, last_memory) {
            (Some(now), Some(before)) => Some(now as i64 - before as i64),
            _ => None,
        };
        marks.push(Mark {
            name: name.to_string(),
            ms: (now - last).as_secs_f64() * 1e3,
            held_bytes,
        });
        last = now;
        last_memory = memory;
    };
    let run = |mark: &mut dyn FnMut(&str)| net.forward_marked(x, voxels, backward, mark);
    let out = if backward {
        run(&mut mark)
    } else {
        tch::no_grad(|| run(&mut mark))
    }?;
    let forward_ms = start.elapsed().as_secs_f64() * 1e3;
    let back_start = Instant::now();
    if backward {
        out.to_kind(Kind::Float)
            .square()
            .mean(Kind::Float)
            .backward();
        sync(device);
        vs.trainable_variables().iter().for_each(|t| {
            let mut g = t.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        });
    }
    let backward_ms = back_start.elapsed().as_secs_f64() * 1e3;
    Ok(Iteration {
        marks,
        forward_ms,
        backward_ms,
    })
}

/// Profiles the model `cfg` describes on `device` with random input; `probe` reads
/// the memory in use (see [`MemoryProbe`]).
pub fn profile(
    cfg: &ModelConfig,
    device: Device,
    options: &ProfileOptions,
    probe: MemoryProbe,
) -> Result<Profile, ModelError> {
    if options.iters == 0 {
        return Err(ModelError::Config(
            "a profile needs at least one timed iteration".into(),
        ));
    }
    let mut vs = nn::VarStore::new(device);
    let net = build(&vs.root(), cfg)?;
    let kind = if options.bf16 {
        Kind::BFloat16
    } else {
        Kind::Float
    };
    if options.bf16 {
        vs.bfloat16();
    }
    let summary = summarize(&vs, net.arch(), &net.parts());
    let (n, d, side) = (options.batch, options.frames, options.size);
    let x = Tensor::rand([n, d, cfg.in_chans, side, side], (kind, device));
    let spike_side = ((side as f64 * options.spike_scale) as i64 / 8 * 8).max(8);
    let voxels = net.uses_voxels().then(|| {
        let shape = [n, d, cfg.spike.voxel_bins, spike_side, spike_side];
        Tensor::rand(shape, (kind, device))
    });
    let mut t = Timings::default();
    for iter in 0..=options.iters {
        let input = (&x, voxels.as_ref());
        let Iteration {
            marks,
            forward_ms,
            backward_ms,
        } = iterate(net.as_ref(), &vs, input, (device, probe), options.backward)?;
        if iter == 0 {
            continue;
        }
        if t.order.is_empty() {
            t.order = marks.iter().map(|m| m.name.clone()).collect();
            t.part_ms = vec![0.0; t.order.len()];
        }
        for (total, m) in t.part_ms.iter_mut().zip(&marks) {
            *total += m.ms;
        }
        t.part_held = marks.iter().map(|m| m.held_bytes).collect();
        t.forward_ms += forward_ms;
        t.backward_ms += backward_ms;
    }
    let iters = options.iters as f64;
    let forward_ms = t.forward_ms / iters;
    let parts = t
        .order
        .iter()
        .zip(&t.part_ms)
        .zip(&t.part_held)
        .map(|((name, total), held)| ProfileRow {
            part: name.clone(),
            forward_ms: total / iters,
            share: total / iters / forward_ms.max(1e-9),
            params: summary
                .parts
                .iter()
                .filter(|p| &p.prefix == name)
                .map(|p| p.params)
                .sum(),
            held_bytes: *held,
        })
        .collect();
    Ok(Profile {
        arch: summary.arch.clone(),
        device: match device {
            Device::Cuda(i) => format!("cuda:{i}"),
            _ => "cpu".into(),
        },
        input: x.size(),
        dtype: format!("{kind:?}"),
        parts,
        forward_ms,
        backward_ms: options.backward.then_some(t.backward_ms / iters),
        total_params: summary.total_params,
        peak_rss_bytes: if device == Device::Cpu {
            peak_rss()
        } else {
            None
        },
    })
}
