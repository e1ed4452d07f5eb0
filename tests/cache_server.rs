//! The cache server as separate processes see it: eviction around pinned records,
//! the byte cap, leases of killed clients, single-flight fills, bad requests, and
//! start-up errors.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{fill_pattern, has_pattern, pin_process, wait_until, ServerProc};
use vrtspike::cache::protocol::{Reply, Request, RequestError};
use vrtspike::cache::{CacheError, Lookup};

const REC: usize = 64 * 1024;

#[test]
fn eviction_never_takes_a_pinned_slot_and_the_cap_holds() {
    // 8 slots of 64 KiB; 3 of them pinned by another process.
    let server = ServerProc::start("evict", &["--cap", "512K"]);
    let client = server.client("test");
    let pinned: Vec<String> = (0..3).map(|i| format!("pinned/{i}")).collect();
    for key in &pinned {
        fill_pattern(&client, key, REC);
    }
    let mut holder = pin_process(&server.address, &pinned);
    for i in 0..60 {
        let key = format!("churn/{i}");
        fill_pattern(&client, &key, REC);
        let stats = client.stats().unwrap();
        assert!(stats.bytes_used <= stats.cap_bytes, "{stats:?}");
        assert!(stats.bytes_carved <= stats.cap_bytes, "{stats:?}");
        assert_eq!(stats.pinned_bytes, 3 * REC as u64);
    }
    let stats = client.stats().unwrap();
    assert!(stats.evictions >= 50, "only {} evictions", stats.evictions);
    for key in &pinned {
        let lease = client
            .peek(key)
            .unwrap()
            .expect("a pinned record was evicted");
        assert!(
            has_pattern(key, &lease),
            "pinned record {key} was overwritten"
        );
    }
    // The most recent record is still cached; the oldest churn is gone.
    assert!(client.peek("churn/59").unwrap().is_some());
    assert!(client.peek("churn/0").unwrap().is_none());
    holder.kill().unwrap();
    holder.wait().unwrap();
}

#[test]
fn a_killed_clients_leases_come_back() {
    let server = ServerProc::start("killed", &["--cap", "256K"]);
    let client = server.client("test");
    let keys: Vec<String> = (0..4).map(|i| format!("k/{i}")).collect();
    for key in &keys {
        fill_pattern(&client, key, REC);
    }
    let mut holder = pin_process(&server.address, &keys);
    // Every slot is pinned: a new record has nowhere to go.
    let Lookup::Miss(mut ticket) = client.get("new").unwrap() else {
        panic!("expected a miss");
    };
    let err = ticket.reserve(REC as u64).unwrap_err();
    assert!(
        matches!(err.refusal(), Some(RequestError::StoreFull { .. })),
        "{err}"
    );
    drop(ticket);
    holder.kill().unwrap(); // SIGKILL
    holder.wait().unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || {
            let s = client.stats().unwrap();
            s.pinned_bytes == 0 && s.leases_held == 0
        }),
        "leases of the killed client were not released: {:?}",
        client.stats().unwrap()
    );
    fill_pattern(&client, "new", REC);
    assert_eq!(client.stats().unwrap().evictions, 1);
}

#[test]
fn concurrent_misses_fill_once() {
    let server = ServerProc::start("flight", &["--cap", "1M"]);
    let address = server.address.clone();
    let barrier = std::sync::Barrier::new(4);
    std::thread::scope(|scope| {
        for t in 0..4 {
            let (address, barrier) = (&address, &barrier);
            scope.spawn(move || {
                let client =
                    vrtspike::cache::CacheClient::connect(address, &format!("t{t}")).unwrap();
                barrier.wait();
                let lease = client
                    .get_or_fill("shared", REC, |slot| {
                        std::thread::sleep(Duration::from_millis(300));
                        common::write_pattern("shared", slot);
                        Ok::<(), std::convert::Infallible>(())
                    })
                    .unwrap();
                assert!(has_pattern("shared", &lease));
            });
        }
    });
    let stats = server.client("check").stats().unwrap();
    assert_eq!(stats.totals.fills, 1, "{stats:?}");
    assert_eq!(stats.totals.misses, 1);
    assert_eq!(stats.totals.hits, 3);
    assert!(stats.totals.waits >= 1);
}

#[test]
fn an_abandoned_fill_passes_to_a_waiter() {
    let server = ServerProc::start("abandon", &["--cap", "1M"]);
    let first = server.client("first");
    let Lookup::Miss(ticket) = first.get("key").unwrap() else {
        panic!("expected a miss");
    };
    let address = server.address.clone();
    let waiter = std::thread::spawn(move || {
        let second = vrtspike::cache::CacheClient::connect(&address, "second").unwrap();
        // Blocks until the first fill is abandoned, then fills itself.
        let lease = second
            .get_or_fill("key", REC, |slot| {
                common::write_pattern("key", slot);
                Ok::<(), std::convert::Infallible>(())
            })
            .unwrap();
        has_pattern("key", &lease)
    });
    // The waiter is inside its get once the server counted its wait (polled, not
    // slept): only then is the fill abandoned, so the waiter takes it over.
    assert!(
        wait_until(Duration::from_secs(60), || {
            first.stats().is_ok_and(|s| s.totals.waits == 1)
        }),
        "the second client never waited for the fill: {:?}",
        first.stats()
    );
    drop(ticket); // abandons the fill
    assert!(waiter.join().unwrap());
    let stats = first.stats().unwrap();
    assert_eq!(stats.totals.fills_abandoned, 1);
    assert_eq!(stats.totals.fills, 1);
    assert_eq!(stats.totals.waits, 1, "{stats:?}");
}

#[test]
fn bad_requests_get_errors_and_the_server_keeps_serving() {
    let mut server = ServerProc::start("bad", &["--cap", "256K"]);
    let client = server.client("bad");
    let other = server.client("other");
    let refused = |reply: Reply| match reply {
        Reply::Error(e) => e,
        other => panic!("expected an error reply, got {other:?}"),
    };

    // Unknown lease, and a double release.
    let e = refused(client.call(Request::Release { lease: 4242 }).unwrap());
    assert_eq!(e, RequestError::LeaseNotHeld { lease: 4242 });
    fill_pattern(&client, "a", REC);
    let lease = client.peek("a").unwrap().unwrap();
    let id = lease.id();
    std::mem::forget(lease); // release by hand, twice
    assert!(matches!(
        client.call(Request::Release { lease: id }).unwrap(),
        Reply::Done
    ));
    let e = refused(client.call(Request::Release { lease: id }).unwrap());
    assert_eq!(e, RequestError::LeaseNotHeld { lease: id });
    assert!(e.to_string().contains(&id.to_string()));

    // Another client's lease cannot be released by this one.
    let theirs = other.peek("a").unwrap().unwrap();
    let e = refused(
        client
            .call(Request::Release { lease: theirs.id() })
            .unwrap(),
    );
    assert!(matches!(e, RequestError::LeaseNotHeld { .. }));
    drop(theirs);

    // Unknown ticket, commit before reserve, record larger than a slot.
    let e = refused(client.call(Request::Commit { ticket: 777 }).unwrap());
    assert_eq!(e, RequestError::TicketNotHeld { ticket: 777 });
    let Reply::Miss { ticket } = client.call(Request::Get { key: "big".into() }).unwrap() else {
        panic!("expected a miss");
    };
    let e = refused(client.call(Request::Commit { ticket }).unwrap());
    assert!(matches!(e, RequestError::TicketState { .. }), "{e}");
    let e = refused(
        client
            .call(Request::Reserve {
                ticket,
                len: 1 << 20,
            })
            .unwrap(),
    );
    assert!(matches!(e, RequestError::RecordTooLarge { .. }), "{e}");
    assert!(e.to_string().contains("big"), "{e}");
    // Extreme values from a peer are refusals too, never a panic of the server.
    let e = refused(
        client
            .call(Request::Reserve {
                ticket,
                len: u64::MAX,
            })
            .unwrap(),
    );
    assert!(
        matches!(e, RequestError::RecordTooLarge { len: u64::MAX, .. }),
        "{e}"
    );
    let e = refused(client.call(Request::Release { lease: u64::MAX }).unwrap());
    assert_eq!(e, RequestError::LeaseNotHeld { lease: u64::MAX });
    assert!(matches!(
        client.call(Request::Abort { ticket }).unwrap(),
        Reply::Done
    ));

    // Unknown key; a hello after the handshake.
    let e = refused(
        client
            .call(Request::Invalidate { key: "nope".into() })
            .unwrap(),
    );
    assert_eq!(e, RequestError::UnknownKey { key: "nope".into() });
    let (reply, _rx) = ipc_channel::ipc::channel().unwrap();
    let e = refused(
        client
            .call(Request::Hello {
                protocol: vrtspike::cache::rendezvous::CACHE_PROTOCOL_VERSION,
                name: "again".into(),
                job: String::new(),
                pid: 1,
                mapped_store: None,
                reply,
            })
            .unwrap(),
    );
    assert!(matches!(e, RequestError::Protocol(_)));

    // A write past the slot's length through the API is refused and writes nothing.
    let Lookup::Miss(mut fill) = client.get("w").unwrap() else {
        panic!("expected a miss");
    };
    fill.reserve(100).unwrap();
    let err = fill.write_at(90, &[1u8; 20]).unwrap_err();
    assert!(
        matches!(err, CacheError::WriteOutOfSlot { slot_len: 100, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("\"w\""), "{err}");
    fill.write_at(0, &[9u8; 100]).unwrap();
    let lease = fill.commit().unwrap();
    assert_eq!(&lease[..], &[9u8; 100][..]);
    drop(lease);

    // Garbage on the rendezvous socket does not hurt anyone.
    {
        use std::io::Write;
        use std::os::linux::net::SocketAddrExt;
        let addr =
            std::os::unix::net::SocketAddr::from_abstract_name(server.address.as_bytes()).unwrap();
        let mut raw = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
        let _ = raw.write_all(b"\xff\xff\xff\xffnot a handshake");
    }

    // Errors were counted; everyone is still served.
    let stats = other.stats().unwrap();
    assert!(stats.totals.errors >= 8, "{:?}", stats.totals);
    fill_pattern(&other, "after", REC);
    assert!(server.alive());
    let fresh = server.client("fresh");
    assert!(fresh.peek("after").unwrap().is_some());
}

fn serve_error(args: &[&str]) -> String {
    let address = common::unique_address("start");
    let out = Command::new(common::exe())
        .args(["cache", "serve", "--address", &address])
        .args(args)
        .output()
        .unwrap();
    assert!(!out.status.success(), "server started with {args:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn start_up_errors_name_the_sizes() {
    // A cap larger than the machine's whole memory.
    let err = serve_error(&["--cap", "1024T"]);
    assert!(err.contains("needs 1024.00 TiB"), "{err}");
    assert!(err.contains("MemTotal"), "{err}");
    // A cap that holds no record of the size given.
    let err = serve_error(&["--cap", "1M", "--record-bytes", "8M"]);
    assert!(err.contains("holds no record of 8388608 bytes"), "{err}");
    // The flag of the slot classes is gone, not silently ignored.
    let err = serve_error(&["--cap", "1M", "--slot-bytes", "8M"]);
    assert!(err.contains("--slot-bytes"), "{err}");
    // No size at all.
    let err = serve_error(&[]);
    assert!(err.contains("--cap"), "{err}");
    // Two servers on one address.
    let server = ServerProc::start("twice", &["--cap", "1M"]);
    let out = Command::new(common::exe())
        .args([
            "cache",
            "serve",
            "--address",
            &server.address,
            "--cap",
            "1M",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is in use"), "{err}");
}

#[test]
fn hits_come_from_shared_memory_without_a_message_and_are_counted() {
    let server = ServerProc::start("shared-hits", &["--cap", "1M"]);
    let reader = server.client("reader");
    let observer = server.client("observer");
    fill_pattern(&reader, "k", REC);
    let counters = |id| {
        let stats = observer.stats().unwrap();
        let client = stats.clients.iter().find(|c| c.id == id).cloned();
        (stats, client.expect("the reader is listed").counters)
    };
    let (_, before) = counters(reader.id());
    for _ in 0..100 {
        let Lookup::Hit(lease) = reader.get("k").unwrap() else {
            panic!("expected a hit");
        };
        assert!(has_pattern("k", &lease));
    }
    let (stats, after) = counters(reader.id());
    assert_eq!(after.hits - before.hits, 100, "{after:?}");
    assert_eq!(after.requests, before.requests, "hits sent messages");
    assert_eq!(reader.shared_hits(), 100);
    assert_eq!(stats.pinned_bytes, 0, "released leases still pin");

    // A held lease pins in shared memory: the stats see it, invalidate is refused.
    let lease = reader.peek("k").unwrap().expect("cached");
    let (stats, _) = counters(reader.id());
    assert_eq!(stats.pinned_bytes, REC as u64);
    assert_eq!(stats.leases_held, 1);
    let err = observer.invalidate("k").unwrap_err();
    assert!(
        matches!(err.refusal(), Some(RequestError::Pinned { pins: 1, .. })),
        "{err}"
    );
    drop(lease);
    assert_eq!(observer.stats().unwrap().pinned_bytes, 0);

    // A key too long for a slot is refused by name.
    let long = "x".repeat(200);
    let err = reader
        .get(&long)
        .err()
        .expect("a 200-byte key was accepted");
    assert!(
        matches!(
            err.refusal(),
            Some(RequestError::KeyTooLong { max: 160, .. })
        ),
        "{err}"
    );

    // The reader's hits outlive its connection in the totals.
    let hits_before = observer.stats().unwrap().totals.hits;
    drop(reader);
    assert!(
        wait_until(Duration::from_secs(5), || {
            let s = observer.stats().unwrap();
            s.clients.len() == 1 && s.totals.hits == hits_before
        }),
        "hits were lost with the connection: {:?}",
        observer.stats().unwrap()
    );
    observer.invalidate("k").unwrap();
    assert!(observer.peek("k").unwrap().is_none());
}

#[test]
fn memory_is_reserved_as_slots_are_carved_not_at_start() {
    // An 8 GiB cap: the store takes only the memory of what is filled.
    let server = ServerProc::start("reserve", &["--cap", "8G", "--record-bytes", "64K"]);
    let client = server.client("test");
    let start = client.stats().unwrap();
    assert!(
        start.reserved_bytes == start.metadata_bytes && start.reserved_bytes < 64 << 20,
        "reserved {} bytes at start (metadata {})",
        start.reserved_bytes,
        start.metadata_bytes
    );
    for i in 0..4 {
        fill_pattern(&client, &format!("k/{i}"), REC);
    }
    let after = client.stats().unwrap();
    assert_eq!(after.reserved_bytes, start.reserved_bytes + 4 * REC as u64);
    assert_eq!(after.reserve_refusals, 0);
    let text = after.to_string();
    assert!(text.contains("reserved"), "{text}");
}

#[test]
fn a_slot_the_node_has_no_memory_for_is_a_named_refusal() {
    // Headroom beyond any machine: every new slot is refused, the server lives on.
    let mut server = ServerProc::start("nomem", &["--cap", "1M", "--reserve-headroom", "1000T"]);
    let client = server.client("test");
    let Lookup::Miss(mut ticket) = client.get("k").unwrap() else {
        panic!("expected a miss");
    };
    let err = ticket.reserve(REC as u64).unwrap_err();
    let Some(RequestError::OutOfMemory { key, limit, .. }) = err.refusal() else {
        panic!("expected OutOfMemory, got {err}");
    };
    assert_eq!(key, "k");
    assert!(
        limit.contains("MemAvailable") || limit.contains("cgroup"),
        "{limit}"
    );
    drop(ticket);
    let stats = client.stats().unwrap();
    assert_eq!(stats.reserve_refusals, 1);
    assert_eq!(stats.bytes_carved, 0);
    assert!(server.alive());
}

#[test]
fn a_client_that_only_takes_shared_hits_sees_its_server_gone() {
    let mut server = ServerProc::start("gone", &["--cap", "1M"]);
    let client = server.client("reader");
    fill_pattern(&client, "k", REC);
    assert!(!client.server_gone(), "a live server");
    // A hit comes from shared memory with no message, so only the probe can tell.
    assert!(matches!(client.get("k").unwrap(), Lookup::Hit(_)));
    let _ = server.child.kill();
    let _ = server.child.wait();
    assert!(!server.alive());
    assert!(
        wait_until(Duration::from_secs(5), || client.server_gone()),
        "the closed rendezvous socket was not seen"
    );
    assert!(matches!(client.get("absent"), Err(e) if e.is_server_gone()));
}
