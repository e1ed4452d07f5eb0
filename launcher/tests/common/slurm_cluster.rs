//! A private one-node SLURM for the tests: Debian's munged, slurmctld and slurmd
//! (packages `slurm-wlm` and `munge`, which `make test` installs), started in the
//! foreground as children of the test, each in a folder of its own under the
//! test's temporary folder: config (`etc/slurm.conf`, handed to the client
//! commands as `SLURM_CONF`), state, spool, logs, the munge key and socket, and
//! ports the kernel picked. Process tracking is `proctrack/linuxproc` (no cgroups,
//! no systemd); the node is `localhost`, so `MASTER_ADDR` resolves anywhere.
//!
//! Requeued jobs wait `AuthInfo=cred_expire` + 1 s before they may run again (120 s
//! by default) and are then started by the next pass of the main scheduler
//! (`sched_interval`, 60 s by default): this cluster sets [`CRED_EXPIRE_S`] and
//! [`SCHED_INTERVAL_S`] so a requeue costs seconds, not minutes.
//!
//! Every process of a job has its working directory in the folder it was submitted
//! from, and every `slurmstepd` in the daemons' folder: [`processes_under`] finds
//! them by that. Dropping the cluster cancels its jobs, kills whatever of them is
//! left, stops the daemons and leaves nothing running. A test includes it beside
//! `mod common;` (`#[path = "common/slurm_cluster.rs"] mod slurm_cluster;`).

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::common::{alive, cmdline, free_port, signal, wait_until};

/// The node's name (and `MASTER_ADDR` of its jobs).
pub const NODE: &str = "localhost";
/// `AuthInfo=cred_expire`: a requeued job waits this + 1 s before it may start.
pub const CRED_EXPIRE_S: u64 = 10;
/// `SchedulerParameters=sched_interval`: how often pending jobs are looked at.
pub const SCHED_INTERVAL_S: u64 = 2;

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
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("it needs root (slurmd starts the jobs as their user)".into());
    }
    let missing: Vec<&str> = PROGRAMS
        .iter()
        .copied()
        .filter(|p| find_program(p).is_none())
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "{} not found (Debian packages slurm-wlm and munge)",
            missing.join(", ")
        )
    })
}

/// `name` on PATH or in the sbin folders (daemons live there).
pub fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/sbin", "/usr/bin"])
        .map(|dir| Path::new(dir).join(name))
        .find(|candidate| candidate.is_file());
    found
}

/// A daemon run in the foreground by the test.
struct Daemon {
    name: &'static str,
    child: Child,
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
        ["JobState", "Reason", "Restarts", "ExitCode", "RunTime"]
            .iter()
            .map(|k| format!("{k}={}", self.get(k)))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// The running cluster.
pub struct OneNodeSlurm {
    dir: PathBuf,
    /// Where the tests submit jobs from (their processes work there).
    jobs_dir: PathBuf,
    conf: PathBuf,
    cpus: u32,
    daemons: Vec<Daemon>,
}

impl OneNodeSlurm {
    /// Starts munged, slurmctld and slurmd with everything under `dir` (created),
    /// for jobs submitted from `jobs_dir` (not under `dir`), and waits until the node
    /// is idle. Panics, with the daemons' logs, when it cannot.
    pub fn start(dir: &Path, jobs_dir: &Path) -> OneNodeSlurm {
        assert!(!jobs_dir.starts_with(dir) && !dir.starts_with(jobs_dir));
        for sub in ["etc", "state", "spool", "log", "munge"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap_or_else(|e| panic!("{e}"));
        }
        let mut cluster = OneNodeSlurm {
            dir: dir.to_path_buf(),
            jobs_dir: jobs_dir.to_path_buf(),
            conf: dir.join("etc/slurm.conf"),
            cpus: node_cpus(),
            daemons: Vec::new(),
        };
        cluster.start_munge();
        cluster.write_config();
        cluster.spawn("slurmctld", &["-D", "-i", "-f"]);
        cluster.spawn("slurmd", &["-D", "-N", NODE, "-f"]);
        let idle = wait_until(Duration::from_secs(60), || {
            cluster.node_state().starts_with("idle")
        });
        assert!(
            idle,
            "the node never became idle (sinfo: {:?})\n{}",
            cluster.node_state(),
            cluster.logs()
        );
        cluster
    }

    /// CPUs of the node.
    pub fn cpus(&self) -> u32 {
        self.cpus
    }

    /// A client command (`sbatch`, `scontrol`, ...) of this cluster: `SLURM_CONF`
    /// set, the SLURM variables of any job around the test removed.
    pub fn command(&self, program: &str) -> Command {
        let path = find_program(program).unwrap_or_else(|| PathBuf::from(program));
        let mut command = Command::new(path);
        for (name, _) in std::env::vars().filter(|(n, _)| n.starts_with("SLURM_")) {
            command.env_remove(name);
        }
        command.env("SLURM_CONF", &self.conf).stdin(Stdio::null());
        command
    }

    /// Runs a client command to its end; its standard output, or a panic with
    /// what it said.
    pub fn run(&self, program: &str, args: &[&str]) -> String {
        let output = self
            .command(program)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{program}: {e}"));
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "{program} {args:?}: {}\n{stdout}{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        stdout
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

    /// The node's state (`idle`, `allocated`, ...).
    pub fn node_state(&self) -> String {
        self.command("sinfo")
            .args(["--noheader", "--nodes", NODE, "--format=%T"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    }

    /// The last lines of the daemons' logs, for failure messages.
    pub fn logs(&self) -> String {
        let mut text = String::new();
        for name in ["slurmctld.log", "slurmd.log", "munged.log"] {
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

    fn start_munge(&mut self) {
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
        let socket = munge.join("munge.socket");
        let args = [
            "-F".to_string(),
            format!("--socket={}", socket.display()),
            format!("--key-file={}", key.display()),
            format!("--pid-file={}", munge.join("munged.pid").display()),
            format!("--log-file={}", self.dir.join("log/munged.log").display()),
            format!("--seed-file={}", munge.join("munged.seed").display()),
        ];
        self.spawn_with("munged", &args);
        let up = wait_until(Duration::from_secs(30), || socket.exists());
        assert!(
            up,
            "munged did not create {}\n{}",
            socket.display(),
            self.logs()
        );
    }

    fn write_config(&self) {
        let d = self.dir.display();
        let text = format!(
            "# A private one-node cluster of the vrtspike tests (launcher/tests/common/slurm_cluster.rs).\n\
             ClusterName=vrtspiketest\n\
             SlurmctldHost={NODE}(127.0.0.1)\n\
             SlurmctldPort={ctld}\n\
             SlurmdPort={slurmd}\n\
             SlurmUser=root\n\
             SlurmdUser=root\n\
             AuthType=auth/munge\n\
             CredType=cred/munge\n\
             # cred_expire: how long a requeued job waits (+1 s); 120 s by default.\n\
             AuthInfo=socket={d}/munge/munge.socket,cred_expire={CRED_EXPIRE_S}\n\
             StateSaveLocation={d}/state\n\
             SlurmdSpoolDir={d}/spool\n\
             SlurmctldPidFile={d}/slurmctld.pid\n\
             SlurmdPidFile={d}/slurmd.pid\n\
             SlurmctldLogFile={d}/log/slurmctld.log\n\
             SlurmdLogFile={d}/log/slurmd.log\n\
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
             SlurmdDebug=info\n\
             NodeName={NODE} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN\n\
             PartitionName=vrtspike Nodes={NODE} Default=YES MaxTime=INFINITE State=UP\n",
            ctld = free_port(),
            slurmd = free_port(),
            cpus = self.cpus,
        );
        std::fs::write(&self.conf, text).unwrap_or_else(|e| panic!("{e}"));
        let plugstack = self.dir.join("etc/plugstack.conf");
        std::fs::write(&plugstack, "").unwrap_or_else(|e| panic!("{e}"));
    }

    fn spawn(&mut self, name: &'static str, args: &[&str]) {
        let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        all.push(self.conf.display().to_string());
        self.spawn_with(name, &all);
    }

    /// Starts a daemon in the foreground, working directory the cluster's folder,
    /// output in `log/<name>.out`; it gets SIGTERM if the test's thread dies.
    fn spawn_with(&mut self, name: &'static str, args: &[String]) {
        let program = find_program(name).unwrap_or_else(|| panic!("{name} not found"));
        let out_path = self.dir.join("log").join(format!("{name}.out"));
        let out = std::fs::File::create(&out_path).unwrap_or_else(|e| panic!("{e}"));
        let err = out.try_clone().unwrap_or_else(|e| panic!("{e}"));
        let mut command = Command::new(program);
        command
            .args(args)
            .current_dir(&self.dir)
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
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        self.daemons.push(Daemon { name, child });
    }
}

impl Drop for OneNodeSlurm {
    fn drop(&mut self) {
        let killed = self.clear();
        if !killed.is_empty() {
            eprintln!("slurm_cluster: killed what the jobs left: {killed:?}");
        }
        // The node first, then the controller, then munge.
        while let Some(mut daemon) = self.daemons.pop() {
            signal(daemon.child.id(), Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline && matches!(daemon.child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
            if matches!(daemon.child.try_wait(), Ok(None)) {
                eprintln!("slurm_cluster: {} ignored SIGTERM: SIGKILL", daemon.name);
                let _ = daemon.child.kill();
            }
            let _ = daemon.child.wait();
        }
        // slurmctld's script helper, and step daemons that outlived slurmd.
        for (pid, _) in processes_under(&self.dir) {
            signal(pid, Signal::SIGKILL);
        }
    }
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
