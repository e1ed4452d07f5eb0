//! Exact resume on CPU: N steps, stop (checkpoint), resume, N more steps gives the
//! same losses and the same weights, bit for bit, as 2N uninterrupted steps.

use std::path::Path;

use vrtspike::config::Config;
use vrtspike::synth::{self, SynthOptions};
use vrtspike::train::{train, RankEnv, TrainOptions};

fn dataset(dir: &Path) {
    let options = SynthOptions::small(5);
    synth::generate_folder(dir, &options, &|_| {}).unwrap();
}

fn config(root: &Path) -> Config {
    let text = format!(
        "DATA:\n  ROOT: {}\n  CROP_SIZE: 32\n  VAL_CROP_SIZE: 32\n  CLIP_LEN: 2\n  SPIKE_BINS: 4\n  USE_RAM_CACHE: false\n\
         DATALOADER:\n  TOTAL_WORKERS: 2\n\
         TRAIN:\n  BATCH_SIZE: 2\n  TOTAL_STEPS: 8\n  WARMUP_STEPS: 2\n  LR: 1.0e-3\n  MAX_GRAD_NORM: 0.5\n  WEIGHT_DECAY: 0.01\n  SEED: 7\n\
         MODEL:\n  ARCH: unet_spike\n  UNET:\n    CHANNELS: 4\n    LEVELS: 1\n  SPIKE:\n    ENABLED: true\n    VOXEL_BINS: 4\n\
         LOG:\n  LOG_EVERY_STEPS: 1\n  VAL_EVERY_STEPS: 4\n  CKPT_EVERY_STEPS: 100\n",
        root.display()
    );
    Config::parse(&text, Path::new("resume.yaml")).unwrap()
}

fn env(run_dir: &Path) -> RankEnv {
    RankEnv::from_vars(&|_| None, Some(run_dir), Some("cpu")).unwrap()
}

#[test]
fn stop_and_resume_equals_uninterrupted() {
    tch::set_num_threads(1);
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    dataset(&data);
    let config = config(&data);

    let whole = train(
        &config,
        &env(&tmp.path().join("a")),
        &TrainOptions::default(),
    )
    .unwrap();
    assert!(whole.completed && !whole.preempted);
    assert_eq!(whole.losses.len(), 8);
    assert!(whole.losses.iter().all(|(_, l)| l.is_finite()));

    let run_b = tmp.path().join("b");
    let first = train(
        &config,
        &env(&run_b),
        &TrainOptions {
            stop_after_steps: Some(3),
        },
    )
    .unwrap();
    assert!(first.preempted && !first.completed);
    assert_eq!(first.steps, 3);
    assert!(run_b.join("checkpoints/step_00000003/state.json").is_file());
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(run_b.join("checkpoints/step_00000003/state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["sampler"]["position"], 6, "3 batches of 2 consumed");
    let second = train(&config, &env(&run_b), &TrainOptions::default()).unwrap();
    assert!(second.completed);
    assert_eq!(second.steps, 8);

    let resumed: Vec<(u64, f64)> = first.losses.iter().chain(&second.losses).copied().collect();
    assert_eq!(
        resumed, whole.losses,
        "losses of 3 + resume + 5 steps equal 8 steps"
    );
    let weights = |run: &Path| {
        std::fs::read(run.join("checkpoints/step_00000008/model.safetensors")).unwrap()
    };
    assert!(
        weights(&tmp.path().join("a")) == weights(&run_b),
        "final weights are bit-identical"
    );
    let moments = |run: &Path| {
        std::fs::read(run.join("checkpoints/step_00000008/optimizer.safetensors")).unwrap()
    };
    assert!(
        moments(&tmp.path().join("a")) == moments(&run_b),
        "AdamW moments are bit-identical"
    );
    // Validation ran at the end and the summary was written.
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_b.join("result.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "completed");
    assert_eq!(summary["steps"], 8);
    assert!(summary["val_psnr"].as_f64().unwrap() > 5.0);
    assert!(summary["input_psnr"].as_f64().unwrap() > 5.0);
    let file_psnr = summary["val_psnr"].as_f64().unwrap();
    let returned_psnr = second.summary.val_psnr.unwrap();
    assert!((file_psnr - returned_psnr).abs() < 1e-9);
    let metrics = std::fs::read_to_string(run_b.join("metrics.jsonl")).unwrap();
    assert!(metrics.lines().any(|l| l.contains("\"kind\":\"val\"")));
}
