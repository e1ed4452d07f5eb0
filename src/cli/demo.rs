//! `vrtspike demo`: the main job as far as it goes today: a cache server in its own
//! process driven by a short synthetic load from two processes, then its live stats.

use anyhow::{ensure, Result};
use clap::Args;

use super::bench::{run_cache, CacheBenchArgs};

/// `demo` takes no options yet.
#[derive(Args)]
pub struct DemoArgs {
    /// Seconds of synthetic load.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
}

/// Runs the demo.
pub fn run(args: DemoArgs) -> Result<()> {
    let bench = CacheBenchArgs::demo(args.seconds);
    tracing::info!(
        "starting a cache server and 2 client processes x 2 threads for {:.0} s",
        args.seconds
    );
    let report = run_cache(&bench)?;
    if let Some(stats) = &report.server {
        println!("cache server statistics at the end of the load:");
        print!("{stats}");
    }
    println!(
        "{:.0} gets/s, hit rate {:.1}%, hit latency p50 {:.0} µs p99 {:.0} µs, {} evictions, {} torn reads",
        report.ops_per_s,
        100.0 * report.hit_rate,
        report.hit_p50_us,
        report.hit_p99_us,
        report.evictions,
        report.torn_reads
    );
    ensure!(report.torn_reads == 0, "{} torn reads", report.torn_reads);
    Ok(())
}
