//! The devices as DRA shows them: each under its published name, with the health the stream reports
//! (Healthy, Unhealthy, or Unknown while it is not watched), the engine's message, and the device taints its
//! conditions put on it in the ResourceSlice. Built from the DRA side's view of the inventory, with the
//! monitor's conditions; the health stream and the slices both read it, so they never disagree.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::api::dra::health_v1::HealthStatus;
use crate::devices::{DeviceInfo, Health, Inventory, InventoryWatch};
use crate::health::{ConditionKind, Effect};
use crate::monitor::{DeviceSnapshot, MonitorHandle};

use super::names::device_name;

/// The API's limit on taints per device.
pub const MAX_TAINTS: usize = 16;
/// The longest the monitor is waited on for conditions; past it the view is built from the inventory alone
/// (health and reason), so that a busy monitor never holds a fault back from the health stream.
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
    inventory
        .devices()
        .iter()
        .map(|d| {
            // A snapshot that disagrees with the inventory on health is older than it: not used.
            let snapshot = snapshots
                .and_then(|s| s.iter().find(|s| s.info.id == d.info.id))
                .filter(|s| s.health == d.health);
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
        .collect()
}

/// The monitor, for the devices' conditions: asked on every change of the inventory or of `changes`.
#[derive(Debug, Clone)]
pub struct Conditions {
    /// Where the snapshots come from.
    pub monitor: MonitorHandle,
    /// Changes whenever a device's conditions do (`crate::monitor::Monitored::changes`).
    pub changes: watch::Receiver<u64>,
}

/// The views [`follow`] keeps: one for the health stream, which gets a change first from the inventory and
/// the conditions last known, then again with the monitor's answer; one for the slices, which gets only
/// views built with the monitor's answer (their taints name the condition).
#[derive(Debug, Clone)]
pub struct Views {
    /// For the health stream.
    pub health: watch::Receiver<DraView>,
    /// For the ResourceSlices.
    pub slices: watch::Receiver<DraView>,
}

/// Keeps [`Views`] of `devices` current until `devices`' sender is gone: rebuilt on every change of the
/// inventory and of the conditions, and every `refresh` (a message's count and times move on without a
/// change of conditions). A change of the inventory reaches the health stream at once, with the conditions
/// last known, whether or not the monitor is still to answer a question asked before it (on a refresh, or
/// for the fault before): the monitor answers between events, and waiting for it would hold the fault back
/// until the monitor is done logging and checkpointing it. Must be called inside a tokio runtime.
pub fn follow(
    mut devices: InventoryWatch,
    conditions: Option<Conditions>,
    driver: String,
    refresh: Duration,
) -> Views {
    let first = Arc::new(build(&devices.borrow_and_update(), None, &driver));
    let (health, health_rx) = watch::channel(first.clone());
    let (slices, slices_rx) = watch::channel(first);
    tokio::spawn(async move {
        let (monitor, mut changes) = match conditions {
            Some(c) => (Some(c.monitor), Some(c.changes)),
            None => (None, None),
        };
        let mut known: Option<Vec<DeviceSnapshot>> = None;
        let mut tick = tokio::time::interval(refresh);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The question to the monitor in flight, and whether something changed since it was asked.
        let mut asking: Option<Pin<Box<dyn Future<Output = Answer> + Send>>> = None;
        let mut ask = true;
        loop {
            if ask && asking.is_none() {
                ask = false;
                if let Some(changes) = &mut changes {
                    changes.borrow_and_update();
                }
                match &monitor {
                    Some(monitor) => {
                        let monitor = monitor.clone();
                        asking = Some(Box::pin(async move {
                            tokio::time::timeout(MONITOR_ANSWER, monitor.devices())
                                .await
                                .ok()
                                .flatten()
                        }));
                    }
                    // Nothing to ask: the inventory is all there is.
                    None => {
                        let view = build(&devices.borrow_and_update(), None, &driver);
                        publish(&health, view.clone());
                        publish(&slices, view);
                    }
                }
            }
            let answered = async {
                match &mut asking {
                    Some(answer) => answer.await,
                    None => std::future::pending().await,
                }
            };
            let conditions_changed = async {
                let gone = match &mut changes {
                    Some(changes) => changes.changed().await.is_err(),
                    None => true,
                };
                if gone {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                biased;
                changed = devices.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    // At once, with the conditions last known (a device whose health changed shows its
                    // reason); the slices wait for the monitor's answer, their taints name the condition.
                    publish(&health, build(&devices.borrow_and_update(), known.as_deref(), &driver));
                    ask = true;
                    // The health stream writes the change before the monitor is asked: its answer takes
                    // the monitor's thread while the kubelet reads.
                    tokio::task::yield_now().await;
                }
                answer = answered => {
                    asking = None;
                    // A monitor past its time leaves the conditions last known: the view is built from the
                    // inventory's health and reasons all the same.
                    if let Some(answer) = answer {
                        known = Some(answer);
                    }
                    let view = build(&devices.borrow_and_update(), known.as_deref(), &driver);
                    publish(&health, view.clone());
                    publish(&slices, view);
                }
                () = conditions_changed => ask = true,
                _ = tick.tick() => ask = true,
                () = health.closed() => return,
            }
        }
    });
    Views {
        health: health_rx,
        slices: slices_rx,
    }
}

/// The monitor's answer: every device's snapshot, or `None` if it did not answer in time or is gone.
type Answer = Option<Vec<DeviceSnapshot>>;

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
            message: Some(message.into()),
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

    #[tokio::test(start_paused = true)]
    async fn a_fault_reaches_the_health_view_while_the_monitor_is_still_to_answer() {
        let (tx, rx) = watch::channel(Arc::new(inventory()));
        let (changes_tx, changes) = watch::channel(0_u64);
        let (monitor, _busy) = MonitorHandle::unanswered();
        let views = follow(
            rx,
            Some(Conditions { monitor, changes }),
            "gpu.nvidia.com".into(),
            Duration::from_secs(10),
        );
        let mut health = views.health;
        health.borrow_and_update();
        // A question to the monitor is in flight (a refresh, the fault before) and the monitor is busy: it
        // stays unanswered.
        changes_tx.send_replace(1);
        tokio::task::yield_now().await;
        let asked = tokio::time::Instant::now();
        let mut inv = inventory();
        inv.set_health("GPU-1", Health::Unhealthy, Some("XID 79".into()));
        tx.send_replace(Arc::new(inv));
        let view = tokio::time::timeout(
            Duration::from_secs(5),
            health.wait_for(|v| v[1].health == HealthStatus::Unhealthy),
        )
        .await
        .expect("in time")
        .expect("the view goes on")
        .clone();
        // Paused time moves only while everything waits: a view held back for the monitor's answer would
        // come after its wait for it.
        assert!(
            asked.elapsed() < MONITOR_ANSWER,
            "the fault waited {:?} for the monitor",
            asked.elapsed()
        );
        assert_eq!(view[1].message, "XID 79");
        assert_eq!(view[1].taints[0].effect, "NoSchedule");
        // The slices still wait for the monitor's conditions, and take the fault without them when it is
        // late, rather than never.
        let mut slices = views.slices;
        let late = tokio::time::timeout(
            Duration::from_secs(5),
            slices.wait_for(|v| v[1].health == HealthStatus::Unhealthy),
        )
        .await
        .expect("in time")
        .expect("the view goes on")
        .clone();
        assert_eq!(late[1].taints[0].key, "gpu.nvidia.com/unhealthy");
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
