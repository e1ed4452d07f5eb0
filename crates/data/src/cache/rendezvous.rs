//! The first words on the rendezvous socket. The client says hello (one byte) as
//! soon as it connects; the server answers with one frame: the name of the
//! one-shot channel to connect to with the server's protocol version (so a client
//! of another build leaves before it sends a message the server may not decode), a
//! refusal (another user), or "busy" (too many handshakes in flight: try again
//! shortly). Nothing is set up for a connection
//! before its hello. Every frame on the socket is length-prefixed
//! (`write_frame`, `read_frame`).

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};

pub use vrtspike_contract::cache_addr::CACHE_PROTOCOL_VERSION;

use super::CacheError;

/// The byte a client sends first.
pub const HELLO: u8 = b'H';

/// The server's first frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Greeting {
    /// Connect to this one-shot channel, of a server speaking this protocol.
    Channel {
        /// The one-shot channel's name.
        name: String,
        /// The server's [`CACHE_PROTOCOL_VERSION`].
        protocol: u32,
    },
    /// This user is not allowed in.
    Refused,
    /// Too many handshakes in flight; retry.
    Busy,
}

const CHANNEL: &str = "channel ";
/// The protocol version of servers whose greeting names none (builds before
/// versions were in the greeting).
pub const UNVERSIONED_PROTOCOL: u32 = 1;
const REFUSED: &str = "refused";
const BUSY: &str = "busy";

impl Greeting {
    /// The frame's bytes.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Greeting::Channel { name, protocol } => {
                format!("{CHANNEL}p{protocol} {name}").into_bytes()
            }
            Greeting::Refused => REFUSED.as_bytes().to_vec(),
            Greeting::Busy => BUSY.as_bytes().to_vec(),
        }
    }

    /// A frame read back; `None` if it is none of these.
    pub fn decode(frame: &[u8]) -> Option<Greeting> {
        let text = std::str::from_utf8(frame).ok()?;
        if let Some(rest) = text.strip_prefix(CHANNEL) {
            let versioned = rest
                .strip_prefix('p')
                .and_then(|r| r.split_once(' '))
                .and_then(|(v, name)| Some((v.parse::<u32>().ok()?, name)));
            let (protocol, name) = versioned.unwrap_or((UNVERSIONED_PROTOCOL, rest));
            return (!name.is_empty()).then(|| Greeting::Channel {
                name: name.to_string(),
                protocol,
            });
        }
        match text {
            REFUSED => Some(Greeting::Refused),
            BUSY => Some(Greeting::Busy),
            _ => None,
        }
    }
}

/// The abstract socket address of `address`.
pub(crate) fn socket_addr(address: &str) -> Result<SocketAddr, CacheError> {
    SocketAddr::from_abstract_name(address.as_bytes()).map_err(|_| CacheError::BadAddress {
        address: address.to_string(),
    })
}

/// Length-prefixed frame on the rendezvous socket.
pub(crate) fn write_frame(stream: &mut UnixStream, bytes: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(bytes.len())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "frame too long"))?;
    stream.write_all(&len.to_le_bytes())?;
    stream.write_all(bytes)
}

pub(crate) fn read_frame(stream: &mut UnixStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > 4096 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {len} bytes"),
        ));
    }
    let mut buf = vec![0u8; len];
    stream.read_exact(&mut buf)?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greetings_round_trip_and_garbage_is_none() {
        for g in [
            Greeting::Channel {
                name: "/tmp/x/socket".into(),
                protocol: CACHE_PROTOCOL_VERSION,
            },
            Greeting::Channel {
                name: "/tmp/x y".into(),
                protocol: 77,
            },
            Greeting::Refused,
            Greeting::Busy,
        ] {
            assert_eq!(Greeting::decode(&g.encode()), Some(g));
        }
        assert_eq!(Greeting::decode(b"channel "), None);
        assert_eq!(Greeting::decode(b"channel p3 "), None);
        // A server from before versions names its channel alone.
        assert_eq!(
            Greeting::decode(b"channel /tmp/x/socket"),
            Some(Greeting::Channel {
                name: "/tmp/x/socket".into(),
                protocol: UNVERSIONED_PROTOCOL
            })
        );
        assert_eq!(Greeting::decode(b"/tmp/x/socket"), None);
        assert_eq!(Greeting::decode(&[0xff, 0xfe]), None);
    }
}
