//! The TensorBoard event files `vrtspike` writes, read back by the `tensorboard`
//! Python package (the venv's `.venv/bin/python`): every record's CRCs and protobuf
//! parse, and the accumulator sees the tags, steps, values and image sizes written.
//! Skipped with a message when the venv or its `tensorboard` is missing.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};
use vrtspike::monitor::tensorboard::RgbImage;
use vrtspike::train::metrics::MetricsSink;

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
