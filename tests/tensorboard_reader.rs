//! The TensorBoard event files `vrtspike` writes, read back by the `tensorboard`
//! Python package (the venv's `.venv/bin/python`): every record's CRCs and protobuf
//! parse, and the accumulator sees the tags, steps, values and image sizes written.
//! Skipped with a message when the venv or its `tensorboard` is missing. A tiny
//! training run leaves events with every figure of its metrics and validation
//! images; `LOG.TENSORBOARD: false` leaves none.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};
use vrtspike::config::Config;
use vrtspike::monitor::tensorboard::RgbImage;
use vrtspike::synth::{self, SynthOptions};
use vrtspike::train::metrics::MetricsSink;
use vrtspike::train::{train, RankEnv, TrainOptions};

const READER: &str = r#"
import json, sys
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow as pw, errors
from tensorboard.compat.proto import event_pb2
from tensorboard.backend.event_processing import event_accumulator as ea

path = sys.argv[1]
reader = pw.PyRecordReader_New(path, 0, None)
records = 0
while True:
    try:
        reader.GetNext()
    except errors.OutOfRangeError:
        break
    event_pb2.Event.FromString(reader.record())
    records += 1
acc = ea.EventAccumulator(path, size_guidance={ea.SCALARS: 0, ea.IMAGES: 0})
acc.Reload()
tags = acc.Tags()
print(json.dumps({
    "records": records,
    "file_version": acc.file_version,
    "scalars": {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in tags["scalars"]},
    "images": {t: [[e.step, e.width, e.height, len(e.encoded_image_string)] for e in acc.Images(t)]
               for t in tags["images"]},
}))
"#;

fn python() -> Option<PathBuf> {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    if !python.exists() {
        eprintln!("skipped: no {} (make setup creates it)", python.display());
        return None;
    }
    let probe = Command::new(&python)
        .args(["-c", "import tensorboard"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        eprintln!(
            "skipped: {} has no tensorboard (pip install -r requirements.txt)",
            python.display()
        );
        return None;
    }
    Some(python)
}

fn read(python: &Path, file: &Path) -> Value {
    let out = Command::new(python)
        .args(["-c", READER])
        .arg(file)
        .output()
        .expect("runs python");
    assert!(
        out.status.success(),
        "reader failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("reader prints JSON")
}

#[test]
fn python_reads_scalars_and_images() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut sink = MetricsSink::new(dir.path(), true, 0, 100).unwrap();
    sink.write(
        "event",
        json!({"event": "start", "step": 0, "restart_count": 1}),
    );
    for step in [10u64, 20, 30] {
        sink.write(
            "train",
            json!({"step": step, "loss": 1.0 / step as f64, "lr": 2e-4, "grad_norm": null}),
        );
    }
    sink.write(
        "val",
        json!({"step": 30, "val_psnr": 31.25, "val_ssim": 0.875, "input_psnr": 27.5}),
    );
    sink.write(
        "memory",
        json!({"step": 30, "pss_mb": 1536.0, "sys_used_mb": 4096.0,
        "gpu_allocated_mb": 2048.0, "gpu_reserved_mb": 3072.0}),
    );
    let panel = |v: f32| RgbImage::from_chw(&vec![v; 3 * 8 * 6], 3, 8, 6).unwrap();
    let (blur, output, sharp) = (panel(0.2), panel(0.5), panel(0.9));
    let triple = RgbImage::side_by_side(&[&blur, &output, &sharp], 2).unwrap();
    let tb = sink.tensorboard().expect("on by default");
    tb.image(30, "val/images/clip0", &triple);
    let file = tb.path().unwrap().to_path_buf();
    sink.finish();
    drop(sink);
    let name = file.file_name().unwrap().to_string_lossy().into_owned();
    assert!(file.parent().unwrap().ends_with("tb") && name.starts_with("events.out.tfevents."));

    let got = read(&python, &file);
    assert_eq!(got["records"], 8, "{got}");
    assert_eq!(got["file_version"], 2.0);
    let scalars = &got["scalars"];
    assert_eq!(
        scalars["train/loss"],
        json!([
            [10, 0.1f32 as f64],
            [20, 0.05f32 as f64],
            [30, (1.0f32 / 30.0) as f64]
        ])
    );
    assert_eq!(scalars["train/lr"].as_array().unwrap().len(), 3);
    assert!(scalars.get("train/grad_norm").is_none());
    assert_eq!(scalars["val/psnr"], json!([[30, 31.25]]));
    assert_eq!(scalars["val/ssim"], json!([[30, 0.875]]));
    assert_eq!(scalars["val/input_psnr"], json!([[30, 27.5]]));
    assert_eq!(scalars["memory/process_pss_mb"], json!([[30, 1536.0]]));
    assert_eq!(scalars["memory/system_used_gb"], json!([[30, 4.0]]));
    assert_eq!(scalars["memory/gpu0_allocated_gb"], json!([[30, 2.0]]));
    assert_eq!(scalars["memory/gpu0_reserved_gb"], json!([[30, 3.0]]));
    assert_eq!(scalars["events/restart_count"], json!([[0, 1.0]]));
    let image = &got["images"]["val/images/clip0"][0];
    assert_eq!(
        (image[0].as_i64(), image[1].as_i64(), image[2].as_i64()),
        (Some(30), Some(6 * 3 + 4), Some(8))
    );
    assert!(image[3].as_u64().unwrap() > 50);
}

#[test]
fn python_rejects_a_corrupted_file() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut sink = MetricsSink::new(dir.path(), true, 0, 10).unwrap();
    sink.write("train", json!({"step": 1, "loss": 0.5}));
    let file = sink.tensorboard().unwrap().path().unwrap().to_path_buf();
    drop(sink);
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 6;
    bytes[last] ^= 0xFF;
    std::fs::write(&file, bytes).unwrap();
    let out = Command::new(&python)
        .args(["-c", READER])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "a flipped byte must fail the CRC check"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("crc32"));
}

/// A synthetic set of 2 training and 1 test sequence of 6 frames (64x96).
fn dataset(dir: &Path) {
    let options = SynthOptions::small(3);
    synth::generate_folder(dir, &options, &|_| {}).unwrap();
}

/// 4 steps of a tiny U-Net, logged every step, validated (32x32 centre crops) every 2.
fn tiny_run(data: &Path, run_dir: &Path, tensorboard: bool) {
    let text = format!(
        "DATA:\n  ROOT: {}\n  CROP_SIZE: 32\n  VAL_CROP_SIZE: 32\n  CLIP_LEN: 2\n  SPIKE_BINS: 4\n  USE_RAM_CACHE: false\n\
         DATALOADER:\n  TOTAL_WORKERS: 1\n\
         TRAIN:\n  BATCH_SIZE: 2\n  TOTAL_STEPS: 4\n  WARMUP_STEPS: 1\n  SEED: 1\n\
         MODEL:\n  ARCH: unet_spike\n  UNET:\n    CHANNELS: 4\n    LEVELS: 1\n  SPIKE:\n    ENABLED: true\n    VOXEL_BINS: 4\n\
         LOG:\n  LOG_EVERY_STEPS: 1\n  MEM_EVERY_STEPS: 2\n  VAL_EVERY_STEPS: 2\n  CKPT_EVERY_STEPS: 100\n  TENSORBOARD: {tensorboard}\n",
        data.display()
    );
    let config = Config::parse(&text, Path::new("tb.yaml")).unwrap();
    let env = RankEnv::from_vars(&|_| None, Some(run_dir), Some("cpu")).unwrap();
    let outcome = train(&config, &env, &TrainOptions::default()).unwrap();
    assert!(outcome.completed);
}

fn event_files(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect()
}

#[test]
fn a_training_run_leaves_every_figure_and_images() {
    let Some(python) = python() else { return };
    tch::set_num_threads(1);
    let tmp = tempfile::tempdir().unwrap();
    dataset(&tmp.path().join("data"));
    let run_dir = tmp.path().join("run");
    tiny_run(&tmp.path().join("data"), &run_dir, true);
    let files = event_files(&run_dir.join("tb"));
    assert_eq!(files.len(), 1, "{files:?}");
    let got = read(&python, &files[0]);
    let scalars = &got["scalars"];
    let steps = |tag: &str| -> Vec<i64> {
        let points = scalars[tag].as_array();
        let points = points.unwrap_or_else(|| panic!("no {tag} in {scalars}"));
        points.iter().map(|p| p[0].as_i64().unwrap()).collect()
    };
    for tag in [
        "train/loss",
        "train/lr",
        "train/samples_per_s",
        "train/data_time_ms",
        "train/step_time_ms",
        "train/comm_time_ms",
        "train/cache_hit_rate",
        "train/skipped_steps",
        "train/grad_norm",
    ] {
        assert_eq!(steps(tag), [1, 2, 3, 4], "{tag}");
    }
    for tag in ["val/psnr", "val/ssim", "val/input_psnr"] {
        assert_eq!(steps(tag), [2, 4], "{tag}");
    }
    for tag in ["memory/process_pss_mb", "memory/system_used_gb"] {
        assert_eq!(steps(tag), [2, 4], "{tag}");
    }
    let psnr = scalars["val/psnr"][1][1].as_f64().unwrap();
    assert!(psnr > 5.0 && psnr < 60.0, "{psnr}");
    let step_ms = scalars["train/step_time_ms"][0][1].as_f64().unwrap();
    assert!(step_ms > 0.0, "{step_ms}");
    let images = got["images"].as_object().unwrap();
    assert_eq!(images.len(), 3, "first frame of 3 clips: {images:?}");
    let clip0 = &images["val/images/clip0"];
    assert_eq!(clip0.as_array().unwrap().len(), 2, "one a validation");
    // blur | output | sharp, 32x32 each with 4-pixel gaps.
    assert_eq!(
        (&clip0[0][1], &clip0[0][2]),
        (&json!(3 * 32 + 8), &json!(32))
    );
}

#[test]
fn tensorboard_off_leaves_no_events() {
    tch::set_num_threads(1);
    let tmp = tempfile::tempdir().unwrap();
    dataset(&tmp.path().join("data"));
    let run_dir = tmp.path().join("run");
    tiny_run(&tmp.path().join("data"), &run_dir, false);
    assert!(run_dir.join("metrics.jsonl").is_file());
    assert!(!run_dir.join("tb").exists());
}
