//! The cache protocol's frames as the server and clients decode them (ipc-channel's
//! postcard messages): random bytes, and valid frames of every request and reply cut
//! or with bytes changed, decode to a message or to an error; never a panic, and
//! never an allocation sized by a length field the frame does not back. And the
//! decoded requests with any values a peer can put in them (lengths, tickets, lease
//! ids up to `u64::MAX`, nonsense written into its own pin page) get a reply or an
//! error naming the value, never a panic of the store, whose sizes stay in bounds.

use ipc_channel::ipc::IpcMessage;
use proptest::prelude::*;

use vrtspike::cache::protocol::{
    LeaseGrant, ReadOrderAnnouncement, Reply, Request, RequestError, Welcome,
};
use vrtspike::cache::store::{GetOutcome, Store};

use super::{accepted, bounded_by_input, check, largest_allocation, mutated, names};

/// Valid frames of every request and reply that carries no OS handle.
fn valid_frames() -> Vec<Vec<u8>> {
    let grant = LeaseGrant {
        lease: 7,
        offset: 1 << 40,
        len: 123_456,
    };
    let key = "train/GOPR0372_07_00/000042".to_string();
    let requests = [
        Request::Get { key: key.clone() },
        Request::Peek { key: key.clone() },
        Request::Reserve {
            ticket: 3,
            len: u64::MAX,
        },
        Request::Commit { ticket: 3 },
        Request::Abort { ticket: 3 },
        Request::Release { lease: 9 },
        Request::Invalidate { key: key.clone() },
        Request::Stats,
        Request::Shutdown,
        Request::ReadOrder(ReadOrderAnnouncement {
            first_step: 40,
            keys: vec![key.clone(), "b".into()],
            steps: vec![vec![0, 1], vec![], vec![1]],
            readers: vec![3, 4],
        }),
        Request::Prefetch {
            key: key.clone(),
            len: 123,
        },
    ];
    let replies = [
        Reply::Hit(grant),
        Reply::HitAfterWait(grant),
        Reply::Miss { ticket: 4 },
        Reply::Reserved {
            ticket: 4,
            offset: 4096,
            len: 10,
        },
        Reply::Committed(grant),
        Reply::NotCached,
        Reply::Done,
        Reply::Declined,
        Reply::Welcome(Welcome {
            client: 1,
            store_id: 2,
            store_len: 3,
            arena_bytes: 4,
            pin_page: 5,
            fill_wait_ms: 120_000,
            store_fd_follows: true,
        }),
        Reply::Error(RequestError::StoreFull {
            key: key.clone(),
            len: 1,
            pinned_bytes: 2,
            filling_bytes: 3,
            cap: 4,
        }),
        Reply::Error(RequestError::TooManyLeases { max: 64 }),
        Reply::Error(RequestError::Protocol("out of order".into())),
    ];
    let mut frames: Vec<Vec<u8>> = requests
        .iter()
        .map(|r| postcard::to_stdvec(r).unwrap())
        .collect();
    frames.extend(replies.iter().map(|r| postcard::to_stdvec(r).unwrap()));
    // A Hello as a client sends it, minus the reply channel the OS message carries
    // beside the bytes (variant 0, name, pid, mapped store, channel index 0).
    let mut hello = vec![0u8];
    hello.extend(postcard::to_stdvec(&("rank0/worker3", 4242u32, Some(9u64), 0usize)).unwrap());
    frames.push(hello);
    frames
}

/// Decodes `bytes` as the server (a request) and as a client (a reply) would.
fn decode_both(bytes: &[u8]) -> Result<(), TestCaseError> {
    let (request, largest) = largest_allocation(|| {
        IpcMessage::from_data(bytes.to_vec())
            .to::<Request>()
            .is_ok()
    });
    bounded_by_input(largest, bytes.len(), 2)?;
    let (reply, largest) =
        largest_allocation(|| IpcMessage::from_data(bytes.to_vec()).to::<Reply>().is_ok());
    bounded_by_input(largest, bytes.len(), 2)?;
    if request || reply {
        accepted();
    }
    Ok(())
}

#[test]
fn random_frames_decode_or_fail_without_panic() {
    check(
        "protocol random",
        10_000,
        prop::collection::vec(any::<u8>(), 0..64),
        |bytes| decode_both(&bytes),
    );
}

#[test]
fn cut_and_changed_frames_decode_or_fail_without_panic() {
    let frames = prop::sample::select(valid_frames()).prop_flat_map(mutated);
    check("protocol mutations", 10_000, frames, |bytes| {
        decode_both(&bytes)
    });
}

/// One request of a peer, with any values.
#[derive(Debug, Clone)]
enum Op {
    Get(u8),
    Peek(u8),
    /// A ticket the peer holds (by index) or any number; any length.
    Reserve(Option<u8>, u64, u64),
    Commit(Option<u8>, u64),
    Abort(Option<u8>, u64),
    /// A lease the peer holds (by index) or any number.
    Release(Option<u8>, u64),
    Invalidate(u8),
    /// The peer writes a nonsense read into its own pin page.
    RecordRead(u64),
    /// A read order with any first step, key indices (some past its list) and readers.
    ReadOrder(u64, Vec<Vec<u8>>, Vec<u64>),
    /// The peer writes any progress into its own pin page.
    Progress(u64),
    Prefetch(u8, u64),
    Disconnect,
}

fn any_len() -> impl Strategy<Value = u64> {
    prop_oneof![1u64..300_000, Just(0), Just(u64::MAX), any::<u64>()]
}

fn op() -> impl Strategy<Value = Op> {
    let held = proptest::option::of(any::<u8>());
    prop_oneof![
        (0u8..6).prop_map(Op::Get),
        (0u8..6).prop_map(Op::Peek),
        (held.clone(), any::<u64>(), any_len()).prop_map(|(h, t, l)| Op::Reserve(h, t, l)),
        (held.clone(), any::<u64>()).prop_map(|(h, t)| Op::Commit(h, t)),
        (held.clone(), any::<u64>()).prop_map(|(h, t)| Op::Abort(h, t)),
        (held, any::<u64>()).prop_map(|(h, l)| Op::Release(h, l)),
        (0u8..6).prop_map(Op::Invalidate),
        any::<u64>().prop_map(Op::RecordRead),
        (
            any::<u64>(),
            prop::collection::vec(prop::collection::vec(0u8..8, 0..4), 0..8),
            prop::collection::vec(any::<u64>(), 0..3),
        )
            .prop_map(|(first, steps, readers)| Op::ReadOrder(first, steps, readers)),
        any::<u64>().prop_map(Op::Progress),
        ((0u8..6), any_len()).prop_map(|(k, len)| Op::Prefetch(k, len)),
        Just(Op::Disconnect),
    ]
}

/// A peer's state: its connection, the tickets and leases it was given.
struct Peer {
    client: u64,
    page: usize,
    tickets: Vec<u64>,
    leases: Vec<u64>,
}

fn pick(held: &[u64], index: Option<u8>, any: u64) -> u64 {
    match index {
        Some(i) if !held.is_empty() => held[i as usize % held.len()],
        _ => any,
    }
}

/// Applies `op`; a refusal must name the value it refuses.
fn apply(store: &mut Store, peer: &mut Peer, op: &Op) -> Result<(), TestCaseError> {
    let key = |k: &u8| format!("seq/{k:06}");
    // A connection out of leases is refused by its limit, whatever the request.
    let refused = |e: RequestError, needle: String| match e {
        RequestError::TooManyLeases { max } => names(&e.to_string(), &max.to_string()),
        e => names(&e.to_string(), &needle),
    };
    match op {
        Op::Get(k) => match store.get(peer.client, &key(k)) {
            Ok(GetOutcome::Hit(grant)) => peer.leases.push(grant.lease),
            Ok(GetOutcome::Miss(ticket)) => peer.tickets.push(ticket),
            Ok(GetOutcome::Wait { .. }) => {}
            Err(e) => refused(e, key(k))?,
        },
        Op::Peek(k) => match store.peek(peer.client, &key(k)) {
            Ok(Some(grant)) => peer.leases.push(grant.lease),
            Ok(None) => {}
            Err(e) => refused(e, key(k))?,
        },
        Op::Reserve(h, t, len) => {
            let ticket = pick(&peer.tickets, *h, *t);
            if let Err(e) = store.reserve(peer.client, ticket, *len) {
                let needle = match e {
                    RequestError::TicketNotHeld { .. } => ticket.to_string(),
                    _ => "seq/".into(),
                };
                refused(e, needle)?;
            }
        }
        Op::Commit(h, t) => {
            let ticket = pick(&peer.tickets, *h, *t);
            match store.commit(peer.client, ticket) {
                Ok(grant) => peer.leases.push(grant.lease),
                Err(RequestError::TicketNotHeld { ticket: named }) => {
                    names(&named.to_string(), &ticket.to_string())?
                }
                Err(e) => refused(e, "seq/".into())?,
            }
        }
        Op::Abort(h, t) => {
            let ticket = pick(&peer.tickets, *h, *t);
            if let Err(e) = store.abort(peer.client, ticket) {
                refused(e, ticket.to_string())?;
            }
        }
        Op::Release(h, l) => {
            let lease = pick(&peer.leases, *h, *l);
            if let Err(e) = store.release(peer.client, lease) {
                refused(e, lease.to_string())?;
            }
        }
        Op::Invalidate(k) => {
            if let Err(e) = store.invalidate(&key(k)) {
                refused(e, key(k))?;
            }
        }
        Op::RecordRead(slot) => store.pin_page(peer.page).record_read(*slot as usize),
        Op::ReadOrder(first_step, steps, readers) => {
            // Six keys listed; indices 6 and 7 name none.
            let order = ReadOrderAnnouncement {
                first_step: *first_step,
                keys: (0u8..6).map(|k| key(&k)).collect(),
                steps: steps
                    .iter()
                    .map(|s| s.iter().map(|&k| u32::from(k)).collect())
                    .collect(),
                readers: readers.clone(),
            };
            if let Err(e) = store.announce_read_order(peer.client, order) {
                refused(e, "names key".into())?;
            }
        }
        Op::Progress(step) => store.pin_page(peer.page).set_progress(*step),
        Op::Prefetch(k, len) => {
            use vrtspike::cache::store::PrefetchOutcome;
            match store.prefetch(peer.client, &key(k), *len) {
                Ok(PrefetchOutcome::Reserved { ticket, .. }) => peer.tickets.push(ticket),
                Ok(_) => {}
                Err(e) => refused(e, key(k))?,
            }
        }
        Op::Disconnect => {
            store.disconnect(peer.client);
            store.forget(peer.client);
            let (client, page) = store
                .connect("again".into(), 2)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            *peer = Peer {
                client,
                page,
                tickets: Vec::new(),
                leases: Vec::new(),
            };
        }
    }
    Ok(())
}

#[test]
fn requests_with_any_values_are_answered_or_refused_by_name_never_a_panic() {
    let ops = prop::collection::vec(op(), 1..40);
    check("store requests", 2_000, ops, |ops| {
        let mut store = Store::on_heap(1, 1 << 20, None);
        let (client, page) = store.connect("peer".into(), 1).unwrap();
        let mut peer = Peer {
            client,
            page,
            tickets: Vec::new(),
            leases: Vec::new(),
        };
        for op in &ops {
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                apply(&mut store, &mut peer, op)
            }));
            match outcome {
                Ok(result) => result?,
                Err(_) => return Err(TestCaseError::fail(format!("{op:?} panicked"))),
            }
            let s = store.stats(0);
            if s.bytes_used > s.bytes_carved || s.bytes_carved > s.cap_bytes {
                return Err(TestCaseError::fail(format!(
                    "sizes out of bounds after {op:?}: {s:?}"
                )));
            }
        }
        accepted();
        Ok(())
    });
}
