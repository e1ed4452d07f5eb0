//! `scripts/gpu_bundle_check.sh` bind-mounts the real venv's site-packages into a
//! stand-in folder for its checks; its clean-up (`release_standin`) must never
//! remove the stand-in through a mount that did not come off, which would delete the
//! real venv. Run in a private mount namespace (root): a bind mount kept busy (a
//! shell whose working directory is inside it) cannot be unmounted; the real files
//! must survive, the stand-in be left in place and named, and the clean-up fail.
//! Where the build does not run as root the test is ignored (`launcher/build.rs`).

use std::path::{Path, PathBuf};
use std::process::Command;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu_bundle_check.sh")
}

/// Runs `body` in bash, in a private mount namespace, with the script sourced (its
/// `set -e` taken back) and
/// `$1` = the real site-packages, `$2` = the stand-in, `$3` = the work folder.
fn in_mount_namespace(body: &str, dirs: [&Path; 3]) -> (i32, String) {
    let output = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "bash", "-c"])
        .arg(format!("source \"$1\"; set +e; shift; {body}"))
        .arg("bundle-check-cleanup")
        .arg(script())
        .args(dirs)
        .output()
        .unwrap_or_else(|e| panic!("running unshare: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.code().unwrap_or(-1), text)
}

fn layout(root: &Path) -> (PathBuf, PathBuf, PathBuf, PathBuf) {
    let real = root.join("venv/site-packages");
    let kept = real.join("torch/__init__.py");
    let standin = root.join("standin");
    let work = root.join("work");
    for dir in [
        real.join("torch"),
        standin.join("site-packages"),
        work.clone(),
    ] {
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    }
    std::fs::write(&kept, "real").unwrap_or_else(|e| panic!("{e}"));
    (real, kept, standin, work)
}

#[test]
#[cfg_attr(vrtspike_no_root, ignore = "needs root for a private mount namespace")]
fn a_stand_in_still_mounted_is_left_in_place_and_the_real_venv_survives() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "this test needs root");
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (real, kept, standin, work) = layout(tmp.path());
    let busy = "mount --bind \"$1\" \"$2/site-packages\" && cd \"$2/site-packages\" \
                && release_standin \"$2\" \"$3\"; echo \"rc=$?\"";
    let (_, said) = in_mount_namespace(busy, [&real, &standin, &work]);
    assert!(kept.is_file(), "the real site-packages was emptied: {said}");
    assert!(said.contains("rc=1"), "the clean-up did not fail: {said}");
    assert!(
        said.contains("still mounted") && said.contains("left in place"),
        "{said}"
    );
    assert!(standin.is_dir(), "{said}");
    assert!(!work.exists(), "the work folder goes anyway: {said}");

    // Unmounted, everything goes (and the real files stay).
    std::fs::create_dir_all(&work).unwrap_or_else(|e| panic!("{e}"));
    let clean = "mount --bind \"$1\" \"$2/site-packages\" && release_standin \"$2\" \"$3\"; \
                 echo \"rc=$?\"";
    let (_, said) = in_mount_namespace(clean, [&real, &standin, &work]);
    assert!(said.contains("rc=0"), "{said}");
    assert!(!standin.exists() && !work.exists(), "{said}");
    assert!(kept.is_file(), "{said}");
}
