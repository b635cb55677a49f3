//! How the fake kubelet behaves: which kubelet version it is, its timings, its API server, and the services it
//! chooses from what a plugin advertises.

use std::time::Duration;

use super::health::{self, HealthService};
use crate::apiserver::{ApiServerLink, FakeApiServer};

/// Which kubelet to behave as. They differ in the gRPC services they know and in what they take from a
/// health report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum KubeletVersion {
    /// `v1.DRAPlugin`, `v1beta1.DRAPlugin`; health `v1alpha1` behind the alpha gate `ResourceHealthStatus`
    /// (off unless [`DraOptions::resource_health_status`]); no per-device timeout, no message.
    V1_34,
    /// As 1.34, and a report's `health_check_timeout_seconds` counts.
    V1_35,
    /// The gate is on by default, a report's `message` reaches the pod status, and the health stream is
    /// opened even when the plugin does not advertise it (`Unimplemented`, tried again every 5 s).
    #[default]
    V1_36,
    /// Also knows `v1.DRAResourceHealth`, and opens a health stream only when the plugin advertises one.
    V1_37,
}

impl KubeletVersion {
    /// The DRA plugin services this kubelet can call, newest first.
    pub fn plugin_services(self) -> &'static [DraService] {
        &[DraService::V1, DraService::V1beta1]
    }

    /// The health services it can open.
    pub fn health_services(self) -> &'static [HealthService] {
        if self >= KubeletVersion::V1_37 {
            &[HealthService::V1, HealthService::V1alpha1]
        } else {
            &[HealthService::V1alpha1]
        }
    }

    pub(super) fn health_fields(self) -> health::Fields {
        health::Fields {
            timeout: self >= KubeletVersion::V1_35,
            message: self >= KubeletVersion::V1_36,
        }
    }
}

/// The version of the `DRAPlugin` service chosen at registration; prepare and unprepare use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraService {
    /// `k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`, advertised as `v1.DRAPlugin`.
    V1,
    /// `k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin`, advertised as `v1beta1.DRAPlugin`.
    V1beta1,
}

impl DraService {
    /// The name a plugin advertises in `supported_versions`.
    pub fn advertised_name(self) -> &'static str {
        match self {
            DraService::V1 => "v1.DRAPlugin",
            DraService::V1beta1 => "v1beta1.DRAPlugin",
        }
    }
}

/// How the fake kubelet behaves; the defaults are the real kubelet's.
#[derive(Debug, Clone)]
pub struct DraOptions {
    pub(super) version: KubeletVersion,
    pub(super) resource_health_status: Option<bool>,
    pub(super) unadvertised_health: Option<bool>,
    pub(super) first_backoff: Duration,
    pub(super) max_backoff: Duration,
    pub(super) health_retry: Duration,
    pub(super) wipe_delay: Duration,
    pub(super) call_timeout: Duration,
    pub(super) api: Option<(ApiServerLink, String)>,
    pub(super) hold_registrations: bool,
}

impl Default for DraOptions {
    fn default() -> Self {
        DraOptions {
            version: KubeletVersion::default(),
            resource_health_status: None,
            unadvertised_health: None,
            // nestedpendingoperations: 500 ms, doubling, at most 2 min 2 s.
            first_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(122),
            health_retry: Duration::from_secs(5),
            wipe_delay: Duration::from_secs(30),
            call_timeout: Duration::from_secs(45),
            api: None,
            hold_registrations: false,
        }
    }
}

impl DraOptions {
    /// Behave as kubelet `version`.
    pub fn version(mut self, version: KubeletVersion) -> Self {
        self.version = version;
        self
    }

    /// Sets the `ResourceHealthStatus` feature gate (default: on from 1.36). Off, no health stream is opened.
    pub fn resource_health_status(mut self, on: bool) -> Self {
        self.resource_health_status = Some(on);
        self
    }

    /// Whether the health stream is opened (on `v1alpha1`) when the plugin advertises no health service, as
    /// kubelets 1.36 do (default: only for [`KubeletVersion::V1_36`]).
    pub fn watch_unadvertised_health(mut self, open: bool) -> Self {
        self.unadvertised_health = Some(open);
        self
    }

    /// Holds every registration attempt until [`DraKubelet::release_registrations`](super::DraKubelet::release_registrations):
    /// the window a real kubelet leaves between a registration socket appearing and its plugin watcher's
    /// reconciler (once a second) registering it, made as long as a test needs. A driver whose slices go out
    /// in that window has pods bound to it that the kubelet fails with "DRA driver ... is not registered".
    pub fn hold_registrations(mut self) -> Self {
        self.hold_registrations = true;
        self
    }

    /// The first delay before a failed registration is tried again (default 500 ms; it doubles).
    pub fn first_backoff(mut self, delay: Duration) -> Self {
        self.first_backoff = delay;
        self
    }

    /// How long after a health stream ended (or failed to open) it is opened again (default 5 s, of the
    /// fake's clock).
    pub fn health_retry(mut self, delay: Duration) -> Self {
        self.health_retry = delay;
        self
    }

    /// How long after a driver's last connection went its slices are deleted (default 30 s, of the fake's
    /// clock).
    pub fn wipe_delay(mut self, delay: Duration) -> Self {
        self.wipe_delay = delay;
        self
    }

    /// The timeout of each prepare and unprepare call (default 45 s), sent with the call as its deadline
    /// (`grpc-timeout`), as the kubelet's context deadline is.
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// Acts on `api` as the kubelet of node `node` does: deletes the node's ResourceSlices when it starts
    /// and a driver's when the driver is gone, and reads the ResourceClaims of pods whose claims name no
    /// driver.
    pub fn api_server(mut self, api: &FakeApiServer, node: &str) -> Self {
        self.api = Some((api.link(), node.to_string()));
        self
    }

    fn health_gate(&self) -> bool {
        self.resource_health_status
            .unwrap_or(self.version >= KubeletVersion::V1_36)
    }

    fn watches_unadvertised_health(&self) -> bool {
        self.unadvertised_health
            .unwrap_or(self.version == KubeletVersion::V1_36)
    }
}

/// The services the kubelet uses with a plugin, chosen from its `supported_versions`: the first entry that is
/// a DRA plugin service this kubelet knows (health entries never count), and the health service (v1 when
/// both sides know it, else v1alpha1; none when the gate is off, or when nothing is advertised and the
/// kubelet does not open it anyway). `Err` with the kubelet's reason when no plugin service fits.
pub fn choose_services(
    supported: &[String],
    options: &DraOptions,
) -> Result<(DraService, Option<HealthService>), String> {
    if supported.is_empty() {
        return Err("empty list of supported gRPC services (aka supported versions)".into());
    }
    let known = options.version.plugin_services();
    let service = supported
        .iter()
        .find_map(|s| known.iter().find(|k| k.advertised_name() == s))
        .copied()
        .ok_or_else(|| {
            let known: Vec<&str> = known.iter().map(|k| k.advertised_name()).collect();
            format!(
                "none of services supported by the plugin ({supported:?}) are supported by the kubelet \
                 ({known:?})"
            )
        })?;
    if !options.health_gate() {
        return Ok((service, None));
    }
    let advertised = |h: HealthService| supported.iter().any(|s| s == h.advertised_name());
    let health = options
        .version
        .health_services()
        .iter()
        .copied()
        .find(|h| advertised(*h))
        .or_else(|| {
            options
                .watches_unadvertised_health()
                .then_some(HealthService::V1alpha1)
        });
    Ok((service, health))
}
