//! The launcher's config overrides and memory plan check: `--set` reaches every rank
//! unchanged, `DATA.CACHE_CONNECTIONS` sizes the cache server the launcher starts,
//! a bad `--set` is refused naming the key and the argument before any rank starts, and a plan that cannot fit (a cache larger than the RAM) is refused
//! naming the cache, unless `--no-plan-check` is given.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{launcher_command, run_with_limit, texts, vrtspike, Job};

const LIMIT: Duration = Duration::from_secs(60);

#[test]
fn overrides_reach_every_rank() {
    let job = Job::new("exit 0");
    let output = job.run(
        &[
            "--gpus",
            "0",
            "--ranks",
            "2",
            "--set",
            "TRAIN.LR=0.5",
            "--set=DATA.CROP_SIZE=64",
        ],
        LIMIT,
    );
    let (stdout, stderr) = texts(&output);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    for rank in 0..2 {
        let log = job.rank_log(rank);
        assert!(
            log.contains("args: train --config")
                && log.contains("--set=TRAIN.LR=0.5 --set=DATA.CROP_SIZE=64"),
            "rank {rank}: {log}"
        );
    }
}

#[test]
fn no_cache_server_without_the_ram_cache() {
    let job = Job::new("echo \"cache address: [${VRTSPIKE_CACHE_ADDR:-}]\"");
    let output = job.run(
        &[
            "--gpus",
            "0",
            "--ranks",
            "2",
            "--set",
            "DATA.USE_RAM_CACHE=false",
        ],
        LIMIT,
    );
    let (stdout, stderr) = texts(&output);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("no cache server"), "{stderr}");
    assert!(
        !job.run_dir.join("logs").join("cache.node0.log").exists(),
        "a cache server was started"
    );
    for rank in 0..2 {
        let log = job.rank_log(rank);
        assert!(log.contains("cache address: []"), "rank {rank}: {log}");
    }
}

#[test]
fn the_cache_connections_key_sizes_the_launchers_server() {
    let job = Job::new("exit 0");
    let output = job.run(
        &[
            "--gpus",
            "0",
            "--ranks",
            "1",
            "--set",
            "DATA.CACHE_CONNECTIONS=600",
        ],
        LIMIT,
    );
    let (stdout, stderr) = texts(&output);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    // The summary's cache figures are the server's own stats, taken at the end.
    let summary = job.summary(0);
    assert_eq!(summary["cache"]["connections"], 600, "{summary}");
}

#[test]
fn a_bad_override_is_refused_naming_the_key() {
    for (spec, key) in [
        ("DATA.CROP_SIZ=64", "DATA.CROP_SIZ"),
        ("TRAIN.BATCH_SIZE=lots", "TRAIN.BATCH_SIZE"),
        ("DATA.CACHE_CONNECTIONS=0", "DATA.CACHE_CONNECTIONS"),
    ] {
        let job = Job::new("exit 0");
        let output = job.run(&["--gpus", "0", "--set", spec], LIMIT);
        let (stdout, stderr) = texts(&output);
        assert!(!output.status.success(), "{spec}: {stdout}\n{stderr}");
        assert!(
            stderr.contains(key) && stderr.contains(&format!("--set {spec}")),
            "{spec}: {stderr}"
        );
        assert!(
            job.rank_pid(0, 0).is_none(),
            "{spec}: a rank started: {stderr}"
        );
        let summary = job.summary(0);
        assert!(
            summary["error"].as_str().unwrap_or("").contains(key),
            "{summary}"
        );
    }
}

/// The launcher on `job` without the tests' small `--cache-size` (the plan must see
/// the config's cap).
fn launch_without_cache_size(job: &Job, extra: &[&str]) -> Command {
    let mut command = launcher_command(&job.config, &job.run_dir);
    command
        .arg("--rank-cmd")
        .arg(&job.rank_cmd)
        .args(["--gpus", "0", "--max-restarts", "0"])
        .args(extra)
        .env("VRTSPIKE", vrtspike());
    command
}

#[test]
fn an_impossible_plan_is_refused_naming_the_cache() {
    let job = Job::new("exit 0");
    let command = launch_without_cache_size(&job, &["--set", "DATA.CACHE_SIZE_GB=100000"]);
    let output = run_with_limit(command, LIMIT);
    let (stdout, stderr) = texts(&output);
    assert!(!output.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("cannot fit")
            && stderr.contains("cache 100000.0 GiB (DATA.CACHE_SIZE_GB)")
            && stderr.contains("--no-plan-check"),
        "{stderr}"
    );
    assert!(job.rank_pid(0, 0).is_none(), "a rank started: {stderr}");
}
