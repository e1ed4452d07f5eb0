//! For unit tests whose check other tests would disturb (the process's heap or
//! resident set): run an `#[ignore]`d test alone in a fresh process of the same test
//! binary. Test builds only.

use std::process::{Command, Stdio};

/// Runs the `#[ignore]`d unit test `test` (its full path) of the current test binary
/// alone in a fresh process, without the environment variables `env_remove`: for a
/// check that other tests' threads and memory would disturb. Returns the process's
/// output when the test ran and passed, else a message with that output.
pub fn run_ignored_test_alone(test: &str, env_remove: &[&str]) -> Result<String, String> {
    let exe = std::env::current_exe().map_err(|e| format!("the test binary: {e}"))?;
    let mut command = Command::new(exe);
    command
        .args([
            "--exact",
            test,
            "--ignored",
            "--test-threads=1",
            "--nocapture",
        ])
        .stdin(Stdio::null());
    for name in env_remove {
        command.env_remove(name);
    }
    let out = command
        .output()
        .map_err(|e| format!("running {test}: {e}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        return Err(format!("{test} failed: {text}"));
    }
    if !text.contains("1 passed") {
        return Err(format!("{test} did not run: {text}"));
    }
    Ok(text)
}
