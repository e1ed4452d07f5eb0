//! `vrtspike info`: the versions and devices this binary sees.

use anyhow::Result;

/// Prints what this binary links and sees.
pub fn run() -> Result<()> {
    println!("vrtspike {}", env!("CARGO_PKG_VERSION"));
    println!("libtorch cuda available: {}", tch::Cuda::is_available());
    println!("cuda devices: {}", tch::Cuda::device_count());
    println!("cpu threads: {}", tch::get_num_threads());
    Ok(())
}
