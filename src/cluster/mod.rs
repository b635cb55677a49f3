//! The Kubernetes API side: a Warning Event on the Node and on each pod holding a device when it becomes
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

use crate::devices::{Health, Inventory, InventoryWatch};
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

/// How many Events may go out: `burst` at once, then one every `refill`. The default is 20, then one
/// every 3 s: at most 20 + 20 a minute, whatever the node throws.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventBudget {
    /// Events that may go out back to back.
    pub burst: u32,
    /// Time to earn one more.
    pub refill: Duration,
}

impl Default for EventBudget {
    fn default() -> Self {
        EventBudget {
            burst: 20,
            refill: Duration::from_secs(3),
        }
    }
}

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
/// plugin before it registers. The client itself is built later ([`Cluster::spawn`]), off the kubelet's path.
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
        pods: Option<Arc<PodResources>>,
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
            let client = match Client::try_from(self.config) {
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
                match Client::try_from(watch_config) {
                    Ok(watch_client) => {
                        tokio::spawn(follower(watch_client, cluster.node.clone(), notes.clone()));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot build a client to watch the node's fence annotation");
                    }
                }
            }
            let written = Arc::new(std::sync::Mutex::new(None));
            let keeper = tokio::spawn(cluster.clone().keep_condition(
                wanted,
                metrics.clone(),
                written.clone(),
            ));
            tokio::spawn(cluster.clone().send_events(queue, budget, metrics.clone()));
            tokio::select! {
                () = follow(before, inventory, conditions, notes, pods, metrics) => {}
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
        if let Err(e) = crate::util::runtime::spawn_on_own_thread("kube-api", report) {
            tracing::warn!(error = %e, "cannot start the Kubernetes API side's thread: no Events and no node condition");
        }
        ApiStop {
            stop: stop_tx,
            done: done_rx,
        }
    }
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

/// What a stopping plugin did with the node condition.
#[derive(Debug, PartialEq, Eq)]
enum Left {
    /// Set to `Unknown`.
    Unknown,
    /// Left alone: another instance wrote it after this one.
    Newer,
    /// This instance never wrote it.
    NothingWritten,
}

/// The node condition as this instance last wrote it: at stop, the node still showing exactly this means no
/// other instance has written since.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Written {
    status: String,
    message: String,
    heartbeat: String,
}

impl Cluster {
    /// Writes the wanted node condition, retrying with backoff until it is written; a newer wanted state
    /// replaces one still being retried.
    async fn keep_condition(
        self,
        mut wanted: watch::Receiver<WantedCondition>,
        metrics: Arc<Metrics>,
        written: Arc<std::sync::Mutex<Option<Written>>>,
    ) {
        // What the node says now: (status, lastTransitionTime) of our condition, once read.
        let mut on_node: Option<Option<(String, String)>> = None;
        let mut failing = false;
        loop {
            let target = wanted.borrow_and_update().clone();
            let mut delays = retry_delays().without_max_times().build();
            // Whether a newer state arrived while this one was being retried (then it is written at once).
            let mut newer = false;
            loop {
                let result = self.write_condition(&target, &mut on_node).await;
                metrics.api_call("node_condition", result.is_ok());
                match result {
                    Ok(wrote) => {
                        *written
                            .lock()
                            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(wrote);
                        if failing {
                            tracing::info!(node = %self.node, "node condition written again");
                        }
                        failing = false;
                        break;
                    }
                    Err(e) => {
                        if !failing {
                            tracing::warn!(node = %self.node, error = %explain(&e, "get on nodes and patch on nodes/status"), "cannot write the node condition; retrying with backoff");
                        } else {
                            tracing::debug!(error = %e, "node condition still not written");
                        }
                        failing = true;
                        let delay = delays.next().unwrap_or(MAX_RETRY);
                        tokio::select! {
                            () = tokio::time::sleep(delay) => {}
                            changed = wanted.changed() => {
                                if changed.is_err() { return; }
                                newer = true;
                                break;
                            }
                        }
                    }
                }
            }
            if !newer && !wanted.has_changed().unwrap_or(false) && wanted.changed().await.is_err() {
                return;
            }
        }
    }

    /// Reads the node's conditions (once) and patches ours. The requests are made by hand with a view of
    /// only the fields used: the typed Node would bring the code to decode every field of a Node into the
    /// binary, and its pages into every node's memory.
    async fn write_condition(
        &self,
        target: &WantedCondition,
        on_node: &mut Option<Option<(String, String)>>,
    ) -> Result<Written, kube::Error> {
        let path = format!("/api/v1/nodes/{}", self.node);
        let known = match on_node {
            Some(known) => known.clone(),
            None => {
                let request = hyper::Request::get(&path)
                    .body(Vec::new())
                    .map_err(kube::Error::HttpError)?;
                let node: NodeView = self.client.request(request).await?;
                let found = node
                    .status
                    .conditions
                    .into_iter()
                    .find(|c| c.type_ == CONDITION_TYPE)
                    .map(|c| (c.status, c.last_transition_time.unwrap_or_default()));
                *on_node = Some(found.clone());
                found
            }
        };
        let now = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
        let status = target.status();
        let transition = match known {
            Some((was, at)) if was == status => at,
            _ => now.clone(),
        };
        let patch = serde_json::json!({
            "status": {
                "conditions": [{
                    "type": CONDITION_TYPE,
                    "status": status,
                    "reason": target.reason(),
                    "message": target.message,
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": transition,
                }]
            }
        });
        let request = hyper::Request::patch(format!("{path}/status"))
            .header("content-type", "application/strategic-merge-patch+json")
            .body(patch.to_string().into_bytes())
            .map_err(kube::Error::HttpError)?;
        self.client.request_text(request).await?;
        *on_node = Some(Some((status.to_string(), transition)));
        Ok(Written {
            status: status.to_string(),
            message: target.message.clone(),
            heartbeat: now,
        })
    }

    /// At stop: the condition `Unknown` if it is still as this instance wrote it. The patch carries the
    /// Node's `resourceVersion` as read, so that a write by another instance between the read and the
    /// patch makes the API server refuse it (409) rather than be overwritten.
    async fn leave_stopped(&self, ours: Option<Written>) -> Result<Left, kube::Error> {
        let Some(ours) = ours else {
            return Ok(Left::NothingWritten);
        };
        let path = format!("/api/v1/nodes/{}", self.node);
        let request = hyper::Request::get(&path)
            .body(Vec::new())
            .map_err(kube::Error::HttpError)?;
        let node: NodeView = self.client.request(request).await?;
        let current = node
            .status
            .conditions
            .into_iter()
            .find(|c| c.type_ == CONDITION_TYPE)
            .map(|c| Written {
                status: c.status,
                message: c.message.unwrap_or_default(),
                heartbeat: c.last_heartbeat_time.unwrap_or_default(),
            });
        if current.as_ref() != Some(&ours) {
            return Ok(Left::Newer);
        }
        let now = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
        let message = crate::util::text::cut_bytes(
            &format!(
                "gpu-device-plugin stopped on this node at {now}: GPU health is not watched by it; its last report ({}): {}",
                ours.status, ours.message
            ),
            CONDITION_MESSAGE_LIMIT,
        );
        let mut patch = serde_json::json!({
            "status": {
                "conditions": [{
                    "type": CONDITION_TYPE,
                    "status": "Unknown",
                    "reason": STOPPED_REASON,
                    "message": message,
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }]
            }
        });
        if let Some(version) = node.metadata.resource_version {
            patch["metadata"] = serde_json::json!({ "resourceVersion": version });
        }
        let request = hyper::Request::patch(format!("{path}/status"))
            .header("content-type", "application/strategic-merge-patch+json")
            .body(patch.to_string().into_bytes())
            .map_err(kube::Error::HttpError)?;
        match self.client.request_text(request).await {
            Ok(_) => Ok(Left::Unknown),
            // Written by another instance between the read and the patch: theirs stands.
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(Left::Newer),
            Err(e) => Err(e),
        }
    }

    /// Sends queued Events within the budget, each retried a few times with backoff.
    async fn send_events(
        self,
        mut queue: mpsc::Receiver<Note>,
        budget: EventBudget,
        metrics: Arc<Metrics>,
    ) {
        let recorder = Recorder::new(
            self.client.clone(),
            Reporter {
                controller: CONTROLLER.into(),
                // `kubectl describe` shows "From: <controller>, <instance>", as "kubelet, <node>" for the
                // kubelet's own Events.
                instance: Some(self.node.clone()),
            },
        );
        let mut bucket = TokenBucket::new(budget, Instant::now());
        let mut dropped_since_warned = 0u64;
        let mut warned_at: Option<Instant> = None;
        while let Some(note) = queue.recv().await {
            if !bucket.take(Instant::now()) {
                metrics.event_dropped();
                dropped_since_warned += 1;
                if warned_at.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) {
                    tracing::warn!(dropped = dropped_since_warned, burst = budget.burst, every = %humantime::format_duration(budget.refill), "Kubernetes Events over budget dropped (the log and metrics still have every transition)");
                    warned_at = Some(Instant::now());
                    dropped_since_warned = 0;
                }
                continue;
            }
            let reference = self.reference(&note.target).await;
            let event = Event {
                type_: note.type_,
                reason: note.reason.into(),
                note: Some(crate::util::text::cut_bytes(&note.text, NOTE_LIMIT)),
                action: action(note.reason, &note.text),
                secondary: None,
            };
            let published = (|| recorder.publish(&event, &reference))
                .retry(retry_delays().with_max_times(EVENT_RETRIES))
                .sleep(tokio::time::sleep)
                .notify(|e, _| tracing::debug!(error = %e, "Event not recorded; retrying"))
                .await;
            metrics.api_call("event", published.is_ok());
            if let Err(e) = published {
                tracing::warn!(error = %explain(&e, "create and patch on events.k8s.io events"), reason = note.reason, "cannot record a Kubernetes Event; given up");
            }
        }
    }

    /// The object an Event is about. A pod's UID is looked up, since `kubectl describe pod` shows only
    /// Events that carry it; a Node's Events carry the node name as UID, as the kubelet's do.
    async fn reference(&self, target: &Target) -> ObjectReference {
        match target {
            Target::Node => ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(self.node.clone()),
                uid: Some(self.node.clone()),
                ..Default::default()
            },
            Target::Pod { namespace, name } => {
                // Only the metadata: decoding a whole Pod takes a lot of code for one field.
                let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
                let uid = match pods.get_metadata(name).await {
                    Ok(pod) => pod.metadata.uid,
                    Err(e) => {
                        tracing::debug!(error = %explain(&e, "get on pods"), pod = %name, "pod UID unknown; its Event will show in `kubectl get events`, not in `kubectl describe pod`");
                        None
                    }
                };
                ObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    namespace: Some(namespace.clone()),
                    name: Some(name.clone()),
                    uid,
                    ..Default::default()
                }
            }
        }
    }
}

/// Follows the inventory: each change of health (and any since `before`, at once) wakes the node condition
/// and queues Events.
async fn follow(
    mut before: Arc<Inventory>,
    mut inventory: InventoryWatch,
    conditions: watch::Sender<WantedCondition>,
    notes: mpsc::Sender<Note>,
    pods: Option<Arc<PodResources>>,
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
            let holders = match &pods {
                Some(pods) => pods.holders(Duration::ZERO).await.unwrap_or_default(),
                None => BTreeMap::new(),
            };
            for change in &changes {
                let none = Vec::new();
                for note in notes_for(change, holders.get(&change.id).unwrap_or(&none)) {
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

/// The part of a Node the condition needs.
#[derive(Debug, Default, Deserialize)]
struct NodeView {
    #[serde(default)]
    metadata: MetadataView,
    #[serde(default)]
    status: NodeStatusView,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct MetadataView {
    #[serde(default)]
    resource_version: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct NodeStatusView {
    #[serde(default)]
    conditions: Vec<ConditionView>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ConditionView {
    #[serde(rename = "type")]
    type_: String,
    status: String,
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    last_heartbeat_time: Option<String>,
    #[serde(default)]
    last_transition_time: Option<String>,
}

/// One device's change of health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    /// Device ID.
    pub id: String,
    /// NVML's index of its GPU (the list position where the source has none), as `nvidia-smi` shows it.
    pub index: usize,
    /// The health it changed to.
    pub to: Health,
    /// Its message now (Unhealthy), or the one it had (recovered).
    pub message: Option<String>,
}

/// The devices whose health differs between two inventories (a device new in `after` counts as having been
/// Healthy).
pub fn transitions(before: &Inventory, after: &Inventory) -> Vec<Transition> {
    after
        .devices()
        .iter()
        .enumerate()
        .filter_map(|(position, d)| {
            let was = before.get(&d.info.id);
            let was_health = was.map_or(Health::Healthy, |w| w.health);
            (was_health != d.health).then(|| Transition {
                id: d.info.id.clone(),
                index: d.info.gpu_index().unwrap_or(position),
                to: d.health,
                message: match d.health {
                    Health::Unhealthy => d.reason.clone(),
                    Health::Healthy => was.and_then(|w| w.reason.clone()),
                },
            })
        })
        .collect()
}

/// What the node condition should say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WantedCondition {
    /// Unhealthy GPUs, of all.
    pub unhealthy: usize,
    /// All GPUs.
    pub total: usize,
    /// The message.
    pub message: String,
}

impl WantedCondition {
    /// `True` while any GPU is Unhealthy.
    pub fn status(&self) -> &'static str {
        if self.unhealthy > 0 { "True" } else { "False" }
    }

    /// The condition's reason.
    pub fn reason(&self) -> &'static str {
        if self.unhealthy > 0 {
            UNHEALTHY_REASON
        } else {
            HEALTHY_REASON
        }
    }
}

/// The node condition for an inventory: every Unhealthy GPU with its message.
pub fn condition_of(inventory: &Inventory) -> WantedCondition {
    let unhealthy: Vec<String> = inventory
        .devices()
        .iter()
        .enumerate()
        .filter(|(_, d)| d.health == Health::Unhealthy)
        .map(|(position, d)| {
            let index = d.info.gpu_index().unwrap_or(position);
            device_line(&d.info.id, index, d.reason.as_deref())
        })
        .collect();
    let total = inventory.len();
    let message = if unhealthy.is_empty() {
        format!("all {total} GPUs Healthy")
    } else {
        format!(
            "{} of {total} GPUs Unhealthy. {}",
            unhealthy.len(),
            unhealthy.join(" | ")
        )
    };
    WantedCondition {
        unhealthy: unhealthy.len(),
        total,
        message: crate::util::text::cut_bytes(&message, CONDITION_MESSAGE_LIMIT),
    }
}

fn device_line(id: &str, index: usize, message: Option<&str>) -> String {
    format!(
        "device {id} (index {index}): {}",
        message.unwrap_or("Unhealthy")
    )
}

/// Who an Event is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The node.
    Node,
    /// A pod.
    Pod {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
}

/// An Event to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    /// Who it is about.
    pub target: Target,
    /// Warning or Normal.
    pub type_: EventType,
    /// `GPUUnhealthy` or `GPURecovered`.
    pub reason: &'static str,
    /// The message.
    pub text: String,
}

/// The Events for one transition: one on the node, one on each pod holding the device (a pod with several
/// containers on it gets one, naming them).
pub fn notes_for(change: &Transition, holders: &[Holder]) -> Vec<Note> {
    let (type_, reason) = match change.to {
        Health::Unhealthy => (EventType::Warning, UNHEALTHY_REASON),
        Health::Healthy => (EventType::Normal, RECOVERED_REASON),
    };
    let text = |held_by: Option<&str>| {
        let held = held_by
            .map(|c| format!(", used by {c}"))
            .unwrap_or_default();
        match change.to {
            Health::Unhealthy => format!(
                "device {} (index {}){held}: {}",
                change.id,
                change.index,
                change.message.as_deref().unwrap_or("Unhealthy")
            ),
            Health::Healthy => format!(
                "device {} (index {}){held}: Healthy again, back in service{}",
                change.id,
                change.index,
                change
                    .message
                    .as_deref()
                    .map(|m| format!(" (was {m})"))
                    .unwrap_or_default()
            ),
        }
    };
    let mut notes = vec![Note {
        target: Target::Node,
        type_,
        reason,
        text: text(None),
    }];
    let mut by_pod: BTreeMap<(&str, &str), Vec<&str>> = BTreeMap::new();
    for h in holders {
        by_pod
            .entry((&h.namespace, &h.pod))
            .or_default()
            .push(&h.container);
    }
    for ((namespace, name), containers) in by_pod {
        let containers = match containers.as_slice() {
            [one] => format!("container {one}"),
            many => format!("containers {}", many.join(", ")),
        };
        notes.push(Note {
            target: Target::Pod {
                namespace: namespace.into(),
                name: name.into(),
            },
            type_,
            reason,
            text: text(Some(&containers)),
        });
    }
    notes
}

/// The recorder folds repeats of an Event into one with a count, keyed on (object, type, reason, action);
/// the note is not part of its key. The action carries a digest of the note, so that only an Event with the
/// same text is folded in: two GPUs failing on one node are two Events, each with its own message.
fn action(reason: &str, text: &str) -> String {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut hasher);
    let verb = if reason == UNHEALTHY_REASON {
        "TakeOutOfService"
    } else {
        "ReturnToService"
    };
    format!("{verb}-{:08x}", hasher.finish() as u32)
}

/// An API error with what to do about the usual ones.
fn explain(e: &kube::Error, rbac: &str) -> String {
    match e {
        kube::Error::Api(status) if status.is_forbidden() => format!(
            "{e} (the plugin's service account needs {rbac}; the RBAC in manifests/base/rbac.yaml grants it)"
        ),
        _ => e.to_string(),
    }
}

/// A token bucket on an injected clock.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    budget: EventBudget,
    tokens: u32,
    since: Instant,
}

impl TokenBucket {
    /// A full bucket at `now`.
    pub fn new(budget: EventBudget, now: Instant) -> Self {
        TokenBucket {
            budget,
            tokens: budget.burst,
            since: now,
        }
    }

    /// Takes one token if there is one at `now`.
    pub fn take(&mut self, now: Instant) -> bool {
        if !self.budget.refill.is_zero() {
            let earned = now.saturating_duration_since(self.since).as_nanos()
                / self.budget.refill.as_nanos();
            let earned = u32::try_from(earned).unwrap_or(u32::MAX);
            if self.tokens.saturating_add(earned) >= self.budget.burst {
                self.tokens = self.budget.burst;
                self.since = now;
            } else if earned > 0 {
                self.tokens += earned;
                self.since += self.budget.refill * earned;
            }
        }
        if self.tokens == 0 {
            return false;
        }
        self.tokens -= 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::DeviceInfo;

    fn inventory(n: usize) -> Inventory {
        Inventory::new((0..n).map(|i| DeviceInfo {
            id: format!("GPU-{i}"),
            numa_node: None,
            ..DeviceInfo::default()
        }))
    }

    #[test]
    fn a_fault_and_a_recovery_are_transitions_a_new_message_alone_is_not() {
        let before = inventory(3);
        let mut after = before.clone();
        after.set_health(
            "GPU-1",
            Health::Unhealthy,
            Some("Unhealthy: XID 79: GPU has fallen off the bus.".into()),
        );
        let changes = transitions(&before, &after);
        assert_eq!(
            changes,
            [Transition {
                id: "GPU-1".into(),
                index: 1,
                to: Health::Unhealthy,
                message: Some("Unhealthy: XID 79: GPU has fallen off the bus.".into()),
            }]
        );
        let mut again = after.clone();
        again.set_health(
            "GPU-1",
            Health::Unhealthy,
            Some("Unhealthy: XID 48.".into()),
        );
        assert!(transitions(&after, &again).is_empty());
        let mut recovered = again.clone();
        recovered.set_health("GPU-1", Health::Healthy, None);
        let back = transitions(&again, &recovered);
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].to, Health::Healthy);
        assert_eq!(back[0].message.as_deref(), Some("Unhealthy: XID 48."));
    }

    #[test]
    fn the_condition_lists_every_unhealthy_gpu_and_is_false_when_none_is() {
        let mut inv = inventory(8);
        let healthy = condition_of(&inv);
        assert_eq!(
            (healthy.status(), healthy.reason()),
            ("False", HEALTHY_REASON)
        );
        assert_eq!(healthy.message, "all 8 GPUs Healthy");
        inv.set_health(
            "GPU-2",
            Health::Unhealthy,
            Some("Unhealthy: XID 79: off the bus.".into()),
        );
        inv.set_health(
            "GPU-5",
            Health::Unhealthy,
            Some("Unhealthy: ECC double-bit error.".into()),
        );
        let sick = condition_of(&inv);
        assert_eq!((sick.status(), sick.reason()), ("True", UNHEALTHY_REASON));
        assert_eq!(
            sick.message,
            "2 of 8 GPUs Unhealthy. device GPU-2 (index 2): Unhealthy: XID 79: off the bus. | \
             device GPU-5 (index 5): Unhealthy: ECC double-bit error."
        );
    }

    #[test]
    fn the_condition_message_is_bounded_on_a_node_of_long_messages() {
        let mut inv = inventory(64);
        for i in 0..64 {
            inv.set_health(
                &format!("GPU-{i}"),
                Health::Unhealthy,
                Some("é".repeat(1000)),
            );
        }
        let wanted = condition_of(&inv);
        assert!(wanted.message.len() <= CONDITION_MESSAGE_LIMIT);
        assert!(
            wanted.message.starts_with("64 of 64 GPUs Unhealthy.")
                && wanted.message.ends_with("...")
        );
    }

    #[test]
    fn each_pod_holding_the_device_gets_one_event_naming_its_containers() {
        let change = Transition {
            id: "GPU-3".into(),
            index: 3,
            to: Health::Unhealthy,
            message: Some("Unhealthy: XID 79: GPU has fallen off the bus.".into()),
        };
        let holder = |ns: &str, pod: &str, c: &str| Holder {
            namespace: ns.into(),
            pod: pod.into(),
            container: c.into(),
        };
        let notes = notes_for(
            &change,
            &[
                holder("ml", "train-0", "trainer"),
                holder("ml", "train-0", "profiler"),
                holder("web", "infer", "server"),
            ],
        );
        let texts: Vec<(&Target, &str)> =
            notes.iter().map(|n| (&n.target, n.text.as_str())).collect();
        assert_eq!(
            texts,
            [
                (
                    &Target::Node,
                    "device GPU-3 (index 3): Unhealthy: XID 79: GPU has fallen off the bus."
                ),
                (
                    &Target::Pod {
                        namespace: "ml".into(),
                        name: "train-0".into()
                    },
                    "device GPU-3 (index 3), used by containers trainer, profiler: Unhealthy: XID 79: GPU has fallen off the bus."
                ),
                (
                    &Target::Pod {
                        namespace: "web".into(),
                        name: "infer".into()
                    },
                    "device GPU-3 (index 3), used by container server: Unhealthy: XID 79: GPU has fallen off the bus."
                ),
            ]
        );
        assert!(
            notes
                .iter()
                .all(|n| n.type_ == EventType::Warning && n.reason == UNHEALTHY_REASON)
        );
        let back = notes_for(
            &Transition {
                to: Health::Healthy,
                ..change
            },
            &[],
        );
        assert_eq!(back.len(), 1);
        assert_eq!(
            (back[0].type_, back[0].reason),
            (EventType::Normal, RECOVERED_REASON)
        );
        assert_eq!(
            back[0].text,
            "device GPU-3 (index 3): Healthy again, back in service (was Unhealthy: XID 79: GPU has fallen off the bus.)"
        );
    }

    #[test]
    fn events_with_different_text_are_never_folded_together() {
        assert_ne!(
            action(UNHEALTHY_REASON, "device a: x"),
            action(UNHEALTHY_REASON, "device b: x")
        );
        assert_eq!(
            action(UNHEALTHY_REASON, "device a: x"),
            action(UNHEALTHY_REASON, "device a: x")
        );
        assert!(action(UNHEALTHY_REASON, &"x".repeat(5000)).len() <= 128);
    }

    #[test]
    fn the_bucket_allows_a_burst_then_one_per_refill() {
        let budget = EventBudget {
            burst: 3,
            refill: Duration::from_secs(3),
        };
        let start = Instant::now();
        let mut bucket = TokenBucket::new(budget, start);
        let allowed = (0..10).filter(|_| bucket.take(start)).count();
        assert_eq!(allowed, 3);
        assert!(!bucket.take(start + Duration::from_millis(2999)));
        assert!(bucket.take(start + Duration::from_secs(3)));
        assert!(!bucket.take(start + Duration::from_secs(3)));
        // A minute of quiet fills it to the burst, no more.
        let later = start + Duration::from_secs(63);
        assert_eq!((0..10).filter(|_| bucket.take(later)).count(), 3);
    }

    #[test]
    fn notes_are_cut_at_a_character_boundary() {
        let cut = crate::util::text::cut_bytes(&"é".repeat(1000), NOTE_LIMIT);
        assert!(cut.len() <= NOTE_LIMIT && cut.ends_with("..."));
    }
}
