//! The `vrtspike` subcommands, one file each: argument types, the glue from them to
//! the library, and printing. Library logic lives in the library; this folder only
//! parses, calls and prints. `cache`, `bench` and `h5-probe` are `vrtspike-data`'s
//! command line (`crates/data/src/cli/`), which the `vrtspike-cache` binary shares.

pub use vrtspike_data::cli::{bench, cache, h5_probe};

pub mod analyze;
pub mod config;
pub mod demo;
pub mod infer;
pub mod info;
pub mod inspect;
pub mod model;
pub mod plan;
pub mod plot;
pub mod profile;
pub mod synth;
pub mod train;

use anyhow::{bail, Result};
use tch::Device;

/// Parses `cpu`, `cuda` or `cuda:N`, and refuses a CUDA device this process cannot
/// see (libtorch would panic at the first tensor put there).
pub fn parse_device(name: &str) -> Result<Device> {
    let device = parse_device_name(name)?;
    if let Device::Cuda(index) = device {
        let visible = tch::Cuda::device_count();
        if index as i64 >= visible {
            bail!(
                "--device {name}: no such CUDA device ({visible} visible to this process; \
                 `vrtspike info` lists them)"
            );
        }
    }
    Ok(device)
}

/// The device `name` spells: `cpu`, `cuda` or `cuda:N`.
fn parse_device_name(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(i)) => Ok(Device::Cuda(i)),
            _ => bail!("--device {other:?}: expected cpu, cuda or cuda:N"),
        },
    }
}

/// 18320007 -> "18,320,007".
pub fn group_digits(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn digits_are_grouped() {
        assert_eq!(group_digits(18_320_007), "18,320,007");
        assert_eq!(group_digits(300), "300");
        assert_eq!(group_digits(1000), "1,000");
    }

    #[test]
    fn devices_parse() {
        assert_eq!(parse_device("cpu").unwrap(), Device::Cpu);
        assert_eq!(parse_device_name("cuda:1").unwrap(), Device::Cuda(1));
        assert_eq!(parse_device_name("cuda").unwrap(), Device::Cuda(0));
        assert!(parse_device("gpu").is_err());
        // No machine has 4097 GPUs: an error naming the device, not tch's panic.
        let err = parse_device("cuda:4096").unwrap_err().to_string();
        assert!(
            err.contains("cuda:4096") && err.contains("no such CUDA device"),
            "{err}"
        );
    }
}
