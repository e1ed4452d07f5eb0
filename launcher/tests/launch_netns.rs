//! Two real nodes in the suite: two Linux network namespaces on this machine, each
//! with its own loopback and its own abstract Unix sockets (so its own cache
//! server), joined by a veth pair; one `vrtspike-launch --nnodes 2` in each, one
//! CPU rank per node, Gloo over the veth (`GLOO_SOCKET_IFNAME`), a shared run
//! directory. Needs root (CI runs as root) and `ip` (iproute2): where the build
//! found neither, the tests are ignored (counted as such in cargo's closing line,
//! see `launcher/build.rs`); under `CI=true`, or when either is missing at run time,
//! they fail saying what they need. Every test removes its namespaces and veth pair, and
//! kills what runs in them, even when it fails (a guard); names carry the pid and a
//! counter, so two test binaries cannot collide.
//!
//! - One job: `kill -9` of node 1's rank after a checkpoint -> both nodes restart
//!   together; then node 1's rank is stopped (SIGSTOP): node 1's launcher names it
//!   from its own ticks (node 0 never judges another node's rank, whose record on a
//!   shared file system may be late), node 0 hears it on the control link and
//!   saves its own stacks -> both restart again; the job completes on both nodes
//!   with the same final parameters, and nothing is left in either namespace.
//! - `kill -9` of node 1's launcher -> node 0 ends, naming node 1.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::Value;
use vrtspike_contract::heartbeat;
use vrtspike_contract::rundir::RunLayout;

use common::{
    exit_code, read_json, signal, synth_tiny, wait_until, write_tiny_config, Job, TinyTrain,
};

const LIMIT: Duration = Duration::from_secs(300);
const NODE0_ADDR: &str = "10.213.0.1";
const NODE1_ADDR: &str = "10.213.0.2";

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// Two network namespaces joined by a veth pair; removed (with everything that
/// runs in them) when dropped.
struct TwoNodes {
    ns: [String; 2],
    veth: [String; 2],
}

/// `ip` from this process's PATH (the launchers' PATH may differ).
fn ip_exe() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("ip"))
        .find(|exe| exe.is_file())
}

/// Runs `ip` with `args`; the error names the command.
fn ip(args: &[&str]) -> Result<(), String> {
    let output = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if !output.status.success() {
        return Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    Ok(())
}

/// Why these tests cannot run here, if they cannot.
fn cannot_run() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("root: network namespaces need root (CI runs as root)".into());
    }
    if ip_exe().is_none() {
        return Some("the `ip` command: install iproute2".into());
    }
    None
}

impl TwoNodes {
    fn new() -> TwoNodes {
        let tag = format!(
            "{}x{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        let nodes = TwoNodes {
            ns: [format!("vsp{tag}a"), format!("vsp{tag}b")],
            veth: [format!("vsa{tag}"), format!("vsb{tag}")],
        };
        if let Err(e) = nodes.set_up() {
            panic!("setting up two namespaces: {e}");
        }
        nodes
    }

    fn set_up(&self) -> Result<(), String> {
        let [ns0, ns1] = [&self.ns[0], &self.ns[1]];
        let [v0, v1] = [&self.veth[0], &self.veth[1]];
        ip(&["netns", "add", ns0])?;
        ip(&["netns", "add", ns1])?;
        ip(&["link", "add", v0, "type", "veth", "peer", "name", v1])?;
        for (ns, veth, addr) in [(ns0, v0, NODE0_ADDR), (ns1, v1, NODE1_ADDR)] {
            ip(&["link", "set", veth, "netns", ns])?;
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", veth])?;
            ip(&["-n", ns, "link", "set", veth, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(())
    }

    /// The processes that run in node `node`'s namespace.
    fn pids(&self, node: usize) -> Vec<u32> {
        Command::new("ip")
            .args(["netns", "pids", &self.ns[node]])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .split_whitespace()
                    .filter_map(|p| p.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// `command` run inside node `node`'s namespace, with Gloo on its veth and
    /// its output in `log`.
    fn command(&self, node: usize, command: &Command, log: &Path) -> Command {
        let out = std::fs::File::create(log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
        let err = out.try_clone().unwrap_or_else(|e| panic!("{e}"));
        let mut inside = Command::new(ip_exe().unwrap_or_else(|| PathBuf::from("ip")));
        inside
            .args(["netns", "exec", &self.ns[node]])
            .arg(command.get_program())
            .args(command.get_args())
            .env("GLOO_SOCKET_IFNAME", &self.veth[node])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        if let Some(dir) = command.get_current_dir() {
            inside.current_dir(dir);
        }
        for (key, value) in command.get_envs() {
            match value {
                Some(value) => inside.env(key, value),
                None => inside.env_remove(key),
            };
        }
        inside
    }
}

impl Drop for TwoNodes {
    fn drop(&mut self) {
        for node in 0..2 {
            for pid in self.pids(node) {
                signal(pid, Signal::SIGKILL);
            }
        }
        for ns in &self.ns {
            let _ = ip(&["netns", "del", ns]);
        }
        let _ = ip(&["link", "del", &self.veth[0]]);
    }
}

/// The launcher arguments of node `node` of two, node 0 at [`NODE0_ADDR`].
fn node_args(node: u32) -> Vec<String> {
    common::two_node_args(1, node, NODE0_ADDR, &[])
}

/// The last `final parameters agree` hash in a rank's log.
fn final_hash(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines()
        .rev()
        .find_map(|l| l.split("final parameters agree across ranks: hash ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .map(str::to_string)
}

/// Waits for rank 1's record to show attempt `attempt` past `after_step` with a
/// checkpoint of at least `checkpoint` on disk; returns rank 1's pid.
fn rank1_running(run: &Path, attempt: u32, checkpoint: u64) -> Option<u32> {
    let layout = RunLayout::new(run);
    let mut pid = None;
    wait_until(LIMIT, || {
        let beat = heartbeat::read(run, 1).ok().flatten();
        let latest = layout.latest_checkpoint().map_or(0, |c| c.step);
        pid = beat
            .filter(|b| b.attempt == attempt && latest >= checkpoint && b.progress.step > latest)
            .map(|b| b.pid);
        pid.is_some()
    });
    pid
}

fn summaries(run: &Path) -> (Value, Value) {
    let layout = RunLayout::new(run);
    (
        read_json(&layout.launcher_summary(0)),
        read_json(&layout.launcher_summary(1)),
    )
}

#[test]
#[cfg_attr(
    any(vrtspike_no_root, vrtspike_no_ip),
    ignore = "needs root and `ip` (iproute2) for network namespaces"
)]
fn two_namespace_nodes_restart_together_name_a_stopped_rank_and_agree_at_the_end() {
    if let Some(why) = cannot_run() {
        panic!("this test needs {why}");
    }
    let nodes = TwoNodes::new();
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let data = synth_tiny(tmp.path());
    let train = TinyTrain {
        total_steps: 60,
        ckpt_every: 4,
        timeout_s: 60,
    };
    let config = write_tiny_config(tmp.path(), &data, &train);
    let run: PathBuf = tmp.path().join("run");
    let launch = |node: u32, watch: &[&str]| {
        let mut command = common::launcher_command(&config, &run);
        command
            .args(node_args(node))
            .args([
                "--max-restarts",
                "2",
                "--grace-s",
                "2",
                "--restart-delay-s",
                "0",
            ])
            .args(["--cache-size", "64M"])
            .args(watch)
            // gdb on a debug build takes half a minute: /proc stacks only.
            .env("PATH", tmp.path().join("no-tools"))
            .env("OMP_NUM_THREADS", "1");
        let log = tmp.path().join(format!("launcher{node}.log"));
        nodes
            .command(node as usize, &command, &log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting node {node}: {e}"))
    };
    // Each node watches its own ranks.
    let mut node0 = launch(0, &["--stall-timeout-s", "5"]);
    let mut node1 = launch(1, &["--stall-timeout-s", "5"]);

    // Attempt 0: kill -9 of node 1's rank after a checkpoint.
    let victim = rank1_running(&run, 0, 4).unwrap_or_else(|| panic!("no checkpoint in attempt 0"));
    signal(victim, Signal::SIGKILL);
    // Attempt 1: stop node 1's rank after a new checkpoint.
    let resumed = RunLayout::new(&run)
        .latest_checkpoint()
        .map_or(0, |c| c.step);
    let stopped = rank1_running(&run, 1, resumed + 4)
        .unwrap_or_else(|| panic!("no new checkpoint in attempt 1"));
    signal(stopped, Signal::SIGSTOP);
    let stopped_at = Instant::now();
    let stacks = heartbeat::stacks_path(&run, 1, 1);
    let named = wait_until(LIMIT, || stacks.exists());
    let named_s = stopped_at.elapsed().as_secs_f64();

    let code0 = exit_code(&mut node0, LIMIT);
    let code1 = exit_code(&mut node1, LIMIT);
    let log = |node: u32| {
        std::fs::read_to_string(tmp.path().join(format!("launcher{node}.log"))).unwrap_or_default()
    };
    let context = format!("node 0:\n{}\nnode 1:\n{}", log(0), log(1));
    assert!(
        named,
        "the stopped rank's stacks were never saved\n{context}"
    );
    let (summary0, summary1) = summaries(&run);
    assert_eq!(
        (code0, code1),
        (Some(0), Some(0)),
        "{summary0}\n{summary1}\n{context}"
    );
    for summary in [&summary0, &summary1] {
        assert_eq!(summary["exit"], "completed", "{summary}");
        assert_eq!(
            summary["restarts"], 2,
            "both nodes restarted together: {summary}"
        );
        assert_eq!(summary["world_size"], 2);
    }
    let killed = &summary1["attempts"][0]["failure"];
    assert_eq!(
        (killed["rank"].as_u64(), killed["signal"].as_str()),
        (Some(1), Some("SIGKILL")),
        "{summary1}\n{context}"
    );
    assert_eq!(summary0["attempts"][0]["failure"]["process"], "node 1");
    // Node 1 named its stopped rank; node 0 heard it from node 1.
    let cause1 = summary1["attempts"][1]["failure"]["cause"]
        .as_str()
        .unwrap_or("");
    assert!(
        cause1.starts_with("stopped: rank 1 (node 1) in phase "),
        "{summary1}"
    );
    let heard = &summary0["attempts"][1]["failure"];
    assert_eq!(heard["process"], "node 1", "{summary0}");
    assert!(
        heard["cause"]
            .as_str()
            .is_some_and(|c| c.starts_with("node 1: stopped: rank 1 (node 1)")),
        "{summary0}"
    );
    assert!(
        stacks.exists() && heartbeat::stacks_path(&run, 1, 0).exists(),
        "every rank's stacks"
    );
    // The same final parameters on both nodes.
    let layout = RunLayout::new(&run);
    let (hash0, hash1) = (
        final_hash(&layout.rank_log(0)),
        final_hash(&layout.rank_log(1)),
    );
    assert!(hash0.is_some() && hash0 == hash1, "{hash0:?} {hash1:?}");
    let nothing_left = wait_until(Duration::from_secs(10), || {
        nodes.pids(0).is_empty() && nodes.pids(1).is_empty()
    });
    assert!(
        nothing_left,
        "left: {:?} {:?}",
        nodes.pids(0),
        nodes.pids(1)
    );
    let latency = |s: &Value, a: usize| {
        s["attempts"][a]["restart_latency_s"]
            .as_f64()
            .unwrap_or(f64::NAN)
    };
    println!(
        "launch_netns: restart after kill -9 of node 1's rank: {:.2} s (node 0) / {:.2} s (node 1); \
         stopped rank named by node 1 in {named_s:.1} s, restart {:.2} s / {:.2} s; final hash {}",
        latency(&summary0, 1),
        latency(&summary1, 1),
        latency(&summary0, 2),
        latency(&summary1, 2),
        hash0.unwrap_or_default()
    );
}

#[test]
#[cfg_attr(
    any(vrtspike_no_root, vrtspike_no_ip),
    ignore = "needs root and `ip` (iproute2) for network namespaces"
)]
fn kill_9_of_node_1_s_launcher_ends_node_0_naming_it() {
    if let Some(why) = cannot_run() {
        panic!("this test needs {why}");
    }
    let nodes = TwoNodes::new();
    let job = Job::new("while :; do sleep 0.05; done");
    let launch = |node: u32| {
        let mut args = node_args(node);
        args.extend([
            "--max-restarts".into(),
            "3".into(),
            "--grace-s".into(),
            "2".into(),
        ]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let log = job.tmp.path().join(format!("launcher{node}.log"));
        nodes
            .command(node as usize, &job.command(&args), &log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting node {node}: {e}"))
    };
    let mut node0 = launch(0);
    let mut node1 = launch(1);
    let up = job.two_ranks_started(Duration::from_secs(60));
    assert!(up, "the ranks never started");
    assert!(!nodes.pids(1).is_empty());
    node1.kill().unwrap_or_else(|e| panic!("{e}")); // SIGKILL
    let _ = node1.wait();
    let killed = Instant::now();
    assert_eq!(exit_code(&mut node0, Duration::from_secs(60)), Some(1));
    let ended_s = killed.elapsed().as_secs_f64();
    let summary0 = job.summary(0);
    assert_eq!(
        summary0["restarts"], 0,
        "no restart without node 1: {summary0}"
    );
    let error = summary0["error"].as_str().unwrap_or("");
    assert!(
        error.contains("node 1") && error.contains("went away"),
        "{summary0}"
    );
    let nothing_left = wait_until(Duration::from_secs(10), || {
        nodes.pids(0).is_empty() && nodes.pids(1).is_empty()
    });
    assert!(
        nothing_left,
        "left: {:?} {:?}",
        nodes.pids(0),
        nodes.pids(1)
    );
    println!("launch_netns: node 0 ended {ended_s:.2} s after kill -9 of node 1's launcher");
}

#[test]
#[cfg_attr(
    any(vrtspike_no_root, vrtspike_no_ip),
    ignore = "needs root and `ip` (iproute2) for network namespaces"
)]
fn a_cut_link_is_named_lost_on_both_sides_and_neither_restarts() {
    if let Some(why) = cannot_run() {
        panic!("this test needs {why}");
    }
    let nodes = TwoNodes::new();
    let job = Job::new("while :; do sleep 0.05; done");
    let launch = |node: u32| {
        let mut args = node_args(node);
        let extra = [
            "--max-restarts",
            "3",
            "--grace-s",
            "2",
            "--peer-silence-s",
            "3",
        ];
        args.extend(extra.map(String::from));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let log = job.tmp.path().join(format!("launcher{node}.log"));
        nodes
            .command(node as usize, &job.command(&args), &log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting node {node}: {e}"))
    };
    let mut node0 = launch(0);
    let mut node1 = launch(1);
    let up = job.two_ranks_started(Duration::from_secs(60));
    assert!(up, "the ranks never started");
    // The cable pulled: nothing closes, nothing more arrives either way.
    ip(&["-n", &nodes.ns[1], "link", "set", &nodes.veth[1], "down"])
        .unwrap_or_else(|e| panic!("{e}"));
    let cut = Instant::now();
    assert_eq!(exit_code(&mut node0, Duration::from_secs(30)), Some(75));
    let node0_s = cut.elapsed().as_secs_f64();
    assert_eq!(exit_code(&mut node1, Duration::from_secs(30)), Some(75));
    let node1_s = cut.elapsed().as_secs_f64();
    let (summary0, summary1) = summaries(&job.run_dir);
    for (node, summary, lost) in [(0, &summary0, 1), (1, &summary1, 0)] {
        assert_eq!(summary["exit"], "node_lost", "node {node}: {summary}");
        assert_eq!(summary["restarts"], 0, "node {node} restarted: {summary}");
        let cause = summary["failure"]["cause"].as_str().unwrap_or("");
        let silent_s: Option<u64> = cause
            .split_once("silent for ")
            .and_then(|(_, rest)| rest.split_once(" s: lost"))
            .and_then(|(secs, _)| secs.parse().ok());
        assert!(
            cause.starts_with(&format!("node {lost} (host "))
                && silent_s.is_some_and(|s| (3..=5).contains(&s))
                && cause.contains(&format!("rank(s) {node} here waited on it (its victims)")),
            "node {node}: {summary}"
        );
    }
    let nothing_left = wait_until(Duration::from_secs(10), || {
        nodes.pids(0).is_empty() && nodes.pids(1).is_empty()
    });
    assert!(
        nothing_left,
        "left: {:?} {:?}",
        nodes.pids(0),
        nodes.pids(1)
    );
    println!(
        "launch_netns: link cut: node 0 ended {node0_s:.2} s and node 1 {node1_s:.2} s later, \
         each naming the other lost (--peer-silence-s 3)"
    );
}
