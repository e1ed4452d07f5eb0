// Shared by the build scripts of the workspace's packages (included, not a crate):
// finds the torch wheel's `lib` folder the way torch-sys does (the virtualenv's
// `python` when VIRTUAL_ENV is set, else `python3`) and adds it as an rpath.

/// Emits `-Wl,-rpath,<torch>/lib` for every linked target of the package.
fn torch_rpath() {
    println!("cargo:rerun-if-env-changed=VIRTUAL_ENV");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-changed=build/torch_rpath.rs");
    let lib_dir = match std::env::var("LIBTORCH") {
        Ok(root) => Some(std::path::Path::new(&root).join("lib").display().to_string()),
        Err(_) => {
            let python = match std::env::var_os("VIRTUAL_ENV") {
                Some(venv) => std::path::Path::new(&venv).join("bin").join("python"),
                None => std::path::PathBuf::from("python3"),
            };
            let script = "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))";
            std::process::Command::new(&python)
                .args(["-c", script])
                .output()
                .ok()
                .filter(|out| out.status.success())
                .and_then(|out| String::from_utf8(out.stdout).ok())
                .map(|s| s.trim().to_string())
        }
    };
    match lib_dir {
        Some(dir) => println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}"),
        None => println!(
            "cargo:warning=torch not found: binaries will need LD_LIBRARY_PATH (run `make setup`)"
        ),
    }
}
