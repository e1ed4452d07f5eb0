//! Faults a well-behaved client never makes, to test how the server copes.

use crate::cache::{CacheClient, CacheError};

/// Sends the server a frame on `client`'s request channel that decodes to no
/// request (a variant number past the last one). The server closes the connection
/// (it cannot tell what the client meant) while the client object, and any lease it
/// holds, lives on.
pub fn send_undecodable_request(client: &CacheClient) -> Result<(), CacheError> {
    let raw = client.request_channel().clone().to_opaque().to::<u32>();
    raw.send(u32::MAX).map_err(|e| CacheError::Ipc {
        op: "undecodable request",
        message: e.to_string(),
    })
}
