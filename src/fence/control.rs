//! The control socket, `<state-dir>/control.sock` (mode 0600, owned by the plugin's user): where
//! `gpu-device-plugin fence` and `release` reach the running plugin. Changing a GPU's health needs root on
//! the node or `kubectl exec` into the plugin's pod; the TCP status port only ever reads.
//!
//! HTTP/1.1 over the Unix socket: `POST /fence` and `POST /release` with a JSON [`ControlRequest`]; the
//! answer is a JSON [`ControlAnswer`] with a status code that says what happened (200 done, 400 a bad
//! request, 404 no such device, 409 no such condition on it, 503 the plugin is stopping). Who asked is taken
//! from the socket's peer credentials and recorded with the fence; the reason and the user name are made
//! printable as they come in, so that a newline in them cannot forge a log line.
//!
//! Like the HTTP port, a side surface: a few connections at once, each bounded in time and buffer (see
//! [`bounds`]), served apart from the fault path. The socket is bound again when it disappears while this
//! instance runs (the other instance of a rolling update that had replaced it exits and removes it), so
//! that `fence` always reaches a running plugin.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use notify::{Event, RecommendedWatcher, RecursiveMode, Watcher as _};
use serde::{Deserialize, Serialize};
use tokio::net::UnixStream;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

use crate::health::ConditionSelector;
use crate::kubelet::KubeletError;
use crate::kubelet::socket::PluginSocket;
use crate::monitor::{MonitorHandle, Operated, OperatorError, OperatorRequest};
use crate::util::bounded::{self, Bounds, Gate};

/// The socket's file name in the state directory.
pub const SOCKET_NAME: &str = "control.sock";

/// The largest request body read.
const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// The longest reason or user name kept.
const MAX_TEXT_BYTES: usize = 512;

/// The most control connections served at once (fewer under a small open-file limit): an operator runs one
/// command at a time; a script fencing several GPUs a few. Past it, the oldest is closed to make room.
pub const MAX_CONNECTIONS: usize = 8;

/// How long a control client has to send its request's headers; the command line sends them at once.
const HEADER_READ: Duration = Duration::from_secs(5);

/// The longest a control connection is served: a fence waits for the monitor, and the command line gives up
/// after 10 s.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(15);

/// Each control connection's buffer: the request body (at most [`MAX_REQUEST_BYTES`]) streams through it.
const MAX_BUF: usize = 8 * 1024;

/// How often the socket is looked at without an event: for a watch that could not be set up (inotify
/// instances run out on busy nodes), and for another instance's socket left by a process that was killed
/// (nothing removes the file, so no event comes). One `stat` while ours is in place.
const RECHECK: Duration = Duration::from_secs(30);

/// The control socket's bounds under the open-file limit now.
pub fn bounds() -> Bounds {
    Bounds::under_open_files(MAX_CONNECTIONS, HEADER_READ, CONNECTION_LIFETIME, MAX_BUF)
}

/// What the command line asks.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ControlRequest {
    /// A device ID (GPU or MIG UUID) or NVML index (`3`, `3:1` for a MIG device), or a GPU's UUID or index
    /// for all its MIG devices.
    pub device: String,
    /// Why; required to fence.
    #[serde(default)]
    pub reason: Option<String>,
    /// For a release: the condition to clear (`fenced` when absent).
    #[serde(default)]
    pub condition: Option<String>,
    /// The user as the command line knows it (`$SUDO_USER`, `$USER`), recorded beside the peer's uid.
    #[serde(default)]
    pub user: Option<String>,
}

/// The plugin's answer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ControlAnswer {
    /// The devices changed and their health after.
    pub devices: Vec<Operated>,
    /// What went wrong, when something did.
    pub error: Option<String>,
}

/// Serves the control socket in `state_dir` until `shutdown`. A socket left by another instance (the other
/// pod of a rolling update shares the state directory) is replaced: the newest instance answers. When the
/// socket at the path disappears, or is one that nothing answers on, it is bound again; while another live
/// instance's is there, it is left alone.
pub fn spawn(
    state_dir: &Path,
    queries: MonitorHandle,
    shutdown: CancellationToken,
) -> Result<PathBuf, KubeletError> {
    let path = state_dir.join(SOCKET_NAME);
    let (conn_tx, mut conn_rx) = mpsc::channel::<UnixStream>(16);
    let mut socket = PluginSocket::bind(&path, conn_tx.clone())?;
    let bounds = bounds();
    tracing::info!(
        socket = %path.display(),
        max_connections = bounds.max_connections,
        "control socket for fence and release"
    );
    let watch = match SocketWatch::start(state_dir) {
        Ok(watch) => Some(watch),
        Err(e) => {
            tracing::warn!(dir = %state_dir.display(), error = %e, recheck_s = RECHECK.as_secs(), "cannot watch the state directory: a control socket removed by another instance is bound again only at the next check");
            None
        }
    };
    let gate = Gate::new("control socket", bounds.max_connections);
    let returned = path.clone();
    tokio::spawn(async move {
        let mut recheck = tokio::time::interval_at(tokio::time::Instant::now() + RECHECK, RECHECK);
        recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                stream = conn_rx.recv() => match stream {
                    // Past the cap the oldest connection is closed first; this waits (briefly) for it.
                    Some(stream) => {
                        if let Some(place) = gate.admit().await {
                            tokio::spawn(serve_connection(stream, queries.clone(), bounds, place));
                        }
                    }
                    None => break,
                },
                () = woken(watch.as_ref()) => keep_bound(&mut socket, &conn_tx),
                _ = recheck.tick() => keep_bound(&mut socket, &conn_tx),
            }
        }
        socket.remove();
    });
    Ok(returned)
}

/// Waits for the watch's next wake-up; for ever without a watch.
async fn woken(watch: Option<&SocketWatch>) {
    match watch {
        Some(watch) => watch.wake.notified().await,
        None => std::future::pending().await,
    }
}

/// Keeps the control socket in place by the rule every served socket follows
/// ([`PluginSocket::keep_in_place`]): bound again when it is gone or replaced by anything but another live
/// instance's socket, which is left to that one.
fn keep_bound(socket: &mut PluginSocket, conns: &mpsc::Sender<UnixStream>) {
    use crate::kubelet::socket::{Found, Kept};
    let path = socket.path().to_path_buf();
    match socket.keep_in_place(conns.clone()) {
        Ok(Kept::InPlace) => {}
        Ok(Kept::LeftTo) => {
            tracing::debug!(socket = %path.display(), "another instance answers on the control socket; leaving it to that one");
        }
        Ok(Kept::Rebound(found)) => {
            let why = match found {
                Found::Gone => {
                    "the control socket was removed (the instance that had replaced it is gone)"
                }
                Found::Dead => {
                    "nothing answers on the control socket (left by an instance that is gone)"
                }
                other => other.describe(),
            };
            tracing::info!(socket = %path.display(), "{why}: bound it again");
        }
        Err(e) => {
            tracing::warn!(socket = %path.display(), error = %e, "the control socket is not in place and cannot be bound again: fence and release cannot reach this plugin");
        }
    }
}

/// An inotify watch of the state directory for changes to the control socket's name alone (the checkpoint
/// is written in the same directory, every health change).
struct SocketWatch {
    _watcher: RecommendedWatcher,
    wake: Arc<Notify>,
}

impl SocketWatch {
    fn start(state_dir: &Path) -> notify::Result<Self> {
        let wake = Arc::new(Notify::new());
        let notify = wake.clone();
        let mut watcher = notify::recommended_watcher(move |event: notify::Result<Event>| {
            let relevant = match event {
                Ok(event) => {
                    event.need_rescan()
                        || event
                            .paths
                            .iter()
                            .any(|p| p.file_name() == Some(OsStr::new(SOCKET_NAME)))
                }
                // Queue overflow or a watch error: something may have been missed, so look again.
                Err(_) => true,
            };
            if relevant {
                notify.notify_one();
            }
        })?;
        watcher.watch(state_dir, RecursiveMode::NonRecursive)?;
        Ok(SocketWatch {
            _watcher: watcher,
            wake,
        })
    }
}

async fn serve_connection(
    stream: UnixStream,
    queries: MonitorHandle,
    bounds: Bounds,
    place: bounded::Place,
) {
    let peer = stream
        .peer_cred()
        .map(|c| (c.uid(), c.pid()))
        .unwrap_or((u32::MAX, None));
    let service = move |request: Request<Incoming>| {
        let queries = queries.clone();
        async move { answer(&queries, request, peer).await }
    };
    bounded::serve_connection(stream, service, bounds, place).await;
}

async fn answer(
    queries: &MonitorHandle,
    request: Request<Incoming>,
    peer: (u32, Option<i32>),
) -> Response<Full<Bytes>> {
    let fence = match (request.method(), request.uri().path()) {
        (&Method::POST, "/fence") => true,
        (&Method::POST, "/release") => false,
        _ => return reply(StatusCode::NOT_FOUND, Vec::new(), "POST /fence or /release"),
    };
    let body = match Limited::new(request.into_body(), MAX_REQUEST_BYTES)
        .collect()
        .await
    {
        Ok(body) => body.to_bytes(),
        Err(e) => {
            return reply(
                StatusCode::BAD_REQUEST,
                Vec::new(),
                &format!("cannot read the request: {e}"),
            );
        }
    };
    let asked: ControlRequest = match serde_json::from_slice(&body) {
        Ok(asked) => asked,
        Err(e) => {
            return reply(
                StatusCode::BAD_REQUEST,
                Vec::new(),
                &format!("not a request: {e}"),
            );
        }
    };
    let (device, operator_request) = match operator_request(&asked, fence, peer) {
        Ok(request) => request,
        Err(e) => return reply(StatusCode::BAD_REQUEST, Vec::new(), &e),
    };
    match queries.operate(&device, operator_request).await {
        Ok(devices) => reply(StatusCode::OK, devices, ""),
        Err(e) => {
            let status = match e {
                OperatorError::UnknownDevice { .. } => StatusCode::NOT_FOUND,
                OperatorError::NoSuchCondition { .. } => StatusCode::CONFLICT,
                OperatorError::Stopping => StatusCode::SERVICE_UNAVAILABLE,
            };
            reply(status, Vec::new(), &e.to_string())
        }
    }
}

/// The device and what the monitor is asked, from a request and the peer's `(uid, pid)`; or why the request
/// is refused. Outside text (device, reason, user) is made printable here, at entry: the monitor logs it.
fn operator_request(
    asked: &ControlRequest,
    fence: bool,
    peer: (u32, Option<i32>),
) -> Result<(String, OperatorRequest), String> {
    let text = |t: &str| {
        crate::util::text::cut_bytes(&crate::util::text::printable(t.trim()), MAX_TEXT_BYTES)
    };
    let (uid, pid) = peer;
    let who = match asked.user.as_deref().map(text) {
        Some(user) if !user.is_empty() => format!("{user} (uid {uid})"),
        _ => format!("uid {uid}"),
    };
    let by = match pid {
        Some(pid) => format!("{who} via the control socket, pid {pid}"),
        None => format!("{who} via the control socket"),
    };
    let reason = asked.reason.as_deref().map(text).unwrap_or_default();
    let device = text(&asked.device);
    let request = if fence {
        if reason.is_empty() {
            return Err(format!(
                "a fence needs a reason — run: gpu-device-plugin fence {device} --reason \"<why>\""
            ));
        }
        OperatorRequest::Fence { reason, by }
    } else {
        let which = match asked.condition.as_deref() {
            None => ConditionSelector::fenced(),
            Some(name) => ConditionSelector::parse(name.trim()).map_err(|e| {
                format!(
                    "{e} — see the device's conditions with gpu-device-plugin status, then run: gpu-device-plugin release {device} --condition <one of them>"
                )
            })?,
        };
        OperatorRequest::Release { which, reason, by }
    };
    Ok((device, request))
}

fn reply(status: StatusCode, devices: Vec<Operated>, error: &str) -> Response<Full<Bytes>> {
    let answer = ControlAnswer {
        devices,
        error: (!error.is_empty()).then(|| error.to_string()),
    };
    let body = serde_json::to_vec(&answer).unwrap_or_default();
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

/// Why the command line got no answer.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Nothing listens on the socket.
    #[error(
        "the plugin is not running: nothing answers on {} (is --state-dir the plugin's? run this where the plugin runs: on the node as root, or with kubectl exec in its pod)",
        .0.display()
    )]
    NotRunning(PathBuf),
    /// The socket exists but may not be used.
    #[error("cannot use {}: {cause} (the control socket is the plugin user's only; run as root)", .path.display())]
    Denied {
        /// The socket.
        path: PathBuf,
        /// The OS error.
        cause: std::io::Error,
    },
    /// The exchange failed.
    #[error("no answer on {}: {cause}", .path.display())]
    Http {
        /// The socket.
        path: PathBuf,
        /// What failed.
        cause: String,
    },
    /// The plugin answered with an error.
    #[error("{0}")]
    Refused(String),
}

/// Sends `request` to the plugin whose state directory is `state_dir`, to `/fence` or `/release`.
pub async fn send(
    state_dir: &Path,
    fence: bool,
    request: &ControlRequest,
) -> Result<Vec<Operated>, ControlError> {
    let path = state_dir.join(SOCKET_NAME);
    let exchange = exchange(&path, fence, request);
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .unwrap_or_else(|_| {
            Err(ControlError::Http {
                path: path.clone(),
                cause: "timed out after 10 s".into(),
            })
        })
}

async fn exchange(
    path: &Path,
    fence: bool,
    request: &ControlRequest,
) -> Result<Vec<Operated>, ControlError> {
    let stream = UnixStream::connect(path)
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => {
                ControlError::NotRunning(path.to_owned())
            }
            std::io::ErrorKind::PermissionDenied => ControlError::Denied {
                path: path.to_owned(),
                cause: e,
            },
            _ => ControlError::Http {
                path: path.to_owned(),
                cause: e.to_string(),
            },
        })?;
    let http = |cause: String| ControlError::Http {
        path: path.to_owned(),
        cause,
    };
    let body = serde_json::to_vec(request).map_err(|e| http(e.to_string()))?;
    let uri = if fence { "/fence" } else { "/release" };
    let request = Request::post(uri)
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| http(e.to_string()))?;
    let (status, body) = crate::http::round_trip(stream, request)
        .await
        .map_err(http)?;
    let answer: ControlAnswer = serde_json::from_slice(&body)
        .map_err(|e| http(format!("not an answer ({status}): {e}")))?;
    match answer.error {
        Some(error) => Err(ControlError::Refused(error)),
        None if status.is_success() => Ok(answer.devices),
        None => Err(ControlError::Refused(status.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newline_in_a_reason_or_user_cannot_forge_a_log_line() -> Result<(), String> {
        let asked = ControlRequest {
            device: "GPU-1".into(),
            reason: Some("burn-in\n2026-11-26T00:00:00Z  INFO released by an operator".into()),
            user: Some("eve\r\u{1b}[2K".into()),
            ..Default::default()
        };
        let (device, request) = operator_request(&asked, true, (1000, Some(42)))?;
        assert_eq!(device, "GPU-1");
        let OperatorRequest::Fence { reason, by } = request else {
            return Err(format!("not a fence: {request:?}"));
        };
        assert_eq!(
            reason,
            "burn-in\\n2026-11-26T00:00:00Z  INFO released by an operator"
        );
        assert_eq!(
            by,
            "eve\\r\\u{1b}[2K (uid 1000) via the control socket, pid 42"
        );
        Ok(())
    }

    #[test]
    fn a_reason_made_printable_is_still_cut_to_its_limit() -> Result<(), String> {
        let asked = ControlRequest {
            device: "GPU-1".into(),
            reason: Some("x\n".repeat(MAX_TEXT_BYTES)),
            ..Default::default()
        };
        let (_, request) = operator_request(&asked, false, (0, None))?;
        let OperatorRequest::Release { reason, by, .. } = request else {
            return Err(format!("not a release: {request:?}"));
        };
        assert!(
            reason.len() <= MAX_TEXT_BYTES && reason.starts_with("x\\nx\\n"),
            "{reason}"
        );
        assert_eq!(by, "uid 0 via the control socket");
        Ok(())
    }
}
