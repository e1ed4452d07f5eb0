//! The TensorBoard side of `metrics.jsonl`: maps each record (`train`, `val`,
//! `memory`, `event`) to scalar tags (`train/loss`, `val/psnr`,
//! `memory/process_pss_mb`, `memory/gpu0_allocated_gb`, ...) and writes them to
//! `<run dir>/tb/`. The event file is opened at the first record, and a write error
//! disables the sink after one warning (training goes on).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::tensorboard::{EventWriter, RgbImage, SummaryValue};
use super::MonitorError;

/// The folder under the run directory holding the event files.
pub const TB_DIR: &str = "tb";

/// Keys that are not figures.
const NOT_SCALARS: [&str; 5] = ["kind", "time", "step", "event", "device"];

/// The scalar tags of one metrics record of `kind`, in key order.
pub fn scalar_tags(kind: &str, fields: &Map<String, Value>) -> Vec<(String, f32)> {
    if kind == "event" {
        return event_tags(fields);
    }
    let gpu = fields.get("device").and_then(Value::as_u64).unwrap_or(0);
    fields
        .iter()
        .filter(|(key, _)| !NOT_SCALARS.contains(&key.as_str()))
        .filter_map(|(key, value)| {
            let v = value.as_f64()?;
            Some(match kind {
                "val" => (format!("val/{}", val_name(key)), v),
                "memory" => memory_tag(key, v, gpu),
                other => (format!("{other}/{key}"), v),
            })
        })
        .map(|(tag, v)| (tag, v as f32))
        .collect()
}

/// `val_psnr` -> `psnr`, `val_s` -> `time_s`, others unchanged (`input_psnr`).
fn val_name(key: &str) -> &str {
    match key {
        "val_s" => "time_s",
        _ => key.strip_prefix("val_").unwrap_or(key),
    }
}

/// The user's memory tags: host in `process_*_mb` / `system_*_gb`, devices in
/// `gpu<N>_*_gb`, utilisation in `gpu<N>_util_pct`.
fn memory_tag(key: &str, mb: f64, gpu: u64) -> (String, f64) {
    const GB: f64 = 1024.0;
    match key {
        "pss_mb" => ("memory/process_pss_mb".into(), mb),
        "rss_mb" => ("memory/process_rss_mb".into(), mb),
        "sys_used_mb" => ("memory/system_used_gb".into(), mb / GB),
        "sys_total_mb" => ("memory/system_total_gb".into(), mb / GB),
        "gpu_util_pct" => (format!("memory/gpu{gpu}_util_pct"), mb),
        _ => match key.strip_prefix("gpu_").and_then(|k| k.strip_suffix("_mb")) {
            Some(what) => (format!("memory/gpu{gpu}_{what}_gb"), mb / GB),
            None => (format!("memory/{key}"), mb),
        },
    }
}

/// `start` -> `events/restart_count`; any other event -> `events/<name>` = 1.
fn event_tags(fields: &Map<String, Value>) -> Vec<(String, f32)> {
    match fields.get("event").and_then(Value::as_str) {
        Some("start") => fields
            .get("restart_count")
            .and_then(Value::as_f64)
            .map(|n| vec![("events/restart_count".to_string(), n as f32)])
            .unwrap_or_default(),
        Some(name) => vec![(format!("events/{name}"), 1.0)],
        None => Vec::new(),
    }
}

/// Writes metrics records and validation images as TensorBoard events.
pub struct TensorBoardSink {
    dir: PathBuf,
    writer: Option<EventWriter>,
    failed: bool,
    last_step: i64,
}

impl TensorBoardSink {
    /// A sink for `<run_dir>/tb/` (nothing is created before the first record).
    pub fn new(run_dir: &Path) -> TensorBoardSink {
        TensorBoardSink {
            dir: run_dir.join(TB_DIR),
            writer: None,
            failed: false,
            last_step: 0,
        }
    }

    /// The event file, once opened.
    pub fn path(&self) -> Option<&Path> {
        self.writer.as_ref().map(EventWriter::path)
    }

    /// Writes the scalars of one metrics record (its `step`, else the last one seen).
    pub fn record(&mut self, kind: &str, fields: &Map<String, Value>) {
        if let Some(step) = fields.get("step").and_then(Value::as_i64) {
            self.last_step = step;
        }
        let tags = scalar_tags(kind, fields);
        if tags.is_empty() {
            return;
        }
        let values: Vec<SummaryValue> = tags
            .iter()
            .map(|(tag, v)| SummaryValue::Scalar(tag, *v))
            .collect();
        self.write(self.last_step, &values);
    }

    /// Writes one image (e.g. `val/images/<clip>`: blur | output | sharp) at `step`.
    pub fn image(&mut self, step: i64, tag: &str, image: &RgbImage) {
        self.write(step, &[SummaryValue::Image(tag, image)]);
    }

    fn write(&mut self, step: i64, values: &[SummaryValue]) {
        if self.failed {
            return;
        }
        if self.writer.is_none() {
            match EventWriter::create(&self.dir) {
                Ok(writer) => self.writer = Some(writer),
                Err(e) => return self.disable(&e),
            }
        }
        if let Some(writer) = &mut self.writer {
            if let Err(e) = writer.write(step, values) {
                self.disable(&e);
            }
        }
    }

    fn disable(&mut self, error: &MonitorError) {
        tracing::warn!(error = %error, "TensorBoard events disabled for this run");
        self.failed = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tags(kind: &str, value: Value) -> Vec<(String, f32)> {
        match value {
            Value::Object(map) => scalar_tags(kind, &map),
            _ => unreachable!(),
        }
    }

    #[test]
    fn train_and_val_tags() {
        let t = tags(
            "train",
            json!({"step": 5, "loss": 0.25, "lr": 1e-4, "grad_norm": null, "time": 1.0, "kind": "train"}),
        );
        assert_eq!(
            t,
            vec![("train/loss".into(), 0.25), ("train/lr".into(), 1e-4)]
        );
        let v = tags(
            "val",
            json!({"step": 5, "val_psnr": 30.5, "val_ssim": 0.9, "input_psnr": 25.0, "val_s": 2.0}),
        );
        let names: Vec<&str> = v.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(
            names,
            ["val/input_psnr", "val/psnr", "val/time_s", "val/ssim"]
        );
    }

    #[test]
    fn the_cache_bypass_count_is_a_train_scalar() {
        let t = tags(
            "train",
            json!({"step": 5, "cache_bypass": 3, "cache_hit_rate": 0.5}),
        );
        assert_eq!(
            t,
            vec![
                ("train/cache_bypass".into(), 3.0),
                ("train/cache_hit_rate".into(), 0.5)
            ]
        );
    }

    #[test]
    fn memory_tags_follow_the_users_names() {
        let m = tags(
            "memory",
            json!({"step": 10, "pss_mb": 512.0, "sys_used_mb": 2048.0, "gpu_allocated_mb": 1024.0,
                   "gpu_reserved_mb": 3072.0, "gpu_util_pct": 87, "device": 1}),
        );
        assert_eq!(
            m,
            vec![
                ("memory/gpu1_allocated_gb".into(), 1.0),
                ("memory/gpu1_reserved_gb".into(), 3.0),
                ("memory/gpu1_util_pct".into(), 87.0),
                ("memory/process_pss_mb".into(), 512.0),
                ("memory/system_used_gb".into(), 2.0),
            ]
        );
    }

    #[test]
    fn event_tags_count_restarts() {
        let start = tags(
            "event",
            json!({"event": "start", "step": 0, "restart_count": 2}),
        );
        assert_eq!(start, vec![("events/restart_count".into(), 2.0)]);
        let skip = tags("event", json!({"event": "skipped_step", "step": 9}));
        assert_eq!(skip, vec![("events/skipped_step".into(), 1.0)]);
    }

    #[test]
    fn sink_opens_lazily_and_writes() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = TensorBoardSink::new(dir.path());
        assert!(sink.path().is_none());
        assert!(!dir.path().join(TB_DIR).exists());
        let fields = json!({"step": 1, "loss": 0.5});
        sink.record("train", fields.as_object().unwrap());
        let path = sink.path().unwrap().to_path_buf();
        assert!(path.starts_with(dir.path().join(TB_DIR)));
        let size = std::fs::metadata(&path).unwrap().len();
        sink.record("train", fields.as_object().unwrap());
        assert!(std::fs::metadata(&path).unwrap().len() > size);
    }
}
