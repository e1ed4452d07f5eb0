//! Which dataset a node-shared cache server holds: the dataset's canonical root and
//! a signature of its files (relative path, size and modification time of every
//! file under the root), so two jobs that name one dataset by different paths
//! meet on one server, and a dataset changed on disk (a file touched, resized,
//! added or removed) gets a new one. The records of different crop sizes, clip
//! lengths or spike bins are all cut from the same compact records, so these do
//! not enter the signature. See [`crate::cache_addr::shared_cache_address`].

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use crate::fnv::Fnv64;

/// A dataset as a node-shared cache server knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatasetSignature {
    /// The dataset's root with every link and `..` resolved.
    pub root: PathBuf,
    /// FNV-1a (64 bit) of the root and of every file's path, size and mtime.
    pub digest: u64,
    /// Files under the root.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// Why a dataset could not be signed.
#[derive(Debug, thiserror::Error)]
#[error("signing the dataset at {path}: {source}")]
pub struct SignatureError {
    /// The file or folder at fault.
    pub path: PathBuf,
    /// What went wrong.
    pub source: io::Error,
}

/// Signs the dataset under `root` (see the module doc). Symbolic links to files
/// count as the files they name; a link to a folder counts by its target's path
/// and is not followed (no loops).
pub fn sign(root: &Path) -> Result<DatasetSignature, SignatureError> {
    let at = |path: &Path| {
        let path = path.to_path_buf();
        move |source| SignatureError { path, source }
    };
    let canonical = fs::canonicalize(root).map_err(at(root))?;
    let mut hash = Fnv64::new();
    hash.field(canonical.as_os_str().as_encoded_bytes());
    let mut totals = (0u64, 0u64);
    walk(&canonical, Path::new(""), &mut hash, &mut totals)?;
    Ok(DatasetSignature {
        root: canonical,
        digest: hash.finish(),
        files: totals.0,
        bytes: totals.1,
    })
}

/// Adds every entry under `dir` (named `rel` from the root) to `hash`, sorted by
/// name so the order of the folder on disk does not matter.
fn walk(
    dir: &Path,
    rel: &Path,
    hash: &mut Fnv64,
    totals: &mut (u64, u64),
) -> Result<(), SignatureError> {
    let at = |path: &Path| {
        let path = path.to_path_buf();
        move |source| SignatureError { path, source }
    };
    let mut entries = fs::read_dir(dir)
        .map_err(at(dir))?
        .map(|entry| entry.map(|e| e.file_name()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(at(dir))?;
    entries.sort();
    for name in entries {
        let path = dir.join(&name);
        let rel = rel.join(&name);
        let kind = fs::symlink_metadata(&path).map_err(at(&path))?.file_type();
        if kind.is_dir() {
            hash.field(b"d");
            hash.field(rel.as_os_str().as_encoded_bytes());
            walk(&path, &rel, hash, totals)?;
            continue;
        }
        let meta = fs::metadata(&path).map_err(at(&path))?;
        if meta.is_dir() {
            let target = fs::canonicalize(&path).map_err(at(&path))?;
            hash.field(b"l");
            hash.field(rel.as_os_str().as_encoded_bytes());
            hash.field(target.as_os_str().as_encoded_bytes());
            continue;
        }
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        hash.field(b"f");
        hash.field(rel.as_os_str().as_encoded_bytes());
        hash.bytes(&meta.len().to_le_bytes());
        hash.bytes(&mtime.to_le_bytes());
        totals.0 += 1;
        totals.1 += meta.len();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    fn dataset(dir: &Path) -> PathBuf {
        let root = dir.join("data");
        let seq = root.join("train").join("seq0");
        fs::create_dir_all(&seq).unwrap_or_else(|e| panic!("{e}"));
        fs::write(root.join("dataset.yaml"), "spike: 8\n").unwrap_or_else(|e| panic!("{e}"));
        fs::write(seq.join("0.png"), [1u8; 100]).unwrap_or_else(|e| panic!("{e}"));
        fs::write(seq.join("0.dat"), [2u8; 50]).unwrap_or_else(|e| panic!("{e}"));
        root
    }

    fn signed(root: &Path) -> DatasetSignature {
        sign(root).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn another_spelling_of_the_root_is_the_same_dataset() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let root = dataset(dir.path());
        let plain = signed(&root);
        assert_eq!((plain.files, plain.bytes), (3, 159));
        let dotted = signed(&root.join("train").join("..").join(".").join(""));
        assert_eq!(plain, dotted);
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&root, &link).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(plain, signed(&link));
    }

    #[test]
    fn a_touched_resized_added_or_removed_file_is_another_dataset() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let root = dataset(dir.path());
        let png = root.join("train").join("seq0").join("0.png");
        let before = signed(&root);
        assert_eq!(before, signed(&root), "signing twice gives one signature");

        let file = fs::File::options()
            .write(true)
            .open(&png)
            .unwrap_or_else(|e| panic!("{e}"));
        let later = SystemTime::now() + Duration::from_secs(5);
        file.set_modified(later).unwrap_or_else(|e| panic!("{e}"));
        let touched = signed(&root);
        assert_ne!(before.digest, touched.digest, "touched");

        file.set_len(99).unwrap_or_else(|e| panic!("{e}"));
        file.set_modified(later).unwrap_or_else(|e| panic!("{e}"));
        let resized = signed(&root);
        assert_ne!(touched.digest, resized.digest, "resized, same mtime");

        fs::write(root.join("extra.txt"), "x").unwrap_or_else(|e| panic!("{e}"));
        let added = signed(&root);
        assert_ne!(resized.digest, added.digest, "added");
        fs::remove_file(root.join("extra.txt")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(resized.digest, signed(&root).digest, "removed again");
    }

    #[test]
    fn the_same_files_under_another_root_are_another_dataset() {
        let one = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let two = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (a, b) = (dataset(one.path()), dataset(two.path()));
        // Same mtimes too: only the root differs.
        for root in [&a, &b] {
            for f in ["dataset.yaml", "train/seq0/0.png", "train/seq0/0.dat"] {
                let file = fs::File::options()
                    .write(true)
                    .open(root.join(f))
                    .unwrap_or_else(|e| panic!("{e}"));
                file.set_modified(UNIX_EPOCH + Duration::from_secs(1_000_000))
                    .unwrap_or_else(|e| panic!("{e}"));
            }
        }
        assert_ne!(signed(&a).digest, signed(&b).digest);
    }

    #[test]
    fn a_missing_root_names_it() {
        let err = sign(Path::new("/no/such/dataset")).unwrap_err();
        assert!(err.to_string().contains("/no/such/dataset"), "{err}");
    }
}
