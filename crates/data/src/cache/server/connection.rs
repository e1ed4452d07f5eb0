//! One connection's life on its own thread: the handshake (the client's hello, a
//! one-shot channel named to it, the hello message with its label, the welcome
//! and the store's memfd), the request loop, and the clean-up (its fills abandoned
//! at once, its leases and pin page only once its rendezvous socket closes); and
//! the answer to a connection that is refused or finds the server busy.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::Duration;

use ipc_channel::ipc::{IpcOneShotServer, IpcReceiver, IpcSender};
use ipc_channel::IpcError;
use tracing::{debug, info, warn};

use super::super::admission::{self, HandshakeSlot};
use super::super::announcement;
use super::super::fdpass;
use super::super::handshake_dir;
use super::super::protocol::{ClientId, Reply, Request, RequestError, Welcome};
use super::super::rendezvous::{self, write_frame, Greeting};
use super::super::store::ClientLabel;
use super::requests::handle;
use super::{request_shutdown, Shared};

/// Writes one greeting without waiting (the socket's buffer takes it, or the peer
/// is not reading and loses it), then closes.
pub(super) fn answer_and_close(mut stream: UnixStream, greeting: &Greeting) {
    if stream.set_nonblocking(true).is_ok() {
        let _ = write_frame(&mut stream, &greeting.encode());
    }
}

/// The rendezvous part of a handshake: the client's hello byte, a one-shot channel
/// named to it, its acknowledgement, and the first message on the channel (the
/// one-shot socket's files are removed then).
fn open_channel(
    shared: &Shared,
    stream: &mut UnixStream,
) -> Result<(IpcReceiver<Request>, Request), String> {
    let timeout = shared.config.handshake_timeout;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    let mut hello = [0u8; 1];
    stream
        .read_exact(&mut hello)
        .map_err(|e| format!("client said no hello: {e}"))?;
    if hello[0] != rendezvous::HELLO {
        return Err(format!("client said {:#x}, not hello", hello[0]));
    }
    let (oneshot, name) =
        IpcOneShotServer::<Request>::new().map_err(|e| format!("one-shot server: {e}"))?;
    let dir = &shared.handshake_dir;
    // The one-shot socket goes as soon as the client is connected, or failed to.
    let mut handshake_files = handshake_dir::OneshotFiles::new(&name, dir);
    if shared.gate.admits_others(nix::unistd::geteuid().as_raw()) {
        handshake_dir::open_oneshot_to_others(&name, dir).map_err(|e| e.to_string())?;
    }
    let greeting = Greeting::Channel(name.clone()).encode();
    write_frame(stream, &greeting).map_err(|e| format!("sending channel name: {e}"))?;
    let mut ack = [0u8; 1];
    stream
        .read_exact(&mut ack)
        .map_err(|e| format!("client did not finish the handshake: {e}"))?;
    let accepted = accept_within(oneshot, &name, timeout);
    handshake_files.remove();
    accepted
}

/// Accepts the client's connection to the one-shot channel `name` within
/// `timeout`. The channel's accept has no timeout, and a client that acknowledged
/// without connecting would hold its handshake slot for good: when the time is up,
/// a watchdog connects itself, so the accept returns with a message that is not the
/// client's hello, and the handshake fails.
fn accept_within(
    oneshot: IpcOneShotServer<Request>,
    name: &str,
    timeout: Duration,
) -> Result<(IpcReceiver<Request>, Request), String> {
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let wake_name = name.to_string();
    let watchdog = std::thread::Builder::new()
        .name("cache-accept-watch".into())
        .spawn(move || {
            if wait.recv_timeout(timeout) != Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
                return false;
            }
            match IpcSender::<Request>::connect(wake_name) {
                Ok(wake) => wake.send(Request::Stats).is_ok(),
                Err(_) => false,
            }
        })
        .map_err(|e| format!("cannot start the accept watchdog: {e}"))?;
    let accepted = oneshot.accept();
    let _ = done.send(());
    let woken = watchdog.join().unwrap_or(false);
    match accepted {
        Ok((_, Request::Stats)) if woken => Err(format!(
            "the client acknowledged the channel but did not connect to it within {} s",
            timeout.as_secs_f64()
        )),
        Ok(pair) => Ok(pair),
        Err(e) => Err(format!("accept: {e:?}")),
    }
}

/// Handshake: after the client's hello byte, a fresh one-shot ipc server, its name
/// sent over the rendezvous socket; the client connects, sends Hello, then
/// acknowledges here, and the one-shot socket's directory is removed at once.
fn handshake(
    shared: &Shared,
    stream: &mut UnixStream,
) -> Result<(IpcReceiver<Request>, IpcSender<Reply>, ClientId), String> {
    let uid = admission::peer_of(stream)
        .map_err(|e| format!("reading the client's credentials: {e}"))?
        .uid;
    let (requests, hello) = open_channel(shared, stream)?;
    let Request::Hello {
        name,
        job,
        pid,
        mapped_store,
        reply,
    } = hello
    else {
        return Err(format!("first message was {}, not hello", hello.kind()));
    };
    let connected = shared.store().and_then(|mut store| {
        store.connect_as(ClientLabel {
            name: name.clone(),
            job,
            pid,
            uid,
        })
    });
    let (client, pin_page) = match connected {
        Ok(parts) => parts,
        Err(error) => {
            let message = format!("client {name:?} (pid {pid}) refused: {error}");
            let _ = reply.send(Reply::Error(error));
            return Err(message);
        }
    };
    let store_fd_follows = mapped_store != Some(shared.store_id);
    let welcome = Reply::Welcome(Welcome {
        client,
        store_id: shared.store_id,
        store_len: shared.segment.len(),
        arena_bytes: shared.config.cap_bytes,
        pin_page: pin_page as u32,
        fill_wait_ms: u64::try_from(shared.config.fill_wait_timeout.as_millis())
            .unwrap_or(u64::MAX),
        store_fd_follows,
    });
    let sent = reply.send(welcome).map_err(|e| format!("welcome: {e:?}"));
    let sent = sent.and_then(|()| match store_fd_follows {
        true => fdpass::send_fd(stream, shared.segment.fd())
            .map_err(|e| format!("sending the store's memfd: {e}")),
        false => Ok(()),
    });
    if let Err(message) = sent {
        if let Ok(mut store) = shared.store() {
            store.disconnect(client);
            store.forget(client);
        }
        return Err(message);
    }
    debug!(client, %name, pid, "client connected");
    Ok((requests, reply, client))
}

pub(super) fn serve_connection(shared: &Shared, mut stream: UnixStream, slot: HandshakeSlot) {
    if shared.shutdown.load(Ordering::SeqCst) {
        return;
    }
    let handshake = handshake(shared, &mut stream);
    drop(slot);
    let (requests, reply, client) = match handshake {
        Ok(parts) => parts,
        Err(message) => {
            if !shared.shutdown.load(Ordering::SeqCst) {
                warn!("handshake failed: {message}");
            }
            return;
        }
    };
    let budget = shared.config.read_order_budget;
    loop {
        let request = match announcement::decoding_at_most(budget, || requests.recv()) {
            Ok(request) => request,
            Err(IpcError::Disconnected) => break,
            Err(e) => match announcement::take_refusal() {
                // A read order refused while it was decoded: the frame was whole,
                // so the connection goes on with the refusal as the answer.
                Some(problem) => {
                    warn!(client, "read order refused while decoded: {problem}");
                    let refused = Reply::Error(RequestError::BadReadOrder { problem });
                    if reply.send(refused).is_err() {
                        break;
                    }
                    continue;
                }
                None => {
                    warn!(client, "bad message, closing the connection: {e:?}");
                    break;
                }
            },
        };
        let shutdown = matches!(request, Request::Shutdown);
        let answer = handle(shared, client, request);
        if reply.send(answer).is_err() {
            break;
        }
        if shutdown {
            info!(client, "shutdown requested");
            request_shutdown(shared);
        }
    }
    // The client's requests go nowhere from now on (it sees the server gone).
    drop((requests, reply));
    let Ok(mut store) = shared.store() else {
        debug!(client, "client gone; no clean-up in a poisoned store");
        return;
    };
    let abandoned = store.disconnect(client);
    drop(store);
    if abandoned > 0 {
        shared.fill_done.notify_all();
        info!(
            client,
            abandoned, "connection ended; its fills were abandoned"
        );
    } else {
        debug!(client, "connection ended");
    }
    wait_until_closed(&mut stream);
    if let Ok(mut store) = shared.store() {
        store.forget(client);
        debug!(client, "client gone; its leases are released");
    }
}

/// Waits until the client closes its end of the rendezvous socket (it holds it for
/// its connection's whole life): its leases may pin until then.
fn wait_until_closed(stream: &mut UnixStream) {
    if stream.set_read_timeout(None).is_err() {
        return;
    }
    let mut buf = [0u8; 64];
    while matches!(stream.read(&mut buf), Ok(n) if n > 0) {}
}
