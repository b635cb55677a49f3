//! A stand-in for the kubelet's device manager, for testing and benchmarking device plugins on a machine with
//! no node. It behaves as the real one does where a plugin can tell:
//!
//! - serves `Registration` on `<dir>/kubelet.sock`; `Register` checks the version and the resource name, dials
//!   the plugin's socket back and calls `GetDevicePluginOptions` **before** answering, so a plugin that is not
//!   serving yet fails to register;
//! - then opens `ListAndWatch` and keeps the latest list; it never re-opens a stream that ended;
//! - the newest registration wins (a rolling update runs two plugins);
//! - [`FakeKubelet::restart`] stops, deletes every socket in the directory as the kubelet does when it starts,
//!   and creates `kubelet.sock` again, binding then listening as the kubelet does: a plugin that connects the
//!   instant inotify reports the file can be refused, as with the real one;
//! - Allocate replies must carry one response per container, or the call fails as it would in the kubelet.
//!
//! Tests wait on its state with timeouts ([`FakeKubelet::wait_registrations`], [`FakeKubelet::wait_list`]);
//! nothing here sleeps.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpu_device_plugin::api::device_plugin_client::DevicePluginClient;
use gpu_device_plugin::api::registration_server::{Registration, RegistrationServer};
use gpu_device_plugin::api::{
    AllocateRequest, AllocateResponse, ContainerAllocateRequest,
    ContainerPreferredAllocationRequest, Device, DevicePluginOptions, Empty, KUBELET_SOCKET,
    PreferredAllocationRequest, PreferredAllocationResponse, RegisterRequest, VERSION,
};
use gpu_device_plugin::config::check_extended_resource_name;
use gpu_device_plugin::kubelet::uds;
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::task::AbortOnDropHandle;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// The kubelet gives a plugin this long to answer its dial-back during `Register`.
const DIAL_BACK_TIMEOUT: Duration = Duration::from_secs(10);

/// Name of the kubelet's checkpoint file; the kubelet keeps it across restarts (it is not a socket).
pub const CHECKPOINT_FILE: &str = "kubelet_internal_checkpoint";

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

/// What the fake kubelet has seen on ListAndWatch.
#[derive(Debug, Clone, Default)]
pub struct ListState {
    /// Which registration (1-based count) the current stream belongs to; 0 before any.
    pub registration: usize,
    /// Messages received on the current stream.
    pub messages: u64,
    /// Messages received on all streams.
    pub total_messages: u64,
    /// The latest complete device list.
    pub devices: Vec<Device>,
    /// When the latest list arrived.
    pub received_at: Option<Instant>,
    /// How the current stream ended, if it did while the kubelet was running: `Ok` for a clean end of
    /// stream, `Err` with the status for an error. The kubelet never re-opens it either way.
    pub ended: Option<Result<(), String>>,
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

struct Plugin {
    client: DevicePluginClient<Channel>,
    _reader: AbortOnDropHandle<()>,
}

struct Shared {
    dir: PathBuf,
    registrations: watch::Sender<Vec<Registered>>,
    lists: watch::Sender<ListState>,
    plugin: Mutex<Option<Plugin>>,
}

/// A running fake kubelet on one directory.
pub struct FakeKubelet {
    shared: Arc<Shared>,
    server: Option<AbortOnDropHandle<()>>,
}

impl FakeKubelet {
    /// Starts serving `Registration` on `<dir>/kubelet.sock`; writes the checkpoint file as the kubelet does.
    pub async fn start(dir: &Path) -> Result<Self, FakeKubeletError> {
        let shared = Arc::new(Shared {
            dir: dir.to_owned(),
            registrations: watch::Sender::new(Vec::new()),
            lists: watch::Sender::new(ListState::default()),
            plugin: Mutex::new(None),
        });
        let mut kubelet = FakeKubelet {
            shared,
            server: None,
        };
        kubelet.serve()?;
        Ok(kubelet)
    }

    fn serve(&mut self) -> Result<(), FakeKubeletError> {
        let dir = &self.shared.dir;
        let _kept = std::fs::write(dir.join(CHECKPOINT_FILE), b"{}");
        let path = dir.join(KUBELET_SOCKET);
        let listener = UnixListener::bind(&path).map_err(|source| FakeKubeletError::Bind {
            path: path.display().to_string(),
            source,
        })?;
        let service = RegistrationServer::new(RegistrationService {
            shared: self.shared.clone(),
        });
        let task = tokio::spawn(async move {
            let _stopped = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await;
        });
        self.server = Some(AbortOnDropHandle::new(task));
        Ok(())
    }

    /// The device plugin directory.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// Stops the kubelet: closes `kubelet.sock` and every connection to the plugin, as a dying kubelet does.
    pub fn stop(&mut self) {
        self.server = None;
        let plugin = self.shared.plugin.lock().map(|mut p| p.take());
        drop(plugin);
        let _gone = std::fs::remove_file(self.shared.dir.join(KUBELET_SOCKET));
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

    /// The latest ListAndWatch state.
    pub fn list(&self) -> ListState {
        self.shared.lists.borrow().clone()
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
        let plugin = self
            .shared
            .plugin
            .lock()
            .map_err(|_| FakeKubeletError::NotRegistered)?;
        plugin
            .as_ref()
            .map(|p| p.client.clone())
            .ok_or(FakeKubeletError::NotRegistered)
    }

    /// Calls Allocate on the registered plugin, one container per entry of `containers`. A reply without one
    /// response per container is turned into an `INTERNAL` error, as the kubelet rejects it.
    pub async fn allocate(&self, containers: &[&[&str]]) -> Result<AllocateResponse, Status> {
        let mut client = self
            .client()
            .map_err(|e| Status::unavailable(e.to_string()))?;
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
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let received_at = Instant::now();
        let request = request.into_inner();
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
        let socket = self.shared.dir.join(&request.endpoint);
        let dial = async {
            let channel = uds::connect(&socket).await.map_err(|e| {
                Status::unavailable(format!("cannot dial {}: {e:?}", socket.display()))
            })?;
            let mut client = DevicePluginClient::new(channel);
            let options = client
                .get_device_plugin_options(Empty {})
                .await?
                .into_inner();
            Ok::<_, Status>((client, options))
        };
        let (client, dialed_options) = tokio::time::timeout(DIAL_BACK_TIMEOUT, dial)
            .await
            .map_err(|_| {
                Status::deadline_exceeded("plugin did not answer GetDevicePluginOptions")
            })??;

        let mut registration = 0;
        self.shared.registrations.send_modify(|regs| {
            regs.push(Registered {
                endpoint: request.endpoint.clone(),
                resource_name: request.resource_name.clone(),
                options: request.options,
                dialed_options,
                received_at,
            });
            registration = regs.len();
        });
        let reader = tokio::spawn(read_list_and_watch(
            client.clone(),
            self.shared.clone(),
            registration,
        ));
        let plugin = Plugin {
            client,
            _reader: AbortOnDropHandle::new(reader),
        };
        // The newest registration replaces the previous plugin endpoint and its stream.
        if let Ok(mut current) = self.shared.plugin.lock() {
            *current = Some(plugin);
        }
        Ok(Response::new(Empty {}))
    }
}

async fn read_list_and_watch(
    mut client: DevicePluginClient<Channel>,
    shared: Arc<Shared>,
    registration: usize,
) {
    // A new stream starts from nothing: the kubelet knows only what this plugin instance sends.
    shared.lists.send_modify(|s| {
        s.registration = registration;
        s.messages = 0;
        s.devices.clear();
        s.received_at = None;
        s.ended = None;
    });
    let mut stream = match client.list_and_watch(Empty {}).await {
        Ok(response) => response.into_inner(),
        Err(status) => {
            return ended(
                &shared,
                registration,
                Err(format!("ListAndWatch failed to open: {status}")),
            );
        }
    };
    loop {
        match stream.message().await {
            Ok(Some(message)) => shared.lists.send_modify(|s| {
                if s.registration == registration {
                    s.messages += 1;
                    s.total_messages += 1;
                    s.devices = message.devices;
                    s.received_at = Some(Instant::now());
                }
            }),
            Ok(None) => return ended(&shared, registration, Ok(())),
            Err(status) => {
                return ended(
                    &shared,
                    registration,
                    Err(format!("ListAndWatch ended with an error: {status}")),
                );
            }
        }
    }
}

/// Records how the stream of `registration` ended, unless a newer registration already replaced it.
fn ended(shared: &Shared, registration: usize, how: Result<(), String>) {
    shared.lists.send_modify(|s| {
        if s.registration != registration {
            return;
        }
        if let Err(error) = &how {
            s.errors.push(error.clone());
        }
        s.ended = Some(how);
    });
}
