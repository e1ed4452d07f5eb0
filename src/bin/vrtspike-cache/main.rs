//! `vrtspike-cache`: the node's cache server as a process without libtorch. Every
//! process that links libtorch carries its CUDA libraries' relocations and static
//! initialisers (about 120 MB of private memory, and more than 200 MB of Pss in
//! all); the server never touches a tensor, so it is built from the library's
//! cache, config and a few util modules alone (compiled here again, through
//! `#[path]`), and its memory is the data it holds plus a few MB.
//!
//! Its command line is `vrtspike cache`'s (`src/cli/cache.rs`, the same file):
//! `vrtspike-cache serve | stats | shutdown | pin ...`, also with a leading
//! `cache` as `vrtspike cache serve` passes it on when it `exec`s this binary.
//! `--build-id` prints the id of the sources it was built from, which `vrtspike`
//! checks before it hands over.

use std::ffi::OsString;

use anyhow::{Context, Result};
use clap::Parser;
use vrtspike_contract::signals::{self, Disposition};

#[allow(dead_code, unused_imports)]
#[path = "../../cache/mod.rs"]
mod cache;
#[path = "../../cli/cache.rs"]
mod cache_cli;
#[allow(dead_code, unused_imports)]
#[path = "../../config/mod.rs"]
mod config;

#[allow(dead_code, unused_imports)]
mod util;

// A server that a job started ignores SLURM's SIGUSR2 and SIGTERM from its first
// instruction, as `vrtspike` does.
vrtspike_contract::count_job_signals_from_the_first_instruction!();

/// The node's shared-memory cache server, without libtorch.
#[derive(Parser)]
#[command(name = "vrtspike-cache", version, about)]
struct Cli {
    #[command(subcommand)]
    command: cache_cli::CacheCommand,
}

/// The arguments without a leading `cache` (`vrtspike cache serve ...` passes its
/// own on when it hands over).
fn arguments() -> Vec<OsString> {
    let mut args: Vec<OsString> = std::env::args_os().collect();
    if args.get(1).is_some_and(|a| a == "cache") {
        args.remove(1);
    }
    args
}

fn main() -> Result<()> {
    util::logging::init();
    let args = arguments();
    if args.len() == 2 && args[1] == "--build-id" {
        println!("{}", cache_cli::BUILD_ID);
        return Ok(());
    }
    let cli = Cli::parse_from(args);
    let (usr2, term) = match cli.command.ends_with_parent() {
        true => (Disposition::Ignore, Disposition::Ignore),
        false => (Disposition::Ignore, Disposition::Default),
    };
    signals::settle(usr2, term).context("setting up SIGUSR2 and SIGTERM")?;
    cache_cli::run(cli.command, cache_cli::Serving::HereAlways)
}
