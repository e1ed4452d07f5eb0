//! What tests and benchmarks share: a cache server spawned as a child process of
//! the `vrtspike` binary ([`process`]) and synthetic records that prove their own
//! integrity ([`record`]). It sits on `cache`; no library layer imports it.

pub mod process;
pub mod record;
