//! Holding the node-shared cache server again after it went away, off the
//! supervision loop: one thread of the job (the keeper) attaches again, or starts
//! a server, when asked, and on failure waits and tries again with a growing pause
//! until it holds one or the attempt ends. Meanwhile the gang goes on handling
//! rank failures, hangs and signals, and the ranks read from disk (their loaders
//! fall back, then connect to the new server): a server that stays gone never
//! ends the job. The keeper lives as long as the job, since the attach it starts
//! gets its parent-death signal from the thread that started it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::spawn::Supervised;

/// Attaches again (or starts a server), giving up early once the check it is
/// passed says so.
pub type Hold = dyn Fn(&dyn Fn() -> bool) -> Result<Supervised> + Send;

/// The pause after the first failed try; it doubles up to [`LONGEST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_secs(2);

/// The longest pause between two tries.
const LONGEST_PAUSE: Duration = Duration::from_secs(30);

/// How often a pause looks whether it must give up.
const TICK: Duration = Duration::from_millis(50);

/// The job's keeper thread and what it shares with the gang.
pub struct Keeper {
    asks: Option<Sender<()>>,
    held: Receiver<Supervised>,
    flags: Arc<Flags>,
    thread: Option<JoinHandle<()>>,
}

/// What the gang and the keeper thread both see.
#[derive(Default)]
struct Flags {
    /// A re-attach is under way.
    busy: AtomicBool,
    /// The current re-attach must give up (the attempt, or the job, is ending).
    give_up: AtomicBool,
}

impl Keeper {
    /// Starts the keeper thread, which runs `hold` when asked.
    pub fn start(hold: Box<Hold>) -> std::io::Result<Keeper> {
        let (asks, asked) = mpsc::channel::<()>();
        let (gave, held) = mpsc::channel();
        let flags = Arc::new(Flags::default());
        let shared = Arc::clone(&flags);
        let thread = std::thread::Builder::new()
            .name("cache-keeper".into())
            .spawn(move || {
                for () in asked.iter() {
                    if let Some(process) = try_until_held(&*hold, &shared.give_up) {
                        // The receiver lives as long as the keeper.
                        let _ = gave.send(process);
                    }
                    shared.busy.store(false, Ordering::SeqCst);
                }
            })?;
        Ok(Keeper {
            asks: Some(asks),
            held,
            flags,
            thread: Some(thread),
        })
    }

    /// Asks for the server to be held again, unless that is under way.
    pub fn ask(&self) {
        self.flags.give_up.store(false, Ordering::SeqCst);
        if self.flags.busy.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some(asks) = &self.asks {
            if asks.send(()).is_err() {
                self.flags.busy.store(false, Ordering::SeqCst);
            }
        }
    }

    /// Whether a re-attach is under way.
    pub fn busy(&self) -> bool {
        self.flags.busy.load(Ordering::SeqCst)
    }

    /// The new hold, once the keeper has one.
    pub fn take(&self) -> Option<Supervised> {
        self.held.try_recv().ok()
    }

    /// The attempt ends: the re-attach under way gives up (this does not wait).
    pub fn give_up(&self) {
        self.flags.give_up.store(true, Ordering::SeqCst);
    }

    /// The job ends: stops the keeper thread and returns the hold it got last,
    /// if the gang did not take it.
    pub fn finish(mut self) -> Option<Supervised> {
        self.stop_thread();
        self.take()
    }

    fn stop_thread(&mut self) {
        self.give_up();
        self.asks = None;
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("the cache keeper thread panicked");
            }
        }
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.stop_thread();
    }
}

/// Tries `hold` until it holds a server (`Some`) or `give_up` is set (`None`).
fn try_until_held(hold: &Hold, give_up: &AtomicBool) -> Option<Supervised> {
    let giving_up = || give_up.load(Ordering::SeqCst);
    let mut pause = FIRST_PAUSE;
    let started = Instant::now();
    let mut tries = 0u32;
    while !giving_up() {
        tries += 1;
        match hold(&giving_up) {
            Ok(process) => {
                tracing::info!(
                    "holding the node-shared cache server again after {:.1} s ({tries} \
                     tries)",
                    started.elapsed().as_secs_f64()
                );
                return Some(process);
            }
            Err(_) if giving_up() => return None,
            Err(e) => {
                tracing::warn!(
                    "attaching to the node-shared cache server again failed ({e:#}): the \
                     ranks read from disk; trying again in {} s",
                    pause.as_secs()
                );
                let until = Instant::now() + pause;
                while Instant::now() < until && !giving_up() {
                    std::thread::sleep(TICK);
                }
                pause = (pause * 2).min(LONGEST_PAUSE);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;
    use crate::spawn::{spawn, stop_all, ChildKind};

    fn sleeper(dir: &std::path::Path) -> Result<Supervised> {
        let mut command = std::process::Command::new("sleep");
        command.arg("60");
        spawn(
            "cache attach".into(),
            &mut command,
            &dir.join("sleep.log"),
            ChildKind::Other,
        )
        .map_err(anyhow::Error::from)
    }

    /// Polls `condition` until it holds, at most `limit`.
    fn wait_until(limit: Duration, condition: impl Fn() -> bool) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if condition() {
                return true;
            }
            std::thread::sleep(TICK);
        }
        condition()
    }

    /// Polls `keeper` for its hold, at most a minute.
    fn held(keeper: &Keeper) -> Option<Supervised> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Some(process) = keeper.take() {
                return Some(process);
            }
            std::thread::sleep(TICK);
        }
        None
    }

    #[test]
    fn a_failed_try_is_tried_again_until_a_server_is_held() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().to_path_buf();
        let tries = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&tries);
        let keeper = Keeper::start(Box::new(move |_: &dyn Fn() -> bool| {
            match counted.fetch_add(1, Ordering::SeqCst) {
                0 => anyhow::bail!("no server"),
                _ => sleeper(&path),
            }
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        keeper.ask();
        assert!(keeper.busy());
        let mut process = held(&keeper).unwrap_or_else(|| panic!("never held"));
        // Started by the keeper thread, it lives on after the re-attach (its
        // parent-death signal is the thread's).
        assert!(process.running());
        assert_eq!(tries.load(Ordering::SeqCst), 2);
        let idle = wait_until(Duration::from_secs(60), || !keeper.busy());
        assert!(idle);
        assert!(process.running());
        assert!(keeper.finish().is_none());
        stop_all(&mut [&mut process], Duration::from_secs(1));
    }

    #[test]
    fn giving_up_ends_a_try_that_would_never_end_and_the_next_ask_tries_again() {
        let tries = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&tries);
        // Each try blocks, as a server that never becomes ready would, until told
        // to give up.
        let keeper = Keeper::start(Box::new(move |giving_up: &dyn Fn() -> bool| {
            counted.fetch_add(1, Ordering::SeqCst);
            while !giving_up() {
                std::thread::sleep(Duration::from_millis(5));
            }
            anyhow::bail!("interrupted")
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        keeper.ask();
        let wait = |n: usize| {
            wait_until(Duration::from_secs(60), || {
                tries.load(Ordering::SeqCst) == n
            })
        };
        assert!(wait(1));
        keeper.give_up();
        assert!(wait_until(Duration::from_secs(60), || !keeper.busy()));
        assert_eq!(tries.load(Ordering::SeqCst), 1);
        keeper.ask();
        assert!(wait(2));
        // The job's end stops the thread although its try never ends by itself.
        assert!(keeper.finish().is_none());
    }
}
