//! A private SLURM for the tests: Debian's munged, slurmctld and slurmd (packages
//! `slurm-wlm` and `munge`, which `make test` installs), started in the foreground
//! as children of the test, with everything in a folder of its own under the
//! test's temporary folder: config (`etc/slurm.conf`, handed to the client commands
//! as `SLURM_CONF`), state, a spool folder per node, logs, the munge key and socket.
//! Process tracking is `proctrack/linuxproc` with `task/none` (no cgroups, no
//! systemd). Two shapes:
//!
//! - [`SlurmCluster::one_node`]: every daemon on this host, the node `localhost`
//!   (so `MASTER_ADDR` resolves anywhere), ports the kernel picked;
//! - [`SlurmCluster::on_virtual_hosts`]: munged and slurmctld on a controller host
//!   and one slurmd on each of N nodes, each node a host of its own
//!   (`common/vhosts.rs`: its own network, hostname, `/run` and `/dev/shm`), with
//!   `NodeAddr` and `NodeHostname` per node and SLURM's default ports (the hosts'
//!   network namespaces are private), and `SlurmdTimeout` as the test asks.
//!
//! Requeued jobs wait `AuthInfo=cred_expire` + 1 s before they may run again (120 s
//! by default) and are then started by the next pass of the main scheduler
//! (`sched_interval`, 60 s by default): the clusters set [`CRED_EXPIRE_S`] and
//! [`SCHED_INTERVAL_S`] so a requeue costs seconds, not minutes.
//!
//! Every process of a job has its working directory in the folder it was submitted
//! from, and every `slurmstepd` in the daemons' folder: [`processes_under`] finds
//! them by that, on every node (the hosts share this machine's process table).
//! Dropping the cluster cancels its jobs, kills whatever of them is left, stops the
//! daemons and leaves nothing running (and, on virtual hosts, removes the hosts).
//! A test includes it beside `mod common;` and the hosts' module
//! (`#[path = "common/slurm_cluster.rs"] mod slurm_cluster;`, `#[path =
//! "common/vhosts.rs"] mod vhosts;`).
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::common::{alive, cmdline, find_program, free_port, missing, signal, wait_until};
use crate::vhosts::{self, Host, VirtualHosts};

/// The one-node cluster's node (and `MASTER_ADDR` of its jobs).
pub const NODE: &str = "localhost";
/// `AuthInfo=cred_expire`: a requeued job waits this + 1 s before it may start.
pub const CRED_EXPIRE_S: u64 = 10;
/// `SchedulerParameters=sched_interval`: how often pending jobs are looked at.
pub const SCHED_INTERVAL_S: u64 = 2;
/// SLURM's own `SlurmdTimeout`: how long a silent node stays up.
pub const DEFAULT_SLURMD_TIMEOUT_S: u64 = 300;
/// slurmctld's and slurmd's ports on virtual hosts (SLURM's defaults).
const CTLD_PORT: u16 = 6817;
const SLURMD_PORT: u16 = 6818;

/// The programs the cluster needs.
const PROGRAMS: [&str; 9] = [
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "scontrol",
    "squeue",
    "scancel",
    "sinfo",
    "srun",
];

/// Why a real SLURM cannot run here, if it cannot.
pub fn unavailable() -> Option<String> {
    missing(
        "slurmd starts the jobs as their user",
        &PROGRAMS,
        "slurm-wlm and munge",
    )
}

/// Why a real SLURM on virtual hosts cannot run here, if it cannot.
pub fn unavailable_on_virtual_hosts() -> Option<String> {
    unavailable().or_else(vhosts::unavailable)
}

/// A daemon run in the foreground by the test.
struct Daemon {
    /// Its name in messages and log files (`slurmd.vn1`, ...).
    label: String,
    /// The test's child: the daemon, or on a virtual host the `nsenter` that
    /// waits for it.
    child: Child,
    /// The daemon's pid.
    pid: u32,
}

/// Where a daemon runs.
#[derive(Debug, Clone, Copy)]
enum Place {
    /// On this host.
    Here,
    /// On the virtual controller host.
    Controller,
    /// On virtual node `index`.
    Node(usize),
}

/// One job as `scontrol -o show job` reports it.
#[derive(Debug, Clone)]
pub struct JobInfo {
    /// `KEY=value` pairs of the line.
    pub fields: Vec<(String, String)>,
}

impl JobInfo {
    /// The value of `key` (`JobState`, `Restarts`, `ExitCode`, `Reason`, ...).
    pub fn get(&self, key: &str) -> &str {
        self.fields
            .iter()
            .find(|(k, _)| k == key)
            .map_or("", |(_, v)| v.as_str())
    }

    /// `JobState`.
    pub fn state(&self) -> &str {
        self.get("JobState")
    }

    /// `Restarts`: how many times the job was requeued.
    pub fn restarts(&self) -> u32 {
        self.get("Restarts").parse().unwrap_or(u32::MAX)
    }

    /// The fields a failure message shows.
    pub fn brief(&self) -> String {
        [
            "JobState", "Reason", "Restarts", "ExitCode", "RunTime", "NodeList",
        ]
        .iter()
        .map(|k| format!("{k}={}", self.get(k)))
        .collect::<Vec<_>>()
        .join(" ")
    }
}

/// How many virtual nodes, and how long SLURM waits for a silent one.
#[derive(Debug, Clone, Copy)]
pub struct MultiNode {
    /// Nodes (`vn1`...).
    pub nodes: usize,
    /// `SlurmdTimeout`.
    pub slurmd_timeout_s: u64,
}

/// A node as a test looks at it after a job: where its shared memory and its
/// Unix sockets are listed.
#[derive(Debug, Clone)]
pub struct NodeView {
    /// The node's name.
    pub name: String,
    /// Its `/dev/shm`.
    pub shm_dir: PathBuf,
    /// Its `/proc/net/unix`.
    pub unix_table: PathBuf,
}

/// The running cluster.
pub struct SlurmCluster {
    dir: PathBuf,
    /// Where the tests submit jobs from (their processes work there).
    jobs_dir: PathBuf,
    conf: PathBuf,
    cpus: u32,
    /// The nodes' names.
    nodes: Vec<String>,
    daemons: Vec<Daemon>,
    /// The hosts the daemons run on, if not this one; dropped (removed) after
    /// [`Drop::drop`] stopped the daemons.
    hosts: Option<VirtualHosts>,
}

impl SlurmCluster {
    /// Starts munged, slurmctld and slurmd on this host with everything under
    /// `dir` (created), for jobs submitted from `jobs_dir` (not under `dir`), and
    /// waits until the node is idle. Panics, with the daemons' logs, when it cannot.
    pub fn one_node(dir: &Path, jobs_dir: &Path) -> SlurmCluster {
        let mut cluster = SlurmCluster::new(dir, jobs_dir, None, vec![NODE.to_string()]);
        cluster.start_munge(Place::Here);
        cluster.write_config(None);
        cluster.spawn("slurmctld", "slurmctld", &["-D", "-i", "-f"], Place::Here);
        cluster.spawn("slurmd", "slurmd", &["-D", "-N", NODE, "-f"], Place::Here);
        cluster.wait_idle();
        cluster
    }

    /// Makes the virtual hosts (`common/vhosts.rs`) and starts munged and
    /// slurmctld on the controller and a slurmd on each node, with everything
    /// under `dir` (created), for jobs submitted from `jobs_dir` (not under `dir`);
    /// waits until every node is idle. Panics, with the daemons' logs, when it
    /// cannot (the hosts are removed again).
    pub fn on_virtual_hosts(dir: &Path, jobs_dir: &Path, shape: MultiNode) -> SlurmCluster {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let hosts = VirtualHosts::start(dir, shape.nodes, &[jobs_dir])
            .unwrap_or_else(|e| panic!("making {} virtual hosts: {e}", shape.nodes));
        let names = hosts.nodes().iter().map(|h| h.name.clone()).collect();
        let mut cluster = SlurmCluster::new(dir, jobs_dir, Some(hosts), names);
        cluster.start_munge(Place::Controller);
        cluster.write_config(Some(shape.slurmd_timeout_s));
        cluster.spawn(
            "slurmctld",
            "slurmctld",
            &["-D", "-i", "-f"],
            Place::Controller,
        );
        for (index, name) in cluster.nodes.clone().iter().enumerate() {
            cluster.spawn(
                "slurmd",
                &format!("slurmd.{name}"),
                &["-D", "-N", name, "-f"],
                Place::Node(index),
            );
        }
        cluster.wait_idle();
        cluster
    }

    fn new(
        dir: &Path,
        jobs_dir: &Path,
        hosts: Option<VirtualHosts>,
        nodes: Vec<String>,
    ) -> SlurmCluster {
        assert!(!jobs_dir.starts_with(dir) && !dir.starts_with(jobs_dir));
        for sub in ["etc", "state", "log", "munge"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap_or_else(|e| panic!("{e}"));
        }
        for node in &nodes {
            std::fs::create_dir_all(dir.join("spool").join(node)).unwrap_or_else(|e| panic!("{e}"));
        }
        SlurmCluster {
            dir: dir.to_path_buf(),
            jobs_dir: jobs_dir.to_path_buf(),
            conf: dir.join("etc/slurm.conf"),
            cpus: node_cpus(),
            nodes,
            daemons: Vec::new(),
            hosts,
        }
    }

    fn wait_idle(&self) {
        let idle = wait_until(Duration::from_secs(60), || {
            let states = self.node_states();
            states.len() == self.nodes.len() && states.iter().all(|(_, s)| s.starts_with("idle"))
        });
        assert!(
            idle,
            "the nodes never became idle (sinfo: {:?})\n{}",
            self.node_states(),
            self.logs()
        );
    }

    /// CPUs of a node.
    pub fn cpus(&self) -> u32 {
        self.cpus
    }

    /// The nodes' names, in order.
    pub fn node_names(&self) -> &[String] {
        &self.nodes
    }

    /// The virtual hosts, when the cluster runs on them.
    pub fn hosts(&self) -> Option<&VirtualHosts> {
        self.hosts.as_ref()
    }

    /// A client command (`sbatch`, `scontrol`, ...) of this cluster: `SLURM_CONF`
    /// set, the SLURM variables of any job around the test removed; on virtual
    /// hosts it runs in the controller's network.
    pub fn command(&self, program: &str) -> Command {
        let path = find_program(program).unwrap_or_else(|| PathBuf::from(program));
        let mut command = match &self.hosts {
            Some(hosts) => hosts.controller().enter_network(&path),
            None => Command::new(path),
        };
        for (name, _) in std::env::vars().filter(|(n, _)| n.starts_with("SLURM_")) {
            command.env_remove(name);
        }
        command.env("SLURM_CONF", &self.conf).stdin(Stdio::null());
        command
    }

    /// Runs a client command to its end; its standard output, or a panic with
    /// what it said.
    pub fn run(&self, program: &str, args: &[&str]) -> String {
        let mut command = self.command(program);
        command.args(args);
        stdout_of(command, &format!("{program} {args:?}"))
    }

    /// The job as `scontrol` sees it (`None` once SLURM forgot it).
    pub fn job(&self, id: u32) -> Option<JobInfo> {
        let output = self
            .command("scontrol")
            .args(["-o", "show", "job", &id.to_string()])
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&output.stdout);
        let line = text.lines().find(|l| l.starts_with("JobId="))?;
        let fields = line
            .split_whitespace()
            .filter_map(|token| token.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Some(JobInfo { fields })
    }

    /// The state `squeue` shows (`PENDING`, `RUNNING`, `COMPLETING`, ...), empty
    /// once the job has left the queue.
    pub fn queue_state(&self, id: u32) -> String {
        self.command("squeue")
            .args(["--noheader", "--format=%T", "--jobs", &id.to_string()])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    }

    /// Each node's state as `sinfo` shows it (`idle`, `allocated`, `down*`, ...).
    pub fn node_states(&self) -> Vec<(String, String)> {
        self.command("sinfo")
            .args(["--Node", "--noheader", "--format=%N %T"])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .filter_map(|l| l.split_once(' '))
                    .map(|(n, s)| (n.to_string(), s.trim().to_string()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The state of node `name` (empty when sinfo does not show it).
    pub fn node_state(&self, name: &str) -> String {
        self.node_states()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| s)
            .unwrap_or_default()
    }

    /// Where each node's shared memory and Unix sockets are listed.
    pub fn node_views(&self) -> Vec<NodeView> {
        match &self.hosts {
            Some(hosts) => hosts
                .nodes()
                .iter()
                .map(|h| NodeView {
                    name: h.name.clone(),
                    shm_dir: h.shm_dir(),
                    unix_table: h.unix_table(),
                })
                .collect(),
            None => vec![NodeView {
                name: NODE.to_string(),
                shm_dir: PathBuf::from("/dev/shm"),
                unix_table: PathBuf::from("/proc/net/unix"),
            }],
        }
    }

    /// Processes on the virtual nodes other than their slurmd, as `(node, pid,
    /// command line)`: after a job, what it left there. Empty for the one-node
    /// cluster, whose host runs everything else too.
    pub fn strays_on_nodes(&self) -> Vec<(String, u32, String)> {
        let Some(hosts) = &self.hosts else {
            return Vec::new();
        };
        let daemons: Vec<u32> = self.daemons.iter().map(|d| d.pid).collect();
        hosts
            .nodes()
            .iter()
            .flat_map(|host| {
                host.processes()
                    .into_iter()
                    .filter(|(pid, _)| !daemons.contains(pid))
                    .map(|(pid, line)| (host.name.clone(), pid, line))
            })
            .collect()
    }

    /// The last lines of the daemons' logs, for failure messages.
    pub fn logs(&self) -> String {
        let mut names = vec!["slurmctld.log".to_string()];
        names.extend(self.nodes.iter().map(|n| format!("slurmd.{n}.log")));
        names.push("munged.log".into());
        let mut text = String::new();
        for name in names {
            let path = self.dir.join("log").join(name);
            let log = std::fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let tail = &lines[lines.len().saturating_sub(15)..];
            text.push_str(&format!(
                "--- {} ---\n{}\n",
                path.display(),
                tail.join("\n")
            ));
        }
        text
    }

    /// Cancels every job of the cluster and waits until none is left, nor any of
    /// their processes (those still there after the wait are killed). Returns the
    /// processes that had to be killed.
    pub fn clear(&self) -> Vec<String> {
        let queue = self
            .command("squeue")
            .args(["--noheader", "--format=%i"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let ids: Vec<&str> = queue.split_whitespace().collect();
        if !ids.is_empty() {
            let _ = self.command("scancel").args(&ids).status();
        }
        let gone = || {
            self.queue_is_empty()
                && processes_under(&self.jobs_dir).is_empty()
                && self.step_daemons().is_empty()
        };
        if wait_until(Duration::from_secs(90), gone) {
            return Vec::new();
        }
        let mut killed = Vec::new();
        for (pid, line) in processes_under(&self.jobs_dir)
            .into_iter()
            .chain(self.step_daemons())
        {
            signal(pid, Signal::SIGKILL);
            killed.push(format!("{pid} {line}"));
        }
        killed
    }

    fn queue_is_empty(&self) -> bool {
        self.command("squeue")
            .args(["--noheader", "--format=%i"])
            .output()
            .is_ok_and(|o| o.status.success() && o.stdout.iter().all(u8::is_ascii_whitespace))
    }

    /// The `slurmstepd` processes of this cluster (working directory: its folder).
    pub fn step_daemons(&self) -> Vec<(u32, String)> {
        processes_under(&self.dir)
            .into_iter()
            .filter(|(_, line)| line.starts_with("slurmstepd"))
            .collect()
    }

    fn start_munge(&mut self, place: Place) {
        let munge = self.dir.join("munge");
        // munged wants its socket folder searchable by all and its key private.
        std::fs::set_permissions(&munge, std::fs::Permissions::from_mode(0o755))
            .unwrap_or_else(|e| panic!("{e}"));
        let key = munge.join("munge.key");
        let mut random = vec![0u8; 1024];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut urandom| std::io::Read::read_exact(&mut urandom, &mut random))
            .unwrap_or_else(|e| panic!("/dev/urandom: {e}"));
        std::fs::write(&key, &random).unwrap_or_else(|e| panic!("{}: {e}", key.display()));
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o400))
            .unwrap_or_else(|e| panic!("{e}"));
        // A socket with a path: every host reaches it, whatever its network.
        let socket = munge.join("munge.socket");
        let args = [
            "-F".to_string(),
            format!("--socket={}", socket.display()),
            format!("--key-file={}", key.display()),
            format!("--pid-file={}", munge.join("munged.pid").display()),
            format!("--log-file={}", self.dir.join("log/munged.log").display()),
            format!("--seed-file={}", munge.join("munged.seed").display()),
        ];
        self.spawn_with("munged", "munged", &args, place);
        let up = wait_until(Duration::from_secs(30), || socket.exists());
        assert!(
            up,
            "munged did not create {}\n{}",
            socket.display(),
            self.logs()
        );
    }

    /// `slurm.conf`: the part every shape shares, then the controller's host and
    /// ports and the nodes (with `SlurmdTimeout` when given).
    fn write_config(&self, slurmd_timeout_s: Option<u64>) {
        let d = self.dir.display();
        let mut text = format!(
            "# A private cluster of the vrtspike tests (launcher/tests/common/slurm_cluster.rs).\n\
             ClusterName=vrtspiketest\n\
             SlurmUser=root\n\
             SlurmdUser=root\n\
             AuthType=auth/munge\n\
             CredType=cred/munge\n\
             # cred_expire: how long a requeued job waits (+1 s); 120 s by default.\n\
             AuthInfo=socket={d}/munge/munge.socket,cred_expire={CRED_EXPIRE_S}\n\
             StateSaveLocation={d}/state\n\
             SlurmdSpoolDir={d}/spool/%n\n\
             SlurmctldPidFile={d}/slurmctld.pid\n\
             SlurmdPidFile={d}/slurmd.%n.pid\n\
             SlurmctldLogFile={d}/log/slurmctld.log\n\
             SlurmdLogFile={d}/log/slurmd.%n.log\n\
             PlugStackConfig={d}/etc/plugstack.conf\n\
             ProctrackType=proctrack/linuxproc\n\
             TaskPlugin=task/none\n\
             JobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\n\
             JobCompType=jobcomp/none\n\
             MpiDefault=none\n\
             MailProg=/bin/true\n\
             SchedulerType=sched/builtin\n\
             # sched_interval: how often pending (requeued) jobs are looked at; 60 s by default.\n\
             SchedulerParameters=sched_interval={SCHED_INTERVAL_S}\n\
             SelectType=select/cons_tres\n\
             SelectTypeParameters=CR_CPU\n\
             ReturnToService=2\n\
             SlurmctldDebug=info\n\
             SlurmdDebug=info\n"
        );
        let cpus = self.cpus;
        match &self.hosts {
            None => text.push_str(&format!(
                "SlurmctldHost={NODE}(127.0.0.1)\n\
                 SlurmctldPort={ctld}\n\
                 SlurmdPort={slurmd}\n\
                 NodeName={NODE} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN\n",
                ctld = free_port(),
                slurmd = free_port(),
            )),
            Some(hosts) => {
                let controller = hosts.controller();
                text.push_str(&format!(
                    "SlurmctldHost={}({})\n\
                     SlurmctldPort={CTLD_PORT}\n\
                     SlurmdPort={SLURMD_PORT}\n",
                    controller.name, controller.addr
                ));
                if let Some(timeout) = slurmd_timeout_s {
                    text.push_str(&format!(
                        "# How long a silent node stays up (SLURM's default: 300 s).\n\
                         SlurmdTimeout={timeout}\n"
                    ));
                }
                for node in hosts.nodes() {
                    text.push_str(&format!(
                        "NodeName={name} NodeAddr={addr} NodeHostname={name} CPUs={cpus} State=UNKNOWN\n",
                        name = node.name,
                        addr = node.addr
                    ));
                }
            }
        }
        text.push_str(&format!(
            "PartitionName=vrtspike Nodes={} Default=YES MaxTime=INFINITE State=UP\n",
            self.nodes.join(",")
        ));
        std::fs::write(&self.conf, text).unwrap_or_else(|e| panic!("{e}"));
        let plugstack = self.dir.join("etc/plugstack.conf");
        std::fs::write(&plugstack, "").unwrap_or_else(|e| panic!("{e}"));
    }

    fn spawn(&mut self, program: &str, label: &str, args: &[&str], place: Place) {
        let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        all.push(self.conf.display().to_string());
        self.spawn_with(program, label, &all, place);
    }

    /// Starts a daemon in the foreground at `place`, working directory the
    /// cluster's folder, output in `log/<label>.out`; it gets SIGTERM if the test's
    /// thread dies.
    fn spawn_with(&mut self, program: &str, label: &str, args: &[String], place: Place) {
        let path = find_program(program).unwrap_or_else(|| panic!("{program} not found"));
        let mut command = match (place, &self.hosts) {
            (Place::Here, _) => {
                let mut command = Command::new(path);
                command.current_dir(&self.dir);
                command
            }
            (Place::Controller, Some(hosts)) => hosts.controller().enter(&path, &self.dir),
            (Place::Node(index), Some(hosts)) => hosts.nodes()[index].enter(&path, &self.dir),
            (_, None) => panic!("{label}: {place:?} without virtual hosts"),
        };
        let out_path = self.dir.join("log").join(format!("{label}.out"));
        let out = std::fs::File::create(&out_path).unwrap_or_else(|e| panic!("{e}"));
        let err = out.try_clone().unwrap_or_else(|e| panic!("{e}"));
        command
            .args(args)
            .env("SLURM_CONF", &self.conf)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        for (var, _) in std::env::vars().filter(|(n, _)| n.starts_with("SLURM_")) {
            command.env_remove(var);
        }
        // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches only the
        // child's own state between fork and exec.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("starting {label}: {e}"));
        let pid = match place {
            Place::Here => Some(child.id()),
            Place::Controller | Place::Node(_) => Host::entered(child.id()),
        };
        // Kept even without its pid, so that dropping the cluster reaps it.
        self.daemons.push(Daemon {
            label: label.to_string(),
            pid: pid.unwrap_or_else(|| child.id()),
            child,
        });
        assert!(pid.is_some(), "{label} exited at once\n{}", self.logs());
    }
}

impl Drop for SlurmCluster {
    fn drop(&mut self) {
        let killed = self.clear();
        if !killed.is_empty() {
            eprintln!("slurm_cluster: killed what the jobs left: {killed:?}");
        }
        // The nodes first, then the controller, then munge.
        while let Some(mut daemon) = self.daemons.pop() {
            signal(daemon.pid, Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline && matches!(daemon.child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
            if matches!(daemon.child.try_wait(), Ok(None)) {
                eprintln!("slurm_cluster: {} ignored SIGTERM: SIGKILL", daemon.label);
                signal(daemon.pid, Signal::SIGKILL);
                let _ = daemon.child.kill();
            }
            let _ = daemon.child.wait();
        }
        // slurmctld's script helper, and step daemons that outlived slurmd. The
        // virtual hosts, if any, go next (a field: dropped after this).
        for (pid, _) in processes_under(&self.dir) {
            signal(pid, Signal::SIGKILL);
        }
    }
}

/// Runs `command` (`what` in messages) to its end; its standard output, or a
/// panic with what it said.
pub fn stdout_of(mut command: Command, what: &str) -> String {
    let output = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{what}: {}\n{stdout}{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// CPUs slurmd finds on this machine (`slurmd -C`), at least 1.
fn node_cpus() -> u32 {
    let output = find_program("slurmd")
        .and_then(|slurmd| Command::new(slurmd).arg("-C").output().ok())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    output
        .split_whitespace()
        .find_map(|token| token.strip_prefix("CPUs="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(1)
        .max(1)
}

/// Live processes (not zombies) whose working directory is `dir` or under it,
/// with their command lines.
pub fn processes_under(dir: &Path) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cwd) = std::fs::read_link(format!("/proc/{pid}/cwd")) else {
            continue;
        };
        if cwd.starts_with(dir) && alive(pid) {
            found.push((pid, cmdline(pid)));
        }
    }
    found
}
