//! The kubelet's plugin manager and DRA plugin manager: registration with its backoff, the store of
//! registered plugins and their connections, the health stream of each, and the wiping of a gone driver's
//! slices. The sockets come from the watcher.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use gpu_device_plugin::api::dra::registration::registration_client::RegistrationClient;
use gpu_device_plugin::api::dra::registration::{InfoRequest, RegistrationStatus};
use gpu_device_plugin::util::{authority, uds};
use h2::frame::Headers;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint, Uri};

use super::health::{HealthService, HealthStream};
use super::{
    DraRegistration, DraService, HealthStreamEvent, Outcome, PLUGIN_TYPE, RegistrationAttempt,
    Shared, StreamEvent, Wipe, choose_services,
};
use crate::apiserver::ApiServerLink;

/// The kubelet dials a registration socket for this long.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// `GetInfo` gets this long.
const GET_INFO_TIMEOUT: Duration = Duration::from_secs(1);
/// `NotifyRegistrationStatus` gets this long.
const NOTIFY_TIMEOUT: Duration = Duration::from_secs(5);

/// The registered plugins, the sockets being handled, and the pending slice wipes.
#[derive(Default)]
pub(crate) struct Store {
    plugins: Vec<Plugin>,
    /// Every registration socket known, with the identity of the file (a socket made again is another
    /// file) and the token that ends its registration and health stream.
    pub(super) sockets: HashMap<PathBuf, (FileId, CancellationToken)>,
    /// Drivers whose slices will be deleted unless one of their plugins connects first.
    pending_wipes: HashMap<String, CancellationToken>,
}

pub(super) struct Plugin {
    registration: DraRegistration,
    channel: Channel,
    /// Open connections to its endpoint.
    connections: Arc<AtomicUsize>,
}

impl Store {
    /// The registration sockets taken in.
    pub(crate) fn sockets(&self) -> Vec<PathBuf> {
        let mut sockets: Vec<PathBuf> = self.sockets.keys().cloned().collect();
        sockets.sort();
        sockets
    }

    /// Whether a plugin of `driver` has a connection up.
    pub(crate) fn usable(&self, driver: &str) -> bool {
        self.plugins
            .iter()
            .any(|p| p.registration.driver == driver && p.connections.load(Ordering::SeqCst) > 0)
    }

    /// The plugin of `driver` the kubelet calls: the newest connected one, else the newest.
    pub(crate) fn pick(&self, driver: &str) -> Option<(DraService, Channel)> {
        let mut ofdriver = self
            .plugins
            .iter()
            .rev()
            .filter(|p| p.registration.driver == driver);
        let newest = ofdriver.clone().next();
        ofdriver
            .find(|p| p.connections.load(Ordering::SeqCst) > 0)
            .or(newest)
            .map(|p| (p.registration.service, p.channel.clone()))
    }
}

/// Which file a path names: a socket removed and made again is another one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FileId {
    pub(super) inode: u64,
    pub(super) ctime: (i64, i64),
}

/// Ends the kubelet's life: its tasks stop, every connection closes, registrations are forgotten.
pub(crate) fn stop(shared: &Shared) {
    shared.life().cancel();
    let store = shared.plugins.lock().map(|mut s| std::mem::take(&mut *s));
    shared.registered.send_replace(Vec::new());
    shared.usable.send_replace(Default::default());
    drop(store);
}

/// Deregisters the plugin found on `socket`: its attempts and health stream end (`token`), it leaves the
/// store. Returns what to drop once the store is unlocked (its connection).
pub(super) fn deregister(
    shared: &Arc<Shared>,
    store: &mut Store,
    socket: &Path,
    token: &CancellationToken,
    life: &CancellationToken,
) -> Vec<Plugin> {
    token.cancel();
    let (gone, kept): (Vec<Plugin>, Vec<Plugin>) = std::mem::take(&mut store.plugins)
        .into_iter()
        .partition(|p| p.registration.socket == socket);
    store.plugins = kept;
    if !gone.is_empty() {
        shared
            .registered
            .send_modify(|regs| regs.retain(|r| r.socket != socket));
    }
    for plugin in &gone {
        sync(shared, store, &plugin.registration.driver, life);
    }
    gone
}

/// What the DRA plugin manager does whenever a driver's plugins or connections change: a usable driver's
/// pending wipe is cancelled; an unusable one's slices are deleted after the wipe delay (the first such
/// change starts the timer, later ones leave it running).
fn sync(shared: &Arc<Shared>, store: &mut Store, driver: &str, life: &CancellationToken) {
    if life.is_cancelled() {
        return;
    }
    let usable = store.usable(driver);
    if let Some((api, node)) = shared.options.api.clone() {
        if usable {
            if let Some(pending) = store.pending_wipes.remove(driver) {
                pending.cancel();
            }
        } else if !store.pending_wipes.contains_key(driver) {
            schedule_wipe(shared, store, driver, life, api, node);
        }
    }
    // Published last: a test that sees the driver gone may move the clock at once, and the wipe's timer
    // must be counting by then.
    shared
        .usable
        .send_if_modified(|all| all.insert(driver.to_string(), usable) != Some(usable));
}

fn schedule_wipe(
    shared: &Arc<Shared>,
    store: &mut Store,
    driver: &str,
    life: &CancellationToken,
    api: ApiServerLink,
    node: String,
) {
    let token = life.child_token();
    store
        .pending_wipes
        .insert(driver.to_string(), token.clone());
    let due = shared.clock.sleep(shared.options.wipe_delay);
    let (weak, driver) = (Arc::downgrade(shared), driver.to_string());
    shared.runtime.spawn(async move {
        tokio::select! {
            () = token.cancelled() => {}
            () = due => {
                let Some(shared) = weak.upgrade() else { return };
                if let Ok(mut store) = shared.plugins.lock() {
                    if token.is_cancelled() {
                        return;
                    }
                    store.pending_wipes.remove(&driver);
                }
                let deleted = api.wipe_slices(&node, Some(&driver));
                shared.wipes.send_modify(|w| w.push(Wipe { driver: Some(driver), deleted }));
            }
        }
    });
}

/// Registers the plugin on `socket`, trying again with backoff as long as the kubelet would.
pub(super) async fn register_socket(
    shared: Arc<Shared>,
    socket: PathBuf,
    token: CancellationToken,
    life: CancellationToken,
) {
    let mut delay = shared.options.first_backoff;
    let mut held = shared.held.subscribe();
    tokio::select! {
        () = token.cancelled() => return,
        _released = held.wait_for(|h| !h) => {}
    }
    loop {
        let (driver, outcome) = attempt(&shared, &socket, &token, &life).await;
        if token.is_cancelled() {
            return;
        }
        let again = matches!(
            outcome,
            Outcome::GetInfoFailed(_) | Outcome::Refused { retried: true, .. }
        );
        // Counting from before the attempt is published: a test that sees it may move the clock at once.
        let backoff = shared.clock.sleep(delay);
        shared.attempts.send_modify(|a| {
            a.push(RegistrationAttempt {
                socket: socket.clone(),
                driver,
                outcome,
                at: Instant::now(),
            })
        });
        if !again {
            return;
        }
        backoff.await;
        delay = (delay * 2).min(shared.options.max_backoff);
    }
}

/// A channel to a registration socket as the kubelet's plugin watcher opens it: grpc-go dials the socket's
/// path with no authority of its own (`operationexecutor`'s `dial`, in every kubelet version), so each request
/// carries the path, percent-encoded, as its `:authority`. A plugin whose HTTP/2 server refuses that
/// authority is never registered, as with the real kubelet.
async fn dial_registration(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = socket.to_owned();
    let authority = grpc_go_authority(&path.to_string_lossy());
    // The URI names nothing: the connector decides where to go, the relay what authority is sent.
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let (path, authority) = (path.clone(), authority.clone());
            async move {
                let stream = uds::connect_stream(&path).await?;
                let (ours, theirs) = tokio::io::duplex(64 * 1024);
                tokio::spawn(async move {
                    let _ended = authority::relay(theirs, stream, move |h: &mut Headers| {
                        authority::set_authority(h, &authority)
                    })
                    .await;
                });
                Ok::<_, std::io::Error>(TokioIo::new(ours))
            }
        }))
        .await
}

/// The `:authority` grpc-go sends for a target with no scheme: the target with every byte outside RFC 3986's
/// unreserved characters, sub-delimiters and `:`, `[`, `]`, `@` percent-encoded (upper-case hex).
pub(crate) fn grpc_go_authority(target: &str) -> String {
    let mut out = String::with_capacity(target.len() * 2);
    for b in target.bytes() {
        let kept = b.is_ascii_alphanumeric() || b"-_.~!$&'()*+,;=:[]@".contains(&b);
        if kept {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// One registration attempt, as the kubelet's operation generator makes it. Returns the driver name (empty
/// before `GetInfo` answered) and the outcome.
async fn attempt(
    shared: &Arc<Shared>,
    socket: &Path,
    token: &CancellationToken,
    life: &CancellationToken,
) -> (String, Outcome) {
    let info = async {
        let channel = tokio::time::timeout(DIAL_TIMEOUT, dial_registration(socket))
            .await
            .map_err(|_| format!("cannot dial {}: timed out", socket.display()))?
            .map_err(|e| format!("cannot dial {}: {e:?}", socket.display()))?;
        let mut client = RegistrationClient::new(channel);
        let info = tokio::time::timeout(GET_INFO_TIMEOUT, client.get_info(InfoRequest {}))
            .await
            .map_err(|_| "GetInfo timed out after 1s".to_string())?
            .map_err(|status| format!("GetInfo failed: {status}"))?;
        Ok::<_, String>((client, info.into_inner()))
    };
    let (mut client, info) = match info.await {
        Ok(answer) => answer,
        Err(e) => {
            return (
                String::new(),
                Outcome::GetInfoFailed(format!(
                    "RegisterPlugin error -- failed to get plugin info using RPC GetInfo at socket {}, err: {e}",
                    socket.display()
                )),
            );
        }
    };
    let driver = info.name.clone();
    if info.r#type != PLUGIN_TYPE {
        let reason = format!(
            "RegisterPlugin error -- no handler registered for plugin type: {} at socket {}",
            info.r#type,
            socket.display()
        );
        return (driver, refuse(&mut client, reason, true).await);
    }
    let endpoint = if info.endpoint.is_empty() {
        socket.to_owned()
    } else {
        PathBuf::from(&info.endpoint)
    };
    let (service, health) = match choose_services(&info.supported_versions, &shared.options) {
        Ok(chosen) => chosen,
        Err(e) => {
            let reason = format!(
                "RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC versions \
                 of DRA driver plugin {driver} at endpoint {}: {e}",
                endpoint.display()
            );
            return (driver, refuse(&mut client, reason, true).await);
        }
    };
    let registration = DraRegistration {
        driver: driver.clone(),
        socket: socket.to_owned(),
        endpoint: endpoint.clone(),
        supported_versions: info.supported_versions.clone(),
        service,
        health,
    };
    let connections = Arc::new(AtomicUsize::new(0));
    let channel = connect(shared, &registration, connections.clone(), life).await;
    let duplicate = {
        let Ok(mut store) = shared.plugins.lock() else {
            return (
                driver,
                Outcome::GetInfoFailed("plugin store poisoned".into()),
            );
        };
        if token.is_cancelled() {
            return (driver, Outcome::GetInfoFailed("deregistered".into()));
        }
        let duplicate = store
            .plugins
            .iter()
            .any(|p| p.registration.driver == driver && p.registration.endpoint == endpoint);
        if !duplicate {
            store.plugins.push(Plugin {
                registration: registration.clone(),
                channel: channel.clone(),
                connections,
            });
            shared
                .registered
                .send_modify(|regs| regs.push(registration.clone()));
            sync(shared, &mut store, &driver, life);
        }
        duplicate
    };
    if duplicate {
        // The kubelet has recorded the socket as registered by now: it does not try again.
        let reason = format!(
            "RegisterPlugin error -- plugin registration failed with err: endpoint {} already registered for \
             DRA driver plugin {driver}",
            endpoint.display()
        );
        return (driver, refuse(&mut client, reason, false).await);
    }
    if let Some(service) = health {
        // It watches the token itself: a deregistration clears the driver's health on the way out.
        shared.runtime.spawn(watch_health(
            shared.clone(),
            registration.clone(),
            service,
            channel,
            token.clone(),
            life.clone(),
        ));
    }
    match notify(&mut client, true, "").await {
        Ok(()) => (driver, Outcome::Registered(registration)),
        Err(e) => (driver, Outcome::NotifyFailed(registration, e)),
    }
}

/// Refuses the plugin with `reason`. A notification that fails makes the attempt fail, and be tried again.
async fn refuse(
    client: &mut RegistrationClient<Channel>,
    reason: String,
    retried: bool,
) -> Outcome {
    let notified = notify(client, false, &reason).await;
    Outcome::Refused {
        reason,
        retried: retried || notified.is_err(),
    }
}

async fn notify(
    client: &mut RegistrationClient<Channel>,
    registered: bool,
    error: &str,
) -> Result<(), String> {
    let status = RegistrationStatus {
        plugin_registered: registered,
        error: error.to_string(),
    };
    match tokio::time::timeout(NOTIFY_TIMEOUT, client.notify_registration_status(status)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(status)) => Err(format!("NotifyRegistrationStatus failed: {status}")),
        Err(_) => Err("NotifyRegistrationStatus timed out after 5s".into()),
    }
}

/// A channel to the plugin's DRA endpoint whose connections are counted in `connections`: connected at once
/// when the endpoint answers (the kubelet asks gRPC to connect right away), else on the first call.
async fn connect(
    shared: &Arc<Shared>,
    registration: &DraRegistration,
    connections: Arc<AtomicUsize>,
    life: &CancellationToken,
) -> Channel {
    let tracker = Tracker {
        shared: Arc::downgrade(shared),
        driver: registration.driver.clone(),
        connections,
        life: life.clone(),
    };
    let path = registration.endpoint.clone();
    let connector = tower::service_fn(move |_: Uri| {
        let (path, tracker) = (path.clone(), tracker.clone());
        async move {
            let stream = UnixStream::connect(&path).await?;
            Ok::<_, std::io::Error>(TokioIo::new(Tracked {
                stream,
                _guard: tracker.connected(),
            }))
        }
    });
    // The URI names nothing: the connector decides where to go.
    let endpoint = Endpoint::from_static("http://localhost");
    match endpoint.connect_with_connector(connector.clone()).await {
        Ok(channel) => channel,
        Err(_) => endpoint.connect_with_connector_lazy(connector),
    }
}

/// Counts a driver plugin's connections, as the kubelet's gRPC stats handler follows them.
#[derive(Clone)]
struct Tracker {
    shared: Weak<Shared>,
    driver: String,
    connections: Arc<AtomicUsize>,
    /// The kubelet life the connection belongs to: one from before a restart changes nothing.
    life: CancellationToken,
}

impl Tracker {
    fn connected(&self) -> ConnectionGuard {
        self.connections.fetch_add(1, Ordering::SeqCst);
        self.changed();
        ConnectionGuard(self.clone())
    }

    fn changed(&self) {
        if self.life.is_cancelled() {
            return;
        }
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        if let Ok(mut store) = shared.plugins.lock() {
            sync(&shared, &mut store, &self.driver, &self.life);
        }
    }
}

/// Held by a connection's stream: its drop is the connection's end.
struct ConnectionGuard(Tracker);

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::SeqCst);
        self.0.changed();
    }
}

/// A Unix stream that reports its end.
struct Tracked {
    stream: UnixStream,
    _guard: ConnectionGuard,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The health stream of one registered plugin: opened, read into the cache, cleared and opened again after
/// the retry delay when it ends, until the plugin is deregistered (which clears the cache too) or the
/// kubelet stops (which does not: its cache is checkpointed).
async fn watch_health(
    shared: Arc<Shared>,
    registration: DraRegistration,
    service: HealthService,
    channel: Channel,
    token: CancellationToken,
    life: CancellationToken,
) {
    let driver = registration.driver.as_str();
    let record = |event: StreamEvent| {
        shared.streams.send_modify(|s| {
            s.push(HealthStreamEvent {
                driver: driver.to_string(),
                endpoint: registration.endpoint.clone(),
                service,
                event,
            })
        })
    };
    let fields = shared.options.version.health_fields();
    loop {
        let opened = tokio::select! {
            () = token.cancelled() => return,
            opened = HealthStream::open(channel.clone(), service) => opened,
        };
        // The retry counts from the failure or the end, before either is published: a test that sees it may
        // move the clock at once.
        let retry;
        match opened {
            Err(status) => {
                retry = shared.clock.sleep(shared.options.health_retry);
                record(StreamEvent::OpenFailed(
                    status.code(),
                    status.message().to_string(),
                ));
            }
            Ok(mut stream) => {
                record(StreamEvent::Opened);
                let ended = loop {
                    tokio::select! {
                        () = token.cancelled() => {
                            if !life.is_cancelled() {
                                shared.health.send_modify(|cache| cache.clear(driver));
                            }
                            return;
                        }
                        next = stream.next() => match next {
                            Ok(Some(reports)) => {
                                let count = reports.len();
                                let now = shared.clock.now();
                                shared.health.send_modify(|cache| cache.update(driver, reports, now, fields));
                                record(StreamEvent::Report(count));
                            }
                            Ok(None) => break None,
                            Err(status) => break Some(status.to_string()),
                        }
                    }
                };
                retry = shared.clock.sleep(shared.options.health_retry);
                shared.health.send_modify(|cache| cache.clear(driver));
                record(StreamEvent::Ended(ended));
            }
        }
        tokio::select! {
            () = token.cancelled() => return,
            () = retry => {}
        }
    }
}
