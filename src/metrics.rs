//! Prometheus metrics, served on `/metrics`. The rest of the code records what happens through [`Metrics`]'s
//! methods and never sees Prometheus types; per-device state (health, conditions) and the kubelet link are
//! read from the status report when a scrape comes, so they are always what `/status` says.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::health::Observation;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    resource: String,
    device: String,
    index: String,
}

/// One active condition of one device: the device's labels, the condition's kind and value (the XID, the
/// recovery action; empty where it has none) and its effect under the policy in force.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConditionLabels {
    resource: String,
    device: String,
    index: String,
    kind: String,
    value: String,
    effect: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DriverLabels {
    driver: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SocketLabels {
    socket: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HealthLabels {
    to: String,
}

/// The highest XID counted under its own value in `xid_events`; any other value is counted as `other`. NVIDIA's
/// catalog ends well below it; a driver raising arbitrary values then costs one series, not one per value.
pub const MAX_XID_LABEL: u64 = 255;

/// The `xid` label of an XID event.
fn xid_label(xid: u64) -> String {
    if xid <= MAX_XID_LABEL {
        xid.to_string()
    } else {
        "other".to_string()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct XidLabels {
    xid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    method: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ApiLabels {
    request: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
}

/// Every metric the plugin exports, prefixed `gpu_device_plugin_`; or none, when metrics are off
/// ([`Metrics::off`]): then every method does nothing, so that whoever records needs no `Option`.
#[derive(Debug)]
pub struct Metrics(Option<Recorders>);

/// The registry and what is recorded into it.
#[derive(Debug)]
struct Recorders {
    registry: Registry,
    device_healthy: Family<DeviceLabels, Gauge>,
    devices_with_condition: Family<KindLabels, Gauge>,
    device_condition: Family<ConditionLabels, Gauge>,
    kubelet_registered: Gauge,
    dra_registered: Family<DriverLabels, Gauge>,
    streams: Gauge,
    unmonitored: Gauge,
    transitions: Family<HealthLabels, Counter>,
    xid_events: Family<XidLabels, Counter>,
    events: Family<KindLabels, Counter>,
    registrations: Counter,
    kubelet_restarts: Counter,
    calls: Family<CallLabels, Counter>,
    published: Histogram,
    claims_list_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    claims_list_pages: Gauge,
    api_requests: Family<ApiLabels, Counter>,
    events_dropped: Counter,
    http_open: Gauge,
    http_evicted: Counter,
    socket_evicted: Family<SocketLabels, Counter>,
    health_streams_ended: Counter,
}

/// One device's state for the per-device gauges.
#[derive(Debug, Clone)]
pub struct DeviceGauge<'a> {
    /// The extended resource it is served under.
    pub resource: &'a str,
    /// Its ID.
    pub device: &'a str,
    /// NVML's index.
    pub index: usize,
    /// Whether it is Healthy.
    pub healthy: bool,
    /// Its active conditions.
    pub conditions: Vec<ConditionGauge<'a>>,
}

/// One active condition of a device, for the per-device condition gauge.
#[derive(Debug, Clone, Copy)]
pub struct ConditionGauge<'a> {
    /// Its kind (`xid`, `fenced`, ...).
    pub kind: &'a str,
    /// Its value where it has one (the XID, the recovery action).
    pub value: Option<u64>,
    /// Whether it makes the device Unhealthy under the policy in force.
    pub unhealthy: bool,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Metrics that record nothing, for a plugin or test that serves no `/metrics`.
    pub fn off() -> std::sync::Arc<Self> {
        std::sync::Arc::new(Metrics(None))
    }
}

impl Metrics {
    /// All metrics registered, every counter at zero.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("gpu_device_plugin");
        let device_healthy = Family::<DeviceLabels, Gauge>::default();
        registry.register(
            "device_healthy",
            "1 while the device is Healthy (allocatable), 0 while Unhealthy",
            device_healthy.clone(),
        );
        let devices_with_condition = Family::<KindLabels, Gauge>::default();
        registry.register(
            "devices_with_condition",
            "Devices with an active condition of this kind (xid, ecc-dbe, gpu-lost, ...)",
            devices_with_condition.clone(),
        );
        // Which device is Unhealthy, and why: an alert names the GPU and the engine's reason, a dashboard
        // shows faults per GPU (`devices_with_condition` counts per node only).
        let device_condition = Family::<ConditionLabels, Gauge>::default();
        registry.register(
            "device_condition",
            "1 for each active condition of a device: its kind, value (the XID, the recovery action) and effect (Unhealthy or None) under the policy in force",
            device_condition.clone(),
        );
        let kubelet_registered = Gauge::default();
        registry.register(
            "kubelet_registered",
            "1 while the kubelet has accepted our registration and not closed our stream since",
            kubelet_registered.clone(),
        );
        // `kubelet_registered` speaks for the device plugin's resources only (with every GPU through DRA it
        // has none, and says 1): the DRA registration has a gauge of its own, present only when DRA serves.
        let dra_registered = Family::<DriverLabels, Gauge>::default();
        registry.register(
            "dra_registered",
            "1 while the kubelet has accepted the DRA driver's registration, by driver; absent when no GPU is served through DRA",
            dra_registered.clone(),
        );
        // Always present, 0 when every device is watched: an alert on it needs no `absent()`, unlike the
        // per-kind count of conditions, which has no series while no device has the condition.
        let unmonitored = Gauge::default();
        registry.register(
            "unmonitored_devices",
            "Devices served whose faults are not watched (NVML unavailable, or their event registration or \
             waits failing): they stay allocatable, and /status says why",
            unmonitored.clone(),
        );
        let streams = Gauge::default();
        registry.register(
            "list_and_watch_streams",
            "ListAndWatch streams open now",
            streams.clone(),
        );
        let transitions = Family::<HealthLabels, Counter>::default();
        registry.register(
            "health_transitions",
            "Device health changes, by the health changed to",
            transitions.clone(),
        );
        let xid_events = Family::<XidLabels, Counter>::default();
        registry.register(
            "xid_events",
            "XID events received, by XID (values over 255 as xid=\"other\")",
            xid_events.clone(),
        );
        let events = Family::<KindLabels, Counter>::default();
        registry.register(
            "health_events",
            "Health events received, by kind (xid, ecc-sbe, ecc-dbe, gpu-lost)",
            events.clone(),
        );
        let registrations = Counter::default();
        registry.register(
            "kubelet_registrations",
            "Registrations the kubelet accepted",
            registrations.clone(),
        );
        let kubelet_restarts = Counter::default();
        registry.register(
            "kubelet_restarts",
            "New kubelet.sock files seen (kubelet restarts) after the first registration",
            kubelet_restarts.clone(),
        );
        let calls = Family::<CallLabels, Counter>::default();
        registry.register(
            "kubelet_calls",
            "Allocate and PreStartContainer calls, and DRA claims prepared and unprepared (PrepareClaim, UnprepareClaim), by method and gRPC code",
            calls.clone(),
        );
        // 50 µs to about 1.6 s.
        let published = Histogram::new(exponential_buckets(0.000_05, 2.0, 16));
        registry.register(
            "event_to_published_seconds",
            "Time from a health event to the device list that reflects it being published to the streams",
            published.clone(),
        );
        let claims_list_seconds = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "dra_claims_list_seconds",
            "How long the last list of the cluster's ResourceClaims took (DRA: what holds this node's devices)",
            claims_list_seconds.clone(),
        );
        let claims_list_pages = Gauge::default();
        registry.register(
            "dra_claims_list_pages",
            "Pages the last list of the cluster's ResourceClaims read",
            claims_list_pages.clone(),
        );
        let api_requests = Family::<ApiLabels, Counter>::default();
        registry.register(
            "kubernetes_api_writes",
            "Kubernetes Events recorded, node condition writes and ResourceSlice writes, by request and result (ok, or error after retries for Events, each failed try for the condition and the slices)",
            api_requests.clone(),
        );
        let events_dropped = Counter::default();
        registry.register(
            "kubernetes_events_dropped",
            "Kubernetes Events not sent because they were over the Event budget",
            events_dropped.clone(),
        );
        let http_open = Gauge::default();
        registry.register(
            "http_connections_open",
            "HTTP connections being served now (this scrape's included)",
            http_open.clone(),
        );
        let http_evicted = Counter::default();
        registry.register(
            "http_connections_evicted",
            "HTTP connections closed to make room for a new one because every place was taken (the oldest first)",
            http_evicted.clone(),
        );
        let socket_evicted = Family::<SocketLabels, Counter>::default();
        registry.register(
            "socket_connections_evicted",
            "Connections to a socket the kubelet uses closed to make room for a new one (the oldest that had not sent the HTTP/2 preface first) or closed for not sending it within 10 s, by socket",
            socket_evicted.clone(),
        );
        let health_streams_ended = Counter::default();
        registry.register(
            "dra_health_streams_ended",
            "DRA health streams ended to make room for a new one past the cap of 8 (the oldest first)",
            health_streams_ended.clone(),
        );
        // Restarts of the plugin, for the dashboard: every counter starts again from zero and a restarted
        // plugin's first registration brings `kubelet_registrations` back to where a plugin that registered once
        // left it, so only a time set at start tells two processes apart (`changes()` over it counts restarts).
        let start_time = Gauge::<i64>::default();
        start_time.set(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX)),
        );
        registry.register(
            "start_time_seconds",
            "When this plugin process started, in seconds since the Unix epoch",
            start_time,
        );
        let build = Info::new(BuildLabels {
            version: env!("CARGO_PKG_VERSION").into(),
        });
        registry.register("build", "The plugin's version", build);
        Metrics(Some(Recorders {
            registry,
            device_healthy,
            devices_with_condition,
            device_condition,
            kubelet_registered,
            dra_registered,
            streams,
            unmonitored,
            transitions,
            xid_events,
            events,
            registrations,
            kubelet_restarts,
            calls,
            published,
            claims_list_seconds,
            claims_list_pages,
            api_requests,
            events_dropped,
            http_open,
            http_evicted,
            socket_evicted,
            health_streams_ended,
        }))
    }

    /// A health event came in.
    pub fn observed(&self, observation: &Observation) {
        let Some(m) = &self.0 else {
            return;
        };
        let kind = match observation {
            Observation::Xid(xid) => {
                m.xid_events
                    .get_or_create(&XidLabels {
                        xid: xid_label(*xid),
                    })
                    .inc();
                "xid"
            }
            Observation::DoubleBitEcc => "ecc-dbe",
            Observation::SingleBitEcc => "ecc-sbe",
            Observation::GpuLost => "gpu-lost",
            _ => return,
        };
        m.events
            .get_or_create(&KindLabels { kind: kind.into() })
            .inc();
    }

    /// A device's health changed to `to` (`Healthy` or `Unhealthy`).
    pub fn transition(&self, to: &str) {
        let Some(m) = &self.0 else {
            return;
        };
        m.transitions
            .get_or_create(&HealthLabels { to: to.into() })
            .inc();
    }

    /// A list of the cluster's ResourceClaims took `took` and `pages` pages.
    pub fn claims_listed(&self, took: Duration, pages: usize) {
        let Some(m) = &self.0 else {
            return;
        };
        m.claims_list_seconds.set(took.as_secs_f64());
        m.claims_list_pages
            .set(i64::try_from(pages).unwrap_or(i64::MAX));
    }

    /// A change was published to the streams `took` after its event.
    pub fn published(&self, took: Duration) {
        let Some(m) = &self.0 else {
            return;
        };
        m.published.observe(took.as_secs_f64());
    }

    /// The kubelet accepted a registration; `new_kubelet` when it came from a kubelet.sock other than the
    /// previous registration's.
    pub fn registered(&self, new_kubelet: bool) {
        let Some(m) = &self.0 else {
            return;
        };
        m.registrations.inc();
        if new_kubelet {
            m.kubelet_restarts.inc();
        }
    }

    /// An Allocate or PreStartContainer call, or a DRA claim prepared or unprepared (`PrepareClaim`,
    /// `UnprepareClaim`), ended with `code`.
    pub fn call(&self, method: &str, code: tonic::Code) {
        let Some(m) = &self.0 else {
            return;
        };
        m.calls
            .get_or_create(&CallLabels {
                method: method.into(),
                code: format!("{code:?}"),
            })
            .inc();
    }

    /// A write to the Kubernetes API (`event`, `node_condition` or `resource_slice`) ended.
    pub fn api_call(&self, request: &str, ok: bool) {
        let Some(m) = &self.0 else {
            return;
        };
        m.api_requests
            .get_or_create(&ApiLabels {
                request: request.into(),
                result: if ok { "ok" } else { "error" }.into(),
            })
            .inc();
    }

    /// A Kubernetes Event was dropped, over the budget.
    pub fn event_dropped(&self) {
        let Some(m) = &self.0 else {
            return;
        };
        m.events_dropped.inc();
    }

    /// Kubernetes Events dropped so far.
    pub fn events_dropped(&self) -> u64 {
        let Some(m) = &self.0 else {
            return 0;
        };
        m.events_dropped.get()
    }

    /// The oldest HTTP connection was closed to make room for a new one: every place was taken.
    pub fn http_connection_evicted(&self) {
        let Some(m) = &self.0 else {
            return;
        };
        m.http_evicted.inc();
    }

    /// A connection to the kubelet socket `socket` was closed by its bounds: to make room, or silent too long.
    pub fn socket_connection_evicted(&self, socket: &str) {
        let Some(m) = &self.0 else {
            return;
        };
        m.socket_evicted
            .get_or_create(&SocketLabels {
                socket: socket.into(),
            })
            .inc();
    }

    /// A DRA health stream was ended to make room for a new one.
    pub fn health_stream_ended(&self) {
        let Some(m) = &self.0 else {
            return;
        };
        m.health_streams_ended.inc();
    }

    /// Whether the kubelet has accepted the DRA driver `driver` (set when a scrape comes; `None` when no GPU
    /// is served through DRA, and the gauge is left out).
    pub fn dra_registered(&self, driver: Option<(&str, bool)>) {
        let Some(m) = &self.0 else {
            return;
        };
        m.dra_registered.clear();
        if let Some((driver, registered)) = driver {
            m.dra_registered
                .get_or_create(&DriverLabels {
                    driver: driver.into(),
                })
                .set(i64::from(registered));
        }
    }

    /// `open` HTTP connections are being served (set when a scrape comes).
    pub fn http_connections_open(&self, open: usize) {
        let Some(m) = &self.0 else {
            return;
        };
        m.http_open.set(i64::try_from(open).unwrap_or(i64::MAX));
    }

    /// The metrics in the OpenMetrics text format, with per-device state from `devices` and the kubelet's
    /// link: `registered` when every resource the process serves is, `streams_open` for all of them together.
    pub fn render<'a>(
        &self,
        devices: impl IntoIterator<Item = DeviceGauge<'a>>,
        registered: bool,
        streams_open: usize,
    ) -> String {
        let Some(m) = &self.0 else {
            return String::new();
        };
        m.device_healthy.clear();
        m.devices_with_condition.clear();
        m.device_condition.clear();
        let mut unmonitored = 0_i64;
        for d in devices {
            let labels = DeviceLabels {
                resource: d.resource.to_string(),
                device: d.device.to_string(),
                index: d.index.to_string(),
            };
            m.device_healthy
                .get_or_create(&labels)
                .set(i64::from(d.healthy));
            for c in &d.conditions {
                m.device_condition
                    .get_or_create(&ConditionLabels {
                        resource: labels.resource.clone(),
                        device: labels.device.clone(),
                        index: labels.index.clone(),
                        kind: c.kind.into(),
                        value: c.value.map(|v| v.to_string()).unwrap_or_default(),
                        effect: if c.unhealthy { "Unhealthy" } else { "None" }.into(),
                    })
                    .set(1);
            }
            let kinds: std::collections::BTreeSet<&str> =
                d.conditions.iter().map(|c| c.kind).collect();
            if kinds.contains(crate::health::ConditionKind::Unmonitored.name()) {
                unmonitored = unmonitored.saturating_add(1);
            }
            for kind in kinds {
                m.devices_with_condition
                    .get_or_create(&KindLabels { kind: kind.into() })
                    .inc();
            }
        }
        m.unmonitored.set(unmonitored);
        m.kubelet_registered.set(i64::from(registered));
        m.streams
            .set(i64::try_from(streams_open).unwrap_or(i64::MAX));
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &m.registry) {
            tracing::warn!(error = %e, "cannot encode the metrics");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_condition_of_each_device_is_a_series_and_dra_registration_shows_only_with_dra() {
        let metrics = Metrics::new();
        let device = |index: usize, conditions| DeviceGauge {
            resource: "nvidia.com/gpu",
            device: if index == 0 { "GPU-a" } else { "GPU-b" },
            index,
            healthy: index == 0,
            conditions,
        };
        let xid = |xid: u64, unhealthy| ConditionGauge {
            kind: "xid",
            value: Some(xid),
            unhealthy,
        };
        let fenced = ConditionGauge {
            kind: "fenced",
            value: None,
            unhealthy: true,
        };
        let text = metrics.render(
            [
                device(0, vec![xid(43, false)]),
                device(1, vec![xid(79, true), fenced]),
            ],
            true,
            1,
        );
        for line in [
            r#"gpu_device_plugin_device_condition{resource="nvidia.com/gpu",device="GPU-a",index="0",kind="xid",value="43",effect="None"} 1"#,
            r#"gpu_device_plugin_device_condition{resource="nvidia.com/gpu",device="GPU-b",index="1",kind="xid",value="79",effect="Unhealthy"} 1"#,
            r#"gpu_device_plugin_device_condition{resource="nvidia.com/gpu",device="GPU-b",index="1",kind="fenced",value="",effect="Unhealthy"} 1"#,
            r#"gpu_device_plugin_devices_with_condition{kind="xid"} 2"#,
        ] {
            assert!(text.contains(line), "missing {line}\n{text}");
        }
        assert!(
            !text.contains("gpu_device_plugin_dra_registered{"),
            "{text}"
        );
        assert!(
            text.contains("gpu_device_plugin_start_time_seconds "),
            "{text}"
        );

        // The next scrape: GPU-b released and recovered, DRA refused.
        metrics.dra_registered(Some(("gpu.nvidia.com", false)));
        let text = metrics.render([device(0, Vec::new()), device(1, Vec::new())], true, 1);
        assert!(
            !text.contains("gpu_device_plugin_device_condition{"),
            "a cleared condition leaves no series behind: {text}"
        );
        assert!(
            text.contains(r#"gpu_device_plugin_dra_registered{driver="gpu.nvidia.com"} 0"#),
            "{text}"
        );
    }
}
