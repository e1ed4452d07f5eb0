//! One rank's training run from start (or its last checkpoint) to `TRAIN.TOTAL_STEPS`,
//! as a loop: build the run ([`RunBuilder`]), then step and run the periodic tasks
//! that are due (log, memory, parameter check, validation, checkpoint) until the
//! run ends or is preempted. Rank 0 writes the summary (see [`super::summary`]).

use vrtspike_contract::summary::RunSummary;

use crate::config::Config;

use super::env::RankEnv;
use super::run::RunBuilder;
use super::summary;
use super::tasks;
use super::TrainError;

pub use super::summary::{RESULT_FILE, TRAIN_SUMMARY_FILE};

/// Knobs of one invocation (not of the run config).
#[derive(Debug, Clone, Default)]
pub struct TrainOptions {
    /// Stop (with a checkpoint, as on preemption) once this many steps are done,
    /// without changing the schedule, which still spans `TRAIN.TOTAL_STEPS`.
    pub stop_after_steps: Option<u64>,
}

/// How a run ended.
#[derive(Debug, Clone)]
pub struct TrainOutcome {
    /// Steps done (all attempts).
    pub steps: u64,
    /// Reached `TRAIN.TOTAL_STEPS`.
    pub completed: bool,
    /// Stopped by a preemption request or `stop_after_steps`, with a checkpoint.
    pub preempted: bool,
    /// Mean loss over ranks of each step of this attempt: (step number, loss).
    pub losses: Vec<(u64, f64)>,
    /// The summary rank 0 wrote (the same on every rank).
    pub summary: RunSummary,
}

/// Trains this rank (see the module doc). Every rank of the job must call it.
pub fn train(
    config: &Config,
    env: &RankEnv,
    options: &TrainOptions,
) -> Result<TrainOutcome, TrainError> {
    let mut run = RunBuilder::new(config, env, options).build()?;
    let mut tasks = tasks::standard(&run);
    while run.state.step < run.stop_at {
        let report = run.step()?;
        for task in tasks.iter_mut().filter(|t| t.due(&report)) {
            task.run(&mut run, &report)?;
        }
        if report.preempted {
            run.note_preempted();
            break;
        }
    }
    run.settle()?;
    run.sinks.metrics.finish();
    for task in &mut tasks {
        task.finish(&mut run)?;
    }
    let totals = summary::gather(&mut run)?;
    let summary = summary::summary(&run, &totals);
    if env.rank == 0 {
        summary::write(env, &summary)?;
    }
    Ok(TrainOutcome {
        steps: run.state.step,
        completed: run.state.step >= config.train.total_steps,
        preempted: run.attempt.preempted,
        losses: std::mem::take(&mut run.attempt.losses),
        summary,
    })
}
