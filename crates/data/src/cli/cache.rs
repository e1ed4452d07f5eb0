//! `vrtspike cache serve | stats | shutdown | pin | attach`: run the node's cache
//! server, or query and stop a running one; the same commands are those of
//! `vrtspike-cache` (what never runs a model, without libtorch).
//!
//! `vrtspike cache serve` (and `vrtspike bench`) hand over to `vrtspike-cache` (they
//! `exec` it in their own process, with the same arguments), so the server holds the
//! data and not libtorch; they run in this process only when no `vrtspike-cache` of
//! the same sources is beside it (or at `$VRTSPIKE_CACHE_SERVER`), and say so.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};

use crate::cache::{self, CacheClient, ClientOptions, Server, ServerConfig};
use crate::config::{CacheSharing, Config};
use crate::util::bytes::parse_size;
use vrtspike_contract::seconds::{parse_positive_seconds, parse_seconds};

/// Where `vrtspike cache serve` finds the cache server binary (over the one beside
/// its own binary).
pub const SERVER_ENV: &str = "VRTSPIKE_CACHE_SERVER";

/// The build id of the cache server's sources (see `build/cache_build_id.rs`).
pub const BUILD_ID: &str = env!("VRTSPIKE_CACHE_BUILD_ID");

/// Where a command that never runs a model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Where {
    /// In the `vrtspike-cache` binary, without libtorch (this process becomes it).
    WithoutLibtorch,
    /// In this process, whatever it links.
    Here,
}

/// The cache subcommands.
#[derive(Subcommand)]
pub enum CacheCommand {
    /// Run a cache server in the foreground until it is told to stop.
    Serve(ServeArgs),
    /// Print a running server's statistics.
    Stats(StatsArgs),
    /// Ask a running server to stop.
    Shutdown(ClientArgs),
    /// Pin cached records and hold them until killed or the server goes away
    /// (to see eviction work around pinned records).
    Pin(PinArgs),
    /// Hold a connection to a running server until killed or the server goes
    /// away (how a job keeps a node-shared server alive; exits 69 when no server
    /// listens at the address).
    Attach(AttachArgs),
}

impl CacheCommand {
    /// Whether this command ignores the job's SIGUSR2 and SIGTERM (which SLURM
    /// sends to every process of a job): a server that ends with its parent (`serve
    /// --exit-with-parent`, as a launcher or a rank starts it), which lives until its
    /// parent stops it or dies; a node-shared server (`serve --linger-s`), which
    /// other jobs may still use and which ends after its linger, not with any job; a
    /// job's `attach --exit-with-parent`, which its launcher stops.
    pub fn ignores_job_signals(&self) -> bool {
        match self {
            CacheCommand::Serve(args) => args.exit_with_parent || args.linger_s.is_some(),
            CacheCommand::Attach(args) => args.exit_with_parent,
            _ => false,
        }
    }
}

/// `cache attach`.
#[derive(Args)]
pub struct AttachArgs {
    #[command(flatten)]
    address: AddressArgs,
    #[command(flatten)]
    trust: TrustArgs,
    /// This client's name in the server's stats (the job).
    #[arg(long, default_value = "vrtspike cache attach")]
    name: String,
    /// Exit when the parent process dies (set by the launcher); ignores the job's
    /// SIGUSR2 and SIGTERM like the server it holds.
    #[arg(long)]
    exit_with_parent: bool,
}

/// `cache pin`.
#[derive(Args)]
pub struct PinArgs {
    #[command(flatten)]
    address: AddressArgs,
    #[command(flatten)]
    trust: TrustArgs,
    /// Keys of cached records to pin.
    #[arg(required = true)]
    keys: Vec<String>,
}

/// Where the server listens.
#[derive(Args)]
pub struct AddressArgs {
    /// Abstract socket name (default: $VRTSPIKE_CACHE_ADDR, else
    /// vrtspike-cache-u<uid>-<job>, the job being slurm<SLURM_JOB_ID> or `default`).
    #[arg(long)]
    pub address: Option<String>,
}

impl AddressArgs {
    fn resolve(&self) -> String {
        cache::address::resolve(self.address.as_deref())
    }
}

/// Whose servers a client talks to.
#[derive(Args)]
pub struct TrustArgs {
    /// Also talk to a server run by this user id (repeatable; the server must let
    /// this user in with its own --allow-uid). By default a server of another user
    /// is refused before anything is read from it.
    #[arg(long = "allow-uid", value_name = "UID")]
    allow_uids: Vec<u32>,
}

impl TrustArgs {
    /// The client options: the environment's, these uids, and `timeout` if given.
    fn options(&self, timeout: Option<Duration>) -> Result<ClientOptions> {
        let options = ClientOptions::from_env()?.trusting(&self.allow_uids);
        Ok(match timeout {
            Some(timeout) => options.waiting(timeout),
            None => options,
        })
    }
}

/// A short-lived client: where, whom it trusts, how long it waits.
#[derive(Args)]
pub struct ClientArgs {
    #[command(flatten)]
    address: AddressArgs,
    #[command(flatten)]
    trust: TrustArgs,
    /// Seconds to wait for the server to connect and for each answer; then fail
    /// (a hung server never hangs the caller, the launcher at exit among them).
    #[arg(long, default_value_t = 10.0, value_parser = parse_positive_seconds)]
    timeout: f64,
}

impl ClientArgs {
    /// Connects as `name`: the address and the client.
    fn connect(&self, name: &str) -> Result<(String, CacheClient)> {
        let address = self.address.resolve();
        let timeout = Duration::from_secs_f64(self.timeout);
        let options = self.trust.options(Some(timeout))?;
        let client = CacheClient::connect_with(&address, name, &options)
            .with_context(|| format!("{name} at {address} (--timeout {} s)", self.timeout))?;
        Ok((address, client))
    }
}

/// `cache serve`.
#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    address: AddressArgs,
    /// Byte cap (e.g. 20G); default: DATA.CACHE_SIZE_GB of --config.
    #[arg(long, value_parser = parse_size)]
    cap: Option<u64>,
    /// A run config whose DATA.CACHE_SIZE_GB sets the cap. With its
    /// DATA.CACHE_SHARING node (the default), a DATA.ROOT and no --address (nor
    /// $VRTSPIKE_CACHE_ADDR), the server listens at that dataset's node-shared
    /// address: the jobs on the dataset attach to it instead of starting one.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a key of --config, `KEY.PATH=VALUE` (as `vrtspike train --set`).
    #[arg(long = "set", value_name = "KEY=VALUE", requires = "config")]
    set: Vec<String>,
    /// The typical smallest record (bytes, or with K/M/G): the store gets a record
    /// descriptor per this many bytes of the cap (default 64K, at least 1024).
    /// Records of any size up to the cap are stored either way.
    #[arg(long, value_parser = parse_size)]
    record_bytes: Option<u64>,
    /// Seconds a get waits for another client's fill of the same key (clients wait
    /// for the answer that long, and their usual reply timeout on top).
    #[arg(long, default_value_t = 120)]
    fill_wait_s: u64,
    /// Memory each new slot must leave free on the node (MemAvailable, or the
    /// cgroup's room), e.g. 2G; a slot that would eat into it is refused and the
    /// record is read from disk instead.
    #[arg(long, value_parser = parse_size)]
    reserve_headroom: Option<u64>,
    /// Also let processes of this user id connect (repeatable). By default only
    /// the server's own user gets in; others are refused at accept.
    #[arg(long = "allow-uid", value_name = "UID")]
    allow_uids: Vec<u32>,
    /// Seconds a connecting client has to finish its handshake; a handshake still
    /// unfinished then is dropped and its place given back.
    #[arg(long, default_value_t = 10)]
    handshake_timeout_s: u64,
    /// Exit when the parent process dies (set by the launcher, or by the rank that
    /// started it); such a server ignores SIGUSR2 and SIGTERM, which SLURM sends
    /// to every process of a job: its parent stops it (SIGINT or `cache shutdown`).
    #[arg(long, conflicts_with = "linger_s")]
    exit_with_parent: bool,
    /// A node-shared server: stop once no client has been connected for this many
    /// seconds (from its start too), whoever started it; it ignores SIGUSR2 and
    /// SIGTERM. Exits 73 when another server holds the address.
    #[arg(long, value_parser = parse_seconds)]
    linger_s: Option<f64>,
    /// Who started it (a job's name), shown to the jobs that attach.
    #[arg(long)]
    started_by: Option<String>,
    /// Memory the ranks' announced read orders (the planned policy's) may take in
    /// the server, over all of them (e.g. 512M): an announcement past it is refused
    /// and that rank's records are evicted by LRU. `vrtspike cache stats` shows
    /// what they hold.
    #[arg(long, value_parser = parse_size, default_value = "256M")]
    read_order_budget: u64,
    /// Connections served at once (a pin page of 4 KiB each in the store); one
    /// past them is refused and that loader worker reads from disk. Default: 8 a
    /// core of this node, at least 512; `--config`'s DATA.CACHE_CONNECTIONS when
    /// it names a count.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    connections: Option<u32>,
}

/// `cache stats`.
#[derive(Args)]
pub struct StatsArgs {
    #[command(flatten)]
    client: ClientArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Print again every this many seconds until interrupted.
    #[arg(long, value_parser = parse_seconds)]
    watch: Option<f64>,
}

/// Runs a cache subcommand; `place` says where `serve` and `attach` run.
pub fn run(command: CacheCommand, place: Where) -> Result<()> {
    let holds = matches!(command, CacheCommand::Serve(_) | CacheCommand::Attach(_));
    if holds && place == Where::WithoutLibtorch {
        hand_over();
    }
    match command {
        CacheCommand::Serve(args) => serve(args),
        CacheCommand::Stats(args) => stats(args),
        CacheCommand::Shutdown(args) => {
            let (address, client) = args.connect("vrtspike cache shutdown")?;
            client.shutdown_server()?;
            println!("cache server at {address} stopped");
            Ok(())
        }
        CacheCommand::Pin(args) => pin(args),
        CacheCommand::Attach(args) => attach(args),
    }
}

/// Holds a connection until the server goes: exits 69 when there is none at
/// all, 74 when the one there is not ours to use (another user's process,
/// another build's server, or one with no connection left: the message says
/// which), else says it is ready (the launcher waits for that) and then fails only
/// when the server stops answering.
fn attach(args: AttachArgs) -> Result<()> {
    if args.exit_with_parent {
        nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
            .context("setting the parent-death signal")?;
    }
    let address = args.address.resolve();
    let client = match CacheClient::connect_with(&address, &args.name, &args.trust.options(None)?) {
        Ok(client) => client,
        Err(cache::CacheError::Connect { source, .. })
            if source.kind() == std::io::ErrorKind::ConnectionRefused =>
        {
            eprintln!("no cache server at {address}");
            std::process::exit(vrtspike_contract::cache_serve::EXIT_NO_SERVER);
        }
        Err(e) if e.is_not_ours() => {
            eprintln!("{e}");
            std::process::exit(vrtspike_contract::cache_serve::EXIT_NOT_OURS);
        }
        Err(e) => return Err(e.into()),
    };
    let pid = client.stats()?.server_pid;
    println!("attached to the cache server at {address} (pid {pid})");
    vrtspike_contract::ready::notify(&|name| std::env::var(name).ok())
        .context("telling the launcher that the attach is ready")?;
    loop {
        std::thread::sleep(Duration::from_millis(500));
        client
            .stats()
            .with_context(|| format!("the cache server at {address} (pid {pid}) went away"))?;
    }
}

fn pin(args: PinArgs) -> Result<()> {
    let address = args.address.resolve();
    let client =
        CacheClient::connect_with(&address, "vrtspike cache pin", &args.trust.options(None)?)?;
    let mut leases = Vec::new();
    for key in &args.keys {
        match client.peek(key)? {
            Some(lease) => leases.push(lease),
            None => bail!("key {key:?} is not cached at {address}"),
        }
    }
    let bytes: usize = leases.iter().map(|l| l.len()).sum();
    println!("pinned {} records ({bytes} bytes)", leases.len());
    // Hold until the server goes away (or this process is killed).
    loop {
        std::thread::sleep(Duration::from_millis(200));
        client
            .stats()
            .with_context(|| format!("holding {} leases", leases.len()))?;
    }
}

/// The `vrtspike-cache` binary to hand `serve` over to: `$VRTSPIKE_CACHE_SERVER`,
/// else the one beside this binary; `None` (and a warning) when there is none, or
/// when it was built from other sources than this binary.
fn server_binary() -> Option<PathBuf> {
    let path = match std::env::var_os(SERVER_ENV) {
        Some(path) => PathBuf::from(path),
        None => std::env::current_exe()
            .ok()?
            .with_file_name("vrtspike-cache"),
    };
    if !path.is_file() {
        tracing::warn!(
            server = %path.display(),
            "no vrtspike-cache binary: the cache server runs in this process, with libtorch \
             mapped (build the workspace for the server without it)"
        );
        return None;
    }
    let id = build_id_of(&path);
    match id.as_deref() {
        Some(BUILD_ID) => Some(path),
        other => {
            tracing::warn!(
                server = %path.display(),
                its_build = other.unwrap_or("unknown"),
                this_build = BUILD_ID,
                "vrtspike-cache was built from other sources than this binary: the cache \
                 server runs in this process (rebuild the workspace)"
            );
            None
        }
    }
}

/// What `path --build-id` prints (`None` when it cannot be run or fails): the
/// build id of a `vrtspike-cache` binary, to hold against [`BUILD_ID`].
pub fn build_id_of(path: &Path) -> Option<String> {
    let output = std::process::Command::new(path)
        .arg("--build-id")
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// Replaces this process by `vrtspike-cache` with the same arguments, if there is
/// one of these sources; returns only when it cannot (then the caller runs the
/// command here). The process, its pid, its readiness pipe, its parent-death signal
/// and ignored signals stay what they were, so whoever started it sees no difference.
pub fn hand_over() {
    use std::os::unix::process::CommandExt;
    let Some(server) = server_binary() else {
        return;
    };
    let error = std::process::Command::new(&server)
        .args(std::env::args_os().skip(1))
        .exec();
    tracing::warn!(server = %server.display(), %error, "cannot run vrtspike-cache: the cache server runs in this process");
}

fn serve(args: ServeArgs) -> Result<()> {
    if args.exit_with_parent {
        nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
            .context("setting the parent-death signal")?;
    }
    let run_config = match &args.config {
        Some(path) => Some(Config::resolve(path, &args.set)?.config),
        None => None,
    };
    let cap = match (args.cap, &run_config) {
        (Some(cap), _) => cap,
        (None, Some(run)) => run.data.cache_bytes(),
        (None, None) => bail!("give the cache size with --cap SIZE or --config FILE"),
    };
    let address = serve_address(&args.address, run_config.as_ref())?;
    let mut config = ServerConfig::new(address, cap);
    config.record_bytes = args.record_bytes;
    config.fill_wait_timeout = Duration::from_secs(args.fill_wait_s);
    config.handshake_timeout = Duration::from_secs(args.handshake_timeout_s.max(1));
    if let Some(headroom) = args.reserve_headroom {
        config.reserve_headroom = headroom;
    }
    config.allowed_uids.extend(&args.allow_uids);
    config.linger = args.linger_s.map(Duration::from_secs_f64);
    config.read_order_budget = args.read_order_budget;
    // --connections, else the run config's DATA.CACHE_CONNECTIONS, else sized
    // for the node.
    let wanted = args.connections.or_else(|| {
        run_config
            .as_ref()
            .and_then(|run| run.data.cache_connections.count())
    });
    if let Some(connections) = wanted {
        config.connections = connections as usize;
    }
    let server = match Server::bind(config) {
        Ok(server) => server,
        Err(e @ cache::CacheError::AddressInUse { .. }) if args.linger_s.is_some() => {
            // The loser of a race between two jobs: they attach to the winner.
            eprintln!("{e}");
            std::process::exit(vrtspike_contract::cache_serve::EXIT_ADDRESS_IN_USE);
        }
        Err(e) => return Err(e.into()),
    };
    match &args.started_by {
        Some(job) => println!(
            "cache server listening at {} (started by {job})",
            server.address()
        ),
        None => println!("cache server listening at {}", server.address()),
    }
    // A launcher that started this server waits for this word (not the line above).
    vrtspike_contract::ready::notify(&|name| std::env::var(name).ok())
        .context("telling the launcher that the cache server is ready")?;
    let result = server.run();
    cache::handshake_dir::remove_own();
    result?;
    Ok(())
}

/// Where `cache serve` listens: `--address`, else `$VRTSPIKE_CACHE_ADDR`, else,
/// for a `--config` with `DATA.CACHE_SHARING: node` and a `DATA.ROOT`, the
/// node-shared address of that dataset (so the jobs on it attach to this server,
/// started by hand), else the tools' default.
fn serve_address(address: &AddressArgs, run: Option<&Config>) -> Result<String> {
    let explicit =
        address.address.is_some() || std::env::var_os(vrtspike_contract::env::CACHE_ADDR).is_some();
    let shared_root = run
        .filter(|run| run.data.cache_sharing == CacheSharing::Node)
        .and_then(|run| run.data.root.as_deref());
    match (explicit, shared_root) {
        (false, Some(root)) => {
            let (shared, signature) = vrtspike_contract::cache_addr::node_shared_address(root)?;
            println!(
                "DATA.CACHE_SHARING is node: serving the jobs on {} ({} files) at {shared}",
                signature.root.display(),
                signature.tally.files
            );
            Ok(shared)
        }
        _ => Ok(address.resolve()),
    }
}

fn stats(args: StatsArgs) -> Result<()> {
    let (_, client) = args.client.connect("vrtspike cache stats")?;
    loop {
        let report = client.stats()?;
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            print!("{report}");
        }
        match args.watch {
            Some(secs) if secs > 0.0 => std::thread::sleep(Duration::from_secs_f64(secs)),
            _ => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrtspike_contract::child::write_executable;

    #[test]
    fn build_id_of_reads_what_the_binary_prints_or_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let script = |name: &str, body: &str| {
            let path = dir.path().join(name);
            write_executable(&path, &format!("#!/bin/sh\n{body}\n")).unwrap();
            path
        };
        let ok = script("ok", "[ \"$1\" = --build-id ] && echo ' 0123abcd '");
        assert_eq!(build_id_of(&ok).as_deref(), Some("0123abcd"));
        let fails = script("fails", "echo 0123abcd; exit 3");
        assert_eq!(build_id_of(&fails), None);
        assert_eq!(build_id_of(&dir.path().join("missing")), None);
    }
}
