//! A child of a job's process, as the launcher and a rank that starts the node's
//! cache server both start one: its log, opened for appending (its folder made
//! first) with the length it had, so the child's own lines are those after it,
//! and the last lines after an offset for an error report; its own process group;
//! and its tie to the process that starts it ([`Tie`]). [`spawn_logged`] does it
//! all. [`write_executable`] writes a script a process will start, so that its
//! start never fails as "Text file busy".

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// Lines of a failed process's log kept in its failure report.
pub const TAIL_LINES: usize = 20;

/// Opens `path` for appending, creating it and its folder; returns it with its
/// length before anything is appended.
pub fn open_append(path: &Path) -> io::Result<(File, u64)> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let file = OpenOptions::new().create(true).append(true).open(path)?;
    let offset = file.metadata()?.len();
    Ok((file, offset))
}

/// The last `lines` lines of a log after byte `from` (fewer if it is shorter;
/// empty if unreadable).
pub fn tail(path: &Path, from: u64, lines: usize) -> Vec<String> {
    let Ok(bytes) = std::fs::read(path) else {
        return Vec::new();
    };
    let start = usize::try_from(from).unwrap_or(usize::MAX).min(bytes.len());
    let text = String::from_utf8_lossy(&bytes[start..]);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..]
        .iter()
        .map(|l| l.to_string())
        .collect()
}

/// Whether a child ends with the process that starts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tie {
    /// It gets SIGKILL when the thread that spawned it dies (so even `kill -9` of
    /// its starter takes it down), and does not start at all when its starter
    /// died before that was set. Spawn it from a thread that lives as long as the
    /// starter: Linux sends the signal when the spawning *thread* exits.
    DiesWithStarter,
    /// It outlives its starter (a node-shared cache server).
    Outlives,
}

/// A child started by [`spawn_logged`].
#[derive(Debug)]
pub struct Spawned {
    /// The process.
    pub process: Child,
    /// The length of its log before it started: its own lines follow.
    pub log_offset: u64,
}

/// Spawns `command` in a process group of its own (a signal to the group reaches
/// everything it starts; a Ctrl-C of the starter's terminal does not reach it),
/// stdin from `/dev/null`, stdout and stderr appended to `log`, tied to its
/// starter as `tie` says.
pub fn spawn_logged(command: &mut Command, log: &Path, tie: Tie) -> io::Result<Spawned> {
    let (out, log_offset) = open_append(log)?;
    let err = out.try_clone()?;
    command
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0);
    if tie == Tie::DiesWithStarter {
        die_with_starter(command);
    }
    Ok(Spawned {
        process: command.spawn()?,
        log_offset,
    })
}

/// The pre-exec hook of [`Tie::DiesWithStarter`].
fn die_with_starter(command: &mut Command) {
    let starter = std::process::id() as i32;
    // SAFETY: the hook runs in the forked child before exec; it only makes the
    // prctl and getppid system calls, which are async-signal-safe, and allocates
    // nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() != starter {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Writes `text` to `path` as an executable script (mode 0755) through a `sh`
/// child, so that no descriptor of this process ever has the file open for
/// writing. Written from here, another thread's fork (or `posix_spawn`) between
/// the open and the close would hand its child that descriptor until the child's
/// exec, and starting the script in that window fails with ETXTBSY ("Text file
/// busy"): the processes of a test binary run many threads that start children.
pub fn write_executable(path: &Path, text: &str) -> io::Result<()> {
    let mut writer = Command::new("sh")
        .arg("-c")
        .arg("cat > \"$1\" && chmod 755 \"$1\"")
        .arg("sh")
        .arg(path)
        .stdin(Stdio::piped())
        .spawn()?;
    let sent = match writer.stdin.take() {
        Some(mut stdin) => stdin.write_all(text.as_bytes()),
        None => Err(io::Error::other("sh has no stdin")),
    };
    let status = writer.wait()?;
    sent?;
    if status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "{}: sh could not write it ({status})",
            path.display()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scripts written while other threads start children all start: with
    /// `std::fs::write` some fail with ETXTBSY.
    #[test]
    fn scripts_written_while_other_threads_spawn_all_start() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let done = AtomicBool::new(false);
        let outcomes: Vec<io::Result<Option<i32>>> = std::thread::scope(|scope| {
            for _ in 0..3 {
                scope.spawn(|| {
                    while !done.load(Ordering::SeqCst) {
                        let _ = Command::new("true").status();
                    }
                });
            }
            let outcomes = (0..150)
                .map(|i| {
                    let script = dir.path().join(format!("script-{i}"));
                    write_executable(&script, "#!/bin/sh\nexit 7\n")?;
                    Ok(Command::new(&script).status()?.code())
                })
                .collect();
            done.store(true, Ordering::SeqCst);
            outcomes
        });
        for outcome in outcomes {
            assert_eq!(outcome.unwrap_or_else(|e| panic!("{e}")), Some(7));
        }
    }

    #[test]
    fn a_script_in_a_missing_folder_is_an_error_naming_it() {
        let err = write_executable(Path::new("/nonexistent-vrtspike/x"), "")
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent-vrtspike/x"), "{err}");
    }

    #[test]
    fn a_tied_child_is_killed_when_its_spawning_thread_ends() {
        let spawner = std::thread::spawn(|| {
            let mut command = Command::new("sleep");
            command.arg("30");
            spawn_logged(&mut command, Path::new("/dev/null"), Tie::DiesWithStarter)
        });
        let mut child = spawner
            .join()
            .unwrap_or_else(|_| panic!("the spawning thread panicked"))
            .unwrap_or_else(|e| panic!("{e}"))
            .process;
        // Bounded: a child that outlived its starter would sleep 30 s.
        let started = std::time::Instant::now();
        let status = child.wait().unwrap_or_else(|e| panic!("{e}"));
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}");
        assert!(started.elapsed() < std::time::Duration::from_secs(20));
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let log = dir.path().join("t.log");
        let text: String = (0..30).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&log, text).unwrap_or_else(|e| panic!("{e}"));
        let last = tail(&log, 0, 20);
        assert_eq!(last.len(), 20);
        assert_eq!(last[0], "line 10");
        assert_eq!(last[19], "line 29");
        assert_eq!(tail(&log, 10 * 7 + 18 * 8, 20), ["line 28", "line 29"]);
        assert!(tail(&log, 1 << 40, 20).is_empty());
        assert!(tail(&dir.path().join("none"), 0, 5).is_empty());
    }

    #[test]
    fn a_log_is_opened_in_a_new_folder_at_its_end() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let log = dir.path().join("logs/cache.node0.log");
        let (_, offset) = open_append(&log).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(offset, 0);
        std::fs::write(&log, "earlier\n").unwrap_or_else(|e| panic!("{e}"));
        let (mut file, offset) = open_append(&log).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(offset, 8);
        std::io::Write::write_all(&mut file, b"mine\n").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(tail(&log, offset, TAIL_LINES), ["mine"]);
    }
}
