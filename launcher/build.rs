//! Which facilities of this machine the launcher's tests cannot have, as `cfg`s
//! that mark those tests ignored, so `cargo test` counts them in its closing line
//! ("N ignored") instead of passing them after printing "skipped":
//!
//! - `vrtspike_no_root`: the build does not run as root (network namespaces, mounts);
//! - `vrtspike_no_ip`: no `ip` (iproute2) on `PATH`;
//! - `vrtspike_no_torchrun`: no `torchrun` in `$VIRTUAL_ENV` or the workspace's `.venv`.
//!
//! Under `CI=true` none is set: CI runs as root with torchrun installed, so every
//! test runs there and one whose facility is missing fails, saying what it needs.
//! A test that is not ignored fails the same way when its facility is missing at
//! run time (built as root, run as another user).

use std::path::{Path, PathBuf};

fn main() {
    for cfg in ["vrtspike_no_root", "vrtspike_no_ip", "vrtspike_no_torchrun"] {
        println!("cargo:rustc-check-cfg=cfg({cfg})");
    }
    println!("cargo:rerun-if-changed=build.rs");
    for var in ["CI", "VIRTUAL_ENV", "PATH", "USER", "SUDO_USER"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        return;
    }
    if !runs_as_root() {
        println!("cargo:rustc-cfg=vrtspike_no_root");
    }
    if on_path("ip").is_none() {
        println!("cargo:rustc-cfg=vrtspike_no_ip");
    }
    let torchrun = torchrun();
    if let Some(bin) = torchrun.as_deref().and_then(Path::parent) {
        println!("cargo:rerun-if-changed={}", bin.display());
    }
    if torchrun.is_none() {
        println!("cargo:rustc-cfg=vrtspike_no_torchrun");
    }
}

/// Whether the effective uid is 0 (from `/proc/self/status`).
fn runs_as_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .is_some_and(|effective| effective == "0")
}

/// `name` on `PATH`.
fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|exe| exe.is_file())
}

/// torchrun of the project's virtualenv (as `tests/launch_torchrun.rs` finds it).
fn torchrun() -> Option<PathBuf> {
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from)?;
    let venvs = [
        std::env::var_os("VIRTUAL_ENV").map(PathBuf::from),
        Some(manifest.join("..").join(".venv")),
    ];
    venvs
        .into_iter()
        .flatten()
        .map(|venv| venv.join("bin/torchrun"))
        .find(|exe| exe.is_file())
}
