//! The rank's place in the job, from the launcher's environment contract (RANK,
//! LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT, VRTSPIKE_RUN_DIR,
//! VRTSPIKE_DEVICE, VRTSPIKE_CACHE_ADDR, VRTSPIKE_RESTART_COUNT). Without RANK it
//! is a single rank with its run directory from `--run-dir` or `runs/<date-time>`.

use std::path::{Path, PathBuf};

use super::TrainError;

/// Environment variable naming the run directory.
pub const RUN_DIR_ENV: &str = "VRTSPIKE_RUN_DIR";
/// Environment variable naming the device (`cpu`, `cuda:<n>`).
pub const DEVICE_ENV: &str = "VRTSPIKE_DEVICE";
/// Environment variable naming the node's cache server.
pub const CACHE_ADDR_ENV: &str = "VRTSPIKE_CACHE_ADDR";
/// Environment variable counting restarts of the job.
pub const RESTART_COUNT_ENV: &str = "VRTSPIKE_RESTART_COUNT";

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
    /// Compute device.
    pub device: tch::Device,
    /// Run directory (checkpoints, metrics, logs).
    pub run_dir: PathBuf,
    /// The node's cache server, if one runs.
    pub cache_addr: Option<String>,
    /// Restarts of the job before this attempt.
    pub restart_count: u32,
}

impl RankEnv {
    /// Reads the contract through `var`; `run_dir_arg` (`--run-dir`) wins over
    /// VRTSPIKE_RUN_DIR; `device_arg` (`--device`) over VRTSPIKE_DEVICE.
    pub fn from_vars(
        var: &dyn Fn(&str) -> Option<String>,
        run_dir_arg: Option<&Path>,
        device_arg: Option<&str>,
    ) -> Result<RankEnv, TrainError> {
        let number = |name: &str, default: usize| -> Result<usize, TrainError> {
            match var(name) {
                None => Ok(default),
                Some(text) => text.trim().parse().map_err(|_| TrainError::Env {
                    var: name.to_string(),
                    message: format!("expected a non-negative integer, got {text:?}"),
                }),
            }
        };
        let distributed = var("RANK").is_some();
        let rank = number("RANK", 0)?;
        let world_size = number("WORLD_SIZE", 1)?;
        if distributed && var("WORLD_SIZE").is_none() {
            return Err(TrainError::Env {
                var: "WORLD_SIZE".into(),
                message: "RANK is set but WORLD_SIZE is not".into(),
            });
        }
        if rank >= world_size.max(1) {
            return Err(TrainError::Env {
                var: "RANK".into(),
                message: format!("rank {rank} is not below WORLD_SIZE {world_size}"),
            });
        }
        let local_rank = number("LOCAL_RANK", rank)?;
        let local_world_size = number("LOCAL_WORLD_SIZE", world_size)?;
        let device_text = device_arg.map(str::to_owned).or_else(|| var(DEVICE_ENV));
        let device = match device_text.as_deref() {
            None | Some("cpu") => tch::Device::Cpu,
            Some("cuda") => tch::Device::Cuda(local_rank),
            Some(text) => match text.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
                Some(n) => tch::Device::Cuda(n),
                None => {
                    return Err(TrainError::Env {
                        var: DEVICE_ENV.into(),
                        message: format!("expected cpu, cuda or cuda:<n>, got {text:?}"),
                    })
                }
            },
        };
        let run_dir = match (run_dir_arg, var(RUN_DIR_ENV)) {
            (Some(dir), _) => dir.to_path_buf(),
            (None, Some(dir)) => PathBuf::from(dir),
            (None, None) => PathBuf::from("runs").join(utc_stamp()),
        };
        let restart_count = number(RESTART_COUNT_ENV, 0)? as u32;
        Ok(RankEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            device,
            run_dir,
            cache_addr: var(CACHE_ADDR_ENV).filter(|a| !a.is_empty()),
            restart_count,
        })
    }

    /// From the process environment.
    pub fn from_env(
        run_dir_arg: Option<&Path>,
        device_arg: Option<&str>,
    ) -> Result<RankEnv, TrainError> {
        RankEnv::from_vars(&|name| std::env::var(name).ok(), run_dir_arg, device_arg)
    }

    /// Whether there is more than one rank.
    pub fn distributed(&self) -> bool {
        self.world_size > 1
    }

    /// `<run>/checkpoints`.
    pub fn checkpoint_dir(&self) -> PathBuf {
        self.run_dir.join("checkpoints")
    }
}

/// `YYYYMMDD-HHMMSS` in UTC, for the default run directory.
fn utc_stamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
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
        assert_eq!(e.device, tch::Device::Cpu);
        assert!(!e.distributed());
    }

    #[test]
    fn contract_variables_are_read_and_checked() {
        let vars = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            (RUN_DIR_ENV, "/tmp/run"),
            (DEVICE_ENV, "cuda:1"),
            (CACHE_ADDR_ENV, "vrtspike-cache-x"),
            (RESTART_COUNT_ENV, "2"),
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
        let e = RankEnv::from_vars(&vars, Some(Path::new("/x")), Some("cpu")).unwrap();
        assert_eq!(
            (e.run_dir, e.device),
            (PathBuf::from("/x"), tch::Device::Cpu)
        );
        let err = RankEnv::from_vars(&env(&[("RANK", "2"), ("WORLD_SIZE", "2")]), None, None)
            .unwrap_err();
        assert!(err.to_string().contains("RANK"), "{err}");
        let err = RankEnv::from_vars(&env(&[("RANK", "x"), ("WORLD_SIZE", "2")]), None, None)
            .unwrap_err();
        assert!(err.to_string().contains("RANK"), "{err}");
    }
}
