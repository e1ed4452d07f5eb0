//! `vrtspike h5-probe` and `vrtspike-cache h5-probe` (hidden): the child process
//! that reads an HDF5 session file before its parent does (`dataset::h5_probe`), so
//! a libhdf5 crash on a corrupt file kills this process, not a rank, the cache
//! server or a Python DataLoader worker. `--serve` answers the parent's requests;
//! with file arguments it checks those and prints a verdict.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::dataset::h5_probe;

/// Arguments of `vrtspike h5-probe`.
#[derive(Args)]
pub struct H5ProbeArgs {
    /// Answer a parent's probe requests on stdin/stdout (the library starts this).
    #[arg(long, conflicts_with = "files")]
    serve: bool,
    /// Session files to check in this process.
    files: Vec<PathBuf>,
}

/// Serves the parent, or checks `files` and fails if any is unusable.
pub fn run(args: H5ProbeArgs) -> Result<()> {
    if args.serve {
        return h5_probe::serve_stdio().context("h5-probe --serve: the parent's socket failed");
    }
    if args.files.is_empty() {
        bail!("h5-probe: give session files to check, or --serve");
    }
    let mut bad = 0;
    for file in &args.files {
        match h5_probe::probe_here(file) {
            Ok(()) => println!("{}: ok", file.display()),
            Err(err) => {
                println!("{err}");
                bad += 1;
            }
        }
    }
    if bad > 0 {
        bail!(
            "{bad} of {} HDF5 session files are unusable",
            args.files.len()
        );
    }
    Ok(())
}
