//! The rank's place in the job: the contract's rank environment
//! (`vrtspike_contract::env`, parsed once per rank: from `vrtspike-launch` or
//! torchrun's variables, or from srun's when srun started the ranks itself) with
//! `--run-dir` and `--device` applied, and the tch device the model and the
//! process group share. The run directory is `--run-dir`, else VRTSPIKE_RUN_DIR,
//! else one every rank of the job names alike: `runs/torchrun-<run id>` under
//! torchrun, `runs/slurm-<job id>` under srun (as the launcher's under SLURM), else
//! for a single rank the contract's `runs/<date>-<time>`; ranks of a job with none
//! of these must be given one.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use vrtspike_contract::env::{self as contract, Device};
use vrtspike_contract::rundir::{default_run_dir, RunLayout};
use vrtspike_contract::summary::CacheSharing;

use super::TrainError;

/// Where this rank runs.
#[derive(Debug, Clone)]
pub struct RankEnv {
    /// Global rank.
    pub rank: usize,
    /// Ranks in the job.
    pub world_size: usize,
    /// Rank on this node.
    pub local_rank: usize,
    /// Ranks on this node.
    pub local_world_size: usize,
    /// Compute device (the process group uses the same one).
    pub device: tch::Device,
    /// Run directory (checkpoints, metrics, logs).
    pub run_dir: PathBuf,
    /// The node's cache server, if one runs.
    pub cache_addr: Option<String>,
    /// Restarts of the job before this attempt.
    pub restart_count: u32,
    /// The cache server this node's ranks chose themselves, when no launcher
    /// started one (`node_cache`): the run summary's `cache_sharing`.
    pub cache_sharing: Option<CacheSharing>,
    /// The one parsed environment, with the device and run directory decided here.
    pub contract: contract::RankEnv,
}

impl RankEnv {
    /// Reads the contract through `var`; `run_dir_arg` (`--run-dir`) wins over
    /// VRTSPIKE_RUN_DIR; `device_arg` (`--device`) over VRTSPIKE_DEVICE.
    pub fn from_vars(
        var: &dyn Fn(&str) -> Option<String>,
        run_dir_arg: Option<&Path>,
        device_arg: Option<&str>,
    ) -> Result<RankEnv, TrainError> {
        let mut parsed = contract::RankEnv::from_vars(var).map_err(|e| TrainError::Env {
            var: e.var.to_string(),
            message: e.message,
        })?;
        if let Some(text) = device_arg {
            parsed.device = Device::parse(text, contract::own_gpu(parsed.local_rank, var))
                .map_err(|message| TrainError::Env {
                    var: format!("--device (over {})", contract::DEVICE),
                    message,
                })?;
        }
        if let Some(dir) = run_dir_arg {
            parsed.run_dir = Some(dir.to_path_buf());
        }
        if parsed.run_dir.is_none() {
            parsed.run_dir = Some(job_run_dir(&parsed)?);
        }
        Ok(RankEnv::from_contract(parsed))
    }

    /// From the process environment.
    pub fn from_env(
        run_dir_arg: Option<&Path>,
        device_arg: Option<&str>,
    ) -> Result<RankEnv, TrainError> {
        RankEnv::from_vars(&|name| std::env::var(name).ok(), run_dir_arg, device_arg)
    }

    /// The rank of a parsed environment (a missing run directory is the
    /// contract's default).
    pub fn from_contract(parsed: contract::RankEnv) -> RankEnv {
        let run_dir = parsed
            .run_dir
            .clone()
            .unwrap_or_else(|| default_run_dir(None, SystemTime::now()));
        RankEnv {
            rank: parsed.rank as usize,
            world_size: parsed.world_size as usize,
            local_rank: parsed.local_rank as usize,
            local_world_size: parsed.local_world_size as usize,
            device: match parsed.device {
                Device::Cpu => tch::Device::Cpu,
                Device::Cuda(n) => tch::Device::Cuda(n as usize),
            },
            run_dir,
            cache_addr: parsed.cache_addr.clone(),
            restart_count: parsed.restart_count,
            cache_sharing: None,
            contract: parsed,
        }
    }

    /// Whether there is more than one rank.
    pub fn distributed(&self) -> bool {
        self.world_size > 1
    }

    /// The run directory's layout.
    pub fn layout(&self) -> RunLayout {
        RunLayout::new(&self.run_dir)
    }

    /// `<run>/checkpoints`.
    pub fn checkpoint_dir(&self) -> PathBuf {
        self.layout().checkpoints_dir()
    }
}

/// The run directory every rank of the job names alike (see the module doc).
fn job_run_dir(parsed: &contract::RankEnv) -> Result<PathBuf, TrainError> {
    if let Some(step) = &parsed.slurm {
        return Ok(default_run_dir(Some(&step.job_id), SystemTime::now()));
    }
    if let Some(tag) = parsed.job_tag() {
        return Ok(PathBuf::from("runs").join(tag));
    }
    if parsed.distributed() {
        return Err(TrainError::Env {
            var: contract::RUN_DIR.to_string(),
            message: format!(
                "not set, and {} ranks started without vrtspike-launch, torchrun or srun \
                 have no shared name for one: give every rank the same --run-dir",
                parsed.world_size
            ),
        });
    }
    Ok(default_run_dir(None, SystemTime::now()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn single_rank_without_the_contract() {
        let e = RankEnv::from_vars(&env(&[]), None, None).unwrap();
        assert_eq!((e.rank, e.world_size, e.local_world_size), (0, 1, 1));
        assert!(e.run_dir.starts_with("runs") && e.run_dir.to_string_lossy().len() > 10);
        assert_eq!(e.contract.run_dir.as_ref(), Some(&e.run_dir));
        assert_eq!(e.device, tch::Device::Cpu);
        assert!(!e.distributed());
    }

    #[test]
    fn contract_variables_are_read_and_checked() {
        let vars = env(&[
            (contract::RANK, "3"),
            (contract::WORLD_SIZE, "4"),
            (contract::LOCAL_RANK, "1"),
            (contract::LOCAL_WORLD_SIZE, "2"),
            (contract::MASTER_ADDR, "127.0.0.1"),
            (contract::MASTER_PORT, "29500"),
            (contract::RUN_DIR, "/tmp/run"),
            (contract::DEVICE, "cuda:1"),
            (contract::CACHE_ADDR, "vrtspike-cache-x"),
            (contract::RESTART_COUNT, "2"),
        ]);
        let e = RankEnv::from_vars(&vars, None, None).unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (3, 4, 1, 2)
        );
        assert_eq!(e.device, tch::Device::Cuda(1));
        assert_eq!(e.run_dir, PathBuf::from("/tmp/run"));
        assert_eq!(e.cache_addr.as_deref(), Some("vrtspike-cache-x"));
        assert_eq!(e.restart_count, 2);
        assert_eq!(e.checkpoint_dir(), PathBuf::from("/tmp/run/checkpoints"));
        // --device and --run-dir win, and the process group sees the same device.
        let e = RankEnv::from_vars(&vars, Some(Path::new("/x")), Some("cuda")).unwrap();
        assert_eq!(
            (e.run_dir, e.device),
            (PathBuf::from("/x"), tch::Device::Cuda(1))
        );
        assert_eq!(e.contract.device, Device::Cuda(1));
        let err = RankEnv::from_vars(&vars, None, Some("gpu")).unwrap_err();
        assert!(err.to_string().contains("--device"), "{err}");
        let err = RankEnv::from_vars(&env(&[("RANK", "2"), ("WORLD_SIZE", "2")]), None, None)
            .unwrap_err();
        assert!(err.to_string().contains("RANK"), "{err}");
        let err = RankEnv::from_vars(&env(&[("RANK", "x"), ("WORLD_SIZE", "2")]), None, None)
            .unwrap_err();
        assert!(err.to_string().contains("RANK"), "{err}");
    }

    #[test]
    fn every_rank_of_a_job_names_the_same_run_dir() {
        let two = [
            (contract::RANK, "1"),
            (contract::WORLD_SIZE, "2"),
            (contract::MASTER_ADDR, "127.0.0.1"),
            (contract::MASTER_PORT, "29500"),
        ];
        let err = RankEnv::from_vars(&env(&two), None, None).unwrap_err();
        assert!(err.to_string().contains("--run-dir"), "{err}");
        let mut torchrun = two.to_vec();
        torchrun.push((contract::TORCHELASTIC_RUN_ID, "f00d"));
        let e = RankEnv::from_vars(&env(&torchrun), None, None).unwrap();
        assert_eq!(e.run_dir, PathBuf::from("runs/torchrun-f00d"));
        let srun = [
            ("SLURM_PROCID", "1"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_STEP_NODELIST", "localhost"),
            ("SLURM_JOB_ID", "77"),
        ];
        let e = RankEnv::from_vars(&env(&srun), None, None).unwrap();
        assert_eq!(e.run_dir, PathBuf::from("runs/slurm-77"));
        assert_eq!((e.rank, e.world_size, e.local_world_size), (1, 2, 2));
    }
}
