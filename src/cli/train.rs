//! `vrtspike train --config C`: one rank of a training job. Started by
//! `vrtspike-launch` with the rank environment, or alone as a single rank.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use vrtspike::config::Config;
use vrtspike::train::node_cache::{self, ServeFrom};
use vrtspike::train::run_config::record_config;
use vrtspike::train::{
    accumulation, failure, rendezvous, train, RankEnv, TrainError, TrainOptions,
};

/// `vrtspike train`: trains the model of a config on its dataset.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Run config (YAML).
    #[arg(long)]
    pub config: PathBuf,
    /// Override a key, `KEY.PATH=VALUE` (YAML value), typed and checked like the
    /// file; repeatable, applied in order after the file and its `BASE` chain.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Run directory (default: VRTSPIKE_RUN_DIR, else `runs/<date>-<time>`); a run
    /// directory with checkpoints resumes from the newest.
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Device: `cpu`, `cuda` or `cuda:<n>` (default: VRTSPIKE_DEVICE, else cpu).
    #[arg(long)]
    pub device: Option<String>,
    /// Stop with a checkpoint after this many steps (the schedule still spans
    /// TRAIN.TOTAL_STEPS); resume later with the same run directory.
    #[arg(long)]
    pub stop_after_steps: Option<u64>,
}

/// Records why training failed for the launcher; an out-of-memory ends the rank here
/// with its own exit code and one line (it is the config, not a bug: no backtrace).
fn fail(env: &RankEnv, error: TrainError) -> TrainError {
    let code = failure::record(env, &error);
    if let TrainError::OutOfMemory(_) = &error {
        tracing::error!("rank {} of {}: {error}", env.rank, env.world_size);
        std::process::exit(code);
    }
    error
}

/// Runs `vrtspike train`.
pub fn run(args: TrainArgs) -> Result<()> {
    let mut config = Config::resolve(&args.config, &args.set)
        .with_context(|| format!("resolving {}", args.config.display()))?
        .config;
    let mut env = RankEnv::from_env(args.run_dir.as_deref(), args.device.as_deref())?;
    accumulation::keep_global_batch(&mut config, &|name| std::env::var(name).ok())
        .map_err(|e| fail(&env, e))?;
    if env.rank == 0 {
        println!("run directory: {}", env.run_dir.display());
    }
    let timeout = std::time::Duration::from_secs(config.dist.timeout_s);
    rendezvous::resolve(&mut env, timeout).map_err(|e| fail(&env, e))?;
    let vrtspike = std::env::current_exe().context("locating the vrtspike binary")?;
    let serve_from = ServeFrom {
        vrtspike: &vrtspike,
        config: &args.config,
        overrides: &args.set,
    };
    // Held for the whole run: local rank 0's server ends when it is dropped.
    let _node_cache =
        node_cache::start_or_attach(&mut env, &config, &serve_from).map_err(|e| fail(&env, e))?;
    record_config(&config, &env).context("recording the resolved config")?;
    let options = TrainOptions {
        stop_after_steps: args.stop_after_steps,
    };
    let outcome = train(&config, &env, &options)
        .map_err(|e| fail(&env, e))
        .with_context(|| {
            format!(
                "rank {} of {}: training {}",
                env.rank,
                env.world_size,
                args.config.display()
            )
        })?;
    if env.rank == 0 {
        println!("{}", serde_json::to_string_pretty(&outcome.summary)?);
    }
    Ok(())
}
