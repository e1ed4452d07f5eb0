//! Virtual hosts on this machine for the multi-node tests: a controller and N
//! nodes, each a set of Linux namespaces of its own (pid, network, UTS, mount)
//! whose init is a `sleep` started through `unshare`. Each host has its own
//! processes (and /proc), its own hostname, its own loopback (so its own abstract
//! Unix sockets: a cache server per node), an address on a private subnet, its
//! own `/run`, `/dev/shm` and `/tmp` (fresh tmpfs), and an `/etc/hosts` that names
//! every host. The nodes reach each other and the controller through a bridge in
//! the controller's network namespace, each over a veth pair (`10.214.0.<k>` for
//! node k from 1, `10.214.0.254` the controller). The rest of the file system is
//! this machine's, and the folders the test names (its cluster's and its jobs',
//! under `/tmp`) are bound into every host's `/tmp` at their paths: a cluster's
//! shared file system beside node-local temp space.

//! Programs run on a host through `nsenter` into its namespaces. Unlike `ip netns
//! exec`, which remounts `/sys` for the new network namespace (and slurmd 22.05 then
//! fails to start its cgroup plugin), nothing here touches `/sys`: the cgroup mounts
//! stay visible on every host.
//!
//! Nothing is created in the test's own namespaces: no interface, no route, no
//! mount. Dropping the hosts kills each host's init, and with it every process of
//! the host (the kernel empties a pid namespace whose init dies); the namespaces,
//! the veths, the bridge and the tmpfs mounts go with their last process. The
//! inits also die when the test's thread does (parent death signals), so a killed
//! test leaves nothing behind either.
#![allow(dead_code)]

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::common::{alive, children_of, cmdline, find_program, missing, signal, wait_until};

/// The private subnet's first three octets.
const SUBNET: &str = "10.214.0";
/// The controller's last octet.
const CONTROLLER_OCTET: u32 = 254;
/// The bridge, in the controller's network namespace.
const BRIDGE: &str = "vbr0";
/// A node's end of its veth pair, in the node's network namespace.
const NODE_LINK: &str = "eth0";
/// The controller's host name.
pub const CONTROLLER: &str = "vctl";

/// The programs the hosts need (util-linux and iproute2).
pub const PROGRAMS: [&str; 6] = ["unshare", "nsenter", "ip", "mount", "mkdir", "hostname"];

/// Why virtual hosts cannot be made here, if they cannot.
pub fn unavailable() -> Option<String> {
    missing(
        "namespaces, mounts, veth pairs",
        &PROGRAMS,
        "util-linux, iproute2, coreutils, hostname",
    )
}

/// One host: the namespaces its init process keeps open.
pub struct Host {
    /// Its host name (UTS namespace), also its name in `/etc/hosts`.
    pub name: String,
    /// Its address on the private subnet.
    pub addr: String,
    /// `unshare`, the test's child; its child is the host's init.
    holder: Child,
    /// The host's init (pid 1 of its pid namespace), as this machine numbers it.
    init: u32,
    /// `/proc/<init>/ns/net` and `/proc/<init>/ns/pid` (`net:[inode]`, ...).
    net_ns: String,
    pid_ns: String,
}

impl Host {
    /// Starts the host's init (a `sleep`, pid 1 of a pid namespace of its own,
    /// with its own network, UTS and mount namespaces and /proc) and waits until
    /// it runs. `unshare` gets SIGKILL when the test's thread dies, and the init
    /// when `unshare` dies (`--kill-child`); the kernel then kills every process
    /// of the host's pid namespace.
    fn start(name: String, addr: String) -> Result<Host, String> {
        let unshare = program("unshare")?;
        let mut command = Command::new(unshare);
        command
            .args(["--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc"])
            .args(["--net", "--uts", "--mount", "--propagation", "private"])
            .args(["sleep", "infinity"])
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches only the
        // child's own state between fork and exec.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut holder = command
            .spawn()
            .map_err(|e| format!("starting the init of {name}: {e}"))?;
        let ours = namespace(std::process::id(), "net").unwrap_or_default();
        let mut init = None;
        let ready = wait_until(Duration::from_secs(10), || {
            init = children_of(holder.id()).into_iter().find(|&pid| {
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                let ns = namespace(pid, "net").unwrap_or_default();
                comm.trim() == "sleep" && !ns.is_empty() && ns != ours
            });
            init.is_some()
        });
        let Some(init) = init.filter(|_| ready) else {
            let _ = holder.kill();
            let _ = holder.wait();
            return Err(format!(
                "the init of {name} (unshare, pid {}) never ran in namespaces of its own",
                holder.id()
            ));
        };
        Ok(Host {
            name,
            addr,
            holder,
            init,
            net_ns: namespace(init, "net").unwrap_or_default(),
            pid_ns: namespace(init, "pid").unwrap_or_default(),
        })
    }

    /// The host's init (its namespaces are the host's).
    pub fn pid(&self) -> u32 {
        self.init
    }

    /// `program` run on this host (all its namespaces), in `wd`. `nsenter` forks
    /// (a pid namespace is entered by its children): the process started is
    /// `nsenter`, which waits for `program`, its child, and exits as it does;
    /// signals must go to the child ([`Host::entered`]).
    pub fn enter(&self, program: &Path, wd: &Path) -> Command {
        let mut command = self.nsenter(&["--pid", "--net", "--uts", "--mount"]);
        command.arg(format!("--wd={}", wd.display()));
        command.arg("--").arg(program);
        command
    }

    /// The process an [`Host::enter`] command started as `nsenter` (pid
    /// `nsenter`), once it runs.
    pub fn entered(nsenter: u32) -> Option<u32> {
        let mut found = None;
        wait_until(Duration::from_secs(10), || {
            found = children_of(nsenter).into_iter().next();
            found.is_some() || !alive(nsenter)
        });
        found
    }

    /// `program` run in this host's network namespace only (its file system view
    /// and working directory are the caller's): for client commands.
    pub fn enter_network(&self, program: &Path) -> Command {
        let mut command = self.nsenter(&["--net"]);
        command.arg("--").arg(program);
        command
    }

    fn nsenter(&self, namespaces: &[&str]) -> Command {
        let nsenter = find_program("nsenter").unwrap_or_else(|| PathBuf::from("nsenter"));
        let mut command = Command::new(nsenter);
        command
            .arg(format!("--target={}", self.pid()))
            .args(namespaces);
        command
    }

    /// Runs `program args` on this host to its end; the error names the command,
    /// the host and what it said.
    fn run(&self, program: &str, args: &[&str]) -> Result<(), String> {
        let exe = self::program(program)?;
        self.finish(self.enter(&exe, Path::new("/")), program, args)
    }

    /// [`Host::run`] in this host's network namespace only (its pids are this
    /// machine's: `ip link ... netns <pid>` names another host by its init).
    fn run_in_network(&self, program: &str, args: &[&str]) -> Result<(), String> {
        let exe = self::program(program)?;
        self.finish(self.enter_network(&exe), program, args)
    }

    fn finish(&self, mut command: Command, program: &str, args: &[&str]) -> Result<(), String> {
        let output = command
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("{program} {} on {}: {e}", args.join(" "), self.name))?;
        if !output.status.success() {
            return Err(format!(
                "{program} {} on {}: {}: {}",
                args.join(" "),
                self.name,
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        }
        Ok(())
    }

    /// Its host name, loopback, fresh `/run`, `/dev/shm` and `/tmp`, the shared
    /// folders bound back in, and the hosts file as its `/etc/hosts`.
    fn set_up(&self, files: &Files) -> Result<(), String> {
        self.run("hostname", &[&self.name])?;
        self.run("ip", &["link", "set", "lo", "up"])?;
        self.run(
            "mount",
            &["-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/run"],
        )?;
        self.run(
            "mount",
            &["-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/dev/shm"],
        )?;
        let hosts = files.hosts.display().to_string();
        self.run("mount", &["--bind", &hosts, "/etc/hosts"])?;
        // A node's own /tmp: the shared folders under it are bound to a stash in
        // /run first, then moved back to their paths on the fresh /tmp.
        let tmp = Path::new("/tmp");
        let shared: Vec<&PathBuf> = files.shared.iter().filter(|d| d.starts_with(tmp)).collect();
        let stash = |i: usize| format!("/run/vhosts-shared/{i}");
        for (i, dir) in shared.iter().enumerate() {
            self.run("mkdir", &["-p", &stash(i)])?;
            self.run("mount", &["--bind", &dir.display().to_string(), &stash(i)])?;
        }
        self.run(
            "mount",
            &["-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/tmp"],
        )?;
        for (i, dir) in shared.iter().enumerate() {
            let dir = dir.display().to_string();
            self.run("mkdir", &["-p", &dir])?;
            self.run("mount", &["--move", &stash(i), &dir])?;
        }
        Ok(())
    }

    /// Live processes of this host (of its pid namespace), its init left out,
    /// with their command lines. The `unshare` and the `nsenter`s that wait for a
    /// process of the host are this machine's, not the host's.
    pub fn processes(&self) -> Vec<(u32, String)> {
        self.matching(|pid| namespace(pid, "pid").as_deref() == Some(self.pid_ns.as_str()))
    }

    /// Live processes in this host's network namespace (the host's, the
    /// `nsenter`s and `unshare` that entered it, and client commands run in its
    /// network), its init left out.
    fn in_network(&self) -> Vec<(u32, String)> {
        self.matching(|pid| namespace(pid, "net").as_deref() == Some(self.net_ns.as_str()))
    }

    fn matching(&self, mut keep: impl FnMut(u32) -> bool) -> Vec<(u32, String)> {
        let init = self.init;
        all_pids()
            .into_iter()
            .filter(|&pid| pid != init && alive(pid) && keep(pid))
            .map(|pid| (pid, cmdline(pid)))
            .collect()
    }

    /// This host's `/dev/shm` (seen through its holder's root).
    pub fn shm_dir(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root/dev/shm", self.pid()))
    }

    /// This host's table of Unix sockets (`/proc/net/unix` as the host sees it).
    pub fn unix_table(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/net/unix", self.pid()))
    }

    /// SIGKILL to the host's init (the kernel then kills every process of its pid
    /// namespace) and to whatever else is in its network, and waits (bounded)
    /// until they are gone; those still there are returned.
    fn kill_all(&mut self) -> Vec<(u32, String)> {
        signal(self.init, Signal::SIGKILL);
        for (pid, _) in self.in_network() {
            signal(pid, Signal::SIGKILL);
        }
        let _ = self.holder.kill();
        let _ = self.holder.wait();
        wait_until(Duration::from_secs(10), || {
            !alive(self.init) && self.processes().is_empty() && self.in_network().is_empty()
        });
        let mut left = self.processes();
        left.extend(
            self.in_network()
                .into_iter()
                .filter(|(pid, _)| namespace(*pid, "pid").as_deref() != Some(&self.pid_ns)),
        );
        if alive(self.init) {
            left.push((self.init, cmdline(self.init)));
        }
        left
    }
}

/// The file system every host shares with this machine beyond its own `/run`,
/// `/dev/shm` and `/tmp`.
struct Files {
    /// The hosts' `/etc/hosts`.
    hosts: PathBuf,
    /// Folders of this machine's `/tmp` every host sees at their paths (as a
    /// cluster's shared file system); the rest of `/tmp` is each host's own.
    shared: Vec<PathBuf>,
}

/// The controller and the nodes.
pub struct VirtualHosts {
    controller: Host,
    nodes: Vec<Host>,
}

impl VirtualHosts {
    /// Makes the controller and `nodes` nodes (named `vn1`, `vn2`, ...), with the
    /// hosts file written under `dir`; every host sees the folders `shared` (and
    /// `dir`) at their paths. Whatever was made is removed again when a step fails.
    pub fn start(dir: &Path, nodes: usize, shared: &[&Path]) -> Result<VirtualHosts, String> {
        let files = Files {
            hosts: dir.join("hosts"),
            shared: std::iter::once(dir)
                .chain(shared.iter().copied())
                .map(Path::to_path_buf)
                .collect(),
        };
        let mut text = String::from("127.0.0.1 localhost\n");
        text.push_str(&format!("{SUBNET}.{CONTROLLER_OCTET} {CONTROLLER}\n"));
        for k in 1..=nodes {
            text.push_str(&format!("{SUBNET}.{k} {}\n", node_name(k - 1)));
        }
        std::fs::write(&files.hosts, text)
            .map_err(|e| format!("{}: {e}", files.hosts.display()))?;

        let controller = Host::start(
            CONTROLLER.to_string(),
            format!("{SUBNET}.{CONTROLLER_OCTET}"),
        )?;
        // From here on, dropping `hosts` removes whatever was made.
        let mut hosts = VirtualHosts {
            controller,
            nodes: Vec::new(),
        };
        let controller = &hosts.controller;
        controller.set_up(&files)?;
        controller.run("ip", &["link", "add", BRIDGE, "type", "bridge"])?;
        let bridge_addr = format!("{}/24", controller.addr);
        controller.run("ip", &["addr", "add", &bridge_addr, "dev", BRIDGE])?;
        controller.run("ip", &["link", "set", BRIDGE, "up"])?;
        for index in 0..nodes {
            let name = node_name(index);
            let addr = format!("{SUBNET}.{}", index + 1);
            let node = Host::start(name, addr)?;
            hosts.nodes.push(node);
            hosts.wire_node(index, &files)?;
        }
        Ok(hosts)
    }

    /// Node `index`'s own set-up, and its veth pair to the bridge.
    fn wire_node(&self, index: usize, files: &Files) -> Result<(), String> {
        let controller = &self.controller;
        let node = &self.nodes[index];
        // The controller's end of the pair is named after the node.
        let link = node.name.as_str();
        node.set_up(files)?;
        let pid = node.pid().to_string();
        controller.run_in_network(
            "ip",
            &[
                "link", "add", link, "type", "veth", "peer", "name", NODE_LINK, "netns", &pid,
            ],
        )?;
        controller.run("ip", &["link", "set", link, "master", BRIDGE])?;
        controller.run("ip", &["link", "set", link, "up"])?;
        let addr = format!("{}/24", node.addr);
        node.run("ip", &["addr", "add", &addr, "dev", NODE_LINK])?;
        node.run("ip", &["link", "set", NODE_LINK, "up"])
    }

    /// The controller's host.
    pub fn controller(&self) -> &Host {
        &self.controller
    }

    /// The nodes, in order (`vn1` first).
    pub fn nodes(&self) -> &[Host] {
        &self.nodes
    }

    /// Cuts node `index`'s link: its veth's end at the bridge goes down, so the
    /// node reaches nobody and nobody reaches it.
    pub fn cut_link(&self, index: usize) -> Result<(), String> {
        let node = self
            .nodes
            .get(index)
            .ok_or_else(|| format!("no node {index}"))?;
        self.controller
            .run("ip", &["link", "set", &node.name, "down"])
    }

    /// SIGKILL to every process of node `index` but its init (its daemons too:
    /// the node is dead; the init keeps its namespaces for the checks); the
    /// processes killed.
    pub fn kill_processes(&self, index: usize) -> Vec<(u32, String)> {
        let Some(node) = self.nodes.get(index) else {
            return Vec::new();
        };
        let victims = node.processes();
        for (pid, _) in &victims {
            signal(*pid, Signal::SIGKILL);
        }
        victims
    }
}

impl Drop for VirtualHosts {
    fn drop(&mut self) {
        let mut left = Vec::new();
        for host in self.nodes.iter_mut().chain([&mut self.controller]) {
            left.extend(host.kill_all());
        }
        if !left.is_empty() {
            eprintln!("vhosts: processes that outlived SIGKILL: {left:?}");
        }
    }
}

/// The name of node `index` (0-based): `vn1`, `vn2`, ...
pub fn node_name(index: usize) -> String {
    format!("vn{}", index + 1)
}

fn program(name: &str) -> Result<PathBuf, String> {
    find_program(name).ok_or_else(|| format!("{name} not found"))
}

/// `/proc/<pid>/ns/<kind>` (`net:[inode]`, ...), if the process is there.
fn namespace(pid: u32, kind: &str) -> Option<String> {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}"))
        .ok()
        .map(|link| link.display().to_string())
}

/// Every pid in /proc.
fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str().and_then(|s| s.parse().ok()))
        .collect()
}
