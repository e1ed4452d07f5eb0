//! Whether a failed attempt is restarted: up to `--max-restarts`, and never into a
//! crash loop (an attempt that failed exactly like the one before it without
//! writing a new checkpoint would only fail again). A failure the rank classed as
//! deterministic (out of memory: the config does not fit) is never restarted.

use std::time::Duration;

use crate::summary::Failure;

/// The restart rules of one job.
#[derive(Debug, Clone, Copy)]
pub struct RestartPolicy {
    /// Restarts allowed in all.
    pub max_restarts: u32,
    /// Wait before each restart.
    pub delay: Duration,
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Start the gang again after this wait.
    Restart(Duration),
    /// Stop: why no restart.
    GiveUp(String),
}

/// What the policy needs to know about the failed attempt.
#[derive(Debug)]
pub struct FailedAttempt<'a> {
    /// Restarts done before it.
    pub restarts_done: u32,
    /// How it failed.
    pub failure: &'a Failure,
    /// Whether it wrote a checkpoint newer than the one it started from.
    pub made_progress: bool,
    /// How the attempt before it failed, if it did.
    pub previous_failure: Option<&'a Failure>,
}

impl RestartPolicy {
    /// Decides on one failed attempt.
    pub fn decide(&self, attempt: &FailedAttempt) -> Decision {
        if let Some(class) = attempt.failure.class.filter(|c| c.deterministic()) {
            return Decision::GiveUp(format!(
                "a rank failed with {}, which a restart of the same config would hit again: \
                 change the config as the cause says",
                class.name()
            ));
        }
        if attempt.restarts_done >= self.max_restarts {
            return Decision::GiveUp(format!(
                "no restart left ({} of --max-restarts {} used)",
                attempt.restarts_done, self.max_restarts
            ));
        }
        let same_as_before = attempt
            .previous_failure
            .is_some_and(|before| same_way(before, attempt.failure));
        if same_as_before && !attempt.made_progress {
            return Decision::GiveUp(
                "the same failure twice in a row without a new checkpoint (a crash loop)".into(),
            );
        }
        Decision::Restart(self.delay)
    }
}

/// Same process, same exit code or signal.
fn same_way(a: &Failure, b: &Failure) -> bool {
    (&a.process, a.exit_code, &a.signal) == (&b.process, b.exit_code, &b.signal)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(process: &str, code: Option<i32>) -> Failure {
        Failure {
            rank: Some(1),
            pid: 1,
            exit_code: code,
            signal: code.is_none().then(|| "SIGKILL".to_string()),
            ..Failure::of(0, process.into(), String::new())
        }
    }

    const POLICY: RestartPolicy = RestartPolicy {
        max_restarts: 3,
        delay: Duration::from_millis(5),
    };

    #[test]
    fn restarts_until_the_budget_is_spent() {
        let f = failure("rank 1", Some(3));
        let at = |restarts_done| FailedAttempt {
            restarts_done,
            failure: &f,
            made_progress: true,
            previous_failure: None,
        };
        assert_eq!(POLICY.decide(&at(0)), Decision::Restart(POLICY.delay));
        assert_eq!(POLICY.decide(&at(2)), Decision::Restart(POLICY.delay));
        assert!(
            matches!(POLICY.decide(&at(3)), Decision::GiveUp(why) if why.contains("3 of --max-restarts 3"))
        );
    }

    #[test]
    fn an_out_of_memory_is_never_restarted() {
        let mut oom = failure("rank 1", Some(12));
        oom.class = Some(vrtspike_contract::FailureClass::OutOfMemory);
        let decision = POLICY.decide(&FailedAttempt {
            restarts_done: 0,
            failure: &oom,
            made_progress: true,
            previous_failure: None,
        });
        assert!(
            matches!(&decision, Decision::GiveUp(why) if why.contains("out_of_memory")),
            "{decision:?}"
        );
        // A rank's other errors keep the usual rules.
        oom.class = Some(vrtspike_contract::FailureClass::Error);
        let decision = POLICY.decide(&FailedAttempt {
            restarts_done: 0,
            failure: &oom,
            made_progress: true,
            previous_failure: None,
        });
        assert_eq!(decision, Decision::Restart(POLICY.delay));
    }

    #[test]
    fn crash_loop_stops_restarts() {
        let first = failure("rank 1", Some(3));
        let again = failure("rank 1", Some(3));
        let other = failure("rank 0", None);
        let decide = |failure, previous_failure, made_progress| {
            POLICY.decide(&FailedAttempt {
                restarts_done: 1,
                failure,
                made_progress,
                previous_failure,
            })
        };
        assert!(
            matches!(decide(&again, Some(&first), false), Decision::GiveUp(why) if why.contains("crash loop"))
        );
        assert!(matches!(
            decide(&again, Some(&first), true),
            Decision::Restart(_)
        ));
        assert!(matches!(
            decide(&other, Some(&first), false),
            Decision::Restart(_)
        ));
    }
}
