//! Accepting what the kubelet accepts on `kubelet.sock`: a request whose HTTP/2 `:authority` is not a host.
//!
//! A gRPC client that dials a plain socket path (grpc-go with a custom dialer, as most Go device plugins and
//! NVIDIA's do; Python's grpcio with a `unix:` target) sends that path as the `:authority` of its calls.
//! grpc-go's server, and so the kubelet, takes any authority. Rust's HTTP/2 server (h2, under hyper and
//! tonic) parses the authority as a URI authority and resets the stream with PROTOCOL_ERROR when it is not
//! one. So every connection to the fake kubelet goes through [`relay`]: frames from the client are decoded
//! (HPACK and all, by h2's own codec), a request whose authority does not parse gets `localhost` in its
//! place, and the frames are encoded again for the server; frames from the server pass through as bytes.
//!
//! The relay re-encodes only the client's direction, so each side keeps one consistent HPACK context:
//! the client's encoder with the relay's decoder, the relay's encoder with the server's decoder, and the
//! server's encoder with the client's decoder. It does not keep DATA padding (no gRPC client pads).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::{SinkExt, StreamExt};
use h2::frame::{Frame, Headers, Pseudo};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tonic::codegen::http::uri::Authority;
use tonic::codegen::http::{Method, Uri};

/// The client connection preface (RFC 9113 §3.4), sent before any frame.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Relays one connection between a client and the server until either side closes it.
pub async fn relay(client: UnixStream, server: UnixStream) -> io::Result<()> {
    let (mut client_read, mut client_write) = client.into_split();
    let (server_read, mut server_write) = server.into_split();
    let down = async move {
        let mut server_read = server_read;
        let copied = tokio::io::copy(&mut server_read, &mut client_write).await;
        let _closed = client_write.shutdown().await;
        copied.map(drop)
    };
    let up = async move {
        let mut preface = [0u8; PREFACE.len()];
        client_read.read_exact(&mut preface).await?;
        server_write.write_all(&preface).await?;
        if &preface != PREFACE {
            // Not HTTP/2: pass it on as it is and let the server say so.
            tokio::io::copy(&mut client_read, &mut server_write).await?;
            return server_write.shutdown().await;
        }
        let mut from_client: h2::Codec<_, bytes::Bytes> = h2::Codec::new(ReadOnly(client_read));
        let mut to_server: h2::Codec<_, bytes::Bytes> = h2::Codec::new(WriteOnly(server_write));
        while let Some(frame) = from_client.next().await {
            let frame = match frame.map_err(|e| io::Error::other(format!("{e:?}")))? {
                Frame::Headers(headers) => Frame::Headers(with_usable_authority(headers)),
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

/// The headers with `localhost` as the authority when theirs is not a valid URI authority; anything else
/// (responses, trailers, valid authorities, every other header and flag) as it is.
fn with_usable_authority(mut headers: Headers) -> Headers {
    let pseudo = headers.pseudo_mut();
    let usable = pseudo
        .authority
        .as_deref()
        .is_none_or(|a| Authority::try_from(a).is_ok());
    if !usable {
        // h2 builds its header strings only from a URI.
        let localhost = Pseudo::request(Method::POST, Uri::from_static("http://localhost/"), None);
        pseudo.authority = localhost.authority;
    }
    headers
}

/// The read half of a socket as the full-duplex stream h2's codec wants; the relay never writes to it.
struct ReadOnly(OwnedReadHalf);

impl AsyncRead for ReadOnly {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for ReadOnly {
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

/// The write half of a socket as the full-duplex stream h2's codec wants; the relay never reads from it.
struct WriteOnly(OwnedWriteHalf);

impl AsyncRead for WriteOnly {
    fn poll_read(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        _: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Poll::Pending
    }
}

impl AsyncWrite for WriteOnly {
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
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use std::time::Duration;

    /// An HPACK "literal header field without indexing, new name" (RFC 7541 §6.2.2), lengths under 127.
    fn literal(name: &str, value: &str) -> Vec<u8> {
        let mut out = vec![0x00, name.len() as u8];
        out.extend_from_slice(name.as_bytes());
        out.push(value.len() as u8);
        out.extend_from_slice(value.as_bytes());
        out
    }

    /// A frame header and payload (RFC 9113 §4.1).
    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut out = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    fn request(stream: u32, authority: &str) -> Vec<u8> {
        let block: Vec<u8> = [
            literal(":method", "POST"),
            literal(":scheme", "http"),
            literal(":path", "/v1beta1.Registration/Register"),
            literal(":authority", authority),
            literal("content-type", "application/grpc"),
            literal("te", "trailers"),
        ]
        .concat();
        // HEADERS with END_HEADERS.
        frame(0x1, 0x4, stream, &block)
    }

    async fn next_headers(codec: &mut h2::Codec<UnixStream, bytes::Bytes>) -> Headers {
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(10), codec.next())
                .await
                .expect("a frame within 10 s")
                .expect("the relay keeps the connection")
                .expect("a frame h2 can decode");
            if let Frame::Headers(headers) = frame {
                return headers;
            }
        }
    }

    #[tokio::test]
    async fn a_socket_path_authority_reaches_the_server_as_localhost_and_the_rest_is_kept() {
        let (mut client, relay_client) = UnixStream::pair().unwrap();
        let (relay_server, mut server) = UnixStream::pair().unwrap();
        tokio::spawn(relay(relay_client, relay_server));

        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(0x4, 0, 0, &[])); // an empty SETTINGS
        bytes.extend(request(1, "/var/lib/kubelet/device-plugins/kubelet.sock"));
        bytes.extend(request(3, "example.com:8443"));
        client.write_all(&bytes).await.unwrap();

        let mut preface = [0u8; 24];
        server.read_exact(&mut preface).await.unwrap();
        assert_eq!(&preface, PREFACE);
        let mut codec = h2::Codec::new(server);
        let mut first = next_headers(&mut codec).await;
        assert!(first.is_end_headers());
        let fields = first.fields().clone();
        let pseudo = first.pseudo_mut();
        assert_eq!(pseudo.authority.as_deref(), Some("localhost"));
        assert_eq!(
            pseudo.path.as_deref(),
            Some("/v1beta1.Registration/Register")
        );
        assert_eq!(pseudo.method.as_ref().map(|m| m.as_str()), Some("POST"));
        assert_eq!(
            fields.get("content-type").map(|v| v.as_bytes()),
            Some(&b"application/grpc"[..])
        );
        // A valid authority is left as it is.
        let mut second = next_headers(&mut codec).await;
        assert_eq!(
            second.pseudo_mut().authority.as_deref(),
            Some("example.com:8443")
        );
    }
}
