//! `vrtspike-cache`: what never runs a model, as processes without libtorch: the
//! node's cache server, and the benchmarks' processes (`bench cache`, `bench
//! loader` and their workers). Every process that links libtorch carries its CUDA
//! libraries' relocations and static initialisers (about 120 MB of private memory,
//! and more than 250 MB of Pss in all); these never touch a tensor, so this binary
//! is built from `vrtspike-data` alone, and its Pss is the data it holds plus a few
//! MB.
//!
//! Its command line is `vrtspike`'s (`vrtspike_data::cli`, which both binaries
//! use): `vrtspike-cache serve | stats | shutdown | pin ...` and
//! `vrtspike-cache bench ...` (and the hidden `h5-probe`, the HDF5 probe child of
//! the Python package), also with a leading `cache` as `vrtspike cache serve`
//! passes it on when it `exec`s this binary. `--build-id` prints the id of the
//! sources it was built from, which `vrtspike` checks before it hands over.

use std::ffi::OsString;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use vrtspike_contract::signals::{self, Disposition};
use vrtspike_data::{cli, util};

// A server that a job started ignores SLURM's SIGUSR2 and SIGTERM from its first
// instruction, as `vrtspike` does.
vrtspike_contract::count_job_signals_from_the_first_instruction!();

/// The node's shared-memory cache server and the benchmarks, without libtorch.
#[derive(Parser)]
#[command(
    name = "vrtspike-cache",
    version,
    about = "The node's cache server and the benchmarks of vrtspike, without libtorch"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    #[command(flatten)]
    Cache(cli::cache::CacheCommand),
    /// Benchmarks that print one JSON object.
    #[command(subcommand)]
    Bench(cli::bench::BenchCommand),
    /// Reads HDF5 session files for a parent process, which a libhdf5 crash spares
    /// (the Python package's probe: it maps no libtorch).
    #[command(name = "h5-probe", hide = true)]
    H5Probe(cli::h5_probe::H5ProbeArgs),
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
        println!("{}", cli::cache::BUILD_ID);
        return Ok(());
    }
    let cli = Cli::parse_from(args);
    let ignores = match &cli.command {
        Command::Cache(c) => c.ignores_job_signals(),
        Command::H5Probe(_) => true,
        Command::Bench(_) => false,
    };
    let (usr2, term) = match ignores {
        true => (Disposition::Ignore, Disposition::Ignore),
        false => (Disposition::Ignore, Disposition::Default),
    };
    signals::settle(usr2, term).context("setting up SIGUSR2 and SIGTERM")?;
    let here = cli::cache::Where::Here;
    match cli.command {
        Command::Cache(command) => cli::cache::run(command, here),
        Command::Bench(command) => cli::bench::run(command, here),
        Command::H5Probe(args) => cli::h5_probe::run(args),
    }
}
