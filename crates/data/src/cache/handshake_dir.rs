//! Where the one-shot handshake sockets live, and their removal. The control
//! channel's library makes a temp directory with one socket in it per handshake;
//! the server points the process's temp dir at a directory of its own,
//! `$TMPDIR/vrtspike-cache-<uid>/<pid>@<host>/`, removes each handshake's directory
//! as soon as the client has connected to it, and at start removes the directories
//! of servers that died (their pid is gone), so a server killed mid-handshake
//! leaves nothing behind for long. `<host>` names the machine and the pid
//! namespace (host name, pid namespace inode): where nodes share `$TMPDIR` (a
//! cluster's shared /tmp), a server judges only its own host's directories, never
//! another node's, whose pids it cannot see.

use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tracing::{debug, warn};

use super::CacheError;

/// Traverse-only for others: they can reach a handshake socket whose name the
/// server gave them (when other uids are allowed), but not list the directory.
const DIR_MODE: u32 = 0o711;

fn io_error(path: &Path, source: std::io::Error) -> CacheError {
    CacheError::HandshakeDir {
        path: path.to_path_buf(),
        message: source.to_string(),
    }
}

/// `$TMPDIR/vrtspike-cache-<uid>`: made if absent, and checked to be a real
/// directory of this user that no one else can write.
fn user_dir(base: &Path, uid: u32) -> Result<PathBuf, CacheError> {
    let dir = base.join(format!("vrtspike-cache-{uid}"));
    match fs::DirBuilder::new().mode(DIR_MODE).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_error(&dir, e)),
    }
    let meta = fs::symlink_metadata(&dir).map_err(|e| io_error(&dir, e))?;
    if !meta.is_dir() || meta.uid() != uid || meta.mode() & 0o022 != 0 {
        return Err(CacheError::HandshakeDir {
            path: dir,
            message: format!(
                "not a directory of uid {uid} that only it can write (owner {}, mode {:o})",
                meta.uid(),
                meta.mode() & 0o7777
            ),
        });
    }
    Ok(dir)
}

/// This host and pid namespace, as directory names carry it: the host name and the
/// pid namespace's inode.
fn host_key() -> String {
    let host = fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host: String = host
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let ns = fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino());
    format!("{host}.{ns}")
}

/// The name of process `pid`'s directory on host `host`.
fn dir_name(pid: u32, host: &str) -> String {
    format!("{pid}@{host}")
}

/// The pid of a directory named for a process of host `host`; `None` for another
/// host's (or anything else).
fn pid_on_host(name: &str, host: &str) -> Option<u32> {
    let (pid, on) = name.split_once('@')?;
    (on == host).then(|| pid.parse().ok()).flatten()
}

/// Removes the directories of servers of this host whose process is gone.
fn remove_stale(user_dir: &Path, host: &str) {
    let Ok(entries) = fs::read_dir(user_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| pid_on_host(n, host)) else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        match fs::remove_dir_all(entry.path()) {
            Ok(()) => debug!(
                pid,
                "removed the handshake directory of a dead cache server"
            ),
            Err(e) => warn!("cannot remove {}: {e}", entry.path().display()),
        }
    }
}

/// Makes this process's handshake directory under `base`, removes those of dead
/// servers, and points the process's temp dir (where the channel library makes its
/// one-shot sockets) at it. Returns the directory.
pub fn prepare_in(base: &Path, uid: u32) -> Result<PathBuf, CacheError> {
    let user = user_dir(base, uid)?;
    let host = host_key();
    remove_stale(&user, &host);
    let own = user.join(dir_name(std::process::id(), &host));
    match fs::DirBuilder::new().mode(DIR_MODE).create(&own) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_error(&own, e)),
    }
    fs::set_permissions(&own, fs::Permissions::from_mode(DIR_MODE))
        .map_err(|e| io_error(&own, e))?;
    Ok(own)
}

/// [`prepare_in`] the system temp dir, once per process; later calls return the
/// first one's directory.
pub fn prepare() -> Result<PathBuf, CacheError> {
    static OWN: OnceLock<PathBuf> = OnceLock::new();
    if let Some(own) = OWN.get() {
        return Ok(own.clone());
    }
    let uid = nix::unistd::geteuid().as_raw();
    let own = prepare_in(&std::env::temp_dir(), uid)?;
    if let Err(other) = tempfile::env::override_temp_dir(&own) {
        if other != own {
            warn!(
                "this process's temp dir is set to {} already; cache handshakes go there",
                other.display()
            );
        }
    }
    Ok(OWN.get_or_init(|| own).clone())
}

/// The handshake directory of this host's process `pid` (a server of this user)
/// under the system temp dir.
pub fn dir_of(pid: u32) -> PathBuf {
    let uid = nix::unistd::geteuid().as_raw();
    std::env::temp_dir()
        .join(format!("vrtspike-cache-{uid}"))
        .join(dir_name(pid, &host_key()))
}

/// Removes this process's handshake directory (at the end of `cache serve`).
pub fn remove_own() {
    let own = dir_of(std::process::id());
    if let Err(e) = fs::remove_dir_all(&own) {
        if e.kind() != std::io::ErrorKind::NotFound {
            warn!("cannot remove {}: {e}", own.display());
        }
    }
}

/// The directory of the one-shot socket `socket_path`, if it lies in a handshake
/// directory of this process (never anything else).
fn oneshot_dir(socket_path: &str, own: &Path) -> Option<PathBuf> {
    let dir = Path::new(socket_path).parent()?;
    (dir.parent() == Some(own)).then(|| dir.to_path_buf())
}

/// A one-shot socket's files, removed by [`remove`](Self::remove) once the client
/// has connected, or when dropped (the handshake failed before).
pub struct OneshotFiles<'a> {
    socket_path: &'a str,
    own: &'a Path,
    removed: bool,
}

impl<'a> OneshotFiles<'a> {
    /// The files of the one-shot socket `socket_path` made in `own`.
    pub fn new(socket_path: &'a str, own: &'a Path) -> OneshotFiles<'a> {
        OneshotFiles {
            socket_path,
            own,
            removed: false,
        }
    }

    /// Removes them now.
    pub fn remove(&mut self) {
        if !self.removed {
            self.removed = true;
            remove_oneshot(self.socket_path, self.own);
        }
    }
}

impl Drop for OneshotFiles<'_> {
    fn drop(&mut self) {
        self.remove();
    }
}

/// Removes the one-shot socket and its directory once the client has connected
/// (the connection lives on without the name).
pub fn remove_oneshot(socket_path: &str, own: &Path) {
    if let Some(dir) = oneshot_dir(socket_path, own) {
        match fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => warn!(
                "cannot remove the handshake directory {}: {e}",
                dir.display()
            ),
        }
    }
}

/// Lets other (allowed) users reach the one-shot socket: its directory traverse
/// only, the socket writable.
pub fn open_oneshot_to_others(socket_path: &str, own: &Path) -> Result<(), CacheError> {
    let Some(dir) = oneshot_dir(socket_path, own) else {
        return Ok(());
    };
    fs::set_permissions(&dir, fs::Permissions::from_mode(DIR_MODE))
        .map_err(|e| io_error(&dir, e))?;
    let socket = Path::new(socket_path);
    fs::set_permissions(socket, fs::Permissions::from_mode(0o777)).map_err(|e| io_error(socket, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_servers_directories_go_and_live_ones_stay() {
        let base = tempfile::tempdir().unwrap();
        let uid = nix::unistd::geteuid().as_raw();
        let user = user_dir(base.path(), uid).unwrap();
        let host = host_key();
        // pid 0x7fff_fff0 is above any pid_max: never a live process.
        let dead = user.join(dir_name(2147483632, &host));
        fs::create_dir_all(dead.join(".tmpabc")).unwrap();
        fs::write(dead.join(".tmpabc/socket"), b"").unwrap();
        let live = user.join(dir_name(1, &host));
        fs::create_dir_all(&live).unwrap();
        // Another node's server sharing this temp dir: its pid means nothing here.
        let other_node = user.join(dir_name(2147483632, "vn2.4026531836"));
        fs::create_dir_all(&other_node).unwrap();
        let own = prepare_in(base.path(), uid).unwrap();
        assert!(!dead.exists(), "a dead server's directory was kept");
        assert!(live.exists(), "a live process's directory was removed");
        assert!(
            other_node.exists(),
            "another host's directory was judged here"
        );
        assert_eq!(own, user.join(dir_name(std::process::id(), &host)));
        let mode = fs::metadata(&own).unwrap().mode() & 0o777;
        assert_eq!(mode, DIR_MODE);
    }

    #[test]
    fn only_a_oneshot_directory_of_this_server_is_removed() {
        let base = tempfile::tempdir().unwrap();
        let uid = nix::unistd::geteuid().as_raw();
        let own = prepare_in(base.path(), uid).unwrap();
        let oneshot = own.join(".tmpxyz");
        fs::create_dir(&oneshot).unwrap();
        let socket = oneshot.join("socket");
        fs::write(&socket, b"").unwrap();
        let elsewhere = base.path().join("other");
        fs::create_dir(&elsewhere).unwrap();
        remove_oneshot(elsewhere.join("socket").to_str().unwrap(), &own);
        assert!(elsewhere.exists(), "removed a directory outside its own");
        remove_oneshot(socket.to_str().unwrap(), &own);
        assert!(!oneshot.exists());
        assert!(own.exists());
    }

    #[test]
    fn a_user_dir_writable_by_others_is_refused() {
        let base = tempfile::tempdir().unwrap();
        let uid = nix::unistd::geteuid().as_raw();
        let dir = base.path().join(format!("vrtspike-cache-{uid}"));
        fs::create_dir(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
        let err = user_dir(base.path(), uid).unwrap_err();
        assert!(err.to_string().contains("only it can write"), "{err}");
    }
}
