//! `DATA.CACHE_SHARING: node` when the node-shared address is not the job's to
//! use, end to end with a real launcher and a real `vrtspike train` CPU rank: a
//! server of another cache protocol version (another build's) at the address, or
//! a process of another user bound there first (abstract names have no
//! permissions). Either way the job attaches to nothing there, falls back to a
//! server of its own (the `job` address), says so once (its log, and the
//! summary's `cache.sharing`) and trains to the end. The second test needs root
//! (it runs the squatter as `nobody`) and fails without it.

mod common;
#[path = "common/squat.rs"]
mod squat;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{launcher_command, read_json, run_with_limit, synth_tiny, texts};
use common::{node_shared_address, write_tiny_config, TinyTrain};
use vrtspike_contract::cache_addr::CACHE_PROTOCOL_VERSION;
use vrtspike_contract::rundir::RunLayout;

use squat::{assert_fell_back, other_version_at, Squatter, FELL_BACK, NOBODY};

/// A failure guard only: every wait ends far sooner on a healthy run.
const LIMIT: Duration = Duration::from_secs(240);

struct Setup {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    config: PathBuf,
    /// The job's node-shared address.
    address: String,
}

fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let dir = tmp.path().to_path_buf();
    let data = synth_tiny(&dir);
    let run = TinyTrain {
        total_steps: 4,
        ckpt_every: 1000,
        timeout_s: 60,
    };
    let config = write_tiny_config(&dir, &data, &run);
    let address = node_shared_address(&data);
    Setup {
        _tmp: tmp,
        dir,
        config,
        address,
    }
}

/// Runs one job of one CPU rank to its end; its launcher's output.
fn run_job(s: &Setup) -> (String, PathBuf) {
    let run = s.dir.join("run");
    let mut command = launcher_command(&s.config, &run);
    command
        .args(["--gpus", "0", "--ranks", "1", "--max-restarts", "0"])
        .args(["--cache-size", "64M"]);
    let output = run_with_limit(command, LIMIT);
    let (stdout, stderr) = texts(&output);
    let said = format!("{stdout}\n{stderr}");
    assert!(output.status.success(), "the job failed:\n{said}");
    (said, run)
}

/// The job completed on a server of its own, fell back from `address` once,
/// and its summary says why (`why` names what was found).
fn check_fell_back(said: &str, run: &Path, address: &str, why: &[&str]) {
    assert_eq!(said.matches(FELL_BACK).count(), 1, "{said}");
    let summary = read_json(&RunLayout::new(run).launcher_summary(0));
    assert_eq!(summary["exit"], "completed", "{summary}");
    assert_eq!(summary["restarts"], 0, "{summary}");
    let sharing = &summary["cache"]["sharing"];
    assert_fell_back(sharing, address, why);
    // The rank read through the job's own server.
    let totals = &summary["cache"]["totals"];
    let lookups = totals["hits"].as_u64().unwrap_or(0) + totals["misses"].as_u64().unwrap_or(0);
    assert!(lookups > 0, "{summary}");
}

#[test]
fn a_server_of_another_protocol_version_is_left_for_a_server_of_the_jobs_own() {
    let s = setup();
    let went_on = other_version_at(&s.address);
    let (said, run) = run_job(&s);
    let ours = CACHE_PROTOCOL_VERSION;
    check_fell_back(
        &said,
        &run,
        &s.address,
        &[
            &format!("speaks cache protocol version {}", ours + 1),
            &format!("this build speaks version {ours}"),
        ],
    );
    assert_eq!(went_on.load(Ordering::SeqCst), 0);
}

#[test]
fn an_address_squatted_by_another_user_is_left_for_a_server_of_the_jobs_own() {
    let s = setup();
    let mut squatter = Squatter::start(&common::vrtspike(), &s.address, LIMIT);
    let (said, run) = run_job(&s);
    check_fell_back(
        &said,
        &run,
        &s.address,
        &[&format!("runs as uid {NOBODY}"), &s.address],
    );
    assert!(squatter.running(), "the squatter was stopped");
}
