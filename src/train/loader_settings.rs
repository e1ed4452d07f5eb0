//! The loader settings of a rank, resolved once for the run: `TOTAL_WORKERS` for this
//! node (`auto`: 80% of the cores with at least 4 per GPU, less the loader workers
//! other jobs already run through the node's cache server, lowered by the memory
//! plan when the loaders' in-flight bytes would not fit) split over the node's
//! ranks, the training and validation prefetch factors, and `DROP_LAST` (which also
//! picks the training sampler's remainder: drop the tail, or pad by wrapping).

use crate::config::{Config, Workers};
use crate::dataset::DatasetIndex;
use crate::pipeline::loader::LoaderBudget;
use crate::pipeline::sampler::Remainder;
use crate::plan::{self, DatasetFacts, Machine};

/// The node a rank runs on, as the loader settings need it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeFacts {
    /// CPU cores of the node.
    pub cores: usize,
    /// GPUs of the node in use (0 for CPU ranks).
    pub gpus: usize,
    /// Ranks on the node.
    pub local_ranks: usize,
    /// Host RAM in bytes.
    pub ram_bytes: u64,
    /// Loader workers other jobs run through this node's cache server now
    /// (`TOTAL_WORKERS: auto` leaves their cores to them).
    pub other_jobs_workers: usize,
}

impl NodeFacts {
    /// This machine, with `local_ranks` ranks on GPUs (`on_gpu`) or CPU.
    pub fn this_machine(local_ranks: usize, on_gpu: bool) -> NodeFacts {
        let mut sys = sysinfo::System::new();
        sys.refresh_memory();
        NodeFacts {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            gpus: if on_gpu { local_ranks } else { 0 },
            local_ranks: local_ranks.max(1),
            ram_bytes: sys.total_memory(),
            other_jobs_workers: 0,
        }
    }
}

/// The resolved loader settings of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoaderSettings {
    /// Loader threads of the node.
    pub node_workers: u32,
    /// `auto`'s count before the memory cap, when the cap lowered it.
    pub capped_from: Option<u32>,
    /// `auto`'s count before the workers of other jobs on the node's cache server
    /// were left their cores, when there were any.
    pub shared_from: Option<u32>,
    /// This rank's workers, prefetch factors and `DROP_LAST`.
    pub budget: LoaderBudget,
    /// The training sampler's remainder (`DROP_LAST`: drop; else pad).
    pub remainder: Remainder,
}

impl LoaderSettings {
    /// Resolves the loader settings of `config` on `node`, with the sample shape of
    /// the training split `index` (its spike grid).
    pub fn resolve(
        config: &Config,
        node: NodeFacts,
        index: Option<&DatasetIndex>,
    ) -> LoaderSettings {
        let machine = Machine {
            ram_bytes: node.ram_bytes,
            cores: node.cores,
            gpus: node.gpus,
            gpu_mem_bytes: None,
            cpu_ranks: node.local_ranks,
            jobs: 1,
        };
        let facts = index.and_then(grid_facts);
        let (sample, _) = plan::sample_bytes(config, facts.as_ref());
        let workers = plan::node_workers(config, machine, sample);
        let (node_workers, shared_from) = leave_to_other_jobs(config, workers.workers, node);
        let per_rank = (node_workers as usize / node.local_ranks.max(1)).max(1);
        LoaderSettings {
            node_workers,
            capped_from: workers.capped_from,
            shared_from,
            budget: LoaderBudget::new(config, per_rank),
            remainder: if config.dataloader.drop_last {
                Remainder::Drop
            } else {
                Remainder::Pad
            },
        }
    }

    /// Logs the settings once (rank 0), the memory cap as a warning.
    pub fn log(&self) {
        if let Some(from) = self.capped_from {
            tracing::warn!(
                "DATALOADER.TOTAL_WORKERS: auto lowered from {from} to {} loader threads on this \
                 node: the loaders' in-flight bytes would push host memory above {:.0}% of RAM",
                self.node_workers,
                100.0 * plan::HOST_SHARE_LIMIT
            );
        }
        if let Some(from) = self.shared_from {
            tracing::info!(
                "DATALOADER.TOTAL_WORKERS: auto lowered from {from} to {} loader threads on this \
                 node: other jobs already run {} through the node's cache server",
                self.node_workers,
                from - self.node_workers
            );
        }
        let b = &self.budget;
        tracing::info!(
            node_workers = self.node_workers,
            rank_workers = b.workers,
            train_prefetch = b.train_prefetch_factor,
            val_prefetch = b.val_prefetch_factor,
            drop_last = b.drop_last,
            "loader"
        );
    }
}

/// `workers` of the node for `TOTAL_WORKERS: auto`, less the workers other jobs
/// run through its cache server (at least one a rank); with what it was, when
/// lowered. A count in the config is kept as it is.
fn leave_to_other_jobs(config: &Config, workers: u32, node: NodeFacts) -> (u32, Option<u32>) {
    let others = u32::try_from(node.other_jobs_workers).unwrap_or(u32::MAX);
    if config.dataloader.total_workers != Workers::Auto || others == 0 {
        return (workers, None);
    }
    let floor = u32::try_from(node.local_ranks.max(1)).unwrap_or(u32::MAX);
    let left = workers.saturating_sub(others).max(floor);
    (left, (left < workers).then_some(workers))
}

/// The sizes of the first sequence of `index` (the sample shape needs only those).
fn grid_facts(index: &DatasetIndex) -> Option<DatasetFacts> {
    let first = index.sequences.first()?;
    Some(DatasetFacts {
        compact_bytes: 0,
        frames: index.frame_count(),
        height: first.height,
        width: first.width,
        spike_height: first.spike_height,
        spike_width: first.spike_width,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const GB: u64 = 1 << 30;

    fn node(cores: usize, gpus: usize, local_ranks: usize, ram_bytes: u64) -> NodeFacts {
        NodeFacts {
            cores,
            gpus,
            local_ranks,
            ram_bytes,
            other_jobs_workers: 0,
        }
    }

    fn config(text: &str) -> Config {
        Config::parse(text, Path::new("t.yaml")).unwrap()
    }

    #[test]
    fn workers_split_over_ranks_with_prefetch_and_drop_last() {
        let node = node(40, 4, 4, 256 * GB);
        let c = config(
            "DATALOADER:\n  TOTAL_WORKERS: 12\n  TRAIN_PREFETCH_FACTOR: 3\n  \
             VAL_PREFETCH_FACTOR: 5\n  DROP_LAST: false\n",
        );
        let p = LoaderSettings::resolve(&c, node, None);
        assert_eq!((p.node_workers, p.budget.workers), (12, 3));
        assert_eq!(
            (p.budget.train_prefetch_factor, p.budget.val_prefetch_factor),
            (3, 5)
        );
        assert!(!p.budget.drop_last);
        assert_eq!(p.remainder, Remainder::Pad);
        // auto: 80% of 40 cores = 32 over 4 ranks; DROP_LAST (default) drops.
        let p = LoaderSettings::resolve(&config("{}"), node, None);
        assert_eq!(
            (p.node_workers, p.budget.workers, p.capped_from),
            (32, 8, None)
        );
        assert_eq!(p.remainder, Remainder::Drop);
        // Fewer workers than ranks: still one each.
        let p = LoaderSettings::resolve(&config("DATALOADER:\n  TOTAL_WORKERS: 2\n"), node, None);
        assert_eq!(p.budget.workers, 1);
    }

    #[test]
    fn auto_leaves_other_jobs_workers_their_cores() {
        let node = NodeFacts {
            cores: 40,
            gpus: 4,
            local_ranks: 4,
            ram_bytes: 256 * GB,
            other_jobs_workers: 20,
        };
        // auto: 32 less the 20 other jobs run, over 4 ranks.
        let p = LoaderSettings::resolve(&config("{}"), node, None);
        assert_eq!(
            (p.node_workers, p.budget.workers, p.shared_from),
            (12, 3, Some(32))
        );
        // Never below one a rank.
        let crowded = NodeFacts {
            other_jobs_workers: 500,
            ..node
        };
        let p = LoaderSettings::resolve(&config("{}"), crowded, None);
        assert_eq!((p.node_workers, p.budget.workers), (4, 1));
        // A count in the config is the user's: kept.
        let p = LoaderSettings::resolve(&config("DATALOADER:\n  TOTAL_WORKERS: 80\n"), node, None);
        assert_eq!((p.node_workers, p.shared_from), (80, None));
    }

    #[test]
    fn auto_is_capped_by_the_memory_plan() {
        // Sample: 4 B x 6 frames x (2 x 3 x 256^2 + 8 x 128^2) = 12 MiB; a worker
        // holds prefetch 2 x batch 1 = 24 MiB. 10 GiB RAM, 8 GiB cache: 0.9 x 10 - 8 =
        // 1 GiB left = 42 workers; auto wants 80% of 64 cores = 51.
        let node = node(64, 0, 1, 10 * GB);
        let c = config(
            "DATA:\n  CACHE_SIZE_GB: 8\n  CLIP_LEN: 6\n  SPIKE_BINS: 8\n  CROP_SIZE: 256\n\
             TRAIN:\n  BATCH_SIZE: 1\n",
        );
        let p = LoaderSettings::resolve(&c, node, None);
        assert_eq!(p.capped_from, Some(51));
        assert_eq!(p.node_workers, 42);
        // A count is never changed.
        let c = c
            .with_overrides(&["DATALOADER.TOTAL_WORKERS=60".into()])
            .unwrap();
        let p = LoaderSettings::resolve(&c, node, None);
        assert_eq!((p.node_workers, p.capped_from), (60, None));
    }
}
