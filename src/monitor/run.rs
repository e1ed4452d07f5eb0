//! A run directory as the plot and the analyser see it: the records of
//! `metrics.jsonl` by kind, the summary (`summary.json`, else `train_summary.json`),
//! an optional `profile.json` (`vrtspike profile --json`) and the tails of `logs/*.log`.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::MonitorError;
use vrtspike_contract::rundir::METRICS_FILE;

/// Lines kept from the end of each log.
const LOG_TAIL_LINES: usize = 200;

/// One metrics record (a JSON object with its `kind`).
pub type Record = Map<String, Value>;

/// A start of training: the step it started (or resumed) at and its restart count.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Start {
    /// Step at which it started.
    pub step: f64,
    /// The launcher's restart count (0 for the first start).
    pub restart_count: u64,
    /// The checkpoint it resumed from.
    pub resumed_from: Option<String>,
}

/// What was read from a run directory.
#[derive(Debug, Default, Clone)]
pub struct RunData {
    /// The directory.
    pub dir: PathBuf,
    /// `train` records, in file order.
    pub train: Vec<Record>,
    /// `val` records.
    pub val: Vec<Record>,
    /// `memory` records.
    pub memory: Vec<Record>,
    /// `event` records.
    pub events: Vec<Record>,
    /// Lines of `metrics.jsonl` that were not JSON objects (a torn last line).
    pub bad_lines: usize,
    /// The launcher's summary, else rank 0's.
    pub summary: Option<Value>,
    /// A `vrtspike profile --json` result.
    pub profile: Option<Value>,
    /// `(log file name, its last lines)`.
    pub logs: Vec<(String, Vec<String>)>,
}

fn read_json(path: &Path) -> Result<Option<Value>, MonitorError> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| MonitorError::format(path, format!("not JSON: {e}"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(MonitorError::io(path, e)),
    }
}

impl RunData {
    /// Reads `dir`; a missing `metrics.jsonl` is an error, the other files are optional.
    pub fn load(dir: &Path) -> Result<RunData, MonitorError> {
        let metrics = dir.join(METRICS_FILE);
        let text = std::fs::read_to_string(&metrics).map_err(|e| MonitorError::io(&metrics, e))?;
        let mut run = RunData::from_metrics(&text);
        run.dir = dir.to_path_buf();
        run.summary = match read_json(&dir.join("summary.json"))? {
            Some(summary) => Some(summary),
            None => read_json(&dir.join("train_summary.json"))?,
        };
        run.profile = read_json(&dir.join("profile.json"))?;
        run.logs = read_log_tails(&dir.join("logs"));
        Ok(run)
    }

    /// The records of a `metrics.jsonl` text (no other file).
    pub fn from_metrics(text: &str) -> RunData {
        let mut run = RunData::default();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let Ok(Value::Object(record)) = serde_json::from_str::<Value>(line) else {
                run.bad_lines += 1;
                continue;
            };
            let target = match record.get("kind").and_then(Value::as_str) {
                Some("train") => &mut run.train,
                Some("val") => &mut run.val,
                Some("memory") => &mut run.memory,
                Some("event") => &mut run.events,
                _ => continue,
            };
            target.push(record);
        }
        run
    }

    /// `(step, value)` of a numeric `field` of `records` (records without it skipped).
    pub fn series(records: &[Record], field: &str) -> Vec<(f64, f64)> {
        records
            .iter()
            .filter_map(|r| {
                let step = r.get("step")?.as_f64()?;
                let value = r.get(field)?.as_f64()?;
                value.is_finite().then_some((step, value))
            })
            .collect()
    }

    /// Every `start` event, in order.
    pub fn starts(&self) -> Vec<Start> {
        self.events_named("start")
            .map(|r| Start {
                step: r.get("step").and_then(Value::as_f64).unwrap_or(0.0),
                restart_count: r.get("restart_count").and_then(Value::as_u64).unwrap_or(0),
                resumed_from: r
                    .get("resumed_from")
                    .and_then(Value::as_str)
                    .map(str::to_string),
            })
            .collect()
    }

    /// The starts after the first (restarts and resumes), at their steps.
    pub fn restarts(&self) -> Vec<Start> {
        let mut starts = self.starts();
        if !starts.is_empty() {
            starts.remove(0);
        }
        starts
    }

    /// Event records named `name`.
    pub fn events_named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Record> + 'a {
        self.events
            .iter()
            .filter(move |r| r.get("event").and_then(Value::as_str) == Some(name))
    }

    /// A number from the summary.
    pub fn summary_f64(&self, key: &str) -> Option<f64> {
        self.summary.as_ref()?.get(key)?.as_f64()
    }
}

/// The last lines of every `*.log` in `dir` (none if there is no such folder).
fn read_log_tails(dir: &Path) -> Vec<(String, Vec<String>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut logs: Vec<(String, Vec<String>)> = entries
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
        .filter_map(|e| {
            let bytes = std::fs::read(e.path()).ok()?;
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(LOG_TAIL_LINES)..]
                .iter()
                .map(|l| l.to_string())
                .collect();
            Some((e.file_name().to_string_lossy().into_owned(), tail))
        })
        .collect();
    logs.sort();
    logs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_by_kind_and_restarts() {
        let text = r#"{"kind":"event","event":"start","step":0,"restart_count":0}
{"kind":"train","step":10,"loss":0.5}
{"kind":"train","step":20,"loss":null}
{"kind":"memory","step":20,"pss_mb":100.0}
{"kind":"event","event":"start","step":20,"restart_count":1,"resumed_from":"ck/20"}
{"kind":"val","step":30,"val_psnr":28.0}
{"kind":"trai"#;
        let run = RunData::from_metrics(text);
        assert_eq!(
            (run.train.len(), run.val.len(), run.memory.len()),
            (2, 1, 1)
        );
        assert_eq!(run.bad_lines, 1);
        assert_eq!(RunData::series(&run.train, "loss"), vec![(10.0, 0.5)]);
        let restarts = run.restarts();
        assert_eq!(restarts.len(), 1);
        assert_eq!(restarts[0].step, 20.0);
        assert_eq!(restarts[0].resumed_from.as_deref(), Some("ck/20"));
    }

    #[test]
    fn load_reads_summary_and_logs() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            RunData::load(dir.path()),
            Err(MonitorError::Io { .. })
        ));
        std::fs::write(
            dir.path().join(METRICS_FILE),
            "{\"kind\":\"train\",\"step\":1}\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("train_summary.json"), "{\"steps\": 1}").unwrap();
        std::fs::create_dir(dir.path().join("logs")).unwrap();
        std::fs::write(dir.path().join("logs/rank0.log"), "a\nb\n").unwrap();
        let run = RunData::load(dir.path()).unwrap();
        assert_eq!(run.summary_f64("steps"), Some(1.0));
        let expected = vec![(
            "rank0.log".to_string(),
            vec!["a".to_string(), "b".to_string()],
        )];
        assert_eq!(run.logs, expected);
        std::fs::write(dir.path().join("profile.json"), "{oops").unwrap();
        let err = RunData::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("profile.json"), "{err}");
    }
}
