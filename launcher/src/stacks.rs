//! Saving a hung job's stacks: for every rank, one file
//! (`stacks/attempt<K>/rank<R>.txt` in the run dir) with each thread's name,
//! state, kernel wait channel and kernel stack from `/proc/<pid>/task/*` (the
//! kernel stack usually needs root: its absence is noted), then the user-space
//! stacks of all threads from `eu-stack` or `gdb` when one is installed (the
//! launcher is the ranks' parent, so it may attach to them).

use std::fmt::Write as _;
use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vrtspike_contract::heartbeat;

/// The longest a stack tool may take on one rank.
const TOOL_LIMIT: Duration = Duration::from_secs(60);

/// A program that prints a live process's user-space stacks.
#[derive(Debug, Clone)]
enum StackTool {
    /// elfutils' `eu-stack -p PID` (fast).
    EuStack(PathBuf),
    /// `gdb -p PID -batch -ex 'thread apply all bt'`.
    Gdb(PathBuf),
}

/// Saves the stacks of `ranks` (rank, pid) of attempt `attempt` in parallel;
/// returns one line per rank: where they went, or why they could not be saved.
pub fn save_all(run_dir: &Path, attempt: u32, ranks: &[(u32, u32)]) -> Vec<String> {
    let tool = find_tool();
    std::thread::scope(|scope| {
        let jobs: Vec<_> = ranks
            .iter()
            .map(|&(rank, pid)| {
                let path = heartbeat::stacks_path(run_dir, attempt, rank);
                let tool = tool.clone();
                scope.spawn(move || match save(&path, rank, pid, tool.as_ref()) {
                    Ok(()) => format!("rank {rank}: {}", path.display()),
                    Err(e) => format!("rank {rank}: {} not written: {e}", path.display()),
                })
            })
            .collect();
        jobs.into_iter()
            .map(|job| {
                job.join()
                    .unwrap_or_else(|_| "a stack dump panicked".into())
            })
            .collect()
    })
}

/// Writes rank `rank` (process `pid`)'s stacks to `path`.
fn save(path: &Path, rank: u32, pid: u32, tool: Option<&StackTool>) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut file = File::create(path)?;
    writeln!(
        file,
        "rank {rank}, pid {pid}: threads from /proc/{pid}/task"
    )?;
    file.write_all(proc_threads(pid).as_bytes())?;
    match tool {
        None => writeln!(
            file,
            "\nno user-space stacks: neither eu-stack nor gdb is installed (install elfutils or gdb)"
        )?,
        Some(tool) => {
            writeln!(file, "\nuser-space stacks ({tool:?}):")?;
            file.flush()?;
            let note = run_tool(tool, pid, &file);
            writeln!(file, "{note}")?;
        }
    }
    Ok(())
}

/// Each thread of `pid`: id, name, state, wait channel and kernel stack.
fn proc_threads(pid: u32) -> String {
    let task_dir = PathBuf::from(format!("/proc/{pid}/task"));
    let mut tids: Vec<u32> = match std::fs::read_dir(&task_dir) {
        Ok(entries) => entries
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect(),
        Err(e) => return format!("{}: {e}\n", task_dir.display()),
    };
    tids.sort_unstable();
    let mut text = String::new();
    for tid in tids {
        let dir = task_dir.join(tid.to_string());
        let read = |name: &str| match std::fs::read_to_string(dir.join(name)) {
            Ok(content) => content.trim_end().to_string(),
            Err(e) => format!("({name} unreadable: {e})"),
        };
        let state = thread_state(&read("stat"));
        let _ = writeln!(
            text,
            "\nthread {tid} {:?} state {state} wchan {}",
            read("comm"),
            read("wchan")
        );
        let stack = read("stack");
        if !stack.is_empty() {
            let _ = writeln!(text, "{stack}");
        }
    }
    text
}

/// The state letter of a `stat` line (`S`, `R`, `D`, ...), after the `(comm)`.
fn thread_state(stat: &str) -> String {
    stat.rsplit_once(") ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .unwrap_or("?")
        .to_string()
}

/// `eu-stack`, else `gdb`, from PATH.
fn find_tool() -> Option<StackTool> {
    let path = std::env::var_os("PATH")?;
    let find = |name: &str| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    };
    find("eu-stack")
        .map(StackTool::EuStack)
        .or_else(|| find("gdb").map(StackTool::Gdb))
}

/// Runs `tool` on `pid` with its output appended to `out`; returns a note on how
/// it ended.
fn run_tool(tool: &StackTool, pid: u32, out: &File) -> String {
    let mut command = match tool {
        StackTool::EuStack(exe) => {
            let mut c = Command::new(exe);
            c.args(["-p", &pid.to_string()]);
            c
        }
        StackTool::Gdb(exe) => {
            let mut c = Command::new(exe);
            c.args(["-nx", "-batch", "-p", &pid.to_string()]).args([
                "-ex",
                "set pagination off",
                "-ex",
                "thread apply all bt",
            ]);
            c
        }
    };
    let (stdout, stderr) = match (out.try_clone(), out.try_clone()) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => return format!("(cannot pass the file to {tool:?}: {e})"),
    };
    command.stdin(Stdio::null()).stdout(stdout).stderr(stderr);
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) => return format!("({tool:?} did not start: {e})"),
    };
    let deadline = Instant::now() + TOOL_LIMIT;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return format!("({tool:?} {status})"),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return format!("({tool:?} stopped after {} s)", TOOL_LIMIT.as_secs());
            }
            Err(e) => return format!("(waiting for {tool:?}: {e})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_come_from_after_the_name() {
        assert_eq!(thread_state("123 (a b) c) S 1 2 3"), "S");
        assert_eq!(thread_state("garbage"), "?");
    }

    #[test]
    fn a_live_process_gets_its_threads_written() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut child = Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap_or_else(|e| panic!("{e}"));
        let lines = save_all(tmp.path(), 2, &[(5, child.id())]);
        let _ = child.kill();
        let _ = child.wait();
        let path = heartbeat::stacks_path(tmp.path(), 2, 5);
        assert_eq!(lines, [format!("rank 5: {}", path.display())]);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            text.contains(&format!("thread {} \"sleep\"", child.id())),
            "{text}"
        );
        assert!(text.contains("wchan"), "{text}");
        match find_tool() {
            None => assert!(text.contains("no user-space stacks"), "{text}"),
            // Both tools number the frames of each thread from #0.
            Some(tool) => assert!(
                text.contains(&format!("user-space stacks ({tool:?})")) && text.contains("#0 "),
                "{text}"
            ),
        }
    }
}
