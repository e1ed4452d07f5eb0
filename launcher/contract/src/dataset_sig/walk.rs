//! The full walk of a dataset for its signature: every folder under the root, read
//! by a few threads at once (on a network file system each stat is a round trip,
//! so they overlap), each folder opened relative to the root's descriptor and
//! signed on its own ([`FolderSum`]: its sorted entries, so neither the order on
//! disk nor the order the threads take the folders matters). A worker reuses its
//! buffers from folder to folder. The walk gives up at its deadline and says so.

use std::ffi::OsStr;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::Instant;

use nix::errno::Errno;

use super::listing::{self, Listing, OddKind, Seen};
use super::Tally;
use crate::fnv::Fnv64;

/// One folder, signed: its path from the root (empty for the root), the digest of
/// its entries, and what they hold.
#[derive(Debug)]
pub(super) struct FolderSum {
    pub rel: Vec<u8>,
    pub digest: u64,
    pub tally: Tally,
}

/// How a walk ended.
pub(super) enum Walked {
    /// Every folder, in no particular order.
    Complete(Vec<FolderSum>),
    /// The deadline came first; the files read until then.
    OutOfTime { files: u64 },
}

/// Why a walk stopped: a failure of the system, not of the dataset.
#[derive(Debug)]
pub(super) struct WalkError {
    pub rel: Vec<u8>,
    pub errno: Errno,
}

/// The folders still to read, and the walkers at work.
struct Queue {
    folders: Vec<Vec<u8>>,
    busy: usize,
}

/// What the walkers share.
struct Shared<'a> {
    root: &'a Path,
    root_fd: &'a OwnedFd,
    deadline: Instant,
    queue: Mutex<Queue>,
    more: Condvar,
    /// Set when the walk must end early (the deadline, or a failure).
    stop: AtomicBool,
    out_of_time: AtomicBool,
    failure: Mutex<Option<WalkError>>,
}

/// Entries between two looks at the clock.
const CLOCK_EVERY: usize = 256;

/// Walks every folder under `root` (open as `root_fd`) with `threads` walkers,
/// until `deadline`.
pub(super) fn walk(
    root: &Path,
    root_fd: &OwnedFd,
    threads: usize,
    deadline: Instant,
) -> Result<Walked, WalkError> {
    let shared = Shared {
        root,
        root_fd,
        deadline,
        queue: Mutex::new(Queue {
            folders: vec![Vec::new()],
            busy: 0,
        }),
        more: Condvar::new(),
        stop: AtomicBool::new(false),
        out_of_time: AtomicBool::new(false),
        failure: Mutex::new(None),
    };
    let sums: Vec<Vec<FolderSum>> = std::thread::scope(|scope| {
        let walkers: Vec<_> = (0..threads.max(1))
            .map(|_| scope.spawn(|| walker(&shared)))
            .collect();
        walkers
            .into_iter()
            .map(|w| w.join().unwrap_or_default())
            .collect()
    });
    if let Some(failure) = shared
        .failure
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner)
    {
        return Err(failure);
    }
    if shared.out_of_time.load(Ordering::SeqCst) {
        let files = sums.iter().flatten().map(|s| s.tally.files).sum();
        return Ok(Walked::OutOfTime { files });
    }
    Ok(Walked::Complete(sums.into_iter().flatten().collect()))
}

/// One walker: takes folders until none is left (or the walk stops).
fn walker(shared: &Shared) -> Vec<FolderSum> {
    let mut listing = Listing::default();
    let mut found = Vec::new();
    let mut sums = Vec::new();
    while let Some(rel) = next_folder(shared) {
        let signed = sign_folder(shared, &rel, &mut listing, &mut found);
        let mut queue = shared.queue.lock().unwrap_or_else(PoisonError::into_inner);
        queue.busy -= 1;
        match signed {
            Ok(Some((digest, tally))) => {
                queue.folders.append(&mut found);
                sums.push(FolderSum { rel, digest, tally });
            }
            Ok(None) => {}
            Err(errno) => {
                let mut failure = shared
                    .failure
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                failure.get_or_insert(WalkError { rel, errno });
                shared.stop.store(true, Ordering::SeqCst);
            }
        }
        found.clear();
        shared.more.notify_all();
    }
    sums
}

/// The next folder to read; `None` when every folder is read (or the walk stops).
fn next_folder(shared: &Shared) -> Option<Vec<u8>> {
    let mut queue = shared.queue.lock().unwrap_or_else(PoisonError::into_inner);
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            return None;
        }
        if let Some(rel) = queue.folders.pop() {
            queue.busy += 1;
            return Some(rel);
        }
        if queue.busy == 0 {
            return None;
        }
        queue = shared
            .more
            .wait(queue)
            .unwrap_or_else(PoisonError::into_inner);
    }
}

/// Whether the walk is past its deadline (then it stops).
fn past_deadline(shared: &Shared) -> bool {
    if Instant::now() < shared.deadline {
        return false;
    }
    shared.out_of_time.store(true, Ordering::SeqCst);
    shared.stop.store(true, Ordering::SeqCst);
    true
}

/// Signs the folder `rel`; its sub-folders go to `found`. `None` when the walk
/// stopped meanwhile.
fn sign_folder(
    shared: &Shared,
    rel: &[u8],
    listing: &mut Listing,
    found: &mut Vec<Vec<u8>>,
) -> Result<Option<(u64, Tally)>, Errno> {
    if past_deadline(shared) {
        return Ok(None);
    }
    let mut hash = Fnv64::default();
    let mut tally = Tally::default();
    let dir = match listing::open(shared.root_fd, rel, listing)? {
        Ok(dir) => dir,
        Err(kind) => {
            hash.field(kind.word().as_bytes());
            tally.odd(kind, shared.root, rel);
            return Ok(Some((hash.finish(), tally)));
        }
    };
    let path = shared.root.join(OsStr::from_bytes(rel));
    for i in 0..listing.len() {
        if i % CLOCK_EVERY == CLOCK_EVERY - 1 && past_deadline(shared) {
            return Ok(None);
        }
        let (name, listed) = listing.get(i);
        let seen = listing::look(&dir, &path, name, listed, false)?;
        let name = name.to_bytes();
        listing::feed(&mut hash, name, &seen);
        match &seen {
            Seen::Folder { .. } => found.push(listing::child(rel, name)),
            Seen::File { size, .. } => tally.file(*size),
            Seen::Dangling { .. } => {
                tally.odd(OddKind::Dangling, shared.root, &listing::child(rel, name))
            }
            Seen::Odd(kind) => tally.odd(*kind, shared.root, &listing::child(rel, name)),
            Seen::FolderLink { .. } => {}
        }
    }
    Ok(Some((hash.finish(), tally)))
}
