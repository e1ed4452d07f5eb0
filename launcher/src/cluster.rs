//! Where this launcher sits in the job: how many nodes, which one it is, and where
//! rank 0's rendezvous store listens, from SLURM's environment, from
//! `--nnodes/--node-rank/--master-addr`, or one node on loopback. The store's port
//! is `--master-port` when given, else node 0 picks a free one for each attempt
//! (and tells the other nodes): nothing is derived from the job id, so jobs that
//! share node 0 cannot collide.

use vrtspike_contract::hostlist;

use crate::args::{Args, SlurmMode};

/// The node layout of the job, as this launcher sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Nodes in the job (one launcher and one cache server each).
    pub nnodes: u32,
    /// This node's index, 0-based.
    pub node_rank: u32,
    /// Host of rank 0's store.
    pub master_addr: String,
    /// Port of rank 0's store; `None` = node 0 picks a free one per attempt.
    pub master_port: Option<u16>,
    /// Where the layout came from, for the log and the summary.
    pub source: &'static str,
}

/// Why the node layout could not be worked out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    /// A SLURM variable is missing or not a number.
    #[error("SLURM variable {name}: {problem}")]
    SlurmVar {
        /// The variable.
        name: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// The host list does not parse.
    #[error(transparent)]
    HostList(#[from] hostlist::HostListError),
    /// More than one task per node under SLURM.
    #[error("SLURM runs {ntasks} tasks on {nnodes} nodes: run one launcher per node (srun --ntasks-per-node=1); it starts the ranks itself")]
    TasksPerNode {
        /// SLURM_NTASKS.
        ntasks: u32,
        /// SLURM_NNODES.
        nnodes: u32,
    },
    /// Flags that do not fit together.
    #[error("{0}")]
    Flags(String),
}

/// Works out the layout from the arguments and an environment lookup.
pub fn resolve(
    args: &Args,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Topology, TopologyError> {
    let node_flags = args.nnodes.is_some() || args.node_rank.is_some();
    let use_slurm = match args.slurm {
        SlurmMode::On => true,
        SlurmMode::Off => false,
        SlurmMode::Auto => env("SLURM_PROCID").is_some() && !node_flags,
    };
    let topology = if use_slurm {
        if node_flags {
            return Err(TopologyError::Flags(
                "--nnodes/--node-rank cannot be combined with --slurm on".into(),
            ));
        }
        from_slurm(args, env)?
    } else {
        from_flags(args)?
    };
    check_min_nodes(args.min_nodes, topology.nnodes)?;
    Ok(topology)
}

/// `--min-nodes` must lie between 1 and the job's nodes.
fn check_min_nodes(min_nodes: Option<u32>, nnodes: u32) -> Result<(), TopologyError> {
    match min_nodes {
        Some(n) if n == 0 || n > nnodes => Err(TopologyError::Flags(format!(
            "--min-nodes {n}: it must be between 1 and the job's {nnodes} node(s)"
        ))),
        _ => Ok(()),
    }
}

fn from_slurm(
    args: &Args,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Topology, TopologyError> {
    let text = |name: &'static str| {
        env(name).ok_or(TopologyError::SlurmVar {
            name,
            problem: "not set (is this a SLURM job step?)".into(),
        })
    };
    let number = |name: &'static str, value: String| {
        value
            .trim()
            .parse::<u32>()
            .map_err(|_| TopologyError::SlurmVar {
                name,
                problem: format!("{value:?} is not a number"),
            })
    };
    let nodelist = env("SLURM_STEP_NODELIST")
        .or_else(|| env("SLURM_NODELIST"))
        .or_else(|| env("SLURM_JOB_NODELIST"))
        .ok_or(TopologyError::SlurmVar {
            name: "SLURM_NODELIST",
            problem: "not set".into(),
        })?;
    let hosts = hostlist::expand(&nodelist)?;
    let ntasks = number("SLURM_NTASKS", text("SLURM_NTASKS")?)?;
    let nnodes = match env("SLURM_NNODES").or_else(|| env("SLURM_JOB_NUM_NODES")) {
        Some(value) => number("SLURM_NNODES", value)?,
        None => u32::try_from(hosts.len()).unwrap_or(u32::MAX),
    };
    if ntasks != nnodes {
        return Err(TopologyError::TasksPerNode { ntasks, nnodes });
    }
    let procid = number("SLURM_PROCID", text("SLURM_PROCID")?)?;
    let node_rank = match env("SLURM_NODEID") {
        Some(value) => number("SLURM_NODEID", value)?,
        None => procid,
    };
    if let Some(local) = env("SLURM_LOCALID") {
        let local = number("SLURM_LOCALID", local)?;
        if local != 0 {
            return Err(TopologyError::TasksPerNode { ntasks, nnodes });
        }
    }
    if node_rank >= nnodes {
        return Err(TopologyError::SlurmVar {
            name: "SLURM_NODEID",
            problem: format!("{node_rank} is not below SLURM_NNODES={nnodes}"),
        });
    }
    let master_addr = match &args.master_addr {
        Some(addr) => addr.clone(),
        None => hosts
            .first()
            .cloned()
            .ok_or_else(|| TopologyError::SlurmVar {
                name: "SLURM_NODELIST",
                problem: "names no host".into(),
            })?,
    };
    Ok(Topology {
        nnodes,
        node_rank,
        master_addr,
        master_port: args.master_port,
        source: "SLURM",
    })
}

fn from_flags(args: &Args) -> Result<Topology, TopologyError> {
    let nnodes = args.nnodes.unwrap_or(1);
    let node_rank = args.node_rank.unwrap_or(0);
    if nnodes == 0 {
        return Err(TopologyError::Flags("--nnodes must be at least 1".into()));
    }
    if node_rank >= nnodes {
        return Err(TopologyError::Flags(format!(
            "--node-rank {node_rank} is not below --nnodes {nnodes}"
        )));
    }
    if nnodes > 1 && args.master_addr.is_none() {
        return Err(TopologyError::Flags(format!(
            "--nnodes {nnodes} needs --master-addr (node 0's address, the same on every node)"
        )));
    }
    Ok(Topology {
        nnodes,
        node_rank,
        master_addr: args
            .master_addr
            .clone()
            .unwrap_or_else(|| "127.0.0.1".into()),
        master_port: args.master_port,
        source: if nnodes > 1 { "flags" } else { "single node" },
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use clap::Parser;

    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut argv = vec!["vrtspike-launch", "--config", "c.yaml"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).unwrap_or_else(|e| panic!("{e}"))
    }

    fn slurm_env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    const JOB: &[(&str, &str)] = &[
        ("SLURM_PROCID", "2"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_NODEID", "2"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_NNODES", "4"),
        ("SLURM_NODELIST", "gpu[07-09],login1"),
        ("SLURM_JOB_ID", "123456"),
    ];

    #[test]
    fn one_node_by_default() {
        let topo = resolve(&args(&[]), &|_| None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(topo.nnodes, 1);
        assert_eq!(topo.node_rank, 0);
        assert_eq!(topo.master_addr, "127.0.0.1");
        assert_eq!(topo.master_port, None);
    }

    #[test]
    fn slurm_layout_and_first_host_as_master() {
        let topo = resolve(&args(&[]), &slurm_env(JOB)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            topo,
            Topology {
                nnodes: 4,
                node_rank: 2,
                master_addr: "gpu07".into(),
                master_port: None,
                source: "SLURM",
            },
            "no port from the job id: node 0 picks one"
        );
    }

    #[test]
    fn slurm_ignored_when_off_or_with_node_flags() {
        let env = slurm_env(JOB);
        let topo = resolve(&args(&["--slurm", "off"]), &env).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(topo.nnodes, 1);
        let flags = [
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "h",
            "--master-port",
            "7",
        ];
        let topo = resolve(&args(&flags), &env).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((topo.nnodes, topo.node_rank, topo.source), (2, 1, "flags"));
    }

    #[test]
    fn min_nodes_lies_between_1_and_the_nodes() {
        let env = slurm_env(JOB);
        for ok in ["1", "4"] {
            let topo = resolve(&args(&["--min-nodes", ok]), &env);
            assert!(topo.is_ok(), "--min-nodes {ok}: {topo:?}");
        }
        for bad in ["0", "5"] {
            let err = resolve(&args(&["--min-nodes", bad]), &env).unwrap_err();
            assert!(
                err.to_string().contains(&format!(
                    "--min-nodes {bad}: it must be between 1 and the job's 4"
                )),
                "{err}"
            );
        }
        let err = resolve(&args(&["--min-nodes", "2"]), &|_| None).unwrap_err();
        assert!(err.to_string().contains("1 node(s)"), "{err}");
    }

    #[test]
    fn slurm_errors_name_the_variable() {
        let mut many_tasks = JOB.to_vec();
        many_tasks.retain(|(k, _)| *k != "SLURM_NTASKS");
        many_tasks.push(("SLURM_NTASKS", "8"));
        let err = resolve(&args(&[]), &slurm_env(&many_tasks)).unwrap_err();
        assert!(err.to_string().contains("--ntasks-per-node=1"), "{err}");

        let mut bad = JOB.to_vec();
        bad.retain(|(k, _)| *k != "SLURM_NODELIST");
        bad.push(("SLURM_NODELIST", "gpu[07-"));
        let err = resolve(&args(&[]), &slurm_env(&bad)).unwrap_err();
        assert!(err.to_string().contains("gpu[07-"), "{err}");

        let err = resolve(&args(&["--slurm", "on"]), &|_| None).unwrap_err();
        assert!(err.to_string().contains("SLURM_NODELIST"), "{err}");
    }

    #[test]
    fn multi_node_flags_need_the_master_address() {
        let err = resolve(&args(&["--nnodes", "2"]), &|_| None).unwrap_err();
        assert!(err.to_string().contains("--master-addr"), "{err}");
        let err = resolve(&args(&["--node-rank", "1"]), &|_| None).unwrap_err();
        assert!(err.to_string().contains("--node-rank 1"), "{err}");
    }
}
