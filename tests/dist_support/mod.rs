//! Multi-process harness for the dist tests: a test re-runs its own test binary
//! as N rank processes (torchrun-style environment, a free loopback port) and
//! collects their outcomes; inside a rank, `rank_env` says who it is.

#![allow(dead_code)] // each test binary uses a different subset

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Set in rank processes; holds the rank.
const ROLE_VAR: &str = "VRTSPIKE_TEST_RANK";

/// This process's (rank, world size, port) when it is a spawned rank.
pub fn rank_env() -> Option<(usize, usize, u16)> {
    let rank = std::env::var(ROLE_VAR).ok()?.parse().ok()?;
    let world = std::env::var("WORLD_SIZE").ok()?.parse().ok()?;
    let port = std::env::var("MASTER_PORT").ok()?.parse().ok()?;
    Some((rank, world, port))
}

/// The rank environment this rank process was started with, parsed once by the
/// launcher contract (what a real rank hands to `GroupOptions::for_rank`).
pub fn torchrun_env() -> vrtspike_contract::RankEnv {
    vrtspike_contract::RankEnv::from_process_env().expect("torchrun env")
}

/// A free TCP port on loopback (bound then released).
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local addr").port()
}

/// One rank's result: its exit status and output, and how long it ran.
pub struct RankOutcome {
    pub rank: usize,
    pub output: Output,
    pub elapsed: Duration,
}

impl RankOutcome {
    pub fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.output.stderr).into_owned()
    }
    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.output.stdout).into_owned()
    }
    pub fn ok(&self) -> bool {
        self.output.status.success()
    }
}

/// Runs test `test_name` of this binary as ranks `ranks` of a world of `world`,
/// each with `extra_env`, and waits for all of them.
pub fn run_ranks(
    test_name: &str,
    world: usize,
    ranks: &[usize],
    extra_env: &[(&str, String)],
) -> Vec<RankOutcome> {
    let exe = std::env::current_exe().expect("test binary path");
    let port = free_port();
    let start = Instant::now();
    let children: Vec<_> = ranks
        .iter()
        .map(|&rank| {
            let mut cmd = Command::new(&exe);
            cmd.args([test_name, "--exact", "--nocapture", "--test-threads=1"])
                .env(ROLE_VAR, rank.to_string())
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("OMP_NUM_THREADS", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (key, value) in extra_env {
                cmd.env(key, value);
            }
            (rank, cmd.spawn().expect("spawn rank"))
        })
        .collect();
    children
        .into_iter()
        .map(|(rank, child)| {
            let output = child.wait_with_output().expect("wait for rank");
            RankOutcome {
                rank,
                output,
                elapsed: start.elapsed(),
            }
        })
        .collect()
}

/// Asserts every rank exited 0, showing each failing rank's output.
pub fn assert_all_ok(outcomes: &[RankOutcome]) {
    for outcome in outcomes {
        assert!(
            outcome.ok(),
            "rank {} failed ({}):\nstdout:\n{}\nstderr:\n{}",
            outcome.rank,
            outcome.output.status,
            outcome.stdout(),
            outcome.stderr()
        );
    }
}

/// Joins the Gloo group of this rank process (torchrun environment, 30 s timeout).
pub fn join() -> vrtspike::ddp::ProcessGroup {
    use vrtspike::ddp::{Backend, GroupOptions, ProcessGroup};
    let options = GroupOptions::for_rank(&torchrun_env(), Backend::Gloo, Duration::from_secs(30))
        .expect("torchrun env");
    ProcessGroup::new(&options).expect("join the group")
}

/// A training set of `steps` steps of `per_step` 3x6x6 samples and targets, the
/// same in every process.
pub fn data(steps: usize, per_step: usize) -> (tch::Tensor, tch::Tensor) {
    use tch::{Device, Kind, Tensor};
    tch::manual_seed(1234);
    let shape = [steps as i64, per_step as i64, 3, 6, 6];
    let x = Tensor::randn(shape, (Kind::Float, Device::Cpu));
    let y = Tensor::randn(shape, (Kind::Float, Device::Cpu));
    (x, y)
}

/// The largest element-wise difference between two sorted named parameter lists.
pub fn max_abs_diff(a: &[(String, tch::Tensor)], b: &[(String, tch::Tensor)]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((na, ta), (nb, tb))| {
            assert_eq!(na, nb);
            (ta - tb).abs().max().double_value(&[])
        })
        .fold(0.0, f64::max)
}

/// Runs `test` on ranks 0 and 1 of 2 with `out_var` naming a fresh folder for
/// what they write; asserts both succeeded and returns the folder.
pub fn two_ranks_writing(test: &str, out_var: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let outcomes = run_ranks(
        test,
        2,
        &[0, 1],
        &[(out_var, dir.path().display().to_string())],
    );
    assert_all_ok(&outcomes);
    dir
}

/// Named tensors saved with `Tensor::save_multi`, sorted by name.
pub fn load_sorted(path: &std::path::Path) -> Vec<(String, tch::Tensor)> {
    let mut named =
        tch::Tensor::load_multi(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}
