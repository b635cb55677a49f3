//! The prepared-claim record: `<state-dir>/dra-prepared-claims.json`, every claim this node prepared and
//! what the kubelet was given for it. A prepare repeated after a restart (the kubelet retries, or asks a new
//! instance during a rolling update) answers from it; unprepare removes from it; a device prepared for one
//! claim is refused to another while the first holds it.
//!
//! Preparing a claim changes nothing on the node (the CDI IDs name specs that exist already), so a claim is
//! written once, complete; a prepare the process did not live to record is simply done again. The file is
//! replaced atomically before the kubelet hears the answer. A record from another boot is dropped (the
//! kubelet prepares every claim again after a reboot), so what a crash of the node could take from it is never
//! read again: it is synced to disk only when the boot is not known.
//!
//! The record is a cache: the API server is the truth for what is allocated where. One that cannot be read
//! is set aside with a warning, never taken for "nothing prepared", and one of a newer format is left as
//! it is; the plugin then learns what is prepared on the node from the ResourceClaims allocated in its pool
//! ([`crate::dra::prepare`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::health::checkpoint::Durability;
use crate::monitor::checkpoint::{self as files, CheckpointError};
use crate::util::files::FileId;

/// File name in the state directory.
pub const FILE_NAME: &str = "dra-prepared-claims.json";
const TEMP_PREFIX: &str = ".dra-prepared-claims.";
/// The record's format version.
const VERSION: u32 = 1;
/// A record larger than this is not ours to parse (10 000 claims of 8 devices fit well under it).
const MAX_BYTES: u64 = 16 * 1024 * 1024;

/// What the record's file holds when looked at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Look {
    /// No file: nothing recorded (a first start, or the file deleted by hand).
    Absent,
    /// A record of this build's format.
    Found(Record),
    /// A file that cannot be read as a record (damaged, not a regular file, a link, too large), and why.
    Unreadable(String),
    /// A record of a newer format, by its version: another version of the plugin wrote it (a rolling
    /// update shares the state directory), and it must find it as it left it after a rollback.
    Newer(u32),
}

/// Why a file cannot be used as the record.
enum Unusable {
    Unreadable(String),
    Newer(u32),
}

/// One device as the kubelet was given it for a claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    /// The claim's requests this device satisfies.
    pub requests: Vec<String>,
    /// Pool.
    pub pool: String,
    /// Device name.
    pub device: String,
    /// The CDI device IDs handed out.
    pub cdi_device_ids: Vec<String>,
}

/// One prepared claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedClaim {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Its devices of this driver.
    pub devices: Vec<PreparedDevice>,
}

/// Every claim prepared on this node, by claim UID.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    boot_id: Option<String>,
    /// Prepared claims by UID.
    pub claims: BTreeMap<String, PreparedClaim>,
}

impl Record {
    /// An empty record for this boot.
    pub fn new(boot_id: Option<String>) -> Self {
        Record {
            version: VERSION,
            boot_id,
            claims: BTreeMap::new(),
        }
    }

    /// The boot it was made in, when known.
    pub fn boot_id(&self) -> Option<&str> {
        self.boot_id.as_deref()
    }

    /// How far a write of it must get: past a restart of the plugin while the boot is known (a crash of the
    /// node ends the boot, and the record with it: no sync to disk on the prepare's way), past a crash of
    /// the node while it is not (the record is then kept across boots).
    pub fn durability(&self) -> Durability {
        match self.boot_id {
            Some(_) => Durability::Process,
            None => Durability::Synced,
        }
    }

    /// The claim other than `uid` that holds `device` of `pool`, if any.
    pub fn holder(&self, pool: &str, device: &str, uid: &str) -> Option<(&str, &PreparedClaim)> {
        self.claims
            .iter()
            .find(|(other, claim)| {
                *other != uid
                    && claim
                        .devices
                        .iter()
                        .any(|d| d.pool == pool && d.device == device)
            })
            .map(|(uid, claim)| (uid.as_str(), claim))
    }
}

/// The lock beside the record, held while a prepare or unprepare reads and writes it: the two pods of a
/// rolling update serve the same node's claims from the same record, and take turns.
const LOCK_NAME: &str = ".dra-prepared-claims.lock";
/// How long a call waits for the other instance to be done with the record (a call of its own takes
/// milliseconds; one stopped with the lock held must not hang this one).
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The record's lock, held until dropped.
#[derive(Debug)]
pub struct RecordLock {
    _file: std::fs::File,
}

/// The record's file.
#[derive(Debug, Clone)]
pub struct RecordFile {
    path: PathBuf,
}

impl RecordFile {
    /// The record in `state_dir`.
    pub fn in_dir(state_dir: &Path) -> Self {
        RecordFile {
            path: state_dir.join(FILE_NAME),
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Which file is there now, if any: another instance's write replaces it.
    pub fn file_id(&self) -> Option<FileId> {
        FileId::of(&self.path)
    }

    /// Takes the record's lock, waiting at most [`LOCK_WAIT`] for another instance to give it back. Blocks:
    /// call it off the async threads.
    pub fn lock(&self) -> Result<RecordLock, String> {
        use rustix::fs::{FlockOperation, flock};
        let path = self.path.with_file_name(LOCK_NAME);
        let file = crate::util::files::open_lock_file(&path)?;
        let deadline = std::time::Instant::now() + LOCK_WAIT;
        loop {
            match flock(&file, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => return Ok(RecordLock { _file: file }),
                Err(e) if e == rustix::io::Errno::WOULDBLOCK => {
                    if std::time::Instant::now() >= deadline {
                        return Err(format!(
                            "another instance of the plugin has held {} for more than {LOCK_WAIT:?}",
                            path.display()
                        ));
                    }
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                Err(e) => return Err(format!("cannot lock {}: {e}", path.display())),
            }
        }
    }

    /// The record as it was left, for a start: empty when there is none, when it is from another boot, or
    /// when it cannot be used. One that cannot be read is set aside (kept beside, to look at); one of a
    /// newer format (a newer version of the plugin, during a rolling update or before a rollback) is left
    /// in place, untouched. Either way the plugin learns what is prepared from the API server
    /// ([`crate::dra::prepare::Preparer`]), never from "nothing".
    pub fn load(&self, boot_id: Option<String>) -> Record {
        match self.look(boot_id.clone()) {
            Look::Absent => Record::new(boot_id),
            Look::Found(record) => record,
            Look::Unreadable(why) => {
                let aside = self.set_aside();
                tracing::warn!(
                    file = %self.path.display(),
                    set_aside = %aside,
                    error = %why,
                    "the prepared-claim record cannot be used; what is prepared on this node is read from the \
                     API server instead"
                );
                Record::new(boot_id)
            }
            Look::Newer(version) => {
                tracing::warn!(
                    file = %self.path.display(),
                    version,
                    "the prepared-claim record is of a newer format (written by a newer version of the plugin): \
                     left untouched for it; what is prepared on this node is read from the API server instead, \
                     and this instance keeps its own in memory"
                );
                Record::new(boot_id)
            }
        }
    }

    /// What the file holds now. A record from another boot is found empty (the kubelet prepares its claims
    /// again after a reboot). Nothing is moved or written.
    pub fn look(&self, boot_id: Option<String>) -> Look {
        match self.read() {
            Ok(None) => Look::Absent,
            Ok(Some(record)) if boot_id.is_some() && record.boot_id != boot_id => {
                tracing::info!(
                    claims = record.claims.len(),
                    "the prepared-claim record is from another boot; the kubelet prepares its claims again"
                );
                Look::Found(Record::new(boot_id))
            }
            Ok(Some(mut record)) => {
                record.boot_id = boot_id;
                Look::Found(record)
            }
            Err(Unusable::Newer(version)) => Look::Newer(version),
            Err(Unusable::Unreadable(why)) => Look::Unreadable(why),
        }
    }

    /// Moves a record that cannot be read out of the way (not written over: kept beside, to look at);
    /// where it went, or why it was not moved.
    pub fn set_aside(&self) -> String {
        files::set_aside(&self.path)
            .map(|p| p.display().to_string())
            .unwrap_or_else(|e| format!("not moved: {e}"))
    }

    fn read(&self) -> Result<Option<Record>, Unusable> {
        use std::io::Read as _;
        let unreadable = |why: String| Unusable::Unreadable(why);
        let file = match crate::util::files::open_unfollowed(&self.path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(unreadable(format!("cannot read it: {e}"))),
        };
        if !file
            .metadata()
            .map_err(|e| unreadable(e.to_string()))?
            .is_file()
        {
            return Err(unreadable("not a regular file".into()));
        }
        let mut text = String::new();
        file.take(MAX_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|e| unreadable(format!("cannot read it: {e}")))?;
        if text.len() as u64 > MAX_BYTES {
            return Err(unreadable(format!("larger than {MAX_BYTES} bytes")));
        }
        // The version first: a newer format may be shaped in ways this build cannot read.
        #[derive(Deserialize)]
        struct Versioned {
            version: u32,
        }
        let versioned: Versioned =
            serde_json::from_str(&text).map_err(|e| unreadable(e.to_string()))?;
        if versioned.version > VERSION {
            return Err(Unusable::Newer(versioned.version));
        }
        if versioned.version != VERSION {
            return Err(unreadable(format!(
                "format version {} (this plugin writes {VERSION})",
                versioned.version
            )));
        }
        let record: Record = serde_json::from_str(&text).map_err(|e| unreadable(e.to_string()))?;
        Ok(Some(record))
    }

    /// Replaces the file with `record`, made to last as long as the record counts ([`Record::durability`]).
    pub fn save(&self, record: &Record) -> Result<(), CheckpointError> {
        let text = serde_json::to_vec(record).map_err(|e| CheckpointError::Io {
            action: "cannot encode",
            path: self.path.clone(),
            source: e.into(),
        })?;
        files::replace(&self.path, TEMP_PREFIX, &text, record.durability())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(device: &str) -> PreparedClaim {
        PreparedClaim {
            namespace: "ns".into(),
            name: "train".into(),
            devices: vec![PreparedDevice {
                requests: vec!["gpu".into()],
                pool: "node-a".into(),
                device: device.into(),
                cdi_device_ids: vec!["nvidia.com/gpu=GPU-0".into()],
            }],
        }
    }

    #[test]
    fn a_saved_record_loads_again_in_the_same_boot_and_not_in_another() {
        let dir = tempfile::tempdir().expect("dir");
        let file = RecordFile::in_dir(dir.path());
        let mut record = Record::new(Some("boot-1".into()));
        record.claims.insert("uid-1".into(), claim("gpu-0"));
        file.save(&record).expect("save");
        assert_eq!(file.load(Some("boot-1".into())), record);
        assert!(file.load(Some("boot-2".into())).claims.is_empty());
    }

    #[test]
    fn only_a_record_that_outlives_the_boot_is_synced_to_disk() {
        // Known boot: a node crash starts another, which drops the record; the prepare does not wait on the
        // disk for it.
        assert_eq!(
            Record::new(Some("boot-1".into())).durability(),
            Durability::Process
        );
        // Unknown boot: the record is read again after a reboot, so it must be whole then.
        assert_eq!(Record::new(None).durability(), Durability::Synced);
        let dir = tempfile::tempdir().expect("dir");
        let file = RecordFile::in_dir(dir.path());
        let mut record = Record::new(None);
        record.claims.insert("uid-1".into(), claim("gpu-0"));
        file.save(&record).expect("save");
        assert_eq!(file.load(None), record);
    }

    #[test]
    fn a_corrupt_record_is_set_aside_and_the_plugin_starts_with_none() {
        let dir = tempfile::tempdir().expect("dir");
        let file = RecordFile::in_dir(dir.path());
        std::fs::write(file.path(), "{\"version\": 1, \"claims\": [").expect("write");
        assert!(file.load(None).claims.is_empty());
        assert!(!file.path().exists(), "moved out of the way");
        let aside = std::fs::read_dir(dir.path())
            .expect("list")
            .filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().contains(".unreadable-"));
        assert!(aside, "kept beside, to look at");
    }

    #[test]
    fn a_record_of_a_newer_format_is_left_in_place_untouched() {
        let dir = tempfile::tempdir().expect("dir");
        let file = RecordFile::in_dir(dir.path());
        let newer = r#"{"version": 2, "claims": {"u-1": {"shape": "unknown here"}}}"#;
        std::fs::write(file.path(), newer).expect("write");
        assert_eq!(file.look(None), Look::Newer(2));
        assert!(file.load(None).claims.is_empty());
        assert_eq!(
            std::fs::read_to_string(file.path()).ok().as_deref(),
            Some(newer)
        );
        assert_eq!(std::fs::read_dir(dir.path()).expect("list").count(), 1);
    }

    #[test]
    fn a_fifo_in_place_of_the_record_is_not_waited_on() {
        let dir = tempfile::tempdir().expect("dir");
        let file = RecordFile::in_dir(dir.path());
        let made = std::process::Command::new("mkfifo")
            .arg(file.path())
            .status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo");
        // Opening a FIFO for reading blocks until a writer comes; the test would hang if it were opened so.
        let (tx, rx) = std::sync::mpsc::channel();
        let path = dir.path().to_path_buf();
        std::thread::spawn(move || {
            let _sent = tx.send(RecordFile::in_dir(&path).load(None));
        });
        let loaded = rx
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("load returns");
        assert!(loaded.claims.is_empty());
    }

    #[test]
    fn the_holder_of_a_device_is_another_claim_never_the_one_asking() {
        let mut record = Record::new(None);
        record.claims.insert("uid-1".into(), claim("gpu-0"));
        assert_eq!(
            record.holder("node-a", "gpu-0", "uid-2").map(|h| h.0),
            Some("uid-1")
        );
        assert!(record.holder("node-a", "gpu-0", "uid-1").is_none());
        assert!(record.holder("node-a", "gpu-1", "uid-2").is_none());
    }
}
