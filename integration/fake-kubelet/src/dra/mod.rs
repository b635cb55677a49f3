//! The kubelet's DRA side, for testing a DRA driver's kubelet plugin without a node. It behaves as kubelets
//! 1.34 to 1.37 do where a plugin can tell:
//!
//! - **plugin watcher**: watches `<root>/plugins_registry` recursively (and walks it at start), but not
//!   inside a directory whose name starts with a dot; dot-files and anything but a socket are ignored; a
//!   socket made again is registered again, a removed one deregistered; a file it is told of that is gone
//!   when it looks is an error in its log ([`DraKubelet::watcher_errors`]);
//! - **registration**: dialled by the socket's path as grpc-go does, so each call carries the path,
//!   percent-encoded, as its HTTP/2 `:authority`; `GetInfo` (1 s), type `DRAPlugin`, the first of the plugin's `supported_versions` this
//!   kubelet knows ([`KubeletVersion`]), then `NotifyRegistrationStatus` (5 s); a refusal is notified with
//!   its reason; a failed attempt is tried again with backoff from [`DraOptions::first_backoff`] doubling to
//!   about 2 min; every attempt is recorded ([`DraKubelet::attempts`]);
//! - **health**: after a registration, `NodeWatchResources` on the DRA endpoint feeds the health cache;
//!   when the stream ends the driver's cache is cleared and the stream opened again after 5 s;
//! - **pods**: [`DraKubelet::prepare_pod`], [`DraKubelet::end_pod`], [`DraKubelet::unprepare`] call the
//!   plugin as the kubelet does, and [`DraKubelet::allocated_resources_status`] is what the kubelet would
//!   write into the pod's container statuses;
//! - **slices**: linked to a [`FakeApiServer`](crate::apiserver::FakeApiServer), it deletes the node's
//!   ResourceSlices when it starts and a driver's 30 s after its last connection went.
//!
//! Time is the fake's own ([`DraKubelet::advance_clock`]): a test moves it past the 30 s staleness or the
//! wipe delay without sleeping. The fake runs on a thread and runtime of its own, as a separate process.
//!
//! Not modelled: the periodic `GetInfo` liveness probe, gRPC's background reconnects to a plugin whose
//! connection dropped (the next call or health stream reconnects), the 1 s pace of the kubelet's reconciler
//! (an attempt starts as soon as the socket appears; [`DraOptions::hold_registrations`] holds it as long as a
//! test needs), `reservedFor` checks on claims; a socket renamed away
//! is deregistered here, where the kubelet acts only on a removal.

mod clock;
mod health;
mod options;
mod plugins;
mod pods;
#[cfg(test)]
mod tests;
mod watcher;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub use health::{DEFAULT_HEALTH_TIMEOUT, DeviceHealth, Health, HealthService, MAX_MESSAGE_LENGTH};
pub use options::{DraOptions, DraService, KubeletVersion, choose_services};
pub use pods::{ClaimError, ClaimRef, ClaimUse, Pod, PodClaim, PreparedDevice};

/// The plugin registration type of a DRA driver.
pub const PLUGIN_TYPE: &str = "DRAPlugin";

/// A plugin the kubelet has registered and holds a connection to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraRegistration {
    /// The driver name (`PluginInfo.name`).
    pub driver: String,
    /// The registration socket it was found on.
    pub socket: PathBuf,
    /// The DRA endpoint the kubelet calls.
    pub endpoint: PathBuf,
    /// What the plugin advertised.
    pub supported_versions: Vec<String>,
    /// The plugin service chosen.
    pub service: DraService,
    /// The health service the kubelet watches, if any.
    pub health: Option<HealthService>,
}

/// What came of one registration attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Registered, and `NotifyRegistrationStatus(true)` delivered.
    Registered(DraRegistration),
    /// Registered, but `NotifyRegistrationStatus(true)` failed (the kubelet keeps the registration).
    NotifyFailed(DraRegistration, String),
    /// Dialling or `GetInfo` failed: nothing is notified, the attempt is tried again after the backoff.
    GetInfoFailed(String),
    /// Refused with `NotifyRegistrationStatus(false, reason)`; `retried` when the kubelet tries again after
    /// the backoff (a wrong type or no known version; not an endpoint already registered).
    Refused {
        /// The error sent to the plugin.
        reason: String,
        /// Whether another attempt follows.
        retried: bool,
    },
}

/// One registration attempt on a socket.
#[derive(Debug, Clone)]
pub struct RegistrationAttempt {
    /// The registration socket.
    pub socket: PathBuf,
    /// The driver name `GetInfo` gave (empty if it failed).
    pub driver: String,
    /// What came of it.
    pub outcome: Outcome,
    /// When it ended (real time).
    pub at: Instant,
}

/// Something that happened to a health stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    /// `NodeWatchResources` answered: the stream is open.
    Opened,
    /// `NodeWatchResources` failed (the status's code and message): tried again after the retry delay.
    OpenFailed(tonic::Code, String),
    /// A report was taken in (its number of devices).
    Report(usize),
    /// The stream ended (`None` cleanly, else the error): the driver's health was cleared.
    Ended(Option<String>),
}

/// A health stream's event, with whose stream it was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthStreamEvent {
    /// The driver.
    pub driver: String,
    /// Its DRA endpoint.
    pub endpoint: PathBuf,
    /// The service the stream is on.
    pub service: HealthService,
    /// What happened.
    pub event: StreamEvent,
}

/// One prepare or unprepare call the kubelet made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraCall {
    /// `NodePrepareResources` or `NodeUnprepareResources`.
    pub method: &'static str,
    /// The driver called.
    pub driver: String,
    /// The service version used.
    pub service: DraService,
    /// The UIDs of the claims in the request, in order.
    pub claims: Vec<String>,
    /// `Err` with the gRPC status when the call failed as a whole.
    pub result: Result<(), String>,
}

/// ResourceSlices the kubelet deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wipe {
    /// The driver whose slices went (`None`: every slice of the node, at start).
    pub driver: Option<String>,
    /// How many were deleted.
    pub deleted: usize,
}

/// Errors of the fake kubelet's DRA side.
#[derive(Debug, thiserror::Error)]
pub enum DraError {
    /// The kubelet could not start (its directories, its thread).
    #[error("cannot start the DRA kubelet on {path}: {source}")]
    Start {
        /// The kubelet root.
        path: String,
        /// OS error.
        source: std::io::Error,
    },
    /// A wait ran out of time.
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(Duration, String),
    /// No plugin of the driver is registered.
    #[error("DRA driver {0} is not registered")]
    NotRegistered(String),
    /// A call failed as a whole (gRPC error, timeout, or an answer that does not fit the request).
    #[error("{method} on DRA driver {driver} failed: {message}")]
    Call {
        /// The method.
        method: &'static str,
        /// The driver.
        driver: String,
        /// What went wrong.
        message: String,
    },
    /// A claim failed (an `error` in the answer, or no entry for it).
    #[error("{0}")]
    Claim(Box<ClaimError>),
    /// Which drivers a claim belongs to cannot be told (no driver given and no API server, or the claim
    /// there is missing, not allocated, or another one by UID).
    #[error("ResourceClaim {claim}: {message}")]
    ClaimLookup {
        /// `namespace/name`.
        claim: String,
        /// Why.
        message: String,
    },
    /// The kubelet's thread is gone.
    #[error("the fake kubelet stopped")]
    Stopped,
}

/// State shared by the kubelet's tasks and the test's handle.
pub(crate) struct Shared {
    root: PathBuf,
    options: DraOptions,
    clock: clock::Clock,
    runtime: tokio::runtime::Handle,
    /// Cancelled when the running kubelet stops (restart): its tasks and connections die with it.
    life: Mutex<CancellationToken>,
    plugins: Mutex<plugins::Store>,
    registered: watch::Sender<Vec<DraRegistration>>,
    attempts: watch::Sender<Vec<RegistrationAttempt>>,
    streams: watch::Sender<Vec<HealthStreamEvent>>,
    health: watch::Sender<health::HealthCache>,
    claims: watch::Sender<BTreeMap<String, pods::ClaimInfo>>,
    calls: watch::Sender<Vec<DraCall>>,
    wipes: watch::Sender<Vec<Wipe>>,
    /// What the plugin watcher logged at error level (`Error when handling create event`), one line each.
    watch_errors: Mutex<Vec<String>>,
    /// Whether each driver that had a plugin has a connection up.
    usable: watch::Sender<BTreeMap<String, bool>>,
    /// Whether registration attempts wait ([`DraOptions::hold_registrations`]).
    held: watch::Sender<bool>,
}

impl Shared {
    fn life(&self) -> CancellationToken {
        self.life
            .lock()
            .map(|l| l.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }
}

/// A running fake kubelet, DRA side. Dropping it stops it: every connection to the plugins closes.
pub struct DraKubelet {
    shared: Arc<Shared>,
    _stop: tokio_util::sync::DropGuard,
}

impl DraKubelet {
    /// Starts on kubelet root `root` (where `plugins_registry/` and `plugins/` are, made if missing) with the
    /// real kubelet's behaviour ([`DraOptions::default`]).
    pub fn start(root: &Path) -> Result<Self, DraError> {
        Self::start_with(root, DraOptions::default())
    }

    /// Starts with `options`.
    pub fn start_with(root: &Path, options: DraOptions) -> Result<Self, DraError> {
        let start_err = |source| DraError::Start {
            path: root.display().to_string(),
            source,
        };
        for dir in ["plugins_registry", "plugins"] {
            std::fs::create_dir_all(root.join(dir)).map_err(start_err)?;
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(start_err)?;
        let handle = runtime.handle().clone();
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        std::thread::Builder::new()
            .name("fake-kubelet-dra".into())
            .spawn(move || runtime.block_on(stopped.cancelled()))
            .map_err(start_err)?;
        let shared = Arc::new(Shared {
            root: root.to_owned(),
            held: watch::Sender::new(options.hold_registrations),
            options,
            clock: clock::Clock::new(),
            runtime: handle,
            life: Mutex::new(CancellationToken::new()),
            plugins: Mutex::default(),
            registered: watch::Sender::new(Vec::new()),
            attempts: watch::Sender::new(Vec::new()),
            streams: watch::Sender::new(Vec::new()),
            health: watch::Sender::new(health::HealthCache::default()),
            claims: watch::Sender::new(BTreeMap::new()),
            calls: watch::Sender::new(Vec::new()),
            wipes: watch::Sender::new(Vec::new()),
            watch_errors: Mutex::new(Vec::new()),
            usable: watch::Sender::new(BTreeMap::new()),
        });
        watcher::start(&shared);
        Ok(DraKubelet {
            shared,
            _stop: stop.drop_guard(),
        })
    }

    /// The kubelet root.
    pub fn root(&self) -> &Path {
        &self.shared.root
    }

    /// Restarts as the kubelet does: every connection and stream closes, registrations are forgotten, the
    /// node's slices are deleted (when linked to an API server), and `plugins_registry` is walked and watched
    /// again. Prepared claims and the health cache are kept, as the kubelet checkpoints them.
    pub fn restart(&self) {
        plugins::stop(&self.shared);
        watcher::start(&self.shared);
    }

    /// Moves the fake's clock forward: health gets older, and the kubelet's timers (health stream retry,
    /// slice wipe, registration backoff) that fall due fire.
    pub fn advance_clock(&self, by: Duration) {
        self.shared.clock.advance(by);
    }

    /// Lets registration attempts held by [`DraOptions::hold_registrations`] go on, as the plugin watcher's
    /// reconciler does at its next pass.
    pub fn release_registrations(&self) {
        self.shared.held.send_replace(false);
    }

    /// The plugins registered now.
    pub fn registrations(&self) -> Vec<DraRegistration> {
        self.shared.registered.borrow().clone()
    }

    /// Waits until a plugin of `driver` is registered; returns the newest.
    pub async fn wait_registered(
        &self,
        driver: &str,
        timeout: Duration,
    ) -> Result<DraRegistration, DraError> {
        let regs = wait(
            &self.shared.registered,
            timeout,
            &format!("DRA driver {driver} to register"),
            |regs| regs.iter().any(|r| r.driver == driver),
        )
        .await?;
        regs.into_iter()
            .rev()
            .find(|r| r.driver == driver)
            .ok_or_else(|| DraError::NotRegistered(driver.into()))
    }

    /// Every registration attempt so far, oldest first.
    pub fn attempts(&self) -> Vec<RegistrationAttempt> {
        self.shared.attempts.borrow().clone()
    }

    /// Waits until the attempts satisfy `pred`; returns them.
    pub async fn wait_attempts(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl FnMut(&Vec<RegistrationAttempt>) -> bool,
    ) -> Result<Vec<RegistrationAttempt>, DraError> {
        wait(&self.shared.attempts, timeout, what, pred).await
    }

    /// Every health stream event so far, oldest first.
    pub fn health_streams(&self) -> Vec<HealthStreamEvent> {
        self.shared.streams.borrow().clone()
    }

    /// Waits until the health stream events satisfy `pred`; returns them.
    pub async fn wait_health_streams(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl FnMut(&Vec<HealthStreamEvent>) -> bool,
    ) -> Result<Vec<HealthStreamEvent>, DraError> {
        wait(&self.shared.streams, timeout, what, pred).await
    }

    /// The health of `driver`'s device `pool/device` as the kubelet reads it now.
    pub fn device_health(&self, driver: &str, pool: &str, device: &str) -> DeviceHealth {
        let now = self.shared.clock.now();
        self.shared.health.borrow().get(driver, pool, device, now)
    }

    /// Waits until the health of `driver`'s device `pool/device` satisfies `pred` (read again on every report,
    /// clock advance and expiry); returns it.
    pub async fn wait_device_health(
        &self,
        (driver, pool, device): (&str, &str, &str),
        timeout: Duration,
        mut pred: impl FnMut(&DeviceHealth) -> bool,
    ) -> Result<DeviceHealth, DraError> {
        let what = format!("the health of {driver}/{pool}/{device}");
        self.wait_timed(&what, timeout, |shared, now| {
            let health = shared.health.borrow().get(driver, pool, device, now);
            pred(&health).then_some(health)
        })
        .await
    }

    /// As [`DraKubelet::wait_device_health`], with when the kubelet received the first report of the run that
    /// says the health returned (a heartbeat or a new message since does not move it; `None` while the health
    /// is Unknown for want of a fresh report). The time is the fake's clock, which is the real monotonic
    /// clock until [`DraKubelet::advance_clock`] moves it, stamped on the kubelet's thread as it takes the
    /// report in: a benchmark times the report without its own task's wake-up. `pred` is given both, so that
    /// a wait for a report after some moment does not take one from before it.
    pub async fn wait_device_health_since(
        &self,
        (driver, pool, device): (&str, &str, &str),
        timeout: Duration,
        mut pred: impl FnMut(&DeviceHealth, Option<Instant>) -> bool,
    ) -> Result<(DeviceHealth, Option<Instant>), DraError> {
        let what = format!("the health of {driver}/{pool}/{device}");
        self.wait_timed(&what, timeout, |shared, now| {
            let cache = shared.health.borrow();
            let health = cache.get(driver, pool, device, now);
            let since = cache.since(driver, pool, device, now);
            pred(&health, since).then_some((health, since))
        })
        .await
    }

    /// The prepare and unprepare calls made so far, oldest first.
    pub fn calls(&self) -> Vec<DraCall> {
        self.shared.calls.borrow().clone()
    }

    /// What the plugin watcher logged as errors so far: the kubelet logs `Error when handling create event`
    /// for each file it was told of that is gone when it looks (a socket made under a temporary name in
    /// its directory and renamed at once).
    pub fn watcher_errors(&self) -> Vec<String> {
        self.shared
            .watch_errors
            .lock()
            .map(|e| e.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    /// The slice deletions made so far, oldest first.
    pub fn wipes(&self) -> Vec<Wipe> {
        self.shared.wipes.borrow().clone()
    }

    /// Waits until the slice deletions satisfy `pred`; returns them.
    pub async fn wait_wipes(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl FnMut(&Vec<Wipe>) -> bool,
    ) -> Result<Vec<Wipe>, DraError> {
        wait(&self.shared.wipes, timeout, what, pred).await
    }

    /// Whether a plugin of `driver` is registered with its connection up (the kubelet's "usable").
    pub fn connected(&self, driver: &str) -> bool {
        self.shared
            .plugins
            .lock()
            .is_ok_and(|store| store.usable(driver))
    }

    /// Waits until whether `driver` is usable (see [`DraKubelet::connected`]) is `connected`.
    pub async fn wait_connected(
        &self,
        driver: &str,
        connected: bool,
        timeout: Duration,
    ) -> Result<(), DraError> {
        let what = format!("DRA driver {driver} to be connected: {connected}");
        wait(&self.shared.usable, timeout, &what, |all| {
            all.get(driver).copied().unwrap_or(false) == connected
        })
        .await
        .map(drop)
    }

    /// The registration sockets the plugin watcher has taken in (dot-files and non-sockets never are).
    pub fn sockets(&self) -> Vec<PathBuf> {
        self.shared
            .plugins
            .lock()
            .map(|store| store.sockets())
            .unwrap_or_default()
    }

    /// Prepares `pod`'s claims as the kubelet does before starting it: one `NodePrepareResources` per driver
    /// with every claim of that driver not prepared yet. `Err` names the claim and the plugin's message when a
    /// claim fails, or the call when it fails as a whole; the pod would not start.
    pub async fn prepare_pod(&self, pod: &Pod) -> Result<(), DraError> {
        let (shared, pod) = (self.shared.clone(), pod.clone());
        self.run(async move { pods::prepare(&shared, &pod).await })
            .await
    }

    /// Ends `pod` as the kubelet does when it is gone: its claims that no other pod uses are unprepared (one
    /// `NodeUnprepareResources` per driver). Returns the claims whose unprepare failed (they stay prepared,
    /// as the kubelet tries again); `Err` when a call failed as a whole.
    pub async fn end_pod(&self, pod: &Pod) -> Result<Vec<ClaimError>, DraError> {
        let (shared, pod) = (self.shared.clone(), pod.clone());
        self.run(async move { pods::end(&shared, &pod).await })
            .await
    }

    /// Unprepares `claims` whatever the kubelet knows of them (it does so for claims it never saw prepared,
    /// after a restart or for deleted claims). Returns the claims whose unprepare failed.
    pub async fn unprepare(&self, claims: &[ClaimRef]) -> Result<Vec<ClaimError>, DraError> {
        let (shared, claims) = (self.shared.clone(), claims.to_vec());
        self.run(async move { pods::unprepare(&shared, claims).await })
            .await
    }

    /// The devices prepared for claim `uid`, by driver.
    pub fn prepared(&self, uid: &str) -> Option<BTreeMap<String, Vec<PreparedDevice>>> {
        self.shared
            .claims
            .borrow()
            .get(uid)
            .filter(|c| c.prepared)
            .map(|c| c.devices.clone())
    }

    /// The CDI device IDs the runtime gets for `container` of `pod`, in the order the kubelet collects them.
    pub fn cdi_devices(&self, pod: &Pod, container: &str) -> Vec<String> {
        pods::cdi_devices(&self.shared.claims.borrow(), pod, container)
    }

    /// What the kubelet would write into `pod`'s `status.containerStatuses` now, as Kubernetes JSON: one
    /// object per container that uses a claim, `{"name": <container>, "allocatedResourcesStatus": [...]}`,
    /// each status `{"name": "claim:<claim>[/<request>]", "resources": [{"resourceID", "health",
    /// "message"?}]}` (`allocatedResourcesStatus` left out when empty, as the kubelet's JSON omits it).
    pub fn allocated_resources_status(&self, pod: &Pod) -> Value {
        let now = self.shared.clock.now();
        pods::resources_status(
            &self.shared.claims.borrow(),
            &self.shared.health.borrow(),
            pod,
            now,
        )
    }

    /// Waits until [`DraKubelet::allocated_resources_status`] of `pod` satisfies `pred` (computed again on
    /// every report, prepare, clock advance and staleness); returns it.
    pub async fn wait_allocated_resources_status(
        &self,
        pod: &Pod,
        what: &str,
        timeout: Duration,
        mut pred: impl FnMut(&Value) -> bool,
    ) -> Result<Value, DraError> {
        self.wait_timed(what, timeout, |shared, now| {
            let status =
                pods::resources_status(&shared.claims.borrow(), &shared.health.borrow(), pod, now);
            pred(&status).then_some(status)
        })
        .await
    }

    /// Waits until `check` gives a value, computing it again whenever health, claims or the clock change and
    /// when an entry turns stale.
    async fn wait_timed<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut check: impl FnMut(&Shared, Instant) -> Option<T>,
    ) -> Result<T, DraError> {
        let shared = &self.shared;
        let mut health = shared.health.subscribe();
        let mut claims = shared.claims.subscribe();
        let mut clock = shared.clock.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            health.mark_unchanged();
            claims.mark_unchanged();
            clock.mark_unchanged();
            let now = shared.clock.now();
            if let Some(found) = check(shared, now) {
                return Ok(found);
            }
            let expiry = shared.health.borrow().next_expiry(now);
            let stale = async {
                match expiry {
                    // Stale once strictly older than the timeout.
                    Some(at) => {
                        shared
                            .clock
                            .sleep_until(at.checked_add(Duration::from_millis(1)).unwrap_or(at))
                            .await
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => {
                    return Err(DraError::Timeout(timeout, what.to_string()));
                }
                _ = health.changed() => {}
                _ = claims.changed() => {}
                _ = clock.changed() => {}
                () = stale => {}
            }
        }
    }

    /// Runs `work` on the kubelet's own runtime, where its connections live.
    async fn run<T: Send + 'static>(
        &self,
        work: impl Future<Output = Result<T, DraError>> + Send + 'static,
    ) -> Result<T, DraError> {
        self.shared
            .runtime
            .spawn(work)
            .await
            .map_err(|_| DraError::Stopped)?
    }
}

impl Drop for DraKubelet {
    fn drop(&mut self) {
        plugins::stop(&self.shared);
    }
}

/// Waits until the value in `sender` satisfies `pred`; returns it.
async fn wait<T: Clone>(
    sender: &watch::Sender<T>,
    timeout: Duration,
    what: &str,
    mut pred: impl FnMut(&T) -> bool,
) -> Result<T, DraError> {
    let mut rx = sender.subscribe();
    match tokio::time::timeout(timeout, rx.wait_for(|v| pred(v))).await {
        Ok(Ok(value)) => Ok(value.clone()),
        _ => Err(DraError::Timeout(timeout, what.to_string())),
    }
}
