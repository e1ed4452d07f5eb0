//! Two CPU ranks of `vrtspike train` started by hand with the launcher's
//! environment contract and an in-process cache server: they train in lockstep
//! (parameter-hash checks pass), validate over both ranks, and rank 0 writes the
//! summary; SIGUSR2 to both ranks makes them agree on a step, checkpoint and exit 0,
//! and a second start resumes from that checkpoint.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod ranks_support;

use ranks_support::{start_ranks, wait_all};
use vrtspike::cache::{spawn_server, ServerConfig};
use vrtspike::synth::{self, SynthOptions};

/// How long both ranks may take.
const RANKS_LIMIT: Duration = Duration::from_secs(120);

fn write_config(dir: &Path, data: &Path, total_steps: u64) -> PathBuf {
    let path = dir.join(format!("ddp{total_steps}.yaml"));
    let text = format!(
        "DATA:\n  ROOT: {}\n  CROP_SIZE: 32\n  VAL_CROP_SIZE: null\n  VAL_TILE: 32\n  VAL_TILE_OVERLAP: 16\n  CLIP_LEN: 2\n  SPIKE_BINS: 4\n  CACHE_SIZE_GB: 0.1\n\
         DATALOADER:\n  TOTAL_WORKERS: 2\n\
         TRAIN:\n  BATCH_SIZE: 2\n  TOTAL_STEPS: {total_steps}\n  LR: 1.0e-3\n  SEED: 3\n  PARAM_CHECK_EVERY: 2\n\
         MODEL:\n  ARCH: unet_spike\n  UNET:\n    CHANNELS: 4\n    LEVELS: 1\n  SPIKE:\n    ENABLED: true\n    VOXEL_BINS: 4\n\
         LOG:\n  LOG_EVERY_STEPS: 1\n  VAL_EVERY_STEPS: 1000\n  CKPT_EVERY_STEPS: 1000\n  MEM_EVERY_STEPS: 2\n\
         DIST:\n  TIMEOUT_S: 60\n",
        data.display()
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn summary(run: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(run.join("result.json")).unwrap()).unwrap()
}

#[test]
fn two_ranks_train_validate_and_preempt() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let options = SynthOptions::small(9);
    synth::generate_folder(&data, &options, &|_| {}).unwrap();
    let address = format!("vrtspike-test-train-{}", std::process::id());
    let server = spawn_server(ServerConfig::new(address.clone(), 64 << 20)).unwrap();

    // A complete run.
    let run = tmp.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    let config = write_config(tmp.path(), &data, 6);
    let mut ranks = start_ranks(&config, &run, Some(server.address()));
    wait_all(&mut ranks, &run, RANKS_LIMIT);
    let s = summary(&run);
    assert_eq!(s["status"], "completed");
    assert_eq!(s["steps"], 6);
    assert_eq!(s["world_size"], 2);
    assert_eq!(s["samples_seen"], 24, "2 ranks x batch 2 x 6 steps");
    assert!(s["val_psnr"].as_f64().unwrap() > 5.0 && s["val_ssim"].as_f64().unwrap() > 0.0);
    // Validation covered every test frame exactly once over the two ranks.
    assert_eq!(s["val_frames"], 6, "3 clips of 2 frames split over 2 ranks");
    assert!(
        s["cache_hit_rate"].as_f64().unwrap() > 0.0,
        "the cache served repeated frames"
    );
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert_eq!(
        metrics
            .lines()
            .filter(|l| l.contains("\"kind\":\"train\""))
            .count(),
        6
    );
    assert!(metrics
        .lines()
        .any(|l| l.contains("\"kind\":\"memory\"") && l.contains("pss_mb")));
    assert!(run
        .join("checkpoints/step_00000006/model.safetensors")
        .is_file());

    // Preemption: SIGUSR2 to both ranks of a long run.
    let run = tmp.path().join("preempt");
    std::fs::create_dir_all(&run).unwrap();
    let config = write_config(tmp.path(), &data, 100_000);
    let mut ranks = start_ranks(&config, &run, Some(server.address()));
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::read_to_string(run.join("metrics.jsonl"))
        .map(|m| {
            m.lines()
                .filter(|l| l.contains("\"kind\":\"train\""))
                .count()
                < 3
        })
        .unwrap_or(true)
    {
        assert!(Instant::now() < deadline, "no training progress");
        std::thread::sleep(Duration::from_millis(50));
    }
    for child in &ranks {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGUSR2,
        )
        .unwrap();
    }
    wait_all(&mut ranks, &run, RANKS_LIMIT);
    let s = summary(&run);
    assert_eq!(s["status"], "preempted");
    let stopped_at = s["steps"].as_u64().unwrap();
    let checkpoint = run.join(format!("checkpoints/step_{stopped_at:08}"));
    assert!(
        checkpoint.join("state.json").is_file(),
        "checkpoint at the agreed step"
    );
    // A second start resumes there (and stops after two more steps).
    let mut ranks = start_ranks(&config, &run, Some(server.address()));
    std::thread::sleep(Duration::from_millis(10));
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::read_to_string(run.join("metrics.jsonl"))
        .map(|m| m.matches("\"event\":\"start\"").count() < 2)
        .unwrap_or(true)
    {
        assert!(Instant::now() < deadline, "second attempt did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    for child in &ranks {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGUSR2,
        )
        .unwrap();
    }
    wait_all(&mut ranks, &run, RANKS_LIMIT);
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let second_start = metrics
        .lines()
        .filter(|l| l.contains("\"event\":\"start\""))
        .nth(1)
        .unwrap();
    let start: serde_json::Value = serde_json::from_str(second_start).unwrap();
    assert_eq!(
        start["step"].as_u64(),
        Some(stopped_at),
        "resumed from the preemption checkpoint"
    );
    assert!(summary(&run)["steps"].as_u64().unwrap() > stopped_at);
    drop(server);
}
