//! `vrtspike plan`: the memory plan of a config on this machine (or the one described
//! by `--ram`, `--cores`, `--gpus`, `--gpu-mem`), as text or JSON.

use std::path::PathBuf;

use anyhow::{anyhow, Context, Result};
use clap::Args;
use vrtspike::config::Config;
use vrtspike::plan::{dataset_facts, model_params, plan, Machine};
use vrtspike::train::measure::measure_step;
use vrtspike::util::bytes::parse_size;

/// Arguments of `plan`.
#[derive(Args)]
pub struct PlanArgs {
    /// The config file.
    #[arg(long)]
    config: PathBuf,
    /// Override a key, `KEY.PATH=VALUE` (YAML value); repeatable, applied in order.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// GPUs (ranks) of the node; default: the CUDA devices this binary sees.
    #[arg(long)]
    gpus: Option<usize>,
    /// CPU ranks of the node when --gpus is 0 (as the launcher's --ranks).
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// Host RAM, e.g. 256G; default: this machine's.
    #[arg(long)]
    ram: Option<String>,
    /// Memory of one GPU, e.g. 48G; default: unknown.
    #[arg(long = "gpu-mem")]
    gpu_mem: Option<String>,
    /// CPU cores; default: this machine's.
    #[arg(long)]
    cores: Option<usize>,
    /// Node cache cap (e.g. 20G), instead of DATA.CACHE_SIZE_GB (as the launcher's
    /// --cache-size).
    #[arg(long = "cache-size")]
    cache_size: Option<String>,
    /// Jobs like this one on the node at once (an ablation, a sweep): with
    /// DATA.CACHE_SHARING node their cache is counted once, with job once per job.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    jobs: u64,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Also run one training step of the model on --device with a batch of the real
    /// sample shape and report its peak memory.
    #[arg(long)]
    measure: bool,
    /// Device of --measure: cpu, cuda or cuda:N (default: cuda if available, else cpu).
    #[arg(long, requires = "measure")]
    device: Option<String>,
}

impl PlanArgs {
    /// Whether it runs a training step (`--measure`), not only prints.
    pub fn measures(&self) -> bool {
        self.measure
    }
}

fn size(flag: &str, text: &str) -> Result<u64> {
    parse_size(text).map_err(|e| anyhow!("--{flag}: {e}"))
}

fn machine(args: &PlanArgs) -> Result<Machine> {
    let ram_bytes = match &args.ram {
        Some(text) => size("ram", text)?,
        None => {
            let mut sys = sysinfo::System::new();
            sys.refresh_memory();
            sys.total_memory()
        }
    };
    let gpu_mem_bytes = args
        .gpu_mem
        .as_deref()
        .map(|t| size("gpu-mem", t))
        .transpose()?;
    Ok(Machine {
        ram_bytes,
        cores: args
            .cores
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
        gpus: args
            .gpus
            .unwrap_or_else(|| usize::try_from(tch::Cuda::device_count()).unwrap_or(0)),
        gpu_mem_bytes,
        cpu_ranks: args.ranks,
        jobs: usize::try_from(args.jobs).unwrap_or(usize::MAX),
    })
}

/// Runs `plan`.
pub fn run(args: PlanArgs) -> Result<()> {
    let mut config = Config::resolve(&args.config, &args.set)
        .with_context(|| format!("resolving {}", args.config.display()))?
        .config;
    if let Some(text) = &args.cache_size {
        config.data.cache_size_gb = size("cache-size", text)? as f64 / (1u64 << 30) as f64;
    }
    for notice in config.notices() {
        tracing::info!("config notice: {notice}");
    }
    let machine = machine(&args)?;
    let params = model_params(&config.model).context("building the model to count parameters")?;
    let dataset = dataset_facts(&config).context("indexing DATA.ROOT (training split)")?;
    let mut plan = plan(&config, machine, params, dataset.as_ref());
    if args.measure {
        let device = match &args.device {
            Some(name) => super::parse_device(name)?,
            None => tch::Device::cuda_if_available(),
        };
        let measured = measure_step(&config, device, dataset.as_ref())
            .with_context(|| format!("measuring one training step on {device:?}"))?;
        plan.measured = Some(measured);
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&plan).context("writing the plan as JSON")?
        );
    } else {
        print!("{}", plan.render_text());
    }
    Ok(())
}
