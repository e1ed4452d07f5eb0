//! The first words on the rendezvous socket. The client says hello (one byte) as
//! soon as it connects; the server answers with one frame: the name of the
//! one-shot channel to connect to, a refusal (another user), or "busy" (too many
//! handshakes in flight: try again shortly). Nothing is set up for a connection
//! before its hello. Every frame on the socket is length-prefixed
//! (`write_frame`, `read_frame`).

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};

use super::CacheError;

/// The byte a client sends first.
pub const HELLO: u8 = b'H';

/// The server's first frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Greeting {
    /// Connect to this one-shot channel.
    Channel(String),
    /// This user is not allowed in.
    Refused,
    /// Too many handshakes in flight; retry.
    Busy,
}

const CHANNEL: &str = "channel ";
const REFUSED: &str = "refused";
const BUSY: &str = "busy";

impl Greeting {
    /// The frame's bytes.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Greeting::Channel(name) => format!("{CHANNEL}{name}").into_bytes(),
            Greeting::Refused => REFUSED.as_bytes().to_vec(),
            Greeting::Busy => BUSY.as_bytes().to_vec(),
        }
    }

    /// A frame read back; `None` if it is none of these.
    pub fn decode(frame: &[u8]) -> Option<Greeting> {
        let text = std::str::from_utf8(frame).ok()?;
        if let Some(name) = text.strip_prefix(CHANNEL) {
            return (!name.is_empty()).then(|| Greeting::Channel(name.to_string()));
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
            Greeting::Channel("/tmp/x/socket".into()),
            Greeting::Refused,
            Greeting::Busy,
        ] {
            assert_eq!(Greeting::decode(&g.encode()), Some(g));
        }
        assert_eq!(Greeting::decode(b"channel "), None);
        assert_eq!(Greeting::decode(b"/tmp/x/socket"), None);
        assert_eq!(Greeting::decode(&[0xff, 0xfe]), None);
    }
}
