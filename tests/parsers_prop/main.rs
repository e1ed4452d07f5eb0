//! Property tests over the parsers a user's files reach (`.dat`, `.npy`, PNG,
//! `dataset.yaml`, HDF5 sessions, the YAML config and `--set` overrides, the cache
//! protocol's frames): random, mutated and truncated inputs give an error whose
//! Display names the file, key or request at fault, never a panic, a hang or an
//! allocation sized by an unchecked header field.
//!
//! Each property runs a fixed number of cases (chosen so the whole set runs in well
//! under a minute in the debug profile); `PROPTEST_CASES=N` runs N cases for every
//! property instead. Each property prints the cases it ran (`--nocapture`).

mod config;
mod dat;
mod h5;
mod meta;
mod npy;
mod png;
mod protocol;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Instant;

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// The bound on one case's time: a guard against a hang or a size-driven loop (the
/// faults these properties found took hours or exhausted memory), far above a
/// case's normal milliseconds, so a loaded 2-core CI machine cannot trip it.
pub const HANG_GUARD: std::time::Duration = std::time::Duration::from_secs(60);

/// The system allocator, noting the largest single request of each thread while
/// [`largest_allocation`] watches it.
struct Watched;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
    static ACCEPTED: Cell<u32> = const { Cell::new(0) };
}

/// Counts a case whose input the parser accepted (the rest were errors).
pub fn accepted() {
    ACCEPTED.with(|n| n.set(n.get() + 1));
}

fn note(size: usize) {
    // A panic's report (message, backtrace) is sized by the binary, not the input.
    if std::thread::panicking() {
        return;
    }
    let _ = LARGEST.try_with(|largest| largest.set(largest.get().max(size)));
}

// SAFETY: every call forwards to `System` with the caller's arguments unchanged; the
// bookkeeping touches only a const-initialised thread-local `Cell` (no allocation).
unsafe impl GlobalAlloc for Watched {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: as for `dealloc`; `new_size` is the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Watched = Watched;

/// Runs `f` and returns its result with the largest single allocation it made on
/// this thread (Rust allocations only; a C library's `malloc` is not seen).
pub fn largest_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|largest| largest.set(0));
    let out = f();
    (out, LARGEST.with(Cell::get))
}

/// Fails the case if a parse of a `file_len`-byte input allocated more than the
/// input could justify (`per_byte` output bytes per input byte, plus 1 MiB).
pub fn bounded_by_input(
    largest: usize,
    file_len: usize,
    per_byte: usize,
) -> Result<(), TestCaseError> {
    let limit = (1 << 20) + per_byte * file_len;
    if largest <= limit {
        Ok(())
    } else {
        Err(TestCaseError::fail(format!(
            "a {file_len}-byte input made an allocation of {largest} bytes (limit {limit})"
        )))
    }
}

/// Runs `test` on `cases` inputs from `strategy` (or `PROPTEST_CASES` inputs), prints
/// how many ran, and fails with the shrunk input on the first failing case.
pub fn check<S, F>(name: &str, cases: u32, strategy: S, test: F)
where
    S: Strategy,
    S::Value: std::fmt::Debug,
    F: Fn(S::Value) -> Result<(), TestCaseError>,
{
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let start = Instant::now();
    ACCEPTED.with(|n| n.set(0));
    let ran = std::sync::atomic::AtomicU32::new(0);
    let result = runner.run(&strategy, |value| {
        ran.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        test(value)
    });
    let ran = ran.into_inner();
    println!(
        "property {name}: {ran} cases ({} accepted, the rest named errors) in {:.1} s",
        ACCEPTED.with(Cell::get),
        start.elapsed().as_secs_f64()
    );
    if let Err(failure) = result {
        panic!("property {name} failed: {failure}");
    }
}

/// Fails the case unless `message` (an error's Display) contains `needle`.
pub fn names(message: &str, needle: &str) -> Result<(), TestCaseError> {
    if message.contains(needle) {
        Ok(())
    } else {
        Err(TestCaseError::fail(format!(
            "error does not name {needle:?}: {message}"
        )))
    }
}

/// A valid input with some bytes overwritten at random positions (`edits` of
/// (position fraction, byte)) and then cut at a random fraction of its length.
pub fn mutated(valid: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    let len = valid.len();
    (
        proptest::collection::vec((0.0..1.0f64, proptest::num::u8::ANY), 0..8),
        proptest::option::weighted(0.3, 0.0..1.0f64),
    )
        .prop_map(move |(edits, cut)| {
            let mut bytes = valid.clone();
            for (at, byte) in edits {
                let i = ((at * len as f64) as usize).min(len.saturating_sub(1));
                if let Some(b) = bytes.get_mut(i) {
                    *b = byte;
                }
            }
            if let Some(cut) = cut {
                bytes.truncate((cut * len as f64) as usize);
            }
            bytes
        })
}
