//! Everything the kubelet's device manager talks to: the gRPC server on our socket ([`server`]), registration
//! ([`registration`]), and staying registered across kubelet restarts ([`watch`], [`socket`]).
//!
//! [`run`] keeps one gRPC server for the life of the process. A supervisor loop makes the directory look
//! right: our socket in place (re-bound if the kubelet deleted it) and a registration with the current
//! kubelet (made again whenever `kubelet.sock` is re-created). Device state lives outside, in the inventory
//! watch, so nothing is lost across a kubelet restart.

pub mod pods;
pub mod registration;
pub mod server;
pub mod socket;
pub mod watch;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::api::device_plugin_server::DevicePluginServer;
use crate::api::{KUBELET_SOCKET, RegisterRequest, VERSION};
use crate::devices::InventoryWatch;
use crate::devices::allocation::AllocateOptions;
use server::PluginService;
use socket::PluginSocket;
use watch::DirWatch;

/// How long shutdown waits for open streams to close before it stops waiting; the process must be gone within
/// the 2 s a DaemonSet update or node drain allows it comfortably.
const SHUTDOWN_GRACE: Duration = Duration::from_millis(1000);

/// Work that can wait for the kubelet (the HTTP surfaces, the API client) starts once the kubelet has accepted
/// the first registration, or this long after the plugin started without one.
pub const OTHERS_START_AT_LATEST: Duration = Duration::from_secs(2);

/// Resolves once the kubelet has accepted a registration, or after [`OTHERS_START_AT_LATEST`]; says which.
/// The kubelet first: what starts after it never delays the plugin's own start-up.
pub async fn registered_or_late(mut status: tokio::sync::watch::Receiver<KubeletStatus>) -> bool {
    tokio::time::timeout(
        OTHERS_START_AT_LATEST,
        status.wait_for(|k| k.registrations > 0),
    )
    .await
    .is_ok_and(|r| r.is_ok())
}

/// What to look at when a socket cannot be bound: the directory's permissions, where they are the cause.
fn bind_hint(error: &std::io::Error) -> &'static str {
    if error.kind() == std::io::ErrorKind::PermissionDenied {
        " (is the directory writable by this process?)"
    } else {
        ""
    }
}

/// Errors that stop the plugin.
#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    /// The device plugin directory does not exist.
    #[error(
        "device plugin directory {} does not exist (is the host's /var/lib/kubelet/device-plugins mounted into \
         the pod, and is --kubelet-dir right?)",
        .0.display()
    )]
    DirMissing(PathBuf),
    /// The device plugin directory is something else than a directory.
    #[error("device plugin directory {} is not a directory (check --kubelet-dir)", .0.display())]
    NotADir(PathBuf),
    /// Our socket path would not fit in a Unix socket address.
    #[error("socket path {} is {len} bytes, over the 107-byte Unix socket limit (use a shorter --kubelet-dir)", .path.display())]
    SocketPathTooLong {
        /// The path.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
    },
    /// Binding our socket failed.
    #[error("cannot bind {}: {source}{}", .path.display(), bind_hint(source))]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The inotify watch could not be set up.
    #[error("cannot watch {}: {source} (raise fs.inotify.max_user_watches or max_user_instances?)", .dir.display())]
    Watch {
        /// The watched directory.
        dir: PathBuf,
        /// The watcher error.
        source: notify::Error,
    },
    /// The device plugin directory was moved, deleted or replaced while the plugin served in it.
    #[error(
        "device plugin directory {} was moved, deleted or replaced while the plugin ran: the kubelet can no \
         longer reach its socket; stopping so that a restart serves in the directory the kubelet uses now",
        .0.display()
    )]
    DirReplaced(PathBuf),
    /// The resource's device list would not fit in one ListAndWatch message the kubelet accepts.
    #[error(
        "the device list of {resource} is {bytes} bytes encoded ({devices} devices), more than the {limit} bytes \
         the kubelet accepts in one ListAndWatch message: it would drop the stream and never see a fault; serve \
         fewer devices under this name (about {fit} fit: fewer sharing replicas, or MIG profiles under names of \
         their own)"
    )]
    ListTooLarge {
        /// The resource.
        resource: String,
        /// The largest list's encoded size.
        bytes: usize,
        /// Devices in it.
        devices: usize,
        /// The kubelet's limit.
        limit: usize,
        /// About how many devices fit.
        fit: usize,
    },
    /// The gRPC server stopped while the plugin meant to serve.
    #[error("the device plugin gRPC server stopped unexpectedly")]
    ServerStopped,
    /// The OS random source failed, so no unique socket name could be made.
    #[error("cannot make a unique socket name: {0}")]
    Random(String),
}

/// What the kubelet side of the plugin needs to know.
#[derive(Debug, Clone)]
pub struct PluginConfig {
    /// The kubelet's device plugin directory.
    pub kubelet_dir: PathBuf,
    /// Extended resource name to register, e.g. `nvidia.com/gpu`.
    pub resource_name: String,
    /// Socket file name; `None` picks a name unique to this process.
    pub socket_name: Option<String>,
    /// How Allocate describes devices to the runtime.
    pub allocate: AllocateOptions,
    /// Ask the kubelet to call PreStartContainer before each container start (the health gate).
    pub pre_start_check: bool,
    /// Where registrations and calls are counted, if anywhere.
    pub metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// Where the plugin stands with the kubelet, for `/readyz` and `/status`; kept current by [`run`].
    pub status: tokio::sync::watch::Sender<KubeletStatus>,
    /// Registration retry delays.
    pub backoff: ExponentialBuilder,
}

impl PluginConfig {
    /// Defaults for everything but the directory and resource name.
    pub fn new(kubelet_dir: impl Into<PathBuf>, resource_name: impl Into<String>) -> Self {
        PluginConfig {
            kubelet_dir: kubelet_dir.into(),
            resource_name: resource_name.into(),
            socket_name: None,
            allocate: AllocateOptions::default(),
            pre_start_check: true,
            metrics: crate::metrics::Metrics::off(),
            status: tokio::sync::watch::Sender::new(KubeletStatus::default()),
            backoff: default_backoff(),
        }
    }
}

/// Registration retry delays: the first retry after 1–2 ms, doubling up to 10 s, with jitter so that the
/// plugins of a node do not retry in lock-step. Retries go on for as long as the kubelet is away.
///
/// The first retry is short because the commonest failure is brief: the kubelet binds `kubelet.sock` and
/// then listens on it, and inotify reports the file at the bind, so a plugin that connects at once can be
/// refused in between (measured: 1 kubelet restart in 100 on a 2-core machine).
pub fn default_backoff() -> ExponentialBuilder {
    ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(1))
        .with_max_delay(Duration::from_secs(10))
        .with_jitter()
        .without_max_times()
}

/// Checks what can be checked before serving: the directory exists and the socket path fits.
pub fn socket_path_for(config: &PluginConfig) -> Result<PathBuf, KubeletError> {
    match std::fs::metadata(&config.kubelet_dir) {
        Ok(found) if found.is_dir() => {}
        Ok(_) => return Err(KubeletError::NotADir(config.kubelet_dir.clone())),
        Err(_) => return Err(KubeletError::DirMissing(config.kubelet_dir.clone())),
    }
    let name = match &config.socket_name {
        Some(name) => name.clone(),
        None => socket::unique_socket_name()?,
    };
    socket::socket_path(&config.kubelet_dir, &name)
}

/// How long after a successful `Register` the kubelet has to open its ListAndWatch stream before we register
/// again. The kubelet opens it right after `Register` returns; a kubelet that accepted us and opened nothing
/// has lost us (it died in between, or replaced us with another instance's registration).
pub const STREAM_WAIT: Duration = Duration::from_secs(5);

/// Serves the device plugin API and stays registered with the kubelet until `shutdown` is cancelled; then
/// ends every stream, removes the socket and returns.
///
/// The directory must exist: the kubelet creates it and never deletes it, so its absence means the host
/// directory is not mounted, which waiting would not fix. A missing `kubelet.sock` is waited for.
///
/// Invariant kept: while we serve and `kubelet.sock` exists, the kubelet holds a ListAndWatch stream to this
/// process. We register when we are not registered with the kubelet now behind `kubelet.sock` (start, a new
/// `kubelet.sock`), when the kubelet closes the last stream (kubelets up to 1.36 close the newest
/// instance's connection when any instance's stream ends, as in a rolling update), and when it opens none
/// within [`STREAM_WAIT`] of accepting us. One `Register` is in flight at a time and is never abandoned:
/// the kubelet may have accepted it already, and a second one would leave it two clients of this process.
pub async fn run(
    config: PluginConfig,
    inventory: InventoryWatch,
    shutdown: CancellationToken,
) -> Result<(), KubeletError> {
    let path = socket_path_for(&config)?;
    socket::remove_stale_sockets(&config.kubelet_dir);
    let socket_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Watch before binding and before looking for kubelet.sock, so no change can slip between the look and
    // the watch.
    let dir_watch = DirWatch::start(&config.kubelet_dir, &socket_name)?;

    let (conns, conn_rx) = mpsc::channel::<UnixStream>(64);
    let endpoint = Endpoint::bind(path, conns)?;
    tracing::info!(socket = %endpoint.path.display(), resource = %config.resource_name, "serving device plugin API");
    let (server, streams, ender) = Server::start(&config, inventory, conn_rx, &shutdown);

    let mut supervisor = Supervisor::new(
        config,
        shutdown,
        dir_watch,
        endpoint,
        (streams, ender),
        socket_name,
    );
    let stop = supervisor.supervise().await?;

    supervisor.endpoint.close();
    let dir_replaced = stop == Stop::DirReplaced;
    let server_died = !supervisor.shutdown.is_cancelled() && !dir_replaced;
    server.stop().await;
    if dir_replaced {
        return Err(KubeletError::DirReplaced(
            supervisor.config.kubelet_dir.clone(),
        ));
    }
    if server_died {
        return Err(KubeletError::ServerStopped);
    }
    Ok(())
}

/// Why the supervisor stopped serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// The process is shutting down.
    Shutdown,
    /// The device plugin directory is no longer the one we serve in (see [`DirWatch::replaced`]).
    DirReplaced,
    /// The gRPC server is gone: nothing can be served any more.
    ServerGone,
}

/// When the supervisor next acts by itself, unless something happens first.
enum Wake {
    /// The link has just changed: look at everything again before waiting.
    Again,
    /// At this instant, or, with `None`, only when something happens.
    At(Option<Instant>),
}

/// Our socket in the directory: its path, the channel every connection goes into (the gRPC server reads the
/// other end, whichever listener accepted it), and the listener bound now.
struct Endpoint {
    path: PathBuf,
    conns: mpsc::Sender<UnixStream>,
    socket: PluginSocket,
    /// Binds in a row whose file vanished as it was made (see [`Endpoint::rebind`]).
    vanished: u32,
}

impl Endpoint {
    /// Binds our socket; the plugin must be serving before it registers, since the kubelet dials back.
    fn bind(path: PathBuf, conns: mpsc::Sender<UnixStream>) -> Result<Self, KubeletError> {
        let socket = PluginSocket::bind(&path, conns.clone())?;
        Ok(Endpoint {
            path,
            conns,
            socket,
            vanished: 0,
        })
    }

    /// Whether our socket file is still the one we bound.
    fn is_in_place(&self) -> bool {
        self.socket.is_in_place()
    }

    /// Binds our socket again, after it was deleted (the kubelet deletes every socket here when it starts)
    /// or replaced ([`PluginSocket::keep_in_place`]).
    /// A file that vanishes as it is made (`NotFound`) means the directory is being emptied: deleted with
    /// everything in it (then serving stops as for a replaced directory, not as for a socket that cannot be
    /// bound), or cleared by a kubelet starting (then the next turn binds again, a bounded number of times).
    fn rebind(&mut self) -> Result<Option<Stop>, KubeletError> {
        use socket::{Found, Kept};
        // The rule every served socket follows: bound again unless another process serves there.
        match self.socket.keep_in_place(self.conns.clone()) {
            Ok(Kept::InPlace) => {
                self.vanished = 0;
                Ok(None)
            }
            Ok(Kept::LeftTo) => {
                tracing::warn!(socket = %self.path.display(), "another process serves on the plugin socket's name; leaving it to that one");
                Ok(None)
            }
            Ok(Kept::Rebound(found)) => {
                let why = match found {
                    Found::Gone => "was removed (kubelet restart?)",
                    other => other.describe(),
                };
                tracing::info!(socket = %self.path.display(), "plugin socket {why}: binding it again");
                self.vanished = 0;
                Ok(None)
            }
            Err(e @ KubeletError::Bind { .. }) if vanished(&e) => {
                if !self.path.parent().is_some_and(Path::is_dir) {
                    return Ok(Some(Stop::DirReplaced));
                }
                self.vanished += 1;
                if self.vanished > MAX_VANISHED_BINDS {
                    return Err(e);
                }
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Drops our end of the connection channel, then stops accepting and removes our socket file if it is
    /// still ours, so that nothing new reaches the server that is about to stop.
    fn close(self) {
        drop(self.conns);
        self.socket.remove();
    }
}

/// The one gRPC server of the process, fed by [`Endpoint`]'s channel, and the token that stops it.
struct Server {
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    shutdown: CancellationToken,
}

impl Server {
    /// Starts serving the device plugin API on the connections of `conns`; also returns the count of open
    /// ListAndWatch streams, which is how the kubelet's hold on us is seen.
    fn start(
        config: &PluginConfig,
        inventory: InventoryWatch,
        conns: mpsc::Receiver<UnixStream>,
        shutdown: &CancellationToken,
    ) -> (
        Server,
        tokio::sync::watch::Receiver<server::Streams>,
        server::StreamEnder,
    ) {
        // A child of the process's token: the server and its streams also stop when the supervisor gives up
        // on its own.
        let server_shutdown = shutdown.child_token();
        let service =
            PluginService::new(inventory, config.allocate.clone(), server_shutdown.clone())
                .with_pre_start_check(config.pre_start_check)
                .with_metrics(config.metrics.clone());
        let streams = service.streams();
        let ender = service.stream_ender();
        // Held to a cap, as the DRA sockets are: only the kubelet should connect here.
        let metrics = config.metrics.clone();
        let incoming = crate::util::bounded::held_connections(
            conns,
            "device plugin socket",
            std::sync::Arc::new(move || metrics.socket_connection_evicted("device plugin socket")),
        );
        let task = tokio::spawn(
            crate::util::bounded::kubelet_server()
                .add_service(DevicePluginServer::new(service))
                .serve_with_incoming_shutdown(incoming, server_shutdown.clone().cancelled_owned()),
        );
        let server = Server {
            task,
            shutdown: server_shutdown,
        };
        (server, streams, ender)
    }

    /// Ends every stream and waits for the server to stop, at most [`SHUTDOWN_GRACE`], so that the process
    /// is gone within the time a DaemonSet update or node drain allows it.
    async fn stop(self) {
        self.shutdown.cancel();
        match tokio::time::timeout(SHUTDOWN_GRACE, self.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => {
                tracing::warn!(error = %registration::error_chain(&e), "gRPC server stopped with an error")
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "gRPC server task failed"),
            Err(_) => {
                tracing::warn!("gRPC connections still open after {SHUTDOWN_GRACE:?}; closing them")
            }
        }
    }
}

/// The loop that makes the directory look right: our socket in place and a registration with the kubelet
/// now behind `kubelet.sock`, whose stream it still holds.
struct Supervisor {
    config: PluginConfig,
    /// The process's token: our own streams end at shutdown, and that is not the kubelet closing them.
    shutdown: CancellationToken,
    dir_watch: DirWatch,
    endpoint: Endpoint,
    /// The ListAndWatch streams the server holds open.
    streams: tokio::sync::watch::Receiver<server::Streams>,
    /// Ends the streams the kubelet replaced (see [`Supervisor::end_replaced_streams`]).
    ender: server::StreamEnder,
    kubelet_socket: PathBuf,
    registrar: Registrar,
    link: Link,
    /// The kubelet.sock of the latest accepted registration, to count kubelet restarts.
    last_kubelet: Option<Option<crate::util::files::FileId>>,
    /// Another plugin's socket went within [`OTHER_LEFT_SPACING`] of our registration: register again at
    /// this instant, still registered meanwhile.
    register_again_at: Option<Instant>,
}

/// The most ListAndWatch streams of ours left open when registering again for another plugin's socket gone
/// (see [`Supervisor::register_again_for_other_left`]).
const MAX_OPEN_STREAMS: usize = 3;

/// At most one registration a second for other plugins' sockets going away: a process removing sockets in a
/// loop (root, in the kubelet's directory) would otherwise make the plugin, and the kubelet, register once
/// per removal (967 registrations in 2.5 s, half a core, measured).
const OTHER_LEFT_SPACING: Duration = Duration::from_secs(1);

impl Supervisor {
    /// A supervisor that owes a registration now; says in the status what it serves and where.
    fn new(
        config: PluginConfig,
        shutdown: CancellationToken,
        dir_watch: DirWatch,
        endpoint: Endpoint,
        (streams, ender): (
            tokio::sync::watch::Receiver<server::Streams>,
            server::StreamEnder,
        ),
        socket_name: String,
    ) -> Self {
        let kubelet_socket = config.kubelet_dir.join(KUBELET_SOCKET);
        config.status.send_modify(|s| {
            s.resource = config.resource_name.clone();
            s.kubelet_socket = kubelet_socket.display().to_string();
            s.endpoint = socket_name.clone();
            s.pre_start_check = config.pre_start_check;
        });
        let registrar = Registrar::new(&config, socket_name);
        Supervisor {
            config,
            shutdown,
            dir_watch,
            endpoint,
            streams,
            ender,
            kubelet_socket,
            registrar,
            link: Link::Owed(Some(Instant::now())),
            last_kubelet: None,
            register_again_at: None,
        }
    }

    /// Keeps the socket bound and the registration current until serving must stop, and says why. Each turn
    /// looks at the directory and the streams first, then either registers (when an attempt is due) or
    /// waits for the next thing to act on. An error is a socket that cannot be bound again.
    async fn supervise(&mut self) -> Result<Stop, KubeletError> {
        loop {
            if let Some(stop) = self.must_stop() {
                return Ok(stop);
            }
            if let Some(stop) = self.keep_socket_in_place()? {
                return Ok(stop);
            }
            self.follow_streams();
            self.publish_status();
            let wake_at = match self.next_wake() {
                Wake::Again => continue,
                Wake::At(at) => at,
            };
            // An attempt that is due now starts at once: a timer, even an expired one, costs a tick (1 ms) of
            // the runtime's timer wheel, and a kubelet restart is exactly when every millisecond counts.
            let due = matches!(self.link, Link::Owed(Some(at)) if at <= Instant::now());
            let next = if due {
                self.register().await?
            } else {
                self.wait(wake_at).await
            };
            if let ControlFlow::Break(stop) = next {
                return Ok(stop);
            }
        }
    }

    /// Whether serving must stop before anything else is done: the process shuts down, or the directory
    /// was replaced under us (waiting would not bring the kubelet back to it).
    fn must_stop(&self) -> Option<Stop> {
        if self.shutdown.is_cancelled() {
            return Some(Stop::Shutdown);
        }
        if self.dir_watch.replaced() {
            return Some(Stop::DirReplaced);
        }
        None
    }

    /// Binds our socket again if it was deleted (the kubelet deletes every socket here when it restarts),
    /// and then owes a registration unless we are registered with the kubelet now behind `kubelet.sock`.
    fn keep_socket_in_place(&mut self) -> Result<Option<Stop>, KubeletError> {
        if !self.endpoint.is_in_place() {
            if let Some(stop) = self.endpoint.rebind()? {
                return Ok(Some(stop));
            }
            if !self.link.holds(&self.kubelet_socket) {
                self.link = self.registrar.owe_now();
            }
        }
        Ok(None)
    }

    /// While registered: notes when the kubelet opened its stream, and marks the registration lost when no
    /// stream is open any more (a kubelet restart, or another instance's stream ending on kubelets up to
    /// 1.36), with the delay before registering again.
    fn follow_streams(&mut self) {
        if let Link::Registered {
            awaiting,
            lost,
            since,
            ..
        } = &mut self.link
        {
            let now = *self.streams.borrow_and_update();
            if let Some((opened_before, _)) = *awaiting
                && now.opened > opened_before
            {
                *awaiting = None;
            }
            // Past the wait for its stream, the newest stream ending is the registration lost, whether or not
            // older ones are still open (with none open, the newest has ended too).
            if awaiting.is_none() && now.newest_ended {
                let delay = self.registrar.lost_after(since.elapsed());
                tracing::warn!(
                    held_ms = since.elapsed().as_millis() as u64,
                    retry_in_ms = delay.as_millis() as u64,
                    "the kubelet closed our ListAndWatch stream (it restarted, or, on kubelets up to 1.36, \
                     another instance of this plugin stopped, as in a rolling update); registering again"
                );
                *lost = Some(delay);
            }
        }
    }

    /// Tells `/readyz` and `/status` whether we are registered and how many streams are open; watchers wake
    /// only on a change.
    fn publish_status(&self) {
        let registered = matches!(self.link, Link::Registered { lost: None, .. });
        let open = self.streams.borrow().open;
        self.config.status.send_if_modified(|s| {
            let changed = s.registered != registered || s.streams_open != open;
            s.registered = registered;
            s.streams_open = open;
            changed
        });
    }

    /// When to act next by ourselves: the owed attempt, or the end of the wait for the kubelet's stream. A
    /// lost registration becomes one owed after its delay, and the turn starts again.
    fn next_wake(&mut self) -> Wake {
        match &self.link {
            Link::Owed(at) => Wake::At(*at),
            Link::Registered {
                lost: Some(delay), ..
            } => {
                let delay = *delay;
                // The kubelet dropped the client it used (ours): it uses none of ours now, so the end of the
                // clients it replaced before cuts nothing.
                self.end_replaced_streams();
                self.link = self.registrar.owe_after_lost(delay);
                Wake::Again
            }
            Link::Registered {
                awaiting: Some((_, deadline)),
                ..
            } => Wake::At(Some(*deadline)),
            Link::Registered { .. } => Wake::At(self.register_again_at),
        }
    }

    /// One registration attempt, run to its end, and the link it leaves. Breaks when serving must stop
    /// meanwhile.
    async fn register(&mut self) -> Result<ControlFlow<Stop>, KubeletError> {
        // Whatever it was owed for, this registration makes us the kubelet's newest client.
        self.register_again_at = None;
        let before = self.streams.borrow().opened;
        let target = crate::util::files::FileId::of(&self.kubelet_socket);
        let (outcome, changed) = match self.attempt_watching().await? {
            ControlFlow::Continue(ran) => ran,
            ControlFlow::Break(stop) => return Ok(ControlFlow::Break(stop)),
        };
        self.link = self.settle(outcome, target, before, changed);
        Ok(ControlFlow::Continue(()))
    }

    /// Runs an attempt to its end while watching the directory: changes meanwhile are noted (the returned
    /// flag), and our socket is re-bound at once so that the kubelet's dial-back can reach it.
    async fn attempt_watching(
        &mut self,
    ) -> Result<ControlFlow<Stop, (Attempt, bool)>, KubeletError> {
        let mut changed = false;
        let attempt = self.registrar.attempt(&self.kubelet_socket);
        tokio::pin!(attempt);
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => return Ok(ControlFlow::Break(Stop::Shutdown)),
                () = self.dir_watch.changed() => {
                    changed = true;
                    // The registration under way makes us the kubelet's newest client anyway.
                    self.dir_watch.take_other_left();
                    if self.dir_watch.replaced() {
                        return Ok(ControlFlow::Break(Stop::DirReplaced));
                    }
                    if !self.endpoint.is_in_place() {
                        if let Some(stop) = self.endpoint.rebind()? {
                            return Ok(ControlFlow::Break(stop));
                        }
                    }
                }
                outcome = &mut attempt => return Ok(ControlFlow::Continue((outcome, changed))),
            }
        }
    }

    /// The link an attempt leaves, given `target`, the `kubelet.sock` it began with, and `before`, the streams
    /// opened by then. A registration with a kubelet that has since been replaced is made again at once;
    /// so is a failure while the directory changed.
    fn settle(
        &mut self,
        outcome: Attempt,
        target: Option<crate::util::files::FileId>,
        before: u64,
        changed: bool,
    ) -> Link {
        // What kubelet.sock is now. If there was none when the attempt began, the one that appeared meanwhile
        // is the one the attempt reached.
        let now_id = crate::util::files::FileId::of(&self.kubelet_socket);
        match outcome {
            Attempt::Registered if target.is_some() && now_id != target => {
                tracing::info!(
                    "kubelet.sock was replaced while registering; registering with the new kubelet"
                );
                self.registrar.owe_now()
            }
            Attempt::Registered => {
                let target = target.or(now_id);
                self.config.status.send_modify(|s| s.registrations += 1);
                self.config
                    .metrics
                    .registered(self.last_kubelet.is_some_and(|last| last != target));
                self.last_kubelet = Some(target);
                Link::Registered {
                    kubelet: target,
                    since: Instant::now(),
                    awaiting: Some((before, Instant::now() + STREAM_WAIT)),
                    lost: None,
                }
            }
            Attempt::NoKubelet => Link::Owed(None),
            // A new kubelet came up while we talked to the old one (its inotify event may still be on its
            // way): no reason to wait.
            Attempt::Failed(_) if changed || now_id != target => self.registrar.owe_now(),
            Attempt::Failed(retry_in) => Link::Owed(Some(Instant::now() + retry_in)),
        }
    }

    /// Waits for the next thing to act on: shutdown, a directory change, a stream opened or closed, or the
    /// time to act by ourselves. Breaks when serving must stop.
    async fn wait(&mut self, wake_at: Option<Instant>) -> ControlFlow<Stop> {
        tokio::select! {
            () = self.shutdown.cancelled() => return ControlFlow::Break(Stop::Shutdown),
            () = self.dir_watch.changed() => self.on_dir_change(),
            changed = self.streams.changed() => {
                if changed.is_err() {
                    // The gRPC server is gone (it holds the other end): nothing can be served any more.
                    return ControlFlow::Break(Stop::ServerGone);
                }
            }
            () = sleep_until(wake_at) => self.on_wake(),
        }
        ControlFlow::Continue(())
    }

    /// A sign of a kubelet restart; our socket is looked at on the next turn. A sign that changed nothing (a
    /// late duplicate of an event already acted on) must not register twice. Another plugin's socket gone
    /// while we are registered: register again at once (see [`DirWatch::take_other_left`]); on a real 1.36
    /// kubelet a plugin of our resource that registered after us and stopped left the node with no GPUs
    /// until we were restarted.
    fn on_dir_change(&mut self) {
        let other_left = self.dir_watch.take_other_left();
        if !self.link.holds(&self.kubelet_socket) && self.endpoint.is_in_place() {
            self.link = self.registrar.owe_now();
        } else if other_left
            && let Link::Registered {
                awaiting: None,
                since,
                ..
            } = self.link
        {
            let at = since + OTHER_LEFT_SPACING;
            if at <= Instant::now() {
                self.register_again_for_other_left();
            } else {
                self.register_again_at = Some(at);
            }
        }
    }

    /// Owes a registration now because another plugin's socket went (see [`Supervisor::on_dir_change`]).
    ///
    /// A kubelet up to 1.36 keeps the client each registration replaces, stream open, for good: without a
    /// bound, a socket made and removed in a loop left one more stream per registration. Past
    /// [`MAX_OPEN_STREAMS`], every stream is ended before registering: such a kubelet then drops the
    /// client it uses (ours, or nobody's if the plugin that went had taken the resource) until the new
    /// registration's first list, a moment later.
    fn register_again_for_other_left(&mut self) {
        tracing::info!(
            "another device plugin's socket was removed; registering again, in case it had taken this \
             resource from us (kubelets up to 1.36 then drop the resource with it)"
        );
        if self.streams.borrow().open >= MAX_OPEN_STREAMS {
            tracing::info!(
                open = self.streams.borrow().open,
                "ending this plugin's ListAndWatch streams before registering again: a kubelet up to 1.36 \
                 keeps every client a registration replaces"
            );
            self.end_replaced_streams();
        }
        self.register_again_at = None;
        self.link = self.registrar.owe_now();
    }

    /// Ends every stream opened so far: the next registration's stream is the one the kubelet uses.
    fn end_replaced_streams(&self) {
        let streams = *self.streams.borrow();
        if streams.open > 0 {
            self.ender.end_through(streams.opened);
        }
    }

    /// The time set by [`Supervisor::next_wake`] came. An owed attempt is due and starts on the next turn; a
    /// registration held back by [`OTHER_LEFT_SPACING`] is owed now; a registration whose stream the kubelet
    /// did not open in time is made again after a backoff delay.
    fn on_wake(&mut self) {
        if self
            .register_again_at
            .is_some_and(|at| at <= Instant::now())
            && matches!(self.link, Link::Registered { awaiting: None, .. })
        {
            self.register_again_for_other_left();
            return;
        }
        if let Link::Registered {
            awaiting: Some(_), ..
        } = self.link
        {
            let delay = self.registrar.next_delay();
            tracing::warn!(
                waited_ms = STREAM_WAIT.as_millis() as u64,
                retry_in_ms = delay.as_millis() as u64,
                "the kubelet accepted the registration but opened no ListAndWatch stream; registering again"
            );
            self.link = Link::Owed(Some(Instant::now() + delay));
        }
    }
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Where the plugin stands with the kubelet.
#[derive(Debug)]
enum Link {
    /// A registration is owed: at this instant, or, with `None`, as soon as `kubelet.sock` appears.
    Owed(Option<Instant>),
    /// The kubelet behind `kubelet` accepted our registration.
    Registered {
        /// Identity of `kubelet.sock` when we registered: a different one is a different kubelet.
        kubelet: Option<crate::util::files::FileId>,
        /// When the kubelet accepted it.
        since: Instant,
        /// Until the kubelet opens its stream: the streams opened before the registration, and how long we
        /// wait for a new one.
        awaiting: Option<(u64, Instant)>,
        /// The kubelet closed the last stream: register again after this delay.
        lost: Option<Duration>,
    },
}

impl Link {
    /// Whether we are registered with the kubelet now behind `kubelet_socket`.
    fn holds(&self, kubelet_socket: &std::path::Path) -> bool {
        match self {
            Link::Registered { kubelet, lost, .. } => {
                lost.is_none()
                    && kubelet.is_some()
                    && *kubelet == crate::util::files::FileId::of(kubelet_socket)
            }
            Link::Owed(_) => false,
        }
    }
}

/// How one registration attempt ended.
#[derive(Debug)]
enum Attempt {
    /// The kubelet accepted it.
    Registered,
    /// There is no `kubelet.sock`: wait for it to appear.
    NoKubelet,
    /// It failed; try again after this delay.
    Failed(Duration),
}

/// A registration whose stream the kubelet closes within this long counts as short-lived (see
/// [`Registrar::lost_after`]).
const SHORT_LIVED: Duration = Duration::from_secs(10);

/// Registration attempts: the request, the backoff between failures, and what was last logged.
struct Registrar {
    request: RegisterRequest,
    backoff_builder: ExponentialBuilder,
    backoff: backon::ExponentialBackoff,
    failures: u32,
    /// Short-lived registrations in a row.
    short_lived: u32,
    /// The last failure logged at warn level; a repeat of it is logged at debug only.
    last_logged: Option<String>,
    waiting_logged: bool,
}

impl Registrar {
    fn new(config: &PluginConfig, endpoint: String) -> Self {
        Registrar {
            request: RegisterRequest {
                version: VERSION.to_string(),
                endpoint,
                resource_name: config.resource_name.clone(),
                options: Some(server::plugin_options(config.pre_start_check)),
            },
            backoff_builder: config.backoff,
            backoff: config.backoff.build(),
            failures: 0,
            short_lived: 0,
            last_logged: None,
            waiting_logged: false,
        }
    }

    /// How long to wait before registering again after the kubelet closed our last stream, `held` after
    /// accepting the registration. The first time, not at all: a rolling update's cut is a one-off and every
    /// millisecond of it is a node without GPUs. A kubelet that keeps closing the stream soon after each
    /// registration gets them further and further apart (5 ms, doubling, at most 10 s) rather than a storm.
    fn lost_after(&mut self, held: Duration) -> Duration {
        self.short_lived = if held < SHORT_LIVED {
            self.short_lived.saturating_add(1)
        } else {
            1
        };
        match self.short_lived {
            0 | 1 => Duration::ZERO,
            n => Duration::from_millis(5)
                .saturating_mul(1 << (n - 2).min(12))
                .min(Duration::from_secs(10)),
        }
    }

    /// A registration owed now, with a fresh backoff: something changed (a new kubelet, our socket).
    fn owe_now(&mut self) -> Link {
        self.backoff = self.backoff_builder.build();
        // A kubelet restart explains a lost stream: only losses without one count as a kubelet that keeps
        // closing the stream.
        self.short_lived = 0;
        Link::Owed(Some(Instant::now()))
    }

    /// A registration owed `delay` from now (see [`Registrar::lost_after`]) after the kubelet closed our
    /// last stream.
    fn owe_after_lost(&mut self, delay: Duration) -> Link {
        self.backoff = self.backoff_builder.build();
        Link::Owed(Some(Instant::now() + delay))
    }

    /// The next backoff delay.
    fn next_delay(&mut self) -> Duration {
        self.backoff.next().unwrap_or(Duration::from_secs(10))
    }

    async fn attempt(&mut self, kubelet_socket: &std::path::Path) -> Attempt {
        if !kubelet_socket.exists() {
            // No kubelet yet (or it is restarting): its socket's creation wakes us, no need to poll.
            if !self.waiting_logged {
                tracing::info!(socket = %kubelet_socket.display(), "waiting for the kubelet to create its socket");
                self.waiting_logged = true;
            }
            return Attempt::NoKubelet;
        }
        self.waiting_logged = false;
        let started = Instant::now();
        match registration::register(kubelet_socket, self.request.clone()).await {
            Ok(()) => {
                tracing::info!(
                    resource = %self.request.resource_name,
                    endpoint = %self.request.endpoint,
                    failed_attempts = self.failures,
                    took_ms = started.elapsed().as_secs_f64() * 1000.0,
                    "registered with the kubelet"
                );
                self.failures = 0;
                self.last_logged = None;
                self.backoff = self.backoff_builder.build();
                Attempt::Registered
            }
            Err(e) => {
                self.failures += 1;
                let delay = self.next_delay();
                let cause = e.to_string();
                if self.last_logged.as_deref() != Some(cause.as_str()) {
                    tracing::warn!(error = %cause, retry_in_ms = delay.as_millis() as u64, "cannot register with the kubelet; will retry");
                    self.last_logged = Some(cause);
                } else {
                    tracing::debug!(error = %cause, attempt = self.failures, "registration failed again");
                }
                Attempt::Failed(delay)
            }
        }
    }
}

/// The plugin's link with the kubelet.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeletStatus {
    /// Extended resource name registered.
    pub resource: String,
    /// The kubelet's registration socket.
    pub kubelet_socket: String,
    /// Our socket's file name, as registered.
    pub endpoint: String,
    /// The kubelet behind `kubelet.sock` accepted our registration and has not closed our stream since.
    pub registered: bool,
    /// ListAndWatch streams open now (the kubelet holds one while it uses this plugin).
    pub streams_open: usize,
    /// Registrations the kubelet accepted since the plugin started.
    pub registrations: u64,
    /// Whether the kubelet calls PreStartContainer before each container start (the start check).
    pub pre_start_check: bool,
}

/// Binds in a row whose file may vanish as it is made before that is an error.
const MAX_VANISHED_BINDS: u32 = 16;

/// Whether a bind failed because a path it made was gone a moment later.
fn vanished(e: &KubeletError) -> bool {
    matches!(e, KubeletError::Bind { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_the_kubelet_keeps_closing_is_registered_for_further_and_further_apart() {
        let config = PluginConfig::new("/d", "nvidia.com/gpu");
        let mut registrar = Registrar::new(&config, "plugin.sock".into());
        let soon = Duration::from_millis(3);
        // A rolling update's cut: at once, however soon after the registration.
        assert_eq!(registrar.lost_after(soon), Duration::ZERO);
        let delays: Vec<_> = (0..4).map(|_| registrar.lost_after(soon)).collect();
        assert_eq!(delays, [5, 10, 20, 40].map(Duration::from_millis).to_vec());
        assert!(registrar.lost_after(soon) <= Duration::from_secs(10));
        for _ in 0..40 {
            assert!(registrar.lost_after(soon) <= Duration::from_secs(10));
        }
        // A stream held for a while resets the count: the next cut is answered at once again.
        assert_eq!(registrar.lost_after(SHORT_LIVED), Duration::ZERO);
        // So does a kubelet restart, which explains the lost stream.
        assert!(registrar.lost_after(soon) > Duration::ZERO);
        registrar.owe_now();
        assert_eq!(registrar.lost_after(soon), Duration::ZERO);
    }

    #[tokio::test]
    async fn a_kubelet_socket_that_refuses_is_tried_again_within_2_ms()
    -> Result<(), Box<dyn std::error::Error>> {
        // A socket file nobody listens on, as between the kubelet's bind and its listen.
        let dir = tempfile::tempdir()?;
        let kubelet_socket = dir.path().join(KUBELET_SOCKET);
        drop(std::os::unix::net::UnixListener::bind(&kubelet_socket)?);
        let config = PluginConfig::new(dir.path(), "nvidia.com/gpu");
        let mut registrar = Registrar::new(&config, "plugin.sock".into());
        let outcome = registrar.attempt(&kubelet_socket).await;
        let Attempt::Failed(wait) = outcome else {
            return Err(format!("a refused registration must be retried, got {outcome:?}").into());
        };
        assert!(wait <= Duration::from_millis(2), "next try in {wait:?}");
        assert_eq!(registrar.failures, 1);
        Ok(())
    }
}
