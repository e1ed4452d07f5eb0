//! `cargo bench --bench cache`: runs `vrtspike bench cache --json` (the same
//! benchmark `make bench` runs) with the binary cargo built, and prints its JSON.

use std::process::Command;

fn main() {
    let status = Command::new(env!("CARGO_BIN_EXE_vrtspike"))
        .args(["bench", "cache", "--json"])
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => {
            eprintln!("vrtspike bench cache failed: {s}");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("cannot run vrtspike: {e}");
            std::process::exit(1);
        }
    }
}
