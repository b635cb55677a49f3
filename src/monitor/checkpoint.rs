//! The health checkpoint's file: `<state-dir>/health-checkpoint.json`, the record
//! ([`crate::health::checkpoint`]) written atomically (temp file, rename); a checkpoint that cannot be read or
//! parsed is reported and ignored, never a crash loop.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::health::checkpoint::{Checkpoint, Durability};

/// File name of the checkpoint in the state directory.
pub const FILE_NAME: &str = "health-checkpoint.json";

/// Where the kernel publishes this boot's random id.
pub const DEFAULT_BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// Prefix of the temporary files a write goes through (hidden, and named for the checkpoint).
const TEMP_PREFIX: &str = ".health-checkpoint.";

/// Why a checkpoint was not used.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading or writing the file failed.
    #[error("{action} {}: {source}", .path.display())]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not a checkpoint this version understands.
    #[error("checkpoint {} is corrupt: {why}", .path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
}

/// The checkpoint file in a state directory.
#[derive(Debug, Clone)]
pub struct Store {
    path: PathBuf,
}

impl Store {
    /// The checkpoint in `state_dir`.
    pub fn in_dir(state_dir: &Path) -> Self {
        Store {
            path: state_dir.join(FILE_NAME),
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the checkpoint: `Ok(None)` when there is none yet.
    pub fn load(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(CheckpointError::Io {
                    action: "cannot read",
                    path: self.path.clone(),
                    source,
                });
            }
        };
        Checkpoint::parse(&text)
            .map(Some)
            .map_err(|why| CheckpointError::Corrupt {
                path: self.path.clone(),
                why,
            })
    }

    /// Moves a checkpoint that cannot be used out of the way, to `<name>.unreadable-<unix seconds>` beside
    /// it, so that the next save does not overwrite what it recorded (a newer version's file after a
    /// rollback, a damaged one to look at). Returns where it went.
    pub fn set_aside(&self) -> std::io::Result<PathBuf> {
        set_aside(&self.path)
    }

    /// Replaces the checkpoint atomically: a crash of the plugin leaves the old file or the new one, never
    /// half of one. With [`Durability::Synced`] so does a crash of the node. With [`Durability::Process`] a
    /// node crash may leave the previous file, or (on a file system that does not write a file's data before
    /// a rename over it) a damaged one, which loading reports and ignores: nothing in it would outlive the
    /// reboot anyway.
    pub fn save(
        &self,
        checkpoint: &Checkpoint,
        durability: Durability,
    ) -> Result<(), CheckpointError> {
        let text = checkpoint.encode().map_err(|e| CheckpointError::Io {
            action: "cannot encode",
            path: self.path.clone(),
            source: e.into(),
        })?;
        replace(&self.path, TEMP_PREFIX, &text, durability)
    }
}

/// Moves a state file that cannot be used out of the way, to `<name>.unreadable-<unix seconds>` beside it,
/// so that the next save does not overwrite what it recorded. Returns where it went.
pub fn set_aside(path: &Path) -> std::io::Result<PathBuf> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".unreadable-{secs}"));
    let aside = path.with_file_name(name);
    std::fs::rename(path, &aside)?;
    Ok(aside)
}

/// Replaces the state file at `path` with `bytes` atomically, through a temporary file beside it named
/// `<temp_prefix>…`; with [`Durability::Synced`] the data and the rename are on disk before it returns.
pub fn replace(
    path: &Path,
    temp_prefix: &str,
    bytes: &[u8],
    durability: Durability,
) -> Result<(), CheckpointError> {
    let io = |action, source| CheckpointError::Io {
        action,
        path: path.to_path_buf(),
        source,
    };
    // A temporary file of this write's own: during a rolling update two instances share the state
    // directory and both write the file, and a shared temporary name would let their writes mix.
    // One that is not persisted is removed on drop.
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let mut file = tempfile::Builder::new()
        .prefix(temp_prefix)
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(|e| io("cannot create a temporary file beside", e))?;
    file.write_all(bytes).map_err(|e| io("cannot write", e))?;
    let synced = durability == Durability::Synced;
    if synced {
        file.as_file()
            .sync_all()
            .map_err(|e| io("cannot sync", e))?;
    }
    file.persist(path)
        .map_err(|e| io("cannot replace", e.error))?;
    if synced {
        // Make the rename itself durable.
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io("cannot sync directory of", e))?;
    }
    Ok(())
}

/// This boot's id, or `None` if it cannot be read.
pub fn read_boot_id(path: &Path) -> Option<String> {
    let id = std::fs::read_to_string(path).ok()?;
    let id = id.trim();
    (!id.is_empty()).then(|| id.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::checkpoint::DeviceRecord;
    use crate::health::{ConditionKind, HealthEngine, Observation, Policy};
    use std::time::Duration;

    #[test]
    fn a_checkpoint_round_trips_through_the_file() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let store = Store::in_dir(dir.path());
        assert!(store.load()?.is_none(), "no checkpoint yet");
        let mut engine = HealthEngine::new(Policy::default());
        let at = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        engine.observe("GPU-a", &Observation::Xid(79), at);
        engine.observe("GPU-a", &Observation::Xid(79), at + Duration::from_secs(5));
        engine.observe("GPU-b", &Observation::Unmonitored("no events".into()), at);
        let written = Checkpoint::of(&engine, Some("boot-1".into()));
        store.save(&written, Durability::Synced)?;
        let read = store.load()?.unwrap_or_default();
        assert_eq!(read, written);
        let a = read
            .devices
            .get("GPU-a")
            .map(DeviceRecord::conditions)
            .unwrap_or_default();
        assert_eq!(a.len(), 1);
        assert_eq!(
            (a[0].kind.clone(), a[0].count, a[0].last_seen),
            (ConditionKind::Xid(79), 2, at + Duration::from_secs(5))
        );
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())?
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(TEMP_PREFIX))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        Ok(())
    }

    #[test]
    fn an_unsynced_checkpoint_reads_back_the_same() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let store = Store::in_dir(dir.path());
        let mut engine = HealthEngine::new(Policy::default());
        engine.observe(
            "GPU-a",
            &Observation::Xid(79),
            UNIX_EPOCH + Duration::from_secs(1_800_000_000),
        );
        let written = Checkpoint::of(&engine, Some("boot-1".into()));
        store.save(&written, Durability::Process)?;
        assert_eq!(store.load()?, Some(written));
        Ok(())
    }

    #[test]
    fn a_corrupt_checkpoint_is_an_error_not_a_panic() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let store = Store::in_dir(dir.path());
        std::fs::write(
            store.path(),
            b"{\"version\": 1, \"devices\": {\"GPU-a\": 42",
        )?;
        assert!(matches!(store.load(), Err(CheckpointError::Corrupt { .. })));
        std::fs::write(
            store.path(),
            b"{\"version\": 99, \"bootId\": null, \"devices\": {}}",
        )?;
        assert!(matches!(store.load(), Err(CheckpointError::Corrupt { .. })));
        Ok(())
    }

    #[test]
    fn boot_id_is_read_trimmed() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("boot_id");
        std::fs::write(&path, "8a3f\n")?;
        assert_eq!(read_boot_id(&path), Some("8a3f".into()));
        assert_eq!(read_boot_id(&dir.path().join("missing")), None);
        Ok(())
    }
}
