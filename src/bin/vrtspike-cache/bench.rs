//! The library's benchmarks, which run no model.

#[path = "../../bench/cache.rs"]
pub mod cache;
#[path = "../../bench/histogram.rs"]
pub mod histogram;
#[path = "../../bench/loader.rs"]
pub mod loader;
#[path = "../../bench/policy.rs"]
pub mod policy;
