//! The environment every rank of an attempt starts with: the ranks of this node
//! (--gpus/--ranks), and for each one the contract's [`RankEnv`] (whose variable
//! names live in `vrtspike_contract::env`) plus the launcher's defaults for
//! libtorch (OMP_NUM_THREADS, PYTORCH_CUDA_ALLOC_CONF).

use std::path::Path;

use vrtspike_contract::env::{Device, RankEnv, Rendezvous};

use crate::cluster::Topology;

/// How ranks are laid out on every node (the same on each node).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRanks {
    /// Ranks on each node.
    pub per_node: u32,
    /// One GPU per rank (CUDA, NCCL) or CPU ranks (Gloo).
    pub gpus: bool,
}

/// Why --gpus/--ranks cannot be honoured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RanksError {
    /// --ranks given with GPUs.
    #[error("--ranks is for CPU ranks (--gpus 0); with GPUs there is one rank per GPU")]
    RanksWithGpus,
    /// More GPUs asked for than visible.
    #[error("--gpus {asked} asks for more GPUs than the {visible} visible here (CUDA_VISIBLE_DEVICES / the NVIDIA driver)")]
    TooManyGpus {
        /// --gpus.
        asked: u32,
        /// GPUs visible.
        visible: u32,
    },
    /// --ranks 0.
    #[error("--ranks must be at least 1")]
    NoRanks,
}

impl NodeRanks {
    /// The ranks of this node from --gpus (default: every visible GPU) and --ranks
    /// (CPU ranks, default 1, only with no GPU).
    pub fn from_args(
        gpus: Option<u32>,
        ranks: Option<u32>,
        visible_gpus: u32,
    ) -> Result<NodeRanks, RanksError> {
        let gpus = gpus.unwrap_or(visible_gpus);
        if gpus > 0 {
            if ranks.is_some_and(|r| r != gpus) {
                return Err(RanksError::RanksWithGpus);
            }
            if gpus > visible_gpus {
                return Err(RanksError::TooManyGpus {
                    asked: gpus,
                    visible: visible_gpus,
                });
            }
            return Ok(NodeRanks {
                per_node: gpus,
                gpus: true,
            });
        }
        match ranks.unwrap_or(1) {
            0 => Err(RanksError::NoRanks),
            per_node => Ok(NodeRanks {
                per_node,
                gpus: false,
            }),
        }
    }
}

/// What one attempt shares between its ranks.
#[derive(Debug, Clone)]
pub struct AttemptEnv<'a> {
    /// The node layout.
    pub topology: &'a Topology,
    /// The ranks of each node.
    pub ranks: NodeRanks,
    /// The port every rank meets on.
    pub master_port: u16,
    /// Restarts before this attempt.
    pub restart_count: u32,
    /// The launcher's --max-restarts.
    pub max_restarts: u32,
    /// The node's cache server address.
    pub cache_addr: Option<&'a str>,
    /// The run directory (absolute).
    pub run_dir: &'a Path,
    /// OMP_NUM_THREADS for each rank, unless the user set it.
    pub threads_per_rank: u32,
    /// The factor on the gradient accumulation that keeps the job's global batch
    /// in a world elastic membership shrank (1: none, and no variable set).
    pub accumulation: u32,
}

impl AttemptEnv<'_> {
    /// Ranks in the whole job.
    pub fn world_size(&self) -> u32 {
        self.topology.nnodes * self.ranks.per_node
    }

    /// Global rank of a local rank on this node.
    pub fn global_rank(&self, local_rank: u32) -> u32 {
        self.topology.node_rank * self.ranks.per_node + local_rank
    }

    /// The contract environment of local rank `local_rank`.
    pub fn rank_env(&self, local_rank: u32) -> RankEnv {
        let topo = self.topology;
        RankEnv {
            rank: self.global_rank(local_rank),
            local_rank,
            world_size: self.world_size(),
            local_world_size: self.ranks.per_node,
            node_rank: topo.node_rank,
            nnodes: topo.nnodes,
            master: Some(Rendezvous {
                addr: topo.master_addr.clone(),
                port: self.master_port,
            }),
            restart_count: self.restart_count,
            max_restarts: self.max_restarts,
            cache_addr: self.cache_addr.map(str::to_string),
            run_dir: Some(self.run_dir.to_path_buf()),
            device: if self.ranks.gpus {
                Device::Cuda(local_rank)
            } else {
                Device::Cpu
            },
            run_id: None,
            slurm: None,
        }
    }

    /// The variables for local rank `local_rank`; `inherited` looks up the
    /// launcher's own environment (a user's setting of an optional variable wins).
    pub fn vars(
        &self,
        local_rank: u32,
        inherited: &dyn Fn(&str) -> Option<String>,
    ) -> Vec<(String, String)> {
        let mut vars: Vec<(String, String)> = self
            .rank_env(local_rank)
            .to_vars()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        if self.accumulation > 1 {
            vars.push((
                vrtspike_contract::env::ACCUMULATION.to_string(),
                self.accumulation.to_string(),
            ));
        }
        let defaults = [
            (
                "PYTORCH_CUDA_ALLOC_CONF",
                "expandable_segments:True".to_string(),
            ),
            ("OMP_NUM_THREADS", self.threads_per_rank.to_string()),
        ];
        for (name, value) in defaults {
            if inherited(name).is_none() {
                vars.push((name.to_string(), value));
            }
        }
        vars
    }
}

/// GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else the driver's
/// device list (0 on a machine without the NVIDIA driver).
pub fn visible_gpus(env: &dyn Fn(&str) -> Option<String>) -> u32 {
    if let Some(list) = env("CUDA_VISIBLE_DEVICES") {
        let list = list.trim();
        // CUDA stops at the first invalid entry, e.g. "-1" hides every GPU.
        return list
            .split(',')
            .map(str::trim)
            .take_while(|id| !id.is_empty() && !id.starts_with('-'))
            .count() as u32;
    }
    std::fs::read_dir("/proc/driver/nvidia/gpus")
        .map(|dir| dir.count() as u32)
        .unwrap_or(0)
}

/// Threads per rank that keep the ranks of a node from oversubscribing its cores.
pub fn threads_per_rank(cores: usize, ranks_per_node: u32) -> u32 {
    let per = cores / (ranks_per_node.max(1) as usize);
    per.max(1) as u32
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::PathBuf;

    use vrtspike_contract::env as names;

    use super::*;

    #[test]
    fn contract_for_node_one_of_two() {
        let topology = Topology {
            nnodes: 2,
            node_rank: 1,
            master_addr: "n0".into(),
            master_port: Some(29500),
            source: "flags",
        };
        let run_dir = PathBuf::from("/runs/x");
        let env = AttemptEnv {
            topology: &topology,
            ranks: NodeRanks {
                per_node: 3,
                gpus: true,
            },
            master_port: 29500,
            restart_count: 2,
            max_restarts: 5,
            cache_addr: Some("addr"),
            run_dir: &run_dir,
            threads_per_rank: 4,
            accumulation: 1,
        };
        let user = |name: &str| (name == "OMP_NUM_THREADS").then(|| "7".to_string());
        let vars: HashMap<String, String> = env.vars(2, &user).into_iter().collect();
        let get = |k: &str| vars.get(k).map(String::as_str);
        assert_eq!(get(names::RANK), Some("5"));
        assert_eq!(get(names::LOCAL_RANK), Some("2"));
        assert_eq!(get(names::WORLD_SIZE), Some("6"));
        assert_eq!(get(names::LOCAL_WORLD_SIZE), Some("3"));
        assert_eq!(get(names::MASTER_ADDR), Some("n0"));
        assert_eq!(get(names::MASTER_PORT), Some("29500"));
        assert_eq!(get(names::RESTART_COUNT), Some("2"));
        assert_eq!(get(names::DEVICE), Some("cuda:2"));
        assert_eq!(get(names::RUN_DIR), Some("/runs/x"));
        assert_eq!(get(names::CACHE_ADDR), Some("addr"));
        // What the rank parses is what the launcher meant.
        let parsed = RankEnv::from_vars(&|k: &str| vars.get(k).cloned());
        assert_eq!(parsed, Ok(env.rank_env(2)));
        assert_eq!(
            get("PYTORCH_CUDA_ALLOC_CONF"),
            Some("expandable_segments:True")
        );
        // The user's own setting is inherited, not overridden.
        assert_eq!(get("OMP_NUM_THREADS"), None);
        assert_eq!(get(names::ACCUMULATION), None, "no factor in a full world");
        // A world elastic membership shrank to a half keeps the global batch.
        let shrunk = AttemptEnv {
            accumulation: 2,
            ..env.clone()
        };
        let vars: HashMap<String, String> = shrunk.vars(0, &user).into_iter().collect();
        assert_eq!(vars.get(names::ACCUMULATION).map(String::as_str), Some("2"));
    }

    #[test]
    fn visible_gpus_from_cuda_visible_devices() {
        let with = |value: &'static str| {
            move |name: &str| (name == "CUDA_VISIBLE_DEVICES").then(|| value.to_string())
        };
        assert_eq!(visible_gpus(&with("0,1,3")), 3);
        assert_eq!(visible_gpus(&with("")), 0);
        assert_eq!(visible_gpus(&with("-1")), 0);
        assert_eq!(visible_gpus(&with("GPU-abc,GPU-def")), 2);
    }

    #[test]
    fn ranks_from_gpus_and_cpu_ranks() {
        let cpu = |per_node| NodeRanks {
            per_node,
            gpus: false,
        };
        let gpu = |per_node| NodeRanks {
            per_node,
            gpus: true,
        };
        assert_eq!(NodeRanks::from_args(None, None, 0), Ok(cpu(1)));
        assert_eq!(NodeRanks::from_args(Some(0), Some(2), 4), Ok(cpu(2)));
        assert_eq!(NodeRanks::from_args(None, None, 4), Ok(gpu(4)));
        assert_eq!(NodeRanks::from_args(Some(3), None, 4), Ok(gpu(3)));
        assert_eq!(
            NodeRanks::from_args(Some(3), None, 0),
            Err(RanksError::TooManyGpus {
                asked: 3,
                visible: 0
            })
        );
        assert_eq!(
            NodeRanks::from_args(Some(2), Some(4), 2),
            Err(RanksError::RanksWithGpus)
        );
        assert_eq!(
            NodeRanks::from_args(Some(0), Some(0), 0),
            Err(RanksError::NoRanks)
        );
    }

    #[test]
    fn threads_split_the_cores() {
        assert_eq!(threads_per_rank(16, 3), 5);
        assert_eq!(threads_per_rank(2, 4), 1);
        assert_eq!(threads_per_rank(8, 0), 8);
    }
}
