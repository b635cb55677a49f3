//! A Kubernetes device plugin for NVIDIA GPUs.
//!
//! - [`kubelet`]: the kubelet protocol: gRPC server, registration, the socket-directory watch.
//! - [`devices`]: the device model, the [`devices::DeviceSource`] trait and simulated GPUs.
//! - [`nvml`]: the NVML GPU backend: discovery and the health event threads (one per GPU).
//! - [`health`]: the health engine (pure: observations and time in, conditions, health and messages out),
//!   its policy, checkpoint, and the monitor task around it.
//! - [`allocation`]: pure Allocate / GetPreferredAllocation decisions.
//! - [`cluster`]: the Kubernetes API side: Events and the node condition.
//! - [`config`]: command line, environment and config file.
//! - [`status`]: what the agent says about itself (devices, conditions, the kubelet link), as `/status`
//!   serves it and the `status` command shows it.
//! - [`http`]: the HTTP surfaces: `/healthz`, `/readyz`, `/status`, `/metrics`.
//! - [`metrics`]: the Prometheus metrics, recorded through plain methods.
//! - [`runtime`]: a thread and runtime of their own, for work kept off the kubelet's path.
//! - [`limits`]: the open-file limit, raised at start and shared between the fault path and the side surfaces.
//! - [`pods`]: which pods hold which devices, from the kubelet's pod-resources API.
//! - [`api`]: the kubelet's device plugin and pod-resources APIs, generated from `proto/`.
//! - [`control`]: the control socket, where `fence` and `release` reach the running plugin.
//! - [`fence_dir`], [`fence_annotation`]: fences from detectors' report files and from the Node annotation.
//! - [`naming`]: the IDs the kubelet sees (UUIDs or indices, replicas).
//! - [`resources`]: which resources the process registers and which devices each lists.
//! - [`text`]: outside text cut to a limit and made printable.

pub mod api;
pub mod cluster;
pub mod config;
pub mod devices;
pub mod fence;
pub mod health;
pub mod http;
pub mod kubelet;
pub mod metrics;
pub mod monitor;
pub mod sources;
pub mod util;
