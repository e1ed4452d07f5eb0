//! No torn reads: 8 reader threads in 2 processes over more keys than fit, so fills
//! evict constantly; every read's whole record is checksummed.

mod common;

use std::process::{Command, Stdio};

use common::ServerProc;
use vrtspike::bench::cache::{WorkerOptions, WorkerReport};
use vrtspike::cache::store::extent_for;
use vrtspike::testkit::record::FrameShape;

#[test]
fn no_torn_reads_under_concurrent_fill_and_eviction() {
    let shape = FrameShape {
        height: 120,
        width: 160,
        channels: 3,
    };
    let slot = extent_for(shape.record_bytes() as u64).unwrap();
    let slots = 24;
    let cap = (slots * slot).to_string();
    let server = ServerProc::start("stress", &["--cap", &cap]);
    let options = WorkerOptions {
        address: server.address.clone(),
        threads: 4,
        keys: 40,
        seconds: 3.0,
        height: shape.height,
        width: shape.width,
        crop: 64,
        seed: 0,
        verify_every: 1,
    };
    let workers: Vec<_> = (1..=2)
        .map(|seed| {
            let json = serde_json::to_string(&WorkerOptions {
                seed,
                ..options.clone()
            })
            .unwrap();
            Command::new(common::exe())
                .args(["bench", "cache-worker", "--options", &json])
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut reports = Vec::new();
    for worker in workers {
        let out = worker.wait_with_output().unwrap();
        assert!(out.status.success(), "worker failed: {}", out.status);
        let report: WorkerReport = serde_json::from_slice(&out.stdout).unwrap();
        reports.push(report);
    }
    let stats = server.client("check").stats().unwrap();
    let torn: u64 = reports.iter().map(|r| r.torn_reads).sum();
    let ops: u64 = reports.iter().map(|r| r.ops).sum();
    let verified: u64 = reports.iter().map(|r| r.verified).sum();
    let misses: u64 = reports.iter().map(|r| r.misses).sum();
    assert_eq!(torn, 0, "torn reads: {reports:?}");
    assert_eq!(verified, ops, "every read must be verified");
    assert!(ops > 500, "only {ops} reads");
    assert!(misses > 50, "only {misses} fills: no eviction pressure");
    assert!(stats.evictions > 20, "only {} evictions", stats.evictions);
    assert!(stats.bytes_used <= stats.cap_bytes);
}
