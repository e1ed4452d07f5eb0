//! The global batch kept when elastic membership shrank the world: the launcher
//! sets `VRTSPIKE_ACCUMULATION` (the job's first world over this one) and the rank
//! multiplies `TRAIN.GRADIENT_ACCUMULATION_STEPS` by it before anything reads the
//! config, so each step still averages `BATCH_SIZE x accumulation x world` samples.

use vrtspike_contract::env as contract;

use super::TrainError;
use crate::config::Config;

/// Multiplies the config's gradient accumulation by the factor `var` gives
/// (unset: 1, the config unchanged); returns the factor.
pub fn keep_global_batch(
    config: &mut Config,
    var: &dyn Fn(&str) -> Option<String>,
) -> Result<u32, TrainError> {
    let factor = contract::accumulation_from(var).map_err(|e| TrainError::Env {
        var: e.var.to_string(),
        message: e.message,
    })?;
    if factor == 1 {
        return Ok(1);
    }
    let train = &mut config.train;
    let steps = train
        .gradient_accumulation_steps
        .checked_mul(factor)
        .ok_or_else(|| TrainError::Env {
            var: contract::ACCUMULATION.to_string(),
            message: format!(
                "{factor} x TRAIN.GRADIENT_ACCUMULATION_STEPS {} overflows",
                train.gradient_accumulation_steps
            ),
        })?;
    tracing::info!(
        "{}={factor}: TRAIN.GRADIENT_ACCUMULATION_STEPS {} -> {steps}, so the global batch \
         of the job's first world is kept in this smaller one",
        contract::ACCUMULATION,
        train.gradient_accumulation_steps
    );
    train.gradient_accumulation_steps = steps;
    Ok(factor)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(accumulation: u32) -> Config {
        let mut config = Config::default();
        config.train.gradient_accumulation_steps = accumulation;
        config
    }

    #[test]
    fn the_factor_multiplies_the_accumulation_and_a_bad_one_is_named() {
        let mut unset = config(3);
        assert_eq!(keep_global_batch(&mut unset, &|_| None).ok(), Some(1));
        assert_eq!(unset.train.gradient_accumulation_steps, 3);
        let two = |name: &str| (name == contract::ACCUMULATION).then(|| "2".to_string());
        let mut doubled = config(3);
        assert_eq!(keep_global_batch(&mut doubled, &two).ok(), Some(2));
        assert_eq!(doubled.train.gradient_accumulation_steps, 6);
        let zero = |name: &str| (name == contract::ACCUMULATION).then(|| "0".to_string());
        let err = keep_global_batch(&mut config(1), &zero)
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains(contract::ACCUMULATION)),
            "{err:?}"
        );
    }
}
