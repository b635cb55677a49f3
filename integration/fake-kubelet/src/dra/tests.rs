//! The fake kubelet's DRA side against a tiny DRA plugin served from the test, on a thread and runtime of its
//! own as a separate process would be.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpu_device_plugin::api::dra::{health_v1, health_v1alpha1, registration as reg, v1, v1beta1};
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::{UnboundedReceiverStream, UnixListenerStream};
use tokio_stream::{Stream, StreamExt as _};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::*;
use crate::apiserver::FakeApiServer;

const WAIT: Duration = Duration::from_secs(10);
const DRIVER: &str = "gpu.example.com";

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// What the test plugin answers in GetInfo.
#[derive(Debug, Clone)]
struct Config {
    driver: String,
    plugin_type: String,
    versions: Vec<String>,
    /// `None`: the DRA socket's path.
    endpoint: Option<String>,
    /// The registration socket's name under `plugins_registry`.
    registration: String,
    /// Whether the health services are served at all.
    health: bool,
    /// GetInfo fails this many times first.
    get_info_failures: usize,
    /// The directory under `plugins/` of its DRA socket.
    dir: String,
}

impl Config {
    fn new(driver: &str) -> Self {
        Config {
            driver: driver.into(),
            plugin_type: "DRAPlugin".into(),
            versions: [
                "v1.DRAPlugin",
                "v1beta1.DRAPlugin",
                "v1.DRAResourceHealth",
                "v1alpha1.DRAResourceHealth",
            ]
            .map(String::from)
            .to_vec(),
            endpoint: None,
            registration: format!("{driver}-reg.sock"),
            health: true,
            get_info_failures: 0,
            dir: driver.into(),
        }
    }

    fn versions(mut self, versions: &[&str]) -> Self {
        self.versions = versions.iter().map(|v| v.to_string()).collect();
        self
    }
}

/// How the test plugin misbehaves.
#[derive(Debug, Default)]
struct Behaviour {
    get_info_failures: usize,
    claim_errors: HashMap<String, String>,
    omitted: HashSet<String>,
    unprepare_errors: HashMap<String, String>,
}

/// What the test plugin has seen.
#[derive(Debug, Default, Clone)]
struct Seen {
    notified: Vec<(bool, String)>,
    /// `<service version>.<method>` and the claim UIDs of the request.
    calls: Vec<(String, Vec<String>)>,
    /// The health services streams were opened on.
    health_opened: Vec<&'static str>,
}

#[derive(Debug, Clone)]
struct Dev {
    device: String,
    health: i32,
    timeout: i64,
    message: String,
}

fn dev(device: &str, health: Health, message: &str) -> Dev {
    Dev {
        device: device.into(),
        health: match health {
            Health::Healthy => 1,
            Health::Unhealthy => 2,
            Health::Unknown => 0,
        },
        timeout: 0,
        message: message.into(),
    }
}

#[derive(Clone)]
struct Plugin {
    config: Config,
    dra_socket: PathBuf,
    behaviour: Arc<Mutex<Behaviour>>,
    seen: Arc<watch::Sender<Seen>>,
    streams: Arc<Mutex<Vec<mpsc::UnboundedSender<Vec<Dev>>>>>,
}

impl Plugin {
    fn behave<T>(&self, f: impl FnOnce(&mut Behaviour) -> T) -> T {
        f(&mut self.behaviour.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn saw(&self, f: impl FnOnce(&mut Seen)) {
        self.seen.send_modify(f);
    }

    /// A `NodePrepareResources` call of `version` for `claims` (UID, name), recorded: the devices prepared
    /// for each claim, one named after it.
    fn prepare(
        &self,
        version: &str,
        claims: impl Iterator<Item = (String, String)>,
    ) -> HashMap<String, (Vec<v1::Device>, String)> {
        let claims: Vec<(String, String)> = claims.collect();
        self.saw(|s| {
            s.calls.push((
                format!("{version}.NodePrepareResources"),
                claims.iter().map(|c| c.0.clone()).collect(),
            ))
        });
        claims
            .iter()
            .filter(|(uid, _)| !self.behave(|b| b.omitted.contains(uid)))
            .map(|(uid, name)| {
                let error = self.behave(|b| b.claim_errors.get(uid).cloned().unwrap_or_default());
                let device = v1::Device {
                    request_names: vec!["gpu".into()],
                    pool_name: "node-a".into(),
                    device_name: format!("dev-{name}"),
                    cdi_device_ids: vec![
                        format!("example.com/gpu={name}"),
                        format!("example.com/extra={name}"),
                    ],
                    share_id: None,
                };
                (uid.clone(), (vec![device], error))
            })
            .collect()
    }

    /// A `NodeUnprepareResources` call of `version` for the claims `uids`, recorded: the UIDs.
    fn unprepare(&self, version: &str, uids: impl Iterator<Item = String>) -> Vec<String> {
        let uids: Vec<String> = uids.collect();
        self.saw(|s| {
            s.calls
                .push((format!("{version}.NodeUnprepareResources"), uids.clone()))
        });
        uids
    }

    fn health_stream<T: Send + 'static>(
        &self,
        service: &'static str,
        convert: fn(Vec<Dev>) -> T,
    ) -> Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>> {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Ok(mut streams) = self.streams.lock() {
            streams.push(tx);
        }
        self.saw(|s| s.health_opened.push(service));
        Box::pin(UnboundedReceiverStream::new(rx).map(move |devs| Ok(convert(devs))))
    }
}

#[tonic::async_trait]
impl reg::registration_server::Registration for Plugin {
    async fn get_info(
        &self,
        _: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        let fail = self.behave(|b| {
            let fail = b.get_info_failures > 0;
            b.get_info_failures = b.get_info_failures.saturating_sub(1);
            fail
        });
        if fail {
            return Err(Status::unavailable("not ready"));
        }
        Ok(Response::new(reg::PluginInfo {
            r#type: self.config.plugin_type.clone(),
            name: self.config.driver.clone(),
            endpoint: self
                .config
                .endpoint
                .clone()
                .unwrap_or_else(|| self.dra_socket.display().to_string()),
            supported_versions: self.config.versions.clone(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        self.saw(|s| s.notified.push((status.plugin_registered, status.error)));
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for Plugin {
    async fn node_prepare_resources(
        &self,
        request: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        let claims = request.into_inner().claims.into_iter();
        let claims = self
            .prepare("v1", claims.map(|c| (c.uid, c.name)))
            .into_iter()
            .map(|(uid, (devices, error))| {
                (uid, v1::NodePrepareResourceResponse { devices, error })
            })
            .collect();
        Ok(Response::new(v1::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        let uids = request.into_inner().claims.into_iter().map(|c| c.uid);
        let claims = self
            .unprepare("v1", uids)
            .into_iter()
            .map(|uid| {
                let error =
                    self.behave(|b| b.unprepare_errors.get(&uid).cloned().unwrap_or_default());
                (uid, v1::NodeUnprepareResourceResponse { error })
            })
            .collect();
        Ok(Response::new(v1::NodeUnprepareResourcesResponse { claims }))
    }
}

#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for Plugin {
    async fn node_prepare_resources(
        &self,
        request: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        let claims = request.into_inner().claims.into_iter();
        let claims = self
            .prepare("v1beta1", claims.map(|c| (c.uid, c.name)))
            .into_iter()
            .map(|(uid, (devices, error))| {
                let devices = devices
                    .into_iter()
                    .map(|d| v1beta1::Device {
                        request_names: d.request_names,
                        pool_name: d.pool_name,
                        device_name: d.device_name,
                        cdi_device_ids: d.cdi_device_ids,
                    })
                    .collect();
                (uid, v1beta1::NodePrepareResourceResponse { devices, error })
            })
            .collect();
        Ok(Response::new(v1beta1::NodePrepareResourcesResponse {
            claims,
        }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        let uids = request.into_inner().claims.into_iter().map(|c| c.uid);
        let claims = self
            .unprepare("v1beta1", uids)
            .into_iter()
            .map(|uid| (uid, v1beta1::NodeUnprepareResourceResponse::default()))
            .collect();
        Ok(Response::new(v1beta1::NodeUnprepareResourcesResponse {
            claims,
        }))
    }
}

/// The health stream's answer of `$api` (`health_v1alpha1`, `health_v1`) for some devices.
macro_rules! health_answer {
    ($api:ident) => {
        |devs: Vec<Dev>| $api::NodeWatchResourcesResponse {
            devices: devs
                .into_iter()
                .map(|d| $api::DeviceHealth {
                    device: Some($api::DeviceIdentifier {
                        pool_name: "node-a".into(),
                        device_name: d.device,
                    }),
                    health: d.health,
                    last_updated_time: 0,
                    health_check_timeout_seconds: d.timeout,
                    message: d.message,
                })
                .collect(),
        }
    };
}

#[tonic::async_trait]
impl health_v1alpha1::dra_resource_health_server::DraResourceHealth for Plugin {
    type NodeWatchResourcesStream = Pin<
        Box<dyn Stream<Item = Result<health_v1alpha1::NodeWatchResourcesResponse, Status>> + Send>,
    >;

    async fn node_watch_resources(
        &self,
        _: Request<health_v1alpha1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        Ok(Response::new(self.health_stream(
            "v1alpha1",
            health_answer!(health_v1alpha1),
        )))
    }
}

#[tonic::async_trait]
impl health_v1::dra_resource_health_server::DraResourceHealth for Plugin {
    type NodeWatchResourcesStream =
        Pin<Box<dyn Stream<Item = Result<health_v1::NodeWatchResourcesResponse, Status>> + Send>>;

    async fn node_watch_resources(
        &self,
        _: Request<health_v1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        Ok(Response::new(
            self.health_stream("v1", health_answer!(health_v1)),
        ))
    }
}

/// A DRA plugin process: its sockets and the thread serving them.
struct TestPlugin {
    plugin: Plugin,
    registration: PathBuf,
    stop: Option<CancellationToken>,
}

impl TestPlugin {
    /// Serves the DRA socket (`plugins/<driver>/dra.sock`), then the registration socket, as a plugin should.
    fn start(root: &Path, config: Config) -> std::io::Result<Self> {
        let dir = root.join("plugins").join(&config.dir);
        std::fs::create_dir_all(&dir)?;
        let dra_socket = dir.join("dra.sock");
        let registration = root.join("plugins_registry").join(&config.registration);
        if let Some(parent) = registration.parent() {
            std::fs::create_dir_all(parent)?;
        }
        for stale in [&dra_socket, &registration] {
            let _gone = std::fs::remove_file(stale);
        }
        let health = config.health;
        let behaviour = Behaviour {
            get_info_failures: config.get_info_failures,
            ..Behaviour::default()
        };
        let plugin = Plugin {
            config,
            dra_socket: dra_socket.clone(),
            behaviour: Arc::new(Mutex::new(behaviour)),
            seen: Arc::new(watch::Sender::new(Seen::default())),
            streams: Arc::default(),
        };
        let dra = std::os::unix::net::UnixListener::bind(&dra_socket)?;
        let registrar = std::os::unix::net::UnixListener::bind(&registration)?;
        dra.set_nonblocking(true)?;
        registrar.set_nonblocking(true)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let stop = CancellationToken::new();
        let (served, stopped) = (plugin.clone(), stop.clone());
        std::thread::spawn(move || {
            runtime.block_on(async move {
                let (Ok(dra), Ok(registrar)) = (
                    tokio::net::UnixListener::from_std(dra),
                    tokio::net::UnixListener::from_std(registrar),
                ) else {
                    return;
                };
                let mut router = tonic::transport::Server::builder()
                    .add_service(v1::dra_plugin_server::DraPluginServer::new(served.clone()))
                    .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(
                        served.clone(),
                    ));
                if health {
                    router = router
                        .add_service(
                            health_v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(
                                served.clone(),
                            ),
                        )
                        .add_service(
                            health_v1::dra_resource_health_server::DraResourceHealthServer::new(
                                served.clone(),
                            ),
                        );
                }
                let dra = router.serve_with_incoming(UnixListenerStream::new(dra));
                let registrar = tonic::transport::Server::builder()
                    .add_service(reg::registration_server::RegistrationServer::new(served))
                    // As the plugin does: the plugin watcher sends the socket's path as the authority.
                    .serve_with_incoming(UnixListenerStream::new(registrar).map(|conn| {
                        conn.map(gpu_device_plugin::util::authority::served_any)
                    }));
                tokio::select! {
                    () = stopped.cancelled() => {}
                    _ = dra => {}
                    _ = registrar => {}
                }
            });
            // The runtime goes with the thread: every connection closes, as when a process exits.
        });
        Ok(TestPlugin {
            plugin,
            registration,
            stop: Some(stop),
        })
    }

    fn behave(&self, f: impl FnOnce(&mut Behaviour)) {
        self.plugin.behave(f);
    }

    /// Sends a complete report on every open health stream.
    fn report(&self, devices: Vec<Dev>) {
        if let Ok(mut streams) = self.plugin.streams.lock() {
            streams.retain(|s| s.send(devices.clone()).is_ok());
        }
    }

    /// Ends every open health stream cleanly.
    fn end_health_streams(&self) {
        if let Ok(mut streams) = self.plugin.streams.lock() {
            streams.clear();
        }
    }

    async fn wait_seen(&self, what: &str, pred: impl FnMut(&Seen) -> bool) -> Seen {
        let mut rx = self.plugin.seen.subscribe();
        match tokio::time::timeout(WAIT, rx.wait_for(pred)).await {
            Ok(Ok(seen)) => seen.clone(),
            _ => panic!(
                "the plugin did not see {what}: {:?}",
                self.plugin.seen.borrow()
            ),
        }
    }

    fn seen(&self) -> Seen {
        self.plugin.seen.borrow().clone()
    }

    /// Dies without removing its sockets (SIGKILL).
    fn kill(mut self) {
        if let Some(stop) = self.stop.take() {
            stop.cancel();
        }
    }
}

impl Drop for TestPlugin {
    /// Exits as on SIGTERM: its sockets removed, then its connections closed.
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _gone = std::fs::remove_file(&self.registration);
            let _gone = std::fs::remove_file(&self.plugin.dra_socket);
            stop.cancel();
        }
    }
}

fn options() -> DraOptions {
    DraOptions::default()
        .first_backoff(Duration::from_millis(20))
        .health_retry(Duration::from_secs(5))
}

/// A kubelet with [`options`] and a plugin of [`DRIVER`] registered with it, its health stream open (the
/// directory they share first: it must outlive both).
async fn registered_and_streaming()
-> Result<(tempfile::TempDir, DraKubelet, TestPlugin), Box<dyn std::error::Error>> {
    let root = tempfile::tempdir()?;
    let kubelet = DraKubelet::start_with(root.path(), options())?;
    let plugin = TestPlugin::start(root.path(), Config::new(DRIVER))?;
    kubelet.wait_registered(DRIVER, WAIT).await?;
    plugin
        .wait_seen("the health stream", |s| !s.health_opened.is_empty())
        .await;
    Ok((root, kubelet, plugin))
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

#[test]
fn the_kubelet_takes_the_first_plugin_service_it_knows_and_never_a_health_entry() {
    let choose =
        |versions: &[&str], options: DraOptions| choose_services(&strings(versions), &options);
    let all = [
        "v1alpha1.DRAResourceHealth",
        "v1beta1.DRAPlugin",
        "v1.DRAPlugin",
        "v1.DRAResourceHealth",
    ];
    let kubelet = |v| DraOptions::default().version(v);
    assert_eq!(
        choose(&all, kubelet(KubeletVersion::V1_36)),
        Ok((DraService::V1beta1, Some(HealthService::V1alpha1)))
    );
    assert_eq!(
        choose(&all, kubelet(KubeletVersion::V1_37)),
        Ok((DraService::V1beta1, Some(HealthService::V1))),
        "1.37 knows v1 health and takes it whatever the order"
    );
    assert_eq!(
        choose(
            &["v1.DRAPlugin", "v1alpha1.DRAResourceHealth"],
            kubelet(KubeletVersion::V1_37)
        ),
        Ok((DraService::V1, Some(HealthService::V1alpha1)))
    );
    // Nothing advertised: 1.36 watches anyway, 1.37 does not, 1.34 has the gate off.
    assert_eq!(
        choose(&["v1.DRAPlugin"], kubelet(KubeletVersion::V1_36)),
        Ok((DraService::V1, Some(HealthService::V1alpha1)))
    );
    assert_eq!(
        choose(&["v1.DRAPlugin"], kubelet(KubeletVersion::V1_37)),
        Ok((DraService::V1, None))
    );
    assert_eq!(
        choose(&all, kubelet(KubeletVersion::V1_34)),
        Ok((DraService::V1beta1, None))
    );
    assert_eq!(
        choose(
            &all,
            kubelet(KubeletVersion::V1_34).resource_health_status(true)
        ),
        Ok((DraService::V1beta1, Some(HealthService::V1alpha1)))
    );
    let refused = choose(
        &["v1alpha1.DRAResourceHealth", "v2.DRAPlugin"],
        kubelet(KubeletVersion::V1_36),
    );
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.contains("none of services supported by the plugin")),
        "{refused:?}"
    );
    assert!(choose(&[], kubelet(KubeletVersion::V1_36)).is_err());
}

#[tokio::test]
async fn a_plugin_is_registered_on_its_first_known_service_and_told_so() -> TestResult {
    let root = tempfile::tempdir()?;
    let kubelet = DraKubelet::start_with(root.path(), options())?;
    let plugin = TestPlugin::start(
        root.path(),
        Config::new(DRIVER).versions(&[
            "v1alpha1.DRAResourceHealth",
            "v1beta1.DRAPlugin",
            "v1.DRAPlugin",
        ]),
    )?;
    let registered = kubelet.wait_registered(DRIVER, WAIT).await?;
    assert_eq!(registered.service, DraService::V1beta1);
    assert_eq!(registered.health, Some(HealthService::V1alpha1));
    assert_eq!(registered.endpoint, plugin.plugin.dra_socket);
    let seen = plugin
        .wait_seen("the notification", |s| !s.notified.is_empty())
        .await;
    assert_eq!(seen.notified, vec![(true, String::new())]);
    // Prepare goes to the chosen version.
    let pod = Pod::new("default", "p").claim(
        PodClaim::new("gpu", "uid-1")
            .driver(DRIVER)
            .used_by("c", "gpu"),
    );
    kubelet.prepare_pod(&pod).await?;
    assert_eq!(
        plugin.seen().calls,
        vec![(
            "v1beta1.NodePrepareResources".to_string(),
            strings(&["uid-1"])
        )]
    );
    Ok(())
}

#[tokio::test]
async fn a_plugin_of_another_type_is_refused_and_tried_again() -> TestResult {
    let root = tempfile::tempdir()?;
    let kubelet = DraKubelet::start_with(root.path(), options())?;
    let mut config = Config::new(DRIVER);
    config.plugin_type = "CSIPlugin".into();
    let plugin = TestPlugin::start(root.path(), config)?;
    let seen = plugin
        .wait_seen("two refusals", |s| s.notified.len() >= 2)
        .await;
    assert!(
        seen.notified.iter().all(|(ok, reason)| !ok
            && reason.contains("no handler registered for plugin type: CSIPlugin"))
    );
    // The kubelet may see the socket before the plugin listens on it: that attempt fails at GetInfo, and
    // the refusal comes with the next.
    let attempts = kubelet.attempts();
    let refused = attempts
        .iter()
        .find(|a| !matches!(a.outcome, Outcome::GetInfoFailed(_)));
    assert!(
        matches!(
            refused.map(|a| &a.outcome),
            Some(Outcome::Refused { retried: true, .. })
        ),
        "{attempts:?}"
    );
    assert!(kubelet.registrations().is_empty());
    Ok(())
}

#[tokio::test]
async fn a_plugin_with_no_known_service_is_told_why() -> TestResult {
    let root = tempfile::tempdir()?;
    let kubelet = DraKubelet::start_with(root.path(), options())?;
    let plugin = TestPlugin::start(root.path(), Config::new(DRIVER).versions(&["v2.DRAPlugin"]))?;
    let seen = plugin
        .wait_seen("a refusal", |s| !s.notified.is_empty())
        .await;
    let (registered, reason) = &seen.notified[0];
    assert!(!registered);
    assert!(
        reason.contains("v2.DRAPlugin") && reason.contains("none of services"),
        "{reason}"
    );
    assert!(kubelet.registrations().is_empty());
    Ok(())
}

#[tokio::test]
async fn get_info_failures_are_tried_again_without_a_notification() -> TestResult {
    let root = tempfile::tempdir()?;
    let kubelet = DraKubelet::start_with(root.path(), options())?;
    let mut config = Config::new(DRIVER);
    config.get_info_failures = 2;
    let plugin = TestPlugin::start(root.path(), config)?;
    let attempts: Vec<Outcome> = kubelet
        .wait_attempts("the registration", WAIT, |a| {
            a.iter()
                .any(|a| matches!(a.outcome, Outcome::Registered(_)))
        })
        .await?
        .into_iter()
        .filter(|a| a.socket == plugin.registration)
        .map(|a| a.outcome)
        .collect();
    // Two refusals of GetInfo (and any refused connection before the socket listened), then registered.
    let (last, before) = attempts.split_last().ok_or("no attempt")?;
    assert!(matches!(last, Outcome::Registered(_)), "{attempts:?}");
    assert!(
        before.len() >= 2
            && before
                .iter()
                .all(|o| matches!(o, Outcome::GetInfoFailed(_))),
        "{attempts:?}"
    );
    assert_eq!(plugin.seen().notified, vec![(true, String::new())]);
    Ok(())
}

#[tokio::test]
async fn a_second_registration_socket_for_the_same_endpoint_is_refused_once() -> TestResult {
    let root = tempfile::tempdir()?;
    let kubelet = DraKubelet::start_with(root.path(), options())?;
    let first = TestPlugin::start(root.path(), Config::new(DRIVER))?;
    kubelet.wait_registered(DRIVER, WAIT).await?;
    // Another instance claims the first one's DRA endpoint.
    let mut config = Config::new("copy");
    config.driver = DRIVER.into();
    config.dir = "copy".into();
    config.registration = "copy-reg.sock".into();
    config.endpoint = Some(first.plugin.dra_socket.display().to_string());
    let second = TestPlugin::start(root.path(), config)?;
    let seen = second
        .wait_seen("the refusal", |s| !s.notified.is_empty())
        .await;
    assert!(!seen.notified[0].0);
    assert!(
        seen.notified[0].1.contains("already registered"),
        "{:?}",
        seen.notified
    );
    // A socket can be seen before it listens (the kubelet is refused and tries again): the refusal is the
    // attempt that counts.
    let attempts = kubelet
        .wait_attempts("the refused attempt", WAIT, |a| {
            a.iter().any(|a| {
                a.socket == second.registration && matches!(a.outcome, Outcome::Refused { .. })
            })
        })
        .await?;
    let refused = attempts
        .iter()
        .find(|a| a.socket == second.registration && matches!(a.outcome, Outcome::Refused { .. }));
    assert!(
        matches!(
            refused.map(|a| &a.outcome),
            Some(Outcome::Refused { retried: false, .. })
        ),
        "{refused:?}"
    );
    assert_eq!(kubelet.registrations().len(), 1);
    Ok(())
}

#[tokio::test]
async fn dot_files_and_plain_files_are_ignored_and_subdirectories_searched() -> TestResult {
    let root = tempfile::tempdir()?;
    let kubelet = DraKubelet::start_with(root.path(), options())?;
    let registry = root.path().join("plugins_registry");
    std::fs::write(registry.join("not-a-socket.sock"), b"")?;
    let mut hidden = Config::new("hidden.example.com");
    hidden.registration = ".hidden-reg.sock".into();
    let _hidden = TestPlugin::start(root.path(), hidden)?;
    let mut nested = Config::new(DRIVER);
    nested.registration = "nested/deeper/gpu-reg.sock".into();
    let nested = TestPlugin::start(root.path(), nested)?;
    let registered = kubelet.wait_registered(DRIVER, WAIT).await;
    assert!(
        registered.is_ok(),
        "{registered:?}: {:?} {:?}",
        kubelet.sockets(),
        kubelet.attempts()
    );
    // Events are taken in order: the ignored files came before the nested socket.
    assert_eq!(kubelet.sockets(), vec![nested.registration.clone()]);
    Ok(())
}

#[tokio::test]
async fn reports_fill_the_health_cache_and_go_stale_when_the_clock_moves() -> TestResult {
    let (_root, kubelet, plugin) = registered_and_streaming().await?;
    let mut slow = dev("dev-b", Health::Healthy, "");
    slow.timeout = 60;
    plugin.report(vec![
        dev("dev-a", Health::Unhealthy, "XID 79: fell off the bus"),
        slow,
    ]);
    let read = kubelet
        .wait_device_health((DRIVER, "node-a", "dev-a"), WAIT, |h| {
            h.health == Health::Unhealthy
        })
        .await?;
    assert_eq!(read.message, "XID 79: fell off the bus");
    kubelet.advance_clock(Duration::from_secs(31));
    let read = kubelet
        .wait_device_health((DRIVER, "node-a", "dev-a"), WAIT, |h| {
            h.health == Health::Unknown
        })
        .await?;
    assert_eq!(read.message, "");
    assert_eq!(
        kubelet.device_health(DRIVER, "node-a", "dev-b").health,
        Health::Healthy,
        "its own 60 s timeout holds"
    );
    Ok(())
}

#[tokio::test]
async fn a_health_change_is_timed_by_the_report_that_made_it_not_by_later_repeats() -> TestResult {
    let (_root, kubelet, plugin) = registered_and_streaming().await?;
    plugin.report(vec![dev("dev-a", Health::Healthy, "")]);
    let (_, healthy) = kubelet
        .wait_device_health_since((DRIVER, "node-a", "dev-a"), WAIT, |h, _| {
            h.health == Health::Healthy
        })
        .await?;
    let sent = Instant::now();
    plugin.report(vec![dev("dev-a", Health::Unhealthy, "XID 79")]);
    let (read, first) = kubelet
        .wait_device_health_since((DRIVER, "node-a", "dev-a"), WAIT, |h, _| {
            h.health == Health::Unhealthy
        })
        .await?;
    assert_eq!(read.message, "XID 79");
    let first = first.ok_or("a device reported Unhealthy has a time")?;
    assert!(healthy.is_some_and(|h| h <= sent) && first >= sent);
    // A repeat with a new message: the same run of Unhealthy.
    plugin.report(vec![dev("dev-a", Health::Unhealthy, "XID 79, then 48")]);
    let (_, again) = kubelet
        .wait_device_health_since((DRIVER, "node-a", "dev-a"), WAIT, |h, _| {
            h.message == "XID 79, then 48"
        })
        .await?;
    assert_eq!(again, Some(first));
    Ok(())
}

#[tokio::test]
async fn the_end_of_a_stream_clears_the_driver_and_it_is_opened_again_after_the_delay() -> TestResult
{
    let root = tempfile::tempdir()?;
    let kubelet = DraKubelet::start_with(root.path(), options())?;
    let plugin = TestPlugin::start(root.path(), Config::new(DRIVER))?;
    kubelet.wait_registered(DRIVER, WAIT).await?;
    plugin
        .wait_seen("the health stream", |s| s.health_opened.len() == 1)
        .await;
    plugin.report(vec![dev("dev-a", Health::Healthy, "")]);
    kubelet
        .wait_device_health((DRIVER, "node-a", "dev-a"), WAIT, |h| {
            h.health == Health::Healthy
        })
        .await?;
    plugin.end_health_streams();
    kubelet
        .wait_device_health((DRIVER, "node-a", "dev-a"), WAIT, |h| {
            h.health == Health::Unknown
        })
        .await?;
    kubelet
        .wait_health_streams("the end", WAIT, |e| {
            e.iter().any(|e| e.event == StreamEvent::Ended(None))
        })
        .await?;
    assert_eq!(plugin.seen().health_opened.len(), 1, "not before the delay");
    kubelet.advance_clock(Duration::from_secs(5));
    plugin
        .wait_seen("the stream again", |s| s.health_opened.len() == 2)
        .await;
    Ok(())
}

#[tokio::test]
async fn kubelet_1_36_watches_health_that_is_not_advertised_and_tries_again_on_unimplemented()
-> TestResult {
    let root = tempfile::tempdir()?;
    let kubelet = DraKubelet::start_with(root.path(), options().version(KubeletVersion::V1_36))?;
    let mut config = Config::new(DRIVER).versions(&["v1.DRAPlugin"]);
    config.health = false;
    let _plugin = TestPlugin::start(root.path(), config)?;
    let registered = kubelet.wait_registered(DRIVER, WAIT).await?;
    assert_eq!(registered.health, Some(HealthService::V1alpha1));
    let unimplemented = |e: &Vec<HealthStreamEvent>| {
        e.iter()
            .filter(|e| {
                matches!(
                    e.event,
                    StreamEvent::OpenFailed(tonic::Code::Unimplemented, _)
                )
            })
            .count()
    };
    kubelet
        .wait_health_streams("Unimplemented", WAIT, |e| unimplemented(e) == 1)
        .await?;
    kubelet.advance_clock(Duration::from_secs(5));
    kubelet
        .wait_health_streams("Unimplemented again", WAIT, |e| unimplemented(e) == 2)
        .await?;
    Ok(())
}

#[tokio::test]
async fn kubelet_1_37_watches_v1_health_when_the_plugin_advertises_it() -> TestResult {
    let root = tempfile::tempdir()?;
    let kubelet = DraKubelet::start_with(root.path(), options().version(KubeletVersion::V1_37))?;
    let plugin = TestPlugin::start(root.path(), Config::new(DRIVER))?;
    let registered = kubelet.wait_registered(DRIVER, WAIT).await?;
    assert_eq!(registered.health, Some(HealthService::V1));
    let seen = plugin
        .wait_seen("the health stream", |s| !s.health_opened.is_empty())
        .await;
    assert_eq!(seen.health_opened, vec!["v1"]);
    Ok(())
}

fn two_claim_pod() -> Pod {
    Pod::new("default", "trainer")
        .claim(
            PodClaim::new("gpus", "uid-a")
                .resource_claim("trainer-gpus-x7k2p")
                .driver(DRIVER)
                .used_by("main", "gpu"),
        )
        .claim(
            PodClaim::new("spare", "uid-b")
                .driver(DRIVER)
                .used_by("sidecar", ""),
        )
}

#[tokio::test]
async fn a_pod_is_prepared_in_one_call_per_driver_and_only_once() -> TestResult {
    let root = tempfile::tempdir()?;
    let kubelet = DraKubelet::start_with(root.path(), options())?;
    let plugin = TestPlugin::start(root.path(), Config::new(DRIVER))?;
    kubelet.wait_registered(DRIVER, WAIT).await?;
    let pod = two_claim_pod();
    kubelet.prepare_pod(&pod).await?;
    kubelet.prepare_pod(&pod).await?;
    assert_eq!(
        plugin.seen().calls,
        vec![(
            "v1.NodePrepareResources".to_string(),
            strings(&["uid-a", "uid-b"])
        )]
    );
    assert_eq!(
        kubelet.cdi_devices(&pod, "main"),
        strings(&[
            "example.com/gpu=trainer-gpus-x7k2p",
            "example.com/extra=trainer-gpus-x7k2p"
        ])
    );
    assert_eq!(
        kubelet
            .prepared("uid-b")
            .map(|d| d[DRIVER][0].device.clone()),
        Some("dev-spare".to_string())
    );
    Ok(())
}

#[tokio::test]
async fn a_claim_the_plugin_fails_or_leaves_out_fails_the_pod_by_name() -> TestResult {
    let root = tempfile::tempdir()?;
    let kubelet = DraKubelet::start_with(root.path(), options())?;
    let plugin = TestPlugin::start(root.path(), Config::new(DRIVER))?;
    kubelet.wait_registered(DRIVER, WAIT).await?;
    let pod = two_claim_pod();
    plugin.behave(|b| {
        b.claim_errors
            .insert("uid-b".into(), "GPU-0 is prepared for another claim".into());
    });
    let failed = kubelet.prepare_pod(&pod).await;
    let Err(DraError::Claim(error)) = &failed else {
        panic!("{failed:?}");
    };
    assert_eq!(
        (error.name.as_str(), error.message.as_str()),
        ("spare", "GPU-0 is prepared for another claim")
    );
    assert_eq!(
        kubelet.prepared("uid-a"),
        None,
        "nothing is kept of a failed pod"
    );
    plugin.behave(|b| {
        b.claim_errors.clear();
        b.omitted.insert("uid-a".into());
    });
    let failed = kubelet.prepare_pod(&pod).await;
    assert!(
        matches!(&failed, Err(DraError::Claim(e)) if e.name == "trainer-gpus-x7k2p" && e.message.contains("no entry")),
        "{failed:?}"
    );
    Ok(())
}

#[tokio::test]
async fn the_pod_status_shows_each_device_by_its_first_cdi_id_with_its_health() -> TestResult {
    let (_root, kubelet, plugin) = registered_and_streaming().await?;
    let pod = two_claim_pod();
    kubelet.prepare_pod(&pod).await?;
    // The plugin names a device after the ResourceClaim object it prepared it for.
    plugin.report(vec![
        dev("dev-trainer-gpus-x7k2p", Health::Unhealthy, "XID 48"),
        dev("dev-spare", Health::Healthy, ""),
    ]);
    let expected = json!([
        {"name": "main", "allocatedResourcesStatus": [{"name": "claim:gpus/gpu", "resources": [
            {"resourceID": "example.com/gpu=trainer-gpus-x7k2p", "health": "Unhealthy", "message": "XID 48"},
        ]}]},
        {"name": "sidecar", "allocatedResourcesStatus": [{"name": "claim:spare", "resources": [
            {"resourceID": "example.com/gpu=spare", "health": "Healthy"},
        ]}]},
    ]);
    let status = kubelet
        .wait_allocated_resources_status(&pod, "the health in the status", WAIT, |s| *s == expected)
        .await;
    assert!(
        status.is_ok(),
        "{status:?}: {}",
        kubelet.allocated_resources_status(&pod)
    );
    kubelet.advance_clock(Duration::from_secs(31));
    let unknown = kubelet
        .wait_allocated_resources_status(&pod, "Unknown", WAIT, |s| {
            s[0]["allocatedResourcesStatus"][0]["resources"][0]
                == json!({"resourceID": "example.com/gpu=trainer-gpus-x7k2p", "health": "Unknown"})
        })
        .await;
    assert!(
        unknown.is_ok(),
        "{}",
        kubelet.allocated_resources_status(&pod)
    );
    Ok(())
}

#[tokio::test]
async fn ending_a_pod_unprepares_its_claims_and_unknown_claims_can_be_unprepared() -> TestResult {
    let root = tempfile::tempdir()?;
    let kubelet = DraKubelet::start_with(root.path(), options())?;
    let plugin = TestPlugin::start(root.path(), Config::new(DRIVER))?;
    kubelet.wait_registered(DRIVER, WAIT).await?;
    let pod = two_claim_pod();
    kubelet.prepare_pod(&pod).await?;
    plugin.behave(|b| {
        b.unprepare_errors.insert("uid-b".into(), "busy".into());
    });
    let errors = kubelet.end_pod(&pod).await?;
    assert_eq!(errors.len(), 1);
    assert_eq!(
        (errors[0].uid.as_str(), errors[0].message.as_str()),
        ("uid-b", "busy")
    );
    assert_eq!(kubelet.prepared("uid-a"), None, "unprepared and forgotten");
    assert!(kubelet.prepared("uid-b").is_some(), "kept for another try");
    let never = ClaimRef {
        namespace: "default".into(),
        name: "gone".into(),
        uid: "uid-gone".into(),
        driver: DRIVER.into(),
    };
    assert!(kubelet.unprepare(&[never]).await?.is_empty());
    assert_eq!(
        plugin.seen().calls.last(),
        Some(&(
            "v1.NodeUnprepareResources".to_string(),
            strings(&["uid-gone"])
        ))
    );
    Ok(())
}

#[tokio::test]
async fn claims_name_their_drivers_through_the_api_server() -> TestResult {
    let root = tempfile::tempdir()?;
    let api = FakeApiServer::start().await?;
    let kubelet = DraKubelet::start_with(root.path(), options().api_server(&api, "node-a"))?;
    let plugin = TestPlugin::start(root.path(), Config::new(DRIVER))?;
    kubelet.wait_registered(DRIVER, WAIT).await?;
    let uid = api.add_claim(
        "default",
        "gpus",
        vec![crate::apiserver::AllocationResult::new(
            "gpu", DRIVER, "node-a", "dev-gpus",
        )],
    );
    let pod = Pod::new("default", "p").claim(PodClaim::new("gpus", &uid).used_by("c", "gpu"));
    kubelet.prepare_pod(&pod).await?;
    assert_eq!(
        plugin.seen().calls,
        vec![("v1.NodePrepareResources".to_string(), vec![uid.clone()])]
    );
    // Made again: another UID than the pod's.
    api.add_claim("default", "gpus", vec![]);
    let other = Pod::new("default", "q").claim(PodClaim::new("gpus", &uid).used_by("c", ""));
    kubelet.end_pod(&pod).await?;
    let failed = kubelet.prepare_pod(&other).await;
    assert!(
        matches!(&failed, Err(DraError::ClaimLookup { message, .. }) if message.contains("UID")),
        "{failed:?}"
    );
    Ok(())
}

fn slice(name: &str, driver: &str) -> serde_json::Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {"driver": driver, "nodeName": "node-a",
                 "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1}, "devices": []},
    })
}

/// Creates a slice through the API server's HTTP side, as a driver would.
async fn create_slice(
    api: &FakeApiServer,
    body: serde_json::Value,
) -> Result<u16, Box<dyn std::error::Error>> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let body = body.to_string();
    let addr = api.url().trim_start_matches("http://").to_string();
    let mut stream = tokio::net::TcpStream::connect(&addr).await?;
    let request = format!(
        "POST /apis/resource.k8s.io/v1/resourceslices HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await?;
    Ok(answer.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0))
}

#[tokio::test]
async fn a_restart_registers_again_and_deletes_the_nodes_slices() -> TestResult {
    let root = tempfile::tempdir()?;
    let api = FakeApiServer::start().await?;
    let plugin = TestPlugin::start(root.path(), Config::new(DRIVER))?;
    // Found by the walk at start.
    let kubelet = DraKubelet::start_with(root.path(), options().api_server(&api, "node-a"))?;
    // Registered once the plugin is told so (a restart before would cut the notification off).
    plugin
        .wait_seen("the registration", |s| s.notified.len() == 1)
        .await;
    assert_eq!(create_slice(&api, slice("s-1", DRIVER)).await?, 201);
    kubelet.restart();
    assert!(api.slices().is_empty());
    assert_eq!(
        kubelet.wipes().last(),
        Some(&Wipe {
            driver: None,
            deleted: 1
        })
    );
    kubelet.wait_registered(DRIVER, WAIT).await?;
    plugin
        .wait_seen("a second registration", |s| s.notified.len() == 2)
        .await;
    Ok(())
}

#[tokio::test]
async fn a_drivers_slices_go_30_seconds_after_its_last_connection_unless_it_comes_back()
-> TestResult {
    let root = tempfile::tempdir()?;
    let api = FakeApiServer::start().await?;
    let kubelet = DraKubelet::start_with(root.path(), options().api_server(&api, "node-a"))?;
    let plugin = TestPlugin::start(root.path(), Config::new(DRIVER))?;
    kubelet.wait_registered(DRIVER, WAIT).await?;
    kubelet.wait_connected(DRIVER, true, WAIT).await?;
    assert_eq!(create_slice(&api, slice("mine", DRIVER)).await?, 201);
    assert_eq!(
        create_slice(&api, slice("theirs", "other.example.com")).await?,
        201
    );

    // It dies and comes back before the delay: nothing is deleted.
    plugin.kill();
    kubelet.wait_connected(DRIVER, false, WAIT).await?;
    let plugin = TestPlugin::start(root.path(), Config::new(DRIVER))?;
    kubelet.wait_connected(DRIVER, true, WAIT).await?;
    kubelet.advance_clock(Duration::from_secs(31));

    // It dies for good.
    plugin.kill();
    kubelet.wait_connected(DRIVER, false, WAIT).await?;
    assert_eq!(api.slices().len(), 2, "not before the delay");
    kubelet.advance_clock(Duration::from_secs(30));
    let wipes = kubelet
        .wait_wipes("the driver's wipe", WAIT, |w| {
            w.iter().any(|w| w.driver.is_some())
        })
        .await?;
    assert_eq!(
        wipes,
        vec![
            Wipe {
                driver: None,
                deleted: 0
            },
            Wipe {
                driver: Some(DRIVER.into()),
                deleted: 1
            }
        ],
        "one wipe, after the second death"
    );
    let left: Vec<String> = api
        .slices()
        .iter()
        .filter_map(|s| s["metadata"]["name"].as_str().map(String::from))
        .collect();
    assert_eq!(left, vec!["theirs".to_string()]);
    Ok(())
}
