// Shared by the build scripts of the workspace's packages (included, not a crate):
// which facilities of this machine some tests cannot have, emitted as `cfg`s that
// mark those tests ignored, so `cargo test` counts them in its closing line ("N
// ignored") instead of passing them after printing "skipped". Under `CI=true`
// none is set: CI runs as root with every tool installed, so each such test runs
// there and fails if its facility is missing. A test that is not ignored fails
// the same way when its facility is missing at run time (built as root, run as
// another user).

/// Whether the build runs under `CI=true` (then no facility is reported missing).
fn in_ci() -> bool {
    println!("cargo:rerun-if-env-changed=CI");
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Declares the facility `cfg`s a package's tests use; sets those missing here
/// (`missing`: its name and whether it is missing).
fn facilities(missing: &[(&str, bool)]) {
    for (cfg, _) in missing {
        println!("cargo:rustc-check-cfg=cfg({cfg})");
    }
    if in_ci() {
        return;
    }
    for (cfg, lacking) in missing {
        if *lacking {
            println!("cargo:rustc-cfg={cfg}");
        }
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
fn on_path(name: &str) -> Option<std::path::PathBuf> {
    println!("cargo:rerun-if-env-changed=PATH");
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|exe| exe.is_file())
}
