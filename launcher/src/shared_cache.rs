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

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use nix::sys::signal::Signal;
use vrtspike_contract::cache_serve::{self, CacheAttach, CacheServe, StartError, EXIT_NO_SERVER};
use vrtspike_contract::shared_server::{self, SharedStart};

use crate::cache_server;
use crate::signals;
use crate::spawn::{self, ChildKind, Supervised};

/// How to reach, or start, the node-shared server.
pub struct SharedSpec<'a> {
    /// Its command line (the contract makes it a lingering one).
    pub serve: CacheServe<'a>,
    /// Seconds a server this job starts stays after the last job detached.
    pub linger_s: f64,
    /// The job, as the server's stats and logs name it.
    pub job: &'a str,
    /// The job as its ranks' clients name it for the per-job figures (the run
    /// directory, `RunLayout::job_label`): the attach counts there too.
    pub job_label: String,
    /// The log of the server this launcher starts, and of its attach.
    pub log: PathBuf,
    /// How long the server may take to accept connections.
    pub start_timeout: Duration,
    /// The cap this job asks for, in bytes (`--cache-size`, else the config's).
    pub wanted_cap: Option<u64>,
}

/// Attaches this job to the node-shared server, starting it first when none
/// answers. Returns the attach child: watch it, and stop it at the end.
pub fn attach_or_start(spec: &SharedSpec) -> Result<Supervised> {
    let start = SharedStart {
        serve: spec.serve,
        linger_s: spec.linger_s,
        started_by: spec.job,
        log: &spec.log,
        timeout: spec.start_timeout,
        interrupted: &|| signals::interrupts() > 0,
    };
    let (held, _) = shared_server::attach_or_start(&start, &mut || attach(spec))?;
    Ok(held)
}

/// Runs `vrtspike cache attach`; `None` when no server listens at the address.
fn attach(spec: &SharedSpec) -> Result<Option<Supervised>> {
    let address = spec.serve.address;
    let (mut command, mut pipe) = CacheAttach {
        vrtspike: spec.serve.vrtspike,
        address,
        name: spec.job,
    }
    .command()
    .context("creating the cache attach's readiness pipe")?;
    command.env(vrtspike_contract::env::RUN_DIR, &spec.job_label);
    let spawned = spawn::spawn(
        "cache attach".into(),
        &mut command,
        &spec.log,
        ChildKind::Other,
    );
    pipe.close_child_end();
    let mut held = spawned
        .context("starting vrtspike cache attach")?
        .with_stop_signal(Signal::SIGINT);
    let waited =
        cache_serve::wait_ready(&mut pipe, spec.start_timeout, &mut || held.poll(), &|| {
            signals::interrupts() > 0
        });
    match waited {
        Ok(_) => {
            report_attached(spec, held.pid());
            Ok(Some(held))
        }
        Err(StartError::Exited(status)) if status.code() == Some(EXIT_NO_SERVER) => Ok(None),
        // The server stopped between the connect and the first answer: try again.
        Err(StartError::Exited(status)) => {
            tracing::warn!(
                address,
                "cache attach {}; trying again",
                spawn::describe(status)
            );
            Ok(None)
        }
        Err(e) => {
            spawn::stop_all(&mut [&mut held], Duration::from_secs(1));
            bail!("{e} (attaching to {address:?}); see {}", spec.log.display())
        }
    }
}

/// Logs which server this job attached to, who started it, and a cap that is
/// not the one this job asked for.
fn report_attached(spec: &SharedSpec, attach_pid: u32) {
    let address = spec.serve.address;
    let stats = cache_server::stats(spec.serve.vrtspike, address);
    let pid = stats
        .as_ref()
        .and_then(|s| s["server_pid"].as_u64())
        .unwrap_or(0);
    let cap = stats.as_ref().and_then(|s| s["cap_bytes"].as_u64());
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
