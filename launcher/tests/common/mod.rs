//! Shared pieces of the launcher's tests: the launcher and `vrtspike` binaries, a
//! stand-in rank (a shell script written into the test's directory, run through
//! the launcher's hidden `--rank-cmd`), and small waits on files and processes.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::Value;

/// The launcher under test.
pub fn launcher() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_vrtspike-launch"))
}

/// The launcher on `config` into `run_dir`, with the environment the tests need: no
/// GPU, info logs, no stdin, and no SLURM variables (tests that want SLURM fake it;
/// a real one around the tests must not leak in). A node-shared cache server it
/// starts (the default `DATA.CACHE_SHARING: node`) ends as soon as its last job
/// detaches (`--cache-linger-s 0`; a later `--cache-linger-s` wins), so a test
/// that checks that nothing is left needs no wait.
pub fn launcher_command(config: &Path, run_dir: &Path) -> Command {
    launcher_command_at(&launcher(), config, run_dir)
}

/// [`launcher_command`] of the launcher at `exe` (a link to [`launcher`] beside a
/// stand-in `vrtspike`: the launcher runs the `vrtspike` beside it).
pub fn launcher_command_at(exe: &Path, config: &Path, run_dir: &Path) -> Command {
    let mut command = Command::new(exe);
    command
        .arg("--config")
        .arg(config)
        .arg("--run-dir")
        .arg(run_dir)
        .args(["--cache-linger-s", "0"])
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null());
    for (name, _) in std::env::vars().filter(|(name, _)| name.starts_with("SLURM_")) {
        command.env_remove(name);
    }
    command
}

/// The `vrtspike` binary beside the launcher (it runs the cache server).
pub fn vrtspike() -> PathBuf {
    let exe = launcher().with_file_name("vrtspike");
    assert!(
        exe.is_file(),
        "{} is missing: run the tests with `cargo test --workspace` (or `cargo build -p vrtspike` first)",
        exe.display()
    );
    exe
}

/// A test's directory: a config file, the stand-in rank, the run directory.
pub struct Job {
    /// Holds the directory until the test ends.
    pub tmp: tempfile::TempDir,
    /// The config handed to the launcher.
    pub config: PathBuf,
    /// The run directory.
    pub run_dir: PathBuf,
    /// The stand-in rank.
    pub rank_cmd: PathBuf,
}

/// Lines every stand-in runs first: it records its environment and pid in the run
/// directory (`env.rank<R>.attempt<K>`, `pid.rank<R>.attempt<K>`) and its
/// arguments in its log.
const PRELUDE: &str = r#"#!/bin/sh
set -u
TAG="rank$RANK.attempt$VRTSPIKE_RESTART_COUNT"
env > "$VRTSPIKE_RUN_DIR/env.$TAG.tmp" && mv "$VRTSPIKE_RUN_DIR/env.$TAG.tmp" "$VRTSPIKE_RUN_DIR/env.$TAG"
echo $$ > "$VRTSPIKE_RUN_DIR/pid.$TAG"
echo "stand-in rank $RANK of $WORLD_SIZE, attempt $VRTSPIKE_RESTART_COUNT, args: $*"
"#;

impl Job {
    /// A job whose ranks run `body` (POSIX sh, after the prelude).
    pub fn new(body: &str) -> Job {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let config = tmp.path().join("job.yaml");
        std::fs::write(
            &config,
            "DATA:\n  CACHE_SIZE_GB: 0.01\nMODEL:\n  ARCH: unet_spike\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let rank_cmd = tmp.path().join("rank.sh");
        write_exe(&rank_cmd, &format!("{PRELUDE}{body}\n"));
        let run_dir = tmp.path().join("run");
        Job {
            tmp,
            config,
            run_dir,
            rank_cmd,
        }
    }

    /// The launcher command for this job with the stand-in rank, fast timings,
    /// a small cache, and `extra` arguments.
    pub fn command<S: AsRef<std::ffi::OsStr>>(&self, extra: &[S]) -> Command {
        self.command_with_config(&self.config, extra)
    }

    /// [`Job::command`] with another config path.
    pub fn command_with_config<S: AsRef<std::ffi::OsStr>>(
        &self,
        config: &Path,
        extra: &[S],
    ) -> Command {
        let _ = vrtspike();
        let mut command = launcher_command(config, &self.run_dir);
        command
            .arg("--rank-cmd")
            .arg(&self.rank_cmd)
            .args(["--cache-size", "16M", "--restart-delay-s", "0"])
            .args(extra)
            .env("VRTSPIKE", vrtspike());
        command
    }

    /// Runs the launcher to its end (killed after `limit`).
    pub fn run(&self, extra: &[&str], limit: Duration) -> Output {
        run_with_limit(self.command(extra), limit)
    }

    /// The summary written by node `node_rank`'s launcher.
    pub fn summary(&self, node_rank: u32) -> Value {
        let name = if node_rank == 0 {
            "summary.json".to_string()
        } else {
            format!("summary.node{node_rank}.json")
        };
        read_json(&self.run_dir.join(name))
    }

    /// The environment a stand-in recorded, if it ran.
    pub fn rank_env(&self, rank: u32, attempt: u32) -> HashMap<String, String> {
        let path = self
            .run_dir
            .join(format!("env.rank{rank}.attempt{attempt}"));
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        text.lines()
            .filter_map(|line| line.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// The pid a stand-in recorded, once it has.
    pub fn rank_pid(&self, rank: u32, attempt: u32) -> Option<u32> {
        std::fs::read_to_string(
            self.run_dir
                .join(format!("pid.rank{rank}.attempt{attempt}")),
        )
        .ok()?
        .trim()
        .parse()
        .ok()
    }

    /// Whether ranks 0 and 1 of the first attempt recorded their pids within
    /// `limit`.
    pub fn two_ranks_started(&self, limit: Duration) -> bool {
        wait_until(limit, || {
            self.rank_pid(0, 0).is_some() && self.rank_pid(1, 0).is_some()
        })
    }

    /// A rank's log.
    pub fn rank_log(&self, rank: u32) -> String {
        std::fs::read_to_string(self.run_dir.join(format!("logs/rank{rank}.log")))
            .unwrap_or_default()
    }
}

/// `name` on PATH or in the sbin folders (daemons and `ip` live there).
pub fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/sbin", "/usr/bin"])
        .map(|dir| Path::new(dir).join(name))
        .find(|candidate| candidate.is_file());
    found
}

/// Why a test that needs root (for `root_for`) and `programs` (from the Debian
/// packages `packages`) cannot run here, if it cannot.
pub fn missing(root_for: &str, programs: &[&str], packages: &str) -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some(format!("it needs root ({root_for})"));
    }
    let absent: Vec<&str> = programs
        .iter()
        .copied()
        .filter(|p| find_program(p).is_none())
        .collect();
    (!absent.is_empty()).then(|| {
        format!(
            "{} not found (Debian packages {packages})",
            absent.join(", ")
        )
    })
}

/// The launcher arguments of node `node` of a two-node job of `ranks` CPU ranks a
/// node, node 0 at `master`, then `extra`.
pub fn two_node_args(ranks: u32, node: u32, master: &str, extra: &[&str]) -> Vec<String> {
    node_args(2, ranks, node, master, extra)
}

/// The launcher arguments of node `node` of a job of `nnodes` nodes of `ranks` CPU
/// ranks each, node 0 at `master`, then `extra`.
pub fn node_args(nnodes: u32, ranks: u32, node: u32, master: &str, extra: &[&str]) -> Vec<String> {
    let (nnodes, ranks, node) = (nnodes.to_string(), ranks.to_string(), node.to_string());
    let ours = [
        "--gpus",
        "0",
        "--ranks",
        &ranks,
        "--nnodes",
        &nnodes,
        "--node-rank",
        &node,
    ];
    ours.iter()
        .chain(&["--master-addr", master])
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
}

/// The `start` events of a run's metrics (one per start of the ranks), in order.
pub fn start_events(layout: &vrtspike_contract::RunLayout) -> Vec<Value> {
    let metrics = std::fs::read_to_string(layout.metrics()).unwrap_or_default();
    metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "start")
        .collect()
}

/// The launcher of two CPU ranks on `config` that a preemption may end at any
/// time (no restart; 60 s to checkpoint and exit), its output piped.
pub fn preemptible_two_ranks(config: &Path, run_dir: &Path) -> std::io::Result<Child> {
    launcher_command(config, run_dir)
        .args(["--gpus", "0", "--ranks", "2", "--max-restarts", "0"])
        .args(["--cache-size", "64M", "--grace-s", "60"])
        .args(["--preempt-timeout-s", "60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
}

/// The processes of `tree` (named by `names`, in order) still alive once
/// `limit` has passed, or as soon as none is.
pub fn left_behind<'a>(tree: &[u32], names: &'a [String], limit: Duration) -> Vec<&'a String> {
    wait_until(limit, || !tree.iter().any(|p| alive(*p)));
    tree.iter()
        .zip(names)
        .filter(|(p, _)| alive(**p))
        .map(|(_, n)| n)
        .collect()
}

/// Reads and parses a JSON file.
pub fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs `command`, killing it if it outlives `limit` (then the test fails).
pub fn run_with_limit(mut command: Command, limit: Duration) -> Output {
    let child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting the launcher: {e}"));
    wait_with_limit(child, limit)
}

/// Waits for a started launcher (output piped), killing it if it outlives `limit`
/// (then the test fails).
pub fn wait_with_limit(child: std::process::Child, limit: Duration) -> Output {
    let pid = child.id();
    let watchdog = std::thread::spawn(move || {
        let start = Instant::now();
        while start.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(50));
            if !alive(pid) {
                return false;
            }
        }
        signal(pid, Signal::SIGKILL);
        true
    });
    let output = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("waiting for the launcher: {e}"));
    let timed_out = watchdog.join().unwrap_or(false);
    assert!(
        !timed_out,
        "the launcher ran past {limit:?}; stderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Sends `signal` to process `pid` (ignoring a process that is already gone).
pub fn signal(pid: u32, signal: Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal);
}

/// Whether a process exists (and is not a zombie).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat
                .rfind(')')
                .and_then(|at| stat[at + 1..].split_whitespace().next())
                .unwrap_or("");
            state != "Z" && state != "X"
        }
        Err(_) => false,
    }
}

/// Polls `condition` every 20 ms until it holds (true) or `limit` passes (false).
pub fn wait_until(limit: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if condition() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    condition()
}

/// Waits for a launcher to exit (killing it after `limit`, and failing the test);
/// its exit code.
pub fn exit_code(child: &mut std::process::Child, limit: Duration) -> Option<i32> {
    let exited = wait_until(limit, || matches!(child.try_wait(), Ok(Some(_))));
    if !exited {
        let _ = child.kill();
    }
    let status = child.wait().unwrap_or_else(|e| panic!("{e}"));
    assert!(exited, "a launcher ran past {limit:?}");
    status.code()
}

/// Direct children of `pid`, from /proc.
pub fn children_of(pid: u32) -> Vec<u32> {
    let mut kids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        let ppid = stat
            .rfind(')')
            .and_then(|at| stat[at + 1..].split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            kids.push(child);
        }
    }
    kids
}

/// `Shmem:` of /proc/meminfo in MiB.
pub fn shmem_mb() -> f64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("Shmem:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Standard output and error as text, for assertions and messages.
pub fn texts(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A TCP port free right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("free port: {e}"))
}

/// The job secret the fake node 0 and the launchers under test share
/// (`VRTSPIKE_JOB_SECRET`).
pub const TEST_SECRET: &str = "test-secret-0123456789abcdef0123456789";

fn hmac_hex(text: &str) -> String {
    use hmac::{Hmac, Mac};
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(TEST_SECRET.as_bytes())
        .unwrap_or_else(|e| panic!("{e}"));
    mac.update(text.as_bytes());
    mac.finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Stands in for node 0's launcher on `port` (the control link of a lone node > 0
/// under test, which must get `VRTSPIKE_JOB_SECRET=TEST_SECRET`): checks the
/// launcher's proof of the secret (the protocol of `launcher/src/peers/auth.rs`),
/// welcomes it, starts attempt 0 with rank 0's store on `master_port`, and returns
/// all it said after the handshake once it hangs up.
pub fn fake_node0(port: u16, master_port: u16) -> std::thread::JoinHandle<String> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", port))
        .unwrap_or_else(|e| panic!("fake node 0 on port {port}: {e}"));
    std::thread::spawn(move || {
        use std::io::{BufRead, BufReader, Read, Write};
        let Ok((mut stream, _)) = listener.accept() else {
            return String::new();
        };
        let nonce = "f00d";
        let _ = stream.write_all(format!("VRTSPIKE-CONTROL 3 {nonce}\n").as_bytes());
        let mut reader = BufReader::new(stream.try_clone().unwrap_or_else(|e| panic!("{e}")));
        let mut hello = String::new();
        let _ = reader.read_line(&mut hello);
        let fields: Vec<&str> = hello.trim().split(' ').collect();
        // HELLO <node> <nonce> <proof> <version> <config digest>
        let [_, node, theirs, proof, _, _] = fields[..] else {
            return format!("bad hello {hello:?}");
        };
        if hmac_hex(&format!("hello {node} {nonce} {theirs}")) != proof {
            return format!("wrong proof in {hello:?}");
        }
        let welcome = hmac_hex(&format!("welcome {node} {theirs} {nonce}"));
        let _ = stream.write_all(format!("WELCOME {welcome}\nSTART 0 {master_port}\n").as_bytes());
        let mut said = String::new();
        let _ = reader.read_to_string(&mut said);
        said
    })
}

/// SLURM's `srun` on one node as the tests need it (`fake_srun.py`): G tasks with
/// srun's variables, and a signal srun gets goes to every process of the step.
const FAKE_SRUN: &str = include_str!("fake_srun.py");

/// `scontrol` that records its arguments in `$FAKE_SLURM_DIR/scontrol.called`.
const FAKE_SCONTROL: &str = r#"#!/bin/sh
echo "$@" > "$FAKE_SLURM_DIR/scontrol.called"
"#;

/// Writes an executable script.
pub fn write_exe(path: &Path, text: &str) {
    vrtspike_contract::child::write_executable(path, text).unwrap_or_else(|e| panic!("{e}"));
}

/// A `bin/` folder under `dir` with the fake `srun` and `scontrol`, and the PATH
/// that puts it first.
pub fn fake_slurm(dir: &Path) -> (PathBuf, String) {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap_or_else(|e| panic!("{e}"));
    write_exe(&bin.join("srun"), FAKE_SRUN);
    write_exe(&bin.join("scontrol"), FAKE_SCONTROL);
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    (bin, path)
}

/// Every descendant of `pid` (its whole process tree), from /proc.
pub fn process_tree(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let mut todo = vec![pid];
    while let Some(parent) = todo.pop() {
        for child in children_of(parent) {
            found.push(child);
            todo.push(child);
        }
    }
    found
}

/// The command line of process `pid` (arguments joined by spaces).
pub fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|bytes| {
            bytes
                .split(|b| *b == 0)
                .map(|arg| String::from_utf8_lossy(arg).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

/// The node-shared cache server's address of this user for the dataset at `data`
/// (what the launcher attaches to or starts under `DATA.CACHE_SHARING: node`).
pub fn node_shared_address(data: &Path) -> String {
    let signature = vrtspike_contract::dataset_sig::sign(data).unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    vrtspike_contract::cache_addr::shared_cache_address(uid, signature.digest, None)
}

/// A tiny dataset written by `vrtspike synth` into `dir/data`.
pub fn synth_tiny(dir: &Path) -> PathBuf {
    synth_tiny_as(dir, &[])
}

/// The same tiny dataset as HDF5 sessions (each rank reads them through an
/// `h5-probe` child process).
pub fn synth_tiny_h5(dir: &Path) -> PathBuf {
    synth_tiny_as(dir, &["--h5"])
}

fn synth_tiny_as(dir: &Path, extra: &[&str]) -> PathBuf {
    let data = dir.join("data");
    let mut args = vec!["--seqs", "2", "--test-seqs", "1", "--frames", "6"];
    args.extend(["--height", "64", "--width", "96", "--seed", "9"]);
    args.extend(extra);
    synth(&data, &args);
    data
}

/// `vrtspike synth --out data args...`, or a panic with what it said.
pub fn synth(data: &Path, args: &[&str]) {
    let output = Command::new(vrtspike())
        .arg("synth")
        .arg("--out")
        .arg(data)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running vrtspike synth: {e}"));
    let (stdout, stderr) = texts(&output);
    assert!(output.status.success(), "synth: {stdout}\n{stderr}");
}

/// Whether rank 0 has logged a finished training step in `run_dir`.
pub fn trained_a_step(run_dir: &Path) -> bool {
    let layout = vrtspike_contract::rundir::RunLayout::new(run_dir);
    std::fs::read_to_string(layout.metrics())
        .is_ok_and(|text| text.lines().any(|l| l.contains("\"kind\":\"train\"")))
}

/// What the tiny U-Net training runs of the end-to-end tests differ in.
#[derive(Debug, Clone, Copy)]
pub struct TinyTrain {
    /// `TRAIN.TOTAL_STEPS`.
    pub total_steps: u64,
    /// `LOG.CKPT_EVERY_STEPS`.
    pub ckpt_every: u64,
    /// `DIST.TIMEOUT_S`.
    pub timeout_s: u64,
}

/// The tiny U-Net config of `configs/tiny`, smaller still, on `data`, written as
/// `dir/tiny.yaml`.
pub fn write_tiny_config(dir: &Path, data: &Path, run: &TinyTrain) -> PathBuf {
    let path = dir.join("tiny.yaml");
    let text = format!(
        "DATA:\n  ROOT: {}\n  CROP_SIZE: 32\n  VAL_CROP_SIZE: null\n  VAL_TILE: 32\n  VAL_TILE_OVERLAP: 16\n  CLIP_LEN: 2\n  SPIKE_BINS: 4\n  CACHE_SIZE_GB: 0.05\n\
         DATALOADER:\n  TOTAL_WORKERS: 2\n\
         TRAIN:\n  BATCH_SIZE: 2\n  TOTAL_STEPS: {}\n  LR: 1.0e-3\n  SEED: 3\n\
         MODEL:\n  ARCH: unet_spike\n  UNET:\n    CHANNELS: 4\n    LEVELS: 1\n  SPIKE:\n    ENABLED: true\n    VOXEL_BINS: 4\n\
         LOG:\n  LOG_EVERY_STEPS: 1\n  VAL_EVERY_STEPS: 1000\n  CKPT_EVERY_STEPS: {}\n  MEM_EVERY_STEPS: 1000\n\
         DIST:\n  TIMEOUT_S: {}\n",
        data.display(),
        run.total_steps,
        run.ckpt_every,
        run.timeout_s
    );
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    path
}
