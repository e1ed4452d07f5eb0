//! One job on this node, from its first attempt to its summary: the supervisor
//! behind `vrtspike-launch`, and here its supervision loop. What every attempt
//! shares is resolved once ([`setup`], with the node's cache server in [`cache`]);
//! each attempt's ranks run as a gang ([`attempt`]); between two attempts the job
//! restarts from the last checkpoint or ends ([`between`]); and at every exit
//! [`record`] writes `summary.json`. The binary (`main.rs`) parses the arguments
//! and hands over to [`Job`].

mod attempt;
mod between;
mod cache;
mod membership;
mod record;
mod setup;

use std::time::{Duration, Instant};

use anyhow::Result;

use crate::args::Args;
use crate::peers::PeerLinks;
use crate::rundir::RunDir;
use crate::signals;
use between::Next;
pub use record::say;
use record::{Ending, JobRecord};
use setup::Supervision;

/// A job: what the launcher knows about it, and its links to the other nodes'
/// launchers (multi-node jobs).
pub struct Job {
    record: JobRecord,
    peers: Option<PeerLinks>,
}

impl Job {
    pub fn new(run_dir: RunDir, args: &Args) -> Job {
        Job {
            record: JobRecord::new(run_dir, args),
            peers: None,
        }
    }

    /// Runs the job to its end; `Ok` is how it ended (with the reason it gave up
    /// restarting, if it did), `Err` a failure to start it at all.
    pub fn run(&mut self, args: &Args) -> Result<Ending> {
        let mut setup = setup::prepare(&mut self.record, args)?;
        if setup.topology.nnodes > 1 {
            let links = setup::connect_peers(args, &setup.topology, &self.record.run_dir)?;
            self.peers = Some(links);
        }
        let mut server = setup.cache.hold_first()?;
        let keeper = match server {
            Some(_) => setup.cache.keeper()?,
            None => None,
        };
        if let Some(peers) = self
            .peers
            .as_ref()
            .filter(|_| setup.topology.node_rank == 0)
        {
            let timeout = Duration::from_secs_f64(args.peer_timeout_s);
            peers.wait_for_nodes(timeout, &|| signals::requested_ending().is_some())?;
        }
        let ctx = Supervision {
            setup: &setup,
            args,
            peers: self.peers.as_ref(),
        };
        let mut last_failed_at: Option<Instant> = None;
        let ending = loop {
            // Between attempts the last checkpoint is already on disk.
            if let Some(ending) = between::ending_before_attempt(&mut self.record, ctx.peers) {
                break ending;
            }
            let plan = match between::next_attempt(ctx, &mut self.record)? {
                Ok(plan) => plan,
                Err(ending) => break ending,
            };
            if let Some(server) = server.as_mut() {
                setup.cache.hold_again_if_gone(server)?;
            }
            let attempt = attempt::run(
                ctx,
                plan,
                last_failed_at,
                &mut self.record,
                server.as_mut(),
                keeper.as_ref(),
            )?;
            match between::after_attempt(ctx, &mut self.record, attempt) {
                Next::End(ending) => break ending,
                Next::Restart(failed_at) => last_failed_at = failed_at,
            }
        };
        if let Some(server) = server {
            self.record.cache_stats = setup.cache.stop(server, keeper);
        }
        Ok(ending)
    }

    /// Writes the summary, reports the ending, and returns the exit status.
    pub fn finish(self, result: Result<Ending>) -> u8 {
        self.record.finish(result, self.peers.as_ref())
    }
}
