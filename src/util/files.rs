//! Opening a file from a directory others may write into, without being held up or led elsewhere by it.

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

/// Opens `path` for reading without blocking and without following a link: a FIFO opens at once (and is
/// then refused by its type, which the caller checks on the file it holds), a link fails with `ELOOP`, and a
/// terminal swapped in is not made the plugin's controlling terminal.
pub fn open_unfollowed(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_NOCTTY)
        .open(path)
}
