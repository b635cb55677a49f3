//! The HTTP surfaces, on `--http-addr`: `/healthz` (liveness), `/readyz` (registered with the kubelet and
//! serving), `/status` (JSON: every device with its conditions and message, the kubelet link, the policy;
//! an HTML page of the same to a browser, see [`page`]).
//! They read the same state the kubelet side does, through the monitor's status queries and the kubelet
//! link's watch, and are never in the kubelet's path: a slow or failing HTTP client cannot delay a fault.
//!
//! Also the client side, for `gpu-device-plugin status`.
//!
//! Manifests bind it on every address of the pod, so anyone who reaches the node may connect: connections
//! are bounded in number, time and buffer size ([`bounded`], [`bounds`]), and a flood costs the HTTP port
//! alone.

pub mod page;
pub mod status;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::devices::Health;
use crate::http::status::{DeviceStatus, KubeletStatus, PolicySummary, Report};
use crate::kubelet::pods::PodResources;
use crate::metrics::Metrics;
use crate::metrics::{ConditionGauge, DeviceGauge};
use crate::monitor::DeviceSnapshot;
use crate::monitor::MonitorHandle;
use crate::sources::Heartbeat;
use crate::util::bounded;

/// Where the HTTP surfaces listen unless told otherwise: loopback only, so nothing is exposed off the node by
/// default.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9412";

/// How long the monitor has to answer before `/healthz` says it is stuck.
const MONITOR_ANSWER: Duration = Duration::from_secs(2);

/// The most HTTP connections served at once (fewer under a small open-file limit: see
/// [`crate::util::limits::connection_cap`]). The kubelet's probes, a Prometheus scrape and an operator's `status`
/// need a handful; past the cap, the oldest connection is closed to make room.
pub const MAX_CONNECTIONS: usize = 128;

/// How long an HTTP client has to send its request's headers (and how long a kept-alive connection may sit
/// idle): the kubelet's probes and Prometheus send theirs at once.
pub const HEADER_READ: Duration = Duration::from_secs(5);

/// The longest an HTTP connection is served: longer than any answer takes to write, short enough that a
/// client cannot keep its place.
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);

/// Each HTTP connection's read and write buffer, the least hyper allows: requests are a GET line and a few
/// headers.
pub const MAX_BUF: usize = 8 * 1024;

/// The HTTP port's bounds under the open-file limit now.
pub fn bounds() -> bounded::Bounds {
    bounded::Bounds::under_open_files(MAX_CONNECTIONS, HEADER_READ, CONNECTION_LIFETIME, MAX_BUF)
}

/// How long to wait before trying the address again when it is taken (during a rolling update with the host
/// network, the old instance holds it until it exits).
const BIND_RETRY: Duration = Duration::from_secs(5);

/// What the HTTP surfaces read.
#[derive(Debug, Clone)]
pub struct Context {
    /// The monitor, for device details and as the liveness signal of the event loop.
    pub devices: MonitorHandle,
    /// The link with the kubelet, per resource served (the first is the main one).
    pub kubelet: Vec<watch::Receiver<KubeletStatus>>,
    /// The resource of each device.
    pub resources: std::sync::Arc<crate::devices::resources::ResourcePlan>,
    /// The policy in force.
    pub policy: PolicySummary,
    /// The heartbeats of the threads waiting for the GPUs' events (one per GPU), where there are any.
    pub event_thread: Option<Heartbeat>,
    /// How long such a thread may go without coming round its loop before it counts as stuck.
    pub stuck_after: Duration,
    /// The metrics `/metrics` serves.
    pub metrics: Arc<Metrics>,
    /// Where `/status` learns which pods hold each device, if anywhere.
    pub pods: Option<Arc<PodResources>>,
    /// Devices present but not served, with why (found at start).
    pub unserved: Vec<crate::devices::Unserved>,
    /// The DRA side, when some GPUs are served through it.
    pub dra: Option<DraSurface>,
}

/// What the surfaces read of the DRA side.
#[derive(Debug, Clone)]
pub struct DraSurface {
    /// The GPUs served through DRA.
    pub gpus: crate::devices::selection::DraSelection,
    /// The DRA side's own account: registration, prepared claims.
    pub status: watch::Receiver<crate::dra::registration::DraStatus>,
}

/// `/status` asks the kubelet which pods hold the devices at most this often.
const PODS_MAX_AGE: Duration = Duration::from_secs(5);

/// Serves the HTTP surfaces on `addr` until `shutdown`, in a task of its own. An address in use is tried
/// again every few seconds (said once at warn level): the plugin's real work never waits for it.
///
/// The kubelet first: the surfaces start once the kubelet has accepted the first registration, or after
/// [`crate::kubelet::OTHERS_START_AT_LATEST`] without one, so that their start-up work never delays the plugin's own.
pub fn spawn(addr: SocketAddr, context: Context, shutdown: CancellationToken) {
    tokio::spawn(async move {
        let registered = match context.kubelet.first() {
            Some(first) => crate::kubelet::registered_or_late(first.clone()).await,
            None => false,
        };
        tracing::debug!(registered, "starting the HTTP surfaces");
        let mut warned = false;
        let listener = loop {
            match bind(addr) {
                Ok(listener) => break listener,
                Err(e) => {
                    if !warned {
                        tracing::warn!(%addr, error = %e, retry_in_s = BIND_RETRY.as_secs(), "cannot serve HTTP (/healthz, /readyz, /status) yet; will retry");
                        warned = true;
                    }
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(BIND_RETRY) => {}
                    }
                }
            }
        };
        serve(listener, Arc::new(context), shutdown).await;
    });
}

/// Connections the kernel completes and queues until the plugin accepts them (the kernel caps it at
/// `net.core.somaxconn`, 4096 on current kernels). A burst (a flood, or many clients at once) waits there at
/// no descriptor's cost; past the queue, the kernel drops a client's SYN and the client tries again only a
/// second later, half the liveness probe's timeout. tokio's default is 128.
const ACCEPT_BACKLOG: u32 = 1024;

/// A listener on `addr` with a queue of [`ACCEPT_BACKLOG`], reusing an address left in TIME_WAIT as tokio's
/// own bind does.
fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(ACCEPT_BACKLOG)
}

/// Serves the HTTP surfaces on an already bound listener until `shutdown`, within [`bounds`].
pub async fn serve(listener: TcpListener, context: Arc<Context>, shutdown: CancellationToken) {
    let bounds = bounds();
    if let Ok(local) = listener.local_addr() {
        tracing::info!(
            addr = %local,
            max_connections = bounds.max_connections,
            "serving HTTP: /healthz /readyz /status /metrics"
        );
    }
    let gate = bounded::Gate::new("HTTP", bounds.max_connections);
    loop {
        let stream = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot accept an HTTP connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Past the cap the oldest connection is closed first (see [`bounded`]); this waits for it.
        let admitted = tokio::select! {
            () = shutdown.cancelled() => return,
            place = gate.admit() => place,
        };
        let Some(place) = admitted else {
            continue;
        };
        if place.evicted_another() {
            context.metrics.http_connection_evicted();
        }
        let context = context.clone();
        let connections = gate.clone();
        let service = move |request: Request<Incoming>| {
            let context = context.clone();
            let connections = connections.clone();
            async move { route(&context, &connections, &request).await }
        };
        tokio::spawn(bounded::serve_connection(stream, service, bounds, place));
    }
}

/// Why the NVML event threads (one per GPU) leave faults unseen, for `/healthz`; `None` while every one comes
/// round its loop and can wait for events. A thread stuck longer than `stuck_after` is named before one whose
/// every wait fails.
fn event_threads(heartbeat: &Heartbeat, stuck_after: Duration) -> Option<String> {
    let gpus = |of: usize, names: &[String]| {
        let gpus = if of == 1 { "GPU" } else { "GPUs" };
        format!("{} of {of} {gpus} ({})", names.len(), names.join(", "))
    };
    match heartbeat.age() {
        Some(age) if age > stuck_after => {
            let (of, stuck) = heartbeat.stuck(stuck_after);
            return Some(format!(
                "the NVML event thread has been stuck for {} s (in the driver?) on {}: their faults are not \
                 seen\n",
                age.as_secs(),
                gpus(of, &stuck)
            ));
        }
        _ => {}
    }
    let (of, blind) = heartbeat.blind();
    (!blind.is_empty()).then(|| {
        format!(
            "every NVML event wait fails on {}: their faults are not seen (they are unmonitored)\n",
            gpus(of, &blind)
        )
    })
}

/// `/healthz`'s answer while the plugin is alive. Devices served unmonitored (NVML unavailable at start) do not
/// make it red: a restart would not bring the driver back, and every restart ends the kubelet's stream, taking
/// the GPUs out of service for nothing. It says so, for whoever reads the probe.
fn alive(devices: &[DeviceSnapshot]) -> String {
    let unmonitored = devices
        .iter()
        .filter(|d| {
            d.conditions
                .iter()
                .any(|c| c.condition.kind == crate::health::ConditionKind::Unmonitored)
        })
        .count();
    if unmonitored == 0 {
        return "ok\n".into();
    }
    format!(
        "ok; {unmonitored} of {} devices are served unmonitored, their faults not seen (see /status)\n",
        devices.len()
    )
}

async fn route<B>(
    context: &Context,
    connections: &bounded::Gate,
    request: &Request<B>,
) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n".into());
    }
    match request.uri().path() {
        "/healthz" => healthz(context).await,
        "/readyz" => readyz(context),
        "/status" => status(context, request).await,
        "/metrics" => metrics(context, connections).await,
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: try /healthz, /readyz, /status or /metrics\n".into(),
        ),
    }
}

/// `/healthz`: alive while the monitor answers and no event thread is stuck.
async fn healthz(context: &Context) -> Response<Full<Bytes>> {
    match tokio::time::timeout(MONITOR_ANSWER, context.devices.devices()).await {
        Ok(Some(devices)) => match context
            .event_thread
            .as_ref()
            .and_then(|heartbeat| event_threads(heartbeat, context.stuck_after))
        {
            Some(why) => text(StatusCode::SERVICE_UNAVAILABLE, why),
            None => text(StatusCode::OK, alive(&devices)),
        },
        Ok(None) => text(
            StatusCode::SERVICE_UNAVAILABLE,
            "the health monitor has stopped\n".into(),
        ),
        Err(_) => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the health monitor did not answer within {MONITOR_ANSWER:?}\n"),
        ),
    }
}

/// `/readyz`: ready when the kubelet holds every resource (one that is not registered is capacity missing)
/// and the DRA driver, where it is on.
fn readyz(context: &Context) -> Response<Full<Bytes>> {
    let not_ready = context.kubelet.iter().find_map(|k| {
        let kubelet = k.borrow().clone();
        if kubelet.registered && kubelet.streams_open > 0 {
            None
        } else if kubelet.registered {
            Some(format!(
                "{}: registered, but the kubelet holds no ListAndWatch stream yet\n",
                kubelet.resource
            ))
        } else {
            Some(format!(
                "{}: not registered with the kubelet at {}\n",
                kubelet.resource, kubelet.kubelet_socket
            ))
        }
    });
    let not_ready = not_ready.or_else(|| {
        let dra = context.dra.as_ref()?.status.borrow().clone();
        (!dra.registered).then(|| match dra.error {
            Some(e) => format!("DRA driver {}: the kubelet refused it: {e}\n", dra.driver),
            None => format!(
                "DRA driver {}: not registered with the kubelet yet\n",
                dra.driver
            ),
        })
    });
    match not_ready {
        None => text(StatusCode::OK, "ready\n".into()),
        Some(why) => text(StatusCode::SERVICE_UNAVAILABLE, why),
    }
}

/// `/status`: the report, as JSON or, for a browser, as a page.
async fn status<B>(context: &Context, request: &Request<B>) -> Response<Full<Bytes>> {
    let Some(devices) = snapshot(context).await else {
        return text(
            StatusCode::SERVICE_UNAVAILABLE,
            "the health monitor did not answer\n".into(),
        );
    };
    let holders = match &context.pods {
        Some(pods) => pods.holders(PODS_MAX_AGE).await,
        None => None,
    };
    let pods_of = |id: &str| {
        holders
            .as_ref()
            .and_then(|h| h.get(id).cloned())
            .unwrap_or_default()
    };
    let mut kubelet = context.kubelet.iter().map(|k| k.borrow().clone());
    let kubelet = (kubelet.next().unwrap_or_default(), kubelet.collect());
    let dra = context.dra.as_ref().map(|d| d.status.borrow().clone());
    let report = Report {
        devices: devices
            .iter()
            .map(|d| match dra_device(context, d, &dra) {
                Some(dra) => DeviceStatus {
                    dra: Some(dra),
                    ..DeviceStatus::of(d, String::new(), Vec::new())
                },
                None => {
                    let resource = resource_of(context, d, &kubelet.0);
                    DeviceStatus::of(d, resource, pods_of(&d.info.id))
                }
            })
            .collect(),
        kubelet: kubelet.0,
        other_resources: kubelet.1,
        policy: context.policy.clone(),
        unserved: context.unserved.clone(),
        dra,
    };
    let accept = request
        .headers()
        .get(hyper::header::ACCEPT)
        .and_then(|a| a.to_str().ok());
    if page::wants_html(accept) {
        return answer(
            StatusCode::OK,
            "text/html; charset=utf-8",
            page::CONTENT_SECURITY_POLICY,
            page::html(&report),
        );
    }
    match serde_json::to_vec_pretty(&report) {
        Ok(body) => respond(StatusCode::OK, "application/json", body),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
    }
}

/// `/metrics`: every series, the devices' from the monitor's snapshot.
async fn metrics(context: &Context, connections: &bounded::Gate) -> Response<Full<Bytes>> {
    let Some(devices) = snapshot(context).await else {
        return text(
            StatusCode::SERVICE_UNAVAILABLE,
            "the health monitor did not answer\n".into(),
        );
    };
    context.metrics.http_connections_open(connections.open());
    let links: Vec<KubeletStatus> = context.kubelet.iter().map(|k| k.borrow().clone()).collect();
    let first = links.first().cloned().unwrap_or_default();
    let dra = context.dra.as_ref().map(|d| d.status.borrow().clone());
    let resources: Vec<String> = devices
        .iter()
        .map(|d| match dra_device(context, d, &dra) {
            // Through DRA: the driver stands where the resource would.
            Some(dra) => dra.driver,
            None => resource_of(context, d, &first),
        })
        .collect();
    let gauges = devices
        .iter()
        .zip(&resources)
        .map(|(d, resource)| DeviceGauge {
            resource,
            device: &d.info.id,
            index: d.index,
            healthy: d.health == Health::Healthy,
            conditions: d
                .conditions
                .iter()
                .map(|c| ConditionGauge {
                    kind: c.condition.kind.name(),
                    value: c.condition.kind.value(),
                    unhealthy: c.effect == crate::health::Effect::Unhealthy,
                })
                .collect(),
        });
    context
        .metrics
        .dra_registered(dra.as_ref().map(|d| (d.driver.as_str(), d.registered)));
    // Registered: every resource the process serves is; streams: all of them together.
    let registered = links.iter().all(|k| k.registered);
    let streams = links.iter().map(|k| k.streams_open).sum();
    respond(
        StatusCode::OK,
        "application/openmetrics-text; version=1.0.0; charset=utf-8",
        context.metrics.render(gauges, registered, streams),
    )
}

/// The monitor's devices now, or `None` if the monitor does not answer within [`MONITOR_ANSWER`].
async fn snapshot(context: &Context) -> Option<Vec<DeviceSnapshot>> {
    tokio::time::timeout(MONITOR_ANSWER, context.devices.devices())
        .await
        .ok()?
}

/// The resource `device` is served under (the main one, `main`, where the plan names none).
/// How `device` is published through DRA, when it is served there.
fn dra_device(
    context: &Context,
    device: &DeviceSnapshot,
    status: &Option<crate::dra::registration::DraStatus>,
) -> Option<status::DraDevice> {
    let surface = context.dra.as_ref()?;
    if !surface.gpus.serves(&device.info) {
        return None;
    }
    let name = crate::dra::names::device_name(&device.info);
    let status = status.as_ref();
    Some(status::DraDevice {
        driver: status.map(|s| s.driver.clone()).unwrap_or_default(),
        claim: status.and_then(|s| s.prepared.get(&name).cloned()),
        device: name,
    })
}

fn resource_of(context: &Context, device: &DeviceSnapshot, main: &KubeletStatus) -> String {
    let resource = context.resources.resource_of(
        &device.info.id,
        device.info.mig.as_ref().map(|m| m.profile.as_str()),
    );
    if resource.is_empty() {
        main.resource.clone()
    } else {
        resource.into_owned()
    }
}

/// The Content-Security-Policy of every answer but the HTML page: nothing in it may be run, styled, framed or
/// loaded. `/status` carries outside text (fence reasons, device names) raw in its JSON; a browser told to
/// render it, or a page that frames it, must find nothing it may act on.
pub const PLAIN_CONTENT_SECURITY_POLICY: &str =
    "default-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn respond(
    status: StatusCode,
    content_type: &str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    answer(status, content_type, PLAIN_CONTENT_SECURITY_POLICY, body)
}

/// Every HTTP answer goes through here, errors included, so that each carries its Content-Security-Policy
/// and `X-Content-Type-Options: nosniff` (a browser must not guess HTML or script from a text or JSON body).
fn answer(
    status: StatusCode,
    content_type: &str,
    policy: &str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("content-security-policy", policy)
        .header("x-content-type-options", "nosniff")
        .body(Full::new(body.into()))
        .unwrap_or_default()
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    respond(status, "text/plain; charset=utf-8", body)
}

/// Why the `status` command got no report.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing answered at the address.
    #[error("cannot reach the plugin at {addr}: {cause} (is it running, with --http-addr {addr}?)")]
    Connect {
        /// The address.
        addr: String,
        /// The OS error.
        cause: std::io::Error,
    },
    /// The HTTP exchange failed.
    #[error("the plugin at {addr} did not answer over HTTP: {cause}")]
    Http {
        /// The address.
        addr: String,
        /// What failed.
        cause: String,
    },
    /// An answer that is not a status report.
    #[error("the plugin at {addr} answered {status}: {body}")]
    Refused {
        /// The address.
        addr: String,
        /// HTTP status.
        status: StatusCode,
        /// What it said.
        body: String,
    },
    /// No answer in time.
    #[error("the plugin at {0} did not answer within 5 s")]
    Timeout(String),
}

/// Fetches the status report from a running plugin's `/status`.
pub async fn fetch_report(addr: &str) -> Result<Report, ClientError> {
    let (status, body) = get(addr, "/status").await?;
    if status != StatusCode::OK {
        return Err(ClientError::Refused {
            addr: addr.to_string(),
            status,
            body: String::from_utf8_lossy(&body).trim().to_string(),
        });
    }
    serde_json::from_slice(&body).map_err(|e| ClientError::Http {
        addr: addr.to_string(),
        cause: format!("not a status report: {e}"),
    })
}

/// One GET of `path` from a running plugin: the status code and the body. At most 5 s.
pub async fn get(addr: &str, path: &str) -> Result<(StatusCode, Bytes), ClientError> {
    tokio::time::timeout(Duration::from_secs(5), fetch(addr, path))
        .await
        .unwrap_or_else(|_| Err(ClientError::Timeout(addr.to_string())))
}

async fn fetch(addr: &str, path: &str) -> Result<(StatusCode, Bytes), ClientError> {
    let http = |cause: String| ClientError::Http {
        addr: addr.to_string(),
        cause,
    };
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|cause| ClientError::Connect {
            addr: addr.to_string(),
            cause,
        })?;
    let request = Request::get(path)
        .header("host", addr)
        .body(Full::new(Bytes::new()))
        .map_err(|e| http(e.to_string()))?;
    round_trip(stream, request).await.map_err(http)
}

/// One HTTP/1.1 request over `stream` (TCP, or the control socket): the status code and the whole body, or
/// what failed, in words.
pub async fn round_trip<S>(
    stream: S,
    request: Request<Full<Bytes>>,
) -> Result<(StatusCode, Bytes), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(connection);
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healthz_names_the_gpu_whose_event_thread_is_stuck_before_one_whose_waits_fail() {
        let stuck_after = Duration::from_secs(30);
        let heartbeat = Heartbeat::default();
        let a = heartbeat.waiter("GPU-a");
        let b = heartbeat.waiter("GPU-b");
        assert_eq!(event_threads(&heartbeat, stuck_after), None);
        a.set_blind(true);
        assert_eq!(
            event_threads(&heartbeat, stuck_after).as_deref(),
            Some(
                "every NVML event wait fails on 1 of 2 GPUs (GPU-a): their faults are not seen (they are \
                 unmonitored)\n"
            )
        );
        b.silent_for(Duration::from_secs(45));
        let why = event_threads(&heartbeat, stuck_after).unwrap_or_default();
        assert!(
            why.starts_with("the NVML event thread has been stuck for 45 s (in the driver?) on 1 of 2 GPUs (GPU-b)"),
            "{why}"
        );
    }
}
