// Included by build.rs (not a crate): the build id of `vrtspike-cache`'s sources,
// which the `vrtspike` and `vrtspike-cache` binaries both carry, so `vrtspike cache
// serve` and `vrtspike bench` hand over only to a `vrtspike-cache` built from the
// same sources.

/// What `vrtspike-cache` is compiled from (folders are walked; a little more than
/// it uses, never less).
const CACHE_SERVER_SOURCES: &[&str] = &[
    "src/bin/vrtspike-cache",
    "src/bench",
    "src/cache",
    "src/cli/bench.rs",
    "src/cli/cache.rs",
    "src/config",
    "src/dataset",
    "src/pipeline",
    "src/testkit",
    "src/util",
    "launcher/contract/src",
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
fn cache_build_id() {
    println!("cargo:rerun-if-changed=build/cache_build_id.rs");
    let mut files = Vec::new();
    for source in CACHE_SERVER_SOURCES {
        println!("cargo:rerun-if-changed={source}");
        source_files(std::path::Path::new(source), &mut files);
    }
    let mut hash = vrtspike_contract::fnv::Fnv64::new();
    hash.bytes(env!("CARGO_PKG_VERSION").as_bytes());
    for file in &files {
        hash.bytes(file.to_string_lossy().as_bytes());
        hash.bytes(&std::fs::read(file).unwrap_or_default());
    }
    let hash = hash.finish();
    println!("cargo:rustc-env=VRTSPIKE_CACHE_BUILD_ID={hash:016x}");
}
