//! The IO around the health engine: takes a device source's events, asks it for probes when the engine wants
//! them, publishes the inventory every ListAndWatch stream reads, logs each transition once, and keeps the
//! checkpoint current.
//!
//! Source → `mpsc` of events → this task (engine) → `watch` of the inventory → gRPC streams; probe requests
//! go back to the source on their own channel. The kubelet comes first: a change is published, the gRPC
//! connection writes it, and only then is it logged and checkpointed.

pub mod checkpoint;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::MissedTickBehavior;

use crate::devices::DeviceInfo;
use crate::devices::{Health, Inventory, InventoryWatch};
use crate::health::checkpoint::{Checkpoint, DeviceRecord, Durability};
use crate::health::policy::Recover;
use crate::health::{Condition, Effect};
use crate::health::{ConditionKind, ConditionSelector, HealthEngine, Observation, Outcome, Policy};
use crate::metrics::Metrics;
use crate::sources::{DeviceEvent, DeviceSource, Heartbeat, SourceError};
use checkpoint::Store;

/// How the monitor runs.
#[derive(Debug, Clone)]
pub struct MonitorConfig {
    /// The health policy.
    pub policy: Policy,
    /// Where the checkpoint lives; `None` keeps state in memory only.
    pub state_dir: Option<PathBuf>,
    /// Where this boot's id is read.
    pub boot_id_path: PathBuf,
    /// Where events, transitions and publish latency are counted, if anywhere.
    pub metrics: Arc<Metrics>,
}

impl MonitorConfig {
    /// Default policy, no checkpoint.
    pub fn in_memory() -> Self {
        MonitorConfig {
            policy: Policy::default(),
            state_dir: None,
            boot_id_path: PathBuf::from(checkpoint::DEFAULT_BOOT_ID_PATH),
            metrics: Metrics::off(),
        }
    }
}

/// The way in to the running monitor for everything but the kubelet's streams: every device as it stands
/// ([`MonitorHandle::devices`], for `/status`, `/metrics` and the fence sources; [`MonitorHandle::refresh`]
/// for the followers of [`Monitored::devices`]), operators' fences and releases
/// ([`MonitorHandle::operate`]) and the checkpoint saved at shutdown ([`MonitorHandle::flush`]). The monitor
/// answers between events, so an answer also says that it is alive.
#[derive(Debug, Clone)]
pub struct MonitorHandle(mpsc::Sender<Query>);

/// What can be asked of the monitor.
#[derive(Debug)]
enum Query {
    /// Every device's status.
    Devices(oneshot::Sender<Vec<DeviceSnapshot>>),
    /// Save the checkpoint now; the answer follows the writer until it is idle.
    Flush(oneshot::Sender<Option<watch::Receiver<bool>>>),
    /// Send every device's snapshot to the followers of [`Monitored::devices`] now, changed or not (a
    /// message's count and times move on without a change the monitor would send it for).
    Refresh,
    /// An operator's fence or release.
    Operate {
        target: String,
        request: OperatorRequest,
        reply: oneshot::Sender<Result<Vec<Operated>, OperatorError>>,
    },
}

/// What an operator asks of a device (or of every MIG device of a GPU, named by the GPU's UUID).
#[derive(Debug, Clone)]
pub enum OperatorRequest {
    /// Take it out of service: the `fenced` condition.
    Fence {
        /// Why.
        reason: String,
        /// Who, and by which way in.
        by: String,
    },
    /// Clear conditions: `fenced`, or one stuck on a repaired GPU when named.
    Release {
        /// Which conditions.
        which: ConditionSelector,
        /// Why (logged).
        reason: String,
        /// Who, and by which way in.
        by: String,
    },
}

/// A device an operator's request changed, and its health after.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Operated {
    /// The device.
    pub id: String,
    /// `Healthy` or `Unhealthy`.
    pub health: String,
}

/// Why an operator's request did nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OperatorError {
    /// No device has that ID or NVML index, and no GPU of MIG devices has that UUID.
    #[error(
        "no device {target} on this node (devices: {known}){}",
        .command.as_ref().map(|c| format!(" — name one by UUID or NVML index, e.g. run: {c}")).unwrap_or_default()
    )]
    UnknownDevice {
        /// What was asked for.
        target: String,
        /// The devices there are, comma-separated (cut short on a large node); `index=UUID` where the
        /// request could name them by index too.
        known: String,
        /// A command that names a device that is there, for a request from the command line.
        command: Option<String>,
    },
    /// The device holds no condition of that name.
    #[error(
        "no condition {which} on {target}; conditions there: {has}{}",
        .command.as_ref().map(|c| format!(" — run: {c}")).unwrap_or_else(|| " (nothing to release)".into())
    )]
    NoSuchCondition {
        /// The device.
        target: String,
        /// The condition asked for.
        which: String,
        /// The conditions it has.
        has: String,
        /// The command that releases what it has, when it has anything.
        command: Option<String>,
    },
    /// The monitor is gone (the plugin is stopping).
    #[error("the plugin is stopping")]
    Stopping,
}

impl MonitorHandle {
    /// Applies an operator's request to `target`: a device ID, or a GPU's UUID for all its MIG devices.
    pub async fn operate(
        &self,
        target: &str,
        request: OperatorRequest,
    ) -> Result<Vec<Operated>, OperatorError> {
        let (reply, answer) = oneshot::channel();
        let query = Query::Operate {
            target: target.to_string(),
            request,
            reply,
        };
        self.0
            .send(query)
            .await
            .map_err(|_| OperatorError::Stopping)?;
        answer.await.unwrap_or(Err(OperatorError::Stopping))
    }

    /// A handle whose questions are taken but never answered while the returned guard lives: a monitor
    /// busy with something else.
    #[cfg(test)]
    pub(crate) fn unanswered() -> (MonitorHandle, impl Send) {
        let (tx, rx) = mpsc::channel(64);
        (MonitorHandle(tx), rx)
    }

    /// Every device as the monitor sees it now, or `None` if the monitor is gone.
    pub async fn devices(&self) -> Option<Vec<DeviceSnapshot>> {
        let (reply, answer) = oneshot::channel();
        self.0.send(Query::Devices(reply)).await.ok()?;
        answer.await.ok()
    }

    /// Asks for every device's snapshot to be sent to the followers of [`Monitored::devices`] now. Does not
    /// wait: a full queue means the monitor has questions to answer first, and the next refresh asks again.
    pub fn refresh(&self) {
        let _full = self.0.try_send(Query::Refresh);
    }

    /// As [`MonitorHandle::refresh`], waiting for room in the queue: for a follower that has nothing yet.
    pub async fn refresh_now(&self) {
        let _gone = self.0.send(Query::Refresh).await;
    }

    /// Saves the current state to the checkpoint and waits until it is written. For shutdown: a write still
    /// queued when the runtime stops would never run, and a restart would forget what the kubelet was told.
    pub async fn flush(&self) {
        let (reply, answer) = oneshot::channel();
        if self.0.send(Query::Flush(reply)).await.is_err() {
            return;
        }
        if let Ok(Some(mut busy)) = answer.await {
            let _written = busy.wait_for(|busy| !busy).await;
        }
    }
}

/// A running monitor: the inventory every ListAndWatch stream reads, and a way to ask for the details.
#[derive(Debug)]
pub struct Monitored {
    /// The inventory watch.
    pub inventory: InventoryWatch,
    /// The way in for devices, fences and the shutdown flush.
    pub handle: MonitorHandle,
    /// Every device's snapshot, sent whenever the inventory or a device's conditions change, for a reader
    /// that needs the conditions with every change (the DRA side's taints) without asking for them.
    pub devices: DevicesFeed,
    /// The heartbeats of the source's event threads, where it has them.
    pub heartbeat: Option<Heartbeat>,
    /// Devices the source found but does not serve, with why (for the status report).
    pub unserved: Vec<crate::devices::Unserved>,
}

/// Every device as the monitor saw it after a change, in the inventory's order.
pub type Snapshots = Arc<Vec<DeviceSnapshot>>;

/// Where [`Snapshots`] are followed. The monitor builds them only while someone follows: a node without a
/// reader pays nothing for them.
#[derive(Debug, Clone)]
pub struct DevicesFeed(watch::Sender<Snapshots>);

impl DevicesFeed {
    /// Follows the snapshots from the next change or [`MonitorHandle::refresh`] on: the one held now may
    /// be older than the inventory (nobody followed it), so a new follower asks for a refresh.
    pub fn follow(&self) -> watch::Receiver<Snapshots> {
        self.0.subscribe()
    }
}

/// One device as the monitor sees it between two events: what `/status`, `/metrics` and the fence sources
/// work from. Typed: each of them renders it in its own terms.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceSnapshot {
    /// What the device is.
    pub info: DeviceInfo,
    /// NVML's index of the GPU (of its GPU, for a MIG device), as `nvidia-smi` numbers it; the position in
    /// the device list where the source has no index.
    pub index: usize,
    /// Its health as the kubelet has it.
    pub health: Health,
    /// The health message, when the device has conditions (or the reason it is listed Unhealthy).
    pub message: Option<String>,
    /// Its conditions, in the order first seen, each with what the policy in force makes of it.
    pub conditions: Vec<ConditionSnapshot>,
}

/// One active condition, with its effect and recovery under the policy in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConditionSnapshot {
    /// The condition as the engine holds it.
    pub condition: Condition,
    /// Whether it takes the device out of service.
    pub effect: Effect,
    /// Whether it clears by itself.
    pub recover: Recover,
}

/// Discovers the source's devices, restores their health from the checkpoint, starts the source and the
/// monitor task. Returns the inventory watch the gRPC server reads. Must be called inside a tokio runtime.
pub fn spawn(
    source: Box<dyn DeviceSource>,
    config: MonitorConfig,
) -> Result<InventoryWatch, SourceError> {
    spawn_monitored(source, config).map(|m| m.inventory)
}

/// As [`spawn`], with a way to query the monitor.
pub fn spawn_monitored(
    mut source: Box<dyn DeviceSource>,
    config: MonitorConfig,
) -> Result<Monitored, SourceError> {
    let heartbeat = source.heartbeat();
    let found = source.discover()?;
    let unserved = source.unserved();
    tracing::info!(
        devices = found.len(),
        not_served = unserved.len(),
        "discovered devices"
    );
    let mut inventory = Inventory::new(found);
    let mut engine = HealthEngine::new(config.policy.clone());
    let store = config.state_dir.as_deref().map(Store::in_dir);
    let boot_id = checkpoint::read_boot_id(&config.boot_id_path);
    if boot_id.is_none() {
        tracing::warn!(path = %config.boot_id_path.display(), "cannot read the boot id; reboots will not be recognised");
    }
    let carried = match &store {
        Some(store) => restore(
            &mut engine,
            &mut inventory,
            store,
            boot_id.as_deref(),
            source.unidentified(),
        ),
        None => BTreeMap::new(),
    };

    let ids: Vec<String> = inventory
        .devices()
        .iter()
        .map(|d| d.info.id.clone())
        .collect();
    let (tx, rx) = watch::channel(Arc::new(inventory));
    // Bounded: a source that outruns the engine waits rather than growing memory.
    let (event_tx, event_rx) = mpsc::channel(1024);
    let (probe_tx, probe_rx) = mpsc::channel(64);
    source.start(event_tx, probe_rx)?;
    // A first probe of every device reads the driver's recovery action and tells whether it has one.
    if !ids.is_empty() {
        let _full = probe_tx.try_send(ids);
    }
    let monitor = Monitor {
        engine,
        inventory: tx,
        probes: probe_tx,
        writer: store.map(Writer::new),
        carried,
        boot_id,
        metrics: config.metrics.clone(),
        devices: watch::Sender::new(Arc::default()),
        devices_changed: false,
    };
    // What was restored from the checkpoint, for a follower from the start.
    monitor.devices.send_replace(Arc::new(monitor.snapshot()));
    let devices = DevicesFeed(monitor.devices.clone());
    let (query_tx, query_rx) = mpsc::channel(16);
    tokio::spawn(monitor.run(event_rx, query_rx));
    Ok(Monitored {
        inventory: rx,
        handle: MonitorHandle(query_tx),
        devices,
        heartbeat,
        unserved,
    })
}

/// Puts the checkpoint's conditions back on the devices listed. Returns the records of devices not listed
/// that must still be written with every checkpoint: while `unidentified` devices are present, one of them
/// may be such a device.
fn restore(
    engine: &mut HealthEngine,
    inventory: &mut Inventory,
    store: &Store,
    boot_id: Option<&str>,
    unidentified: usize,
) -> BTreeMap<String, DeviceRecord> {
    let mut carried = BTreeMap::new();
    let saved = match store.load() {
        Ok(Some(saved)) => saved,
        Ok(None) => return carried,
        Err(e) => {
            // Kept aside, not overwritten by the next save: a rollback from a newer version, or a damaged
            // file, loses nothing for good.
            if !matches!(e, checkpoint::CheckpointError::Corrupt { .. }) {
                tracing::warn!(error = %e, "ignoring the health checkpoint; starting with every GPU Healthy");
                return carried;
            }
            match store.set_aside() {
                Ok(aside) => tracing::warn!(
                    error = %e,
                    kept = %aside.display(),
                    "ignoring the health checkpoint (kept aside); starting with every GPU Healthy"
                ),
                Err(rename) => tracing::warn!(
                    error = %e,
                    rename = %rename,
                    "ignoring the health checkpoint, which cannot be moved aside either; starting with every GPU Healthy"
                ),
            }
            return carried;
        }
    };
    let rebooted =
        matches!((saved.boot_id.as_deref(), boot_id), (Some(before), Some(now)) if before != now);
    if rebooted {
        tracing::info!(
            "the node rebooted since the checkpoint; dropping conditions a reboot resolves"
        );
    }
    let now = SystemTime::now();
    for (id, record) in &saved.devices {
        if inventory.get(id).is_none() {
            if unidentified > 0 {
                tracing::warn!(device = %id, unidentified, "device in the checkpoint is not listed, but GPUs are present that cannot be named; its record is kept");
                let mut record = record.clone();
                if rebooted {
                    record.conditions.retain(|c| {
                        ConditionKind::from_parts(&c.condition, c.value)
                            .is_some_and(|kind| engine.policy().recover(&kind) == Recover::Never)
                    });
                }
                if !record.conditions.is_empty() {
                    carried.insert(id.clone(), record);
                }
            } else {
                tracing::info!(device = %id, "device in the checkpoint is gone; dropped");
            }
            continue;
        }
        let outcome = engine.restore(
            id,
            record.conditions(),
            record.last_unhealthy(),
            rebooted,
            now,
        );
        // Listed Unhealthy from the start: out of service, so at warn level as any other way out is.
        if outcome.new == Health::Unhealthy {
            tracing::warn!(
                device = %id,
                health = %outcome.new,
                conditions = %outcome.conditions.join(","),
                health_message = outcome.message.as_deref().unwrap_or(""),
                "restored device health from the checkpoint"
            );
        } else if !outcome.conditions.is_empty() {
            tracing::info!(
                device = %id,
                health = %outcome.new,
                conditions = %outcome.conditions.join(","),
                health_message = outcome.message.as_deref().unwrap_or(""),
                "restored device health from the checkpoint"
            );
        }
        let message = in_context(inventory, id, outcome.message);
        inventory.set_health(id, outcome.new, message);
    }
    carried
}

/// A device's message as every surface shows it: a MIG device's names its profile and GPU, so that an
/// operator reading an Event or a pod's refusal knows which slice of which GPU it is about.
fn in_context(inventory: &Inventory, id: &str, message: Option<String>) -> Option<String> {
    let message = message?;
    let Some(mig) = inventory.get(id).and_then(|d| d.info.mig.as_ref()) else {
        return Some(message);
    };
    let (health, rest) = message.split_once(": ").unwrap_or(("", message.as_str()));
    Some(crate::health::message::truncate(&format!(
        "{health}: MIG device {} of GPU {}: {rest}",
        mig.profile, mig.parent
    )))
}

/// A change the kubelet has been sent, still to be logged and checkpointed.
struct Recorded {
    id: String,
    observation: Observation,
    outcome: Outcome,
}

struct Monitor {
    engine: HealthEngine,
    inventory: watch::Sender<Arc<Inventory>>,
    probes: mpsc::Sender<Vec<String>>,
    writer: Option<Writer>,
    /// Records of devices not listed, kept while devices are present that cannot be named.
    carried: BTreeMap<String, DeviceRecord>,
    boot_id: Option<String>,
    metrics: Arc<Metrics>,
    /// Where every device's snapshot goes after a change, for those who follow it.
    devices: watch::Sender<Snapshots>,
    /// Whether the inventory or a device's conditions changed since the snapshots were last sent.
    devices_changed: bool,
}

impl Monitor {
    async fn run(
        mut self,
        mut events: mpsc::Receiver<DeviceEvent>,
        mut queries: mpsc::Receiver<Query>,
    ) {
        self.save();
        // First tick one period from now. (An interval's immediate first tick, awaited, still waits for the
        // timer wheel's next millisecond, and events arriving meanwhile would wait with it.)
        let period = self.engine.policy().recovery_action_interval;
        let mut poll = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        poll.set_missed_tick_behavior(MissedTickBehavior::Delay);
        // A source may have nothing more to say (the driver's GPUs served unmonitored without NVML report
        // once, at start; GPUs whose event threads all ended): the monitor goes on all the same. It owns the
        // inventory every ListAndWatch stream reads and answers `/healthz`, `/status` and the operators'
        // fences; stopping with the source would take all of them away, and nothing would bring them back.
        let mut source_open = true;
        loop {
            let now = SystemTime::now();
            let due = self.engine.due_probes(now);
            self.probe(due);
            let wait = self
                .engine
                .next_deadline()
                .map(|d| d.duration_since(now).unwrap_or_default());
            tokio::select! {
                event = events.recv(), if source_open => match event {
                    Some(event) => {
                        let after = self.handle(event);
                        if self.devices_changed {
                            // The kubelet first: let the gRPC connection, woken by the new inventory, write
                            // the list before this thread builds the snapshots, logs the change and wakes the
                            // checkpoint writer, whose disk work would compete with that write and with the
                            // kubelet reading it.
                            tokio::task::yield_now().await;
                            self.send_devices();
                        }
                        if let Some(after) = after {
                            self.record(after);
                        }
                    }
                    None => {
                        tracing::debug!("the device source sends no more events; devices stay as they are");
                        source_open = false;
                    }
                },
                () = sleep(wait) => {}
                Some(query) = queries.recv() => match query {
                    Query::Devices(reply) => {
                        let _asker_gone = reply.send(self.snapshot());
                    }
                    Query::Refresh => {
                        self.devices_changed = true;
                        self.send_devices();
                    }
                    Query::Flush(reply) => {
                        self.save();
                        let busy = self.writer.as_ref().map(|w| w.busy.subscribe());
                        let _asker_gone = reply.send(busy);
                    }
                    Query::Operate { target, request, reply } => {
                        let answer = self.operate(&target, request);
                        if let Ok(changed) = &answer && !changed.is_empty() {
                            tokio::task::yield_now().await;
                            self.send_devices();
                            self.save();
                        }
                        let _asker_gone = reply.send(answer);
                    }
                },
                _ = poll.tick() => {
                    let ids = self.inventory.borrow().devices().iter()
                        .filter(|d| self.engine.device(&d.info.id).and_then(|s| s.reports_recovery_action()) == Some(true))
                        .map(|d| d.info.id.clone())
                        .collect();
                    self.probe(ids);
                }
            }
        }
    }

    /// An operator's fence or release of `target` (a device, or every MIG device of a GPU): applied as an
    /// observation, so the kubelet, the log and every surface learn it as they learn a fault. Returns the
    /// devices changed (before the checkpoint is saved, which the caller does).
    fn operate(
        &mut self,
        target: &str,
        request: OperatorRequest,
    ) -> Result<Vec<Operated>, OperatorError> {
        let command = match &request {
            OperatorRequest::Fence { .. } => "fence",
            OperatorRequest::Release { .. } => "release",
        };
        let (devices, name) = self.chosen(target);
        if devices.is_empty() {
            return Err(self.unknown_device(target, command));
        }
        let target = name.as_str();
        let (observation, devices) = match request {
            OperatorRequest::Fence { reason, by } => {
                tracing::warn!(device = %target, %by, %reason, "fenced by an operator: out of service until released");
                (Observation::Fence { reason, by }, devices)
            }
            OperatorRequest::Release { which, reason, by } => {
                let holding = self.holding(target, &devices, &which, &reason, &by)?;
                (Observation::Release { which }, holding)
            }
        };
        let mut changed = Vec::new();
        for id in devices {
            let event = DeviceEvent::Observed {
                id: id.clone(),
                observation: observation.clone(),
                at: SystemTime::now(),
            };
            if let Some(after) = self.handle(event) {
                log(&after.id, &after.observation, &after.outcome);
            }
            changed.push(Operated {
                health: self.engine.health(&id).as_api_str().to_string(),
                id,
            });
        }
        Ok(changed)
    }

    /// The devices `target` names (a device, or every MIG device of a GPU; by UUID, or by the NVML index
    /// `nvidia-smi` shows beside it, what an operator reads off a node before pulling a card), and the UUID
    /// they are logged and answered under.
    fn chosen(&self, target: &str) -> (Vec<String>, String) {
        let by_index = target.parse::<usize>().ok();
        let inventory = self.inventory.borrow();
        let chosen: Vec<&crate::devices::DeviceState> = inventory
            .devices()
            .iter()
            .filter(|d| {
                d.info.id == target
                    || d.info.mig.as_ref().is_some_and(|m| m.parent == target)
                    || d.info.index.as_deref() == Some(target)
                    || by_index.is_some_and(|i| d.info.gpu_index() == Some(i))
            })
            .collect();
        // Logged and answered under the UUID, whichever way it was named.
        let name = match chosen.as_slice() {
            [one] => one.info.id.clone(),
            [first, ..] => first
                .info
                .mig
                .as_ref()
                .filter(|m| {
                    chosen
                        .iter()
                        .all(|d| d.info.mig.as_ref().is_some_and(|o| o.parent == m.parent))
                })
                .map_or_else(|| target.to_string(), |m| m.parent.clone()),
            [] => target.to_string(),
        };
        (chosen.iter().map(|d| d.info.id.clone()).collect(), name)
    }

    /// Why `target` names no device, with the devices there are and the command that would work.
    fn unknown_device(&self, target: &str, command: &str) -> OperatorError {
        let inventory = self.inventory.borrow();
        let known: Vec<String> = inventory
            .devices()
            .iter()
            .enumerate()
            .map(|(position, d)| match &d.info.index {
                Some(index) => format!("{index}={}", d.info.id),
                None => format!("{position}={}", d.info.id),
            })
            .collect();
        let example = inventory
            .devices()
            .first()
            .map_or_else(|| "GPU-…".to_string(), |d| d.info.id.clone());
        OperatorError::UnknownDevice {
            target: crate::util::text::shown(target, 80),
            known: crate::util::text::cut_bytes(&known.join(", "), 400),
            command: Some(format!("gpu-device-plugin {command} {example}")),
        }
    }

    /// The devices of `devices` holding a condition `which` matches, with the release logged; refused when
    /// none does, with what each holds and the command that would release it.
    fn holding(
        &self,
        target: &str,
        devices: &[String],
        which: &ConditionSelector,
        reason: &str,
        by: &str,
    ) -> Result<Vec<String>, OperatorError> {
        let holding: Vec<String> = devices
            .iter()
            .filter(|id| {
                self.engine
                    .device(id)
                    .is_some_and(|h| h.conditions().iter().any(|c| which.matches(&c.kind)))
            })
            .cloned()
            .collect();
        if holding.is_empty() {
            let mut has: Vec<String> = devices
                .iter()
                .filter_map(|id| self.engine.device(id))
                .flat_map(|h| h.conditions().iter().map(|c| c.kind.to_string()))
                .collect();
            has.dedup();
            // The command that would release what is there: a fence without --condition.
            let command = has.first().map(|first| match first.as_str() {
                "fenced" => format!("gpu-device-plugin release {target}"),
                other => format!("gpu-device-plugin release {target} --condition {other}"),
            });
            return Err(OperatorError::NoSuchCondition {
                target: target.to_string(),
                which: which.to_string(),
                has: if has.is_empty() {
                    "none".into()
                } else {
                    has.join(", ")
                },
                command,
            });
        }
        let never = holding
            .iter()
            .filter_map(|id| self.engine.device(id))
            .any(|h| {
                h.conditions().iter().any(|c| {
                    which.matches(&c.kind)
                        && c.kind != ConditionKind::Fenced
                        && self.engine.policy().recover(&c.kind) == Recover::Never
                })
            });
        if never {
            tracing::warn!(device = %target, condition = %which, %by, %reason, "an operator released a recover: never condition");
        } else {
            tracing::info!(device = %target, condition = %which, %by, %reason, "released by an operator");
        }
        Ok(holding)
    }

    /// Every device as it stands, in the inventory's order.
    fn snapshot(&self) -> Vec<DeviceSnapshot> {
        let policy = self.engine.policy();
        self.inventory
            .borrow()
            .devices()
            .iter()
            .enumerate()
            .map(|(position, d)| DeviceSnapshot {
                index: d.info.gpu_index().unwrap_or(position),
                info: d.info.clone(),
                health: d.health,
                message: d.reason.clone().or_else(|| self.engine.message(&d.info.id)),
                conditions: self
                    .engine
                    .device(&d.info.id)
                    .map(|h| h.conditions())
                    .unwrap_or_default()
                    .iter()
                    .map(|c| ConditionSnapshot {
                        effect: policy.effect(&c.kind),
                        recover: policy.recover(&c.kind),
                        condition: c.clone(),
                    })
                    .collect(),
            })
            .collect()
    }

    fn probe(&self, ids: Vec<String>) {
        if ids.is_empty() {
            return;
        }
        tracing::debug!(devices = ?ids, "probing");
        // A full queue means probes are already on their way; the engine asks again after the probe interval.
        let _full = self.probes.try_send(ids);
    }

    /// Applies an event to the engine and the inventory; returns what is left to do once the kubelet has
    /// the change: the log line and the checkpoint.
    fn handle(&mut self, event: DeviceEvent) -> Option<Recorded> {
        match event {
            DeviceEvent::Observed {
                id,
                observation,
                at,
            } => {
                if self.inventory.borrow().get(&id).is_none() {
                    tracing::warn!(device = %id, %observation, "event for a device that is not present; ignored");
                    return None;
                }
                self.metrics.observed(&observation);
                let outcome = self.engine.observe(&id, &observation, at);
                if outcome.probe_now {
                    self.probe(vec![id.clone()]);
                }
                let health = outcome.new;
                let message = in_context(&self.inventory.borrow(), &id, outcome.message.clone());
                // Most events (a harmless XID, a probe that changes nothing) leave the inventory as it is:
                // check before copying it.
                if self
                    .inventory
                    .borrow()
                    .would_change(&id, health, message.as_deref())
                {
                    self.publish(|inv| inv.set_health(&id, health, message));
                    self.metrics
                        .published(SystemTime::now().duration_since(at).unwrap_or_default());
                    if outcome.is_transition() {
                        self.metrics.transition(outcome.new.as_api_str());
                    }
                }
                if outcome.is_transition() || outcome.conditions_changed {
                    self.devices_changed = true;
                    return Some(Recorded {
                        id,
                        observation,
                        outcome,
                    });
                }
                log(&id, &observation, &outcome);
                None
            }
            DeviceEvent::Removed(id) => {
                self.engine.remove(&id);
                tracing::info!(device = %id, "device removed");
                self.publish(|inv| inv.remove(&id));
                self.save();
                None
            }
            DeviceEvent::Added(info) => {
                tracing::info!(device = %info.id, "device added");
                self.publish(|inv| inv.add(info));
                None
            }
        }
    }

    /// Logs a change of health or conditions and saves the checkpoint.
    fn record(&self, recorded: Recorded) {
        log(&recorded.id, &recorded.observation, &recorded.outcome);
        self.save();
    }

    /// Sends every device's snapshot to its followers if anything changed since the last time, and if
    /// anyone follows. A condition that changes no health (an XID recorded only) still changes what they
    /// show. Called once the kubelet has the change, and before the log and the checkpoint of a change of
    /// health or conditions: the snapshots are how the DRA side learns which condition it is, for the slices'
    /// taints.
    fn send_devices(&mut self) {
        if !std::mem::take(&mut self.devices_changed) || self.devices.receiver_count() == 0 {
            return;
        }
        self.devices.send_replace(Arc::new(self.snapshot()));
    }

    /// Applies `change` to the inventory and publishes it if it changed anything. The inventory is copied
    /// only if a reader still holds the current one (a list being built); readers keep what they hold.
    fn publish(&mut self, change: impl FnOnce(&mut Inventory) -> bool) {
        let changed = self
            .inventory
            .send_if_modified(|current| change(Arc::make_mut(current)));
        self.devices_changed |= changed;
    }

    /// Hands the current state to the checkpoint writer and carries on: a burst of faults on several GPUs
    /// must not queue behind one fsync each on its way to the kubelet.
    fn save(&self) {
        if let Some(writer) = &self.writer {
            let mut checkpoint = Checkpoint::of(&self.engine, self.boot_id.clone());
            for (id, record) in &self.carried {
                checkpoint
                    .devices
                    .entry(id.clone())
                    .or_insert_with(|| record.clone());
            }
            // A carried record may hold the only condition that must outlive a reboot.
            let durability = if self.carried.is_empty() {
                Durability::needed_by(&self.engine)
            } else {
                Durability::Synced
            };
            writer.save(checkpoint, durability);
        }
    }
}

/// Writes checkpoints off the runtime thread, newest first: while a write is in progress, later states
/// replace each other in one pending slot, and the writer takes the newest when it is done. At most one
/// blocking task writes at a time. The runtime does not run a blocking task still queued when it stops, so
/// at shutdown the plugin asks for a last save and waits for the writer ([`MonitorHandle::flush`]): the last
/// state a kubelet has seen is on disk before the plugin is gone.
struct Writer {
    store: Store,
    state: Arc<std::sync::Mutex<WriterState>>,
    /// True from a save until every pending state is written.
    busy: Arc<watch::Sender<bool>>,
    /// Saves that failed in a row (0 once one succeeds).
    failures: Arc<watch::Sender<u32>>,
}

#[derive(Default)]
struct WriterState {
    pending: Option<(Checkpoint, Durability)>,
    running: bool,
}

impl Writer {
    fn new(store: Store) -> Self {
        Writer {
            store,
            state: Arc::default(),
            busy: Arc::new(watch::Sender::new(false)),
            failures: Arc::new(watch::Sender::new(0)),
        }
    }

    fn save(&self, checkpoint: Checkpoint, durability: Durability) {
        let mut state = lock(&self.state);
        state.pending = Some((checkpoint, durability));
        if state.running {
            return;
        }
        state.running = true;
        self.busy.send_replace(true);
        drop(state);
        let (store, shared, busy) = (self.store.clone(), self.state.clone(), self.busy.clone());
        let failed = self.failures.clone();
        tokio::task::spawn_blocking(move || {
            let mut failures = 0u32;
            loop {
                let next = {
                    let mut state = lock(&shared);
                    let next = state.pending.take();
                    if next.is_none() {
                        state.running = false;
                        busy.send_replace(false);
                    }
                    next
                };
                let Some((checkpoint, durability)) = next else {
                    break;
                };
                match store.save(&checkpoint, durability) {
                    Ok(()) => {
                        if failures > 0 {
                            tracing::info!(failures, "health checkpoint saved again");
                        }
                        failures = 0;
                        failed.send_replace(0);
                    }
                    Err(e) => {
                        failures += 1;
                        failed.send_replace(failures);
                        let pause = save_retry_pause(failures);
                        if failures == 1 {
                            tracing::error!(error = %e, retry_in = %humantime::format_duration(pause), "cannot save the health checkpoint; a restart would forget GPU faults; trying again until it is saved");
                        } else {
                            tracing::debug!(error = %e, failures, "health checkpoint still not saved");
                        }
                        // Try again unless a newer state came meanwhile (it is written instead).
                        lock(&shared)
                            .pending
                            .get_or_insert((checkpoint, durability));
                        std::thread::sleep(pause);
                    }
                }
            }
        });
    }
}

/// How long the checkpoint writer waits before trying a failed save again: 1 s, doubling, at most 60 s.
fn save_retry_pause(failures: u32) -> Duration {
    Duration::from_secs(1u64 << failures.saturating_sub(1).min(6)).min(Duration::from_secs(60))
}

fn lock(state: &std::sync::Mutex<WriterState>) -> std::sync::MutexGuard<'_, WriterState> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A device taken out of service is logged at warn level, whatever took it out (a fault, a fence, a
/// restored condition): alerting on warn must not miss the event that matters most. Recovery is info.
fn log(id: &str, observation: &Observation, outcome: &Outcome) {
    if outcome.is_transition() && outcome.new == Health::Unhealthy {
        tracing::warn!(
            device = %id,
            old = %outcome.old,
            new = %outcome.new,
            conditions = %outcome.conditions.join(","),
            health_message = outcome.message.as_deref().unwrap_or(""),
            "device health changed"
        );
    } else if outcome.is_transition() {
        tracing::info!(
            device = %id,
            old = %outcome.old,
            new = %outcome.new,
            conditions = %outcome.conditions.join(","),
            health_message = outcome.message.as_deref().unwrap_or(""),
            "device health changed"
        );
    } else if outcome.conditions_changed {
        tracing::info!(device = %id, health = %outcome.new, conditions = %outcome.conditions.join(","), "device conditions changed");
    } else {
        tracing::debug!(device = %id, ?observation, health = %outcome.new, "observation recorded");
    }
}

async fn sleep(wait: Option<Duration>) {
    match wait {
        Some(wait) => tokio::time::sleep(wait).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checkpoint(n: usize) -> Checkpoint {
        Checkpoint {
            version: 1,
            boot_id: Some(format!("state-{n}")),
            devices: Default::default(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_fault_right_after_start_is_published_without_waiting_for_any_timer() {
        use crate::devices::Health;
        use crate::sources::simulated::{SimulatedGpus, simulated_uuid};

        // Start between two of the timer wheel's milliseconds, as a real process does.
        tokio::time::advance(Duration::from_micros(400)).await;
        let (gpus, control) = SimulatedGpus::new(2);
        let mut inventory = spawn(Box::new(gpus), MonitorConfig::in_memory())
            .unwrap_or_else(|e| panic!("monitor: {e}"));
        let started = tokio::time::Instant::now();
        control
            .observe(&simulated_uuid(1), Observation::Xid(79))
            .await;
        let id = simulated_uuid(1);
        let seen = inventory
            .wait_for(|inv| inv.get(&id).map(|d| d.health) == Some(Health::Unhealthy))
            .await
            .is_ok();
        assert!(seen, "the fault never reached the inventory");
        // The clock is paused and moves only when every task waits for a timer: had the monitor waited for
        // one (even one due now, which the timer wheel rounds up to its next millisecond), time would show it.
        assert_eq!(tokio::time::Instant::now(), started);
    }

    #[tokio::test]
    async fn a_follower_of_the_devices_gets_every_change_of_conditions_without_asking() {
        use crate::sources::simulated::{SimulatedGpus, simulated_uuid};
        let (gpus, control) = SimulatedGpus::new(2);
        let monitored = spawn_monitored(Box::new(gpus), MonitorConfig::in_memory())
            .unwrap_or_else(|e| panic!("monitor: {e}"));
        let mut feed = monitored.devices.follow();
        let conditions_of = |s: &Snapshots, id: &str| -> Vec<ConditionKind> {
            s.iter()
                .filter(|d| d.info.id == id)
                .flat_map(|d| d.conditions.iter().map(|c| c.condition.kind.clone()))
                .collect()
        };
        let wait = Duration::from_secs(5);
        // A new follower asks for what stands now.
        monitored.handle.refresh();
        let now = tokio::time::timeout(wait, feed.wait_for(|s| s.len() == 2))
            .await
            .expect("the refresh in time")
            .expect("the monitor runs")
            .clone();
        assert!(now.iter().all(|d| d.conditions.is_empty()));
        // A fault: the snapshot names the condition.
        let one = simulated_uuid(1);
        control.observe(&one, Observation::Xid(79)).await;
        let faulted =
            tokio::time::timeout(wait, feed.wait_for(|s| !conditions_of(s, &one).is_empty()))
                .await
                .expect("the fault in time")
                .expect("the monitor runs")
                .clone();
        assert_eq!(conditions_of(&faulted, &one), [ConditionKind::Xid(79)]);
        assert_eq!(
            faulted.iter().find(|d| d.info.id == one).map(|d| d.health),
            Some(crate::devices::Health::Unhealthy)
        );
        // A condition that changes no health (XID 31 is recorded only) is sent all the same: the inventory
        // does not change, the slices' taints do.
        let zero = simulated_uuid(0);
        control.observe(&zero, Observation::Xid(31)).await;
        let recorded =
            tokio::time::timeout(wait, feed.wait_for(|s| !conditions_of(s, &zero).is_empty()))
                .await
                .expect("the recorded condition in time")
                .expect("the monitor runs")
                .clone();
        assert_eq!(conditions_of(&recorded, &zero), [ConditionKind::Xid(31)]);
        assert_eq!(
            monitored.inventory.borrow().get(&zero).map(|d| d.health),
            Some(crate::devices::Health::Healthy)
        );
    }

    #[tokio::test]
    async fn status_shows_nvml_index_and_the_gpu_not_served_with_why() {
        use crate::sources::simulated::{SimulatedGpus, simulated_uuid};
        let (gpus, _control) = SimulatedGpus::new(3);
        let gpus = gpus.leave_unserved(0, "MIG mode is on and it has no MIG devices");
        let monitored = spawn_monitored(Box::new(gpus), MonitorConfig::in_memory())
            .unwrap_or_else(|e| panic!("monitor: {e}"));
        let devices = monitored.handle.devices().await.unwrap_or_default();
        let shown: Vec<(usize, &str)> = devices
            .iter()
            .map(|d| (d.index, d.info.id.as_str()))
            .collect();
        // GPU 1 is 1, as nvidia-smi numbers it, though it is first in the list.
        let (one, two) = (simulated_uuid(1), simulated_uuid(2));
        assert_eq!(shown, [(1, one.as_str()), (2, two.as_str())]);
        assert_eq!(
            monitored.unserved,
            [crate::devices::Unserved {
                index: Some(0),
                id: Some(simulated_uuid(0)),
                why: "MIG mode is on and it has no MIG devices".into(),
            }]
        );
    }

    #[test]
    fn records_of_unlisted_devices_are_kept_while_a_device_cannot_be_named()
    -> Result<(), Box<dyn std::error::Error>> {
        use crate::health::checkpoint::ConditionRecord;
        use crate::health::policy::HealthConfig;

        let dir = tempfile::tempdir()?;
        let store = Store::in_dir(dir.path());
        let condition = |name: &str, value| ConditionRecord {
            condition: name.into(),
            value,
            detail: None,
            count: 1,
            first_seen_ms: 1_000,
            last_seen_ms: 1_000,
        };
        let silent = DeviceRecord {
            conditions: vec![condition("ecc-dbe", None), condition("xid", Some(79))],
            last_unhealthy_ms: Some(1_000),
        };
        let mut saved = checkpoint(0);
        saved.boot_id = Some("boot-1".into());
        saved.devices.insert("GPU-silent".into(), silent);
        store.save(&saved, Durability::Synced)?;
        let config: HealthConfig =
            serde_norway::from_str("conditions:\n  ecc-dbe: {recover: never}\n")?;
        let policy = Policy::new(&config, None, None)?;
        let restore_with = |unidentified, boot| {
            let mut engine = HealthEngine::new(policy.clone());
            let mut inventory = Inventory::new(Vec::new());
            restore(
                &mut engine,
                &mut inventory,
                &store,
                Some(boot),
                unidentified,
            )
        };

        // Every GPU named: a device not listed is gone.
        assert!(restore_with(0, "boot-1").is_empty());
        // One GPU cannot be named: its record may be this one, and is kept whole on the same boot.
        let kept = restore_with(1, "boot-1");
        assert_eq!(kept.get("GPU-silent").map(|r| r.conditions.len()), Some(2));
        // After a reboot only what outlives one is kept.
        let kept = restore_with(1, "boot-2");
        let names: Vec<&str> = kept["GPU-silent"]
            .conditions
            .iter()
            .map(|c| c.condition.as_str())
            .collect();
        assert_eq!(names, ["ecc-dbe"]);
        Ok(())
    }

    #[test]
    fn a_failed_save_is_tried_again_until_it_is_written() -> Result<(), Box<dyn std::error::Error>>
    {
        let dir = tempfile::tempdir()?;
        // The state directory is gone (as on a disk that fails writes): the save fails.
        let state_dir = dir.path().join("state");
        let store = Store::in_dir(&state_dir);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()?;
        runtime.block_on(async {
            let writer = Writer::new(store.clone());
            let mut busy = writer.busy.subscribe();
            let mut failures = writer.failures.subscribe();
            writer.save(checkpoint(7), Durability::Synced);
            let failed =
                tokio::time::timeout(Duration::from_secs(10), failures.wait_for(|n| *n > 0))
                    .await
                    .is_ok_and(|seen| seen.is_ok());
            assert!(failed, "the save did not fail");
            std::fs::create_dir(&state_dir).unwrap_or_else(|e| panic!("{e}"));
            // The directory is back: the retry writes the checkpoint and the writer goes idle.
            let idle = tokio::time::timeout(Duration::from_secs(10), busy.wait_for(|b| !b))
                .await
                .is_ok_and(|seen| seen.is_ok());
            assert!(idle, "the writer never wrote the checkpoint");
        });
        let saved = store.load()?.and_then(|c| c.boot_id);
        assert_eq!(saved.as_deref(), Some("state-7"));
        assert_eq!(save_retry_pause(1), Duration::from_secs(1));
        assert_eq!(save_retry_pause(40), Duration::from_secs(60));
        Ok(())
    }

    #[test]
    fn the_writer_leaves_the_newest_state_on_disk_once_the_runtime_is_gone()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let store = Store::in_dir(dir.path());
        let runtime = tokio::runtime::Builder::new_current_thread().build()?;
        runtime.block_on(async {
            let writer = Writer::new(store.clone());
            for n in 0..200 {
                let durability = if n % 2 == 0 {
                    Durability::Synced
                } else {
                    Durability::Process
                };
                writer.save(checkpoint(n), durability);
            }
        });
        // Dropping the runtime waits for the writer, as the process does at exit.
        drop(runtime);
        let saved = store.load()?.and_then(|c| c.boot_id);
        assert_eq!(saved.as_deref(), Some("state-199"));
        Ok(())
    }
}
