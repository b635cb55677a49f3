//! Reading the fence directory, on a thread of its own: every call here may block on the file system (a
//! stuck mount, a slow disk), so none runs on the async thread that carries faults to the kubelet. The
//! thread also keeps the inotify watch on the directory, made again when the directory is replaced.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fs::{DirEntry, FileType};
use std::hash::Hasher as _;
use std::io::Read as _;
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use notify::event::{AccessKind, AccessMode, ModifyKind};
use notify::{EventKind, RecursiveMode, Watcher as _};
use tokio::sync::{mpsc, oneshot};

use super::{Report, parse_report};

/// The largest report read.
pub const MAX_REPORT_BYTES: u64 = 64 * 1024;

/// The most reports read in one reading of the directory, the first by name: at most this many files are
/// opened, and at most 16 MiB read, however many a detector leaves there.
pub const MAX_REPORTS: usize = 256;

/// What one reading found.
#[derive(Debug)]
pub enum Reading {
    /// The directory could not be listed (gone, replaced by a file, out of file descriptors): nothing can be
    /// said about its reports, so every fence from it stays as it is.
    Unreadable {
        /// Why, as the system said it.
        why: String,
    },
    /// The directory as it was listed.
    Listed(Listing),
}

/// The report files of a directory that could be listed.
#[derive(Debug, Default)]
pub struct Listing {
    /// Usable reports, by file name.
    pub reports: BTreeMap<String, Report>,
    /// Report files that exist but cannot be used now (being written, unparseable, not a regular file,
    /// unreadable, past [`MAX_REPORTS`]): a fence from one of them stays as it is until the file is gone.
    pub held: BTreeSet<String>,
    /// What is wrong with the files that cannot be used.
    pub problems: Vec<Problem>,
    /// Report files past [`MAX_REPORTS`], not read.
    pub unread: usize,
}

/// A report file that cannot be used, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The file's name, printable (see [`crate::util::text::printable`]).
    pub file: String,
    /// Why it cannot be used.
    pub why: String,
    /// Changes when the file or the problem does, so that a problem is said again only when it is new.
    pub version: u64,
    /// Whether a fence from this file is kept (the file exists under a name that can be a report's).
    pub held: bool,
}

/// A reading, and whether the directory is watched for changes (if not, it must be read again without
/// waiting for a change).
#[derive(Debug)]
pub struct Answer {
    /// What was read.
    pub reading: Reading,
    /// `Err` with why when the directory is not watched now.
    pub watched: Result<(), String>,
}

/// The thread that reads the directory.
#[derive(Debug)]
pub struct Reader {
    requests: std::sync::mpsc::Sender<Request>,
}

/// One reading asked for: the files whose fences are in place, to look for past [`MAX_REPORTS`].
struct Request {
    keep: Vec<String>,
    reply: oneshot::Sender<Answer>,
}

impl Reader {
    /// Starts the thread that watches and reads `dir`; every change there is a message on `wake` (one
    /// pending at most: changes that come while one waits are the same news). The thread ends when the
    /// reader is dropped.
    pub fn spawn(dir: PathBuf, wake: mpsc::Sender<()>) -> std::io::Result<Reader> {
        let (requests, asked) = std::sync::mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("fence-dir".into())
            .spawn(move || {
                crate::util::runtime::lower_priority();
                let mut watch = DirWatch {
                    dir,
                    wake,
                    current: None,
                };
                while let Ok(request) = asked.recv() {
                    // Watched before it is read, so that no change after the reading goes unseen.
                    let watched = watch.ensure();
                    let reading = read(&watch.dir, &request.keep, MAX_REPORTS);
                    let _gone = request.reply.send(Answer { reading, watched });
                }
            })?;
        Ok(Reader { requests })
    }

    /// Asks for a reading; `keep` names the files whose fences are in place. The answer comes when the
    /// thread has read the directory: never, if the file system does not answer.
    pub fn read(&self, keep: Vec<String>) -> oneshot::Receiver<Answer> {
        let (reply, answer) = oneshot::channel();
        // If the thread is gone the answer's sender is dropped with the request, which the caller sees.
        let _sent = self.requests.send(Request { keep, reply });
        answer
    }
}

/// The inotify watch on the directory, and which directory it is on (device and inode): a directory
/// replaced by a rename is a new one to watch. A directory removed and made again at once often gets the
/// same inode number back (ext4 hands it out again), so the watch also notes when the kernel says the
/// directory it watched is gone or moved: the kernel drops that watch, and a new one is needed whatever the
/// inode number says.
struct DirWatch {
    dir: PathBuf,
    wake: mpsc::Sender<()>,
    current: Option<Current>,
}

/// The watch in place.
struct Current {
    /// Kept for as long as the watch is wanted: dropping it ends the watch.
    _watcher: notify::RecommendedWatcher,
    /// The directory's device and inode when it was watched.
    id: (u64, u64),
    /// Set from the watcher's thread when the watched directory itself was removed or moved away.
    lost: Arc<AtomicBool>,
}

impl DirWatch {
    /// Watches the directory now at the path, unless it is the one watched already.
    fn ensure(&mut self) -> Result<(), String> {
        let metadata = match std::fs::metadata(&self.dir) {
            Ok(m) if m.is_dir() => m,
            Ok(_) => {
                self.current = None;
                return Err("not a directory".into());
            }
            Err(e) => {
                self.current = None;
                return Err(e.to_string());
            }
        };
        let id = (metadata.dev(), metadata.ino());
        if self
            .current
            .as_ref()
            .is_some_and(|c| c.id == id && !c.lost.load(Ordering::SeqCst))
        {
            return Ok(());
        }
        self.current = None;
        let wake = self.wake.clone();
        let lost = Arc::new(AtomicBool::new(false));
        let (dir, lost_here) = (self.dir.clone(), lost.clone());
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                // Noted before the wake-up, so that the reading it brings watches the directory anew.
                if is_self_gone(&event, &dir) {
                    lost_here.store(true, Ordering::SeqCst);
                }
                if is_change(&event) {
                    // Full means a wake-up is pending already, which covers this change too.
                    let _pending = wake.try_send(());
                }
            })
            .map_err(|e| e.to_string())?;
        watcher
            .watch(&self.dir, RecursiveMode::NonRecursive)
            .map_err(|e| e.to_string())?;
        self.current = Some(Current {
            _watcher: watcher,
            id,
            lost,
        });
        Ok(())
    }
}

/// Whether an event says the watched directory `dir` itself was removed or moved away (its own path, not a
/// file in it), or that events were lost: either way the watch is to be made again.
fn is_self_gone(event: &notify::Result<notify::Event>, dir: &Path) -> bool {
    let Ok(event) = event else {
        return true;
    };
    matches!(
        event.kind,
        EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(_))
    ) && event.paths.iter().any(|p| p == dir)
}

/// Whether an inotify event may mean a report added, changed or removed. The plugin's own reading opens the
/// directory and each report (inotify says open, and notify's mask cannot leave it out), and those events
/// must not wake it, or each reading would start the next. A write is a change as it happens, not only when
/// its writer closes the file: a detector may keep its report open.
pub fn is_change(event: &notify::Result<notify::Event>) -> bool {
    let Ok(event) = event else {
        // The watch failing (the queue overflowed): look again.
        return true;
    };
    match event.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        // Written, created, removed, renamed, attributes changed, the directory's own removal or move, and
        // anything the watcher cannot classify (a rescan).
        _ => true,
    }
}

/// Reads the report files of `dir`: at most `cap` of them, the first by name. Files named in `keep` (those
/// whose fences are in place) past the cap are only looked for, so that their fences stay while they exist.
pub fn read(dir: &Path, keep: &[String], cap: usize) -> Reading {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => return Reading::Unreadable { why: e.to_string() },
    };
    // The first `cap` names only, so that a directory of a million files costs `cap` names of memory.
    let mut first: BTreeMap<OsString, DirEntry> = BTreeMap::new();
    let mut candidates = 0usize;
    for entry in entries {
        // A listing cut short says nothing about the files it did not reach.
        let entry = match entry {
            Ok(entry) => entry,
            Err(e) => return Reading::Unreadable { why: e.to_string() },
        };
        let name = entry.file_name();
        let bytes = name.as_encoded_bytes();
        // Hidden files are a detector's temporary files, renamed into place when complete.
        if bytes.starts_with(b".") || !bytes.ends_with(b".json") {
            continue;
        }
        candidates += 1;
        first.insert(name, entry);
        if first.len() > cap {
            first.pop_last();
        }
    }
    let mut listing = Listing {
        unread: candidates - first.len(),
        ..Listing::default()
    };
    for (name, entry) in &first {
        read_entry(name, entry, &mut listing);
    }
    if listing.unread > 0 {
        for key in keep {
            if first.contains_key(std::ffi::OsStr::new(key)) {
                continue;
            }
            match std::fs::symlink_metadata(dir.join(key)) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                // There, or cannot tell: kept either way.
                _ => {
                    listing.held.insert(key.clone());
                }
            }
        }
    }
    listing
        .problems
        .sort_by(|a, b| a.file.cmp(&b.file).then(a.why.cmp(&b.why)));
    Reading::Listed(listing)
}

/// One report file into `listing`: a report, or a problem.
fn read_entry(name: &std::ffi::OsStr, entry: &DirEntry, listing: &mut Listing) {
    let (why, version, held) = match examine(name, entry) {
        Examined::Report(key, report) => {
            listing.reports.insert(key, report);
            return;
        }
        Examined::Gone => return,
        Examined::BadName(why) => (why, 0, None),
        Examined::Unusable(key, why, version) => (why, version, Some(key)),
    };
    listing.problems.push(Problem {
        file: crate::util::text::shown(&name.to_string_lossy(), crate::util::text::SHOWN_MAX),
        version: hash((version, &why)),
        why,
        held: held.is_some(),
    });
    if let Some(key) = held {
        listing.held.insert(key);
    }
}

/// What a report file turned out to be.
enum Examined {
    /// A report, under its file name.
    Report(String, Report),
    /// Removed since it was listed: as if it had not been there.
    Gone,
    /// A name that cannot be a report's, and why.
    BadName(String),
    /// A file under a report's name that cannot be used now: its name, why, and the file's version.
    Unusable(String, String, u64),
}

fn examine(name: &std::ffi::OsStr, entry: &DirEntry) -> Examined {
    // A name is a key in the fence's "by" and in the log: it must read back as itself.
    let Some(name) = name.to_str() else {
        return Examined::BadName("its name is not UTF-8".into());
    };
    if name.contains(':') {
        return Examined::BadName("its name holds a colon".into());
    }
    if crate::util::text::printable(name) != name {
        return Examined::BadName("its name holds control characters".into());
    }
    let unusable = |why: String, version: u64| Examined::Unusable(name.to_string(), why, version);
    // The entry's own type, from the listing (or lstat where the file system does not say): nothing that is
    // not a regular file is opened at all.
    let kind = match entry.file_type() {
        Ok(kind) => kind,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Examined::Gone,
        Err(e) => return unusable(format!("cannot tell what it is: {e}"), 0),
    };
    if !kind.is_file() {
        let version = entry
            .metadata()
            .map(|m| hash((m.ino(), m.mtime(), m.mtime_nsec())))
            .unwrap_or(0);
        return unusable(not_regular(kind), version);
    }
    let (text, version) = match open_report(&entry.path()) {
        Ok(read) => read,
        Err(Unusable::Gone) => return Examined::Gone,
        Err(Unusable::Problem(why, version)) => return unusable(why, version),
    };
    if text.iter().all(u8::is_ascii_whitespace) {
        return unusable(
            "empty (being written? write it under a hidden name and rename it into place)".into(),
            version,
        );
    }
    match parse_report(&text) {
        Ok(report) => Examined::Report(name.to_string(), report),
        Err(why) => unusable(why, version),
    }
}

/// Why a file that is not a regular file is not read.
fn not_regular(kind: FileType) -> String {
    if kind.is_symlink() {
        return not_regular_link();
    }
    let what = if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_block_device() || kind.is_char_device() {
        "a device"
    } else {
        "not a file"
    };
    format!("not a regular file ({what})")
}

/// Why a report file was not read.
enum Unusable {
    /// Removed since it was listed.
    Gone,
    /// There, and not usable: why, and the file's version where known.
    Problem(String, u64),
}

/// Opens and reads a report without following a link and without blocking on what is not a regular file
/// (a FIFO swapped in after the listing opens at once, and is refused by its type before any read).
fn open_report(path: &Path) -> Result<(Vec<u8>, u64), Unusable> {
    let problem = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Unusable::Gone
        } else if e.raw_os_error() == Some(libc::ELOOP) {
            // Swapped for a link since it was listed.
            Unusable::Problem(not_regular_link(), 0)
        } else {
            Unusable::Problem(format!("cannot read it: {e}"), 0)
        }
    };
    let file = crate::util::files::open_unfollowed(path).map_err(problem)?;
    let metadata = file.metadata().map_err(problem)?;
    let version = hash((
        metadata.ino(),
        metadata.len(),
        metadata.mtime(),
        metadata.mtime_nsec(),
    ));
    if !metadata.is_file() {
        return Err(Unusable::Problem(
            not_regular(metadata.file_type()),
            version,
        ));
    }
    let mut text = Vec::new();
    file.take(MAX_REPORT_BYTES + 1)
        .read_to_end(&mut text)
        .map_err(|e| Unusable::Problem(format!("cannot read it: {e}"), version))?;
    if text.len() as u64 > MAX_REPORT_BYTES {
        return Err(Unusable::Problem(
            format!("larger than {MAX_REPORT_BYTES} bytes"),
            version,
        ));
    }
    Ok((text, version))
}

fn not_regular_link() -> String {
    "a symbolic link, which is not followed: write the report itself here".into()
}

/// A hash of `value`, as a problem's version.
pub fn hash(value: impl std::hash::Hash) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests;
