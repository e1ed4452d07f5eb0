//! Build script: links every binary and test of this package with an rpath to the
//! libtorch of the project's virtualenv, so binaries run without LD_LIBRARY_PATH, and
//! compiles the c10d shim (`src/ddp/shim/`) that gives Rust libtorch's distributed engine
//! and the activation-checkpointing shim (`src/model/shim/`), and gives the binaries
//! the build id of the cache server's sources (`vrtspike-cache`, which links no
//! libtorch).

include!("build/torch_rpath.rs");
include!("build/shim.rs");
include!("build/checkpoint_shim.rs");
include!("build/cache_build_id.rs");

fn main() {
    torch_rpath();
    build_c10d_shim();
    build_checkpoint_shim();
    cache_build_id();
}
