//! The library's testkit parts the benchmarks use.

#[path = "../../testkit/fault.rs"]
pub mod fault;
#[path = "../../testkit/process.rs"]
pub mod process;
#[path = "../../testkit/record.rs"]
pub mod record;
