//! One folder of a dataset as its signature sees it: the names it lists, read into
//! buffers its walker reuses from folder to folder (no allocation per entry), in
//! name order; and what each entry adds to the folder's digest: a file's size and
//! mtime, a sub-folder's name (its walker signs its content), or the odd entry a
//! dataset volume may hold (an unreadable one, a dangling link, one removed while
//! the folder was read), each by its kind and name, never an error.

use std::ffi::{CStr, OsStr, OsString};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::dir::{Dir, Type};
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{fstatat, FileStat, Mode, SFlag};

use crate::fnv::Fnv64;

/// One name of a [`Listing`]: where it is in the names buffer, and its type as
/// the folder said (`None`: the file system does not say).
#[derive(Debug, Clone, Copy)]
struct Name {
    start: usize,
    /// With its terminating NUL.
    len: usize,
    kind: Option<Type>,
}

/// The names of one folder, sorted; [`Listing::read`] refills it.
#[derive(Debug, Default)]
pub(super) struct Listing {
    /// Every name, each ended by a NUL.
    bytes: Vec<u8>,
    names: Vec<Name>,
}

/// An entry that signs as what it is, not as an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OddKind {
    /// Not readable by this user (a root-owned `lost+found`, a folder of mode 000).
    Unreadable,
    /// A symbolic link to nothing (or to a loop).
    Dangling,
    /// Listed, then gone before it was looked at.
    Vanished,
}

impl OddKind {
    /// Its tag in the digest and its word in messages.
    pub fn word(self) -> &'static str {
        match self {
            OddKind::Unreadable => "unreadable",
            OddKind::Dangling => "dangling",
            OddKind::Vanished => "vanished",
        }
    }
}

/// What one entry is, as far as the signature goes.
#[derive(Debug)]
pub(super) enum Seen {
    /// A file (or what a link to a file names): its size and mtime.
    File { size: u64, mtime_ns: i128 },
    /// A folder: walked on its own (`mtime_ns` only when asked for).
    Folder { mtime_ns: Option<i128> },
    /// A link to a folder: counted by its target's path, not followed (no loops).
    FolderLink { target: PathBuf },
    /// A dangling link, with what it names.
    Dangling { target: OsString },
    /// Unreadable or vanished.
    Odd(OddKind),
}

impl Listing {
    /// Reads the names of `dir` (not `.` nor `..`) and sorts them.
    pub fn read(&mut self, dir: &mut Dir) -> Result<(), Errno> {
        self.bytes.clear();
        self.names.clear();
        for entry in dir.iter() {
            let entry = entry?;
            let name = entry.file_name().to_bytes_with_nul();
            if name == b".\0" || name == b"..\0" {
                continue;
            }
            self.names.push(Name {
                start: self.bytes.len(),
                len: name.len(),
                kind: entry.file_type(),
            });
            self.bytes.extend_from_slice(name);
        }
        let bytes = &self.bytes;
        self.names.sort_unstable_by(|a, b| {
            bytes[a.start..a.start + a.len].cmp(&bytes[b.start..b.start + b.len])
        });
        Ok(())
    }

    /// How many names it holds.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// The `i`-th name (in name order) and its type as listed.
    pub fn get(&self, i: usize) -> (&CStr, Option<Type>) {
        let name = self.names[i];
        let bytes = &self.bytes[name.start..name.start + name.len];
        // The names were copied with their NUL, and a listed name holds no other.
        let text = CStr::from_bytes_with_nul(bytes).unwrap_or_default();
        (text, name.kind)
    }
}

/// Opens the folder `rel` of the tree at `root_fd` (the root itself when empty)
/// and reads its names into `listing`: the folder, or the odd entry it is.
pub(super) fn open(
    root_fd: &OwnedFd,
    rel: &[u8],
    listing: &mut Listing,
) -> Result<Result<Dir, OddKind>, Errno> {
    let at: &[u8] = if rel.is_empty() { b"." } else { rel };
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let opened = Dir::openat(root_fd, OsStr::from_bytes(at), flags, Mode::empty())
        .and_then(|mut dir| listing.read(&mut dir).map(|()| dir));
    match opened {
        Ok(dir) => Ok(Ok(dir)),
        Err(e) => kind_of(e).map(Err).ok_or(e),
    }
}

/// The path of `name` in the folder `rel`, from the root.
pub(super) fn child(rel: &[u8], name: &[u8]) -> Vec<u8> {
    let mut path = Vec::with_capacity(rel.len() + 1 + name.len());
    if !rel.is_empty() {
        path.extend_from_slice(rel);
        path.push(b'/');
    }
    path.extend_from_slice(name);
    path
}

/// What the entry `name` of the folder `dir` (at `path`) is; `stat_folders` also
/// reads a folder's mtime. `Err` is a failure that says nothing about the dataset
/// (out of file descriptors, an I/O error): the walk stops on it.
pub(super) fn look(
    dir: &impl AsFd,
    path: &Path,
    name: &CStr,
    listed: Option<Type>,
    stat_folders: bool,
) -> Result<Seen, Errno> {
    if listed == Some(Type::Directory) && !stat_folders {
        return Ok(Seen::Folder { mtime_ns: None });
    }
    let own = match fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(stat) => stat,
        Err(e) => return odd(e),
    };
    match SFlag::from_bits_truncate(own.st_mode) & SFlag::S_IFMT {
        SFlag::S_IFDIR => Ok(Seen::Folder {
            mtime_ns: Some(mtime_ns(&own)),
        }),
        SFlag::S_IFLNK => follow(dir, path, name),
        _ => Ok(file(&own)),
    }
}

/// A link: what it names, or that it names nothing.
fn follow(dir: &impl AsFd, path: &Path, name: &CStr) -> Result<Seen, Errno> {
    let target = match fstatat(dir, name, AtFlags::empty()) {
        Ok(stat) => stat,
        Err(Errno::ENOENT | Errno::ELOOP | Errno::ENOTDIR) => {
            return match nix::fcntl::readlinkat(dir, name) {
                Ok(target) => Ok(Seen::Dangling { target }),
                Err(e) => odd(e),
            }
        }
        Err(e) => return odd(e),
    };
    if SFlag::from_bits_truncate(target.st_mode) & SFlag::S_IFMT != SFlag::S_IFDIR {
        return Ok(file(&target));
    }
    let link = path.join(OsStr::from_bytes(name.to_bytes()));
    match std::fs::canonicalize(&link) {
        Ok(target) => Ok(Seen::FolderLink { target }),
        Err(e) => odd(Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))),
    }
}

/// An error that is an odd entry of the dataset, or one that stops the walk.
pub(super) fn odd(e: Errno) -> Result<Seen, Errno> {
    match kind_of(e) {
        Some(kind) => Ok(Seen::Odd(kind)),
        None => Err(e),
    }
}

/// The odd entry an error of looking at it (or of opening it) shows; `None`
/// when the error says nothing about the dataset.
pub(super) fn kind_of(e: Errno) -> Option<OddKind> {
    match e {
        Errno::EACCES | Errno::EPERM => Some(OddKind::Unreadable),
        Errno::ENOENT | Errno::ENOTDIR => Some(OddKind::Vanished),
        Errno::ELOOP => Some(OddKind::Dangling),
        _ => None,
    }
}

fn file(stat: &FileStat) -> Seen {
    Seen::File {
        size: u64::try_from(stat.st_size).unwrap_or(0),
        mtime_ns: mtime_ns(stat),
    }
}

/// The mtime in nanoseconds since the epoch.
pub(super) fn mtime_ns(stat: &FileStat) -> i128 {
    i128::from(stat.st_mtime) * 1_000_000_000 + i128::from(stat.st_mtime_nsec)
}

/// Feeds the entry `name` that is `seen` to its folder's `hash`.
pub(super) fn feed(hash: &mut Fnv64, name: &[u8], seen: &Seen) {
    match seen {
        Seen::File { size, mtime_ns } => {
            hash.field(b"f");
            hash.field(name);
            hash.bytes(&size.to_le_bytes());
            hash.bytes(&mtime_ns.to_le_bytes());
        }
        Seen::Folder { mtime_ns } => {
            hash.field(b"d");
            hash.field(name);
            if let Some(mtime) = mtime_ns {
                hash.bytes(&mtime.to_le_bytes());
            }
        }
        Seen::FolderLink { target } => {
            hash.field(b"l");
            hash.field(name);
            hash.field(target.as_os_str().as_bytes());
        }
        Seen::Dangling { target } => {
            hash.field(OddKind::Dangling.word().as_bytes());
            hash.field(name);
            hash.field(target.as_bytes());
        }
        Seen::Odd(kind) => {
            hash.field(kind.word().as_bytes());
            hash.field(name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(path: &Path) -> Dir {
        Dir::open(path, OFlag::O_RDONLY | OFlag::O_DIRECTORY, Mode::empty())
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn names_come_sorted_without_dot_entries_and_the_buffers_are_reused() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        for name in ["b", "a", "ab", "c.png"] {
            std::fs::write(dir.path().join(name), name).unwrap_or_else(|e| panic!("{e}"));
        }
        std::fs::create_dir(dir.path().join("sub")).unwrap_or_else(|e| panic!("{e}"));
        let mut listing = Listing::default();
        listing
            .read(&mut open(dir.path()))
            .unwrap_or_else(|e| panic!("{e}"));
        let names: Vec<String> = (0..listing.len())
            .map(|i| listing.get(i).0.to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["a", "ab", "b", "c.png", "sub"]);
        assert_eq!(listing.get(4).1, Some(Type::Directory));
        let capacity = (listing.bytes.capacity(), listing.names.capacity());
        listing
            .read(&mut open(dir.path()))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(listing.len(), 5);
        assert_eq!(
            (listing.bytes.capacity(), listing.names.capacity()),
            capacity
        );
    }

    #[test]
    fn links_are_what_they_name_or_dangling() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let at = dir.path();
        std::fs::write(at.join("file"), [0u8; 7]).unwrap_or_else(|e| panic!("{e}"));
        std::fs::create_dir(at.join("folder")).unwrap_or_else(|e| panic!("{e}"));
        let link = |target: &str, name: &str| {
            std::os::unix::fs::symlink(target, at.join(name)).unwrap_or_else(|e| panic!("{e}"))
        };
        link("file", "to-file");
        link("folder", "to-folder");
        link("/no/such/thing", "dangling");
        link("loop", "loop");
        let handle = open(at);
        let seen = |name: &str| {
            let name = std::ffi::CString::new(name).unwrap_or_default();
            look(&handle, at, &name, None, false).unwrap_or_else(|e| panic!("{e}"))
        };
        assert!(matches!(seen("to-file"), Seen::File { size: 7, .. }));
        let Seen::FolderLink { target } = seen("to-folder") else {
            panic!("a link to a folder");
        };
        assert_eq!(target, at.join("folder").canonicalize().unwrap_or_default());
        let Seen::Dangling { target } = seen("dangling") else {
            panic!("a dangling link");
        };
        assert_eq!(target, "/no/such/thing");
        assert!(matches!(seen("loop"), Seen::Dangling { .. }));
        assert!(matches!(seen("gone"), Seen::Odd(OddKind::Vanished)));
        assert!(matches!(seen("folder"), Seen::Folder { mtime_ns: Some(_) }));
    }

    #[test]
    fn only_errors_about_the_entry_make_it_odd() {
        assert_eq!(kind_of(Errno::EACCES), Some(OddKind::Unreadable));
        assert_eq!(kind_of(Errno::ENOENT), Some(OddKind::Vanished));
        assert_eq!(kind_of(Errno::ELOOP), Some(OddKind::Dangling));
        assert_eq!(kind_of(Errno::EMFILE), None);
        assert_eq!(kind_of(Errno::EIO), None);
    }
}
