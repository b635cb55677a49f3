//! The health engine, pure: observations from a GPU backend and the time in; per-device conditions, health
//! and a message out. It never sleeps, reads files or logs: the monitor (`crate::monitor`) does the IO around
//! it, so every policy is a fast unit test with an injected clock.
//!
//! A GPU's health is the sum of its active conditions (named as in NVIDIA's DRA health schema): it is
//! Unhealthy while any condition's effect, under the [`Policy`], is Unhealthy. Conditions clear:
//! - when the driver's recovery action (read by probing the GPU) returns to None: every condition that may
//!   recover clears at once — the driver is the authority where it reports one;
//! - otherwise, when a probe succeeds after a quiet period with no new Unhealthy event. A lost GPU's probe
//!   fails until it answers again, so `gpu-lost` and XID 79 clear only then;
//! - never, for conditions whose rule says `recover: never`;
//! - on a new boot, for every condition but those (see [`HealthEngine::restore`]).
//!
//! A device keeps at most [`MAX_XID_CONDITIONS`] distinct XIDs as conditions (a broken driver can raise
//! thousands of values, each of which would be a condition, a metric series, a line of `/status` and of the
//! checkpoint). Past the bound the weakest is dropped, so what is kept always decides health at least as
//! strictly as what was dropped; the dropped ones are counted (see [`DeviceHealth::other_xids`]).

pub mod checkpoint;
pub mod message;
pub mod policy;
pub mod xid;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::time::SystemTime;

use crate::devices::Health;
pub use policy::{HealthConfig, Policy, Recover};
pub use xid::{XidAction, XidInfo, xid_info};

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
    /// Health events on this device are watched again: an `unmonitored` condition ends.
    Monitored,
    /// The answer to a probe the engine asked for.
    Probe(ProbeResult),
    /// An operator (or a detector acting for one) takes the device out of service: `fenced` until released.
    Fence {
        /// Why, in the operator's words.
        reason: String,
        /// Who: the way in and, where known, the user.
        by: String,
    },
    /// An operator clears the conditions `which` names (`fenced`, or one stuck on a repaired GPU).
    Release {
        /// The conditions to clear.
        which: ConditionSelector,
    },
}

/// In words for a log line an operator reads (`XID 79`, `GPU lost`), not Rust's debug form.
impl fmt::Display for Observation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Observation::Xid(xid) => write!(f, "XID {xid}"),
            Observation::DoubleBitEcc => f.write_str("double-bit ECC error"),
            Observation::SingleBitEcc => f.write_str("single-bit ECC error"),
            Observation::GpuLost => f.write_str("GPU lost"),
            Observation::Unmonitored(why) => write!(f, "unmonitored: {why}"),
            Observation::Monitored => f.write_str("monitored again"),
            Observation::Probe(ProbeResult::Answered { recovery_action }) => {
                match recovery_action {
                    Some(action) => write!(f, "probe answered, recovery action {action}"),
                    None => f.write_str("probe answered"),
                }
            }
            Observation::Probe(ProbeResult::Lost) => f.write_str("probe: GPU lost"),
            Observation::Probe(ProbeResult::Failed(why)) => write!(f, "probe failed: {why}"),
            Observation::Fence { reason, by } => write!(f, "fence by {by}: {reason}"),
            Observation::Release { which } => write!(f, "release of {which}"),
        }
    }
}

/// Conditions named the way the config file and `release --condition` name them: `fenced`, `gpu-lost`,
/// `ecc-dbe`, `ecc-sbe-burst`, `unmonitored`, `recovery-action`, `xid-<N>`, or `xid` for every XID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConditionSelector {
    name: &'static str,
    value: Option<u64>,
}

impl ConditionSelector {
    /// The `fenced` condition.
    pub fn fenced() -> Self {
        ConditionSelector {
            name: "fenced",
            value: None,
        }
    }

    /// Reads a condition's name; the error lists the names there are. A value is written `xid-79` (the
    /// spelling every output uses); `xid=79`, as earlier versions showed it, is accepted too.
    pub fn parse(text: &str) -> Result<Self, String> {
        const NAMES: [&str; 7] = [
            "fenced",
            "gpu-lost",
            "ecc-dbe",
            "ecc-sbe-burst",
            "unmonitored",
            "recovery-action",
            "xid",
        ];
        if let Some(name) = NAMES.iter().find(|n| **n == text) {
            return Ok(ConditionSelector { name, value: None });
        }
        for name in ["xid", "recovery-action"] {
            let Some(value) = text
                .strip_prefix(name)
                .and_then(|rest| rest.strip_prefix('-').or_else(|| rest.strip_prefix('=')))
            else {
                continue;
            };
            let value = value
                .parse()
                .map_err(|_| format!("{text:?}: the value after {name}- is not a number"))?;
            return Ok(ConditionSelector {
                name,
                value: Some(value),
            });
        }
        Err(format!(
            "{:?} is not a condition (one of {}, xid-<N>)",
            crate::util::text::cut_bytes(text, 80),
            NAMES.join(", ")
        ))
    }

    /// Whether `kind` is one of the conditions named.
    pub fn matches(&self, kind: &ConditionKind) -> bool {
        kind.name() == self.name && self.value.is_none_or(|v| kind.value() == Some(v))
    }
}

impl fmt::Display for ConditionSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.value {
            Some(value) => write!(f, "{}-{value}", self.name),
            None => f.write_str(self.name),
        }
    }
}

/// What probing a GPU found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeResult {
    /// The GPU answered. `recovery_action` is the driver's recovery action field, `None` where the driver
    /// does not report it (then the quiet-period rule decides recovery).
    Answered {
        /// NVML recovery action: 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and reset.
        recovery_action: Option<u32>,
    },
    /// The GPU does not answer (GPU is lost).
    Lost,
    /// The probe failed for another reason; nothing is concluded.
    Failed(String),
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
    /// `ecc-sbe-burst`: more single-bit ECC errors in a window than the policy tolerates.
    EccSbeBurst,
    /// `recovery-action`, value = the driver's recovery action (never 0: None is no condition).
    RecoveryAction(u32),
    /// `fenced`: taken out of service by an operator until released; no probe, reboot or setting clears it.
    Fenced,
}

impl ConditionKind {
    /// The condition's name in the DRA health schema.
    pub fn name(&self) -> &'static str {
        match self {
            ConditionKind::Xid(_) => "xid",
            ConditionKind::GpuLost => "gpu-lost",
            ConditionKind::Unmonitored => "unmonitored",
            ConditionKind::EccDbe => "ecc-dbe",
            ConditionKind::EccSbeBurst => "ecc-sbe-burst",
            ConditionKind::RecoveryAction(_) => "recovery-action",
            ConditionKind::Fenced => "fenced",
        }
    }

    /// The condition's value, for those that have one.
    pub fn value(&self) -> Option<u64> {
        match self {
            ConditionKind::Xid(xid) => Some(*xid),
            ConditionKind::RecoveryAction(action) => Some(u64::from(*action)),
            _ => None,
        }
    }

    /// The kind from its name and value, as stored in a checkpoint.
    pub fn from_parts(name: &str, value: Option<u64>) -> Option<ConditionKind> {
        Some(match (name, value) {
            ("xid", Some(xid)) => ConditionKind::Xid(xid),
            ("gpu-lost", _) => ConditionKind::GpuLost,
            ("unmonitored", _) => ConditionKind::Unmonitored,
            ("ecc-dbe", _) => ConditionKind::EccDbe,
            ("ecc-sbe-burst", _) => ConditionKind::EccSbeBurst,
            ("recovery-action", Some(action)) => {
                ConditionKind::RecoveryAction(u32::try_from(action).ok()?)
            }
            ("fenced", _) => ConditionKind::Fenced,
            _ => return None,
        })
    }

    /// Conditions a probe cannot clear: `unmonitored` describes the watch, not the GPU, and a recovery
    /// action clears only when the driver says None.
    fn cleared_by_quiet_probe(&self) -> bool {
        !matches!(
            self,
            ConditionKind::Unmonitored | ConditionKind::RecoveryAction(_) | ConditionKind::Fenced
        )
    }
}

/// Written as `release --condition` and the config file's `conditions:` take it: `xid-79`, `recovery-action-2`.
impl fmt::Display for ConditionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.value() {
            Some(value) => write!(f, "{}-{value}", self.name()),
            None => f.write_str(self.name()),
        }
    }
}

/// A condition a device has, with how often and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    /// Which condition.
    pub kind: ConditionKind,
    /// Extra words for the message (why a GPU is unmonitored).
    pub detail: Option<String>,
    /// How many times it was observed.
    pub count: u64,
    /// First observation.
    pub first_seen: SystemTime,
    /// Latest observation.
    pub last_seen: SystemTime,
}

/// The most distinct XIDs a device keeps as conditions. NVIDIA's catalog names about 160 XIDs and a real
/// fault raises one to three of them; 16 keeps every XID of any real episode while bounding what a driver
/// raising random values costs (conditions, metric series, `/status`, the checkpoint).
pub const MAX_XID_CONDITIONS: usize = 16;

/// XID events not kept as conditions because the device already held [`MAX_XID_CONDITIONS`] stronger or
/// newer ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OtherXids {
    /// How many events (of XIDs dropped from, or never entered into, the kept set).
    pub events: u64,
    /// The latest XID dropped.
    pub last: Option<u64>,
}

/// Per-device conditions and what the engine needs to decide recovery.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceHealth {
    conditions: Vec<Condition>,
    /// XID events beyond the [`MAX_XID_CONDITIONS`] kept: counted, not kept.
    other_xids: OtherXids,
    /// Latest observation of a condition with an Unhealthy effect; the quiet period counts from here.
    last_unhealthy: Option<SystemTime>,
    /// When to probe next; `None` when nothing waits for a probe.
    next_probe: Option<SystemTime>,
    /// Times of recent single-bit ECC errors, for burst detection.
    sbe_times: VecDeque<SystemTime>,
    /// Whether the driver reports the recovery action field; `None` until a probe has said.
    recovery_field: Option<bool>,
    /// XID 154 said the recovery action changed since the last read: reading None now means it returned to
    /// None, even if the plugin never read the value it had in between.
    action_changed: bool,
}

impl DeviceHealth {
    /// Active conditions, in the order first seen.
    pub fn conditions(&self) -> &[Condition] {
        &self.conditions
    }

    /// Whether the driver reports a recovery action for this GPU.
    pub fn reports_recovery_action(&self) -> Option<bool> {
        self.recovery_field
    }

    /// XID events past the bound of [`MAX_XID_CONDITIONS`] distinct XIDs, counted only.
    pub fn other_xids(&self) -> OtherXids {
        self.other_xids
    }
}

/// What one observation did to a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Health before.
    pub old: Health,
    /// Health after.
    pub new: Health,
    /// Whether the set of active conditions changed (added or cleared), not only a count.
    pub conditions_changed: bool,
    /// The active conditions after, as `name=value`.
    pub conditions: Vec<String>,
    /// The device's message (KEP-4680 shape, at most 1024 characters) when the device is Unhealthy, changed
    /// health or changed conditions; otherwise `None` (then [`HealthEngine::message`] has it).
    pub message: Option<String>,
    /// Whether the engine wants the device probed now (the driver announced a new recovery action).
    pub probe_now: bool,
}

impl Outcome {
    /// Whether health changed.
    pub fn is_transition(&self) -> bool {
        self.old != self.new
    }
}

/// The health of every device, from the observations so far.
#[derive(Debug, Default)]
pub struct HealthEngine {
    policy: Policy,
    devices: HashMap<String, DeviceHealth>,
}

impl HealthEngine {
    /// An engine applying `policy`, with no conditions recorded.
    pub fn new(policy: Policy) -> Self {
        HealthEngine {
            policy,
            devices: HashMap::new(),
        }
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The state of `device`, if anything was observed on it.
    pub fn device(&self, device: &str) -> Option<&DeviceHealth> {
        self.devices.get(device)
    }

    /// Health of `device` under the policy.
    pub fn health(&self, device: &str) -> Health {
        self.devices
            .get(device)
            .map_or(Health::Healthy, |state| self.health_of(state))
    }

    fn health_of(&self, state: &DeviceHealth) -> Health {
        if state
            .conditions
            .iter()
            .any(|c| self.policy.effect(&c.kind) == Effect::Unhealthy)
        {
            Health::Unhealthy
        } else {
            Health::Healthy
        }
    }

    /// The message for `device`, or `None` when it has no condition.
    pub fn message(&self, device: &str) -> Option<String> {
        let state = self.devices.get(device)?;
        message::compose(
            self.health_of(state),
            &state.conditions,
            state.other_xids,
            &self.policy,
        )
    }

    /// Records `observation` on `device` at `now`.
    pub fn observe(&mut self, device: &str, observation: &Observation, now: SystemTime) -> Outcome {
        let mut state = self.devices.remove(device).unwrap_or_default();
        let old = self.health_of(&state);
        let before: Vec<ConditionKind> = state.conditions.iter().map(|c| c.kind.clone()).collect();
        let mut probe_now = false;
        match observation {
            Observation::Xid(xid) => {
                self.record(&mut state, ConditionKind::Xid(*xid), None, now);
                self.bound_xids(&mut state);
                // XID 154 announces a new recovery action: read it.
                probe_now =
                    xid_info(*xid).is_some_and(|i| i.action == XidAction::FollowRecoveryAction);
                state.action_changed |= probe_now;
            }
            Observation::DoubleBitEcc => self.record(&mut state, ConditionKind::EccDbe, None, now),
            Observation::GpuLost => self.record(&mut state, ConditionKind::GpuLost, None, now),
            Observation::Probe(ProbeResult::Lost) => self.still_lost(&mut state, now),
            Observation::Unmonitored(why) => {
                self.record(
                    &mut state,
                    ConditionKind::Unmonitored,
                    Some(why.clone()),
                    now,
                );
            }
            Observation::Monitored => state
                .conditions
                .retain(|c| c.kind != ConditionKind::Unmonitored),
            Observation::SingleBitEcc => {
                let burst = self.policy.sbe_burst;
                state.sbe_times.push_back(now);
                while state
                    .sbe_times
                    .front()
                    .is_some_and(|t| now.duration_since(*t).unwrap_or_default() > burst.window)
                    || state.sbe_times.len() > burst.count as usize + 1
                {
                    state.sbe_times.pop_front();
                }
                if state.sbe_times.len() > burst.count as usize {
                    let detail = format!(
                        "more than {} in {}",
                        burst.count,
                        humantime::format_duration(burst.window)
                    );
                    self.record(&mut state, ConditionKind::EccSbeBurst, Some(detail), now);
                }
            }
            Observation::Probe(ProbeResult::Answered { recovery_action }) => {
                self.answered(&mut state, *recovery_action, now);
            }
            Observation::Probe(ProbeResult::Failed(_)) => {}
            Observation::Fence { reason, by } => {
                let detail = format!("by {by}: {reason}");
                self.record(&mut state, ConditionKind::Fenced, Some(detail), now);
            }
            Observation::Release { which } => {
                state.conditions.retain(|c| !which.matches(&c.kind));
                self.reschedule(&mut state, now);
            }
        }
        let conditions_changed = !state.conditions.iter().map(|c| &c.kind).eq(before.iter());
        let outcome = self.outcome(old, &state, conditions_changed, probe_now);
        self.devices.insert(device.to_string(), state);
        outcome
    }

    /// What a step did to a device, from its state after the step.
    fn outcome(
        &self,
        old: Health,
        state: &DeviceHealth,
        conditions_changed: bool,
        probe_now: bool,
    ) -> Outcome {
        let new = self.health_of(state);
        // Formatting the message (times in RFC 3339) is the costliest part of an event; a storm of harmless
        // XIDs on a Healthy GPU needs none of it.
        let wanted = new == Health::Unhealthy || old != new || conditions_changed;
        Outcome {
            old,
            new,
            conditions_changed,
            conditions: state
                .conditions
                .iter()
                .map(|c| c.kind.to_string())
                .collect(),
            message: wanted
                .then(|| message::compose(new, &state.conditions, state.other_xids, &self.policy))
                .flatten(),
            probe_now,
        }
    }

    fn record(
        &self,
        state: &mut DeviceHealth,
        kind: ConditionKind,
        detail: Option<String>,
        now: SystemTime,
    ) {
        if self.policy.effect(&kind) == Effect::Unhealthy {
            state.last_unhealthy = Some(now);
            if self.policy.recover(&kind) == Recover::Auto {
                state.next_probe = Some(now + self.policy.quiet_period);
            }
        }
        match state.conditions.iter_mut().find(|c| c.kind == kind) {
            Some(existing) => {
                existing.count += 1;
                existing.last_seen = now;
                if detail.is_some() {
                    existing.detail = detail;
                }
            }
            None => state.conditions.push(Condition {
                kind,
                detail,
                count: 1,
                first_seen: now,
                last_seen: now,
            }),
        }
    }

    /// How strictly a condition holds a device: no effect, Unhealthy until it recovers, Unhealthy for good.
    fn strength(&self, kind: &ConditionKind) -> u8 {
        match (self.policy.effect(kind), self.policy.recover(kind)) {
            (Effect::None, _) => 0,
            (Effect::Unhealthy, Recover::Auto) => 1,
            (Effect::Unhealthy, Recover::Never) => 2,
        }
    }

    /// Keeps at most [`MAX_XID_CONDITIONS`] XID conditions, dropping the weakest (among equals, one the
    /// catalog does not name, then the oldest) into the count of other XIDs. Health cannot get weaker by it: a dropped Unhealthy XID leaves only XIDs
    /// at least as strong, and every XID that recovers does so at the same moment (the quiet period counts
    /// from the device's last Unhealthy event, whichever XID it was, and the driver's recovery action clears
    /// them all).
    fn bound_xids(&self, state: &mut DeviceHealth) {
        let xids = || {
            state
                .conditions
                .iter()
                .filter(|c| matches!(c.kind, ConditionKind::Xid(_)))
        };
        if xids().count() <= MAX_XID_CONDITIONS {
            return;
        }
        let weakest = state
            .conditions
            .iter()
            .enumerate()
            .filter(|(_, c)| matches!(c.kind, ConditionKind::Xid(_)))
            .min_by_key(|(_, c)| {
                // Among equals, an XID NVIDIA's catalog names (79: fallen off the bus) says more to the
                // operator than a value it does not know.
                let known = c.kind.value().and_then(xid_info).is_some();
                (self.strength(&c.kind), known, c.last_seen)
            })
            .map(|(at, _)| at);
        if let Some(at) = weakest {
            let dropped = state.conditions.remove(at);
            state.other_xids.events = state.other_xids.events.saturating_add(dropped.count);
            state.other_xids.last = dropped.kind.value();
        }
    }

    /// A probe found the GPU lost. That is no new event: the quiet period keeps counting from the last
    /// Unhealthy event the GPU raised (its loss, an XID 79), and the probe is retried after the probe
    /// interval: a lost GPU reset 12 minutes in is served at the next probe, not a quiet period after the
    /// last failed one. Only where the GPU raised no Unhealthy event does the probe's finding count as one.
    fn still_lost(&self, state: &mut DeviceHealth, now: SystemTime) {
        if state.last_unhealthy.is_none() {
            self.record(state, ConditionKind::GpuLost, None, now);
            return;
        }
        if !state
            .conditions
            .iter()
            .any(|c| c.kind == ConditionKind::GpuLost)
        {
            state.conditions.push(Condition {
                kind: ConditionKind::GpuLost,
                detail: None,
                count: 1,
                first_seen: now,
                last_seen: now,
            });
        }
        self.reschedule(state, now);
    }

    /// A probe succeeded: apply the driver's recovery action, then the quiet-period rule.
    fn answered(&self, state: &mut DeviceHealth, recovery_action: Option<u32>, now: SystemTime) {
        state.recovery_field = Some(recovery_action.is_some());
        let had_action = std::mem::take(&mut state.action_changed)
            || state
                .conditions
                .iter()
                .any(|c| matches!(c.kind, ConditionKind::RecoveryAction(_)));
        match recovery_action {
            Some(0) if had_action => {
                // The driver says the GPU is usable again: it is the authority.
                let clears = |c: &Condition| {
                    matches!(c.kind, ConditionKind::RecoveryAction(_))
                        || (self.policy.recover(&c.kind) == Recover::Auto
                            && c.kind.cleared_by_quiet_probe())
                };
                state.conditions.retain(|c| !clears(c));
            }
            Some(0) | None => {}
            Some(action) => {
                let kind = ConditionKind::RecoveryAction(action);
                let current = state.conditions.iter().any(|c| c.kind == kind);
                if !current {
                    state
                        .conditions
                        .retain(|c| !matches!(c.kind, ConditionKind::RecoveryAction(_)));
                    self.record(state, kind, None, now);
                }
            }
        }
        let action_pending = state
            .conditions
            .iter()
            .any(|c| matches!(c.kind, ConditionKind::RecoveryAction(_)));
        let quiet = state
            .last_unhealthy
            .is_none_or(|t| now.duration_since(t).unwrap_or_default() >= self.policy.quiet_period);
        if quiet && !action_pending {
            state.conditions.retain(|c| {
                !(c.kind.cleared_by_quiet_probe() && self.policy.recover(&c.kind) == Recover::Auto)
            });
        }
        self.reschedule(state, now);
    }

    /// After a probe: probe again after the probe interval while something may still recover.
    fn reschedule(&self, state: &mut DeviceHealth, now: SystemTime) {
        let waiting = state.conditions.iter().any(|c| {
            c.kind.cleared_by_quiet_probe()
                && self.policy.recover(&c.kind) == Recover::Auto
                && self.policy.effect(&c.kind) == Effect::Unhealthy
        });
        state.next_probe = waiting.then(|| {
            self.quiet_end(state, now)
                .max(now + self.policy.probe_interval)
        });
    }

    /// When the quiet period after the device's last Unhealthy event ends (`now` if it never had one).
    fn quiet_end(&self, state: &DeviceHealth, now: SystemTime) -> SystemTime {
        state
            .last_unhealthy
            .map_or(now, |t| t + self.policy.quiet_period)
    }

    /// Devices to probe now; each is then not due again for a probe interval, so a probe that never comes
    /// back is retried.
    pub fn due_probes(&mut self, now: SystemTime) -> Vec<String> {
        let interval = self.policy.probe_interval;
        let mut due: Vec<String> = self
            .devices
            .iter_mut()
            .filter(|(_, s)| s.next_probe.is_some_and(|t| t <= now))
            .map(|(id, s)| {
                s.next_probe = Some(now + interval);
                id.clone()
            })
            .collect();
        due.sort();
        due
    }

    /// The earliest time a probe falls due, for the caller's timer.
    pub fn next_deadline(&self) -> Option<SystemTime> {
        self.devices.values().filter_map(|s| s.next_probe).min()
    }

    /// Forgets a device that is gone.
    pub fn remove(&mut self, device: &str) {
        self.devices.remove(device);
    }

    /// Devices with any condition, for the checkpoint.
    pub fn devices(&self) -> impl Iterator<Item = (&String, &DeviceHealth)> {
        self.devices.iter()
    }

    /// Puts back the state of a device from a checkpoint. On a new boot, conditions a reboot resolves (all
    /// but `recover: never`) are dropped. Returns the outcome as if observed now.
    pub fn restore(
        &mut self,
        device: &str,
        conditions: Vec<Condition>,
        last_unhealthy: Option<SystemTime>,
        rebooted: bool,
        now: SystemTime,
    ) -> Outcome {
        let conditions: Vec<Condition> = conditions
            .into_iter()
            .filter(|c| !rebooted || self.policy.recover(&c.kind) == Recover::Never)
            .collect();
        let mut state = DeviceHealth {
            conditions,
            last_unhealthy,
            ..DeviceHealth::default()
        };
        // A checkpoint written before the bound, or by hand, may hold more.
        while state
            .conditions
            .iter()
            .filter(|c| matches!(c.kind, ConditionKind::Xid(_)))
            .count()
            > MAX_XID_CONDITIONS
        {
            self.bound_xids(&mut state);
        }
        self.reschedule(&mut state, now);
        if state.next_probe.is_some() {
            // Whatever the quiet period left, look at the GPU soon after start: it may have been reset while
            // the plugin was away.
            state.next_probe = Some(self.quiet_end(&state, now).max(now));
        }
        let outcome = self.outcome(Health::Healthy, &state, !state.conditions.is_empty(), false);
        self.devices.insert(device.to_string(), state);
        outcome
    }

    /// Whether any device holds a condition that outlives a reboot (`recover: never`): only then must the
    /// checkpoint reach the disk before the next crash; everything else a new boot drops anyway.
    pub fn holds_conditions_past_reboot(&self) -> bool {
        self.devices.values().any(|state| {
            state
                .conditions
                .iter()
                .any(|c| self.policy.recover(&c.kind) == Recover::Never)
        })
    }

    /// The last Unhealthy event on `device`, for the checkpoint.
    pub fn last_unhealthy(&self, device: &str) -> Option<SystemTime> {
        self.devices.get(device).and_then(|s| s.last_unhealthy)
    }
}

#[cfg(test)]
mod tests;
