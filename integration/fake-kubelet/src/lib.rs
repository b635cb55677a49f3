//! A stand-in for the kubelet's device manager, for testing and benchmarking device plugins on a machine with
//! no node. It behaves as the real one does where a plugin can tell:
//!
//! - serves `Registration` on `<dir>/kubelet.sock`; `Register` checks the version and the resource name, dials
//!   the plugin's socket back and calls `GetDevicePluginOptions` **before** answering, so a plugin that is not
//!   serving yet fails to register. A registration the kubelet has accepted stays accepted when the plugin
//!   gives up waiting for the answer (grpc-go runs the handler to its end);
//! - then opens `ListAndWatch`; it never re-opens a stream that ended;
//! - keeps its clients as one of two device managers ([`DeviceManager`]): kubelets up to 1.36 (one client per
//!   resource; the end of *any* client's stream disconnects the *current* one), or later ones (one client
//!   per plugin socket, the newest used);
//! - a disconnected client's devices all become Unhealthy (allocatable 0), as the kubelet marks them;
//! - [`FakeKubelet::restart`] stops, deletes every socket in the directory as the kubelet does when it starts,
//!   and creates `kubelet.sock` again, binding then listening as the kubelet does: a plugin that connects the
//!   instant inotify reports the file can be refused, as with the real one;
//! - Allocate replies must carry one response per container, or the call fails as it would in the kubelet.
//!
//! Tests wait on its state with timeouts ([`FakeKubelet::wait_registrations`], [`FakeKubelet::wait_list`]);
//! nothing here sleeps.

pub mod apiserver;
pub mod dra;
mod pod_resources;

use std::collections::HashMap;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use gpu_device_plugin::api::device_plugin_client::DevicePluginClient;
use gpu_device_plugin::api::registration_server::{Registration, RegistrationServer};
use gpu_device_plugin::api::{
    AllocateRequest, AllocateResponse, ContainerAllocateRequest,
    ContainerPreferredAllocationRequest, Device, DevicePluginOptions, Empty, KUBELET_SOCKET,
    PreStartContainerRequest, PreferredAllocationRequest, PreferredAllocationResponse,
    RegisterRequest, VERSION,
};
use gpu_device_plugin::config::check_extended_resource_name;
use gpu_device_plugin::util::{authority, uds};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

pub use dra::{DraKubelet, DraOptions};

/// The kubelet gives a plugin this long to answer its dial-back during `Register`.
const DIAL_BACK_TIMEOUT: Duration = Duration::from_secs(10);

/// Name of the kubelet's checkpoint file; the kubelet keeps it across restarts (it is not a socket).
pub const CHECKPOINT_FILE: &str = "kubelet_internal_checkpoint";

/// Which kubelet device manager to behave as. They differ only when two plugin instances serve one resource,
/// as during a rolling update with surge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceManager {
    /// Kubelets 1.25 to 1.36 (before kubernetes PR #135437): one client per resource. A new registration
    /// replaces the current client without closing the old one, whose stream stays open and whose lists
    /// still update the resource. When any client's ListAndWatch ends, the kubelet looks the client up by
    /// resource name and disconnects the *current* one: its connection is closed and every device of the
    /// resource becomes Unhealthy. So an old instance exiting cuts the new one off.
    #[default]
    Legacy,
    /// Kubelets with PR #135437: one client per plugin socket; the newest registration is the one used, and
    /// the end of a stream disconnects only the client it belongs to (the resource's devices become
    /// Unhealthy only when that client is the one in use).
    MultiClient,
}

/// One accepted registration.
#[derive(Debug, Clone)]
pub struct Registered {
    /// Socket file name the plugin registered.
    pub endpoint: String,
    /// Resource name.
    pub resource_name: String,
    /// Options the plugin registered with.
    pub options: Option<DevicePluginOptions>,
    /// Options the plugin answered on the dial-back.
    pub dialed_options: DevicePluginOptions,
    /// When `Register` arrived.
    pub received_at: Instant,
}

/// What the fake kubelet has seen on ListAndWatch: the resource as the device manager holds it.
#[derive(Debug, Clone, Default)]
pub struct ListState {
    /// Which registration (1-based count) the resource's list now follows: the one accepted last, or, with
    /// the legacy device manager, whichever live client sent the latest list. 0 before any.
    pub registration: usize,
    /// Lists received from that registration.
    pub messages: u64,
    /// Lists received from every registration.
    pub total_messages: u64,
    /// The resource's devices: the latest complete list, with every device Unhealthy once the client in use
    /// was disconnected.
    pub devices: Vec<Device>,
    /// When the latest list arrived.
    pub received_at: Option<Instant>,
    /// How the stream of the client in use ended, if it did while the kubelet was running: `Ok` for a clean
    /// end of stream, `Err` with the status for an error. The kubelet never re-opens it either way.
    pub ended: Option<Result<(), String>>,
    /// Whether the client in use was disconnected (its devices all Unhealthy) and no registration came since.
    pub disconnected: bool,
    /// Times the legacy device manager disconnected the client in use because *another* client's stream
    /// ended (the rolling-update defect of kubelets up to 1.36).
    pub cut_by_other: usize,
    /// Streams that ended with an error over the life of this fake.
    pub errors: Vec<String>,
}

impl ListState {
    /// Health of device `id` in the latest list.
    pub fn health(&self, id: &str) -> Option<&str> {
        self.devices
            .iter()
            .find(|d| d.id == id)
            .map(|d| d.health.as_str())
    }

    /// Number of devices the kubelet would count allocatable (health exactly `Healthy`).
    pub fn allocatable(&self) -> usize {
        self.devices
            .iter()
            .filter(|d| d.health == "Healthy")
            .count()
    }
}

/// Errors from the fake kubelet's own operations.
#[derive(Debug, thiserror::Error)]
pub enum FakeKubeletError {
    /// Binding `kubelet.sock` failed.
    #[error("cannot bind {path}: {source}")]
    Bind {
        /// Socket path.
        path: String,
        /// OS error.
        source: std::io::Error,
    },
    /// Cleaning the directory failed.
    #[error("cannot clean {path}: {source}")]
    Clean {
        /// Directory.
        path: String,
        /// OS error.
        source: std::io::Error,
    },
    /// A wait ran out of time.
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(Duration, String),
    /// No plugin is registered.
    #[error("no plugin is registered")]
    NotRegistered,
}

/// One client of the device manager: a connection to a plugin socket and the task reading its stream.
/// Dropping it closes the connection.
struct Client {
    registration: usize,
    endpoint: String,
    /// The plugin asked (in GetDevicePluginOptions) for PreStartContainer calls.
    pre_start_required: bool,
    /// The plugin offers GetPreferredAllocation.
    preferred_allocation: bool,
    client: DevicePluginClient<Channel>,
    _reader: Option<AbortOnDropHandle<()>>,
}

#[derive(Default)]
struct Clients {
    /// Every client whose connection is open, oldest first. With the legacy device manager this includes
    /// clients replaced by a newer registration: the kubelet never closes them.
    live: Vec<Client>,
    /// The registration each resource uses (its client is in `live`).
    current: HashMap<String, usize>,
}

struct Shared {
    dir: PathBuf,
    manager: DeviceManager,
    registrations: watch::Sender<Vec<Registered>>,
    /// The ListAndWatch state of the first resource ever registered (the one a plugin with one resource
    /// serves), which the methods without a resource argument read.
    lists: watch::Sender<ListState>,
    /// Which resource `lists` follows; `None` before the first registration.
    primary: Mutex<Option<String>>,
    /// The state of every other resource, as the device manager keeps one per resource.
    other_lists: Mutex<HashMap<String, watch::Sender<ListState>>>,
    clients: Mutex<Clients>,
    /// While true, `Register` waits after accepting a plugin, before answering (see
    /// [`FakeKubelet::hold_registrations`]).
    hold: watch::Sender<bool>,
    /// Cancelled when the running kubelet stops: its work in progress (a `Register` being accepted) dies
    /// with it, as a kubelet's goroutines die with its process.
    alive: Mutex<CancellationToken>,
    /// Whether an accepted registration gets its ListAndWatch (see [`FakeKubelet::open_streams`]).
    open_streams: std::sync::atomic::AtomicBool,
    /// Which pods' containers hold which devices, for the pod-resources API.
    pods: Arc<Mutex<pod_resources::PodTable>>,
    /// Pod-resources calls answered.
    pod_calls: Arc<std::sync::atomic::AtomicU64>,
}

/// A running fake kubelet on one directory.
pub struct FakeKubelet {
    shared: Arc<Shared>,
    server: Option<AbortOnDropHandle<()>>,
    /// Where the pod-resources API is served, if it is ([`FakeKubelet::serve_pod_resources`]).
    pod_resources: Option<PathBuf>,
    /// Stops the pod-resources server's thread when dropped.
    pod_server: Option<tokio_util::sync::DropGuard>,
}

impl FakeKubelet {
    /// Starts serving `Registration` on `<dir>/kubelet.sock` as the legacy device manager (kubelets up to
    /// 1.36); writes the checkpoint file as the kubelet does.
    pub async fn start(dir: &Path) -> Result<Self, FakeKubeletError> {
        Self::start_as(dir, DeviceManager::Legacy).await
    }

    /// Starts as the given device manager.
    pub async fn start_as(dir: &Path, manager: DeviceManager) -> Result<Self, FakeKubeletError> {
        let shared = Arc::new(Shared {
            dir: dir.to_owned(),
            manager,
            registrations: watch::Sender::new(Vec::new()),
            lists: watch::Sender::new(ListState::default()),
            primary: Mutex::new(None),
            other_lists: Mutex::default(),
            clients: Mutex::new(Clients::default()),
            hold: watch::Sender::new(false),
            alive: Mutex::new(CancellationToken::new()),
            open_streams: std::sync::atomic::AtomicBool::new(true),
            pods: Arc::default(),
            pod_calls: Arc::default(),
        });
        let mut kubelet = FakeKubelet {
            shared,
            server: None,
            pod_resources: None,
            pod_server: None,
        };
        kubelet.serve()?;
        Ok(kubelet)
    }

    fn serve(&mut self) -> Result<(), FakeKubeletError> {
        let dir = &self.shared.dir;
        let _kept = std::fs::write(dir.join(CHECKPOINT_FILE), b"{}");
        let path = dir.join(KUBELET_SOCKET);
        // A socket a dead kubelet left behind is replaced, as the kubelet's clean-up at start does; a live
        // one (another kubelet on this directory) answers and makes the bind below fail.
        if std::os::unix::net::UnixStream::connect(&path)
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
        {
            let _stale = std::fs::remove_file(&path);
        }
        let listener = UnixListener::bind(&path).map_err(|source| FakeKubeletError::Bind {
            path: path.display().to_string(),
            source,
        })?;
        let alive = CancellationToken::new();
        if let Ok(mut current) = self.shared.alive.lock() {
            *current = alive.clone();
        }
        let service = RegistrationServer::new(RegistrationService {
            shared: self.shared.clone(),
            alive,
        });
        // Every connection reaches the gRPC server through the relay that accepts any :authority, as the
        // kubelet does. The relays live in this task: stopping the kubelet closes every connection.
        let task = tokio::spawn(async move {
            let (to_server, incoming) = mpsc::channel::<UnixStream>(16);
            let server = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(ReceiverStream::new(incoming).map(Ok::<_, std::io::Error>));
            tokio::pin!(server);
            let mut relays = JoinSet::new();
            loop {
                tokio::select! {
                    _stopped = &mut server => return,
                    accepted = listener.accept() => {
                        let Ok((client, _)) = accepted else { continue };
                        let Ok((ours, theirs)) = UnixStream::pair() else { continue };
                        relays.spawn(authority::relay(client, ours, authority::usable_authority));
                        if to_server.send(theirs).await.is_err() {
                            return;
                        }
                    }
                    Some(_done) = relays.join_next(), if !relays.is_empty() => {}
                }
            }
        });
        self.server = Some(AbortOnDropHandle::new(task));
        if let Some(path) = self.pod_resources.clone() {
            self.serve_pod_resources(&path)?;
        }
        Ok(())
    }

    /// Serves the pod-resources API v1 on the socket at `path` (the kubelet's is
    /// `/var/lib/kubelet/pod-resources/kubelet.sock`), from now on and after every restart, until the kubelet
    /// stops. It lists the containers given devices by [`FakeKubelet::allocate_to`].
    pub fn serve_pod_resources(&mut self, path: &Path) -> Result<(), FakeKubeletError> {
        let _stale = std::fs::remove_file(path);
        let bind_err = |source| FakeKubeletError::Bind {
            path: path.display().to_string(),
            source,
        };
        let listener = std::os::unix::net::UnixListener::bind(path).map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        let service = gpu_device_plugin::api::pod_resources::pod_resources_lister_server::PodResourcesListerServer::new(
            pod_resources::Service::new(self.shared.pods.clone(), self.shared.pod_calls.clone()),
        );
        // A thread and runtime of its own, as the kubelet serves it from other threads than the device
        // manager's: its calls never hold up the device plugin side (a benchmark's time-stamps among it).
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        gpu_device_plugin::util::runtime::spawn_on_own_thread(
            "pod-resources",
            gpu_device_plugin::util::runtime::Priority::Side,
            async move {
                let Ok(listener) = UnixListener::from_std(listener) else {
                    return;
                };
                let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
                let server = tonic::transport::Server::builder()
                    .add_service(service)
                    .serve_with_incoming_shutdown(incoming, stopped.cancelled());
                let _ended = server.await;
            },
        )
        .map_err(bind_err)?;
        self.pod_resources = Some(path.to_owned());
        self.pod_server = Some(stop.drop_guard());
        Ok(())
    }

    /// Pod-resources calls answered so far (rate-limited calls not counted).
    pub fn pod_resources_calls(&self) -> u64 {
        self.shared
            .pod_calls
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Starts container `container` of pod `namespace/pod` with `devices` as the kubelet does: Allocate on
    /// the registered plugin, and on success the pod-resources API lists the container with the devices
    /// under the registered resource name.
    pub async fn allocate_to(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
        devices: &[&str],
    ) -> Result<AllocateResponse, Status> {
        let response = self.allocate(&[devices]).await?;
        let resource = self.resource_name();
        if let Ok(mut pods) = self.shared.pods.lock() {
            pods.assign(
                namespace,
                pod,
                container,
                &resource,
                devices.iter().map(|s| s.to_string()).collect(),
            );
        }
        Ok(response)
    }

    /// The resource the methods without a resource argument act on: the first one registered (empty before
    /// any).
    fn resource_name(&self) -> String {
        self.shared
            .primary
            .lock()
            .ok()
            .and_then(|p| p.clone())
            .unwrap_or_default()
    }

    /// Admits a container asking for `count` of the resource, as the kubelet's device manager does: the
    /// devices it may get are the Healthy ones of the latest list that no container holds (the kubelet's own
    /// record, which outlives any plugin); the plugin's GetPreferredAllocation chooses among them when it
    /// offers it (an answer that is not `count` of them is ignored, as the kubelet ignores it), otherwise the
    /// first in ID order; then Allocate, and the container holds them. Too few → `RESOURCE_EXHAUSTED` with the
    /// kubelet's message. Returns the devices and the plugin's answer.
    pub async fn admit(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
        count: usize,
    ) -> Result<(Vec<String>, AllocateResponse), Status> {
        let resource = self.resource_name();
        let held = self
            .shared
            .pods
            .lock()
            .map(|pods| pods.held(&resource))
            .unwrap_or_default();
        let mut available: Vec<String> = self
            .list()
            .devices
            .iter()
            .filter(|d| d.health == "Healthy" && !held.contains(&d.id))
            .map(|d| d.id.clone())
            .collect();
        available.sort();
        if available.len() < count {
            return Err(Status::resource_exhausted(format!(
                "requested number of devices unavailable for {resource}. Requested: {count}, Available: {}",
                available.len()
            )));
        }
        let offers = self
            .current(|c| c.preferred_allocation)
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let mut chosen: Vec<String> = available[..count].to_vec();
        if offers && count < available.len() {
            let ids: Vec<&str> = available.iter().map(String::as_str).collect();
            let size = i32::try_from(count).map_err(|_| Status::invalid_argument("count"))?;
            let preferred = self.preferred_allocation(&ids, &[], size).await?;
            if preferred.len() == count && preferred.iter().all(|id| available.contains(id)) {
                chosen = preferred;
            }
        }
        let ids: Vec<&str> = chosen.iter().map(String::as_str).collect();
        let response = self.allocate_to(namespace, pod, container, &ids).await?;
        Ok((chosen, response))
    }

    /// Removes a pod (it ended): the pod-resources API no longer lists it. Returns whether it was there.
    pub fn remove_pod(&self, namespace: &str, pod: &str) -> bool {
        self.shared
            .pods
            .lock()
            .map(|mut pods| pods.remove(namespace, pod))
            .unwrap_or(false)
    }

    /// The device plugin directory.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// The device manager this fake behaves as.
    pub fn manager(&self) -> DeviceManager {
        self.shared.manager
    }

    /// Stops the kubelet: closes `kubelet.sock` and every connection to the plugin, as a dying kubelet does.
    pub fn stop(&mut self) {
        if let Ok(alive) = self.shared.alive.lock() {
            alive.cancel();
        }
        self.server = None;
        self.pod_server = None;
        if let Some(path) = &self.pod_resources {
            let _gone = std::fs::remove_file(path);
        }
        let clients = self
            .shared
            .clients
            .lock()
            .map(|mut c| std::mem::take(&mut *c));
        drop(clients);
        let _gone = std::fs::remove_file(self.shared.dir.join(KUBELET_SOCKET));
    }

    /// Makes `Register` wait, after it has accepted a plugin (dialled back, client in place, stream opening)
    /// and before it answers, until [`FakeKubelet::release_registrations`]: a slow kubelet, for testing what
    /// a plugin does while its `Register` is in flight.
    pub fn hold_registrations(&self) {
        self.shared.hold.send_replace(true);
    }

    /// With `false`, registrations are accepted but no ListAndWatch is opened for them: what a plugin sees
    /// when the kubelet lost it between answering and opening the stream (it died, or a newer registration
    /// replaced and another stream's end cut the client). `true` (the default) restores the kubelet's way.
    pub fn open_streams(&self, open: bool) {
        self.shared
            .open_streams
            .store(open, std::sync::atomic::Ordering::SeqCst);
    }

    /// Lets held and later `Register` calls answer.
    pub fn release_registrations(&self) {
        self.shared.hold.send_replace(false);
    }

    /// Open connections to plugins (clients), with the registration number of each. With the legacy device
    /// manager a replaced client stays open.
    pub fn clients(&self) -> Vec<(usize, String)> {
        self.shared
            .clients
            .lock()
            .map(|c| {
                c.live
                    .iter()
                    .map(|c| (c.registration, c.endpoint.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Restarts as the kubelet does: stop, delete every socket in the directory (plugins' included, the
    /// checkpoint file kept), create `kubelet.sock` again.
    pub fn restart(&mut self) -> Result<(), FakeKubeletError> {
        self.stop();
        delete_sockets(&self.shared.dir)?;
        self.serve()
    }

    /// Restarts (see [`FakeKubelet::restart`]) and waits for the plugin to register again; returns the new
    /// registration and the time from the start of the restart to the `Register` call arriving.
    pub async fn restart_and_wait(
        &mut self,
        timeout: Duration,
    ) -> Result<(Registered, Duration), FakeKubeletError> {
        let restarted = Instant::now();
        self.restart()?;
        // The first registration that arrived after the restart began; a late second registration from
        // before it (a plugin that registered twice) does not count.
        let mut rx = self.shared.registrations.subscribe();
        let waited = tokio::time::timeout(
            timeout,
            rx.wait_for(|r| r.iter().any(|reg| reg.received_at >= restarted)),
        )
        .await;
        let registered = match waited {
            Ok(Ok(regs)) => regs
                .iter()
                .find(|reg| reg.received_at >= restarted)
                .cloned(),
            _ => None,
        };
        let registered = registered.ok_or_else(|| {
            FakeKubeletError::Timeout(timeout, "registration after restart".into())
        })?;
        let took = registered.received_at.saturating_duration_since(restarted);
        Ok((registered, took))
    }

    /// Registrations so far, oldest first.
    pub fn registrations(&self) -> Vec<Registered> {
        self.shared.registrations.borrow().clone()
    }

    /// Waits until at least `count` registrations have been accepted; returns them all.
    pub async fn wait_registrations(
        &self,
        count: usize,
        timeout: Duration,
    ) -> Result<Vec<Registered>, FakeKubeletError> {
        let mut rx = self.shared.registrations.subscribe();
        let waited = tokio::time::timeout(timeout, rx.wait_for(|r| r.len() >= count)).await;
        match waited {
            Ok(Ok(regs)) => Ok(regs.clone()),
            _ => Err(FakeKubeletError::Timeout(
                timeout,
                format!("registration #{count}"),
            )),
        }
    }

    /// Follows the registrations as they are accepted.
    pub fn watch_registrations(&self) -> watch::Receiver<Vec<Registered>> {
        self.shared.registrations.subscribe()
    }

    /// Follows the ListAndWatch state as it changes.
    pub fn watch_list(&self) -> watch::Receiver<ListState> {
        self.shared.lists.subscribe()
    }

    /// The latest ListAndWatch state.
    pub fn list(&self) -> ListState {
        self.shared.lists.borrow().clone()
    }

    /// The latest ListAndWatch state of `resource` (default before it registered).
    pub fn list_of(&self, resource: &str) -> ListState {
        self.shared.lists_of(resource).borrow().clone()
    }

    /// Waits until `resource`'s ListAndWatch state satisfies `pred`; returns that state.
    pub async fn wait_list_of(
        &self,
        resource: &str,
        what: &str,
        timeout: Duration,
        pred: impl FnMut(&ListState) -> bool,
    ) -> Result<ListState, FakeKubeletError> {
        let mut rx = self.shared.lists_of(resource).subscribe();
        let waited = tokio::time::timeout(timeout, rx.wait_for(pred)).await;
        match waited {
            Ok(Ok(state)) => Ok(state.clone()),
            _ => Err(FakeKubeletError::Timeout(timeout, what.to_string())),
        }
    }

    /// Calls Allocate on the plugin registered for `resource`, one container per entry of `containers`.
    pub async fn allocate_on(
        &self,
        resource: &str,
        containers: &[&[&str]],
    ) -> Result<AllocateResponse, Status> {
        let client = self
            .current_of(resource, |c| c.client.clone())
            .map_err(|e| Status::unavailable(e.to_string()))?;
        allocate_with(client, containers).await
    }

    /// Waits until the ListAndWatch state satisfies `pred`; returns that state.
    pub async fn wait_list(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl FnMut(&ListState) -> bool,
    ) -> Result<ListState, FakeKubeletError> {
        let mut rx = self.shared.lists.subscribe();
        let waited = tokio::time::timeout(timeout, rx.wait_for(pred)).await;
        match waited {
            Ok(Ok(state)) => Ok(state.clone()),
            _ => Err(FakeKubeletError::Timeout(timeout, what.to_string())),
        }
    }

    fn client(&self) -> Result<DevicePluginClient<Channel>, FakeKubeletError> {
        self.current(|c| c.client.clone())
    }

    fn current<T>(&self, f: impl FnOnce(&Client) -> T) -> Result<T, FakeKubeletError> {
        self.current_of(&self.resource_name(), f)
    }

    fn current_of<T>(
        &self,
        resource: &str,
        f: impl FnOnce(&Client) -> T,
    ) -> Result<T, FakeKubeletError> {
        let clients = self
            .shared
            .clients
            .lock()
            .map_err(|_| FakeKubeletError::NotRegistered)?;
        let current = *clients
            .current
            .get(resource)
            .ok_or(FakeKubeletError::NotRegistered)?;
        clients
            .live
            .iter()
            .find(|c| c.registration == current)
            .map(f)
            .ok_or(FakeKubeletError::NotRegistered)
    }

    /// Starts a container holding `devices` as the kubelet does: if the plugin asked for it, PreStartContainer
    /// first, and a refusal fails the start (the kubelet then reports `CreateContainerConfigError` with the
    /// refusal's text in a pod event, and tries again at the container's next restart). Returns whether
    /// PreStartContainer was called.
    pub async fn start_container(&self, devices: &[&str]) -> Result<bool, Status> {
        let (required, mut client) = self
            .current(|c| (c.pre_start_required, c.client.clone()))
            .map_err(|e| Status::unavailable(e.to_string()))?;
        if !required {
            return Ok(false);
        }
        let request = PreStartContainerRequest {
            devices_ids: devices.iter().map(|s| s.to_string()).collect(),
        };
        client.pre_start_container(request).await?;
        Ok(true)
    }

    /// Calls Allocate on the registered plugin, one container per entry of `containers`. A reply without one
    /// response per container is turned into an `INTERNAL` error, as the kubelet rejects it.
    pub async fn allocate(&self, containers: &[&[&str]]) -> Result<AllocateResponse, Status> {
        let client = self
            .client()
            .map_err(|e| Status::unavailable(e.to_string()))?;
        allocate_with(client, containers).await
    }

    /// Calls GetPreferredAllocation on the registered plugin for one container.
    pub async fn preferred_allocation(
        &self,
        available: &[&str],
        must_include: &[&str],
        size: i32,
    ) -> Result<Vec<String>, Status> {
        let mut client = self
            .client()
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let strings = |ids: &[&str]| ids.iter().map(|s| s.to_string()).collect();
        let request = PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: strings(available),
                must_include_device_i_ds: strings(must_include),
                allocation_size: size,
            }],
        };
        let PreferredAllocationResponse {
            container_responses,
        } = client.get_preferred_allocation(request).await?.into_inner();
        if container_responses.len() != 1 {
            return Err(Status::internal(format!(
                "plugin returned {} preferred allocations for 1 container",
                container_responses.len()
            )));
        }
        Ok(container_responses
            .into_iter()
            .flat_map(|c| c.device_i_ds)
            .collect())
    }
}

impl Drop for FakeKubelet {
    /// A fake kubelet that goes away does what a dying kubelet does: its socket and every connection to the
    /// plugins close.
    fn drop(&mut self) {
        self.stop();
    }
}

/// Deletes every socket in `dir`, as the kubelet's device manager does when it starts.
pub fn delete_sockets(dir: &Path) -> Result<(), FakeKubeletError> {
    let clean_err = |source| FakeKubeletError::Clean {
        path: dir.display().to_string(),
        source,
    };
    for entry in std::fs::read_dir(dir).map_err(clean_err)? {
        let entry = entry.map_err(clean_err)?;
        if entry.file_type().map_err(clean_err)?.is_socket() {
            let _raced = std::fs::remove_file(entry.path());
        }
    }
    Ok(())
}

struct RegistrationService {
    shared: Arc<Shared>,
    /// This kubelet's life: cancelled when it stops.
    alive: CancellationToken,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        // grpc-go runs a handler to its end even when the caller gives up on it (its context is cancelled,
        // and the kubelet's Register does not look): a plugin that abandons a Register may still have been
        // accepted. hyper would drop this future on the caller's reset, so the work runs in a task of its own.
        // It dies with the kubelet, though.
        let (shared, alive) = (self.shared.clone(), self.alive.clone());
        let request = request.into_inner();
        let work = tokio::spawn(async move {
            tokio::select! {
                () = alive.cancelled() => Err(Status::unavailable("the kubelet stopped")),
                accepted = accept(shared, request, &alive) => accepted,
            }
        });
        match work.await {
            Ok(result) => result.map(Response::new),
            Err(e) => Err(Status::internal(format!("registration task failed: {e}"))),
        }
    }
}

/// Allocate on `client`, one container per entry of `containers`. A reply without one response per container is
/// turned into an `INTERNAL` error, as the kubelet rejects it.
async fn allocate_with(
    mut client: DevicePluginClient<Channel>,
    containers: &[&[&str]],
) -> Result<AllocateResponse, Status> {
    let request = AllocateRequest {
        container_requests: containers
            .iter()
            .map(|ids| ContainerAllocateRequest {
                devices_ids: ids.iter().map(|s| s.to_string()).collect(),
            })
            .collect(),
    };
    let response = client.allocate(request).await?.into_inner();
    if response.container_responses.len() != containers.len() {
        return Err(Status::internal(format!(
            "plugin returned {} container responses for {} containers",
            response.container_responses.len(),
            containers.len()
        )));
    }
    Ok(response)
}

impl Shared {
    /// The ListAndWatch state of `resource`: `lists` for the first resource registered, a state of its own
    /// for any other.
    fn lists_of(&self, resource: &str) -> watch::Sender<ListState> {
        if let Ok(mut primary) = self.primary.lock() {
            match primary.as_deref() {
                None => {
                    *primary = Some(resource.to_string());
                    return self.lists.clone();
                }
                Some(p) if p == resource => return self.lists.clone(),
                Some(_) => {}
            }
        }
        match self.other_lists.lock() {
            Ok(mut others) => others
                .entry(resource.to_string())
                .or_insert_with(|| watch::Sender::new(ListState::default()))
                .clone(),
            Err(_) => watch::Sender::new(ListState::default()),
        }
    }
}

async fn accept(
    shared: Arc<Shared>,
    request: RegisterRequest,
    alive: &CancellationToken,
) -> Result<Empty, Status> {
    let received_at = Instant::now();
    if request.version != VERSION {
        return Err(Status::invalid_argument(format!(
            "unsupported device plugin API version {:?}",
            request.version
        )));
    }
    if let Err(e) = check_extended_resource_name(&request.resource_name) {
        return Err(Status::invalid_argument(e.to_string()));
    }
    if request.endpoint.is_empty() || request.endpoint.contains('/') {
        return Err(Status::invalid_argument(format!(
            "endpoint {:?} is not a socket file name",
            request.endpoint
        )));
    }
    let socket = shared.dir.join(&request.endpoint);
    let dial = async {
        let channel = uds::connect(&socket)
            .await
            .map_err(|e| Status::unavailable(format!("cannot dial {}: {e:?}", socket.display())))?;
        let mut client = DevicePluginClient::new(channel);
        let options = client
            .get_device_plugin_options(Empty {})
            .await?
            .into_inner();
        Ok::<_, Status>((client, options))
    };
    let (client, dialed_options) = tokio::time::timeout(DIAL_BACK_TIMEOUT, dial)
        .await
        .map_err(|_| Status::deadline_exceeded("plugin did not answer GetDevicePluginOptions"))??;

    record(
        &shared,
        alive,
        &request,
        client,
        dialed_options,
        received_at,
    )?;
    let mut hold = shared.hold.subscribe();
    let _released = hold.wait_for(|held| !held).await;
    Ok(Empty {})
}

/// Records an accepted registration: the registration, the new client and its stream reader. Under the
/// clients' lock, and refused if the kubelet stopped meanwhile: `stop` cancels first and takes the clients
/// after, so a client is either refused here or closed there.
fn record(
    shared: &Arc<Shared>,
    alive: &CancellationToken,
    request: &RegisterRequest,
    client: DevicePluginClient<Channel>,
    dialed_options: DevicePluginOptions,
    received_at: Instant,
) -> Result<(), Status> {
    let Ok(mut clients) = shared.clients.lock() else {
        return Err(Status::internal("client table poisoned"));
    };
    if alive.is_cancelled() {
        return Err(Status::unavailable("the kubelet stopped"));
    }
    let mut registration = 0;
    shared.registrations.send_modify(|regs| {
        regs.push(Registered {
            endpoint: request.endpoint.clone(),
            resource_name: request.resource_name.clone(),
            options: request.options,
            dialed_options,
            received_at,
        });
        registration = regs.len();
    });
    // The newest registration is the one the resource uses from now on; nothing known about the devices
    // changes until its first list arrives.
    let lists = shared.lists_of(&request.resource_name);
    lists.send_modify(|s| {
        s.registration = registration;
        s.messages = 0;
        s.ended = None;
        s.disconnected = false;
    });
    let reader = shared
        .open_streams
        .load(std::sync::atomic::Ordering::SeqCst)
        .then(|| {
            AbortOnDropHandle::new(tokio::spawn(read_list_and_watch(
                client.clone(),
                shared.clone(),
                request.resource_name.clone(),
                registration,
            )))
        });
    let new = Client {
        registration,
        endpoint: request.endpoint.clone(),
        pre_start_required: dialed_options.pre_start_required,
        preferred_allocation: dialed_options.get_preferred_allocation_available,
        client,
        _reader: reader,
    };
    // Neither device manager closes the client a new registration replaces.
    clients.live.push(new);
    clients
        .current
        .insert(request.resource_name.clone(), registration);
    Ok(())
}

async fn read_list_and_watch(
    mut client: DevicePluginClient<Channel>,
    shared: Arc<Shared>,
    resource: String,
    registration: usize,
) {
    let lists = shared.lists_of(&resource);
    let mut stream = match client.list_and_watch(Empty {}).await {
        Ok(response) => response.into_inner(),
        Err(status) => {
            return stream_ended(
                &shared,
                &resource,
                registration,
                Err(format!("ListAndWatch failed to open: {status}")),
            );
        }
    };
    loop {
        match stream.message().await {
            Ok(Some(message)) => {
                let counts = match shared.manager {
                    // The legacy manager takes every client's list as the resource's.
                    DeviceManager::Legacy => true,
                    DeviceManager::MultiClient => shared
                        .clients
                        .lock()
                        .is_ok_and(|c| c.current.get(&resource) == Some(&registration)),
                };
                lists.send_modify(|s| {
                    s.total_messages += 1;
                    if !counts {
                        return;
                    }
                    if s.registration != registration {
                        s.registration = registration;
                        s.messages = 0;
                    }
                    s.messages += 1;
                    s.devices = message.devices;
                    s.received_at = Some(Instant::now());
                    s.disconnected = false;
                })
            }
            Ok(None) => return stream_ended(&shared, &resource, registration, Ok(())),
            Err(status) => {
                return stream_ended(
                    &shared,
                    &resource,
                    registration,
                    Err(format!("ListAndWatch ended with an error: {status}")),
                );
            }
        }
    }
}

/// What the device manager does when the stream of `registration` ends: the client's run is over, and then
/// it disconnects a client, which one depending on the device manager.
fn stream_ended(shared: &Shared, resource: &str, registration: usize, how: Result<(), String>) {
    let lists = shared.lists_of(resource);
    let Ok(mut clients) = shared.clients.lock() else {
        return;
    };
    // This client's own connection: dropped after the lock is released (dropping it aborts this task).
    let mut gone = Vec::new();
    if let Some(i) = clients
        .live
        .iter()
        .position(|c| c.registration == registration)
    {
        gone.push(clients.live.remove(i));
    }
    let disconnect = match shared.manager {
        // `runClient` looks the client up by resource name after the stream ends: the current one, whoever
        // it is.
        DeviceManager::Legacy => clients.current.get(resource).copied(),
        DeviceManager::MultiClient => clients
            .current
            .get(resource)
            .copied()
            .filter(|&c| c == registration),
    };
    if let Some(current) = disconnect {
        clients.current.remove(resource);
        if let Some(i) = clients.live.iter().position(|c| c.registration == current) {
            gone.push(clients.live.remove(i));
        }
        lists.send_modify(|s| {
            for device in &mut s.devices {
                device.health = "Unhealthy".into();
            }
            s.disconnected = true;
            if current == registration {
                s.ended = Some(how.clone());
            } else {
                s.cut_by_other += 1;
                s.ended = Some(Err(format!(
                    "disconnected: the stream of registration {registration} ended"
                )));
            }
        });
    }
    if let Err(error) = how {
        lists.send_modify(|s| s.errors.push(error));
    }
    drop(clients);
    drop(gone);
}
