//! The heap policy of the processes that run the model (train, profile, infer).
//!
//! libtorch's CPU tensors come from glibc's `malloc`. Blocks above the mmap threshold
//! get their own mapping, returned to the kernel when freed; smaller ones come from
//! the heap, whose freed space stays resident. The threshold starts at 128 KiB but
//! glibc raises it after every large free, up to 32 MiB, so within the first forward
//! and backward pass nearly every activation moves onto the heap; freed activations
//! then stay resident, scattered between live ones, and the next pass adds to them.
//! Pinning the threshold keeps the large activations in their own mappings, so the
//! resident set follows the live tensors; the price is a page fault per page of every
//! new mapped tensor, which libtorch's transparent huge pages (`THP_MEM_ALLOC_ENABLE`,
//! turned on here unless set) make one fault per 2 MiB. The VRT GoPro model at
//! 6x64x64, forward and backward on 2 CPU threads: glibc's rule 19.6 GB in 36.6 s;
//! pinned at 8 MiB with huge pages 14.1 GB in 36.7-37.8 s; at 1-2 MiB 13.8 GB but
//! 40-46 s; at 16 MiB 16.9 GB (docs/benchmarks.md, "Model time and memory").
//!
//! `VRTSPIKE_MMAP_THRESHOLD` sets the threshold (`8M`, `1M`, ... or `glibc` for
//! glibc's own dynamic rule); glibc's `MALLOC_MMAP_THRESHOLD_`, when set, is left to
//! glibc and wins. `THP_MEM_ALLOC_ENABLE=0` turns the huge pages off.
//!
//! On a GPU the same processes get `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`
//! unless it is set (the user's own fix for fragmentation of the CUDA caching
//! allocator: segments grow in place instead of leaving stranded blocks), whoever
//! started them (`vrtspike-launch` sets it too; torchrun and srun do not).

use super::bytes::parse_size;

/// The environment variable that sets the threshold.
pub const THRESHOLD_ENV: &str = "VRTSPIKE_MMAP_THRESHOLD";

/// glibc's own tunable; when set, this module changes nothing.
const GLIBC_ENV: &str = "MALLOC_MMAP_THRESHOLD_";

/// The threshold used when nothing is set: the small and middle tensors of a step
/// reuse heap space at no fault cost, the activations that make the peak are mapped.
pub const DEFAULT_THRESHOLD: u64 = 8 << 20;

/// glibc's largest mmap threshold (`HEAP_MAX_SIZE / 2` on 64-bit).
const MAX_THRESHOLD: u64 = 32 << 20;

/// What the process's heap does with large blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeapPolicy {
    /// Blocks of at least this many bytes get their own mapping.
    Pinned(u64),
    /// glibc's dynamic threshold (asked for by `VRTSPIKE_MMAP_THRESHOLD=glibc`).
    GlibcDynamic,
    /// `MALLOC_MMAP_THRESHOLD_` is set: glibc applies it.
    GlibcTunable,
    /// This C library has no `mallopt` (not glibc).
    Unsupported,
}

/// A `VRTSPIKE_MMAP_THRESHOLD` value that is not a size or `glibc`.
#[derive(Debug, thiserror::Error)]
#[error("{THRESHOLD_ENV}={value}: {reason}")]
pub struct HeapPolicyError {
    value: String,
    reason: String,
}

/// The policy the environment asks for (`threshold`: `VRTSPIKE_MMAP_THRESHOLD`;
/// `glibc_tunable_set`: whether `MALLOC_MMAP_THRESHOLD_` is set).
pub fn policy_for(
    threshold: Option<&str>,
    glibc_tunable_set: bool,
) -> Result<HeapPolicy, HeapPolicyError> {
    if glibc_tunable_set {
        return Ok(HeapPolicy::GlibcTunable);
    }
    let Some(value) = threshold.map(str::trim) else {
        return Ok(HeapPolicy::Pinned(DEFAULT_THRESHOLD));
    };
    if value.eq_ignore_ascii_case("glibc") {
        return Ok(HeapPolicy::GlibcDynamic);
    }
    let error = |reason: String| HeapPolicyError {
        value: value.to_string(),
        reason,
    };
    let bytes = parse_size(value).map_err(|e| error(format!("{e} (or `glibc`)")))?;
    if bytes == 0 || bytes > MAX_THRESHOLD {
        return Err(error(format!(
            "the threshold must be between 1 byte and {} MiB",
            MAX_THRESHOLD >> 20
        )));
    }
    Ok(HeapPolicy::Pinned(bytes))
}

/// libtorch's switch for transparent huge pages in its CPU allocator.
pub const HUGE_PAGES_ENV: &str = "THP_MEM_ALLOC_ENABLE";

/// The CUDA caching allocator's settings, read by libtorch at its first CUDA allocation.
pub const CUDA_ALLOC_CONF_ENV: &str = "PYTORCH_CUDA_ALLOC_CONF";

/// The CUDA caching allocator's default here: segments that grow in place.
pub const CUDA_ALLOC_CONF_DEFAULT: &str = "expandable_segments:True";

/// An environment variable libtorch reads once, and whether its value is this
/// module's default or the user's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvDefault {
    /// It was unset: set here to this module's default.
    SetHere,
    /// It was set; libtorch reads it as given.
    AsSet(String),
}

/// The heap of a process that runs the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heap {
    /// Where large blocks go.
    pub policy: HeapPolicy,
    /// Huge pages for CPU tensors (`THP_MEM_ALLOC_ENABLE`).
    pub huge_pages: EnvDefault,
    /// The CUDA caching allocator's settings (`PYTORCH_CUDA_ALLOC_CONF`).
    pub cuda_alloc: EnvDefault,
}

/// Reads the policy from the environment and applies it to this process, turns on
/// libtorch's huge pages unless `THP_MEM_ALLOC_ENABLE` is set, and gives the CUDA
/// caching allocator expandable segments unless `PYTORCH_CUDA_ALLOC_CONF` is set; call
/// it first in `main`, before any tensor is allocated (libtorch reads the variables
/// once, at its first allocation) and before any thread starts.
pub fn apply_from_env() -> Result<Heap, HeapPolicyError> {
    let threshold = std::env::var(THRESHOLD_ENV).ok();
    let tunable = std::env::var_os(GLIBC_ENV).is_some();
    let policy = apply(policy_for(threshold.as_deref(), tunable)?);
    Ok(Heap {
        policy,
        huge_pages: default_env(HUGE_PAGES_ENV, "1"),
        cuda_alloc: default_env(CUDA_ALLOC_CONF_ENV, CUDA_ALLOC_CONF_DEFAULT),
    })
}

/// Sets `name` to `value` unless it is set (to anything, empty included).
fn default_env(name: &str, value: &str) -> EnvDefault {
    match std::env::var_os(name) {
        Some(set) => EnvDefault::AsSet(set.to_string_lossy().into_owned()),
        None => {
            std::env::set_var(name, value);
            EnvDefault::SetHere
        }
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn apply(policy: HeapPolicy) -> HeapPolicy {
    let HeapPolicy::Pinned(bytes) = policy else {
        return policy;
    };
    // The bound check in `policy_for` keeps it far below i32::MAX.
    let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: mallopt only sets a parameter of glibc's allocator; any value is
    // accepted or refused (return 0), never undefined.
    if unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, value) } == 0 {
        return HeapPolicy::Unsupported;
    }
    policy
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn apply(policy: HeapPolicy) -> HeapPolicy {
    match policy {
        HeapPolicy::Pinned(_) => HeapPolicy::Unsupported,
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_pins_the_default_threshold() {
        assert_eq!(
            policy_for(None, false).unwrap(),
            HeapPolicy::Pinned(DEFAULT_THRESHOLD)
        );
    }

    #[test]
    fn sizes_and_glibc_are_read() {
        assert_eq!(
            policy_for(Some("256K"), false).unwrap(),
            HeapPolicy::Pinned(256 << 10)
        );
        assert_eq!(
            policy_for(Some(" glibc "), false).unwrap(),
            HeapPolicy::GlibcDynamic
        );
    }

    /// The environment is process-wide: the check runs alone in a fresh process.
    #[test]
    #[ignore = "run in a fresh process by unset_variables_get_the_defaults_and_set_ones_are_kept"]
    fn env_defaults_probe() {
        std::env::remove_var(CUDA_ALLOC_CONF_ENV);
        std::env::set_var(HUGE_PAGES_ENV, "0");
        let heap = apply_from_env().expect("policy");
        assert_eq!(heap.cuda_alloc, EnvDefault::SetHere);
        assert_eq!(
            std::env::var(CUDA_ALLOC_CONF_ENV).as_deref(),
            Ok(CUDA_ALLOC_CONF_DEFAULT)
        );
        assert_eq!(heap.huge_pages, EnvDefault::AsSet("0".into()));
        assert_eq!(std::env::var(HUGE_PAGES_ENV).as_deref(), Ok("0"));
        // A second call sees the first one's value as set, and keeps it.
        std::env::set_var(CUDA_ALLOC_CONF_ENV, "max_split_size_mb:128");
        let again = apply_from_env().expect("policy");
        assert_eq!(
            again.cuda_alloc,
            EnvDefault::AsSet("max_split_size_mb:128".into())
        );
    }

    #[test]
    fn unset_variables_get_the_defaults_and_set_ones_are_kept() {
        let probe = "util::heap::tests::env_defaults_probe";
        if let Err(e) = crate::util::alone::run_ignored_test_alone(probe, &[GLIBC_ENV]) {
            panic!("{e}");
        }
    }

    #[test]
    fn the_glibc_tunable_wins() {
        assert_eq!(
            policy_for(Some("1M"), true).unwrap(),
            HeapPolicy::GlibcTunable
        );
    }

    #[test]
    fn bad_values_name_the_variable() {
        for bad in ["lots", "0", "64M"] {
            let err = policy_for(Some(bad), false).unwrap_err().to_string();
            assert!(err.starts_with("VRTSPIKE_MMAP_THRESHOLD="), "{err}");
            assert!(err.contains(bad), "{err}");
        }
    }

    /// Whether glibc serves the block at `ptr` from its own mapping (the IS_MMAPPED
    /// bit of the chunk's size word, just before the block).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn own_mapping(ptr: *const u8) -> bool {
        // SAFETY: `ptr` is a live block from glibc's malloc (Rust's System allocator
        // calls malloc for this alignment); glibc keeps the chunk's size word in the
        // 8 bytes before every block, readable while the block is allocated.
        let size_word = unsafe { (ptr as *const usize).sub(1).read() };
        size_word & 2 != 0
    }

    /// The check itself, in a process of its own: glibc serves a block from its own
    /// mapping only when the arena's free space cannot, and in a test binary other
    /// tests' threads leave their arenas with large free chunks at random.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    #[ignore = "run in a fresh process by a_pinned_threshold_keeps_large_blocks_in_their_own_mapping"]
    fn pinned_threshold_probe() {
        assert_eq!(
            apply(HeapPolicy::Pinned(1 << 20)),
            HeapPolicy::Pinned(1 << 20)
        );
        // Freeing an 8 MiB mapped block would raise glibc's dynamic threshold to
        // 8 MiB and put the next 4 MiB block on the heap; pinned, it stays mapped.
        let big: Vec<u8> = Vec::with_capacity(8 << 20);
        assert!(own_mapping(big.as_ptr()));
        drop(big);
        let block: Vec<u8> = Vec::with_capacity(4 << 20);
        assert!(
            own_mapping(block.as_ptr()),
            "a 4 MiB block came from the heap"
        );
        let small: Vec<u8> = Vec::with_capacity(64 << 10);
        assert!(
            !own_mapping(small.as_ptr()),
            "a 64 KiB block got its own mapping"
        );
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_pinned_threshold_keeps_large_blocks_in_their_own_mapping() {
        let probe = "util::heap::tests::pinned_threshold_probe";
        if let Err(e) = crate::util::alone::run_ignored_test_alone(probe, &[GLIBC_ENV]) {
            panic!("{e}");
        }
    }
}
