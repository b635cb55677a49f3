//! A request whose HTTP/2 `:authority` is a socket path, served anyway.
//!
//! The kubelet's plugin watcher dials a registration socket (`plugins_registry/<driver>-reg.sock`) by its
//! path, with grpc-go and a custom dialer and no authority of its own: grpc-go then sends the path as the
//! `:authority` of `GetInfo` and `NotifyRegistrationStatus`, percent-encoded
//! (`%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2F…`). Go's server takes any authority. Rust's HTTP/2 server
//! (h2, under hyper and tonic) parses it as a URI authority and resets the stream with PROTOCOL_ERROR when it
//! is not one, so a tonic server alone can never be registered. (The kubelet's device manager and its DRA
//! client since 1.34 send `localhost`; its plugin watcher, in every version, does not.)
//!
//! [`relay`] stands between the client and the server: frames from the client are decoded (HPACK and all,
//! by h2's own codec, the one the server uses), the headers of each request rewritten (for a server,
//! [`usable_authority`]), and the frames encoded again for the server; frames from the server pass through
//! as bytes. Only the client's direction is encoded again, so each side keeps one consistent HPACK context:
//! the client's encoder with the relay's decoder, the relay's encoder with the server's decoder, the
//! server's encoder with the client's decoder. DATA padding is not kept (no gRPC client pads).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::{SinkExt, StreamExt};
use h2::frame::{BytesStr, Frame, Headers};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf, ReadHalf, WriteHalf};
use tonic::codegen::http::uri::Authority;

/// The client connection preface (RFC 9113 §3.4), sent before any frame.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The most header bytes one request may carry through the relay, decoded (hyper's server takes as much).
pub const MAX_HEADER_LIST: usize = 16 * 1024;

/// Relays one connection between `client` and `server` until either side closes it, each request's headers
/// from the client passed through `rewrite` on the way. Returns how it ended; either way both are closed
/// when it returns (they are dropped).
pub async fn relay<C, S>(
    client: C,
    server: S,
    rewrite: impl Fn(&mut Headers) + Send,
) -> io::Result<()>
where
    C: AsyncRead + AsyncWrite + Send,
    S: AsyncRead + AsyncWrite + Send,
{
    let (mut client_read, mut client_write) = tokio::io::split(client);
    let (mut server_read, server_write) = tokio::io::split(server);
    let down = async move {
        let copied = tokio::io::copy(&mut server_read, &mut client_write).await;
        let _closed = client_write.shutdown().await;
        copied.map(drop)
    };
    let up = async move {
        let mut server_write = server_write;
        let mut preface = [0u8; PREFACE.len()];
        client_read.read_exact(&mut preface).await?;
        server_write.write_all(&preface).await?;
        if &preface != PREFACE {
            // Not HTTP/2: pass it on as it is and let the server say so.
            tokio::io::copy(&mut client_read, &mut server_write).await?;
            return server_write.shutdown().await;
        }
        let mut from_client: h2::Codec<_, bytes::Bytes> = h2::Codec::new(ReadOnly(client_read));
        from_client.set_max_recv_header_list_size(MAX_HEADER_LIST);
        let mut to_server: h2::Codec<_, bytes::Bytes> = h2::Codec::new(WriteOnly(server_write));
        while let Some(frame) = from_client.next().await {
            let frame = match frame.map_err(|e| io::Error::other(format!("{e:?}")))? {
                // h2 keeps decoding past the bound only to keep its HPACK context; never pass on a part.
                Frame::Headers(headers) if headers.is_over_size() => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("request headers past {MAX_HEADER_LIST} bytes"),
                    ));
                }
                Frame::Headers(headers) => {
                    let mut headers = without_priority(headers);
                    rewrite(&mut headers);
                    Frame::Headers(headers)
                }
                // Advisory only (RFC 9113 deprecates it), and h2 cannot encode it again: left out.
                Frame::Priority(_) => continue,
                other => other,
            };
            to_server.send(frame).await.map_err(io::Error::other)?;
        }
        to_server.get_mut().0.shutdown().await
    };
    // Either direction ending ends the connection, as a closed socket would.
    tokio::select! {
        result = down => result,
        result = up => result,
    }
}

/// How many bytes a relayed connection holds in each direction between the relay and the server.
const RELAY_BUFFER: usize = 64 * 1024;

/// `conn` as a gRPC server gets it through a relay that gives an authority h2 refuses `localhost` in its
/// place ([`usable_authority`]). The relay, a task of the current runtime, holds `conn` until either side
/// closes.
pub fn served_any<C>(conn: C) -> tokio::io::DuplexStream
where
    C: AsyncRead + AsyncWrite + Send + 'static,
{
    let (ours, theirs) = tokio::io::duplex(RELAY_BUFFER);
    tokio::spawn(async move {
        if let Err(e) = relay(conn, ours, usable_authority).await {
            tracing::debug!(error = %e, "a relayed connection ended");
        }
    });
    theirs
}

/// `headers` without the priority a HEADERS frame may carry (RFC 9113 deprecates it): h2 keeps the flag of
/// a decoded frame but not its five bytes, so a frame encoded again with it would be malformed.
fn without_priority(headers: Headers) -> Headers {
    let (stream, end_stream) = (headers.stream_id(), headers.is_end_stream());
    let (pseudo, fields) = headers.into_parts();
    let mut fresh = Headers::new(stream, pseudo, fields);
    if end_stream {
        fresh.set_end_stream();
    }
    fresh
}

/// For a server: `localhost` as the authority when the request's is not a valid URI authority (grpc-go's
/// socket path); anything else (responses, trailers, valid authorities, every other header and flag) as it
/// is.
pub fn usable_authority(headers: &mut Headers) {
    let pseudo = headers.pseudo_mut();
    let usable = pseudo
        .authority
        .as_deref()
        .is_none_or(|a| Authority::try_from(a).is_ok());
    if !usable {
        pseudo.authority = BytesStr::try_from(bytes::Bytes::from_static(b"localhost")).ok();
    }
}

/// For a client that must send what another client sends: `authority` as the authority of every request
/// (trailers, which have none, are left alone). h2 builds authorities only from a URI, which refuses some
/// that real clients send (a percent-encoded socket path); this sets any UTF-8 text.
pub fn set_authority(headers: &mut Headers, authority: &str) {
    let pseudo = headers.pseudo_mut();
    if pseudo.method.is_some() {
        pseudo.authority =
            BytesStr::try_from(bytes::Bytes::copy_from_slice(authority.as_bytes())).ok();
    }
}

/// The read half of a stream as the full-duplex stream h2's codec wants; the relay never writes to it.
struct ReadOnly<T>(ReadHalf<T>);

impl<T: AsyncRead> AsyncRead for ReadOnly<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<T> AsyncWrite for ReadOnly<T> {
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, _: &[u8]) -> Poll<io::Result<usize>> {
        Poll::Ready(Err(io::ErrorKind::Unsupported.into()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// The write half of a stream as the full-duplex stream h2's codec wants; the relay never reads from it.
struct WriteOnly<T>(WriteHalf<T>);

impl<T> AsyncRead for WriteOnly<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        _: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Poll::Pending
    }
}

impl<T: AsyncWrite> AsyncWrite for WriteOnly<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
