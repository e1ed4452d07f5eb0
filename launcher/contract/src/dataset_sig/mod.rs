//! Which dataset a node-shared cache server holds: the dataset's canonical root and
//! a signature of its files (relative path, size and modification time of every
//! file under the root), so two jobs that name one dataset by different paths
//! meet on one server, and a dataset changed on disk (a file touched, resized,
//! added or removed) gets a new one. The records of different crop sizes, clip
//! lengths or spike bins are all cut from the same compact records, so these do
//! not enter the signature. See [`crate::cache_addr::shared_cache_address`].
//!
//! What a volume holds beside the data signs as what it is, never as an error: a
//! folder or file this user cannot read (a root-owned `lost+found`), a dangling
//! link, an entry removed while the tree is read ([`OddKind`], by its name). The
//! walk reads several folders at once and reuses its buffers ([`walk`]); it has a
//! time budget ([`BUDGET_ENV`], [`DEFAULT_BUDGET_S`] s), after which the tree
//! signs by its top folders instead ([`shallow`], [`Coverage::Shallow`]). A job
//! signs once per node: the launcher, or local rank 0 of ranks started without
//! one, and hands the address on.

mod listing;
mod shallow;
mod walk;

use std::ffi::OsStr;
use std::fmt;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

pub use listing::OddKind;
use walk::{FolderSum, WalkError, Walked};

use crate::fnv::Fnv64;

/// The variable that bounds the signing of a dataset, in seconds.
pub const BUDGET_ENV: &str = "VRTSPIKE_DATASET_SIGN_BUDGET_S";

/// Seconds the full walk may take before the tree signs by its top folders.
pub const DEFAULT_BUDGET_S: f64 = 10.0;

/// The most walker threads (on a network file system they overlap round trips).
const MOST_THREADS: usize = 16;

/// Odd entries named in a signature's report (the rest only counted).
const EXAMPLES: usize = 3;

/// A dataset as a node-shared cache server knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatasetSignature {
    /// The dataset's root with every link and `..` resolved.
    pub root: PathBuf,
    /// FNV-1a (64 bit) of the root and of every folder's entries.
    pub digest: u64,
    /// Files read, their bytes, and the odd entries.
    pub tally: Tally,
    /// Whether every folder was read.
    pub coverage: Coverage,
    /// How long it took.
    pub took: Duration,
}

/// What a signature read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    /// Files (links to files included).
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Entries this user cannot read.
    pub unreadable: u64,
    /// Links to nothing.
    pub dangling: u64,
    /// Entries gone between their folder's listing and their own look.
    pub vanished: u64,
    /// The first few odd entries, by path.
    pub examples: Vec<(PathBuf, OddKind)>,
}

impl Tally {
    fn file(&mut self, size: u64) {
        self.files += 1;
        self.bytes += size;
    }

    /// Counts the odd entry `rel` (from `root`) of `kind`.
    fn odd(&mut self, kind: OddKind, root: &Path, rel: &[u8]) {
        *match kind {
            OddKind::Unreadable => &mut self.unreadable,
            OddKind::Dangling => &mut self.dangling,
            OddKind::Vanished => &mut self.vanished,
        } += 1;
        if self.examples.len() < EXAMPLES {
            self.examples
                .push((root.join(OsStr::from_bytes(rel)), kind));
        }
    }

    fn add(&mut self, other: &Tally) {
        self.files += other.files;
        self.bytes += other.bytes;
        self.unreadable += other.unreadable;
        self.dangling += other.dangling;
        self.vanished += other.vanished;
        let room = EXAMPLES.saturating_sub(self.examples.len());
        self.examples
            .extend(other.examples.iter().take(room).cloned());
    }

    /// Odd entries in all.
    pub fn odd_entries(&self) -> u64 {
        self.unreadable + self.dangling + self.vanished
    }
}

impl fmt::Display for Tally {
    /// `N unreadable, M dangling, K vanished (e.g. PATH: unreadable, ...)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} unreadable, {} dangling, {} vanished",
            self.unreadable, self.dangling, self.vanished
        )?;
        let examples: Vec<String> = self
            .examples
            .iter()
            .map(|(path, kind)| format!("{}: {}", path.display(), kind.word()))
            .collect();
        if !examples.is_empty() {
            write!(f, " (e.g. {})", examples.join(", "))?;
        }
        Ok(())
    }
}

/// How much of the tree a signature read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Coverage {
    /// Every folder.
    Full,
    /// The budget ran out: the top folders only ([`shallow`]).
    Shallow {
        /// The budget that ran out.
        budget: Duration,
        /// Files the full walk had read by then.
        walked_files: u64,
    },
}

/// How a dataset is signed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SignOptions {
    /// Walker threads.
    pub threads: usize,
    /// Time for the full walk; then the tree signs by its top folders.
    pub budget: Duration,
}

impl SignOptions {
    /// The budget from [`BUDGET_ENV`] (else [`DEFAULT_BUDGET_S`]), a walker a
    /// core (at least 4, at most 16).
    pub fn from_env() -> Result<SignOptions, SignatureError> {
        SignOptions::from_vars(&|name| std::env::var(name).ok())
    }

    /// [`SignOptions::from_env`] with the variables read through `var`.
    pub fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<SignOptions, SignatureError> {
        let budget_s = match var(BUDGET_ENV) {
            Some(text) => {
                crate::seconds::parse_seconds(&text).map_err(|message| SignatureError::Setting {
                    var: BUDGET_ENV,
                    message,
                })?
            }
            None => DEFAULT_BUDGET_S,
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Ok(SignOptions {
            threads: cores.clamp(4, MOST_THREADS),
            budget: Duration::from_secs_f64(budget_s),
        })
    }
}

/// Why a dataset could not be signed.
#[derive(Debug, thiserror::Error)]
pub enum SignatureError {
    /// The root is not there, not a folder, or the walk failed for a reason that
    /// is not the dataset's (out of file descriptors, an I/O error).
    #[error("signing the dataset at {}: {source}", path.display())]
    Io {
        /// The file or folder at fault.
        path: PathBuf,
        /// What went wrong.
        source: io::Error,
    },
    /// A setting of the signature does not read.
    #[error("{var}: {message}")]
    Setting {
        /// The variable.
        var: &'static str,
        /// What is wrong with it.
        message: String,
    },
}

/// Signs the dataset under `root` with the [`SignOptions::from_env`] (see the
/// module doc). Symbolic links to files count as the files they name; a link to
/// a folder counts by its target's path and is not followed (no loops).
pub fn sign(root: &Path) -> Result<DatasetSignature, SignatureError> {
    sign_with(root, &SignOptions::from_env()?)
}

/// [`sign`] as `options` say; logs the odd entries and a spent budget.
pub fn sign_with(root: &Path, options: &SignOptions) -> Result<DatasetSignature, SignatureError> {
    let started = Instant::now();
    let io_at = |path: &Path| {
        let path = path.to_path_buf();
        move |source| SignatureError::Io { path, source }
    };
    let canonical = std::fs::canonicalize(root).map_err(io_at(root))?;
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    let root_fd: OwnedFd = nix::fcntl::open(&canonical, flags, Mode::empty())
        .map_err(|e| io_at(&canonical)(io::Error::from(e)))?;
    let mut hash = Fnv64::default();
    hash.field(canonical.as_os_str().as_bytes());
    let deadline = started + options.budget;
    let walked = walk::walk(&canonical, &root_fd, options.threads, deadline)
        .map_err(|e| walk_error(&canonical, e))?;
    let (tally, coverage) = match walked {
        Walked::Complete(mut folders) => (fold(&mut hash, &mut folders), Coverage::Full),
        Walked::OutOfTime { files } => {
            let tally = shallow::sign(&canonical, &root_fd, &mut hash)
                .map_err(|e| walk_error(&canonical, e))?;
            let coverage = Coverage::Shallow {
                budget: options.budget,
                walked_files: files,
            };
            (tally, coverage)
        }
    };
    let signature = DatasetSignature {
        root: canonical,
        digest: hash.finish(),
        tally,
        coverage,
        took: started.elapsed(),
    };
    report(&signature);
    Ok(signature)
}

/// Feeds the folders to `hash` in path order; their tallies together.
fn fold(hash: &mut Fnv64, folders: &mut [FolderSum]) -> Tally {
    folders.sort_unstable_by(|a, b| a.rel.cmp(&b.rel));
    let mut tally = Tally::default();
    for folder in folders.iter() {
        hash.field(&folder.rel);
        hash.bytes(&folder.digest.to_le_bytes());
        tally.add(&folder.tally);
    }
    tally
}

fn walk_error(root: &Path, e: WalkError) -> SignatureError {
    SignatureError::Io {
        path: root.join(OsStr::from_bytes(&e.rel)),
        source: io::Error::from(e.errno),
    }
}

/// Says what the signature met that a user may not expect.
fn report(signature: &DatasetSignature) {
    let root = signature.root.display();
    if signature.tally.odd_entries() > 0 {
        tracing::warn!(
            "the dataset at {root} holds entries that are signed by their kind and name, not \
             read: {}",
            signature.tally
        );
    }
    if let Coverage::Shallow {
        budget,
        walked_files,
    } = &signature.coverage
    {
        tracing::warn!(
            "signing the dataset at {root} took longer than {BUDGET_ENV}={} s ({walked_files} \
             files read by then): it is signed by its top {} levels of folders instead (a file \
             below them rewritten in place, under its name, goes unseen: stop the shared server \
             after such a change, or raise {BUDGET_ENV})",
            budget.as_secs_f64(),
            shallow::DEPTH
        );
    }
}

#[cfg(test)]
mod tests;
