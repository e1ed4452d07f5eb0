// Builds the c10d shim (src/ddp/shim/c10d_shim.cpp) with the `cc` crate
// against the headers of the torch wheel that tch links, so Rust can reach
// libtorch's distributed engine. Included by build.rs (not a crate).
//
// Against a CUDA libtorch the NCCL backend and the CUDA allocator calls are
// always compiled in: the CUDA and NCCL headers come from the venv (`make
// setup`), and a build that cannot find them fails naming what is missing.
// VRTSPIKE_NO_NCCL builds a Gloo-only shim on purpose (with a warning); a
// CPU-only libtorch gets one too. The compiled archive is reused while the
// source and flags are unchanged (cc caches nothing). VRTSPIKE_CUDA_INCLUDE
// (colon-separated) / VRTSPIKE_NCCL_INCLUDE point at headers elsewhere.
//
// Every linked target also loads `libtorch_cuda.so` and `libc10_cuda.so` when
// the libtorch has them (`link_torch_cuda`): nothing in the binary calls them,
// so the linker's `--as-needed` would drop them and libtorch would never
// register its CUDA backend.

/// What the shim is built against.
struct ShimTorch {
    /// The wheel's `torch` folder (or `$LIBTORCH`).
    root: std::path::PathBuf,
    /// `torch._C._GLIBCXX_USE_CXX11_ABI` as "0" or "1".
    cxx11_abi: String,
}

/// Finds torch the way torch-sys does: `$LIBTORCH`, else the virtualenv's python.
fn shim_find_torch() -> Option<ShimTorch> {
    if let Ok(root) = std::env::var("LIBTORCH") {
        let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_string());
        return Some(ShimTorch { root: root.into(), cxx11_abi: abi });
    }
    let python = match std::env::var_os("VIRTUAL_ENV") {
        Some(venv) => std::path::Path::new(&venv).join("bin").join("python"),
        None => std::path::PathBuf::from("python3"),
    };
    let script = "import os, torch; print(os.path.dirname(torch.__file__)); \
                  print(int(torch._C._GLIBCXX_USE_CXX11_ABI))";
    let out = std::process::Command::new(&python).args(["-c", script]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let mut lines = text.lines();
    let root = lines.next()?.trim().to_string();
    let cxx11_abi = lines.next()?.trim().to_string();
    Some(ShimTorch { root: root.into(), cxx11_abi })
}

/// What the c10d shim is built with on the CUDA side.
enum ShimCuda {
    /// The CUDA and NCCL headers were found: NCCL and the CUDA allocator calls go in.
    Nccl(Vec<std::path::PathBuf>),
    /// `VRTSPIKE_NO_NCCL` asked for a Gloo-only shim.
    Disabled,
    /// The libtorch being linked has no CUDA (`libtorch_cuda.so` absent): Gloo only.
    CpuTorch,
}

/// Decides the shim's CUDA side. A CUDA libtorch without the headers fails the build
/// with what to do, unless `VRTSPIKE_NO_NCCL` asks for a Gloo-only shim: NCCL is never
/// dropped silently.
fn shim_cuda(torch: &ShimTorch) -> ShimCuda {
    if std::env::var_os("VRTSPIKE_NO_NCCL").is_some() {
        println!("cargo:warning=VRTSPIKE_NO_NCCL is set: the c10d shim is built without NCCL (Gloo only; `vrtspike info` says so)");
        return ShimCuda::Disabled;
    }
    if !torch_has_cuda(&torch.root) {
        println!("cargo:warning=the linked libtorch has no CUDA ({} lacks libtorch_cuda.so): the c10d shim is built without NCCL", torch.root.join("lib").display());
        return ShimCuda::CpuTorch;
    }
    match shim_cuda_includes(&torch.root) {
        Ok(dirs) => ShimCuda::Nccl(dirs),
        Err(missing) => panic!(
            "c10d shim: the linked libtorch has CUDA, but {missing}. Run `make setup` \
             (it installs cuda-toolkit[cccl,crt] and nvidia-nccl-cu13 into the venv), point \
             VRTSPIKE_CUDA_INCLUDE / VRTSPIKE_NCCL_INCLUDE at the headers, or build without \
             NCCL on purpose with VRTSPIKE_NO_NCCL=1 (`make build NCCL=0`)"
        ),
    }
}

/// Whether the libtorch under `torch_root` was built with CUDA.
fn torch_has_cuda(torch_root: &std::path::Path) -> bool {
    torch_root.join("lib").join("libtorch_cuda.so").is_file()
}

/// Include folders for the NCCL build, or what is missing.
/// Looks at `$VRTSPIKE_CUDA_INCLUDE` (colon-separated), `$CUDA_HOME/include`,
/// the wheel's `nvidia/cu13/include` (+ its `cccl`), `/usr/local/cuda/include`,
/// and for NCCL `$VRTSPIKE_NCCL_INCLUDE` or the wheel's `nvidia/nccl/include`.
fn shim_cuda_includes(torch_root: &std::path::Path) -> Result<Vec<std::path::PathBuf>, String> {
    use std::path::PathBuf;
    let nvidia = torch_root.parent().map(|site| site.join("nvidia"));
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(list) = std::env::var("VRTSPIKE_CUDA_INCLUDE") {
        candidates.extend(std::env::split_paths(&list));
    }
    if let Ok(home) = std::env::var("CUDA_HOME") {
        candidates.push(PathBuf::from(home).join("include"));
    }
    if let Some(nvidia) = &nvidia {
        candidates.push(nvidia.join("cu13").join("include"));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    let looked = candidates
        .iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let mut dirs: Vec<PathBuf> = Vec::new();
    for dir in candidates.into_iter().filter(|d| d.is_dir()) {
        let cccl = dir.join("cccl");
        dirs.push(dir);
        if cccl.is_dir() {
            dirs.push(cccl);
        }
    }
    let has = |file: &str| dirs.iter().any(|d| d.join(file).is_file());
    for (file, package) in [
        ("cuda_runtime.h", "cuda-toolkit[cudart]"),
        ("crt/host_config.h", "cuda-toolkit[crt]"),
        ("cuda/std/cstdint", "cuda-toolkit[cccl]"),
    ] {
        if !has(file) {
            return Err(format!("no {file} (from {package}) under {looked}"));
        }
    }
    let nccl = match std::env::var("VRTSPIKE_NCCL_INCLUDE") {
        Ok(dir) => PathBuf::from(dir),
        Err(_) => nvidia
            .map(|n| n.join("nccl").join("include"))
            .unwrap_or_default(),
    };
    if !nccl.join("nccl.h").is_file() {
        return Err(format!("no nccl.h (from nvidia-nccl-cu13) in {}", nccl.display()));
    }
    dirs.insert(0, nccl);
    Ok(dirs)
}

/// Links `libtorch_cuda.so` and `libc10_cuda.so` as NEEDED into every target of
/// the package that links libtorch (the `vrtspike` binary, tests, examples,
/// benches), whatever the linker's `--as-needed` would decide, and tells the crate
/// (`VRTSPIKE_LINKED_TORCH_CUDA`) so a test can check they are mapped at run time.
fn link_torch_cuda() {
    let arg = "-Wl,--push-state,--no-as-needed,-ltorch_cuda,-lc10_cuda,--pop-state";
    for target in ["-bin=vrtspike=", "-tests=", "-benches=", "-examples="] {
        println!("cargo:rustc-link-arg{target}{arg}");
    }
    println!("cargo:rustc-env=VRTSPIKE_LINKED_TORCH_CUDA=1");
}

/// The header both shims include (`vs_errors.h`): its folder goes on their include
/// path, its text into their compile-cache key.
const SHIM_ERRORS_HEADER: &str = "src/util/shim/vs_errors.h";

/// `build` with the shared shim header on its include path.
fn shim_with_common_header(build: &mut cc::Build) {
    println!("cargo:rerun-if-changed={SHIM_ERRORS_HEADER}");
    if let Some(dir) = std::path::Path::new(SHIM_ERRORS_HEADER).parent() {
        build.include(dir);
    }
}

/// Compiles and links the shim; panics (failing the build) if torch is missing.
fn build_c10d_shim() {
    const SOURCE: &str = "src/ddp/shim/c10d_shim.cpp";
    println!("cargo:rerun-if-changed={SOURCE}");
    println!("cargo:rerun-if-changed=build/shim.rs");
    for var in [
        "VRTSPIKE_CUDA_INCLUDE",
        "VRTSPIKE_NCCL_INCLUDE",
        "VRTSPIKE_NO_NCCL",
        "CUDA_HOME",
        "LIBTORCH_CXX11_ABI",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let torch = match shim_find_torch() {
        Some(torch) => torch,
        None => panic!("c10d shim: torch not found (set VIRTUAL_ENV or LIBTORCH; run `make setup`)"),
    };
    let include = torch.root.join("include");
    let lib_dir = torch.root.join("lib");
    let shim_cuda = shim_cuda(&torch);
    let (cuda, nccl_state) = match &shim_cuda {
        ShimCuda::Nccl(dirs) => (Some(dirs.clone()), "compiled"),
        ShimCuda::Disabled => (None, "disabled"),
        ShimCuda::CpuTorch => (None, "cpu-torch"),
    };
    // Read by `ddp::runtime` to say why NCCL is absent.
    println!("cargo:rustc-env=VRTSPIKE_SHIM_NCCL={nccl_state}");

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .file(SOURCE)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", torch.cxx11_abi.as_str())
        .define("USE_C10D_GLOO", None)
        .define("GLOG_USE_GLOG_EXPORT", None);
    shim_with_common_header(&mut build);
    if let Some(dirs) = &cuda {
        build.define("USE_C10D_NCCL", None).define("VS_WITH_NCCL", None);
        for dir in dirs {
            build.include(dir);
        }
    }

    let started = std::time::Instant::now();
    let compiled = shim_compile_cached(
        build,
        "c10d_shim",
        "c10d-shim",
        &[SOURCE],
        &format!("{}\n{}\n{:?}", torch.root.display(), torch.cxx11_abi, cuda),
    );
    if compiled {
        // Not a cargo directive: kept in the build script's `output` file.
        println!(
            "c10d shim compiled in {:.1}s (NCCL: {})",
            started.elapsed().as_secs_f64(),
            if cuda.is_some() { "yes" } else { "no" }
        );
    }
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    if cuda.is_some() {
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
    }
    if torch_has_cuda(&torch.root) {
        link_torch_cuda();
    }
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
}

/// Links the static library `lib` built from `sources` by `build`, reusing an
/// archive compiled earlier from the same sources and `flags` (cc caches
/// nothing). The archive is kept under `<profile>/<cache>/<hash>/` beside the
/// profile's build folders so `cargo build` and `cargo test` (distinct
/// build-script runs) share it. Returns whether it compiled.
fn shim_compile_cached(
    build: cc::Build,
    lib: &str,
    cache: &str,
    sources: &[&str],
    flags: &str,
) -> bool {
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap_or_default());
    let source_text: String = sources
        .iter()
        .map(|source| std::fs::read_to_string(source).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n");
    let header_text = std::fs::read_to_string(SHIM_ERRORS_HEADER).unwrap_or_default();
    let stamp = format!("{flags}\n{source_text}\n{header_text}");
    let key = {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        stamp.hash(&mut hasher);
        format!("{:016x}", hasher.finish())
    };
    let profile_dir = out_dir.ancestors().nth(3).map(|d| d.to_path_buf());
    let cache_dir = profile_dir
        .unwrap_or_else(|| out_dir.clone())
        .join(cache)
        .join(&key);
    let archive = format!("lib{lib}.a");
    let cached = cache_dir.join(&archive);
    if cached.is_file() {
        // An archive of an older source left in OUT_DIR would win the link whenever
        // the other shim was compiled (cc adds OUT_DIR to the search path).
        let _ = std::fs::remove_file(out_dir.join(&archive));
        println!("cargo:rustc-link-search=native={}", cache_dir.display());
        println!("cargo:rustc-link-lib=static={lib}");
        println!("cargo:rustc-link-lib=stdc++");
        println!("{lib} reused from {}", cache_dir.display());
        return false;
    }
    build.compile(lib);
    if std::fs::create_dir_all(&cache_dir).is_ok() {
        let partial = cache_dir.join(format!("{archive}.partial"));
        if std::fs::copy(out_dir.join(&archive), &partial).is_ok() {
            let _ = std::fs::rename(&partial, &cached);
        }
    }
    true
}
