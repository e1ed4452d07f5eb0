//! Build script: links every binary and test of this package with an rpath to the
//! libtorch of the project's virtualenv, so binaries run without LD_LIBRARY_PATH, and
//! compiles the c10d shim (`src/ddp/shim/`) that gives Rust libtorch's distributed engine
//! and the activation-checkpointing shim (`src/model/shim/`). (The cache server,
//! `vrtspike-cache`, is built by `crates/data`, which links no libtorch.)

include!("build/torch_rpath.rs");
include!("build/shim.rs");
include!("build/checkpoint_shim.rs");

fn main() {
    torch_rpath();
    build_c10d_shim();
    build_checkpoint_shim();
}
