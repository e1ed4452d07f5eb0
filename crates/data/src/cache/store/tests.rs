use super::*;
use crate::cache::pins::LeaseWord;
use crate::cache::table::MIN_CONNECTIONS;

const MB: u64 = 1 << 20;
const P: u64 = SLOT_ALIGN;

fn fill(store: &mut Store, client: ClientId, key: &str, len: u64) -> LeaseGrant {
    let GetOutcome::Miss(ticket) = store.get(client, key).unwrap() else {
        panic!("expected a miss for {key}");
    };
    store.reserve(client, ticket, len).unwrap();
    store.commit(client, ticket).unwrap()
}

/// Fills `key` and releases the filler's lease at once.
fn fill_released(store: &mut Store, client: ClientId, key: &str, len: u64) -> u64 {
    let grant = fill(store, client, key, len);
    store.release(client, grant.lease).unwrap();
    grant.offset
}

/// What a refused request must leave as it was.
fn shape(store: &Store) -> (u64, usize, u64, u64, usize, usize) {
    let s = store.stats(0);
    (
        s.bytes_carved,
        s.records,
        s.bytes_used,
        s.free_bytes,
        s.free_extents,
        s.fills_in_flight,
    )
}

#[test]
fn miss_fill_then_hit() {
    let mut store = Store::on_heap(1, 4 * MB, None);
    let c = store.connect("a".into(), 1).unwrap().0;
    let grant = fill(&mut store, c, "k", 1000);
    assert_eq!(grant.len, 1000);
    store.release(c, grant.lease).unwrap();
    let GetOutcome::Hit(hit) = store.get(c, "k").unwrap() else {
        panic!("expected a hit");
    };
    assert_eq!(hit.offset, grant.offset);
    let s = store.stats(0);
    assert_eq!((s.totals.hits, s.totals.misses, s.totals.fills), (1, 1, 1));
    assert_eq!((s.bytes_used, s.bytes_live, s.bytes_carved), (P, 1000, P));
}

#[test]
fn eviction_takes_the_least_recently_used_and_never_a_pinned_record() {
    // Room for exactly 3 records of 1 MiB.
    let mut store = Store::on_heap(1, 3 * MB, None);
    let c = store.connect("a".into(), 1).unwrap().0;
    let pinned = fill(&mut store, c, "pinned", MB);
    let old = fill_released(&mut store, c, "old", MB);
    let newer = fill_released(&mut store, c, "newer", MB);
    // "old" was read since: "newer" is now the least recently used.
    let read = store.peek(c, "old").unwrap().unwrap();
    store.release(c, read.lease).unwrap();
    let fourth = fill(&mut store, c, "fourth", MB);
    assert_eq!(fourth.offset, newer);
    assert!(store.peek(c, "newer").unwrap().is_none());
    assert!(store.peek(c, "pinned").unwrap().is_some());
    // Now everything is pinned: the refusal names the key and changes nothing.
    let o = store.peek(c, "old").unwrap().unwrap();
    assert_eq!(o.offset, old);
    let GetOutcome::Miss(t) = store.get(c, "fifth").unwrap() else {
        panic!("expected a miss");
    };
    let before = shape(&store);
    let err = store.reserve(c, t, MB).unwrap_err();
    let RequestError::StoreFull {
        pinned_bytes, cap, ..
    } = err
    else {
        panic!("expected StoreFull, got {err:?}");
    };
    assert_eq!((pinned_bytes, cap), (3 * MB, 3 * MB));
    assert!(err.to_string().contains("fifth"), "{err}");
    assert_eq!(shape(&store), before, "a refused request changed the store");
    let s = store.stats(0);
    assert_eq!((s.evictions, s.full_refusals), (1, 1));
    assert_eq!(s.pinned_bytes, 3 * MB);
    let _ = pinned;
}

#[test]
fn reads_in_shared_memory_count_for_the_lru() {
    let mut store = Store::on_heap(1, 3 * MB, None);
    let (c, page) = store.connect("a".into(), 1).unwrap();
    fill_released(&mut store, c, "a", MB);
    let b = fill_released(&mut store, c, "b", MB);
    fill_released(&mut store, c, "c", MB);
    // The client reads "a" in shared memory (no message): its page records it.
    let slot_a = store.index.get("a").unwrap();
    store.pin_page(page).record_read(slot_a);
    let d = fill(&mut store, c, "d", MB);
    assert_eq!(d.offset, b, "the read kept \"a\"; \"b\" went");
    assert!(store.peek(c, "a").unwrap().is_some());
}

#[test]
fn three_interleaved_sizes_fit_a_cap_of_a_third_of_the_data() {
    // 7.1, 8.0 and 8.5 MB records scaled down 64 times, largest first seen only
    // once the store is full, two epochs; every record fits and the bytes carved
    // stay within the cap.
    let sizes = [111_601u64, 125_001, 133_249];
    let keys: Vec<(String, u64)> = (0..30)
        .map(|i| {
            let len = if i < 12 { sizes[i % 2] } else { sizes[i % 3] };
            (format!("k{i}"), len)
        })
        .collect();
    let data: u64 = keys.iter().map(|(_, len)| len).sum();
    let mut store = Store::on_heap(1, data / 3, None);
    let c = store.connect("a".into(), 1).unwrap().0;
    let mut seen_full = false;
    for epoch in 0..2 {
        for (key, len) in &keys {
            let grant = match store.get(c, key).unwrap() {
                GetOutcome::Hit(grant) => grant,
                GetOutcome::Miss(t) => {
                    if *len == sizes[2] && epoch == 0 && !seen_full {
                        seen_full = store.stats(0).evictions > 0;
                        assert!(seen_full, "the largest came before the store was full");
                    }
                    store.reserve(c, t, *len).unwrap();
                    store.commit(c, t).unwrap()
                }
                GetOutcome::Wait { .. } => panic!("no other client"),
            };
            assert_eq!(grant.len, *len);
            store.release(c, grant.lease).unwrap();
            store.arena.check();
        }
    }
    let s = store.stats(0);
    assert!(s.bytes_carved <= s.cap_bytes, "{s:?}");
    assert_eq!(s.full_refusals + s.reserve_refusals, 0);
    assert!(
        s.bytes_live as f64 >= 0.8 * s.cap_bytes as f64,
        "live {} of a {} cap",
        s.bytes_live,
        s.cap_bytes
    );
}

#[test]
fn a_larger_record_evicts_as_few_neighbours_as_it_needs() {
    let mut store = Store::on_heap(1, 8 * P, None);
    let c = store.connect("a".into(), 1).unwrap().0;
    for key in ["a", "b", "c", "d"] {
        fill_released(&mut store, c, key, 2 * P);
    }
    // "a" is the oldest; a 3-page record takes it and one neighbour, "b".
    let big = fill_released(&mut store, c, "big", 3 * P);
    assert_eq!(big, 0);
    assert!(store.peek(c, "a").unwrap().is_none());
    assert!(store.peek(c, "b").unwrap().is_none());
    assert!(store.peek(c, "c").unwrap().is_some());
    let s = store.stats(0);
    assert_eq!((s.evictions, s.free_bytes, s.free_extents), (2, P, 1));
    store.arena.check();
}

#[test]
fn memory_is_reserved_as_records_are_carved_and_a_refusal_evicts_or_fails_cleanly() {
    // A cap of 4 MiB, but memory for 2 only.
    let budget = Box::new(reserve::BudgetReserver { budget: 2 * MB });
    let mut store = Store::on_heap_reserving(1, 4 * MB, None, budget);
    let c = store.connect("a".into(), 1).unwrap().0;
    assert_eq!(store.stats(0).reserved_bytes, 0, "nothing before a fill");
    let first = fill_released(&mut store, c, "first", MB);
    let pinned = fill(&mut store, c, "pinned", MB);
    let s = store.stats(0);
    assert_eq!((s.reserved_bytes, s.reserve_refusals), (2 * MB, 0));
    // No memory for a third: the unpinned record's extent is reused.
    let third = fill(&mut store, c, "third", MB);
    assert_eq!(third.offset, first);
    let s = store.stats(0);
    assert_eq!(
        (s.reserved_bytes, s.reserve_refusals, s.evictions),
        (2 * MB, 1, 1)
    );
    // Both pinned, no memory for another: a named error, nothing changed.
    let GetOutcome::Miss(t) = store.get(c, "fourth").unwrap() else {
        panic!("expected a miss");
    };
    let before = shape(&store);
    let err = store.reserve(c, t, 10).unwrap_err();
    let RequestError::OutOfMemory {
        ref key,
        needed,
        available,
        reserved,
        ..
    } = err
    else {
        panic!("expected OutOfMemory, got {err:?}");
    };
    assert_eq!(
        (key.as_str(), needed, available, reserved),
        ("fourth", P, 0, 2 * MB)
    );
    assert!(err.to_string().contains("DATA.CACHE_SIZE_GB"), "{err}");
    assert_eq!(shape(&store), before);
    // The ticket is still held: once a record is released, the fill goes on.
    store.release(c, third.lease).unwrap();
    assert_eq!(store.reserve(c, t, 10).unwrap().0, third.offset);
    let _ = pinned;
}

#[test]
fn concurrent_miss_waits_then_hits() {
    let mut store = Store::on_heap(1, 4 * MB, None);
    let a = store.connect("a".into(), 1).unwrap().0;
    let b = store.connect("b".into(), 2).unwrap().0;
    let GetOutcome::Miss(t) = store.get(a, "k").unwrap() else {
        panic!()
    };
    assert_eq!(store.get(b, "k").unwrap(), GetOutcome::Wait { filler: a });
    assert!(matches!(
        store.get(a, "k"),
        Err(RequestError::AlreadyFilling { .. })
    ));
    store.reserve(a, t, 10).unwrap();
    store.commit(a, t).unwrap();
    assert!(matches!(store.get(b, "k").unwrap(), GetOutcome::Hit(_)));
}

#[test]
fn a_disconnect_abandons_fills_and_its_leases_pin_until_the_client_is_gone() {
    let mut store = Store::on_heap(1, 2 * MB, None);
    let (a, page_a) = store.connect("a".into(), 1).unwrap();
    let b = store.connect("b".into(), 2).unwrap().0;
    fill(&mut store, a, "held", MB);
    let GetOutcome::Miss(t) = store.get(a, "half").unwrap() else {
        panic!()
    };
    store.reserve(a, t, MB).unwrap();
    assert_eq!(store.disconnect(a), 1);
    let s = store.stats(0);
    assert_eq!((s.fills_in_flight, s.totals.fills_abandoned), (0, 1));
    // The server dropped a, but its client may still read "held" and write "half":
    // "held" stays pinned, "half"'s extent taken, and a's page is not given to a
    // new connection.
    assert_eq!((s.pinned_bytes, s.filling_bytes), (MB, MB));
    assert_eq!(s.retired_connections, 1);
    let (c, page_c) = store.connect("c".into(), 3).unwrap();
    assert_ne!(page_c, page_a);
    let GetOutcome::Miss(t) = store.get(b, "x").unwrap() else {
        panic!()
    };
    assert!(matches!(
        store.reserve(b, t, MB),
        Err(RequestError::StoreFull { .. })
    ));
    // a's client is gone for good: its lease goes, its extent is free again.
    assert!(store.forget(a));
    let s = store.stats(0);
    assert_eq!((s.pinned_bytes, s.filling_bytes), (0, 0));
    store.reserve(b, t, MB).unwrap();
    store.commit(b, t).unwrap();
    let GetOutcome::Miss(t) = store.get(b, "y").unwrap() else {
        panic!()
    };
    store.reserve(b, t, MB).unwrap();
    assert!(store.peek(c, "held").unwrap().is_none(), "evicted for y");
}

/// A client the server dropped (an undecodable frame) still holds its writable map
/// of the extent it was filling: that extent must not go to another fill (whose
/// record the dropped client would overwrite) until the client is gone.
#[test]
fn a_dropped_fillers_extent_is_not_handed_out_until_it_is_gone() {
    let mut store = Store::on_heap(1, 2 * MB, None);
    let a = store.connect("a".into(), 1).unwrap().0;
    let b = store.connect("b".into(), 2).unwrap().0;
    let GetOutcome::Miss(t) = store.get(a, "k").unwrap() else {
        panic!()
    };
    let (a_writes_at, _) = store.reserve(a, t, MB).unwrap();
    store.disconnect(a);
    // b takes the key over at once, in another extent.
    let b_at = fill_released(&mut store, b, "k", MB);
    assert_ne!(b_at, a_writes_at);
    // Under pressure the store evicts "k" rather than hand a's extent out.
    let x_at = fill_released(&mut store, b, "x", MB);
    assert_ne!(x_at, a_writes_at);
    assert!(store.peek(b, "k").unwrap().is_none(), "k made room for x");
    store.forget(a);
    assert_eq!(fill_released(&mut store, b, "y", MB), a_writes_at);
}

#[test]
fn a_stale_release_never_unpins_a_later_lease() {
    let mut store = Store::on_heap(1, 2 * MB, None);
    let (c, page) = store.connect("a".into(), 1).unwrap();
    let first = fill(&mut store, c, "k", MB);
    // Released through the protocol, then again by the lease's own drop (a swap in
    // the client's page) after a second lease took the same entry.
    store.release(c, first.lease).unwrap();
    let second = store.peek(c, "k").unwrap().unwrap();
    assert_eq!(
        LeaseWord(second.lease).entry(),
        LeaseWord(first.lease).entry()
    );
    assert!(!store.pin_page(page).release(LeaseWord(first.lease)));
    assert_eq!(
        store.release(c, first.lease),
        Err(RequestError::LeaseNotHeld { lease: first.lease })
    );
    assert!(matches!(
        store.invalidate("k"),
        Err(RequestError::Pinned { pins: 1, .. })
    ));
    store.release(c, second.lease).unwrap();
    store.invalidate("k").unwrap();
}

#[test]
fn bad_requests_and_extreme_values_from_a_peer_are_errors() {
    let mut store = Store::on_heap(1, 2 * MB, None);
    let a = store.connect("a".into(), 1).unwrap().0;
    let b = store.connect("b".into(), 2).unwrap().0;
    let grant = fill(&mut store, a, "k", 100);
    store.release(a, grant.lease).unwrap();
    assert_eq!(
        store.release(a, grant.lease),
        Err(RequestError::LeaseNotHeld { lease: grant.lease })
    );
    let g2 = store.peek(a, "k").unwrap().unwrap();
    assert!(store.release(b, g2.lease).is_err(), "b released a's lease");
    for lease in [0, u64::MAX, 1 << 63, 5] {
        assert_eq!(
            store.release(a, lease),
            Err(RequestError::LeaseNotHeld { lease })
        );
    }
    assert!(matches!(
        store.commit(a, 999),
        Err(RequestError::TicketNotHeld { ticket: 999 })
    ));
    let GetOutcome::Miss(t) = store.get(a, "big").unwrap() else {
        panic!()
    };
    assert!(matches!(
        store.commit(a, t),
        Err(RequestError::TicketState { .. })
    ));
    let before = shape(&store);
    for len in [2 * MB + 1, u64::MAX, u64::MAX - 100] {
        let err = store.reserve(a, t, len).unwrap_err();
        assert_eq!(
            err,
            RequestError::RecordTooLarge {
                key: "big".into(),
                len,
                cap: 2 * MB
            }
        );
    }
    assert_eq!(shape(&store), before);
    assert!(matches!(
        store.reserve(a, t, 0),
        Err(RequestError::EmptyRecord { .. })
    ));
    assert!(matches!(
        store.invalidate("nope"),
        Err(RequestError::UnknownKey { .. })
    ));
    assert!(matches!(
        store.invalidate("k"),
        Err(RequestError::Pinned { pins: 1, .. })
    ));
}

#[test]
fn descriptors_run_out_before_bytes_and_eviction_frees_one() {
    // 64 KiB records give 4 descriptors for 256 KiB; smaller records run out of
    // descriptors first.
    let mut store = Store::on_heap(1, 256 << 10, Some(64 << 10));
    let c = store.connect("a".into(), 1).unwrap().0;
    let first = fill_released(&mut store, c, "k0", 100);
    for i in 1..4 {
        fill_released(&mut store, c, &format!("k{i}"), 100);
    }
    assert_eq!(store.stats(0).slot_entries, 4);
    fill_released(&mut store, c, "k4", 100);
    let s = store.stats(0);
    assert_eq!((s.records, s.evictions), (4, 1));
    assert!(store.peek(c, "k0").unwrap().is_none());
    assert_eq!(
        store.index.get("k4").and_then(|s| store.arena.extent_of(s)),
        Some((first, P))
    );
}

#[test]
fn connections_beyond_the_pin_pages_are_refused_until_one_is_forgotten() {
    let mut store = Store::on_heap(1, MB, None);
    // A store on the heap has the fewest pages a server has.
    let ids: Vec<ClientId> = (0..MIN_CONNECTIONS)
        .map(|i| store.connect(format!("c{i}"), 1).unwrap().0)
        .collect();
    let err = store.connect("one too many".into(), 1).unwrap_err();
    assert_eq!(
        err,
        RequestError::TooManyConnections {
            max: MIN_CONNECTIONS
        }
    );
    assert!(err.to_string().contains("512"), "{err}");
    store.disconnect(ids[7]);
    assert!(store.connect("late".into(), 1).is_err());
    store.forget(ids[7]);
    let (_, page) = store.connect("late".into(), 1).unwrap();
    assert!(page < MIN_CONNECTIONS);
}

#[test]
fn a_connection_holds_at_most_its_pages_leases() {
    let mut store = Store::on_heap(1, MB, None);
    let c = store.connect("a".into(), 1).unwrap().0;
    fill(&mut store, c, "k", 10);
    for _ in 1..LEASES_PER_CONNECTION {
        store.peek(c, "k").unwrap().unwrap();
    }
    assert_eq!(
        store.peek(c, "k"),
        Err(RequestError::TooManyLeases {
            max: LEASES_PER_CONNECTION
        })
    );
    let GetOutcome::Miss(t) = store.get(c, "other").unwrap() else {
        panic!()
    };
    // No room for the lease the commit would give: refused before any byte is
    // filled, the fill left for the client to abort.
    assert_eq!(
        store.reserve(c, t, 10),
        Err(RequestError::TooManyLeases {
            max: LEASES_PER_CONNECTION
        })
    );
    assert!(store.is_filling("other"));
    store.abort(c, t).unwrap();
}

/// The client pins hits in its own page, so its page may fill up between a reserve
/// and the commit: the refused commit ends the fill, and the next reader of the
/// key fills it instead of waiting for the whole fill timeout.
#[test]
fn a_commit_refused_for_its_lease_ends_the_fill() {
    let mut store = Store::on_heap(1, MB, None);
    let (c, page) = store.connect("a".into(), 1).unwrap();
    let other = store.connect("b".into(), 2).unwrap().0;
    fill_released(&mut store, c, "k", 10);
    let slot = store.index.get("k").unwrap();
    let GetOutcome::Miss(t) = store.get(c, "late").unwrap() else {
        panic!()
    };
    store.reserve(c, t, 10).unwrap();
    for _ in 0..LEASES_PER_CONNECTION {
        store.pin_page(page).take(slot).unwrap();
    }
    let before = store.stats(0).filling_bytes;
    assert!(matches!(
        store.commit(c, t),
        Err(RequestError::TooManyLeases { .. })
    ));
    assert!(
        !store.is_filling("late"),
        "the refused fill is still in flight"
    );
    assert!(matches!(store.get(other, "late"), Ok(GetOutcome::Miss(_))));
    let s = store.stats(0);
    assert_eq!(
        (before, s.filling_bytes, s.totals.fills_abandoned),
        (P, 0, 1)
    );
}
