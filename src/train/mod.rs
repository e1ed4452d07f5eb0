//! The training loop of one rank (`vrtspike train`): data from the per-rank loader,
//! the model, Charbonnier loss, AdamW with a cosine schedule, optional AMP,
//! gradients averaged over ranks (DDP), periodic validation, memory monitoring,
//! metrics, atomic checkpoints with exact resume, and preemption; under launchers
//! other than `vrtspike-launch` (torchrun, srun) the node's cache server
//! (`node_cache`) and srun's rendezvous port (`rendezvous`).

pub mod accumulation;
pub mod amp;
pub mod checkpoint;
pub mod comm;
pub mod env;
pub mod failure;
pub mod figures;
pub mod heartbeat;
pub mod loader_settings;
pub mod loss;
pub mod measure;
pub mod metrics;
pub mod node_cache;
pub mod oom;
pub mod optim;
pub mod preempt;
pub mod published;
pub mod rendezvous;
pub mod report;
pub mod run;
pub mod run_config;
pub mod schedule;
pub mod step;
pub mod step_timing;
pub mod summary;
pub mod tasks;
pub mod tile_batch;
pub mod trainer;
pub mod transfer;
pub mod validate;

use std::path::{Path, PathBuf};

pub use env::RankEnv;
pub use trainer::{train, TrainOptions, TrainOutcome};

/// Why training stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A bad environment variable of the launcher contract.
    #[error("environment variable {var}: {message}")]
    Env {
        /// The variable.
        var: String,
        /// What was wrong.
        message: String,
    },
    /// The config cannot run (a key named).
    #[error("config: {key}: {message}")]
    Config {
        /// Key path such as `DATA.ROOT`.
        key: String,
        /// What was wrong.
        message: String,
    },
    /// The dataset failed (the file at fault named).
    #[error(transparent)]
    Data(#[from] crate::dataset::DataError),
    /// The input pipeline failed (a record source, the sampler or the loader).
    #[error(transparent)]
    Pipeline(#[from] crate::pipeline::PipelineError),
    /// A collective or the process group failed (the rank named).
    #[error(transparent)]
    Dist(#[from] crate::ddp::DistError),
    /// The model could not be built or run.
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// A checkpoint could not be written or read.
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    /// Training or validation ran out of memory (deterministic for the config: the
    /// message names the stage, the input shape and what to change).
    #[error("{0}")]
    OutOfMemory(Box<oom::OutOfMemory>),
    /// libtorch failed.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// The node's cache server could not be started, nor the node-shared one
    /// attached to (its address and log named).
    #[error(transparent)]
    CacheServer(#[from] vrtspike_contract::cache_serve::ServeError),
    /// The node-shared cache address is held by a server this job cannot use
    /// (local rank 0 falls back to a server of the job's own).
    #[error(transparent)]
    NotOurs(#[from] vrtspike_contract::shared_server::NotOurs),
    /// A file of the run directory could not be written.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        message: String,
    },
}

impl TrainError {
    /// A file of the run directory that could not be written or created.
    pub fn io(path: &Path, error: impl std::fmt::Display) -> TrainError {
        TrainError::Io {
            path: path.to_path_buf(),
            message: error.to_string(),
        }
    }
}
