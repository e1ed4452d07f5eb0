//! `vrtspike profile`: forward/backward time per stage, parameters and memory of a
//! model config (the timing is `vrtspike::model::profile`), as a table or JSON.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

use tch::Device;
use vrtspike::config::Config;
use vrtspike::model::profile::{profile, MemoryProbe, Profile, ProfileOptions, RssProbe};

use super::{group_digits, parse_device};

/// `vrtspike profile`
#[derive(Debug, Args)]
pub struct ProfileArgs {
    /// Run config (its `MODEL` section is used).
    #[arg(long)]
    pub config: PathBuf,
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
    /// Run in bfloat16 (weights and inputs cast; the trainer's AMP is close to this).
    #[arg(long)]
    pub bf16: bool,
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
    let cfg = Config::load(&args.config)?.model;
    let options = ProfileOptions {
        batch: args.batch,
        frames: args.frames,
        size: args.size,
        spike_scale: args.spike_scale,
        iters: args.iters,
        backward: !args.no_backward,
        bf16: args.bf16,
    };
    let probe = memory_probe(device);
    let profile = profile(&cfg, device, &options, probe)
        .with_context(|| format!("profiling the model of {}", args.config.display()))?;
    if args.json {
        println!("{}", serde_json::to_string(&profile)?);
    } else {
        print_table(&profile);
    }
    Ok(())
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
/// its peaks), the CUDA allocator's allocated bytes on a GPU.
fn memory_probe(device: Device) -> Arc<dyn MemoryProbe> {
    match device {
        Device::Cuda(i) => Arc::new(CudaProbe(i)),
        _ => Arc::new(RssProbe::start(Duration::from_millis(1))),
    }
}

/// The CUDA caching allocator's allocated bytes of one device (no figure if the
/// allocator cannot be read).
struct CudaProbe(usize);

impl MemoryProbe for CudaProbe {
    fn current(&self) -> Option<u64> {
        let stats = vrtspike::dist::cuda_memory_stats(self.0).ok().flatten()?;
        Some(stats.allocated_current)
    }

    fn take_peak(&self) -> Option<u64> {
        let stats = vrtspike::dist::cuda_memory_stats(self.0).ok().flatten()?;
        vrtspike::dist::reset_cuda_peak(self.0).ok()?;
        Some(stats.allocated_peak)
    }
}
