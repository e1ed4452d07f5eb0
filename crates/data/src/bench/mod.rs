//! The benchmarks `vrtspike bench` runs (and the stress tests reuse): the cache
//! benchmark's driver and workers ([`cache`]), the loader benchmark over ranks
//! ([`loader`]), its table of eviction policies against Belady's bound
//! ([`policy`]), the store's eviction at a node's scale ([`store`]), the
//! dataset's signature ([`sign`]), the loader's dump of the samples it hands out
//! ([`dump`]) and their latency histogram. They sit on top of the library and
//! `testkit`; no library layer imports them.

pub mod cache;
pub mod dump;
pub mod histogram;
pub mod loader;
pub mod policy;
pub mod sign;
pub mod store;
pub mod worker;
