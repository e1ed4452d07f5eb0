//! `DATA.CACHE_SHARING: node`, end to end with real launchers and real
//! `vrtspike train` CPU ranks on one tiny dataset: the jobs of one user on one
//! dataset share one cache server, which outlives the job that started it (whether
//! that job ends or its launcher is killed with `kill -9`) while another job reads
//! from it, then lingers and exits, leaving neither a process nor its abstract
//! socket; two launchers started at the same instant (their servers held until both
//! have come) end up with one server, the other's having lost the race;
//! `kill -9` of the shared server with two jobs attached: both train on without a
//! restart, one starts a new server and the other attaches to it; a server started
//! by hand (`vrtspike cache serve --config C`) serves the jobs on C's dataset and
//! stays after them until stopped; after `kill -9` of the shared server the
//! launcher holds it again in the background: a preemption meanwhile is handled at
//! once, and a server that never comes back does not end the job. The dataset holds a dangling link and a folder
//! of mode 000 beside its data, as a volume may.

mod common;

use std::fs::File;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{
    alive, exit_code, launcher_command_at, node_shared_address, read_json, signal, synth_tiny,
    vrtspike, wait_until, write_tiny_config, TinyTrain,
};
use nix::sys::signal::Signal;
use serde_json::Value;
use vrtspike_contract::rundir::RunLayout;

/// A failure guard only: every wait ends far sooner on a healthy run.
const LIMIT: Duration = Duration::from_secs(240);

/// Steps that no test reaches: each job runs until it is preempted or killed.
const ENDLESS: u64 = 1_000_000;

struct Setup {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    config: PathBuf,
    address: String,
}

impl Drop for Setup {
    /// Opens `lost+found` again, so that an ordinary user's test removes its folder.
    fn drop(&mut self) {
        let lost = self.dir.join("data").join("lost+found");
        let _ = std::fs::set_permissions(&lost, std::fs::Permissions::from_mode(0o755));
    }
}

fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let dir = tmp.path().to_path_buf();
    let data = synth_tiny(&dir);
    odd_entries(&data);
    let run = TinyTrain {
        total_steps: ENDLESS,
        ckpt_every: ENDLESS,
        timeout_s: 60,
    };
    let config = write_tiny_config(&dir, &data, &run);
    let address = node_shared_address(&data);
    Setup {
        _tmp: tmp,
        dir,
        config,
        address,
    }
}

/// What a dataset volume may hold beside the data, which the dataset's signature
/// signs by kind and name (it failed the launcher before): a root-owned
/// `lost+found` of mode 000 at the root (unreadable to an ordinary user;
/// `dataset_sig`'s unit test reads it as `nobody`), and a link to nothing beside
/// the sequences.
fn odd_entries(data: &Path) {
    let lost = data.join("lost+found");
    std::fs::create_dir(&lost).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(lost.join("#1234"), b"orphan").unwrap_or_else(|e| panic!("{e}"));
    std::fs::set_permissions(&lost, std::fs::Permissions::from_mode(0o000))
        .unwrap_or_else(|e| panic!("{e}"));
    std::os::unix::fs::symlink("/no/such/sequence", data.join("train").join("dangling-seq"))
        .unwrap_or_else(|e| panic!("{e}"));
}

/// Kills the launchers (and a hand-started server) a test started if it fails
/// half-way (their jobs are endless): each `kill -9` of a launcher takes its
/// ranks and attach with it.
struct Reaper(Vec<u32>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for &pid in &self.0 {
            let ours = common::cmdline(pid);
            if alive(pid) && (ours.contains("vrtspike-launch") || ours.contains("cache serve")) {
                signal(pid, Signal::SIGKILL);
            }
        }
    }
}

/// A launcher of one CPU rank with a node-shared cache (linger 1 s), its output in
/// `<dir>/<name>.out`; `reaper` kills it if the test fails.
fn launch(s: &Setup, name: &str, reaper: &mut Reaper) -> (Child, PathBuf) {
    launch_with(s, name, reaper, 0)
}

/// [`launch`] with `restarts` restarts allowed.
fn launch_with(s: &Setup, name: &str, reaper: &mut Reaper, restarts: u32) -> (Child, PathBuf) {
    launch_from(&common::launcher(), s, name, reaper, restarts)
}

/// [`launch`] of the launcher at `exe`.
fn launch_at(exe: &Path, s: &Setup, name: &str, reaper: &mut Reaper) -> (Child, PathBuf) {
    launch_from(exe, s, name, reaper, 0)
}

/// [`launch_with`] of the launcher at `exe`.
fn launch_from(
    exe: &Path,
    s: &Setup,
    name: &str,
    reaper: &mut Reaper,
    restarts: u32,
) -> (Child, PathBuf) {
    let run = s.dir.join(name);
    let out = s.dir.join(format!("{name}.out"));
    let file = File::create(&out).unwrap_or_else(|e| panic!("{e}"));
    let err = file.try_clone().unwrap_or_else(|e| panic!("{e}"));
    let child = launcher_command_at(exe, &s.config, &run)
        .args(["--gpus", "0", "--ranks", "1", "--max-restarts"])
        .arg(restarts.to_string())
        .args(["--cache-size", "64M", "--preempt-timeout-s", "60"])
        .args(["--cache-linger-s", "1"])
        .stdout(Stdio::from(file))
        .stderr(Stdio::from(err))
        .spawn()
        .unwrap_or_else(|e| panic!("starting the launcher: {e}"));
    reaper.0.push(child.id());
    (child, run)
}

/// Training steps rank 0 has logged in `run`.
fn steps(run: &Path) -> usize {
    std::fs::read_to_string(RunLayout::new(run).metrics())
        .map(|text| {
            text.lines()
                .filter(|l| l.contains("\"kind\":\"train\""))
                .count()
        })
        .unwrap_or(0)
}

/// Waits until `run` logs more than `after` steps; fails naming the job.
fn wait_for_steps(run: &Path, after: usize, launcher: &mut Child, out: &Path) {
    let trained = wait_until(LIMIT, || {
        steps(run) > after || matches!(launcher.try_wait(), Ok(Some(_)))
    });
    assert!(
        trained && steps(run) > after,
        "{} logged no step past {after}; its output:\n{}\nrank 0:\n{}",
        run.display(),
        read(out),
        read(&RunLayout::new(run).rank_log(0))
    );
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The server's stats at `address`, or `None` when none answers.
fn stats(address: &str) -> Option<Value> {
    let output = Command::new(vrtspike())
        .args(["cache", "stats", "--json", "--timeout", "10", "--address"])
        .arg(address)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    serde_json::from_slice(&output.stdout).ok()
}

fn server_pid(address: &str) -> u32 {
    let shown = stats(address).unwrap_or_else(|| panic!("no cache server at {address}"));
    shown["server_pid"]
        .as_u64()
        .and_then(|pid| u32::try_from(pid).ok())
        .unwrap_or_else(|| panic!("stats without a server pid: {shown}"))
}

/// The names of the server's clients that are jobs (the launchers' attaches).
fn attached_jobs(address: &str) -> Vec<String> {
    let shown = stats(address).unwrap_or_default();
    let mut jobs: Vec<String> = shown["clients"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["name"].as_str())
        .filter(|name| name.starts_with("job "))
        .map(str::to_string)
        .collect();
    jobs.sort();
    jobs
}

/// The server's figures of the job in `run` (its ranks name it by the run
/// directory), or `None` when the server does not list it.
fn job_figures(address: &str, run: &Path) -> Option<Value> {
    let label = RunLayout::new(run).job_label();
    let shown = stats(address)?;
    shown["jobs"]
        .as_array()?
        .iter()
        .find(|j| j["job"] == label.as_str())
        .cloned()
}

/// Reads the job made: its hits and misses.
fn lookups(figures: &Value) -> u64 {
    let count = |key: &str| figures["counters"][key].as_u64().unwrap_or(0);
    count("hits") + count("misses")
}

/// Whether any process listens at the abstract address (`/proc/net/unix`).
fn socket_exists(address: &str) -> bool {
    let table = std::fs::read_to_string("/proc/net/unix").unwrap_or_default();
    let name = format!("@{address}");
    table
        .lines()
        .any(|line| line.split_whitespace().last() == Some(&name))
}

/// Preempts a job (SIGUSR2: it checkpoints and exits 0) and checks its end.
fn preempt(launcher: &mut Child, run: &Path, out: &Path) {
    signal(launcher.id(), Signal::SIGUSR2);
    let code = exit_code(launcher, LIMIT);
    assert_eq!(code, Some(0), "{}:\n{}", run.display(), read(out));
    let summary = read_json(&RunLayout::new(run).launcher_summary(0));
    assert_eq!(summary["exit"], "preempted", "{summary}");
    assert_eq!(summary["cache"]["sharing"]["mode"], "node", "{summary}");
}

/// After the last job: the server lingers, then exits and leaves no socket.
fn assert_gone_after_linger(address: &str, server: u32) {
    let gone = wait_until(LIMIT, || !alive(server) && !socket_exists(address));
    assert!(
        gone,
        "the shared server {server} (alive: {}) or its socket {address} (exists: {}) stayed",
        alive(server),
        socket_exists(address)
    );
}

/// Two jobs on one server; the first one, which started it, ends (`end`) while the
/// second trains; the second keeps training on the same server, then ends, and
/// the server goes after its linger.
fn the_second_job_outlives_the_first(end: &dyn Fn(&mut Child, &Path, &Path)) {
    let s = setup();
    let mut reaper = Reaper(Vec::new());
    assert!(
        !socket_exists(&s.address),
        "a server of this dataset before the test"
    );
    let (mut first, first_run) = launch(&s, "first", &mut reaper);
    let first_out = s.dir.join("first.out");
    wait_for_steps(&first_run, 0, &mut first, &first_out);
    let server = server_pid(&s.address);
    assert!(
        read(&first_out).contains("started the node-shared cache server"),
        "{}",
        read(&first_out)
    );

    let (mut second, second_run) = launch(&s, "second", &mut reaper);
    let second_out = s.dir.join("second.out");
    wait_for_steps(&second_run, 0, &mut second, &second_out);
    assert_eq!(
        server_pid(&s.address),
        server,
        "the second job started its own"
    );
    assert_eq!(
        attached_jobs(&s.address).len(),
        2,
        "{:?}",
        stats(&s.address)
    );
    let log = read(&second_out);
    assert!(
        log.contains("attached to the node-shared cache server")
            && log.contains(&first_run.display().to_string())
            && !log.contains("started the node-shared cache server"),
        "the second job's log names the server and the job that started it:\n{log}"
    );

    // Per-job figures: each job's ranks count under its own run directory.
    for run in [&first_run, &second_run] {
        let figures = job_figures(&s.address, run)
            .unwrap_or_else(|| panic!("no figures of {}: {:?}", run.display(), stats(&s.address)));
        assert!(lookups(&figures) > 0, "{figures}");
        assert!(figures["clients"].as_u64() > Some(0), "{figures}");
    }

    end(&mut first, &first_run, &first_out);
    let ended = job_figures(&s.address, &first_run).unwrap_or_default();
    assert_eq!(ended["clients"], 0, "the ended job's figures stay: {ended}");
    assert!(lookups(&ended) > 0, "{ended}");
    assert!(
        alive(server),
        "the shared server ended with the job that started it"
    );
    let jobs = attached_jobs(&s.address);
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    assert!(
        jobs[0].contains(&second_run.display().to_string()),
        "{jobs:?}"
    );
    let before = steps(&second_run);
    wait_for_steps(&second_run, before + 3, &mut second, &second_out);
    assert_eq!(server_pid(&s.address), server, "the same server serves on");
    let log = read(&second_out);
    assert!(
        !log.contains("went away"),
        "the second job lost its server:\n{log}"
    );

    preempt(&mut second, &second_run, &second_out);
    let summary = read_json(&RunLayout::new(&second_run).launcher_summary(0));
    let own = &summary["cache"]["sharing"]["this_job"];
    assert!(
        lookups(own) > 0 && own["job"] == RunLayout::new(&second_run).job_label().as_str(),
        "the job's summary has its own figures: {summary}"
    );
    assert_gone_after_linger(&s.address, server);
}

#[test]
fn the_starter_ends_first_and_the_other_job_trains_on_then_the_server_lingers_and_goes() {
    the_second_job_outlives_the_first(&|launcher, run, out| preempt(launcher, run, out));
}

#[test]
fn kill_9_of_the_starters_launcher_leaves_the_other_job_reading() {
    the_second_job_outlives_the_first(&|launcher, run, _| {
        let ranks = common::process_tree(launcher.id());
        signal(launcher.id(), Signal::SIGKILL);
        let _ = launcher.wait();
        // Its ranks and its attach end with it (parent-death signal); the server
        // does not, though the launcher started it.
        let gone = wait_until(LIMIT, || {
            ranks.iter().all(|pid| !alive(*pid) || is_server(*pid))
        });
        assert!(gone, "{} left processes behind", run.display());
    });
}

fn is_server(pid: u32) -> bool {
    common::cmdline(pid).contains("--linger-s")
}

/// A link to the launcher beside a stand-in `vrtspike`, steered by files in
/// `<dir>/control`: each `cache serve` waits until `parties` of them have come (a
/// file each in `<dir>/barrier`, polled for at most 60 s), so launchers that found
/// no server start theirs at one instant and race for the address however the
/// machine schedules them; while `control/fail` exists a `cache serve` fails at
/// once (exit 3); while `control/hold` exists it waits (after touching
/// `control/held`), as a server that never gets ready. Every other command, and
/// `cache serve` past these, runs the real `vrtspike`.
fn stand_in_launcher(dir: &Path, parties: usize) -> PathBuf {
    let bin = dir.join("stand-in-bin");
    let barrier = dir.join("barrier");
    for folder in [&bin, &barrier, &dir.join("control")] {
        std::fs::create_dir_all(folder).unwrap_or_else(|e| panic!("{e}"));
    }
    let exe = bin.join("vrtspike-launch");
    std::fs::hard_link(common::launcher(), &exe)
        .or_else(|_| std::fs::copy(common::launcher(), &exe).map(|_| ()))
        .unwrap_or_else(|e| panic!("placing the launcher in {}: {e}", bin.display()));
    let script = format!(
        "#!/bin/bash\n\
         if [[ \"$1 $2\" == \"cache serve\" ]]; then\n\
           if [[ -e {control}/fail ]]; then echo 'stand-in: cache serve fails' >&2; exit 3; fi\n\
           if [[ -e {control}/hold ]]; then\n\
             touch {control}/held\n\
             for _ in $(seq 12000); do [[ -e {control}/hold ]] || break; sleep 0.05; done\n\
           fi\n\
           touch {barrier}/$$\n\
           for _ in $(seq 1200); do\n\
             (( $(ls {barrier} | wc -l) >= {parties} )) && break\n\
             sleep 0.05\n\
           done\n\
         fi\n\
         exec {real} \"$@\"\n",
        control = dir.join("control").display(),
        barrier = barrier.display(),
        real = vrtspike().display(),
    );
    let stand_in = bin.join("vrtspike");
    common::write_exe(&stand_in, &script);
    exe
}

#[test]
fn two_launchers_started_at_the_same_instant_share_one_server() {
    let s = setup();
    let mut reaper = Reaper(Vec::new());
    let racing = stand_in_launcher(&s.dir, 2);
    let (mut one, one_run) = launch_at(&racing, &s, "one", &mut reaper);
    let (mut two, two_run) = launch_at(&racing, &s, "two", &mut reaper);
    let (one_out, two_out) = (s.dir.join("one.out"), s.dir.join("two.out"));
    wait_for_steps(&one_run, 0, &mut one, &one_out);
    wait_for_steps(&two_run, 0, &mut two, &two_out);
    let server = server_pid(&s.address);
    assert_eq!(
        attached_jobs(&s.address).len(),
        2,
        "{:?}",
        stats(&s.address)
    );
    let started = [&one_out, &two_out]
        .iter()
        .filter(|out| read(out).contains("started the node-shared cache server"))
        .count();
    assert_eq!(
        started,
        1,
        "one server started:\n{}\n---\n{}",
        read(&one_out),
        read(&two_out)
    );
    // The race ran: the other launcher's server found the address taken (it
    // exited with EXIT_ADDRESS_IN_USE) and its launcher attached to the winner.
    let lost = [&one_out, &two_out]
        .iter()
        .filter(|out| read(out).contains("took the address first: attaching to it"))
        .count();
    assert_eq!(
        lost,
        1,
        "one launcher lost the race:\n{}\n---\n{}",
        read(&one_out),
        read(&two_out)
    );
    let servers = common::process_tree(std::process::id())
        .into_iter()
        .filter(|pid| is_server(*pid) && alive(*pid) && common::cmdline(*pid).contains(&s.address))
        .count();
    assert!(servers <= 1, "{servers} shared servers run");
    preempt(&mut one, &one_run, &one_out);
    preempt(&mut two, &two_run, &two_out);
    assert_gone_after_linger(&s.address, server);
}

#[test]
fn kill_9_of_the_shared_server_leaves_both_jobs_training_on_one_new_server() {
    let s = setup();
    let mut reaper = Reaper(Vec::new());
    let (mut one, one_run) = launch_with(&s, "one", &mut reaper, 0);
    let one_out = s.dir.join("one.out");
    wait_for_steps(&one_run, 0, &mut one, &one_out);
    let (mut two, two_run) = launch_with(&s, "two", &mut reaper, 0);
    let two_out = s.dir.join("two.out");
    wait_for_steps(&two_run, 0, &mut two, &two_out);
    let old = server_pid(&s.address);
    assert_eq!(
        attached_jobs(&s.address).len(),
        2,
        "{:?}",
        stats(&s.address)
    );

    signal(old, Signal::SIGKILL);
    // Each job's attach ends with the server; its launcher attaches again (one
    // starts a new server, the other attaches to it) while the ranks go on: no
    // restart (none is allowed), the loaders read from disk meanwhile and then
    // connect to the new server.
    let reattached = |out: &Path| read(out).contains("went away (its attach");
    let both = wait_until(LIMIT, || reattached(&one_out) && reattached(&two_out));
    assert!(both, "{}\n---\n{}", read(&one_out), read(&two_out));
    let attached = wait_until(LIMIT, || attached_jobs(&s.address).len() == 2);
    assert!(
        attached,
        "{:?}\none:\n{}\n---\ntwo:\n{}\n---\none's cache log:\n{}\n---\ntwo's cache log:\n{}",
        stats(&s.address),
        read(&one_out),
        read(&two_out),
        read(&RunLayout::new(&one_run).cache_log(0)),
        read(&RunLayout::new(&two_run).cache_log(0))
    );
    let new = server_pid(&s.address);
    assert_ne!(new, old);
    let (one_steps, two_steps) = (steps(&one_run), steps(&two_run));
    wait_for_steps(&one_run, one_steps + 3, &mut one, &one_out);
    wait_for_steps(&two_run, two_steps + 3, &mut two, &two_out);
    assert_eq!(server_pid(&s.address), new, "still one server");
    // The loaders read through the new server again: both jobs' ranks are its
    // clients with lookups of their own.
    for run in [&one_run, &two_run] {
        let figures = job_figures(&s.address, run).unwrap_or_default();
        assert!(
            lookups(&figures) > 0 && figures["clients"].as_u64() > Some(1),
            "{}: {figures}",
            run.display()
        );
    }
    preempt(&mut one, &one_run, &one_out);
    preempt(&mut two, &two_run, &two_out);
    for run in [&one_run, &two_run] {
        let summary = read_json(&RunLayout::new(run).launcher_summary(0));
        assert_eq!(summary["restarts"], 0, "{summary}");
    }
    assert_gone_after_linger(&s.address, new);
}

#[test]
fn a_server_started_by_hand_serves_the_jobs_and_stays_after_them() {
    // `vrtspike cache serve --config C` with no address: the node-shared server
    // of C's dataset, with no linger (it stays until stopped).
    let s = setup();
    let mut reaper = Reaper(Vec::new());
    let mut serve = Command::new(vrtspike());
    serve
        .args(["cache", "serve", "--config"])
        .arg(&s.config)
        .env_remove("VRTSPIKE_CACHE_ADDR")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut hand = serve
        .spawn()
        .unwrap_or_else(|e| panic!("starting vrtspike cache serve: {e}"));
    reaper.0.push(hand.id());
    assert!(
        wait_until(LIMIT, || socket_exists(&s.address)),
        "the hand-started server did not listen at {}",
        s.address
    );
    let server = server_pid(&s.address);

    let (mut job, run) = launch(&s, "job", &mut reaper);
    let out = s.dir.join("job.out");
    wait_for_steps(&run, 2, &mut job, &out);
    let log = read(&out);
    assert!(
        log.contains("attached to the node-shared cache server")
            && !log.contains("started the node-shared cache server"),
        "the job attached to the hand-started server:\n{log}"
    );
    assert_eq!(server_pid(&s.address), server);
    assert!(job_figures(&s.address, &run).is_some_and(|f| lookups(&f) > 0));
    preempt(&mut job, &run, &out);

    // No linger: it serves on after the job, until it is stopped. Once the job
    // has detached (the server lists no job), a server with a linger would go
    // within it (1 s for the launchers' servers here): polled for 3 s, it stays.
    let detached = wait_until(LIMIT, || attached_jobs(&s.address).is_empty());
    assert!(detached, "{:?}", stats(&s.address));
    let stopped = wait_until(Duration::from_secs(3), || {
        !alive(server) || !socket_exists(&s.address)
    });
    assert!(
        !stopped && server_pid(&s.address) == server,
        "the hand-started server stopped with the job"
    );
    let stopped = Command::new(vrtspike())
        .args(["cache", "shutdown", "--address", &s.address])
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(stopped.status.success(), "{stopped:?}");
    let code = exit_code(&mut hand, LIMIT);
    assert_eq!(code, Some(0), "cache serve after its shutdown");
    assert_gone_after_linger(&s.address, server);
}

/// Touches (or removes) the stand-in's control file `name` ([`stand_in_launcher`]).
fn control(s: &Setup, name: &str, on: bool) {
    let path = s.dir.join("control").join(name);
    let done = match on {
        true => std::fs::write(&path, b""),
        false => std::fs::remove_file(&path),
    };
    done.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// One job on a stand-in `vrtspike`, trained past its first step; the shared
/// server's pid.
fn one_job_on_a_stand_in(s: &Setup, reaper: &mut Reaper) -> (Child, PathBuf, PathBuf, u32) {
    let exe = stand_in_launcher(&s.dir, 1);
    let (mut job, run) = launch_at(&exe, s, "job", reaper);
    let out = s.dir.join("job.out");
    wait_for_steps(&run, 0, &mut job, &out);
    let server = server_pid(&s.address);
    (job, run, out, server)
}

#[test]
fn a_preemption_while_the_server_is_held_again_is_handled_at_once() {
    let s = setup();
    let mut reaper = Reaper(Vec::new());
    let (mut job, run, out, server) = one_job_on_a_stand_in(&s, &mut reaper);
    // The next server never gets ready: the re-attach after the kill stays under
    // way for as long as the test lasts.
    control(&s, "hold", true);
    signal(server, Signal::SIGKILL);
    let held = wait_until(LIMIT, || s.dir.join("control/held").exists());
    assert!(held, "no server was started again:\n{}", read(&out));
    assert!(read(&out).contains("in the background"), "{}", read(&out));
    // The ranks train on, reading from disk.
    let before = steps(&run);
    wait_for_steps(&run, before + 2, &mut job, &out);
    // SIGUSR2 is handled while the re-attach waits: the ranks checkpoint and the
    // job ends, although no server ever got ready.
    signal(job.id(), Signal::SIGUSR2);
    let code = exit_code(&mut job, LIMIT);
    let log = read(&out);
    assert_eq!(code, Some(0), "{log}");
    let summary = read_json(&RunLayout::new(&run).launcher_summary(0));
    assert_eq!(summary["exit"], "preempted", "{summary}");
    assert_eq!(summary["restarts"], 0, "{summary}");
    assert!(
        s.dir.join("control/hold").exists()
            && !log.contains("holding the node-shared cache server again"),
        "the re-attach finished before the preemption was handled:\n{log}"
    );
    control(&s, "hold", false);
}

#[test]
fn a_shared_server_gone_for_good_never_ends_the_job() {
    let s = setup();
    let mut reaper = Reaper(Vec::new());
    let (mut job, run, out, server) = one_job_on_a_stand_in(&s, &mut reaper);
    // Every later start fails: the server is gone for good.
    control(&s, "fail", true);
    signal(server, Signal::SIGKILL);
    let failing = wait_until(LIMIT, || {
        read(&out)
            .matches("attaching to the node-shared cache server again failed")
            .count()
            >= 2
    });
    assert!(failing, "{}", read(&out));
    // The ranks train on from disk, and the job ends as asked, with no restart.
    let before = steps(&run);
    wait_for_steps(&run, before + 3, &mut job, &out);
    signal(job.id(), Signal::SIGUSR2);
    let code = exit_code(&mut job, LIMIT);
    assert_eq!(code, Some(0), "{}", read(&out));
    let summary = read_json(&RunLayout::new(&run).launcher_summary(0));
    assert_eq!(summary["exit"], "preempted", "{summary}");
    assert_eq!(summary["restarts"], 0, "{summary}");
    assert!(!socket_exists(&s.address), "a server came back");
}
