//! `vrtspike profile`: forward/backward time per stage, parameters and memory of a
//! model config (the timing is `vrtspike::model::profile`), and with `--optimizer`
//! whole training steps with the update (`vrtspike::train::step_timing`), as a table
//! or JSON.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;

use tch::Device;
use vrtspike::model::profile::{
    profile, InputShape, MemoryProbe, Precision, Profile, ProfileOptions, RssProbe,
};

use super::{group_digits, parse_device};
use vrtspike::config::Config;
use vrtspike::train::optim::UpdateKernel;
use vrtspike::train::step_timing::{time_steps, StepTiming, StepTimingOptions};

/// `vrtspike profile`
#[derive(Debug, Args)]
pub struct ProfileArgs {
    /// Run config (its `MODEL` section is used).
    #[arg(long)]
    pub config: PathBuf,
    /// Override a key, `KEY.PATH=VALUE` (YAML value); repeatable, applied in order
    /// (`--set MODEL.USE_CHECKPOINT_ATTN=true`).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Clips per batch.
    #[arg(long, default_value_t = 1)]
    pub batch: i64,
    /// Frames per clip.
    #[arg(long, default_value_t = 6)]
    pub frames: i64,
    /// Square crop side in RGB pixels.
    #[arg(long, default_value_t = 256)]
    pub size: i64,
    /// Spike voxel side over the RGB side (GoPro-Spike: 0.5).
    #[arg(long, default_value_t = 0.5)]
    pub spike_scale: f64,
    /// Timed iterations (after one warm-up).
    #[arg(long, default_value_t = 3)]
    pub iters: usize,
    /// Forward only (no backward pass).
    #[arg(long)]
    pub no_backward: bool,
    /// Run the forward pass under CUDA autocast in bfloat16, as training with
    /// `TRAIN.AMP_ENABLED` does (CUDA only).
    #[arg(long, conflicts_with = "cast_bf16")]
    pub bf16: bool,
    /// Cast weights and inputs to bfloat16 instead (any device).
    #[arg(long)]
    pub cast_bf16: bool,
    /// Also time whole training steps (forward, backward, gradient norm, clipping,
    /// AdamW, zeroing) with the config's `TRAIN` settings, once per AdamW kernel
    /// named: `fused` (what training runs), `foreach`, `loop` (the per-parameter
    /// update before issue 34); comma-separated.
    #[arg(long, value_delimiter = ',', value_name = "KERNEL")]
    pub optimizer: Vec<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Runs `vrtspike profile`.
pub fn run(args: ProfileArgs) -> Result<()> {
    let device = parse_device(&args.device)?;
    if args.iters == 0 {
        bail!("--iters must be at least 1");
    }
    let config = Config::load(&args.config)
        .and_then(|c| c.with_overrides(&args.set))
        .with_context(|| format!("reading {}", args.config.display()))?;
    let kernels = args
        .optimizer
        .iter()
        .map(|k| k.parse::<UpdateKernel>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("--optimizer {e}"))?;
    if !kernels.is_empty() && args.no_backward {
        bail!("--optimizer times training steps: it needs the backward pass (drop --no-backward)");
    }
    if !kernels.is_empty() && args.cast_bf16 {
        bail!("--optimizer trains float32 weights: use --bf16 (autocast), not --cast-bf16");
    }
    let cfg = config.model.clone();
    let shape = InputShape {
        batch: args.batch,
        frames: args.frames,
        size: args.size,
        spike_scale: args.spike_scale,
    };
    let options = ProfileOptions {
        shape,
        iters: args.iters,
        backward: !args.no_backward,
        precision: match (args.bf16, args.cast_bf16) {
            (true, _) => Precision::AutocastBf16,
            (false, true) => Precision::CastBf16,
            (false, false) => Precision::Fp32,
        },
    };
    let (probe, cuda) = memory_probe(device);
    let profile = profile(&cfg, device, &options, probe.clone())
        .with_context(|| format!("profiling the model of {}", args.config.display()))?;
    let mut train_steps = Vec::with_capacity(kernels.len());
    for kernel in kernels {
        let timing = StepTimingOptions {
            shape,
            iters: args.iters,
            bf16: args.bf16,
            kernel,
        };
        let timed = time_steps(&config, device, &timing, probe.clone()).with_context(|| {
            format!(
                "timing training steps ({kernel:?} AdamW) of {}",
                args.config.display()
            )
        })?;
        train_steps.push(timed);
    }
    let report = Report {
        cuda_peak: cuda.map(|probe| probe.run_peak()),
        profile,
        train_steps,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report.profile);
        print_steps(&report.train_steps);
        if let Some(peak) = &report.cuda_peak {
            println!(
                "CUDA peak over the run: allocated {} MiB, reserved {} MiB",
                mib(Some(peak.allocated_bytes as f64)),
                mib(Some(peak.reserved_bytes as f64))
            );
        }
    }
    Ok(())
}

/// The profile, with the CUDA allocator's peaks over the whole run on a GPU and the
/// timed training steps of each `--optimizer` kernel.
#[derive(Serialize)]
struct Report {
    #[serde(flatten)]
    profile: Profile,
    cuda_peak: Option<CudaPeak>,
    train_steps: Vec<StepTiming>,
}

fn print_steps(steps: &[StepTiming]) {
    for t in steps {
        println!(
            "training step, {:?} AdamW over {} tensors: {:.1} ms (min {:.1}), of which the update {:.2} ms; peak {} MiB",
            t.optimizer,
            t.tensors,
            t.step_ms,
            t.step_min_ms,
            t.update_ms,
            mib(t.peak_bytes.map(|b| b as f64)),
        );
    }
}

/// The CUDA caching allocator's largest figures over a run (warm-up included).
#[derive(Serialize)]
struct CudaPeak {
    allocated_bytes: u64,
    reserved_bytes: u64,
}

/// Bytes as MiB with one decimal, `-` for no figure.
fn mib(bytes: Option<f64>) -> String {
    bytes
        .map(|b| format!("{:.1}", b / f64::from(1 << 20)))
        .unwrap_or_else(|| "-".into())
}

fn print_table(profile: &Profile) {
    println!(
        "{} on {} input {:?} {}: forward {:.1} ms{}",
        profile.arch,
        profile.device,
        profile.input,
        profile.dtype,
        profile.forward_ms,
        profile
            .backward_ms
            .map(|b| format!(", backward {b:.1} ms"))
            .unwrap_or_default()
    );
    println!(
        "{:<16} {:>11} {:>7} {:>12} {:>10} {:>10} {:>11} {:>10}",
        "part",
        "forward ms",
        "share",
        "parameters",
        "held MiB",
        "peak MiB",
        "backward ms",
        "peak MiB"
    );
    for row in &profile.parts {
        let backward = row
            .backward_ms
            .map(|ms| format!("{ms:.2}"))
            .unwrap_or_else(|| "-".into());
        println!(
            "{:<16} {:>11.2} {:>6.1}% {:>12} {:>10} {:>10} {:>11} {:>10}",
            row.part,
            row.forward_ms,
            100.0 * row.share,
            group_digits(row.params),
            mib(row.held_bytes.map(|b| b as f64)),
            mib(row.forward_peak_bytes.map(|b| b as f64)),
            backward,
            mib(row.backward_peak_bytes.map(|b| b as f64)),
        );
    }
    println!("total parameters: {}", group_digits(profile.total_params));
    if let Some(rss) = profile.peak_rss_bytes {
        println!("peak RSS: {} MiB", mib(Some(rss as f64)));
    }
}

/// The memory of `device`: the resident set on CPU (sampled every millisecond for
/// its peaks), the CUDA allocator's allocated bytes on a GPU (and that probe again,
/// for the run's peaks).
fn memory_probe(device: Device) -> (Arc<dyn MemoryProbe>, Option<Arc<CudaProbe>>) {
    match device {
        Device::Cuda(i) => {
            let probe = Arc::new(CudaProbe {
                device: i,
                allocated: AtomicU64::new(0),
                reserved: AtomicU64::new(0),
            });
            (probe.clone(), Some(probe))
        }
        _ => (Arc::new(RssProbe::start(Duration::from_millis(1))), None),
    }
}

/// The CUDA caching allocator's allocated bytes of one device (no figure if the
/// allocator cannot be read); it keeps the largest allocated and reserved figures
/// it saw, since the profile resets the allocator's peaks part by part.
struct CudaProbe {
    device: usize,
    allocated: AtomicU64,
    reserved: AtomicU64,
}

impl CudaProbe {
    fn run_peak(&self) -> CudaPeak {
        CudaPeak {
            allocated_bytes: self.allocated.load(Ordering::Relaxed),
            reserved_bytes: self.reserved.load(Ordering::Relaxed),
        }
    }
}

impl MemoryProbe for CudaProbe {
    fn current(&self) -> Option<u64> {
        let stats = vrtspike::ddp::cuda_memory_stats(self.device)
            .ok()
            .flatten()?;
        Some(stats.allocated_current)
    }

    fn take_peak(&self) -> Option<u64> {
        let stats = vrtspike::ddp::cuda_memory_stats(self.device)
            .ok()
            .flatten()?;
        vrtspike::ddp::reset_cuda_peak(self.device).ok()?;
        self.allocated
            .fetch_max(stats.allocated_peak, Ordering::Relaxed);
        self.reserved
            .fetch_max(stats.reserved_peak, Ordering::Relaxed);
        Some(stats.allocated_peak)
    }
}
