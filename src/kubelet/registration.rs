//! Registering with the kubelet: one `Registration.Register` call on `kubelet.sock`.

use std::path::Path;
use std::time::Duration;

use crate::api::RegisterRequest;
use crate::api::registration_client::RegistrationClient;

use crate::util::uds;

/// Upper bound for one registration attempt. The kubelet dials the plugin back inside `Register` with a 10 s
/// timeout of its own, so a healthy kubelet answers well within this.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(15);

/// Why one registration attempt failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// `kubelet.sock` did not accept a connection.
    #[error("cannot connect to {path}: {cause}")]
    Connect {
        /// The kubelet socket.
        path: String,
        /// The connection error with its causes.
        cause: String,
    },
    /// The kubelet answered with an error: a bad version or resource name, or it could not dial us back.
    #[error("kubelet refused the registration: {code:?}: {message}")]
    Rejected {
        /// gRPC code.
        code: tonic::Code,
        /// The kubelet's message.
        message: String,
    },
    /// No answer within [`ATTEMPT_TIMEOUT`].
    #[error("kubelet did not answer within {0:?}")]
    Timeout(Duration),
}

/// Calls `Register` once.
pub async fn register(
    kubelet_socket: &Path,
    request: RegisterRequest,
) -> Result<(), RegisterError> {
    let attempt = async {
        let channel = uds::connect(kubelet_socket)
            .await
            .map_err(|e| RegisterError::Connect {
                path: kubelet_socket.display().to_string(),
                cause: error_chain(&e),
            })?;
        RegistrationClient::new(channel)
            .register(request)
            .await
            .map_err(|s| RegisterError::Rejected {
                code: s.code(),
                message: s.message().to_string(),
            })?;
        Ok(())
    };
    tokio::time::timeout(ATTEMPT_TIMEOUT, attempt)
        .await
        .unwrap_or(Err(RegisterError::Timeout(ATTEMPT_TIMEOUT)))
}

/// An error and all its sources on one line: transport errors say only "transport error" at the top, the
/// useful part ("No such file or directory") is underneath.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
