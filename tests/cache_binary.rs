//! The cache server runs without libtorch: `vrtspike cache serve` (as the launcher,
//! a rank and the tests start it) hands over to `vrtspike-cache` in the same
//! process, which maps no libtorch and serves as before; a `vrtspike-cache` built
//! from other sources, or none, leaves the server in `vrtspike`, with a warning.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use vrtspike::testkit::process::{spawn_cache_server, wait_for_child_server, ChildGuard};

/// Fails, saying how to build it, unless a `vrtspike-cache` lies beside `vrtspike`:
/// it is `vrtspike-data`'s binary, which `make test` builds first (`cargo build
/// --workspace --bins`) and `cargo test` does not (the data crate has no
/// integration tests of its own).
fn assert_server_built() {
    let server = Path::new(env!("CARGO_BIN_EXE_vrtspike")).with_file_name("vrtspike-cache");
    assert!(
        server.is_file(),
        "{} is missing: run `cargo build -p vrtspike-data` (or `make test`)",
        server.display()
    );
}

fn address(tag: &str) -> String {
    format!("vrtspike-test-bin-{tag}-{}", std::process::id())
}

/// The binary process `pid` runs, and whether it maps any libtorch library.
fn binary_and_torch(pid: u32) -> (String, bool) {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let name = exe.file_name().unwrap().to_string_lossy().into_owned();
    (name, maps.contains("libtorch"))
}

#[test]
fn cache_serve_runs_the_server_without_libtorch() {
    assert_server_built();
    let exe = Path::new(env!("CARGO_BIN_EXE_vrtspike"));
    let address = address("own");
    let (child, client) = spawn_cache_server(exe, &address, 16 << 20, None).unwrap();
    let (binary, torch) = binary_and_torch(child.0.id());
    assert_eq!(binary, "vrtspike-cache");
    assert!(!torch, "the cache server maps libtorch");
    // It serves: a miss filled, then a hit in shared memory.
    let lease = client
        .get_or_fill("k", 5000, |slot| {
            slot.fill(3);
            Ok::<(), std::convert::Infallible>(())
        })
        .unwrap();
    drop(lease);
    let hit = client.peek("k").unwrap().expect("cached");
    assert!(hit.iter().all(|&b| b == 3));
    assert_eq!(client.stats().unwrap().server_pid, child.0.id());
}

#[test]
fn a_server_binary_of_other_sources_is_not_used() {
    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join("vrtspike-cache");
    vrtspike_contract::child::write_executable(&stale, "#!/bin/sh\necho 0000000000000000\n")
        .unwrap();
    for server in [stale.clone(), dir.path().join("nowhere")] {
        let address = address(&format!("{}", server.exists()));
        let log = dir.path().join("server.log");
        let child = Command::new(env!("CARGO_BIN_EXE_vrtspike"))
            .args(["cache", "serve", "--exit-with-parent", "--cap", "4M"])
            .args(["--address", &address])
            .env("VRTSPIKE_CACHE_SERVER", &server)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut child = ChildGuard(child);
        let client =
            wait_for_child_server(&mut child.0, &address, Duration::from_secs(60)).unwrap();
        let (binary, _) = binary_and_torch(child.0.id());
        assert_eq!(binary, "vrtspike", "{}", server.display());
        assert!(client.stats().is_ok());
        let said = std::fs::read_to_string(&log).unwrap();
        let why = match server.exists() {
            true => "built from other sources",
            false => "no vrtspike-cache binary",
        };
        assert!(said.contains(why), "{said}");
    }
}

#[test]
fn the_loader_benchmark_runs_without_libtorch() {
    // `vrtspike bench loader` hands over to `vrtspike-cache`, which runs the ranks
    // (dataset, pipeline, the planned policy's read orders) and the server without
    // libtorch: a process that loads it holds far more than 100 MB.
    assert_server_built();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let options = vrtspike::synth::SynthOptions {
        train_seqs: 2,
        test_seqs: 0,
        frames: 6,
        height: 64,
        width: 96,
        seed: 1,
    };
    vrtspike::synth::generate_folder(&data, &options, &|_| {}).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_vrtspike"))
        .args(["bench", "loader", "--json", "--root"])
        .arg(&data)
        .args([
            "--ranks",
            "2",
            "--workers",
            "1",
            "--epochs",
            "2",
            "--clip",
            "2",
        ])
        .args([
            "--crop",
            "32",
            "--bins",
            "4",
            "--cache-percent",
            "30",
            "--lockstep",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["samples_last_epoch"], 10, "{report}");
    assert_eq!(report["store"]["read_orders_announced"], 4, "{report}");
    let own = report["server_memory"]["overhead_mb"].as_f64().unwrap();
    assert!(
        own < 100.0,
        "the server holds {own} MB of its own: {report}"
    );
    assert!(!stderr.contains("runs in this process"), "{stderr}");
}
