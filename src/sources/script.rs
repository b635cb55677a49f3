//! The fault script: a text file of GPU fault commands, one per line, that simulated GPUs and the fake
//! `libnvidia-ml` both follow as it grows, so a test, a benchmark or a person can inject faults with `echo`.
//!
//! ```text
//! xid <uuid> <code>      critical XID error event
//! dbe <uuid>             double-bit ECC error event
//! sbe <uuid>             single-bit ECC error event
//! lost <uuid>            the GPU falls off the bus
//! restore <uuid>         the GPU answers again, as after a reset
//! action <uuid> <0-4>    the driver's recovery action changes (announced by XID 154)
//! ```
//!
//! Blank lines and lines starting with `#` are ignored. A malformed line is reported and skipped; the
//! follower keeps going.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};

/// One fault command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// `xid <uuid> <code>`.
    Xid {
        /// Target GPU.
        uuid: String,
        /// The XID.
        xid: u64,
    },
    /// `dbe <uuid>`.
    Dbe {
        /// Target GPU.
        uuid: String,
    },
    /// `sbe <uuid>`.
    Sbe {
        /// Target GPU.
        uuid: String,
    },
    /// `lost <uuid>`.
    Lost {
        /// Target GPU.
        uuid: String,
    },
    /// `restore <uuid>`.
    Restore {
        /// Target GPU.
        uuid: String,
    },
    /// `action <uuid> <0-4>`.
    Action {
        /// Target GPU.
        uuid: String,
        /// NVML recovery action: 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and reset.
        action: u32,
    },
}

impl Command {
    /// The GPU the command targets.
    pub fn uuid(&self) -> &str {
        match self {
            Command::Xid { uuid, .. }
            | Command::Dbe { uuid }
            | Command::Sbe { uuid }
            | Command::Lost { uuid }
            | Command::Restore { uuid }
            | Command::Action { uuid, .. } => uuid,
        }
    }
}

/// A line that is not a command.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed fault command {line:?}: {why}")]
pub struct ParseError {
    /// The line.
    pub line: String,
    /// What is wrong with it.
    pub why: &'static str,
}

/// Parses one line; `Ok(None)` for a blank line or a comment.
pub fn parse_line(line: &str) -> Result<Option<Command>, ParseError> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let err = |why| ParseError {
        line: line.to_string(),
        why,
    };
    let words: Vec<&str> = line.split_whitespace().collect();
    let uuid = || {
        words
            .get(1)
            .map(|u| u.to_string())
            .ok_or_else(|| err("missing GPU UUID"))
    };
    let arity = |n: usize| {
        if words.len() == n {
            Ok(())
        } else {
            Err(err("wrong number of words"))
        }
    };
    let command = match words[0] {
        "xid" => {
            arity(3)?;
            let xid = words[2]
                .parse()
                .map_err(|_| err("the XID is not a number"))?;
            Command::Xid { uuid: uuid()?, xid }
        }
        "dbe" => {
            arity(2)?;
            Command::Dbe { uuid: uuid()? }
        }
        "sbe" => {
            arity(2)?;
            Command::Sbe { uuid: uuid()? }
        }
        "lost" => {
            arity(2)?;
            Command::Lost { uuid: uuid()? }
        }
        "restore" => {
            arity(2)?;
            Command::Restore { uuid: uuid()? }
        }
        "action" => {
            arity(3)?;
            let action = words[2]
                .parse()
                .ok()
                .filter(|a| *a <= 4)
                .ok_or_else(|| err("the recovery action is not 0-4"))?;
            Command::Action {
                uuid: uuid()?,
                action,
            }
        }
        _ => {
            return Err(err(
                "unknown command (xid, dbe, sbe, lost, restore, action)",
            ));
        }
    };
    Ok(Some(command))
}

/// A line of the file, and whether it was there before following started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Line<'a> {
    /// Present when following started: history, for state such as a lost GPU; not a new event.
    Existing(&'a str),
    /// Appended since: a new event.
    Appended(&'a str),
}

/// Follows a file as it grows, with inotify: each complete line is handed to the callback on the watcher's
/// own thread, as soon as inotify reports the write (no hand-over to another thread, so a fault reaches the
/// callback with one thread wake-up, as a driver's event reaches its waiter). Dropping the follower stops it.
pub struct Follower {
    _watcher: RecommendedWatcher,
    path: PathBuf,
}

impl Follower {
    /// The followed file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A file read as it grows: each read hands over the complete lines written since the last one; a partial
/// last line waits for the rest. A file that shrank (truncated) is read again from its start.
pub struct Tail {
    file: File,
    pending: Vec<u8>,
}

impl Tail {
    /// Opens `path` at its start, creating it empty if it does not exist.
    pub fn open(path: &Path) -> io::Result<Tail> {
        let file = File::options()
            .create(true)
            .append(true)
            .read(true)
            .open(path)?;
        Ok(Tail {
            file,
            pending: Vec::new(),
        })
    }

    /// Hands over each complete line written since the last call.
    pub fn read_lines(&mut self, mut on_line: impl FnMut(&str)) -> io::Result<()> {
        let position = self.file.stream_position()?;
        if self.file.metadata()?.len() < position {
            self.file.seek(SeekFrom::Start(0))?;
            self.pending.clear();
        }
        self.file.read_to_end(&mut self.pending)?;
        let complete = match self.pending.iter().rposition(|&b| b == b'\n') {
            Some(i) => i + 1,
            None => return Ok(()),
        };
        let text: Vec<u8> = self.pending.drain(..complete).collect();
        for line in String::from_utf8_lossy(&text).lines() {
            on_line(line);
        }
        Ok(())
    }
}

/// What the watcher's callback needs: the file and the caller's callback.
struct Reader<F> {
    tail: Tail,
    on_line: F,
}

/// Starts following `path`, creating it empty if it does not exist. Lines already in the file are passed as
/// [`Line::Existing`] before this returns; later lines as [`Line::Appended`].
pub fn follow(path: &Path, on_line: impl FnMut(Line<'_>) + Send + 'static) -> io::Result<Follower> {
    let reader = Arc::new(Mutex::new(Reader {
        tail: Tail::open(path)?,
        on_line,
    }));
    // Held until the existing lines are read: an append the watcher reports meanwhile waits for them, so
    // the order of lines is kept and nothing appended between the watch and the first read is missed.
    let mut first = lock(&reader);
    let shared = reader.clone();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let changed = match event {
            Ok(e) => matches!(
                e.kind,
                EventKind::Modify(_) | EventKind::Create(_) | EventKind::Any
            ),
            Err(_) => true,
        };
        if changed {
            let reader = &mut *lock(&shared);
            let on_line = &mut reader.on_line;
            if let Err(e) = reader.tail.read_lines(|l| on_line(Line::Appended(l))) {
                eprintln!("fault script: cannot read: {e}");
            }
        }
    })
    .map_err(io::Error::other)?;
    watcher
        .watch(path, RecursiveMode::NonRecursive)
        .map_err(io::Error::other)?;
    let Reader { tail, on_line } = &mut *first;
    tail.read_lines(|l| on_line(Line::Existing(l)))?;
    drop(first);
    Ok(Follower {
        _watcher: watcher,
        path: path.to_owned(),
    })
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::mpsc as std_mpsc;
    use std::time::Duration;

    #[test]
    fn every_command_parses() {
        let parsed: Vec<_> = [
            "xid GPU-a 79",
            "dbe GPU-a",
            "sbe GPU-a",
            "lost GPU-a",
            "restore GPU-a",
            "action GPU-a 2",
            "",
            "# note",
        ]
        .iter()
        .map(|l| parse_line(l))
        .collect();
        let a = || "GPU-a".to_string();
        assert_eq!(
            parsed,
            vec![
                Ok(Some(Command::Xid { uuid: a(), xid: 79 })),
                Ok(Some(Command::Dbe { uuid: a() })),
                Ok(Some(Command::Sbe { uuid: a() })),
                Ok(Some(Command::Lost { uuid: a() })),
                Ok(Some(Command::Restore { uuid: a() })),
                Ok(Some(Command::Action {
                    uuid: a(),
                    action: 2
                })),
                Ok(None),
                Ok(None),
            ]
        );
    }

    #[test]
    fn malformed_lines_say_what_is_wrong() {
        for (line, why) in [
            ("xid GPU-a", "wrong number"),
            ("xid GPU-a seventy", "not a number"),
            ("action GPU-a 9", "0-4"),
            ("reboot GPU-a", "unknown command"),
            ("dbe", "wrong number"),
        ] {
            let err = parse_line(line)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(err.contains(why) && err.contains(line), "{line}: {err}");
        }
    }

    #[test]
    fn follower_reports_existing_lines_then_appended_ones() -> Result<(), Box<dyn std::error::Error>>
    {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("events");
        std::fs::write(&path, "lost GPU-a\n")?;
        let (tx, rx) = std_mpsc::channel();
        let _follower = follow(&path, move |line| {
            let owned = match line {
                Line::Existing(l) => format!("existing {l}"),
                Line::Appended(l) => format!("appended {l}"),
            };
            let _ = tx.send(owned);
        })?;
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(5))?,
            "existing lost GPU-a"
        );
        let mut file = File::options().append(true).open(&path)?;
        // A line written in two pieces is delivered once, whole.
        file.write_all(b"xid GPU-a ")?;
        file.flush()?;
        file.write_all(b"79\n")?;
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(5))?,
            "appended xid GPU-a 79"
        );
        Ok(())
    }
}
