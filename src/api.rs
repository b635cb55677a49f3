//! The kubelet device plugin API v1beta1, generated from `proto/api.proto` at build time.
#![allow(missing_docs, clippy::all, clippy::pedantic)]

tonic::include_proto!("v1beta1");

/// The only API version the kubelet accepts in `RegisterRequest.version`.
pub const VERSION: &str = "v1beta1";

/// File name of the kubelet's registration socket inside the device plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
