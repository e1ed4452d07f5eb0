//! Which facilities of this machine the launcher's tests cannot have, as `cfg`s
//! that mark those tests ignored, so `cargo test` counts them in its closing line
//! ("N ignored") instead of passing them after printing "skipped":
//!
//! - `vrtspike_no_root`: the build does not run as root (network namespaces, mounts);
//! - `vrtspike_no_ip`: no `ip` (iproute2) on `PATH`;
//! - `vrtspike_no_torchrun`: no `torchrun` in `$VIRTUAL_ENV` or the workspace's `.venv`;
//! - `vrtspike_skip_real_slurm`: `VRTSPIKE_SKIP_REAL_SLURM=1` (the tests under a real
//!   Slurm, which need root and Debian's slurm-wlm and munge).
//!
//! (The checks are `../build/facilities.rs`, shared with the workspace's package.)
//! Under `CI=true` none is set: CI runs as root with torchrun installed, so every
//! test runs there and one whose facility is missing fails, saying what it needs.
//! A test that is not ignored fails the same way when its facility is missing at
//! run time (built as root, run as another user).

use std::path::{Path, PathBuf};

include!("../build/facilities.rs");

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../build/facilities.rs");
    for var in [
        "VIRTUAL_ENV",
        "USER",
        "SUDO_USER",
        "VRTSPIKE_SKIP_REAL_SLURM",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let torchrun = torchrun();
    if let Some(bin) = torchrun.as_deref().and_then(Path::parent) {
        println!("cargo:rerun-if-changed={}", bin.display());
    }
    facilities(&[
        ("vrtspike_no_root", !runs_as_root()),
        ("vrtspike_no_ip", on_path("ip").is_none()),
        ("vrtspike_no_torchrun", torchrun.is_none()),
        (
            "vrtspike_skip_real_slurm",
            std::env::var("VRTSPIKE_SKIP_REAL_SLURM").is_ok_and(|v| v == "1"),
        ),
    ]);
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
