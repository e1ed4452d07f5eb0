//! Opening a client connection: the rendezvous on the server's abstract socket
//! (the server's uid checked first, a busy server asked again), the hello and
//! welcome over the one-shot channel, and this process's mapping of the store (the
//! one it has, or the memfd the server passes), checked against the announced sizes.

use std::cell::Cell;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipc_channel::ipc::{self, IpcSender};

use super::super::admission::peer_of;
use super::super::fdpass;
use super::super::protocol::{Reply, Request, RequestError, Welcome};
use super::super::rendezvous::{self, Greeting, CACHE_PROTOCOL_VERSION};
use super::super::rendezvous::{read_frame, socket_addr};
use super::super::shm::{self, Mapping, StoreFd};
use super::super::CacheError;
use super::channel::recv_within;
use super::options::{check_server, ClientOptions};
use super::CacheClient;
use crate::util::is_timeout;

impl CacheClient {
    /// Connects to the server at `address` with the [`ClientOptions::from_env`];
    /// `name` labels this client in stats. A server busy with other handshakes is
    /// asked again for up to 10 s.
    pub fn connect(address: &str, name: &str) -> Result<CacheClient, CacheError> {
        CacheClient::connect_with(address, name, &ClientOptions::from_env()?)
    }

    /// Connects to the server at `address` as `options` say.
    pub fn connect_with(
        address: &str,
        name: &str,
        options: &ClientOptions,
    ) -> Result<CacheClient, CacheError> {
        let started = Instant::now();
        let mut pause = Duration::from_millis(10);
        loop {
            if let Some((stream, oneshot)) = Self::rendezvous(address, options)? {
                return Self::handshake(address, name, stream, oneshot, options);
            }
            if started.elapsed() >= options.handshake_timeout {
                return Err(CacheError::Busy {
                    address: address.to_string(),
                    waited_s: started.elapsed().as_secs(),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    /// Connects, checks the server's credentials before anything else, and says
    /// hello: the socket and the one-shot channel's name, or `None` when the server
    /// is busy.
    fn rendezvous(
        address: &str,
        options: &ClientOptions,
    ) -> Result<Option<(UnixStream, String)>, CacheError> {
        let connect_err = |source| CacheError::Connect {
            address: address.to_string(),
            source,
        };
        let mut stream = UnixStream::connect_addr(&socket_addr(address)?).map_err(connect_err)?;
        let server = peer_of(&stream).map_err(connect_err)?;
        check_server(address, server, &options.trusted_uids)?;
        stream
            .set_read_timeout(Some(options.handshake_timeout))
            .map_err(connect_err)?;
        let uid = nix::unistd::geteuid().as_raw();
        let not_allowed = || CacheError::NotAllowed {
            address: address.to_string(),
            server_uid: server.uid,
            uid,
        };
        // A server of another (trusted) user that closes on us has refused us.
        let refused = |message: String| match server.uid == uid {
            true => CacheError::Handshake {
                address: address.to_string(),
                message,
            },
            false => not_allowed(),
        };
        // A server that refused us may have closed before the hello arrives.
        let said_hello = stream.write_all(&[rendezvous::HELLO]);
        let frame = read_frame(&mut stream);
        let greeting = match (frame, said_hello) {
            (Ok(frame), _) => Greeting::decode(&frame),
            (Err(e), _) if is_timeout(&e) => {
                return Err(CacheError::Handshake {
                    address: address.to_string(),
                    message: format!(
                        "the server sent no greeting within {:.1} s",
                        options.handshake_timeout.as_secs_f64()
                    ),
                })
            }
            (Err(e), Ok(())) | (Err(_), Err(e)) => {
                return Err(refused(format!("the server closed the connection: {e}")))
            }
        };
        match greeting {
            Some(Greeting::Channel { name, protocol }) if protocol == CACHE_PROTOCOL_VERSION => {
                Ok(Some((stream, name)))
            }
            // Dropping the socket unacknowledged ends the server's side of it.
            Some(Greeting::Channel { protocol, .. }) => Err(CacheError::ProtocolVersion {
                address: address.to_string(),
                server: protocol,
                client: CACHE_PROTOCOL_VERSION,
            }),
            Some(Greeting::Busy) => Ok(None),
            Some(Greeting::Refused) => Err(not_allowed()),
            None => Err(refused("the server's greeting made no sense".into())),
        }
    }

    /// The rest of the handshake, over the one-shot channel named `oneshot`.
    fn handshake(
        address: &str,
        name: &str,
        mut stream: UnixStream,
        oneshot: String,
        options: &ClientOptions,
    ) -> Result<CacheClient, CacheError> {
        let handshake_err = |message: String| CacheError::Handshake {
            address: address.to_string(),
            message,
        };
        let mapped_store = shm::mapped_store(address)?;
        let requests = IpcSender::<Request>::connect(oneshot)
            .map_err(|e| handshake_err(format!("connecting the request channel: {e}")))?;
        let (reply_tx, replies) =
            ipc::channel::<Reply>().map_err(|e| handshake_err(format!("reply channel: {e}")))?;
        requests
            .send(Request::Hello {
                protocol: CACHE_PROTOCOL_VERSION,
                name: name.to_string(),
                job: options.job.clone(),
                pid: std::process::id(),
                mapped_store,
                reply: reply_tx,
            })
            .map_err(|e| handshake_err(format!("hello: {e:?}")))?;
        stream
            .write_all(&[1])
            .map_err(|e| handshake_err(e.to_string()))?;
        let welcome = recv_within(&replies, options.handshake_timeout)
            .map_err(|e| handshake_err(format!("no welcome: {e:?}")))?;
        let welcome = match welcome {
            Reply::Error(RequestError::ProtocolVersion { server, client }) => {
                return Err(CacheError::ProtocolVersion {
                    address: address.to_string(),
                    server,
                    client,
                })
            }
            Reply::Error(error @ RequestError::TooManyConnections { .. }) => {
                return Err(CacheError::Refused {
                    request: "hello",
                    error,
                })
            }
            other => welcome_of(other).map_err(handshake_err)?,
        };
        let mapping = map_store(&welcome, address, &stream).map_err(|e| match e {
            MapError::Handshake(message) => handshake_err(message),
            MapError::Cache(e) => e,
        })?;
        let table = mapping.table(welcome.arena_bytes)?;
        let own = mapping.own_page(&table.layout(), welcome.pin_page as usize)?;
        if own.page().owner() != welcome.client {
            return Err(handshake_err(format!(
                "pin page {} is not this connection's",
                welcome.pin_page
            )));
        }
        Ok(CacheClient {
            address: address.to_string(),
            id: welcome.client,
            requests,
            replies,
            mapping,
            table,
            arena_bytes: welcome.arena_bytes,
            own,
            shared_hits: Cell::new(0),
            pending_acks: Cell::new(0),
            broken: Cell::new(false),
            reply_timeout: options.reply_timeout,
            fill_wait: Duration::from_millis(welcome.fill_wait_ms),
            _rendezvous: stream,
        })
    }
}

/// A failure to map the store: of the handshake, or of the cache itself.
enum MapError {
    Handshake(String),
    Cache(CacheError),
}

impl From<CacheError> for MapError {
    fn from(e: CacheError) -> MapError {
        MapError::Cache(e)
    }
}

/// The welcome in `reply`, or why there is none.
fn welcome_of(reply: Reply) -> Result<Welcome, String> {
    match reply {
        Reply::Welcome(welcome) => Ok(welcome),
        Reply::Error(error) => Err(error.to_string()),
        other => Err(format!("expected welcome, got {other:?}")),
    }
}

/// This process's mapping of the store `welcome` names: the one it has, or a new
/// one of the memfd that follows on `stream`; checked against the announced sizes.
fn map_store(
    welcome: &Welcome,
    address: &str,
    stream: &UnixStream,
) -> Result<Arc<Mapping>, MapError> {
    let store = match welcome.store_fd_follows {
        true => Some(StoreFd {
            fd: fdpass::recv_fd(stream)
                .map_err(|e| MapError::Handshake(format!("receiving the store: {e}")))?,
            len: welcome.store_len,
        }),
        false => None,
    };
    let mapping = shm::adopt(address, welcome.store_id, store)?;
    if mapping.len() as u64 != welcome.store_len || welcome.arena_bytes > welcome.store_len {
        return Err(MapError::Handshake(format!(
            "store of {} bytes (arena {}) mapped as {} bytes",
            welcome.store_len,
            welcome.arena_bytes,
            mapping.len()
        )));
    }
    Ok(mapping)
}
