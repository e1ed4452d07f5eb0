//! The `vrtspike` binary on a GPU host: `info` sees libtorch's CUDA, NCCL and the
//! device; `profile --device cuda` measures the tiny VRT-Spike per part.

use std::process::Command;

use serde_json::Value;

use super::{cuda, root, vrtspike_bin};

fn run_json(args: &[&str]) -> Value {
    let out = Command::new(vrtspike_bin())
        .args(args)
        .current_dir(root())
        .output()
        .unwrap_or_else(|e| panic!("running {} {args:?}: {e}", vrtspike_bin().display()));
    assert!(
        out.status.success(),
        "vrtspike {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "vrtspike {args:?}: not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

#[test]
fn info_sees_cuda_nccl_and_the_device() {
    let _ = cuda();
    let info = run_json(&["info", "--json"]);
    assert_eq!(info["torch_cuda"]["state"], "loaded", "{info:#}");
    assert_eq!(info["cuda_backend_registered"], true, "{info:#}");
    assert_eq!(info["nccl"]["state"], "compiled", "{info:#}");
    assert!(info["nccl"]["runtime"]["Ok"].is_string(), "{info:#}");
    let devices = info["devices"]["Ok"].as_array().expect("a device list");
    assert!(!devices.is_empty(), "{info:#}");
    assert!(devices[0]["total_memory"].as_u64().unwrap_or(0) > 1 << 30);
    assert!(
        info["nvml_driver"]["Ok"].is_string(),
        "NVML: {}",
        info["nvml_driver"]
    );
}

#[test]
fn profile_on_cuda_measures_every_part() {
    let _ = cuda();
    let profile = run_json(&[
        "profile",
        "--config",
        "configs/tiny/vrt_spike_tiny.yaml",
        "--device",
        "cuda",
        "--frames",
        "3",
        "--size",
        "64",
        "--iters",
        "2",
        "--bf16",
        "--json",
    ]);
    assert_eq!(profile["device"], "cuda:0", "{profile:#}");
    let parts = profile["parts"].as_array().expect("parts");
    assert!(parts.len() >= 10, "{profile:#}");
    for part in parts {
        assert!(part["forward_ms"].as_f64().unwrap_or(-1.0) >= 0.0, "{part}");
        assert!(
            part["forward_peak_bytes"].as_u64().is_some(),
            "no CUDA peak: {part}"
        );
    }
    assert!(profile["backward_ms"].as_f64().unwrap_or(0.0) > 0.0);
    let peak = &profile["cuda_peak"];
    let allocated = peak["allocated_bytes"].as_u64().unwrap_or(0);
    assert!(
        allocated > 0 && peak["reserved_bytes"].as_u64().unwrap_or(0) >= allocated,
        "{peak}"
    );
}
