//! A Kubernetes device plugin for NVIDIA GPUs.
//!
//! The rooms, lowest first; each uses only the rooms above it in this list (checked by
//! `integration/tests/architecture.rs`). A fault travels down the list: source → monitor (engine) → kubelet.
//!
//! - [`util`]: outside text made printable, threads and runtimes of their own, the open-file limit, bounded
//!   sockets (connection caps and timeouts), Unix-socket gRPC channels.
//! - [`api`]: the kubelet's device plugin and pod-resources APIs, generated from `proto/`.
//! - [`devices`]: the device model: the inventory the kubelet is sent, MIG devices, the IDs the kubelet sees,
//!   which resources list which devices, sharing, and the pure Allocate decisions.
//! - [`health`]: the pure health engine: observations and time in, conditions, health and messages out; its
//!   policy, the XID catalog and the checkpoint's record. No tokio, no file system.
//! - [`sources`]: where devices and health events come from: NVML (one event thread per GPU), simulated GPUs
//!   and their fault script.
//! - [`metrics`]: the Prometheus metrics, recorded through plain methods (a no-op when off).
//! - [`monitor`]: the task around the engine: takes the source's events, publishes the inventory, keeps the
//!   checkpoint file, answers snapshots and operators' fences.
//! - [`kubelet`]: the device plugin server, registration, the socket-directory watch, pod-resources.
//! - [`cluster`]: the Kubernetes API: Events and the node condition.
//! - [`dra`]: serving GPUs through Dynamic Resource Allocation: the kubelet DRA plugin, its registration, the
//!   prepared-claim record and the health stream that carries the engine's message into the pod status.
//! - [`http`]: `/healthz`, `/readyz`, `/status`, `/metrics`, and the status report the `status` command shows.
//! - [`fence`]: operator inputs: the control socket (`fence`, `release`), the fence directory, the Node
//!   annotation.
//! - [`config`]: command line, environment, our config file and NVIDIA's.
//! - [`roads`]: which GPU is served by which road (the device plugin or DRA), each resource's registration,
//!   and a change of roads checked against what is in use.
//! - [`reload`]: a SIGHUP's reload: the change of roads checked against what is in use, the GPUs watched
//!   across the restart in place; the process's signals.
//! - [`commands`]: the binary's commands (`status`, `fence`, `release`, `check-config`) and the ones the
//!   plugin runs itself as on a reload.

pub mod api;
pub mod cluster;
pub mod commands;
pub mod config;
pub mod devices;
pub mod dra;
pub mod fence;
pub mod health;
pub mod http;
pub mod kubelet;
pub mod metrics;
pub mod monitor;
pub mod reload;
pub mod roads;
pub mod sources;
pub mod util;
