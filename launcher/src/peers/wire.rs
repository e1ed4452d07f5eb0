//! The lines the launchers of a job say to each other once linked (after the
//! handshake of [`super::auth`]):
//!
//! - `START <attempt> <port>`: node 0 starts attempt `attempt` (the restart count)
//!   with rank 0's rendezvous store on `port`; the other nodes start only then.
//! - `FAIL <attempt> <node> <cause>`: that attempt failed on that node: stop it.
//! - `HUNG <attempt> <node> <cause>`: the same, because a rank was found stopped
//!   or hung: every node saves its ranks' stacks before stopping them.
//! - `QUIT <node> <cause>`: that node left the job for good: give up.
//! - `DONE <node> <how>`: that node ended normally, `completed` or `preempted`.
//! - `BEAT <node> <host>`: that node's launcher is alive (every launcher says it on
//!   each of its links at a fixed interval; node 0 does not pass it on): a link
//!   silent for `--peer-silence-s` is a lost node (see [`super::liveness`]).
//! - `LOST <node> <cause>`: node 0 found that node silent for too long: it is lost
//!   (the other nodes end as node 0 does, or under `--min-nodes` wait for its
//!   word on the membership).
//! - `MEMBERS <attempt> <n>,<n>,...`: node 0's membership from attempt `attempt` on
//!   (elastic, `--min-nodes`): the nodes that take part, by their first index, in
//!   their new order (a node's new index is its place in the list); said before
//!   that attempt's `START`.
//! - `RESTART <attempt>`: node 0 ends attempt `attempt` at a restart point to take
//!   a returning node in (elastic): every node asks its ranks to finish the step
//!   under way, checkpoint and exit, as on preemption; node 0 then says the next
//!   attempt's `MEMBERS` and `START`.
//! - `VIEW <attempt> <rank> <pid> <step> <phase> <entered> <completed> <op>
//!   <buckets> <still_ms> <silent_ms>`: how a rank stands, as the launcher of its
//!   node sees it from its own ticks (`-` for what it does not know yet); each
//!   launcher sends its ranks' about once a second, node 0 passes them on, and a
//!   launcher compares its own ranks with the others' by them (see `crate::hang`):
//!   nothing judges another node's rank from files of a shared run dir.

use vrtspike_contract::heartbeat::{CollectiveOp, Collectives, Phase, Progress};

use crate::relay::RankReport;
use crate::summary::ExitKind;

/// One line of the protocol, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Node 0 starts an attempt.
    Start {
        /// The attempt (restart count).
        attempt: u32,
        /// Rank 0's rendezvous port for it.
        port: u16,
    },
    /// An attempt failed on a node.
    Fail {
        /// The attempt.
        attempt: u32,
        /// Where.
        node: u32,
        /// A stopped or hung rank (every node saves its stacks).
        hung: bool,
        /// Why.
        cause: String,
    },
    /// A node left the job for good.
    Quit {
        /// The node.
        node: u32,
        /// Why.
        cause: String,
    },
    /// A node ended normally.
    Done {
        /// The node.
        node: u32,
        /// Completed, or checkpointed on a preemption.
        how: NormalEnd,
    },
    /// A node's launcher is alive.
    Beat {
        /// The node.
        node: u32,
        /// Its host name.
        host: String,
    },
    /// A node silent for too long: lost.
    Lost {
        /// The node.
        node: u32,
        /// `node 1 (host vn2) silent for 30 s: lost`.
        cause: String,
    },
    /// Node 0's membership from an attempt on (elastic membership).
    Members {
        /// The first attempt with it.
        attempt: u32,
        /// The nodes taking part, by their first index, in their new order.
        members: Vec<u32>,
    },
    /// Node 0 ends an attempt at a restart point (a returning node is taken in).
    Restart {
        /// The attempt that ends.
        attempt: u32,
    },
    /// How a rank stands, from its node's launcher.
    View(RankReport),
}

/// How a node ended normally (its launcher's exit status 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormalEnd {
    /// Every rank finished the job.
    Completed,
    /// The ranks checkpointed and exited on a preemption request.
    Preempted,
}

impl NormalEnd {
    /// Its word on the wire.
    pub fn name(self) -> &'static str {
        match self {
            NormalEnd::Completed => "completed",
            NormalEnd::Preempted => "preempted",
        }
    }

    /// The normal end of a launcher that ends as `kind` (`None`: not a normal one).
    pub fn of(kind: ExitKind) -> Option<NormalEnd> {
        match kind {
            ExitKind::Completed => Some(NormalEnd::Completed),
            ExitKind::Preempted => Some(NormalEnd::Preempted),
            _ => None,
        }
    }

    /// The ending of a launcher that ends as this node did.
    pub fn exit_kind(self) -> ExitKind {
        match self {
            NormalEnd::Completed => ExitKind::Completed,
            NormalEnd::Preempted => ExitKind::Preempted,
        }
    }

    fn parse(word: &str) -> Option<NormalEnd> {
        match word {
            "completed" => Some(NormalEnd::Completed),
            "preempted" => Some(NormalEnd::Preempted),
            _ => None,
        }
    }
}

impl Message {
    /// Parses one line; `None` for anything else.
    pub fn parse(line: &str) -> Option<Message> {
        let (kind, rest) = line.trim_end().split_once(' ')?;
        let mut fields = rest.splitn(3, ' ');
        let mut number = || fields.next()?.parse::<u32>().ok();
        match kind {
            "START" => {
                let attempt = number()?;
                let port = u16::try_from(number()?).ok()?;
                Some(Message::Start { attempt, port })
            }
            "FAIL" | "HUNG" => {
                let (attempt, node) = (number()?, number()?);
                Some(Message::Fail {
                    attempt,
                    node,
                    hung: kind == "HUNG",
                    cause: fields.next().unwrap_or("").to_string(),
                })
            }
            "QUIT" | "LOST" => {
                let (node, cause) = rest.split_once(' ').unwrap_or((rest, ""));
                let (node, cause) = (node.parse().ok()?, cause.to_string());
                Some(match kind {
                    "QUIT" => Message::Quit { node, cause },
                    _ => Message::Lost { node, cause },
                })
            }
            "BEAT" => {
                let (node, host) = rest.trim_end().split_once(' ')?;
                Some(Message::Beat {
                    node: node.parse().ok()?,
                    host: host.to_string(),
                })
            }
            "RESTART" => Some(Message::Restart {
                attempt: rest.trim().parse().ok()?,
            }),
            "DONE" => {
                let (node, how) = rest.trim_end().split_once(' ')?;
                Some(Message::Done {
                    node: node.parse().ok()?,
                    how: NormalEnd::parse(how)?,
                })
            }
            "VIEW" => parse_view(rest.trim_end()).map(Message::View),
            "MEMBERS" => {
                let (attempt, list) = rest.trim_end().split_once(' ')?;
                let members = list
                    .split(',')
                    .map(|n| n.parse().ok())
                    .collect::<Option<Vec<u32>>>()?;
                Some(Message::Members {
                    attempt: attempt.parse().ok()?,
                    members,
                })
            }
            _ => None,
        }
    }

    /// The line, newline included (a cause is kept on one line).
    pub fn line(&self) -> String {
        let flat = |cause: &str| cause.replace(['\n', '\r'], " ");
        match self {
            Message::Start { attempt, port } => format!("START {attempt} {port}\n"),
            Message::Fail {
                attempt,
                node,
                hung,
                cause,
            } => format!(
                "{} {attempt} {node} {}\n",
                if *hung { "HUNG" } else { "FAIL" },
                flat(cause)
            ),
            Message::Quit { node, cause } => format!("QUIT {node} {}\n", flat(cause)),
            Message::Done { node, how } => format!("DONE {node} {}\n", how.name()),
            Message::Restart { attempt } => format!("RESTART {attempt}\n"),
            Message::Beat { node, host } => format!("BEAT {node} {}\n", flat(host)),
            Message::Lost { node, cause } => format!("LOST {node} {}\n", flat(cause)),
            Message::Members { attempt, members } => {
                let list: Vec<String> = members.iter().map(u32::to_string).collect();
                format!("MEMBERS {attempt} {}\n", list.join(","))
            }
            Message::View(report) => format!("VIEW {}\n", view_fields(report)),
        }
    }
}

/// The fields of a `VIEW` line.
fn view_fields(report: &RankReport) -> String {
    let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let c = &report.collectives;
    format!(
        "{} {} {} {} {} {} {} {} {} {} {}",
        report.attempt,
        report.rank,
        or_dash(report.pid.map(|p| p.to_string())),
        or_dash(report.progress.map(|p| p.step.to_string())),
        or_dash(report.progress.map(|p| p.phase.name().to_string())),
        c.entered,
        c.completed,
        c.last.map_or("-", CollectiveOp::name),
        c.buckets,
        report.still_ms,
        or_dash(report.silent_ms.map(|s| s.to_string())),
    )
}

/// A `VIEW` line's fields; `None` if they are not one.
fn parse_view(rest: &str) -> Option<RankReport> {
    let f: Vec<&str> = rest.split(' ').collect();
    let [attempt, rank, pid, step, phase, entered, completed, op, buckets, still, silent] = f[..]
    else {
        return None;
    };
    fn maybe(text: &str) -> Option<&str> {
        (text != "-").then_some(text)
    }
    let progress = match (maybe(step), maybe(phase)) {
        (Some(step), Some(phase)) => Some(Progress {
            step: step.parse().ok()?,
            phase: Phase::parse(phase)?,
        }),
        (None, None) => None,
        _ => return None,
    };
    let last = match maybe(op) {
        Some(name) => Some(CollectiveOp::parse(name)?),
        None => None,
    };
    Some(RankReport {
        attempt: attempt.parse().ok()?,
        rank: rank.parse().ok()?,
        pid: maybe(pid).map(str::parse::<u32>).transpose().ok()?,
        progress,
        collectives: Collectives {
            entered: entered.parse().ok()?,
            completed: completed.parse().ok()?,
            last,
            buckets: buckets.parse().ok()?,
        },
        still_ms: still.parse().ok()?,
        silent_ms: maybe(silent).map(str::parse::<u64>).transpose().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        for message in [
            Message::Start {
                attempt: 3,
                port: 41234,
            },
            Message::Fail {
                attempt: 2,
                node: 1,
                hung: false,
                cause: "rank 3 (pid 9) exited with code 3".into(),
            },
            Message::Fail {
                attempt: 0,
                node: 1,
                hung: true,
                cause: "stopped: rank 1 (node 1) in phase forward at step 5".into(),
            },
            Message::Quit {
                node: 0,
                cause: "no restart left".into(),
            },
            Message::Done {
                node: 4,
                how: NormalEnd::Completed,
            },
            Message::Done {
                node: 0,
                how: NormalEnd::Preempted,
            },
            Message::Beat {
                node: 2,
                host: "vn3".into(),
            },
            Message::Lost {
                node: 1,
                cause: "node 1 (host vn2) silent for 30 s: lost".into(),
            },
            Message::Members {
                attempt: 2,
                members: vec![0, 2, 3],
            },
            Message::Restart { attempt: 4 },
            Message::View(RankReport {
                attempt: 1,
                rank: 3,
                pid: Some(4242),
                progress: Some(Progress {
                    step: 7,
                    phase: Phase::Backward,
                }),
                collectives: Collectives {
                    entered: 30,
                    completed: 29,
                    last: Some(CollectiveOp::AllReduce),
                    buckets: 2,
                },
                still_ms: 1500,
                silent_ms: Some(250),
            }),
            Message::View(RankReport {
                attempt: 0,
                rank: 2,
                pid: None,
                progress: None,
                collectives: Collectives::default(),
                still_ms: 0,
                silent_ms: None,
            }),
        ] {
            assert_eq!(Message::parse(&message.line()), Some(message.clone()));
        }
        assert_eq!(Message::parse("NOPE 1"), None);
        assert_eq!(Message::parse("FAIL x 1 y"), None);
        assert_eq!(Message::parse("START 1 70000"), None);
        assert_eq!(Message::parse("BEAT 1"), None, "a beat names its host");
        assert_eq!(Message::parse("DONE 1"), None, "an end says how it ended");
        assert_eq!(Message::parse("DONE 1 failed"), None, "a failure is QUIT");
        assert_eq!(
            Message::parse("VIEW 0 1 - 3 - 0 0 - 0 0 -"),
            None,
            "a step without phase"
        );
        assert_eq!(
            Message::parse("VIEW 0 1 - - - 0 0 - 0 0"),
            None,
            "a field short"
        );
        let multi = Message::Quit {
            node: 1,
            cause: "a\nb".into(),
        };
        assert_eq!(multi.line(), "QUIT 1 a b\n");
    }
}
