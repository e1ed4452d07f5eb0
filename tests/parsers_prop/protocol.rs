//! The cache protocol's frames as the server and clients decode them (ipc-channel's
//! postcard messages): random bytes, and valid frames of every request and reply cut
//! or with bytes changed, decode to a message or to an error; never a panic, and
//! never an allocation sized by a length field the frame does not back.

use ipc_channel::ipc::IpcMessage;
use proptest::prelude::*;

use vrtspike::cache::protocol::{LeaseGrant, Reply, Request, RequestError};

use super::{accepted, bounded_by_input, check, largest_allocation, mutated};

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
        Reply::Welcome {
            client: 1,
            store_id: 2,
            store_len: 3,
            arena_bytes: 4,
            pin_page: 5,
            fill_wait_ms: 120_000,
            store_fd_follows: true,
        },
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
