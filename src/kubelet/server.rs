//! The `DevicePlugin` gRPC service the kubelet calls. Allocation errors become gRPC status codes here, in one
//! place.

use std::pin::Pin;
use std::sync::Arc;

use futures_util::{Stream, StreamExt};
use tokio::sync::watch;
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::api::device_plugin_server::DevicePlugin;
use crate::api::{
    AllocateRequest, AllocateResponse, ContainerPreferredAllocationResponse, Device,
    DevicePluginOptions, Empty, ListAndWatchResponse, NumaNode, PreStartContainerRequest,
    PreStartContainerResponse, PreferredAllocationRequest, PreferredAllocationResponse,
    TopologyInfo,
};
use crate::devices::allocation::{
    self, AllocateOptions, AllocationError, PreStartError, PreferenceRequest,
};
use crate::devices::naming::Naming;
use crate::devices::{Inventory, InventoryWatch};
use crate::metrics::Metrics;

/// The options this plugin registers with and reports: with `pre_start_check`, the kubelet calls
/// PreStartContainer before every start of a container holding our devices (see [`allocation::pre_start`]).
pub fn plugin_options(pre_start_check: bool) -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: pre_start_check,
        get_preferred_allocation_available: true,
    }
}

/// Serves the device plugin API from the shared inventory.
pub struct PluginService {
    inventory: InventoryWatch,
    options: AllocateOptions,
    /// Ends every ListAndWatch stream cleanly (OK status) when the plugin shuts down.
    shutdown: CancellationToken,
    streams: watch::Sender<Streams>,
    /// Streams numbered up to this one (1-based, as [`Streams::opened`] counts them) are ended: see
    /// [`StreamEnder`].
    end_through: watch::Sender<u64>,
    /// Whether we ask the kubelet for PreStartContainer calls.
    pre_start_check: bool,
    metrics: Arc<Metrics>,
}

/// The ListAndWatch streams this plugin serves: how the kubelet's hold on us is seen. The kubelet opens one
/// stream per registration and never re-opens it; when it closes one (a kubelet restart, or, up to kubelet
/// 1.36, another instance's stream ending) the stream is dropped here.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Streams {
    /// Streams open now.
    pub open: usize,
    /// Streams ever opened: tells a stream opened after a registration from one that was already there.
    pub opened: u64,
    /// The stream opened last has ended, older ones may still be open. A kubelet up to 1.36 replaces its
    /// client of a resource on each registration without closing the one before, so after registering
    /// twice (see `DirWatch::take_other_left`) only the newest stream says whether the kubelet still uses us.
    pub newest_ended: bool,
}

/// Counts a stream as open for as long as it lives; tonic drops a stream when its client cancels it or the
/// connection closes.
struct OpenStream {
    streams: watch::Sender<Streams>,
    /// Which stream this is, of all opened (1-based).
    number: u64,
}

impl OpenStream {
    fn new(streams: &watch::Sender<Streams>) -> Self {
        let mut number = 0;
        streams.send_modify(|s| {
            s.open += 1;
            s.opened += 1;
            s.newest_ended = false;
            number = s.opened;
        });
        OpenStream {
            streams: streams.clone(),
            number,
        }
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.streams.send_modify(|s| {
            s.open = s.open.saturating_sub(1);
            if s.opened == self.number {
                s.newest_ended = true;
            }
        });
    }
}

/// Ends the ListAndWatch streams opened so far, cleanly (OK status), for the supervisor. A kubelet up to 1.36
/// keeps every client it replaced, stream open, for good; the supervisor ends those it knows replaced, at a
/// moment when their end cannot cut the client the kubelet uses.
#[derive(Debug, Clone)]
pub struct StreamEnder(watch::Sender<u64>);

impl StreamEnder {
    /// Ends every stream numbered up to `number` (1-based, as [`Streams::opened`] counts them) still open.
    pub fn end_through(&self, number: u64) {
        self.0.send_if_modified(|through| {
            let later = number > *through;
            if later {
                *through = number;
            }
            later
        });
    }
}

impl PluginService {
    /// A service reading `inventory`; streams end when `shutdown` is cancelled.
    pub fn new(
        inventory: InventoryWatch,
        options: AllocateOptions,
        shutdown: CancellationToken,
    ) -> Self {
        PluginService {
            inventory,
            options,
            shutdown,
            streams: watch::Sender::new(Streams::default()),
            end_through: watch::Sender::new(0),
            pre_start_check: false,
            metrics: Metrics::off(),
        }
    }

    /// Counts Allocate and PreStartContainer calls by result in `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    fn count(&self, method: &str, code: tonic::Code) {
        self.metrics.call(method, code);
    }

    /// Asks the kubelet (in the options it reads) to call PreStartContainer before each container start.
    pub fn with_pre_start_check(mut self, on: bool) -> Self {
        self.pre_start_check = on;
        self
    }

    /// Watches the open ListAndWatch streams.
    pub fn streams(&self) -> watch::Receiver<Streams> {
        self.streams.subscribe()
    }

    /// A way to end the streams opened so far.
    pub fn stream_ender(&self) -> StreamEnder {
        StreamEnder(self.end_through.clone())
    }
}

/// The ListAndWatch message for one inventory: every device, in stable order, as `naming` names it (a GPU's
/// replicas one after another, each with the GPU's health).
pub fn list_response(inventory: &Inventory, naming: &Naming) -> ListAndWatchResponse {
    ListAndWatchResponse {
        devices: naming
            .listed(inventory)
            .map(|(id, d)| Device {
                id,
                health: d.health.as_api_str().to_string(),
                topology: d.info.numa_node.map(|id| TopologyInfo {
                    nodes: vec![NumaNode { id }],
                }),
            })
            .collect(),
    }
}

/// The largest message the kubelet reads from a device plugin: gRPC's default receive limit, which the
/// kubelet's device-plugin client keeps. A larger ListAndWatch message fails the kubelet's stream with
/// RESOURCE_EXHAUSTED; the kubelet drops it, and no list (and no fault) gets through after.
pub const KUBELET_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// gRPC's frame header before each message (a flag byte and a 4-byte length), counted by the limit too.
const GRPC_FRAME_HEADER: usize = 5;

/// Checks that every list `inventory` can make under `naming` fits in one message the kubelet accepts: the
/// largest is the one with every device Unhealthy (the longer word). Returns its size in bytes.
pub fn check_list_size(
    resource: &str,
    inventory: &Inventory,
    naming: &Naming,
) -> Result<usize, super::KubeletError> {
    use prost::Message as _;
    let mut worst = list_response(inventory, naming);
    for device in &mut worst.devices {
        device.health = crate::devices::Health::Unhealthy.as_api_str().to_string();
    }
    let bytes = worst.encoded_len() + GRPC_FRAME_HEADER;
    if bytes <= KUBELET_MAX_MESSAGE_BYTES {
        return Ok(bytes);
    }
    let devices = worst.devices.len();
    Err(super::KubeletError::ListTooLarge {
        resource: resource.to_string(),
        bytes,
        devices,
        limit: KUBELET_MAX_MESSAGE_BYTES,
        fit: KUBELET_MAX_MESSAGE_BYTES * devices / bytes,
    })
}

impl From<PreStartError> for Status {
    fn from(e: PreStartError) -> Self {
        Status::failed_precondition(crate::util::text::status_message(&e.to_string()))
    }
}

/// The one place an allocation's refusal becomes a gRPC status: its text (which may quote a device ID or a
/// fence's reason) through [`crate::util::text::status_message`].
impl From<AllocationError> for Status {
    fn from(e: AllocationError) -> Self {
        let message = crate::util::text::status_message(&e.to_string());
        match e {
            AllocationError::UnhealthyDevice { .. } => Status::failed_precondition(message),
            AllocationError::NoContainers
            | AllocationError::NoDevices(_)
            | AllocationError::UnknownDevice(_)
            | AllocationError::DuplicateDevice(_)
            | AllocationError::SharedRequestTooLarge(_)
            | AllocationError::BadSize { .. } => Status::invalid_argument(message),
        }
    }
}

type ListStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for PluginService {
    async fn get_device_plugin_options(
        &self,
        _request: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(plugin_options(self.pre_start_check)))
    }

    type ListAndWatchStream = ListStream;

    /// The current list at once, then the latest list after every change. `WatchStream` coalesces: a reader
    /// slower than the changes gets the newest list, never a queue. Changes the kubelet cannot see (a new
    /// reason on an already Unhealthy device) are not re-sent. The stream never ends with an error: it ends
    /// at shutdown, or when the kubelet goes away and tonic drops it.
    async fn list_and_watch(
        &self,
        _request: Request<Empty>,
    ) -> Result<Response<ListStream>, Status> {
        let mut last_sent: Option<u64> = None;
        let open = OpenStream::new(&self.streams);
        let number = open.number;
        let mut end_through = self.end_through.subscribe();
        let ended = async move {
            // A sender gone is a server stopping: the shutdown token ends the stream then.
            if end_through
                .wait_for(|through| *through >= number)
                .await
                .is_err()
            {
                std::future::pending::<()>().await;
            }
        };
        let naming = self.options.naming.clone();
        let stream = WatchStream::new(self.inventory.clone())
            .filter_map(move |inventory: Arc<Inventory>| {
                let version = inventory.listed_version();
                let changed = last_sent != Some(version);
                last_sent = Some(version);
                std::future::ready(changed.then(|| Ok(list_response(&inventory, &naming))))
            })
            // If the inventory's sender is ever gone, keep the stream open on the last list: an ended
            // stream makes the kubelet mark every device unhealthy and it never re-opens it.
            .chain(futures_util::stream::pending())
            .take_until(self.shutdown.clone().cancelled_owned())
            .take_until(ended)
            // The whole stream owns the guard, so it counts as open until tonic drops it: a part of it that
            // ends early (the list's watch, once its sender is gone) is not the kubelet closing the stream.
            .inspect(move |_| {
                let _open = &open;
            });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let inventory = self.inventory.borrow().clone();
        let container_responses = request
            .get_ref()
            .container_requests
            .iter()
            .map(|c| {
                let ask = PreferenceRequest {
                    available: &c.available_device_i_ds,
                    must_include: &c.must_include_device_i_ds,
                    size: c.allocation_size,
                };
                allocation::preferred_named(&inventory, &self.options.naming, &ask)
                    .map(|device_i_ds| ContainerPreferredAllocationResponse { device_i_ds })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Response::new(PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let inventory = self.inventory.borrow().clone();
        let containers: Vec<Vec<String>> = request
            .into_inner()
            .container_requests
            .into_iter()
            .map(|c| c.devices_ids)
            .collect();
        match allocation::allocate(&inventory, &containers, &self.options, |p| p.exists()) {
            Ok(container_responses) => {
                self.count("Allocate", tonic::Code::Ok);
                // One container's devices comma-separated, containers apart by `; `: read by people, not parsed.
                let devices: Vec<String> = containers.iter().map(|c| c.join(",")).collect();
                tracing::info!(devices = %devices.join("; "), "allocated");
                Ok(Response::new(AllocateResponse {
                    container_responses,
                }))
            }
            Err(e) => {
                tracing::warn!(
                    devices = %allocation::echoed_ids(containers.iter().flatten()),
                    error = %e,
                    "refused allocation"
                );
                let status = Status::from(e);
                self.count("Allocate", status.code());
                Err(status)
            }
        }
    }

    /// The health gate: a container starts only on devices that are here and Healthy now; a refusal's text
    /// ends up in the pod's events, so it is each device's health message.
    async fn pre_start_container(
        &self,
        request: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        let ids = request.into_inner().devices_ids;
        let inventory = self.inventory.borrow().clone();
        match allocation::pre_start_named(&inventory, &self.options.naming, &ids) {
            Ok(()) => {
                self.count("PreStartContainer", tonic::Code::Ok);
                Ok(Response::new(PreStartContainerResponse {}))
            }
            Err(e) => {
                tracing::warn!(
                    devices = %allocation::echoed_ids(&ids),
                    error = %e,
                    "refused a container start"
                );
                let status = Status::from(e);
                self.count("PreStartContainer", status.code());
                Err(status)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{DeviceInfo, Health};
    use std::time::Duration;
    use tokio::sync::watch;

    const WAIT: Duration = Duration::from_secs(5);

    fn inventory(n: usize) -> Inventory {
        Inventory::new((0..n).map(|i| DeviceInfo {
            id: format!("g{i}"),
            numa_node: None,
            ..DeviceInfo::default()
        }))
    }

    fn set(tx: &watch::Sender<Arc<Inventory>>, id: &str, health: Health, reason: &str) {
        tx.send_modify(|inv| {
            let mut next = Inventory::clone(inv);
            next.set_health(id, health, Some(reason.into()));
            *inv = Arc::new(next);
        });
    }

    async fn open(service: &PluginService) -> ListStream {
        let response = service.list_and_watch(Request::new(Empty {})).await;
        match response {
            Ok(r) => r.into_inner(),
            Err(status) => panic!("ListAndWatch refused: {status}"),
        }
    }

    async fn next(stream: &mut ListStream) -> Option<ListAndWatchResponse> {
        tokio::time::timeout(WAIT, stream.next())
            .await
            .ok()
            .flatten()
            .and_then(Result::ok)
    }

    fn unhealthy(list: &ListAndWatchResponse) -> Vec<&str> {
        list.devices
            .iter()
            .filter(|d| d.health == "Unhealthy")
            .map(|d| d.id.as_str())
            .collect()
    }

    #[tokio::test]
    async fn the_newest_stream_ending_is_told_apart_from_an_older_one_ending() {
        let (_tx, rx) = watch::channel(Arc::new(inventory(1)));
        let service = PluginService::new(rx, AllocateOptions::default(), CancellationToken::new());
        let streams = service.streams();
        let older = open(&service).await;
        let newer = open(&service).await;
        assert_eq!(
            (streams.borrow().open, streams.borrow().newest_ended),
            (2, false)
        );
        // An older stream (a client the kubelet replaced) ending says nothing about the one in use.
        drop(older);
        assert_eq!(
            (streams.borrow().open, streams.borrow().newest_ended),
            (1, false)
        );
        let newest = open(&service).await;
        drop(newer);
        assert!(!streams.borrow().newest_ended);
        // The newest ending is the kubelet letting us go, though an older one may still be open.
        let _kept = open(&service).await;
        let last = open(&service).await;
        drop(newest);
        assert!(!streams.borrow().newest_ended);
        drop(last);
        assert_eq!(
            (streams.borrow().open, streams.borrow().newest_ended),
            (1, true)
        );
    }

    #[tokio::test]
    async fn a_slow_watcher_gets_the_latest_list_not_a_backlog() {
        let (tx, rx) = watch::channel(Arc::new(inventory(4)));
        let service = PluginService::new(rx, AllocateOptions::default(), CancellationToken::new());
        let mut stream = open(&service).await;
        assert!(
            next(&mut stream)
                .await
                .is_some_and(|l| unhealthy(&l).is_empty())
        );
        for round in 0..=100 {
            let health = if round % 2 == 0 {
                Health::Unhealthy
            } else {
                Health::Healthy
            };
            set(&tx, "g1", health, "flapping");
        }
        set(&tx, "g2", Health::Unhealthy, "XID 79");
        let list = next(&mut stream).await;
        assert_eq!(list.as_ref().map(unhealthy), Some(vec!["g1", "g2"]));
    }

    #[tokio::test]
    async fn a_change_the_kubelet_cannot_see_is_not_resent() {
        let (tx, rx) = watch::channel(Arc::new(inventory(2)));
        let service = PluginService::new(rx, AllocateOptions::default(), CancellationToken::new());
        let mut stream = open(&service).await;
        next(&mut stream).await;
        set(&tx, "g0", Health::Unhealthy, "XID 79");
        assert!(next(&mut stream).await.is_some());
        // Same health, new reason: Allocate's message changes, the list does not.
        set(&tx, "g0", Health::Unhealthy, "XID 79, seen twice");
        set(&tx, "g1", Health::Unhealthy, "XID 48");
        let list = next(&mut stream).await;
        assert_eq!(list.as_ref().map(unhealthy), Some(vec!["g0", "g1"]));
    }

    // Paused clock: the quiet period below passes instantly and cannot flake on a slow machine.
    #[tokio::test(start_paused = true)]
    async fn the_stream_stays_open_if_the_inventory_goes_away_and_ends_cleanly_at_shutdown() {
        let (tx, rx) = watch::channel(Arc::new(inventory(1)));
        let shutdown = CancellationToken::new();
        let service = PluginService::new(rx, AllocateOptions::default(), shutdown.clone());
        let mut stream = open(&service).await;
        next(&mut stream).await;
        drop(tx);
        let still_open = tokio::time::timeout(Duration::from_millis(50), stream.next()).await;
        assert!(
            still_open.is_err(),
            "the stream ended or sent something after the inventory went away"
        );
        shutdown.cancel();
        let end = tokio::time::timeout(WAIT, stream.next()).await;
        assert!(
            matches!(end, Ok(None)),
            "expected a clean end of stream, got {end:?}"
        );
    }

    #[test]
    fn a_device_list_over_the_kubelets_message_limit_is_refused_with_its_size() {
        let inventory = inventory(12);
        let naming = |replicas| Naming {
            replicas,
            ..Naming::default()
        };
        let fits = check_list_size("nvidia.com/gpu", &inventory, &naming(64));
        assert!(fits.is_ok_and(|bytes| bytes < KUBELET_MAX_MESSAGE_BYTES));
        let refused = check_list_size("nvidia.com/gpu", &inventory, &naming(100_000))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            refused.contains("nvidia.com/gpu")
                && refused.contains("(1200000 devices)")
                && refused.contains("more than the 4194304 bytes"),
            "{refused}"
        );
    }

    #[test]
    fn allocation_errors_map_to_the_grpc_codes_the_kubelet_expects() {
        let unhealthy = Status::from(AllocationError::UnhealthyDevice {
            id: "g0".into(),
            reason: "XID 79".into(),
        });
        assert_eq!(unhealthy.code(), tonic::Code::FailedPrecondition);
        assert!(unhealthy.message().contains("g0") && unhealthy.message().contains("XID 79"));
        let unknown = Status::from(AllocationError::UnknownDevice("x".into()));
        assert_eq!(unknown.code(), tonic::Code::InvalidArgument);
    }

    #[test]
    fn a_refusal_quoting_huge_outside_text_reaches_the_kubelet_escaped_and_small() {
        let refused = Status::from(AllocationError::UnhealthyDevice {
            id: "g0".into(),
            reason: format!("fenced: {}\n\u{202E}forged", "r".repeat(10 << 20)),
        });
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
        let message = refused.message();
        assert!(
            message.len() <= crate::util::text::STATUS_MESSAGE_MAX,
            "{}",
            message.len()
        );
        assert!(message.contains("g0") && message.contains("more bytes)"));
        let refused = Status::from(AllocationError::UnhealthyDevice {
            id: "g0".into(),
            reason: "fenced\n\u{202E}forged".into(),
        });
        assert!(
            refused.message().contains("fenced\\n\\u{202e}forged"),
            "{}",
            refused.message()
        );
    }
}
