//! The kubelet device plugin API v1beta1, generated from `proto/api.proto` at build time.
#![allow(missing_docs, clippy::all, clippy::pedantic)]

tonic::include_proto!("v1beta1");

/// The only API version the kubelet accepts in `RegisterRequest.version`.
pub const VERSION: &str = "v1beta1";

/// File name of the kubelet's registration socket inside the device plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";

/// The kubelet pod-resources API v1 (which pods and containers hold which devices), generated from
/// `proto/podresources.proto`.
pub mod pod_resources {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]

    tonic::include_proto!("v1");

    /// Where the kubelet serves it.
    pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
}
