//! A pin belongs to exactly one lease, so a stale release is a no-op: a raw
//! `Release` followed by the lease's own drop leaves a later lease of the same
//! record pinned, and a connection the server dropped keeps its leases pinned (its
//! page is not handed to a new client) until its client is gone, and the extent it
//! was filling is not handed to another fill while it may still write into it. Each
//! is checked under eviction pressure: the pinned record must survive, byte for
//! byte.

mod common;

use std::time::Duration;

use common::{fill_pattern, has_pattern, wait_until, ServerProc};
use vrtspike::cache::protocol::{Reply, Request, RequestError};
use vrtspike::cache::{CacheClient, CacheError, Lookup};
use vrtspike::testkit::fault::send_undecodable_request;

const REC: usize = 64 * 1024;

/// Fills enough other records to evict every unpinned one of a 4-record store.
fn churn(client: &CacheClient, tag: &str) {
    for i in 0..12 {
        fill_pattern(client, &format!("{tag}/{i}"), REC);
    }
}

fn assert_pinned_by(observer: &CacheClient, key: &str, pins: u32) {
    let err = observer.invalidate(key).unwrap_err();
    assert!(
        matches!(err.refusal(), Some(RequestError::Pinned { pins: p, .. }) if *p == pins),
        "{key}: {err}"
    );
}

#[test]
fn a_raw_release_then_the_leases_drop_leaves_a_later_lease_pinned() {
    let server = ServerProc::start("stale-release", &["--cap", "256K"]);
    let reader = server.client("reader");
    let observer = server.client("observer");
    fill_pattern(&reader, "k", REC);
    let first = reader.peek("k").unwrap().expect("cached");
    let reply = reader.call(Request::Release { lease: first.id() }).unwrap();
    assert!(matches!(reply, Reply::Done), "{reply:?}");
    let second = reader.peek("k").unwrap().expect("cached");
    // The first lease's own release comes late: it must not unpin the second.
    drop(first);
    assert_pinned_by(&observer, "k", 1);
    assert_eq!(observer.stats().unwrap().leases_held, 1);
    churn(&observer, "churn");
    assert!(has_pattern("k", &second), "a pinned record was overwritten");
    assert!(observer.stats().unwrap().evictions >= 8);
    drop(second);
    observer.invalidate("k").unwrap();
}

#[test]
fn a_dropped_connections_leases_pin_until_its_client_is_gone() {
    let server = ServerProc::start("stale-conn", &["--cap", "256K"]);
    let old = server.client("old");
    let observer = server.client("observer");
    fill_pattern(&old, "k", REC);
    let held = old.peek("k").unwrap().expect("cached");
    // The server drops the old connection (it sent a frame that is no request)
    // while its client still holds the lease.
    send_undecodable_request(&old).unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || observer
            .stats()
            .unwrap()
            .retired_connections
            == 1),
        "the server did not drop the connection: {:?}",
        observer.stats().unwrap()
    );
    assert!(
        matches!(old.get("other"), Err(CacheError::ServerGone { .. })),
        "the old client's requests go nowhere"
    );
    // New clients connect (one of them may get the old page under the bug) and
    // read the same record; the old lease's late drop must not unpin theirs.
    let newcomers: Vec<CacheClient> = (0..3).map(|i| server.client(&format!("new{i}"))).collect();
    let theirs = newcomers[0].peek("k").unwrap().expect("cached");
    assert_pinned_by(&observer, "k", 2);
    churn(&observer, "churn");
    assert!(
        has_pattern("k", &held),
        "the dropped client's record was overwritten"
    );
    drop(held);
    assert_pinned_by(&observer, "k", 1);
    churn(&observer, "more");
    assert!(has_pattern("k", &theirs), "a live lease lost its pin");
    drop(theirs);
    // The old client goes: its page is cleared and free.
    drop(old);
    assert!(
        wait_until(Duration::from_secs(5), || {
            let s = observer.stats().unwrap();
            s.retired_connections == 0 && s.leases_held == 0
        }),
        "the gone client's page was kept: {:?}",
        observer.stats().unwrap()
    );
    observer.invalidate("k").unwrap();
}

#[test]
fn a_dropped_fillers_extent_is_kept_while_it_may_still_write() {
    let server = ServerProc::start("dropped-filler", &["--cap", "256K"]);
    let filler = server.client("filler");
    let observer = server.client("observer");
    let Lookup::Miss(mut ticket) = filler.get("k").unwrap() else {
        panic!("expected a miss");
    };
    ticket.reserve(REC as u64).unwrap();
    // The server drops the filler's connection; its client still maps the extent.
    send_undecodable_request(&filler).unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || observer
            .stats()
            .unwrap()
            .retired_connections
            == 1),
        "the server did not drop the connection: {:?}",
        observer.stats().unwrap()
    );
    // Another client takes the key over at once, and fills more under pressure.
    fill_pattern(&observer, "k", REC);
    churn(&observer, "churn");
    let kept: Vec<String> = (0..12)
        .map(|i| format!("churn/{i}"))
        .chain(["k".to_string()])
        .collect();
    // The dropped client writes on into its map.
    ticket.slot_mut().unwrap().fill(0xAB);
    for key in &kept {
        if let Some(lease) = observer.peek(key).unwrap() {
            assert!(
                has_pattern(key, &lease),
                "{key} was written over by a client the server had dropped"
            );
        }
    }
    assert_eq!(observer.stats().unwrap().filling_bytes, REC as u64);
    // The dropped client goes: its extent is free.
    drop(ticket);
    drop(filler);
    assert!(
        wait_until(Duration::from_secs(30), || {
            let s = observer.stats().unwrap();
            s.retired_connections == 0 && s.filling_bytes == 0
        }),
        "the gone client's extent was kept: {:?}",
        observer.stats().unwrap()
    );
}
