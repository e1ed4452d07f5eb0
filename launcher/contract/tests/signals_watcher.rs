//! A process set up like a training rank (the job's signals counted from the first
//! instruction, then settled as `Count`), with threads that compute started before
//! and after `settle`: every thread of the process blocks SIGUSR2 and SIGTERM, so
//! no handler ever runs on a computing thread (where oneDNN's GEMM may have `rsp`
//! on the heap, issue 26), and every process-directed signal is still counted, by
//! the `job-signals` thread. Its own `main` (`harness = false`): the main thread is
//! this test's, as in the binaries.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vrtspike_contract::signals::{self, Disposition};

vrtspike_contract::count_job_signals_from_the_first_instruction!();

/// How long one signal may take to be counted on a loaded machine.
const COUNT_LIMIT: Duration = Duration::from_secs(30);

/// Process-directed signals of each kind sent one after another.
const ROUNDS: u32 = 50;

fn main() {
    let stop = Arc::new(AtomicBool::new(false));
    // Like a thread a library's constructor starts before `main` settles the signals.
    let early = compute(&stop);
    signals::settle(Disposition::Count, Disposition::Count)
        .unwrap_or_else(|e| panic!("settle: {e}"));
    let late = compute(&stop);
    let threads = once_the_watcher_runs();
    // The job-signals thread waits in sigtimedwait, which unblocks what it waits for
    // while it waits (so the signal wakes it) and takes it off the queue itself:
    // no handler runs there either.
    let open: Vec<&(String, u64)> = threads
        .iter()
        .filter(|(name, blocked)| name != "job-signals" && blocked & both() != both())
        .collect();
    assert!(
        open.is_empty(),
        "threads that would run a handler: {open:?} (of {threads:?})"
    );
    assert!(
        threads.iter().any(|(name, _)| name == "job-signals"),
        "no job-signals thread in {threads:?}"
    );
    for signal in [libc::SIGUSR2, libc::SIGTERM] {
        count_each(signal);
    }
    stop.store(true, Ordering::SeqCst);
    for worker in [early, late] {
        worker
            .join()
            .unwrap_or_else(|_| panic!("a compute thread panicked"));
    }
    println!(
        "signals_watcher: {} threads all block SIGUSR2 and SIGTERM; {ROUNDS} of each counted",
        threads.len()
    );
}

/// The SigBlk bits of SIGUSR2 and SIGTERM.
fn both() -> u64 {
    let bit = |signal: libc::c_int| 1u64 << (signal - 1);
    bit(libc::SIGUSR2) | bit(libc::SIGTERM)
}

/// A thread that computes until `stop`.
fn compute(stop: &Arc<AtomicBool>) -> JoinHandle<f64> {
    let stop = Arc::clone(stop);
    std::thread::spawn(move || {
        let mut x = 1.0f64;
        while !stop.load(Ordering::Relaxed) {
            for _ in 0..10_000 {
                x = (x * 1.000_001).sin() + 1.0;
            }
        }
        x
    })
}

/// [`thread_masks`] once a thread named `job-signals` shows (or after
/// [`COUNT_LIMIT`]): `settle` returns as soon as the thread is spawned, and a thread
/// that has just been created runs with every signal blocked and its parent's name
/// until it has set up (seen under load: the watcher still unnamed).
fn once_the_watcher_runs() -> Vec<(String, u64)> {
    let asked = Instant::now();
    loop {
        let threads = thread_masks();
        if threads.iter().any(|(name, _)| name == "job-signals") || asked.elapsed() > COUNT_LIMIT {
            return threads;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Every thread of this process: its name and its blocked signals (`SigBlk`).
fn thread_masks() -> Vec<(String, u64)> {
    let tasks = std::fs::read_dir("/proc/self/task").unwrap_or_else(|e| panic!("{e}"));
    tasks
        .flatten()
        .map(|task| {
            let status = std::fs::read_to_string(task.path().join("status"))
                .unwrap_or_else(|e| panic!("{}: {e}", task.path().display()));
            let field = |key: &str| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(key))
                    .map(str::trim)
                    .unwrap_or_else(|| panic!("no {key} in {status}"))
                    .to_string()
            };
            let blocked = u64::from_str_radix(&field("SigBlk:"), 16)
                .unwrap_or_else(|e| panic!("SigBlk: {e}"));
            (field("Name:"), blocked)
        })
        .collect()
}

/// Sends `signal` to this process `ROUNDS` times, each once the previous one was
/// counted (a standard signal sent while one is pending would merge with it).
fn count_each(signal: libc::c_int) {
    let before = signals::received(signal);
    for round in 1..=ROUNDS {
        // SAFETY: kill to this process with a signal every thread blocks: it waits
        // for the job-signals thread.
        let rc = unsafe { libc::kill(libc::getpid(), signal) };
        assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
        let asked = Instant::now();
        while signals::received(signal) < before + round {
            assert!(
                asked.elapsed() < COUNT_LIMIT,
                "signal {signal} #{round} not counted within {COUNT_LIMIT:?}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(signals::received(signal), before + round, "counted twice");
    }
}
