//! Ranks that torchrun drives, with the cache: `torchrun --standalone
//! --nproc-per-node 2 --no-python vrtspike train --config C` trains through the
//! node-shared cache server (`DATA.CACHE_SHARING: node`, the default), which local
//! rank 0 starts (no launcher of ours did, none ran for the dataset) and which
//! ends when the last rank detaches (`VRTSPIKE_CACHE_LINGER_S=0`); with `job`,
//! `kill -9` of local rank 0 takes its own server along; a rank killed with `kill -9` under `--max-restarts 1`
//! makes torchrun restart both ranks, which resume from the last checkpoint (the
//! failed attempt's store keys stay under its own prefix) and complete, leaving
//! nothing behind. torchrun comes from the project's virtualenv (`VIRTUAL_ENV`, or
//! the workspace's `.venv`): where the build found none the tests are ignored
//! (counted as such in cargo's closing line, see `launcher/build.rs`); under
//! `CI=true`, or when it is missing at run time, they fail saying so.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use vrtspike_contract::heartbeat;
use vrtspike_contract::rundir::RunLayout;
use vrtspike_contract::summary::{RunSummary, TrainStatus};

use common::{
    alive, cmdline, process_tree, read_json, signal, synth_tiny, texts, vrtspike, wait_until,
    write_tiny_config, TinyTrain,
};

const LIMIT: Duration = Duration::from_secs(240);
const TOTAL_STEPS: u64 = 16;

/// torchrun of the project's virtualenv, if there is one.
fn torchrun() -> Option<PathBuf> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let venvs = [
        std::env::var_os("VIRTUAL_ENV").map(PathBuf::from),
        Some(workspace.join(".venv")),
    ];
    venvs
        .into_iter()
        .flatten()
        .map(|venv| venv.join("bin/torchrun"))
        .find(|exe| exe.is_file())
}

/// torchrun running two `vrtspike train` ranks on `config` in `dir` (its default
/// run directory, `runs/torchrun-<run id>`, lands there).
fn torchrun_command(torchrun: &Path, dir: &Path, config: &Path, extra: &[&str]) -> Command {
    let mut command = Command::new(torchrun);
    command
        .args([
            "--standalone",
            "--nproc-per-node",
            "2",
            "--monitor-interval",
            "0.2",
        ])
        .args(extra)
        .arg("--no-python")
        .arg(vrtspike())
        .args(["train", "--config"])
        .arg(config)
        .current_dir(dir)
        .env("OMP_NUM_THREADS", "1")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, _) in std::env::vars().filter(|(name, _)| {
        name.starts_with("SLURM_")
            || name.starts_with("VRTSPIKE_")
            || name == "CUDA_VISIBLE_DEVICES"
    }) {
        command.env_remove(name);
    }
    // The node-shared server local rank 0 starts ends with the last rank, so the
    // test can check that nothing is left.
    command.env(vrtspike_contract::shared_server::LINGER_ENV, "0");
    command
}

/// The job's one run directory under `dir/runs`.
fn run_dir(dir: &Path) -> PathBuf {
    let runs: Vec<PathBuf> = std::fs::read_dir(dir.join("runs"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(runs.len(), 1, "one run directory: {runs:?}");
    runs[0].clone()
}

fn tiny(dir: &Path) -> PathBuf {
    let data = synth_tiny(dir);
    let train = TinyTrain {
        total_steps: TOTAL_STEPS,
        ckpt_every: 2,
        timeout_s: 60,
    };
    write_tiny_config(dir, &data, &train)
}

/// [`tiny`] with a server of the job's own (`DATA.CACHE_SHARING: job`).
fn tiny_own_cache(dir: &Path) -> PathBuf {
    let config = tiny(dir);
    let text = std::fs::read_to_string(&config).unwrap_or_else(|e| panic!("{e}"));
    let text = text.replacen("DATA:\n", "DATA:\n  CACHE_SHARING: job\n", 1);
    std::fs::write(&config, text).unwrap_or_else(|e| panic!("{e}"));
    config
}

/// Every process seen under torchrun while `child` runs (sampled, with its
/// command line), and its output; `during` acts once, when it says it did.
fn run_watching(
    mut child: Child,
    mut during: impl FnMut(&mut Child) -> bool,
) -> (Output, BTreeMap<u32, String>) {
    let mut seen = BTreeMap::new();
    let started = std::time::Instant::now();
    let mut acted = false;
    while matches!(child.try_wait(), Ok(None)) && started.elapsed() < LIMIT {
        for pid in process_tree(child.id()) {
            note_cmdline(&mut seen, pid);
        }
        if !acted {
            acted = during(&mut child);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    (common::wait_with_limit(child, Duration::from_secs(5)), seen)
}

/// Keeps the last non-empty command line read for `pid`: a child read
/// between its fork and its exec shows its parent's, and one read during the
/// exec or as a zombie shows none (a CI run saw the node's cache server as
/// "" and failed to find it).
fn note_cmdline(seen: &mut BTreeMap<u32, String>, pid: u32) {
    let now = cmdline(pid);
    let known = seen.entry(pid).or_default();
    if !now.is_empty() {
        *known = now;
    }
}

fn assert_nothing_left(seen: &BTreeMap<u32, String>) {
    let gone = wait_until(Duration::from_secs(10), || !seen.keys().any(|p| alive(*p)));
    let left: Vec<&String> = seen
        .iter()
        .filter(|(p, _)| alive(**p))
        .map(|(_, c)| c)
        .collect();
    assert!(gone, "left behind: {left:?}");
}

#[test]
#[cfg_attr(
    vrtspike_no_torchrun,
    ignore = "needs torchrun in VIRTUAL_ENV or the workspace's .venv"
)]
fn torchrun_ranks_train_through_the_node_cache() {
    let Some(torchrun) = torchrun() else {
        panic!("this test needs torchrun in VIRTUAL_ENV or the workspace's .venv (make setup creates it)");
    };
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let config = tiny(tmp.path());
    let child = torchrun_command(&torchrun, tmp.path(), &config, &[])
        .spawn()
        .unwrap_or_else(|e| panic!("starting torchrun: {e}"));
    let (output, seen) = run_watching(child, |_| false);
    let (stdout, stderr) = texts(&output);
    let context = format!("stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(output.status.success(), "{context}");
    let run = run_dir(tmp.path());
    assert!(
        run.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("torchrun-")),
        "{}",
        run.display()
    );
    let layout = RunLayout::new(&run);
    let ranks = RunSummary::read(&layout.train_summary()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (ranks.status, ranks.steps),
        (TrainStatus::Completed, TOTAL_STEPS)
    );
    let hit_rate = ranks.cache_hit_rate.unwrap_or(0.0);
    assert!(hit_rate > 0.5, "through the cache: {ranks:?}");
    assert!(!context.contains("no cache server"), "{context}");
    // DATA.CACHE_SHARING node (the default): local rank 0 started the node-shared
    // server (none ran for this dataset), rank 1 attached to it.
    assert!(
        context.contains("node cache server started (node-shared)"),
        "{context}"
    );
    assert!(context.contains("node cache server attached"), "{context}");
    assert!(layout.cache_log(0).is_file());
    // The dataset was signed once on the node: local rank 0 published which
    // server it is (the node-shared one, at its address) for rank 1 in the run
    // directory.
    let published: Vec<serde_json::Value> = std::fs::read_dir(run.join("rendezvous"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".cache-addr"))
        .map(|e| read_json(&e.path()))
        .collect();
    assert!(
        published.len() == 1
            && published[0]["mode"] == "node"
            && published[0]["address"]
                .as_str()
                .is_some_and(|a| a.starts_with("vrtspike-cache-u") && a.contains("-ds")),
        "{published:?}"
    );
    assert!(
        seen.values().any(|c| c.contains("cache serve")),
        "local rank 0 ran the node's cache server: {seen:?}"
    );
    assert_nothing_left(&seen);
    println!("launch_torchrun: 2 ranks under torchrun, cache hit rate {hit_rate:.2}");
}

#[test]
#[cfg_attr(
    vrtspike_no_torchrun,
    ignore = "needs torchrun in VIRTUAL_ENV or the workspace's .venv"
)]
fn a_rank_killed_under_torchrun_restarts_both_from_the_checkpoint() {
    let Some(torchrun) = torchrun() else {
        panic!("this test needs torchrun in VIRTUAL_ENV or the workspace's .venv (make setup creates it)");
    };
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let config = tiny(tmp.path());
    let child = torchrun_command(&torchrun, tmp.path(), &config, &["--max-restarts", "1"])
        .spawn()
        .unwrap_or_else(|e| panic!("starting torchrun: {e}"));
    let dir = tmp.path().to_path_buf();
    let mut killed = None;
    let (output, seen) = run_watching(child, |child| {
        let Some(run) = std::fs::read_dir(dir.join("runs"))
            .ok()
            .and_then(|mut d| d.next())
        else {
            return false;
        };
        let Ok(run) = run.map(|e| e.path()) else {
            return false;
        };
        let layout = RunLayout::new(&run);
        let beat = heartbeat::read(&run, 1).ok().flatten();
        let Some(beat) = beat.filter(|b| b.attempt == 0 && layout.latest_checkpoint().is_some())
        else {
            return false;
        };
        if !process_tree(child.id()).contains(&beat.pid) {
            return false;
        }
        signal(beat.pid, Signal::SIGKILL);
        killed = Some((beat.pid, layout.latest_checkpoint().map(|c| c.step)));
        true
    });
    let (stdout, stderr) = texts(&output);
    let context = format!("stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(output.status.success(), "{context}");
    let (pid, checkpoint) = killed.unwrap_or_else(|| panic!("rank 1 was never killed: {context}"));
    let layout = RunLayout::new(run_dir(tmp.path()));
    let ranks = RunSummary::read(&layout.train_summary()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (ranks.status, ranks.steps),
        (TrainStatus::Completed, TOTAL_STEPS)
    );
    assert_eq!(ranks.restarts, 1, "{ranks:?}");
    let starts = common::start_events(&layout);
    assert_eq!(starts.len(), 2, "{starts:?}");
    assert_eq!(starts[1]["restart_count"], 1);
    let resumed = starts[1]["step"].as_u64();
    assert!(
        resumed.is_some() && resumed >= checkpoint,
        "resumed from step {resumed:?}, the checkpoint before the kill was {checkpoint:?}"
    );
    assert!(!context.contains("no cache server"), "{context}");
    assert_nothing_left(&seen);
    println!(
        "launch_torchrun: kill -9 of rank 1 (pid {pid}) after checkpoint {checkpoint:?} -> torchrun restarted, resumed at step {resumed:?}, completed"
    );
}

#[test]
#[cfg_attr(
    vrtspike_no_torchrun,
    ignore = "needs torchrun in VIRTUAL_ENV or the workspace's .venv"
)]
fn kill_9_of_local_rank_0_takes_its_cache_server_along() {
    let Some(torchrun) = torchrun() else {
        panic!("this test needs torchrun in VIRTUAL_ENV or the workspace's .venv (make setup creates it)");
    };
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let config = tiny_own_cache(tmp.path());
    let child = torchrun_command(&torchrun, tmp.path(), &config, &["--max-restarts", "0"])
        .spawn()
        .unwrap_or_else(|e| panic!("starting torchrun: {e}"));
    let dir = tmp.path().to_path_buf();
    let mut server = None;
    let (output, seen) = run_watching(child, |child| {
        let tree = process_tree(child.id());
        let Some(cache) = tree.iter().find(|p| cmdline(**p).contains("cache serve")) else {
            return false;
        };
        let Some(run) = std::fs::read_dir(dir.join("runs"))
            .ok()
            .and_then(|mut d| d.next())
        else {
            return false;
        };
        let beat = run
            .ok()
            .and_then(|r| heartbeat::read(&r.path(), 0).ok().flatten());
        let Some(rank0) = beat.map(|b| b.pid).filter(|p| tree.contains(p)) else {
            return false;
        };
        server = Some(*cache);
        signal(rank0, Signal::SIGKILL);
        true
    });
    let (stdout, stderr) = texts(&output);
    assert!(
        !output.status.success(),
        "torchrun reports the failure:\n{stdout}\n{stderr}"
    );
    let server = server.unwrap_or_else(|| panic!("no cache server seen:\n{stderr}"));
    assert!(seen.contains_key(&server));
    assert_nothing_left(&seen);
}
