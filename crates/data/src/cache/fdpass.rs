//! Passing the store's memfd from the server to a client: one byte with the fd as
//! `SCM_RIGHTS` on the rendezvous Unix socket the client already holds. (The
//! control channel's library cannot carry a raw fd, only its own shared-memory
//! type, which it fills itself.)

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

/// The byte sent with the fd.
const FD_TAG: u8 = b'F';

/// Sends `fd` over `stream`.
pub fn send_fd(stream: &UnixStream, fd: BorrowedFd<'_>) -> std::io::Result<()> {
    let fds = [fd.as_raw_fd()];
    let control = [ControlMessage::ScmRights(&fds)];
    let tag = [FD_TAG];
    let iov = [IoSlice::new(&tag)];
    sendmsg::<()>(stream.as_raw_fd(), &iov, &control, MsgFlags::empty(), None)?;
    Ok(())
}

/// Receives one fd sent by [`send_fd`] (close-on-exec); any other fds that came
/// with it are closed.
pub fn recv_fd(stream: &UnixStream) -> std::io::Result<OwnedFd> {
    let mut tag = [0u8; 1];
    let mut iov = [IoSliceMut::new(&mut tag)];
    let mut space = nix::cmsg_space!([RawFd; 4]);
    let msg = recvmsg::<()>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut received: Vec<OwnedFd> = Vec::new();
    for cmsg in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(fds) = cmsg {
            // SAFETY: the kernel just installed these fds in this process for us;
            // nothing else owns them.
            received.extend(
                fds.into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    let truncated = msg.flags.contains(MsgFlags::MSG_CTRUNC);
    let bytes = msg.bytes;
    if bytes == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the server closed the socket before sending the store",
        ));
    }
    if tag[0] != FD_TAG || truncated || received.len() != 1 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "expected the store's fd, got byte {:#x} with {} fds{}",
                tag[0],
                received.len(),
                if truncated { " (truncated)" } else { "" }
            ),
        ));
    }
    Ok(received.remove(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    #[test]
    fn an_fd_crosses_a_socket_and_names_the_same_file() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(b"shared").unwrap();
        send_fd(&a, std::os::fd::AsFd::as_fd(&file)).unwrap();
        let got = recv_fd(&b).unwrap();
        let mut other = std::fs::File::from(got);
        other.rewind().unwrap();
        let mut text = String::new();
        other.read_to_string(&mut text).unwrap();
        assert_eq!(text, "shared");
    }

    #[test]
    fn a_byte_without_an_fd_or_a_close_is_an_error() {
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(b"F").unwrap();
        let err = recv_fd(&b).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "{err}");
        drop(a);
        let err = recv_fd(&b).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof, "{err}");
    }
}
