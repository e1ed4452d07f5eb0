//! How the ranks of a training job talk: one interface, [`Communication`], with a
//! single-rank implementation (nothing to exchange) and a DDP one (a process group
//! and, per `DIST.GRAD_SYNC`, PyTorch DDP's Reducer overlapping the gradient
//! all-reduces with backward, or flat buckets all-reduced after it).

use tch::{TchError, Tensor};

use crate::config::{Config, DistBackend, DistConfig, GradCompressionMode, GradSyncMode};
use crate::ddp::{
    check_parameters, parameter_hash, Backend, Ddp, DdpOptions, GradCompression, GradReducer,
    GradSync, GroupOptions, ProcessGroup, ReduceOp, ReducerOptions,
};

use super::env::RankEnv;
use super::heartbeat;
use super::TrainError;

/// Why a backward pass failed: libtorch itself (an out-of-memory, which the caller
/// classifies) or the communication that ran inside it.
#[derive(Debug)]
pub enum BackwardFailure {
    /// The autograd engine's error.
    Torch(TchError),
    /// A collective inside backward (the Reducer's all-reduces).
    Comm(TrainError),
}

/// What the training loop needs from the other ranks.
pub trait Communication {
    /// Before each micro-batch's forward pass; `sync` says whether its backward
    /// reduces (the optimizer step's last micro-batch).
    fn before_forward(&mut self, _sync: GradSync) -> Result<(), TrainError> {
        Ok(())
    }
    /// Back-propagates `loss` (the micro-batch's scaled loss).
    fn backward(&mut self, loss: &Tensor, _sync: GradSync) -> Result<(), BackwardFailure> {
        loss.f_backward().map_err(BackwardFailure::Torch)
    }
    /// Whether every rank must run every micro-batch's backward, a non-finite
    /// loss's too (collectives run inside it); the step is skipped on every rank then.
    fn backward_is_collective(&self) -> bool {
        false
    }
    /// `values` reduced element-wise over ranks with `op` (with several ranks, a
    /// read back from the group's device).
    fn all_reduce(&mut self, values: &[f64], op: ReduceOp) -> Result<Vec<f64>, TrainError>;
    /// `tensor` (contiguous, on this rank's device) reduced over ranks in place,
    /// nothing read back.
    fn all_reduce_device(&mut self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), TrainError>;
    /// Waits until every rank gets here.
    fn barrier(&mut self) -> Result<(), TrainError>;
    /// Averages the accumulated gradients over ranks (done already, inside the
    /// last backward pass, by the Reducer).
    fn sync_gradients(&mut self) -> Result<(), TrainError>;
    /// Seconds of gradient communication that backward did not hide, so far
    /// (waiting for the slowest rank included): all of [`Self::sync_gradients`]
    /// after backward; with the Reducer, from the last gradient's arrival to the
    /// end of backward. 0 for a single rank.
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

    fn all_reduce_device(&mut self, _tensor: &mut Tensor, _op: ReduceOp) -> Result<(), TrainError> {
        Ok(())
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

/// How a [`DdpComm`] averages gradients (`DIST.GRAD_SYNC`).
#[derive(Debug)]
enum GradAveraging {
    /// PyTorch DDP's Reducer, overlapped with backward.
    Reducer(GradReducer),
    /// Flat buckets all-reduced after backward.
    AfterBackward(Ddp),
}

impl GradAveraging {
    /// The parameters averaged (shallow handles on the model's tensors).
    fn parameters(&self) -> &[Tensor] {
        match self {
            GradAveraging::Reducer(reducer) => reducer.parameters(),
            GradAveraging::AfterBackward(ddp) => ddp.parameters(),
        }
    }
}

/// Several ranks: a process group and gradient averaging over the model's parameters.
#[derive(Debug)]
pub struct DdpComm {
    group: ProcessGroup,
    averaging: GradAveraging,
    sync_seconds: f64,
}

impl DdpComm {
    /// Wraps `params` (every rank's in the same order), which take rank 0's values.
    pub fn new(
        mut group: ProcessGroup,
        params: &[Tensor],
        dist: &DistConfig,
    ) -> Result<DdpComm, TrainError> {
        let handles = || params.iter().map(|p| p.shallow_clone()).collect();
        let bucket_bytes = dist.bucket_bytes();
        let averaging = match dist.grad_sync {
            GradSyncMode::Reducer => {
                let options = ReducerOptions {
                    bucket_bytes,
                    compression: match dist.grad_compression {
                        GradCompressionMode::None => GradCompression::None,
                        GradCompressionMode::Bf16 => GradCompression::Bf16,
                        GradCompressionMode::Fp16 => GradCompression::Fp16,
                    },
                    ..ReducerOptions::default()
                };
                GradAveraging::Reducer(GradReducer::new(&mut group, handles(), options)?)
            }
            GradSyncMode::AfterBackward => GradAveraging::AfterBackward(Ddp::new(
                &mut group,
                handles(),
                DdpOptions {
                    bucket_bytes,
                    ..DdpOptions::default()
                },
            )?),
        };
        Ok(DdpComm {
            group,
            averaging,
            sync_seconds: 0.0,
        })
    }
}

impl Communication for DdpComm {
    fn before_forward(&mut self, sync: GradSync) -> Result<(), TrainError> {
        match &mut self.averaging {
            GradAveraging::Reducer(reducer) => Ok(reducer.before_forward(sync)?),
            GradAveraging::AfterBackward(_) => Ok(()),
        }
    }

    fn backward(&mut self, loss: &Tensor, sync: GradSync) -> Result<(), BackwardFailure> {
        match &mut self.averaging {
            GradAveraging::Reducer(reducer) => {
                let exposed = reducer
                    .backward(&mut self.group, loss, sync)
                    .map_err(|e| BackwardFailure::Comm(e.into()))?;
                self.sync_seconds += exposed.as_secs_f64();
                Ok(())
            }
            GradAveraging::AfterBackward(_) => loss.f_backward().map_err(BackwardFailure::Torch),
        }
    }

    fn backward_is_collective(&self) -> bool {
        matches!(self.averaging, GradAveraging::Reducer(_))
    }

    fn all_reduce(&mut self, values: &[f64], op: ReduceOp) -> Result<Vec<f64>, TrainError> {
        let t = self
            .group
            .all_reduce_host(&Tensor::from_slice(values), op)?;
        Ok(crate::util::readback::values::<f64>(&t)?)
    }

    fn all_reduce_device(&mut self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), TrainError> {
        Ok(self.group.all_reduce(tensor, op)?)
    }

    fn barrier(&mut self) -> Result<(), TrainError> {
        Ok(self.group.barrier()?)
    }

    fn sync_gradients(&mut self) -> Result<(), TrainError> {
        let GradAveraging::AfterBackward(ddp) = &mut self.averaging else {
            return Ok(());
        };
        let started = std::time::Instant::now();
        let result = ddp.sync_gradients(&mut self.group);
        self.sync_seconds += started.elapsed().as_secs_f64();
        Ok(result?)
    }

    fn sync_seconds(&self) -> f64 {
        self.sync_seconds
    }

    fn check_parameters(&mut self, step: u64) -> Result<Option<u64>, TrainError> {
        let params = self.averaging.parameters();
        check_parameters(&mut self.group, params, step)?;
        Ok(Some(parameter_hash(params, self.group.rank())?))
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

/// The communication of this rank: gradient averaging over `params` per
/// `DIST.GRAD_SYNC` when the job has several ranks, else nothing.
pub fn connect(
    config: &Config,
    env: &RankEnv,
    params: &[Tensor],
) -> Result<Box<dyn Communication>, TrainError> {
    if env.distributed() {
        let group = process_group(config, env)?;
        Ok(Box::new(DdpComm::new(group, params, &config.dist)?))
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
        let mut t = Tensor::from_slice(&[2.0f64]);
        comm.all_reduce_device(&mut t, ReduceOp::Sum).unwrap();
        assert_eq!(t.double_value(&[0]), 2.0);
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
