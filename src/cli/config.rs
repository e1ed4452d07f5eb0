//! `vrtspike config show`: the resolved config of a file (its `BASE` chain and `--set`
//! overrides applied), each key marked with where it came from.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use vrtspike::config::Config;

/// Config tools.
#[derive(Subcommand)]
pub enum ConfigCommand {
    /// Every resolved key with its value and origin (default, base, file, override).
    Show(ShowArgs),
}

/// Arguments of `config show`.
#[derive(Args)]
pub struct ShowArgs {
    /// The config file.
    #[arg(long)]
    config: PathBuf,
    /// Override a key, `KEY.PATH=VALUE` (YAML value); repeatable, applied in order.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Runs a `config` subcommand.
pub fn run(cmd: ConfigCommand) -> Result<()> {
    match cmd {
        ConfigCommand::Show(args) => show(&args),
    }
}

fn show(args: &ShowArgs) -> Result<()> {
    let resolved = Config::resolve(&args.config, &args.set)
        .with_context(|| format!("resolving {}", args.config.display()))?;
    if args.json {
        let text = serde_json::to_string_pretty(&resolved.render_json())
            .context("writing the resolved config as JSON")?;
        println!("{text}");
    } else {
        print!("{}", resolved.render_text());
    }
    Ok(())
}
