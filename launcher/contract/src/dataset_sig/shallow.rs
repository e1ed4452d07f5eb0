//! The signature of a dataset too large to walk within the budget: its top
//! folders only (the root, its splits and their sequences: [`DEPTH`] levels),
//! each by its listing and every entry's size and mtime, a folder's mtime
//! included (it changes whenever a name is added to it, removed or renamed), in
//! name order and at most [`MOST_ENTRIES`] entries. It reads the same entries in
//! every process, so the jobs that fall back on one tree meet on one server, and
//! it never equals a full signature (its digest starts with its own tag). What it
//! does not see: a file deeper down rewritten in place under the same name (see
//! `docs/cache.md`).

use std::collections::VecDeque;
use std::ffi::OsStr;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::listing::{self, Listing, OddKind, Seen};
use super::walk::WalkError;
use super::Tally;
use crate::fnv::Fnv64;

/// Levels of folders read: the root (0), its folders (1) and theirs (2).
pub const DEPTH: usize = 3;

/// Entries signed at most, in name order folder by folder.
pub const MOST_ENTRIES: usize = 20_000;

/// The shallow signature of the tree at `root` (open as `root_fd`), fed to `hash`.
pub(super) fn sign(root: &Path, root_fd: &OwnedFd, hash: &mut Fnv64) -> Result<Tally, WalkError> {
    hash.field(b"shallow");
    let mut tally = Tally::default();
    let mut listing = Listing::default();
    let mut folders: VecDeque<(Vec<u8>, usize)> = VecDeque::from([(Vec::new(), 0)]);
    let mut entries = 0usize;
    while let Some((rel, depth)) = folders.pop_front() {
        hash.field(&rel);
        let fail = |errno| WalkError {
            rel: rel.clone(),
            errno,
        };
        let dir = match listing::open(root_fd, &rel, &mut listing).map_err(fail)? {
            Ok(dir) => dir,
            Err(kind) => {
                hash.field(kind.word().as_bytes());
                tally.odd(kind, root, &rel);
                continue;
            }
        };
        let path = root.join(OsStr::from_bytes(&rel));
        for i in 0..listing.len() {
            if entries == MOST_ENTRIES {
                return Ok(tally);
            }
            entries += 1;
            let (name, listed) = listing.get(i);
            let seen = listing::look(&dir, &path, name, listed, true).map_err(fail)?;
            let name = name.to_bytes();
            listing::feed(hash, name, &seen);
            let child = || listing::child(&rel, name);
            match &seen {
                Seen::Folder { .. } if depth + 1 < DEPTH => folders.push_back((child(), depth + 1)),
                Seen::File { size, .. } => tally.file(*size),
                Seen::Dangling { .. } => tally.odd(OddKind::Dangling, root, &child()),
                Seen::Odd(kind) => tally.odd(*kind, root, &child()),
                Seen::Folder { .. } | Seen::FolderLink { .. } => {}
            }
        }
    }
    Ok(tally)
}
