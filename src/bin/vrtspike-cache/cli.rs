//! `vrtspike`'s command lines of what runs here, the same files.

#[path = "../../cli/bench.rs"]
pub mod bench;
#[path = "../../cli/cache.rs"]
pub mod cache;
