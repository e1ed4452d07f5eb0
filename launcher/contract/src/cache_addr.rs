//! The cache server's default address: an abstract Unix socket name that holds the
//! user id and the job, so two jobs, or two users, never meet on one by accident.
//! (An abstract name has no permissions: a client still checks who the server is
//! before it reads a byte; this only keeps honest jobs apart.) The launcher, the
//! ranks and the command-line tools all name a job's server through this one
//! function.

/// The version of the cache server's protocol: its wire format (the rendezvous
/// greeting, the control channel's messages in `crates/data/src/cache/protocol.rs`)
/// and the shared store's layout (`cache/table.rs`, `cache/pins.rs`). It is in the
/// node-shared address ([`shared_cache_address`]) and in the handshake (the
/// server's greeting and the client's hello), so a build never attaches to a
/// server of another: bump it whenever any of those changes.
pub const CACHE_PROTOCOL_VERSION: u32 = 2;

/// The address of the cache server of `job` run by user `uid`:
/// `vrtspike-cache-u<uid>-<job>`.
pub fn cache_address(uid: u32, job: &str) -> String {
    format!("vrtspike-cache-u{uid}-{job}")
}

/// [`cache_address`] for this process's effective user.
pub fn own_cache_address(job: &str) -> String {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    cache_address(uid, job)
}

/// The address of the node-shared server (`DATA.CACHE_SHARING: node`) of user `uid`
/// for the dataset `digest` (see [`crate::dataset_sig`]), spoken at this build's
/// [`CACHE_PROTOCOL_VERSION`]: `vrtspike-cache-u<uid>-ds<digest>-p<version>`, with
/// `-slurm<id>` when the job runs in a SLURM allocation (separate allocations keep
/// separate servers; the steps of one share). Builds of another protocol version
/// meet at another address.
pub fn shared_cache_address(uid: u32, digest: u64, slurm_job: Option<&str>) -> String {
    let version = CACHE_PROTOCOL_VERSION;
    let job = match slurm_job.filter(|id| !id.is_empty()) {
        Some(id) => format!("ds{digest:016x}-p{version}-slurm{id}"),
        None => format!("ds{digest:016x}-p{version}"),
    };
    cache_address(uid, &job)
}

/// Why the node-shared server's address could not be had.
#[derive(Debug, thiserror::Error)]
#[error("DATA.CACHE_SHARING node keys the cache server by the dataset's files: {0}")]
pub struct SharedAddressError(#[from] pub crate::dataset_sig::SignatureError);

/// The node-shared server's address for the dataset at `root` (signed by
/// [`crate::dataset_sig::sign`]) for this process's user, in this process's SLURM
/// allocation if any; with the signature. The launcher, ranks that no launcher
/// started (torchrun, srun) and `cache serve --config` name it alike.
pub fn node_shared_address(
    root: &std::path::Path,
) -> Result<(String, crate::dataset_sig::DatasetSignature), SharedAddressError> {
    let signature = crate::dataset_sig::sign(root)?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let slurm = std::env::var(crate::env::slurm::JOB_ID).ok();
    let address = shared_cache_address(uid, signature.digest, slurm.as_deref());
    Ok((address, signature))
}

/// The job of a process that no launcher named: the SLURM job it runs in
/// (`slurm<id>`), else `default`.
pub fn ambient_job(var: &dyn Fn(&str) -> Option<String>) -> String {
    match var("SLURM_JOB_ID").filter(|id| !id.is_empty()) {
        Some(id) => format!("slurm{id}"),
        None => "default".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_hold_the_user_and_the_job() {
        assert_eq!(
            cache_address(1000, "n0-4242"),
            "vrtspike-cache-u1000-n0-4242"
        );
        assert_ne!(cache_address(1000, "j"), cache_address(1001, "j"));
        assert_ne!(cache_address(1000, "j1"), cache_address(1000, "j2"));
        // SAFETY: as in own_cache_address.
        let me = unsafe { libc::geteuid() };
        assert_eq!(own_cache_address("x"), format!("vrtspike-cache-u{me}-x"));
        assert_eq!(ambient_job(&|_| None), "default");
        assert_eq!(ambient_job(&|_| Some("77".into())), "slurm77");
        assert_eq!(ambient_job(&|_| Some(String::new())), "default");
    }

    #[test]
    fn an_unreadable_dataset_says_why_its_files_are_read() {
        let Err(error) = node_shared_address(std::path::Path::new("/no/such/dataset")) else {
            panic!("a dataset that is not there was signed");
        };
        let text = error.to_string();
        let why = "DATA.CACHE_SHARING node keys the cache server by the dataset's files: ";
        assert!(text.starts_with(why), "{text}");
        assert!(
            text.contains("signing the dataset at /no/such/dataset"),
            "{text}"
        );
    }

    #[test]
    fn shared_addresses_hold_the_user_the_dataset_and_the_allocation() {
        assert_eq!(
            shared_cache_address(1000, 0xab, None),
            format!("vrtspike-cache-u1000-ds00000000000000ab-p{CACHE_PROTOCOL_VERSION}")
        );
        assert_eq!(
            shared_cache_address(1000, 0xab, Some("")),
            shared_cache_address(1000, 0xab, None)
        );
        assert_eq!(
            shared_cache_address(1000, 0xab, Some("77")),
            format!("vrtspike-cache-u1000-ds00000000000000ab-p{CACHE_PROTOCOL_VERSION}-slurm77")
        );
        assert_ne!(
            shared_cache_address(1000, 1, None),
            shared_cache_address(1001, 1, None)
        );
        assert_ne!(
            shared_cache_address(1000, 1, None),
            shared_cache_address(1000, 2, None)
        );
    }
}
