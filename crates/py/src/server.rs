//! The node's cache server of a Dataset, found once in the process that makes the
//! Dataset (the trainer's main process) under the trainer's rules, and held there
//! while the Dataset lives; its DataLoader workers only connect to the address
//! decided here.
//!
//! - `DATA.USE_RAM_CACHE: false`: no server, every read from disk.
//! - `VRTSPIKE_CACHE_ADDR` set (a launcher's server): that one, never started here.
//! - `DATA.CACHE_SHARING: node` (the default): the node-shared server of this user
//!   and dataset, attached to when it runs, else started detached with its linger
//!   (`VRTSPIKE_CACHE_LINGER_S`), the contract's one attach-or-start
//!   (`vrtspike_contract::shared_server`) as the launcher and the ranks use it.
//! - `job`: the job's own server (named by the contract's `RankEnv::job_name`),
//!   started by local rank 0 as its child (it dies with that process) and waited
//!   for by the other local ranks.
//!
//! A server is started from the `vrtspike-cache` binary the package ships, only if
//! it was built from the sources of this extension (its `--build-id`). Whatever
//! fails here leaves the Dataset reading from disk, with a warning that says why.

use std::path::{Path, PathBuf};
use std::time::Duration;

use vrtspike_contract::cache_addr::node_shared_address;
use vrtspike_contract::cache_serve::{CacheServe, Lifetime, ServeError, Watch};
use vrtspike_contract::env::RankEnv;
use vrtspike_contract::shared_server::{self, Joined, SharedStart};
use vrtspike_data::cache::own_server::{wait_for_server, OwnServer};
use vrtspike_data::cache::{default_address, CacheClient, ClientOptions};
use vrtspike_data::cli::cache::{build_id_of, BUILD_ID};
use vrtspike_data::config::{CacheSharing, Config};

/// How long a start, or a wait for local rank 0's server, may take.
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// How this process holds the server while its Dataset lives (held for its drop).
pub struct Hold {
    /// A connection to a server someone else runs (node-shared, or the launcher's):
    /// a lingering server counts this process as attached through it.
    _attached: Option<CacheClient>,
    /// This process's own server (`DATA.CACHE_SHARING: job`, local rank 0): asked
    /// to stop when the Dataset closes, and killed with this process.
    _own: Option<OwnServer>,
}

impl Hold {
    fn attached(client: CacheClient) -> Hold {
        Hold {
            _attached: Some(client),
            _own: None,
        }
    }

    fn own(server: OwnServer) -> Hold {
        Hold {
            _attached: None,
            _own: Some(server),
        }
    }
}

/// The server a Dataset reads through.
pub struct CacheChoice {
    /// Its address (`None`: every read from disk).
    pub address: Option<String>,
    /// This process's hold on it.
    pub hold: Option<Hold>,
    /// How the server was had (`attached`, `started`, ...), for the user.
    pub how: String,
    /// What the user should know (a fall-back to disk, and why).
    pub warnings: Vec<String>,
}

impl CacheChoice {
    fn disk(how: &str, warning: Option<String>) -> CacheChoice {
        CacheChoice {
            address: None,
            hold: None,
            how: how.to_string(),
            warnings: warning.into_iter().collect(),
        }
    }

    fn through(address: String, hold: Hold, how: &str) -> CacheChoice {
        CacheChoice {
            address: Some(address),
            hold: Some(hold),
            how: how.to_string(),
            warnings: Vec::new(),
        }
    }
}

/// What a server is started with.
pub struct ServeWith<'a> {
    /// The `vrtspike-cache` binary, if one was found.
    pub binary: Option<&'a Path>,
    /// The run config file the Dataset was read from (`None`: the defaults, written
    /// to a file for the server).
    pub config_file: Option<&'a Path>,
    /// The Dataset's overrides.
    pub overrides: &'a [String],
    /// This process's name for the servers it starts (`--started-by`).
    pub started_by: &'a str,
}

/// The server for `config`'s dataset by the rules of the module doc; never an
/// error: a failure reads from disk, with a warning.
pub fn choose(config: &Config, with: &ServeWith) -> CacheChoice {
    let data = &config.data;
    if !data.use_ram_cache {
        return CacheChoice::disk("not used (DATA.USE_RAM_CACHE: false)", None);
    }
    let fallback = |why: String| {
        CacheChoice::disk(
            "none: reading from disk",
            Some(format!("{why}: the Dataset reads every record from disk")),
        )
    };
    if let Some(address) = std::env::var(vrtspike_contract::env::CACHE_ADDR)
        .ok()
        .filter(|a| !a.is_empty())
    {
        return match CacheClient::connect(&address, &label("attached")) {
            Ok(client) => {
                CacheChoice::through(address, Hold::attached(client), "attached (launcher's)")
            }
            Err(e) => fallback(format!(
                "cannot reach the cache server at {address} ({} is set): {e}",
                vrtspike_contract::env::CACHE_ADDR
            )),
        };
    }
    let result = match (data.cache_sharing, &data.root) {
        (CacheSharing::Node, Some(root)) => shared(config, root, with),
        _ => own_or_wait(config, with),
    };
    result.unwrap_or_else(fallback)
}

/// This process's label on its connections.
fn label(role: &str) -> String {
    format!("python pid {} ({role})", std::process::id())
}

/// The node-shared server of this user and dataset: attached to, else started.
fn shared(config: &Config, root: &Path, with: &ServeWith) -> Result<CacheChoice, String> {
    let (address, _) = node_shared_address(root).map_err(|e| e.to_string())?;
    let quick = ClientOptions::from_env()
        .map_err(|e| e.to_string())?
        .waiting(Duration::from_secs(2));
    let who = label("node-shared");
    let mut attach = || Ok(CacheClient::connect_with(&address, &who, &quick).ok());
    let Some(binary) = with.binary else {
        return match attach() {
            Ok(Some(client)) => Ok(CacheChoice::through(
                address,
                Hold::attached(client),
                "attached (node-shared)",
            )),
            _ => Err(format!(
                "no node-shared cache server runs at {address}, and none can be started: {}",
                missing_binary()
            )),
        };
    };
    let config_file = ConfigFile::for_server(config, with.config_file)?;
    let log = log_file(&address)?;
    let linger_s = shared_server::linger_s(None, &|name| std::env::var(name).ok())?;
    let start = SharedStart {
        serve: serve_command(binary, &address, &config_file, with),
        linger_s,
        started_by: with.started_by,
        watch: watch(&log),
    };
    let (client, joined) = shared_server::attach_or_start::<_, NoServer>(&start, &mut attach)
        .map_err(|NoServer(why)| why)?;
    let how = match joined {
        Joined::Started => "started (node-shared)",
        Joined::Attached | Joined::RaceLost => "attached (node-shared)",
    };
    Ok(CacheChoice::through(address, Hold::attached(client), how))
}

/// `DATA.CACHE_SHARING: job`: local rank 0 starts the job's own server, the other
/// local ranks wait for it.
fn own_or_wait(config: &Config, with: &ServeWith) -> Result<CacheChoice, String> {
    let env = RankEnv::from_process_env().map_err(|e| e.to_string())?;
    let address = default_address(&env.job_name());
    if env.local_rank != 0 {
        let client = wait_for(&address)?;
        return Ok(CacheChoice::through(
            address,
            Hold::attached(client),
            "attached (job's)",
        ));
    }
    let binary = with.binary.ok_or_else(missing_binary)?;
    let config_file = ConfigFile::for_server(config, with.config_file)?;
    let log = log_file(&address)?;
    let started = serve_command(binary, &address, &config_file, with)
        .start_logged(&watch(&log))
        .map_err(|e| e.to_string())?;
    let own = OwnServer::new(&address, started.spawned.process);
    Ok(CacheChoice::through(
        address,
        Hold::own(own),
        "started (job's)",
    ))
}

/// `vrtspike-cache serve` at `address` with the Dataset's config and overrides,
/// as the job's own server (a [`SharedStart`] makes it a lingering one).
fn serve_command<'a>(
    binary: &'a Path,
    address: &'a str,
    config_file: &'a ConfigFile<'a>,
    with: &ServeWith<'a>,
) -> CacheServe<'a> {
    CacheServe {
        vrtspike: binary,
        address,
        config: config_file.path(),
        cap: None,
        overrides: with.overrides,
        lifetime: Lifetime::WithParent,
    }
}

/// How a start is watched: its log, the start's timeout, never interrupted.
fn watch(log: &Path) -> Watch<'_> {
    Watch {
        log,
        timeout: START_TIMEOUT,
        interrupted: &|| false,
    }
}

/// Waits until local rank 0's server accepts.
fn wait_for(address: &str) -> Result<CacheClient, String> {
    let who = label("waiting for local rank 0's server");
    wait_for_server(address, &who, START_TIMEOUT).map_err(|e| {
        format!(
            "local rank 0 did not start the job's cache server at {address:?} within {:.0} s: {e}",
            START_TIMEOUT.as_secs_f64()
        )
    })
}

/// An attach-or-start that found no server (the start's error).
struct NoServer(String);

impl From<ServeError> for NoServer {
    fn from(e: ServeError) -> NoServer {
        NoServer(e.to_string())
    }
}

fn missing_binary() -> String {
    format!(
        "no vrtspike-cache binary of this build was found (the wheel ships one in \
         vrtspike/_bin/; {} names another)",
        vrtspike_data::cli::cache::SERVER_ENV
    )
}

/// The `vrtspike-cache` binary to start servers with: `path` if it is one built
/// from this extension's sources; otherwise `None` and why.
pub fn check_binary(path: &Path) -> Result<PathBuf, String> {
    if !path.is_file() {
        return Err(format!("{}: no such file", path.display()));
    }
    match build_id_of(path) {
        Some(id) if id == BUILD_ID => Ok(path.to_path_buf()),
        Some(id) => Err(format!(
            "{} was built from other sources (build {id}, this extension's is {BUILD_ID})",
            path.display()
        )),
        None => Err(format!("{} --build-id did not answer", path.display())),
    }
}

/// Where a server this process starts logs: the launcher's run directory when one
/// is named (`VRTSPIKE_RUN_DIR`), else this user's folder under the temp dir.
fn log_file(address: &str) -> Result<PathBuf, String> {
    if let Ok(dir) = std::env::var(vrtspike_contract::env::RUN_DIR) {
        if !dir.is_empty() {
            return Ok(vrtspike_contract::rundir::RunLayout::new(dir).cache_log(0));
        }
    }
    Ok(user_dir()?.join(format!("{address}.log")))
}

/// `$TMPDIR/vrtspike-py-<uid>`, made private to this user.
fn user_dir() -> Result<PathBuf, String> {
    use std::os::unix::fs::DirBuilderExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let dir = std::env::temp_dir().join(format!("vrtspike-py-{uid}"));
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => Ok(dir),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(dir),
        Err(e) => Err(format!("cannot make {}: {e}", dir.display())),
    }
}

/// The config file a started server reads its cap from: the Dataset's own file,
/// or, for a Dataset made from overrides alone, the resolved config written to a
/// private file that goes once the server has read it.
enum ConfigFile<'a> {
    Given(&'a Path),
    Written(tempfile::TempPath),
}

impl<'a> ConfigFile<'a> {
    fn for_server(config: &Config, given: Option<&'a Path>) -> Result<ConfigFile<'a>, String> {
        if let Some(path) = given {
            return Ok(ConfigFile::Given(path));
        }
        let dir = user_dir()?;
        let file = tempfile::Builder::new()
            .prefix("config-")
            .suffix(".yaml")
            .tempfile_in(&dir)
            .map_err(|e| {
                format!(
                    "cannot write a config for the cache server in {}: {e}",
                    dir.display()
                )
            })?;
        std::fs::write(file.path(), config.to_yaml())
            .map_err(|e| format!("cannot write {}: {e}", file.path().display()))?;
        Ok(ConfigFile::Written(file.into_temp_path()))
    }

    fn path(&self) -> &Path {
        match self {
            ConfigFile::Given(path) => path,
            ConfigFile::Written(path) => path,
        }
    }
}
