//! Two "nodes" on loopback, each its own launcher and cache server, sharing one run
//! directory: the stand-in ranks really meet at MASTER_ADDR:MASTER_PORT (global
//! rank 0 accepts one connection from every other rank) and check the world size.

mod common;

use std::time::Duration;

use common::{free_port, texts, Job};

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
    let node = |rank: &'static str| {
        let port = port.clone();
        let command = job.command(&[
            "--gpus",
            "0",
            "--ranks",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            "--max-restarts",
            "0",
        ]);
        std::thread::spawn(move || common::run_with_limit(command, Duration::from_secs(40)))
    };
    let (node0, node1) = (node("0"), node("1"));
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
