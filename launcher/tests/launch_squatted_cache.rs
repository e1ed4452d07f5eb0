//! `DATA.CACHE_SHARING: node` when the node-shared address is not the job's to
//! use, end to end with a real launcher and a real `vrtspike train` CPU rank: a
//! server of another cache protocol version (another build's) at the address, or
//! a process of another user bound there first (abstract names have no
//! permissions). Either way the job attaches to nothing there, falls back to a
//! server of its own (the `job` address), says so once (its log, and the
//! summary's `cache.sharing`) and trains to the end. The second test needs root
//! (it runs the squatter as `nobody`) and fails without it.

mod common;

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{launcher_command, read_json, run_with_limit, synth_tiny, texts, wait_until};
use common::{write_tiny_config, TinyTrain};
use vrtspike_contract::cache_addr::{shared_cache_address, CACHE_PROTOCOL_VERSION};
use vrtspike_contract::dataset_sig;
use vrtspike_contract::rundir::RunLayout;

/// A failure guard only: every wait ends far sooner on a healthy run.
const LIMIT: Duration = Duration::from_secs(240);

/// The uid and gid of `nobody`.
const NOBODY: u32 = 65534;

/// What the job warns, once, when it falls back.
const FELL_BACK: &str = "this job starts a cache server of its own instead";

struct Setup {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    config: PathBuf,
    /// The job's node-shared address.
    address: String,
}

fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let dir = tmp.path().to_path_buf();
    let data = synth_tiny(&dir);
    let run = TinyTrain {
        total_steps: 4,
        ckpt_every: 1000,
        timeout_s: 60,
    };
    let config = write_tiny_config(&dir, &data, &run);
    let signature = dataset_sig::sign(&data).unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let address = shared_cache_address(uid, signature.digest, None);
    Setup {
        _tmp: tmp,
        dir,
        config,
        address,
    }
}

/// Runs one job of one CPU rank to its end; its launcher's output.
fn run_job(s: &Setup) -> (String, PathBuf) {
    let run = s.dir.join("run");
    let mut command = launcher_command(&s.config, &run);
    command
        .args(["--gpus", "0", "--ranks", "1", "--max-restarts", "0"])
        .args(["--cache-size", "64M"]);
    let output = run_with_limit(command, LIMIT);
    let (stdout, stderr) = texts(&output);
    let said = format!("{stdout}\n{stderr}");
    assert!(output.status.success(), "the job failed:\n{said}");
    (said, run)
}

/// The job completed on a server of its own, fell back from `address` once,
/// and its summary says why (`why` names what was found).
fn check_fell_back(said: &str, run: &Path, address: &str, why: &[&str]) {
    assert_eq!(said.matches(FELL_BACK).count(), 1, "{said}");
    let summary = read_json(&RunLayout::new(run).launcher_summary(0));
    assert_eq!(summary["exit"], "completed", "{summary}");
    assert_eq!(summary["restarts"], 0, "{summary}");
    let sharing = &summary["cache"]["sharing"];
    assert_eq!(sharing["mode"], "job", "{summary}");
    assert_eq!(sharing["fell_back_from"], address, "{summary}");
    let own = sharing["address"].as_str().unwrap_or_default();
    assert!(!own.is_empty() && own != address, "{summary}");
    let reason = sharing["why"].as_str().unwrap_or_default();
    for word in why {
        assert!(reason.contains(word), "{word:?} not in {summary}");
    }
    // The rank read through the job's own server.
    let totals = &summary["cache"]["totals"];
    let lookups = totals["hits"].as_u64().unwrap_or(0) + totals["misses"].as_u64().unwrap_or(0);
    assert!(lookups > 0, "{summary}");
}

/// A fake server of the next protocol version at `address`: it greets every
/// connection as a server of that version would, naming a channel that does not
/// exist; it counts the clients that went on after the greeting (none should).
fn other_version_at(address: &str) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
    let name = SocketAddr::from_abstract_name(address.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    let listener = UnixListener::bind_addr(&name).unwrap_or_else(|e| panic!("{e}"));
    let went_on = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = std::sync::Arc::clone(&went_on);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut hello = [0u8; 1];
            if stream.read_exact(&mut hello).is_err() {
                continue;
            }
            let greeting = format!(
                "channel p{} /tmp/vrtspike-no-such-channel/socket",
                CACHE_PROTOCOL_VERSION + 1
            );
            let len = (greeting.len() as u32).to_le_bytes();
            let _ = stream.write_all(&len);
            let _ = stream.write_all(greeting.as_bytes());
            let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
            let mut ack = [0u8; 1];
            if matches!(stream.read(&mut ack), Ok(1)) {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
    });
    went_on
}

#[test]
fn a_server_of_another_protocol_version_is_left_for_a_server_of_the_jobs_own() {
    let s = setup();
    let went_on = other_version_at(&s.address);
    let (said, run) = run_job(&s);
    let ours = CACHE_PROTOCOL_VERSION;
    check_fell_back(
        &said,
        &run,
        &s.address,
        &[
            &format!("speaks cache protocol version {}", ours + 1),
            &format!("this build speaks version {ours}"),
        ],
    );
    assert_eq!(went_on.load(std::sync::atomic::Ordering::SeqCst), 0);
}

/// `vrtspike cache serve` run as `nobody` at `address`.
struct Squatter(Child);

impl Drop for Squatter {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn an_address_squatted_by_another_user_is_left_for_a_server_of_the_jobs_own() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        panic!("this test needs root, to run the squatter as nobody (CI runs as root)");
    }
    let s = setup();
    let squatter = Command::new(common::vrtspike())
        .args(["cache", "serve", "--address", &s.address, "--cap", "1M"])
        .current_dir("/")
        .uid(NOBODY)
        .gid(NOBODY)
        .env("TMPDIR", "/tmp")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("starting the squatter: {e}"));
    let mut squatter = Squatter(squatter);
    let name =
        SocketAddr::from_abstract_name(s.address.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    let bound = wait_until(LIMIT, || {
        UnixStream::connect_addr(&name).is_ok() || matches!(squatter.0.try_wait(), Ok(Some(_)))
    });
    assert!(
        bound && matches!(squatter.0.try_wait(), Ok(None)),
        "the squatter did not bind"
    );
    let (said, run) = run_job(&s);
    check_fell_back(
        &said,
        &run,
        &s.address,
        &[&format!("runs as uid {NOBODY}"), &s.address],
    );
    assert!(
        matches!(squatter.0.try_wait(), Ok(None)),
        "the squatter was stopped"
    );
}
