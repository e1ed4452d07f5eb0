//! Training figures as JSON lines in the run directory (`metrics.jsonl`, one object
//! a line with a `kind`: `train`, `val`, `memory`, `event`), and on rank 0 a
//! progress bar (`indicatif`) showing the same figures. Rank 0 also feeds every
//! record to TensorBoard (`<run dir>/tb/`, see [`crate::monitor::tb_sink`]) unless
//! [`MetricsSink::with_tensorboard`] turns it off (`LOG.TENSORBOARD: false`).

use std::io::Write;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};

use crate::monitor::TensorBoardSink;

/// The metrics file name in the run directory.
pub const METRICS_FILE: &str = vrtspike_contract::rundir::METRICS_FILE;

/// Appends JSON lines (rank 0 only; other ranks hold a disabled sink) and drives the bar.
pub struct MetricsSink {
    file: Option<(PathBuf, std::fs::File)>,
    bar: Option<ProgressBar>,
    tb: Option<TensorBoardSink>,
}

impl MetricsSink {
    /// A sink writing to `<run_dir>/metrics.jsonl` with a bar of `total_steps`
    /// starting at `step`, or a disabled one when `enabled` is false.
    pub fn new(
        run_dir: &Path,
        enabled: bool,
        step: u64,
        total_steps: u64,
    ) -> std::io::Result<MetricsSink> {
        if !enabled {
            return Ok(MetricsSink {
                file: None,
                bar: None,
                tb: None,
            });
        }
        let path = run_dir.join(METRICS_FILE);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        let bar = ProgressBar::new(total_steps);
        if let Ok(style) =
            ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} steps {msg}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_position(step);
        Ok(MetricsSink {
            file: Some((path, file)),
            bar: Some(bar),
            tb: Some(TensorBoardSink::new(run_dir)),
        })
    }

    /// Keeps (`LOG.TENSORBOARD: true`) or drops the TensorBoard events.
    pub fn with_tensorboard(mut self, enabled: bool) -> MetricsSink {
        if !enabled {
            self.tb = None;
        }
        self
    }

    /// The TensorBoard sink (for validation images), if on.
    pub fn tensorboard(&mut self) -> Option<&mut TensorBoardSink> {
        self.tb.as_mut()
    }

    /// Writes one line `{"kind": kind, ...fields}` with the wall-clock time.
    pub fn write(&mut self, kind: &str, fields: Value) {
        let Some((path, file)) = &mut self.file else {
            return;
        };
        let mut object = match fields {
            Value::Object(map) => map,
            other => {
                let mut map = serde_json::Map::new();
                map.insert("value".into(), other);
                map
            }
        };
        object.insert("kind".into(), json!(kind));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        object.insert("time".into(), json!(now));
        if let Some(tb) = &mut self.tb {
            tb.record(kind, &object);
        }
        let line = Value::Object(object).to_string();
        if let Err(e) = writeln!(file, "{line}") {
            tracing::warn!(path = %path.display(), error = %e, "cannot append metrics");
        }
    }

    /// Moves the bar to `step` with a one-line message.
    pub fn progress(&self, step: u64, message: String) {
        if let Some(bar) = &self.bar {
            bar.set_position(step);
            bar.set_message(message);
        }
    }

    /// Prints a line above the bar (or through the log when there is none).
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) if !bar.is_hidden() => bar.println(line),
            _ => tracing::info!("{line}"),
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_json_with_kind() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = MetricsSink::new(dir.path(), true, 0, 10).unwrap();
        sink.write("train", json!({"step": 1, "loss": 0.5}));
        sink.write("val", json!({"step": 1, "val_psnr": 30.0}));
        sink.finish();
        let text = std::fs::read_to_string(dir.path().join(METRICS_FILE)).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["kind"], "train");
        assert_eq!(lines[0]["loss"], 0.5);
        assert_eq!(lines[1]["val_psnr"], 30.0);
        assert_eq!(std::fs::read_dir(dir.path().join("tb")).unwrap().count(), 1);
        let mut off = MetricsSink::new(dir.path(), false, 0, 10).unwrap();
        off.write("train", json!({"step": 2}));
        assert_eq!(
            std::fs::read_to_string(dir.path().join(METRICS_FILE))
                .unwrap()
                .lines()
                .count(),
            2
        );
        let other = tempfile::tempdir().unwrap();
        let mut no_tb = MetricsSink::new(other.path(), true, 0, 10)
            .unwrap()
            .with_tensorboard(false);
        no_tb.write("train", json!({"step": 1, "loss": 0.5}));
        assert!(no_tb.tensorboard().is_none());
        assert!(!other.path().join("tb").exists());
    }
}
