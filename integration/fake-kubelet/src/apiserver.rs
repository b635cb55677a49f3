//! A recording stand-in for the Kubernetes API server, for the plugin's Events and node condition: it serves
//! the few requests the plugin makes over plain HTTP on loopback, checks them as the API server does (content
//! type of a patch, the fields events.k8s.io/v1 requires and their limits, a condition's status), keeps the
//! objects, and records every request so that tests can assert the exact bodies.
//!
//! - `GET /api/v1/nodes/{name}`, `PATCH /api/v1/nodes/{name}/status` (strategic merge: conditions merge by
//!   type, as the API server merges them);
//! - `GET /api/v1/nodes?fieldSelector=metadata.name=<name>`, as a list and with `watch=true` as a watch: the
//!   stream sends `MODIFIED` with the whole Node on every change of it (a status patch,
//!   [`FakeApiServer::set_annotation`]) until the client goes;
//! - `GET /api/v1/namespaces/{ns}/pods/{name}` (metadata only when asked for `as=PartialObjectMetadata`);
//! - `POST /apis/events.k8s.io/v1/namespaces/{ns}/events`, `PATCH .../events/{name}` (JSON merge patch);
//! - resource.k8s.io/v1:
//!   - `GET /apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}`, the claims made by
//!     [`FakeApiServer::add_claim`], and `GET /apis/resource.k8s.io/v1/resourceclaims`, every namespace's,
//!     in pages (`limit`, `continue`) as the API server pages a list, each page answered after
//!     [`FakeApiServer::slow_claim_lists`]'s delay (none unless set);
//!   - ResourceSlices (cluster-scoped): `POST` (with `generateName`), `GET`, `PUT` and merge `PATCH` (a stale
//!     `metadata.resourceVersion` is 409 Conflict), `DELETE` (one, or the collection a selector picks), list
//!     and `watch=true` with `fieldSelector` `spec.nodeName`/`spec.driver`/`metadata.name` and equality
//!     `labelSelector`. Writes are validated as the API server validates a v1 slice (422 Invalid naming the
//!     field); a watch resumes from any resource version still in its history (410 Gone before it, as after
//!     a compaction), and `sendInitialEvents=true` ends its initial events with the bookmark kube-rs expects;
//!   - DeviceClasses: `POST`, `GET`, list, `DELETE`, kept as sent.
//!
//! Anything else is 404. [`FakeApiServer::forbid`] answers every request 403 (a service account without the
//! RBAC), [`FakeApiServer::fail_next`] answers the next requests 503.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use gpu_device_plugin::util::runtime::{Priority, spawn_on_own_thread};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::StreamExt as _;

mod resource;
#[cfg(test)]
mod tests;

use resource::Reply;

/// One request as it arrived, with the answer's status.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    /// HTTP method.
    pub method: String,
    /// Path, without the query.
    pub path: String,
    /// The query, as sent (`watch=true&fieldSelector=...`), empty when none.
    pub query: String,
    /// `Content-Type`, if any.
    pub content_type: Option<String>,
    /// `User-Agent`, if any: the real API server names a client by it in its audit log and request logs.
    pub user_agent: Option<String>,
    /// The body as JSON (`Null` when empty).
    pub body: Value,
    /// The status code answered.
    pub status: u16,
    /// When it arrived.
    pub at: Instant,
}

/// One device a ResourceClaim is allocated, for [`FakeApiServer::add_claim`]: an entry of
/// `status.allocation.devices.results`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocationResult {
    /// The request it satisfies (`<request>/<subrequest>` for a `firstAvailable` alternative).
    pub request: String,
    /// The DRA driver that owns the device.
    pub driver: String,
    /// Its pool.
    pub pool: String,
    /// Its name in the pool.
    pub device: String,
}

impl AllocationResult {
    /// A result for `request`: device `device` of pool `pool` of `driver`.
    pub fn new(request: &str, driver: &str, pool: &str, device: &str) -> Self {
        AllocationResult {
            request: request.into(),
            driver: driver.into(),
            pool: pool.into(),
            device: device.into(),
        }
    }
}

/// What a fake kubelet holds of a [`FakeApiServer`] to act on it as the kubelet acts on its API server: read
/// claims, delete a node's slices. It bypasses HTTP (no [`FakeApiServer::forbid`] or
/// [`FakeApiServer::fail_next`]: the kubelet has its own credentials); its deletions are recorded as the
/// `DELETE` of a collection the kubelet sends, its reads are not recorded.
#[derive(Clone)]
pub struct ApiServerLink {
    state: Arc<Mutex<State>>,
    requests: Arc<watch::Sender<Vec<Recorded>>>,
}

impl std::fmt::Debug for ApiServerLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiServerLink")
    }
}

impl ApiServerLink {
    /// ResourceClaim `namespace/name` as stored.
    pub fn claim(&self, namespace: &str, name: &str) -> Option<Value> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state
            .resource
            .claims
            .get(&(namespace.into(), name.into()))
            .cloned()
    }

    /// Deletes the ResourceSlices of `node` (of `driver` only, if given), as the kubelet's DeleteCollection
    /// does; returns how many.
    pub fn wipe_slices(&self, node: &str, driver: Option<&str>) -> usize {
        let mut selector = format!("spec.nodeName={node}");
        if let Some(driver) = driver {
            selector.push_str(&format!(",spec.driver={driver}"));
        }
        let deleted = {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            state.version += 1;
            let version = state.version;
            state.resource.wipe(version, node, driver)
        };
        self.requests.send_modify(|r| {
            r.push(Recorded {
                method: "DELETE".into(),
                path: "/apis/resource.k8s.io/v1/resourceslices".into(),
                query: format!(
                    "fieldSelector={}",
                    selector.replace('=', "%3D").replace(',', "%2C")
                ),
                content_type: None,
                user_agent: None,
                body: Value::Null,
                status: 200,
                at: Instant::now(),
            })
        });
        deleted
    }
}

#[derive(Debug, Default)]
struct State {
    nodes: BTreeMap<String, Value>,
    pods: BTreeMap<(String, String), Value>,
    events: BTreeMap<(String, String), Value>,
    forbidden: bool,
    fail_next: u32,
    /// How long each page of the cluster-wide ResourceClaim list takes ([`FakeApiServer::slow_claim_lists`]).
    claim_list_page_delay: Duration,
    /// Node status patches still to be applied and then left unanswered ([`FakeApiServer::apply_and_hold_next_status_patch`]).
    hold_next_status_patches: u32,
    version: u64,
    /// Open watches on one node each: the node's name and where its changes go.
    watches: Vec<(String, tokio::sync::mpsc::UnboundedSender<Value>)>,
    /// resource.k8s.io/v1: claims, slices, device classes.
    resource: resource::ResourceState,
}

impl State {
    /// Sends `name`'s current object to every watch on it, forgetting watches whose client went.
    fn changed(&mut self, name: &str) {
        let Some(node) = self.nodes.get(name).cloned() else {
            return;
        };
        self.watches.retain(|(watched, tx)| {
            watched != name || tx.send(json!({"type": "MODIFIED", "object": node})).is_ok()
        });
    }
}

/// A running fake API server.
pub struct FakeApiServer {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    requests: Arc<watch::Sender<Vec<Recorded>>>,
    /// Stops the server's thread when dropped.
    _stop: tokio_util::sync::DropGuard,
}

impl FakeApiServer {
    /// Starts serving on a free loopback port, on a thread and runtime of its own, as a separate process
    /// would: the API server's work never takes a turn on the caller's threads (a benchmark's kubelet side
    /// among them).
    pub async fn start() -> std::io::Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let requests = Arc::new(watch::Sender::new(Vec::new()));
        let stop = tokio_util::sync::CancellationToken::new();
        let (served_state, served_requests, stopped) =
            (state.clone(), requests.clone(), stop.clone());
        spawn_on_own_thread("fake-apiserver", Priority::Side, async move {
            let Ok(listener) = TcpListener::from_std(listener) else {
                return;
            };
            tokio::select! {
                () = stopped.cancelled() => {}
                () = serve(listener, served_state, served_requests) => {}
            }
        })?;
        Ok(FakeApiServer {
            addr,
            state,
            requests,
            _stop: stop.drop_guard(),
        })
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig that points at this server.
    pub fn write_kubeconfig(&self, path: &Path) -> std::io::Result<()> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: plugin\n  user:\n    token: fake-token\ncontexts:\n- name: fake\n  context:\n    \
             cluster: fake\n    user: plugin\ncurrent-context: fake\n",
            self.url()
        );
        std::fs::write(path, text)
    }

    /// Adds a Node object.
    pub fn add_node(&self, name: &str) {
        let node = json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "uid": format!("uid-node-{name}"), "resourceVersion": "1"},
            "status": {"conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status",
                 "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}
            ]}
        });
        self.with_state(|s| s.nodes.insert(name.into(), node));
    }

    /// Sets (`Some`) or removes (`None`) an annotation on node `name`, as `kubectl annotate` does; watches
    /// on the node see the change.
    pub fn set_annotation(&self, name: &str, key: &str, value: Option<&str>) {
        self.with_state(|s| {
            s.version += 1;
            let version = s.version.to_string();
            let Some(node) = s.nodes.get_mut(name) else {
                return;
            };
            let metadata = &mut node["metadata"];
            if !metadata["annotations"].is_object() {
                metadata["annotations"] = json!({});
            }
            match value {
                Some(value) => metadata["annotations"][key] = Value::String(value.into()),
                None => {
                    if let Some(annotations) = metadata["annotations"].as_object_mut() {
                        annotations.remove(key);
                    }
                }
            }
            metadata["resourceVersion"] = Value::String(version);
            s.changed(name);
        });
    }

    /// Sets a condition on node `name` as another writer would (another instance of the plugin): replaces
    /// the one of the same type, or adds it.
    pub fn set_condition(&self, name: &str, condition: Value) {
        self.with_state(|s| {
            s.version += 1;
            let version = s.version.to_string();
            let Some(node) = s.nodes.get_mut(name) else {
                return;
            };
            if !node["status"]["conditions"].is_array() {
                node["status"]["conditions"] = json!([]);
            }
            if let Some(conditions) = node["status"]["conditions"].as_array_mut() {
                conditions.retain(|c| c["type"] != condition["type"]);
                conditions.push(condition);
            }
            node["metadata"]["resourceVersion"] = Value::String(version);
            s.changed(name);
        });
    }

    /// Whether a watch on node `name` is open.
    pub fn watching(&self, name: &str) -> bool {
        self.with_state(|s| {
            s.watches
                .iter()
                .any(|(watched, tx)| watched == name && !tx.is_closed())
        })
    }

    /// Adds a Pod object; returns its UID.
    pub fn add_pod(&self, namespace: &str, name: &str) -> String {
        let uid = format!("uid-pod-{namespace}-{name}");
        let pod = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": uid, "resourceVersion": "1"},
        });
        self.with_state(|s| s.pods.insert((namespace.into(), name.into()), pod));
        uid
    }

    /// While `true`, every request is answered 403 Forbidden.
    pub fn forbid(&self, forbidden: bool) {
        self.with_state(|s| s.forbidden = forbidden);
    }

    /// Applies the next node status patch and records it, but never answers it: the client sees a request
    /// that the server has taken in while it waits for the answer, as when the API server is slow to reply
    /// (or the plugin is stopped in between).
    pub fn apply_and_hold_next_status_patch(&self) {
        self.with_state(|s| s.hold_next_status_patches += 1);
    }

    /// Answers each page of the cluster-wide ResourceClaim list (`GET /apis/resource.k8s.io/v1/resourceclaims`)
    /// `per_page` after it was asked for, as an API server under load, or with a large cluster's claims to
    /// read, answers it: a list of `n` pages takes `n` × `per_page`. Every other request is answered at once.
    /// `Duration::ZERO` (the default) answers pages at once.
    pub fn slow_claim_lists(&self, per_page: Duration) {
        self.with_state(|s| s.claim_list_page_delay = per_page);
    }

    /// Answers the next `n` requests 503 Service Unavailable.
    pub fn fail_next(&self, n: u32) {
        self.with_state(|s| s.fail_next = n);
    }

    /// Every request so far, oldest first.
    pub fn requests(&self) -> Vec<Recorded> {
        self.requests.borrow().clone()
    }

    /// Waits until the requests so far satisfy `pred`; returns them.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        mut pred: impl FnMut(&[Recorded]) -> bool,
    ) -> Result<Vec<Recorded>, String> {
        let mut rx = self.requests.subscribe();
        match tokio::time::timeout(timeout, rx.wait_for(|r| pred(r))).await {
            Ok(Ok(requests)) => Ok(requests.clone()),
            _ => Err(format!(
                "timed out after {timeout:?} waiting for {what}; requests: {:#?}",
                self.requests()
            )),
        }
    }

    /// The condition of type `type_` on node `name`, as stored.
    pub fn node_condition(&self, name: &str, type_: &str) -> Option<Value> {
        self.with_state(|s| {
            s.nodes.get(name).and_then(|node| {
                node["status"]["conditions"]
                    .as_array()?
                    .iter()
                    .find(|c| c["type"] == type_)
                    .cloned()
            })
        })
    }

    /// Every stored Event (events.k8s.io/v1), by namespace and name.
    pub fn events(&self) -> Vec<Value> {
        self.with_state(|s| s.events.values().cloned().collect())
    }

    /// Creates an allocated ResourceClaim `namespace/name` as the scheduler leaves it: `spec.devices.requests`
    /// names each request of `results` (a `<request>/<subrequest>` as a `firstAvailable` entry), and
    /// `status.allocation.devices.results` holds the results as given. Replaces a claim of that name (with a
    /// new UID, as a claim deleted and made again). Returns the UID.
    pub fn add_claim(&self, namespace: &str, name: &str, results: Vec<AllocationResult>) -> String {
        let uid = resource::new_uid();
        let mut requests: Vec<(String, Vec<String>, String)> = Vec::new();
        for result in &results {
            let (request, sub) = match result.request.split_once('/') {
                Some((request, sub)) => (request.to_string(), Some(sub.to_string())),
                None => (result.request.clone(), None),
            };
            match requests.iter_mut().find(|(r, _, _)| *r == request) {
                Some((_, subs, _)) => subs.extend(sub),
                None => requests.push((request, sub.into_iter().collect(), result.driver.clone())),
            }
        }
        let count = |request: &str| {
            results
                .iter()
                .filter(|r| r.request == request || r.request.starts_with(&format!("{request}/")))
                .count()
        };
        let requests: Vec<Value> = requests
            .iter()
            .map(|(request, subs, driver)| {
                if subs.is_empty() {
                    json!({"name": request, "exactly": {
                        "deviceClassName": driver, "allocationMode": "ExactCount", "count": count(request),
                    }})
                } else {
                    json!({"name": request, "firstAvailable": subs.iter().map(|sub| json!({
                        "name": sub, "deviceClassName": driver, "allocationMode": "ExactCount",
                        "count": count(request),
                    })).collect::<Vec<_>>()})
                }
            })
            .collect();
        let results: Vec<Value> = results
            .iter()
            .map(|r| json!({"request": r.request, "driver": r.driver, "pool": r.pool, "device": r.device}))
            .collect();
        self.with_state(|s| {
            s.version += 1;
            let claim = json!({
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {
                    "name": name, "namespace": namespace, "uid": uid,
                    "resourceVersion": s.version.to_string(), "creationTimestamp": "2026-01-01T00:00:00Z",
                },
                "spec": {"devices": {"requests": requests}},
                "status": {"allocation": {"devices": {"results": results}}},
            });
            s.resource
                .claims
                .insert((namespace.into(), name.into()), claim);
        });
        uid
    }

    /// Gives ResourceClaim `namespace/name`'s allocation the device configuration `config` (entries of
    /// `status.allocation.devices.config`, as the scheduler copies them from the claim's DeviceClass and
    /// the claim); the `FromClaim` ones go into `spec.devices.config` too. Returns whether the claim is there.
    pub fn configure_claim(&self, namespace: &str, name: &str, config: Vec<Value>) -> bool {
        self.with_state(|s| {
            s.version += 1;
            let version = s.version.to_string();
            let Some(claim) = s.resource.claims.get_mut(&(namespace.into(), name.into())) else {
                return false;
            };
            let from_claim: Vec<Value> = config
                .iter()
                .filter(|c| c["source"] == "FromClaim")
                .map(|c| json!({"requests": c["requests"], "opaque": c["opaque"]}))
                .collect();
            claim["spec"]["devices"]["config"] = Value::Array(from_claim);
            claim["status"]["allocation"]["devices"]["config"] = Value::Array(config);
            claim["metadata"]["resourceVersion"] = Value::String(version);
            true
        })
    }

    /// The stored ResourceClaim `namespace/name`.
    pub fn claim(&self, namespace: &str, name: &str) -> Option<Value> {
        self.with_state(|s| {
            s.resource
                .claims
                .get(&(namespace.into(), name.into()))
                .cloned()
        })
    }

    /// Deletes ResourceClaim `namespace/name`; returns whether it was there.
    pub fn delete_claim(&self, namespace: &str, name: &str) -> bool {
        self.with_state(|s| {
            s.resource
                .claims
                .remove(&(namespace.into(), name.into()))
                .is_some()
        })
    }

    /// Reserves ResourceClaim `namespace/name` for pod `pod` (UID `pod_uid`), as the scheduler does before the
    /// pod is bound: an entry in `status.reservedFor`. Returns whether the claim is there.
    pub fn reserve_claim(&self, namespace: &str, name: &str, pod: &str, pod_uid: &str) -> bool {
        self.with_state(|s| {
            s.version += 1;
            let version = s.version.to_string();
            let Some(claim) = s.resource.claims.get_mut(&(namespace.into(), name.into())) else {
                return false;
            };
            let consumer = json!({"resource": "pods", "name": pod, "uid": pod_uid});
            match claim["status"]["reservedFor"].as_array_mut() {
                Some(list) => list.push(consumer),
                None => claim["status"]["reservedFor"] = json!([consumer]),
            }
            claim["metadata"]["resourceVersion"] = Value::String(version);
            true
        })
    }

    /// Pads ResourceClaim `namespace/name` with an annotation of `bytes` bytes, past anything the API server
    /// would store (its objects are at most 1.5 MiB): what a broken proxy or something else answering at the
    /// API server's address could send for it. Returns whether the claim is there.
    pub fn inflate_claim(&self, namespace: &str, name: &str, bytes: usize) -> bool {
        self.with_state(|s| {
            let Some(claim) = s.resource.claims.get_mut(&(namespace.into(), name.into())) else {
                return false;
            };
            claim["metadata"]["annotations"] = json!({"example.com/padding": "x".repeat(bytes)});
            true
        })
    }

    /// Takes the allocation off ResourceClaim `namespace/name` (as when it was deallocated); returns whether
    /// the claim is there.
    pub fn deallocate_claim(&self, namespace: &str, name: &str) -> bool {
        self.with_state(|s| {
            s.version += 1;
            let version = s.version.to_string();
            let Some(claim) = s.resource.claims.get_mut(&(namespace.into(), name.into())) else {
                return false;
            };
            if let Some(status) = claim["status"].as_object_mut() {
                status.remove("allocation");
            }
            claim["metadata"]["resourceVersion"] = Value::String(version);
            true
        })
    }

    /// Every ResourceSlice as stored, by name.
    pub fn slices(&self) -> Vec<Value> {
        self.with_state(|s| s.resource.slices())
    }

    /// Deletes every ResourceSlice of node `node`, as the kubelet does when it starts (watches see them
    /// DELETED); returns how many. Not recorded as a request (see [`ApiServerLink`] for the kubelet's own).
    pub fn wipe_slices(&self, node: &str) -> usize {
        self.with_state(|s| {
            s.version += 1;
            let version = s.version;
            s.resource.wipe(version, node, None)
        })
    }

    /// Someone else's update of the ResourceSlice `name` (another writer, an operator's `kubectl edit`):
    /// `edit` applied to the stored slice, which gets a new resource version. Whether there was one.
    pub fn edit_slice(&self, name: &str, edit: impl FnOnce(&mut Value)) -> bool {
        self.with_state(|s| {
            s.version += 1;
            let version = s.version;
            s.resource.edit_slice(version, name, edit)
        })
    }

    /// Waits until the stored slices satisfy `pred`; returns them.
    pub async fn wait_for_slices(
        &self,
        what: &str,
        timeout: Duration,
        mut pred: impl FnMut(&[Value]) -> bool,
    ) -> Result<Vec<Value>, String> {
        let mut rx = self.with_state(|s| s.resource.snapshot.subscribe());
        match tokio::time::timeout(timeout, rx.wait_for(|slices| pred(slices))).await {
            Ok(Ok(slices)) => Ok(slices.clone()),
            _ => Err(format!(
                "timed out after {timeout:?} waiting for {what}; slices: {:#?}",
                self.slices()
            )),
        }
    }

    /// With `true`, behaves as an API server with the `DRADeviceTaints` feature gate off: every device's
    /// `taints` are dropped from a ResourceSlice on write, silently (the answer and the stored object lack
    /// them; the 64-device limit of tainted slices no longer applies).
    pub fn drop_device_taints(&self, drop: bool) {
        self.with_state(|s| s.resource.drop_device_taints = drop);
    }

    /// With `true`, ResourceSlice watches fall behind: the changes made from now on reach them only when
    /// this is called again with `false` (an API server's watch cache behind its writes). Lists, reads and
    /// writes answer at once.
    pub fn lag_slice_watches(&self, lag: bool) {
        self.with_state(|s| s.resource.lag_watches(lag));
    }

    /// Forgets the ResourceSlice change history, as an etcd compaction does: a watch that resumes from a
    /// resource version before now gets `410 Gone` (kube-rs's `watcher` then lists again).
    pub fn compact_slice_history(&self) {
        self.with_state(|s| {
            s.version += 1;
            let version = s.version;
            s.resource.compact(version);
        });
    }

    /// Number of open watches on ResourceSlices.
    pub fn slice_watches(&self) -> usize {
        self.with_state(|s| s.resource.watching())
    }

    /// Every stored DeviceClass, by name.
    pub fn device_classes(&self) -> Vec<Value> {
        self.with_state(|s| s.resource.classes())
    }

    /// A handle through which a fake kubelet acts on this server as the real kubelet does on its API server
    /// (see [`crate::dra::DraOptions::api_server`]).
    pub fn link(&self) -> ApiServerLink {
        ApiServerLink {
            state: self.state.clone(),
            requests: self.requests.clone(),
        }
    }

    fn with_state<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        f(&mut state)
    }
}

async fn serve(
    listener: TcpListener,
    state: Arc<Mutex<State>>,
    requests: Arc<watch::Sender<Vec<Recorded>>>,
) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let (state, requests) = (state.clone(), requests.clone());
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let (state, requests) = (state.clone(), requests.clone());
                async move { Ok::<_, Infallible>(handle(request, &state, &requests).await) }
            });
            let _closed = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
        while connections.try_join_next().is_some() {}
    }
}

/// A response body: whole, or a watch's stream.
type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

async fn handle(
    request: Request<Incoming>,
    state: &Mutex<State>,
    requests: &watch::Sender<Vec<Recorded>>,
) -> Response<Body> {
    let at = Instant::now();
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let query = request.uri().query().unwrap_or("").to_string();
    let content_type = request
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let user_agent = request
        .headers()
        .get("user-agent")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    // A client asking for metadata only (`as=PartialObjectMetadata`) gets it, as from the real API server.
    let metadata_only = request
        .headers()
        .get("accept")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("as=PartialObjectMetadata"));
    let body = match request.into_body().collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let body: Value = if body.is_empty() {
        Value::Null
    } else {
        match serde_json::from_slice(&body) {
            Ok(value) => value,
            Err(e) => {
                return answer(
                    requests,
                    Recorded {
                        method: method.to_string(),
                        path,
                        query,
                        content_type,
                        user_agent,
                        body: Value::Null,
                        status: 400,
                        at,
                    },
                    failure(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
                );
            }
        }
    };
    let special = if method == Method::GET && path.trim_end_matches('/') == "/api/v1/nodes" {
        let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
        Some(nodes(&mut state, &query))
    } else if let Some(rest) = path.strip_prefix(RESOURCE_PREFIX) {
        if method == Method::GET && rest.trim_matches('/') == "resourceclaims" {
            let delay = state
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .claim_list_page_delay;
            tokio::time::sleep(delay).await;
        }
        let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
        Some(route_resource(
            &mut state,
            &method,
            rest,
            &query,
            content_type.as_deref(),
            &body,
        ))
    } else {
        None
    };
    if let Some(reply) = special {
        let status = match &reply {
            Reply::Whole(status, _) => *status,
            Reply::Watch(..) => StatusCode::OK,
        };
        let recorded = Recorded {
            method: method.to_string(),
            path,
            query,
            content_type,
            user_agent,
            body,
            status: status.as_u16(),
            at,
        };
        return match reply {
            Reply::Whole(status, value) => answer(requests, recorded, (status, value)),
            Reply::Watch(events, timeout) => {
                requests.send_modify(|r| r.push(recorded));
                stream(events, timeout)
            }
        };
    }
    let (status, mut reply, held) = {
        let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
        let (status, reply) = route(&mut state, &method, &path, content_type.as_deref(), &body);
        let held = method == Method::PATCH
            && path.starts_with("/api/v1/nodes/")
            && path.ends_with("/status")
            && status == StatusCode::OK
            && state.hold_next_status_patches > 0;
        if held {
            state.hold_next_status_patches -= 1;
        }
        (status, reply, held)
    };
    let recorded = Recorded {
        method: method.to_string(),
        path,
        query,
        content_type,
        user_agent,
        body,
        status: status.as_u16(),
        at,
    };
    if held {
        requests.send_modify(|r| r.push(recorded));
        // Applied and recorded; the answer never comes (until the server stops).
        return std::future::pending().await;
    }
    if metadata_only && method == Method::GET && status == StatusCode::OK {
        reply = json!({
            "kind": "PartialObjectMetadata",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": reply["metadata"].clone(),
        });
    }
    answer(requests, recorded, (status, reply))
}

/// A watch's answer: its events, one JSON object a line, until the client goes, the server stops, or
/// `timeout` (the request's `timeoutSeconds`) has passed, as the API server ends a watch.
fn stream(events: resource::Events, timeout: Option<Duration>) -> Response<Body> {
    let until: std::pin::Pin<Box<dyn Future<Output = ()> + Send + Sync>> = match timeout {
        Some(timeout) => Box::pin(tokio::time::sleep(timeout)),
        None => Box::pin(std::future::pending()),
    };
    let frames = futures_util::StreamExt::take_until(
        tokio_stream::wrappers::UnboundedReceiverStream::new(events),
        until,
    )
    .map(|v| Ok::<_, Infallible>(hyper::body::Frame::data(Bytes::from(format!("{v}\n")))));
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(http_body_util::StreamBody::new(frames).boxed())
        .unwrap_or_default()
}

/// Where resource.k8s.io/v1 lives.
const RESOURCE_PREFIX: &str = "/apis/resource.k8s.io/v1/";

/// A request under [`RESOURCE_PREFIX`] (`rest` is the path after it): refused as any request is while
/// forbidden or failing, else served by [`resource::route`].
fn route_resource(
    state: &mut State,
    method: &Method,
    rest: &str,
    query: &str,
    content_type: Option<&str>,
    body: &Value,
) -> Reply {
    if let Some(refusal) = refuse(state, method, &format!("{RESOURCE_PREFIX}{rest}")) {
        return refusal.into();
    }
    state.version += 1;
    let parts: Vec<&str> = rest.trim_matches('/').split('/').collect();
    resource::route(
        &mut state.resource,
        state.version,
        method,
        &parts,
        query,
        content_type,
        body,
    )
}

/// The answer to every request while the server is forbidden ([`FakeApiServer::forbid`]) or failing
/// ([`FakeApiServer::fail_next`]), if it is.
fn refuse(state: &mut State, method: &Method, path: &str) -> Option<(StatusCode, Value)> {
    if state.forbidden {
        return Some(failure(
            StatusCode::FORBIDDEN,
            "Forbidden",
            &format!(
                "{path} is forbidden: User \"system:serviceaccount:kube-system:gpu-device-plugin\" cannot {} it",
                method.as_str().to_lowercase()
            ),
        ));
    }
    if state.fail_next > 0 {
        state.fail_next -= 1;
        return Some(failure(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the server is currently unable to handle the request",
        ));
    }
    None
}

/// `GET /api/v1/nodes`, with a `metadata.name` field selector (the only one the plugin uses): the list, or
/// with `watch=true` a watch on that node.
fn nodes(state: &mut State, query: &str) -> Reply {
    if state.forbidden {
        return failure(
            StatusCode::FORBIDDEN,
            "Forbidden",
            "nodes is forbidden: User \"system:serviceaccount:kube-system:gpu-device-plugin\" cannot list or watch it",
        )
        .into();
    }
    let params: BTreeMap<&str, String> = query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k, v.replace("%3D", "=").replace("%3d", "=")))
        .collect();
    let Some(name) = params
        .get("fieldSelector")
        .and_then(|f| f.strip_prefix("metadata.name="))
        .map(str::to_string)
    else {
        return invalid("this fake serves nodes by fieldSelector=metadata.name=<name> only").into();
    };
    if params.get("watch").is_some_and(|w| w == "true" || w == "1") {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        state.watches.push((name, tx));
        return Reply::Watch(rx, None);
    }
    let items: Vec<Value> = state.nodes.get(&name).cloned().into_iter().collect();
    Reply::Whole(
        StatusCode::OK,
        json!({
            "apiVersion": "v1",
            "kind": "NodeList",
            "metadata": {"resourceVersion": state.version.to_string()},
            "items": items,
        }),
    )
}

fn answer(
    requests: &watch::Sender<Vec<Recorded>>,
    recorded: Recorded,
    (status, body): (StatusCode, Value),
) -> Response<Body> {
    requests.send_modify(|r| r.push(recorded));
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed())
        .unwrap_or_default()
}

fn failure(code: StatusCode, reason: &str, message: &str) -> (StatusCode, Value) {
    (
        code,
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code.as_u16(),
        }),
    )
}

fn route(
    state: &mut State,
    method: &Method,
    path: &str,
    content_type: Option<&str>,
    body: &Value,
) -> (StatusCode, Value) {
    if let Some(refusal) = refuse(state, method, path) {
        return refusal;
    }
    state.version += 1;
    let version = state.version.to_string();
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (method, parts.as_slice()) {
        (&Method::GET, ["api", "v1", "nodes", name]) => match state.nodes.get(*name) {
            Some(node) => (StatusCode::OK, node.clone()),
            None => not_found("nodes", name),
        },
        (&Method::PATCH, ["api", "v1", "nodes", name, "status"]) => {
            if content_type != Some("application/strategic-merge-patch+json") {
                return failure(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "UnsupportedMediaType",
                    "the body of the request was in an unknown format",
                );
            }
            let Some(node) = state.nodes.get_mut(*name) else {
                return not_found("nodes", name);
            };
            // A resourceVersion in the patch is a precondition, as the real API server takes it.
            if let Some(wanted) = body["metadata"]["resourceVersion"].as_str()
                && node["metadata"]["resourceVersion"].as_str() != Some(wanted)
            {
                return failure(
                    StatusCode::CONFLICT,
                    "Conflict",
                    &format!(
                        "Operation cannot be fulfilled on nodes \"{name}\": the object has been modified; please apply your changes to the latest version and try again"
                    ),
                );
            }
            let conditions = body["status"]["conditions"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            for c in &conditions {
                let type_ok = c["type"].as_str().is_some_and(|t| !t.is_empty());
                let status_ok = matches!(c["status"].as_str(), Some("True" | "False" | "Unknown"));
                if !type_ok || !status_ok {
                    return invalid(&format!(
                        "Node \"{name}\" is invalid: status.conditions: {c}"
                    ));
                }
            }
            let stored = node["status"]["conditions"]
                .as_array_mut()
                .map(std::mem::take)
                .unwrap_or_default();
            let mut merged = stored;
            for c in conditions {
                match merged.iter_mut().find(|old| old["type"] == c["type"]) {
                    Some(old) => merge(old, &c),
                    None => merged.push(c),
                }
            }
            node["status"]["conditions"] = Value::Array(merged);
            node["metadata"]["resourceVersion"] = Value::String(version);
            let node = node.clone();
            state.changed(name);
            (StatusCode::OK, node)
        }
        (&Method::GET, ["api", "v1", "namespaces", ns, "pods", name]) => {
            match state.pods.get(&((*ns).into(), (*name).into())) {
                Some(pod) => (StatusCode::OK, pod.clone()),
                None => not_found("pods", name),
            }
        }
        (&Method::POST, ["apis", "events.k8s.io", "v1", "namespaces", ns, "events"]) => {
            let mut event = body.clone();
            let name = event["metadata"]["name"].as_str().unwrap_or("").to_string();
            if name.is_empty() {
                return invalid("Event is invalid: metadata.name: Required value");
            }
            if let Some(problem) = check_event(ns, &event) {
                return invalid(&format!(
                    "Event.events.k8s.io \"{name}\" is invalid: {problem}"
                ));
            }
            let key = ((*ns).to_string(), name.clone());
            if state.events.contains_key(&key) {
                return failure(
                    StatusCode::CONFLICT,
                    "AlreadyExists",
                    &format!("events.events.k8s.io \"{name}\" already exists"),
                );
            }
            event["metadata"]["namespace"] = Value::String((*ns).into());
            event["metadata"]["resourceVersion"] = Value::String(version);
            event["metadata"]["uid"] = Value::String(format!("uid-event-{name}"));
            state.events.insert(key, event.clone());
            (StatusCode::CREATED, event)
        }
        (
            &Method::PATCH,
            [
                "apis",
                "events.k8s.io",
                "v1",
                "namespaces",
                ns,
                "events",
                name,
            ],
        ) => {
            if content_type != Some("application/merge-patch+json") {
                return failure(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "UnsupportedMediaType",
                    "the body of the request was in an unknown format",
                );
            }
            let Some(stored) = state.events.get(&((*ns).into(), (*name).into())) else {
                return not_found("events.events.k8s.io", name);
            };
            let mut event = stored.clone();
            merge(&mut event, body);
            if let Some(problem) = check_event(ns, &event) {
                return invalid(&format!(
                    "Event.events.k8s.io \"{name}\" is invalid: {problem}"
                ));
            }
            event["metadata"]["resourceVersion"] = Value::String(version);
            state
                .events
                .insert(((*ns).into(), (*name).into()), event.clone());
            (StatusCode::OK, event)
        }
        _ => failure(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("the server could not find the requested resource ({method} {path})"),
        ),
    }
}

/// What the API server's validation of an events.k8s.io/v1 Event would refuse, if anything.
fn check_event(namespace: &str, event: &Value) -> Option<String> {
    let text = |field: &str| event[field].as_str().unwrap_or("");
    let required = [
        "eventTime",
        "reportingController",
        "reportingInstance",
        "action",
        "reason",
    ];
    if let Some(missing) = required.iter().find(|f| text(f).is_empty()) {
        return Some(format!("{missing}: Required value"));
    }
    for (field, limit) in [("action", 128), ("reason", 128), ("reportingInstance", 128)] {
        if text(field).len() > limit {
            return Some(format!(
                "{field}: Too long: may not be more than {limit} bytes"
            ));
        }
    }
    if text("note").len() > 1024 {
        return Some("note: Too long: may not be more than 1024 bytes".into());
    }
    if !matches!(text("type"), "Normal" | "Warning") {
        return Some(format!("type: Unsupported value: {:?}", text("type")));
    }
    let regarding = &event["regarding"];
    if regarding["kind"].as_str().unwrap_or("").is_empty() {
        return Some("regarding.kind: Required value".into());
    }
    match regarding["namespace"].as_str() {
        Some(ns) if !ns.is_empty() && ns != namespace => Some(format!(
            "regarding.namespace: Invalid value: {ns:?}: does not match event.namespace"
        )),
        _ => None,
    }
}

fn not_found(resource: &str, name: &str) -> (StatusCode, Value) {
    failure(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("{resource} \"{name}\" not found"),
    )
}

fn invalid(message: &str) -> (StatusCode, Value) {
    failure(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", message)
}

/// JSON merge patch (RFC 7386): objects merge key by key, `null` deletes, anything else replaces.
fn merge(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Default::default());
    }
    if let Value::Object(target) = target {
        for (key, value) in patch {
            if value.is_null() {
                target.remove(key);
            } else {
                merge(target.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
    }
}
