//! Two CPU ranks of `vrtspike train` started by hand with the launcher's
//! environment contract and an in-process cache server: they train in lockstep
//! (parameter-hash checks pass), validate over both ranks, and rank 0 writes the
//! summary; SIGUSR2 to both ranks makes them agree on a step, checkpoint and exit 0,
//! and a second start resumes from that checkpoint.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod ranks_support;

use ranks_support::{start_ranks, start_world, wait_all};
use vrtspike::cache::{spawn_server, ServerConfig};
use vrtspike::synth::{self, SynthOptions};

/// How long both ranks may take.
const RANKS_LIMIT: Duration = Duration::from_secs(120);

fn write_config(dir: &Path, data: &Path, total_steps: u64) -> PathBuf {
    write_named_config(dir, "ddp", data, total_steps, "")
}

/// A config whose samples do not depend on the rank that draws them (whole
/// square frames, no augmentation), so worlds of other sizes see the same ones.
fn write_whole_frame_config(dir: &Path, data: &Path, total_steps: u64) -> PathBuf {
    write_named_config(dir, "whole", data, total_steps, "  AUGMENT: false\n")
}

/// The tiny two-rank config as `dir/<name><total_steps>.yaml`, `data_keys` added
/// to its `DATA` section.
fn write_named_config(
    dir: &Path,
    name: &str,
    data: &Path,
    total_steps: u64,
    data_keys: &str,
) -> PathBuf {
    let path = dir.join(format!("{name}{total_steps}.yaml"));
    let text = format!(
        "DATA:\n  ROOT: {}\n  CROP_SIZE: 32\n  VAL_CROP_SIZE: null\n  VAL_TILE: 32\n  VAL_TILE_OVERLAP: 16\n  CLIP_LEN: 2\n  SPIKE_BINS: 4\n  CACHE_SIZE_GB: 0.1\n{data_keys}\
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

/// The trained weights of a run's final checkpoint, by name.
fn final_weights(run: &Path, step: u64) -> Vec<(String, tch::Tensor)> {
    let path = run.join(format!("checkpoints/step_{step:08}/model.safetensors"));
    let mut weights = tch::Tensor::read_safetensors(&path).unwrap();
    weights.sort_by(|a, b| a.0.cmp(&b.0));
    weights
}

#[test]
fn two_ranks_equal_one_rank_accumulating_their_share() {
    // Square 32 x 32 frames cropped whole: a sample is the same whoever draws it;
    // 12 frames a sequence, so one epoch holds every step's samples (a step across
    // an epoch's end takes other ones in worlds of other sizes).
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let options = SynthOptions {
        height: 32,
        width: 32,
        frames: 12,
        ..SynthOptions::small(9)
    };
    synth::generate_folder(&data, &options, &|_| {}).unwrap();
    let address = format!("vrtspike-test-accum-{}", std::process::id());
    let server = spawn_server(ServerConfig::new(address.clone(), 64 << 20)).unwrap();
    let steps = 3;
    let config = write_whole_frame_config(tmp.path(), &data, steps);
    let train = |name: &str, world: u32, extra: &[(&str, &str)]| {
        let run = tmp.path().join(name);
        std::fs::create_dir_all(&run).unwrap();
        let mut ranks = start_world(&config, &run, Some(server.address()), world, extra);
        wait_all(&mut ranks, &run, RANKS_LIMIT);
        run
    };
    // 2 ranks x batch 2, and 1 rank x batch 2 x accumulation 2 (as the launcher
    // asks after elastic membership halved the world): the same 4 samples a step.
    let two = train("two", 2, &[]);
    let one = train("one", 1, &[("VRTSPIKE_ACCUMULATION", "2")]);
    for run in [&two, &one] {
        assert_eq!(summary(run)["samples_seen"], 12, "{}", run.display());
    }
    let (a, b) = (final_weights(&two, steps), final_weights(&one, steps));
    assert_eq!(a.len(), b.len());
    let mut worst = 0.0f64;
    for ((name_a, wa), (name_b, wb)) in a.iter().zip(&b) {
        assert_eq!(name_a, name_b);
        let diff = (wa - wb).abs().max().double_value(&[]);
        let scale = wa.abs().max().double_value(&[]).max(1e-3);
        worst = worst.max(diff / scale);
    }
    assert!(
        worst < 1e-4,
        "the weights differ by {worst:e} of their scale"
    );
    // Without the factor one rank trains on half the samples: other weights.
    let half = train("half", 1, &[]);
    assert_eq!(summary(&half)["samples_seen"], 6);
    let c = final_weights(&half, steps);
    let differs = a
        .iter()
        .zip(&c)
        .any(|((_, wa), (_, wc))| (wa - wc).abs().max().double_value(&[]) > 1e-4);
    assert!(differs, "the check cannot tell the batches apart");
    drop(server);
}
