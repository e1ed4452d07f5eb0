//! Build script: links every binary and test of this package with an rpath to the
//! libtorch of the project's virtualenv, so binaries run without LD_LIBRARY_PATH.

include!("build/torch_rpath.rs");

fn main() {
    torch_rpath();
}
