//! The loader workers that other jobs already run through the node's cache server,
//! read from its stats: `DATALOADER.TOTAL_WORKERS: auto` leaves the node's cores to
//! them instead of every job sizing for the whole node. A loader worker names its
//! connection `<client name>/loader-<rank>-<worker>` ([`worker_name`]).

use crate::cache::stats::StatsReport;
use crate::cache::{CacheClient, CacheError, ClientOptions};

/// How a loader worker's connection name starts, after its client name.
const WORKER_PREFIX: &str = "loader-";

/// The name of worker `worker` of rank `rank`'s loader (its thread's, and its
/// connection's after the client name).
pub fn worker_name(rank: usize, worker: usize) -> String {
    format!("{WORKER_PREFIX}{rank}-{worker}")
}

/// Whether a connection named `name` is a loader worker's.
fn is_worker(name: &str) -> bool {
    name.rsplit('/')
        .next()
        .is_some_and(|last| last.starts_with(WORKER_PREFIX))
}

/// Loader workers connected to the server of `report` for jobs other than `job`.
pub fn other_jobs_workers(report: &StatsReport, job: &str) -> usize {
    report
        .clients
        .iter()
        .filter(|c| c.job != job && is_worker(&c.name))
        .count()
}

/// [`other_jobs_workers`] of the server at `address`, asked by a connection of
/// its own (closed again) for `job`.
pub fn other_jobs_workers_at(address: &str, job: &str) -> Result<usize, CacheError> {
    let options = ClientOptions {
        job: job.to_string(),
        ..ClientOptions::from_env()?
    };
    let client = CacheClient::connect_with(address, "loader settings", &options)?;
    Ok(other_jobs_workers(&client.stats()?, job))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{spawn_server, ServerConfig};

    #[test]
    fn only_other_jobs_loader_workers_count() {
        assert!(is_worker("/runs/a/loader-0-3") && is_worker("loader-1-0"));
        assert!(!is_worker("/runs/a/read-order") && !is_worker("loader settings"));
        let address = format!("vrtspike-test-node-workers-{}", std::process::id());
        let _server = spawn_server(ServerConfig::new(address.clone(), 1 << 20)).unwrap();
        let as_job = |job: &str, name: &str| {
            let options = ClientOptions {
                job: job.to_string(),
                ..ClientOptions::default()
            };
            CacheClient::connect_with(&address, name, &options).unwrap()
        };
        let _held = [
            as_job("a", &format!("a/{}", worker_name(0, 0))),
            as_job("a", &format!("a/{}", worker_name(0, 1))),
            as_job("a", "a/read-order"),
            as_job("b", &format!("b/{}", worker_name(0, 0))),
        ];
        assert_eq!(other_jobs_workers_at(&address, "c").unwrap(), 3);
        assert_eq!(other_jobs_workers_at(&address, "a").unwrap(), 1);
        assert_eq!(other_jobs_workers_at(&address, "b").unwrap(), 2);
    }
}
