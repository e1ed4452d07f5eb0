//! `vrtspike analyze RUN_DIR [--json] [--profile FILE]`: where a run's time and
//! memory go and what to change, in the shape of the symptom table.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use vrtspike::monitor::analyze::{diagnose, render, Thresholds};
use vrtspike::monitor::run::RunData;

/// Arguments of `vrtspike analyze`.
#[derive(Args)]
pub struct AnalyzeArgs {
    /// The run directory (holding metrics.jsonl; summary.json, logs/ and profile.json if present).
    pub run_dir: PathBuf,
    /// A `vrtspike profile --json` result (default RUN_DIR/profile.json when present).
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Print the diagnosis as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Runs `vrtspike analyze`.
pub fn run(args: AnalyzeArgs) -> Result<()> {
    let mut data = RunData::load(&args.run_dir)
        .with_context(|| format!("reading the run {}", args.run_dir.display()))?;
    if let Some(path) = &args.profile {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the profile {}", path.display()))?;
        data.profile = Some(
            serde_json::from_str(&text)
                .with_context(|| format!("the profile {} is not JSON", path.display()))?,
        );
    }
    let diagnosis = diagnose(&data, &Thresholds::default());
    if args.json {
        println!("{}", serde_json::to_string_pretty(&diagnosis)?);
    } else {
        println!("{}", render(&diagnosis));
    }
    Ok(())
}
