//! Ranks that no launcher started (two CPU ranks of `vrtspike train` with
//! torchrun's environment, `DATA.CACHE_SHARING: node`) and the node cache server
//! they start or attach to themselves. `DATA.CACHE_CONNECTIONS` sizes the server
//! local rank 0 starts (its stats say so), and a later job that asks for more
//! than the running server has is told so. When the node-shared address is not
//! theirs to use: a process of another user bound there first
//! (abstract names have no permissions), or a server of another cache protocol
//! version (another build's). Local rank 0 falls back to a server of the job's
//! own (the `job` address) as the launcher does; each rank warns once naming the
//! address and the reason, both complete, and the summary's `cache_sharing` says
//! so. The squatter test needs root (it runs the squatter as `nobody`): where the
//! build is not root it is ignored (`build/facilities.rs`).

mod ranks_support;
#[path = "../launcher/tests/common/squat.rs"]
mod squat;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Duration;

use ranks_support::{start_ranks, wait_all};
use squat::{assert_fell_back, other_version_at, Squatter, FELL_BACK, NOBODY};
use vrtspike::synth::{self, SynthOptions};
use vrtspike_contract::cache_addr::{node_shared_address, CACHE_PROTOCOL_VERSION};

/// A failure guard only: a healthy run ends far sooner.
const LIMIT: Duration = Duration::from_secs(240);

struct Setup {
    tmp: tempfile::TempDir,
    config: PathBuf,
    /// The dataset's node-shared address.
    address: String,
}

fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    setup_in(tmp, "")
}

/// The data and a config in `tmp`, with `extra` lines in its DATA section.
fn setup_in(tmp: tempfile::TempDir, extra: &str) -> Setup {
    let data = tmp.path().join("data");
    synth::generate_folder(&data, &SynthOptions::small(5), &|_| {})
        .unwrap_or_else(|e| panic!("{e}"));
    let config = tmp.path().join("squatted.yaml");
    let text = format!(
        "DATA:\n  ROOT: {}\n  CACHE_SHARING: node\n  CROP_SIZE: 32\n  VAL_CROP_SIZE: null\n  VAL_TILE: 32\n  VAL_TILE_OVERLAP: 16\n  CLIP_LEN: 2\n  SPIKE_BINS: 4\n  CACHE_SIZE_GB: 0.05\n{extra}\
         DATALOADER:\n  TOTAL_WORKERS: 2\n\
         TRAIN:\n  BATCH_SIZE: 2\n  TOTAL_STEPS: 4\n  LR: 1.0e-3\n  SEED: 3\n\
         MODEL:\n  ARCH: unet_spike\n  UNET:\n    CHANNELS: 4\n    LEVELS: 1\n  SPIKE:\n    ENABLED: true\n    VOXEL_BINS: 4\n\
         LOG:\n  LOG_EVERY_STEPS: 1\n  VAL_EVERY_STEPS: 1000\n  CKPT_EVERY_STEPS: 1000\n\
         DIST:\n  TIMEOUT_S: 60\n",
        data.display(),
    );
    std::fs::write(&config, text).unwrap_or_else(|e| panic!("{e}"));
    let (address, _) = node_shared_address(&data).unwrap_or_else(|e| panic!("{e}"));
    Setup {
        tmp,
        config,
        address,
    }
}

/// Runs both ranks to their end; the run directory.
fn run_ranks(s: &Setup) -> PathBuf {
    run_ranks_in(s, "run")
}

/// Runs both ranks to their end in the run directory `name`.
fn run_ranks_in(s: &Setup, name: &str) -> PathBuf {
    let run = s.tmp.path().join(name);
    std::fs::create_dir_all(&run).unwrap_or_else(|e| panic!("{e}"));
    let mut ranks = start_ranks(&s.config, &run, None);
    wait_all(&mut ranks, &run, LIMIT);
    run
}

/// Both ranks completed on a server of the job's own, each warned once naming
/// `address` and `why`, and the summary says it fell back from `address`.
fn check_fell_back(run: &Path, address: &str, why: &[&str]) {
    for rank in 0..2 {
        let log = std::fs::read_to_string(run.join(format!("rank{rank}.log")))
            .unwrap_or_else(|e| panic!("{e}"));
        let warnings: Vec<&str> = log.lines().filter(|l| l.contains(FELL_BACK)).collect();
        assert_eq!(warnings.len(), 1, "rank {rank}:\n{log}");
        for word in why.iter().chain([&address]) {
            assert!(
                warnings[0].contains(word),
                "{word:?} not in rank {rank}'s {warnings:?}"
            );
        }
    }
    let text = std::fs::read_to_string(run.join("result.json")).unwrap_or_else(|e| panic!("{e}"));
    let summary: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(summary["status"], "completed", "{summary}");
    assert_eq!(summary["steps"], 4, "{summary}");
    let sharing = &summary["cache_sharing"];
    assert_fell_back(sharing, address, why);
    // The ranks read through the job's own server.
    assert!(summary["cache_hit_rate"].is_number(), "{summary}");
}

#[test]
#[cfg_attr(vrtspike_no_root, ignore = "needs root, to run a process as nobody")]
fn ranks_fall_back_from_an_address_squatted_by_another_user() {
    let s = setup();
    let vrtspike = Path::new(env!("CARGO_BIN_EXE_vrtspike"));
    let mut squatter = Squatter::start(vrtspike, &s.address, LIMIT);
    let run = run_ranks(&s);
    check_fell_back(&run, &s.address, &[&format!("runs as uid {NOBODY}")]);
    assert!(squatter.running(), "the squatter was stopped");
}

#[test]
fn ranks_fall_back_from_a_server_of_another_protocol_version() {
    let s = setup();
    let went_on = other_version_at(&s.address);
    let run = run_ranks(&s);
    let ours = CACHE_PROTOCOL_VERSION;
    check_fell_back(
        &run,
        &s.address,
        &[
            &format!("speaks cache protocol version {}", ours + 1),
            &format!("this build speaks version {ours}"),
        ],
    );
    assert_eq!(went_on.load(Ordering::SeqCst), 0);
}

/// `vrtspike cache ARGS --address ADDRESS`; its stdout (it must succeed).
fn cache_command(args: &[&str], address: &str) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_vrtspike"))
        .arg("cache")
        .args(args)
        .args(["--address", address])
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "cache {args:?}: {stderr}");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Stops the node-shared server at `address` when dropped (it lingers).
struct ShutDown(String);

impl Drop for ShutDown {
    fn drop(&mut self) {
        let _ = Command::new(env!("CARGO_BIN_EXE_vrtspike"))
            .args(["cache", "shutdown", "--address", &self.0])
            .output();
    }
}

#[test]
fn the_config_sizes_the_connections_of_the_server_the_ranks_start() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = setup_in(tmp, "  CACHE_CONNECTIONS: 600\n");
    let _stop = ShutDown(s.address.clone());
    let run = run_ranks(&s);
    let text = std::fs::read_to_string(run.join("result.json")).unwrap_or_else(|e| panic!("{e}"));
    let summary: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(summary["status"], "completed", "{summary}");
    assert_eq!(summary["cache_sharing"]["mode"], "node", "{summary}");
    assert_eq!(
        summary["cache_sharing"]["address"],
        s.address.as_str(),
        "{summary}"
    );
    // Local rank 0 started the node-shared server, which lingers after the job.
    let stats: serde_json::Value =
        serde_json::from_str(&cache_command(&["stats", "--json"], &s.address))
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stats["connections"], 600, "{stats}");
    // A job asking for more attaches to it anyway, and is told once, on rank 0.
    let more = s.config.with_file_name("more.yaml");
    let text = std::fs::read_to_string(&s.config).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(
        &more,
        text.replace("CACHE_CONNECTIONS: 600", "CACHE_CONNECTIONS: 1000"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let second = Setup { config: more, ..s };
    let run = run_ranks_in(&second, "run-more");
    let log = std::fs::read_to_string(run.join("rank0.log")).unwrap_or_else(|e| panic!("{e}"));
    let said =
        "serves 600 connections at once, fewer than this job's DATA.CACHE_CONNECTIONS (1000)";
    assert_eq!(log.matches(said).count(), 1, "{log}");
    let stats: serde_json::Value =
        serde_json::from_str(&cache_command(&["stats", "--json"], &second.address))
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stats["connections"], 600, "{stats}");
}
