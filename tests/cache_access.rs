//! Who gets into the cache server: only its own user (or one let in with
//! `--allow-uid`), refused at accept with a named error on both sides; and whom a
//! client trusts: only a server of its own user (or one it trusts with
//! `--allow-uid`), checked before it reads a byte. A flood of connects that never
//! say hello, or handshakes that never connect to their channel, do not keep a real
//! client out; a silent server does not hang `cache stats`; a get that waits for
//! another's fill longer than its reply timeout keeps its connection; the one-shot
//! handshake directories do not outlive their handshake, nor a killed server. A
//! server of another protocol version (another build's) is never attached, and the
//! error names both versions.
//!
//! No sleep stands in for synchronisation and no upper bound on elapsed time is
//! asserted (a loaded machine would trip it): the tests poll the server's stats or
//! what it did (threads, closed sockets, log lines), with limits far above any
//! wait they expect. Tests that need root (or python3) are ignored where the build
//! did not run as root (or found no python3), except under `CI=true` (CI runs as
//! root), and fail, saying what they need, where they run without it.

mod common;
#[path = "../launcher/tests/common/squat.rs"]
mod squat;

use std::fs;
use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{fill_pattern, has_pattern, unique_address, wait_until, ServerProc};
use squat::{Squatter, NOBODY};
use vrtspike::cache::admission::HandshakeLimits;
use vrtspike::cache::rendezvous::CACHE_PROTOCOL_VERSION;
use vrtspike::cache::{spawn_server, CacheClient, CacheError, ClientOptions, Lookup, ServerConfig};
use vrtspike::testkit::process::wait_for_child_server;

/// How long a poll waits for what must happen: far above any expected wait.
const PATIENCE: Duration = Duration::from_secs(60);

/// A test that cannot run here although the build found what it needs (built as
/// root, run as another user): it fails, saying what it needs. Where the build
/// found it missing the test is ignored (`build/facilities.rs`).
fn cannot_run(why: &str) {
    panic!("this test needs {why}");
}

fn my_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// The handshake directory of the server process `pid`.
fn handshake_dir(pid: u32) -> PathBuf {
    vrtspike::cache::handshake_dir::dir_of(pid)
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

/// `vrtspike cache stats` run as `nobody`, trusting root's server.
fn stats_as_nobody(address: &str) -> std::process::Output {
    Command::new(common::exe())
        .args(["cache", "stats", "--address", address, "--allow-uid", "0"])
        .uid(NOBODY)
        .gid(NOBODY)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap()
}

#[test]
#[cfg_attr(vrtspike_no_root, ignore = "needs root, to run a process as nobody")]
fn a_client_run_as_another_user_is_refused_unless_allowed() {
    if my_uid() != 0 {
        return cannot_run("root, to run a client as nobody");
    }
    let (mut server, address, log) = logged_server("nobody", &[]);
    let out = stats_as_nobody(&address);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("belongs to uid 0"), "{err}");
    assert!(err.contains(&format!("--allow-uid {NOBODY}")), "{err}");
    assert!(
        wait_until(PATIENCE, || {
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
    // The pipe stays open with the child: were it dropped before python's last
    // write, python would die of the broken pipe and take the flood's connections
    // along (seen once: 12 handshake threads held instead of 16).
    let mut ready = [0u8; 6];
    child.stdout.as_mut()?.read_exact(&mut ready).ok()?;
    (&ready == b"ready\n").then_some(child)
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
#[cfg_attr(vrtspike_no_python3, ignore = "needs python3")]
fn a_flood_of_silent_connects_does_not_keep_a_real_client_out() {
    // The flood's handshakes never time out during the test: the real client is
    // served while they hold every place its process may take.
    let server = ServerProc::start("flood", &["--cap", "1M", "--handshake-timeout-s", "600"]);
    let pid = server.child.id();
    let before = threads_of(pid);
    let Some(mut flood) = silent_flood(&server.address, 300) else {
        return cannot_run("python3, to open the flood of connections");
    };
    let client = server.client("real");
    fill_pattern(&client, "k", 4096);
    let Lookup::Hit(lease) = client.get("k").unwrap() else {
        panic!("expected a hit");
    };
    assert!(has_pattern("k", &lease));
    // Served while the flood still held its handshakes, bounded at 16 per process
    // (one thread each), which made no directories.
    let during = threads_of(pid);
    assert!(
        during >= before + 16 && during <= before + 16 + 2,
        "{before} -> {during} threads"
    );
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
    assert!(wait_until(PATIENCE, || entries(&dir).len() == 1));

    // The server dies mid-handshake; the next server to start removes its files.
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    assert!(dir.exists(), "nothing to clean up: the test proves nothing");
    let _next = ServerProc::start("hsdir-next", &["--cap", "1M"]);
    assert!(!dir.exists(), "a killed server's handshake files were kept");
}

#[test]
#[cfg_attr(vrtspike_no_root, ignore = "needs root, to run a process as nobody")]
fn a_client_refuses_a_server_of_another_user_naming_its_uid_and_pid() {
    if my_uid() != 0 {
        return cannot_run("root, to run a server as nobody");
    }
    // Another user's server at the address, letting us in: still refused by us.
    let me = my_uid().to_string();
    let address = unique_address("foreign");
    let server = Squatter::start_with(
        Path::new(common::exe()),
        &address,
        &["--allow-uid", &me],
        PATIENCE,
    );
    let pid = server.pid() as i32;
    // The squatter listens once started.
    let err =
        CacheClient::connect(&address, "wary").expect_err("connected to another user's server");
    let CacheError::ForeignServer {
        server_uid,
        server_pid,
        ..
    } = err
    else {
        panic!("expected ForeignServer, got {err}");
    };
    assert_eq!((server_uid, server_pid), (NOBODY, pid));
    let text = err.to_string();
    assert!(
        text.contains(&format!("uid {NOBODY} (pid {pid})")),
        "{text}"
    );
    // Trusted on purpose, on both sides: served.
    let options = ClientOptions::default().trusting(&[NOBODY]);
    let client = CacheClient::connect_with(&address, "trusting", &options).unwrap();
    fill_pattern(&client, "k", 1000);
    // The command line says the same.
    let out = Command::new(common::exe())
        .args(["cache", "stats", "--address", &address])
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("runs as uid {NOBODY} (pid {pid})")),
        "{stderr}"
    );
    let allow = NOBODY.to_string();
    let out = Command::new(common::exe())
        .args([
            "cache",
            "stats",
            "--address",
            &address,
            "--allow-uid",
            &allow,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(server);
}

/// A fake server run as `nobody` at `address`: it greets at once with a channel
/// name, then reports how many bytes the client sent before closing.
fn fake_foreign_server(address: &str) -> Option<Child> {
    let script = "import socket, sys\n\
         s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n\
         s.bind('\\0' + sys.argv[1]); s.listen(1)\n\
         print('ready', flush=True)\n\
         c, _ = s.accept()\n\
         name = b'channel /tmp/not-a-channel'\n\
         got = b''\n\
         try:\n\
         \x20   c.sendall(len(name).to_bytes(4, 'little') + name)\n\
         \x20   c.settimeout(5)\n\
         \x20   while True:\n\
         \x20       b = c.recv(64)\n\
         \x20       if not b: break\n\
         \x20       got += b\n\
         except OSError: pass\n\
         print('received', len(got), flush=True)\n";
    let mut child = Command::new("python3")
        .args(["-c", script, address])
        .uid(NOBODY)
        .gid(NOBODY)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .ok()?;
    let mut ready = [0u8; 6];
    child.stdout.as_mut()?.read_exact(&mut ready).ok()?;
    (&ready == b"ready\n").then_some(child)
}

#[test]
#[cfg_attr(vrtspike_no_root, ignore = "needs root, to run a process as nobody")]
#[cfg_attr(vrtspike_no_python3, ignore = "needs python3")]
fn a_foreign_server_gets_not_a_byte_and_its_greeting_is_not_read() {
    if my_uid() != 0 {
        return cannot_run("root, to run a fake server as nobody");
    }
    let address = unique_address("fake");
    let Some(mut fake) = fake_foreign_server(&address) else {
        return cannot_run("python3, for the fake server");
    };
    let err = CacheClient::connect(&address, "wary").unwrap_err();
    // Had the client read the greeting, it would have failed on its channel name.
    assert!(
        matches!(
            err,
            CacheError::ForeignServer {
                server_uid: NOBODY,
                ..
            }
        ),
        "{err}"
    );
    let mut said = String::new();
    fake.stdout
        .take()
        .unwrap()
        .read_to_string(&mut said)
        .unwrap();
    assert_eq!(
        said.trim(),
        "received 0",
        "the client wrote to a foreign server"
    );
    fake.wait().unwrap();
}

#[test]
fn a_client_that_acknowledges_but_never_connects_loses_its_handshake_slot() {
    let address = unique_address("no-connect");
    let mut config = ServerConfig::new(address.clone(), 1 << 20);
    config.handshake_timeout = Duration::from_secs(1);
    config.handshake_limits = HandshakeLimits {
        total: 2,
        per_peer: 2,
    };
    let _server = spawn_server(config).unwrap();
    let addr = SocketAddr::from_abstract_name(address.as_bytes()).unwrap();
    // Two handshakes that say hello, read the channel's name, acknowledge it, and
    // never connect to the channel: they take every handshake slot.
    let stuck: Vec<UnixStream> = (0..2)
        .map(|_| {
            let mut raw = UnixStream::connect_addr(&addr).unwrap();
            raw.write_all(b"H").unwrap();
            let mut len = [0u8; 4];
            raw.read_exact(&mut len).unwrap();
            let mut name = vec![0u8; u32::from_le_bytes(len) as usize];
            raw.read_exact(&mut name).unwrap();
            raw.write_all(&[1]).unwrap();
            raw
        })
        .collect();
    // A real client is busy-retried until the server gives those slots up, which
    // it does by closing the stuck handshakes.
    let client = CacheClient::connect(&address, "real").unwrap();
    fill_pattern(&client, "k", 1000);
    for mut raw in stuck {
        raw.set_read_timeout(Some(PATIENCE)).unwrap();
        let mut rest = Vec::new();
        let closed = raw.read_to_end(&mut rest);
        assert!(
            closed.is_ok(),
            "the server kept a stuck handshake open: {closed:?}"
        );
    }
}

#[test]
fn stats_of_a_server_that_never_answers_time_out() {
    // A listener of our own user that accepts and never says a word.
    let address = unique_address("mute");
    let addr = SocketAddr::from_abstract_name(address.as_bytes()).unwrap();
    let listener = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
    // It holds the connection, silent, until `cache stats` has ended.
    let (done, ended) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        let held: Vec<UnixStream> = listener.incoming().take(1).flatten().collect();
        let _ = ended.recv();
        drop(held);
    });
    let mut stats = Command::new(common::exe())
        .args(["cache", "stats", "--address", &address, "--timeout", "1"])
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Only a hung command meets this limit (it gives up after 1 s of silence).
    let ended_itself = wait_until(PATIENCE, || stats.try_wait().unwrap().is_some());
    if !ended_itself {
        let _ = stats.kill();
    }
    let out = stats.wait_with_output().unwrap();
    let _ = done.send(());
    assert!(ended_itself, "cache stats hung on a silent server");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no greeting within 1.0 s"), "{stderr}");
    assert!(stderr.contains("--timeout 1"), "{stderr}");
    holder.join().unwrap();
}

#[test]
fn a_fill_wait_longer_than_the_reply_timeout_keeps_the_connection() {
    let address = unique_address("fill-wait");
    let mut config = ServerConfig::new(address.clone(), 1 << 20);
    config.fill_wait_timeout = Duration::from_secs(5);
    let _server = spawn_server(config).unwrap();
    let filler = CacheClient::connect(&address, "filler").unwrap();
    let Lookup::Miss(mut ticket) = filler.get("k").unwrap() else {
        panic!("expected a miss");
    };
    let waiter = std::thread::spawn({
        let address = address.clone();
        move || {
            let impatient = ClientOptions::default().waiting(Duration::from_secs(1));
            let client = CacheClient::connect_with(&address, "waiter", &impatient).unwrap();
            let started = Instant::now();
            let lease = match client.get("k").unwrap() {
                Lookup::Hit(lease) => lease,
                Lookup::Miss(_) => panic!("the waiter was told to fill"),
            };
            assert!(lease.waited_for_fill());
            assert_eq!(&lease[..4], b"done");
            started.elapsed()
        }
    });
    // The waiter is inside its get once the server counted its wait; it then
    // waits past its 1 s reply timeout (the duration under test, not a sync).
    assert!(
        wait_until(PATIENCE, || filler.stats().unwrap().totals.waits == 1),
        "the waiter never waited for the fill: {:?}",
        filler.stats().unwrap()
    );
    std::thread::sleep(Duration::from_millis(2500));
    ticket.reserve(4).unwrap();
    ticket.write_at(0, b"done").unwrap();
    drop(ticket.commit().unwrap());
    let waited = waiter.join().unwrap();
    assert!(
        waited > Duration::from_secs(2),
        "the get did not wait past its reply timeout ({waited:?}): the test proves nothing"
    );
}

/// The error of a connect to `address`, polled until a server listens there.
fn refusal_of(address: &str) -> CacheError {
    let deadline = Instant::now() + PATIENCE;
    loop {
        match CacheClient::connect(address, "other-build") {
            Err(CacheError::Connect { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => return e,
            Ok(_) => panic!("attached to a server of another protocol version"),
        }
    }
}

#[test]
fn a_server_of_another_protocol_version_is_never_attached() {
    let ours = CACHE_PROTOCOL_VERSION;
    let address = unique_address("other-version");
    let mut config = ServerConfig::new(address.clone(), 1 << 20);
    config.protocol = ours + 1;
    let server = spawn_server(config).unwrap();
    let err = refusal_of(&address);
    let CacheError::ProtocolVersion {
        server: v, client, ..
    } = err
    else {
        panic!("expected ProtocolVersion, got {err}");
    };
    assert_eq!((v, client), (ours + 1, ours));
    let text = err.to_string();
    assert!(
        text.contains(&format!("speaks cache protocol version {}", ours + 1))
            && text.contains(&format!("this build speaks version {ours}"))
            && text.contains(&address),
        "{text}"
    );
    drop(server);
}

#[test]
fn a_server_from_before_versions_is_left_before_the_hello() {
    // A fake server greeting as builds before versions did: the channel's name
    // alone. The client must leave without connecting to the channel.
    let address = unique_address("unversioned");
    let listener = std::os::unix::net::UnixListener::bind_addr(
        &SocketAddr::from_abstract_name(address.as_bytes()).unwrap(),
    )
    .unwrap();
    let fake = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut hello = [0u8; 1];
        stream.read_exact(&mut hello).unwrap();
        let greeting = b"channel /tmp/vrtspike-no-such-channel/socket";
        stream
            .write_all(&(greeting.len() as u32).to_le_bytes())
            .unwrap();
        stream.write_all(greeting).unwrap();
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        // What the client sends next: nothing, it closes (no acknowledgement).
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).map(|_| rest)
    });
    let err = refusal_of(&address);
    let CacheError::ProtocolVersion { server, client, .. } = err else {
        panic!("expected ProtocolVersion, got {err}");
    };
    assert_eq!((server, client), (1, CACHE_PROTOCOL_VERSION));
    let after = fake.join().unwrap();
    assert_eq!(
        after.ok(),
        Some(Vec::new()),
        "the client sent more after the greeting"
    );
}
