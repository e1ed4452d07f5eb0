//! The memory plan of a run (`vrtspike plan`): from the config, the machine and the
//! built model, the node cache cap (against the dataset's compact size when
//! `DATA.ROOT` is set), each rank's loader in-flight bytes (workers x prefetch x batch x
//! sample bytes of the real sample shape), the model's parameter, gradient and AdamW
//! bytes, the host total and its share of RAM, and the warnings of the user's guides.

use serde::Serialize;

use crate::cache::store::read_order::DEFAULT_BUDGET as READ_ORDER_BUDGET;
use crate::config::{CacheSharing, Config, ModelConfig, Workers};
use crate::dataset::{DataError, DatasetIndex, IndexOptions};

const GIB: f64 = (1u64 << 30) as f64;

/// The machine a plan is for.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Machine {
    /// Host RAM in bytes.
    pub ram_bytes: u64,
    /// CPU cores of the node.
    pub cores: usize,
    /// GPUs of the node (one rank each); 0 plans one CPU rank.
    pub gpus: usize,
    /// Memory of one GPU in bytes, when known.
    pub gpu_mem_bytes: Option<u64>,
    /// Ranks on the CPU when `gpus` is 0 (at least 1).
    pub cpu_ranks: usize,
    /// Jobs like this one on the node at once (an ablation, a sweep), each with
    /// these ranks (at least 1): with `DATA.CACHE_SHARING: node` their cache is
    /// counted once.
    pub jobs: usize,
}

impl Machine {
    /// Ranks on the node: one per GPU, else the CPU ranks.
    pub fn ranks(&self) -> usize {
        if self.gpus > 0 {
            self.gpus
        } else {
            self.cpu_ranks.max(1)
        }
    }
}

/// What the plan needs from the dataset (`DATA.ROOT`, training split).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DatasetFacts {
    /// Bytes of all training records as the cache stores them.
    pub compact_bytes: u64,
    /// Training frames.
    pub frames: usize,
    /// RGB frame rows and columns.
    pub height: u32,
    /// RGB frame columns.
    pub width: u32,
    /// Spike grid rows.
    pub spike_height: u32,
    /// Spike grid columns.
    pub spike_width: u32,
}

/// The figures of a plan, in bytes unless named otherwise.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// The machine planned for.
    pub machine: Machine,
    /// Ranks on the node (GPUs, or the CPU ranks).
    pub ranks: usize,
    /// Node cache cap (`DATA.CACHE_SIZE_GB`; 0 without `USE_RAM_CACHE`).
    pub cache_cap: u64,
    /// Who shares the cache (`DATA.CACHE_SHARING`).
    pub cache_sharing: CacheSharing,
    /// Jobs planned for (`Machine::jobs`).
    pub jobs: usize,
    /// Copies of the cache the jobs hold: one with `node` sharing, one per job
    /// with `job`, none without `USE_RAM_CACHE`.
    pub cache_copies: u64,
    /// What the ranks' read orders may take in each cache server beside the
    /// cap (`cache serve --read-order-budget`, its default); 0 without a cache.
    pub read_order_budget: u64,
    /// Compact size of the training split, when `DATA.ROOT` is set.
    pub dataset_bytes: Option<u64>,
    /// Loader threads of the node (`TOTAL_WORKERS`, `auto` resolved).
    pub node_workers: u32,
    /// `TOTAL_WORKERS: auto` before the memory cap, when the cap lowered it.
    pub workers_capped_from: Option<u32>,
    /// Loader threads of one rank.
    pub rank_workers: u32,
    /// One training sample: L x (blur + sharp 3 x crop^2 + K x spike crop) f32.
    pub sample_bytes: u64,
    /// Whether the spike grid was assumed at half the RGB resolution (no `DATA.ROOT`).
    pub spike_grid_assumed: bool,
    /// Samples in flight or ready per rank: workers x prefetch x batch.
    pub rank_samples_in_flight: u64,
    /// Loader bytes of one rank: samples in flight x sample bytes.
    pub rank_loader: u64,
    /// Model parameters.
    pub params: u64,
    /// fp32 parameters.
    pub param_bytes: u64,
    /// fp32 gradients.
    pub grad_bytes: u64,
    /// AdamW first and second moments (fp32).
    pub optimizer_bytes: u64,
    /// Parameters, gradients and optimizer state of one rank.
    pub rank_model: u64,
    /// Host bytes: cache copies x cap + jobs x ranks x loader (+ model states of
    /// CPU ranks).
    pub host_total: u64,
    /// Host total over RAM.
    pub host_share: f64,
    /// The guides' warnings, each with what to try.
    pub warnings: Vec<String>,
    /// Terms that cannot fit at all (the launcher refuses such a plan), each naming
    /// the term and the key to change.
    pub misfits: Vec<String>,
    /// One training step measured on a device (`--measure`).
    pub measured: Option<Measured>,
}

/// Share of RAM the host total may use before the plan warns (and before
/// `TOTAL_WORKERS: auto` is lowered to fit).
pub const HOST_SHARE_LIMIT: f64 = 0.9;

/// The loader threads of a node: `TOTAL_WORKERS` resolved for `machine`, and for
/// `auto` lowered (to at least one per rank) when the loader's in-flight bytes
/// would push the host total above [`HOST_SHARE_LIMIT`] of RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeWorkers {
    /// Loader threads of the node.
    pub workers: u32,
    /// What `auto` gave before the memory cap, when the cap lowered it.
    pub capped_from: Option<u32>,
}

/// See [`NodeWorkers`]; `sample` is the bytes of one training sample.
pub fn node_workers(config: &Config, machine: Machine, sample: u64) -> NodeWorkers {
    let dl = &config.dataloader;
    let wanted = dl.total_workers.resolve(machine.cores, machine.gpus);
    if dl.total_workers != Workers::Auto {
        return NodeWorkers {
            workers: wanted,
            capped_from: None,
        };
    }
    let ranks = machine.ranks() as u64;
    let cache = if config.data.use_ram_cache {
        config.data.cache_bytes()
    } else {
        0
    };
    let budget = (HOST_SHARE_LIMIT * machine.ram_bytes as f64) as u64;
    let per_worker =
        (u64::from(dl.train_prefetch_factor) * u64::from(config.train.batch_size) * sample).max(1);
    let fit = budget.saturating_sub(cache) / per_worker;
    let floor = ranks;
    let cap = u32::try_from(fit.max(floor)).unwrap_or(u32::MAX);
    if wanted > cap {
        NodeWorkers {
            workers: cap,
            capped_from: Some(wanted),
        }
    } else {
        NodeWorkers {
            workers: wanted,
            capped_from: None,
        }
    }
}

/// Parameters of the model `cfg` describes (built on the CPU).
pub fn model_params(cfg: &ModelConfig) -> Result<u64, crate::model::ModelError> {
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    crate::model::build(&vs.root(), cfg)?;
    Ok(vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as u64)
        .sum())
}

/// The training split of `DATA.ROOT` as the plan needs it; `None` without a root.
pub fn dataset_facts(config: &Config) -> Result<Option<DatasetFacts>, DataError> {
    let Some(root) = &config.data.root else {
        return Ok(None);
    };
    let index = DatasetIndex::open(root, "train", IndexOptions::from_config(&config.data))?;
    let first = index.sequences.first();
    Ok(Some(DatasetFacts {
        compact_bytes: index.compact_bytes(),
        frames: index.frame_count(),
        height: first.map_or(0, |s| s.height),
        width: first.map_or(0, |s| s.width),
        spike_height: first.map_or(0, |s| s.spike_height),
        spike_width: first.map_or(0, |s| s.spike_width),
    }))
}

/// Rows and columns of the spike crop under a `DATA.CROP_SIZE` crop, on the spike
/// grid of `dataset` or, without one, at half the RGB resolution (then `true`).
pub fn spike_crop(config: &Config, dataset: Option<&DatasetFacts>) -> (u64, u64, bool) {
    let crop = u64::from(config.data.crop_size);
    match dataset {
        Some(d) if d.height > 0 && d.width > 0 => (
            crop * u64::from(d.spike_height) / u64::from(d.height),
            crop * u64::from(d.spike_width) / u64::from(d.width),
            false,
        ),
        _ => (crop / 2, crop / 2, true),
    }
}

/// Bytes of one training sample of `config` (`DATA.CROP_SIZE`, `CLIP_LEN`,
/// `SPIKE_BINS`), with the spike grid of `dataset` or, without one, half the RGB
/// resolution. Returns the bytes and whether the grid was assumed.
pub fn sample_bytes(config: &Config, dataset: Option<&DatasetFacts>) -> (u64, bool) {
    let crop = u64::from(config.data.crop_size);
    let (spike_rows, spike_cols, assumed) = spike_crop(config, dataset);
    let per_frame =
        2 * 3 * crop * crop + u64::from(config.data.spike_bins) * spike_rows * spike_cols;
    (4 * u64::from(config.data.clip_len) * per_frame, assumed)
}

/// The plan of `config` on `machine` for a model of `params` parameters.
pub fn plan(
    config: &Config,
    machine: Machine,
    params: u64,
    dataset: Option<&DatasetFacts>,
) -> Plan {
    let ranks = machine.ranks();
    let (sample, assumed) = sample_bytes(config, dataset);
    let workers = node_workers(config, machine, sample);
    let node_workers = workers.workers;
    let rank_workers = (node_workers / ranks as u32).max(1);
    let in_flight = u64::from(rank_workers)
        * u64::from(config.dataloader.train_prefetch_factor)
        * u64::from(config.train.batch_size);
    let rank_loader = in_flight * sample;
    let param_bytes = 4 * params;
    let rank_model = 4 * param_bytes; // parameters, gradients, two AdamW moments
    let cache_cap = if config.data.use_ram_cache {
        config.data.cache_bytes()
    } else {
        0
    };
    let host_model = if machine.gpus == 0 {
        ranks as u64 * rank_model
    } else {
        0
    };
    let jobs = machine.jobs.max(1);
    let cache_copies = match (cache_cap, config.data.cache_sharing) {
        (0, _) => 0,
        (_, CacheSharing::Node) => 1,
        (_, CacheSharing::Job) => jobs as u64,
    };
    let read_order_budget = match cache_cap {
        0 => 0,
        _ => READ_ORDER_BUDGET,
    };
    let host_total = cache_copies * (cache_cap + read_order_budget)
        + jobs as u64 * (ranks as u64 * rank_loader + host_model);
    let mut plan = Plan {
        machine,
        ranks,
        cache_cap,
        cache_sharing: config.data.cache_sharing,
        jobs,
        cache_copies,
        read_order_budget,
        dataset_bytes: dataset.map(|d| d.compact_bytes),
        node_workers,
        workers_capped_from: workers.capped_from,
        rank_workers,
        sample_bytes: sample,
        spike_grid_assumed: assumed,
        rank_samples_in_flight: in_flight,
        rank_loader,
        params,
        param_bytes,
        grad_bytes: param_bytes,
        optimizer_bytes: 2 * param_bytes,
        rank_model,
        host_total,
        host_share: host_total as f64 / machine.ram_bytes.max(1) as f64,
        warnings: Vec::new(),
        misfits: Vec::new(),
        measured: None,
    };
    plan.warnings = warnings(&plan);
    plan.misfits = misfits(&plan);
    plan
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / GIB
}

/// The warnings of the user's guides, each saying what to try.
fn warnings(p: &Plan) -> Vec<String> {
    let m = &p.machine;
    let mut out = Vec::new();
    if p.cache_cap > m.ram_bytes / 2 {
        out.push(format!(
            "DATA.CACHE_SIZE_GB: the cache cap {:.1} GiB is above half of the {:.1} GiB RAM; \
             try configs/deblur/vrt_spike_lowmem.yaml (20 GB cache)",
            gib(p.cache_cap),
            gib(m.ram_bytes)
        ));
    }
    if let Some(data) = p.dataset_bytes {
        if p.cache_cap > data {
            out.push(format!(
                "DATA.CACHE_SIZE_GB: the cache cap {:.1} GiB is larger than the whole training \
                 split ({:.1} GiB); {:.0} GB is enough",
                gib(p.cache_cap),
                gib(data),
                gib(data).ceil()
            ));
        }
    }
    if p.node_workers as usize > m.cores {
        out.push(format!(
            "DATALOADER.TOTAL_WORKERS: {} loader threads on {} cores; try \
             configs/deblur/vrt_spike_lowmem.yaml (8 workers) or TOTAL_WORKERS: auto",
            p.node_workers, m.cores
        ));
    }
    if p.host_share > 0.9 {
        out.push(format!(
            "host total {:.1} GiB is {:.0}% of the {:.1} GiB RAM (above 90%); try \
             configs/deblur/vrt_spike_lowmem.yaml (20 GB cache, 8 workers, prefetch 2)",
            gib(p.host_total),
            100.0 * p.host_share,
            gib(m.ram_bytes)
        ));
    }
    if let Some(from) = p.workers_capped_from {
        out.push(format!(
            "DATALOADER.TOTAL_WORKERS: auto would start {from} loader threads; lowered to {} \
             so the loader's in-flight bytes keep the host total under {:.0}% of RAM",
            p.node_workers,
            100.0 * HOST_SHARE_LIMIT
        ));
    }
    out
}

/// The terms that cannot fit at all: the host total above the RAM (naming its
/// largest part), the model states above one GPU's memory.
fn misfits(p: &Plan) -> Vec<String> {
    let m = &p.machine;
    let mut out = Vec::new();
    if p.host_total > m.ram_bytes {
        let all_ranks = (p.jobs * p.ranks) as u64;
        let loader = all_ranks * p.rank_loader;
        let cache = p.cache_copies * p.cache_cap;
        let host_model = p.host_total - cache - loader;
        let copies = match p.cache_copies {
            0 | 1 => String::new(),
            n => format!("{n} copies (one per job, DATA.CACHE_SHARING: job) x "),
        };
        let terms = [
            (
                cache,
                format!(
                    "cache {copies}{:.1} GiB (DATA.CACHE_SIZE_GB)",
                    gib(p.cache_cap)
                ),
            ),
            (
                loader,
                format!(
                    "loaders {all_ranks} rank(s) x {:.2} GiB (DATALOADER.TOTAL_WORKERS, \
                     TRAIN_PREFETCH_FACTOR, TRAIN.BATCH_SIZE)",
                    gib(p.rank_loader)
                ),
            ),
            (
                host_model,
                format!("model states {:.1} GiB (MODEL)", gib(host_model)),
            ),
        ];
        let mut named: Vec<&(u64, String)> = terms.iter().filter(|(b, _)| *b > 0).collect();
        named.sort_by_key(|t| std::cmp::Reverse(t.0));
        let parts: Vec<&str> = named.iter().map(|(_, s)| s.as_str()).collect();
        out.push(format!(
            "host total {:.1} GiB > RAM {:.1} GiB: {}",
            gib(p.host_total),
            gib(m.ram_bytes),
            parts.join(" + ")
        ));
    }
    if let Some(gpu) = m.gpu_mem_bytes {
        if m.gpus > 0 && p.rank_model > gpu {
            out.push(format!(
                "model states {:.1} GiB > GPU memory {:.1} GiB: the model's parameters, \
                 gradients and AdamW state (MODEL; try configs/deblur/vrt_spike_fast.yaml)",
                gib(p.rank_model),
                gib(gpu)
            ));
        }
    }
    out
}

impl Plan {
    /// How the cache is counted: once for the node's jobs on this dataset, or once
    /// per job.
    fn cache_copies_text(&self) -> String {
        match (self.cache_copies, self.cache_sharing) {
            (0, _) => String::new(),
            (_, CacheSharing::Node) => format!(
                "; shared by this user's jobs on this dataset (DATA.CACHE_SHARING: node), \
                 counted once{}",
                match self.jobs {
                    1 => String::new(),
                    n => format!(" for the {n} jobs"),
                }
            ),
            (n, CacheSharing::Job) => {
                format!("; one per job (DATA.CACHE_SHARING: job), counted {n} time(s)")
            }
        }
    }

    /// The plan as aligned text lines.
    pub fn render_text(&self) -> String {
        let m = &self.machine;
        let mut lines = vec![format!(
            "machine: {:.1} GiB RAM, {} cores, {} GPU(s){}",
            gib(m.ram_bytes),
            m.cores,
            m.gpus,
            m.gpu_mem_bytes
                .map(|b| format!(" of {:.1} GiB", gib(b)))
                .unwrap_or_default()
        )];
        let dataset = self
            .dataset_bytes
            .map(|b| format!(" (training split {:.2} GiB)", gib(b)))
            .unwrap_or_else(|| " (set DATA.ROOT to compare with the dataset)".into());
        lines.push(format!(
            "cache cap: {:.2} GiB{dataset}{}{}",
            gib(self.cache_cap),
            match self.read_order_budget {
                0 => String::new(),
                b => format!(
                    " + up to {:.0} MiB of read orders (cache serve --read-order-budget)",
                    b as f64 / (1u64 << 20) as f64
                ),
            },
            self.cache_copies_text()
        ));
        lines.push(format!(
            "loader per rank: {} workers x {} samples ahead = {} samples x {:.2} MiB = {:.2} GiB{}",
            self.rank_workers,
            self.rank_samples_in_flight / u64::from(self.rank_workers.max(1)),
            self.rank_samples_in_flight,
            self.sample_bytes as f64 / (1u64 << 20) as f64,
            gib(self.rank_loader),
            if self.spike_grid_assumed {
                " (spike grid assumed at half resolution)"
            } else {
                ""
            }
        ));
        lines.push(format!(
            "model per rank: {} parameters: {:.2} GiB parameters + {:.2} GiB gradients + \
             {:.2} GiB AdamW = {:.2} GiB (activations not included)",
            self.params,
            gib(self.param_bytes),
            gib(self.grad_bytes),
            gib(self.optimizer_bytes),
            gib(self.rank_model)
        ));
        let jobs = match self.jobs {
            1 => String::new(),
            n => format!("{n} jobs x "),
        };
        lines.push(format!(
            "host total: {:.2} GiB for {jobs}{} rank(s) = {:.1}% of RAM",
            gib(self.host_total),
            self.ranks,
            100.0 * self.host_share
        ));
        if let Some(m) = &self.measured {
            lines.push(format!(
                "measured one step on {} (batch {:?}, voxels {:?}, {:.2} s): peak allocated \
                 {:.2} GiB{} [{}]",
                m.device,
                m.batch_shape,
                m.voxel_shape,
                m.step_seconds,
                gib(m.peak_allocated),
                m.peak_reserved
                    .map(|r| format!(", peak reserved {:.2} GiB", gib(r)))
                    .unwrap_or_default(),
                m.source
            ));
        }
        for w in &self.warnings {
            lines.push(format!("warning: {w}"));
        }
        for w in &self.misfits {
            lines.push(format!("cannot fit: {w}"));
        }
        lines.join("\n") + "\n"
    }
}

/// What one measured step took.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Measured {
    /// The device, `cpu` or `cuda:N`.
    pub device: String,
    /// Where the figures come from.
    pub source: String,
    /// Blur input shape (B, L, 3, crop, crop).
    pub batch_shape: Vec<i64>,
    /// Voxel input shape (B, L, K, rows, columns).
    pub voxel_shape: Vec<i64>,
    /// Peak bytes held by tensors (CUDA), or the rise of the peak resident set (CPU).
    pub peak_allocated: u64,
    /// Peak bytes the CUDA allocator reserved; `None` on the CPU.
    pub peak_reserved: Option<u64>,
    /// Wall time of the step, seconds (first step: includes warm-up).
    pub step_seconds: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn small() -> Config {
        Config::parse(
            "DATA:\n  CROP_SIZE: 64\n  CLIP_LEN: 4\n  SPIKE_BINS: 8\n  CACHE_SIZE_GB: 2\n\
             DATALOADER:\n  TOTAL_WORKERS: 6\n  TRAIN_PREFETCH_FACTOR: 3\n\
             TRAIN:\n  BATCH_SIZE: 2\n",
            Path::new("small.yaml"),
        )
        .unwrap()
    }

    const GB: u64 = 1 << 30;

    #[test]
    fn figures_match_a_hand_computation() {
        let machine = Machine {
            ram_bytes: 16 * GB,
            cores: 8,
            gpus: 2,
            gpu_mem_bytes: Some(24 * GB),
            cpu_ranks: 1,
            jobs: 1,
        };
        let dataset = DatasetFacts {
            compact_bytes: 3 * GB,
            frames: 100,
            height: 256,
            width: 512,
            spike_height: 64,
            spike_width: 128,
        };
        let p = plan(&small(), machine, 1_000_000, Some(&dataset));
        // Spike crop: 64 x 64/256 = 16 rows, 64 x 128/512 = 16 columns.
        // Sample: 4 bytes x 4 frames x (2 x 3 x 64 x 64 + 8 x 16 x 16) = 16 x 26_624.
        assert_eq!(p.sample_bytes, 425_984);
        assert!(!p.spike_grid_assumed);
        // 6 workers over 2 ranks = 3; 3 workers x 3 prefetch x 2 samples = 18 samples.
        assert_eq!((p.node_workers, p.rank_workers), (6, 3));
        assert_eq!(p.rank_samples_in_flight, 18);
        assert_eq!(p.rank_loader, 18 * 425_984);
        assert_eq!(p.param_bytes, 4_000_000);
        assert_eq!(p.optimizer_bytes, 8_000_000);
        assert_eq!(p.rank_model, 16_000_000);
        // Host: 2 GiB cache + 256 MiB of read orders + 2 ranks x 7_667_712 (model
        // states live on the GPUs).
        assert_eq!(p.host_total, 2 * GB + (256 << 20) + 2 * 7_667_712);
        assert!((p.host_share - p.host_total as f64 / (16 * GB) as f64).abs() < 1e-12);
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
        let text = p.render_text();
        assert!(text.contains("host total"), "{text}");
    }

    #[test]
    fn guide_warnings_fire_and_name_a_preset() {
        let machine = Machine {
            ram_bytes: 3 * GB,
            cores: 4,
            gpus: 0,
            gpu_mem_bytes: None,
            cpu_ranks: 1,
            jobs: 1,
        };
        let dataset = DatasetFacts {
            compact_bytes: GB,
            frames: 10,
            height: 64,
            width: 64,
            spike_height: 64,
            spike_width: 64,
        };
        let p = plan(&small(), machine, 200_000_000, Some(&dataset));
        // No GPU: one CPU rank with the model states on the host.
        assert_eq!(p.ranks, 1);
        assert_eq!(p.rank_workers, 6);
        assert_eq!(
            p.host_total,
            2 * GB + (256 << 20) + p.rank_loader + 3_200_000_000
        );
        let all = p.warnings.join("\n");
        assert!(all.contains("above half of the"), "{all}");
        assert!(
            all.contains("larger than the whole training split"),
            "{all}"
        );
        assert!(all.contains("6 loader threads on 4 cores"), "{all}");
        assert!(all.contains("above 90%"), "{all}");
        assert!(all.contains("vrt_spike_lowmem.yaml"), "{all}");
        assert_eq!(p.warnings.len(), 4, "{all}");
        // Without a dataset the spike grid is taken at half resolution.
        let p = plan(&small(), machine, 1, None);
        assert!(p.spike_grid_assumed);
        assert_eq!(p.sample_bytes, 4 * 4 * (2 * 3 * 64 * 64 + 8 * 32 * 32));
    }

    #[test]
    fn a_plan_that_cannot_fit_names_the_term() {
        let machine = Machine {
            ram_bytes: 16 * GB,
            cores: 8,
            gpus: 1,
            gpu_mem_bytes: Some(GB),
            cpu_ranks: 1,
            jobs: 1,
        };
        let fits = plan(&small(), machine, 1_000, None);
        assert!(fits.misfits.is_empty(), "{:?}", fits.misfits);
        let huge = small()
            .with_overrides(&["DATA.CACHE_SIZE_GB=100000".into()])
            .unwrap();
        let p = plan(&huge, machine, 100_000_000, None);
        assert_eq!(p.misfits.len(), 2, "{:?}", p.misfits);
        assert!(p.misfits[0].starts_with("host total"), "{:?}", p.misfits);
        assert!(
            p.misfits[0].contains("> RAM 16.0 GiB: cache 100000.0 GiB (DATA.CACHE_SIZE_GB)"),
            "{:?}",
            p.misfits
        );
        // 100M parameters: 1.5 GiB of states on a 1 GiB GPU.
        assert!(
            p.misfits[1].contains("> GPU memory 1.0 GiB"),
            "{:?}",
            p.misfits
        );
        assert!(p.render_text().contains("cannot fit: host total"));
    }

    #[test]
    fn cpu_ranks_each_hold_a_loader_and_the_model_states() {
        let machine = Machine {
            ram_bytes: 64 * GB,
            cores: 8,
            gpus: 0,
            gpu_mem_bytes: None,
            cpu_ranks: 2,
            jobs: 1,
        };
        let p = plan(&small(), machine, 1_000_000, None);
        // 6 workers over 2 ranks; each rank holds its loader and 16 MB of states.
        assert_eq!((p.ranks, p.rank_workers), (2, 3));
        assert_eq!(
            p.host_total,
            2 * GB + (256 << 20) + 2 * p.rank_loader + 2 * 16_000_000
        );
    }

    #[test]
    fn a_shared_cache_counts_once_for_several_jobs_and_says_so() {
        let machine = Machine {
            ram_bytes: 64 * GB,
            cores: 8,
            gpus: 1,
            gpu_mem_bytes: None,
            cpu_ranks: 1,
            jobs: 3,
        };
        let shared = plan(&small(), machine, 1_000_000, None);
        assert_eq!(shared.cache_sharing, CacheSharing::Node, "the default");
        assert_eq!(shared.cache_copies, 1);
        let orders = shared.read_order_budget;
        assert_eq!(orders, 256 << 20);
        assert_eq!(shared.host_total, 2 * GB + orders + 3 * shared.rank_loader);
        assert!(shared
            .render_text()
            .contains("+ up to 256 MiB of read orders"));
        let text = shared.render_text();
        assert!(
            text.contains("DATA.CACHE_SHARING: node), counted once for the 3 jobs"),
            "{text}"
        );
        assert!(text.contains("for 3 jobs x 1 rank(s)"), "{text}");
        let own = small()
            .with_overrides(&["DATA.CACHE_SHARING=job".into()])
            .unwrap();
        let each = plan(&own, machine, 1_000_000, None);
        assert_eq!(each.cache_copies, 3);
        assert_eq!(
            each.host_total,
            3 * (2 * GB + orders) + 3 * each.rank_loader
        );
        assert!(
            each.render_text()
                .contains("one per job (DATA.CACHE_SHARING: job), counted 3 time(s)"),
            "{}",
            each.render_text()
        );
        let tiny_ram = Machine {
            ram_bytes: 5 * GB,
            ..machine
        };
        let p = plan(&own, tiny_ram, 1_000_000, None);
        assert!(
            p.misfits[0]
                .contains("cache 3 copies (one per job, DATA.CACHE_SHARING: job) x 2.0 GiB"),
            "{:?}",
            p.misfits
        );
        assert!(plan(&small(), tiny_ram, 1_000_000, None).misfits.is_empty());
    }
}
