//! How a client connects: whom it trusts (its own uid, `--allow-uid` and
//! [`ALLOW_UIDS_ENV`]; a server of any other uid is refused before a byte is read
//! from it), how long it waits, and the job its figures count for.

use std::time::Duration;

use super::super::admission::Peer;
use super::super::CacheError;

/// Variable naming more uids whose cache servers a client trusts besides its own
/// (comma-separated), as `--allow-uid` does on the command line.
pub const ALLOW_UIDS_ENV: &str = "VRTSPIKE_CACHE_ALLOW_UIDS";

/// How long a client waits for any one reply before it gives up on the server.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a client has to connect and finish the handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How a client connects: whom it trusts, and how long it waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOptions {
    /// Uids whose servers this client talks to (its own is always one).
    pub trusted_uids: Vec<u32>,
    /// Longest wait for a reply (a get waits the server's fill wait on top).
    pub reply_timeout: Duration,
    /// Longest time to connect and finish the handshake.
    pub handshake_timeout: Duration,
    /// The job this client's figures count for ([`job_label`]).
    pub job: String,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            trusted_uids: vec![nix::unistd::geteuid().as_raw()],
            reply_timeout: REPLY_TIMEOUT,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            job: job_label(),
        }
    }
}

/// The job this process's cache clients name in their hello, for the server's
/// per-job figures: what [`set_job_label`] set, else the run directory the
/// launcher gives its ranks (`VRTSPIKE_RUN_DIR`), else none (`""`).
pub fn job_label() -> String {
    if let Some(label) = JOB_LABEL.get() {
        return label.clone();
    }
    std::env::var(vrtspike_contract::env::RUN_DIR)
        .map(|dir| vrtspike_contract::rundir::RunLayout::new(dir).job_label())
        .unwrap_or_default()
}

/// Names the job of this process's cache clients (a rank sets its run
/// directory); the first call wins.
pub fn set_job_label(label: &str) {
    let _ = JOB_LABEL.set(label.to_string());
}

static JOB_LABEL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

impl ClientOptions {
    /// The defaults, trusting also the uids of [`ALLOW_UIDS_ENV`].
    pub fn from_env() -> Result<ClientOptions, CacheError> {
        let mut options = ClientOptions::default();
        if let Ok(list) = std::env::var(ALLOW_UIDS_ENV) {
            options.trusted_uids.extend(parse_uids(&list)?);
        }
        Ok(options)
    }

    /// Also trusts `uids`.
    pub fn trusting(mut self, uids: &[u32]) -> ClientOptions {
        self.trusted_uids.extend_from_slice(uids);
        self
    }

    /// Waits at most `timeout` to connect and at most `timeout` for each reply.
    pub fn waiting(mut self, timeout: Duration) -> ClientOptions {
        self.reply_timeout = timeout;
        self.handshake_timeout = timeout;
        self
    }
}

/// Uids from a comma-separated list; an error names the entry that is not one.
pub fn parse_uids(list: &str) -> Result<Vec<u32>, CacheError> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>().map_err(|_| {
                CacheError::Protocol(format!("{ALLOW_UIDS_ENV}={list:?}: {s:?} is not a user id"))
            })
        })
        .collect()
}

/// Refuses a server whose process runs as a uid this client does not trust.
pub fn check_server(address: &str, server: Peer, trusted: &[u32]) -> Result<(), CacheError> {
    if trusted.contains(&server.uid) {
        return Ok(());
    }
    Err(CacheError::ForeignServer {
        address: address.to_string(),
        server_uid: server.uid,
        server_pid: server.pid,
        uid: nix::unistd::geteuid().as_raw(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_of_an_untrusted_uid_is_refused_naming_its_uid_and_pid() {
        let me = nix::unistd::geteuid().as_raw();
        let mine = Peer { uid: me, pid: 7 };
        check_server("addr", mine, &[me]).unwrap();
        let other = Peer {
            uid: me.wrapping_add(1000),
            pid: 4321,
        };
        let err = check_server("addr", other, &[me]).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, CacheError::ForeignServer { server_uid, server_pid: 4321, .. } if server_uid == other.uid),
            "{err:?}"
        );
        assert!(text.contains(&format!("uid {}", other.uid)), "{text}");
        assert!(text.contains("pid 4321"), "{text}");
        assert!(text.contains("--allow-uid"), "{text}");
        check_server("addr", other, &[me, other.uid]).unwrap();
    }

    #[test]
    fn trusted_uids_come_from_a_list_and_a_bad_entry_is_named() {
        assert_eq!(parse_uids("1000, 1001,").unwrap(), vec![1000, 1001]);
        assert!(parse_uids("").unwrap().is_empty());
        let err = parse_uids("1000,bob").unwrap_err().to_string();
        assert!(
            err.contains("\"bob\"") && err.contains(ALLOW_UIDS_ENV),
            "{err}"
        );
        let options = ClientOptions::default()
            .trusting(&[5])
            .waiting(Duration::from_secs(2));
        assert_eq!(options.trusted_uids.len(), 2);
        assert_eq!(options.reply_timeout, Duration::from_secs(2));
    }
}
