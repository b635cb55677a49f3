//! gRPC channels over Unix sockets, the only transport the kubelet device plugin API uses.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// How many times a refused connection is tried again at once before it counts as refused. A server makes
/// its socket file at `bind` and accepts connections from its `listen` on; inotify reports the file at the
/// first, so a client woken by it can be refused in between (the kubelet, like any Go server, does the two
/// back to back). Each retry waits only for the async runtime's next turn, so all of them together cover a
/// few hundred microseconds; a server that really is down still fails at once, and the caller's backoff
/// takes over.
const REFUSED_RETRIES: u32 = 20;

/// Opens a gRPC channel to the Unix socket at `path`. The connection is made before this returns, so a
/// missing or dead socket is reported here, not on the first call.
pub async fn connect(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_owned();
    // The URI is required by the HTTP/2 layer but names nothing: the connector below decides where to go.
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { connect_stream(&path).await.map(TokioIo::new) }
        }))
        .await
}

/// Connects to the Unix socket at `path`, a refusal tried again at once a few times (see
/// [`REFUSED_RETRIES`]).
pub async fn connect_stream(path: &Path) -> std::io::Result<UnixStream> {
    let mut refused = 0;
    loop {
        match UnixStream::connect(path).await {
            Err(e) if e.kind() == ErrorKind::ConnectionRefused && refused < REFUSED_RETRIES => {
                refused += 1;
                tokio::task::yield_now().await;
            }
            done => return done,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{
        AddressFamily, Backlog, SockFlag, SockType, UnixAddr, bind, listen, socket,
    };

    #[tokio::test]
    async fn a_socket_that_listens_a_moment_after_its_bind_is_connected_to()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("kubelet.sock");
        // What a server does, in two steps: the file exists from the bind, connections work from the listen.
        let server = socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::empty(),
            None,
        )?;
        bind(
            std::os::fd::AsRawFd::as_raw_fd(&server),
            &UnixAddr::new(&path)?,
        )?;
        let client = tokio::spawn({
            let path = path.clone();
            async move { connect_stream(&path).await }
        });
        // The client tries first, and is refused; then the server listens.
        tokio::task::yield_now().await;
        listen(&server, Backlog::new(8)?)?;
        let connected = client.await?;
        assert!(connected.is_ok(), "{connected:?}");
        Ok(())
    }
}
