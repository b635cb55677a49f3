//! Watching the device plugin directory with inotify for the two signs of a kubelet restart: `kubelet.sock`
//! created, and our own socket removed (the kubelet deletes every socket in the directory when it starts);
//! and for the directory itself moved or deleted, after which nothing this process binds can reach the
//! kubelet (see [`DirWatch::replaced`]). Also for another plugin's socket removed: on kubelets up to 1.36 a
//! plugin of our resource that registered after us took the resource's only client, and the kubelet drops
//! that client when the plugin stops, leaving ours unregistered with its stream still open (see
//! [`DirWatch::take_other_left`]). Only a socket that can have been a plugin counts ([`others`]).

mod others;

use std::ffi::{OsStr, OsString};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use notify::event::{ModifyKind, RenameMode};
use notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::Notify;

use super::KubeletError;
use super::socket::SOCKET_PREFIX;
use crate::api::KUBELET_SOCKET;
use others::Others;

/// A running watch. Events are coalesced into one pending wake-up: whoever wakes looks at the directory as
/// it is now, so a burst of deletions during a kubelet restart costs one re-registration, and nothing is
/// lost when the watcher's queue overflows.
pub struct DirWatch {
    _watcher: RecommendedWatcher,
    wake: Arc<Notify>,
    /// The other sockets of the directory, and whether one that can have been a plugin went since the last
    /// look.
    others: Arc<Others>,
    dir: PathBuf,
    /// Device and inode of the directory watched.
    identity: Option<(u64, u64)>,
}

fn identity(dir: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(dir).ok().map(|m| (m.dev(), m.ino()))
}

impl DirWatch {
    /// Starts watching `dir` for `kubelet.sock` appearing or `our_socket` disappearing.
    pub fn start(dir: &Path, our_socket: &str) -> Result<Self, KubeletError> {
        let wake = Arc::new(Notify::new());
        let notify = wake.clone();
        let others = Others::new(dir, wake.clone());
        let seen = others.clone();
        let ours = OsString::from(our_socket);
        let candidates = ours.clone();
        let watched = dir.to_path_buf();
        let mut watcher = notify::recommended_watcher(move |event: notify::Result<Event>| {
            if sort(&event, &ours, &watched, &seen) {
                notify.notify_one();
            }
        })
        .map_err(|e| KubeletError::Watch {
            dir: dir.to_owned(),
            source: e,
        })?;
        watcher
            .watch(dir, RecursiveMode::NonRecursive)
            .map_err(|e| KubeletError::Watch {
                dir: dir.to_owned(),
                source: e,
            })?;
        // After the watch starts, so that no socket slips between the two: those there already (a plugin
        // may register after us although its socket is older) are looked at too.
        others.rescan(|name| is_other_socket(name, &candidates));
        Ok(DirWatch {
            _watcher: watcher,
            wake,
            others,
            dir: dir.to_path_buf(),
            identity: identity(dir),
        })
    }

    /// Whether the directory at the watched path is no longer the one watched: moved away, deleted, or
    /// replaced by a new one. The kubelet looks for sockets at the path; the watch and our socket are in the
    /// old directory, out of its reach. (In a pod, the hostPath mount keeps showing the old directory:
    /// only a restart of the plugin mounts the new one.)
    pub fn replaced(&self) -> bool {
        identity(&self.dir) != self.identity
    }

    /// Whether another plugin's socket was removed since the last call. The kubelet keeps no record we can
    /// ask of which plugin it uses for a resource, so a plugin registered with its stream open registers again
    /// when this says so: if the plugin that left had taken our resource, the kubelet uses us again; if not,
    /// the kubelet only replaces our client with a new one of ours.
    pub fn take_other_left(&self) -> bool {
        self.others.take_left()
    }

    /// Waits until something relevant happened since the last wake-up.
    pub async fn changed(&self) {
        self.wake.notified().await;
    }
}

/// Whether `event` is worth a look at the directory; tells `others` of the other sockets that appeared and
/// went, which notes whether one that can have been a plugin went.
fn sort(event: &notify::Result<Event>, ours: &OsString, dir: &Path, others: &Arc<Others>) -> bool {
    match event {
        Ok(event) => {
            // A queue overflow (inotify's IN_Q_OVERFLOW, a rescan for notify) lost events we cannot know: a
            // kubelet restart among them is seen by looking at the directory, but another plugin's socket
            // removed leaves no trace there, so it counts as one that may have gone.
            if event.need_rescan() {
                tracing::warn!(
                    dir = %dir.display(),
                    "events in the device plugin directory were lost (its inotify queue overflowed); looking at \
                     it again, and registering again in case another plugin of this resource left meanwhile"
                );
                others.lost_track(|name| is_other_socket(name, ours));
                return true;
            }
            let mut other_gone = false;
            for name in other_sockets(event, ours) {
                if vanished(event) {
                    other_gone |= others.vanished(name);
                } else if appeared(event) {
                    others.appeared(name);
                }
            }
            other_gone || is_restart_sign(event, ours) || is_about_dir(event, dir)
        }
        // A watch error: we may have missed anything, another plugin's socket going included.
        Err(e) => {
            tracing::warn!(error = %e, "device plugin directory watch reported an error");
            others.lost_track(|name| is_other_socket(name, ours));
            true
        }
    }
}

/// An event on the watched directory itself (inotify's `IN_MOVE_SELF`, `IN_DELETE_SELF`).
fn is_about_dir(event: &Event, dir: &Path) -> bool {
    let moved_or_gone = matches!(
        event.kind,
        EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(_))
    );
    moved_or_gone && event.paths.iter().any(|p| p == dir)
}

/// The names in `event` that may be another plugin's socket (see [`is_other_socket`]).
fn other_sockets<'a>(event: &'a Event, ours: &'a OsString) -> impl Iterator<Item = &'a OsStr> + 'a {
    event
        .paths
        .iter()
        .filter_map(|p| p.file_name())
        .filter(move |name| is_other_socket(name, ours))
}

/// A name another plugin's socket may have: not ours, not `kubelet.sock`, and not another instance's of
/// this plugin (a rolling update's old instance: the kubelet's own handling of its stream's end is followed
/// through our streams).
fn is_other_socket(name: &OsStr, ours: &OsString) -> bool {
    let text = name.to_string_lossy();
    name != KUBELET_SOCKET
        && name != ours.as_os_str()
        && !text.trim_start_matches('.').starts_with(SOCKET_PREFIX)
        && Path::new(name).extension().is_some_and(|e| e == "sock")
}

/// An entry removed or renamed away.
fn vanished(event: &Event) -> bool {
    matches!(
        event.kind,
        EventKind::Remove(_)
            | EventKind::Modify(ModifyKind::Name(RenameMode::From | RenameMode::Any))
    )
}

/// An entry created or renamed into the directory. (A rename within it is also reported as one event with
/// both names, after the two above; that one is left alone.)
fn appeared(event: &Event) -> bool {
    matches!(
        event.kind,
        EventKind::Create(_) | EventKind::Modify(ModifyKind::Name(RenameMode::To))
    )
}

fn is_restart_sign(event: &Event, ours: &OsString) -> bool {
    let appeared = matches!(
        event.kind,
        EventKind::Create(_)
            | EventKind::Modify(ModifyKind::Name(
                RenameMode::To | RenameMode::Both | RenameMode::Any
            ))
    );
    if event.need_rescan() {
        return true;
    }
    event.paths.iter().any(|p| match p.file_name() {
        Some(name) if name == KUBELET_SOCKET => appeared,
        Some(name) if name == ours.as_os_str() => vanished(event),
        _ => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use notify::event::{CreateKind, RemoveKind};
    use std::path::PathBuf;

    fn event(kind: EventKind, name: &str) -> Event {
        Event::new(kind).add_path(PathBuf::from("/d").join(name))
    }

    #[test]
    fn kubelet_socket_created_and_our_socket_removed_are_restart_signs() {
        let ours = OsString::from("gpu-device-plugin-1.sock");
        assert!(is_restart_sign(
            &event(EventKind::Create(CreateKind::File), "kubelet.sock"),
            &ours
        ));
        assert!(is_restart_sign(
            &event(
                EventKind::Remove(RemoveKind::File),
                "gpu-device-plugin-1.sock"
            ),
            &ours
        ));
    }

    #[test]
    fn the_directory_moved_or_deleted_wakes_the_supervisor() {
        let dir = Path::new("/d");
        let moved = Event::new(EventKind::Modify(ModifyKind::Name(RenameMode::From)))
            .add_path(PathBuf::from("/d"));
        assert!(is_about_dir(&moved, dir));
        let deleted =
            Event::new(EventKind::Remove(RemoveKind::Folder)).add_path(PathBuf::from("/d"));
        assert!(is_about_dir(&deleted, dir));
        assert!(!is_about_dir(
            &event(EventKind::Remove(RemoveKind::File), "other.sock"),
            dir
        ));
    }

    #[test]
    fn another_plugins_socket_is_told_apart_from_ours_and_the_kubelets() {
        let ours = OsString::from("gpu-device-plugin-1.sock");
        assert!(is_other_socket(OsStr::new("nvidia-gpu.sock"), &ours));
        for name in [
            "gpu-device-plugin-1.sock",
            "gpu-device-plugin-2.sock",
            "kubelet.sock",
            "kubelet_internal_checkpoint",
        ] {
            assert!(!is_other_socket(OsStr::new(name), &ours), "{name}");
        }
    }

    #[tokio::test]
    async fn a_queue_overflow_counts_as_another_plugins_socket_that_may_have_gone() {
        let ours = OsString::from("gpu-device-plugin-1.sock");
        let dir = Path::new("/d");
        let others = || Others::new(dir, Arc::new(tokio::sync::Notify::new()));
        let overflow = Ok(Event::new(EventKind::Other).set_flag(notify::event::Flag::Rescan));
        let seen = others();
        assert!(sort(&overflow, &ours, dir, &seen));
        assert!(seen.take_left(), "an overflow may hide a plugin's exit");
        let failed = Err(notify::Error::generic("the watch failed"));
        let seen = others();
        assert!(sort(&failed, &ours, dir, &seen));
        assert!(seen.take_left());
        // A removal of ours or the kubelet's is no other plugin's.
        let seen = others();
        for name in ["gpu-device-plugin-1.sock", "kubelet.sock"] {
            let gone = Ok(event(EventKind::Remove(RemoveKind::File), name));
            sort(&gone, &ours, dir, &seen);
        }
        assert!(!seen.take_left());
    }

    #[test]
    fn unrelated_events_are_not_restart_signs() {
        let ours = OsString::from("gpu-device-plugin-1.sock");
        // The kubelet going away, another plugin's socket, and our own re-bind are not reasons to act.
        assert!(!is_restart_sign(
            &event(EventKind::Remove(RemoveKind::File), "kubelet.sock"),
            &ours
        ));
        assert!(!is_restart_sign(
            &event(EventKind::Remove(RemoveKind::File), "other.sock"),
            &ours
        ));
        assert!(!is_restart_sign(
            &event(
                EventKind::Modify(ModifyKind::Name(RenameMode::To)),
                "gpu-device-plugin-1.sock"
            ),
            &ours
        ));
    }
}
