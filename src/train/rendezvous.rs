//! The rendezvous port of ranks that srun started without a launcher and without
//! MASTER_PORT (or `--resv-ports`): rank 0 takes a port that is free on its node
//! and publishes it in the run directory (`rendezvous/<job>.<step>-r<requeues>.port`,
//! written atomically), and the other ranks read it there. Nothing is derived from
//! the job id, so two jobs sharing a node cannot pick the same port; the run
//! directory must be shared by the nodes, as the checkpoints already require.

use std::path::Path;
use std::time::Duration;

use vrtspike_contract::env::{self as contract, Rendezvous};

use super::env::RankEnv;
use super::published;
use super::TrainError;

/// Fills in the rank's rendezvous (rank 0's store) when srun's variables left the
/// port to be published; waits up to `timeout` for rank 0's file on other ranks.
pub fn resolve(env: &mut RankEnv, timeout: Duration) -> Result<(), TrainError> {
    if env.contract.master.is_some() || !env.distributed() {
        return Ok(());
    }
    let Some(step) = env.contract.slurm.clone() else {
        // Not an srun step: the usual error, naming MASTER_ADDR.
        env.contract.rendezvous().map_err(|e| TrainError::Env {
            var: e.var.to_string(),
            message: e.message,
        })?;
        return Ok(());
    };
    let tag = format!("slurm-{}-r{}", step.tag(), env.restart_count);
    let path = env.layout().rendezvous_port(&tag);
    let port = if env.rank == 0 {
        publish(&path)?
    } else {
        read_published(&path, timeout)?
    };
    tracing::info!(
        rank = env.rank,
        master = %step.master_host,
        port,
        file = %path.display(),
        "rendezvous port published by rank 0 (no MASTER_PORT)"
    );
    env.contract.master = Some(Rendezvous {
        addr: step.master_host,
        port,
    });
    Ok(())
}

/// Rank 0: a port free now on this node, written to `path`.
fn publish(path: &Path) -> Result<u16, TrainError> {
    let port = std::net::TcpListener::bind(("0.0.0.0", 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .map_err(|e| TrainError::io(path, format!("finding a free port to publish: {e}")))?;
    published::publish(path, &port.to_string())?;
    Ok(port)
}

/// Other ranks: the port rank 0 wrote to `path`, waiting up to `timeout`.
fn read_published(path: &Path, timeout: Duration) -> Result<u16, TrainError> {
    let Some(text) = published::wait_for(path, timeout)? else {
        return Err(TrainError::Env {
            var: contract::MASTER_PORT.to_string(),
            message: format!(
                "not set, and rank 0 did not publish its port in {} within {:.0} s \
                 (is the run directory shared by every node? else set MASTER_PORT)",
                path.display(),
                timeout.as_secs_f64()
            ),
        });
    };
    text.parse()
        .map_err(|_| TrainError::io(path, format!("not a port number: {text:?}")))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn srun_rank(rank: &str, run_dir: &Path) -> RankEnv {
        let vars: HashMap<&str, &str> = [
            ("SLURM_PROCID", rank),
            ("SLURM_LOCALID", rank),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_STEP_NODELIST", "localhost"),
            ("SLURM_JOB_ID", "5"),
        ]
        .into();
        let var = |name: &str| vars.get(name).map(|v| v.to_string());
        RankEnv::from_vars(&var, Some(run_dir), Some("cpu")).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn rank_0_publishes_and_the_others_read() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut one = srun_rank("1", tmp.path());
        let err = resolve(&mut one, Duration::from_millis(200)).unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT"), "{err}");
        let mut zero = srun_rank("0", tmp.path());
        resolve(&mut zero, Duration::from_secs(1)).unwrap_or_else(|e| panic!("{e}"));
        resolve(&mut one, Duration::from_secs(1)).unwrap_or_else(|e| panic!("{e}"));
        let master = zero.contract.master.clone();
        assert!(master
            .as_ref()
            .is_some_and(|m| m.port > 0 && m.addr == "localhost"));
        assert_eq!(one.contract.master, master);
        assert!(tmp.path().join("rendezvous/slurm-5.0-r0.port").is_file());
    }
}
