//! The ResourceSlices that publish this node's DRA devices: one pool named after the node, as many slices as
//! the devices need (at most [`DEVICES_PER_SLICE`] each), owned by the Node so that they go with it.
//!
//! The slices are kept as the inventory says: written when a device comes, goes or changes health (at once for
//! the first sixteen changes of a burst, then at most every 50 ms, each write carrying all that came meanwhile),
//! written
//! again when something else deletes them (the kubelet deletes every slice of its node when it starts, and a
//! driver's slices when its plugin has been gone 30 s), and the pool's generation is raised whenever the
//! devices change, so that the scheduler never mixes slices of two versions of the pool. An Unhealthy device
//! carries a `NoSchedule` taint, so that the scheduler stops giving it to new claims.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, PostParams};
use kube::runtime::{WatchStreamExt as _, watcher};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::view::{DraDevice, DraView};
use crate::devices::DeviceInfo;

/// Devices per slice: the API's limit for slices whose devices carry taints.
pub const DEVICES_PER_SLICE: usize = 64;
/// The wait after a failed write, doubling to [`MAX_RETRY`].
const FIRST_RETRY: Duration = Duration::from_secs(1);
const MAX_RETRY: Duration = Duration::from_secs(60);
/// How often slices are written: sixteen writes back to back (the first publication, then a fault on each
/// GPU of a node of up to fifteen, each in the slice at once), then one every 50 ms, each carrying every
/// change that came while it waited. A GPU that flaps costs the API server at most 20 writes a second.
const WRITES: crate::cluster::EventBudget = crate::cluster::EventBudget {
    burst: 16,
    refill: Duration::from_millis(50),
};
/// The longest string attribute value the API takes.
const MAX_STRING: usize = 64;

/// The `resource.k8s.io/v1` ResourceSlice resource.
pub fn slice_resource() -> ApiResource {
    ApiResource {
        group: "resource.k8s.io".into(),
        version: "v1".into(),
        api_version: "resource.k8s.io/v1".into(),
        kind: "ResourceSlice".into(),
        plural: "resourceslices".into(),
    }
}

/// What the slices are for.
#[derive(Debug, Clone)]
pub struct SliceConfig {
    /// Driver name.
    pub driver: String,
    /// The node (and pool) name.
    pub node: String,
}

impl SliceConfig {
    /// The name of slice `n` of the pool.
    pub fn slice_name(&self, n: usize) -> String {
        let mut name = format!("{}-{}-{n}", self.node, self.driver.replace('.', "-"));
        name.truncate(253);
        name
    }
}

/// A device's name, attributes and capacity as published: what stays as it is while the device is present.
/// Attributes and capacities are NVIDIA's DRA driver's (see `crate::devices::facts`), each left out where the
/// source does not know it; `index` (as `nvidia-smi` numbers the GPU) is ours.
fn described(name: &str, info: &DeviceInfo) -> Value {
    let facts = info.facts.as_deref().cloned().unwrap_or_default();
    let mut attributes = serde_json::Map::new();
    let mut put = |name: &str, value: Value| {
        attributes.insert(name.to_string(), value);
    };
    let string = |value: &str| json!({ "string": crate::util::text::cut_bytes(value, MAX_STRING) });
    match &info.mig {
        None => put("type", string("gpu")),
        Some(mig) => {
            put("type", string("mig"));
            put("parentUUID", string(&mig.parent));
            put("profile", string(&mig.profile));
        }
    }
    put("uuid", string(&info.id));
    let strings = [
        ("productName", &facts.product_name),
        ("brand", &facts.brand),
        ("architecture", &facts.architecture),
        ("resource.kubernetes.io/pciBusID", &facts.pci_bus_id),
        ("resource.kubernetes.io/pcieRoot", &facts.pcie_root),
    ];
    for (name, value) in strings {
        if let Some(value) = value {
            put(name, string(value));
        }
    }
    let capability = facts
        .cuda_compute_capability
        .map(|(major, minor)| format!("{major}.{minor}"));
    let versions = [
        ("cudaComputeCapability", capability.as_deref()),
        ("driverVersion", facts.driver_version.as_deref()),
        ("cudaDriverVersion", facts.cuda_driver_version.as_deref()),
    ];
    for (name, value) in versions {
        if let Some(version) = value.and_then(semver) {
            put(name, json!({ "version": version }));
        }
    }
    if let Some(numa) = info.numa_node.filter(|n| *n >= 0) {
        put("resource.kubernetes.io/numaNode", json!({ "int": numa }));
    }
    if let Some(index) = info.gpu_index() {
        put("index", json!({ "int": index }));
    }
    let mut capacity = serde_json::Map::new();
    if let Some(memory) = facts.memory_bytes {
        capacity.insert("memory".into(), json!({ "value": memory.to_string() }));
    }
    if let Some(placement) = &facts.mig {
        if let Some(c) = &placement.capacities {
            let engines = [
                ("multiprocessors", c.multiprocessors),
                ("copyEngines", c.copy_engines),
                ("decoders", c.decoders),
                ("encoders", c.encoders),
                ("jpegEngines", c.jpeg_engines),
                ("ofaEngines", c.ofa_engines),
            ];
            for (name, count) in engines {
                capacity.insert(name.into(), json!({ "value": count.to_string() }));
            }
        }
        for slice in placement.memory_slices() {
            capacity.insert(format!("memorySlice{slice}"), json!({ "value": "1" }));
        }
    }
    let mut published = json!({
        "name": name,
        "attributes": attributes,
    });
    if !capacity.is_empty() {
        published["capacity"] = Value::Object(capacity);
    }
    published
}

/// `published` (the device as [`described`]) with `device`'s taints (`None`-effect ones only where
/// `none_effect`: API servers before 1.35 refuse them).
fn with_taints(mut published: Value, device: &DraDevice, none_effect: bool) -> Value {
    let taints: Vec<Value> = device
        .taints
        .iter()
        .filter(|t| none_effect || t.effect != "None")
        .map(|t| {
            let mut taint = json!({"key": t.key, "effect": t.effect});
            if let Some(value) = &t.value {
                taint["value"] = json!(value);
            }
            taint
        })
        .collect();
    if !taints.is_empty() {
        published["taints"] = Value::Array(taints);
    }
    published
}

/// A dotted version as semantic versioning spells it, as NVIDIA's driver publishes it: missing parts are
/// zero and leading zeros go (`580.65.06` → `580.65.6`, `13.0` → `13.0.0`); `None` for anything else.
pub fn semver(version: &str) -> Option<String> {
    let parts: Vec<u64> = version
        .trim()
        .split('.')
        .map(|p| p.parse().ok())
        .collect::<Option<_>>()?;
    if parts.is_empty() || parts.len() > 3 {
        return None;
    }
    let part = |i: usize| parts.get(i).copied().unwrap_or(0);
    Some(format!("{}.{}.{}", part(0), part(1), part(2)))
}

/// Each device's [`described`] form, kept while the device stays as it is: a fault's slice write builds only
/// the taints, not every device's attributes again.
#[derive(Default)]
pub struct Described {
    by_name: HashMap<String, (DeviceInfo, Value)>,
}

impl Described {
    /// The devices of `view`, in slices; forgets the devices no longer in it.
    pub fn devices(&mut self, view: &[DraDevice], none_effect: bool) -> Vec<Vec<Value>> {
        let names: HashSet<&str> = view.iter().map(|d| d.name.as_str()).collect();
        self.by_name.retain(|name, _| names.contains(name.as_str()));
        let all: Vec<Value> = view
            .iter()
            .map(|d| {
                let base = match self.by_name.get(&d.name) {
                    Some((info, base)) if *info == d.info => base.clone(),
                    _ => {
                        let base = described(&d.name, &d.info);
                        self.by_name
                            .insert(d.name.clone(), (d.info.clone(), base.clone()));
                        base
                    }
                };
                with_taints(base, d, none_effect)
            })
            .collect();
        if all.is_empty() {
            return vec![Vec::new()];
        }
        all.chunks(DEVICES_PER_SLICE)
            .map(<[Value]>::to_vec)
            .collect()
    }
}

/// The slices' specs for `devices` at `generation`.
pub fn specs(config: &SliceConfig, devices: &[Vec<Value>], generation: i64) -> Vec<Value> {
    devices
        .iter()
        .map(|chunk| {
            json!({
                "driver": config.driver,
                "nodeName": config.node,
                "pool": {
                    "name": config.node,
                    "generation": generation,
                    "resourceSliceCount": devices.len(),
                },
                "devices": chunk,
            })
        })
        .collect()
}

/// Keeps the slices as `view` says until `shutdown`: written with `client`, watched with `watch_client`
/// (one without a read timeout: a watch waits minutes for news, and the server ends it in its own time).
pub async fn publish(
    (client, watch_client): (kube::Client, kube::Client),
    config: SliceConfig,
    mut view: watch::Receiver<DraView>,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    shutdown: CancellationToken,
) {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &slice_resource());
    let selector = format!(
        "spec.nodeName={},spec.driver={}",
        config.node, config.driver
    );
    // With a backoff: a watch that keeps failing (no RBAC, an API server without resource.k8s.io/v1) is
    // tried again after a growing wait, not at once in a loop.
    let watched: Api<DynamicObject> = Api::all_with(watch_client, &slice_resource());
    let mut events = watcher(watched, watcher::Config::default().fields(&selector))
        .default_backoff()
        .boxed();
    let mut said_watch_error: Option<String> = None;
    let mut owner: Option<Value> = None;
    let mut seen: BTreeMap<String, DynamicObject> = BTreeMap::new();
    let mut listed: Option<BTreeMap<String, DynamicObject>> = None;
    let mut published: Option<(Vec<Vec<Value>>, i64)> = None;
    let mut retry = FIRST_RETRY;
    let mut dirty = true;
    let mut said_taints_dropped = false;
    let mut said_no_owner = false;
    // Only reconciles that sent something take from it: one that found everything as wanted (the watch
    // telling of our own write) does not hold back the next change.
    let mut writes = crate::cluster::TokenBucket::new(WRITES, tokio::time::Instant::now());
    let mut ours: BTreeMap<String, Written> = BTreeMap::new();
    let mut described = Described::default();
    // Taints with effect None need a 1.35 API server; an older one refuses the slice, and they are left out.
    let mut none_effect = true;
    loop {
        let wait = if dirty && listed.is_some() {
            writes.ready_in(tokio::time::Instant::now())
        } else {
            Duration::MAX
        };
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = view.changed() => {
                if changed.is_err() {
                    return;
                }
                dirty = true;
                continue;
            }
            event = events.next() => {
                let Some(event) = event else { return };
                if let Some(event) = watch_news(event, &mut said_watch_error) {
                    forget_gone(&event, &mut ours, &seen);
                    follow(event, &mut seen, &mut listed);
                    dirty = true;
                }
                continue;
            }
            () = sleep_for(wait) => {}
        }
        let Some(current) = &listed else { continue };
        if owner.is_none() {
            owner = node_owner(&client, &config.node, &mut said_no_owner).await;
        }
        let devices = described.devices(&view.borrow_and_update(), none_effect);
        let started = tokio::time::Instant::now();
        let generation = match &published {
            Some((before, generation)) if *before == devices => *generation,
            Some((_, generation)) => generation + 1,
            None => first_generation(&config, current, &devices),
        };
        let written = write(
            &api,
            &config,
            owner.as_ref(),
            current,
            &mut ours,
            &devices,
            generation,
        )
        .await;
        if counted(&written, &metrics) > 0 {
            writes.take(started);
        }
        match written {
            Ok(Wrote { dropped, .. }) => {
                if dropped && !said_taints_dropped {
                    said_taints_dropped = true;
                    tracing::warn!(
                        "the API server dropped the device taints of the ResourceSlice (the DRADeviceTaints \
                         feature is off): the scheduler may give an Unhealthy GPU to a new claim, which \
                         prepare then refuses"
                    );
                }
                published = Some((devices, generation));
                retry = FIRST_RETRY;
                dirty = false;
            }
            Err(Failed::Refused(why)) if none_effect && why.contains("None") => {
                none_effect = false;
                tracing::warn!(
                    error = %why,
                    "the API server refuses device taints with effect None (it is older than 1.35): \
                     conditions that do not make a GPU Unhealthy are left out of the ResourceSlice"
                );
            }
            Err(Failed::Refused(why) | Failed::Other(why)) => {
                tracing::warn!(error = %why, retry_in = ?retry, "cannot write the ResourceSlices");
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(retry) => {}
                }
                retry = (retry * 2).min(MAX_RETRY);
            }
        }
    }
}

/// Why a write failed.
enum Failed {
    /// The API server found the slice invalid (422).
    Refused(String),
    /// Anything else.
    Other(String),
}

/// A failed watch in words an operator can act on.
async fn sleep_for(wait: Duration) {
    if wait == Duration::MAX {
        std::future::pending::<()>().await;
    }
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
}

/// A watch event to apply, or `None` for a failure of the watch (said once per kind of failure: the watch is
/// tried again with a backoff).
fn watch_news(
    event: Result<watcher::Event<DynamicObject>, watcher::Error>,
    said_watch_error: &mut Option<String>,
) -> Option<watcher::Event<DynamicObject>> {
    match event {
        Ok(event) => {
            // A watch that works again (a list begun is not yet one that worked).
            if !matches!(event, watcher::Event::Init) {
                *said_watch_error = None;
            }
            Some(event)
        }
        Err(e) => {
            let why = crate::cluster::explain_watch(
                &e,
                "list and watch on resourceslices (resource.k8s.io/v1, Kubernetes 1.34+)",
            );
            if said_watch_error.as_ref() != Some(&why) {
                tracing::warn!(error = %why, "cannot watch this node's ResourceSlices: they are not written until it can (retrying)");
                *said_watch_error = Some(why);
            }
            None
        }
    }
}

/// The calls a reconcile made, each create, update and delete counted in `metrics`, a failed one included; a
/// reconcile that sent nothing made none.
fn counted(written: &Result<Wrote, Failed>, metrics: &crate::metrics::Metrics) -> usize {
    match written {
        Ok(done) => {
            (0..done.calls).for_each(|_| metrics.api_call("resource_slice", true));
            done.calls
        }
        Err(_) => {
            metrics.api_call("resource_slice", false);
            1
        }
    }
}

/// Applies a watch event to what is known of our slices; `listed` is set once the first list is complete.
fn follow(
    event: watcher::Event<DynamicObject>,
    seen: &mut BTreeMap<String, DynamicObject>,
    listed: &mut Option<BTreeMap<String, DynamicObject>>,
) {
    let name = |o: &DynamicObject| o.metadata.name.clone().unwrap_or_default();
    match event {
        // A list begun again (after the watch failed): what is known stands until it is complete, or a write
        // meanwhile would take a slice not yet listed for one that is not there.
        watcher::Event::Init => {
            seen.clear();
            return;
        }
        watcher::Event::InitApply(o) => {
            seen.insert(name(&o), o);
            return;
        }
        watcher::Event::InitDone => {
            *listed = Some(seen.clone());
            return;
        }
        watcher::Event::Apply(o) => {
            seen.insert(name(&o), o);
        }
        watcher::Event::Delete(o) => {
            seen.remove(&name(&o));
        }
    }
    if listed.is_some() {
        *listed = Some(seen.clone());
    }
}

/// Forgets this plugin's writes of the slices `event` says are gone (deleted, or missing from a list just
/// completed), so that they are made again; `seen` is the list being made, before `event` is applied. A slice
/// this plugin wrote and the watch has not yet told of stays known: it is there, whatever the watch says yet.
fn forget_gone(
    event: &watcher::Event<DynamicObject>,
    ours: &mut BTreeMap<String, Written>,
    seen: &BTreeMap<String, DynamicObject>,
) {
    match event {
        watcher::Event::Delete(o) => {
            if let Some(name) = &o.metadata.name {
                ours.remove(name);
            }
        }
        watcher::Event::InitDone => ours.retain(|name, _| seen.contains_key(name)),
        _ => {}
    }
}

/// The generation to start from: the slices already there are kept if they hold these devices, else one
/// past the newest.
fn first_generation(
    config: &SliceConfig,
    current: &BTreeMap<String, DynamicObject>,
    devices: &[Vec<Value>],
) -> i64 {
    let newest = current
        .values()
        .filter_map(|o| o.data["spec"]["pool"]["generation"].as_i64())
        .max();
    // Slice by slice, by name: the map's order is the names' (`…-10` before `…-2`), not the slices'.
    let same = current.len() == devices.len()
        && devices.iter().enumerate().all(|(n, d)| {
            current
                .get(&config.slice_name(n))
                .is_some_and(|o| o.data["spec"]["devices"].as_array() == Some(d))
        });
    match newest {
        Some(g) if same => g,
        Some(g) => g + 1,
        None => 1,
    }
}

/// The Node as the slices' owner, so that they are deleted with it; `None` (and a warning) if it cannot
/// be read: the slices are written without.
/// Said once (`said`), tried again at each write.
async fn node_owner(client: &kube::Client, node: &str, said: &mut bool) -> Option<Value> {
    let nodes: Api<Node> = Api::all(client.clone());
    match nodes.get(node).await {
        Ok(n) => n.metadata.uid.map(|uid| {
            json!({"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid, "controller": true})
        }),
        Err(e) => {
            if !std::mem::replace(said, true) {
                tracing::warn!(error = %crate::cluster::explain(&e, "get on nodes"), "cannot read the Node: the ResourceSlices are written without an owner until it can be read");
            }
            None
        }
    }
}

/// Makes the slices on the API server these; whether the API server dropped taints it was sent.
async fn write(
    api: &Api<DynamicObject>,
    config: &SliceConfig,
    owner: Option<&Value>,
    current: &BTreeMap<String, DynamicObject>,
    written: &mut BTreeMap<String, Written>,
    devices: &[Vec<Value>],
    generation: i64,
) -> Result<Wrote, Failed> {
    let mut dropped = false;
    let mut calls = 0;
    let specs = specs(config, devices, generation);
    let names: Vec<String> = (0..specs.len()).map(|n| config.slice_name(n)).collect();
    for (name, spec) in names.iter().zip(specs) {
        let existing = current.get(name);
        let ours = written.get(name);
        // Unchanged: as we wrote it (the API server may have added defaults), or as we want it; or written
        // by us as we want it and not yet told of by the watch.
        let unchanged = existing.map_or_else(
            || ours.is_some_and(|w| w.spec == spec),
            |o| {
                let owned = owner.is_none()
                    || o.metadata
                        .owner_references
                        .as_ref()
                        .is_some_and(|r| !r.is_empty());
                owned
                    && (o.data["spec"] == spec
                        || ours.is_some_and(|w| {
                            w.spec == spec
                                && o.metadata
                                    .resource_version
                                    .as_ref()
                                    .is_some_and(|v| w.wrote(v))
                        }))
            },
        );
        if unchanged {
            continue;
        }
        // Built as the object it is: no round trip of the whole slice through JSON values.
        let mut object = DynamicObject::new(name, &slice_resource());
        if let Some(owner) = owner {
            let owner =
                serde_json::from_value(owner.clone()).map_err(|e| Failed::Other(e.to_string()))?;
            object.metadata.owner_references = Some(vec![owner]);
        }
        object.data = Value::Object(serde_json::Map::from_iter([("spec".into(), spec.clone())]));
        let sent_taints = has_taints(&object.data);
        calls += 1;
        // Our own last write's version where the watch has not caught up with it yet.
        let version = ours
            .map(|w| w.version.clone())
            .or_else(|| existing.and_then(|b| b.metadata.resource_version.clone()));
        let result = upsert(api, name, object, version).await;
        let done = match result {
            Ok(done) => done,
            Err(e) => {
                // Whatever we knew of it is stale now: the next try starts from what the watch says.
                written.remove(name);
                return Err(match &e {
                    kube::Error::Api(status) if status.code == 422 => {
                        Failed::Refused(status.message.clone())
                    }
                    _ => Failed::Other(crate::cluster::explain(
                        &e,
                        "create and update on resourceslices",
                    )),
                });
            }
        };
        dropped |= sent_taints && !has_taints(&done.data);
        if let Some(version) = done.metadata.resource_version {
            let mut earlier = written
                .remove(name)
                .map(|w| {
                    let mut earlier = w.earlier;
                    earlier.push_back(w.version);
                    earlier
                })
                .unwrap_or_default();
            if earlier.len() > EARLIER_VERSIONS {
                earlier.pop_front();
            }
            written.insert(
                name.clone(),
                Written {
                    version,
                    earlier,
                    // What was sent, which the next wanted spec is compared with, whatever defaults the API
                    // server added to it.
                    spec: spec.clone(),
                },
            );
        }
    }
    for name in current.keys().filter(|n| !names.contains(n)) {
        calls += 1;
        match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => {
                return Err(Failed::Other(crate::cluster::explain(
                    &e,
                    "delete on resourceslices",
                )));
            }
        }
    }
    Ok(Wrote { calls, dropped })
}

/// Replaces the slice `name` at `version` with `object`, or makes it when there is no version to replace.
/// Made again when it is gone (a 404 on the replace); written over what is there when someone else wrote it
/// since (a 409 on the replace) or when it exists after all (a 409 on the create: made by this plugin before
/// the watch told of it, or by another instance).
async fn upsert(
    api: &Api<DynamicObject>,
    name: &str,
    mut object: DynamicObject,
    version: Option<String>,
) -> kube::Result<DynamicObject> {
    let params = PostParams::default();
    if version.is_some() {
        object.metadata.resource_version = version;
        match api.replace(name, &params, &object).await {
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            // Someone else wrote it since (or the watch is behind): over what is there now, at once, rather
            // than again at a version the watch has not caught up with, after a backoff.
            Err(kube::Error::Api(s)) if s.code == 409 => {
                object.metadata.resource_version = api.get(name).await?.metadata.resource_version;
                return api.replace(name, &params, &object).await;
            }
            done => return done,
        }
        object.metadata.resource_version = None;
    }
    match api.create(&params, &object).await {
        Err(kube::Error::Api(s)) if s.code == 409 && s.reason == "AlreadyExists" => {
            object.metadata.resource_version = api.get(name).await?.metadata.resource_version;
            api.replace(name, &params, &object).await
        }
        done => done,
    }
}

/// What a reconcile did.
struct Wrote {
    /// Creates, updates and deletes sent (0: everything was as wanted).
    calls: usize,
    /// The API server dropped the taints of a slice we sent with taints.
    dropped: bool,
}

/// A slice as this plugin last wrote it: the version the API server gave the write, and the spec sent.
struct Written {
    version: String,
    /// The versions of this plugin's writes before it, the oldest first (at most [`EARLIER_VERSIONS`]): a
    /// watch that tells of one of them is behind this plugin's own writes, not telling of someone else's.
    earlier: std::collections::VecDeque<String>,
    spec: Value,
}

impl Written {
    /// Whether `version` is one this plugin wrote: the last write or one of the ones before.
    fn wrote(&self, version: &str) -> bool {
        self.version == version || self.earlier.iter().any(|v| v == version)
    }
}

/// Versions kept of a slice's earlier writes: more than a burst of writes can run ahead of the watch.
const EARLIER_VERSIONS: usize = 32;

fn has_taints(data: &Value) -> bool {
    data["spec"]["devices"].as_array().is_some_and(|d| {
        d.iter()
            .any(|d| d["taints"].as_array().is_some_and(|t| !t.is_empty()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{DeviceInfo, Health, Inventory};
    use crate::dra::view::{Taint, build};

    /// One device as published, described anew.
    fn device(device: &DraDevice, none_effect: bool) -> Value {
        with_taints(described(&device.name, &device.info), device, none_effect)
    }

    /// The devices of `view`, in slices, described anew.
    fn devices(view: &[DraDevice], none_effect: bool) -> Vec<Vec<Value>> {
        Described::default().devices(view, none_effect)
    }

    fn inventory(n: usize) -> Inventory {
        crate::dra::fixtures::gpus(n)
    }

    fn view(inv: &Inventory) -> Vec<DraDevice> {
        build(inv, None, "gpu.nvidia.com")
    }

    fn config() -> SliceConfig {
        SliceConfig {
            driver: "gpu.nvidia.com".into(),
            node: "node-a".into(),
        }
    }

    #[test]
    fn a_gpu_is_published_with_nvidias_name_and_attributes_and_a_taint_while_unhealthy() {
        let mut inv = inventory(2);
        inv.set_health("GPU-1", Health::Unhealthy, Some("XID 79".into()));
        let slices = devices(&view(&inv), true);
        assert_eq!(slices.len(), 1);
        let gpu0 = &slices[0][0];
        assert_eq!(gpu0["name"], "gpu-0");
        assert_eq!(gpu0["attributes"]["type"]["string"], "gpu");
        assert_eq!(gpu0["attributes"]["uuid"]["string"], "GPU-0");
        assert_eq!(
            gpu0["attributes"]["resource.kubernetes.io/numaNode"]["int"],
            0
        );
        assert!(gpu0.get("taints").is_none());
        assert_eq!(
            slices[0][1]["taints"],
            json!([{"key": "gpu.nvidia.com/unhealthy", "effect": "NoSchedule"}])
        );
    }

    #[test]
    fn a_gpus_facts_are_published_as_nvidias_attributes_and_capacity() {
        let mut inv = Inventory::default();
        inv.add(DeviceInfo {
            id: "GPU-0".into(),
            index: Some("0".into()),
            numa_node: Some(1),
            facts: Some(std::sync::Arc::new(crate::devices::facts::DeviceFacts {
                minor: Some(2),
                product_name: Some("NVIDIA H100 80GB HBM3".into()),
                brand: Some("Nvidia".into()),
                architecture: Some("Hopper".into()),
                cuda_compute_capability: Some((9, 0)),
                memory_bytes: Some(85_520_809_984),
                pci_bus_id: Some("0000:17:00.0".into()),
                pcie_root: Some("pci0000:16".into()),
                driver_version: Some("580.65.06".into()),
                cuda_driver_version: Some("13.0".into()),
                mig: None,
            })),
            ..DeviceInfo::default()
        });
        let published = &devices(&view(&inv), true)[0][0];
        assert_eq!(published["name"], "gpu-2");
        let attributes = &published["attributes"];
        assert_eq!(attributes["productName"]["string"], "NVIDIA H100 80GB HBM3");
        assert_eq!(attributes["brand"]["string"], "Nvidia");
        assert_eq!(attributes["architecture"]["string"], "Hopper");
        assert_eq!(attributes["cudaComputeCapability"]["version"], "9.0.0");
        assert_eq!(attributes["driverVersion"]["version"], "580.65.6");
        assert_eq!(attributes["cudaDriverVersion"]["version"], "13.0.0");
        assert_eq!(
            attributes["resource.kubernetes.io/pciBusID"]["string"],
            "0000:17:00.0"
        );
        assert_eq!(
            attributes["resource.kubernetes.io/pcieRoot"]["string"],
            "pci0000:16"
        );
        assert_eq!(attributes["resource.kubernetes.io/numaNode"]["int"], 1);
        assert_eq!(published["capacity"]["memory"]["value"], "85520809984");
        assert!(attributes.as_object().expect("map").len() <= 32);
    }

    #[test]
    fn devices_described_once_are_published_as_if_described_anew() {
        let mut inv = inventory(3);
        let mut described = Described::default();
        assert_eq!(
            described.devices(&view(&inv), true),
            devices(&view(&inv), true)
        );
        // A fault: only the taints change.
        inv.set_health("GPU-1", Health::Unhealthy, Some("XID 79".into()));
        let after_fault = described.devices(&view(&inv), true);
        assert_eq!(after_fault, devices(&view(&inv), true));
        assert!(after_fault[0][1].get("taints").is_some());
        // A device whose facts change (a restart's new driver) is described again, one gone is forgotten.
        let mut changed = view(&inv);
        changed[0].info.numa_node = Some(1);
        changed.remove(2);
        let published = described.devices(&changed, true);
        assert_eq!(published, devices(&changed, true));
        assert_eq!(
            published[0][0]["attributes"]["resource.kubernetes.io/numaNode"],
            json!({"int": 1})
        );
        assert_eq!(described.by_name.len(), 2);
    }

    #[test]
    fn versions_are_spelled_as_semver_or_left_out() {
        assert_eq!(semver("580.65.06").as_deref(), Some("580.65.6"));
        assert_eq!(semver("13.0").as_deref(), Some("13.0.0"));
        assert_eq!(semver("9").as_deref(), Some("9.0.0"));
        assert_eq!(semver("580.65.06.1"), None);
        assert_eq!(semver("r580"), None);
    }

    #[test]
    fn none_effect_taints_carry_their_value_and_are_left_out_for_an_older_api_server() {
        let mut devices_view = view(&inventory(1));
        devices_view[0].taints = vec![Taint {
            key: "gpu.nvidia.com/xid".into(),
            value: Some("13".into()),
            effect: "None",
        }];
        assert_eq!(
            device(&devices_view[0], true)["taints"],
            json!([{"key": "gpu.nvidia.com/xid", "value": "13", "effect": "None"}])
        );
        assert!(device(&devices_view[0], false).get("taints").is_none());
    }

    #[test]
    fn many_devices_take_several_slices_of_one_pool_that_count_each_other() {
        let slices = devices(&view(&inventory(130)), true);
        assert_eq!(
            slices.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![64, 64, 2]
        );
        let specs = specs(&config(), &slices, 4);
        assert_eq!(specs.len(), 3);
        for spec in &specs {
            assert_eq!(
                spec["pool"],
                json!({"name": "node-a", "generation": 4, "resourceSliceCount": 3})
            );
            assert_eq!(spec["nodeName"], "node-a");
            assert_eq!(spec["driver"], "gpu.nvidia.com");
        }
        assert_eq!(config().slice_name(2), "node-a-gpu-nvidia-com-2");
    }

    #[test]
    fn a_restart_keeps_the_generation_of_slices_that_hold_the_same_devices() {
        let slices = devices(&view(&inventory(2)), true);
        let spec = specs(&config(), &slices, 7).remove(0);
        let object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": "node-a-gpu-nvidia-com-0"}, "spec": spec,
        }))
        .expect("object");
        let current = BTreeMap::from([("node-a-gpu-nvidia-com-0".to_string(), object)]);
        assert_eq!(first_generation(&config(), &current, &slices), 7);
        let changed = devices(&view(&inventory(3)), true);
        assert_eq!(first_generation(&config(), &current, &changed), 8);
        assert_eq!(first_generation(&config(), &BTreeMap::new(), &changed), 1);

        // Eleven slices: their names sort `…-10` before `…-2`, the devices do not.
        let many = devices(&view(&inventory(11 * DEVICES_PER_SLICE)), true);
        let current: BTreeMap<String, DynamicObject> = specs(&config(), &many, 3)
            .into_iter()
            .enumerate()
            .map(|(n, spec)| {
                let name = config().slice_name(n);
                let object = serde_json::from_value(json!({
                    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                    "metadata": {"name": name}, "spec": spec,
                }))
                .expect("object");
                (name, object)
            })
            .collect();
        assert_eq!(first_generation(&config(), &current, &many), 3);
    }
}
