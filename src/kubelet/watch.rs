//! Watching the device plugin directory with inotify for the two signs of a kubelet restart: `kubelet.sock`
//! created, and our own socket removed (the kubelet deletes every socket in the directory when it starts).

use std::ffi::OsString;
use std::path::Path;
use std::sync::Arc;

use notify::event::{ModifyKind, RenameMode};
use notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::Notify;

use super::KubeletError;
use crate::api::KUBELET_SOCKET;

/// A running watch. Events are coalesced into one pending wake-up: whoever wakes looks at the directory as
/// it is now, so a burst of deletions during a kubelet restart costs one re-registration, and nothing is
/// lost when the watcher's queue overflows.
pub struct DirWatch {
    _watcher: RecommendedWatcher,
    wake: Arc<Notify>,
}

impl DirWatch {
    /// Starts watching `dir` for `kubelet.sock` appearing or `our_socket` disappearing.
    pub fn start(dir: &Path, our_socket: &str) -> Result<Self, KubeletError> {
        let wake = Arc::new(Notify::new());
        let notify = wake.clone();
        let ours = OsString::from(our_socket);
        let mut watcher = notify::recommended_watcher(move |event: notify::Result<Event>| {
            let relevant = match event {
                Ok(event) => is_restart_sign(&event, &ours),
                // Queue overflow or a watch error: we may have missed something, so look again.
                Err(e) => {
                    tracing::warn!(error = %e, "device plugin directory watch reported an error");
                    true
                }
            };
            if relevant {
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
        Ok(DirWatch {
            _watcher: watcher,
            wake,
        })
    }

    /// Waits until something relevant happened since the last wake-up.
    pub async fn changed(&self) {
        self.wake.notified().await;
    }
}

fn is_restart_sign(event: &Event, ours: &OsString) -> bool {
    let appeared = matches!(
        event.kind,
        EventKind::Create(_)
            | EventKind::Modify(ModifyKind::Name(
                RenameMode::To | RenameMode::Both | RenameMode::Any
            ))
    );
    let vanished = matches!(
        event.kind,
        EventKind::Remove(_)
            | EventKind::Modify(ModifyKind::Name(RenameMode::From | RenameMode::Any))
    );
    if event.need_rescan() {
        return true;
    }
    event.paths.iter().any(|p| match p.file_name() {
        Some(name) if name == KUBELET_SOCKET => appeared,
        Some(name) if name == ours.as_os_str() => vanished,
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
