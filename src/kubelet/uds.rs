//! gRPC channels over Unix sockets, the only transport the kubelet device plugin API uses.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// Opens a gRPC channel to the Unix socket at `path`. The connection is made before this returns, so a
/// missing or dead socket is reported here, not on the first call.
pub async fn connect(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_owned();
    // The URI is required by the HTTP/2 layer but names nothing: the connector below decides where to go.
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
}
