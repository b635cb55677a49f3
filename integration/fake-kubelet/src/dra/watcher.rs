//! The kubelet's plugin watcher on `plugins_registry`: a recursive inotify watch and a walk at start; a socket
//! that appears is handed to registration, one that goes (or a directory holding it) to deregistration. Each
//! kubelet life starts here. Above `plugins`, which it hands the sockets to.

use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use notify::event::{ModifyKind, RenameMode};
use notify::{EventKind, RecursiveMode, Watcher as _};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::plugins::{FileId, deregister, register_socket};
use super::{Shared, Wipe};

/// Starts a kubelet life: deletes the node's slices (when linked to an API server), then walks and watches
/// `plugins_registry`.
pub(crate) fn start(shared: &Arc<Shared>) {
    let life = CancellationToken::new();
    match shared.life.lock() {
        Ok(mut current) => *current = life.clone(),
        Err(poisoned) => *poisoned.into_inner() = life.clone(),
    }
    if let Some((api, node)) = &shared.options.api {
        let deleted = api.wipe_slices(node, None);
        shared.wipes.send_modify(|w| {
            w.push(Wipe {
                driver: None,
                deleted,
            })
        });
    }
    let task = watch_registry(shared.clone(), life.clone());
    shared.runtime.spawn(async move {
        tokio::select! {
            () = life.cancelled() => {}
            () = task => {}
        }
    });
}

/// Walks and watches `plugins_registry` for as long as `life` runs.
async fn watch_registry(shared: Arc<Shared>, life: CancellationToken) {
    let registry = shared.root.join("plugins_registry");
    let (tx, mut events) = mpsc::unbounded_channel();
    let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if let Ok(event) = event {
            let _closed = tx.send(event);
        }
    })
    .and_then(|mut watcher| {
        watcher.watch(&registry, RecursiveMode::Recursive)?;
        Ok(watcher)
    });
    // Kept for as long as this life runs; without it only the walk below finds plugins.
    let mut watcher = match watcher {
        Ok(watcher) => Some(watcher),
        Err(e) => {
            eprintln!(
                "fake kubelet: cannot watch {}: {e}; plugins there now are still registered",
                registry.display()
            );
            None
        }
    };
    for socket in walk(&registry) {
        appeared(&shared, &life, &socket);
    }
    // The kubelet watches no directory whose name starts with a dot (it ignores one when it appears): what
    // happens under one is not seen. Our watch is recursive, so those paths are left out here.
    let seen = |p: &Path| !p.parent().is_some_and(|dir| under_hidden(&registry, dir));
    while let Some(mut event) = events.recv().await {
        if let EventKind::Modify(ModifyKind::Name(RenameMode::Both)) = event.kind
            && let [from, to] = event.paths.as_slice()
        {
            // A rename out of a hidden directory is, to the kubelet, a file created.
            if !seen(from) && seen(to) {
                appeared(&shared, &life, to);
                continue;
            }
        }
        event.paths.retain(|p| seen(p));
        match event.kind {
            EventKind::Create(_) | EventKind::Modify(ModifyKind::Name(RenameMode::To)) => {
                for path in &event.paths {
                    // A new directory is watched before it is walked, as the kubelet does: notify adds its
                    // watch only after reporting the directory, and a socket made in between would be missed.
                    if path.is_dir()
                        && let Some(watcher) = watcher.as_mut()
                    {
                        let _gone = watcher.watch(path, RecursiveMode::Recursive);
                    }
                    appeared(&shared, &life, path);
                }
            }
            EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(RenameMode::From)) => {
                for path in &event.paths {
                    gone(&shared, path);
                }
            }
            EventKind::Modify(ModifyKind::Name(RenameMode::Both)) => {
                if let [from, to] = event.paths.as_slice() {
                    gone(&shared, from);
                    appeared(&shared, &life, to);
                }
            }
            EventKind::Modify(ModifyKind::Name(_)) => {
                for path in &event.paths {
                    if path.exists() {
                        appeared(&shared, &life, path);
                    } else {
                        gone(&shared, path);
                    }
                }
            }
            _ => {}
        }
    }
}

/// The sockets under `dir`, at any depth; dot-files and what is not a socket are left out, as the kubelet's
/// plugin watcher leaves them.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut sockets = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return sockets;
    };
    for entry in entries.flatten() {
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        let path = entry.path();
        if kind.is_dir() {
            sockets.extend(walk(&path));
        } else if kind.is_socket() && !hidden(&path) {
            sockets.push(path);
        }
    }
    sockets.sort();
    sockets
}

fn hidden(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with('.'))
}

/// Whether `dir` is, or is under, a directory below `registry` whose name starts with a dot.
fn under_hidden(registry: &Path, dir: &Path) -> bool {
    dir.strip_prefix(registry).is_ok_and(|rel| {
        rel.components()
            .any(|c| c.as_os_str().to_string_lossy().starts_with('.'))
    })
}

/// A file appeared at `path`: a socket is registered (again, if it was another file before); a directory's
/// sockets are. As the kubelet, it looks at the file before at its name: one gone by then is an error in
/// its log, whatever its name.
fn appeared(shared: &Arc<Shared>, life: &CancellationToken, path: &Path) {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) => {
            let line = format!(
                "Error when handling create event: stat file {} failed: {e}",
                path.display()
            );
            if let Ok(mut errors) = shared.watch_errors.lock() {
                errors.push(line);
            }
            return;
        }
    };
    // A dot-file is ignored, and a dot-directory neither walked nor watched (see `seen` above).
    if hidden(path) {
        return;
    }
    if meta.is_dir() {
        for socket in walk(path) {
            appeared(shared, life, &socket);
        }
        return;
    }
    if !meta.file_type().is_socket() {
        return;
    }
    let id = FileId {
        inode: meta.ino(),
        ctime: (meta.ctime(), meta.ctime_nsec()),
    };
    let token = life.child_token();
    let replaced = {
        let Ok(mut store) = shared.plugins.lock() else {
            return;
        };
        if life.is_cancelled() {
            return;
        }
        if store
            .sockets
            .get(path)
            .is_some_and(|(known, _)| *known == id)
        {
            // The same file seen twice (the walk and an event): nothing changed.
            return;
        }
        let old = store.sockets.insert(path.to_owned(), (id, token.clone()));
        old.map(|(_, old)| deregister(shared, &mut store, path, &old, life))
    };
    drop(replaced);
    let task = register_socket(shared.clone(), path.to_owned(), token.clone(), life.clone());
    shared.runtime.spawn(async move {
        tokio::select! {
            () = token.cancelled() => {}
            () = task => {}
        }
    });
}

/// `path` is gone: every registration socket at or under it is deregistered.
fn gone(shared: &Arc<Shared>, path: &Path) {
    let life = shared.life();
    let removed = {
        let Ok(mut store) = shared.plugins.lock() else {
            return;
        };
        let sockets: Vec<PathBuf> = store
            .sockets
            .keys()
            .filter(|s| s.starts_with(path))
            .cloned()
            .collect();
        let mut removed = Vec::new();
        for socket in sockets {
            if let Some((_, token)) = store.sockets.remove(&socket) {
                removed.extend(deregister(shared, &mut store, &socket, &token, &life));
            }
        }
        removed
    };
    drop(removed);
}
