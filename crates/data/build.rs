//! Build script of `vrtspike-data`: the build id of what `vrtspike-cache` is built
//! from, which this crate's `cli::cache::BUILD_ID` carries into both binaries, so
//! `vrtspike cache serve` and `vrtspike bench` hand over only to a `vrtspike-cache`
//! built from the same sources. It links nothing (libtorch least of all).

/// What `vrtspike-cache` is built from, relative to this crate: its own sources
/// and manifest, the contract crate's, and the workspace's Cargo.lock (the
/// versions of every dependency). Folders are walked.
const CACHE_SERVER_SOURCES: &[&str] = &[
    "Cargo.toml",
    "build.rs",
    "src",
    "../../launcher/contract/Cargo.toml",
    "../../launcher/contract/src",
    "../../Cargo.lock",
];

/// Every file under `path`, sorted.
fn source_files(path: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    match std::fs::read_dir(path) {
        Ok(entries) => {
            let mut paths: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
            paths.sort();
            for p in paths {
                source_files(&p, out);
            }
        }
        Err(_) => out.push(path.to_path_buf()),
    }
}

/// Emits `VRTSPIKE_CACHE_BUILD_ID`: an FNV-1a hash of the cache server's sources
/// (names and bytes) and the package version.
fn main() {
    let mut files = Vec::new();
    for source in CACHE_SERVER_SOURCES {
        println!("cargo:rerun-if-changed={source}");
        source_files(std::path::Path::new(source), &mut files);
    }
    let mut hash = vrtspike_contract::fnv::Fnv64::default();
    hash.bytes(env!("CARGO_PKG_VERSION").as_bytes());
    for file in &files {
        hash.bytes(file.to_string_lossy().as_bytes());
        hash.bytes(&std::fs::read(file).unwrap_or_default());
    }
    let hash = hash.finish();
    println!("cargo:rustc-env=VRTSPIKE_CACHE_BUILD_ID={hash:016x}");
}
