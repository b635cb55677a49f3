//! The devices as DRA shows them: each under its published name, with the health the stream reports
//! (Healthy, Unhealthy, or Unknown while it is not watched), the engine's message, and the device taints its
//! conditions put on it in the ResourceSlice. Built from the DRA side's view of the inventory, with the
//! monitor's conditions; the health stream and the slices both read it, so they never disagree.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::api::dra::health_v1::HealthStatus;
use crate::devices::{DeviceInfo, DeviceState, Health, Inventory, InventoryWatch};
use crate::health::{ConditionKind, Effect};
use crate::monitor::{DeviceSnapshot, MonitorHandle, Snapshots};

use super::names::device_name;

/// The API's limit on taints per device.
pub const MAX_TAINTS: usize = 16;
/// The longest the slices wait for the monitor's snapshots after a change (and the view for the monitor to
/// take its first refresh); past it their view is built from the inventory alone (health and reason), so
/// that a busy monitor never holds a fault back from them.
const MONITOR_ANSWER: Duration = Duration::from_millis(200);

/// A device taint, as the ResourceSlice carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Taint {
    /// `<driver>/<condition>`.
    pub key: String,
    /// The condition's value (the XID, the recovery action), if it has one.
    pub value: Option<String>,
    /// `NoSchedule` for a condition that makes the device Unhealthy, `None` for one only recorded.
    pub effect: &'static str,
}

/// One device as DRA shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraDevice {
    /// Its published name.
    pub name: String,
    /// What it is.
    pub info: DeviceInfo,
    /// What the health stream reports.
    pub health: HealthStatus,
    /// The engine's message; empty when there is nothing to say.
    pub message: String,
    /// Its taints in the slice.
    pub taints: Vec<Taint>,
}

/// Every device DRA serves, in the inventory's order.
pub type DraView = Arc<Vec<DraDevice>>;

/// `inventory` as DRA shows it, with the monitor's `snapshots` where it answered.
pub fn build(
    inventory: &Inventory,
    snapshots: Option<&[DeviceSnapshot]>,
    driver: &str,
) -> Vec<DraDevice> {
    build_checked(inventory, snapshots, driver).0
}

/// As [`build`], and whether `snapshots` had every device as new as the inventory.
fn build_checked(
    inventory: &Inventory,
    snapshots: Option<&[DeviceSnapshot]>,
    driver: &str,
) -> (Vec<DraDevice>, bool) {
    let mut as_new = true;
    let view = inventory
        .devices()
        .iter()
        .map(|d| {
            // A snapshot that disagrees with the inventory is older than it: not used.
            let snapshot = snapshots
                .and_then(|s| s.iter().find(|s| s.info.id == d.info.id))
                .filter(|s| as_new_as(d, s));
            as_new &= snapshot.is_some();
            let conditions = snapshot.map_or(&[][..], |s| &s.conditions[..]);
            let unmonitored = conditions
                .iter()
                .any(|c| c.condition.kind == ConditionKind::Unmonitored);
            let health = match d.health {
                Health::Unhealthy => HealthStatus::Unhealthy,
                Health::Healthy if unmonitored => HealthStatus::Unknown,
                Health::Healthy => HealthStatus::Healthy,
            };
            let message = snapshot
                .and_then(|s| s.message.clone())
                .or_else(|| d.reason.clone())
                .unwrap_or_default();
            let mut taints: Vec<Taint> = Vec::new();
            for c in conditions {
                let taint = Taint {
                    key: format!("{driver}/{}", c.condition.kind.name()),
                    value: c.condition.kind.value().map(|v| v.to_string()),
                    effect: match c.effect {
                        Effect::Unhealthy => "NoSchedule",
                        Effect::None => "None",
                    },
                };
                // One taint per condition: two XIDs are two taints of one key, each with its value, so that
                // a toleration of one XID does not tolerate the other.
                if !taints.contains(&taint) {
                    taints.push(taint);
                }
            }
            if d.health == Health::Unhealthy && !taints.iter().any(|t| t.effect == "NoSchedule") {
                taints.push(Taint {
                    key: format!("{driver}/unhealthy"),
                    value: None,
                    effect: "NoSchedule",
                });
            }
            // The ones that keep claims away first, should a device ever have more than the API takes.
            taints.sort_by_key(|t| t.effect != "NoSchedule");
            taints.truncate(MAX_TAINTS);
            DraDevice {
                name: device_name(&d.info),
                info: d.info.clone(),
                health,
                message,
                taints,
            }
        })
        .collect();
    (view, as_new)
}

/// The monitor, for the devices' conditions: its snapshots, sent after every change of the inventory or of
/// a device's conditions, and asked for again every refresh.
#[derive(Debug, Clone)]
pub struct Conditions {
    /// Asked for a refresh of the snapshots.
    pub monitor: MonitorHandle,
    /// The snapshots (`crate::monitor::Monitored::devices`).
    pub devices: watch::Receiver<Snapshots>,
}

/// The views [`follow`] keeps: one for the health stream, which gets a change first from the inventory and
/// the conditions last known, then again with the monitor's snapshots; one for the slices, which gets views
/// whose conditions are as new as the inventory (their taints name the condition), or the inventory's
/// health and reasons alone once the snapshots are [`MONITOR_ANSWER`] late.
#[derive(Debug, Clone)]
pub struct Views {
    /// For the health stream.
    pub health: watch::Receiver<DraView>,
    /// For the ResourceSlices.
    pub slices: watch::Receiver<DraView>,
}

/// Keeps [`Views`] of `devices` current until `devices`' sender is gone: rebuilt on every change of the
/// inventory and of the monitor's snapshots, which the monitor is asked to send again at the start and every
/// `refresh` (a message's count and times move on without a change of conditions). A change of the
/// inventory reaches the health stream at once, with the conditions last known: the monitor sends its
/// snapshots once the kubelet has the change, and waiting for them would hold the fault back. The slices
/// take a view once the snapshots are as new as the inventory on every device, or [`MONITOR_ANSWER`] after
/// the first change they have not caught up with (from the inventory's health and reasons), never not at
/// all. Must be called inside a tokio runtime.
pub fn follow(
    mut devices: InventoryWatch,
    conditions: Option<Conditions>,
    driver: String,
    refresh: Duration,
) -> Views {
    let (monitor, mut snapshots) = match conditions {
        Some(c) => (Some(c.monitor), Some(c.devices)),
        None => (None, None),
    };
    // The monitor's snapshots as they stand (the conditions restored from the checkpoint, at a start).
    let mut known: Option<Snapshots> = snapshots.as_mut().map(|s| s.borrow_and_update().clone());
    let (first, _) = current(&mut devices, known.as_ref(), &driver);
    let first = Arc::new(first);
    let (health, health_rx) = watch::channel(first.clone());
    let (slices, slices_rx) = watch::channel(first);
    tokio::spawn(async move {
        // Those held may be older than the inventory (nobody followed them): asked for again now, beside the
        // loop, which a full queue of the monitor's must not hold up.
        let asker = monitor.clone();
        let first_refresh = async move {
            if let Some(monitor) = asker {
                let _late = tokio::time::timeout(MONITOR_ANSWER, monitor.refresh_now()).await;
            }
        };
        tokio::pin!(first_refresh);
        let mut refreshed = false;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + refresh, refresh);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Set while the slices wait for snapshots as new as the inventory: until when, at most.
        let mut slices_wait: Option<tokio::time::Instant> = None;
        loop {
            let snapshot_came = async {
                let gone = match &mut snapshots {
                    Some(snapshots) => snapshots.changed().await.is_err(),
                    None => true,
                };
                if gone {
                    std::future::pending::<()>().await;
                }
            };
            let late = async {
                match slices_wait {
                    Some(until) => tokio::time::sleep_until(until).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                changed = devices.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    // Snapshots sent meanwhile first: the view is then as new as both.
                    if let Some(sent) = snapshots.as_mut().filter(|s| s.has_changed().unwrap_or(false)) {
                        known = Some(sent.borrow_and_update().clone());
                    }
                    // At once, with the conditions last known (a device whose health changed shows its
                    // reason); the slices only with snapshots as new, their taints name the condition.
                    let (view, as_new) = current(&mut devices, known.as_ref(), &driver);
                    publish_health(&health, view.clone());
                    offer(&slices, &mut slices_wait, view, monitor.is_none() || as_new);
                    // The health stream writes the change before the snapshots are taken in.
                    tokio::task::yield_now().await;
                }
                () = snapshot_came => {
                    known = snapshots.as_mut().map(|s| s.borrow_and_update().clone());
                    let (view, as_new) = current(&mut devices, known.as_ref(), &driver);
                    publish_health(&health, view.clone());
                    offer(&slices, &mut slices_wait, view, as_new);
                }
                () = late => {
                    // A monitor past its time: the slices take the inventory's health and reasons.
                    slices_wait = None;
                    publish(&slices, current(&mut devices, known.as_ref(), &driver).0);
                }
                () = &mut first_refresh, if !refreshed => refreshed = true,
                _ = tick.tick() => {
                    if let Some(monitor) = &monitor {
                        monitor.refresh();
                    }
                }
                () = health.closed() => return,
            }
        }
    });
    Views {
        health: health_rx,
        slices: slices_rx,
    }
}

/// Gives the slices `view` if its conditions are `as_new` as its inventory; otherwise they wait, from now
/// if they were not waiting already, at most [`MONITOR_ANSWER`] (`wait`).
fn offer(
    slices: &watch::Sender<DraView>,
    wait: &mut Option<tokio::time::Instant>,
    view: Vec<DraDevice>,
    as_new: bool,
) {
    if as_new {
        *wait = None;
        publish(slices, view);
    } else if wait.is_none() {
        *wait = Some(tokio::time::Instant::now() + MONITOR_ANSWER);
    }
}

/// The view of the inventory as it stands, and whether `known` is as new as it on every device. The
/// inventory is taken out of its watch before the view is built: the monitor publishes into it.
fn current(
    devices: &mut InventoryWatch,
    known: Option<&Snapshots>,
    driver: &str,
) -> (Vec<DraDevice>, bool) {
    let inventory = devices.borrow_and_update().clone();
    build_checked(&inventory, known.map(|k| &k[..]), driver)
}

/// Whether `snapshot` is as new as the inventory's `device`: the same health, and where the inventory gives
/// a reason, that reason as its message (the monitor takes the message from it). One of a fault before,
/// with the same health, would otherwise name that fault's condition.
fn as_new_as(device: &DeviceState, snapshot: &DeviceSnapshot) -> bool {
    snapshot.health == device.health
        && (device.reason.is_none() || snapshot.message == device.reason)
}

/// Sends `view` to the health stream if it tells the kubelet something the current one does not: a device's
/// name, health or message. A change of taints alone would wake the stream for a list it does not send.
fn publish_health(tx: &watch::Sender<DraView>, view: Vec<DraDevice>) {
    tx.send_if_modified(|current| {
        let same = current.len() == view.len()
            && current
                .iter()
                .zip(&view)
                .all(|(a, b)| a.name == b.name && a.health == b.health && a.message == b.message);
        if same {
            return false;
        }
        *current = Arc::new(view);
        true
    });
}

/// Sends `view` if it differs from the current one.
fn publish(tx: &watch::Sender<DraView>, view: Vec<DraDevice>) {
    tx.send_if_modified(|current| {
        if **current == view {
            return false;
        }
        *current = Arc::new(view);
        true
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::{Condition, Recover};
    use crate::monitor::ConditionSnapshot;
    use std::time::SystemTime;

    fn inventory() -> Inventory {
        crate::dra::fixtures::gpus(3)
    }

    fn condition(kind: ConditionKind, effect: Effect) -> ConditionSnapshot {
        let now = SystemTime::UNIX_EPOCH;
        ConditionSnapshot {
            condition: Condition {
                kind,
                detail: None,
                count: 1,
                first_seen: now,
                last_seen: now,
            },
            effect,
            recover: Recover::Auto,
        }
    }

    fn snapshot(
        inv: &Inventory,
        id: &str,
        message: &str,
        conditions: Vec<ConditionSnapshot>,
    ) -> DeviceSnapshot {
        let state = inv.get(id).expect("device");
        DeviceSnapshot {
            info: state.info.clone(),
            index: 0,
            health: state.health,
            // As the monitor makes it: the inventory's reason, where it gives one.
            message: state.reason.clone().or_else(|| Some(message.into())),
            conditions,
        }
    }

    #[test]
    fn conditions_become_taints_and_an_unwatched_gpu_is_unknown() {
        let mut inv = inventory();
        inv.set_health("GPU-0", Health::Unhealthy, Some("Unhealthy: XID 79".into()));
        let snapshots = vec![
            snapshot(
                &inv,
                "GPU-0",
                "Unhealthy: XID 79 …",
                vec![condition(ConditionKind::Xid(79), Effect::Unhealthy)],
            ),
            snapshot(
                &inv,
                "GPU-1",
                "Healthy: Also recorded, not affecting health: XID 13 …",
                vec![condition(ConditionKind::Xid(13), Effect::None)],
            ),
            snapshot(
                &inv,
                "GPU-2",
                "Healthy: not watched",
                vec![condition(ConditionKind::Unmonitored, Effect::None)],
            ),
        ];
        let view = build(&inv, Some(&snapshots), "gpu.nvidia.com");
        assert_eq!(view[0].health, HealthStatus::Unhealthy);
        assert_eq!(
            view[0].taints,
            vec![Taint {
                key: "gpu.nvidia.com/xid".into(),
                value: Some("79".into()),
                effect: "NoSchedule"
            }]
        );
        assert_eq!(view[1].health, HealthStatus::Healthy);
        assert_eq!(view[1].taints[0].effect, "None");
        assert!(
            view[1].message.contains("XID 13"),
            "a Healthy device's note reaches the pod status too"
        );
        assert_eq!(view[2].health, HealthStatus::Unknown);
        assert_eq!(view[2].taints[0].key, "gpu.nvidia.com/unmonitored");
    }

    #[test]
    fn each_condition_is_a_taint_of_its_own_the_ones_that_keep_claims_away_first() {
        let mut inv = inventory();
        inv.set_health("GPU-0", Health::Unhealthy, Some("Unhealthy: XID 79".into()));
        let snapshots = vec![snapshot(
            &inv,
            "GPU-0",
            "Unhealthy: XID 79 …; also XID 13, XID 48",
            vec![
                condition(ConditionKind::Xid(13), Effect::None),
                condition(ConditionKind::Xid(79), Effect::Unhealthy),
                condition(ConditionKind::Xid(48), Effect::Unhealthy),
            ],
        )];
        let view = build(&inv, Some(&snapshots), "gpu.nvidia.com");
        let taints: Vec<(&str, Option<&str>, &str)> = view[0]
            .taints
            .iter()
            .map(|t| (t.key.as_str(), t.value.as_deref(), t.effect))
            .collect();
        assert_eq!(
            taints,
            vec![
                ("gpu.nvidia.com/xid", Some("79"), "NoSchedule"),
                ("gpu.nvidia.com/xid", Some("48"), "NoSchedule"),
                ("gpu.nvidia.com/xid", Some("13"), "None"),
            ]
        );
    }

    #[test]
    fn without_the_monitors_answer_an_unhealthy_device_still_shows_with_its_reason_and_a_taint() {
        let mut inv = inventory();
        inv.set_health("GPU-2", Health::Unhealthy, Some("XID 48".into()));
        let view = build(&inv, None, "gpu.nvidia.com");
        assert_eq!(
            (view[2].health, view[2].message.as_str()),
            (HealthStatus::Unhealthy, "XID 48")
        );
        assert_eq!(view[2].taints[0].key, "gpu.nvidia.com/unhealthy");
        assert!(view[0].taints.is_empty() && view[0].message.is_empty());
    }

    /// Every device of `inv` as the monitor would send it, one that is Unhealthy with an XID 79.
    fn snapshots_of(inv: &Inventory) -> Snapshots {
        Arc::new(
            inv.devices()
                .iter()
                .map(|d| {
                    let unhealthy = d.health == Health::Unhealthy;
                    let conditions = if unhealthy {
                        vec![condition(ConditionKind::Xid(79), Effect::Unhealthy)]
                    } else {
                        Vec::new()
                    };
                    let mut s = snapshot(inv, &d.info.id, "", conditions);
                    s.message = d.reason.clone();
                    s
                })
                .collect(),
        )
    }

    /// A view following `rx`, with a monitor that never answers a question and snapshots sent by the test.
    fn following(rx: InventoryWatch) -> (Views, watch::Sender<Snapshots>, impl Send) {
        let (monitor, busy) = MonitorHandle::unanswered();
        let (snapshots_tx, devices) = watch::channel(Snapshots::default());
        let views = follow(
            rx,
            Some(Conditions { monitor, devices }),
            "gpu.nvidia.com".into(),
            Duration::from_secs(10),
        );
        (views, snapshots_tx, busy)
    }

    async fn wait(
        view: &mut watch::Receiver<DraView>,
        what: impl FnMut(&DraView) -> bool,
    ) -> DraView {
        tokio::time::timeout(Duration::from_secs(5), view.wait_for(what))
            .await
            .expect("in time")
            .expect("the view goes on")
            .clone()
    }

    #[tokio::test(start_paused = true)]
    async fn a_fault_reaches_the_health_view_at_once_and_the_slices_with_the_monitors_condition() {
        let (tx, rx) = watch::channel(Arc::new(inventory()));
        let (views, snapshots, _busy) = following(rx);
        snapshots.send_replace(snapshots_of(&inventory()));
        let (mut health, mut slices) = (views.health, views.slices);
        health.borrow_and_update();
        let mut inv = inventory();
        inv.set_health("GPU-1", Health::Unhealthy, Some("XID 79".into()));
        let started = tokio::time::Instant::now();
        tx.send_replace(Arc::new(inv.clone()));
        let view = wait(&mut health, |v| v[1].health == HealthStatus::Unhealthy).await;
        // Paused time moves only while everything waits: a view held back for the monitor would come after
        // its wait for it.
        assert!(
            started.elapsed() < MONITOR_ANSWER,
            "the fault waited {:?} for the monitor",
            started.elapsed()
        );
        assert_eq!(view[1].message, "XID 79");
        assert_eq!(view[1].taints[0].key, "gpu.nvidia.com/unhealthy");
        // The slices do not take the view without the condition: it would be written, then written again.
        assert_eq!(slices.borrow_and_update()[1].health, HealthStatus::Healthy);
        snapshots.send_replace(snapshots_of(&inv));
        let written = wait(&mut slices, |v| v[1].health == HealthStatus::Unhealthy).await;
        assert!(
            started.elapsed() < MONITOR_ANSWER,
            "the slices waited for their time"
        );
        assert_eq!(written[1].taints[0].key, "gpu.nvidia.com/xid");
        assert_eq!(written[1].taints[0].value.as_deref(), Some("79"));
        assert_eq!(written[1].message, "XID 79");
        // The health stream was not woken again for the taint: it tells the kubelet nothing new.
        assert!(!health.has_changed().expect("the view goes on"));
        let told = |v: &DraView| -> Vec<(String, HealthStatus, String)> {
            v.iter()
                .map(|d| (d.name.clone(), d.health, d.message.clone()))
                .collect()
        };
        assert_eq!(
            told(&health.borrow()),
            told(&written),
            "the health stream and the slices agree"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_monitor_with_a_full_queue_at_the_start_holds_no_fault_back() {
        let (tx, rx) = watch::channel(Arc::new(inventory()));
        let (monitor, _busy) = MonitorHandle::unanswered();
        // Every place in the monitor's queue taken: the first refresh waits for room it never gets.
        for _ in 0..64 {
            monitor.refresh();
        }
        let (_snapshots, devices) = watch::channel(Snapshots::default());
        let views = follow(
            rx,
            Some(Conditions { monitor, devices }),
            "gpu.nvidia.com".into(),
            Duration::from_secs(10),
        );
        let mut health = views.health;
        let started = tokio::time::Instant::now();
        let mut inv = inventory();
        inv.set_health("GPU-0", Health::Unhealthy, Some("XID 79".into()));
        tx.send_replace(Arc::new(inv));
        wait(&mut health, |v| v[0].health == HealthStatus::Unhealthy).await;
        assert!(
            started.elapsed() < MONITOR_ANSWER,
            "the fault waited {:?} for the monitor's queue",
            started.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn snapshots_that_come_before_the_inventory_reach_the_slices_with_it() {
        let (tx, rx) = watch::channel(Arc::new(inventory()));
        let (views, snapshots, _busy) = following(rx);
        let mut slices = views.slices;
        let mut inv = inventory();
        inv.set_health("GPU-2", Health::Unhealthy, Some("XID 79".into()));
        snapshots.send_replace(snapshots_of(&inv));
        tokio::task::yield_now().await;
        let started = tokio::time::Instant::now();
        tx.send_replace(Arc::new(inv));
        let written = wait(&mut slices, |v| v[2].health == HealthStatus::Unhealthy).await;
        assert!(
            started.elapsed() < MONITOR_ANSWER,
            "the slices waited for their time"
        );
        assert_eq!(written[2].taints[0].key, "gpu.nvidia.com/xid");
    }

    #[tokio::test(start_paused = true)]
    async fn the_snapshot_of_an_earlier_fault_does_not_name_the_condition_of_the_next() {
        let mut inv = inventory();
        inv.set_health(
            "GPU-1",
            Health::Unhealthy,
            Some("Unhealthy: XID 79 ...".into()),
        );
        let (tx, rx) = watch::channel(Arc::new(inv.clone()));
        let (views, snapshots, _busy) = following(rx);
        snapshots.send_replace(snapshots_of(&inv));
        let mut slices = views.slices;
        wait(&mut slices, |v| {
            v[1].taints
                .first()
                .is_some_and(|t| t.key == "gpu.nvidia.com/xid")
        })
        .await;
        // It recovers, and faults again with another XID before the monitor's snapshots have caught up: the
        // snapshot held says Unhealthy with XID 79.
        let mut again = inventory();
        again.set_health(
            "GPU-1",
            Health::Unhealthy,
            Some("Unhealthy: XID 48 ...".into()),
        );
        tx.send_replace(Arc::new(again));
        let started = tokio::time::Instant::now();
        let written = wait(&mut slices, |v| v[1].message != "Unhealthy: XID 79 ...").await;
        // Not as new as the inventory: the slices waited for snapshots that never came, and took the
        // inventory's reason without the old condition.
        assert!(
            started.elapsed() >= MONITOR_ANSWER,
            "taken after {:?}",
            started.elapsed()
        );
        assert_eq!(written[1].message, "Unhealthy: XID 48 ...");
        assert_eq!(written[1].taints[0].key, "gpu.nvidia.com/unhealthy");
    }

    #[tokio::test(start_paused = true)]
    async fn the_conditions_restored_at_start_are_in_the_first_view() {
        let mut inv = inventory();
        inv.set_health(
            "GPU-2",
            Health::Unhealthy,
            Some("Unhealthy: XID 79 ...".into()),
        );
        let (_tx, rx) = watch::channel(Arc::new(inv.clone()));
        let (monitor, _busy) = MonitorHandle::unanswered();
        let (_snapshots, devices) = watch::channel(snapshots_of(&inv));
        let views = follow(
            rx,
            Some(Conditions { monitor, devices }),
            "gpu.nvidia.com".into(),
            Duration::from_secs(10),
        );
        let first = views.slices.borrow().clone();
        assert_eq!(first[2].taints[0].key, "gpu.nvidia.com/xid");
        assert_eq!(first[2].taints[0].value.as_deref(), Some("79"));
        assert_eq!(*views.health.borrow(), first);
    }

    #[tokio::test(start_paused = true)]
    async fn without_the_monitors_snapshots_the_slices_take_the_fault_late_rather_than_never() {
        let (tx, rx) = watch::channel(Arc::new(inventory()));
        let (views, _snapshots, _busy) = following(rx);
        let mut slices = views.slices;
        let mut inv = inventory();
        inv.set_health("GPU-1", Health::Unhealthy, Some("XID 79".into()));
        let started = tokio::time::Instant::now();
        tx.send_replace(Arc::new(inv));
        let late = wait(&mut slices, |v| v[1].health == HealthStatus::Unhealthy).await;
        assert!(
            started.elapsed() >= MONITOR_ANSWER,
            "taken after {:?}",
            started.elapsed()
        );
        assert_eq!(late[1].taints[0].key, "gpu.nvidia.com/unhealthy");
        assert_eq!(late[1].message, "XID 79");
    }

    #[tokio::test]
    async fn the_view_follows_the_inventory() {
        let (tx, rx) = watch::channel(Arc::new(inventory()));
        let mut view = follow(rx, None, "gpu.nvidia.com".into(), Duration::from_secs(10)).health;
        assert_eq!(view.borrow_and_update().len(), 3);
        let mut inv = inventory();
        inv.set_health("GPU-1", Health::Unhealthy, Some("XID 79".into()));
        tx.send_replace(Arc::new(inv));
        tokio::time::timeout(Duration::from_secs(5), view.changed())
            .await
            .expect("in time")
            .expect("changed");
        assert_eq!(view.borrow()[1].health, HealthStatus::Unhealthy);
    }
}
