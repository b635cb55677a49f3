//! ResourceClaims, read from the API server as far as preparing one needs: its UID and the devices the
//! scheduler allocated to it. The kubelet's prepare call names a claim only; what it holds is here.
//!
//! Views of `resource.k8s.io/v1` written for what is read, rather than the generated types: those need a
//! newer API level than the rest of the plugin speaks (the device-plugin mode works on older clusters).
//!
//! Claims are read and parsed on a thread of their own ([`ApiClaims::spawn`]), at the lower priority, never
//! on the DRA thread that serves the health stream: a flood of prepares of large claims costs that thread
//! a message each way, not the read and parse of each claim. A claim is parsed straight from the answer's
//! bytes into the view (what the view does not hold is skipped, not kept), at most [`MAX_CLAIM_BYTES`].

use std::time::Duration;

use kube::api::ApiResource;
use serde::Deserialize;
use serde::de::IgnoredAny;

pub use super::device_config::AllocatedConfig;

/// The longest a claim is waited for; the kubelet gives a whole prepare call 45 s.
pub const GET_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest claim read: the API server stores an object of at most 1.5 MiB (etcd's request limit), and
/// its JSON is a little larger. A larger answer is refused with its size, unparsed.
pub const MAX_CLAIM_BYTES: usize = 2 * 1024 * 1024;

/// Claims waiting for the claims' thread, at most: each is a few names and an answer channel; past it a
/// read fails at once (the kubelet asks again) rather than queueing without end.
const QUEUED: usize = 1024;

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
    /// The view of a ResourceClaim as the API server sends it, read from its bytes: at most
    /// [`MAX_CLAIM_BYTES`], refused with its size past that.
    pub fn from_json(bytes: &[u8]) -> Result<Claim, String> {
        if bytes.len() > MAX_CLAIM_BYTES {
            return Err(format!(
                "the ResourceClaim is {} bytes, more than the {MAX_CLAIM_BYTES} read (the API server stores \
                 at most 1.5 MiB an object)",
                bytes.len()
            ));
        }
        let object: ClaimObject = serde_json::from_slice(bytes)
            .map_err(|e| format!("not a ResourceClaim this plugin can read: {e}"))?;
        Ok(Claim::from_view(object))
    }

    /// The claims of one page of a ResourceClaim list as the API server sends it (the page itself within
    /// the answer's cap; a claim that cannot be read is left out: one is no reason to know none), and the
    /// page's continue token, if more follow.
    pub fn page_from_json(bytes: &[u8]) -> Result<(Vec<Claim>, Option<String>), String> {
        // The items are skipped here (serde_json skips without recursion, so no nesting in a claim can
        // make the page unreadable) and each read from its own bytes below.
        #[derive(Deserialize)]
        struct Page {
            #[serde(default)]
            metadata: PageMetadata,
            #[serde(default, rename = "items")]
            _items: IgnoredAny,
        }
        #[derive(Default, Deserialize)]
        struct PageMetadata {
            #[serde(default, rename = "continue")]
            token: Option<String>,
        }
        let page: Page = serde_json::from_slice(bytes)
            .map_err(|e| format!("not a list of ResourceClaims this plugin can read: {e}"))?;
        let claims = elements_of(bytes, b"items")
            .into_iter()
            .filter_map(|item| bytes.get(item))
            .filter_map(|item| Claim::from_json(item).ok())
            .collect();
        Ok((claims, page.metadata.token.filter(|t| !t.is_empty())))
    }

    /// The view of a ResourceClaim object.
    pub fn from_object(object: serde_json::Value) -> Result<Claim, String> {
        let object: ClaimObject = serde_json::from_value(object)
            .map_err(|e| format!("not a ResourceClaim this plugin can read: {e}"))?;
        Ok(Claim::from_view(object))
    }

    fn from_view(object: ClaimObject) -> Claim {
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
        Claim {
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
        }
    }
}

/// Where each element of the array at the top-level `key` of the JSON object `json` lies, by byte range. The
/// JSON must be known to be well formed (parsed once already); it is walked once, byte by byte, with a
/// count of the open brackets rather than a recursion, so any nesting costs nothing but the walk.
fn elements_of(json: &[u8], key: &[u8]) -> Vec<std::ops::Range<usize>> {
    let mut elements = Vec::new();
    let mut depth = 0usize;
    // The last string read at the object's own level (a key, when a ':' follows it).
    let mut last_string = 0..0;
    // The value about to start is the one of `key`; the array being walked is it.
    let (mut of_key, mut inside) = (false, false);
    let mut start: Option<usize> = None;
    let mut at = 0;
    while at < json.len() {
        let byte = json[at];
        let element_level = inside && depth == 2;
        match byte {
            b'"' => {
                let opened = at;
                at += 1;
                while at < json.len() && json[at] != b'"' {
                    at += if json[at] == b'\\' { 2 } else { 1 };
                }
                if depth == 1 {
                    last_string = opened + 1..at.min(json.len());
                }
                if element_level && start.is_none() {
                    start = Some(opened);
                }
            }
            b'{' | b'[' => {
                if element_level && start.is_none() {
                    start = Some(at);
                }
                depth += 1;
                if depth == 2 {
                    inside = of_key && byte == b'[';
                    of_key = false;
                }
            }
            b'}' | b']' => {
                if element_level {
                    elements.extend(start.take().map(|s| s..at));
                    inside = false;
                }
                depth = depth.saturating_sub(1);
            }
            b',' if element_level => elements.extend(start.take().map(|s| s..at)),
            b':' if depth == 1 => of_key = json.get(last_string.clone()) == Some(key),
            b' ' | b'\t' | b'\n' | b'\r' | b',' | b':' => {}
            _ => {
                if element_level && start.is_none() {
                    start = Some(at);
                }
            }
        }
        at += 1;
    }
    elements
}

/// Where claims are read from.
#[tonic::async_trait]
pub trait ClaimReader: Send + Sync {
    /// The claim `namespace/name`: `Ok(None)` when there is none.
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<Claim>, String>;

    /// Every claim allocated a device of `driver` in `pool` and reserved for a pod, as the API server holds
    /// them now: what is prepared on the node, or about to be, whatever the record says.
    async fn allocated_in(&self, driver: &str, pool: &str) -> Result<Listed, String>;
}

/// The claims a list found, and how many pages it took.
#[derive(Debug, Clone, Default)]
pub struct Listed {
    /// Every claim allocated a device of the pool and reserved for a pod.
    pub claims: Vec<Claim>,
    /// Pages read.
    pub pages: usize,
}

/// Claims asked for in one page of a list: a claim is a few KiB, and a page must stay well under the
/// answer's size cap ([`crate::cluster::client::MAX_ANSWER_BYTES`]) even with a few large ones.
const LIST_PAGE: u32 = 100;
/// Pages read at most in one list (of [`LIST_PAGE`] claims, or fewer where claims are large).
pub const MAX_PAGES: usize = 2000;

/// Whether `claim` holds a device of `driver` in `pool` for a pod.
pub fn holds_in(claim: &Claim, driver: &str, pool: &str) -> bool {
    !claim.pods.is_empty()
        && claim
            .allocated
            .iter()
            .flatten()
            .any(|r| r.driver == driver && r.pool == pool)
}

/// Claims from the API server, read and parsed on a thread of their own (`dra-claims`, at the side threads'
/// lower priority) with a client of its own: the DRA thread only sends the ask and takes the answer.
#[derive(Clone)]
pub struct ApiClaims {
    asks: tokio::sync::mpsc::Sender<Ask>,
}

/// What the claims' thread is asked.
enum Ask {
    Get {
        namespace: String,
        name: String,
        answer: tokio::sync::oneshot::Sender<Result<Option<Claim>, String>>,
    },
    List {
        driver: String,
        pool: String,
        answer: tokio::sync::oneshot::Sender<Result<Listed, String>>,
    },
}

impl ApiClaims {
    /// Starts the claims' thread, with a client for the API server at `api` built there.
    pub fn spawn(api: kube::Config) -> std::io::Result<ApiClaims> {
        use crate::util::runtime::{Priority, spawn_on_own_thread};
        let (asks, mut queue) = tokio::sync::mpsc::channel::<Ask>(QUEUED);
        spawn_on_own_thread("dra-claims", Priority::Side, async move {
            let client = crate::cluster::client::client(api)
                .map_err(|e| format!("cannot build a Kubernetes API client to read claims: {e}"));
            let in_flight = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            while let Some(ask) = queue.recv().await {
                let client = client.clone();
                let in_flight = in_flight.clone();
                in_flight.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    match ask {
                        Ask::Get {
                            namespace,
                            name,
                            answer,
                        } => {
                            let read = match &client {
                                Ok(client) => ClaimsClient(client).get(&namespace, &name).await,
                                Err(e) => Err(e.clone()),
                            };
                            let _gone = answer.send(read);
                        }
                        Ask::List {
                            driver,
                            pool,
                            answer,
                        } => {
                            let read = match &client {
                                Ok(client) => {
                                    ClaimsClient(client).allocated_in(&driver, &pool).await
                                }
                                Err(e) => Err(e.clone()),
                            };
                            let _gone = answer.send(read);
                        }
                    }
                    // The last read of a burst done: what the answers took is handed back.
                    if in_flight.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) == 1 {
                        crate::util::limits::return_freed_memory();
                    }
                });
            }
        })?;
        Ok(ApiClaims { asks })
    }

    async fn ask<T>(
        &self,
        ask: impl FnOnce(tokio::sync::oneshot::Sender<Result<T, String>>) -> Ask,
    ) -> Result<T, String> {
        let (answer, answered) = tokio::sync::oneshot::channel();
        self.asks.try_send(ask(answer)).map_err(|e| match e {
            tokio::sync::mpsc::error::TrySendError::Full(_) => {
                format!("{QUEUED} claims are waiting to be read already")
            }
            tokio::sync::mpsc::error::TrySendError::Closed(_) => {
                "the thread that reads claims has stopped".to_string()
            }
        })?;
        answered
            .await
            .map_err(|_| "the thread that reads claims has stopped".to_string())?
    }
}

#[tonic::async_trait]
impl ClaimReader for ApiClaims {
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<Claim>, String> {
        let (namespace, name) = (namespace.to_string(), name.to_string());
        self.ask(|answer| Ask::Get {
            namespace,
            name,
            answer,
        })
        .await
    }

    async fn allocated_in(&self, driver: &str, pool: &str) -> Result<Listed, String> {
        let (driver, pool) = (driver.to_string(), pool.to_string());
        self.ask(|answer| Ask::List {
            driver,
            pool,
            answer,
        })
        .await
    }
}

/// Reads claims with a client, on the caller's thread.
struct ClaimsClient<'a>(&'a kube::Client);

impl ClaimsClient<'_> {
    /// The claim `namespace/name`: `Ok(None)` when there is none.
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<Claim>, String> {
        let path = format!("/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims");
        let request = kube::core::Request::new(path)
            .get(name, &kube::api::GetParams::default())
            .map_err(|e| e.to_string())?;
        let text = match tokio::time::timeout(GET_TIMEOUT, self.0.request_text(request)).await {
            Err(_) => {
                return Err(format!(
                    "the API server did not answer within {GET_TIMEOUT:?}"
                ));
            }
            Ok(Err(kube::Error::Api(status))) if status.code == 404 => return Ok(None),
            Ok(Err(e)) => return Err(crate::cluster::explain(&e, "get on resourceclaims")),
            Ok(Ok(text)) => text,
        };
        Claim::from_json(text.as_bytes()).map(Some)
    }

    /// Every claim allocated a device of `driver` in `pool` and reserved for a pod, in pages.
    async fn allocated_in(&self, driver: &str, pool: &str) -> Result<Listed, String> {
        use kube::api::ListParams;
        // Every namespace's: no field selector picks a claim by where it is allocated.
        let lists = kube::core::Request::new("/apis/resource.k8s.io/v1/resourceclaims");
        let mut limit = LIST_PAGE;
        let mut token: Option<String> = None;
        let mut held = Vec::new();
        for pages in 1..=MAX_PAGES {
            let mut params = ListParams::default().limit(limit);
            if let Some(token) = &token {
                params = params.continue_token(token);
            }
            let request = lists.list(&params).map_err(|e| e.to_string())?;
            let text = match tokio::time::timeout(GET_TIMEOUT, self.0.request_text(request)).await {
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
                Ok(Ok(text)) => text,
            };
            let (claims, next) = Claim::page_from_json(text.as_bytes())?;
            held.extend(claims.into_iter().filter(|c| holds_in(c, driver, pool)));
            match next {
                Some(next) => token = Some(next),
                None => {
                    return Ok(Listed {
                        claims: held,
                        pages,
                    });
                }
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
        match ClaimsClient(client).get(namespace, claim).await {
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
        let crate::dra::device_config::Parameters::Read(parameters) = &opaque.parameters else {
            panic!("parameters kept: {opaque:?}");
        };
        assert_eq!(parameters["kind"], "GpuConfig");
    }

    #[test]
    fn a_claim_over_the_size_bound_is_refused_with_its_size_unparsed() {
        let padding = "x".repeat(MAX_CLAIM_BYTES);
        let big = serde_json::json!({"metadata": {"uid": "u", "annotations": {"pad": padding}}});
        let bytes = serde_json::to_vec(&big).expect("json");
        let why = Claim::from_json(&bytes).expect_err("too large");
        assert!(
            why.contains(&bytes.len().to_string()) && why.contains("more than"),
            "{why}"
        );
        // One of 1 MB, within what the API server stores, is read, its padding not kept.
        let padding = "x".repeat(1_000_000);
        let fits = serde_json::json!({"metadata": {"uid": "u", "name": "c", "namespace": "ns",
            "annotations": {"pad": padding}}, "status": {"allocation": {"devices": {"results": []}}}});
        let claim = Claim::from_json(&serde_json::to_vec(&fits).expect("json")).expect("read");
        assert_eq!(
            (
                claim.uid.as_str(),
                claim.name.as_str(),
                claim.namespace.as_str()
            ),
            ("u", "c", "ns")
        );
        assert_eq!(claim.allocated, Some(Vec::new()));
    }

    #[test]
    fn a_page_of_claims_reads_every_claim_it_can_and_the_token_for_the_next() {
        let page = serde_json::json!({"metadata": {"continue": "next-page"}, "items": [
            {"metadata": {"uid": "u-1", "name": "a", "namespace": "ns"}},
            {"metadata": {"uid": 7}},
            {"metadata": {"uid": "u-3", "name": "c", "namespace": "ns"}},
        ]});
        let (claims, token) =
            Claim::page_from_json(&serde_json::to_vec(&page).expect("json")).expect("page");
        let uids: Vec<&str> = claims.iter().map(|c| c.uid.as_str()).collect();
        assert_eq!(uids, ["u-1", "u-3"]);
        assert_eq!(token.as_deref(), Some("next-page"));
        let last = serde_json::json!({"metadata": {"continue": ""}, "items": []});
        let (_, token) =
            Claim::page_from_json(&serde_json::to_vec(&last).expect("json")).expect("page");
        assert_eq!(token, None);
        assert!(Claim::page_from_json(b"[1, 2]").is_err());
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

    /// `depth` nested arrays: `[[…]]`, 2 × `depth` bytes.
    fn nested(depth: usize) -> String {
        format!("{}{}", "[".repeat(depth), "]".repeat(depth))
    }

    /// A claim allocated gpu-0 of this driver, with opaque parameters `parameters` for `driver` in its
    /// allocation's configuration (and in its spec, where the claim's author wrote them).
    fn claim_configured_for(uid: &str, driver: &str, parameters: &str) -> String {
        format!(
            r#"{{"metadata": {{"name": "c", "namespace": "ns", "uid": "{uid}"}},
            "spec": {{"devices": {{"config": [{{"opaque": {{"driver": "{driver}", "parameters": {parameters}}}}}]}}}},
            "status": {{"allocation": {{"devices": {{"results": [
                {{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"}}
            ], "config": [
                {{"source": "FromClaim", "requests": ["nic"], "opaque": {{"driver": "{driver}", "parameters": {parameters}}}}},
                {{"source": "FromClaim", "requests": ["nic"], "opaque": {{"parameters": {parameters}, "driver": "{driver}"}}}}
            ]}}}}, "reservedFor": [{{"resource": "pods", "name": "p", "uid": "p-1"}}]}}}}"#
        )
    }

    #[test]
    fn another_drivers_deeply_nested_configuration_leaves_the_claim_readable_and_served() {
        // 264 bytes of nested arrays: well within what the API server stores.
        let deep = nested(132);
        assert_eq!(deep.len(), 264);
        let text = claim_configured_for("u-1", "nic.example.com", &deep);
        let claim = Claim::from_json(text.as_bytes()).expect("readable");
        assert_eq!(claim.uid, "u-1");
        assert_eq!(claim.allocated.as_ref().map(Vec::len), Some(1));
        assert_eq!(claim.config.len(), 2);
        let config = crate::dra::device_config::ClaimConfig::read(&claim.config, "gpu.nvidia.com")
            .expect("another driver's configuration is not this driver's to read");
        assert_eq!(
            config.check("gpu", crate::dra::device_config::DeviceType::Gpu),
            Ok(())
        );
        // In a list, the claim is read too (a claim left out would not hold its GPU).
        let page = format!(r#"{{"metadata": {{}}, "items": [{text}, {text}]}}"#);
        let (claims, _) = Claim::page_from_json(page.as_bytes()).expect("page");
        assert_eq!(claims.len(), 2);
        assert!(
            claims
                .iter()
                .all(|c| holds_in(c, "gpu.nvidia.com", "node-a"))
        );
        // Nested past any bound: still readable.
        let text = claim_configured_for("u-2", "nic.example.com", &nested(100_000));
        assert!(Claim::from_json(text.as_bytes()).is_ok());
        // This driver's own parameters nested that deep are an error naming the entry, not a crash.
        let text = claim_configured_for("u-3", "gpu.nvidia.com", &deep);
        let claim = Claim::from_json(text.as_bytes()).expect("readable");
        let why = crate::dra::device_config::ClaimConfig::read(&claim.config, "gpu.nvidia.com")
            .expect_err("not a configuration");
        assert!(
            why.starts_with("device configuration 1 (FromClaim)"),
            "{why}"
        );
    }

    #[test]
    fn a_lists_items_are_found_by_their_bytes_whatever_their_strings_hold() {
        let page = br#"{"metadata": {"items": [9]}, "kind": "x\"items\":[", "items": [ {"a": "],\"}"}, [1, [2]], 3 , "s"], "z": [4]}"#;
        let found: Vec<&str> = elements_of(page, b"items")
            .into_iter()
            .map(|r| std::str::from_utf8(&page[r]).expect("utf-8").trim())
            .collect();
        assert_eq!(found, [r#"{"a": "],\"}"}"#, "[1, [2]]", "3", r#""s""#]);
        assert!(elements_of(br#"{"items": 5}"#, b"items").is_empty());
        assert!(elements_of(br#"{"items": []}"#, b"items").is_empty());
    }
}
