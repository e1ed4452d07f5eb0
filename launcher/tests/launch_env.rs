//! The environment contract the launcher gives its ranks: on one node, as node 1 of
//! two (`--nnodes/--node-rank`), and under a faked SLURM step; plus the clear error
//! for a missing config.

mod common;

use std::time::Duration;

use common::{texts, Job};

const LIMIT: Duration = Duration::from_secs(30);

/// Ranks that prove the cache server answers before they start, then exit 0;
/// rank 0 leaves its figures for the summary.
const CHECK_CACHE_AND_EXIT: &str = r#"
"$VRTSPIKE" cache stats --address "$VRTSPIKE_CACHE_ADDR" > /dev/null || { echo "no cache server"; exit 9; }
if [ "$RANK" = 0 ]; then
  echo '{"status": "completed", "steps": 3, "total_steps": 3, "world_size": 2, "val_psnr": 31.5, "input_psnr": 28.25}' > "$VRTSPIKE_RUN_DIR/train_summary.json"
fi
echo "rank $RANK finished"
"#;

#[test]
fn two_cpu_ranks_get_the_torchrun_contract() {
    let job = Job::new(CHECK_CACHE_AND_EXIT);
    let output = job.run(
        &["--gpus", "0", "--ranks", "2", "--", "--steps", "3"],
        LIMIT,
    );
    let (stdout, stderr) = texts(&output);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );

    let run_dir = job.run_dir.canonicalize().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        stdout.contains(&format!("run dir: {}", run_dir.display())),
        "{stdout}"
    );
    // Rank 0's log is echoed with a prefix, rank 1's is not.
    assert!(stdout.contains("[rank0] rank 0 finished"), "{stdout}");
    assert!(!stdout.contains("rank 1 finished"), "{stdout}");

    let (env0, env1) = (job.rank_env(0, 0), job.rank_env(1, 0));
    for (rank, env) in [(0, &env0), (1, &env1)] {
        let get = |k: &str| env.get(k).map(String::as_str);
        assert_eq!(get("RANK"), Some(rank.to_string().as_str()));
        assert_eq!(get("LOCAL_RANK"), Some(rank.to_string().as_str()));
        assert_eq!(get("WORLD_SIZE"), Some("2"));
        assert_eq!(get("LOCAL_WORLD_SIZE"), Some("2"));
        assert_eq!(get("GROUP_RANK"), Some("0"));
        assert_eq!(get("MASTER_ADDR"), Some("127.0.0.1"));
        assert_eq!(get("VRTSPIKE_RESTART_COUNT"), Some("0"));
        assert_eq!(get("TORCHELASTIC_RESTART_COUNT"), Some("0"));
        assert_eq!(get("VRTSPIKE_DEVICE"), Some("cpu"));
        assert_eq!(
            get("VRTSPIKE_RUN_DIR"),
            Some(run_dir.to_str().unwrap_or("?"))
        );
        assert_eq!(
            get("PYTORCH_CUDA_ALLOC_CONF"),
            Some("expandable_segments:True")
        );
        assert!(get("OMP_NUM_THREADS").is_some_and(|n| n.parse::<u32>().is_ok_and(|n| n >= 1)));
    }
    let port = env0.get("MASTER_PORT").and_then(|p| p.parse::<u16>().ok());
    assert!(port.is_some_and(|p| p > 0), "{env0:?}");
    assert_eq!(env0.get("MASTER_PORT"), env1.get("MASTER_PORT"));
    assert_eq!(
        env0.get("VRTSPIKE_CACHE_ADDR"),
        env1.get("VRTSPIKE_CACHE_ADDR")
    );
    // The rank command is `train --config <absolute path>` plus the arguments after `--`.
    let config = job.config.canonicalize().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        job.rank_log(1).contains(&format!(
            "args: train --config {} --steps 3",
            config.display()
        )),
        "{}",
        job.rank_log(1)
    );

    let summary = job.summary(0);
    assert_eq!(summary["exit"], "completed");
    assert_eq!(summary["exit_code"], 0);
    assert_eq!(summary["restarts"], 0);
    assert_eq!(summary["world_size"], 2);
    assert!(
        summary["peak_pss_mb"].as_f64().is_some_and(|mb| mb > 0.0),
        "{summary}"
    );
    // Rank 0's figures are merged in.
    assert_eq!(summary["steps"], 3);
    assert_eq!(summary["val_psnr"], 31.5);
    assert_eq!(summary["input_psnr"], 28.25);
    // The cache server's last statistics are in the summary.
    assert!(
        summary["cache"]["cap_bytes"].as_u64() == Some(16 << 20),
        "{summary}"
    );
    for key in [
        "val_psnr",
        "input_psnr",
        "val_ssim",
        "samples_per_s",
        "cache_hit_rate",
        "steps",
    ] {
        assert!(summary.get(key).is_some(), "summary lacks {key}: {summary}");
    }
}

/// What a launcher said on the control link, but how its ranks stand (`VIEW`)
/// and that it lives (`BEAT`), each about once a second.
fn besides_standings(said: &str) -> Vec<&str> {
    said.lines()
        .filter(|l| !l.starts_with("VIEW ") && !l.starts_with("BEAT "))
        .collect()
}

#[test]
fn second_node_offsets_ranks() {
    let job = Job::new("exit 0");
    let control_port = common::free_port();
    // Node 0 chooses rank 0's port and says it when it starts the attempt.
    let master_port = common::free_port();
    let node0 = common::fake_node0(control_port, master_port);
    let (master_port, control_port) = (master_port.to_string(), control_port.to_string());
    let extra = ["--control-port", &control_port];
    let mut command = job.command(&common::two_node_args(2, 1, "127.0.0.1", &extra));
    command.env("VRTSPIKE_JOB_SECRET", common::TEST_SECRET);
    let output = common::run_with_limit(command, LIMIT);
    let (stdout, stderr) = texts(&output);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    for (rank, local) in [(2, "0"), (3, "1")] {
        let env = job.rank_env(rank, 0);
        let get = |k: &str| env.get(k).map(String::as_str);
        assert_eq!(get("LOCAL_RANK"), Some(local));
        assert_eq!(get("WORLD_SIZE"), Some("4"));
        assert_eq!(get("LOCAL_WORLD_SIZE"), Some("2"));
        assert_eq!(get("GROUP_RANK"), Some("1"));
        assert_eq!(get("MASTER_ADDR"), Some("127.0.0.1"));
        assert_eq!(get("MASTER_PORT"), Some(master_port.as_str()));
    }
    // Node 1's launcher proved the job's secret to node 0's, told how its ranks
    // stood, and said it ended well.
    let said = node0.join().unwrap_or_default();
    assert_eq!(besides_standings(&said), ["DONE 1 completed"], "{said}");
    assert!(
        said.contains("VIEW 0 2 ") && said.contains("VIEW 0 3 "),
        "{said}"
    );
    // Rank 0 runs elsewhere: nothing is echoed, and node 1 names its summary.
    assert!(!stdout.contains("[rank0]"), "{stdout}");
    let summary = job.summary(1);
    assert_eq!(summary["exit"], "completed");
    assert_eq!(summary["node_rank"], 1);
    assert_eq!(summary["nnodes"], 2);
}

#[test]
fn a_job_secret_under_128_bits_is_refused_naming_the_variable() {
    let job = Job::new("exit 0");
    let control_port = common::free_port().to_string();
    let extra = ["--control-port", &control_port, "--peer-timeout-s", "1"];
    let mut command = job.command(&common::two_node_args(1, 1, "127.0.0.1", &extra));
    // 16 hex digits: 64 bits, found offline from one recorded handshake.
    command.env("VRTSPIKE_JOB_SECRET", "0123456789abcdef");
    let output = common::run_with_limit(command, LIMIT);
    let (stdout, stderr) = texts(&output);
    assert!(
        !output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stderr.contains("VRTSPIKE_JOB_SECRET has 16 characters") && stderr.contains("at least 32"),
        "the error names the variable and the minimum: {stderr}"
    );
    assert!(
        !job.run_dir.join("env.rank2.attempt0").exists(),
        "no rank started with a weak secret"
    );
}

#[test]
fn slurm_step_sets_node_ranks_and_master() {
    let job = Job::new("exit 0");
    let control_port = common::free_port();
    let master_port = common::free_port();
    let node0 = common::fake_node0(control_port, master_port);
    let control = control_port.to_string();
    let mut command = job.command(&[
        "--gpus",
        "0",
        "--ranks",
        "2",
        "--slurm",
        "auto",
        "--control-port",
        &control,
    ]);
    command
        .env("SLURM_JOB_ID", "4242")
        .env("SLURM_PROCID", "1")
        .env("SLURM_NODEID", "1")
        .env("SLURM_LOCALID", "0")
        .env("SLURM_NTASKS", "2")
        .env("SLURM_NNODES", "2")
        .env("SLURM_NODELIST", "localhost,gpunode[08]")
        .env("VRTSPIKE_JOB_SECRET", common::TEST_SECRET);
    let output = common::run_with_limit(command, LIMIT);
    let (stdout, stderr) = texts(&output);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    for rank in [2, 3] {
        let env = job.rank_env(rank, 0);
        let get = |k: &str| env.get(k).map(String::as_str);
        assert_eq!(get("WORLD_SIZE"), Some("4"));
        assert_eq!(get("GROUP_RANK"), Some("1"));
        assert_eq!(get("MASTER_ADDR"), Some("localhost"));
        // Not derived from the job id (20000 + 4242): node 0's choice.
        assert_eq!(get("MASTER_PORT"), Some(master_port.to_string().as_str()));
    }
    assert_eq!(job.summary(1)["exit"], "completed");
    let said = node0.join().unwrap_or_default();
    assert_eq!(besides_standings(&said), ["DONE 1 completed"], "{said}");
}

#[test]
fn missing_config_names_the_path() {
    let job = Job::new("exit 0");
    let missing = job.tmp.path().join("no-such-config.yaml");
    let command = job.command_with_config(&missing, &["--gpus", "0"]);
    let output = common::run_with_limit(command, LIMIT);
    let (stdout, stderr) = texts(&output);
    assert_eq!(
        output.status.code(),
        Some(2),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let shown = missing.display().to_string();
    assert!(stderr.contains(&shown), "{stderr}");
    let summary = job.summary(0);
    assert_eq!(summary["exit"], "error");
    assert!(
        summary["error"]
            .as_str()
            .is_some_and(|e| e.contains(&shown)),
        "{summary}"
    );
    // Nothing was started.
    assert!(!job.run_dir.join("logs/rank0.log").exists());
}
