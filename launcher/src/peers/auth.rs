//! Who may join a job's control link: whoever proves it knows the job's secret.
//! Node 0 greets each connection with a fresh nonce; the other node answers with
//! its node rank, a nonce of its own and an HMAC-SHA256 of both under the secret;
//! node 0 checks it and answers with an HMAC of its own, which the other node
//! checks (so it never takes a stale control file's port, now another program's,
//! for node 0). The secret never travels. The hello also says the launcher's
//! version and its config's digest ([`Identity`]): node 0 refuses a launcher
//! whose differ from its own, naming what differs (a node started again with
//! another config or another build). A connection that fails is refused and
//! closed; node 0 logs it with the peer's address. Before anyone has proved the
//! secret nothing it sends is trusted: each handshake line is at most
//! [`MAX_LINE`] bytes and the whole handshake has one deadline (not a time limit
//! per read, which a client sending a byte at a time would never meet).
//!
//! The secret comes from `VRTSPIKE_JOB_SECRET` when the batch script passes one,
//! else node 0 makes one (32 random bytes) and publishes it in the run directory's
//! control file, readable by the job's user only (see [`super::control`]). The
//! nonces and proofs travel in clear, so whoever sees one handshake can try secrets
//! offline: a given secret must carry at least [`MIN_SECRET_BITS`] bits, which the
//! launcher takes as at least [`MIN_SECRET_CHARS`] characters (32 hex digits; the
//! batch template makes 64), and refuses a shorter one naming the variable.

use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::net::TcpStream;
use std::time::Instant;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The variable a batch script may set to the job's secret (the same on every
/// node), instead of node 0 publishing one in the run directory.
pub const SECRET_ENV: &str = "VRTSPIKE_JOB_SECRET";
/// Node 0's greeting: the protocol and its version.
const GREETING: &str = "VRTSPIKE-CONTROL 3";
/// The longest handshake line (the longest the protocol sends is about 120 bytes).
pub const MAX_LINE: usize = 256;
/// The fewest bits of a secret given in [`SECRET_ENV`].
pub const MIN_SECRET_BITS: usize = 128;
/// The fewest characters of a secret given in [`SECRET_ENV`]: what
/// [`MIN_SECRET_BITS`] takes in hex digits (4 bits each). A secret in another
/// alphabet needs as many characters: the launcher cannot tell how random they are.
pub const MIN_SECRET_CHARS: usize = MIN_SECRET_BITS / 4;

/// A secret in [`SECRET_ENV`] too short to resist an offline search.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{SECRET_ENV} has {chars} characters; it must have at least {MIN_SECRET_CHARS} \
     ({MIN_SECRET_BITS} random bits as hex digits), since the handshake's nonces and \
     proofs travel in clear: make one with `od -An -N32 -tx1 /dev/urandom | tr -d ' \\n'`, \
     or leave it unset for node 0 to make one"
)]
pub struct WeakSecret {
    /// Characters the given secret has.
    pub chars: usize,
}

/// The job's secret from the value of [`SECRET_ENV`]: `None` when unset or blank
/// (node 0 makes one), an error when shorter than [`MIN_SECRET_CHARS`].
pub fn given_secret(value: Option<String>) -> Result<Option<String>, WeakSecret> {
    let Some(secret) = value.filter(|s| !s.trim().is_empty()) else {
        return Ok(None);
    };
    let chars = secret.chars().count();
    if chars < MIN_SECRET_CHARS {
        return Err(WeakSecret { chars });
    }
    Ok(Some(secret))
}

/// What a launcher says of itself in its hello: node 0 takes in only its like.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    /// The launcher's version.
    pub version: String,
    /// The digest of the job's config file (hex).
    pub config: String,
}

impl Identity {
    /// This launcher's, for the config file's bytes `config`.
    pub fn of(config: &[u8]) -> Identity {
        Identity {
            version: env!("CARGO_PKG_VERSION").to_string(),
            config: format!("{:016x}", vrtspike_contract::fnv::fnv1a_64(config)),
        }
    }

    /// How `theirs` (node `node`'s) differs from this one, if it does.
    fn differs(&self, node: u32, theirs: &Identity) -> Option<String> {
        if theirs.version != self.version {
            return Some(format!(
                "node {node} runs vrtspike-launch {}, node 0 {}: start every node with the same build",
                theirs.version, self.version
            ));
        }
        if theirs.config != self.config {
            return Some(format!(
                "node {node}'s config (digest {}) is not node 0's (digest {}): another config \
                 file, or one changed since the job started",
                theirs.config, self.config
            ));
        }
        None
    }
}

/// Why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// The link broke or timed out.
    #[error("{0}")]
    Io(String),
    /// The other side said something else than the protocol.
    #[error("not a vrtspike launcher: {0}")]
    Protocol(String),
    /// The other side does not know the job's secret.
    #[error("wrong proof of the job's secret (another job, or a stale control file)")]
    BadProof,
    /// Node 0 refused this launcher, saying why.
    #[error("node 0 refused this launcher: {0}")]
    Refused(String),
    /// The other launcher knows the secret but is not of this job's kind (its
    /// version or config differs): trying again cannot help.
    #[error("{0}")]
    Unlike(String),
}

/// Random bytes as hex, from the kernel.
pub fn random_hex(bytes: usize) -> std::io::Result<String> {
    use std::io::Read;
    let mut buf = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(hex(&buf))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// HMAC-SHA256 of `text` under `secret`, as hex.
fn proof(secret: &str, text: &str) -> String {
    // HMAC takes a key of any length, so `new_from_slice` cannot fail here.
    match Hmac::<Sha256>::new_from_slice(secret.as_bytes()) {
        Ok(mut mac) => {
            mac.update(text.as_bytes());
            hex(&mac.finalize().into_bytes())
        }
        Err(_) => String::new(),
    }
}

/// Whether `given` is the proof of `text` (compared in constant time).
fn proves(secret: &str, text: &str, given: &str) -> bool {
    let expected = proof(secret, text);
    expected.len() == given.len()
        && expected
            .bytes()
            .zip(given.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// The time left until `deadline`, or the error of a handshake past it.
fn time_left(deadline: Instant) -> Result<std::time::Duration, AuthError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(AuthError::Io("the handshake ran past its deadline".into()));
    }
    Ok(left)
}

/// One line of at most [`MAX_LINE`] bytes, read before `deadline`.
fn read_line(reader: &mut BufReader<TcpStream>, deadline: Instant) -> Result<String, AuthError> {
    let io = |e: std::io::Error| AuthError::Io(format!("during the handshake: {e}"));
    let mut line = Vec::new();
    loop {
        reader
            .get_ref()
            .set_read_timeout(Some(time_left(deadline)?))
            .map_err(io)?;
        let available = match reader.fill_buf() {
            Ok([]) => return Err(AuthError::Io("closed during the handshake".into())),
            Ok(bytes) => bytes,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(io(e)),
        };
        let (taken, ended) = match available.iter().position(|&b| b == b'\n') {
            Some(end) => (end, true),
            None => (available.len(), false),
        };
        line.extend_from_slice(&available[..taken.min(MAX_LINE + 1)]);
        reader.consume(taken + usize::from(ended));
        if line.len() > MAX_LINE {
            return Err(AuthError::Protocol(format!(
                "a handshake line longer than {MAX_LINE} bytes"
            )));
        }
        if ended {
            let text = String::from_utf8_lossy(&line);
            return Ok(text.trim_end().to_string());
        }
    }
}

/// Sends one line before `deadline`.
fn send(mut stream: &TcpStream, line: &str, deadline: Instant) -> Result<(), AuthError> {
    let io = |e: std::io::Error| AuthError::Io(format!("during the handshake: {e}"));
    stream
        .set_write_timeout(Some(time_left(deadline)?))
        .map_err(io)?;
    stream.write_all(format!("{line}\n").as_bytes()).map_err(io)
}

/// Node 0's side: greets, checks the proof and the other launcher's identity
/// against `own`, answers, all before `deadline`; returns the node rank the other
/// launcher proved.
pub fn accept(
    reader: &mut BufReader<TcpStream>,
    secret: &str,
    own: &Identity,
    deadline: Instant,
) -> Result<u32, AuthError> {
    let nonce = random_hex(16).map_err(|e| AuthError::Io(e.to_string()))?;
    send(reader.get_ref(), &format!("{GREETING} {nonce}"), deadline)?;
    let hello = read_line(reader, deadline)?;
    let fields: Vec<&str> = hello.split(' ').collect();
    let [word, node, their_nonce, their_proof, version, config] = fields[..] else {
        if fields.first() == Some(&"HELLO") {
            return Err(AuthError::Protocol(format!(
                "a launcher of another protocol version ({} fields in its hello, not 6): {hello:?}",
                fields.len()
            )));
        }
        return Err(AuthError::Protocol(format!("{hello:?}")));
    };
    let node: u32 = match (word, node.parse()) {
        ("HELLO", Ok(node)) => node,
        _ => return Err(AuthError::Protocol(format!("{hello:?}"))),
    };
    if !proves(
        secret,
        &format!("hello {node} {nonce} {their_nonce}"),
        their_proof,
    ) {
        let _ = send(
            reader.get_ref(),
            &format!("REFUSED {}", AuthError::BadProof),
            deadline,
        );
        return Err(AuthError::BadProof);
    }
    let theirs = Identity {
        version: version.to_string(),
        config: config.to_string(),
    };
    if let Some(why) = own.differs(node, &theirs) {
        let _ = send(reader.get_ref(), &format!("UNLIKE {why}"), deadline);
        return Err(AuthError::Unlike(why));
    }
    let answer = proof(secret, &format!("welcome {node} {their_nonce} {nonce}"));
    send(reader.get_ref(), &format!("WELCOME {answer}"), deadline)?;
    Ok(node)
}

/// Another node's side: answers node 0's greeting as node `node` (saying its
/// identity `own`) and checks its answer, all before `deadline`.
pub fn join(
    reader: &mut BufReader<TcpStream>,
    secret: &str,
    node: u32,
    own: &Identity,
    deadline: Instant,
) -> Result<(), AuthError> {
    let greeting = read_line(reader, deadline)?;
    let nonce = match greeting.strip_prefix(GREETING).map(str::trim) {
        Some(nonce) if !nonce.is_empty() => nonce.to_string(),
        _ if greeting.starts_with("VRTSPIKE-CONTROL ") => {
            return Err(AuthError::Protocol(format!(
                "node 0 speaks another protocol version ({greeting:?}, this launcher \
                 {GREETING:?}): start every node with the same build"
            )))
        }
        _ => return Err(AuthError::Protocol(format!("{greeting:?}"))),
    };
    let mine = random_hex(16).map_err(|e| AuthError::Io(e.to_string()))?;
    let hello = proof(secret, &format!("hello {node} {nonce} {mine}"));
    send(
        reader.get_ref(),
        &format!("HELLO {node} {mine} {hello} {} {}", own.version, own.config),
        deadline,
    )?;
    let welcome = read_line(reader, deadline)?;
    if let Some(why) = welcome.strip_prefix("REFUSED ") {
        return Err(AuthError::Refused(why.to_string()));
    }
    if let Some(why) = welcome.strip_prefix("UNLIKE ") {
        return Err(AuthError::Unlike(format!(
            "node 0 refused this launcher: {why}"
        )));
    }
    let answer = welcome
        .strip_prefix("WELCOME ")
        .ok_or_else(|| AuthError::Protocol(format!("{welcome:?}")))?;
    if !proves(secret, &format!("welcome {node} {mine} {nonce}"), answer) {
        return Err(AuthError::BadProof);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    fn id() -> Identity {
        Identity::of(b"TRAIN: {}")
    }

    fn soon() -> Instant {
        Instant::now() + std::time::Duration::from_secs(10)
    }

    fn pair() -> (BufReader<TcpStream>, BufReader<TcpStream>) {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let client = TcpStream::connect(addr).unwrap_or_else(|e| panic!("{e}"));
        let (server, _) = listener.accept().unwrap_or_else(|e| panic!("{e}"));
        (BufReader::new(server), BufReader::new(client))
    }

    #[test]
    fn the_same_secret_links_and_the_node_is_proved() {
        let (mut server, mut client) = pair();
        let joined = std::thread::spawn(move || join(&mut client, "s3cret", 2, &id(), soon()));
        assert_eq!(accept(&mut server, "s3cret", &id(), soon()), Ok(2));
        assert_eq!(joined.join().ok(), Some(Ok(())));
    }

    #[test]
    fn another_config_or_build_is_refused_naming_it() {
        let other_config = Identity::of(b"TRAIN: {TOTAL_STEPS: 9}");
        let other_build = Identity {
            version: "0.0.1".into(),
            ..id()
        };
        for (theirs, says) in [
            (other_config, "config"),
            (other_build, "vrtspike-launch 0.0.1"),
        ] {
            let (mut server, mut client) = pair();
            let joined =
                std::thread::spawn(move || join(&mut client, "s3cret", 1, &theirs, soon()));
            let got = accept(&mut server, "s3cret", &id(), soon());
            assert!(
                matches!(&got, Err(AuthError::Unlike(why)) if why.starts_with("node 1") && why.contains(says)),
                "{got:?}"
            );
            drop(server);
            let refused = joined.join().ok();
            assert!(
                matches!(&refused, Some(Err(AuthError::Unlike(why))) if why.contains(says)),
                "{refused:?}"
            );
        }
        // A launcher of the first protocol (a hello of 4 fields) is named as such.
        let (mut server, client) = pair();
        let old = std::thread::spawn(move || {
            let mut client = client;
            let greeting = read_line(&mut client, soon())?;
            send(client.get_ref(), "HELLO 1 abc 00", soon())?;
            Ok::<String, AuthError>(greeting)
        });
        let got = accept(&mut server, "s3cret", &id(), soon());
        assert!(
            matches!(&got, Err(AuthError::Protocol(why)) if why.contains("another protocol version")),
            "{got:?}"
        );
        let greeting = old.join().ok().and_then(Result::ok).unwrap_or_default();
        assert!(greeting.starts_with("VRTSPIKE-CONTROL 3 "), "{greeting}");
    }

    #[test]
    fn another_secret_is_refused_on_both_sides() {
        let (mut server, mut client) = pair();
        let joined = std::thread::spawn(move || join(&mut client, "other", 1, &id(), soon()));
        assert_eq!(
            accept(&mut server, "s3cret", &id(), soon()),
            Err(AuthError::BadProof)
        );
        drop(server);
        let refused = joined.join().ok();
        assert!(
            matches!(&refused, Some(Err(AuthError::Refused(why))) if why.contains("secret")),
            "{refused:?}"
        );
        // Node 0's answer is checked too: an imposter that accepts any hello.
        let (server, mut client) = pair();
        let imposter = std::thread::spawn(move || {
            let mut server = server;
            send(server.get_ref(), &format!("{GREETING} abc"), soon())?;
            read_line(&mut server, soon())?;
            send(server.get_ref(), "WELCOME 00", soon())
        });
        assert_eq!(
            join(&mut client, "s3cret", 1, &id(), soon()),
            Err(AuthError::BadProof)
        );
        assert_eq!(imposter.join().ok(), Some(Ok(())));
    }

    /// A stranger streaming bytes without a newline is cut off after one line's
    /// worth, not buffered without end.
    #[test]
    fn a_line_past_the_bound_is_refused_after_reading_little() {
        let (mut server, client) = pair();
        let streamer = std::thread::spawn(move || {
            let mut stream = client.into_inner();
            let zeros = [0u8; 4096];
            let mut sent = 0usize;
            while sent < (64 << 20) && stream.write_all(&zeros).is_ok() {
                sent += zeros.len();
            }
            sent
        });
        let got = accept(&mut server, "s3cret", &id(), soon());
        assert!(
            matches!(&got, Err(AuthError::Protocol(why)) if why.contains("longer than 256")),
            "{got:?}"
        );
        drop(server);
        let sent = streamer.join().unwrap_or(usize::MAX);
        assert!(sent < (64 << 20), "node 0 took all {sent} bytes");
    }

    /// The deadline is the whole handshake's: a byte every few milliseconds (each
    /// read well within any per-read limit) does not keep it open.
    #[test]
    fn a_handshake_dripping_bytes_ends_at_its_deadline() {
        let (mut server, client) = pair();
        let dripper = std::thread::spawn(move || {
            let mut stream = client.into_inner();
            while stream.write_all(b"H").is_ok() {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        });
        let deadline = Instant::now() + std::time::Duration::from_millis(500);
        let got = accept(&mut server, "s3cret", &id(), deadline);
        assert!(
            matches!(&got, Err(AuthError::Io(why)) if why.contains("deadline")),
            "{got:?}"
        );
        assert!(Instant::now() >= deadline);
        drop(server);
        let _ = dripper.join();
    }

    #[test]
    fn a_given_secret_must_carry_128_bits() {
        assert_eq!(given_secret(None), Ok(None));
        assert_eq!(
            given_secret(Some("  ".into())),
            Ok(None),
            "blank: node 0 makes one"
        );
        let short = given_secret(Some("0123456789abcdef".into()));
        assert_eq!(short, Err(WeakSecret { chars: 16 }));
        let message = short.map_err(|e| e.to_string()).err().unwrap_or_default();
        assert!(
            message.contains(SECRET_ENV) && message.contains("at least 32"),
            "{message}"
        );
        let enough = "ab".repeat(16);
        assert_eq!(given_secret(Some(enough.clone())), Ok(Some(enough)));
    }

    #[test]
    fn a_stranger_s_line_is_a_protocol_error() {
        let (mut server, client) = pair();
        send(
            &client
                .get_ref()
                .try_clone()
                .unwrap_or_else(|e| panic!("{e}")),
            "QUIT 1 bye",
            soon(),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let got = accept(&mut server, "s3cret", &id(), soon());
        assert!(
            matches!(got, Err(AuthError::Protocol(ref l)) if l.contains("QUIT")),
            "{got:?}"
        );
        assert_eq!(random_hex(4).map(|h| h.len()).ok(), Some(8));
    }
}
