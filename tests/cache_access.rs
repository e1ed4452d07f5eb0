//! Who gets into the cache server: only its own user (or one let in with
//! `--allow-uid`), refused at accept with a named error on both sides; a flood of
//! connects that never say hello does not keep a real client out; the one-shot
//! handshake directories do not outlive their handshake, nor a killed server.

mod common;

use std::fs;
use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{fill_pattern, has_pattern, unique_address, wait_until, ServerProc};
use vrtspike::cache::{spawn_server, CacheClient, CacheError, Lookup, ServerConfig};
use vrtspike::testkit::process::wait_for_child_server;

const NOBODY: u32 = 65534;

fn my_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// The handshake directory of the server process `pid`.
fn handshake_dir(pid: u32) -> PathBuf {
    std::env::temp_dir()
        .join(format!("vrtspike-cache-{}", my_uid()))
        .join(pid.to_string())
}

fn entries(dir: &PathBuf) -> Vec<String> {
    fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_user_not_in_the_allowed_set_is_refused_with_a_named_error() {
    // The real refusal path, run as ourselves: a server whose allowed set leaves
    // out our own uid.
    let address = unique_address("refuse");
    let mut config = ServerConfig::new(address.clone(), 1 << 20);
    config.allowed_uids = vec![my_uid().wrapping_add(4242)];
    let _server = spawn_server(config).unwrap();
    let err = CacheClient::connect(&address, "outsider").unwrap_err();
    let CacheError::NotAllowed {
        server_uid, uid, ..
    } = &err
    else {
        panic!("expected NotAllowed, got {err}");
    };
    assert_eq!((*server_uid, *uid), (my_uid(), my_uid()));
    let text = err.to_string();
    assert!(text.contains("--allow-uid"), "{text}");
    assert!(text.contains(&format!("uid {}", my_uid())), "{text}");
    // Nothing was set up for the refused peer.
    let dir = handshake_dir(std::process::id());
    assert!(
        entries(&dir).iter().all(|e| !e.starts_with(".tmp")),
        "{:?}",
        entries(&dir)
    );
}

/// A `vrtspike cache serve` whose log goes to a file.
fn logged_server(tag: &str, extra: &[&str]) -> (Child, String, tempfile::NamedTempFile) {
    let address = unique_address(tag);
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut child = Command::new(common::exe())
        .args(["cache", "serve", "--address", &address, "--cap", "1M"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap();
    wait_for_child_server(&mut child, &address, Duration::from_secs(30)).unwrap();
    (child, address, log)
}

/// `vrtspike cache stats` run as `nobody`.
fn stats_as_nobody(address: &str) -> std::process::Output {
    Command::new(common::exe())
        .args(["cache", "stats", "--address", address])
        .uid(NOBODY)
        .gid(NOBODY)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap()
}

#[test]
fn a_client_run_as_another_user_is_refused_unless_allowed() {
    if my_uid() != 0 {
        eprintln!("skipped: running a client as nobody needs root");
        return;
    }
    let (mut server, address, log) = logged_server("nobody", &[]);
    let out = stats_as_nobody(&address);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("belongs to uid 0"), "{err}");
    assert!(err.contains(&format!("--allow-uid {NOBODY}")), "{err}");
    assert!(
        wait_until(Duration::from_secs(5), || {
            let text = fs::read_to_string(log.path()).unwrap();
            text.contains(&format!("refused a connection from uid {NOBODY} (pid "))
        }),
        "the server did not log the refusal: {}",
        fs::read_to_string(log.path()).unwrap()
    );
    // The server's own user is still served.
    let client = CacheClient::connect(&address, "owner").unwrap();
    fill_pattern(&client, "k", 1000);
    server.kill().unwrap();
    server.wait().unwrap();

    // Let in on purpose: nobody reads the stats.
    let allow = NOBODY.to_string();
    let (mut server, address, _log) = logged_server("allowed", &["--allow-uid", &allow]);
    let out = stats_as_nobody(&address);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("cache server pid"));
    server.kill().unwrap();
    server.wait().unwrap();
}

/// A process holding `n` connections to `address` that never say a word.
fn silent_flood(address: &str, n: usize) -> Option<Child> {
    let script = format!(
        "import socket, sys, time\n\
         s = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range({n})]\n\
         [c.connect('\\0' + sys.argv[1]) for c in s]\n\
         print('ready', flush=True)\n\
         time.sleep(60)\n"
    );
    let mut child = Command::new("python3")
        .args(["-c", &script, address])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .ok()?;
    let mut ready = [0u8; 5];
    child.stdout.take()?.read_exact(&mut ready).ok()?;
    (&ready == b"ready").then_some(child)
}

fn threads_of(pid: u32) -> usize {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap()
}

#[test]
fn a_flood_of_silent_connects_does_not_keep_a_real_client_out() {
    let server = ServerProc::start("flood", &["--cap", "1M"]);
    let pid = server.child.id();
    let before = threads_of(pid);
    let Some(mut flood) = silent_flood(&server.address, 300) else {
        eprintln!("skipped: no python3 to open the flood of connections");
        return;
    };
    let started = Instant::now();
    let client = server.client("real");
    fill_pattern(&client, "k", 4096);
    let Lookup::Hit(lease) = client.get("k").unwrap() else {
        panic!("expected a hit");
    };
    assert!(has_pattern("k", &lease));
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(3), "served after {waited:?}");
    // The flood's handshakes are bounded (16 per process) and made no directories.
    let during = threads_of(pid);
    assert!(during <= before + 16 + 2, "{before} -> {during} threads");
    let dir = handshake_dir(pid);
    assert!(
        entries(&dir).is_empty(),
        "handshake directories: {:?}",
        entries(&dir)
    );
    flood.kill().unwrap();
    flood.wait().unwrap();
}

#[test]
fn handshake_directories_go_after_the_handshake_and_after_a_killed_server() {
    let mut server = ServerProc::start("hsdir", &["--cap", "1M"]);
    let pid = server.child.id();
    let dir = handshake_dir(pid);
    assert!(dir.is_dir());
    let _client = server.client("one");
    assert!(entries(&dir).is_empty(), "{:?}", entries(&dir));

    // A handshake that stops half-way: the server made a one-shot socket for it.
    let addr = SocketAddr::from_abstract_name(server.address.as_bytes()).unwrap();
    let mut half = UnixStream::connect_addr(&addr).unwrap();
    half.write_all(b"H").unwrap();
    let mut len = [0u8; 4];
    half.read_exact(&mut len).unwrap();
    assert!(wait_until(Duration::from_secs(5), || entries(&dir).len() == 1));

    // The server dies mid-handshake; the next server to start removes its files.
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    assert!(dir.exists(), "nothing to clean up: the test proves nothing");
    let _next = ServerProc::start("hsdir-next", &["--cap", "1M"]);
    assert!(!dir.exists(), "a killed server's handshake files were kept");
}
