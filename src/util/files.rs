//! Opening a file from a directory others may write into, without being held up or led elsewhere by it;
//! and telling whether the file at a path is still the one seen before.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::Path;

/// Options that open without blocking and without following a link: a FIFO opens at once (and is then
/// refused by its type, which the caller checks on the file it holds), a link fails with `ELOOP`, and a
/// terminal swapped in is not made the plugin's controlling terminal. The caller adds how it opens.
pub fn unfollowed() -> OpenOptions {
    let mut options = OpenOptions::new();
    options.custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_NOCTTY);
    options
}

/// Opens (making it, mode 0600, when missing) the lock file at `path`, which two instances of the plugin
/// take turns on with `flock`: a regular file, never a link followed or a FIFO waited on.
pub fn open_lock_file(path: &Path) -> Result<File, String> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let file = unfollowed()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return Err(format!("{} is not a regular file", path.display()));
    }
    Ok(file)
}

/// Opens `path` for reading as [`unfollowed`] does.
pub fn open_unfollowed(path: &Path) -> std::io::Result<File> {
    unfollowed().read(true).open(path)
}

/// Which file is at a path: the same file keeps it, a file made again (or written through a temporary file
/// and a rename) gets another. A kubelet restart makes `kubelet.sock` anew; another instance's write replaces
/// the prepared-claim record; a repeated or late directory event about the same file changes nothing.
///
/// The inode alone is not enough: a file system may give a new file the inode just freed. The modification
/// time is set when a file is made or written and nothing but `utimes` changes it otherwise (a link or a
/// chmod changes the ctime); a kubelet restart takes longer than the file system's timestamp granularity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId {
    dev: u64,
    ino: u64,
    mtime: i64,
    mtime_nsec: i64,
}

impl FileId {
    /// The identity of the file at `path`, or `None` when there is none.
    pub fn of(path: &Path) -> Option<FileId> {
        let meta = std::fs::metadata(path).ok()?;
        Some(FileId {
            dev: meta.dev(),
            ino: meta.ino(),
            mtime: meta.mtime(),
            mtime_nsec: meta.mtime_nsec(),
        })
    }
}
