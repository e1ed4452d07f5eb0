//! `vrtspike-launch`: supervises a vrtspike job on one node. Today it starts the
//! node's cache server (the only RAM copy of the data) with a parent-death signal
//! and stops it cleanly on SIGINT/SIGTERM; starting one rank per GPU comes next.

use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;

/// Start the node's cache server for a run.
#[derive(Parser)]
#[command(name = "vrtspike-launch", version, about)]
struct Args {
    /// Run config (its DATA.CACHE_SIZE_GB sizes the cache).
    #[arg(long)]
    config: PathBuf,
    /// Run id: names the cache address (`vrtspike-cache-<run id>`).
    #[arg(long)]
    run_id: Option<String>,
    /// GPUs on this node (ranks are started by a later version).
    #[arg(long, default_value_t = 0)]
    gpus: u32,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The `vrtspike` binary beside this one.
fn vrtspike_exe() -> Result<PathBuf> {
    let me = std::env::current_exe().context("locating vrtspike-launch")?;
    let exe = me.with_file_name("vrtspike");
    if !exe.exists() {
        bail!("{} not found beside {}", exe.display(), me.display());
    }
    Ok(exe)
}

fn run(args: Args) -> Result<()> {
    if !args.config.exists() {
        bail!("config {} does not exist", args.config.display());
    }
    if args.gpus > 0 {
        tracing::warn!(
            "--gpus {}: ranks are not started yet; only the cache server runs",
            args.gpus
        );
    }
    let run_id = args
        .run_id
        .unwrap_or_else(|| format!("{}", std::process::id()));
    let address = format!("vrtspike-cache-{run_id}");
    install_stop_handlers()?;
    let mut server = Command::new(vrtspike_exe()?)
        .args([
            "cache",
            "serve",
            "--exit-with-parent",
            "--address",
            &address,
        ])
        .arg("--config")
        .arg(&args.config)
        .spawn()
        .context("starting the cache server")?;
    tracing::info!(%address, pid = server.id(), "cache server started; export VRTSPIKE_CACHE_ADDR={address}");
    loop {
        if let Some(status) = server.try_wait().context("waiting for the cache server")? {
            if STOP.load(Ordering::SeqCst) || status.success() {
                return Ok(());
            }
            bail!("the cache server exited with {status}");
        }
        if STOP.load(Ordering::SeqCst) {
            let pid = Pid::from_raw(server.id() as i32);
            let _ = signal::kill(pid, Signal::SIGTERM);
            for _ in 0..50 {
                if server.try_wait()?.is_some() {
                    return Ok(());
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = server.kill();
            let _ = server.wait();
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Set by SIGINT/SIGTERM.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: i32) {
    STOP.store(true, Ordering::SeqCst);
}

/// Makes SIGINT and SIGTERM set [`STOP`] instead of killing the launcher.
fn install_stop_handlers() -> Result<()> {
    let action = signal::SigAction::new(
        signal::SigHandler::Handler(on_signal),
        signal::SaFlags::SA_RESTART,
        signal::SigSet::empty(),
    );
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to a static atomic, which is async-signal-safe.
        unsafe { signal::sigaction(sig, &action) }.with_context(|| format!("installing {sig}"))?;
    }
    Ok(())
}
