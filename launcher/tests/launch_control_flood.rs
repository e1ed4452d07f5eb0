//! Nobody without the job's secret can stop or starve a multi-node job through
//! node 0's control port. Two launchers on loopback (node 0 and node 1, stand-in
//! ranks); while node 0 waits for node 1, strangers flood its control port from
//! addresses of their own (127.0.0.2 and 127.0.0.3): eight connections streaming
//! zeros without a newline as fast as they can (reconnecting when cut), and two
//! dripping a byte every 100 ms. Node 0 must cut each streamer after a bounded
//! line (its peak memory does not grow with what they send), drop each dripper at
//! its handshake's deadline (10 s for the whole handshake, however often bytes
//! come), name the refused address in its log, and let node 1 join meanwhile: the
//! job completes on both nodes.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::{exit_code, free_port, wait_until, Job};
use vrtspike_contract::rundir::RunLayout;

/// What one streamer may send on one connection before the test calls it never
/// cut (node 0 took it all).
const STREAM_CAP: u64 = 64 << 20;
/// How long a dripper drips before the test calls it never dropped.
const DRIP_LIMIT: Duration = Duration::from_secs(40);
const LIMIT: Duration = Duration::from_secs(120);

/// A TCP connection to `port` on 127.0.0.1 from the loopback address `from`.
fn connect_from(from: [u8; 4], port: u16) -> std::io::Result<TcpStream> {
    use std::os::fd::FromRawFd;
    let addr = |ip: [u8; 4], port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(ip),
        },
        sin_zero: [0; 8],
    };
    let (local, remote) = (addr(from, 0), addr([127, 0, 0, 1], port));
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a fresh socket, owned by the TcpStream at once (closed on every
    // error below); bind and connect read `len` bytes of the sockaddr_in values,
    // which live across the calls.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let stream = TcpStream::from_raw_fd(fd);
        let local_ptr = (&local as *const libc::sockaddr_in).cast::<libc::sockaddr>();
        if libc::bind(fd, local_ptr, len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let remote_ptr = (&remote as *const libc::sockaddr_in).cast::<libc::sockaddr>();
        if libc::connect(fd, remote_ptr, len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(stream)
    }
}

/// Streams zeros without a newline, reconnecting whenever node 0 cuts it, until
/// `stop`; returns the most it got to send on one connection.
fn streamer(port: u16, stop: Arc<AtomicBool>) -> u64 {
    let zeros = vec![0u8; 64 << 10];
    let mut most = 0;
    while !stop.load(Ordering::SeqCst) {
        let Ok(mut stream) = connect_from([127, 0, 0, 2], port) else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
        let mut sent = 0u64;
        while sent < STREAM_CAP && !stop.load(Ordering::SeqCst) {
            match stream.write(&zeros) {
                Ok(n) => sent += n as u64,
                Err(_) => break,
            }
        }
        most = most.max(sent);
        if sent >= STREAM_CAP {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    most
}

/// Drips one byte every 100 ms; how long until node 0 dropped it (`None`: not
/// within [`DRIP_LIMIT`]).
fn dripper(port: u16) -> Option<Duration> {
    let mut stream = connect_from([127, 0, 0, 3], port).ok()?;
    let started = Instant::now();
    while started.elapsed() < DRIP_LIMIT {
        if stream.write_all(b"H").is_err() {
            return Some(started.elapsed());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    None
}

/// The launcher process's peak and current resident memory (VmHWM, VmRSS), bytes.
fn memory(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    (kib("VmHWM:"), kib("VmRSS:"))
}

fn node(job: &Job, node: u32, port: u16, control: u16, log: &std::path::Path) -> Child {
    let (port, control) = (port.to_string(), control.to_string());
    let log = std::fs::File::create(log).unwrap_or_else(|e| panic!("{e}"));
    let extra = [
        "--master-port",
        &port,
        "--control-port",
        &control,
        "--max-restarts",
        "0",
        "--grace-s",
        "2",
    ];
    job.command(&common::two_node_args(1, node, "127.0.0.1", &extra))
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn a_flood_on_the_control_port_neither_grows_node_0_nor_keeps_node_1_out() {
    // The ranks run until the test has seen what the flood got.
    let job = Job::new(r#"while [ ! -e "$VRTSPIKE_RUN_DIR/stop" ]; do sleep 0.05; done"#);
    let (port, control) = (free_port(), free_port());
    let log0 = job.tmp.path().join("node0.log");
    let mut node0 = node(&job, 0, port, control, &log0);
    let control_file = RunLayout::new(&job.run_dir).control_file();
    assert!(
        wait_until(LIMIT, || control_file.exists()),
        "node 0 never listened"
    );
    let (_, baseline) = memory(node0.id());

    let stop = Arc::new(AtomicBool::new(false));
    let streamers: Vec<JoinHandle<u64>> = (0..8)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || streamer(control, stop))
        })
        .collect();
    let drippers: Vec<JoinHandle<Option<Duration>>> = (0..2)
        .map(|_| std::thread::spawn(move || dripper(control)))
        .collect();
    // Node 1 joins while the flood goes on.
    let mut node1 = node(&job, 1, port, control, &job.tmp.path().join("node1.log"));
    let joined = wait_until(LIMIT, || job.rank_pid(1, 0).is_some());
    let dropped: Vec<Option<Duration>> = drippers
        .into_iter()
        .map(|d| d.join().unwrap_or(None))
        .collect();
    let (peak, _) = memory(node0.id());
    stop.store(true, Ordering::SeqCst);
    let most: Vec<u64> = streamers
        .into_iter()
        .map(|s| s.join().unwrap_or(u64::MAX))
        .collect();
    std::fs::write(job.run_dir.join("stop"), "").unwrap_or_else(|e| panic!("{e}"));
    let codes = (exit_code(&mut node0, LIMIT), exit_code(&mut node1, LIMIT));
    let log = std::fs::read_to_string(&log0).unwrap_or_default();
    let context = format!("node 0's log:\n{log}");

    let grown = peak.saturating_sub(baseline);
    println!(
        "launch_control_flood: node 1 joined under the flood; node 0 grew {:.1} MiB \
         (peak {:.1} MiB); streamers cut after at most {} KiB each; drippers dropped \
         after {:?}",
        grown as f64 / (1 << 20) as f64,
        peak as f64 / (1 << 20) as f64,
        most.iter().max().copied().unwrap_or(0) >> 10,
        dropped
    );
    assert!(joined, "node 1 never joined during the flood\n{context}");
    assert_eq!(codes, (Some(0), Some(0)), "{context}");
    assert!(
        most.iter().all(|&sent| sent < STREAM_CAP),
        "a streamer was never cut (bytes sent on its longest connection: {most:?})"
    );
    for (i, drop) in dropped.iter().enumerate() {
        let Some(after) = drop else {
            panic!("dripper {i} was never dropped within {DRIP_LIMIT:?}\n{context}");
        };
        assert!(
            *after >= Duration::from_secs(9),
            "dripper {i} was dropped after {after:?}, before its deadline"
        );
    }
    assert!(
        grown < 64 << 20,
        "node 0's launcher grew by {} MiB under the flood",
        grown >> 20
    );
    assert!(
        log.contains("refused a control connection from 127.0.0.2:"),
        "the refused address is logged\n{context}"
    );
}
