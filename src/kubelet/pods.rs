//! Which pods and containers hold which of our devices, from the kubelet's pod-resources API v1
//! (`PodResourcesLister.List`). Asked on every health transition (for the pod Events) and, at most every few
//! seconds, for `/status`. The kubelet rate-limits this API (about 100 calls a second), so answers are
//! shared through a short-lived cache and a failure is logged once, not on every call.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::api::pod_resources::ListPodResourcesRequest;
use crate::api::pod_resources::pod_resources_lister_client::PodResourcesListerClient;
use crate::devices::InventoryWatch;
use crate::devices::naming::Naming;
use crate::util::uds;

/// How long one `List` may take, connection included.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// One container holding a device.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Holder {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The container's name.
    pub container: String,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} ({})", self.namespace, self.pod, self.container)
    }
}

/// Device ID → the containers holding it, each once, sorted.
pub type Holders = BTreeMap<String, Vec<Holder>>;

/// Why the kubelet could not say.
#[derive(Debug, thiserror::Error)]
pub enum PodsError {
    /// Nothing answers on the socket.
    #[error("cannot reach the kubelet's pod-resources API at {}: {source}", .path.display())]
    Connect {
        /// The socket.
        path: PathBuf,
        /// What the connection said.
        source: tonic::transport::Error,
    },
    /// The call failed (RESOURCE_EXHAUSTED when over the kubelet's rate limit).
    #[error("the kubelet's pod-resources API refused List: {0}")]
    Call(#[from] tonic::Status),
    /// No answer in time.
    #[error("the kubelet's pod-resources API did not answer within {CALL_TIMEOUT:?}")]
    Timeout,
}

/// A client of the kubelet's pod-resources API for the extended resources this process serves.
#[derive(Debug)]
pub struct PodResources {
    socket: PathBuf,
    /// Each resource, with how the kubelet names its devices when not by their inventory IDs.
    resources: Vec<(String, Option<Naming>)>,
    /// The inventory the names resolve against, when any resource needs it.
    inventory: Option<InventoryWatch>,
    /// The last answer, per resource.
    cache: Mutex<Option<(Instant, Vec<Holders>)>>,
    /// Whether the last failure has been logged at warn (cleared by a success).
    warned: AtomicBool,
}

impl PodResources {
    /// A client for `resource`'s devices on the kubelet socket at `socket`.
    pub fn new(socket: impl Into<PathBuf>, resource: impl Into<String>) -> Self {
        PodResources {
            socket: socket.into(),
            resources: vec![(resource.into(), None)],
            inventory: None,
            cache: Mutex::new(None),
            warned: AtomicBool::new(false),
        }
    }

    /// Keys the first resource's holders by device (inventory ID) when the kubelet knows the devices by
    /// other IDs (indices, replicas): a GPU is held by every container holding one of its replicas.
    pub fn with_naming(mut self, naming: Naming, inventory: InventoryWatch) -> Self {
        if !naming.is_plain() {
            if let Some(first) = self.resources.first_mut() {
                first.1 = Some(naming);
            }
            self.inventory = Some(inventory);
        }
        self
    }

    /// Also follows `resource` (another resource of this process, named as `naming` says).
    pub fn with_resource(
        mut self,
        resource: impl Into<String>,
        naming: Naming,
        inventory: InventoryWatch,
    ) -> Self {
        let naming = (!naming.is_plain()).then_some(naming);
        if naming.is_some() {
            self.inventory = Some(inventory);
        }
        self.resources.push((resource.into(), naming));
        self
    }

    /// Every resource's holders, keyed by inventory ID.
    fn on_devices(&self, per_resource: &[Holders]) -> Holders {
        let inventory = self.inventory.as_ref().map(|i| i.borrow().clone());
        let mut by_device = Holders::new();
        for ((_, naming), holders) in self.resources.iter().zip(per_resource) {
            for (id, list) in holders {
                let device = match (naming, &inventory) {
                    (Some(naming), Some(inventory)) => naming
                        .resolve(inventory, id)
                        .map_or(id.clone(), String::from),
                    _ => id.clone(),
                };
                by_device
                    .entry(device)
                    .or_default()
                    .extend(list.iter().cloned());
            }
        }
        tidy(&mut by_device);
        by_device
    }

    /// Asks the kubelet now: each resource's holders, by the IDs the kubelet uses.
    pub async fn list(&self) -> Result<Vec<Holders>, PodsError> {
        let call = async {
            let channel =
                uds::connect(&self.socket)
                    .await
                    .map_err(|source| PodsError::Connect {
                        path: self.socket.clone(),
                        source,
                    })?;
            let response = PodResourcesListerClient::new(channel)
                .list(ListPodResourcesRequest {})
                .await?
                .into_inner();
            Ok(self
                .resources
                .iter()
                .map(|(resource, _)| holders_of(resource, &response.pod_resources))
                .collect())
        };
        tokio::time::timeout(CALL_TIMEOUT, call)
            .await
            .unwrap_or(Err(PodsError::Timeout))
    }

    /// The holders as of at most `max_age` ago (asking the kubelet if the last answer is older), or `None`
    /// if the kubelet cannot say. The first failure after a success is logged at warn, later ones at debug.
    pub async fn holders(&self, max_age: Duration) -> Option<Holders> {
        let mut cache = self.cache.lock().await;
        if let Some((at, holders)) = cache.as_ref()
            && at.elapsed() <= max_age
        {
            return Some(self.on_devices(holders));
        }
        match self.list().await {
            Ok(holders) => {
                if self.warned.swap(false, Ordering::Relaxed) {
                    tracing::info!(socket = %self.socket.display(), "the kubelet's pod-resources API answers again");
                }
                let by_device = self.on_devices(&holders);
                *cache = Some((Instant::now(), holders));
                Some(by_device)
            }
            Err(e) => {
                if self.warned.swap(true, Ordering::Relaxed) {
                    tracing::debug!(error = %e, "pod-resources lookup failed");
                } else {
                    tracing::warn!(error = %e, "cannot tell which pods hold the GPUs; Events go to the node only until the kubelet answers");
                }
                None
            }
        }
    }
}

/// Picks our resource's devices out of a `List` answer.
fn holders_of(resource: &str, pods: &[crate::api::pod_resources::PodResources]) -> Holders {
    let mut holders = Holders::new();
    for pod in pods {
        for container in &pod.containers {
            for devices in &container.devices {
                if devices.resource_name != resource {
                    continue;
                }
                for id in &devices.device_ids {
                    holders.entry(id.clone()).or_default().push(Holder {
                        namespace: pod.namespace.clone(),
                        pod: pod.name.clone(),
                        container: container.name.clone(),
                    });
                }
            }
        }
    }
    tidy(&mut holders);
    holders
}

/// Each device's holders sorted, each once.
fn tidy(holders: &mut Holders) {
    for list in holders.values_mut() {
        list.sort();
        list.dedup();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::pod_resources::{ContainerDevices, ContainerResources, PodResources as Pod};

    fn container(name: &str, devices: &[(&str, &[&str])]) -> ContainerResources {
        ContainerResources {
            name: name.into(),
            devices: devices
                .iter()
                .map(|(resource, ids)| ContainerDevices {
                    resource_name: (*resource).into(),
                    device_ids: ids.iter().map(|s| s.to_string()).collect(),
                    topology: None,
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn only_our_resources_devices_are_kept_with_every_container_holding_them() {
        let pods = vec![
            Pod {
                name: "train-0".into(),
                namespace: "ml".into(),
                containers: vec![
                    container("trainer", &[("nvidia.com/gpu", &["GPU-a", "GPU-b"])]),
                    container("sidecar", &[("example.com/nic", &["GPU-a"])]),
                ],
            },
            Pod {
                name: "infer".into(),
                namespace: "web".into(),
                containers: vec![container("server", &[("nvidia.com/gpu", &["GPU-b"])])],
            },
        ];
        let holders = holders_of("nvidia.com/gpu", &pods);
        let names = |id: &str| -> Vec<String> {
            holders
                .get(id)
                .map(|h| h.iter().map(ToString::to_string).collect())
                .unwrap_or_default()
        };
        assert_eq!(names("GPU-a"), ["ml/train-0 (trainer)"]);
        assert_eq!(
            names("GPU-b"),
            ["ml/train-0 (trainer)", "web/infer (server)"]
        );
        assert_eq!(holders.len(), 2);
    }
}
