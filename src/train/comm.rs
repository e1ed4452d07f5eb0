//! How the ranks of a training job talk: one interface, [`Communication`], with a
//! single-rank implementation (nothing to exchange) and a DDP one (a process group
//! and the gradient buckets over it).

use tch::Tensor;

use crate::config::{Config, DistBackend};
use crate::dist::{Backend, Ddp, DdpOptions, GroupOptions, ProcessGroup, ReduceOp};

use super::env::RankEnv;
use super::heartbeat;
use super::TrainError;

/// What the training loop needs from the other ranks.
pub trait Communication {
    /// `values` reduced element-wise over ranks with `op`.
    fn all_reduce(&mut self, values: &[f64], op: ReduceOp) -> Result<Vec<f64>, TrainError>;
    /// Waits until every rank gets here.
    fn barrier(&mut self) -> Result<(), TrainError>;
    /// Averages the accumulated gradients over ranks.
    fn sync_gradients(&mut self) -> Result<(), TrainError>;
    /// Seconds spent in [`Self::sync_gradients`] so far (the gradient all-reduce,
    /// waiting for the slowest rank included); 0 for a single rank.
    fn sync_seconds(&self) -> f64 {
        0.0
    }
    /// Fails, naming the ranks, when they hold different parameters at `step`;
    /// returns the hash every rank agreed on, or `None` when there was nothing to
    /// compare.
    fn check_parameters(&mut self, step: u64) -> Result<Option<u64>, TrainError>;
}

/// A job of one rank.
#[derive(Debug, Default)]
pub struct SingleRank;

impl Communication for SingleRank {
    fn all_reduce(&mut self, values: &[f64], _op: ReduceOp) -> Result<Vec<f64>, TrainError> {
        Ok(values.to_vec())
    }

    fn barrier(&mut self) -> Result<(), TrainError> {
        Ok(())
    }

    fn sync_gradients(&mut self) -> Result<(), TrainError> {
        Ok(())
    }

    fn check_parameters(&mut self, _step: u64) -> Result<Option<u64>, TrainError> {
        Ok(None)
    }
}

/// Several ranks: a process group and DDP over the model's parameters.
#[derive(Debug)]
pub struct DdpComm {
    group: ProcessGroup,
    ddp: Ddp,
    sync_seconds: f64,
}

impl DdpComm {
    /// Wraps `params` (every rank's in the same order), which takes rank 0's values.
    pub fn new(mut group: ProcessGroup, params: &[Tensor]) -> Result<DdpComm, TrainError> {
        let handles = params.iter().map(|p| p.shallow_clone()).collect();
        let ddp = Ddp::new(&mut group, handles, DdpOptions::default())?;
        Ok(DdpComm {
            group,
            ddp,
            sync_seconds: 0.0,
        })
    }
}

impl Communication for DdpComm {
    fn all_reduce(&mut self, values: &[f64], op: ReduceOp) -> Result<Vec<f64>, TrainError> {
        let mut t = Tensor::from_slice(values);
        self.group.all_reduce(&mut t, op)?;
        Ok(Vec::<f64>::try_from(&t)?)
    }

    fn barrier(&mut self) -> Result<(), TrainError> {
        Ok(self.group.barrier()?)
    }

    fn sync_gradients(&mut self) -> Result<(), TrainError> {
        let started = std::time::Instant::now();
        let result = self.ddp.sync_gradients(&mut self.group);
        self.sync_seconds += started.elapsed().as_secs_f64();
        Ok(result?)
    }

    fn sync_seconds(&self) -> f64 {
        self.sync_seconds
    }

    fn check_parameters(&mut self, step: u64) -> Result<Option<u64>, TrainError> {
        self.ddp.check_parameters(&mut self.group, step)?;
        Ok(Some(self.ddp.parameter_hash()?))
    }
}

/// The process group of this training attempt (`DIST.BACKEND`, `DIST.TIMEOUT_S`,
/// the launcher's rank environment).
pub fn process_group(config: &Config, env: &RankEnv) -> Result<ProcessGroup, TrainError> {
    let backend = match (config.dist.backend, env.device.is_cuda()) {
        (DistBackend::Nccl, _) | (DistBackend::Auto, true) => Backend::Nccl,
        _ => Backend::Gloo,
    };
    let mut options = GroupOptions::for_rank(
        &env.contract,
        backend,
        std::time::Duration::from_secs(config.dist.timeout_s),
    )?;
    options.prefix = format!("train-attempt{}", env.restart_count);
    let mut group = ProcessGroup::new(&options)?;
    if let Some(observer) = heartbeat::observer() {
        group.observe(observer);
    }
    Ok(group)
}

/// The communication of this rank: DDP over `params` when the job has several
/// ranks, else nothing.
pub fn connect(
    config: &Config,
    env: &RankEnv,
    params: &[Tensor],
) -> Result<Box<dyn Communication>, TrainError> {
    if env.distributed() {
        Ok(Box::new(DdpComm::new(process_group(config, env)?, params)?))
    } else {
        Ok(Box::new(SingleRank))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_single_rank_reduces_to_its_own_values() {
        let mut comm = SingleRank;
        assert_eq!(
            comm.all_reduce(&[1.5, -2.0], ReduceOp::Sum).unwrap(),
            vec![1.5, -2.0]
        );
        assert_eq!(comm.all_reduce(&[3.0], ReduceOp::Max).unwrap(), vec![3.0]);
        comm.barrier().unwrap();
        comm.sync_gradients().unwrap();
        assert_eq!(comm.sync_seconds(), 0.0);
        assert_eq!(
            comm.check_parameters(4).unwrap(),
            None,
            "nothing to compare"
        );
    }
}
