//! The launcher's command line: what to run (config, GPUs or CPU ranks), where
//! (run directory, nodes), and how to supervise it (grace, restarts, preemption).

use std::path::PathBuf;
use std::str::FromStr;

use clap::{Parser, ValueEnum};
use nix::sys::signal::Signal;
use vrtspike_contract::seconds::{parse_positive_seconds, parse_seconds};

/// Runs a vrtspike training job on this node: the node's cache server, then one
/// rank per GPU (or `--gpus 0 --ranks N` CPU ranks), supervised as a gang.
#[derive(Parser, Debug)]
#[command(name = "vrtspike-launch", version, about, long_about = None, args_override_self = true)]
pub struct Args {
    /// Run config (YAML), handed to every rank and to the cache server.
    #[arg(long)]
    pub config: PathBuf,

    /// GPUs on this node, one rank each (default: every visible GPU; 0 = CPU ranks).
    #[arg(long)]
    pub gpus: Option<u32>,

    /// CPU ranks on this node (only with --gpus 0; default 1).
    #[arg(long)]
    pub ranks: Option<u32>,

    /// Run directory (default `runs/<date>-<time>`); reusing one resumes from its
    /// last checkpoint.
    #[arg(long)]
    pub run_dir: Option<PathBuf>,

    /// Restarts of the whole gang after a failure, each from the last checkpoint.
    /// A restart is skipped when the attempt before it failed the same way without
    /// writing a new checkpoint (a crash loop).
    #[arg(long, default_value_t = 3)]
    pub max_restarts: u32,

    /// Seconds between SIGTERM and SIGKILL when the gang is stopped.
    #[arg(long, default_value_t = 10.0, value_parser = parse_seconds)]
    pub grace_s: f64,

    /// Seconds to wait before a restart.
    #[arg(long, default_value_t = 1.0, value_parser = parse_seconds)]
    pub restart_delay_s: f64,

    /// Signal that asks for preemption (SIGTERM always does too): the ranks get
    /// SIGUSR2, save a checkpoint and exit 0, and so does the launcher.
    #[arg(long, default_value = "SIGUSR2", value_parser = parse_signal)]
    pub preempt_signal: Signal,

    /// Seconds the ranks have to checkpoint and exit after a preemption request.
    #[arg(long, default_value_t = 300.0, value_parser = parse_seconds)]
    pub preempt_timeout_s: f64,

    /// Seconds a rank may stay at one step, phase and collective (per its
    /// heartbeat) while another rank got further (or, alone, at all) before it
    /// counts as hung: it is named, every rank's stacks are saved in the run dir,
    /// and the gang restarts from the last checkpoint. Keep it below DIST.TIMEOUT_S
    /// so the hung rank is named before the waiting ones time out; 0 disables.
    #[arg(long, default_value_t = 300.0, value_parser = parse_seconds)]
    pub hang_timeout_s: f64,

    /// Seconds a rank's liveness tick (a thread of its own advances it twice a
    /// second, whatever the rank waits for) may stay still before the rank counts
    /// as stopped (SIGSTOP, a debugger, a wedged process): it is named, with the
    /// ranks waiting for it, stacks are saved and the gang restarts, as for a hang.
    /// 0 disables.
    #[arg(long, default_value_t = 30.0, value_parser = parse_seconds)]
    pub stall_timeout_s: f64,

    /// Number of nodes (each runs its own launcher); needs --master-addr and
    /// --master-port when above 1. Read from SLURM when it runs the job.
    #[arg(long)]
    pub nnodes: Option<u32>,

    /// This node's index among the --nnodes nodes.
    #[arg(long)]
    pub node_rank: Option<u32>,

    /// Address of the node that runs rank 0 (default 127.0.0.1, or the first host
    /// of SLURM_NODELIST).
    #[arg(long)]
    pub master_addr: Option<String>,

    /// Port of rank 0's rendezvous store (default: a port free on node 0, chosen
    /// for each attempt and sent to the other nodes).
    #[arg(long)]
    pub master_port: Option<u16>,

    /// Port where node 0's launcher listens for the other nodes' launchers, on the
    /// master address (multi-node only; default: one the kernel picks, published
    /// with the job's secret in the run dir's control.json, which the other nodes
    /// read; without a shared run dir give this and VRTSPIKE_JOB_SECRET).
    #[arg(long)]
    pub control_port: Option<u16>,

    /// Seconds a node's launcher keeps trying to reach node 0's launcher.
    #[arg(long, default_value_t = 300.0, value_parser = parse_seconds)]
    pub peer_timeout_s: f64,

    /// Seconds a linked node's launcher may stay silent (no beat, no line) before
    /// the others name it lost and end the job on every node with exit status 75
    /// (multi-node only; the launchers beat every second).
    #[arg(long, default_value_t = 30.0, value_parser = parse_positive_seconds)]
    pub peer_silence_s: f64,

    /// Elastic membership: the fewest nodes the job may go on with. When a node is
    /// lost (silent for --peer-silence-s) and at least this many remain, node 0
    /// renumbers the nodes and ranks that remain and every rank restarts from the
    /// last checkpoint in the smaller world, the global batch kept by gradient
    /// accumulation (a membership change, not a restart of --max-restarts). Default:
    /// every node (a lost node ends the job, exit status 75). 1 <= N <= nodes; a lost
    /// node 0 always ends the job.
    #[arg(long)]
    pub min_nodes: Option<u32>,

    /// Whether to take the node layout from SLURM's environment.
    #[arg(long, value_enum, default_value_t = SlurmMode::Auto)]
    pub slurm: SlurmMode,

    /// Override a config key, `KEY.PATH=VALUE` (YAML value); repeatable, applied in
    /// order. Passed unchanged to every rank, the cache server and the plan check.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,

    /// Start without the memory plan check (`vrtspike plan`), which otherwise
    /// refuses a plan with a term that cannot fit.
    #[arg(long)]
    pub no_plan_check: bool,

    /// Cache server byte cap (e.g. 20G), instead of the config's DATA.CACHE_SIZE_GB.
    #[arg(long)]
    pub cache_size: Option<String>,

    /// Seconds the cache server has to start accepting connections.
    #[arg(long, default_value_t = 60.0, value_parser = parse_seconds)]
    pub cache_start_timeout_s: f64,

    /// With `DATA.CACHE_SHARING: node`: seconds a node-shared cache server this
    /// launcher starts stays after the last job detached (back-to-back jobs find
    /// the cache warm). Default: VRTSPIKE_CACHE_LINGER_S, else 0 inside a SLURM
    /// allocation, else 30. Given twice, the last wins.
    #[arg(long, value_parser = parse_seconds, overrides_with = "cache_linger_s")]
    pub cache_linger_s: Option<f64>,

    /// Seconds between samples of the job's memory (summed Pss of the process tree).
    #[arg(long, default_value_t = 1.0, value_parser = parse_positive_seconds)]
    pub pss_interval_s: f64,

    /// Testing hook: a program run instead of `vrtspike` for the ranks (it gets the
    /// same arguments and environment).
    #[arg(long, hide = true)]
    pub rank_cmd: Option<PathBuf>,

    /// Extra arguments for `vrtspike train`, after `--`.
    #[arg(last = true)]
    pub train_args: Vec<String>,
}

/// Whether the node layout comes from SLURM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SlurmMode {
    /// From SLURM when SLURM_PROCID is set and no --nnodes/--node-rank is given.
    Auto,
    /// Always from SLURM (an error outside a SLURM step).
    On,
    /// Never: --nnodes/--node-rank/--master-addr or one node.
    Off,
}

/// Parses `SIGUSR2`, `USR2`, `usr2` or a signal number.
pub fn parse_signal(text: &str) -> Result<Signal, String> {
    let upper = text.trim().to_ascii_uppercase();
    let parsed = match upper.parse::<i32>() {
        Ok(number) => Signal::try_from(number).ok(),
        Err(_) if upper.starts_with("SIG") => Signal::from_str(&upper).ok(),
        Err(_) => Signal::from_str(&format!("SIG{upper}")).ok(),
    };
    match parsed {
        Some(Signal::SIGKILL | Signal::SIGSTOP) => Err(format!("{text} cannot be caught")),
        Some(signal) => Ok(signal),
        None => Err(format!(
            "{text:?} is not a signal name (e.g. SIGUSR2) or number"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_by_name_short_name_and_number() {
        assert_eq!(parse_signal("SIGUSR2"), Ok(Signal::SIGUSR2));
        assert_eq!(parse_signal("usr1"), Ok(Signal::SIGUSR1));
        assert_eq!(parse_signal("15"), Ok(Signal::SIGTERM));
        assert!(parse_signal("SIGKILL").is_err());
        assert!(parse_signal("NOPE").unwrap_err().contains("NOPE"));
    }

    #[test]
    fn defaults_and_passthrough_arguments() {
        let args = Args::try_parse_from([
            "vrtspike-launch",
            "--config",
            "c.yaml",
            "--gpus",
            "0",
            "--ranks",
            "2",
            "--",
            "--steps",
            "5",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(args.max_restarts, 3);
        assert_eq!(args.grace_s, 10.0);
        assert_eq!(args.hang_timeout_s, 300.0);
        assert_eq!(args.stall_timeout_s, 30.0);
        assert_eq!(args.preempt_signal, Signal::SIGUSR2);
        assert_eq!(args.train_args, ["--steps", "5"]);
        assert!(args.set.is_empty() && !args.no_plan_check);
        let args = Args::try_parse_from([
            "x",
            "--config",
            "c",
            "--set",
            "TRAIN.LR=0.1",
            "--set=DATA.CROP_SIZE=64",
            "--no-plan-check",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(args.set, ["TRAIN.LR=0.1", "DATA.CROP_SIZE=64"]);
        assert!(args.no_plan_check);
        assert!(Args::try_parse_from(["x", "--config", "c", "--grace-s", "-1"]).is_err());
        // Past a day: refused here, not a panic where it becomes a Duration.
        assert!(Args::try_parse_from(["x", "--config", "c", "--grace-s", "1e300"]).is_err());
        assert!(Args::try_parse_from(["x", "--config", "c", "--pss-interval-s", "0"]).is_err());
    }
}
