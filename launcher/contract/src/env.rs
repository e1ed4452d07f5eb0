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
/// torchrun's id of the job (`--rdzv-id`; a fresh one with `--standalone`).
pub const TORCHELASTIC_RUN_ID: &str = "TORCHELASTIC_RUN_ID";
/// The factor on `TRAIN.GRADIENT_ACCUMULATION_STEPS` that keeps the job's global
/// batch after elastic membership shrank the world (the job's first world over
/// this one; absent: 1). The launcher sets it; the rank multiplies.
pub const ACCUMULATION: &str = "VRTSPIKE_ACCUMULATION";

/// The [`ACCUMULATION`] factor `var` gives (1 when unset); 0 or a non-number is
/// an error naming the variable.
pub fn accumulation_from(var: &dyn Fn(&str) -> Option<String>) -> Result<u32, EnvError> {
    let Some(text) = var(ACCUMULATION) else {
        return Ok(1);
    };
    match parse_number(ACCUMULATION, &text)? {
        0 => Err(EnvError {
            var: ACCUMULATION,
            message: "expected a factor of at least 1, got 0".into(),
        }),
        factor => Ok(factor),
    }
}

/// srun's variables a rank reads when no launcher set RANK (one task per rank).
pub mod slurm {
    /// The task's global rank.
    pub const PROCID: &str = "SLURM_PROCID";
    /// The task's rank on its node.
    pub const LOCALID: &str = "SLURM_LOCALID";
    /// Tasks in the step (set by srun only, not in the batch script).
    pub const STEP_NUM_TASKS: &str = "SLURM_STEP_NUM_TASKS";
    /// Nodes in the step.
    pub const STEP_NUM_NODES: &str = "SLURM_STEP_NUM_NODES";
    /// Nodes in the job.
    pub const NNODES: &str = "SLURM_NNODES";
    /// The node's index in the job.
    pub const NODEID: &str = "SLURM_NODEID";
    /// Tasks on each node of the step, compressed: `2(x3),1`.
    pub const STEP_TASKS_PER_NODE: &str = "SLURM_STEP_TASKS_PER_NODE";
    /// The step's hosts, compressed: `node[01-04]`.
    pub const STEP_NODELIST: &str = "SLURM_STEP_NODELIST";
    /// The job's hosts.
    pub const JOB_NODELIST: &str = "SLURM_JOB_NODELIST";
    /// The job id.
    pub const JOB_ID: &str = "SLURM_JOB_ID";
    /// The step id.
    pub const STEP_ID: &str = "SLURM_STEP_ID";
    /// Times the job was requeued.
    pub const RESTART_COUNT: &str = "SLURM_RESTART_COUNT";
    /// Ports reserved for the step (`srun --resv-ports`): `12000-12001`.
    pub const STEP_RESV_PORTS: &str = "SLURM_STEP_RESV_PORTS";
}

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

/// The srun step a rank was started by when no launcher set RANK: one task per
/// rank, the ranks from srun's variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmStep {
    /// `SLURM_JOB_ID`.
    pub job_id: String,
    /// `SLURM_STEP_ID` (`0` when unset).
    pub step_id: String,
    /// The first host of the step: rank 0's, where the rendezvous store listens.
    pub master_host: String,
}

impl SlurmStep {
    /// `<job>.<step>`: names what belongs to this step (its rendezvous port file).
    pub fn tag(&self) -> String {
        format!("{}.{}", self.job_id, self.step_id)
    }
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
    /// Rank 0's store; there when `world_size > 1`, except under an srun step
    /// without MASTER_PORT (rank 0 then publishes its port, see `slurm`).
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
    /// torchrun's job id (`TORCHELASTIC_RUN_ID`), when torchrun started the rank.
    pub run_id: Option<String>,
    /// The srun step, when srun started the rank without a launcher.
    pub slurm: Option<SlurmStep>,
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
            run_id: None,
            slurm: None,
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
        if let Some(id) = &self.run_id {
            vars.push((TORCHELASTIC_RUN_ID, id.clone()));
        }
        vars
    }

    /// The job this rank belongs to, as a name fit for a path or a socket
    /// (`torchrun-<id>`, `slurm-<job>.<step>`), when a launcher other than
    /// `vrtspike-launch` gave one.
    pub fn job_tag(&self) -> Option<String> {
        if let Some(step) = &self.slurm {
            return Some(format!("slurm-{}", step.tag()));
        }
        self.run_id.as_ref().map(|id| format!("torchrun-{id}"))
    }

    /// The job, node and attempt, as every local rank names them alike (the name of
    /// a job's own cache server, `DATA.CACHE_SHARING: job`): the job from torchrun's
    /// run id or srun's job and step, else from the rendezvous port (ranks of one
    /// job share it), else this process (a rank alone).
    pub fn job_name(&self) -> String {
        let job = match (self.job_tag(), &self.master) {
            (Some(tag), _) => tag,
            (None, Some(master)) if self.distributed() => format!("port{}", master.port),
            _ => format!("pid{}", std::process::id()),
        };
        format!("{job}-n{}-a{}", self.node_rank, self.restart_count)
    }

    /// Parses the variables `var` looks up. Without RANK it is a single rank;
    /// with RANK, WORLD_SIZE is required, and MASTER_ADDR/PORT when it exceeds 1.
    ///
    /// Without RANK inside an srun step (`SLURM_STEP_NUM_TASKS` and `SLURM_PROCID`
    /// set), the ranks come from srun's variables ([`slurm`]).
    pub fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<RankEnv, EnvError> {
        if var(RANK).is_none() && var(slurm::STEP_NUM_TASKS).is_some() {
            if let Some(procid) = var(slurm::PROCID) {
                return from_slurm_step(var, &procid);
            }
        }
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
        let device = device_from(var, local_rank)?;
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
            run_id: run_id_from(var),
            slurm: None,
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

/// VRTSPIKE_DEVICE (default the CPU).
fn device_from(var: &dyn Fn(&str) -> Option<String>, local_rank: u32) -> Result<Device, EnvError> {
    match var(DEVICE) {
        None => Ok(Device::Cpu),
        Some(text) => Device::parse(&text, own_gpu(local_rank, var)).map_err(|message| EnvError {
            var: DEVICE,
            message,
        }),
    }
}

/// The GPU `cuda` means for local rank `local_rank`: the only one visible when
/// CUDA_VISIBLE_DEVICES lists one (srun binds one GPU to each task), else the local
/// rank's.
pub fn own_gpu(local_rank: u32, var: &dyn Fn(&str) -> Option<String>) -> u32 {
    let one_visible = var("CUDA_VISIBLE_DEVICES").is_some_and(|list| {
        let list = list.trim();
        !list.is_empty() && !list.contains(',') && !list.starts_with('-')
    });
    if one_visible {
        0
    } else {
        local_rank
    }
}

/// TORCHELASTIC_RUN_ID, unless unset, empty or torchrun's placeholder `none`.
fn run_id_from(var: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    var(TORCHELASTIC_RUN_ID)
        .map(|id| id.trim().to_string())
        .filter(|id| !id.is_empty() && id != "none")
        .map(|id| {
            id.chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect()
        })
}

/// A rank of an srun step (one task per rank, no launcher): RANK from
/// SLURM_PROCID, WORLD_SIZE from SLURM_STEP_NUM_TASKS, LOCAL_RANK from
/// SLURM_LOCALID, the node from SLURM_NODEID, LOCAL_WORLD_SIZE from this node's
/// entry of SLURM_STEP_TASKS_PER_NODE, and the master from the first host of the
/// step's node list. MASTER_ADDR/MASTER_PORT win when set; without MASTER_PORT the
/// port is the first of SLURM_STEP_RESV_PORTS, else rank 0 publishes one (the
/// rank's `master` stays `None` until then).
fn from_slurm_step(
    var: &dyn Fn(&str) -> Option<String>,
    procid: &str,
) -> Result<RankEnv, EnvError> {
    let required = |name: &'static str| -> Result<u32, EnvError> {
        let text = var(name).ok_or_else(|| EnvError {
            var: name,
            message: "not set (srun sets it for every task)".into(),
        })?;
        parse_number(name, &text)
    };
    let optional = |name: &'static str| var(name).map(|t| parse_number(name, &t)).transpose();
    let rank = parse_number(slurm::PROCID, procid)?;
    let world_size = required(slurm::STEP_NUM_TASKS)?;
    if rank >= world_size.max(1) {
        return Err(EnvError {
            var: slurm::PROCID,
            message: format!("task {rank} is not below SLURM_STEP_NUM_TASKS {world_size}"),
        });
    }
    let local_rank = optional(slurm::LOCALID)?.unwrap_or(0);
    let node_rank = optional(slurm::NODEID)?.unwrap_or(0);
    let list_var = if var(slurm::STEP_NODELIST).is_some() {
        slurm::STEP_NODELIST
    } else {
        slurm::JOB_NODELIST
    };
    let list = var(list_var).ok_or_else(|| EnvError {
        var: slurm::STEP_NODELIST,
        message: "not set: the master is the first host of the step's node list".into(),
    })?;
    let hosts = crate::hostlist::expand(&list).map_err(|e| EnvError {
        var: list_var,
        message: e.to_string(),
    })?;
    let nnodes = match optional(slurm::STEP_NUM_NODES)? {
        Some(n) => n,
        None => optional(slurm::NNODES)?.unwrap_or(u32::try_from(hosts.len()).unwrap_or(1)),
    };
    let local_world_size = match var(slurm::STEP_TASKS_PER_NODE) {
        Some(text) => tasks_on_node(&text, node_rank).map_err(|message| EnvError {
            var: slurm::STEP_TASKS_PER_NODE,
            message,
        })?,
        None => world_size.div_ceil(nnodes.max(1)),
    };
    if local_rank >= local_world_size.max(1) {
        return Err(EnvError {
            var: slurm::LOCALID,
            message: format!(
                "local task {local_rank} is not below this node's {local_world_size} tasks"
            ),
        });
    }
    let master_host = hosts.first().cloned().ok_or_else(|| EnvError {
        var: list_var,
        message: "names no host".into(),
    })?;
    let addr = var(MASTER_ADDR).unwrap_or_else(|| master_host.clone());
    let port = match (var(MASTER_PORT), var(slurm::STEP_RESV_PORTS)) {
        (Some(port), _) => Some(port.trim().parse().map_err(|_| EnvError {
            var: MASTER_PORT,
            message: format!("expected a port number, got {port:?}"),
        })?),
        (None, Some(ports)) => Some(first_port(&ports).map_err(|message| EnvError {
            var: slurm::STEP_RESV_PORTS,
            message,
        })?),
        (None, None) => None,
    };
    let master = port.map(|port| Rendezvous { addr, port });
    let device = device_from(var, local_rank)?;
    let job_id = var(slurm::JOB_ID).ok_or_else(|| EnvError {
        var: slurm::JOB_ID,
        message: "not set (srun sets it for every task)".into(),
    })?;
    Ok(RankEnv {
        rank,
        local_rank,
        world_size,
        local_world_size,
        node_rank,
        nnodes,
        master,
        restart_count: optional(RESTART_COUNT)?
            .or(optional(slurm::RESTART_COUNT)?)
            .unwrap_or(0),
        max_restarts: 0,
        cache_addr: var(CACHE_ADDR).filter(|a| !a.is_empty()),
        run_dir: var(RUN_DIR).filter(|d| !d.is_empty()).map(PathBuf::from),
        device,
        run_id: None,
        slurm: Some(SlurmStep {
            job_id: job_id.trim().to_string(),
            step_id: var(slurm::STEP_ID).map_or_else(|| "0".into(), |s| s.trim().to_string()),
            master_host,
        }),
    })
}

/// The tasks on node `node` of a `SLURM_STEP_TASKS_PER_NODE` list (`2(x3),1`).
pub fn tasks_on_node(text: &str, node: u32) -> Result<u32, String> {
    let mut seen = 0u32;
    for item in text.trim().split(',') {
        let (count, times) = match item.split_once("(x") {
            Some((count, rest)) => {
                let times = rest
                    .strip_suffix(')')
                    .and_then(|t| t.parse::<u32>().ok())
                    .ok_or_else(|| format!("bad repeat in {item:?} of {text:?}"))?;
                (count, times)
            }
            None => (item, 1),
        };
        let count: u32 = count
            .trim()
            .parse()
            .map_err(|_| format!("{item:?} of {text:?} is not a task count"))?;
        if node < seen + times {
            return Ok(count);
        }
        seen += times;
    }
    Err(format!("{text:?} lists {seen} nodes; this is node {node}"))
}

/// The first port of a `SLURM_STEP_RESV_PORTS` range (`12000-12001` or `12000`).
fn first_port(text: &str) -> Result<u16, String> {
    let first = text.trim().split([',', '-']).next().unwrap_or("");
    first
        .trim()
        .parse()
        .map_err(|_| format!("expected ports such as 12000-12001, got {text:?}"))
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
            run_id: Some("job-7".into()),
            slurm: None,
        }
    }

    #[test]
    fn the_accumulation_factor_is_1_unless_set_and_never_0() {
        let none = |_: &str| None;
        assert_eq!(accumulation_from(&none).ok(), Some(1));
        let two = lookup(vec![(ACCUMULATION, "2".into())]);
        assert_eq!(accumulation_from(&two).ok(), Some(2));
        for bad in ["0", "two", "-1"] {
            let var = lookup(vec![(ACCUMULATION, bad.into())]);
            let err = accumulation_from(&var).err().map(|e| e.to_string());
            assert!(
                err.as_deref().is_some_and(|e| e.contains(ACCUMULATION)),
                "{bad}: {err:?}"
            );
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
    fn every_local_rank_names_the_same_job_per_node_and_attempt() {
        let torchrun = |rank: &str, restart: &str| {
            let vars = vec![
                (RANK, rank.to_string()),
                (LOCAL_RANK, rank.to_string()),
                (WORLD_SIZE, "2".to_string()),
                (MASTER_ADDR, "127.0.0.1".to_string()),
                (MASTER_PORT, "29500".to_string()),
                (TORCHELASTIC_RUN_ID, "abc".to_string()),
                (TORCHELASTIC_RESTART_COUNT, restart.to_string()),
            ];
            RankEnv::from_vars(&lookup(vars)).unwrap_or_else(|e| panic!("{e}"))
        };
        assert_eq!(torchrun("0", "0").job_name(), "torchrun-abc-n0-a0");
        assert_eq!(torchrun("1", "0").job_name(), torchrun("0", "0").job_name());
        assert_eq!(torchrun("1", "1").job_name(), "torchrun-abc-n0-a1");
        let homemade = vec![
            (RANK, "1".to_string()),
            (WORLD_SIZE, "2".to_string()),
            (MASTER_ADDR, "127.0.0.1".to_string()),
            (MASTER_PORT, "29500".to_string()),
        ];
        let homemade = RankEnv::from_vars(&lookup(homemade)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(homemade.job_name(), "port29500-n0-a0");
        assert_eq!(
            RankEnv::single().job_name(),
            format!("pid{}-n0-a0", std::process::id())
        );
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
        let bound = |name: &str| (name == "CUDA_VISIBLE_DEVICES").then(|| "3".to_string());
        assert_eq!(own_gpu(2, &bound), 0, "one GPU bound to the task: cuda:0");
        let all = |name: &str| (name == "CUDA_VISIBLE_DEVICES").then(|| "0,1,2,3".to_string());
        assert_eq!(own_gpu(2, &all), 2);
        assert_eq!(own_gpu(2, &|_| None), 2);
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

    fn srun_task(rank: u32, local: u32, node: u32) -> Vars {
        vec![
            (slurm::PROCID, rank.to_string()),
            (slurm::LOCALID, local.to_string()),
            (slurm::NODEID, node.to_string()),
            (slurm::STEP_NUM_TASKS, "5".into()),
            (slurm::STEP_NUM_NODES, "2".into()),
            (slurm::STEP_TASKS_PER_NODE, "3,2".into()),
            (slurm::STEP_NODELIST, "gpu[07-08]".into()),
            (slurm::JOB_ID, "4242".into()),
            (slurm::STEP_ID, "1".into()),
        ]
    }

    #[test]
    fn an_srun_task_without_a_launcher_is_a_rank() {
        let env = RankEnv::from_vars(&lookup(srun_task(4, 1, 1))).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((env.rank, env.local_rank, env.world_size), (4, 1, 5));
        assert_eq!((env.node_rank, env.nnodes, env.local_world_size), (1, 2, 2));
        assert_eq!(env.master, None, "rank 0 publishes its port");
        let step = env.slurm.clone().unwrap_or_else(|| panic!("no step"));
        assert_eq!(
            (step.master_host.as_str(), step.tag()),
            ("gpu07", "4242.1".to_string())
        );
        assert_eq!(env.job_tag().as_deref(), Some("slurm-4242.1"));
        let mut vars = srun_task(0, 0, 0);
        vars.push((slurm::STEP_RESV_PORTS, "12000-12003".into()));
        let env = RankEnv::from_vars(&lookup(vars.clone())).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(env.local_world_size, 3);
        let expected = Rendezvous {
            addr: "gpu07".into(),
            port: 12000,
        };
        assert_eq!(env.master, Some(expected));
        vars.push((MASTER_PORT, "29555".into()));
        let env = RankEnv::from_vars(&lookup(vars)).map(|e| e.master.map(|m| m.port));
        assert_eq!(env, Ok(Some(29555)), "MASTER_PORT wins");
        // A launcher's RANK wins over srun's variables.
        let mut vars = srun_task(4, 1, 1);
        vars.extend([(RANK, "0".to_string()), (WORLD_SIZE, "1".to_string())]);
        let env = RankEnv::from_vars(&lookup(vars)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((env.rank, env.world_size, env.slurm), (0, 1, None));
    }

    #[test]
    fn srun_errors_name_the_variable() {
        let fails = |change: &dyn Fn(&mut Vars)| {
            let mut vars = srun_task(1, 1, 0);
            change(&mut vars);
            RankEnv::from_vars(&lookup(vars)).map_err(|e| e.var).err()
        };
        assert_eq!(fails(&|_| {}), None);
        assert_eq!(fails(&|v| v[0].1 = "9".into()), Some(slurm::PROCID));
        assert_eq!(fails(&|v| v[1].1 = "3".into()), Some(slurm::LOCALID));
        assert_eq!(
            fails(&|v| v[5].1 = "3(x".into()),
            Some(slurm::STEP_TASKS_PER_NODE)
        );
        assert_eq!(
            fails(&|v| v[6].1 = "gpu[07-".into()),
            Some(slurm::STEP_NODELIST)
        );
        assert_eq!(
            fails(&|v| v.retain(|(k, _)| *k != slurm::JOB_ID)),
            Some(slurm::JOB_ID)
        );
        assert_eq!(tasks_on_node("2(x3),1", 2), Ok(2));
        assert_eq!(tasks_on_node("2(x3),1", 3), Ok(1));
        assert!(tasks_on_node("2(x3),1", 4).is_err());
    }

    #[test]
    fn torchruns_run_id_names_the_job() {
        let vars = lookup(vec![(TORCHELASTIC_RUN_ID, "a1b2/c".into())]);
        let env = RankEnv::from_vars(&vars).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(env.job_tag().as_deref(), Some("torchrun-a1b2_c"));
        let none = lookup(vec![(TORCHELASTIC_RUN_ID, "none".into())]);
        assert_eq!(RankEnv::from_vars(&none).map(|e| e.job_tag()), Ok(None));
    }

    #[test]
    fn restart_count_falls_back_to_torchruns_name() {
        let vars = lookup(vec![(TORCHELASTIC_RESTART_COUNT, "4".into())]);
        assert_eq!(RankEnv::from_vars(&vars).map(|e| e.restart_count), Ok(4));
    }
}
