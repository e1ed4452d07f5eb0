//! The memory plan check before a launch: runs `vrtspike plan --json` on the config
//! with the job's `--set` overrides, node layout and cache cap (the launcher does
//! not link libtorch, so the planner runs as a subprocess), logs its warnings, and
//! refuses a plan with a term that cannot fit at all, naming it. A config or
//! override the planner cannot read is refused with the planner's own error, which
//! names the key and the `--set` argument.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// What the check needs to know about the launch.
pub struct PlanRequest<'a> {
    /// The `vrtspike` binary.
    pub vrtspike: &'a Path,
    /// The run config.
    pub config: &'a Path,
    /// The `--set KEY.PATH=VALUE` overrides, in order.
    pub overrides: &'a [String],
    /// GPUs of the node in use (0 for CPU ranks).
    pub gpus: u32,
    /// Ranks on the node (one per GPU, or the CPU ranks).
    pub ranks: u32,
    /// The launcher's `--cache-size`, when it overrides the config's cap.
    pub cache_size: Option<&'a str>,
}

/// The planner's verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The guides' warnings (logged; the launch goes on).
    pub warnings: Vec<String>,
    /// Terms that cannot fit (the launch is refused).
    pub misfits: Vec<String>,
}

/// The planner's command line for `request`.
fn command(request: &PlanRequest) -> Command {
    let mut command = crate::spawn::vrtspike_helper(request.vrtspike);
    command
        .args(["plan", "--json", "--gpus", &request.gpus.to_string()])
        .args(["--ranks", &request.ranks.to_string()])
        .arg("--config")
        .arg(request.config);
    for spec in request.overrides {
        command.arg(format!("--set={spec}"));
    }
    if let Some(size) = request.cache_size {
        command.arg(format!("--cache-size={size}"));
    }
    command
        .env("RUST_LOG", "warn")
        // The planner's error, not a backtrace of where it was returned.
        .env("RUST_LIB_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Reads the verdict out of the planner's JSON.
pub fn verdict(plan: &Value) -> Result<Verdict> {
    let strings = |key: &str| -> Result<Vec<String>> {
        let list = plan
            .get(key)
            .and_then(Value::as_array)
            .with_context(|| format!("the plan has no {key} list"))?;
        Ok(list
            .iter()
            .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string))
            .collect())
    };
    Ok(Verdict {
        warnings: strings("warnings")?,
        misfits: strings("misfits")?,
    })
}

/// Runs the planner; `Err` when it fails (a bad config or override, named by its
/// own message) or when a term cannot fit.
pub fn check(request: &PlanRequest) -> Result<Verdict> {
    let output = command(request)
        .output()
        .with_context(|| format!("running {} plan", request.vrtspike.display()))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let message = stderr.split("Stack backtrace:").next().unwrap_or("");
        let tail: Vec<&str> = message.trim_end().lines().rev().take(12).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "the config {} cannot be planned (vrtspike plan {}):\n{}",
            request.config.display(),
            output
                .status
                .code()
                .map_or_else(|| "was killed".to_string(), |c| format!("exited {c}")),
            tail.join("\n")
        );
    }
    let plan: Value =
        serde_json::from_slice(&output.stdout).context("reading the JSON of vrtspike plan")?;
    let verdict = verdict(&plan)?;
    for warning in &verdict.warnings {
        tracing::warn!("memory plan: {warning}");
    }
    if !verdict.misfits.is_empty() {
        bail!(
            "the memory plan of {} cannot fit on this node: {} (skip this check with \
             --no-plan-check)",
            request.config.display(),
            verdict.misfits.join("; ")
        );
    }
    Ok(verdict)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SLURM sends the job's SIGUSR2 and SIGTERM to every process of the step: the
    /// planner, which loads libtorch for a while, must start with them blocked and
    /// ignore them (the launcher decides what the job does).
    #[test]
    fn the_planner_starts_protected_from_the_job_signals() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let vrtspike = crate::spawn::mask_reporting_vrtspike(dir.path());
        let request = PlanRequest {
            vrtspike: &vrtspike,
            config: Path::new("c.yaml"),
            overrides: &[],
            gpus: 0,
            ranks: 1,
            cache_size: None,
        };
        let verdict = check(&request).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(
            verdict.warnings[0].starts_with("protected=true"),
            "{verdict:?}"
        );
    }

    #[test]
    fn verdicts_and_command_lines() {
        let plan = serde_json::json!({"warnings": ["cache above half"], "misfits": []});
        let v = verdict(&plan).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(v.warnings, ["cache above half"]);
        assert!(v.misfits.is_empty());
        assert!(verdict(&serde_json::json!({"warnings": []})).is_err());
        let overrides = vec!["TRAIN.LR=-1".to_string()];
        let request = PlanRequest {
            vrtspike: Path::new("/bin/vrtspike"),
            config: Path::new("c.yaml"),
            overrides: &overrides,
            gpus: 2,
            ranks: 2,
            cache_size: Some("16M"),
        };
        let args: Vec<String> = command(&request)
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            args,
            [
                "plan",
                "--json",
                "--gpus",
                "2",
                "--ranks",
                "2",
                "--config",
                "c.yaml",
                "--set=TRAIN.LR=-1",
                "--cache-size=16M"
            ]
        );
    }
}
