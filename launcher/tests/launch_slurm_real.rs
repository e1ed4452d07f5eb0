//! `launcher/slurm/vrtspike.sbatch` under a real one-node SLURM
//! (`common/slurm_cluster.rs`: Debian's slurmctld, slurmd and munged, started and
//! stopped by the test), submitted from a fresh `git clone` of this repository (its
//! uncommitted changes applied) the way a CPU-only user would:
//! `CONFIG=tiny.yaml sbatch --cpus-per-task=2 launcher/slurm/vrtspike.sbatch`, two
//! CPU ranks of the tiny U-Net on `vrtspike synth` data (`common/slurm_bench.rs`).
//! The cases:
//! - completion;
//! - SIGUSR2 to the batch shell (`scancel --signal=USR2 --batch`), to every process
//!   (`--full`), and SIGTERM to the batch shell alone (`--signal=TERM --batch`):
//!   checkpoint, requeue, resume from that checkpoint, completion;
//! - a one-minute time limit with its warning (`--time=1 --signal=B:USR2@30`): the
//!   same, without a signal from the test;
//! - `scancel`: a checkpoint, and the job stays cancelled;
//! - SIGUSR2 during the final validation: the job is completed, not requeued.
//!
//! Each case reads the job's state and restart count from `scontrol show job`, the
//! run's `summary.json`, the checkpoint resumed from, and checks that no process of
//! the job, no cache server socket and nothing new in /dev/shm is left. It prints
//! the figures (signal to the launcher's summary, requeue to running again).
//!
//! It needs root and the packages `slurm-wlm` and `munge` (`make test` installs
//! them): without them it fails, unless `VRTSPIKE_SKIP_REAL_SLURM=1` (refused under
//! `CI`) makes it say that it skipped.

mod common;
#[path = "common/slurm_bench.rs"]
mod slurm_bench;
#[path = "common/slurm_cluster.rs"]
mod slurm_cluster;
#[path = "common/vhosts.rs"]
mod vhosts;

use slurm_bench::{ClusterShape, JobShape, Stop};

const CASES: [Stop; 7] = [
    Stop::Completes,
    Stop::Usr2ToBatch,
    Stop::Usr2ToEvery,
    Stop::TermToBatch,
    Stop::Cancel,
    Stop::Usr2InFinalValidation,
    Stop::TimeLimit,
];

#[test]
fn sbatch_template_under_a_real_one_node_slurm() {
    let job = JobShape {
        nodes: 1,
        ranks_per_node: 2,
    };
    slurm_bench::run_suite("launch_slurm_real", ClusterShape::OneNode, job, &CASES);
}
