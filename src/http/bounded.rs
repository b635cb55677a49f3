//! HTTP/1 connections served within bounds, for the side surfaces: the HTTP port and the control socket.
//!
//! A client that connects and never finishes its request costs a task, a read buffer and a descriptor for
//! as long as it stays. Unbounded, ten thousand such connections took the plugin from 9 to 179 MB (past the
//! DaemonSet's memory limit after three rounds), and eleven hundred took every descriptor of a 1024 soft
//! limit, so that the kubelet's restart and the next checkpoint save failed. So each surface holds at most
//! [`Bounds::max_connections`] at once (one more is accepted and closed at once, and counted), each
//! connection has [`Bounds::header_read`] to send a request's headers (from its start, and again after
//! each response: the keep-alive idle timeout), is served for [`Bounds::lifetime`] at most, and reads into
//! a buffer of at most [`Bounds::max_buf`].
//!
//! Accept-and-close rather than not accepting past the cap: a connection left in the kernel's accept queue
//! hangs its client until the client gives up, and is served later, when its client may be long gone (a
//! probe timed out); closed at once, the client learns at once, and the queue holds no stale work. Either
//! way the descriptors held are the cap, plus the one being closed.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How long a connection past its lifetime may take to finish the response it is writing.
const GRACE: Duration = Duration::from_secs(5);

/// What one surface allows each connection, and how many at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Connections served at once; past it, a new connection is closed as soon as it is accepted.
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

/// The places of one surface: [`Bounds::max_connections`] permits, and a count of the connections closed
/// because none was free.
#[derive(Debug)]
pub struct Gate {
    /// Which surface, for the log.
    what: &'static str,
    max: usize,
    permits: Arc<Semaphore>,
    refused: AtomicU64,
    /// Connections admitted or refused since the heap was last trimmed.
    since_trim: AtomicUsize,
}

impl Gate {
    /// Places for `max` connections of the surface `what` ("HTTP", "control socket").
    pub fn new(what: &'static str, max: usize) -> Arc<Self> {
        Arc::new(Gate {
            what,
            max,
            permits: Arc::new(Semaphore::new(max)),
            refused: AtomicU64::new(0),
            since_trim: AtomicUsize::new(0),
        })
    }

    /// A place for one more connection, held until it is dropped; `None` when every place is taken: the
    /// caller closes the connection at once. Refusals are said at warn level on the 1st, 2nd, 4th, 8th...
    /// so that a flood is seen in the log without filling it.
    pub fn admit(self: &Arc<Self>) -> Option<Place> {
        self.since_trim.fetch_add(1, Ordering::Relaxed);
        if let Ok(permit) = self.permits.clone().try_acquire_owned() {
            return Some(Place {
                permit: Some(permit),
                gate: self.clone(),
            });
        }
        let refused = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        if refused.is_power_of_two() {
            tracing::warn!(
                surface = self.what,
                open = self.max,
                refused_so_far = refused,
                "every connection place is taken (a flood, or clients that never finish): closing new connections at once"
            );
        }
        None
    }

    /// Connections held now.
    pub fn open(&self) -> usize {
        self.max.saturating_sub(self.permits.available_permits())
    }

    /// Connections closed at once so far, because every place was taken.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// After the last connection of a burst (as many as the cap since the last time) closes, the memory
    /// their buffers took is handed back ([`crate::limits::return_freed_memory`]): a flood leaves the
    /// resident size where it was. Probes and scrapes alone come here every few minutes.
    fn closed(&self) {
        if self.open() == 0 && self.since_trim.load(Ordering::Relaxed) >= self.max {
            self.since_trim.store(0, Ordering::Relaxed);
            let started = std::time::Instant::now();
            crate::limits::return_freed_memory();
            tracing::debug!(
                surface = self.what,
                took_us = started.elapsed().as_micros(),
                "connections closed; freed memory handed back"
            );
        }
    }
}

/// A connection's place at its surface, given back when dropped.
#[derive(Debug)]
pub struct Place {
    permit: Option<OwnedSemaphorePermit>,
    gate: Arc<Gate>,
}

impl Drop for Place {
    fn drop(&mut self) {
        drop(self.permit.take());
        self.gate.closed();
    }
}

/// Serves HTTP/1 on `io` with `service`, within `bounds`, until the client closes, a bound closes the
/// connection, or the exchange fails. What went wrong is the client's business: nothing is returned.
pub async fn serve_connection<I, S, F>(io: I, service: S, bounds: &Bounds)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: Fn(Request<Incoming>) -> F,
    F: Future<Output = Response<Full<Bytes>>>,
{
    let service = hyper::service::service_fn(move |request| {
        let answer = service(request);
        async move { Ok::<_, Infallible>(answer.await) }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(bounds.header_read)
        .max_buf_size(bounds.max_buf.max(MIN_BUF))
        .serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    tokio::select! {
        _closed = connection.as_mut() => return,
        () = tokio::time::sleep(bounds.lifetime) => {}
    }
    connection.as_mut().graceful_shutdown();
    let _finished = tokio::time::timeout(GRACE, connection).await;
}

/// hyper refuses (panics on) a smaller buffer.
const MIN_BUF: usize = 8192;

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

    /// Serves `ok` on a local port within `bounds`, as the HTTP surface does; the address and the gate.
    async fn server(bounds: Bounds) -> std::io::Result<(std::net::SocketAddr, Arc<Gate>)> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let gate = Gate::new("test", bounds.max_connections);
        let serving = gate.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let Some(permit) = serving.admit() else {
                    continue;
                };
                tokio::spawn(async move {
                    serve_connection(
                        stream,
                        |_request| async { Response::new(Full::new(Bytes::from_static(b"ok\n"))) },
                        &bounds,
                    )
                    .await;
                    drop(permit);
                });
            }
        });
        Ok((addr, gate))
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
    async fn a_connection_past_the_cap_is_closed_at_once_and_counted()
    -> Result<(), Box<dyn std::error::Error>> {
        let (addr, gate) = server(BOUNDS).await?;
        let mut held = Vec::new();
        for _ in 0..BOUNDS.max_connections {
            let mut stream = TcpStream::connect(addr).await?;
            // A whole request answered: the connection holds its place (keep-alive).
            stream
                .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                .await?;
            let mut answer = [0u8; 16];
            let _read = stream.read(&mut answer).await?;
            assert!(answer.starts_with(b"HTTP/1.1 200"));
            held.push(stream);
        }
        assert_eq!(gate.open(), BOUNDS.max_connections);
        let mut extra = TcpStream::connect(addr).await?;
        let _sent = extra.write_all(b"GET / HTTP/1.1\r\n").await;
        assert!(
            closed_within(&mut extra, Duration::from_secs(2)).await,
            "a connection past the cap must be closed at once, not after the header timeout"
        );
        assert_eq!(gate.refused(), 1);
        // A place freed is a place for the next client.
        drop(held.pop());
        let (status, _) = crate::http::get(&addr.to_string(), "/").await?;
        assert_eq!(status, StatusCode::OK);
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_never_finishes_its_headers_is_closed_after_the_header_timeout()
    -> Result<(), Box<dyn std::error::Error>> {
        let (addr, gate) = server(BOUNDS).await?;
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
        assert_eq!(gate.refused(), 0);
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_keep_alive_connection_is_closed_after_the_header_timeout()
    -> Result<(), Box<dyn std::error::Error>> {
        let (addr, _gate) = server(BOUNDS).await?;
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
        let (addr, _gate) = server(BOUNDS).await?;
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
        let (addr, _gate) = server(BOUNDS).await?;
        let mut big = TcpStream::connect(addr).await?;
        let padding = "a".repeat(BOUNDS.max_buf);
        let request = format!("GET / HTTP/1.1\r\nhost: x\r\nx-pad: {padding}\r\n\r\n");
        let _sent = big.write_all(request.as_bytes()).await;
        let sent = read_to_close(&mut big).await;
        assert!(sent.starts_with(b"HTTP/1.1 431"), "{sent:?}");
        Ok(())
    }
}
