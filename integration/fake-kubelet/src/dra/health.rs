//! The kubelet's DRA health cache (`healthInfoCache` in pkg/kubelet/cm/dra): what each driver's
//! `NodeWatchResources` stream last said of each device, stamped with the kubelet's own receive time, read
//! back as Unknown once older than the device's timeout. Pure: the caller passes the time.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpu_device_plugin::api::dra::{health_v1, health_v1alpha1};
use tonic::Status;
use tonic::transport::Channel;

/// How long a device's health holds without a new report when the plugin gives no timeout of its own.
pub const DEFAULT_HEALTH_TIMEOUT: Duration = Duration::from_secs(30);

/// Messages longer than this are cut (to 1021 bytes and `...`) before they reach the pod status.
pub const MAX_MESSAGE_LENGTH: usize = 1024;

/// A device's health as the kubelet puts it in a pod's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// The driver reported it healthy, recently enough.
    Healthy,
    /// The driver reported it unhealthy, recently enough.
    Unhealthy,
    /// No report, a stale one, or the driver said it does not know.
    Unknown,
}

impl Health {
    /// The pod status's spelling: `Healthy`, `Unhealthy`, `Unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Healthy => "Healthy",
            Health::Unhealthy => "Unhealthy",
            Health::Unknown => "Unknown",
        }
    }

    /// From the wire's `HealthStatus` (`UNKNOWN = 0; HEALTHY = 1; UNHEALTHY = 2`); anything else is Unknown,
    /// as the kubelet's switch has it.
    fn from_wire(value: i32) -> Self {
        match value {
            1 => Health::Healthy,
            2 => Health::Unhealthy,
            _ => Health::Unknown,
        }
    }
}

/// What the kubelet reads for one device now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHealth {
    /// Its health.
    pub health: Health,
    /// The driver's message (empty when none, when stale, or when this kubelet predates messages).
    pub message: String,
}

/// Which parts of a report a kubelet version takes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fields {
    /// `health_check_timeout_seconds` (kubelets 1.35 and later).
    pub(crate) timeout: bool,
    /// `message` (kubelets 1.36 and later).
    pub(crate) message: bool,
}

/// One device of a report, whichever version of the API it came on.
#[derive(Debug, Clone)]
pub(crate) struct Report {
    pool: String,
    device: String,
    health: Health,
    timeout_seconds: i64,
    message: String,
}

#[derive(Debug, Clone)]
struct Entry {
    health: Health,
    message: String,
    received: Instant,
    /// When the first report of the run that says `health` was received: a repeat (a heartbeat, a new
    /// message) keeps it, a change of health or a report after the entry went stale moves it. What a
    /// benchmark times a change by, whatever reports came after it.
    since: Instant,
    timeout: Duration,
}

impl Entry {
    /// Whether it still holds at `now` (not older than its timeout).
    fn fresh(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.received) <= self.timeout
    }
}

/// Health by driver, then by (pool, device).
#[derive(Debug, Clone, Default)]
pub(crate) struct HealthCache {
    drivers: BTreeMap<String, BTreeMap<(String, String), Entry>>,
}

impl HealthCache {
    /// Takes in a report from `driver` received at `now`. Devices absent from it keep their entry (and go
    /// stale by themselves).
    pub(crate) fn update(
        &mut self,
        driver: &str,
        reports: Vec<Report>,
        now: Instant,
        fields: Fields,
    ) {
        let devices = self.drivers.entry(driver.to_string()).or_default();
        for report in reports {
            let timeout = match u64::try_from(report.timeout_seconds) {
                Ok(seconds) if seconds > 0 && fields.timeout => Duration::from_secs(seconds),
                _ => DEFAULT_HEALTH_TIMEOUT,
            };
            let message = if fields.message {
                cut_message(report.message)
            } else {
                String::new()
            };
            let key = (report.pool, report.device);
            let since = devices
                .get(&key)
                .filter(|e| e.health == report.health && e.fresh(now))
                .map_or(now, |e| e.since);
            devices.insert(
                key,
                Entry {
                    health: report.health,
                    message,
                    received: now,
                    since,
                    timeout,
                },
            );
        }
    }

    /// Forgets everything `driver` said, as the kubelet does when its stream ends.
    pub(crate) fn clear(&mut self, driver: &str) {
        self.drivers.remove(driver);
    }

    /// The entry of `driver`'s device `pool/device` unless it is stale at `now`.
    fn entry(&self, driver: &str, pool: &str, device: &str, now: Instant) -> Option<&Entry> {
        self.drivers
            .get(driver)
            .and_then(|devices| devices.get(&(pool.to_string(), device.to_string())))
            .filter(|e| e.fresh(now))
    }

    /// The health of `driver`'s device `pool/device` as read at `now`: Unknown without an entry or once the
    /// entry is older than its timeout.
    pub(crate) fn get(&self, driver: &str, pool: &str, device: &str, now: Instant) -> DeviceHealth {
        match self.entry(driver, pool, device, now) {
            Some(e) => DeviceHealth {
                health: e.health,
                message: e.message.clone(),
            },
            None => DeviceHealth {
                health: Health::Unknown,
                message: String::new(),
            },
        }
    }

    /// When the kubelet first received the health that `driver`'s device `pool/device` has at `now` (see
    /// `Entry::since`); `None` while that is Unknown for want of a fresh report.
    pub(crate) fn since(
        &self,
        driver: &str,
        pool: &str,
        device: &str,
        now: Instant,
    ) -> Option<Instant> {
        self.entry(driver, pool, device, now).map(|e| e.since)
    }

    /// The first time after `now` at which an entry turns stale, if any will.
    pub(crate) fn next_expiry(&self, now: Instant) -> Option<Instant> {
        self.drivers
            .values()
            .flat_map(|devices| devices.values())
            // A timeout beyond what an Instant can hold never expires.
            .filter_map(|e| e.received.checked_add(e.timeout))
            .filter(|expiry| *expiry >= now)
            .min()
    }

    /// Number of devices `driver` has entries for.
    #[cfg(test)]
    pub(crate) fn devices_of(&self, driver: &str) -> usize {
        self.drivers.get(driver).map_or(0, BTreeMap::len)
    }
}

/// A message over [`MAX_MESSAGE_LENGTH`] bytes cut to 1021 and `...` (at a character boundary).
pub(crate) fn cut_message(message: String) -> String {
    if message.len() <= MAX_MESSAGE_LENGTH {
        return message;
    }
    let mut end = MAX_MESSAGE_LENGTH - 3;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &message[..end])
}

/// The version of `DRAResourceHealth` a stream is opened on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthService {
    /// `v1alpha1.DRAResourceHealth` (kubelets 1.34 and later).
    V1alpha1,
    /// `v1.DRAResourceHealth` (kubelets 1.37 and later).
    V1,
}

impl HealthService {
    /// The name a plugin advertises in `supported_versions`.
    pub fn advertised_name(self) -> &'static str {
        match self {
            HealthService::V1alpha1 => "v1alpha1.DRAResourceHealth",
            HealthService::V1 => "v1.DRAResourceHealth",
        }
    }
}

/// An open `NodeWatchResources` stream.
pub(crate) enum HealthStream {
    V1alpha1(tonic::Streaming<health_v1alpha1::NodeWatchResourcesResponse>),
    V1(tonic::Streaming<health_v1::NodeWatchResourcesResponse>),
}

impl HealthStream {
    /// Opens the stream on `channel`.
    pub(crate) async fn open(channel: Channel, service: HealthService) -> Result<Self, Status> {
        Ok(match service {
            HealthService::V1alpha1 => {
                let mut client =
                    health_v1alpha1::dra_resource_health_client::DraResourceHealthClient::new(
                        channel,
                    );
                let request = health_v1alpha1::NodeWatchResourcesRequest {};
                HealthStream::V1alpha1(client.node_watch_resources(request).await?.into_inner())
            }
            HealthService::V1 => {
                let mut client =
                    health_v1::dra_resource_health_client::DraResourceHealthClient::new(channel);
                let request = health_v1::NodeWatchResourcesRequest {};
                HealthStream::V1(client.node_watch_resources(request).await?.into_inner())
            }
        })
    }

    /// The next report; `None` at the end of the stream.
    pub(crate) async fn next(&mut self) -> Result<Option<Vec<Report>>, Status> {
        // The two versions' messages differ only in their package.
        macro_rules! reports {
            ($message:expr) => {
                $message.map(|m| {
                    m.devices
                        .into_iter()
                        .map(|d| {
                            let id = d.device.unwrap_or_default();
                            Report {
                                pool: id.pool_name,
                                device: id.device_name,
                                health: Health::from_wire(d.health),
                                timeout_seconds: d.health_check_timeout_seconds,
                                message: d.message,
                            }
                        })
                        .collect()
                })
            };
        }
        Ok(match self {
            HealthStream::V1alpha1(stream) => reports!(stream.message().await?),
            HealthStream::V1(stream) => reports!(stream.message().await?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: Fields = Fields {
        timeout: true,
        message: true,
    };

    fn report(device: &str, health: Health, timeout_seconds: i64, message: &str) -> Report {
        Report {
            pool: "node-a".into(),
            device: device.into(),
            health,
            timeout_seconds,
            message: message.into(),
        }
    }

    #[test]
    fn a_device_turns_unknown_once_its_report_is_older_than_its_timeout() {
        let mut cache = HealthCache::default();
        let t0 = Instant::now();
        cache.update(
            "gpu.example.com",
            vec![
                report("gpu-0", Health::Unhealthy, 0, "XID 79"),
                report("gpu-1", Health::Healthy, 5, ""),
            ],
            t0,
            ALL,
        );
        let at = |secs| t0 + Duration::from_secs(secs);
        let read = |device, now| cache.get("gpu.example.com", "node-a", device, now);
        assert_eq!(
            read("gpu-0", at(30)),
            DeviceHealth {
                health: Health::Unhealthy,
                message: "XID 79".into()
            }
        );
        assert_eq!(read("gpu-0", at(31)).health, Health::Unknown);
        assert_eq!(
            read("gpu-0", at(31)).message,
            "",
            "a stale message is not shown"
        );
        assert_eq!(read("gpu-1", at(5)).health, Health::Healthy);
        assert_eq!(read("gpu-1", at(6)).health, Health::Unknown);
        assert_eq!(cache.next_expiry(at(1)), Some(at(5)));
    }

    #[test]
    fn a_device_keeps_the_time_its_health_was_first_reported_until_the_health_changes() {
        let mut cache = HealthCache::default();
        let t0 = Instant::now();
        let at = |secs| t0 + Duration::from_secs(secs);
        let since = |cache: &HealthCache, now| cache.since("d", "node-a", "gpu-0", now);
        cache.update(
            "d",
            vec![report("gpu-0", Health::Healthy, 0, "")],
            at(0),
            ALL,
        );
        cache.update(
            "d",
            vec![report("gpu-0", Health::Healthy, 0, "")],
            at(10),
            ALL,
        );
        assert_eq!(since(&cache, at(10)), Some(at(0)), "a heartbeat keeps it");
        cache.update(
            "d",
            vec![report("gpu-0", Health::Unhealthy, 0, "XID 79")],
            at(12),
            ALL,
        );
        cache.update(
            "d",
            vec![report("gpu-0", Health::Unhealthy, 0, "XID 79, then 48")],
            at(13),
            ALL,
        );
        assert_eq!(
            since(&cache, at(13)),
            Some(at(12)),
            "a new message keeps it"
        );
        assert_eq!(
            since(&cache, at(44)),
            None,
            "stale: Unknown for want of a report"
        );
        cache.update(
            "d",
            vec![report("gpu-0", Health::Unhealthy, 0, "XID 79")],
            at(50),
            ALL,
        );
        assert_eq!(
            since(&cache, at(50)),
            Some(at(50)),
            "a report after a gap starts a new run"
        );
    }

    #[test]
    fn a_device_missing_from_a_report_keeps_its_entry_until_stale() {
        let mut cache = HealthCache::default();
        let t0 = Instant::now();
        cache.update(
            "d",
            vec![report("gpu-0", Health::Unhealthy, 0, "")],
            t0,
            ALL,
        );
        cache.update(
            "d",
            vec![report("gpu-1", Health::Healthy, 0, "")],
            t0 + Duration::from_secs(20),
            ALL,
        );
        assert_eq!(
            cache
                .get("d", "node-a", "gpu-0", t0 + Duration::from_secs(25))
                .health,
            Health::Unhealthy
        );
        assert_eq!(
            cache
                .get("d", "node-a", "gpu-0", t0 + Duration::from_secs(35))
                .health,
            Health::Unknown
        );
    }

    #[test]
    fn older_kubelets_ignore_the_fields_they_predate() {
        let mut cache = HealthCache::default();
        let t0 = Instant::now();
        let kubelet_1_34 = Fields {
            timeout: false,
            message: false,
        };
        cache.update(
            "d",
            vec![report("gpu-0", Health::Unhealthy, 300, "XID 79")],
            t0,
            kubelet_1_34,
        );
        let read = cache.get("d", "node-a", "gpu-0", t0 + Duration::from_secs(31));
        assert_eq!(read.health, Health::Unknown, "the 30 s default applies");
        let read = cache.get("d", "node-a", "gpu-0", t0);
        assert_eq!(read.message, "");
    }

    #[test]
    fn a_long_message_is_cut_to_1024_bytes_with_an_ellipsis() {
        assert_eq!(cut_message("x".repeat(1024)), "x".repeat(1024));
        let cut = cut_message("x".repeat(1025));
        assert_eq!(cut.len(), 1024);
        assert!(cut.ends_with("x..."));
        // Never inside a character.
        let cut = cut_message(format!("{}é{}", "x".repeat(1020), "y".repeat(10)));
        assert!(cut.len() <= 1024 && cut.ends_with("..."), "{cut}");
    }

    #[test]
    fn a_timeout_too_large_for_the_clock_never_expires() {
        let mut cache = HealthCache::default();
        let t0 = Instant::now();
        cache.update(
            "d",
            vec![report("gpu-0", Health::Healthy, i64::MAX, "")],
            t0,
            ALL,
        );
        assert_eq!(cache.next_expiry(t0), None);
        let later = t0 + Duration::from_secs(365 * 24 * 3600);
        assert_eq!(
            cache.get("d", "node-a", "gpu-0", later).health,
            Health::Healthy
        );
    }

    #[test]
    fn clearing_a_driver_leaves_the_others() {
        let mut cache = HealthCache::default();
        let t0 = Instant::now();
        cache.update("a", vec![report("gpu-0", Health::Healthy, 0, "")], t0, ALL);
        cache.update("b", vec![report("gpu-0", Health::Healthy, 0, "")], t0, ALL);
        cache.clear("a");
        assert_eq!(
            cache.get("a", "node-a", "gpu-0", t0).health,
            Health::Unknown
        );
        assert_eq!(
            cache.get("b", "node-a", "gpu-0", t0).health,
            Health::Healthy
        );
        assert_eq!(cache.devices_of("a"), 0);
    }
}
