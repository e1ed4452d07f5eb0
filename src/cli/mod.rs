//! The `vrtspike` subcommands: argument types and the glue from them to the library.

pub mod analyze;
pub mod bench;
pub mod cache;
pub mod demo;
pub mod plot;

use anyhow::Result;

/// `vrtspike info`: what this binary links and sees.
pub fn info() -> Result<()> {
    println!("vrtspike {}", env!("CARGO_PKG_VERSION"));
    println!("libtorch cuda available: {}", tch::Cuda::is_available());
    println!("cuda devices: {}", tch::Cuda::device_count());
    println!("cpu threads: {}", tch::get_num_threads());
    Ok(())
}
