//! The health checkpoint's record: every device's conditions, and the node's boot id, as the monitor writes them
//! to `<state-dir>/health-checkpoint.json` (`crate::monitor::checkpoint`) so that a plugin restart does not
//! forget a broken GPU. Pure: built from the engine, parsed from text, no file system.
//!
//! Conditions from an earlier boot are dropped, but for `recover: never`. So only a checkpoint holding such a
//! condition has to survive a crash of the node itself: that one needs [`Durability::Synced`] (fsync of the
//! file before the rename, of the directory after). Any other needs only to survive a restart of the plugin,
//! which the page cache gives, and a new boot would drop its content anyway; fsyncing it would cost the node
//! disk flushes on every fault for nothing.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::{Condition, ConditionKind, HealthEngine};

/// The record's format version.
pub const VERSION: u32 = 1;

/// The file's content.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Checkpoint {
    /// Format version.
    pub version: u32,
    /// Boot id when written; `None` if it could not be read.
    pub boot_id: Option<String>,
    /// Devices with conditions, by ID.
    pub devices: BTreeMap<String, DeviceRecord>,
}

/// One device in the checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceRecord {
    /// Active conditions.
    pub conditions: Vec<ConditionRecord>,
    /// Latest Unhealthy event, Unix milliseconds.
    pub last_unhealthy_ms: Option<u64>,
}

/// One condition in the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConditionRecord {
    /// Condition name (`xid`, `gpu-lost`, …).
    pub condition: String,
    /// Its value, for `xid` and `recovery-action`.
    pub value: Option<u64>,
    /// Extra words (why unmonitored).
    pub detail: Option<String>,
    /// Times observed.
    pub count: u64,
    /// First seen, Unix milliseconds.
    pub first_seen_ms: u64,
    /// Last seen, Unix milliseconds.
    pub last_seen_ms: u64,
}

fn to_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The last millisecond of year 9999: times are written as RFC 3339, which ends there.
const LATEST_MS: u64 = 253_402_300_799_999;

/// A recorded time; one past year 9999 (a damaged or hand-edited file) is taken as the end of 9999.
fn from_ms(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.min(LATEST_MS))
}

impl Checkpoint {
    /// The engine's state now.
    pub fn of(engine: &HealthEngine, boot_id: Option<String>) -> Self {
        let devices = engine
            .devices()
            .filter(|(_, state)| !state.conditions().is_empty())
            .map(|(id, state)| {
                let record = DeviceRecord {
                    conditions: state
                        .conditions()
                        .iter()
                        .map(|c| ConditionRecord {
                            condition: c.kind.name().to_string(),
                            value: c.kind.value(),
                            detail: c.detail.clone(),
                            count: c.count,
                            first_seen_ms: to_ms(c.first_seen),
                            last_seen_ms: to_ms(c.last_seen),
                        })
                        .collect(),
                    last_unhealthy_ms: engine.last_unhealthy(id).map(to_ms),
                };
                (id.clone(), record)
            })
            .collect();
        Checkpoint {
            version: VERSION,
            boot_id,
            devices,
        }
    }
}

impl DeviceRecord {
    /// The conditions, skipping any this version does not know.
    pub fn conditions(&self) -> Vec<Condition> {
        self.conditions
            .iter()
            .filter_map(|r| {
                Some(Condition {
                    kind: ConditionKind::from_parts(&r.condition, r.value)?,
                    detail: r.detail.clone(),
                    count: r.count,
                    first_seen: from_ms(r.first_seen_ms),
                    last_seen: from_ms(r.last_seen_ms),
                })
            })
            .collect()
    }

    /// The last Unhealthy event.
    pub fn last_unhealthy(&self) -> Option<SystemTime> {
        self.last_unhealthy_ms.map(from_ms)
    }
}

impl Checkpoint {
    /// The record in `text`, or why it is not one this version understands.
    pub fn parse(text: &str) -> Result<Checkpoint, String> {
        let checkpoint: Checkpoint = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if checkpoint.version != VERSION {
            return Err(format!("version {} is not {VERSION}", checkpoint.version));
        }
        Ok(checkpoint)
    }

    /// The record as the file holds it.
    pub fn encode(&self) -> serde_json::Result<Vec<u8>> {
        serde_json::to_vec_pretty(self)
    }
}

/// How far a write of the record must get before it counts as saved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Survives a crash or power loss of the node: the file and the rename are fsynced.
    Synced,
    /// Survives a restart of the plugin; a node crash may leave the previous checkpoint or a damaged one.
    Process,
}

impl Durability {
    /// What the engine's state needs: [`Durability::Synced`] while it holds a condition a reboot keeps.
    pub fn needed_by(engine: &HealthEngine) -> Self {
        if engine.holds_conditions_past_reboot() {
            Durability::Synced
        } else {
            Durability::Process
        }
    }
}
