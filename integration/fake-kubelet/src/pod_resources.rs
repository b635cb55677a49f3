//! The kubelet's pod-resources API v1, fed by the fake kubelet's own allocations as the real kubelet's is
//! fed by its device manager: a container that got devices through [`crate::FakeKubelet::allocate_to`] is
//! listed with them until its pod is removed. Like the real one it rate-limits callers (100 calls a second,
//! bursts of 10; over it: `RESOURCE_EXHAUSTED`) and dies with the kubelet.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpu_device_plugin::cluster::{EventBudget, TokenBucket};
use tokio::time::Instant;

use gpu_device_plugin::api::pod_resources::pod_resources_lister_server::PodResourcesLister;
use gpu_device_plugin::api::pod_resources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    ContainerResources, GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, PodResources,
};
use tonic::{Request, Response, Status};

/// The kubelet's default limit on this API: 100 calls a second (one every 10 ms), bursts of 10.
const LIMIT: EventBudget = EventBudget {
    burst: 10,
    refill: Duration::from_millis(10),
};

/// What one container holds: (resource, device IDs) per Allocate.
type Held = Vec<(String, Vec<String>)>;

/// Pods and what their containers hold: (namespace, pod) → container → what it holds.
#[derive(Debug, Default)]
pub(crate) struct PodTable {
    pods: BTreeMap<(String, String), BTreeMap<String, Held>>,
}

impl PodTable {
    pub(crate) fn assign(
        &mut self,
        namespace: &str,
        pod: &str,
        container: &str,
        resource: &str,
        ids: Vec<String>,
    ) {
        self.pods
            .entry((namespace.into(), pod.into()))
            .or_default()
            .entry(container.into())
            .or_default()
            .push((resource.into(), ids));
    }

    /// Every device of `resource` some container holds.
    pub(crate) fn held(&self, resource: &str) -> std::collections::BTreeSet<String> {
        self.pods
            .values()
            .flat_map(|containers| containers.values())
            .flatten()
            .filter(|(r, _)| r == resource)
            .flat_map(|(_, ids)| ids.iter().cloned())
            .collect()
    }

    pub(crate) fn remove(&mut self, namespace: &str, pod: &str) -> bool {
        self.pods
            .remove(&(namespace.to_string(), pod.to_string()))
            .is_some()
    }

    fn pod(&self, (namespace, name): (&String, &String)) -> Option<PodResources> {
        let containers = self.pods.get(&(namespace.clone(), name.clone()))?;
        Some(PodResources {
            name: name.clone(),
            namespace: namespace.clone(),
            containers: containers
                .iter()
                .map(|(container, devices)| ContainerResources {
                    name: container.clone(),
                    devices: devices
                        .iter()
                        .map(|(resource, ids)| ContainerDevices {
                            resource_name: resource.clone(),
                            device_ids: ids.clone(),
                            topology: None,
                        })
                        .collect(),
                    ..Default::default()
                })
                .collect(),
        })
    }
}

/// The gRPC service.
pub(crate) struct Service {
    pub(crate) table: Arc<Mutex<PodTable>>,
    limiter: Mutex<TokenBucket>,
    /// Calls answered, for tests.
    pub(crate) calls: Arc<std::sync::atomic::AtomicU64>,
}

impl Service {
    pub(crate) fn new(
        table: Arc<Mutex<PodTable>>,
        calls: Arc<std::sync::atomic::AtomicU64>,
    ) -> Self {
        Service {
            table,
            limiter: Mutex::new(TokenBucket::new(LIMIT, Instant::now())),
            calls,
        }
    }

    fn admit(&self) -> Result<std::sync::MutexGuard<'_, PodTable>, Status> {
        let allowed = self
            .limiter
            .lock()
            .map(|mut l| l.take(Instant::now()))
            .unwrap_or(false);
        if !allowed {
            return Err(Status::resource_exhausted("rejected by rate limit"));
        }
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.table
            .lock()
            .map_err(|_| Status::internal("pod table poisoned"))
    }
}

#[tonic::async_trait]
impl PodResourcesLister for Service {
    async fn list(
        &self,
        _request: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        let table = self.admit()?;
        let pod_resources = table
            .pods
            .keys()
            .filter_map(|(namespace, name)| table.pod((namespace, name)))
            .collect();
        Ok(Response::new(ListPodResourcesResponse { pod_resources }))
    }

    async fn get(
        &self,
        request: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        let table = self.admit()?;
        let request = request.into_inner();
        match table.pod((&request.pod_namespace, &request.pod_name)) {
            Some(pod) => Ok(Response::new(GetPodResourcesResponse {
                pod_resources: Some(pod),
            })),
            None => Err(Status::not_found(format!(
                "pod {} in namespace {} not found",
                request.pod_name, request.pod_namespace
            ))),
        }
    }

    async fn get_allocatable_resources(
        &self,
        _request: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        let _table = self.admit()?;
        Err(Status::unimplemented(
            "GetAllocatableResources is not modelled by the fake kubelet",
        ))
    }
}
