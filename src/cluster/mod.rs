//! The Kubernetes API: a Warning Event on the Node and on each pod holding a device when it becomes
//! Unhealthy, a Normal Event when it recovers, and a node condition (`GPUUnhealthy`) that is `True` while any
//! GPU is Unhealthy, with each one's message.
//!
//! It follows the published inventory and never touches the kubelet path: a fault reaches ListAndWatch
//! first; this side sees it afterwards, through the same `watch`, and does its API calls on a thread of its
//! own, with its own runtime.
//! API errors are retried with backoff; a storm of faults is held to a budget of Events ([`EventBudget`]),
//! and the node condition always carries the newest state (older ones still waiting are skipped).
//!
//! Events go through kube-runtime's recorder (events.k8s.io/v1): a repeat of the same Event on the same object
//! within a few minutes becomes one Event with a series count, not a new object.
//!
//! Here: access to the API server and the thread it all runs on; `events.rs` and `condition.rs` beside.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use backon::{BackoffBuilder as _, Retryable as _};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::api::Api;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Config};
use serde::Deserialize;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

pub mod client;
mod condition;
mod events;

use condition::Left;
pub use condition::{WantedCondition, condition_of};
pub use events::{
    ClaimUser, EventBudget, Note, Target, TokenBucket, Transition, notes_for, transitions,
};

use crate::devices::{DeviceInfo, Health, Inventory, InventoryWatch};
use crate::kubelet::pods::{Holder, PodResources};
use crate::metrics::Metrics;

/// The node condition's type.
pub const CONDITION_TYPE: &str = "GPUUnhealthy";
/// Reason of the node condition while a GPU is Unhealthy, and of the Warning Events.
pub const UNHEALTHY_REASON: &str = "GPUUnhealthy";
/// Reason of the node condition while every GPU is Healthy.
pub const HEALTHY_REASON: &str = "GPUsHealthy";
/// Reason of the node condition once the plugin has stopped (status `Unknown`): nothing watches the GPUs'
/// health for it any more, so neither `True` nor `False` would be the truth.
pub const STOPPED_REASON: &str = "PluginStopped";
/// Reason of the Normal Event on recovery.
pub const RECOVERED_REASON: &str = "GPURecovered";
/// The reporting controller named in every Event.
pub const CONTROLLER: &str = "gpu-device-plugin";

/// The API server refuses an Event whose note is longer than this (bytes).
const NOTE_LIMIT: usize = 1024;
/// The node condition's message is kept under this many bytes (every Unhealthy GPU of an 8-GPU node fits).
const CONDITION_MESSAGE_LIMIT: usize = 8 * 1024;
/// Each API call's limits; a hung API server must not hold the queue forever.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const CALL_TIMEOUT: Duration = Duration::from_secs(15);
/// Retries of a failed Event before it is given up; the node condition is retried until it is written.
const EVENT_RETRIES: usize = 3;
const FIRST_RETRY: Duration = Duration::from_secs(1);
const MAX_RETRY: Duration = Duration::from_secs(60);

/// The waits between tries of a failed API call: 1 s, doubling to 60 s.
fn retry_delays() -> backon::ExponentialBuilder {
    backon::ExponentialBuilder::new()
        .with_min_delay(FIRST_RETRY)
        .with_max_delay(MAX_RETRY)
}
/// A change is reported once the device list has been quiet this long (a burst of faults settles), and at
/// most this long after it.
const SETTLE: Duration = Duration::from_millis(100);
const SETTLE_AT_MOST: Duration = Duration::from_secs(1);
/// Events waiting to be sent; more are dropped (and counted), as over the budget.
const QUEUE: usize = 256;

/// Settings of the API side.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterConfig {
    /// Whether to use the API server at all.
    pub enabled: bool,
    /// A kubeconfig to use instead of the pod's service account.
    pub kubeconfig: Option<PathBuf>,
    /// The node this plugin runs on (`NODE_NAME`, from the downward API).
    pub node_name: Option<String>,
    /// The Event budget.
    pub budget: EventBudget,
}

/// Why the API side cannot start with what it was given.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The kubeconfig named on the command line cannot be used.
    #[error("cannot use --kubeconfig {}: {message}", .path.display())]
    Kubeconfig {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
}

/// Where the API server is and which node this is: settled at start, so that a bad `--kubeconfig` stops the
/// plugin before it registers. The client itself is built later ([`ApiAccess::spawn`]), off the kubelet's path.
pub struct ApiAccess {
    config: Config,
    node: String,
    budget: EventBudget,
}

impl std::fmt::Debug for ApiAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiAccess")
            .field("server", &self.config.cluster_url)
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

/// A client and the node, reporting.
#[derive(Clone)]
struct Cluster {
    client: Client,
    node: String,
}

impl ApiAccess {
    /// Finds the API server: `--kubeconfig` if given (an unusable one is an error), else the pod's service
    /// account. Without one, or without a node name, says so in one line and returns `None`: everything
    /// else works without the API server.
    pub async fn resolve(config: &ClusterConfig) -> Result<Option<ApiAccess>, ClusterError> {
        if !config.enabled {
            tracing::info!("Kubernetes API surfaces turned off (--kube-api=false)");
            return Ok(None);
        }
        let mut kube_config = match &config.kubeconfig {
            Some(path) => {
                let bad = |message: String| ClusterError::Kubeconfig {
                    path: path.clone(),
                    message,
                };
                let file =
                    kube::config::Kubeconfig::read_from(path).map_err(|e| bad(e.to_string()))?;
                Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                    .await
                    .map_err(|e| bad(e.to_string()))?
            }
            None => match Config::incluster() {
                Ok(config) => config,
                Err(e) => {
                    tracing::info!(
                        reason = %e,
                        "no Kubernetes API access (not in a pod with a service account, and no --kubeconfig): no Events and no node condition; everything else works"
                    );
                    return Ok(None);
                }
            },
        };
        let Some(node) = config.node_name.clone().filter(|n| !n.is_empty()) else {
            tracing::warn!(
                "NODE_NAME is not set (give it from the downward API, spec.nodeName): no Events and no node condition; everything else works"
            );
            return Ok(None);
        };
        kube_config.connect_timeout = Some(CONNECT_TIMEOUT);
        kube_config.read_timeout = Some(CALL_TIMEOUT);
        kube_config.write_timeout = Some(CALL_TIMEOUT);
        Ok(Some(ApiAccess {
            config: kube_config,
            node,
            budget: config.budget,
        }))
    }

    /// The client settings, for another side that talks to the API server (DRA's claims and slices) with a
    /// client of its own, built on its own thread.
    pub fn client_config(&self) -> Config {
        self.config.clone()
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Reports the devices' health from `start` on: once `start` resolves (the plugin registers first: the
    /// client's TLS set-up is work the kubelet must not wait behind), builds the client, writes the node
    /// condition, and from then on follows `inventory`: the condition on every change of health, Events on
    /// every transition. A transition between `before` (the inventory as the plugin started) and the
    /// start is reported too. Runs on a thread of its own, which ends when the inventory's sender does.
    ///
    /// With `follower`, something else that follows the Node (the fence annotation) runs beside, with a client
    /// of its own for watches and the same queue of Events.
    ///
    /// The returned [`ApiStop`] is for a plugin that stops for good: it leaves the condition saying so.
    pub fn spawn(
        self,
        start: impl std::future::Future<Output = ()> + Send + 'static,
        before: Arc<Inventory>,
        inventory: InventoryWatch,
        users: DeviceUsers,
        metrics: Arc<Metrics>,
        follower: Option<NodeFollower>,
    ) -> ApiStop {
        let budget = self.budget;
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let (done_tx, done_rx) = oneshot::channel::<()>();
        // Resolves when asked to stop; never when the handle is dropped without asking (a SIGHUP's restart
        // in place, which reports again at once: no reason to say the GPUs are unwatched meanwhile).
        let stopped = async move {
            if stop_rx.await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        let report = async move {
            tokio::pin!(stopped);
            tokio::select! {
                () = start => {}
                // Stopped before anything was written: nothing to leave behind.
                () = &mut stopped => return,
            }
            let server = self.config.cluster_url.to_string();
            // A watch waits for changes for minutes: its client has no read timeout (the server ends each
            // watch within its own timeout, and the watcher starts a new one).
            let mut watch_config = self.config.clone();
            watch_config.read_timeout = None;
            let client = match client::client(self.config) {
                Ok(client) => client,
                Err(e) => {
                    tracing::warn!(error = %e, %server, "cannot build a Kubernetes API client: no Events and no node condition; everything else works");
                    return;
                }
            };
            tracing::info!(%server, node = %self.node, "reporting GPU health to the Kubernetes API: Events and the node condition");
            let cluster = Cluster {
                client,
                node: self.node,
            };
            let first = condition_of(&inventory.borrow());
            let (conditions, wanted) = watch::channel(first);
            let (notes, queue) = mpsc::channel(QUEUE);
            if let Some(follower) = follower {
                match client::client(watch_config) {
                    Ok(watch_client) => {
                        tokio::spawn(follower(watch_client, cluster.node.clone(), notes.clone()));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot build a client to watch the node's fence annotation");
                    }
                }
            }
            let written = Arc::new(std::sync::Mutex::new(condition::Ours::default()));
            let keeper = tokio::spawn(cluster.clone().keep_condition(
                wanted,
                metrics.clone(),
                written.clone(),
            ));
            tokio::spawn(cluster.clone().send_events(queue, budget, metrics.clone()));
            tokio::select! {
                () = follow(
                    before,
                    inventory,
                    conditions,
                    notes,
                    users,
                    cluster.client.clone(),
                    metrics,
                ) => {}
                () = &mut stopped => {
                    // No write of ours may land after the last one.
                    keeper.abort();
                    let ours = written
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .clone();
                    match cluster.leave_stopped(ours).await {
                        Ok(Left::Unknown) => tracing::info!(node = %cluster.node, "node condition {CONDITION_TYPE} left Unknown ({STOPPED_REASON}): GPU health is not watched once this plugin is gone"),
                        Ok(Left::Newer) => tracing::info!(node = %cluster.node, "node condition {CONDITION_TYPE} left as it is: another instance of the plugin has written it since"),
                        Ok(Left::NothingWritten) => {}
                        Err(e) => tracing::warn!(node = %cluster.node, error = %explain(&e, "get on nodes and patch on nodes/status"), "cannot leave the node condition {CONDITION_TYPE} Unknown at stop; it keeps its last status"),
                    }
                    let _exiting = done_tx.send(());
                }
            }
        };
        // A thread and runtime of their own: building the client (TLS roots: tens of milliseconds of CPU),
        // encoding Events and talking HTTP never take a turn on the thread that carries faults to the kubelet.
        if let Err(e) = crate::util::runtime::spawn_on_own_thread(
            "kube-api",
            crate::util::runtime::Priority::Side,
            report,
        ) {
            tracing::warn!(error = %e, "cannot start the Kubernetes API side's thread: no Events and no node condition");
        }
        ApiStop {
            stop: stop_tx,
            done: done_rx,
        }
    }
}

/// Who uses a device through a DRA ResourceClaim: the DRA side knows the claim it prepared the device for;
/// who the claim is reserved for is read with this side's client, on its thread.
#[tonic::async_trait]
pub trait ClaimUsers: Send + Sync {
    /// The pods using `device` through a claim now (none when it is not prepared for one, or the claim
    /// cannot be read: its Events then go to the node only).
    async fn users(&self, client: &Client, device: &DeviceInfo) -> Vec<ClaimUser>;
}

/// Something else that follows this Node with the plugin's API access (the fence annotation,
/// `crate::fence::annotation`): given a client without a read timeout (for watches), the Node's name and the
/// queue of Events to raise, returns its task, which runs on the Kubernetes API thread.
pub type NodeFollower = Box<
    dyn FnOnce(
            Client,
            String,
            mpsc::Sender<Note>,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
        + Send,
>;

/// Asks the API side of a plugin that stops for good to leave the node condition truthful.
#[derive(Debug)]
pub struct ApiStop {
    stop: oneshot::Sender<()>,
    done: oneshot::Receiver<()>,
}

impl ApiStop {
    /// Sets the node condition to `Unknown` ([`STOPPED_REASON`]), unless another instance of the plugin
    /// (the new pod of a rolling update) has written it since this one did: that one's report is the
    /// truth, and a stopping instance must not overwrite it. Waits at most `within`.
    ///
    /// Left behind after a rollback to another device plugin, a `True` would keep saying a GPU is
    /// Unhealthy, and a `False` that all are watched and Healthy, long after nothing watches them.
    pub async fn leave_condition(self, within: Duration) {
        if self.stop.send(()).is_err() {
            return;
        }
        if tokio::time::timeout(within, self.done).await.is_err() {
            tracing::warn!(
                "the node condition {CONDITION_TYPE} was not left Unknown within {within:?} of shutdown; it keeps its last status"
            );
        }
    }
}

/// Where the pods using a device are found, for their Events.
#[derive(Default)]
pub struct DeviceUsers {
    /// The kubelet's pod-resources API: the containers holding a device-plugin device.
    pub pods: Option<Arc<PodResources>>,
    /// The DRA side: the pods of the claim a DRA device is prepared for.
    pub claims: Option<Arc<dyn ClaimUsers>>,
}

/// Follows the inventory: each change of health (and any since `before`, at once) wakes the node condition
/// and queues Events.
async fn follow(
    mut before: Arc<Inventory>,
    mut inventory: InventoryWatch,
    conditions: watch::Sender<WantedCondition>,
    notes: mpsc::Sender<Note>,
    users: DeviceUsers,
    client: Client,
    metrics: Arc<Metrics>,
) {
    loop {
        let after = inventory.borrow_and_update().clone();
        let changes = transitions(&before, &after);
        before = after.clone();
        if !changes.is_empty() {
            conditions.send_if_modified(|current| {
                let wanted = condition_of(&after);
                let changed = *current != wanted;
                *current = wanted;
                changed
            });
            let holders = match &users.pods {
                Some(pods) => pods.holders(Duration::ZERO).await.unwrap_or_default(),
                None => BTreeMap::new(),
            };
            for change in &changes {
                let none = Vec::new();
                let claimed = match (&users.claims, after.get(&change.id)) {
                    (Some(claims), Some(device)) => claims.users(&client, &device.info).await,
                    _ => Vec::new(),
                };
                for note in notes_for(change, holders.get(&change.id).unwrap_or(&none), &claimed) {
                    if notes.try_send(note).is_err() {
                        metrics.event_dropped();
                    }
                }
            }
        }
        if inventory.changed().await.is_err() {
            return;
        }
        // Let a burst settle: the kubelet gets each fault of a burst first, and the burst is then reported
        // in one go (one pod lookup, one condition write), not interleaved with faults still arriving.
        let deadline = tokio::time::Instant::now() + SETTLE_AT_MOST;
        loop {
            tokio::select! {
                () = tokio::time::sleep(SETTLE) => break,
                () = tokio::time::sleep_until(deadline) => break,
                changed = inventory.changed() => {
                    if changed.is_err() {
                        break;
                    }
                }
            }
        }
    }
}

/// An API error with what to do about the usual ones.
pub fn explain(e: &kube::Error, rbac: &str) -> String {
    match e {
        kube::Error::Api(status) if status.is_forbidden() => format!(
            "{e} (the plugin's service account needs {rbac}; the RBAC in manifests/base/rbac.yaml grants it)"
        ),
        _ => e.to_string(),
    }
}

/// A watch's failure in words, as [`explain`] says an API error: a refusal names the RBAC the watch needs
/// (`rbac`), any other failure (the API server unreachable, a watch cut) says only what happened.
pub fn explain_watch(e: &kube::runtime::watcher::Error, rbac: &str) -> String {
    use kube::runtime::watcher::Error;
    match e {
        Error::InitialListFailed(e) | Error::WatchStartFailed(e) | Error::WatchFailed(e) => {
            explain(e, rbac)
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use crate::devices::{DeviceInfo, Inventory};

    /// `n` GPUs, `GPU-0` on, for the tests of the Events and the condition.
    pub(super) fn inventory(n: usize) -> Inventory {
        Inventory::new((0..n).map(|i| DeviceInfo {
            id: format!("GPU-{i}"),
            numa_node: None,
            ..DeviceInfo::default()
        }))
    }
}
