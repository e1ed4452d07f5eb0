//! The figures of a run, read from its metrics, summary, logs and profile: the
//! time split of a step (pairs of train lines, restarts and validation left out),
//! memory peaks and the least-squares slope of Pss over steps, the restarts'
//! causes, and the slowest stage.

use serde_json::Value;

use super::report::{MemoryReport, Stage, TimeSplit};
use crate::monitor::run::{Record, RunData};

pub fn f64_of(r: &Record, key: &str) -> Option<f64> {
    r.get(key).and_then(Value::as_f64).filter(|v| v.is_finite())
}

fn time_of(r: &Record) -> Option<f64> {
    f64_of(r, "time")
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    Some(if n % 2 == 1 {
        values[n / 2]
    } else {
        0.5 * (values[n / 2 - 1] + values[n / 2])
    })
}

pub fn mean(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

/// Least-squares slope of `y` over `x` (None for fewer than 3 points or one `x`).
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    if points.len() < 3 {
        return None;
    }
    let n = points.len() as f64;
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

/// Step wall time from consecutive train lines (pairs across a restart and
/// validation time inside a pair are left out).
pub fn time_split(run: &RunData) -> TimeSplit {
    let starts: Vec<f64> = run.events_named("start").filter_map(time_of).collect();
    let vals: Vec<(f64, f64)> = run
        .val
        .iter()
        .filter_map(|r| Some((time_of(r)?, f64_of(r, "val_s")?)))
        .collect();
    let (mut wall, mut steps) = (0.0, 0.0);
    for pair in run.train.windows(2) {
        let (Some(t0), Some(t1), Some(s0), Some(s1)) = (
            time_of(&pair[0]),
            time_of(&pair[1]),
            f64_of(&pair[0], "step"),
            f64_of(&pair[1], "step"),
        ) else {
            continue;
        };
        if s1 <= s0 || t1 <= t0 || starts.iter().any(|&s| s > t0 && s <= t1) {
            continue;
        }
        let val_inside: f64 = vals
            .iter()
            .filter(|(t, _)| *t > t0 && *t <= t1)
            .map(|v| v.1)
            .sum();
        wall += (t1 - t0 - val_inside).max(0.0);
        steps += s1 - s0;
    }
    let explicit: Vec<f64> = run
        .train
        .iter()
        .filter_map(|r| f64_of(r, "step_time_ms"))
        .collect();
    let step_ms = mean(&explicit).or((steps > 0.0).then(|| 1000.0 * wall / steps));
    let field = |key: &str| median(run.train.iter().filter_map(|r| f64_of(r, key)).collect());
    let data_ms = field("data_time_ms");
    let comm_ms = field("comm_time_ms");
    let compute_ms =
        step_ms.map(|s| (s - data_ms.unwrap_or(0.0) - comm_ms.unwrap_or(0.0)).max(0.0));
    let validation_s: f64 = run.val.iter().filter_map(|r| f64_of(r, "val_s")).sum();
    let total = wall + validation_s;
    TimeSplit {
        step_ms,
        data_ms,
        comm_ms,
        compute_ms,
        train_s: wall,
        validation_s,
        validation_share: (total > 0.0).then(|| validation_s / total),
    }
}

/// Peaks and the Pss slope (the first sample, taken while caches fill, is left out).
pub fn memory_report(run: &RunData) -> MemoryReport {
    const GB: f64 = 1024.0;
    let peak = |key: &str| {
        run.memory
            .iter()
            .filter_map(|r| f64_of(r, key))
            .reduce(f64::max)
    };
    let pss = RunData::series(&run.memory, "pss_mb");
    let trend = if pss.len() > 3 { &pss[1..] } else { &pss[..] };
    let slope_per_step = slope(trend);
    let span = trend.last().map(|l| l.0).unwrap_or(0.0) - trend.first().map(|f| f.0).unwrap_or(0.0);
    MemoryReport {
        peak_pss_mb: peak("pss_mb").or_else(|| run.summary_f64("peak_pss_mb")),
        pss_slope_mb_per_1k_steps: slope_per_step.map(|s| s * 1000.0),
        pss_growth_mb: slope_per_step.map(|s| s * span),
        system_used_gb: peak("sys_used_mb").map(|v| v / GB),
        system_total_gb: peak("sys_total_mb").map(|v| v / GB),
        gpu_used_gb: peak("gpu_used_mb").map(|v| v / GB),
        gpu_total_gb: peak("gpu_total_mb").map(|v| v / GB),
        gpu_reserved_gb: peak("gpu_reserved_mb").map(|v| v / GB),
    }
}

/// The failure causes the launcher recorded, then log lines that name one.
pub fn restart_causes(run: &RunData) -> Vec<String> {
    let mut causes = Vec::new();
    if let Some(attempts) = run
        .summary
        .as_ref()
        .and_then(|s| s.get("attempts"))
        .and_then(Value::as_array)
    {
        for attempt in attempts {
            if let Some(cause) = attempt.pointer("/failure/cause").and_then(Value::as_str) {
                causes.push(format!(
                    "attempt {}: {cause}",
                    attempt.get("attempt").and_then(Value::as_u64).unwrap_or(0)
                ));
            }
        }
    }
    const MARKERS: [&str; 6] = [
        "out of memory",
        "panicked",
        "Killed",
        "NCCL",
        "timed out",
        "non-finite",
    ];
    for (name, lines) in &run.logs {
        if let Some(line) = lines
            .iter()
            .rev()
            .find(|l| MARKERS.iter().any(|m| l.contains(m)))
        {
            causes.push(format!("{name}: {}", line.trim()));
        }
    }
    causes
}

/// The profile's slowest part, else the largest share of the step.
pub fn slowest_stage(profile: Option<&Value>, time: &TimeSplit) -> Option<Stage> {
    let from_profile = profile
        .and_then(|p| p.get("parts")?.as_array())
        .and_then(|parts| {
            parts
                .iter()
                .filter_map(|p| Some((p.get("part")?.as_str()?, p.get("forward_ms")?.as_f64()?)))
                .max_by(|a, b| a.1.total_cmp(&b.1))
        })
        .map(|(name, ms)| Stage {
            name: format!("model part {name} (forward)"),
            ms,
        });
    from_profile.or_else(|| {
        [
            ("data wait", time.data_ms),
            ("compute", time.compute_ms),
            ("communication", time.comm_ms),
        ]
        .into_iter()
        .filter_map(|(name, ms)| Some((name, ms?)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(name, ms)| Stage {
            name: name.to_string(),
            ms,
        })
    })
}
