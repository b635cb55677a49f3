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
        // Only a socket itself: a regular file or a link with our name is not ours to delete.
        let is_socket = entry.file_type().is_ok_and(|t| {
            use std::os::unix::fs::FileTypeExt as _;
            t.is_socket()
        });
        if !is_socket {
            continue;
        }
        let path = entry.path();
        let refused = matches!(
            std::os::unix::net::UnixStream::connect(&path),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused
        );
        if refused && std::fs::remove_file(&path).is_ok() {
            tracing::info!(socket = %path.display(), "removed a stale socket left by an earlier instance");
            removed += 1;
        }
    }
    removed
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
