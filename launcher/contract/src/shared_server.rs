//! One attach-or-start for the node-shared cache server (`DATA.CACHE_SHARING: node`),
//! for the launcher and for local rank 0 of a job that no launcher started
//! (torchrun, srun). A job attaches to the server at the node-shared address; when
//! none answers it starts one ([`SharedStart::start`]) and attaches to that. The
//! server it starts is detached: its own process group and no parent-death signal,
//! so it outlives its starter while other jobs are attached, and it stops itself
//! once none has been for its linger ([`linger_s`]). Two jobs that start one at the
//! same instant race for the address: the loser exits with [`EXIT_ADDRESS_IN_USE`]
//! and its job attaches to the winner.
//!
//! How a job holds the server is the caller's (the launcher: a `vrtspike cache
//! attach` child that its gang watches; a rank: a client connection), passed in as
//! the attach to try. An attach that finds the address held by a server the job
//! cannot use ([`NotOurs`]: another user's process, another build's server, one
//! with no connection left) ends the rounds; the job then falls back to a server
//! of its own ([`NotOurs::fall_back`]: the one warning, and the [`FellBack`]
//! record its summary keeps), whoever started it.

use std::path::Path;

use crate::cache_serve::{
    self, CacheServe, Lifetime, ServeError, StartError, Started, Watch, EXIT_ADDRESS_IN_USE,
};
use crate::seconds;
use crate::summary::{CacheSharing, SharingMode};

/// How many times a job starts the node-shared server and attaches to it after
/// its first attach found none, before it gives up (each failed round is a race
/// lost to another job, or a server that stopped in between).
pub const ATTACH_ROUNDS: usize = 5;

/// Seconds a node-shared server stays after its last client left, unless told
/// otherwise (the launcher's `--cache-linger-s`, [`LINGER_ENV`] for ranks that
/// start one themselves): back-to-back jobs find the cache warm.
pub const DEFAULT_LINGER_S: f64 = 30.0;

/// The linger of a node-shared server, in seconds, when no `--cache-linger-s`
/// names one (ranks that start one themselves under torchrun or srun read only
/// this).
pub const LINGER_ENV: &str = "VRTSPIKE_CACHE_LINGER_S";

/// The linger of a node-shared server this process starts: `explicit` (the
/// launcher's `--cache-linger-s`), else [`LINGER_ENV`] read through `var`, else
/// 0 inside a SLURM allocation (a server that outlives its starter is out of
/// reach of Slurm's process tracking, so it must not stay past the allocation's
/// last job), else [`DEFAULT_LINGER_S`]. An error names the variable.
pub fn linger_s(
    explicit: Option<f64>,
    var: &dyn Fn(&str) -> Option<String>,
) -> Result<f64, String> {
    if let Some(seconds) = explicit {
        return Ok(seconds);
    }
    if let Some(text) = var(LINGER_ENV) {
        return seconds::parse_seconds(&text).map_err(|e| format!("{LINGER_ENV}: {e}"));
    }
    match var(crate::env::slurm::JOB_ID).filter(|id| !id.is_empty()) {
        Some(_) => Ok(0.0),
        None => Ok(DEFAULT_LINGER_S),
    }
}

/// What holds the node-shared address is not a server this job can use: another
/// user's process (the address squatted), another build's server, or one with no
/// connection left for the job. The job falls back to a server of its own.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the node-shared cache address {address:?} is held by a server this job cannot use{why}")]
pub struct NotOurs {
    /// The node-shared address.
    pub address: String,
    /// `:` and what the attach said (the uid, or the two protocol versions).
    pub why: String,
}

/// A job's fall-back from the node-shared server to one of its own: what its
/// run summary keeps (the launcher's `cache.sharing`, a rank's `cache_server`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FellBack {
    /// The node-shared address that was not this job's to use.
    pub from: String,
    /// What was found there (the uid, or the two protocol versions).
    pub why: String,
    /// The address of the job's own server.
    pub own: String,
}

impl NotOurs {
    /// Gives up the node-shared address for the job's own server at `own`:
    /// says so (a warning; once for each process that falls back) and returns
    /// the record.
    pub fn fall_back(self, own: &str) -> FellBack {
        tracing::warn!(
            shared = self.address,
            own,
            "{self}; this job starts a cache server of its own instead (DATA.CACHE_SHARING \
             job) and trains"
        );
        FellBack {
            why: self.why.trim_start_matches(':').trim().to_string(),
            from: self.address,
            own: own.to_string(),
        }
    }
}

impl FellBack {
    /// The summary's record of it: `{"mode": "job", "address": own,
    /// "fell_back_from": from, "why": why}`.
    pub fn sharing(&self) -> CacheSharing {
        CacheSharing {
            mode: SharingMode::Job,
            address: self.own.clone(),
            fell_back_from: Some(self.from.clone()),
            why: Some(self.why.clone()),
        }
    }
}

/// Warns when the node-shared server this job attached to serves fewer connections
/// at once (`have`, from its stats) than the job asks for (`want`,
/// `DATA.CACHE_CONNECTIONS`; `None`: auto): a running server keeps what it was
/// started with. Returns whether it warned.
pub fn warn_fewer_connections(address: &str, have: Option<u64>, want: Option<u64>) -> bool {
    let (Some(have), Some(want)) = (have, want) else {
        return false;
    };
    if have >= want {
        return false;
    }
    tracing::warn!(
        address,
        server_connections = have,
        asked_connections = want,
        "the shared cache server serves {have} connections at once, fewer than this job's \
         DATA.CACHE_CONNECTIONS ({want}): it keeps what it was started with (a loader worker \
         refused a connection reads from disk)"
    );
    true
}

/// How a job came to hold the node-shared server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Joined {
    /// It was running already.
    Attached,
    /// This job started it.
    Started,
    /// This job started one, but another job's took the address first.
    RaceLost,
}

/// How this job starts the node-shared server when none answers.
#[derive(Clone, Copy)]
pub struct SharedStart<'a> {
    /// Its command line; its lifetime is made [`Lifetime::Shared`] with the two
    /// fields below.
    pub serve: CacheServe<'a>,
    /// Seconds it stays after the last job detached ([`linger_s`]).
    pub linger_s: f64,
    /// This job, as the jobs that attach later are told (`--started-by`).
    pub started_by: &'a str,
    /// Its log, and how long it may take to accept connections.
    pub watch: Watch<'a>,
}

/// Holds this job to the node-shared server: `attach` (`None` when no server
/// answers), else start one with `start` and attach again, up to
/// [`ATTACH_ROUNDS`] times. Returns what `attach` gave and how it came.
pub fn attach_or_start<H, E: From<ServeError>>(
    start: &SharedStart,
    attach: &mut dyn FnMut() -> Result<Option<H>, E>,
) -> Result<(H, Joined), E> {
    rounds(start.serve.address, start.watch.log, attach, &mut || {
        start.start()
    })
}

/// The rounds of [`attach_or_start`], with the start passed in.
fn rounds<H, E: From<ServeError>>(
    address: &str,
    log: &Path,
    attach: &mut dyn FnMut() -> Result<Option<H>, E>,
    start: &mut dyn FnMut() -> Result<Joined, ServeError>,
) -> Result<(H, Joined), E> {
    if let Some(hold) = attach()? {
        return Ok((hold, Joined::Attached));
    }
    for _ in 0..ATTACH_ROUNDS {
        let joined = start()?;
        if let Some(hold) = attach()? {
            return Ok((hold, joined));
        }
    }
    Err(ServeError::GaveUp {
        address: address.to_string(),
        log: log.to_path_buf(),
        rounds: ATTACH_ROUNDS,
    }
    .into())
}

impl SharedStart<'_> {
    /// Starts a detached server and waits for its word: [`Joined::Started`] once
    /// it is ready, [`Joined::RaceLost`] when another one holds the address (attach
    /// to that one).
    pub fn start(&self) -> Result<Joined, ServeError> {
        let address = self.serve.address;
        let serve = CacheServe {
            lifetime: Lifetime::Shared {
                linger_s: self.linger_s,
                started_by: self.started_by,
            },
            ..self.serve
        };
        match serve.start_logged(&self.watch) {
            Ok(Started { spawned, took }) => {
                tracing::info!(
                    address,
                    pid = spawned.process.id(),
                    "started the node-shared cache server in {:.2} s (it stays while any job \
                     is attached, and {} s after the last)",
                    took.as_secs_f64(),
                    self.linger_s
                );
                cache_serve::reap_in_background(spawned.process);
                Ok(Joined::Started)
            }
            Err(ServeError::NotReady {
                source: StartError::Exited(status),
                ..
            }) if status.code() == Some(EXIT_ADDRESS_IN_USE) => {
                tracing::info!(
                    address,
                    "another job's node-shared cache server took the address first: \
                     attaching to it"
                );
                Ok(Joined::RaceLost)
            }
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::path::PathBuf;
    use std::time::Duration;

    use super::*;

    /// A fake job: its attach finds a server from the `found`-th try on (never
    /// with `usize::MAX`), and each start answers `started`.
    struct Fake {
        attaches: Cell<usize>,
        starts: Cell<usize>,
        found: usize,
        started: Joined,
    }

    impl Fake {
        fn new(found: usize, started: Joined) -> Fake {
            Fake {
                attaches: Cell::new(0),
                starts: Cell::new(0),
                found,
                started,
            }
        }

        fn run(&self) -> Result<(&'static str, Joined), ServeError> {
            let mut attach = || {
                self.attaches.set(self.attaches.get() + 1);
                Ok((self.attaches.get() >= self.found).then_some("held"))
            };
            let mut start = || {
                self.starts.set(self.starts.get() + 1);
                Ok(self.started)
            };
            rounds(
                "addr-x",
                Path::new("/runs/a/cache.log"),
                &mut attach,
                &mut start,
            )
        }

        fn counts(&self) -> (usize, usize) {
            (self.attaches.get(), self.starts.get())
        }
    }

    #[test]
    fn a_running_server_is_attached_to_without_a_start() {
        let fake = Fake::new(1, Joined::Started);
        assert_eq!(fake.run().ok(), Some(("held", Joined::Attached)));
        assert_eq!(fake.counts(), (1, 0));
    }

    #[test]
    fn no_server_is_started_then_attached_to() {
        let fake = Fake::new(2, Joined::Started);
        assert_eq!(fake.run().ok(), Some(("held", Joined::Started)));
        assert_eq!(fake.counts(), (2, 1));
    }

    #[test]
    fn a_lost_race_attaches_to_the_winner() {
        let fake = Fake::new(2, Joined::RaceLost);
        assert_eq!(fake.run().ok(), Some(("held", Joined::RaceLost)));
        assert_eq!(fake.counts(), (2, 1));
        // A server that stopped between a start and the attach: the next round.
        let fake = Fake::new(4, Joined::Started);
        assert_eq!(fake.run().ok(), Some(("held", Joined::Started)));
        assert_eq!(fake.counts(), (4, 3));
    }

    #[test]
    fn every_round_failing_names_the_address_and_the_log() {
        let fake = Fake::new(usize::MAX, Joined::RaceLost);
        let error = fake.run().err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(fake.counts(), (ATTACH_ROUNDS + 1, ATTACH_ROUNDS));
        assert!(
            error.contains("\"addr-x\"")
                && error.contains("/runs/a/cache.log")
                && error.contains(&format!("in {ATTACH_ROUNDS} tries")),
            "{error}"
        );
    }

    #[test]
    fn a_failed_attach_or_start_ends_the_rounds() {
        let mut attach = || {
            Err::<Option<()>, _>(ServeError::GaveUp {
                address: "mine".into(),
                log: PathBuf::from("l"),
                rounds: 1,
            })
        };
        let mut start = || -> Result<Joined, ServeError> { panic!("started after a failure") };
        let error = rounds("a", Path::new("l"), &mut attach, &mut start).err();
        assert!(error.is_some_and(|e| e.to_string().contains("\"mine\"")));
        let mut attach = || Ok::<Option<()>, ServeError>(None);
        let mut start = || {
            Err(ServeError::NotReady {
                address: "a".into(),
                log: PathBuf::from("l"),
                source: StartError::Interrupted,
                tail: String::new(),
            })
        };
        let error = rounds("a", Path::new("l"), &mut attach, &mut start).err();
        assert!(error.is_some_and(|e| e.to_string().contains("interrupted")));
    }

    #[test]
    fn a_fall_back_keeps_the_address_and_the_reason() {
        let not_ours = NotOurs {
            address: "vrtspike-cache-u0-abc".into(),
            why: ": runs as uid 65534".into(),
        };
        assert!(not_ours.to_string().ends_with(
            "\"vrtspike-cache-u0-abc\" is held by a server this job cannot use: runs as uid 65534"
        ));
        let fell_back = not_ours.fall_back("vrtspike-cache-job-x");
        assert_eq!(fell_back.why, "runs as uid 65534");
        assert_eq!(
            serde_json::json!(fell_back.sharing()),
            serde_json::json!({"mode": "job", "address": "vrtspike-cache-job-x",
                "fell_back_from": "vrtspike-cache-u0-abc", "why": "runs as uid 65534"})
        );
    }

    #[test]
    fn fewer_connections_than_asked_are_said_and_auto_or_more_are_not() {
        assert!(warn_fewer_connections("a", Some(512), Some(1024)));
        assert!(!warn_fewer_connections("a", Some(1024), Some(1024)));
        assert!(!warn_fewer_connections("a", Some(512), None));
        assert!(!warn_fewer_connections("a", None, Some(1024)));
    }

    #[test]
    fn the_linger_is_the_flag_then_the_variable_then_none_under_slurm() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(linger_s(None, &vars(&[])), Ok(DEFAULT_LINGER_S));
        assert_eq!(linger_s(Some(4.0), &vars(&[(LINGER_ENV, "9")])), Ok(4.0));
        assert_eq!(linger_s(None, &vars(&[(LINGER_ENV, "9")])), Ok(9.0));
        assert_eq!(linger_s(None, &vars(&[("SLURM_JOB_ID", "12")])), Ok(0.0));
        assert_eq!(
            linger_s(None, &vars(&[("SLURM_JOB_ID", "12"), (LINGER_ENV, "5")])),
            Ok(5.0)
        );
        let bad = linger_s(None, &vars(&[(LINGER_ENV, "-1")])).unwrap_err();
        assert!(bad.contains(LINGER_ENV) && bad.contains("\"-1\""), "{bad}");
        assert!(linger_s(None, &vars(&[(LINGER_ENV, "1e300")])).is_err());
    }

    /// A stand-in `vrtspike` that runs `body` (bash: it keeps fds above 9).
    fn fake_vrtspike(dir: &Path, body: &str) -> PathBuf {
        let exe = dir.join("vrtspike");
        crate::child::write_executable(&exe, &format!("#!/bin/bash\n{body}\n"))
            .unwrap_or_else(|e| panic!("{e}"));
        exe
    }

    fn start_with(exe: &Path, log: &Path) -> Result<Joined, ServeError> {
        let start = SharedStart {
            serve: CacheServe {
                vrtspike: exe,
                address: "vrtspike-test-shared",
                config: Path::new("/c.yaml"),
                cap: None,
                overrides: &[],
                lifetime: Lifetime::WithParent,
            },
            linger_s: 2.5,
            started_by: "job t",
            watch: Watch {
                log,
                timeout: Duration::from_secs(20),
                interrupted: &|| false,
            },
        };
        // A script just written may still be open for writing in a child that
        // another test thread forked meanwhile (until its exec): try again then.
        for _ in 0..100 {
            match start.start() {
                Err(ServeError::NotReady {
                    source: StartError::Io(e),
                    ..
                }) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                other => return other,
            }
        }
        start.start()
    }

    #[test]
    fn a_started_server_lingers_in_its_own_process_group() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let log = dir.path().join("logs/cache.log");
        let exe = fake_vrtspike(
            dir.path(),
            "echo \"pid $$ group $(cut -d' ' -f5 /proc/$$/stat) args $*\"\n\
             echo ready >&\"$VRTSPIKE_READY_FD\"",
        );
        assert_eq!(start_with(&exe, &log).ok(), Some(Joined::Started));
        let text = std::fs::read_to_string(&log).unwrap_or_else(|e| panic!("{e}"));
        let words: Vec<&str> = text.split_whitespace().collect();
        assert_eq!(words.get(1), words.get(3), "its own group: {text}");
        assert!(
            text.contains("--linger-s=2.5 --started-by=job t")
                && !text.contains("--exit-with-parent"),
            "{text}"
        );
    }

    #[test]
    fn a_lost_race_and_a_failed_start_are_told_apart() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let log = dir.path().join("cache.log");
        let lost = fake_vrtspike(dir.path(), &format!("exit {EXIT_ADDRESS_IN_USE}"));
        assert_eq!(start_with(&lost, &log).ok(), Some(Joined::RaceLost));
        std::fs::write(&log, "an earlier start\n").unwrap_or_else(|e| panic!("{e}"));
        let failing = fake_vrtspike(dir.path(), "echo 'bad key DATA.X' >&2; exit 2");
        let error = start_with(&failing, &log)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            error.contains("\"vrtspike-test-shared\"")
                && error.contains("exit status: 2")
                && error.ends_with("cache.log:\nbad key DATA.X"),
            "{error}"
        );
    }
}
