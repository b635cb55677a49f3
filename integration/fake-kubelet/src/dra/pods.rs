//! Pods and their ResourceClaims as the kubelet's DRA manager handles them: prepare and unprepare calls, the
//! claims it holds prepared (its checkpoint), the CDI devices a container gets, and the health the pod
//! status shows.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use gpu_device_plugin::api::dra::{v1, v1beta1};
use serde_json::{Value, json};

use super::health::HealthCache;
use super::{DraCall, DraError, DraService, Shared};

/// A pod as the fake kubelet needs to know it: its identity and its claims.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    /// Namespace (its claims' too).
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
    /// Its entries of `spec.resourceClaims`, with the containers that use each.
    pub claims: Vec<PodClaim>,
}

impl Pod {
    /// Pod `namespace/name` with no claims yet, with the UID [`FakeApiServer::add_pod`] gives it.
    ///
    /// [`FakeApiServer::add_pod`]: crate::apiserver::FakeApiServer::add_pod
    pub fn new(namespace: &str, name: &str) -> Self {
        Pod {
            namespace: namespace.into(),
            name: name.into(),
            uid: format!("uid-pod-{namespace}-{name}"),
            claims: Vec::new(),
        }
    }

    /// Adds a claim.
    pub fn claim(mut self, claim: PodClaim) -> Self {
        self.claims.push(claim);
        self
    }
}

/// One entry of a pod's `spec.resourceClaims`: the ResourceClaim it stands for and who uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodClaim {
    /// The name in the pod spec, which containers' `resources.claims` refer to (and the pod status shows).
    pub name: String,
    /// The ResourceClaim object's name (the same as `name` unless made from a template).
    pub resource_claim: String,
    /// The ResourceClaim's UID.
    pub uid: String,
    /// The drivers of its allocation; empty to read them from the linked API server's claim.
    pub drivers: Vec<String>,
    /// The containers that use it, with the request each names.
    pub uses: Vec<ClaimUse>,
}

impl PodClaim {
    /// The pod's claim `name`, for ResourceClaim `name` with UID `uid`.
    pub fn new(name: &str, uid: &str) -> Self {
        PodClaim {
            name: name.into(),
            resource_claim: name.into(),
            uid: uid.into(),
            drivers: Vec::new(),
            uses: Vec::new(),
        }
    }

    /// The ResourceClaim object's name, when it differs from the pod's name for it.
    pub fn resource_claim(mut self, name: &str) -> Self {
        self.resource_claim = name.into();
        self
    }

    /// Adds a driver of the claim's allocation.
    pub fn driver(mut self, driver: &str) -> Self {
        self.drivers.push(driver.into());
        self
    }

    /// Container `container` uses request `request` of the claim (empty: the whole claim).
    pub fn used_by(mut self, container: &str, request: &str) -> Self {
        self.uses.push(ClaimUse {
            container: container.into(),
            request: request.into(),
        });
        self
    }
}

/// One entry of a container's `resources.claims`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimUse {
    /// The container.
    pub container: String,
    /// The request it names; empty for the whole claim.
    pub request: String,
}

/// A claim to unprepare, with the driver to ask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRef {
    /// Namespace.
    pub namespace: String,
    /// ResourceClaim name.
    pub name: String,
    /// ResourceClaim UID.
    pub uid: String,
    /// The driver.
    pub driver: String,
}

/// A claim a plugin failed (an `error` in its answer, or no entry for the claim).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimError {
    /// `NodePrepareResources` or `NodeUnprepareResources`.
    pub method: &'static str,
    /// Namespace.
    pub namespace: String,
    /// ResourceClaim name.
    pub name: String,
    /// ResourceClaim UID.
    pub uid: String,
    /// The driver.
    pub driver: String,
    /// The plugin's error, or what was wrong with its answer.
    pub message: String,
}

impl std::fmt::Display for ClaimError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} failed for ResourceClaim {}/{} (UID {}) of DRA driver {}: {}",
            self.method, self.namespace, self.name, self.uid, self.driver, self.message
        )
    }
}

/// A device a plugin prepared for a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedDevice {
    /// Its pool.
    pub pool: String,
    /// Its name in the pool.
    pub device: String,
    /// The claim's requests it serves (empty: all of them).
    pub request_names: Vec<String>,
    /// The CDI devices the runtime gets for it.
    pub cdi_device_ids: Vec<String>,
}

/// What the kubelet keeps of a claim (its checkpoint).
#[derive(Debug, Clone)]
pub(crate) struct ClaimInfo {
    namespace: String,
    name: String,
    uid: String,
    /// The devices by driver.
    pub(crate) devices: BTreeMap<String, Vec<PreparedDevice>>,
    /// Every driver answered for it.
    pub(crate) prepared: bool,
    /// The pods that use it.
    pods: BTreeSet<String>,
}

const PREPARE: &str = "NodePrepareResources";
const UNPREPARE: &str = "NodeUnprepareResources";

/// Prepares `pod`'s claims that are not prepared yet: one call per driver with every such claim of that
/// driver. Nothing is kept unless every call succeeds.
pub(crate) async fn prepare(shared: &Arc<Shared>, pod: &Pod) -> Result<(), DraError> {
    let mut batches: BTreeMap<String, Vec<&PodClaim>> = BTreeMap::new();
    let mut needed = Vec::new();
    for claim in &pod.claims {
        let drivers = claim_drivers(shared, pod, claim)?;
        let prepared = shared
            .claims
            .borrow()
            .get(&claim.uid)
            .is_some_and(|c| c.prepared);
        if prepared {
            continue;
        }
        for driver in &drivers {
            batches.entry(driver.clone()).or_default().push(claim);
        }
        needed.push(claim);
    }
    let mut results: BTreeMap<String, BTreeMap<String, Vec<PreparedDevice>>> = BTreeMap::new();
    for (driver, claims) in &batches {
        let refs: Vec<ClaimRef> = claims
            .iter()
            .map(|c| ClaimRef {
                namespace: pod.namespace.clone(),
                name: c.resource_claim.clone(),
                uid: c.uid.clone(),
                driver: driver.clone(),
            })
            .collect();
        for (uid, devices) in call_prepare(shared, driver, &refs).await? {
            results
                .entry(uid)
                .or_default()
                .insert(driver.clone(), devices);
        }
    }
    shared.claims.send_modify(|table| {
        for claim in &needed {
            let info = table.entry(claim.uid.clone()).or_insert_with(|| ClaimInfo {
                namespace: pod.namespace.clone(),
                name: claim.resource_claim.clone(),
                uid: claim.uid.clone(),
                devices: BTreeMap::new(),
                prepared: false,
                pods: BTreeSet::new(),
            });
            info.devices = results.remove(&claim.uid).unwrap_or_default();
            info.prepared = true;
        }
        for claim in &pod.claims {
            if let Some(info) = table.get_mut(&claim.uid) {
                info.pods.insert(pod.uid.clone());
            }
        }
    });
    Ok(())
}

/// The drivers `claim` is allocated from: as the test gave them, else from the linked API server's claim
/// (which must be there, be the same claim by UID, and be allocated, as the kubelet checks).
fn claim_drivers(shared: &Shared, pod: &Pod, claim: &PodClaim) -> Result<Vec<String>, DraError> {
    if !claim.drivers.is_empty() {
        return Ok(claim.drivers.clone());
    }
    let lookup = |message: String| DraError::ClaimLookup {
        claim: format!("{}/{}", pod.namespace, claim.resource_claim),
        message,
    };
    let Some((api, _)) = &shared.options.api else {
        return Err(lookup(
            "no driver given, and no API server linked to read it from".into(),
        ));
    };
    let object = api
        .claim(&pod.namespace, &claim.resource_claim)
        .ok_or_else(|| lookup("not found".into()))?;
    let uid = object["metadata"]["uid"].as_str().unwrap_or("");
    if uid != claim.uid {
        return Err(lookup(format!(
            "its UID is {uid}, the pod's claim is {} (it was deleted and made again)",
            claim.uid
        )));
    }
    let results = object["status"]["allocation"]["devices"]["results"]
        .as_array()
        .ok_or_else(|| lookup("not allocated".into()))?;
    let drivers: BTreeSet<String> = results
        .iter()
        .filter_map(|r| r["driver"].as_str())
        .filter(|d| !d.is_empty())
        .map(str::to_string)
        .collect();
    Ok(drivers.into_iter().collect())
}

/// The plugin the kubelet would call for `driver`.
fn pick(
    shared: &Shared,
    driver: &str,
) -> Result<(DraService, tonic::transport::Channel), DraError> {
    shared
        .plugins
        .lock()
        .ok()
        .and_then(|store| store.pick(driver))
        .ok_or_else(|| DraError::NotRegistered(driver.into()))
}

/// Claims in the wire's shape, for either version.
macro_rules! wire_claims {
    ($api:ident, $claims:expr) => {
        $claims
            .iter()
            .map(|c| $api::Claim {
                namespace: c.namespace.clone(),
                uid: c.uid.clone(),
                name: c.name.clone(),
            })
            .collect()
    };
}

/// A call's answer within `timeout`, or why there is none, in the words the kubelet's error carries.
async fn within<T>(
    timeout: std::time::Duration,
    call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, String> {
    match tokio::time::timeout(timeout, call).await {
        Err(_) => Err(format!("timed out after {timeout:?}")),
        Ok(Err(status)) => Err(status.to_string()),
        Ok(Ok(answer)) => Ok(answer.into_inner()),
    }
}

/// One `NodePrepareResources` to `driver` for `claims`: the devices of each claim, checked as the kubelet
/// checks the answer.
async fn call_prepare(
    shared: &Shared,
    driver: &str,
    claims: &[ClaimRef],
) -> Result<BTreeMap<String, Vec<PreparedDevice>>, DraError> {
    let (service, channel) = pick(shared, driver)?;
    let timeout = shared.options.call_timeout;
    macro_rules! call {
        ($api:ident) => {{
            let mut client = $api::dra_plugin_client::DraPluginClient::new(channel);
            // The deadline goes with the call (`grpc-timeout`), as grpc-go sends the kubelet's context's.
            let mut request = tonic::Request::new($api::NodePrepareResourcesRequest {
                claims: wire_claims!($api, claims),
            });
            request.set_timeout(timeout);
            within(timeout, client.node_prepare_resources(request))
                .await
                .map(|answer| {
                    answer
                        .claims
                        .into_iter()
                        .map(|(uid, claim)| {
                            let devices = claim
                                .devices
                                .into_iter()
                                .map(|d| PreparedDevice {
                                    pool: d.pool_name,
                                    device: d.device_name,
                                    request_names: d.request_names,
                                    cdi_device_ids: d.cdi_device_ids,
                                })
                                .collect::<Vec<_>>();
                            (uid, (devices, claim.error))
                        })
                        .collect::<BTreeMap<_, _>>()
                })
        }};
    }
    let answer = match service {
        DraService::V1 => call!(v1),
        DraService::V1beta1 => call!(v1beta1),
    };
    record(shared, PREPARE, driver, service, claims, &answer);
    let mut answer = answer.map_err(|message| DraError::Call {
        method: PREPARE,
        driver: driver.into(),
        message,
    })?;
    if let Some(stranger) = answer
        .keys()
        .find(|uid| !claims.iter().any(|c| &c.uid == *uid))
    {
        return Err(DraError::Call {
            method: PREPARE,
            driver: driver.into(),
            message: format!("the answer is for a claim UID that was not asked for: {stranger}"),
        });
    }
    let mut prepared = BTreeMap::new();
    for claim in claims {
        let failed = |message: String| {
            DraError::Claim(Box::new(ClaimError {
                method: PREPARE,
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                uid: claim.uid.clone(),
                driver: driver.into(),
                message,
            }))
        };
        match answer.remove(&claim.uid) {
            None => return Err(failed("the answer has no entry for it".into())),
            Some((_, error)) if !error.is_empty() => return Err(failed(error)),
            Some((devices, _)) => {
                prepared.insert(claim.uid.clone(), devices);
            }
        }
    }
    Ok(prepared)
}

/// One `NodeUnprepareResources` to `driver` for `claims`: the claims it failed. Those it unprepared are
/// forgotten.
async fn call_unprepare(
    shared: &Shared,
    driver: &str,
    claims: &[ClaimRef],
) -> Result<Vec<ClaimError>, DraError> {
    let (service, channel) = pick(shared, driver)?;
    let timeout = shared.options.call_timeout;
    macro_rules! call {
        ($api:ident) => {{
            let mut client = $api::dra_plugin_client::DraPluginClient::new(channel);
            // The deadline goes with the call (`grpc-timeout`), as grpc-go sends the kubelet's context's.
            let mut request = tonic::Request::new($api::NodeUnprepareResourcesRequest {
                claims: wire_claims!($api, claims),
            });
            request.set_timeout(timeout);
            within(timeout, client.node_unprepare_resources(request))
                .await
                .map(|answer| {
                    answer
                        .claims
                        .into_iter()
                        .map(|(uid, claim)| (uid, claim.error))
                        .collect::<BTreeMap<_, _>>()
                })
        }};
    }
    let answer = match service {
        DraService::V1 => call!(v1),
        DraService::V1beta1 => call!(v1beta1),
    };
    record(shared, UNPREPARE, driver, service, claims, &answer);
    let answer = answer.map_err(|message| DraError::Call {
        method: UNPREPARE,
        driver: driver.into(),
        message,
    })?;
    let mut errors = Vec::new();
    let mut done = Vec::new();
    for claim in claims {
        let message = match answer.get(&claim.uid) {
            None => "the answer has no entry for it".to_string(),
            Some(error) if !error.is_empty() => error.clone(),
            Some(_) => {
                done.push(claim.uid.clone());
                continue;
            }
        };
        errors.push(ClaimError {
            method: UNPREPARE,
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            uid: claim.uid.clone(),
            driver: driver.into(),
            message,
        });
    }
    shared.claims.send_modify(|table| {
        for uid in &done {
            if let Some(info) = table.get_mut(uid) {
                info.devices.remove(driver);
                if info.devices.is_empty() {
                    table.remove(uid);
                }
            }
        }
    });
    Ok(errors)
}

fn record<T>(
    shared: &Shared,
    method: &'static str,
    driver: &str,
    service: DraService,
    claims: &[ClaimRef],
    answer: &Result<T, String>,
) {
    shared.calls.send_modify(|calls| {
        calls.push(DraCall {
            method,
            driver: driver.into(),
            service,
            claims: claims.iter().map(|c| c.uid.clone()).collect(),
            result: answer.as_ref().map(|_| ()).map_err(Clone::clone),
        })
    });
}

/// Ends `pod`: its claims no other pod uses are unprepared, one call per driver.
pub(crate) async fn end(shared: &Arc<Shared>, pod: &Pod) -> Result<Vec<ClaimError>, DraError> {
    let mut unused = Vec::new();
    shared.claims.send_modify(|table| {
        for claim in &pod.claims {
            if let Some(info) = table.get_mut(&claim.uid) {
                info.pods.remove(&pod.uid);
                if info.pods.is_empty() {
                    unused.extend(info.devices.keys().map(|driver| ClaimRef {
                        namespace: info.namespace.clone(),
                        name: info.name.clone(),
                        uid: info.uid.clone(),
                        driver: driver.clone(),
                    }));
                }
            }
        }
    });
    unprepare(shared, unused).await
}

/// Unprepares `claims`, one call per driver.
pub(crate) async fn unprepare(
    shared: &Arc<Shared>,
    claims: Vec<ClaimRef>,
) -> Result<Vec<ClaimError>, DraError> {
    let mut batches: BTreeMap<String, Vec<ClaimRef>> = BTreeMap::new();
    for claim in claims {
        batches.entry(claim.driver.clone()).or_default().push(claim);
    }
    let mut errors = Vec::new();
    for (driver, claims) in &batches {
        errors.extend(call_unprepare(shared, driver, claims).await?);
    }
    Ok(errors)
}

/// The CDI devices of `container`: for each claim it uses, the prepared devices that serve its request
/// (every device for the whole claim; a device that names no request serves them all), as the kubelet's
/// `cdiDevicesAsList` picks them.
pub(crate) fn cdi_devices(
    table: &BTreeMap<String, ClaimInfo>,
    pod: &Pod,
    container: &str,
) -> Vec<String> {
    let mut ids = Vec::new();
    for claim in &pod.claims {
        let Some(info) = table.get(&claim.uid).filter(|i| i.prepared) else {
            continue;
        };
        for used in claim.uses.iter().filter(|u| u.container == container) {
            for device in info.devices.values().flatten() {
                if used.request.is_empty()
                    || device.request_names.is_empty()
                    || device.request_names.contains(&used.request)
                {
                    ids.extend(device.cdi_device_ids.iter().cloned());
                }
            }
        }
    }
    ids
}

/// `status.containerStatuses` of `pod` as far as the kubelet's DRA manager writes it
/// (`UpdateAllocatedResourcesStatus`): per container, per claim reference, every device of the claim with
/// its health now. A claim not prepared has no entry, nor has one with no devices.
pub(crate) fn resources_status(
    table: &BTreeMap<String, ClaimInfo>,
    health: &HealthCache,
    pod: &Pod,
    now: std::time::Instant,
) -> Value {
    let mut containers: Vec<String> = Vec::new();
    for used in pod.claims.iter().flat_map(|c| &c.uses) {
        if !containers.contains(&used.container) {
            containers.push(used.container.clone());
        }
    }
    let statuses: Vec<Value> = containers
        .iter()
        .map(|container| {
            let mut entries: Vec<Value> = Vec::new();
            for claim in &pod.claims {
                let Some(info) = table.get(&claim.uid) else {
                    continue;
                };
                for used in claim.uses.iter().filter(|u| &u.container == container) {
                    let name = if used.request.is_empty() {
                        format!("claim:{}", claim.name)
                    } else {
                        format!("claim:{}/{}", claim.name, used.request)
                    };
                    let resources: Vec<Value> =
                        info.devices
                            .iter()
                            .flat_map(|(driver, devices)| devices.iter().map(move |d| (driver, d)))
                            .map(|(driver, d)| {
                                let read = health.get(driver, &d.pool, &d.device, now);
                                let id =
                                    d.cdi_device_ids.first().cloned().unwrap_or_else(|| {
                                        format!("{driver}/{}/{}", d.pool, d.device)
                                    });
                                let mut resource =
                                    json!({"resourceID": id, "health": read.health.as_str()});
                                if !read.message.is_empty() {
                                    resource["message"] = Value::String(read.message);
                                }
                                resource
                            })
                            .collect();
                    if resources.is_empty() || entries.iter().any(|e| e["name"] == name) {
                        continue;
                    }
                    entries.push(json!({"name": name, "resources": resources}));
                }
            }
            let mut status = json!({"name": container});
            if !entries.is_empty() {
                status["allocatedResourcesStatus"] = Value::Array(entries);
            }
            status
        })
        .collect();
    Value::Array(statuses)
}
