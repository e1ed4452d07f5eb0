//! The shared libraries mapped into this process, from `/proc/self/maps`: how a
//! binary proves at run time that a library it was linked with is really loaded
//! (libtorch registers its CUDA backend only when `libtorch_cuda.so` is).

use std::path::PathBuf;

/// Could not read this process's memory map.
#[derive(Debug, thiserror::Error)]
#[error("cannot read /proc/self/maps: {0}")]
pub struct MapsError(#[from] std::io::Error);

/// The path of the first mapped file whose name is `file_name` (exactly, e.g.
/// `libtorch_cuda.so`), or `None` when no such library is mapped.
pub fn mapped_library(file_name: &str) -> Result<Option<PathBuf>, MapsError> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    Ok(find_mapped(&maps, file_name))
}

/// The first path in `maps` (the text of a `/proc/<pid>/maps`) whose file name is
/// `file_name`.
fn find_mapped(maps: &str, file_name: &str) -> Option<PathBuf> {
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .map(PathBuf::from)
        .find(|path| path.file_name().is_some_and(|name| name == file_name))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
7f00-7f10 r--p 00000000 fd:00 12 /opt/torch/lib/libtorch_cuda.so.bak
7f10-7f20 r-xp 00001000 fd:00 13 /opt/torch/lib/libtorch_cuda.so
7f20-7f30 rw-p 00000000 00:00 0
7f30-7f40 r--p 00000000 fd:00 14 /usr/lib/libc10_cuda.so (deleted)
";

    #[test]
    fn finds_a_library_by_its_exact_file_name() {
        assert_eq!(
            find_mapped(MAPS, "libtorch_cuda.so"),
            Some(PathBuf::from("/opt/torch/lib/libtorch_cuda.so"))
        );
        assert_eq!(
            find_mapped(MAPS, "libc10_cuda.so"),
            Some(PathBuf::from("/usr/lib/libc10_cuda.so"))
        );
        assert_eq!(find_mapped(MAPS, "libtorch.so"), None);
        assert_eq!(find_mapped(MAPS, "libtorch_cuda"), None);
    }

    #[test]
    fn this_test_binary_has_libtorch_mapped() {
        // Every test binary of this crate links libtorch; the map must show it.
        let path = mapped_library("libtorch_cpu.so").expect("read maps");
        assert!(path.is_some(), "libtorch_cpu.so is not mapped");
    }
}
