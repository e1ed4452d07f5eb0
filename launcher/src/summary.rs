//! `summary.json`, written by the launcher at every exit (success, failure,
//! preemption, interrupt, bad arguments): how the job ended, its attempts and first
//! failure, the job's peak memory, and rank 0's training figures (the contract's
//! typed [`RunSummary`]) merged in.

use std::path::Path;
use std::time::SystemTime;

use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::{Map, Value};

use vrtspike_contract::failure::{FailureClass, RankFailure, EXIT_OUT_OF_MEMORY};
use vrtspike_contract::rundir::RunLayout;
use vrtspike_contract::summary::RunSummary;

use crate::pss::MemoryPeaks;

/// The launcher's exit status when another node was lost (sysexits' EX_TEMPFAIL:
/// try again, on the nodes left).
pub const EXIT_NODE_LOST: u8 = 75;

/// How the job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExitKind {
    /// Every rank exited 0.
    Completed,
    /// The ranks checkpointed and exited 0 after a preemption request.
    Preempted,
    /// A rank failed and no restart was left (or allowed).
    Failed,
    /// Another node's launcher was silent for `--peer-silence-s` (its host down or
    /// cut off): the ranks here stopped, for a requeue on the nodes left.
    NodeLost,
    /// Stopped by SIGINT.
    Interrupted,
    /// The launcher could not start the job (arguments, config, cache server).
    Error,
}

impl ExitKind {
    /// The name used in `summary.json` (`completed`, `failed`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ExitKind::Completed => "completed",
            ExitKind::Preempted => "preempted",
            ExitKind::Failed => "failed",
            ExitKind::NodeLost => "node_lost",
            ExitKind::Interrupted => "interrupted",
            ExitKind::Error => "error",
        }
    }

    /// The launcher's exit status for this ending.
    pub fn exit_code(self) -> u8 {
        match self {
            ExitKind::Completed | ExitKind::Preempted => 0,
            ExitKind::Failed => 1,
            ExitKind::Error => 2,
            ExitKind::NodeLost => EXIT_NODE_LOST,
            ExitKind::Interrupted => 130,
        }
    }
}

/// A rank (or the cache server) that failed.
#[derive(Debug, Clone, Serialize)]
pub struct Failure {
    /// The node where it happened.
    pub node: u32,
    /// Global rank; `None` for the cache server or another node.
    pub rank: Option<u32>,
    /// Which process (`rank 1`, `cache server`).
    pub process: String,
    /// Its pid.
    pub pid: u32,
    /// Exit code, when it exited.
    pub exit_code: Option<i32>,
    /// Signal name, when a signal killed it.
    pub signal: Option<String>,
    /// One line: `rank 1 (pid 123) exited with code 3`.
    pub cause: String,
    /// Its log file.
    pub log: String,
    /// The last lines of that log.
    pub log_tail: Vec<String>,
    /// The rank's own failure class (from its failure record or exit code), when it
    /// gave one: `out_of_memory` or `error`.
    pub class: Option<FailureClass>,
    /// A rank found stopped or hung (every node saves its stacks).
    #[serde(skip)]
    pub stuck: bool,
}

impl Failure {
    /// A failure of `process` on `node` that no exit status, pid or log tells of
    /// (the ranks as a whole, another node): `cause` says it all.
    pub fn of(node: u32, process: String, cause: String) -> Failure {
        Failure {
            node,
            rank: None,
            process,
            pid: 0,
            exit_code: None,
            signal: None,
            cause,
            log: String::new(),
            log_tail: Vec::new(),
            class: None,
            stuck: false,
        }
    }

    /// Adds the rank's own account of this failure: its failure record (written by
    /// this very process) or, without one, its out-of-memory exit code. The cause
    /// gets the rank's message: `rank 1 (pid 7) exited with code 12: out of memory in ...`.
    pub fn with_rank_account(mut self, layout: &RunLayout) -> Failure {
        let Some(rank) = self.rank else {
            return self;
        };
        let record = RankFailure::read_for(&layout.rank_failure(rank), self.pid);
        match record {
            Some(record) => {
                self.cause = format!("{}: {}", self.cause, record.message);
                self.class = Some(record.class);
            }
            None if self.exit_code == Some(EXIT_OUT_OF_MEMORY) => {
                self.cause = format!("{}: out of memory (no failure record)", self.cause);
                self.class = Some(FailureClass::OutOfMemory);
            }
            None => {}
        }
        self
    }
}

/// One start of the gang.
#[derive(Debug, Clone, Serialize)]
pub struct AttemptRecord {
    /// 0 for the first start, then the restart count.
    pub attempt: u32,
    /// Seconds it ran.
    pub duration_s: f64,
    /// `completed`, `failed`, `preempted`, `interrupted`.
    pub outcome: ExitKind,
    /// Newest checkpoint when it started.
    pub resumed_from: Option<String>,
    /// Seconds from the failure before it to its ranks' start (restarts only).
    pub restart_latency_s: Option<f64>,
    /// What failed, if it failed.
    pub failure: Option<Failure>,
    /// Processes that had to be SIGKILLed after the grace period.
    pub killed_after_grace: Vec<String>,
}

/// A node lost and left out by elastic membership, or one that came back.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LostNode {
    /// Its index in the job's first membership.
    pub node: u32,
    /// Its host, as it said in its beats (`None`: it never said).
    pub host: Option<String>,
}

/// One change of the job's membership (`--min-nodes`): the nodes that remain go on
/// from the last checkpoint in a smaller world, or nodes that came back are taken
/// in again in a bigger one.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MembershipChange {
    /// Seconds from launch to the change.
    pub at_s: f64,
    /// The attempt that starts with the new membership.
    pub attempt: u32,
    /// The step of the checkpoint the new world resumes from (`None`: none yet).
    pub resumed_step: Option<u64>,
    /// Nodes before and after.
    pub nodes_before: u32,
    pub nodes_after: u32,
    /// The nodes that remain, by their index in the job's first membership, in
    /// their new order (the new node index is the place in this list).
    pub members: Vec<u32>,
    /// The nodes left out.
    pub lost: Vec<LostNode>,
    /// The nodes that came back and were taken in again.
    pub rejoined: Vec<LostNode>,
    /// The factor on the gradient accumulation that keeps the global batch.
    pub accumulation: u32,
}

/// Everything the launcher knows at exit.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// How the job ended.
    pub exit: ExitKind,
    /// The launcher's exit status.
    pub exit_code: u8,
    /// Why it did not complete, in one line.
    pub error: Option<String>,
    /// The first failure of the job.
    pub failure: Option<Failure>,
    /// Restarts done, of `--max-restarts` (the attempts a membership change
    /// started are not restarts: `membership_changes` names them).
    pub restarts: u32,
    /// Every start of the gang.
    pub attempts: Vec<AttemptRecord>,
    /// Every change of the job's membership (`--min-nodes`), in order.
    pub membership_changes: Vec<MembershipChange>,
    /// The run directory.
    pub run_dir: String,
    /// Nodes in the job.
    pub nnodes: u32,
    /// This node.
    pub node_rank: u32,
    /// Ranks in the job.
    pub world_size: u32,
    /// Ranks on this node.
    pub local_world_size: u32,
    /// Seconds from launch to exit.
    pub wall_s: f64,
    /// Memory of this node's job (launcher, cache server, ranks).
    #[serde(flatten)]
    pub memory: MemoryPeaks,
    /// The cache server's last statistics (`vrtspike cache stats --json`).
    pub cache: Option<Value>,
}

/// Keys every summary has, `null` when nothing reported them.
const TRAIN_KEYS: [&str; 6] = [
    "steps",
    "val_psnr",
    "input_psnr",
    "val_ssim",
    "samples_per_s",
    "cache_hit_rate",
];

impl Summary {
    /// The JSON object: the launcher's fields, rank 0's `train_summary` merged in
    /// (the launcher's own keys win), and every key of [`TRAIN_KEYS`] present.
    pub fn to_json(&self, train_summary: Option<&RunSummary>) -> Value {
        let object_of = |value: serde_json::Result<Value>| match value {
            Ok(Value::Object(map)) => map,
            _ => Map::new(),
        };
        let mut object = object_of(serde_json::to_value(self));
        if let Some(train) = train_summary.map(|t| object_of(serde_json::to_value(t))) {
            for (key, value) in train {
                object.entry(key).or_insert(value);
            }
        }
        if object.get("cache_hit_rate").is_none_or(Value::is_null) {
            if let Some(rate) = self.cache.as_ref().and_then(|c| c.get("hit_rate")) {
                object.insert("cache_hit_rate".into(), rate.clone());
            }
        }
        for key in TRAIN_KEYS {
            object.entry(key).or_insert(Value::Null);
        }
        Value::Object(object)
    }

    /// Writes the summary to `path` atomically (temporary file, then rename),
    /// merging rank 0's summary at `train_summary` if it reads and was written at
    /// or after `launched` (one left by an earlier run in the same directory is not
    /// this run's result).
    pub fn write(&self, path: &Path, train_summary: &Path, launched: SystemTime) -> Result<()> {
        let fresh = std::fs::metadata(train_summary)
            .and_then(|m| m.modified())
            .is_ok_and(|modified| modified >= launched);
        let train = match fresh.then(|| RunSummary::read(train_summary)) {
            None => None,
            Some(Ok(summary)) => Some(summary),
            Some(Err(e)) => {
                tracing::warn!("ignoring rank 0's figures: {e}");
                None
            }
        };
        let text = serde_json::to_string_pretty(&self.to_json(train.as_ref()))?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text + "\n").with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;
    use vrtspike_contract::summary::TrainStatus;

    use super::*;

    fn train(steps: u64) -> RunSummary {
        let text = json!({"status": "completed", "steps": steps, "total_steps": steps,
            "world_size": 2, "val_psnr": 30.5, "restarts": 99, "peak_pss_mb": 1.0});
        serde_json::from_value(text).unwrap_or_else(|e| panic!("{e}"))
    }

    fn summary() -> Summary {
        Summary {
            exit: ExitKind::Completed,
            exit_code: 0,
            error: None,
            failure: None,
            restarts: 1,
            attempts: Vec::new(),
            membership_changes: Vec::new(),
            run_dir: "/r".into(),
            nnodes: 1,
            node_rank: 0,
            world_size: 2,
            local_world_size: 2,
            wall_s: 3.0,
            memory: MemoryPeaks {
                peak_pss_mb: 100.0,
                ..MemoryPeaks::default()
            },
            cache: Some(json!({"hit_rate": 0.75})),
        }
    }

    #[test]
    fn exit_names_match_the_json() {
        for kind in [
            ExitKind::Completed,
            ExitKind::Preempted,
            ExitKind::Failed,
            ExitKind::Interrupted,
            ExitKind::Error,
        ] {
            assert_eq!(serde_json::to_value(kind).ok(), Some(json!(kind.name())));
        }
    }

    #[test]
    fn required_keys_always_present_and_launcher_keys_win() {
        let value = summary().to_json(Some(&train(40)));
        assert_eq!(train(40).status, TrainStatus::Completed);
        assert_eq!(value["exit"], "completed");
        assert_eq!(value["status"], "completed");
        assert_eq!(value["val_psnr"], 30.5);
        assert_eq!(value["steps"], 40);
        assert_eq!(value["restarts"], 1);
        assert_eq!(value["peak_pss_mb"], 100.0);
        assert_eq!(value["cache_hit_rate"], 0.75);
        assert!(value["input_psnr"].is_null() && value["val_ssim"].is_null());
        assert!(value["samples_per_s"].is_null());
    }

    #[test]
    fn written_atomically_with_a_bad_train_summary_ignored() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let train = tmp.path().join("train_summary.json");
        std::fs::write(&train, "{not json").unwrap_or_else(|e| panic!("{e}"));
        let path = tmp.path().join("summary.json");
        let launched = SystemTime::now() - Duration::from_secs(60);
        summary()
            .write(&path, &train, launched)
            .unwrap_or_else(|e| panic!("{e:#}"));
        let value = read(&path);
        assert_eq!(value["restarts"], 1);
        assert!(value["steps"].is_null());
        assert!(!tmp.path().join("summary.json.tmp").exists());
    }

    #[test]
    fn train_summary_of_an_earlier_run_is_not_merged() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let written = tmp.path().join("train_summary.json");
        train(500).write(&written).unwrap_or_else(|e| panic!("{e}"));
        let path = tmp.path().join("summary.json");
        let before = SystemTime::now() - Duration::from_secs(60);
        summary()
            .write(&path, &written, before)
            .unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(read(&path)["steps"], 500);
        let after = SystemTime::now() + Duration::from_secs(60);
        summary()
            .write(&path, &written, after)
            .unwrap_or_else(|e| panic!("{e:#}"));
        assert!(read(&path)["steps"].is_null());
    }

    fn read(path: &Path) -> Value {
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{e}"));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}"))
    }
}
