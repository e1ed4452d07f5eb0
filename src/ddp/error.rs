//! The distributed layer's error type: every variant names the rank and the
//! operation at fault, so a failed job says which process broke and where.

/// A failure of the process group, a collective, or a DDP check.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A required environment variable (torchrun contract) is missing or bad.
    #[error("distributed setup: {0}")]
    Env(#[from] vrtspike_contract::EnvError),
    /// Options that cannot describe a process group.
    #[error("distributed setup: {0}")]
    Options(String),
    /// Rendezvous or process-group construction failed.
    #[error("rank {rank} of {world}: init of the {backend} process group (master {master}) failed: {message}")]
    Init {
        /// This process's rank.
        rank: usize,
        /// The world size.
        world: usize,
        /// `gloo` or `nccl`.
        backend: &'static str,
        /// `addr:port` of the rendezvous store.
        master: String,
        /// What c10d said.
        message: String,
    },
    /// A collective failed or timed out.
    #[error("rank {rank} of {world}: {op} #{seq} ({backend}) failed: {message}")]
    Collective {
        /// This process's rank.
        rank: usize,
        /// The world size.
        world: usize,
        /// `all_reduce`, `broadcast`, `barrier`.
        op: &'static str,
        /// How many collectives this group ran before this one.
        seq: u64,
        /// `gloo` or `nccl`.
        backend: &'static str,
        /// What c10d said.
        message: String,
    },
    /// Ranks hold models of different parameter shapes.
    #[error("rank {rank}: parameter shapes differ across ranks: {message}")]
    ShapeMismatch {
        /// This process's rank.
        rank: usize,
        /// Which ranks disagree with rank 0.
        message: String,
    },
    /// Ranks' parameters are no longer identical.
    #[error("rank {rank}: parameters diverged across ranks at step {step}: {message}")]
    Diverged {
        /// This process's rank.
        rank: usize,
        /// The optimizer step of the check.
        step: u64,
        /// Each rank's parameter hash and which ranks differ from rank 0.
        message: String,
    },
    /// A tensor the DDP layer was given cannot be synchronised.
    #[error("rank {rank}: {op}: {message}")]
    Tensor {
        /// This process's rank.
        rank: usize,
        /// The DDP operation.
        op: &'static str,
        /// What is wrong with the tensor.
        message: String,
    },
    /// A CUDA allocator call failed.
    #[error("CUDA allocator: {0}")]
    Cuda(String),
}
