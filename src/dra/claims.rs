//! ResourceClaims, read from the API server as far as preparing one needs: its UID and the devices the
//! scheduler allocated to it. The kubelet's prepare call names a claim only; what it holds is here.
//!
//! Views of `resource.k8s.io/v1` written for what is read, rather than the generated types: those need a
//! newer API level than the rest of the plugin speaks (the device-plugin mode works on older clusters).

use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject};
use serde::Deserialize;

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
    /// Its UID.
    #[serde(default)]
    pub uid: String,
    /// The devices allocated to it, of every driver; `None` while it is not allocated.
    #[serde(default)]
    pub allocated: Option<Vec<Allocated>>,
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
    uid: Option<String>,
}

#[derive(Deserialize)]
struct Status {
    #[serde(default)]
    allocation: Option<Allocation>,
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
}

impl Claim {
    /// The view of a ResourceClaim object.
    pub fn from_object(object: serde_json::Value) -> Result<Claim, String> {
        let object: ClaimObject = serde_json::from_value(object)
            .map_err(|e| format!("not a ResourceClaim this plugin can read: {e}"))?;
        Ok(Claim {
            uid: object.metadata.uid.unwrap_or_default(),
            allocated: object
                .status
                .and_then(|s| s.allocation)
                .map(|a| a.devices.map(|d| d.results).unwrap_or_default()),
        })
    }
}

/// Where claims are read from.
#[tonic::async_trait]
pub trait ClaimReader: Send + Sync {
    /// The claim `namespace/name`: `Ok(None)` when there is none.
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<Claim>, String>;
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
            ]}}}
        });
        let claim = Claim::from_object(object).expect("readable");
        assert_eq!(claim.uid, "u-1");
        let devices = claim.allocated.expect("allocated");
        assert_eq!(devices.len(), 1);
        assert_eq!(
            (devices[0].driver.as_str(), devices[0].device.as_str()),
            ("gpu.nvidia.com", "gpu-0")
        );
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
