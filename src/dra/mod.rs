//! Serving GPUs through Dynamic Resource Allocation: a kubelet DRA plugin on the same health engine as the
//! device plugin. The devices it serves are published under NVIDIA's DRA driver's names ([`names`]), prepared
//! for claims ([`prepare`], with the record of what was prepared, [`record`], and the claims read from the
//! API server, [`claims`]), and their health is streamed to the kubelet, which puts the engine's message into
//! the pod status ([`health`]). The kubelet finds the plugin through [`registration`]; the scheduler finds
//! the devices in ResourceSlices ([`slices`]). Which GPUs take this road: [`selection`].
//!
//! Two sockets: the DRA API on `<plugins dir>/<driver>/dra.sock` (served first), then the registration
//! socket `<registry dir>/<driver>-reg.sock` that the kubelet's plugin watcher finds. Either socket deleted
//! while the plugin runs is bound again; both are removed when it stops.

pub mod claims;
pub mod device_config;
pub mod health;
pub mod listing;
pub mod names;
pub mod prepare;
pub mod record;
pub mod registration;
pub mod slices;
pub mod view;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixStream;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::api::dra::registration::registration_server::RegistrationServer;
use crate::api::dra::{health_v1, health_v1alpha1, v1, v1beta1};
use crate::devices::InventoryWatch;
use crate::kubelet::KubeletError;
use crate::kubelet::socket::{PluginSocket, Staging};
use crate::metrics::Metrics;
use crate::util::runtime::{Priority, spawn_on_own_thread};

use self::claims::ClaimReader;
use self::health::{HealthConfig, HealthService};
use self::prepare::{PrepareConfig, Preparer};
use self::record::RecordFile;
use self::registration::{DraStatus, RegistrationService};

/// NVIDIA's DRA driver's name: its DeviceClasses and users' selectors name it.
pub const DEFAULT_DRIVER: &str = "gpu.nvidia.com";
/// Where the kubelet's plugin watcher looks.
pub const DEFAULT_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// Where DRA plugins keep their sockets.
pub const DEFAULT_PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
/// How often the sockets are checked for being in place while their directories are watched (inotify says
/// at once when one goes: this is the net under a watch that missed it).
const SOCKET_CHECK: Duration = Duration::from_secs(30);
/// How often without a watch (inotify refused: out of watches).
const SOCKET_CHECK_UNWATCHED: Duration = Duration::from_secs(1);
/// How long the servers get to finish at shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// The DRA side's settings.
#[derive(Debug, Clone)]
pub struct DraConfig {
    /// Driver name.
    pub driver: String,
    /// The kubelet's plugin registry directory.
    pub registry_dir: PathBuf,
    /// The kubelet's DRA plugins directory.
    pub plugins_dir: PathBuf,
    /// The pool devices are published in: the node's name.
    pub pool: String,
    /// CDI kind of the device IDs handed out.
    pub cdi_kind: String,
    /// The plugin's state directory (the prepared-claim record).
    pub state_dir: PathBuf,
    /// This boot's id, when known: a record from another boot is dropped.
    pub boot_id: Option<String>,
    /// The health stream's heartbeat.
    pub heartbeat: Duration,
    /// The pod's UID, when the sockets are named after it (two pods of a rolling update side by side).
    pub pod_uid: Option<String>,
}

impl DraConfig {
    /// `dra.sock` (`dra-<pod UID>.sock`) in the driver's directory under the plugins directory.
    pub fn endpoint(&self) -> PathBuf {
        let name = match &self.pod_uid {
            Some(uid) => format!("dra-{uid}.sock"),
            None => "dra.sock".into(),
        };
        self.plugins_dir.join(&self.driver).join(name)
    }

    /// `<driver>-reg.sock` (`<driver>-<pod UID>-reg.sock`) in the registry directory.
    pub fn registration_socket(&self) -> PathBuf {
        let name = match &self.pod_uid {
            Some(uid) => format!("{}-{uid}-reg.sock", self.driver),
            None => format!("{}-reg.sock", self.driver),
        };
        self.registry_dir.join(name)
    }
}

/// Why the DRA side stopped.
#[derive(Debug, thiserror::Error)]
pub enum DraError {
    /// A directory could not be made.
    #[error("cannot create {}: {source}", .path.display())]
    Dir {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A socket could not be served.
    #[error(transparent)]
    Socket(#[from] KubeletError),
    /// No client for the API server could be built.
    #[error(
        "cannot build a Kubernetes API client for DRA (claims are read from the API server): {0}"
    )]
    Client(String),
}

/// Runs [`run`] on a thread and runtime of its own, with a client for the API server built there from
/// `api`: a slow API server or a burst of prepares never takes a turn from the device plugin's fault path.
/// The thread keeps the process's scheduling priority, as the device plugin's does: its health stream is
/// the fault path of the GPUs served through DRA (a side surface's lower priority put a busy node's faults
/// behind everything else there). The receiver resolves when the DRA side stops, with why.
pub fn spawn(
    config: DraConfig,
    devices: InventoryWatch,
    conditions: Option<view::Conditions>,
    api: kube::Config,
    status: watch::Sender<DraStatus>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> std::io::Result<tokio::sync::oneshot::Receiver<Result<(), DraError>>> {
    let (done, stopped) = tokio::sync::oneshot::channel();
    let slices_api = api.clone();
    let claims_api = api.clone();
    // Bumped when another instance of this driver on the node has gone.
    let (others_gone, resend) = watch::channel(0_u64);
    spawn_on_own_thread("dra", Priority::FaultPath, async move {
        // The client is built here to say at once when the configuration cannot make one; claims are read
        // on a thread of their own, with its own.
        let claims = crate::cluster::client::client(api)
            .map_err(|e| DraError::Client(e.to_string()))
            .and_then(|_checked| {
                claims::ApiClaims::spawn(claims_api).map_err(|e| {
                    DraError::Client(format!("cannot start the thread that reads claims: {e}"))
                })
            });
        let result = match claims {
            Ok(claims) => {
                let views = view::follow(
                    devices.clone(),
                    conditions,
                    config.driver.clone(),
                    config.heartbeat,
                );
                // Stops when the views do (this side's end) or at shutdown.
                publish_slices(
                    slices_api,
                    slices::SliceConfig {
                        driver: config.driver.clone(),
                        node: config.pool.clone(),
                    },
                    config.state_dir.clone(),
                    views.slices,
                    status.subscribe(),
                    others_gone,
                    metrics.clone(),
                    shutdown.clone(),
                );
                let claims = Arc::new(claims);
                run(
                    config,
                    devices,
                    (views.health, resend),
                    claims,
                    status,
                    metrics,
                    shutdown,
                )
                .await
            }
            Err(e) => Err(e),
        };
        let _gone = done.send(result);
    })?;
    Ok(stopped)
}

/// How often an instance waiting to write the node's ResourceSlices tries the lock again.
const SLICES_LOCK_RETRY: Duration = Duration::from_millis(250);

/// Waits until this instance may write the node's ResourceSlices: during a rolling update the two pods would
/// otherwise both write them, each its own view (a fault heard first by one, a fence set on one pod alone),
/// and rewrite each other's. The writer holds an `flock` on the state directory itself (the returned handle),
/// which no one can swap for a FIFO or delete while it is held; another instance's lock goes with its
/// process, so the wait ends within [`SLICES_LOCK_RETRY`] of its stop. `None` at shutdown. A lock that
/// cannot be taken at all is said once and the slices are written without it, rather than never. Bumps
/// `others_gone` when it took the lock from another instance, which has gone then.
async fn slice_writer(
    state_dir: &Path,
    others_gone: &watch::Sender<u64>,
    shutdown: &CancellationToken,
) -> Option<Option<std::fs::File>> {
    use rustix::fs::{FlockOperation, flock};
    let without = |e: &dyn std::fmt::Display| {
        tracing::warn!(error = %e, dir = %state_dir.display(), "cannot take the ResourceSlices' lock on the state directory: this instance writes them without it");
        Some(None)
    };
    let dir = match std::fs::File::open(state_dir) {
        Ok(dir) if dir.metadata().is_ok_and(|m| m.is_dir()) => dir,
        Ok(_) => return without(&"not a directory"),
        Err(e) => return without(&e),
    };
    let mut said = false;
    loop {
        match flock(&dir, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {
                if said {
                    tracing::info!(
                        "the other instance stopped: this one writes the ResourceSlices now"
                    );
                    others_gone.send_modify(|n| *n = n.wrapping_add(1));
                }
                return Some(Some(dir));
            }
            Err(e) if e == rustix::io::Errno::WOULDBLOCK => {
                if !said {
                    tracing::info!(
                        dir = %state_dir.display(),
                        "another instance of the plugin writes this node's ResourceSlices (a rolling update): \
                         this one writes them once it stops"
                    );
                    said = true;
                }
            }
            Err(e) => return without(&e),
        }
        tokio::select! {
            () = shutdown.cancelled() => return None,
            () = tokio::time::sleep(SLICES_LOCK_RETRY) => {}
        }
    }
}

/// Waits until the kubelet has registered the driver (its `NotifyRegistrationStatus(true)`, sent once the
/// kubelet's DRA manager knows the driver): a slice published before that lets the scheduler bind a pod the
/// kubelet then fails with "DRA driver ... is not registered" and retries only after its backoff (about 10 s
/// on a 1.36 kubelet, whose plugin watcher looks once a second). `false` at shutdown, or when the DRA side
/// stopped without a registration.
async fn registered(status: &mut watch::Receiver<DraStatus>, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        () = shutdown.cancelled() => false,
        seen = status.wait_for(|s| s.registered) => seen.is_ok(),
    }
}

/// Keeps the node's ResourceSlices as `view` says, on a side thread of its own with its own API client: the
/// JSON of the slices and the API server's answers are the scheduler's road, and never take a turn from the
/// health stream and prepare on the DRA thread. Without that thread no slice is written, said once. The
/// first slice goes out once the kubelet has registered the driver ([`registered`]); a later refusal or
/// restart of the kubelet leaves them (the kubelet wipes them itself when the driver is gone).
#[allow(clippy::too_many_arguments)]
fn publish_slices(
    api: kube::Config,
    config: slices::SliceConfig,
    state_dir: PathBuf,
    view: watch::Receiver<view::DraView>,
    mut status: watch::Receiver<DraStatus>,
    others_gone: watch::Sender<u64>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let started = spawn_on_own_thread("dra-slices", Priority::Side, async move {
        if !registered(&mut status, &shutdown).await {
            return;
        }
        let Some(_writer) = slice_writer(&state_dir, &others_gone, &shutdown).await else {
            return;
        };
        let mut watch_api = api.clone();
        watch_api.read_timeout = None;
        match crate::cluster::client::client(api)
            .and_then(|c| Ok((c, crate::cluster::client::client(watch_api)?)))
        {
            Ok(clients) => slices::publish(clients, config, view, metrics, shutdown).await,
            Err(e) => {
                tracing::warn!(error = %e, "cannot build a Kubernetes API client for the ResourceSlices: none is written")
            }
        }
    });
    if let Err(e) = started {
        tracing::warn!(error = %e, "cannot start the ResourceSlices' thread: none is written");
    }
}

/// Removes the driver's sockets that an earlier instance left behind with nobody listening: under
/// sockets named after the pod, each pod's names are its own, and a pod that did not live to remove its
/// own would leave the kubelet trying a dead registration. A live one (the other pod of a rolling update)
/// answers the connect and is kept.
fn remove_stale_sockets(config: &DraConfig) {
    use crate::kubelet::socket::remove_stale_sockets_named;
    remove_stale_sockets_named(&config.registry_dir, |name| {
        is_registration_of(&config.driver, name)
    });
    remove_stale_sockets_named(&config.plugins_dir.join(&config.driver), |name| {
        name.starts_with("dra") && name.ends_with(".sock")
    });
}

/// Whether `name` is a registration socket's name of `driver` (this instance's or another's).
fn is_registration_of(driver: &str, name: &str) -> bool {
    name.strip_prefix(driver)
        .is_some_and(|rest| rest.starts_with('-') && rest.ends_with("-reg.sock"))
}

/// The most entries of the registry directory looked at for other instances.
const REGISTRY_ENTRIES_LOOKED_AT: usize = 4096;
/// The most of them connected to: two pods of a rolling update are two sockets.
const OTHER_SOCKETS_TRIED: usize = 16;

/// Whether another instance of this driver serves on the node: a registration socket of the driver's other
/// than this one's that answers a connect (the other pod of a rolling update, or a new pod failing beside
/// this one). One that refuses is a dead pod's, left behind.
async fn another_instance(config: &DraConfig) -> bool {
    use std::os::unix::fs::FileTypeExt as _;
    let own = config.registration_socket();
    let Ok(entries) = std::fs::read_dir(&config.registry_dir) else {
        return false;
    };
    let others: Vec<PathBuf> = entries
        .take(REGISTRY_ENTRIES_LOOKED_AT)
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| is_registration_of(&config.driver, n))
                && e.file_type().is_ok_and(|t| t.is_socket())
                && e.path() != own
        })
        .map(|e| e.path())
        .take(OTHER_SOCKETS_TRIED)
        .collect();
    for path in others {
        // The look every served socket's path gets: a connect that never waits.
        if crate::kubelet::socket::look(&path) == crate::kubelet::socket::Found::Live {
            return true;
        }
        // The health stream and prepare get their turn between two.
        tokio::task::yield_now().await;
    }
    false
}

/// The least time between two looks at the other instances: a burst of events in the registry directory
/// (a script making and removing sockets in a loop) costs two looks a second, not one per event.
const OTHERS_PACE: Duration = Duration::from_millis(500);

/// Keeps `others` saying whether another instance of the driver serves beside this one: looked at when a
/// registration socket of the driver comes or goes (`woken`), at most every [`OTHERS_PACE`], and every
/// [`SOCKET_CHECK`] (a pod killed leaves its socket, which then refuses) until `until`.
async fn follow_others(
    config: DraConfig,
    woken: Arc<tokio::sync::Notify>,
    others: watch::Sender<bool>,
    until: CancellationToken,
) {
    loop {
        let there = another_instance(&config).await;
        let looked = tokio::time::Instant::now();
        if others.send_if_modified(|was| std::mem::replace(was, there) != there) {
            if there {
                tracing::info!(
                    driver = %config.driver,
                    "another instance of the driver serves on this node (a rolling update?): health goes to \
                     the kubelet every second meanwhile"
                );
            } else {
                tracing::info!(driver = %config.driver, "the other instance of the driver has gone");
            }
        }
        tokio::select! {
            () = until.cancelled() => return,
            () = woken.notified() => {}
            () = tokio::time::sleep(SOCKET_CHECK) => {}
        }
        tokio::select! {
            () = until.cancelled() => return,
            () = tokio::time::sleep_until(looked + OTHERS_PACE) => {}
        }
    }
}

/// The inotify watch on the sockets' directories, made again when a directory is replaced (moved away,
/// deleted and made again): a watch follows the directory it was put on, not its path.
struct SocketWatch {
    sockets: Vec<PathBuf>,
    /// The driver: another instance's registration socket coming or going wakes `others`.
    driver: String,
    moved: Arc<tokio::sync::Notify>,
    others: Arc<tokio::sync::Notify>,
    watcher: Option<notify::RecommendedWatcher>,
    /// Each directory's device and inode when the watch was put on it (`None`: not there).
    dirs: Vec<Option<(u64, u64)>>,
}

impl SocketWatch {
    fn new(
        sockets: &[&Path],
        driver: &str,
        moved: Arc<tokio::sync::Notify>,
        others: Arc<tokio::sync::Notify>,
    ) -> Self {
        let mut watch = SocketWatch {
            sockets: sockets.iter().map(|s| s.to_path_buf()).collect(),
            driver: driver.to_string(),
            moved,
            others,
            watcher: None,
            dirs: Vec::new(),
        };
        watch.renew();
        watch
    }

    fn identities(&self) -> Vec<Option<(u64, u64)>> {
        use std::os::unix::fs::MetadataExt as _;
        self.sockets
            .iter()
            .map(|s| {
                let meta = std::fs::metadata(s.parent()?).ok()?;
                Some((meta.dev(), meta.ino()))
            })
            .collect()
    }

    fn renew(&mut self) {
        // The old watch gone first: its inotify descriptor is one of a limited number per user.
        self.watcher = None;
        self.dirs = self.identities();
        let sockets: Vec<&Path> = self.sockets.iter().map(PathBuf::as_path).collect();
        self.watcher = watch_sockets(
            &sockets,
            (&self.driver, self.others.clone()),
            self.moved.clone(),
        );
    }

    /// Puts the watch on the directories again if one of them is not the one watched; whether it did.
    fn renew_if_replaced(&mut self) -> bool {
        if self.identities() == self.dirs {
            return false;
        }
        self.renew();
        tracing::info!("a DRA socket directory was replaced; watching the new one");
        true
    }

    fn is_watching(&self) -> bool {
        self.watcher.is_some()
    }
}

/// Watches the directories of `sockets` (inotify) and wakes `moved` when one of the sockets is created,
/// removed or renamed, when a directory itself is moved or removed, or when the watch may have missed
/// something. Nothing else there wakes it: other plugins' sockets coming and going, or a directory being
/// read. `None` (said) if the watch cannot be set up: the caller then looks every second.
fn watch_sockets(
    sockets: &[&Path],
    (driver, others): (&str, Arc<tokio::sync::Notify>),
    moved: Arc<tokio::sync::Notify>,
) -> Option<notify::RecommendedWatcher> {
    use notify::event::{EventKind, ModifyKind};
    use notify::{RecursiveMode, Watcher as _};
    let driver = driver.to_string();
    let names: Vec<std::ffi::OsString> = sockets
        .iter()
        .filter_map(|s| s.file_name().map(|n| n.to_os_string()))
        .collect();
    let dirs: Vec<PathBuf> = sockets
        .iter()
        .filter_map(|s| s.parent().map(Path::to_path_buf))
        .collect();
    let watched = dirs.clone();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let (ours, theirs) = match event {
            Ok(event) => {
                let kind = matches!(
                    event.kind,
                    EventKind::Create(_)
                        | EventKind::Remove(_)
                        | EventKind::Modify(ModifyKind::Name(_))
                );
                let rescan = event.need_rescan();
                let ours = event.paths.iter().any(|p| {
                    watched.iter().any(|d| d == p)
                        || p.file_name().is_some_and(|n| names.iter().any(|o| o == n))
                });
                let theirs = event.paths.iter().any(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| is_registration_of(&driver, n))
                });
                (rescan || kind && ours, rescan || kind && theirs)
            }
            Err(_) => (true, true),
        };
        if ours {
            moved.notify_one();
        }
        if theirs {
            others.notify_one();
        }
    })
    .map_err(|e| e.to_string());
    let watched = watcher.as_mut().map_err(|e| e.clone()).and_then(|w| {
        dirs.iter().try_for_each(|dir| {
            w.watch(dir, RecursiveMode::NonRecursive)
                .map_err(|e| format!("{}: {e}", dir.display()))
        })
    });
    match watched {
        Ok(()) => watcher.ok(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch the DRA sockets' directories: a deleted socket is bound again within {SOCKET_CHECK_UNWATCHED:?} instead of at once");
            None
        }
    }
}

/// Which of the two sockets a [`Served`] is: how its file is made and which `:authority` its requests may
/// carry.
#[derive(Debug, Clone, Copy)]
enum Role {
    /// The DRA socket: made beside its place; only a valid URI authority (h2's own check), as the kubelet's
    /// DRA client (1.34+) dials `unix:<path>` and sends `localhost`.
    Service,
    /// The registration socket, in the directory the kubelet's plugin watcher follows: made out of its sight
    /// ([`Staging::HiddenDir`]); any authority, as Go's gRPC server takes (the watcher dials the socket's path,
    /// which grpc-go sends as the authority), each connection through a relay
    /// ([`crate::util::authority::served_any`]).
    Registration,
}

/// One served socket and its gRPC server.
struct Served {
    socket: PluginSocket,
    conns: mpsc::Sender<UnixStream>,
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    stop: CancellationToken,
    replaced_said: bool,
    /// The last failure to bind the socket again, said once.
    failure_said: Option<String>,
}

impl Served {
    /// Serves `router` on a socket at `path`, its connections held at a gate named `what` (for the log),
    /// made and its requests taken as its `role` says.
    fn start(
        path: &Path,
        what: &'static str,
        role: Role,
        router: tonic::transport::server::Router,
        metrics: &Arc<Metrics>,
        shutdown: &CancellationToken,
    ) -> Result<Served, DraError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| DraError::Dir {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        let (conns, incoming) = mpsc::channel(16);
        let staging = match role {
            Role::Service => Staging::Beside,
            Role::Registration => Staging::HiddenDir,
        };
        let socket = PluginSocket::bind_staged(path, staging, conns.clone())?;
        // Held to a cap, the oldest silent connection closed past it, a silent one closed after 10 s.
        let metrics = metrics.clone();
        let incoming = crate::util::bounded::held_connections(
            incoming,
            what,
            Arc::new(move || metrics.socket_connection_evicted(what)),
        );
        // Its own token under the process's: a server stopped on the DRA side's own failure stops at once.
        let stop = shutdown.child_token();
        let stopped = stop.clone().cancelled_owned();
        let task = match role {
            Role::Service => tokio::spawn(router.serve_with_incoming_shutdown(incoming, stopped)),
            Role::Registration => {
                use futures_util::StreamExt as _;
                let incoming = incoming.map(|conn| conn.map(crate::util::authority::served_any));
                tokio::spawn(router.serve_with_incoming_shutdown(incoming, stopped))
            }
        };
        Ok(Served {
            socket,
            conns,
            task,
            stop,
            replaced_said: false,
            failure_said: None,
        })
    }

    /// Keeps the socket in place by the rule every served socket follows
    /// ([`PluginSocket::keep_in_place`]): bound again when it is gone or replaced (a FIFO, a file, a link, a
    /// dead socket, whether deleted or renamed over), making its directory again if that is gone too
    /// (someone cleaned up under the running plugin); a live socket of another process (another instance
    /// on the same node) is left to it, said once. Whether the socket is ours and in place after: a failure
    /// (the directory replaced by a file, out of descriptors) is said once per kind and tried again at the
    /// next check, never the end of the DRA side.
    fn keep_in_place(&mut self) -> bool {
        use crate::kubelet::socket::{Found, Kept};
        let made = match self.socket.path().parent() {
            Some(dir) if !self.socket.is_in_place() => {
                std::fs::create_dir_all(dir).map_err(|source| DraError::Dir {
                    path: dir.to_path_buf(),
                    source,
                })
            }
            _ => Ok(()),
        };
        let kept = made.and_then(|()| Ok(self.socket.keep_in_place(self.conns.clone())?));
        match kept {
            Ok(Kept::InPlace) => {
                self.replaced_said = false;
                self.failure_said = None;
                true
            }
            Ok(Kept::LeftTo) => {
                if !self.replaced_said {
                    self.replaced_said = true;
                    tracing::warn!(
                        socket = %self.socket.path().display(),
                        "another process serves on the DRA socket (a second instance of the plugin on this \
                         node?); leaving it to that one"
                    );
                }
                false
            }
            Ok(Kept::Rebound(found)) => {
                let what = match found {
                    Found::Gone => "DRA socket was gone: bound again".to_string(),
                    other => format!("DRA socket {}: bound again", other.describe()),
                };
                tracing::info!(socket = %self.socket.path().display(), "{what}");
                self.replaced_said = false;
                self.failure_said = None;
                true
            }
            Err(e) => {
                let why = e.to_string();
                if self.failure_said.as_ref() != Some(&why) {
                    tracing::warn!(error = %why, retry_in = ?SOCKET_CHECK_UNWATCHED, "cannot bind the DRA socket again: the kubelet cannot reach this driver until it can");
                    self.failure_said = Some(why);
                }
                false
            }
        }
    }

    async fn stop(self) {
        self.socket.remove();
        self.stop.cancel();
        if tokio::time::timeout(SHUTDOWN_GRACE, self.task)
            .await
            .is_err()
        {
            tracing::warn!("a DRA gRPC server did not stop within {SHUTDOWN_GRACE:?}");
        }
    }
}

/// Serves `devices` through DRA until `shutdown`: the DRA API, then the registration the kubelet finds.
/// Prepare reads `devices`; the health stream reports `view`, and sends it again when `resend` says another
/// instance of the driver has gone. `status` follows what the kubelet says of the
/// registration and which claims are prepared.
pub async fn run(
    config: DraConfig,
    devices: InventoryWatch,
    (view, resend): (watch::Receiver<view::DraView>, watch::Receiver<u64>),
    claims: Arc<dyn ClaimReader>,
    status: watch::Sender<DraStatus>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> Result<(), DraError> {
    let preparer = start_preparer(&config, devices, claims, &status, &metrics).await;
    // The health streams end with the servers, whether the process stops or the DRA side fails on its own.
    let streams = shutdown.child_token();
    let (others, others_rx) = watch::channel(false);
    let health = HealthService::new(
        view,
        HealthConfig {
            pool: config.pool.clone(),
            heartbeat: config.heartbeat,
            timeout: health::REPORT_TIMEOUT,
        },
        streams.clone(),
    )
    .with_metrics(metrics.clone())
    .with_resend(resend)
    .with_others(others_rx);
    let endpoint = config.endpoint();
    remove_stale_sockets(&config);
    let dra = crate::util::bounded::kubelet_server()
        .add_service(v1::dra_plugin_server::DraPluginServer::new(
            preparer.clone(),
        ))
        .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(preparer))
        .add_service(
            health_v1::dra_resource_health_server::DraResourceHealthServer::new(health.clone()),
        )
        .add_service(
            health_v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(health),
        );
    let mut dra = Served::start(
        &endpoint,
        "DRA socket",
        Role::Service,
        dra,
        &metrics,
        &shutdown,
    )?;

    let registration = RegistrationService::new(config.driver.clone(), endpoint.clone(), status);
    let reg =
        crate::util::bounded::kubelet_server().add_service(RegistrationServer::new(registration));
    let mut reg = match Served::start(
        &config.registration_socket(),
        "DRA registration socket",
        Role::Registration,
        reg,
        &metrics,
        &shutdown,
    ) {
        Ok(reg) => reg,
        Err(e) => {
            streams.cancel();
            dra.stop().await;
            return Err(e);
        }
    };
    tracing::info!(
        driver = %config.driver,
        endpoint = %endpoint.display(),
        registration = %config.registration_socket().display(),
        "serving GPUs through DRA; waiting for the kubelet's plugin watcher"
    );

    let moved = Arc::new(tokio::sync::Notify::new());
    let others_moved = Arc::new(tokio::sync::Notify::new());
    let mut watch = SocketWatch::new(
        &[&endpoint, &config.registration_socket()],
        &config.driver,
        moved.clone(),
        others_moved.clone(),
    );
    tokio::spawn(follow_others(
        config.clone(),
        others_moved,
        others,
        streams.clone(),
    ));
    let mut in_place = true;
    loop {
        // Looked at every second while a socket cannot be bound or nothing watches them.
        let check = if in_place && watch.is_watching() {
            SOCKET_CHECK
        } else {
            SOCKET_CHECK_UNWATCHED
        };
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = moved.notified() => {}
            () = tokio::time::sleep(check) => {}
        }
        // Both looked at, whatever the first says; again after a new watch, for what came before it.
        in_place = dra.keep_in_place() & reg.keep_in_place();
        if watch.renew_if_replaced() {
            in_place = dra.keep_in_place() & reg.keep_in_place();
        }
    }
    drop(watch);
    // The registration first: the kubelet must not find a driver whose API is already gone.
    streams.cancel();
    reg.stop().await;
    dra.stop().await;
    Ok(())
}

/// The claims' side: the prepared-claim record loaded (off this thread), and the preparer that answers the
/// kubelet's prepare and unprepare with it.
async fn start_preparer(
    config: &DraConfig,
    devices: InventoryWatch,
    claims: Arc<dyn ClaimReader>,
    status: &watch::Sender<DraStatus>,
    metrics: &Arc<Metrics>,
) -> Preparer {
    let record_file = RecordFile::in_dir(&config.state_dir);
    let record = {
        let (file, boot) = (record_file.clone(), config.boot_id.clone());
        tokio::task::spawn_blocking(move || file.load(boot))
            .await
            .unwrap_or_default()
    };
    tracing::info!(
        prepared = record.claims.len(),
        "prepared-claim record loaded"
    );
    status.send_modify(|s| s.driver = config.driver.clone());
    Preparer::new(
        PrepareConfig {
            driver: config.driver.clone(),
            pool: config.pool.clone(),
            cdi_kind: config.cdi_kind.clone(),
        },
        devices,
        claims,
        record,
        record_file,
    )
    .with_status(status.clone())
    .with_metrics(metrics.clone())
}

/// What the DRA side's unit tests share.
#[cfg(test)]
pub(crate) mod fixtures {
    use crate::devices::{DeviceInfo, Inventory};
    use std::path::PathBuf;

    /// `n` Healthy GPUs `GPU-<i>`, NVML index `i`, `/dev/nvidia<i>` (so published as `gpu-<i>`), NUMA node 0.
    pub(crate) fn gpus(n: usize) -> Inventory {
        Inventory::new((0..n).map(|i| DeviceInfo {
            id: format!("GPU-{i}"),
            index: Some(i.to_string()),
            numa_node: Some(0),
            device_nodes: vec![PathBuf::from(format!("/dev/nvidia{i}"))],
            ..DeviceInfo::default()
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registration_sockets_of_the_driver_are_told_from_other_drivers_and_files() {
        let driver = "gpu.nvidia.com";
        for ours in [
            "gpu.nvidia.com-reg.sock",
            "gpu.nvidia.com-0ld-pod-reg.sock",
            "gpu.nvidia.com-8d3c2a41-5b6e-4f0a-9c1d-2e7f3a4b5c6d-reg.sock",
        ] {
            assert!(is_registration_of(driver, ours), "{ours}");
        }
        for theirs in [
            "gpu.nvidia.comreg.sock",
            "compute-domain.nvidia.com-reg.sock",
            "gpu.nvidia.com-reg.sock.tmp",
            ".gpu.nvidia.com-reg.sock",
            "gpu.nvidia.com",
        ] {
            assert!(!is_registration_of(driver, theirs), "{theirs}");
        }
    }

    /// Anything under a registration socket's name that is not one (a FIFO, whose open would block; a file;
    /// a link, even to a live socket) or a dead pod's socket is no other instance, and is looked at without
    /// waiting on it; a live socket is one.
    #[tokio::test]
    async fn only_a_live_registration_socket_of_the_driver_is_another_instance() {
        let dir = tempfile::tempdir().expect("dir");
        let config = DraConfig {
            driver: DEFAULT_DRIVER.into(),
            registry_dir: dir.path().join("registry"),
            plugins_dir: dir.path().join("plugins"),
            pool: "node-a".into(),
            cdi_kind: "nvidia.com/gpu".into(),
            state_dir: dir.path().into(),
            boot_id: None,
            heartbeat: health::HEARTBEAT,
            pod_uid: Some("this-pod".into()),
        };
        let registry = &config.registry_dir;
        std::fs::create_dir(registry).expect("registry");
        let name = |who: &str| registry.join(format!("{DEFAULT_DRIVER}-{who}-reg.sock"));
        let _own = tokio::net::UnixListener::bind(config.registration_socket()).expect("own");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            name("fifo"),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .expect("fifo");
        std::fs::write(name("file"), "not a socket").expect("file");
        drop(tokio::net::UnixListener::bind(name("dead")).expect("dead"));
        let elsewhere = dir.path().join("live-elsewhere.sock");
        let _elsewhere = tokio::net::UnixListener::bind(&elsewhere).expect("elsewhere");
        std::os::unix::fs::symlink(&elsewhere, name("link")).expect("link");
        let look = tokio::time::timeout(Duration::from_secs(5), another_instance(&config));
        assert!(
            !look.await.expect("looked without waiting"),
            "none of them is another instance"
        );

        let _other = tokio::net::UnixListener::bind(name("other-pod")).expect("other");
        assert!(
            another_instance(&config).await,
            "the other pod's live socket"
        );
    }
}
