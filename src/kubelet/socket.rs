//! The plugin's own Unix socket in the kubelet's device plugin directory: a name unique to this process, bound
//! with mode 0600, re-bound when the kubelet deletes it, removed on exit.
//!
//! Connections from every socket this process ever bound go into one channel that the single gRPC server
//! reads, so a re-bind never restarts the server, drops device state or breaks an open ListAndWatch.

use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio_util::task::AbortOnDropHandle;

use super::KubeletError;

/// Longest path a Unix socket address can carry (`sun_path` is 108 bytes including the terminating NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// Prefix of every socket this plugin creates, so a new instance can recognise sockets a crashed one left.
pub const SOCKET_PREFIX: &str = "gpu-device-plugin-";

/// A socket name unique to this process. Two plugin instances run side by side during a rolling update, both
/// often as PID 1 of their own container, so the name carries random bits rather than the PID.
pub fn unique_socket_name() -> Result<String, KubeletError> {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes).map_err(|e| KubeletError::Random(e.to_string()))?;
    Ok(format!(
        "{SOCKET_PREFIX}{:016x}.sock",
        u64::from_be_bytes(bytes)
    ))
}

/// Checks that `dir/name` fits in a Unix socket address.
pub fn socket_path(dir: &Path, name: &str) -> Result<PathBuf, KubeletError> {
    let path = dir.join(name);
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(KubeletError::SocketPathTooLong { path, len });
    }
    Ok(path)
}

/// Removes sockets that earlier instances of this plugin left behind: ours by name, and nobody listening.
/// A live socket (another instance during a rolling update) answers the connect and is kept.
pub fn remove_stale_sockets(dir: &Path) -> usize {
    remove_stale_sockets_named(dir, |name| {
        name.starts_with(SOCKET_PREFIX) || name.starts_with(&format!(".{SOCKET_PREFIX}"))
    })
}

/// As [`remove_stale_sockets`], for the sockets whose names `ours` says are this plugin's.
pub fn remove_stale_sockets_named(dir: &Path, ours: impl Fn(&str) -> bool) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !ours(name) {
            continue;
        }
        // Only a socket itself, and one nobody answers on: a regular file or a link with our name is not
        // ours to delete.
        let path = entry.path();
        if look(&path) == Found::Dead && std::fs::remove_file(&path).is_ok() {
            tracing::info!(socket = %path.display(), "removed a stale socket left by an earlier instance");
            removed += 1;
        }
    }
    removed
}

/// What is at a served socket's path when it is not the socket this process bound there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// Nothing.
    Gone,
    /// A socket something accepts connections on (or is too busy to take one now: alive all the same):
    /// another process serves there, and it is left to it.
    Live,
    /// A socket nothing accepts connections on: its process is gone.
    Dead,
    /// A FIFO.
    Fifo,
    /// A regular file.
    File,
    /// A symbolic link, wherever it leads (or nowhere): never a socket another instance bound.
    Link,
    /// Something else (a directory, a device).
    Other,
}

impl Found {
    /// How it is said in the log.
    pub fn describe(self) -> &'static str {
        match self {
            Found::Gone => "was gone",
            Found::Live => "is served by another process",
            Found::Dead => "was replaced by a socket nothing answers on",
            Found::Fifo => "was replaced by a FIFO",
            Found::File => "was replaced by a regular file",
            Found::Link => "was replaced by a symbolic link",
            Found::Other => "was replaced by something that is not a socket",
        }
    }
}

/// What is at `path`, looked at without waiting on it: the file's own type (a link is not followed), and
/// for a socket a connect that does not block (one whose listener's queue is full answers at once that it
/// would block, and counts as alive). One `lstat` and at most one `connect`; nothing is read or opened.
pub fn look(path: &Path) -> Found {
    use std::os::unix::fs::FileTypeExt as _;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Found::Gone,
        Err(_) => return Found::Other,
    };
    let kind = meta.file_type();
    if kind.is_symlink() {
        Found::Link
    } else if kind.is_fifo() {
        Found::Fifo
    } else if kind.is_file() {
        Found::File
    } else if kind.is_socket() {
        if answers(path) {
            Found::Live
        } else {
            Found::Dead
        }
    } else {
        Found::Other
    }
}

/// Whether something accepts connections on the socket at `path`, asked without blocking: only a refused
/// connect (or a file gone meanwhile) says no.
fn answers(path: &Path) -> bool {
    use nix::errno::Errno;
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
    let Ok(address) = UnixAddr::new(path) else {
        return false;
    };
    let Ok(fd) = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    ) else {
        // Out of descriptors: cannot tell, so not taken from whoever may be there.
        return true;
    };
    use std::os::fd::AsRawFd as _;
    !matches!(
        connect(fd.as_raw_fd(), &address),
        Err(Errno::ECONNREFUSED | Errno::ENOENT | Errno::ENOTSOCK)
    )
}

/// What [`PluginSocket::keep_in_place`] found, and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// Our socket is in place.
    InPlace,
    /// Another process serves a socket there: left to it.
    LeftTo,
    /// Bound again over (or in place of) what was found.
    Rebound(Found),
}

/// Where a socket is made before it is renamed into place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Staging {
    /// Beside it, under a hidden name (`.<name>.tmp`).
    Beside,
    /// In a hidden directory beside it ([`STAGING_DIR`]), under a hidden random name: for a directory the
    /// kubelet's plugin watcher follows. The watcher logs an error for every file it is told of that is gone
    /// when it looks (a temporary socket renamed at once), and looks into no directory whose name starts with
    /// a dot; the rename into place is the one event it sees.
    HiddenDir,
}

/// The hidden directory of [`Staging::HiddenDir`], made once with mode 0700 and left in place (removing it
/// would be one more event for the watcher).
pub const STAGING_DIR: &str = ".gpu-device-plugin";

impl Staging {
    /// The temporary path for a socket at `path`.
    fn temporary(self, path: &Path) -> io::Result<PathBuf> {
        let file_name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        match self {
            Staging::Beside => Ok(path.with_file_name(format!(".{file_name}.tmp"))),
            Staging::HiddenDir => {
                use std::os::unix::fs::DirBuilderExt as _;
                let dir = path.with_file_name(STAGING_DIR);
                let made = match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                    Ok(()) => true,
                    // Ours from before only if a directory itself (a link could lead to another file
                    // system, where the rename fails).
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                        std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir())
                    }
                    Err(_) => false,
                };
                if !made {
                    // Something else has the name: beside, as any other socket (the watcher may log one
                    // error for it), rather than no socket.
                    return Staging::Beside.temporary(path);
                }
                // Two instances of a rolling update may bind at the same moment: a name of its own each.
                let mut bytes = [0u8; 4];
                getrandom::fill(&mut bytes).map_err(|e| io::Error::other(e.to_string()))?;
                Ok(dir.join(format!(".{:08x}", u32::from_be_bytes(bytes))))
            }
        }
    }
}

/// The socket this process serves on, with the listener's accept loop.
pub struct PluginSocket {
    path: PathBuf,
    staging: Staging,
    /// Inode of the socket file we bound: a file at our path with another inode is not ours.
    inode: u64,
    acceptor: AbortOnDropHandle<()>,
}

impl PluginSocket {
    /// Binds `path` and forwards every accepted connection into `conns`.
    ///
    /// The socket is bound under a hidden temporary name beside it, set to 0600, then renamed into place, so
    /// it never exists with looser permissions and appears only once it accepts connections.
    pub fn bind(path: &Path, conns: mpsc::Sender<UnixStream>) -> Result<Self, KubeletError> {
        Self::bind_staged(path, Staging::Beside, conns)
    }

    /// As [`PluginSocket::bind`], the temporary socket made where `staging` says.
    pub fn bind_staged(
        path: &Path,
        staging: Staging,
        conns: mpsc::Sender<UnixStream>,
    ) -> Result<Self, KubeletError> {
        let bind_err = |source| KubeletError::Bind {
            path: path.to_owned(),
            source,
        };
        let tmp = staging.temporary(path).map_err(bind_err)?;
        let _absent = std::fs::remove_file(&tmp);
        let listener = UnixListener::bind(&tmp).map_err(bind_err)?;
        let finish = || -> io::Result<u64> {
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
            std::fs::rename(&tmp, path)?;
            Ok(std::fs::symlink_metadata(path)?.ino())
        };
        let inode = match finish() {
            Ok(inode) => inode,
            Err(e) => {
                let _cleanup = std::fs::remove_file(&tmp);
                return Err(bind_err(e));
            }
        };
        let acceptor = AbortOnDropHandle::new(tokio::spawn(accept_loop(listener, conns)));
        tracing::debug!(socket = %path.display(), "bound plugin socket");
        Ok(PluginSocket {
            path: path.to_owned(),
            staging,
            inode,
            acceptor,
        })
    }

    /// Binds the path again after our file was deleted (the kubelet deletes every socket here when it
    /// restarts). The old listener, unreachable without its file, stops before the new one is bound; if the
    /// bind fails, it stays stopped.
    pub fn rebind(&mut self, conns: mpsc::Sender<UnixStream>) -> Result<(), KubeletError> {
        self.acceptor.abort();
        *self = PluginSocket::bind_staged(&self.path, self.staging, conns)?;
        Ok(())
    }

    /// The one rule for every socket the plugin serves (the device plugin's, the DRA driver's, its
    /// registration, the control socket): our socket in place is kept; a live socket of another process
    /// there (the other pod of a rolling update, under the same name) is left to it; anything else
    /// (nothing, a FIFO, a file, a link, a socket nobody answers on, whether put there by a delete or by a
    /// rename over ours) is replaced by our socket bound again, at once. The look is [`look`]'s: bounded,
    /// never waiting on what is there.
    pub fn keep_in_place(&mut self, conns: mpsc::Sender<UnixStream>) -> Result<Kept, KubeletError> {
        if self.is_in_place() {
            return Ok(Kept::InPlace);
        }
        match look(&self.path) {
            Found::Live => Ok(Kept::LeftTo),
            found => {
                self.rebind(conns)?;
                Ok(Kept::Rebound(found))
            }
        }
    }

    /// Path of the socket.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether our socket file is still in place (the kubelet deletes it when it restarts).
    pub fn is_in_place(&self) -> bool {
        std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.ino() == self.inode)
    }

    /// Stops accepting and removes the socket file if it is still ours.
    pub fn remove(self) {
        if self.is_in_place() {
            if let Err(e) = std::fs::remove_file(&self.path) {
                tracing::warn!(socket = %self.path.display(), error = %e, "cannot remove plugin socket");
            }
        }
    }
}

async fn accept_loop(listener: UnixListener, conns: mpsc::Sender<UnixStream>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                if conns.send(stream).await.is_err() {
                    return;
                }
            }
            Err(e) => {
                // Out of file descriptors or similar: say so, and give the process a moment to free some
                // rather than spinning on the same error.
                tracing::warn!(error = %e, "cannot accept a connection on the plugin socket");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_names_are_unique_per_call_and_recognisable() {
        let a = unique_socket_name().unwrap_or_default();
        let b = unique_socket_name().unwrap_or_default();
        assert_ne!(a, b);
        assert!(a.starts_with(SOCKET_PREFIX) && a.ends_with(".sock"));
    }

    #[test]
    fn a_socket_path_longer_than_sun_path_is_refused() {
        let dir = PathBuf::from(format!("/{}", "d".repeat(100)));
        let err = socket_path(&dir, "gpu-device-plugin-0123456789abcdef.sock").err();
        assert!(matches!(err, Some(KubeletError::SocketPathTooLong { len, .. }) if len > 107));
        assert!(socket_path(Path::new("/var/lib/kubelet/device-plugins"), "x.sock").is_ok());
    }

    #[tokio::test]
    async fn bound_socket_is_private_and_removed_only_while_ours()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("gpu-device-plugin-test.sock");
        let (tx, _rx) = mpsc::channel(1);
        let socket = PluginSocket::bind(&path, tx)?;
        let mode = std::fs::metadata(&path)?.permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(socket.is_in_place());
        std::fs::remove_file(&path)?;
        assert!(!socket.is_in_place());
        std::fs::write(&path, b"someone else's")?;
        socket.remove();
        assert!(
            path.exists(),
            "a file that is not our socket must not be removed"
        );
        Ok(())
    }

    #[tokio::test]
    async fn a_socket_staged_in_the_hidden_directory_appears_in_its_directory_as_its_only_new_name()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("gpu.nvidia.com-reg.sock");
        let (tx, _rx) = mpsc::channel(1);
        let mut socket = PluginSocket::bind_staged(&path, Staging::HiddenDir, tx.clone())?;
        let mode = std::fs::metadata(&path)?.permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let staging = dir.path().join(STAGING_DIR);
        assert_eq!(
            std::fs::metadata(&staging)?.permissions().mode() & 0o777,
            0o700
        );
        // Bound again (the kubelet cleaned up): the same way, nothing left in the hidden directory.
        std::fs::remove_file(&path)?;
        socket.rebind(tx)?;
        assert!(socket.is_in_place());
        let mut names: Vec<String> = std::fs::read_dir(dir.path())?
            .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect::<Result<_, _>>()?;
        names.sort();
        assert_eq!(names, [STAGING_DIR, "gpu.nvidia.com-reg.sock"]);
        assert_eq!(std::fs::read_dir(&staging)?.count(), 0);
        Ok(())
    }

    #[tokio::test]
    async fn a_file_or_link_in_the_hidden_directorys_place_stages_the_socket_beside_it()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let elsewhere = tempfile::tempdir()?;
        for in_the_way in ["file", "link"] {
            let staging = dir.path().join(STAGING_DIR);
            let _gone = std::fs::remove_file(&staging);
            match in_the_way {
                "file" => std::fs::write(&staging, b"someone's")?,
                _ => std::os::unix::fs::symlink(elsewhere.path(), &staging)?,
            }
            let path = dir.path().join("gpu.nvidia.com-reg.sock");
            let (tx, _rx) = mpsc::channel(1);
            let socket = PluginSocket::bind_staged(&path, Staging::HiddenDir, tx)?;
            assert!(socket.is_in_place(), "{in_the_way}");
            assert_eq!(
                std::fs::read_dir(elsewhere.path())?.count(),
                0,
                "{in_the_way}"
            );
            socket.remove();
        }
        Ok(())
    }

    /// Puts `kind` at `path` in one rename, as someone replacing the socket would.
    fn replace_with(path: &Path, kind: &str) -> Result<(), Box<dyn std::error::Error>> {
        let dir = path.parent().ok_or("no directory")?;
        let made = dir.join(format!("made-{kind}"));
        match kind {
            "fifo" => rustix::fs::mknodat(
                rustix::fs::CWD,
                &made,
                rustix::fs::FileType::Fifo,
                rustix::fs::Mode::from_raw_mode(0o600),
                0,
            )?,
            "file" => std::fs::write(&made, b"not a socket")?,
            "dead socket" => drop(std::os::unix::net::UnixListener::bind(&made)?),
            "dangling link" => std::os::unix::fs::symlink(dir.join("nowhere"), &made)?,
            _ => return Err(format!("no such kind {kind}").into()),
        }
        std::fs::rename(&made, path)?;
        Ok(())
    }

    #[tokio::test]
    async fn a_socket_replaced_by_anything_but_a_live_socket_is_bound_again_and_a_live_one_left()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("served.sock");
        let (tx, mut rx) = mpsc::channel(4);
        let mut socket = PluginSocket::bind(&path, tx.clone())?;
        assert_eq!(socket.keep_in_place(tx.clone())?, Kept::InPlace);
        std::fs::remove_file(&path)?;
        assert_eq!(
            socket.keep_in_place(tx.clone())?,
            Kept::Rebound(Found::Gone)
        );
        for (kind, found) in [
            ("fifo", Found::Fifo),
            ("file", Found::File),
            ("dead socket", Found::Dead),
            ("dangling link", Found::Link),
        ] {
            replace_with(&path, kind)?;
            assert_eq!(look(&path), found, "{kind}");
            assert_eq!(
                socket.keep_in_place(tx.clone())?,
                Kept::Rebound(found),
                "{kind}"
            );
            assert!(socket.is_in_place(), "{kind}");
            // It serves: a client's connection reaches the channel.
            let _client = UnixStream::connect(&path).await?;
            let served = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await;
            assert!(matches!(served, Ok(Some(_))), "{kind}");
        }
        // Another process's live socket under the name is left to it.
        let made = dir.path().join("other.sock");
        let _other = std::os::unix::net::UnixListener::bind(&made)?;
        std::fs::rename(&made, &path)?;
        assert_eq!(look(&path), Found::Live);
        assert_eq!(socket.keep_in_place(tx)?, Kept::LeftTo);
        assert!(!socket.is_in_place());
        Ok(())
    }

    #[tokio::test]
    async fn a_socket_whose_queue_is_full_is_alive_and_looked_at_without_waiting()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("busy.sock");
        // Nobody accepts: connects fill the listener's queue, past which a blocking connect would wait.
        let _listener = std::os::unix::net::UnixListener::bind(&path)?;
        let mut held = Vec::new();
        let address = nix::sys::socket::UnixAddr::new(&path)?;
        loop {
            use nix::sys::socket::{AddressFamily, SockFlag, SockType, connect, socket};
            use std::os::fd::AsRawFd as _;
            let fd = socket(
                AddressFamily::Unix,
                SockType::Stream,
                SockFlag::SOCK_NONBLOCK,
                None,
            )?;
            match connect(fd.as_raw_fd(), &address) {
                Ok(()) => held.push(fd),
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => return Err(e.into()),
            }
            assert!(held.len() < 100_000, "the queue never filled");
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let looked = path.clone();
        std::thread::spawn(move || {
            let _sent = tx.send(look(&looked));
        });
        assert_eq!(rx.recv_timeout(Duration::from_secs(5))?, Found::Live);
        Ok(())
    }

    #[tokio::test]
    async fn stale_sockets_are_removed_and_live_ones_kept() -> Result<(), Box<dyn std::error::Error>>
    {
        let dir = tempfile::tempdir()?;
        let stale = dir.path().join(format!("{SOCKET_PREFIX}dead.sock"));
        drop(std::os::unix::net::UnixListener::bind(&stale)?);
        let live = dir.path().join(format!("{SOCKET_PREFIX}live.sock"));
        let _live = std::os::unix::net::UnixListener::bind(&live)?;
        let other = dir.path().join("other-vendor.sock");
        drop(std::os::unix::net::UnixListener::bind(&other)?);
        // Files and links that only carry our name are left alone (connecting to them is refused as well).
        let file = dir.path().join(format!("{SOCKET_PREFIX}notes.txt"));
        std::fs::write(&file, "kept")?;
        let target = dir.path().join("elsewhere.sock");
        drop(std::os::unix::net::UnixListener::bind(&target)?);
        let link = dir.path().join(format!("{SOCKET_PREFIX}link.sock"));
        std::os::unix::fs::symlink(&target, &link)?;
        assert_eq!(remove_stale_sockets(dir.path()), 1);
        assert!(!stale.exists() && live.exists() && other.exists());
        assert!(file.exists() && link.symlink_metadata().is_ok() && target.exists());
        Ok(())
    }
}
