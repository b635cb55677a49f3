//! The control socket, `<state-dir>/control.sock` (mode 0600, owned by the plugin's user): where
//! `gpu-device-plugin fence` and `release` reach the running plugin. Changing a GPU's health needs root on
//! the node or `kubectl exec` into the plugin's pod; the TCP status port only ever reads.
//!
//! HTTP/1.1 over the Unix socket: `POST /fence` and `POST /release` with a JSON [`ControlRequest`]; the
//! answer is a JSON [`ControlAnswer`] with a status code that says what happened (200 done, 400 a bad
//! request, 404 no such device, 409 no such condition on it, 503 the plugin is stopping). Who asked is taken
//! from the socket's peer credentials and recorded with the fence.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::health::ConditionSelector;
use crate::health::monitor::{Operated, OperatorError, OperatorRequest, StatusQueries};
use crate::kubelet::KubeletError;
use crate::kubelet::socket::PluginSocket;

/// The socket's file name in the state directory.
pub const SOCKET_NAME: &str = "control.sock";

/// The largest request body read.
const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// The longest reason or user name kept.
const MAX_TEXT_BYTES: usize = 512;

/// What the command line asks.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ControlRequest {
    /// A device ID (GPU or MIG UUID), or a GPU's UUID for all its MIG devices.
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
/// pod of a rolling update shares the state directory) is replaced: the newest instance answers.
pub fn spawn(
    state_dir: &Path,
    queries: StatusQueries,
    shutdown: CancellationToken,
) -> Result<PathBuf, KubeletError> {
    let path = state_dir.join(SOCKET_NAME);
    let (conn_tx, mut conn_rx) = mpsc::channel::<UnixStream>(16);
    let socket = PluginSocket::bind(&path, conn_tx)?;
    tracing::info!(socket = %path.display(), "control socket for fence and release");
    tokio::spawn(async move {
        loop {
            let stream = tokio::select! {
                () = shutdown.cancelled() => break,
                stream = conn_rx.recv() => match stream {
                    Some(stream) => stream,
                    None => break,
                },
            };
            let queries = queries.clone();
            tokio::spawn(serve_connection(stream, queries));
        }
        socket.remove();
    });
    Ok(path)
}

async fn serve_connection(stream: UnixStream, queries: StatusQueries) {
    let peer = stream
        .peer_cred()
        .map(|c| (c.uid(), c.pid()))
        .unwrap_or((u32::MAX, None));
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let queries = queries.clone();
        async move { Ok::<_, Infallible>(answer(&queries, request, peer).await) }
    });
    let _closed = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

async fn answer(
    queries: &StatusQueries,
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
    let text = |t: &Option<String>| {
        t.as_deref()
            .map(|t| crate::text::cut_bytes(t.trim(), MAX_TEXT_BYTES))
    };
    let (uid, pid) = peer;
    let who = match text(&asked.user) {
        Some(user) if !user.is_empty() => format!("{user} (uid {uid})"),
        _ => format!("uid {uid}"),
    };
    let by = match pid {
        Some(pid) => format!("{who} via the control socket, pid {pid}"),
        None => format!("{who} via the control socket"),
    };
    let reason = text(&asked.reason).unwrap_or_default();
    let operator_request = if fence {
        if reason.is_empty() {
            return reply(
                StatusCode::BAD_REQUEST,
                Vec::new(),
                "a fence needs a reason (--reason)",
            );
        }
        OperatorRequest::Fence { reason, by }
    } else {
        let which = match asked.condition.as_deref() {
            None => ConditionSelector::fenced(),
            Some(name) => match ConditionSelector::parse(name.trim()) {
                Ok(which) => which,
                Err(e) => return reply(StatusCode::BAD_REQUEST, Vec::new(), &e),
            },
        };
        OperatorRequest::Release { which, reason, by }
    };
    match queries.operate(asked.device.trim(), operator_request).await {
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
