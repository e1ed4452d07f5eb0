//! `cargo bench --bench logging`: the per-step cost of logging: N `train` records
//! (the trainer's fields) through `MetricsSink` into `metrics.jsonl` alone, the same
//! with TensorBoard events, and TensorBoard alone; prints one JSON object with the
//! microseconds per record. N is `LOGGING_BENCH_RECORDS` (default 20,000).

use std::time::Instant;

use serde_json::{json, Value};
use vrtspike::monitor::TensorBoardSink;
use vrtspike::train::metrics::MetricsSink;

fn record(step: u64) -> Value {
    json!({
        "step": step, "epoch": step / 1000, "loss": 0.05 + 1.0 / (step as f64 + 1.0), "lr": 2e-4,
        "input_loss": 0.09, "grad_norm": 0.7, "samples_per_s": 12.5, "data_time_ms": 1.8,
        "step_time_ms": 282.5, "comm_time_ms": 42.6, "cache_hit_rate": 0.97, "cache_evictions": 0,
        "loss_scale": 65536.0, "skipped_steps": 0,
    })
}

/// Microseconds per record for `n` records through `sink`.
fn time_sink(mut sink: MetricsSink, n: u64) -> f64 {
    let started = Instant::now();
    for step in 1..=n {
        sink.write("train", record(step));
    }
    sink.finish();
    started.elapsed().as_secs_f64() * 1e6 / n as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: u64 = std::env::var("LOGGING_BENCH_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let dir = tempfile::tempdir()?;
    let (a, b, c) = (
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("c"),
    );
    for d in [&a, &b, &c] {
        std::fs::create_dir(d)?;
    }
    let metrics_only = time_sink(MetricsSink::new(&a, true, 0, n)?.with_tensorboard(false), n);
    let metrics_and_tb = time_sink(MetricsSink::new(&b, true, 0, n)?, n);
    let mut tb = TensorBoardSink::new(&c);
    let records: Vec<Value> = (1..=n).map(record).collect();
    let started = Instant::now();
    for r in &records {
        if let Value::Object(map) = r {
            tb.record("train", map);
        }
    }
    let tb_only = started.elapsed().as_secs_f64() * 1e6 / n as f64;
    let tb_bytes = tb
        .path()
        .map_or(0, |p| std::fs::metadata(p).map_or(0, |m| m.len()));
    println!(
        "{}",
        json!({
            "records": n,
            "us_per_record_metrics_jsonl": metrics_only,
            "us_per_record_metrics_and_tensorboard": metrics_and_tb,
            "us_per_record_tensorboard_only": tb_only,
            "tensorboard_bytes_per_record": tb_bytes as f64 / n as f64,
        })
    );
    Ok(())
}
