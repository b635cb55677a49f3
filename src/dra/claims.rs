//! ResourceClaims, read from the API server as far as preparing one needs: its UID and the devices the
//! scheduler allocated to it. The kubelet's prepare call names a claim only; what it holds is here.
//!
//! Views of `resource.k8s.io/v1` written for what is read, rather than the generated types: those need a
//! newer API level than the rest of the plugin speaks (the device-plugin mode works on older clusters).

use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject};
use serde::Deserialize;

pub use super::device_config::AllocatedConfig;

/// The longest a claim is waited for; the kubelet gives a whole prepare call 45 s.
pub const GET_TIMEOUT: Duration = Duration::from_secs(10);

/// The `resource.k8s.io/v1` ResourceClaim resource.
pub fn claim_resource() -> ApiResource {
    ApiResource {
        group: "resource.k8s.io".into(),
        version: "v1".into(),
        api_version: "resource.k8s.io/v1".into(),
        kind: "ResourceClaim".into(),
        plural: "resourceclaims".into(),
    }
}

/// A ResourceClaim, as far as preparing it needs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct Claim {
    /// Its namespace.
    #[serde(default)]
    pub namespace: String,
    /// Its name.
    #[serde(default)]
    pub name: String,
    /// Its UID.
    #[serde(default)]
    pub uid: String,
    /// The devices allocated to it, of every driver; `None` while it is not allocated.
    #[serde(default)]
    pub allocated: Option<Vec<Allocated>>,
    /// The device configuration of its allocation (`status.allocation.devices.config`), every driver's.
    #[serde(default)]
    pub config: Vec<AllocatedConfig>,
    /// The pods it is reserved for (`status.reservedFor`), by name: they are in the claim's namespace.
    #[serde(default)]
    pub pods: Vec<String>,
}

/// One allocated device of a claim (`status.allocation.devices.results[]`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Allocated {
    /// The claim's request it satisfies (`<request>` or `<request>/<subrequest>`).
    #[serde(default)]
    pub request: String,
    /// Driver.
    #[serde(default)]
    pub driver: String,
    /// Pool.
    #[serde(default)]
    pub pool: String,
    /// Device name.
    #[serde(default)]
    pub device: String,
}

#[derive(Deserialize)]
struct ClaimObject {
    #[serde(default)]
    metadata: Metadata,
    #[serde(default)]
    status: Option<Status>,
}

#[derive(Default, Deserialize)]
struct Metadata {
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    uid: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Status {
    #[serde(default)]
    allocation: Option<Allocation>,
    #[serde(default)]
    reserved_for: Vec<Consumer>,
}

/// One entry of `status.reservedFor`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Consumer {
    #[serde(default)]
    api_group: String,
    #[serde(default)]
    resource: String,
    #[serde(default)]
    name: String,
}

#[derive(Deserialize)]
struct Allocation {
    #[serde(default)]
    devices: Option<Devices>,
}

#[derive(Deserialize)]
struct Devices {
    #[serde(default)]
    results: Vec<Allocated>,
    #[serde(default)]
    config: Vec<AllocatedConfig>,
}

impl Claim {
    /// The view of a ResourceClaim object.
    pub fn from_object(object: serde_json::Value) -> Result<Claim, String> {
        let object: ClaimObject = serde_json::from_value(object)
            .map_err(|e| format!("not a ResourceClaim this plugin can read: {e}"))?;
        let (allocation, reserved_for) = object
            .status
            .map(|s| (s.allocation, s.reserved_for))
            .unwrap_or_default();
        let (allocated, config) = match allocation {
            Some(a) => {
                let (results, config) =
                    a.devices.map(|d| (d.results, d.config)).unwrap_or_default();
                (Some(results), config)
            }
            None => (None, Vec::new()),
        };
        Ok(Claim {
            namespace: object.metadata.namespace.unwrap_or_default(),
            name: object.metadata.name.unwrap_or_default(),
            uid: object.metadata.uid.unwrap_or_default(),
            allocated,
            config,
            pods: reserved_for
                .into_iter()
                .filter(|c| c.api_group.is_empty() && c.resource == "pods" && !c.name.is_empty())
                .map(|c| c.name)
                .collect(),
        })
    }
}

/// Where claims are read from.
#[tonic::async_trait]
pub trait ClaimReader: Send + Sync {
    /// The claim `namespace/name`: `Ok(None)` when there is none.
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<Claim>, String>;

    /// Every claim allocated a device of `driver` in `pool` and reserved for a pod, as the API server holds
    /// them now: what is prepared on the node, or about to be, whatever the record says.
    async fn allocated_in(&self, driver: &str, pool: &str) -> Result<Vec<Claim>, String>;
}

/// Claims asked for in one page of a list: a claim is a few KiB, and a page must stay well under the
/// answer's size cap ([`crate::cluster::client::MAX_ANSWER_BYTES`]) even with a few large ones.
const LIST_PAGE: u32 = 100;
/// Pages read at most in one list (of [`LIST_PAGE`] claims, or fewer where claims are large).
const MAX_PAGES: usize = 2000;

/// Whether `claim` holds a device of `driver` in `pool` for a pod.
pub fn holds_in(claim: &Claim, driver: &str, pool: &str) -> bool {
    !claim.pods.is_empty()
        && claim
            .allocated
            .iter()
            .flatten()
            .any(|r| r.driver == driver && r.pool == pool)
}

/// Claims from the API server.
#[derive(Clone)]
pub struct ApiClaims {
    client: kube::Client,
}

impl ApiClaims {
    /// Reads with `client`.
    pub fn new(client: kube::Client) -> Self {
        ApiClaims { client }
    }
}

#[tonic::async_trait]
impl ClaimReader for ApiClaims {
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<Claim>, String> {
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), namespace, &claim_resource());
        let object = tokio::time::timeout(GET_TIMEOUT, api.get_opt(name))
            .await
            .map_err(|_| format!("the API server did not answer within {GET_TIMEOUT:?}"))?
            .map_err(|e| crate::cluster::explain(&e, "get on resourceclaims"))?;
        let Some(object) = object else {
            return Ok(None);
        };
        let value = serde_json::to_value(object).map_err(|e| e.to_string())?;
        Claim::from_object(value).map(Some)
    }

    async fn allocated_in(&self, driver: &str, pool: &str) -> Result<Vec<Claim>, String> {
        use kube::api::ListParams;
        // Every namespace's: no field selector picks a claim by where it is allocated.
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &claim_resource());
        let mut limit = LIST_PAGE;
        let mut token: Option<String> = None;
        let mut held = Vec::new();
        for _ in 0..MAX_PAGES {
            let mut params = ListParams::default().limit(limit);
            if let Some(token) = &token {
                params = params.continue_token(token);
            }
            let page = match tokio::time::timeout(GET_TIMEOUT, api.list(&params)).await {
                Err(_) => {
                    return Err(format!(
                        "the API server did not answer a list of resourceclaims within {GET_TIMEOUT:?}"
                    ));
                }
                // A page of large claims over the answer's cap: the same page in smaller ones.
                Ok(Err(e)) if crate::cluster::client::is_too_large(&e) && limit > 1 => {
                    limit = (limit / 4).max(1);
                    continue;
                }
                Ok(Err(e)) => return Err(crate::cluster::explain(&e, "list on resourceclaims")),
                Ok(Ok(page)) => page,
            };
            for object in page.items {
                let value = serde_json::to_value(object).map_err(|e| e.to_string())?;
                // One claim this plugin cannot read is no reason to know none.
                if let Ok(claim) = Claim::from_object(value) {
                    if holds_in(&claim, driver, pool) {
                        held.push(claim);
                    }
                }
            }
            match page.metadata.continue_ {
                Some(next) if !next.is_empty() => token = Some(next),
                _ => return Ok(held),
            }
        }
        Err(format!(
            "more than {MAX_PAGES} pages of resourceclaims in the cluster"
        ))
    }
}

/// Who uses each DRA device, for the Events: the pods the claim it is prepared for is reserved for.
pub struct PreparedFor {
    status: tokio::sync::watch::Receiver<super::registration::DraStatus>,
}

impl PreparedFor {
    /// Follows the claims prepared, as the DRA side shows them in `status`.
    pub fn new(status: tokio::sync::watch::Receiver<super::registration::DraStatus>) -> Self {
        PreparedFor { status }
    }
}

#[tonic::async_trait]
impl crate::cluster::ClaimUsers for PreparedFor {
    async fn users(
        &self,
        client: &kube::Client,
        device: &crate::devices::DeviceInfo,
    ) -> Vec<crate::cluster::ClaimUser> {
        let name = super::names::device_name(device);
        let Some(claim) = self.status.borrow().prepared.get(&name).cloned() else {
            return Vec::new();
        };
        let Some((namespace, claim)) = claim.split_once('/') else {
            return Vec::new();
        };
        match ApiClaims::new(client.clone()).get(namespace, claim).await {
            Ok(Some(read)) => read
                .pods
                .into_iter()
                .map(|pod| crate::cluster::ClaimUser {
                    namespace: namespace.into(),
                    pod,
                    claim: claim.into(),
                })
                .collect(),
            Ok(None) => Vec::new(),
            Err(e) => {
                tracing::debug!(error = %e, claim = %format!("{namespace}/{claim}"), device = %name, "cannot read who a claim is reserved for; its Event goes to the node only");
                Vec::new()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_allocated_claim_reads_as_its_uid_and_devices() {
        let object = serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "ns", "uid": "u-1"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"}
            ], "config": [
                {"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com",
                 "parameters": {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}}}
            ]}}, "reservedFor": [
                {"resource": "pods", "name": "train-0", "uid": "p-1"},
                {"apiGroup": "example.com", "resource": "pods", "name": "not-a-pod", "uid": "x"},
                {"resource": "pods", "name": "train-1", "uid": "p-2"}
            ]}
        });
        let claim = Claim::from_object(object).expect("readable");
        assert_eq!(claim.uid, "u-1");
        assert_eq!(claim.pods, ["train-0", "train-1"]);
        let devices = claim.allocated.expect("allocated");
        assert_eq!(devices.len(), 1);
        assert_eq!(
            (devices[0].driver.as_str(), devices[0].device.as_str()),
            ("gpu.nvidia.com", "gpu-0")
        );
        assert_eq!(claim.config.len(), 1);
        assert_eq!(
            (
                claim.config[0].source.as_str(),
                &claim.config[0].requests[..]
            ),
            ("FromClaim", &["gpu".to_string()][..])
        );
        let opaque = claim.config[0].opaque.as_ref().expect("opaque");
        assert_eq!(opaque.parameters["kind"], "GpuConfig");
    }

    #[test]
    fn a_claim_without_an_allocation_is_not_allocated() {
        let object = serde_json::json!({"metadata": {"uid": "u"}, "status": {}});
        assert_eq!(
            Claim::from_object(object).expect("readable").allocated,
            None
        );
        let wrong = serde_json::json!({"metadata": {"uid": 7}});
        assert!(Claim::from_object(wrong).is_err());
    }
}
