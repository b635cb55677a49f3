//! HTTP/1 connections served within bounds, for the side surfaces: the HTTP port and the control socket;
//! and the gRPC connections of the DRA sockets held to a cap ([`Held`]).
//!
//! A client that connects and never finishes its request costs a task, a read buffer and a descriptor for
//! as long as it stays. Unbounded, ten thousand such connections took the plugin from 9 to 179 MB (past the
//! DaemonSet's memory limit after three rounds), and eleven hundred took every descriptor of a 1024 soft
//! limit, so that the kubelet's restart and the next checkpoint save failed. So each surface holds at most
//! [`Bounds::max_connections`] at once, each connection has [`Bounds::header_read`] to send a request's
//! headers (from its start, and again after each response: the keep-alive idle timeout), is served for
//! [`Bounds::lifetime`] at most, and reads into a buffer of at most [`Bounds::max_buf`].
//!
//! Past the cap, the oldest connection is closed to make room for the new one ([`Gate::admit`]). The
//! kubelet's liveness probe, a scrape and `status` send their request as soon as they connect and are
//! answered within milliseconds, so they are never the oldest; a flood of clients that never finish is.
//! Refusing the new connection instead would let anyone who reaches the port hold every place with a
//! hundred idle connections opened again every few seconds, fail the liveness probe, and have the kubelet
//! restart the plugin (missing the faults meanwhile); not accepting it would hang it in the kernel's queue.
//! The new connection waits until the oldest one is closed, so the descriptors held are the cap plus the
//! one just accepted.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

/// How long a connection past its lifetime may take to finish the response it is writing.
const GRACE: Duration = Duration::from_secs(5);

/// hyper refuses (panics on) a smaller buffer.
const MIN_BUF: usize = 8192;

/// What one surface allows each connection, and how many at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Connections served at once; past it, the oldest is closed to make room for the new one.
    pub max_connections: usize,
    /// How long a client has to send a request's headers, from the connection's start or the end of the
    /// previous response: the bound on a slow or silent client, and the keep-alive idle timeout.
    pub header_read: Duration,
    /// The longest a connection is served; then it is closed after the response in progress, if any
    /// (within a few more seconds), so that a client that keeps sending requests, or reads its answer very
    /// slowly, cannot keep its place for ever.
    pub lifetime: Duration,
    /// The largest read (and write) buffer of a connection, in bytes: request headers larger than this are
    /// refused (431). hyper's minimum is 8 KiB.
    pub max_buf: usize,
}

impl Bounds {
    /// A surface's bounds with at most `max_connections` at once, fewer under a small open-file limit (its
    /// share of the limit now, see [`crate::util::limits::connection_cap`]).
    pub fn under_open_files(
        max_connections: usize,
        header_read: Duration,
        lifetime: Duration,
        max_buf: usize,
    ) -> Bounds {
        Bounds {
            max_connections: crate::util::limits::connection_cap(
                max_connections,
                crate::util::limits::open_files_now(),
            ),
            header_read,
            lifetime,
            max_buf,
        }
    }
}

/// The places of one surface: [`Bounds::max_connections`] permits, the connections holding them oldest
/// first (so that the oldest can be told to make room), and a count of those closed to make room.
#[derive(Debug)]
pub struct Gate {
    /// Which surface, for the log.
    what: &'static str,
    max: usize,
    permits: Arc<Semaphore>,
    /// Each place held, the token that closes its connection and whether its client has sent anything,
    /// oldest first; a place taken out to make room is no longer here, though its permit is held until its
    /// connection is closed.
    held: Mutex<VecDeque<Kept>>,
    next_id: AtomicU64,
    evicted: AtomicU64,
    /// Connections admitted since the heap was last trimmed.
    since_trim: AtomicUsize,
}

impl Gate {
    /// Places for `max` connections of the surface `what` ("HTTP", "control socket").
    pub fn new(what: &'static str, max: usize) -> Arc<Self> {
        Arc::new(Gate {
            what,
            max,
            permits: Arc::new(Semaphore::new(max)),
            held: Mutex::new(VecDeque::with_capacity(max)),
            next_id: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            since_trim: AtomicUsize::new(0),
        })
    }

    /// A place for one more connection, held until it is dropped. When every place is taken, the oldest
    /// connection is told to close ([`Place::closing`]) and this waits until it has: the accept loop that
    /// calls this takes no other connection meanwhile. Evictions are said at warn level on the 1st, 2nd,
    /// 4th, 8th... so that a flood is seen in the log without filling it. `None` only if the gate was shut,
    /// which nothing does.
    pub async fn admit(self: &Arc<Self>) -> Option<Place> {
        self.since_trim.fetch_add(1, Ordering::Relaxed);
        let mut evicted_another = false;
        let permit = match self.permits.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                evicted_another = self.evict_oldest();
                self.permits.clone().acquire_owned().await.ok()?
            }
        };
        Some(self.place(Some(permit), evicted_another))
    }

    /// A place at once, for what holds no descriptor of its own (a stream on a connection already held):
    /// when every place is taken the oldest is told to close, as [`Gate::admit`] does, but this does not wait
    /// for it.
    pub fn admit_now(self: &Arc<Self>) -> Place {
        let evicted_another = self.held() >= self.max && self.evict_oldest();
        let permit = self.permits.clone().try_acquire_owned().ok();
        self.place(permit, evicted_another)
    }

    fn place(
        self: &Arc<Self>,
        permit: Option<OwnedSemaphorePermit>,
        evicted_another: bool,
    ) -> Place {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let close = CancellationToken::new();
        let spoke = Arc::new(std::sync::atomic::AtomicBool::new(false));
        self.places().push_back(Kept {
            id,
            close: close.clone(),
            spoke: spoke.clone(),
        });
        Place {
            id,
            close,
            spoke,
            evicted_another,
            permit,
            gate: self.clone(),
        }
    }

    /// Places held and not told to close.
    pub fn held(&self) -> usize {
        self.places().len()
    }

    /// Tells the oldest connection whose client has sent nothing yet to close, else the oldest; whether
    /// there was one (all may be closing already). A client that speaks (the kubelet on its socket) keeps
    /// its place through a flood of connections that never do.
    fn evict_oldest(&self) -> bool {
        let evicted = {
            let mut places = self.places();
            let silent = places
                .iter()
                .position(|p| !p.spoke.load(Ordering::Relaxed))
                .unwrap_or(0);
            places.remove(silent)
        };
        let Some(Kept { close, .. }) = evicted else {
            return false;
        };
        close.cancel();
        let evicted = self.evicted.fetch_add(1, Ordering::Relaxed) + 1;
        if evicted.is_power_of_two() {
            tracing::warn!(
                surface = self.what,
                open = self.max,
                evicted_so_far = evicted,
                "every place is taken (a flood, or clients that never finish): closing the oldest to make room"
            );
        }
        true
    }

    /// The places held, in order. A panic elsewhere while this was held leaves a list that is still whole
    /// (every change is one push, pop or retain), so a poisoned lock is used all the same.
    fn places(&self) -> MutexGuard<'_, VecDeque<Kept>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Connections held now (those closing to make room included).
    pub fn open(&self) -> usize {
        self.max.saturating_sub(self.permits.available_permits())
    }

    /// Connections closed so far to make room for a newer one.
    pub fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }

    /// After the last connection of a burst (as many as the cap since the last time) closes, the memory
    /// their buffers took is handed back ([`crate::util::limits::return_freed_memory`]): a flood leaves the
    /// resident size where it was. Probes and scrapes alone come here every few minutes.
    fn closed(&self) {
        if self.open() == 0 && self.since_trim.load(Ordering::Relaxed) >= self.max {
            self.since_trim.store(0, Ordering::Relaxed);
            let started = std::time::Instant::now();
            crate::util::limits::return_freed_memory();
            tracing::debug!(
                surface = self.what,
                took_us = started.elapsed().as_micros(),
                "connections closed; freed memory handed back"
            );
        }
    }
}

/// One place as the gate keeps it.
#[derive(Debug)]
struct Kept {
    id: u64,
    close: CancellationToken,
    spoke: Arc<std::sync::atomic::AtomicBool>,
}

/// A connection's place at its surface, given back when dropped.
#[derive(Debug)]
pub struct Place {
    id: u64,
    close: CancellationToken,
    spoke: Arc<std::sync::atomic::AtomicBool>,
    evicted_another: bool,
    permit: Option<OwnedSemaphorePermit>,
    gate: Arc<Gate>,
}

impl Place {
    /// Whether an older connection was closed to make room for this one (for the surface's metrics).
    pub fn evicted_another(&self) -> bool {
        self.evicted_another
    }

    /// Completes when the gate wants this connection closed, to make room for a newer one.
    pub async fn closing(&self) {
        self.close.cancelled().await;
    }

    /// As [`Place::closing`], for a task that does not hold the place.
    pub fn closing_owned(&self) -> tokio_util::sync::WaitForCancellationFutureOwned {
        self.close.clone().cancelled_owned()
    }

    /// Notes that the client has sent something: it is closed to make room only after every silent one.
    pub fn spoke(&self) {
        self.spoke.store(true, Ordering::Relaxed);
    }
}

/// A connection held at a gate, for a server that drives the connection itself (tonic): reading and
/// writing fail once the gate wants the place back, and reading fails when the client has not sent its
/// first `opening` bytes within the first `silent_for` (a client that never speaks, or says one byte and
/// stops, holds a descriptor for no one). The place is given back when the server drops it.
pub struct Held<I> {
    io: I,
    place: Place,
    closing: std::pin::Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
    silent_until: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// Bytes still to come before the client counts as having spoken.
    opening: usize,
    /// Told once when the connection is closed for staying silent.
    on_silent: Option<Closed>,
}

/// What is told when a connection is closed by its bounds (for a counter in `/metrics`).
pub type Closed = Arc<dyn Fn() + Send + Sync>;

/// What every gRPC client sends first: the HTTP/2 connection preface, 24 bytes.
pub const HTTP2_PREFACE: usize = 24;

impl<I> Held<I> {
    /// `io`, holding `place`, with `silent_for` to send its first `opening` bytes.
    pub fn new(io: I, place: Place, silent_for: Duration, opening: usize) -> Self {
        let closing = Box::pin(place.closing_owned());
        Held {
            io,
            place,
            closing,
            silent_until: Some(Box::pin(tokio::time::sleep(silent_for))),
            opening: opening.max(1),
            on_silent: None,
        }
    }

    /// Tells `closed` when the connection is closed for staying silent.
    pub fn on_silent(mut self, closed: Closed) -> Self {
        self.on_silent = Some(closed);
        self
    }

    /// Why the connection is to end now, if it is (registering the wake-ups that say so later).
    fn ended(&mut self, cx: &mut std::task::Context<'_>, reading: bool) -> Option<std::io::Error> {
        use std::future::Future as _;
        if self.closing.as_mut().poll(cx).is_ready() {
            return Some(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "closed to make room for a newer connection",
            ));
        }
        let silent = reading
            && self
                .silent_until
                .as_mut()
                .is_some_and(|t| t.as_mut().poll(cx).is_ready());
        if !silent {
            return None;
        }
        if let Some(closed) = self.on_silent.take() {
            closed();
        }
        Some(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "the client did not send the HTTP/2 preface after connecting",
        ))
    }
}

impl<I: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Held<I> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if let Some(e) = this.ended(cx, true) {
            return std::task::Poll::Ready(Err(e));
        }
        let before = buf.filled().len();
        let read = std::pin::Pin::new(&mut this.io).poll_read(cx, buf);
        if this.silent_until.is_some() && matches!(read, std::task::Poll::Ready(Ok(()))) {
            this.opening = this.opening.saturating_sub(buf.filled().len() - before);
            if this.opening == 0 {
                this.silent_until = None;
                this.place.spoke();
            }
        }
        read
    }
}

impl<I: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Held<I> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        data: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if let Some(e) = this.ended(cx, false) {
            return std::task::Poll::Ready(Err(e));
        }
        std::pin::Pin::new(&mut this.io).poll_write(cx, data)
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl<I: tonic::transport::server::Connected> tonic::transport::server::Connected for Held<I> {
    type ConnectInfo = I::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let id = self.id;
        self.gate.places().retain(|p| p.id != id);
        drop(self.permit.take());
        self.gate.closed();
    }
}

/// Serves HTTP/1 on `io` with `service`, within `bounds`, holding `place`, until the client closes, a bound
/// closes the connection, the gate wants the place back, or the exchange fails. What went wrong is the
/// client's business: nothing is returned.
pub async fn serve_connection<I, S, F>(io: I, service: S, bounds: Bounds, place: Place)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: Fn(Request<Incoming>) -> F,
    F: Future<Output = Response<Full<Bytes>>>,
{
    let service = hyper::service::service_fn(move |request| {
        let answer = service(request);
        async move { Ok::<_, Infallible>(answer.await) }
    });
    // Declared after `place` (a parameter), so dropped before it: the descriptor is closed before the
    // place is given back, and a connection waiting for that place never makes one more open at once.
    // A client may shut its side down once its request is sent and still wait for the answer (a script
    // with `shutdown(SHUT_WR)`, `curl` over a socket): without half-close hyper takes that end of input for
    // the end of the connection, and the answer is never sent though the request was carried out. Such a
    // connection is still held to the header timeout and the lifetime.
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .half_close(true)
        .header_read_timeout(bounds.header_read)
        .max_buf_size(bounds.max_buf.max(MIN_BUF))
        .serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    tokio::select! {
        _closed = connection.as_mut() => return,
        () = place.closing() => return,
        () = tokio::time::sleep(bounds.lifetime) => {}
    }
    connection.as_mut().graceful_shutdown();
    tokio::select! {
        _finished = tokio::time::timeout(GRACE, connection.as_mut()) => {}
        () = place.closing() => {}
    }
}

/// Connections to a socket the kubelet uses (the device plugin's, the DRA sockets) at once, at most (fewer
/// under a small open-file limit): the kubelet holds one or two.
pub const KUBELET_SOCKET_CONNECTIONS: usize = 64;
/// Requests (HTTP/2 streams) open at once on one connection to such a socket: past it the client is refused
/// (a gRPC client waits for a place). The kubelet holds a stream or two and calls one at a time per pod; a
/// client that sends requests and never reads the answers holds them all open, each with its answer.
pub const KUBELET_SOCKET_STREAMS: u32 = 64;

/// The gRPC server for a socket the kubelet uses, with its bounds (at most [`KUBELET_SOCKET_STREAMS`]
/// requests open per connection); its connections come from [`held_connections`].
pub fn kubelet_server() -> tonic::transport::Server {
    tonic::transport::Server::builder().max_concurrent_streams(KUBELET_SOCKET_STREAMS)
}

/// How long a new connection to such a socket may stay silent before it is closed.
pub const KUBELET_SOCKET_SILENT_FOR: Duration = Duration::from_secs(10);

/// The connections of a gRPC server's Unix socket that the kubelet uses, each held at a gate of its own
/// named `what`: at most [`KUBELET_SOCKET_CONNECTIONS`] at once, past it the oldest silent one closed to make
/// room, and one that has not sent the HTTP/2 preface within [`KUBELET_SOCKET_SILENT_FOR`] closed; each one
/// closed either way is told to `closed`. The
/// kubelet sends it as soon as it connects, so its connection keeps its place through a flood of silent
/// ones.
pub fn held_connections(
    conns: tokio::sync::mpsc::Receiver<tokio::net::UnixStream>,
    what: &'static str,
    closed: Closed,
) -> impl futures_util::Stream<Item = std::io::Result<Held<tokio::net::UnixStream>>> {
    use futures_util::StreamExt as _;
    let silent_for = KUBELET_SOCKET_SILENT_FOR;
    let gate = Gate::new(
        what,
        crate::util::limits::connection_cap(
            KUBELET_SOCKET_CONNECTIONS,
            crate::util::limits::open_files_now(),
        ),
    );
    tokio_stream::wrappers::ReceiverStream::new(conns).filter_map(move |stream| {
        let (gate, closed) = (gate.clone(), closed.clone());
        async move {
            let place = gate.admit().await?;
            if place.evicted_another() {
                closed();
            }
            Some(Ok(
                Held::new(stream, place, silent_for, HTTP2_PREFACE).on_silent(closed)
            ))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::StatusCode;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::{TcpListener, TcpStream};

    const BOUNDS: Bounds = Bounds {
        max_connections: 2,
        header_read: Duration::from_secs(5),
        lifetime: Duration::from_secs(30),
        max_buf: 8192,
    };

    /// Serves `ok` on a local port within `bounds`, as the HTTP surface does; the address, the gate, and a
    /// channel that says each connection admitted.
    async fn server(
        bounds: Bounds,
    ) -> std::io::Result<(
        std::net::SocketAddr,
        Arc<Gate>,
        tokio::sync::mpsc::UnboundedReceiver<()>,
    )> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let gate = Gate::new("test", bounds.max_connections);
        let serving = gate.clone();
        let (admitted, admissions) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let Some(place) = serving.admit().await else {
                    continue;
                };
                let _told = admitted.send(());
                tokio::spawn(serve_connection(
                    stream,
                    |_request| async { Response::new(Full::new(Bytes::from_static(b"ok\n"))) },
                    bounds,
                    place,
                ));
            }
        });
        Ok((addr, gate, admissions))
    }

    /// Reads until the server closes the connection (EOF or reset); what it sent.
    async fn read_to_close(stream: &mut TcpStream) -> Vec<u8> {
        let mut all = Vec::new();
        let _closed = stream.read_to_end(&mut all).await;
        all
    }

    /// The same wait in real time, bounded, for tests that must not auto-advance the clock.
    async fn closed_within(stream: &mut TcpStream, limit: Duration) -> bool {
        tokio::time::timeout(limit, read_to_close(stream))
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_connection_past_the_cap_takes_the_place_of_the_oldest_and_is_answered()
    -> Result<(), Box<dyn std::error::Error>> {
        let (addr, gate, mut admissions) = server(BOUNDS).await?;
        // Every place held by a client that has not finished its headers (yet).
        let mut oldest = TcpStream::connect(addr).await?;
        oldest.write_all(b"GET / HTTP/1.1\r\n").await?;
        let mut younger = TcpStream::connect(addr).await?;
        younger.write_all(b"GET / HTTP/1.1\r\n").await?;
        for _ in 0..BOUNDS.max_connections {
            admissions.recv().await.ok_or("the server stopped")?;
        }
        assert_eq!(gate.open(), BOUNDS.max_connections);

        // A probe is answered at once, not after the others' header timeout.
        let addr_text = addr.to_string();
        let probe = crate::http::get(&addr_text, "/");
        let (status, _) = tokio::time::timeout(Duration::from_secs(2), probe).await??;
        assert_eq!(status, StatusCode::OK);
        assert!(
            closed_within(&mut oldest, Duration::from_secs(2)).await,
            "the oldest connection must be closed to make room"
        );
        assert_eq!(gate.evicted(), 1);
        // The younger one kept its place: it finishes its request and is answered.
        younger.write_all(b"host: x\r\n\r\n").await?;
        let mut answer = [0u8; 16];
        let _read = younger.read(&mut answer).await?;
        assert!(answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_never_finishes_its_headers_is_closed_after_the_header_timeout()
    -> Result<(), Box<dyn std::error::Error>> {
        let (addr, gate, _admissions) = server(BOUNDS).await?;
        let mut slow = TcpStream::connect(addr).await?;
        slow.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n").await?;
        let started = tokio::time::Instant::now();
        let sent = read_to_close(&mut slow).await;
        let took = started.elapsed();
        assert!(
            took >= BOUNDS.header_read && took < BOUNDS.header_read * 2,
            "{took:?}"
        );
        assert!(!sent.starts_with(b"HTTP/1.1 200"));
        // A silent client, too (it sent nothing at all).
        let mut silent = TcpStream::connect(addr).await?;
        let _sent = read_to_close(&mut silent).await;
        assert!(started.elapsed() < BOUNDS.header_read * 3);
        tokio::task::yield_now().await;
        assert_eq!(gate.evicted(), 0);
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_keep_alive_connection_is_closed_after_the_header_timeout()
    -> Result<(), Box<dyn std::error::Error>> {
        let (addr, _gate, _admissions) = server(BOUNDS).await?;
        let mut idle = TcpStream::connect(addr).await?;
        idle.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await?;
        let started = tokio::time::Instant::now();
        let sent = read_to_close(&mut idle).await;
        assert!(sent.starts_with(b"HTTP/1.1 200"), "{sent:?}");
        let took = started.elapsed();
        assert!(
            took >= BOUNDS.header_read && took < BOUNDS.header_read * 2,
            "{took:?}"
        );
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_keeps_asking_is_closed_after_the_connection_lifetime()
    -> Result<(), Box<dyn std::error::Error>> {
        let (addr, _gate, _admissions) = server(BOUNDS).await?;
        let mut busy = TcpStream::connect(addr).await?;
        let started = tokio::time::Instant::now();
        let mut answers = 0;
        let mut answer = [0u8; 4096];
        // A request every second, each within the header timeout: only the lifetime ends it.
        loop {
            if busy
                .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .is_err()
            {
                break;
            }
            match busy.read(&mut answer).await {
                Ok(n) if n > 0 => answers += 1,
                _ => break,
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            assert!(started.elapsed() < BOUNDS.lifetime * 2, "never closed");
        }
        let took = started.elapsed();
        assert!(took >= BOUNDS.lifetime, "{took:?} after {answers} answers");
        Ok(())
    }

    #[tokio::test]
    async fn headers_larger_than_the_buffer_are_refused() -> Result<(), Box<dyn std::error::Error>>
    {
        let (addr, _gate, _admissions) = server(BOUNDS).await?;
        let mut big = TcpStream::connect(addr).await?;
        let padding = "a".repeat(BOUNDS.max_buf);
        let request = format!("GET / HTTP/1.1\r\nhost: x\r\nx-pad: {padding}\r\n\r\n");
        let _sent = big.write_all(request.as_bytes()).await;
        let sent = read_to_close(&mut big).await;
        assert!(sent.starts_with(b"HTTP/1.1 431"), "{sent:?}");
        Ok(())
    }
}
