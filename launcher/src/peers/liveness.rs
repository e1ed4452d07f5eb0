//! Liveness between the launchers of a job: each says `BEAT <node> <host>` on each
//! of its links at a fixed interval ([`BEAT_INTERVAL`], shorter for a short
//! silence), and notes when it last heard anything on each link. A link silent
//! for the liveness timeout (`--peer-silence-s`) is a lost node: its launcher
//! names it (`node 1 (host vn2) silent for 30 s: lost`), keeps a `LOST` line (node
//! 0 passes it on, so every node ends the same way) and closes the link. A link
//! that closes is a launcher going away, told by the read side ([`super`]); a
//! silent one (its host down, its network cut, its launcher stopped) is only ever
//! found here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{PeerEvent, Shared};

/// How often a launcher says it is alive (at most).
pub const BEAT_INTERVAL: Duration = Duration::from_secs(1);

/// The interval of the beats for a liveness timeout of `silence`: at least four
/// beats fit in it.
pub fn beat_interval(silence: Duration) -> Duration {
    BEAT_INTERVAL.min(silence / 4)
}

/// When each linked node was last heard, and the host it said it runs on.
#[derive(Default)]
pub struct Heard {
    at: Mutex<HashMap<u32, Instant>>,
    hosts: Mutex<HashMap<u32, String>>,
}

impl Heard {
    /// `node` said something just now.
    pub fn now(&self, node: u32) {
        let mut at = self.at.lock().unwrap_or_else(|p| p.into_inner());
        at.insert(node, Instant::now());
    }

    /// `node` runs on `host`.
    pub fn host(&self, node: u32, host: &str) {
        let mut hosts = self.hosts.lock().unwrap_or_else(|p| p.into_inner());
        hosts.insert(node, host.to_string());
    }

    /// The host `node` said it runs on.
    pub fn host_of(&self, node: u32) -> Option<String> {
        let hosts = self.hosts.lock().unwrap_or_else(|p| p.into_inner());
        hosts.get(&node).cloned()
    }

    /// The nodes silent for longer than `silence`, with how long.
    pub fn silent(&self, silence: Duration) -> Vec<(u32, Duration)> {
        let at = self.at.lock().unwrap_or_else(|p| p.into_inner());
        let mut silent: Vec<(u32, Duration)> = at
            .iter()
            .map(|(node, at)| (*node, at.elapsed()))
            .filter(|(_, quiet)| *quiet > silence)
            .collect();
        silent.sort_unstable_by_key(|(node, _)| *node);
        silent
    }

    /// The nodes not heard since `since`.
    pub fn unheard_since(&self, since: Instant) -> Vec<u32> {
        let at = self.at.lock().unwrap_or_else(|p| p.into_inner());
        let mut unheard: Vec<u32> = at
            .iter()
            .filter(|(_, at)| **at <= since)
            .map(|(node, _)| *node)
            .collect();
        unheard.sort_unstable();
        unheard
    }

    /// Forgets `node` (its link is closed).
    fn forget(&self, node: u32) {
        let mut at = self.at.lock().unwrap_or_else(|p| p.into_inner());
        at.remove(&node);
    }
}

/// This host's name (its UTS namespace's), as the other nodes name it.
pub fn this_host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_string())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// The words for a node silent for `quiet`.
pub fn lost_cause(node: u32, host: Option<&str>, quiet: Duration) -> String {
    format!(
        "node {node} (host {}) silent for {:.0} s: lost",
        host.unwrap_or("unknown"),
        quiet.as_secs_f64()
    )
}

/// Beats on every link of `shared` from node `node_rank` and names the links
/// silent for `silence`, until the process ends.
pub(super) fn spawn(node_rank: u32, silence: Duration, shared: Arc<Shared>) -> std::io::Result<()> {
    let host = this_host();
    let interval = beat_interval(silence);
    std::thread::Builder::new()
        .name("peer-liveness".into())
        .spawn(move || loop {
            shared.send(
                &PeerEvent::Beat {
                    node: node_rank,
                    host: host.clone(),
                },
                None,
            );
            for (node, quiet) in shared.heard.silent(silence) {
                declare_lost(node_rank, node, quiet, &shared);
            }
            std::thread::sleep(interval);
        })
        .map(|_| ())
}

/// Names `node` lost, keeps (node 0: passes on) its `LOST` line and closes its
/// link. A node that came back and is not taken in yet is only dropped (logged).
fn declare_lost(node_rank: u32, node: u32, quiet: Duration, shared: &Shared) {
    shared.heard.forget(node);
    if !shared.has_left(node) {
        let cause = lost_cause(node, shared.heard.host_of(node).as_deref(), quiet);
        tracing::error!("{cause}");
        let message = PeerEvent::Lost { node, cause };
        shared.push(message.clone());
        if node_rank == 0 {
            shared.send(&message, Some(node));
        }
    } else if !shared.is_member(node) {
        tracing::warn!(
            "node {node}, back but not taken in yet, silent for {:.0} s: dropped again",
            quiet.as_secs_f64()
        );
    }
    // Closed after its LOST line is kept: its reader then finds it left.
    shared.unlink(node, None);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beats_fit_the_silence_and_the_cause_names_node_and_host() {
        assert_eq!(beat_interval(Duration::from_secs(30)), BEAT_INTERVAL);
        assert_eq!(
            beat_interval(Duration::from_secs(2)),
            Duration::from_millis(500)
        );
        assert_eq!(
            lost_cause(1, Some("vn2"), Duration::from_millis(30_400)),
            "node 1 (host vn2) silent for 30 s: lost"
        );
        let heard = Heard::default();
        heard.now(1);
        heard.now(2);
        assert!(heard.silent(Duration::from_secs(5)).is_empty());
        std::thread::sleep(Duration::from_millis(30));
        heard.now(2);
        let silent = heard.silent(Duration::from_millis(20));
        assert_eq!(silent.iter().map(|s| s.0).collect::<Vec<_>>(), [1]);
        let since = Instant::now();
        assert_eq!(heard.unheard_since(since), [1, 2]);
        heard.now(1);
        assert_eq!(heard.unheard_since(since), [2]);
        assert!(!this_host().is_empty());
    }
}
