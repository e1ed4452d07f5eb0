//! The diagnosis as text: the time split and the figures, then one line a
//! finding with the change to try.

use super::findings::pct;
use super::report::Diagnosis;

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
