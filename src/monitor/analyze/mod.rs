//! The bottleneck analyser behind `vrtspike analyze`: from a run's metrics, summary,
//! logs and (if present) profile, where the time goes (data wait, compute,
//! communication, validation), the slowest stage, memory headroom and trend (a
//! least-squares slope of Pss over steps: a leak), cache hit rate and evictions,
//! restarts and their causes, each finding with the change to try. The thresholds
//! are the user's symptom table ([`Thresholds::default`]).
//!
//! Here the diagnosis is put together: `figures.rs` reads a run's figures,
//! `findings.rs` holds them against the limits, `render.rs` writes the diagnosis
//! as text, and `report.rs` holds the types they share.

mod figures;
mod findings;
mod render;
mod report;

use serde_json::Value;

use super::run::RunData;
pub use figures::slope;
use figures::{f64_of, mean};
pub use render::render;
pub use report::{Area, Diagnosis, Finding, MemoryReport, Restart, Stage, Thresholds, TimeSplit};

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
        time: figures::time_split(run),
        slowest_stage: None,
        forward_ms: profile.and_then(|p| p.get("forward_ms")?.as_f64()),
        gpu_util_pct: mean(
            &run.memory
                .iter()
                .filter_map(|r| f64_of(r, "gpu_util_pct"))
                .collect::<Vec<_>>(),
        ),
        memory: figures::memory_report(run),
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
        restart_causes: figures::restart_causes(run),
        skipped_steps: run.events_named("skipped_step").count() as u64,
        findings: Vec::new(),
        thresholds: limits.clone(),
    };
    diagnosis.slowest_stage = figures::slowest_stage(profile, &diagnosis.time);
    diagnosis.findings = findings::findings(&diagnosis, limits);
    diagnosis
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
