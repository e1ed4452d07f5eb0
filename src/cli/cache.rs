//! `vrtspike cache serve | stats | shutdown`: run the node's cache server, or query
//! and stop a running one.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};

use vrtspike::cache::{self, CacheClient, Server, ServerConfig};
use vrtspike::config::Config;
use vrtspike::util::bytes::parse_size;

/// The cache subcommands.
#[derive(Subcommand)]
pub enum CacheCommand {
    /// Run a cache server in the foreground until it is told to stop.
    Serve(ServeArgs),
    /// Print a running server's statistics.
    Stats(StatsArgs),
    /// Ask a running server to stop.
    Shutdown(AddressArgs),
    /// Pin cached records and hold them until killed or the server goes away
    /// (to see eviction work around pinned records).
    Pin(PinArgs),
}

impl CacheCommand {
    /// A server that ends with its parent (`serve --exit-with-parent`, as a
    /// launcher or a rank starts it): it ignores the job's SIGUSR2 and SIGTERM and
    /// lives until its parent stops it or dies.
    pub fn ends_with_parent(&self) -> bool {
        matches!(self, CacheCommand::Serve(args) if args.exit_with_parent)
    }
}

/// `cache pin`.
#[derive(Args)]
pub struct PinArgs {
    #[command(flatten)]
    address: AddressArgs,
    /// Keys of cached records to pin.
    #[arg(required = true)]
    keys: Vec<String>,
}

/// Where the server listens.
#[derive(Args)]
pub struct AddressArgs {
    /// Abstract socket name (default: $VRTSPIKE_CACHE_ADDR, else vrtspike-cache-default).
    #[arg(long)]
    pub address: Option<String>,
}

impl AddressArgs {
    fn resolve(&self) -> String {
        self.address
            .clone()
            .or_else(|| std::env::var(cache::ADDRESS_ENV).ok())
            .unwrap_or_else(|| cache::default_address("default"))
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
    /// A run config whose DATA.CACHE_SIZE_GB sets the cap.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a key of --config, `KEY.PATH=VALUE` (as `vrtspike train --set`).
    #[arg(long = "set", value_name = "KEY=VALUE", requires = "config")]
    set: Vec<String>,
    /// Slot sizes (bytes, or with K/M/G); default: one class per record size.
    #[arg(long, value_parser = parse_size, value_delimiter = ',')]
    slot_bytes: Vec<u64>,
    /// Seconds a get waits for another client's fill of the same key.
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
    /// Exit when the parent process dies (set by the launcher, or by the rank that
    /// started it); such a server ignores SIGUSR2 and SIGTERM, which SLURM sends
    /// to every process of a job: its parent stops it (SIGINT or `cache shutdown`).
    #[arg(long)]
    exit_with_parent: bool,
}

/// `cache stats`.
#[derive(Args)]
pub struct StatsArgs {
    #[command(flatten)]
    address: AddressArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Print again every this many seconds until interrupted.
    #[arg(long)]
    watch: Option<f64>,
}

/// Runs a cache subcommand.
pub fn run(command: CacheCommand) -> Result<()> {
    match command {
        CacheCommand::Serve(args) => serve(args),
        CacheCommand::Stats(args) => stats(args),
        CacheCommand::Shutdown(args) => {
            let address = args.resolve();
            let client = CacheClient::connect(&address, "vrtspike cache shutdown")?;
            client.shutdown_server()?;
            println!("cache server at {address} stopped");
            Ok(())
        }
        CacheCommand::Pin(args) => pin(args),
    }
}

fn pin(args: PinArgs) -> Result<()> {
    let address = args.address.resolve();
    let client = CacheClient::connect(&address, "vrtspike cache pin")?;
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

fn serve(args: ServeArgs) -> Result<()> {
    if args.exit_with_parent {
        nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
            .context("setting the parent-death signal")?;
    }
    let cap = match (args.cap, &args.config) {
        (Some(cap), _) => cap,
        (None, Some(path)) => Config::resolve(path, &args.set)?.config.data.cache_bytes(),
        (None, None) => bail!("give the cache size with --cap SIZE or --config FILE"),
    };
    let mut config = ServerConfig::new(args.address.resolve(), cap);
    config.slot_bytes = args.slot_bytes;
    config.fill_wait_timeout = Duration::from_secs(args.fill_wait_s);
    if let Some(headroom) = args.reserve_headroom {
        config.reserve_headroom = headroom;
    }
    config.allowed_uids.extend(&args.allow_uids);
    let server = Server::bind(config)?;
    println!("cache server listening at {}", server.address());
    // A launcher that started this server waits for this word (not the line above).
    vrtspike_contract::ready::notify(&|name| std::env::var(name).ok())
        .context("telling the launcher that the cache server is ready")?;
    let result = server.run();
    cache::handshake_dir::remove_own();
    result?;
    Ok(())
}

fn stats(args: StatsArgs) -> Result<()> {
    let address = args.address.resolve();
    let client = CacheClient::connect(&address, "vrtspike cache stats")?;
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
