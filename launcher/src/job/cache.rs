//! The node's cache server across the job's attempts: this job's own (a child the
//! gang watches), or the node-shared one that the job holds with an attach
//! (`DATA.CACHE_SHARING: node`). It is started, or attached to, before the first
//! attempt; this job's own is started again between attempts when it went away,
//! the node-shared one is held again in the background while an attempt runs
//! ([`crate::reattach`]); at the end its
//! figures are asked for the summary (a shared server's with this job's own entry)
//! before it is stopped (a shared one: only the attach, the server lingers). When
//! the node-shared address is held by a server the job cannot use (another
//! user's process, another build's server, one with no connection left), the job
//! falls back to a server of its own, says so once and notes it in the summary's
//! `cache.sharing`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use vrtspike_contract::cache_serve::{CacheServe, Lifetime, Watch};
use vrtspike_contract::dataset_sig::Coverage;
use vrtspike_contract::shared_server::{FellBack, SharedStart};

use crate::args::Args;
use crate::cache_server::{self, ConfigFacts};
use crate::reattach::Keeper;
use crate::rundir::RunDir;
use crate::shared_cache::{self, SharedSpec};
use crate::signals;
use crate::spawn::{self, Supervised};

/// How this node's cache server is started (and restarted, or attached to again).
#[derive(Clone)]
pub struct NodeCache {
    /// `DATA.USE_RAM_CACHE`: the ranks read through a cache server.
    pub enabled: bool,
    /// The server's address.
    pub address: String,
    /// The `vrtspike` binary that starts it.
    vrtspike: PathBuf,
    /// The run config and its `--set` overrides.
    config: PathBuf,
    overrides: Vec<String>,
    /// `--cache-size`, over the config's cap.
    cap: Option<String>,
    /// Its log (and its attach's).
    log: PathBuf,
    start_timeout: Duration,
    /// This job as its ranks' clients name it (the run directory).
    job_label: String,
    /// `DATA.CACHE_SHARING: node`: the node-shared server this job attaches to.
    shared: Option<SharedSetup>,
    /// The address of a server of this job's own (where it falls back to).
    own_address: String,
    /// Why this job runs a server of its own although the config shares one: the
    /// node-shared address was not its to use.
    fell_back: Option<FellBack>,
}

/// The node-shared cache server of this job's dataset.
#[derive(Clone)]
struct SharedSetup {
    /// This job as the server's stats name it: the run directory and launcher.
    job: String,
    /// The cap this job asks for.
    wanted_cap: u64,
    /// The connections this job asks for (`None`: auto).
    wanted_connections: Option<u64>,
    /// Seconds a server this job starts stays after the last job detached.
    linger_s: f64,
}

impl NodeCache {
    /// This node's cache server for the config's `facts`: the node-shared one of
    /// its dataset, else one of this job's own (with a warning when the config
    /// names no DATA.ROOT to key a shared one by).
    pub fn resolve(
        args: &Args,
        facts: &ConfigFacts,
        vrtspike: PathBuf,
        config: PathBuf,
        run_dir: &RunDir,
        node_rank: u32,
    ) -> Result<NodeCache> {
        let shared = match facts.ram_cache && facts.shared {
            true => shared_setup(args, facts, run_dir)?,
            false => None,
        };
        let own_address = cache_server::address(node_rank);
        Ok(NodeCache {
            enabled: facts.ram_cache,
            address: match &shared {
                Some((address, _)) => address.clone(),
                None => own_address.clone(),
            },
            vrtspike,
            config,
            overrides: args.set.clone(),
            cap: args.cache_size.clone(),
            log: run_dir.layout.cache_log(node_rank),
            start_timeout: Duration::from_secs_f64(args.cache_start_timeout_s),
            job_label: run_dir.layout.job_label(),
            shared: shared.map(|(_, setup)| setup),
            own_address,
            fell_back: None,
        })
    }

    /// The server before the first attempt; `None` with `DATA.USE_RAM_CACHE: false`.
    /// A node-shared address that is not this job's to use ([`shared_cache::NotOurs`])
    /// makes it a server of the job's own from then on.
    pub fn hold_first(&mut self) -> Result<Option<Supervised>> {
        if !self.enabled {
            tracing::info!("DATA.USE_RAM_CACHE is false: no cache server, ranks read from disk");
            return Ok(None);
        }
        match self.hold() {
            Err(e) if self.shared.is_some() => match e.downcast::<shared_cache::NotOurs>() {
                Ok(not_ours) => {
                    self.fall_back(not_ours);
                    self.hold().map(Some)
                }
                Err(e) => Err(e),
            },
            held => held.map(Some),
        }
    }

    /// Gives up the node-shared server for one of this job's own, saying so once.
    fn fall_back(&mut self, not_ours: shared_cache::NotOurs) {
        self.fell_back = Some(not_ours.fall_back(&self.own_address));
        self.shared = None;
        self.address = self.own_address.clone();
    }

    /// Starts this job's cache server, or attaches to the node-shared one (starting
    /// it if none runs): what the gang watches and the job stops at its end.
    pub fn hold(&self) -> Result<Supervised> {
        self.hold_unless(&|| false)
    }

    /// [`NodeCache::hold`], giving up early once `give_up` says so (or the job is
    /// interrupted).
    pub fn hold_unless(&self, give_up: &dyn Fn() -> bool) -> Result<Supervised> {
        let serve = CacheServe {
            vrtspike: &self.vrtspike,
            address: &self.address,
            config: &self.config,
            cap: self.cap.as_deref(),
            overrides: &self.overrides,
            lifetime: Lifetime::WithParent,
        };
        let watch = Watch {
            log: &self.log,
            timeout: self.start_timeout,
            interrupted: &|| signals::interrupts() > 0 || give_up(),
        };
        let Some(shared) = &self.shared else {
            return cache_server::start(&serve, &watch);
        };
        shared_cache::attach_or_start(&SharedSpec {
            start: SharedStart {
                serve,
                linger_s: shared.linger_s,
                started_by: &shared.job,
                watch,
            },
            job_label: &self.job_label,
            wanted_cap: Some(shared.wanted_cap),
            wanted_connections: shared.wanted_connections,
        })
    }

    /// Between attempts: starts this job's own server again if it went away. A
    /// node-shared one is held again by the keeper ([`NodeCache::keeper`]) while
    /// the next attempt runs, never here: a server that stays gone does not end
    /// the job (its ranks read from disk).
    pub fn hold_again_if_gone(&self, server: &mut Supervised) -> Result<()> {
        if server.running() || self.shared.is_some() {
            return Ok(());
        }
        tracing::warn!("restarting the cache server");
        *server = self.hold()?;
        Ok(())
    }

    /// The thread that holds the node-shared server again when it went away
    /// ([`Keeper`]); `None` for this job's own server.
    pub fn keeper(&self) -> Result<Option<Keeper>> {
        if self.shared.is_none() {
            return Ok(None);
        }
        let cache = self.clone();
        let keeper = Keeper::start(Box::new(move |give_up: &dyn Fn() -> bool| {
            cache.hold_unless(give_up)
        }))
        .context("starting the thread that holds the node-shared cache server again")?;
        Ok(Some(keeper))
    }

    /// Asks for the server's figures, then stops it (a shared one: this job's
    /// attach). A shared server's figures are every attached job's together:
    /// this job's own are its entry in `jobs` (its ranks name it by the run
    /// directory), added as `sharing.this_job`. A hold the `keeper` got as the
    /// last attempt ended replaces the gone one; the keeper stops after the
    /// figures are in (the attaches it started end with its thread, and with the
    /// last of them a shared server with a short linger).
    pub fn stop(
        &self,
        mut server: Supervised,
        keeper: Option<Keeper>,
    ) -> Option<serde_json::Value> {
        if let Some(keeper) = &keeper {
            keeper.give_up();
            if let Some(held) = keeper.take() {
                server = held;
            }
        }
        let mut stats = cache_server::stats(&self.vrtspike, &self.address);
        if let (Some(shared), Some(serde_json::Value::Object(figures))) =
            (&self.shared, stats.as_mut())
        {
            let this_job = figures
                .get("jobs")
                .and_then(serde_json::Value::as_array)
                .and_then(|jobs| jobs.iter().find(|j| j["job"] == self.job_label.as_str()))
                .cloned();
            figures.insert(
                "sharing".into(),
                serde_json::json!({"mode": "node", "address": self.address,
                    "job": shared.job, "figures": "server-wide", "this_job": this_job}),
            );
        }
        if let (Some(fell_back), Some(serde_json::Value::Object(figures))) =
            (&self.fell_back, stats.as_mut())
        {
            figures.insert("sharing".into(), serde_json::json!(fell_back.sharing()));
        }
        spawn::stop_all(&mut [&mut server], Duration::from_secs(5));
        // One its re-attach got while giving up.
        if let Some(mut late) = keeper.and_then(Keeper::finish) {
            spawn::stop_all(&mut [&mut late], Duration::from_secs(5));
        }
        stats
    }
}

/// The node-shared server's address and this job's name for it; `None` (one
/// server for this job, with a warning) when the config names no DATA.ROOT.
fn shared_setup(
    args: &Args,
    facts: &ConfigFacts,
    run_dir: &RunDir,
) -> Result<Option<(String, SharedSetup)>> {
    let Some(root) = &facts.data_root else {
        tracing::warn!(
            "DATA.CACHE_SHARING is node but DATA.ROOT is null: this job starts a cache server \
             of its own"
        );
        return Ok(None);
    };
    let (address, signature) = vrtspike_contract::cache_addr::node_shared_address(root)?;
    tracing::info!(
        address,
        root = %signature.root.display(),
        files = signature.tally.files,
        bytes = signature.tally.bytes,
        full = signature.coverage == Coverage::Full,
        "DATA.CACHE_SHARING is node: one cache server for this user's jobs on this dataset \
         (signed in {:.2} s, once for the job's ranks on this node)",
        signature.took.as_secs_f64()
    );
    let wanted_cap = match args.cache_size.as_deref() {
        Some(text) => vrtspike_contract::size::parse_size(text)
            .with_context(|| format!("--cache-size {text:?} is not a size (e.g. 20G)"))?,
        None => facts.cache_bytes,
    };
    let job = format!(
        "job {} (launcher pid {})",
        run_dir.path.display(),
        std::process::id()
    );
    let linger_s =
        vrtspike_contract::shared_server::linger_s(args.cache_linger_s, &|n| std::env::var(n).ok())
            .map_err(anyhow::Error::msg)?;
    let setup = SharedSetup {
        job,
        wanted_cap,
        wanted_connections: facts.connections,
        linger_s,
    };
    Ok(Some((address, setup)))
}
