//! The parent's side of the HDF5 probe: [`Prober`] checks each session file in a
//! serving child before this process opens it with libhdf5 and caches the verdict
//! per file (keyed by its metadata and a CRC of its bytes). A child that dies of a
//! crash while probing a file it was fresh for has judged the file; one that had
//! probed other files first is replaced and the file probed again; one killed from
//! outside has judged nothing, and the file is probed again up to
//! [`PROBE_TRIES`] times.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use super::super::error::{DataError, Result};
use super::child::{Answer, ProbeChild};
use super::crash::{died_message, how_it_ended, is_crash, timeout_message};
use super::{ProbeMode, PROBE_TRIES};

/// The parent reuses a child only if its last request is younger than this
/// (well inside [`CHILD_IDLE`], so it never writes to one that is exiting).
const REUSE_WITHIN: Duration = Duration::from_secs(20);

/// What a probe concluded about one file (cached per process).
pub(super) type Verdict = std::result::Result<(), String>;

/// Files up to this size are fingerprinted whole; larger ones by their first and
/// last [`FINGERPRINT_SPAN`] bytes.
const FINGERPRINT_WHOLE: u64 = 8 << 20;

/// Bytes fingerprinted at each end of a large file.
const FINGERPRINT_SPAN: u64 = 1 << 20;

/// A file's identity for the verdict cache: its metadata and a CRC of its bytes
/// (file times tick only every few milliseconds, so a file rewritten in place at
/// once keeps its size and times).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct FileKey {
    path: PathBuf,
    len: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    dev: u64,
    ino: u64,
    crc: u32,
}

impl FileKey {
    fn of(path: &Path) -> Result<FileKey> {
        let meta = std::fs::metadata(path).map_err(|e| DataError::io(path, e))?;
        let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
        Ok(FileKey {
            path: path.to_path_buf(),
            len: meta.len(),
            mtime_ns: ns(meta.mtime(), meta.mtime_nsec()),
            ctime_ns: ns(meta.ctime(), meta.ctime_nsec()),
            dev: meta.dev(),
            ino: meta.ino(),
            crc: fingerprint(path, meta.len()).map_err(|e| DataError::io(path, e))?,
        })
    }
}

/// CRC-32 of the whole file when small, else of its first and last megabyte.
fn fingerprint(path: &Path, len: u64) -> std::io::Result<u32> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(path)?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = Vec::new();
    if len <= FINGERPRINT_WHOLE {
        file.read_to_end(&mut buf)?;
        hasher.update(&buf);
        return Ok(hasher.finalize());
    }
    for start in [0, len - FINGERPRINT_SPAN] {
        buf.clear();
        file.seek(SeekFrom::Start(start))?;
        (&mut file).take(FINGERPRINT_SPAN).read_to_end(&mut buf)?;
        hasher.update(&buf);
    }
    Ok(hasher.finalize())
}

/// Checks session files in child processes and remembers the verdicts.
#[derive(Debug)]
pub struct Prober {
    mode: ProbeMode,
    timeout: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    verdicts: HashMap<FileKey, Verdict>,
    child: Option<ProbeChild>,
    spawns: u32,
}

impl Prober {
    /// A prober with its own verdict cache and child.
    pub fn new(mode: ProbeMode, timeout: Duration) -> Prober {
        Prober {
            mode,
            timeout,
            state: Mutex::new(State::default()),
        }
    }

    /// How this prober checks files.
    pub fn mode(&self) -> &ProbeMode {
        &self.mode
    }

    /// How many children this prober has started.
    pub fn spawns(&self) -> u32 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).spawns
    }

    /// `Ok` when `path` may be opened with libhdf5 in this process; otherwise an
    /// error naming the file and what the probe saw. Probes each file once.
    pub fn check(&self, path: &Path) -> Result<()> {
        let exe = match &self.mode {
            ProbeMode::InProcess => return Ok(()),
            ProbeMode::Unavailable(why) => return Err(DataError::format(path, why.clone())),
            ProbeMode::Child(exe) => exe,
        };
        let key = FileKey::of(path)?;
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let verdict = match state.verdicts.get(&key) {
            Some(verdict) => verdict.clone(),
            None => {
                let verdict = state.probe(exe, self.timeout, path)?;
                state.verdicts.insert(key, verdict.clone());
                verdict
            }
        };
        verdict.map_err(|message| DataError::format(path, message))
    }
}

impl State {
    /// Probes `path` in the serving child (spawned or replaced as needed). `Err`
    /// when no child could answer at all (not cached); the verdict otherwise.
    fn probe(&mut self, exe: &Path, timeout: Duration, path: &Path) -> Result<Verdict> {
        let mut killed_from_outside = 0;
        loop {
            // A child inherited through a fork is the starter's: this process
            // starts its own.
            let mut child = match self.child.take() {
                Some(c) if c.is_ours() && c.last_used.elapsed() < REUSE_WITHIN => c,
                _ => {
                    self.spawns += 1;
                    ProbeChild::spawn(exe, timeout, path)?
                }
            };
            let fresh = child.probed == 0;
            let unjudged = match child.ask(path, timeout) {
                Answer::Verdict(verdict) => {
                    self.child = Some(child);
                    return Ok(verdict);
                }
                Answer::Died(status) if !is_crash(status) => format!(
                    "its HDF5 probe process was killed by {} from outside",
                    how_it_ended(status)
                ),
                Answer::Unjudged(why) => {
                    self.child = Some(child);
                    why
                }
                Answer::Died(_) if !fresh => {
                    tracing::debug!(file = %path.display(), "h5 probe child died; probing again in a fresh one");
                    continue;
                }
                Answer::Died(status) => return Ok(Err(died_message(status))),
                Answer::TimedOut => return Ok(Err(timeout_message(timeout))),
                Answer::Garbled(line) => {
                    return Err(DataError::format(
                        path,
                        format!("the HDF5 probe {} answered {line:?}", exe.display()),
                    ))
                }
            };
            killed_from_outside += 1;
            if killed_from_outside >= PROBE_TRIES {
                return Err(DataError::Unjudged {
                    path: path.to_path_buf(),
                    why: format!(
                        "{unjudged} in each of {PROBE_TRIES} tries (not a verdict on the file: \
                         it was not opened, and DATA.SKIP_BAD_FRAMES does not skip it)"
                    ),
                });
            }
            tracing::warn!(file = %path.display(), "{unjudged}; probing the file again");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::wire::hex;
    use super::super::{files, unavailable, ENV_EXECUTABLE, ENV_TIMEOUT, GREETING};
    use super::*;
    use std::os::unix::ffi::OsStrExt;
    use std::time::Instant;
    use vrtspike_contract::child::write_executable;

    /// A fake probe executable: a shell script that greets with `greeting`, logs
    /// each request to `requests.log`, and runs `on_request` (with `$line` set).
    fn fake_probe(dir: &Path, greeting: &str, on_request: &str) -> PathBuf {
        let exe = dir.join("fake-vrtspike");
        let log = dir.join("requests.log");
        let script = format!(
            "#!/bin/sh\necho '{greeting}'\nwhile read line; do\n  echo \"$line\" >> '{}'\n  {on_request}\ndone\n",
            log.display()
        );
        write_executable(&exe, &script).unwrap();
        exe
    }

    /// Answers every request as usable, except files named `crashes*`, on which
    /// it dies by SIGSEGV as libhdf5 does.
    const CRASHES_ON_CRASHES: &str =
        "case \"$line\" in *63726173686573*) kill -SEGV $$ ;; esac\n  echo '{\"error\":null}'";

    fn requests(dir: &Path, file: &Path) -> usize {
        let wanted = hex(file.as_os_str().as_bytes());
        std::fs::read_to_string(dir.join("requests.log"))
            .unwrap_or_default()
            .lines()
            .filter(|l| *l == wanted)
            .count()
    }

    #[test]
    fn a_crashing_child_is_a_named_error_and_later_files_still_open() {
        let dir = tempfile::tempdir().unwrap();
        let (good, bad) = files(dir.path());
        let exe = fake_probe(dir.path(), GREETING, CRASHES_ON_CRASHES);
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_secs(20));
        let err = prober.check(&bad).unwrap_err().to_string();
        assert!(
            err.contains("crashes.h5") && err.contains("SIGSEGV") && err.contains("corrupt"),
            "{err}"
        );
        prober.check(&good).unwrap();
        // A fresh child's crash is final: probed once, and the verdict is cached.
        assert!(prober.check(&bad).is_err());
        prober.check(&good).unwrap();
        assert_eq!(
            (requests(dir.path(), &bad), requests(dir.path(), &good)),
            (1, 1)
        );
    }

    #[test]
    fn a_crash_after_other_files_is_confirmed_in_a_fresh_child() {
        let dir = tempfile::tempdir().unwrap();
        let (good, bad) = files(dir.path());
        let exe = fake_probe(dir.path(), GREETING, CRASHES_ON_CRASHES);
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_secs(20));
        prober.check(&good).unwrap();
        let err = prober.check(&bad).unwrap_err().to_string();
        assert!(err.contains("SIGSEGV"), "{err}");
        assert_eq!(requests(dir.path(), &bad), 2);
        // A changed file is probed again.
        std::fs::write(&good, b"changed").unwrap();
        prober.check(&good).unwrap();
        assert_eq!(requests(dir.path(), &good), 2);
    }

    /// One line of `/proc/<pid>/status` of a process started the probe child's way:
    /// a bash script (bash keeps the mask it inherits) answering with its own line.
    #[test]
    fn the_child_starts_with_the_job_signals_blocked() {
        let dir = tempfile::tempdir().unwrap();
        let (good, _) = files(dir.path());
        let exe = dir.path().join("mask-probe");
        let script = format!(
            "#!/bin/bash\necho '{GREETING}'\nwhile read line; do\n  mask=$(grep SigBlk /proc/$$/status | tr -dc '0-9a-f' | tail -c 16)\n  echo \"{{\\\"error\\\":\\\"mask=$mask\\\"}}\"\ndone\n"
        );
        write_executable(&exe, &script).unwrap();
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_secs(20));
        let err = prober.check(&good).unwrap_err().to_string();
        let mask = err
            .rsplit("mask=")
            .next()
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
            .unwrap_or_else(|| panic!("{err}"));
        let bit = |signal: i32| 1u64 << (signal - 1);
        let job = bit(libc::SIGUSR2) | bit(libc::SIGTERM);
        assert_eq!(mask & job, job, "{err}");
    }

    /// A child killed from outside (the job's signal, the OOM killer: SIGKILL here,
    /// which no mask holds back) says nothing about the file: probed again.
    #[test]
    fn a_child_killed_from_outside_is_no_verdict_and_the_file_is_probed_again() {
        let dir = tempfile::tempdir().unwrap();
        let (good, _) = files(dir.path());
        let marker = dir.path().join("killed-once");
        let once = format!(
            "if [ ! -e '{}' ]; then touch '{}'; kill -KILL $$; fi\n  echo '{{\"error\":null}}'",
            marker.display(),
            marker.display()
        );
        let exe = fake_probe(dir.path(), GREETING, &once);
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_secs(20));
        prober.check(&good).unwrap();
        assert_eq!((requests(dir.path(), &good), prober.spawns()), (2, 2));
    }

    #[test]
    fn a_child_killed_from_outside_every_time_gives_no_verdict_and_is_never_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let (good, _) = files(dir.path());
        let exe = fake_probe(dir.path(), GREETING, "kill -KILL $$");
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_secs(20));
        let err = prober.check(&good).unwrap_err();
        assert!(!err.judges_the_data(), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("good.h5") && text.contains("SIGKILL") && text.contains("not a verdict"),
            "{text}"
        );
        let tries = PROBE_TRIES as usize;
        assert_eq!(requests(dir.path(), &good), tries);
        // Not cached: the next check probes again.
        assert!(prober.check(&good).is_err());
        assert_eq!(requests(dir.path(), &good), 2 * tries);
        // The same when the child's worker is what was killed each time.
        let dir = tempfile::tempdir().unwrap();
        let (good, _) = files(dir.path());
        let answer = r#"echo '{"error":null,"unjudged":"its probe worker was killed by SIGTERM from outside, 3 times"}'"#;
        let exe = fake_probe(dir.path(), GREETING, answer);
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_secs(20));
        let err = prober.check(&good).unwrap_err();
        assert!(matches!(err, DataError::Unjudged { .. }), "{err}");
        assert_eq!(requests(dir.path(), &good), tries);
    }

    /// A process forked from the prober's (a Python DataLoader worker) starts a
    /// probe child of its own and leaves the starter's alone, even when it drops the
    /// inherited handle: the starter goes on with its child.
    #[test]
    fn a_forked_process_probes_in_its_own_child_and_spares_the_starters() {
        let dir = tempfile::tempdir().unwrap();
        let (good, bad) = files(dir.path());
        let later = dir.path().join("later.h5");
        std::fs::write(&later, b"later").unwrap();
        let exe = fake_probe(dir.path(), GREETING, CRASHES_ON_CRASHES);
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_secs(20));
        prober.check(&good).unwrap();
        // SAFETY: the forked child only probes one file (spawning a process), drops
        // the prober and leaves with _exit; glibc's fork keeps malloc usable there.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let ours = prober.check(&bad).is_err() && prober.spawns() == 2;
            drop(prober);
            // SAFETY: ends the forked child at once, running no destructor of the
            // test harness it shares with the parent.
            unsafe { libc::_exit(if ours { 0 } else { 1 }) };
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            let mut status = 0;
            // SAFETY: waits without blocking for the child forked above.
            let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if done == pid {
                break status;
            }
            if Instant::now() > deadline {
                // SAFETY: the child forked above, stuck: killed and reaped.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, &mut status, 0);
                }
                panic!("the forked process did not finish its probe in 30 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the forked process did not probe in a child of its own (status {status:#x})"
        );
        prober.check(&later).unwrap();
        assert_eq!(prober.spawns(), 1, "the starter's child still serves it");
        assert_eq!(requests(dir.path(), &later), 1);
    }

    #[test]
    fn a_hanging_child_is_killed_and_named() {
        let dir = tempfile::tempdir().unwrap();
        let (good, _) = files(dir.path());
        let exe = fake_probe(dir.path(), GREETING, "exec sleep 60");
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_millis(500));
        let start = Instant::now();
        let err = prober.check(&good).unwrap_err().to_string();
        assert!(
            err.contains("good.h5") && err.contains("did not finish") && err.contains(ENV_TIMEOUT),
            "{err}"
        );
        assert!(start.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn the_childs_error_is_named_with_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let (good, _) = files(dir.path());
        let answer = r#"echo '{"error":"dataset '"'"'blur'"'"' is missing"}'"#;
        let exe = fake_probe(dir.path(), GREETING, answer);
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_secs(20));
        let err = prober.check(&good).unwrap_err().to_string();
        assert_eq!(
            err,
            format!("{}: dataset 'blur' is missing", good.display())
        );
    }

    #[test]
    fn a_wrong_executable_or_none_is_a_named_error() {
        let dir = tempfile::tempdir().unwrap();
        let (good, _) = files(dir.path());
        let exe = fake_probe(dir.path(), "some other tool 2.0", "echo '{\"error\":null}'");
        let prober = Prober::new(ProbeMode::Child(exe), Duration::from_secs(20));
        let err = prober.check(&good).unwrap_err().to_string();
        assert!(err.contains("good.h5") && err.contains("greeted"), "{err}");
        assert!(err.contains(ENV_EXECUTABLE), "{err}");
        let missing = Prober::new(
            ProbeMode::Child(dir.path().join("no-such-exe")),
            Duration::from_secs(20),
        );
        let err = missing.check(&good).unwrap_err().to_string();
        assert!(
            err.contains("good.h5") && err.contains("no-such-exe"),
            "{err}"
        );
        let none = Prober::new(unavailable("test"), Duration::from_secs(20));
        let err = none.check(&good).unwrap_err().to_string();
        assert!(
            err.contains("good.h5") && err.contains(ENV_EXECUTABLE),
            "{err}"
        );
    }
}
