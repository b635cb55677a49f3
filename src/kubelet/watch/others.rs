//! Which of the other sockets in the kubelet's directory can have been a device plugin, so that only the
//! removal of one of those makes this plugin register again.
//!
//! Nothing here can ask the kubelet which plugin it uses, but one thing every registered plugin did is
//! visible from the directory: it served its socket. The kubelet dials a plugin back (and calls
//! GetDevicePluginOptions) before its `Register` returns, so a plugin serves before it registers, and a
//! path that never accepted a connection (a regular file named `x.sock`, a socket nobody listens on, one
//! gone before anyone could dial it) cannot have taken the resource from us. Each `*.sock` that appears is
//! looked at: its file type, then a connect that never waits, tried again while the socket is there and
//! refuses (a server's `bind` makes the file, its `listen` comes after).
//!
//! A removal counts as "another plugin may have gone" when the socket was seen accepting (one removed while
//! it is still being looked at is decided by that look), and when the name was never tracked (more than
//! [`MAX_TRACKED`] at once, or no runtime to look with): the plugin cannot rule those out. Which resource a
//! plugin served is not visible from the directory, so any plugin's socket counts.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;

/// The most sockets tracked at once. A directory holds a handful of plugins; past this, a removal counts
/// as a plugin's that may have gone, as every removal did before sockets were looked at.
pub const MAX_TRACKED: usize = 64;

/// The first wait before a socket that refused is tried again; doubled each time up to [`LOOK_AGAIN_MAX`].
const LOOK_AGAIN_FIRST: Duration = Duration::from_millis(1);

/// The longest wait between two tries of a socket that refuses: one connection attempt a second per such
/// socket while it stays.
const LOOK_AGAIN_MAX: Duration = Duration::from_secs(1);

/// The other sockets of the directory, as far as they have been looked at; and the flag and wake-up that
/// tell the supervisor another plugin may have gone.
pub struct Others {
    dir: PathBuf,
    seen: Mutex<Seen>,
    /// Set when another plugin may have gone since the supervisor last asked.
    left: AtomicBool,
    wake: Arc<Notify>,
    /// Where the looks run; none outside a runtime, and then no socket is tracked.
    runtime: Option<tokio::runtime::Handle>,
}

#[derive(Default)]
struct Seen {
    names: HashMap<OsString, Entry>,
    /// Numbers the lookers, so that one left behind by a name dropped and tracked again stops.
    next_looker: u64,
}

struct Entry {
    state: State,
    /// The looker running for this name, if one is.
    looker: Option<u64>,
    /// Bumped each time the name appears again, so a look begun on an older file is not taken for it.
    generation: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Being looked at; `removed` once the name was removed meanwhile (decided when the look ends).
    Looking { removed: bool },
    /// Seen accepting a connection: it can have been a plugin.
    Accepting,
    /// Not a socket, or gone before it accepted: its removal is no plugin's.
    NotAPlugin,
}

/// What a looker does after a look.
enum Next {
    /// The name is settled, or no longer this looker's.
    Done,
    /// The name appeared again: look at once.
    Again,
    /// It refused: look again after the spacing.
    Later,
}

/// What one look at a path found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Look {
    Accepting,
    NotAPlugin,
    /// A socket that refused (or a look that failed): try again while it is there.
    Refused,
}

impl Others {
    /// Others of `dir`; `wake` is the supervisor's wake-up.
    pub fn new(dir: &Path, wake: Arc<Notify>) -> Arc<Self> {
        Arc::new(Others {
            dir: dir.to_path_buf(),
            seen: Mutex::new(Seen::default()),
            left: AtomicBool::new(false),
            wake,
            runtime: tokio::runtime::Handle::try_current().ok(),
        })
    }

    fn seen(&self) -> MutexGuard<'_, Seen> {
        // A panic while holding the lock leaves the map as consistent as any single step leaves it.
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether another plugin may have gone since the last call.
    pub fn take_left(&self) -> bool {
        self.left.swap(false, Ordering::SeqCst)
    }

    /// Another plugin may have gone: set the flag and wake the supervisor.
    fn may_have_left(&self) {
        self.left.store(true, Ordering::SeqCst);
        self.wake.notify_one();
    }

    /// A socket name appeared (created, or renamed into the directory): look at it.
    pub fn appeared(self: &Arc<Self>, name: &OsStr) {
        let Some(runtime) = &self.runtime else {
            return;
        };
        let mut seen = self.seen();
        if !seen.names.contains_key(name) && seen.names.len() >= MAX_TRACKED {
            return;
        }
        seen.next_looker += 1;
        let id = seen.next_looker;
        let entry = seen.names.entry(name.to_owned()).or_insert(Entry {
            state: State::NotAPlugin,
            looker: None,
            generation: 0,
        });
        entry.generation += 1;
        entry.state = State::Looking { removed: false };
        if entry.looker.is_none() {
            entry.looker = Some(id);
            runtime.spawn(self.clone().look_until_known(name.to_owned(), id));
        }
    }

    /// A socket name was removed (or renamed away). Returns whether the removal counts now as another
    /// plugin's that may have gone (the flag is set then); one still being looked at is decided later.
    pub fn vanished(&self, name: &OsStr) -> bool {
        let mut seen = self.seen();
        let counts = match seen.names.get_mut(name) {
            // Never tracked: it cannot be ruled out.
            None => true,
            Some(entry) => match entry.state {
                State::Looking { .. } => {
                    entry.state = State::Looking { removed: true };
                    return false;
                }
                State::Accepting => true,
                State::NotAPlugin => false,
            },
        };
        seen.names.remove(name);
        drop(seen);
        if counts {
            self.left.store(true, Ordering::SeqCst);
        }
        counts
    }

    /// Events were lost (a queue overflow, a watch error): another plugin may have gone unseen, and what is
    /// tracked may be out of date, so it is brought up to what the directory holds now.
    pub fn lost_track(self: &Arc<Self>, candidate: impl Fn(&OsStr) -> bool) {
        self.left.store(true, Ordering::SeqCst);
        self.rescan(candidate);
    }

    /// Tracks what the directory holds now: names gone are dropped, names not yet tracked looked at.
    pub fn rescan(self: &Arc<Self>, candidate: impl Fn(&OsStr) -> bool) {
        let present: Vec<OsString> = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries
                .filter_map(Result::ok)
                .map(|e| e.file_name())
                .filter(|n| candidate(n))
                .collect(),
            Err(e) => {
                tracing::debug!(dir = %self.dir.display(), error = %e, "cannot list the device plugin directory");
                return;
            }
        };
        let new: Vec<OsString> = {
            let mut seen = self.seen();
            seen.names.retain(|name, _| present.contains(name));
            present
                .into_iter()
                .filter(|n| !seen.names.contains_key(n))
                .collect()
        };
        for name in new {
            self.appeared(&name);
        }
    }

    /// Looks at `name` until it is known to accept, known to be no plugin's, or dropped; `id` is this
    /// looker's number.
    async fn look_until_known(self: Arc<Self>, name: OsString, id: u64) {
        let path = self.dir.join(&name);
        let mut wait = LOOK_AGAIN_FIRST;
        while let Some(generation) = self.generation_for(&name, id) {
            let look = look(&path);
            match self.settle(&name, id, generation, look) {
                Next::Done => return,
                Next::Again => wait = LOOK_AGAIN_FIRST,
                Next::Later => {
                    // A retry's spacing, not a wait for anything: listen() makes no inotify event.
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(LOOK_AGAIN_MAX);
                }
            }
        }
    }

    /// What a look found makes of `name`'s entry, and what its looker does next.
    fn settle(&self, name: &OsStr, id: u64, generation: u64, look: Look) -> Next {
        let mut seen = self.seen();
        let Some(entry) = seen.names.get_mut(name) else {
            return Next::Done;
        };
        if entry.looker != Some(id) {
            return Next::Done;
        }
        if entry.generation != generation {
            // The name appeared again meanwhile: look at the new file.
            return Next::Again;
        }
        let removed = matches!(entry.state, State::Looking { removed: true });
        match look {
            Look::Refused if !removed => return Next::Later,
            Look::Accepting if removed => {
                seen.names.remove(name);
                drop(seen);
                self.may_have_left();
            }
            Look::Accepting => {
                entry.state = State::Accepting;
                entry.looker = None;
            }
            // Removed before it accepted, or no socket: no plugin's.
            Look::Refused | Look::NotAPlugin if removed => {
                seen.names.remove(name);
            }
            Look::Refused | Look::NotAPlugin => {
                entry.state = State::NotAPlugin;
                entry.looker = None;
            }
        }
        Next::Done
    }

    /// The generation of `name` for looker `id`, or `None` when the name is dropped or has another looker.
    fn generation_for(&self, name: &OsStr, id: u64) -> Option<u64> {
        self.seen()
            .names
            .get(name)
            .filter(|e| e.looker == Some(id))
            .map(|e| e.generation)
    }

    /// How many names are tracked now (for tests).
    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.seen().names.len()
    }
}

/// One look at `path`, with the look a served socket's own path gets ([`crate::kubelet::socket::look`]): a
/// socket that accepts a connection (or whose queue is full: it listens all the same), one that refuses, or
/// anything else (gone, a file, a FIFO, a link).
fn look(path: &Path) -> Look {
    use crate::kubelet::socket::Found;
    match crate::kubelet::socket::look(path) {
        Found::Live => Look::Accepting,
        Found::Dead => Look::Refused,
        Found::Gone | Found::Fifo | Found::File | Found::Link | Found::Other => Look::NotAPlugin,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    /// Waits for `done` on `others`, each change woken by a look ending; at most 5 s.
    async fn settled(others: &Others, name: &str, done: impl Fn(Option<State>) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let state = others.seen().names.get(OsStr::new(name)).map(|e| e.state);
            if done(state) {
                return true;
            }
            if tokio::time::Instant::now() > deadline {
                return false;
            }
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_socket_that_accepted_counts_when_removed() -> TestResult {
        let dir = tempfile::tempdir()?;
        let others = Others::new(dir.path(), Arc::new(Notify::new()));
        let listener = UnixListener::bind(dir.path().join("nvidia-gpu.sock"))?;
        others.appeared(OsStr::new("nvidia-gpu.sock"));
        assert!(settled(&others, "nvidia-gpu.sock", |s| s == Some(State::Accepting)).await);
        std::fs::remove_file(dir.path().join("nvidia-gpu.sock"))?;
        drop(listener);
        assert!(others.vanished(OsStr::new("nvidia-gpu.sock")));
        assert!(others.take_left());
        assert_eq!(others.tracked(), 0);
        Ok(())
    }

    #[tokio::test]
    async fn a_regular_file_or_a_socket_nobody_listens_on_is_no_plugins() -> TestResult {
        let dir = tempfile::tempdir()?;
        let others = Others::new(dir.path(), Arc::new(Notify::new()));
        std::fs::write(dir.path().join("x.sock"), b"")?;
        others.appeared(OsStr::new("x.sock"));
        assert!(settled(&others, "x.sock", |s| s == Some(State::NotAPlugin)).await);
        assert!(!others.vanished(OsStr::new("x.sock")));

        // Bound, never listened on: it refuses, is looked at again while there, and its removal is no
        // plugin's.
        use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, bind, socket};
        let path = dir.path().join("quiet.sock");
        let fd = socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::empty(),
            None,
        )?;
        bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &UnixAddr::new(&path)?)?;
        others.appeared(OsStr::new("quiet.sock"));
        assert!(!others.vanished(OsStr::new("quiet.sock")));
        std::fs::remove_file(&path)?;
        assert!(settled(&others, "quiet.sock", |s| s.is_none()).await);
        assert!(!others.take_left());
        Ok(())
    }

    #[tokio::test]
    async fn a_name_never_tracked_counts_when_removed() {
        let dir = Path::new("/nonexistent-for-this-test");
        let others = Others::new(dir, Arc::new(Notify::new()));
        assert!(others.vanished(OsStr::new("from-before.sock")));
        assert!(others.take_left());
    }

    #[tokio::test]
    async fn a_lost_track_counts_and_tracks_what_the_directory_holds() -> TestResult {
        let dir = tempfile::tempdir()?;
        let others = Others::new(dir.path(), Arc::new(Notify::new()));
        let _listener = UnixListener::bind(dir.path().join("a.sock"))?;
        std::fs::write(dir.path().join("b.sock"), b"")?;
        others.lost_track(|n| Path::new(n).extension().is_some_and(|e| e == "sock"));
        assert!(others.take_left());
        assert!(settled(&others, "a.sock", |s| s == Some(State::Accepting)).await);
        assert!(settled(&others, "b.sock", |s| s == Some(State::NotAPlugin)).await);
        Ok(())
    }
}
