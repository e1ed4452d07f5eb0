//! Issue 26: a preemption signal that SLURM delivers to every process of a job must
//! never corrupt a rank's heap. A loop of trials, each a real 2-rank CPU job on the
//! tiny VRT-Spike (`configs/tiny/vrt_spike_tiny.yaml`, 4 micro-batches a step, so the
//! step a signal lands in still runs forward passes through SpyNet's `gemm:jit`
//! convolutions): at a random step and moment, SIGUSR2 (every third trial SIGTERM)
//! goes to every process of the job at once (launcher, cache server, ranks), then
//! again to every one of them every 250 us until the job has ended, as a job that
//! is warned more than once would get it. Every trial must end in a checkpoint at
//! the step the ranks stopped at, exit 0, summaries that say `preempted`, no glibc
//! heap abort and no process left; and while the job runs, no thread of a rank but
//! the contract's `job-signals` may have either signal unblocked.
//!
//! Before the fix the ranks ran the counting handler on whichever thread the signal
//! reached, usually the main thread inside oneDNN's GEMM, whose `rsp` points at a
//! heap workspace there: the signal frame went over the heap and glibc aborted
//! ("corrupted size vs. prev_size"). `VRTSPIKE_PREEMPT_LOOP_TRIALS` and
//! `VRTSPIKE_PREEMPT_LOOP_SEED` run a longer or another loop by hand.

mod common;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use vrtspike_contract::rundir::RunLayout;
use vrtspike_contract::summary::{RunSummary, TrainStatus};

use common::{alive, cmdline, process_tree, synth_tiny, texts, wait_until, wait_with_limit};

/// Trials of the loop in the test suite (about 7 s each on a 2-core machine).
const TRIALS: u32 = 10;
/// The loop's seed unless `VRTSPIKE_PREEMPT_LOOP_SEED` names another.
const SEED: u64 = 26;
/// Limit of one job, from its start to its end.
const LIMIT: Duration = Duration::from_secs(180);
/// Between two rounds of signals to every process.
const REPEAT_EVERY: Duration = Duration::from_micros(250);
/// The signal goes out after this many logged steps at most.
const MAX_STEPS_BEFORE: u64 = 3;
/// ... and this much later at most (a step of 4 micro-batches takes about 1.6 s).
const MAX_DELAY_MS: u64 = 1200;
/// What a glibc heap check or a crash leaves in a rank's log or the launcher's.
const CRASH_MARKS: [&str; 7] = [
    "corrupted",
    "double free",
    "free(): ",
    "malloc(): ",
    "SIGABRT",
    "SIGSEGV",
    "Aborted",
];

/// SplitMix64: the trials' steps, moments and signals, reproducible from the seed.
struct Draws(u64);

impl Draws {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `low..=high`.
    fn between(&mut self, low: u64, high: u64) -> u64 {
        low + self.next() % (high - low + 1)
    }
}

/// A number from the environment variable `name`, else `default`.
fn from_env(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(text) => text
            .parse()
            .unwrap_or_else(|e| panic!("{name}={text:?}: {e}")),
        Err(_) => default,
    }
}

/// One trial's draw.
#[derive(Debug, Clone, Copy)]
struct Trial {
    index: u64,
    signal: Signal,
    after_steps: u64,
    delay: Duration,
}

/// The tiny VRT-Spike of `configs/tiny` on `data`, 4 micro-batches a step.
fn write_config(dir: &Path, data: &Path) -> PathBuf {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny/vrt_spike_tiny.yaml");
    let model =
        std::fs::read_to_string(&tiny).unwrap_or_else(|e| panic!("{}: {e}", tiny.display()));
    let text = format!(
        "DATA:\n  ROOT: {}\n  CROP_SIZE: 32\n  VAL_CROP_SIZE: null\n  VAL_TILE: 32\n  VAL_TILE_OVERLAP: 16\n  CLIP_LEN: 2\n  SPIKE_BINS: 4\n  CACHE_SIZE_GB: 0.05\n\
         DATALOADER:\n  TOTAL_WORKERS: 2\n\
         TRAIN:\n  BATCH_SIZE: 2\n  GRADIENT_ACCUMULATION_STEPS: 4\n  TOTAL_STEPS: 400\n  LR: 1.0e-3\n  SEED: 3\n\
         {model}\n\
         LOG:\n  LOG_EVERY_STEPS: 1\n  VAL_EVERY_STEPS: 1000\n  CKPT_EVERY_STEPS: 1000\n  MEM_EVERY_STEPS: 1000\n\
         DIST:\n  TIMEOUT_S: 60\n  GRAD_SYNC: reducer\n",
        data.display()
    );
    let path = dir.join("vrt_tiny.yaml");
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    path
}

/// Training steps rank 0 has logged.
fn steps_logged(run_dir: &Path) -> usize {
    std::fs::read_to_string(RunLayout::new(run_dir).metrics())
        .map(|text| {
            text.lines()
                .filter(|l| l.contains("\"kind\":\"train\""))
                .count()
        })
        .unwrap_or(0)
}

/// A process held by a pidfd, so a signal can never reach a later process that
/// reuses its pid.
struct Target {
    fd: OwnedFd,
}

impl Target {
    fn open(pid: u32) -> Option<Target> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        let fd = i32::try_from(fd).ok().filter(|fd| *fd >= 0)?;
        // SAFETY: the descriptor was just returned to us and nothing else owns it.
        Some(Target {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Sends `signal`; false once the process is gone.
    fn signal(&self, signal: Signal) -> bool {
        // SAFETY: a pidfd we own, a valid signal number, no siginfo, no flags.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.fd.as_raw_fd(),
                signal as libc::c_int,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        rc == 0
    }
}

/// Threads of `pid` that have SIGUSR2 or SIGTERM unblocked, except the contract's
/// `job-signals` (in `sigtimedwait`, which unblocks what it waits for).
fn open_threads(pid: u32) -> Vec<String> {
    let bits = (1u64 << (libc::SIGUSR2 - 1)) | (1u64 << (libc::SIGTERM - 1));
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|task| {
            let status = std::fs::read_to_string(task.path().join("status")).ok()?;
            let field = |key: &str| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(key))
                    .map(str::trim)
            };
            let name = field("Name:")?.to_string();
            let blocked = u64::from_str_radix(field("SigBlk:")?, 16).ok()?;
            (name != "job-signals" && blocked & bits != bits)
                .then(|| format!("{name} ({})", task.file_name().to_string_lossy()))
        })
        .collect()
}

/// Signals every target at once, then again every [`REPEAT_EVERY`] until `done` or
/// every target is gone; returns the signals delivered.
fn signal_repeatedly(targets: Vec<Target>, signal: Signal, done: &AtomicBool) -> u64 {
    let mut live = targets;
    let mut sent = 0u64;
    while !live.is_empty() && !done.load(Ordering::SeqCst) {
        live.retain(|t| t.signal(signal));
        sent += live.len() as u64;
        std::thread::sleep(REPEAT_EVERY);
    }
    sent
}

/// What a trial that ended well measured.
struct Ended {
    steps: u64,
    signals: u64,
    exit_s: f64,
    processes: usize,
}

/// Runs one trial; `Err` says what went wrong, with the job's output.
fn run_trial(tmp: &Path, config: &Path, trial: Trial) -> Result<Ended, String> {
    let run_dir = tmp.join(format!("run{}", trial.index));
    let layout = RunLayout::new(&run_dir);
    let launcher = common::preemptible_two_ranks(config, &run_dir)
        .map_err(|e| format!("starting the launcher: {e}"))?;
    let pid = launcher.id();
    let started = wait_until(LIMIT, || {
        steps_logged(&run_dir) >= trial.after_steps as usize || !alive(pid)
    });
    std::thread::sleep(trial.delay);
    let mut tree = process_tree(pid);
    tree.push(pid);
    let names: Vec<String> = tree.iter().map(|p| cmdline(*p)).collect();
    let ranks: Vec<u32> = tree
        .iter()
        .zip(&names)
        .filter(|(_, n)| n.contains(" train "))
        .map(|(p, _)| *p)
        .collect();
    let open: Vec<String> = ranks.iter().flat_map(|r| open_threads(*r)).collect();
    let targets: Vec<Target> = tree.iter().filter_map(|p| Target::open(*p)).collect();
    let processes = targets.len();
    let done = Arc::new(AtomicBool::new(false));
    let asked = Instant::now();
    let sender = {
        let done = Arc::clone(&done);
        std::thread::spawn(move || signal_repeatedly(targets, trial.signal, &done))
    };
    let output = wait_with_limit(launcher, LIMIT);
    let exit_s = asked.elapsed().as_secs_f64();
    done.store(true, Ordering::SeqCst);
    let signals = sender.join().unwrap_or(0);
    let (stdout, stderr) = texts(&output);
    let logs: String = (0..2)
        .map(|r| std::fs::read_to_string(layout.rank_log(r)).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n--- rank 1 ---\n");
    let context = format!(
        "{trial:?}, {signals} signals to {names:?}\nstderr:\n{stderr}\nstdout:\n{stdout}\n--- rank 0 ---\n{logs}"
    );
    let fail = |what: String| -> Result<Ended, String> { Err(format!("{what}\n{context}")) };
    if !started {
        return fail(format!("no {} steps within {LIMIT:?}", trial.after_steps));
    }
    if ranks.len() != 2 {
        return fail(format!(
            "{} rank processes when the signal went out",
            ranks.len()
        ));
    }
    if let Some(mark) = CRASH_MARKS
        .iter()
        .find(|m| logs.contains(*m) || stderr.contains(*m))
    {
        return fail(format!("a crash: {mark:?} in the output"));
    }
    if !open.is_empty() {
        return fail(format!(
            "threads of the ranks with SIGUSR2 or SIGTERM unblocked: {open:?}"
        ));
    }
    if !output.status.success() {
        return fail(format!("the launcher exited with {}", output.status));
    }
    let summary = common::read_json(&layout.launcher_summary(0));
    if summary["exit"] != "preempted" || !summary["failure"].is_null() {
        return fail(format!("launcher summary {summary}"));
    }
    let ranks_summary = RunSummary::read(&layout.train_summary()).map_err(|e| e.to_string())?;
    if ranks_summary.status != TrainStatus::Preempted {
        return fail(format!("rank summary {ranks_summary:?}"));
    }
    let checkpoint = layout.latest_checkpoint().map(|c| c.step);
    if checkpoint != Some(ranks_summary.steps) || ranks_summary.steps < trial.after_steps {
        return fail(format!(
            "checkpoint {checkpoint:?} for {} steps done",
            ranks_summary.steps
        ));
    }
    let left = common::left_behind(&tree, &names, Duration::from_secs(10));
    if !left.is_empty() {
        return fail(format!("left behind: {left:?}"));
    }
    Ok(Ended {
        steps: ranks_summary.steps,
        signals,
        exit_s,
        processes,
    })
}

#[test]
fn preemption_signals_to_every_process_at_random_steps_never_corrupt_a_rank() {
    let trials = from_env("VRTSPIKE_PREEMPT_LOOP_TRIALS", u64::from(TRIALS));
    let seed = from_env("VRTSPIKE_PREEMPT_LOOP_SEED", SEED);
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let data = synth_tiny(tmp.path());
    let config = write_config(tmp.path(), &data);
    let mut draws = Draws(seed);
    let started = Instant::now();
    let mut failures = Vec::new();
    for index in 0..trials {
        let trial = Trial {
            index,
            signal: if index % 3 == 2 {
                Signal::SIGTERM
            } else {
                Signal::SIGUSR2
            },
            after_steps: draws.between(1, MAX_STEPS_BEFORE),
            delay: Duration::from_millis(draws.between(0, MAX_DELAY_MS)),
        };
        match run_trial(tmp.path(), &config, trial) {
            Ok(ended) => println!(
                "trial {index}: {} after {} steps + {} ms -> {} signals to {} processes, \
                 checkpoint at step {}, exit 0 in {:.2} s",
                trial.signal,
                trial.after_steps,
                trial.delay.as_millis(),
                ended.signals,
                ended.processes,
                ended.steps,
                ended.exit_s
            ),
            Err(why) => {
                let first = why.lines().next().unwrap_or_default().to_string();
                println!("trial {index}: FAILED: {first}");
                failures.push(why);
            }
        }
        let _ = std::fs::remove_dir_all(tmp.path().join(format!("run{index}")));
    }
    println!(
        "launch_preempt_loop: {} of {trials} trials failed (seed {seed}) in {:.0} s",
        failures.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "{} of {trials} trials failed; the first:\n{}",
        failures.len(),
        failures[0]
    );
}
