//! The health engine, pure: observations from a GPU backend in, per-device conditions and health out. It never
//! sleeps, reads files or logs; the caller passes the time of each observation and logs the outcome.
//!
//! Conditions are named as in NVIDIA's DRA health schema (`xid` with the XID as value, `gpu-lost`,
//! `unmonitored`, `ecc-dbe`), plus `ecc-sbe`. Each has an effect: `None` (recorded, the device stays Healthy)
//! or `Unhealthy`. XID effects follow NVIDIA's XID catalog: an XID whose immediate action is "restart the
//! application" or "ignore" means the GPU itself is fine; one that needs a GPU reset, a reboot, the XID 48
//! (double-bit ECC) or NVLink workflow, or that is not in the built-in table, makes the device Unhealthy.

use std::collections::HashMap;
use std::fmt;
use std::time::SystemTime;

use crate::devices::Health;

/// Something a GPU backend saw on one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    /// A critical XID error event with this XID.
    Xid(u64),
    /// A double-bit (uncorrectable) ECC error event.
    DoubleBitEcc,
    /// A single-bit (corrected) ECC error event.
    SingleBitEcc,
    /// The device stopped answering: NVML returned GPU_IS_LOST.
    GpuLost,
    /// Health events cannot be watched on this device; the text says why.
    Unmonitored(String),
}

/// What the GPU needs, per NVIDIA's XID catalog ("resolution bucket, immediate action").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XidAction {
    /// Restart the application; the GPU is fine.
    RestartApp,
    /// Nothing to do.
    Ignore,
    /// Stop the GPU's processes and reset the GPU.
    ResetGpu,
    /// Reboot the node.
    RebootNode,
    /// Double-bit ECC error: reset, and drain first if row remapping failed too.
    EccWorkflow,
    /// NVLink error: decode it; most need a reset.
    NvlinkWorkflow,
    /// The driver's recovery action changed; the action itself says what to do.
    FollowRecoveryAction,
}

impl XidAction {
    /// Whether a GPU with this XID should be kept away from new pods.
    pub fn effect(self) -> Effect {
        match self {
            XidAction::RestartApp | XidAction::Ignore => Effect::None,
            XidAction::ResetGpu
            | XidAction::RebootNode
            | XidAction::EccWorkflow
            | XidAction::NvlinkWorkflow
            | XidAction::FollowRecoveryAction => Effect::Unhealthy,
        }
    }

    /// What an operator should do, in words.
    pub fn advice(self) -> &'static str {
        match self {
            XidAction::RestartApp => "restart the application; the GPU is fine",
            XidAction::Ignore => "no action needed",
            XidAction::ResetGpu => "stop the GPU's workloads and reset the GPU",
            XidAction::RebootNode => "drain and reboot the node",
            XidAction::EccWorkflow => {
                "drain the GPU and reset it; check for failed row remapping (XID 64)"
            }
            XidAction::NvlinkWorkflow => "check the NVLink error details; most need a GPU reset",
            XidAction::FollowRecoveryAction => "follow the recovery action the driver reports",
        }
    }
}

/// One entry of the built-in XID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XidInfo {
    /// What happened, in words.
    pub meaning: &'static str,
    /// What the catalog says to do.
    pub action: XidAction,
}

/// The XIDs the catalog lists for current GPUs, with what each means and needs.
pub fn xid_info(xid: u64) -> Option<XidInfo> {
    use XidAction::*;
    let (meaning, action) = match xid {
        8 => ("the GPU stopped processing (idle timeout)", RestartApp),
        13 => (
            "graphics engine exception, usually an application fault",
            RestartApp,
        ),
        31 => (
            "GPU memory page fault, usually an application fault",
            RestartApp,
        ),
        32 => ("invalid or corrupted push buffer stream", RestartApp),
        43 => ("the GPU stopped processing a channel", Ignore),
        45 => ("channel clean-up after earlier errors", Ignore),
        48 => ("double-bit ECC error", EccWorkflow),
        62 => ("internal micro-controller halt", ResetGpu),
        63 => ("a memory row was remapped or a page retired", Ignore),
        64 => ("memory row remapping failed", ResetGpu),
        68 => ("video decoder exception", RestartApp),
        69 => ("graphics engine class error", RestartApp),
        74 => ("NVLink error", NvlinkWorkflow),
        79 => ("the GPU has fallen off the bus", RebootNode),
        92 => ("high single-bit ECC error rate (early warning)", Ignore),
        94 => ("contained memory error", RestartApp),
        95 => ("uncontained memory error", ResetGpu),
        109 => ("context switch timeout", ResetGpu),
        119 => ("GSP firmware RPC timeout", ResetGpu),
        120 => ("GSP firmware error", ResetGpu),
        121 => ("chip-to-chip link error", Ignore),
        136 => ("link training failed", ResetGpu),
        140 => ("unrecovered ECC error", ResetGpu),
        143 => ("GPU initialisation error", ResetGpu),
        144..=150 => ("NVLink5 error", NvlinkWorkflow),
        154 => ("the driver's recovery action changed", FollowRecoveryAction),
        155 => ("NVLink software-defined error", ResetGpu),
        _ => return None,
    };
    Some(XidInfo { meaning, action })
}

/// Whether a condition keeps the device away from new pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// Recorded; the device stays Healthy.
    None,
    /// The device is Unhealthy while the condition holds.
    Unhealthy,
}

/// A kind of condition, with its value where it has one.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ConditionKind {
    /// `xid`, value = the XID.
    Xid(u64),
    /// `gpu-lost`.
    GpuLost,
    /// `unmonitored`.
    Unmonitored,
    /// `ecc-dbe`.
    EccDbe,
    /// `ecc-sbe`.
    EccSbe,
}

impl ConditionKind {
    /// The condition's name in the DRA health schema.
    pub fn name(&self) -> &'static str {
        match self {
            ConditionKind::Xid(_) => "xid",
            ConditionKind::GpuLost => "gpu-lost",
            ConditionKind::Unmonitored => "unmonitored",
            ConditionKind::EccDbe => "ecc-dbe",
            ConditionKind::EccSbe => "ecc-sbe",
        }
    }
}

impl fmt::Display for ConditionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConditionKind::Xid(xid) => write!(f, "xid={xid}"),
            other => f.write_str(other.name()),
        }
    }
}

/// A condition a device has had, with how often and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    /// Which condition.
    pub kind: ConditionKind,
    /// Its effect on health.
    pub effect: Effect,
    /// What it means and what to do, in words.
    pub description: String,
    /// How many times it was observed.
    pub count: u64,
    /// First observation.
    pub first_seen: SystemTime,
    /// Latest observation.
    pub last_seen: SystemTime,
}

/// Classifies one observation: which condition it is, its effect, and a description for operators.
pub fn classify(observation: &Observation) -> (ConditionKind, Effect, String) {
    match observation {
        Observation::Xid(xid) => match xid_info(*xid) {
            Some(info) => (
                ConditionKind::Xid(*xid),
                info.action.effect(),
                format!("XID {xid}: {}; {}", info.meaning, info.action.advice()),
            ),
            None => (
                ConditionKind::Xid(*xid),
                Effect::Unhealthy,
                format!(
                    "XID {xid}: not in the built-in XID table, treated as needing a GPU reset; check the driver's XID catalog"
                ),
            ),
        },
        Observation::DoubleBitEcc => (
            ConditionKind::EccDbe,
            Effect::Unhealthy,
            "double-bit (uncorrectable) ECC error; drain the GPU and reset it".into(),
        ),
        Observation::SingleBitEcc => (
            ConditionKind::EccSbe,
            Effect::None,
            "single-bit ECC error, corrected by the GPU; no action needed".into(),
        ),
        Observation::GpuLost => (
            ConditionKind::GpuLost,
            Effect::Unhealthy,
            "the GPU stopped answering (GPU is lost); drain and reboot the node".into(),
        ),
        Observation::Unmonitored(why) => (
            ConditionKind::Unmonitored,
            Effect::None,
            format!("health events cannot be watched: {why}"),
        ),
    }
}

/// What one observation did to a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The condition observed.
    pub condition: ConditionKind,
    /// Its effect.
    pub effect: Effect,
    /// Health before.
    pub old: Health,
    /// Health after.
    pub new: Health,
    /// Why the device is Unhealthy, from every condition with an Unhealthy effect; `None` while Healthy.
    pub reason: Option<String>,
}

impl Outcome {
    /// Whether health changed.
    pub fn is_transition(&self) -> bool {
        self.old != self.new
    }
}

/// Per-device conditions and the health they add up to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceHealth {
    conditions: Vec<Condition>,
}

impl DeviceHealth {
    /// Unhealthy while any condition has an Unhealthy effect.
    pub fn health(&self) -> Health {
        if self
            .conditions
            .iter()
            .any(|c| c.effect == Effect::Unhealthy)
        {
            Health::Unhealthy
        } else {
            Health::Healthy
        }
    }

    /// Every condition seen, in the order first seen.
    pub fn conditions(&self) -> &[Condition] {
        &self.conditions
    }

    /// The Unhealthy conditions in words, or `None` while Healthy.
    pub fn reason(&self) -> Option<String> {
        let parts: Vec<String> = self
            .conditions
            .iter()
            .filter(|c| c.effect == Effect::Unhealthy)
            .map(|c| match c.count {
                1 => c.description.clone(),
                n => format!("{} (seen {n} times)", c.description),
            })
            .collect();
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

/// The health of every device, from the observations so far.
#[derive(Debug, Default)]
pub struct HealthEngine {
    devices: HashMap<String, DeviceHealth>,
}

impl HealthEngine {
    /// An engine with no conditions recorded.
    pub fn new() -> Self {
        HealthEngine::default()
    }

    /// Records `observation` on `device` at `now`.
    pub fn observe(&mut self, device: &str, observation: &Observation, now: SystemTime) -> Outcome {
        let (kind, effect, description) = classify(observation);
        let state = self.devices.entry(device.to_string()).or_default();
        let old = state.health();
        match state.conditions.iter_mut().find(|c| c.kind == kind) {
            Some(existing) => {
                existing.count += 1;
                existing.last_seen = now;
                existing.description = description;
            }
            None => state.conditions.push(Condition {
                kind: kind.clone(),
                effect,
                description,
                count: 1,
                first_seen: now,
                last_seen: now,
            }),
        }
        Outcome {
            condition: kind,
            effect,
            old,
            new: state.health(),
            reason: state.reason(),
        }
    }

    /// The conditions of `device`, if any were observed.
    pub fn device(&self, device: &str) -> Option<&DeviceHealth> {
        self.devices.get(device)
    }

    /// Forgets a device that is gone.
    pub fn remove(&mut self, device: &str) {
        self.devices.remove(device);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + secs)
    }

    fn health_after(observations: &[Observation]) -> Health {
        let mut engine = HealthEngine::new();
        let mut health = Health::Healthy;
        for (i, o) in observations.iter().enumerate() {
            health = engine.observe("gpu", o, at(i as u64)).new;
        }
        health
    }

    #[test]
    fn xids_the_catalog_says_need_a_reset_or_reboot_make_the_gpu_unhealthy() {
        for xid in [
            48, 62, 64, 74, 79, 95, 109, 119, 120, 136, 140, 143, 144, 150, 155,
        ] {
            assert_eq!(
                health_after(&[Observation::Xid(xid)]),
                Health::Unhealthy,
                "XID {xid}"
            );
        }
    }

    #[test]
    fn application_and_informational_xids_leave_the_gpu_healthy() {
        for xid in [8, 13, 31, 32, 43, 45, 63, 68, 69, 92, 94, 121] {
            assert_eq!(
                health_after(&[Observation::Xid(xid)]),
                Health::Healthy,
                "XID {xid}"
            );
        }
    }

    #[test]
    fn an_xid_missing_from_the_table_is_treated_as_unhealthy() {
        assert_eq!(health_after(&[Observation::Xid(999)]), Health::Unhealthy);
    }

    #[test]
    fn ecc_and_lost_and_unmonitored_have_their_effects() {
        assert_eq!(
            health_after(&[Observation::DoubleBitEcc]),
            Health::Unhealthy
        );
        assert_eq!(health_after(&[Observation::SingleBitEcc]), Health::Healthy);
        assert_eq!(health_after(&[Observation::GpuLost]), Health::Unhealthy);
        assert_eq!(
            health_after(&[Observation::Unmonitored("no events".into())]),
            Health::Healthy
        );
    }

    #[test]
    fn a_healthy_xid_is_recorded_with_count_and_times() {
        let mut engine = HealthEngine::new();
        engine.observe("gpu", &Observation::Xid(13), at(1));
        let outcome = engine.observe("gpu", &Observation::Xid(13), at(5));
        assert!(!outcome.is_transition());
        assert_eq!(outcome.reason, None);
        let conditions = engine
            .device("gpu")
            .map(|d| d.conditions().to_vec())
            .unwrap_or_default();
        assert_eq!(conditions.len(), 1);
        assert_eq!(
            (
                conditions[0].count,
                conditions[0].first_seen,
                conditions[0].last_seen
            ),
            (2, at(1), at(5))
        );
        assert_eq!(conditions[0].kind.to_string(), "xid=13");
    }

    #[test]
    fn the_transition_names_the_condition_and_the_reason_says_what_to_do() {
        let mut engine = HealthEngine::new();
        engine.observe("gpu", &Observation::Xid(13), at(0));
        let outcome = engine.observe("gpu", &Observation::Xid(79), at(1));
        assert!(outcome.is_transition());
        assert_eq!(
            (outcome.old, outcome.new),
            (Health::Healthy, Health::Unhealthy)
        );
        assert_eq!(outcome.condition, ConditionKind::Xid(79));
        let reason = outcome.reason.unwrap_or_default();
        assert!(
            reason.contains("XID 79") && reason.contains("reboot"),
            "{reason}"
        );
        assert!(
            !reason.contains("XID 13"),
            "a harmless XID is not a reason: {reason}"
        );
        // A second fault while Unhealthy is not a transition but is part of the reason.
        let outcome = engine.observe("gpu", &Observation::DoubleBitEcc, at(2));
        assert!(!outcome.is_transition());
        assert!(
            outcome
                .reason
                .is_some_and(|r| r.contains("XID 79") && r.contains("ECC"))
        );
    }

    #[test]
    fn devices_are_independent() {
        let mut engine = HealthEngine::new();
        engine.observe("a", &Observation::Xid(79), at(0));
        let b = engine.observe("b", &Observation::Xid(13), at(0));
        assert_eq!(b.new, Health::Healthy);
    }
}
