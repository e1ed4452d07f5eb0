//! The lines between a parent and its probe child, over the socket that is the
//! child's stdin and stdout: the child's greeting, one hex-encoded path a request
//! (any bytes survive), and one JSON [`Reply`] an answer.

/// The first line a probe child writes, so a wrong executable is told apart from
/// a corrupt file.
pub const GREETING: &str = "vrtspike-h5-probe 1";

/// The child's answer for one file: `error` is `None` when the file is usable;
/// `unjudged` says why there is no verdict (its worker was killed from outside).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(super) struct Reply {
    pub(super) error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) unjudged: Option<String>,
}

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(super) fn unhex(text: &str) -> Option<Vec<u8>> {
    let text = text.as_bytes();
    if text.len() % 2 != 0 {
        return None;
    }
    text.chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_survive_the_hex_encoding() {
        let bytes = b"/tmp/a b\n\xff.h5";
        assert_eq!(unhex(&hex(bytes)).unwrap(), bytes);
        assert_eq!(unhex("abc"), None);
        assert_eq!(unhex("zz"), None);
    }
}
