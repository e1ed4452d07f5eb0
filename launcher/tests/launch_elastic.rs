//! Elastic membership on loopback (issue 37): two node launchers of one CPU rank
//! each train the tiny U-Net under `--min-nodes 1`; after a checkpoint node 1's
//! launcher, rank and cache server are stopped (SIGSTOP: silent, links open, as a
//! cut link or a hung host leaves them). Node 0 names node 1 lost, goes on alone
//! from the checkpoint with gradient accumulation 2 (the global batch kept), without
//! using a restart (`--max-restarts 0`), and completes; its summary lists the
//! membership change and the heartbeat directory names the lost node.
//!
//! And a lost node that comes back: node 1's launcher, rank and cache server are
//! killed (SIGKILL) after a checkpoint, node 0 goes on alone, a new node-1
//! launcher is started for the same job; node 0 takes it in at the next
//! checkpoint (a restart point: its ranks checkpoint and exit as on preemption),
//! and the job completes on both nodes with the global batch kept throughout
//! (a node-1 launcher with another config is refused before, naming it).
//!
//! And a node back that cannot be taken in: of three nodes, nodes 1 and 2 die, node
//! 0 goes on alone (accumulating 3); node 1 comes back, but two nodes cannot keep
//! the global batch of three, so it waits (past its own --peer-timeout-s: node 0
//! is linked); node 0 completes the job and the waiting launcher ends as node 0
//! did (completed, exit status 0, no attempt run).

mod common;

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use vrtspike_contract::heartbeat;
use vrtspike_contract::rundir::RunLayout;

use common::{exit_code, left_behind, process_tree, signal, wait_until, TinyTrain};

const TOTAL_STEPS: u64 = 16;
const CKPT_EVERY: u64 = 4;
/// Per-rank batch of the tiny config.
const BATCH: u64 = 2;
const LIMIT: Duration = Duration::from_secs(240);

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// When the first training step past `step` was logged after `since` (unix s).
fn first_step_after(layout: &RunLayout, step: u64, since: f64) -> Option<f64> {
    let metrics = std::fs::read_to_string(layout.metrics()).unwrap_or_default();
    metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "train" && v["step"].as_u64().is_some_and(|s| s > step))
        .filter_map(|v| v["time"].as_f64())
        .find(|t| *t > since)
}

/// Node `node`'s launcher of the two, its log in `log`.
fn start_node(config: &Path, run: &Path, node: u32, log: &Path) -> Child {
    start_node_of(2, config, run, node, log, &[])
}

/// Node `node`'s launcher of `nnodes`, its log in `log`, with `more` arguments.
fn start_node_of(
    nnodes: u32,
    config: &Path,
    run: &Path,
    node: u32,
    log: &Path,
    more: &[&str],
) -> Child {
    let extra = [
        "--min-nodes",
        "1",
        "--peer-silence-s",
        "3",
        "--grace-s",
        "2",
        "--max-restarts",
        "0",
        "--cache-size",
        "64M",
        "--stall-timeout-s",
        "0",
        // A cache server of each node's own, stopped with its node.
        "--set",
        "DATA.CACHE_SHARING=job",
    ];
    let out = std::fs::File::create(log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
    common::launcher_command(config, run)
        .args(common::node_args(nnodes, 1, node, "127.0.0.1", &extra))
        .args(more)
        .stdout(Stdio::null())
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("starting node {node}: {e}"))
}

/// The tiny config of `total_steps` in `dir`, a checkpoint every [`CKPT_EVERY`].
fn tiny_config(dir: &Path, total_steps: u64) -> std::path::PathBuf {
    let data = common::synth_tiny(dir);
    let tiny = TinyTrain {
        total_steps,
        ckpt_every: CKPT_EVERY,
        timeout_s: 60,
    };
    common::write_tiny_config(dir, &data, &tiny)
}

/// Rank 1 (node 1) trains past a checkpoint.
fn rank1_past_a_checkpoint(run: &Path, layout: &RunLayout) -> bool {
    wait_until(LIMIT, || {
        let latest = layout.latest_checkpoint().map_or(0, |c| c.step);
        let beat = heartbeat::read(run, 1).ok().flatten();
        latest >= CKPT_EVERY && beat.is_some_and(|b| b.progress.step > latest)
    })
}

/// A launcher's process and every process under it.
fn tree(pid: u32) -> Vec<u32> {
    [vec![pid], process_tree(pid)].concat()
}

/// Sends `sig` to every process of `pids`.
fn signal_all(pids: &[u32], sig: Signal) {
    for pid in pids {
        signal(*pid, sig);
    }
}

/// Sends `sig` to a launcher and every process under it; returns them.
fn signal_tree(pid: u32, sig: Signal) -> Vec<u32> {
    let pids = tree(pid);
    signal_all(&pids, sig);
    pids
}

/// The processes of `tree` (named by `what`) still alive after a bounded wait.
fn left_of(tree: &[u32], what: &str) -> Vec<String> {
    let names: Vec<String> = tree.iter().map(|p| format!("{what} pid {p}")).collect();
    let left = left_behind(tree, &names, Duration::from_secs(10));
    left.into_iter().cloned().collect()
}

/// Nothing of the launchers' process trees (each named) is left.
fn assert_none_left(trees: &[(&Vec<u32>, &str)]) {
    for (tree, what) in trees {
        let left = left_of(tree, what);
        assert!(left.is_empty(), "left behind: {left:?}");
    }
}

#[test]
fn a_node_lost_under_min_nodes_1_leaves_node_0_to_finish_alone_with_the_global_batch() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let config = tiny_config(tmp.path(), TOTAL_STEPS);
    let run = tmp.path().join("run");
    let layout = RunLayout::new(&run);
    let logs = [tmp.path().join("node0.log"), tmp.path().join("node1.log")];
    let mut node0 = start_node(&config, &run, 0, &logs[0]);
    let mut node1 = start_node(&config, &run, 1, &logs[1]);
    let log = |node: usize| std::fs::read_to_string(&logs[node]).unwrap_or_default();

    // Rank 1 (node 1) past the first checkpoint.
    let past_checkpoint = rank1_past_a_checkpoint(&run, &layout);
    assert!(past_checkpoint, "no checkpoint:\n{}\n{}", log(0), log(1));
    let node1_tree = signal_tree(node1.id(), Signal::SIGSTOP);
    let stopped = Instant::now();
    let stopped_unix = unix_now();
    let node0_tree = tree(node0.id());
    let code = exit_code(&mut node0, LIMIT);
    let finished_after = stopped.elapsed();
    signal_all(&node1_tree, Signal::SIGKILL);
    let _ = node1.wait();
    assert_eq!(code, Some(0), "node 0:\n{}", log(0));

    // Every step averaged 2 ranks' batches: before the change over 2 ranks, after
    // it over 1 rank accumulating 2.
    let summary = node0_completed(&layout, TOTAL_STEPS, 2);
    let attempts = summary["attempts"].as_array().cloned().unwrap_or_default();
    assert_eq!(attempts.len(), 2, "{summary}");
    assert_eq!(attempts[0]["failure"]["process"], "node 1", "{summary}");
    let changes = membership_changes(&summary);
    assert_eq!(changes.len(), 1, "{summary}");
    let change = &changes[0];
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    assert_eq!(
        (
            &change["nodes_before"],
            &change["nodes_after"],
            &change["attempt"],
            &change["accumulation"],
        ),
        (&2.into(), &1.into(), &1.into(), &2.into()),
        "{summary}"
    );
    assert_eq!(change["members"], serde_json::json!([0]), "{summary}");
    assert_eq!(change["lost"][0]["node"], 1, "{summary}");
    assert_eq!(change["lost"][0]["host"], host.trim(), "{summary}");
    let resumed = change["resumed_step"].as_u64().unwrap_or(0);
    assert!(
        resumed >= CKPT_EVERY && resumed % CKPT_EVERY == 0,
        "{summary}"
    );
    assert_eq!(
        attempts[1]["resumed_from"],
        format!("step_{resumed:08}"),
        "{summary}"
    );
    assert_eq!(summary["world_size"], 1, "{summary}");
    // The second start of the ranks: one rank, from the checkpoint.
    let starts = common::start_events(&layout);
    assert_eq!(starts.len(), 2, "{starts:?}");
    assert_eq!(
        (&starts[1]["world_size"], &starts[1]["step"]),
        (&1.into(), &resumed.into()),
        "{starts:?}"
    );
    assert!(
        log(0).contains("membership change: 1 of 2 nodes go on without node 1"),
        "{}",
        log(0)
    );
    // The lost node is named beside the ranks' heartbeats.
    let lost = heartbeat::read_lost_nodes(&run).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(lost.len(), 1, "{lost:?}");
    assert!(
        lost[0].0 == 1 && lost[0].1.contains("silent for") && lost[0].1.ends_with("lost"),
        "{lost:?}"
    );
    // Nothing of either node is left.
    let left = left_of(&node0_tree, "node 0");
    assert!(left.is_empty(), "left behind: {left:?}");
    let left = left_of(&node1_tree, "node 1");
    assert!(left.is_empty(), "left behind: {left:?}");
    let trained_on = first_step_after(&layout, resumed, stopped_unix).map(|t| t - stopped_unix);
    println!(
        "launch_elastic: node 1 stopped; node 0 trained past the checkpoint of step {resumed} alone \
         {} s later and finished {:.1} s later (--peer-silence-s 3, --grace-s 2, {TOTAL_STEPS} \
         steps)",
        trained_on.map_or("never".to_string(), |s| format!("{s:.1}")),
        finished_after.as_secs_f64()
    );
    assert!(
        trained_on.is_some(),
        "no step past the checkpoint after the stop"
    );
}

/// Steps of the re-admission run: enough that node 0, training alone, is still
/// short of the end when the returning node is taken in.
const REJOIN_TOTAL_STEPS: u64 = 128;

/// Node 0's summary, checked: the job completed all `steps`, each averaging the
/// batches of `first_nodes` ranks (the global batch kept whatever the world).
fn node0_completed(layout: &RunLayout, steps: u64, first_nodes: u64) -> serde_json::Value {
    let summary = common::read_json(&layout.launcher_summary(0));
    assert_eq!(summary["exit"], "completed", "{summary}");
    assert_eq!(summary["steps"], steps, "{summary}");
    assert_eq!(
        summary["samples_seen"],
        steps * BATCH * first_nodes,
        "the global batch was not kept: {summary}"
    );
    summary
}

/// A summary's membership changes.
fn membership_changes(summary: &serde_json::Value) -> Vec<serde_json::Value> {
    summary["membership_changes"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// The world size of every start of the ranks, in order.
fn worlds(layout: &RunLayout) -> Vec<u64> {
    common::start_events(layout)
        .iter()
        .filter_map(|s| s["world_size"].as_u64())
        .collect()
}

/// The entries of `/dev/shm`.
fn shm_entries() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return Vec::new();
    };
    dir.flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn a_lost_node_that_comes_back_is_taken_in_at_the_next_checkpoint_and_the_job_ends_on_both() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let config = tiny_config(tmp.path(), REJOIN_TOTAL_STEPS);
    let shm_before = shm_entries();
    let run = tmp.path().join("run");
    let layout = RunLayout::new(&run);
    let logs = [
        tmp.path().join("node0.log"),
        tmp.path().join("node1.log"),
        tmp.path().join("node1-again.log"),
        tmp.path().join("node1-unlike.log"),
    ];
    let mut node0 = start_node(&config, &run, 0, &logs[0]);
    let mut node1 = start_node(&config, &run, 1, &logs[1]);
    let log = |i: usize| std::fs::read_to_string(&logs[i]).unwrap_or_default();

    let past_checkpoint = rank1_past_a_checkpoint(&run, &layout);
    assert!(past_checkpoint, "no checkpoint:\n{}\n{}", log(0), log(1));
    // Node 1 dies outright: its launcher, rank and cache server.
    let node1_tree = signal_tree(node1.id(), Signal::SIGKILL);
    let _ = node1.wait();
    let went_on = wait_until(LIMIT, || {
        log(0).contains("membership change: 1 of 2 nodes go on without node 1")
    });
    assert!(went_on, "node 0 did not go on alone:\n{}", log(0));

    // A node-1 launcher with another config is refused, naming it, at once.
    let other = tmp.path().join("other.yaml");
    let text = std::fs::read_to_string(&config).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(&other, format!("{text}\n# another config\n")).unwrap_or_else(|e| panic!("{e}"));
    let mut unlike = start_node(&other, &run, 1, &logs[3]);
    let code = exit_code(&mut unlike, Duration::from_secs(60));
    assert!(code.is_some_and(|c| c != 0), "{code:?}:\n{}", log(3));
    assert!(log(3).contains("config (digest "), "{}", log(3));
    let refused = "refused a control connection from 127.0.0.1:";
    assert!(
        log(0)
            .lines()
            .any(|l| l.contains(refused) && l.contains("node 1's config")),
        "{}",
        log(0)
    );

    // A new launcher of node 1, for the same job.
    let started = Instant::now();
    let started_unix = unix_now();
    let mut again = start_node(&config, &run, 1, &logs[2]);
    let taken_in = wait_until(LIMIT, || {
        let starts = common::start_events(&layout);
        starts.len() >= 3 && starts[2]["world_size"] == 2
    });
    assert!(taken_in, "not taken in:\n{}\n{}", log(0), log(2));
    let resumed2 = common::start_events(&layout)[2]["step"]
        .as_u64()
        .unwrap_or(0);
    let both_training = wait_until(LIMIT, || {
        first_step_after(&layout, resumed2, started_unix).is_some()
    });
    let both_after = started.elapsed();
    assert!(both_training, "no step after re-admission:\n{}", log(0));
    let node0_tree = tree(node0.id());
    let again_tree = tree(again.id());
    let code0 = exit_code(&mut node0, LIMIT);
    let code1 = exit_code(&mut again, LIMIT);
    assert_eq!(code0, Some(0), "node 0:\n{}", log(0));
    assert_eq!(code1, Some(0), "node 1 again:\n{}", log(2));

    // The global batch was kept in all three worlds: 2 ranks, 1 rank
    // accumulating 2, 2 ranks again.
    let summary = node0_completed(&layout, REJOIN_TOTAL_STEPS, 2);
    assert_eq!(summary["world_size"], 2, "{summary}");
    // Neither membership change used a restart (`--max-restarts 0`).
    assert_eq!(summary["restarts"], 0, "{summary}");
    let changes = membership_changes(&summary);
    assert_eq!(changes.len(), 2, "{summary}");
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let (lost, back) = (&changes[0], &changes[1]);
    assert_eq!(
        (
            &lost["nodes_before"],
            &lost["nodes_after"],
            &lost["lost"][0]["node"]
        ),
        (&2.into(), &1.into(), &1.into()),
        "{summary}"
    );
    assert_eq!(
        (
            &back["nodes_before"],
            &back["nodes_after"],
            &back["accumulation"],
            &back["members"],
        ),
        (&1.into(), &2.into(), &1.into(), &serde_json::json!([0, 1])),
        "{summary}"
    );
    assert_eq!(back["rejoined"][0]["node"], 1, "{summary}");
    assert_eq!(back["rejoined"][0]["host"], host.trim(), "{summary}");
    assert_eq!(back["lost"], serde_json::json!([]), "{summary}");
    // Taken in at a checkpoint newer than the one node 0 went on alone from,
    // written when its ranks stopped at the restart point.
    let resumed1 = lost["resumed_step"].as_u64().unwrap_or(0);
    assert_eq!(back["resumed_step"], resumed2, "{summary}");
    assert!(resumed2 > resumed1, "{summary}");
    let attempts = summary["attempts"].as_array().cloned().unwrap_or_default();
    assert_eq!(attempts.len(), 3, "{summary}");
    assert_eq!(attempts[1]["outcome"], "preempted", "{summary}");
    assert_eq!(
        attempts[2]["resumed_from"],
        format!("step_{resumed2:08}"),
        "{summary}"
    );
    let starts = common::start_events(&layout);
    assert_eq!(worlds(&layout), [2, 1, 2], "{starts:?}");
    assert!(
        log(0).contains("membership change: node 1 (host ") && log(0).contains(") rejoined"),
        "{}",
        log(0)
    );
    // The returning node's own summary says it came back.
    let summary1 = common::read_json(&layout.launcher_summary(1));
    assert_eq!(summary1["exit"], "completed", "{summary1}");
    assert_eq!(summary1["restarts"], 0, "{summary1}");
    let rejoined = &summary1["membership_changes"][0]["rejoined"][0];
    assert_eq!(
        (&rejoined["node"], &rejoined["host"]),
        (&1.into(), &host.trim().into()),
        "{summary1}"
    );
    // Nothing of any launcher is left, nor any shared memory.
    assert_none_left(&[
        (&node0_tree, "node 0"),
        (&node1_tree, "node 1"),
        (&again_tree, "node 1 again"),
    ]);
    let new_shm: Vec<String> = shm_entries()
        .into_iter()
        .filter(|e| !shm_before.contains(e) && e.contains("vrtspike"))
        .collect();
    assert!(new_shm.is_empty(), "left in /dev/shm: {new_shm:?}");
    println!(
        "launch_elastic: node 1 killed after a checkpoint; its new launcher was taken in at the \
         checkpoint of step {resumed2} and both nodes trained {:.1} s after it started \
         (--peer-silence-s 3, {REJOIN_TOTAL_STEPS} steps)",
        both_after.as_secs_f64()
    );
}

/// Steps of the three-node run: node 0, alone, still trains when node 1 comes back.
const WAITING_TOTAL_STEPS: u64 = 240;

#[test]
fn a_node_back_that_cannot_be_taken_in_waits_and_ends_as_node_0_does() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let config = tiny_config(tmp.path(), WAITING_TOTAL_STEPS);
    let run = tmp.path().join("run");
    let layout = RunLayout::new(&run);
    let logs: Vec<_> = ["node0", "node1", "node2", "node1-again"]
        .iter()
        .map(|name| tmp.path().join(format!("{name}.log")))
        .collect();
    let log = |i: usize| std::fs::read_to_string(&logs[i]).unwrap_or_default();
    let mut nodes: Vec<Child> = (0..3)
        .map(|node| start_node_of(3, &config, &run, node, &logs[node as usize], &[]))
        .collect();

    let past_checkpoint = rank1_past_a_checkpoint(&run, &layout);
    assert!(past_checkpoint, "no checkpoint:\n{}\n{}", log(0), log(1));
    // Nodes 1 and 2 die outright, together: node 0 goes on alone (3 divides by 1).
    let dead: Vec<u32> = [tree(nodes[1].id()), tree(nodes[2].id())].concat();
    signal_all(&dead, Signal::SIGKILL);
    for node in &mut nodes[1..] {
        let _ = node.wait();
    }
    let alone = wait_until(LIMIT, || worlds(&layout) == [3, 1]);
    assert!(alone, "node 0 did not go on alone:\n{}", log(0));

    // Node 1 comes back while node 0 trains: linked, but 2 nodes cannot keep the
    // global batch of 3, so no restart point is made and it waits, past its
    // --peer-timeout-s (node 0 is linked).
    let timeout = ["--peer-timeout-s", "1"];
    let mut again = start_node_of(3, &config, &run, 1, &logs[3], &timeout);
    let linked = wait_until(LIMIT, || log(0).contains("node 1 came back from"));
    assert!(linked, "node 1 did not link again:\n{}\n{}", log(0), log(3));
    let linked_at = Instant::now();
    let still_training = common::start_events(&layout)
        .last()
        .and_then(|s| s["step"].as_u64())
        .is_some_and(|_| !layout.launcher_summary(0).exists());
    assert!(
        still_training,
        "node 0 ended before node 1 was back: raise the steps"
    );
    let node0_tree = tree(nodes[0].id());
    let again_tree = tree(again.id());
    let code0 = exit_code(&mut nodes[0], LIMIT);
    let waited = linked_at.elapsed();
    let code1 = exit_code(&mut again, LIMIT);
    assert_eq!(code0, Some(0), "node 0:\n{}", log(0));
    assert_eq!(code1, Some(0), "node 1 again:\n{}", log(3));
    assert!(
        waited > Duration::from_secs(2),
        "node 0 ended {waited:?} after node 1 linked: too soon to show a wait past its \
         --peer-timeout-s of 1 s (raise the steps)"
    );
    assert!(
        log(3).contains("waiting to be taken in for as long as node 0 is linked"),
        "{}",
        log(3)
    );
    println!(
        "launch_elastic: node 1 came back to 1 of 3 nodes, waited {:.1} s (--peer-timeout-s 1) \
         until node 0 completed, and ended completed",
        waited.as_secs_f64()
    );

    // Node 0 finished alone, the global batch kept, one membership change.
    let summary = node0_completed(&layout, WAITING_TOTAL_STEPS, 3);
    assert_eq!(summary["world_size"], 1, "{summary}");
    let changes = membership_changes(&summary);
    assert_eq!(changes.len(), 1, "{summary}");
    assert_eq!(changes[0]["members"], serde_json::json!([0]), "{summary}");
    assert_eq!(changes[0]["accumulation"], 3, "{summary}");
    assert_eq!(worlds(&layout), [3, 1], "node 1 was taken in");
    // The waiting launcher ended as node 0 did, having run nothing.
    let summary1 = common::read_json(&layout.launcher_summary(1));
    assert_eq!(summary1["exit"], "completed", "{summary1}");
    assert_eq!(summary1["exit_code"], 0, "{summary1}");
    assert_eq!(summary1["attempts"], serde_json::json!([]), "{summary1}");
    assert_eq!(summary1["error"], serde_json::Value::Null, "{summary1}");
    assert!(
        log(3).contains("node 0 ended the job (completed) before this node was taken in"),
        "{}",
        log(3)
    );
    assert_none_left(&[
        (&node0_tree, "node 0"),
        (&dead, "nodes 1 and 2"),
        (&again_tree, "node 1 again"),
    ]);
}
