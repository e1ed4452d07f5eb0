//! The bottleneck analyser behind `vrtspike analyze`: from a run's metrics, summary,
//! logs and (if present) profile, where the time goes (data wait, compute,
//! communication, validation), the slowest stage, memory headroom and trend (a
//! least-squares slope of Pss over steps: a leak), cache hit rate and evictions,
//! restarts and their causes, each finding with the change to try. The thresholds
//! are the user's symptom table ([`Thresholds::default`]).

use serde::Serialize;
use serde_json::Value;

use super::run::{Record, RunData};

/// The symptom table's limits.
#[derive(Debug, Clone, Serialize)]
pub struct Thresholds {
    /// GPU utilisation below this (percent) points at the loader.
    pub gpu_util_pct: f64,
    /// A forward pass above this (ms) points at the model.
    pub forward_ms: f64,
    /// A cache hit rate below this points at the cache.
    pub hit_rate: f64,
    /// A data wait above this (ms per step) points at the loader.
    pub data_time_ms: f64,
    /// Validation above this share of the wall time is worth thinning.
    pub val_share: f64,
    /// Pss growth over the measured steps above this share of its mean is a leak.
    pub leak_growth: f64,
    /// Host or device memory past this share of the total leaves little headroom.
    pub memory_used: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            gpu_util_pct: 50.0,
            forward_ms: 1500.0,
            hit_rate: 0.60,
            data_time_ms: 10.0,
            val_share: 0.20,
            leak_growth: 0.10,
            memory_used: 0.90,
        }
    }
}

/// What a finding is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Area {
    /// Data loading.
    Loader,
    /// The model's own compute.
    Model,
    /// The shared-memory cache.
    Cache,
    /// Gradient synchronisation.
    Communication,
    /// Validation passes.
    Validation,
    /// Memory headroom.
    Memory,
    /// Memory that grows with steps.
    Leak,
    /// Restarts of the job.
    Restarts,
    /// Skipped (non-finite) steps.
    Stability,
}

/// One row of the diagnosis table.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// The part at fault.
    pub area: Area,
    /// What was seen.
    pub symptom: String,
    /// The figure, formatted.
    pub measured: String,
    /// The limit it crossed.
    pub limit: String,
    /// The concrete change to try.
    pub change: String,
}

/// Where a training step's time goes (means per optimizer step).
#[derive(Debug, Clone, Default, Serialize)]
pub struct TimeSplit {
    /// Wall time per step outside validation, ms.
    pub step_ms: Option<f64>,
    /// Waiting for data per step, ms (the window's wait for batches).
    pub data_ms: Option<f64>,
    /// Gradient synchronisation per step, ms (when the metrics record it).
    pub comm_ms: Option<f64>,
    /// The rest of the step: forward, backward, optimizer, checkpoints, ms.
    pub compute_ms: Option<f64>,
    /// Seconds of training measured between metrics lines.
    pub train_s: f64,
    /// Seconds of validation.
    pub validation_s: f64,
    /// Validation's share of train + validation time.
    pub validation_share: Option<f64>,
}

/// Memory figures: peaks, headroom and the Pss trend.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MemoryReport {
    /// Largest process Pss, MiB.
    pub peak_pss_mb: Option<f64>,
    /// Least-squares slope of Pss over steps, MiB per 1,000 steps.
    pub pss_slope_mb_per_1k_steps: Option<f64>,
    /// Pss growth predicted by the slope over the measured steps, MiB.
    pub pss_growth_mb: Option<f64>,
    /// Largest host memory in use, GiB, and the host's total.
    pub system_used_gb: Option<f64>,
    /// Host memory, GiB.
    pub system_total_gb: Option<f64>,
    /// Largest device memory in use (NVML), GiB.
    pub gpu_used_gb: Option<f64>,
    /// Device memory, GiB.
    pub gpu_total_gb: Option<f64>,
    /// Largest CUDA allocator reservation, GiB.
    pub gpu_reserved_gb: Option<f64>,
}

/// The slowest stage (from the profile, else from the time split).
#[derive(Debug, Clone, Serialize)]
pub struct Stage {
    /// Its name.
    pub name: String,
    /// Its time, ms.
    pub ms: f64,
}

/// A restart of the job.
#[derive(Debug, Clone, Serialize)]
pub struct Restart {
    /// Step it resumed at.
    pub step: f64,
    /// The launcher's restart count.
    pub restart_count: u64,
}

/// The whole diagnosis.
#[derive(Debug, Clone, Serialize)]
pub struct Diagnosis {
    /// Steps done (summary, else the last metrics line).
    pub steps: Option<f64>,
    /// Time split.
    pub time: TimeSplit,
    /// The slowest stage.
    pub slowest_stage: Option<Stage>,
    /// Forward pass time from the profile, ms.
    pub forward_ms: Option<f64>,
    /// Mean GPU utilisation, percent.
    pub gpu_util_pct: Option<f64>,
    /// Memory.
    pub memory: MemoryReport,
    /// Cache hit rate (summary, else the last metrics line).
    pub cache_hit_rate: Option<f64>,
    /// Cache evictions (the cache server's statistics).
    pub cache_evictions: Option<u64>,
    /// Restarts, from the metrics' start events.
    pub restarts: Vec<Restart>,
    /// Failure causes from the summary and the logs.
    pub restart_causes: Vec<String>,
    /// Steps skipped for non-finite losses or gradients.
    pub skipped_steps: u64,
    /// Findings, most important first.
    pub findings: Vec<Finding>,
    /// The limits used.
    pub thresholds: Thresholds,
}

fn f64_of(r: &Record, key: &str) -> Option<f64> {
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

fn mean(values: &[f64]) -> Option<f64> {
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
fn time_split(run: &RunData) -> TimeSplit {
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
fn memory_report(run: &RunData) -> MemoryReport {
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
fn restart_causes(run: &RunData) -> Vec<String> {
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

/// The diagnosis of `run` under `limits`.
pub fn diagnose(run: &RunData, limits: &Thresholds) -> Diagnosis {
    let last_train = run.train.last();
    let evictions = run
        .summary
        .as_ref()
        .and_then(|s| s.pointer("/cache/evictions"))
        .and_then(Value::as_u64)
        .or_else(|| last_train.and_then(|r| r.get("cache_evictions")?.as_u64()));
    let profile = run.profile.as_ref();
    let mut diagnosis = Diagnosis {
        steps: run
            .summary_f64("steps")
            .or_else(|| last_train.and_then(|r| f64_of(r, "step"))),
        time: time_split(run),
        slowest_stage: None,
        forward_ms: profile.and_then(|p| p.get("forward_ms")?.as_f64()),
        gpu_util_pct: mean(
            &run.memory
                .iter()
                .filter_map(|r| f64_of(r, "gpu_util_pct"))
                .collect::<Vec<_>>(),
        ),
        memory: memory_report(run),
        cache_hit_rate: run
            .summary_f64("cache_hit_rate")
            .or_else(|| last_train.and_then(|r| f64_of(r, "cache_hit_rate"))),
        cache_evictions: evictions,
        restarts: run
            .restarts()
            .into_iter()
            .map(|s| Restart {
                step: s.step,
                restart_count: s.restart_count,
            })
            .collect(),
        restart_causes: restart_causes(run),
        skipped_steps: run.events_named("skipped_step").count() as u64,
        findings: Vec::new(),
        thresholds: limits.clone(),
    };
    diagnosis.slowest_stage = slowest_stage(profile, &diagnosis.time);
    diagnosis.findings = findings(&diagnosis, limits);
    diagnosis
}

/// The profile's slowest part, else the largest share of the step.
fn slowest_stage(profile: Option<&Value>, time: &TimeSplit) -> Option<Stage> {
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

fn pct(v: f64) -> String {
    format!("{:.0}%", 100.0 * v)
}

/// The findings, in the order of the symptom table, then memory, restarts, stability.
fn findings(d: &Diagnosis, limits: &Thresholds) -> Vec<Finding> {
    let mut out = Vec::new();
    let loader_change = "raise DATALOADER.TOTAL_WORKERS and DATALOADER.TRAIN_PREFETCH_FACTOR; \
                         keep DATA.USE_RAM_CACHE on so repeats come from the cache";
    if let Some(util) = d.gpu_util_pct.filter(|u| *u < limits.gpu_util_pct) {
        out.push(Finding {
            area: Area::Loader,
            symptom: "GPU mostly idle".into(),
            measured: format!("{util:.0}% utilisation"),
            limit: format!("< {:.0}%", limits.gpu_util_pct),
            change: loader_change.into(),
        });
    }
    if let Some(fwd) = d.forward_ms.filter(|f| *f > limits.forward_ms) {
        out.push(Finding {
            area: Area::Model,
            symptom: "slow forward pass".into(),
            measured: format!("{fwd:.0} ms forward"),
            limit: format!("> {:.0} ms", limits.forward_ms),
            change: "enable TRAIN.AMP_ENABLED (bf16), use a smaller preset (MODEL.VRT_DEPTHS, \
                     WINDOW_SIZE) or a smaller DATA.CROP_SIZE / DATA.CLIP_LEN; activation \
                     checkpointing trades compute for memory, not speed"
                .into(),
        });
    }
    cache_findings(d, limits, &mut out);
    if let Some(data) = d.time.data_ms.filter(|t| *t > limits.data_time_ms) {
        let share = d
            .time
            .step_ms
            .map(|s| format!(" ({} of the step)", pct(data / s)));
        out.push(Finding {
            area: Area::Loader,
            symptom: "waiting for data".into(),
            measured: format!("{data:.1} ms per step{}", share.unwrap_or_default()),
            limit: format!("> {:.0} ms", limits.data_time_ms),
            change: loader_change.into(),
        });
    }
    if let (Some(comm), Some(step)) = (d.time.comm_ms, d.time.step_ms) {
        if step > 0.0 && comm / step > 0.25 {
            out.push(Finding {
                area: Area::Communication,
                symptom: "gradient synchronisation dominates".into(),
                measured: format!("{comm:.0} ms of {step:.0} ms per step"),
                limit: "> 25% of the step".into(),
                change: "raise TRAIN.GRADIENT_ACCUMULATION_STEPS (fewer syncs per sample) or \
                         use DIST.BACKEND nccl on GPUs"
                    .into(),
            });
        }
    }
    if let Some(share) = d.time.validation_share.filter(|s| *s > limits.val_share) {
        out.push(Finding {
            area: Area::Validation,
            symptom: "validation takes much of the run".into(),
            measured: format!("{} of the time ({:.0} s)", pct(share), d.time.validation_s),
            limit: format!("> {}", pct(limits.val_share)),
            change: "raise LOG.VAL_EVERY_STEPS, or validate on fewer/shorter clips; a larger \
                     DATA.VAL_TILE runs fewer tiles when memory allows"
                .into(),
        });
    }
    memory_findings(d, limits, &mut out);
    run_findings(d, &mut out);
    out
}

fn cache_findings(d: &Diagnosis, limits: &Thresholds, out: &mut Vec<Finding>) {
    let Some(rate) = d.cache_hit_rate.filter(|r| *r < limits.hit_rate) else {
        return;
    };
    let evicting = d.cache_evictions.is_some_and(|e| e > 0);
    out.push(Finding {
        area: Area::Cache,
        symptom: if evicting {
            "cache too small: records evicted before reuse".into()
        } else {
            "low cache hit rate".into()
        },
        measured: format!(
            "{} hit rate, {} evictions",
            pct(rate),
            d.cache_evictions.map_or("?".into(), |e| e.to_string())
        ),
        limit: format!("< {}", pct(limits.hit_rate)),
        change: if evicting {
            "raise DATA.CACHE_SIZE_GB to hold the training set (or lower DATA.CLIP_LEN)".into()
        } else {
            "check DATA.USE_RAM_CACHE is on; a first epoch only fills the cache, so judge \
             the hit rate after it"
                .into()
        },
    });
}

fn memory_findings(d: &Diagnosis, limits: &Thresholds, out: &mut Vec<Finding>) {
    let m = &d.memory;
    if let (Some(growth), Some(peak)) = (m.pss_growth_mb, m.peak_pss_mb) {
        if peak > 0.0 && growth > limits.leak_growth * peak && growth > 64.0 {
            out.push(Finding {
                area: Area::Leak,
                symptom: "process memory grows with steps".into(),
                measured: format!(
                    "Pss +{:.1} MiB per 1,000 steps ({growth:.0} MiB over the run, peak {peak:.0} MiB)",
                    m.pss_slope_mb_per_1k_steps.unwrap_or(0.0)
                ),
                limit: format!("growth > {} of the peak", pct(limits.leak_growth)),
                change: "look for tensors kept across steps (losses stored with their graph, \
                         growing lists); if it stops at the cache size it is the cache filling"
                    .into(),
            });
        }
    }
    let pairs = [
        (m.system_used_gb, m.system_total_gb, "host", "lower DATA.CACHE_SIZE_GB, DATALOADER.TOTAL_WORKERS or TRAIN_PREFETCH_FACTOR"),
        (m.gpu_used_gb, m.gpu_total_gb, "GPU", "lower TRAIN.BATCH_SIZE (raise GRADIENT_ACCUMULATION_STEPS to keep the effective batch), DATA.CROP_SIZE, or enable TRAIN.AMP_ENABLED; set DATA.VAL_TILE for validation"),
    ];
    for (used, total, what, change) in pairs {
        if let (Some(used), Some(total)) = (used, total) {
            if total > 0.0 && used >= limits.memory_used * total {
                out.push(Finding {
                    area: Area::Memory,
                    symptom: format!("little {what} memory headroom"),
                    measured: format!("{used:.1} of {total:.1} GiB used"),
                    limit: format!(">= {}", pct(limits.memory_used)),
                    change: change.into(),
                });
            }
        }
    }
}

fn run_findings(d: &Diagnosis, out: &mut Vec<Finding>) {
    if !d.restarts.is_empty() || !d.restart_causes.is_empty() {
        let oom = d.restart_causes.iter().any(|c| c.contains("out of memory"));
        let killed = d
            .restart_causes
            .iter()
            .any(|c| c.contains("SIGKILL") || c.contains("Killed"));
        out.push(Finding {
            area: Area::Restarts,
            symptom: "the job restarted".into(),
            measured: format!(
                "{} restart(s) at step(s) {}; causes: {}",
                d.restarts.len(),
                d.restarts.iter().map(|r| format!("{:.0}", r.step)).collect::<Vec<_>>().join(", "),
                if d.restart_causes.is_empty() { "not recorded".into() } else { d.restart_causes.join("; ") }
            ),
            limit: "0".into(),
            change: if oom {
                "GPU out of memory: lower TRAIN.BATCH_SIZE or DATA.CROP_SIZE, enable TRAIN.AMP_ENABLED".into()
            } else if killed {
                "killed (often the host OOM killer): lower DATA.CACHE_SIZE_GB or DATALOADER.TOTAL_WORKERS".into()
            } else {
                "read the failing rank's log (logs/rank<N>.log); lower LOG.CKPT_EVERY_STEPS to lose less work per restart".into()
            },
        });
    }
    if d.skipped_steps > 0 {
        out.push(Finding {
            area: Area::Stability,
            symptom: "steps skipped for inf/NaN".into(),
            measured: format!("{} skipped step(s)", d.skipped_steps),
            limit: "0".into(),
            change:
                "lower TRAIN.LR or raise TRAIN.WARMUP_STEPS, set TRAIN.MAX_GRAD_NORM; with fp16 \
                     AMP prefer TRAIN.AMP_DTYPE bf16"
                    .into(),
        });
    }
}

fn opt(v: Option<f64>, unit: &str) -> String {
    v.map_or_else(|| "n/a".into(), |v| format!("{v:.1} {unit}"))
}

/// The diagnosis as text: the time split, figures, then the symptom table.
pub fn render(d: &Diagnosis) -> String {
    let t = &d.time;
    let share = |v: Option<f64>| match (v, t.step_ms) {
        (Some(v), Some(s)) if s > 0.0 => format!(" ({})", pct(v / s)),
        _ => String::new(),
    };
    let mut lines = vec![
        format!(
            "steps: {}",
            d.steps.map_or("n/a".into(), |s| format!("{s:.0}"))
        ),
        format!("time per step: {}", opt(t.step_ms, "ms")),
        format!(
            "  data wait:      {}{}",
            opt(t.data_ms, "ms"),
            share(t.data_ms)
        ),
        format!(
            "  compute:        {}{}",
            opt(t.compute_ms, "ms"),
            share(t.compute_ms)
        ),
        format!(
            "  communication:  {}{}",
            t.comm_ms
                .map_or("not measured".into(), |c| format!("{c:.1} ms")),
            share(t.comm_ms)
        ),
        format!(
            "validation: {:.1} s{}",
            t.validation_s,
            t.validation_share.map_or(String::new(), |s| format!(
                " ({} of train + validation)",
                pct(s)
            ))
        ),
        format!(
            "slowest stage: {}",
            d.slowest_stage
                .as_ref()
                .map_or("n/a".into(), |s| format!("{} {:.1} ms", s.name, s.ms))
        ),
        format!("GPU utilisation: {}", opt(d.gpu_util_pct, "%")),
        format!(
            "memory: peak Pss {}, Pss slope {}, host {} of {}, GPU {} of {} (reserved {})",
            opt(d.memory.peak_pss_mb, "MiB"),
            opt(d.memory.pss_slope_mb_per_1k_steps, "MiB/1k steps"),
            opt(d.memory.system_used_gb, "GiB"),
            opt(d.memory.system_total_gb, "GiB"),
            opt(d.memory.gpu_used_gb, "GiB"),
            opt(d.memory.gpu_total_gb, "GiB"),
            opt(d.memory.gpu_reserved_gb, "GiB"),
        ),
        format!(
            "cache: hit rate {}, evictions {}",
            d.cache_hit_rate.map_or("n/a".into(), pct),
            d.cache_evictions.map_or("n/a".into(), |e| e.to_string())
        ),
        format!(
            "restarts: {}, skipped steps: {}",
            d.restarts.len(),
            d.skipped_steps
        ),
        String::new(),
    ];
    if d.findings.is_empty() {
        lines.push("no symptom crossed its limit".into());
    }
    for f in &d.findings {
        lines.push(format!(
            "[{:?}] {}: {} (limit {})\n    try: {}",
            f.area, f.symptom, f.measured, f.limit, f.change
        ));
    }
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A made-up run: `steps` train lines 10 steps apart, each step `step_s` long.
    struct Fake {
        step_s: f64,
        data_ms: f64,
        hit_rate: f64,
        gpu_util: f64,
        pss: fn(f64) -> f64,
    }

    const HEALTHY: Fake = Fake {
        step_s: 0.5,
        data_ms: 2.0,
        hit_rate: 0.95,
        gpu_util: 92.0,
        pss: |_| 2000.0,
    };

    fn lines(f: &Fake, steps: u64) -> Vec<Value> {
        let mut out = vec![
            json!({"kind": "event", "event": "start", "step": 0, "restart_count": 0, "time": 0.0}),
        ];
        for i in 1..=steps {
            let step = (i * 10) as f64;
            let time = step * f.step_s;
            out.push(
                json!({"kind": "train", "step": step, "time": time, "loss": 0.1,
                "data_time_ms": f.data_ms, "cache_hit_rate": f.hit_rate, "samples_per_s": 8.0}),
            );
            out.push(
                json!({"kind": "memory", "step": step, "time": time, "pss_mb": (f.pss)(step),
                "sys_used_mb": 8000.0, "sys_total_mb": 64000.0, "gpu_used_mb": 20000.0,
                "gpu_total_mb": 80000.0, "gpu_util_pct": f.gpu_util}),
            );
        }
        out
    }

    fn run_of(lines: &[Value]) -> RunData {
        let text: Vec<String> = lines.iter().map(Value::to_string).collect();
        RunData::from_metrics(&text.join("\n"))
    }

    fn areas(d: &Diagnosis) -> Vec<Area> {
        d.findings.iter().map(|f| f.area).collect()
    }

    #[test]
    fn healthy_run_has_no_findings() {
        let d = diagnose(&run_of(&lines(&HEALTHY, 20)), &Thresholds::default());
        assert!(d.findings.is_empty(), "{}", render(&d));
        assert!((d.time.step_ms.unwrap() - 500.0).abs() < 1e-6);
        assert!((d.time.compute_ms.unwrap() - 498.0).abs() < 1e-6);
        assert_eq!(d.slowest_stage.as_ref().unwrap().name, "compute");
        assert!(d.memory.pss_slope_mb_per_1k_steps.unwrap().abs() < 1e-9);
        assert!(render(&d).contains("no symptom crossed its limit"));
    }

    #[test]
    fn starved_gpu_and_slow_data_point_at_the_loader() {
        let fake = Fake {
            gpu_util: 31.0,
            data_ms: 40.0,
            ..HEALTHY
        };
        let d = diagnose(&run_of(&lines(&fake, 20)), &Thresholds::default());
        assert_eq!(areas(&d), vec![Area::Loader, Area::Loader]);
        assert!(d.findings[0].measured.contains("31%"));
        assert!(d.findings[1]
            .measured
            .contains("40.0 ms per step (8% of the step)"));
        assert!(d.findings[1].change.contains("TOTAL_WORKERS"));
    }

    #[test]
    fn slow_forward_points_at_the_model_and_names_the_stage() {
        let mut run = run_of(&lines(&HEALTHY, 5));
        run.profile = Some(json!({"forward_ms": 2100.0, "parts": [
            {"part": "stage1", "forward_ms": 300.0}, {"part": "reconstruction", "forward_ms": 900.0}]}));
        let d = diagnose(&run, &Thresholds::default());
        assert_eq!(areas(&d), vec![Area::Model]);
        assert!(d.findings[0].change.contains("AMP_ENABLED"));
        let stage = d.slowest_stage.unwrap();
        assert!(stage.name.contains("reconstruction") && stage.ms == 900.0);
    }

    #[test]
    fn evicting_cache_is_too_small() {
        let fake = Fake {
            hit_rate: 0.35,
            ..HEALTHY
        };
        let mut run = run_of(&lines(&fake, 5));
        run.summary =
            Some(json!({"steps": 50, "cache_hit_rate": 0.41, "cache": {"evictions": 1234}}));
        let d = diagnose(&run, &Thresholds::default());
        assert_eq!(areas(&d), vec![Area::Cache]);
        assert_eq!(d.cache_hit_rate, Some(0.41));
        assert!(d.findings[0]
            .measured
            .contains("41% hit rate, 1234 evictions"));
        assert!(d.findings[0].change.contains("CACHE_SIZE_GB"));
        run.summary = Some(json!({"cache_hit_rate": 0.41, "cache": {"evictions": 0}}));
        let warm = diagnose(&run, &Thresholds::default());
        assert!(warm.findings[0].change.contains("first epoch"));
    }

    #[test]
    fn growing_pss_is_a_leak_with_its_slope() {
        let fake = Fake {
            pss: |step| 2000.0 + 0.5 * step,
            ..HEALTHY
        };
        let d = diagnose(&run_of(&lines(&fake, 100)), &Thresholds::default());
        assert_eq!(areas(&d), vec![Area::Leak]);
        assert!((d.memory.pss_slope_mb_per_1k_steps.unwrap() - 500.0).abs() < 1e-6);
        assert!(d.findings[0]
            .measured
            .contains("+500.0 MiB per 1,000 steps"));
        // The same growth in the first sample only (caches filling) is no leak.
        let warmup = Fake {
            pss: |step| if step <= 10.0 { 100.0 } else { 2000.0 },
            ..HEALTHY
        };
        let d = diagnose(&run_of(&lines(&warmup, 100)), &Thresholds::default());
        assert!(d.findings.is_empty(), "{}", render(&d));
    }

    #[test]
    fn restarts_are_counted_with_causes_and_gaps_left_out() {
        let mut all = lines(&HEALTHY, 10);
        // Restarted at step 100 after 1,000 s of downtime; validation of 30 s inside.
        all.push(json!({"kind": "event", "event": "start", "step": 100, "restart_count": 1, "time": 1040.0}));
        all.push(json!({"kind": "train", "step": 110, "time": 1050.0, "data_time_ms": 2.0}));
        all.push(json!({"kind": "val", "step": 115, "time": 1085.0, "val_s": 30.0}));
        all.push(json!({"kind": "train", "step": 120, "time": 1085.0, "data_time_ms": 2.0}));
        all.push(json!({"kind": "event", "event": "skipped_step", "step": 111, "time": 1051.0}));
        let mut run = run_of(&all);
        run.summary = Some(json!({"attempts": [
            {"attempt": 0, "failure": {"cause": "rank 1 (pid 9) exited with code 1"}},
            {"attempt": 1, "failure": null}]}));
        run.logs = vec![(
            "rank1.log".into(),
            vec![
                "ok".into(),
                "RuntimeError: CUDA out of memory. Tried".into(),
            ],
        )];
        let d = diagnose(&run, &Thresholds::default());
        assert_eq!(d.restarts.len(), 1);
        assert_eq!(d.restarts[0].step, 100.0);
        assert_eq!(d.restart_causes.len(), 2);
        assert_eq!(
            areas(&d),
            vec![Area::Validation, Area::Restarts, Area::Stability]
        );
        let restart = &d.findings[1];
        assert!(
            restart.measured.contains("step(s) 100"),
            "{}",
            restart.measured
        );
        assert!(restart.change.contains("BATCH_SIZE"));
        // 100 steps of 0.5 s before, then 10 steps in 5 s (35 s minus 30 s validation).
        assert!(
            (d.time.step_ms.unwrap() - 500.0).abs() < 1e-6,
            "{:?}",
            d.time
        );
        assert!((d.time.validation_s - 30.0).abs() < 1e-9);
    }

    #[test]
    fn full_memory_and_slopes() {
        assert_eq!(slope(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]), Some(2.0));
        assert_eq!(slope(&[(1.0, 1.0), (1.0, 3.0), (1.0, 5.0)]), None);
        assert_eq!(slope(&[(0.0, 1.0), (1.0, 3.0)]), None);
        let mut all = lines(&HEALTHY, 5);
        all.push(json!({"kind": "memory", "step": 60, "pss_mb": 2000.0, "gpu_used_mb": 78000.0, "gpu_total_mb": 80000.0}));
        let d = diagnose(&run_of(&all), &Thresholds::default());
        assert_eq!(areas(&d), vec![Area::Memory]);
        assert!(d.findings[0].symptom.contains("GPU"));
        let json = serde_json::to_value(&d).unwrap();
        assert_eq!(json["findings"][0]["area"], "memory");
    }
}
