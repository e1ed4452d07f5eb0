//! `vrtspike info`: the versions and devices this binary sees, line by line (or as
//! JSON): libtorch and the CUDA it was built for, whether libtorch's CUDA library is
//! loaded, NCCL in the c10d shim, cuDNN, the devices, the NVML driver.

use anyhow::Result;
use clap::Args;
use serde::Serialize;
use vrtspike::ddp::{torch_runtime, Nccl, TorchCudaLib, TorchRuntime};

/// Arguments of `vrtspike info`.
#[derive(Args)]
pub struct InfoArgs {
    /// Print one JSON object instead of lines.
    #[arg(long)]
    json: bool,
}

/// The whole report.
#[derive(Serialize)]
struct Info {
    vrtspike: &'static str,
    #[serde(flatten)]
    torch: TorchRuntime,
    nvml_driver: Result<String, String>,
    cpu_threads: i32,
}

/// Prints what this binary links and sees.
pub fn run(args: InfoArgs) -> Result<()> {
    let info = Info {
        vrtspike: env!("CARGO_PKG_VERSION"),
        torch: torch_runtime(),
        nvml_driver: nvml_driver(),
        cpu_threads: tch::get_num_threads(),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&info)?);
    } else {
        print_lines(&info);
    }
    Ok(())
}

/// The driver version NVML reports, or why NVML could not answer.
fn nvml_driver() -> Result<String, String> {
    let nvml = nvml_wrapper::Nvml::init().map_err(|e| format!("NVML not available: {e}"))?;
    nvml.sys_driver_version()
        .map_err(|e| format!("NVML has no driver version: {e}"))
}

fn print_lines(info: &Info) {
    let t = &info.torch;
    println!("vrtspike {}", info.vrtspike);
    println!(
        "libtorch: {} (built for CUDA {})",
        t.torch_version,
        t.cuda_built
            .as_deref()
            .unwrap_or("-: no CUDA backend registered")
    );
    match &t.torch_cuda {
        TorchCudaLib::Loaded { path } => println!("libtorch_cuda: loaded ({})", path.display()),
        TorchCudaLib::Missing => {
            println!("libtorch_cuda: NOT loaded although the build linked it (CUDA unusable)")
        }
        TorchCudaLib::NotInBuild => println!("libtorch_cuda: not in this build's libtorch"),
    }
    println!(
        "CUDA backend registered: {}",
        if t.cuda_backend_registered {
            "yes"
        } else {
            "no"
        }
    );
    match &t.nccl {
        Nccl::Compiled { runtime: Ok(v) } => {
            println!("NCCL: compiled into the c10d shim; library {v}")
        }
        Nccl::Compiled { runtime: Err(e) } => {
            println!("NCCL: compiled into the c10d shim; library version unknown ({e})")
        }
        Nccl::Absent { reason } => println!("NCCL: not compiled in ({reason})"),
    }
    println!(
        "cuDNN: built with {}, loaded {}",
        t.cudnn_built.as_deref().unwrap_or("-"),
        t.cudnn_loaded.as_deref().unwrap_or("-")
    );
    match &t.devices {
        Ok(devices) if devices.is_empty() => println!("CUDA devices: none visible"),
        Ok(devices) => {
            println!("CUDA devices: {}", devices.len());
            for d in devices {
                println!(
                    "  cuda:{}: {}, {:.1} GiB, compute capability {}, {} SMs",
                    d.index,
                    d.name,
                    d.total_memory as f64 / (1u64 << 30) as f64,
                    d.compute_capability,
                    d.multiprocessors
                );
            }
        }
        Err(e) => println!("CUDA devices: cannot list them ({e})"),
    }
    match &info.nvml_driver {
        Ok(v) => println!("NVML driver: {v}"),
        Err(e) => println!("NVML driver: - ({e})"),
    }
    println!("cpu threads: {}", info.cpu_threads);
}
