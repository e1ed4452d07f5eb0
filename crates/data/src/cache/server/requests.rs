//! The server's answer to each request of a connection: served on the locked store
//! (a get waits, single flight, for another client's fill of its key), a refusal
//! logged and counted, and a panic caught: it poisons the store, and every request
//! from then on is refused naming it.

use std::any::Any;
use std::panic::{self, AssertUnwindSafe};
use std::time::Instant;

use tracing::warn;

use super::super::protocol::{ClientId, Reply, Request, RequestError};
use super::super::store::{GetOutcome, PrefetchOutcome, Store};
use super::Shared;

pub(super) fn handle(shared: &Shared, client: ClientId, request: Request) -> Reply {
    let kind = request.kind();
    let result = guarded(shared, client, kind, || serve(shared, client, request));
    result.unwrap_or_else(|error| {
        warn!(client, request = kind, "refused: {error}");
        if let Ok(mut store) = shared.store() {
            store.count_error(client);
        }
        Reply::Error(error)
    })
}

/// Runs `serve` (one `kind` request of `client`); a panic in it poisons the store.
fn guarded(
    shared: &Shared,
    client: ClientId,
    kind: &str,
    serve: impl FnOnce() -> Result<Reply, RequestError>,
) -> Result<Reply, RequestError> {
    panic::catch_unwind(AssertUnwindSafe(serve)).unwrap_or_else(|panic| {
        let message = panic_message(panic.as_ref());
        Err(shared.poison(format!(
            "the {kind} request of client {client} panicked: {message}"
        )))
    })
}

/// The message a panic was raised with.
fn panic_message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic with no message")
}

fn serve(shared: &Shared, client: ClientId, request: Request) -> Result<Reply, RequestError> {
    shared.store()?.count_request(client);
    match request {
        Request::Get { key } => get_or_wait(shared, client, &key),
        Request::Peek { key } => shared
            .store()?
            .peek(client, &key)
            .map(|g| g.map_or(Reply::NotCached, Reply::Hit)),
        Request::Reserve { ticket, len } => match shared.store()?.reserve(client, ticket, len) {
            Ok((offset, len)) => Ok(Reply::Reserved {
                ticket,
                offset,
                len,
            }),
            // The planned policy's choice, not a failure: not logged or counted.
            Err(RequestError::Declined { .. }) => Ok(Reply::Declined),
            Err(error) => Err(error),
        },
        Request::ReadOrder(order) => shared
            .store()?
            .announce_read_order(client, order)
            .map(|()| Reply::Done),
        Request::Prefetch { key, len } => {
            let outcome = shared.store()?.prefetch(client, &key, len)?;
            Ok(match outcome {
                PrefetchOutcome::Present => Reply::Done,
                PrefetchOutcome::Declined => Reply::Declined,
                PrefetchOutcome::Reserved {
                    ticket,
                    offset,
                    len,
                } => Reply::Reserved {
                    ticket,
                    offset,
                    len,
                },
            })
        }
        Request::Commit { ticket } => {
            let grant = shared.store()?.commit(client, ticket);
            shared.fill_done.notify_all();
            grant.map(Reply::Committed)
        }
        Request::Abort { ticket } => {
            let done = shared.store()?.abort(client, ticket);
            shared.fill_done.notify_all();
            done.map(|()| Reply::Done)
        }
        Request::Release { lease } => shared.store()?.release(client, lease).map(|()| Reply::Done),
        Request::Invalidate { key } => shared.store()?.invalidate(&key).map(|()| Reply::Done),
        Request::Stats => Ok(Reply::Stats(Box::new(shared.store()?.stats(shared.pid)))),
        Request::Shutdown => Ok(Reply::Done),
        Request::Hello { .. } => Err(RequestError::Protocol(
            "hello after the handshake".to_string(),
        )),
    }
}

/// A get that waits (single flight) while another client fills the key.
fn get_or_wait(shared: &Shared, client: ClientId, key: &str) -> Result<Reply, RequestError> {
    let started = Instant::now();
    let timeout = shared.config.fill_wait_timeout;
    let mut store = shared.store()?;
    let mut waited = false;
    loop {
        match store.get(client, key)? {
            GetOutcome::Hit(grant) if waited => return Ok(Reply::HitAfterWait(grant)),
            GetOutcome::Hit(grant) => return Ok(Reply::Hit(grant)),
            GetOutcome::Miss(ticket) => return Ok(Reply::Miss { ticket }),
            GetOutcome::Wait { filler } => {
                waited = true;
                let waited = started.elapsed();
                if waited >= timeout {
                    return Err(RequestError::FillTimedOut {
                        key: key.to_string(),
                        filler,
                        waited_s: waited.as_secs(),
                    });
                }
                let filling =
                    |s: &mut Store| s.is_filling(key) && shared.poisoned_by.get().is_none();
                let (guard, _) = shared
                    .fill_done
                    .wait_timeout_while(store, timeout - waited, filling)
                    .map_err(|_| {
                        shared.poison("a request panicked while holding the store".into())
                    })?;
                shared.check_poison()?;
                store = guard;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Server, ServerConfig};
    use super::*;
    use crate::cache::CacheError;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    /// A bound server, its shared state and a connection to its store.
    fn connected(name: &str) -> (Server, Arc<Shared>, ClientId) {
        let address = format!("vrtspike-test-{name}-{}", std::process::id());
        let server = Server::bind(ServerConfig::new(address, 1 << 20)).unwrap();
        let shared = Arc::clone(&server.shared);
        let client = shared.store().unwrap().connect("t".into(), 1).unwrap().0;
        (server, shared, client)
    }

    fn refused_as_poisoned(reply: Reply) -> String {
        match reply {
            Reply::Error(RequestError::StorePoisoned { cause }) => cause,
            other => panic!("expected a StorePoisoned refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_panic_in_a_request_poisons_the_store_and_stops_the_server() {
        let (server, shared, client) = connected("panic");
        assert!(matches!(
            handle(&shared, client, Request::Stats),
            Reply::Stats(_)
        ));
        let panicked = guarded(&shared, client, "get", || {
            let _store = shared.store()?;
            panic!("bug in the store");
        });
        let Err(RequestError::StorePoisoned { cause }) = panicked else {
            panic!("expected StorePoisoned, got {panicked:?}");
        };
        assert!(cause.contains("get request of client"), "{cause}");
        assert!(cause.contains("bug in the store"), "{cause}");
        assert!(shared.shutdown.load(Ordering::SeqCst));
        let later = refused_as_poisoned(handle(&shared, client, Request::Stats));
        assert_eq!(later, cause, "later requests name the first panic");
        match server.run() {
            Err(CacheError::StorePoisoned { cause: why, .. }) => assert_eq!(why, cause),
            other => panic!("expected the server to stop with StorePoisoned: {other:?}"),
        }
    }

    #[test]
    fn a_store_lock_poisoned_elsewhere_is_refused_too() {
        let (_server, shared, client) = connected("lock");
        let poisoner = std::thread::spawn({
            let shared = Arc::clone(&shared);
            move || {
                let _store = shared.store.lock();
                panic!("poisoning the store lock");
            }
        });
        assert!(poisoner.join().is_err());
        let key = "k".to_string();
        let cause = refused_as_poisoned(handle(&shared, client, Request::Get { key }));
        assert!(cause.contains("holding the store"), "{cause}");
        assert!(shared.shutdown.load(Ordering::SeqCst));
    }
}
