//! Build script: links every binary and test of this package with an rpath to the
//! libtorch of the project's virtualenv, so binaries run without LD_LIBRARY_PATH, and
//! compiles the c10d shim (`src/ddp/shim/`) that gives Rust libtorch's distributed engine
//! and the activation-checkpointing shim (`src/model/shim/`). (The cache server,
//! `vrtspike-cache`, is built by `crates/data`, which links no libtorch.) It also
//! marks the tests this machine cannot run as ignored (`build/facilities.rs`):
//! `vrtspike_no_root` (a client or server run as `nobody`), `vrtspike_no_python3`
//! (`python3` on `PATH`, for a flood of connections and a fake server),
//! `vrtspike_no_tensorboard` (tensorboard in the workspace's `.venv`).

include!("build/torch_rpath.rs");
include!("build/shim.rs");
include!("build/checkpoint_shim.rs");
include!("build/facilities.rs");

fn main() {
    torch_rpath();
    build_c10d_shim();
    build_checkpoint_shim();
    println!("cargo:rerun-if-changed=build/facilities.rs");
    facilities(&[
        ("vrtspike_no_root", !runs_as_root()),
        ("vrtspike_no_python3", on_path("python3").is_none()),
        ("vrtspike_no_tensorboard", !has_tensorboard()),
    ]);
}

/// Whether the workspace's `.venv` has tensorboard installed (what
/// `tests/tensorboard_reader.rs` reads event files with).
fn has_tensorboard() -> bool {
    let lib = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/lib");
    println!("cargo:rerun-if-changed={}", lib.display());
    std::fs::read_dir(&lib)
        .into_iter()
        .flatten()
        .flatten()
        .any(|python| python.path().join("site-packages/tensorboard").is_dir())
}
