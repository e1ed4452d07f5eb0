//! Starting a node's cache server for a job, written once: the command line
//! (`vrtspike cache serve --exit-with-parent ...` with the readiness pipe's write
//! end passed down, see [`crate::ready`]) and the wait for its word. The launcher
//! starts the server this way; so does local rank 0 when no launcher did (torchrun,
//! srun), and the other local ranks of that node then wait for it to accept.
//!
//! A node-shared server (`DATA.CACHE_SHARING: node`) is started instead with
//! `--linger-s` (it outlives its starter while other jobs are attached, and exits
//! once none has been for that long), and each job holds it with
//! `vrtspike cache attach` ([`CacheAttach`]) or a connection of its own: how a
//! job attaches to it, or starts it, is [`crate::shared_server`].

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use crate::child::{self, Spawned, Tie};
use crate::ready::{self, Readiness, ReadyPipe};
use crate::signals;

/// The exit status of `cache serve` when another server holds the address.
pub const EXIT_ADDRESS_IN_USE: i32 = 73;

/// The exit status of `cache attach` when no server listens at the address.
pub const EXIT_NO_SERVER: i32 = 69;

/// The exit status of `cache attach` when what listens at the address is not a
/// server this process can use: another user's process (anyone can bind an
/// abstract name first), a server of another cache protocol version (another
/// build), or one with no connection left. Its message, on stderr, names the
/// address and the uid, the versions or the server's limit.
pub const EXIT_NOT_OURS: i32 = 74;

/// How long a server lives.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Lifetime<'a> {
    /// Until its parent stops it or dies (`--exit-with-parent`): one job's server.
    WithParent,
    /// Until no client has been connected for `linger_s` seconds (`--linger-s`),
    /// whoever started it: a node-shared server. `started_by` names the job that
    /// started it (`--started-by`, for the logs of the jobs that attach).
    Shared {
        /// Seconds it waits after the last client left.
        linger_s: f64,
        /// The job that started it.
        started_by: &'a str,
    },
}

/// What a job's cache server is started with.
#[derive(Debug, Clone, Copy)]
pub struct CacheServe<'a> {
    /// The `vrtspike` binary.
    pub vrtspike: &'a Path,
    /// Its abstract socket name.
    pub address: &'a str,
    /// The run config: its DATA.CACHE_SIZE_GB is the cap unless `cap` is given.
    pub config: &'a Path,
    /// The byte cap as text (`20G`), over the config's.
    pub cap: Option<&'a str>,
    /// The job's `--set KEY.PATH=VALUE` overrides of the config.
    pub overrides: &'a [String],
    /// One job's, or shared by the node's jobs.
    pub lifetime: Lifetime<'a>,
}

/// A job's hold on a node-shared server: `vrtspike cache attach --exit-with-parent
/// --address A --name N`, a client that says it is ready once connected and exits
/// when the server goes ([`EXIT_NO_SERVER`] when there is none at all).
#[derive(Debug, Clone, Copy)]
pub struct CacheAttach<'a> {
    /// The `vrtspike` binary.
    pub vrtspike: &'a Path,
    /// The server's abstract socket name.
    pub address: &'a str,
    /// The client's name in the server's stats (the job).
    pub name: &'a str,
    /// The job as its ranks' clients name it for the per-job figures (the run
    /// directory, `RunLayout::job_label`, in [`crate::env::RUN_DIR`]): the attach
    /// counts there too.
    pub job_label: &'a str,
}

impl CacheAttach<'_> {
    /// The attach's command line ([`CacheAttach::start_logged`] starts it).
    pub fn command(&self) -> Command {
        let mut command = Command::new(self.vrtspike);
        command
            .args(["cache", "attach", "--exit-with-parent", "--address"])
            .arg(self.address)
            .arg("--name")
            .arg(self.name)
            .env(crate::env::RUN_DIR, self.job_label);
        command
    }

    /// Starts the attach (it dies with its starter) and waits for its word, as
    /// [`CacheServe::start_logged`] does.
    pub fn start_logged(&self, watch: &Watch) -> Result<Started, ServeError> {
        start_logged(self.command(), self.address, Lifetime::WithParent, watch)
    }
}

/// Why the server did not get ready.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Its log, its readiness pipe or its process could not be made or watched.
    #[error("starting the cache server: {0}")]
    Io(#[from] std::io::Error),
    /// It exited before it was ready.
    #[error("the cache server exited before accepting connections ({0})")]
    Exited(ExitStatus),
    /// It did not say it was ready in time.
    #[error("the cache server did not say it was ready within {0:.0} s")]
    TimedOut(f64),
    /// The waiting process was asked to stop.
    #[error("interrupted while the cache server was starting")]
    Interrupted,
}

impl CacheServe<'_> {
    /// The server's command line ([`CacheServe::start_logged`] starts it).
    pub fn command(&self) -> Command {
        let mut command = Command::new(self.vrtspike);
        command.args(["cache", "serve"]);
        match self.lifetime {
            Lifetime::WithParent => {
                command.arg("--exit-with-parent");
            }
            Lifetime::Shared {
                linger_s,
                started_by,
            } => {
                command
                    .arg(format!("--linger-s={linger_s}"))
                    .arg(format!("--started-by={started_by}"));
            }
        }
        command
            .arg("--address")
            .arg(self.address)
            .arg("--config")
            .arg(self.config);
        for spec in self.overrides {
            command.arg(format!("--set={spec}"));
        }
        if let Some(cap) = self.cap {
            command.args(["--cap", cap]);
        }
        command
    }
}

/// Why a server could not be had (started, or attached to).
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// It did not get ready: it exited first (the end of its log in `tail`), it
    /// was too slow, or the wait was interrupted.
    #[error("{source} (address {address:?}); see {}{tail}", log.display())]
    NotReady {
        /// The server's address.
        address: String,
        /// Its log.
        log: PathBuf,
        /// Why.
        source: StartError,
        /// `:` and the log's last lines from this start, when it exited.
        tail: String,
    },
    /// Every round of [`crate::shared_server::attach_or_start`] lost a race, or
    /// met a server that stopped in between.
    #[error(
        "could not attach to, nor start, the node-shared cache server at {address:?} in \
         {rounds} tries; see {}",
        log.display()
    )]
    GaveUp {
        /// The server's address.
        address: String,
        /// Its log.
        log: PathBuf,
        /// The rounds tried.
        rounds: usize,
    },
}

/// Where a started child logs, and how long it is waited for.
#[derive(Clone, Copy)]
pub struct Watch<'a> {
    /// The log its output is appended to.
    pub log: &'a Path,
    /// How long it may take to say it is ready.
    pub timeout: Duration,
    /// Whether this process was asked to stop meanwhile (give up the wait).
    pub interrupted: &'a dyn Fn() -> bool,
}

/// A child that said it is ready.
#[derive(Debug)]
pub struct Started {
    /// The process and where its own lines begin in its log.
    pub spawned: Spawned,
    /// How long it took.
    pub took: Duration,
}

impl CacheServe<'_> {
    /// Starts the server in a process group of its own (a Ctrl-C of the starter's
    /// terminal does not reach it) with its output appended to `watch.log`, and
    /// waits for its word on a readiness pipe ([`crate::ready`]). It gets the job's
    /// signals blocked across `exec` (it settles them itself: it ignores them), and
    /// one job's server ([`Lifetime::WithParent`]) SIGKILL when its starter dies
    /// ([`Tie::DiesWithStarter`]); a shared one outlives its starter. A server
    /// that did not get ready is stopped and reaped; one that exited has its log's
    /// last lines in the error.
    pub fn start_logged(&self, watch: &Watch) -> Result<Started, ServeError> {
        start_logged(self.command(), self.address, self.lifetime, watch)
    }
}

/// Starts `command` as [`CacheServe::start_logged`] says.
fn start_logged(
    mut command: Command,
    address: &str,
    lifetime: Lifetime,
    watch: &Watch,
) -> Result<Started, ServeError> {
    let not_ready = |source, tail| ServeError::NotReady {
        address: address.to_string(),
        log: watch.log.to_path_buf(),
        source,
        tail,
    };
    let tie = match lifetime {
        Lifetime::WithParent => Tie::DiesWithStarter,
        Lifetime::Shared { .. } => Tie::Outlives,
    };
    let (mut spawned, mut pipe) = spawn_ready(&mut command, watch.log, tie)
        .map_err(|e| not_ready(e.into(), String::new()))?;
    match wait_ready(&mut pipe, &mut spawned.process, watch) {
        Ok(took) => Ok(Started { spawned, took }),
        Err(source @ StartError::Exited(_)) => {
            let lines = child::tail(watch.log, spawned.log_offset, child::TAIL_LINES);
            Err(not_ready(source, format!(":\n{}", lines.join("\n"))))
        }
        Err(source) => {
            let _ = spawned.process.kill();
            let _ = spawned.process.wait();
            Err(not_ready(source, String::new()))
        }
    }
}

/// Spawns `command` ([`child::spawn_logged`]) with a readiness pipe whose write
/// end it inherits, and the job's signals blocked across `exec`.
fn spawn_ready(
    command: &mut Command,
    log: &Path,
    tie: Tie,
) -> std::io::Result<(Spawned, ReadyPipe)> {
    let mut pipe = ReadyPipe::new()?;
    if let Some(fd) = pipe.child_fd() {
        command.env(ready::READY_FD, fd.to_string());
        // SAFETY: the hook runs in the forked child before exec and only calls
        // fcntl (async-signal-safe); it allocates nothing.
        unsafe {
            command.pre_exec(move || ready::inherit_in_child(fd));
        }
    }
    signals::block_across_exec(command);
    let spawned = child::spawn_logged(command, log, tie);
    pipe.close_child_end();
    Ok((spawned?, pipe))
}

/// Waits up to `watch.timeout` for the word of `process` on `pipe`, giving up
/// early once `watch.interrupted`. Returns how long it took.
fn wait_ready(
    pipe: &mut ReadyPipe,
    process: &mut Child,
    watch: &Watch,
) -> Result<Duration, StartError> {
    let started = Instant::now();
    loop {
        if (watch.interrupted)() {
            return Err(StartError::Interrupted);
        }
        let readiness = pipe.wait(Duration::from_millis(100))?;
        if readiness == Readiness::Ready {
            return Ok(started.elapsed());
        }
        if let Some(status) = process.try_wait()? {
            return Err(StartError::Exited(status));
        }
        if started.elapsed() > watch.timeout {
            return Err(StartError::TimedOut(watch.timeout.as_secs_f64()));
        }
        if readiness == Readiness::Closed {
            // It closed the pipe unready, so it is exiting: look again shortly.
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Waits for a node-shared server this process started on a thread, so it
/// leaves no zombie if it stops while this process runs (and is inherited by
/// init if it does not).
pub fn reap_in_background(mut child: std::process::Child) {
    let spawned = std::thread::Builder::new()
        .name("shared-cache-reaper".into())
        .spawn(move || child.wait());
    if let Err(e) = spawned {
        eprintln!("cannot start the shared cache server's reaper thread: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_names_the_address_config_overrides_and_cap() {
        let overrides = ["DATA.CACHE_SIZE_GB=1".to_string()];
        let spec = CacheServe {
            vrtspike: Path::new("/bin/vrtspike"),
            address: "vrtspike-cache-x",
            config: Path::new("/c.yaml"),
            cap: Some("16M"),
            overrides: &overrides,
            lifetime: Lifetime::WithParent,
        };
        assert_eq!(
            args_of(&spec.command()),
            [
                "cache",
                "serve",
                "--exit-with-parent",
                "--address",
                "vrtspike-cache-x",
                "--config",
                "/c.yaml",
                "--set=DATA.CACHE_SIZE_GB=1",
                "--cap",
                "16M"
            ]
        );
    }

    fn args_of(command: &Command) -> Vec<String> {
        command
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn a_shared_server_lingers_instead_of_ending_with_its_parent() {
        let spec = CacheServe {
            vrtspike: Path::new("/bin/vrtspike"),
            address: "vrtspike-cache-x",
            config: Path::new("/c.yaml"),
            cap: None,
            overrides: &[],
            lifetime: Lifetime::Shared {
                linger_s: 2.5,
                started_by: "job n0-42",
            },
        };
        let args = args_of(&spec.command());
        assert!(!args.iter().any(|a| a == "--exit-with-parent"), "{args:?}");
        assert!(args.iter().any(|a| a == "--linger-s=2.5"), "{args:?}");
        assert!(
            args.iter().any(|a| a == "--started-by=job n0-42"),
            "{args:?}"
        );
        let attach = CacheAttach {
            vrtspike: Path::new("/bin/vrtspike"),
            address: "vrtspike-cache-x",
            name: "job n0-42",
            job_label: "runs/a",
        };
        let command = attach.command();
        let label = command
            .get_envs()
            .find(|(k, _)| *k == crate::env::RUN_DIR)
            .and_then(|(_, v)| v.map(|v| v.to_string_lossy().into_owned()));
        assert_eq!(label.as_deref(), Some("runs/a"));
        assert_eq!(
            args_of(&command),
            [
                "cache",
                "attach",
                "--exit-with-parent",
                "--address",
                "vrtspike-cache-x",
                "--name",
                "job n0-42"
            ]
        );
    }

    #[test]
    fn a_server_that_exits_first_is_reported_with_its_log() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let log = dir.path().join("cache.log");
        let spec = CacheServe {
            vrtspike: Path::new("/bin/false"),
            address: "x",
            config: Path::new("/c.yaml"),
            cap: None,
            overrides: &[],
            lifetime: Lifetime::WithParent,
        };
        let watch = Watch {
            log: &log,
            timeout: Duration::from_secs(10),
            interrupted: &|| false,
        };
        let result = spec.start_logged(&watch);
        assert!(
            matches!(
                &result,
                Err(ServeError::NotReady {
                    source: StartError::Exited(_),
                    ..
                })
            ),
            "{result:?}"
        );
        let text = result.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            text.contains("(address \"x\")") && text.contains("cache.log:"),
            "{text}"
        );
        let interrupted = spec.start_logged(&Watch {
            interrupted: &|| true,
            ..watch
        });
        assert!(
            matches!(
                interrupted,
                Err(ServeError::NotReady {
                    source: StartError::Interrupted,
                    ..
                })
            ),
            "{interrupted:?}"
        );
    }
}
