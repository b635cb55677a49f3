//! Everything the kubelet's device manager talks to: the gRPC server on our socket ([`server`]), registration
//! ([`registration`]), and staying registered across kubelet restarts ([`watch`], [`socket`]).
//!
//! [`run`] keeps one gRPC server for the life of the process. A supervisor loop makes the directory look
//! right: our socket in place (re-bound if the kubelet deleted it) and a registration with the current
//! kubelet (made again whenever `kubelet.sock` is re-created). Device state lives outside, in the inventory
//! watch, so nothing is lost across a kubelet restart.

pub mod registration;
pub mod server;
pub mod socket;
pub mod uds;
pub mod watch;

use std::path::PathBuf;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use futures_util::StreamExt as _;
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use crate::allocation::AllocateOptions;
use crate::api::device_plugin_server::DevicePluginServer;
use crate::api::{KUBELET_SOCKET, RegisterRequest, VERSION};
use crate::devices::InventoryWatch;
use server::PluginService;
use socket::PluginSocket;
use watch::DirWatch;

/// How long shutdown waits for open streams to close before it stops waiting; the process must be gone within
/// the 2 s a DaemonSet update or node drain allows it comfortably.
const SHUTDOWN_GRACE: Duration = Duration::from_millis(1000);

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
    /// Our socket path would not fit in a Unix socket address.
    #[error("socket path {} is {len} bytes, over the 107-byte Unix socket limit (use a shorter --kubelet-dir)", .path.display())]
    SocketPathTooLong {
        /// The path.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
    },
    /// Binding our socket failed.
    #[error("cannot bind {}: {source} (is the directory writable by this process?)", .path.display())]
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
    if !config.kubelet_dir.is_dir() {
        return Err(KubeletError::DirMissing(config.kubelet_dir.clone()));
    }
    let name = match &config.socket_name {
        Some(name) => name.clone(),
        None => socket::unique_socket_name()?,
    };
    socket::socket_path(&config.kubelet_dir, &name)
}

/// Serves the device plugin API and stays registered with the kubelet until `shutdown` is cancelled; then
/// ends every stream, removes the socket and returns.
///
/// The directory must exist: the kubelet creates it and never deletes it, so its absence means the host
/// directory is not mounted, which waiting would not fix. A missing `kubelet.sock` is waited for.
pub async fn run(
    config: PluginConfig,
    inventory: InventoryWatch,
    shutdown: CancellationToken,
) -> Result<(), KubeletError> {
    let path = socket_path_for(&config)?;
    let dir = config.kubelet_dir.as_path();
    socket::remove_stale_sockets(dir);
    let socket_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Watch before binding and before looking for kubelet.sock, so no change can slip between the look and
    // the watch.
    let dir_watch = DirWatch::start(dir, &socket_name)?;

    let (conn_tx, conn_rx) = mpsc::channel::<UnixStream>(64);
    let mut socket = PluginSocket::bind(&path, conn_tx.clone())?;
    tracing::info!(socket = %path.display(), resource = %config.resource_name, "serving device plugin API");

    let service = PluginService::new(inventory, config.allocate.clone(), shutdown.clone());
    let incoming = ReceiverStream::new(conn_rx).map(Ok::<_, std::io::Error>);
    let server_shutdown = shutdown.clone();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(service))
            .serve_with_incoming_shutdown(incoming, server_shutdown.cancelled_owned()),
    );

    let mut registrar = Registrar::new(&config, socket_name, dir.join(KUBELET_SOCKET));
    loop {
        if !socket.is_in_place() {
            tracing::info!(socket = %path.display(), "plugin socket was removed (kubelet restart?); binding it again");
            drop(socket);
            socket = PluginSocket::bind(&path, conn_tx.clone())?;
            registrar.reset();
        }
        let retry_at = registrar.next_attempt_at();
        // An attempt that is due now starts at once: a timer, even an expired one, costs a tick (1 ms) of
        // the runtime's timer wheel, and a kubelet restart is exactly when every millisecond counts.
        let due = retry_at.is_some_and(|at| at <= Instant::now());
        if !due {
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = dir_watch.changed() => registrar.reset(),
                () = sleep_until(retry_at) => {}
            }
            continue;
        }
        tokio::select! {
            () = shutdown.cancelled() => break,
            // A restart sign mid-attempt: this attempt talks to a kubelet that is going away.
            () = dir_watch.changed() => registrar.reset(),
            () = registrar.attempt() => {}
        }
    }

    drop(conn_tx);
    socket.remove();
    match tokio::time::timeout(SHUTDOWN_GRACE, server).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => {
            tracing::warn!(error = %registration::error_chain(&e), "gRPC server stopped with an error")
        }
        Ok(Err(e)) => tracing::warn!(error = %e, "gRPC server task failed"),
        Err(_) => {
            tracing::warn!("gRPC connections still open after {SHUTDOWN_GRACE:?}; closing them")
        }
    }
    Ok(())
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Registration state: whether we owe the kubelet a registration, when to try next, and what was last logged.
struct Registrar {
    kubelet_socket: PathBuf,
    request: RegisterRequest,
    backoff_builder: ExponentialBuilder,
    backoff: backon::ExponentialBackoff,
    /// `Some(at)` while a registration is owed.
    next_at: Option<Instant>,
    failures: u32,
    /// The last failure logged at warn level; a repeat of it is logged at debug only.
    last_logged: Option<String>,
    waiting_logged: bool,
}

impl Registrar {
    fn new(config: &PluginConfig, endpoint: String, kubelet_socket: PathBuf) -> Self {
        Registrar {
            kubelet_socket,
            request: RegisterRequest {
                version: VERSION.to_string(),
                endpoint,
                resource_name: config.resource_name.clone(),
                options: Some(server::plugin_options()),
            },
            backoff_builder: config.backoff,
            backoff: config.backoff.build(),
            next_at: Some(Instant::now()),
            failures: 0,
            last_logged: None,
            waiting_logged: false,
        }
    }

    /// Owe a registration now, with a fresh backoff: something changed in the directory.
    fn reset(&mut self) {
        self.backoff = self.backoff_builder.build();
        self.next_at = Some(Instant::now());
    }

    fn next_attempt_at(&self) -> Option<Instant> {
        self.next_at
    }

    async fn attempt(&mut self) {
        if !self.kubelet_socket.exists() {
            // No kubelet yet (or it is restarting): its socket's creation wakes us, no need to poll.
            if !self.waiting_logged {
                tracing::info!(socket = %self.kubelet_socket.display(), "waiting for the kubelet to create its socket");
                self.waiting_logged = true;
            }
            self.next_at = None;
            return;
        }
        self.waiting_logged = false;
        let started = Instant::now();
        match registration::register(&self.kubelet_socket, self.request.clone()).await {
            Ok(()) => {
                tracing::info!(
                    resource = %self.request.resource_name,
                    endpoint = %self.request.endpoint,
                    failed_attempts = self.failures,
                    took_ms = started.elapsed().as_secs_f64() * 1000.0,
                    "registered with the kubelet"
                );
                self.next_at = None;
                self.failures = 0;
                self.last_logged = None;
                self.backoff = self.backoff_builder.build();
            }
            Err(e) => {
                self.failures += 1;
                let delay = self.backoff.next().unwrap_or(Duration::from_secs(10));
                let cause = e.to_string();
                if self.last_logged.as_deref() != Some(cause.as_str()) {
                    tracing::warn!(error = %cause, retry_in_ms = delay.as_millis() as u64, "cannot register with the kubelet; will retry");
                    self.last_logged = Some(cause);
                } else {
                    tracing::debug!(error = %cause, attempt = self.failures, "registration failed again");
                }
                self.next_at = Some(Instant::now() + delay);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_kubelet_socket_that_refuses_is_tried_again_within_2_ms()
    -> Result<(), Box<dyn std::error::Error>> {
        // A socket file nobody listens on, as between the kubelet's bind and its listen.
        let dir = tempfile::tempdir()?;
        let kubelet_socket = dir.path().join(KUBELET_SOCKET);
        drop(std::os::unix::net::UnixListener::bind(&kubelet_socket)?);
        let config = PluginConfig::new(dir.path(), "nvidia.com/gpu");
        let mut registrar = Registrar::new(&config, "plugin.sock".into(), kubelet_socket);
        registrar.attempt().await;
        let retry_at = registrar
            .next_attempt_at()
            .ok_or("a refused registration must be retried")?;
        let wait = retry_at.saturating_duration_since(Instant::now());
        assert!(wait <= Duration::from_millis(2), "next try in {wait:?}");
        assert_eq!(registrar.failures, 1);
        Ok(())
    }
}
