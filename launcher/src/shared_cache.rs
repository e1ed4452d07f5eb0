//! The node-shared cache server (`DATA.CACHE_SHARING: node`): one per user, node
//! and dataset, at an address made of the uid and the dataset's signature
//! (`vrtspike_contract::dataset_sig`). A job holds it with a `vrtspike cache attach`
//! child (its parent-death signal ends it with the launcher, even after `kill -9`),
//! which is what the gang watches instead of the server: if the server goes, the
//! attach ends and the attempt fails like on a dead server of the job's own.
//!
//! The rounds of attach and start, the detached start and the race for the address
//! are the contract's (`vrtspike_contract::shared_server`, which ranks under
//! torchrun or srun use too); this is the launcher's attach, and its report of the
//! server it attached to.

use anyhow::Result;
use nix::sys::signal::Signal;
use vrtspike_contract::cache_serve::{
    CacheAttach, ServeError, StartError, EXIT_NOT_OURS, EXIT_NO_SERVER,
};
pub use vrtspike_contract::shared_server::NotOurs;
use vrtspike_contract::shared_server::{self, SharedStart};

use crate::cache_server;
use crate::spawn::{self, Supervised};

/// How to reach, or start, the node-shared server.
pub struct SharedSpec<'a> {
    /// How a server is started when none answers (its log and start timeout are
    /// the attach's too).
    pub start: SharedStart<'a>,
    /// The job as its ranks' clients name it for the per-job figures.
    pub job_label: &'a str,
    /// The cap this job asks for, in bytes (`--cache-size`, else the config's).
    pub wanted_cap: Option<u64>,
    /// The connections this job asks for (`DATA.CACHE_CONNECTIONS`; `None`: auto).
    pub wanted_connections: Option<u64>,
}

/// Attaches this job to the node-shared server, starting it first when none
/// answers. Returns the attach child: watch it, and stop it at the end.
pub fn attach_or_start(spec: &SharedSpec) -> Result<Supervised> {
    let (held, _) = shared_server::attach_or_start(&spec.start, &mut || attach(spec))?;
    Ok(held)
}

/// Runs `vrtspike cache attach`; `None` when no server listens at the address,
/// [`NotOurs`] when the one there is not this job's to use.
fn attach(spec: &SharedSpec) -> Result<Option<Supervised>> {
    let serve = &spec.start.serve;
    let attach = CacheAttach {
        vrtspike: serve.vrtspike,
        address: serve.address,
        name: spec.start.started_by,
        job_label: spec.job_label,
    };
    match attach.start_logged(&spec.start.watch) {
        Ok(started) => {
            let log = spec.start.watch.log;
            let held = Supervised::adopt("cache attach".into(), started.spawned, log)
                .with_stop_signal(Signal::SIGINT);
            report_attached(spec, held.pid());
            Ok(Some(held))
        }
        Err(ServeError::NotReady {
            source: StartError::Exited(status),
            tail,
            ..
        }) if status.code() == Some(EXIT_NOT_OURS) => Err(NotOurs {
            address: serve.address.to_string(),
            why: tail,
        }
        .into()),
        Err(ServeError::NotReady {
            source: StartError::Exited(status),
            ..
        }) => {
            // None there; or the server stopped between the connect and the
            // first answer: try again.
            if status.code() != Some(EXIT_NO_SERVER) {
                let how = spawn::describe(status);
                tracing::warn!(address = serve.address, "cache attach {how}; trying again");
            }
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

/// Logs which server this job attached to, who started it, and a cap that is
/// not the one this job asked for.
fn report_attached(spec: &SharedSpec, attach_pid: u32) {
    let address = spec.start.serve.address;
    let stats = cache_server::stats(spec.start.serve.vrtspike, address);
    let pid = stats
        .as_ref()
        .and_then(|s| s["server_pid"].as_u64())
        .unwrap_or(0);
    let cap = stats.as_ref().and_then(|s| s["cap_bytes"].as_u64());
    let connections = stats.as_ref().and_then(|s| s["connections"].as_u64());
    let starter = started_by(pid).unwrap_or_else(|| "unknown".into());
    tracing::info!(
        address,
        server_pid = pid,
        started_by = %starter,
        attach_pid,
        "attached to the node-shared cache server"
    );
    if let (Some(have), Some(want)) = (cap, spec.wanted_cap) {
        if have != want {
            tracing::info!(
                address,
                server_cap = have,
                asked_cap = want,
                "the shared cache server keeps the cap it was started with ({have} bytes); \
                 this job asked for {want} bytes"
            );
        }
    }
    shared_server::warn_fewer_connections(address, connections, spec.wanted_connections);
}

/// The `--started-by` of the server process `pid`, from its command line.
fn started_by(pid: u64) -> Option<String> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    cmdline
        .split(|&b| b == 0)
        .filter_map(|arg| std::str::from_utf8(arg).ok())
        .find_map(|arg| arg.strip_prefix("--started-by="))
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_starter_is_read_from_the_servers_command_line() {
        // A compound command: the shell stays (does not exec sleep), with its args.
        let mut child = std::process::Command::new("sh")
            .args([
                "-c",
                "sleep 30; :",
                "sh",
                "--started-by=job /runs/a (launcher pid 7)",
            ])
            .spawn()
            .unwrap_or_else(|e| panic!("{e}"));
        // Its command line is read once the exec is visible in /proc.
        let pid = u64::from(child.id());
        let mut found = None;
        for _ in 0..500 {
            found = started_by(pid);
            if found.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(found.as_deref(), Some("job /runs/a (launcher pid 7)"));
        assert_eq!(started_by(0), None);
    }
}
