//! What tests and benchmarks share: a cache server spawned as a child process of
//! the `vrtspike` binary ([`process`]), synthetic records that prove their own
//! integrity ([`record`]) and faults a well-behaved client never makes ([`fault`]).
//! It sits on `cache`; no library layer imports it.

pub mod fault;
pub mod process;
pub mod record;
