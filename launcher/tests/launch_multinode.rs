//! Two "nodes" on loopback, each its own launcher and cache server, sharing one run
//! directory: the stand-in ranks really meet at MASTER_ADDR:MASTER_PORT (global
//! rank 0 accepts one connection from every other rank) and check the world size;
//! a failure on one node stops the other at once, and both restart together.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{alive, exit_code, free_port, texts, wait_until, Job};

/// A rendezvous in Python: rank 0 listens on MASTER_ADDR:MASTER_PORT until every
/// other rank has said its RANK; each rank checks the WORLD_SIZE rank 0 answers.
const RENDEZVOUS: &str = r#"
exec python3 - <<'PY'
import os, socket, sys, time
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
if rank == 0:
    server = socket.create_server((addr, port))
    server.settimeout(20)
    seen = {0}
    while len(seen) < world:
        conn, _ = server.accept()
        seen.add(int(conn.recv(16).decode()))
        conn.sendall(str(world).encode())
        conn.close()
    print("rank 0 met ranks", sorted(seen), flush=True)
else:
    deadline = time.time() + 20
    while True:
        try:
            conn = socket.create_connection((addr, port), timeout=1)
            break
        except OSError:
            if time.time() > deadline:
                sys.exit(f"rank {rank}: nobody listens at {addr}:{port}")
            time.sleep(0.05)
    conn.sendall(str(rank).encode())
    answer = int(conn.recv(16).decode())
    if answer != world:
        sys.exit(f"rank {rank}: WORLD_SIZE {world}, rank 0 says {answer}")
    print(f"rank {rank} met rank 0", flush=True)
PY
"#;

#[test]
fn two_nodes_on_loopback_meet_at_the_master() {
    let job = Job::new(RENDEZVOUS);
    let port = free_port().to_string();
    let node = |rank: u32| {
        let extra = ["--master-port", &port, "--max-restarts", "0"];
        let command = job.command(&common::two_node_args(2, rank, "127.0.0.1", &extra));
        std::thread::spawn(move || common::run_with_limit(command, Duration::from_secs(40)))
    };
    let (node0, node1) = (node(0), node(1));
    for (name, handle) in [("node 0", node0), ("node 1", node1)] {
        let output = handle
            .join()
            .unwrap_or_else(|_| panic!("{name} thread panicked"));
        let (stdout, stderr) = texts(&output);
        assert!(
            output.status.success(),
            "{name}: stdout:\n{stdout}\nstderr:\n{stderr}"
        );
        if name == "node 0" {
            assert!(
                stdout.contains("[rank0] rank 0 met ranks [0, 1, 2, 3]"),
                "{stdout}"
            );
        }
    }
    for rank in 1..4 {
        assert!(
            job.rank_log(rank)
                .contains(&format!("rank {rank} met rank 0")),
            "{}",
            job.rank_log(rank)
        );
    }
    // Each node has its own cache server.
    let cache0 = job.rank_env(0, 0).get("VRTSPIKE_CACHE_ADDR").cloned();
    let cache2 = job.rank_env(2, 0).get("VRTSPIKE_CACHE_ADDR").cloned();
    assert!(
        cache0.is_some() && cache0 != cache2,
        "{cache0:?} {cache2:?}"
    );
    assert_eq!(
        job.rank_env(1, 0).get("VRTSPIKE_CACHE_ADDR"),
        cache0.as_ref()
    );
    assert!(job.run_dir.join("logs/cache.node0.log").exists());
    assert!(job.run_dir.join("logs/cache.node1.log").exists());
    assert_eq!(job.summary(0)["exit"], "completed");
    assert_eq!(job.summary(1)["exit"], "completed");
    assert_eq!(job.summary(1)["world_size"], 4);
}

/// The launcher command of node `node` of two on loopback.
fn node_command(job: &Job, node: u32, port: u16, extra: &[&str]) -> Command {
    let port = port.to_string();
    let mut args = vec!["--master-port", &port, "--grace-s", "2"];
    args.extend_from_slice(extra);
    job.command(&common::two_node_args(2, node, "127.0.0.1", &args))
}

fn spawn_quiet(mut command: Command) -> Child {
    command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn failure_on_one_node_stops_the_other_node_at_once() {
    // Rank 2 (node 1) fails; ranks 0, 1 (node 0) would run for a minute.
    let job = Job::new(
        r#"
if [ "$RANK" = 2 ]; then sleep 0.5; echo "rank 2 out of memory"; exit 3; fi
i=0; while [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done
"#,
    );
    let port = free_port();
    let mut node0 = spawn_quiet(node_command(&job, 0, port, &["--max-restarts", "0"]));
    let mut node1 = spawn_quiet(node_command(&job, 1, port, &["--max-restarts", "0"]));
    assert!(wait_until(Duration::from_secs(20), || job
        .rank_pid(0, 0)
        .is_some()));
    let started = Instant::now();
    assert_eq!(exit_code(&mut node1, Duration::from_secs(20)), Some(1));
    assert_eq!(exit_code(&mut node0, Duration::from_secs(20)), Some(1));
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(15), "node 0 took {elapsed:?}");
    for rank in [0, 1] {
        let pid = job.rank_pid(rank, 0).unwrap_or(0);
        assert!(!alive(pid), "rank {rank} survived");
    }
    let summary0 = job.summary(0);
    assert_eq!(summary0["exit"], "failed");
    assert_eq!(summary0["failure"]["node"], 1);
    let cause = summary0["failure"]["cause"].as_str().unwrap_or("");
    assert!(
        cause.contains("node 1") && cause.contains("rank 2") && cause.contains("code 3"),
        "{summary0}"
    );
    assert_eq!(job.summary(1)["failure"]["rank"], 2);
    println!(
        "launch_multinode: node 0 stopped {:.2} s after node 1's rank failed",
        elapsed.as_secs_f64()
    );
}

#[test]
fn both_nodes_restart_together() {
    // Attempt 0: rank 3 (node 1) is killed. Attempt 1: every rank finishes.
    let job = Job::new(
        r#"
if [ "$VRTSPIKE_RESTART_COUNT" = 0 ]; then
  if [ "$RANK" = 3 ]; then sleep 0.5; kill -9 $$; fi
  while :; do sleep 0.05; done
fi
echo "rank $RANK attempt 1 done"
"#,
    );
    let port = free_port();
    let extra = ["--max-restarts", "2"];
    let mut node0 = spawn_quiet(node_command(&job, 0, port, &extra));
    let mut node1 = spawn_quiet(node_command(&job, 1, port, &extra));
    assert_eq!(exit_code(&mut node0, Duration::from_secs(40)), Some(0));
    assert_eq!(exit_code(&mut node1, Duration::from_secs(40)), Some(0));
    for rank in 0..4 {
        assert!(job
            .rank_log(rank)
            .contains(&format!("rank {rank} attempt 1 done")));
    }
    let (summary0, summary1) = (job.summary(0), job.summary(1));
    assert_eq!(summary0["restarts"], 1, "{summary0}");
    assert_eq!(summary1["restarts"], 1, "{summary1}");
    assert_eq!(summary0["attempts"][0]["failure"]["process"], "node 1");
    assert_eq!(summary1["attempts"][0]["failure"]["signal"], "SIGKILL");
}

#[test]
fn kill_9_of_one_launcher_fails_the_other_node() {
    let job = Job::new("while :; do sleep 0.05; done");
    let port = free_port();
    let mut node0 = spawn_quiet(node_command(&job, 0, port, &["--max-restarts", "3"]));
    let mut node1 = spawn_quiet(node_command(&job, 1, port, &["--max-restarts", "3"]));
    let up = wait_until(Duration::from_secs(20), || {
        (0..4).all(|rank| job.rank_pid(rank, 0).is_some())
    });
    assert!(up, "the ranks never started");
    node1.kill().unwrap_or_else(|e| panic!("{e}"));
    let _ = node1.wait();
    let killed = Instant::now();
    assert_eq!(exit_code(&mut node0, Duration::from_secs(20)), Some(1));
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
    println!(
        "launch_multinode: node 0 gave up {:.2} s after kill -9 of node 1's launcher",
        killed.elapsed().as_secs_f64()
    );
}

#[test]
fn node_0_starts_no_rank_before_every_node_joined() {
    let job = Job::new("exit 0");
    let port = free_port();
    let mut node0 = spawn_quiet(node_command(&job, 0, port, &["--peer-timeout-s", "2"]));
    assert_eq!(exit_code(&mut node0, Duration::from_secs(20)), Some(2));
    assert!(
        job.rank_pid(0, 0).is_none(),
        "rank 0 started without node 1"
    );
    let error = job.summary(0)["error"].as_str().unwrap_or("").to_string();
    assert!(error.contains("node(s) [1] of 2 did not join"), "{error}");
}

#[test]
fn a_node_whose_attempt_failed_after_node_0_completed_does_not_restart_alone() {
    // Node 0's ranks finish at once; rank 2 (node 1) fails in attempt 0 and would
    // succeed if it ran again. Before, node 1 restarted alone (real ranks then wait
    // at the rendezvous for the collective timeout, attempt after attempt).
    let job = Job::new(
        r#"
if [ "$RANK" -ge 2 ] && [ "$VRTSPIKE_RESTART_COUNT" = 0 ]; then sleep 1; exit 3; fi
echo "rank $RANK attempt $VRTSPIKE_RESTART_COUNT done"
"#,
    );
    let port = free_port();
    let extra = ["--max-restarts", "2"];
    let mut node0 = spawn_quiet(node_command(&job, 0, port, &extra));
    let mut node1 = spawn_quiet(node_command(&job, 1, port, &extra));
    assert_eq!(exit_code(&mut node0, Duration::from_secs(40)), Some(0));
    assert_eq!(exit_code(&mut node1, Duration::from_secs(40)), Some(1));
    assert!(
        job.rank_pid(2, 1).is_none(),
        "node 1 ran an attempt on its own"
    );
    let summary1 = job.summary(1);
    assert_eq!(summary1["restarts"], 0, "{summary1}");
    let error = summary1["error"].as_str().unwrap_or("");
    assert!(error.contains("no restart alone"), "{summary1}");
}

#[test]
fn a_silent_node_is_named_lost_and_the_other_stops_without_restarting() {
    // Node 1's launcher is stopped (SIGSTOP): its link stays open but says
    // nothing, as a cut link or a hung host leaves it.
    let job = Job::new("while :; do sleep 0.05; done");
    let port = free_port();
    let extra = ["--max-restarts", "3", "--peer-silence-s", "2"];
    let mut node0 = spawn_quiet(node_command(&job, 0, port, &extra));
    let mut node1 = spawn_quiet(node_command(&job, 1, port, &extra));
    let up = wait_until(Duration::from_secs(20), || {
        (0..4).all(|rank| job.rank_pid(rank, 0).is_some())
    });
    assert!(up, "the ranks never started");
    common::signal(node1.id(), nix::sys::signal::Signal::SIGSTOP);
    let stopped = Instant::now();
    let code = exit_code(&mut node0, Duration::from_secs(20));
    let named_after = stopped.elapsed();
    common::signal(node1.id(), nix::sys::signal::Signal::SIGCONT);
    assert_eq!(code, Some(75), "node 0's exit status for a lost node");
    assert!(
        named_after >= Duration::from_secs(2) && named_after < Duration::from_secs(8),
        "node 0 ended {named_after:?} after node 1 went silent"
    );
    let summary0 = job.summary(0);
    assert_eq!(summary0["exit"], "node_lost", "{summary0}");
    assert_eq!(summary0["exit_code"], 75, "{summary0}");
    assert_eq!(summary0["restarts"], 0, "restarted short: {summary0}");
    assert_eq!(summary0["failure"]["process"], "node 1", "{summary0}");
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let cause = summary0["failure"]["cause"].as_str().unwrap_or("");
    assert!(
        cause.starts_with(&format!("node 1 (host {}) silent for ", host.trim()))
            && cause.contains(" s: lost")
            && cause.contains("rank(s) 0, 1 here waited on it (its victims)"),
        "{summary0}"
    );
    for rank in [0, 1] {
        let pid = job.rank_pid(rank, 0).unwrap_or(0);
        assert!(!alive(pid), "rank {rank} survived");
    }
    // Node 1, woken, finds itself cut off and stops its ranks too.
    let code1 = exit_code(&mut node1, Duration::from_secs(20));
    assert!(
        code1.is_some_and(|c| c != 0),
        "node 1 exited with {code1:?}"
    );
    for rank in [2, 3] {
        let pid = job.rank_pid(rank, 0).unwrap_or(0);
        assert!(!alive(pid), "rank {rank} survived");
    }
    assert!(job.rank_pid(0, 1).is_none(), "a second attempt started");
    println!(
        "launch_multinode: node 0 named node 1 lost and ended {:.2} s after it went silent \
         (--peer-silence-s 2)",
        named_after.as_secs_f64()
    );
}

#[test]
fn a_rank_failing_while_a_node_is_silent_brings_no_short_restart() {
    // Rank 0 fails (as a rank whose peer went quiet does) right after node 1's
    // launcher is stopped, before node 1 can be named lost: node 0 must not
    // restart without it.
    let job = Job::new(
        r#"
if [ "$RANK" = 0 ] && [ "$VRTSPIKE_RESTART_COUNT" = 0 ]; then
  while [ ! -e "$VRTSPIKE_RUN_DIR/node1-stopped" ]; do sleep 0.05; done
  exit 3
fi
while :; do sleep 0.05; done
"#,
    );
    let port = free_port();
    let extra = ["--max-restarts", "3", "--peer-silence-s", "3"];
    let mut node0 = spawn_quiet(node_command(&job, 0, port, &extra));
    let mut node1 = spawn_quiet(node_command(&job, 1, port, &extra));
    let up = wait_until(Duration::from_secs(20), || {
        (0..4).all(|rank| job.rank_pid(rank, 0).is_some())
    });
    assert!(up, "the ranks never started");
    common::signal(node1.id(), nix::sys::signal::Signal::SIGSTOP);
    std::fs::write(job.run_dir.join("node1-stopped"), b"").unwrap_or_else(|e| panic!("{e}"));
    let code = exit_code(&mut node0, Duration::from_secs(20));
    common::signal(node1.id(), nix::sys::signal::Signal::SIGCONT);
    let code1 = exit_code(&mut node1, Duration::from_secs(20));
    assert_eq!(code, Some(75), "node 0 ends for the lost node");
    assert!(
        code1.is_some_and(|c| c != 0),
        "node 1 exited with {code1:?}"
    );
    let summary0 = job.summary(0);
    assert_eq!(summary0["restarts"], 0, "restarted short: {summary0}");
    assert!(job.rank_pid(0, 1).is_none(), "rank 0 ran a second attempt");
    assert_eq!(summary0["attempts"][0]["failure"]["rank"], 0, "{summary0}");
    // The lost node is the job's failure; rank 0, which failed first, its victim.
    assert_eq!(summary0["failure"]["process"], "node 1", "{summary0}");
    let cause = summary0["failure"]["cause"].as_str().unwrap_or("");
    assert!(
        cause.starts_with("node 1 (host ")
            && cause.contains(": lost; before it was found lost: rank 0 (pid ")
            && cause.ends_with("exited with code 3 (its victim, not the cause)"),
        "{summary0}"
    );
}
