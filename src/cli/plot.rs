//! `vrtspike plot RUN_DIR [--out FILE.png|.svg]`: the run's figure (loss, PSNR,
//! throughput, data wait, memory, restarts); prints the file's path.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use vrtspike::monitor::plot::{plot, PLOT_FILE};
use vrtspike::monitor::run::RunData;

/// Arguments of `vrtspike plot`.
#[derive(Args)]
pub struct PlotArgs {
    /// The run directory (holding metrics.jsonl).
    pub run_dir: PathBuf,
    /// The figure's file: `.svg` for SVG, PNG otherwise (default RUN_DIR/plot.png).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Runs `vrtspike plot`.
pub fn run(args: PlotArgs) -> Result<()> {
    let data = RunData::load(&args.run_dir)
        .with_context(|| format!("reading the run {}", args.run_dir.display()))?;
    let out = args.out.unwrap_or_else(|| args.run_dir.join(PLOT_FILE));
    plot(&data, &out).with_context(|| format!("plotting {}", args.run_dir.display()))?;
    println!("{}", out.display());
    Ok(())
}
