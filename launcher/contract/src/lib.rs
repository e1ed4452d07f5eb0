//! The contract between `vrtspike-launch`, the node's cache server and the
//! training ranks, written down once: [`cache_addr`] (the default address of a
//! job's cache server), [`env`] (the variables every rank starts with), [`rundir`] (where things live in a run directory, and which checkpoint is
//! the latest), [`summary`] (the figures rank 0 leaves for the launcher), [`ready`]
//! (how a child says it is ready), [`pss`] (how memory is measured),
//! [`heartbeat`] (each rank's step, phase, collectives and liveness tick, for
//! finding a hung or stopped rank), [`failure`] (why a rank failed, in its own
//! words, and its exit code), [`signals`] (SIGUSR2 and SIGTERM, which SLURM sends
//! to every process of a job, counted from the first instruction), [`cache_serve`]
//! (how a job's cache server is started and waited for), [`shared_server`] (how a
//! job attaches to the node-shared one, or starts it), [`dataset_sig`] (which
//! dataset a node-shared cache server holds) and [`hostlist`] (SLURM's
//! compressed host lists); [`fnv`] is the one stable hash they all use, [`size`]
//! and [`seconds`] the one reading of byte sizes and seconds, [`child`] a
//! child's log and its tie to its starter. It links no libtorch, so the launcher stays free of it.

pub mod cache_addr;
pub mod cache_serve;
pub mod child;
pub mod dataset_sig;
pub mod env;
pub mod failure;
pub mod fnv;
pub mod heartbeat;
pub mod hostlist;
mod json_file;
pub mod pss;
pub mod ready;
pub mod rundir;
pub mod seconds;
pub mod shared_server;
pub mod signals;
pub mod size;
pub mod summary;

pub use env::{Device, EnvError, RankEnv, Rendezvous, SlurmStep};
pub use failure::{FailureClass, RankFailure, EXIT_OUT_OF_MEMORY};
pub use rundir::{Checkpoint, RunLayout};
pub use summary::{RunSummary, SummaryError, TrainStatus};
