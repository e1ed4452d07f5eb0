//! Benchmarks and stress loads that `vrtspike bench` runs and the tests reuse:
//! checksummed synthetic records and the cache benchmark's driver and workers.

pub mod cache;
pub mod histogram;
pub mod process;
pub mod record;
