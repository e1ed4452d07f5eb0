// Builds the shims of the model and of the training step against the same torch
// headers as the c10d shim (build/shim.rs, whose `shim_find_torch` and
// `shim_compile_cached` it uses): `vs_checkpoint` from src/model/shim/
// (checkpoint.cpp, the activation checkpointing and backward hook; kernels.cpp, the
// attention-kernel and autocast switches) and `vs_train` from src/train/shim/
// (update.cpp, the optimizer step's multi-tensor kernels; transfer.cpp, batches to the
// GPU through page-locked memory on a side stream). Two archives, so a
// change to one does not recompile the other. They need no CUDA headers: CUDA
// generators are reached through ATen's hooks. Included by build.rs (not a crate).

/// Compiles and links the model's and the training step's shims; panics (failing
/// the build) if torch is missing.
fn build_checkpoint_shim() {
    println!("cargo:rerun-if-changed=build/checkpoint_shim.rs");
    let torch = match shim_find_torch() {
        Some(torch) => torch,
        None => panic!(
            "checkpoint shim: torch not found (set VIRTUAL_ENV or LIBTORCH; run `make setup`)"
        ),
    };
    compile_torch_shim(
        &torch,
        "vs_checkpoint",
        "checkpoint-shim",
        &["src/model/shim/checkpoint.cpp", "src/model/shim/kernels.cpp"],
    );
    compile_torch_shim(
        &torch,
        "vs_train",
        "train-shim",
        &["src/train/shim/update.cpp", "src/train/shim/transfer.cpp"],
    );
    println!(
        "cargo:rustc-link-search=native={}",
        torch.root.join("lib").display()
    );
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
}

/// Compiles `sources` into the static library `lib` (reused from the compile cache
/// `cache` when nothing changed) and links it.
fn compile_torch_shim(torch: &ShimTorch, lib: &str, cache: &str, sources: &[&str]) {
    for source in sources {
        println!("cargo:rerun-if-changed={source}");
    }
    let include = torch.root.join("include");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .files(sources)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", torch.cxx11_abi.as_str())
        .define("GLOG_USE_GLOG_EXPORT", None);
    shim_with_common_header(&mut build);
    let started = std::time::Instant::now();
    let flags = format!("{}\n{}", torch.root.display(), torch.cxx11_abi);
    if shim_compile_cached(build, lib, cache, sources, &flags) {
        // Not a cargo directive: kept in the build script's `output` file.
        println!(
            "{lib} compiled in {:.1}s",
            started.elapsed().as_secs_f64()
        );
    }
}
