//! The rank environment: the torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE, ...)
//! and vrtspike's own (cache address, run directory, device, restart count), as
//! one struct that the launcher turns into variables ([`RankEnv::to_vars`]) and a
//! rank parses once ([`RankEnv::from_vars`]). Every variable name lives here.

use std::fmt;
use std::path::PathBuf;

/// Global rank (torchrun).
pub const RANK: &str = "RANK";
/// Rank on this node (torchrun).
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Ranks in the job (torchrun).
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Ranks on this node (torchrun).
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// This node's index (torchrun).
pub const GROUP_RANK: &str = "GROUP_RANK";
/// This node's index (the name other tools read).
pub const NODE_RANK: &str = "NODE_RANK";
/// Nodes in the job.
pub const NNODES: &str = "NNODES";
/// Host of rank 0's rendezvous store (torchrun).
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// Port of rank 0's rendezvous store (torchrun).
pub const MASTER_PORT: &str = "MASTER_PORT";
/// Restarts before this attempt (torchrun's name).
pub const TORCHELASTIC_RESTART_COUNT: &str = "TORCHELASTIC_RESTART_COUNT";
/// Restarts allowed (torchrun's name).
pub const TORCHELASTIC_MAX_RESTARTS: &str = "TORCHELASTIC_MAX_RESTARTS";
/// Restarts before this attempt (0 on the first).
pub const RESTART_COUNT: &str = "VRTSPIKE_RESTART_COUNT";
/// The node's cache server address (an abstract socket name).
pub const CACHE_ADDR: &str = "VRTSPIKE_CACHE_ADDR";
/// The run directory.
pub const RUN_DIR: &str = "VRTSPIKE_RUN_DIR";
/// The device: `cpu`, `cuda` (the local rank's GPU) or `cuda:<n>`.
pub const DEVICE: &str = "VRTSPIKE_DEVICE";

/// A variable that is missing or cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("environment variable {var}: {message}")]
pub struct EnvError {
    /// The variable, e.g. `WORLD_SIZE`.
    pub var: &'static str,
    /// What is wrong with it.
    pub message: String,
}

/// The device a rank computes on, decided once for the model and the process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The CPU (Gloo between ranks).
    Cpu,
    /// One CUDA device by index (NCCL between ranks).
    Cuda(u32),
}

impl Device {
    /// Parses `cpu`, `cuda` (meaning `cuda:<local_rank>`) or `cuda:<n>`.
    pub fn parse(text: &str, local_rank: u32) -> Result<Device, String> {
        match text.trim() {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(local_rank)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("expected cpu, cuda or cuda:<n>, got {text:?}")),
        }
    }

    /// The CUDA device index, if it is one.
    pub fn cuda_index(self) -> Option<u32> {
        match self {
            Device::Cpu => None,
            Device::Cuda(n) => Some(n),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// Where rank 0's rendezvous store listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    /// `MASTER_ADDR`.
    pub addr: String,
    /// `MASTER_PORT`.
    pub port: u16,
}

/// Everything a rank learns from its environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    /// Global rank, `0..world_size`.
    pub rank: u32,
    /// Rank on this node.
    pub local_rank: u32,
    /// Ranks in the job.
    pub world_size: u32,
    /// Ranks on this node.
    pub local_world_size: u32,
    /// This node's index.
    pub node_rank: u32,
    /// Nodes in the job.
    pub nnodes: u32,
    /// Rank 0's store; always there when `world_size > 1`.
    pub master: Option<Rendezvous>,
    /// Restarts before this attempt.
    pub restart_count: u32,
    /// Restarts the launcher allows.
    pub max_restarts: u32,
    /// The node's cache server, if one runs.
    pub cache_addr: Option<String>,
    /// The run directory, if the launcher named one.
    pub run_dir: Option<PathBuf>,
    /// The device of the model and of the process group.
    pub device: Device,
}

impl RankEnv {
    /// One rank alone on the CPU, outside any launcher.
    pub fn single() -> RankEnv {
        RankEnv {
            rank: 0,
            local_rank: 0,
            world_size: 1,
            local_world_size: 1,
            node_rank: 0,
            nnodes: 1,
            master: None,
            restart_count: 0,
            max_restarts: 0,
            cache_addr: None,
            run_dir: None,
            device: Device::Cpu,
        }
    }

    /// More than one rank.
    pub fn distributed(&self) -> bool {
        self.world_size > 1
    }

    /// The rendezvous store, or an error naming MASTER_ADDR when it is unknown.
    pub fn rendezvous(&self) -> Result<&Rendezvous, EnvError> {
        self.master.as_ref().ok_or_else(|| EnvError {
            var: MASTER_ADDR,
            message: "not set (start ranks with vrtspike-launch or torchrun)".into(),
        })
    }

    /// The variables a launcher sets for this rank (unknown optional ones left out).
    pub fn to_vars(&self) -> Vec<(&'static str, String)> {
        let mut vars = vec![
            (RANK, self.rank.to_string()),
            (LOCAL_RANK, self.local_rank.to_string()),
            (WORLD_SIZE, self.world_size.to_string()),
            (LOCAL_WORLD_SIZE, self.local_world_size.to_string()),
            (GROUP_RANK, self.node_rank.to_string()),
            (NODE_RANK, self.node_rank.to_string()),
            (NNODES, self.nnodes.to_string()),
            (TORCHELASTIC_RESTART_COUNT, self.restart_count.to_string()),
            (TORCHELASTIC_MAX_RESTARTS, self.max_restarts.to_string()),
            (RESTART_COUNT, self.restart_count.to_string()),
            (DEVICE, self.device.to_string()),
        ];
        if let Some(master) = &self.master {
            vars.push((MASTER_ADDR, master.addr.clone()));
            vars.push((MASTER_PORT, master.port.to_string()));
        }
        if let Some(addr) = &self.cache_addr {
            vars.push((CACHE_ADDR, addr.clone()));
        }
        if let Some(dir) = &self.run_dir {
            vars.push((RUN_DIR, dir.display().to_string()));
        }
        vars
    }

    /// Parses the variables `var` looks up. Without RANK it is a single rank;
    /// with RANK, WORLD_SIZE is required, and MASTER_ADDR/PORT when it exceeds 1.
    pub fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<RankEnv, EnvError> {
        let number = |name: &'static str, default: u32| -> Result<u32, EnvError> {
            match var(name) {
                None => Ok(default),
                Some(text) => parse_number(name, &text),
            }
        };
        let rank = number(RANK, 0)?;
        let world_size = number(WORLD_SIZE, 1)?;
        if var(RANK).is_some() && var(WORLD_SIZE).is_none() {
            return Err(EnvError {
                var: WORLD_SIZE,
                message: "RANK is set but WORLD_SIZE is not".into(),
            });
        }
        if rank >= world_size.max(1) {
            return Err(EnvError {
                var: RANK,
                message: format!("rank {rank} is not below WORLD_SIZE {world_size}"),
            });
        }
        let local_rank = number(LOCAL_RANK, rank)?;
        let local_world_size = number(LOCAL_WORLD_SIZE, world_size)?;
        if local_rank >= local_world_size.max(1) {
            return Err(EnvError {
                var: LOCAL_RANK,
                message: format!(
                    "local rank {local_rank} is not below LOCAL_WORLD_SIZE {local_world_size}"
                ),
            });
        }
        let master = rendezvous_from(var, world_size > 1)?;
        let restart_count = match var(RESTART_COUNT) {
            Some(text) => parse_number(RESTART_COUNT, &text)?,
            None => number(TORCHELASTIC_RESTART_COUNT, 0)?,
        };
        let device = match var(DEVICE) {
            None => Device::Cpu,
            Some(text) => Device::parse(&text, local_rank).map_err(|message| EnvError {
                var: DEVICE,
                message,
            })?,
        };
        Ok(RankEnv {
            rank,
            local_rank,
            world_size,
            local_world_size,
            node_rank: number(GROUP_RANK, 0)?,
            nnodes: number(NNODES, 1)?,
            master,
            restart_count,
            max_restarts: number(TORCHELASTIC_MAX_RESTARTS, 0)?,
            cache_addr: var(CACHE_ADDR).filter(|a| !a.is_empty()),
            run_dir: var(RUN_DIR).filter(|d| !d.is_empty()).map(PathBuf::from),
            device,
        })
    }

    /// Parses this process's environment.
    pub fn from_process_env() -> Result<RankEnv, EnvError> {
        RankEnv::from_vars(&|name| std::env::var(name).ok())
    }
}

/// MASTER_ADDR and MASTER_PORT: both or neither, and both when `required`.
fn rendezvous_from(
    var: &dyn Fn(&str) -> Option<String>,
    required: bool,
) -> Result<Option<Rendezvous>, EnvError> {
    let missing = |name: &'static str| EnvError {
        var: name,
        message: "not set (start ranks with vrtspike-launch or torchrun)".into(),
    };
    match (var(MASTER_ADDR), var(MASTER_PORT)) {
        (None, None) if !required => Ok(None),
        (None, _) => Err(missing(MASTER_ADDR)),
        (Some(_), None) => Err(missing(MASTER_PORT)),
        (Some(addr), Some(port)) => {
            let port = port.trim().parse().map_err(|_| EnvError {
                var: MASTER_PORT,
                message: format!("expected a port number, got {port:?}"),
            })?;
            Ok(Some(Rendezvous { addr, port }))
        }
    }
}

fn parse_number(name: &'static str, text: &str) -> Result<u32, EnvError> {
    text.trim().parse().map_err(|_| EnvError {
        var: name,
        message: format!("expected a non-negative integer, got {text:?}"),
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn lookup(pairs: Vec<(&'static str, String)>) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> =
            pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        move |name| map.get(name).cloned()
    }

    fn two_node_rank() -> RankEnv {
        RankEnv {
            rank: 5,
            local_rank: 2,
            world_size: 6,
            local_world_size: 3,
            node_rank: 1,
            nnodes: 2,
            master: Some(Rendezvous {
                addr: "n0".into(),
                port: 29500,
            }),
            restart_count: 2,
            max_restarts: 5,
            cache_addr: Some("vrtspike-cache-n1-7".into()),
            run_dir: Some(PathBuf::from("/runs/x")),
            device: Device::Cuda(2),
        }
    }

    #[test]
    fn variables_round_trip() {
        let env = two_node_rank();
        let vars = env.to_vars();
        let get = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str());
        assert_eq!(get(RANK), Some("5"));
        assert_eq!(get(TORCHELASTIC_RESTART_COUNT), Some("2"));
        assert_eq!(get(DEVICE), Some("cuda:2"));
        assert_eq!(get(MASTER_PORT), Some("29500"));
        assert_eq!(RankEnv::from_vars(&lookup(vars)), Ok(env));
        let alone = RankEnv::single();
        assert_eq!(RankEnv::from_vars(&lookup(alone.to_vars())), Ok(alone));
    }

    #[test]
    fn no_variables_is_one_rank_on_the_cpu() {
        let env = RankEnv::from_vars(&|_| None);
        assert_eq!(env, Ok(RankEnv::single()));
    }

    #[test]
    fn device_is_decided_once_from_the_variable() {
        let mut vars = two_node_rank().to_vars();
        vars.retain(|(k, _)| *k != DEVICE);
        vars.push((DEVICE, "cuda".into()));
        let env = RankEnv::from_vars(&lookup(vars.clone())).map(|e| e.device);
        assert_eq!(env, Ok(Device::Cuda(2)), "cuda means the local rank's GPU");
        assert_eq!(Device::parse("cuda:1", 0), Ok(Device::Cuda(1)));
        assert_eq!(Device::parse(" cpu ", 3), Ok(Device::Cpu));
        vars.retain(|(k, _)| *k != DEVICE);
        vars.push((DEVICE, "tpu".into()));
        let err = RankEnv::from_vars(&lookup(vars)).map_err(|e| e.var);
        assert_eq!(err, Err(DEVICE));
    }

    type Vars = Vec<(&'static str, String)>;

    #[test]
    fn errors_name_the_variable() {
        let base = || {
            vec![
                (RANK, "1".to_string()),
                (WORLD_SIZE, "2".to_string()),
                (MASTER_ADDR, "127.0.0.1".to_string()),
                (MASTER_PORT, "29500".to_string()),
            ]
        };
        let fails = |change: &dyn Fn(&mut Vars)| {
            let mut vars = base();
            change(&mut vars);
            RankEnv::from_vars(&lookup(vars)).map_err(|e| e.var).err()
        };
        assert_eq!(fails(&|_| {}), None);
        assert_eq!(
            fails(&|v| v.retain(|(k, _)| *k != WORLD_SIZE)),
            Some(WORLD_SIZE)
        );
        assert_eq!(fails(&|v| v[0].1 = "2".into()), Some(RANK));
        assert_eq!(fails(&|v| v[0].1 = "x".into()), Some(RANK));
        assert_eq!(
            fails(&|v| v.retain(|(k, _)| *k != MASTER_ADDR)),
            Some(MASTER_ADDR)
        );
        assert_eq!(
            fails(&|v| v.retain(|(k, _)| *k != MASTER_PORT)),
            Some(MASTER_PORT)
        );
        assert_eq!(fails(&|v| v[3].1 = "99999".into()), Some(MASTER_PORT));
        assert_eq!(
            fails(&|v| v.push((LOCAL_RANK, "4".into()))),
            Some(LOCAL_RANK)
        );
        let alone = RankEnv::single();
        let err = alone.rendezvous().map_err(|e| e.to_string());
        assert!(err.is_err_and(|e| e.contains(MASTER_ADDR)));
    }

    #[test]
    fn restart_count_falls_back_to_torchruns_name() {
        let vars = lookup(vec![(TORCHELASTIC_RESTART_COUNT, "4".into())]);
        assert_eq!(RankEnv::from_vars(&vars).map(|e| e.restart_count), Ok(4));
    }
}
