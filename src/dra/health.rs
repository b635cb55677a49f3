//! The DRA health stream (`DRAResourceHealth/NodeWatchResources`, `v1alpha1` and `v1`): how the engine's
//! health and message reach the pod status (`allocatedResourcesStatus`).
//!
//! Every message is the complete list of the devices this driver publishes, sent at once, after every change,
//! and again every [`HealthConfig::heartbeat`] while nothing changes: the kubelet turns a device it has not
//! heard of within `health_check_timeout_seconds` Unknown, and an end of the stream clears everything it
//! knew, so the stream is kept open for as long as the plugin runs.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::Stream;
use futures_util::StreamExt as _;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::api::dra::{health_v1, health_v1alpha1};
use crate::health::message::truncate;
use crate::util::bounded::Gate;

use super::view::{DraDevice, DraView};

/// How often the stream is sent while nothing changes.
pub const HEARTBEAT: Duration = Duration::from_secs(10);
/// Health streams open at once, at most: past it, a new stream ends the oldest.
pub const MAX_STREAMS: usize = 8;
/// The heartbeat while another instance of this driver serves on the node: the kubelet forgets the
/// driver's whole health whenever either instance's stream ends (one of them stopping, or failing over and
/// over), and each list fills it again.
pub const HEARTBEAT_BESIDE_ANOTHER: Duration = Duration::from_secs(1);
/// After another instance has gone, the list is sent at once and again this much later: the kubelet may
/// forget the driver's health when that instance's stream ends or when its reconciler, about a second
/// after the socket went, deregisters it.
pub const RESEND_AGAIN: Duration = Duration::from_secs(2);
/// How long the kubelet is told to trust a report: three heartbeats, so one late one is no gap.
pub const REPORT_TIMEOUT: Duration = Duration::from_secs(30);

/// The health stream's settings.
#[derive(Debug, Clone)]
pub struct HealthConfig {
    /// The pool the devices are published in (the node's name).
    pub pool: String,
    /// The time between messages while nothing changes.
    pub heartbeat: Duration,
    /// `health_check_timeout_seconds` of every device.
    pub timeout: Duration,
}

/// One device's line in a report, before it is put into either version's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceReport {
    /// Pool.
    pub pool: String,
    /// Device name, as published.
    pub device: String,
    /// `HealthStatus` value (the same numbers in both versions).
    pub health: i32,
    /// When this was reported, in Unix seconds.
    pub at: i64,
    /// Seconds the kubelet should trust it.
    pub timeout_seconds: i64,
    /// The engine's message; empty while Healthy.
    pub message: String,
}

/// The complete list, as of `now`.
pub fn report(view: &[DraDevice], config: &HealthConfig, now: SystemTime) -> Vec<DeviceReport> {
    let at = now
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    view.iter()
        .map(|d| DeviceReport {
            pool: config.pool.clone(),
            device: d.name.clone(),
            health: d.health as i32,
            at,
            timeout_seconds: i64::try_from(config.timeout.as_secs()).unwrap_or(i64::MAX),
            message: truncate(&d.message),
        })
        .collect()
}

/// Sleeps until `at`, or for ever if there is none.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Whether two lists tell the kubelet the same, whenever each was made.
fn same_but_the_time(a: &[DeviceReport], b: &[DeviceReport]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(a, b)| {
            (&a.pool, &a.device, a.health, a.timeout_seconds, &a.message)
                == (&b.pool, &b.device, b.health, b.timeout_seconds, &b.message)
        })
}

/// What one stream keeps between its reports.
struct Reports {
    devices: watch::Receiver<DraView>,
    config: Arc<HealthConfig>,
    beat: tokio::time::Interval,
    /// The view's sender is gone: only heartbeats are left.
    source_gone: bool,
    /// The last list sent.
    sent: Option<Vec<DeviceReport>>,
    /// Bumped when another instance of this driver goes ([`HealthService::with_resend`]).
    resend: watch::Receiver<u64>,
    /// Whether anyone still bumps `resend`.
    resend_told: bool,
    /// Whether another instance of the driver serves beside this one ([`HealthService::with_others`]).
    others: watch::Receiver<bool>,
    /// Whether anyone still tells of `others`.
    others_told: bool,
    /// The heartbeat meanwhile.
    quick: tokio::time::Interval,
    /// When the list goes again after such a bump.
    again: Option<tokio::time::Instant>,
}

/// The service, for both versions.
#[derive(Clone)]
pub struct HealthService {
    devices: watch::Receiver<DraView>,
    config: Arc<HealthConfig>,
    shutdown: CancellationToken,
    /// The streams open: past [`MAX_STREAMS`] the oldest is ended.
    open: Arc<Gate>,
    metrics: Arc<crate::metrics::Metrics>,
    resend: watch::Receiver<u64>,
    others: watch::Receiver<bool>,
}

impl HealthService {
    /// Reports the devices of `devices` until `shutdown`.
    pub fn new(
        devices: watch::Receiver<DraView>,
        config: HealthConfig,
        shutdown: CancellationToken,
    ) -> Self {
        HealthService {
            devices,
            config: Arc::new(config),
            shutdown,
            open: Gate::new("DRA health streams", MAX_STREAMS),
            metrics: crate::metrics::Metrics::off(),
            resend: watch::channel(0).1,
            others: watch::channel(false).1,
        }
    }

    /// Sends the list every [`HEARTBEAT_BESIDE_ANOTHER`] while `others` is true (another instance of this
    /// driver serves on the node), and at once and once more [`RESEND_AGAIN`] later when it turns false.
    pub fn with_others(mut self, others: watch::Receiver<bool>) -> Self {
        self.others = others;
        self
    }

    /// Sends the list again, unchanged, whenever `resend` changes, and once more [`RESEND_AGAIN`] later:
    /// for when another instance of this driver on the node has gone (the other pod of a rolling update).
    /// The kubelet forgets a driver's whole health when any of its instances' streams ends, this one's
    /// reports with it, and would otherwise show the pods' devices without health until the next heartbeat.
    pub fn with_resend(mut self, resend: watch::Receiver<u64>) -> Self {
        self.resend = resend;
        self
    }

    /// Counts the streams ended to make room in `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// The reports of one stream: the list at once, after every change the kubelet can see and on every
    /// heartbeat. A change it cannot see (a device's taints, a condition that leaves its health and message
    /// as they are) is not sent: the work would only compete with the next fault. A kubelet slower than the
    /// changes gets the newest list when it reads again, never a queue of old ones. Polled by the stream's
    /// own connection task, no task or channel between the view and the kubelet.
    fn reports(&self) -> impl Stream<Item = Vec<DeviceReport>> + Send + 'static {
        let mut beat = tokio::time::interval(self.config.heartbeat);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let period = HEARTBEAT_BESIDE_ANOTHER.min(self.config.heartbeat);
        let mut quick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        quick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let state = Reports {
            devices: self.devices.clone(),
            config: self.config.clone(),
            beat,
            source_gone: false,
            sent: None,
            resend: self.resend.clone(),
            resend_told: true,
            others: self.others.clone(),
            others_told: true,
            quick,
            again: None,
        };
        futures_util::stream::unfold(state, |mut s| async move {
            loop {
                let again = s.again;
                let changed = tokio::select! {
                    changed = s.devices.changed(), if !s.source_gone => {
                        // Without a source the last list stands: an ended stream would clear it.
                        s.source_gone = changed.is_err();
                        true
                    }
                    _ = s.beat.tick() => false,
                    gone = s.resend.changed(), if s.resend_told => {
                        if gone.is_err() {
                            // No one tells of other instances (any more): the view and the beat are left.
                            s.resend_told = false;
                            continue;
                        }
                        s.again = Some(tokio::time::Instant::now() + RESEND_AGAIN);
                        false
                    }
                    () = sleep_until_some(again) => {
                        s.again = None;
                        false
                    }
                    beside = s.others.changed(), if s.others_told => {
                        if beside.is_err() {
                            // No one tells (any more): the last word stands.
                            s.others_told = false;
                            continue;
                        }
                        if *s.others.borrow_and_update() {
                            s.quick.reset();
                            continue;
                        }
                        // The other instance is gone: the kubelet may have forgotten this one's reports.
                        s.again = Some(tokio::time::Instant::now() + RESEND_AGAIN);
                        false
                    }
                    _ = s.quick.tick(), if *s.others.borrow() => false,
                };
                let list = report(&s.devices.borrow_and_update(), &s.config, SystemTime::now());
                if changed {
                    if s.sent
                        .as_deref()
                        .is_some_and(|sent| same_but_the_time(sent, &list))
                    {
                        continue;
                    }
                    s.beat.reset();
                }
                s.sent = Some(list.clone());
                return Some((list, s));
            }
        })
    }

    /// One stream. The kubelet holds one (two across its restart); past [`MAX_STREAMS`] the oldest is
    /// ended, so that a kubelet opening its stream always gets one, whoever holds the others.
    fn stream<T: Send + 'static>(&self, into: fn(Vec<DeviceReport>) -> T) -> ReportStream<T> {
        let place = self.open.admit_now();
        if place.evicted_another() {
            self.metrics.health_stream_ended();
        }
        // Ends at shutdown or when its place is wanted back: the task behind it returns then; the place is
        // given back when tonic drops the stream.
        let ended = place.closing_owned();
        Box::pin(
            self.reports()
                .take_until(ended)
                .take_until(self.shutdown.clone().cancelled_owned())
                .map(move |list| {
                    let _place = &place;
                    Ok(into(list))
                }),
        )
    }
}

/// A report as API version `$version`'s message (the versions are the same but for the package).
macro_rules! message {
    ($name:ident, $version:ident) => {
        fn $name(list: Vec<DeviceReport>) -> $version::NodeWatchResourcesResponse {
            $version::NodeWatchResourcesResponse {
                devices: list
                    .into_iter()
                    .map(|d| $version::DeviceHealth {
                        device: Some($version::DeviceIdentifier {
                            pool_name: d.pool,
                            device_name: d.device,
                        }),
                        health: d.health,
                        last_updated_time: d.at,
                        health_check_timeout_seconds: d.timeout_seconds,
                        message: d.message,
                    })
                    .collect(),
            }
        }
    };
}

message!(v1_message, health_v1);
message!(v1alpha1_message, health_v1alpha1);

/// A health stream of either version's messages.
type ReportStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;
type V1Stream = ReportStream<health_v1::NodeWatchResourcesResponse>;
type V1alpha1Stream = ReportStream<health_v1alpha1::NodeWatchResourcesResponse>;

#[tonic::async_trait]
impl health_v1::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = V1Stream;

    async fn node_watch_resources(
        &self,
        _request: Request<health_v1::NodeWatchResourcesRequest>,
    ) -> Result<Response<V1Stream>, Status> {
        tracing::debug!("the kubelet opened the DRA health stream (v1)");
        Ok(Response::new(self.stream(v1_message)))
    }
}

#[tonic::async_trait]
impl health_v1alpha1::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = V1alpha1Stream;

    async fn node_watch_resources(
        &self,
        _request: Request<health_v1alpha1::NodeWatchResourcesRequest>,
    ) -> Result<Response<V1alpha1Stream>, Status> {
        tracing::debug!("the kubelet opened the DRA health stream (v1alpha1)");
        Ok(Response::new(self.stream(v1alpha1_message)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{Health, Inventory};
    use crate::dra::view::build;

    fn inventory() -> Inventory {
        crate::dra::fixtures::gpus(2)
    }

    fn view(inv: &Inventory) -> DraView {
        Arc::new(build(inv, None, "gpu.nvidia.com"))
    }

    fn config(heartbeat: Duration) -> HealthConfig {
        HealthConfig {
            pool: "node-a".into(),
            heartbeat,
            timeout: REPORT_TIMEOUT,
        }
    }

    #[test]
    fn a_report_lists_every_device_with_the_engines_message() {
        let mut inv = inventory();
        inv.set_health(
            "GPU-1",
            Health::Unhealthy,
            Some("XID 79: fell off the bus".into()),
        );
        let list = report(
            &view(&inv),
            &config(HEARTBEAT),
            UNIX_EPOCH + Duration::from_secs(7),
        );
        assert_eq!(list.len(), 2);
        assert_eq!(list[0].device, "gpu-0");
        assert_eq!(list[0].health, health_v1::HealthStatus::Healthy as i32);
        assert_eq!(list[0].message, "");
        assert_eq!(list[1].health, health_v1::HealthStatus::Unhealthy as i32);
        assert_eq!(list[1].message, "XID 79: fell off the bus");
        assert_eq!((list[1].at, list[1].timeout_seconds), (7, 30));
        assert_eq!(list[1].pool, "node-a");
    }

    /// A stream's reports as they are.
    fn lists(list: Vec<DeviceReport>) -> Vec<DeviceReport> {
        list
    }

    async fn next(stream: &mut ReportStream<Vec<DeviceReport>>) -> Option<Vec<DeviceReport>> {
        stream
            .next()
            .await
            .map(|r| r.expect("a stream never sends an error"))
    }

    #[tokio::test(start_paused = true)]
    async fn the_stream_sends_the_list_at_once_on_every_change_and_on_each_heartbeat() {
        let (tx, rx) = watch::channel(view(&inventory()));
        let shutdown = CancellationToken::new();
        let service = HealthService::new(rx, config(Duration::from_secs(10)), shutdown.clone());
        let mut reports = service.stream(lists);
        let first = next(&mut reports).await.expect("first list");
        assert!(first.iter().all(|d| d.health == 1));

        let mut inv = inventory();
        inv.set_health("GPU-0", Health::Unhealthy, Some("XID 48".into()));
        tx.send_replace(view(&inv));
        let second = next(&mut reports).await.expect("list after the change");
        assert_eq!(second[0].health, 2);
        assert_eq!(second[0].message, "XID 48");

        // Nothing changes: the same list comes again, one heartbeat later and not before.
        let start = tokio::time::Instant::now();
        let beat = next(&mut reports).await.expect("heartbeat");
        let again: Vec<DeviceReport> = second
            .iter()
            .map(|d| DeviceReport {
                at: beat[0].at,
                ..d.clone()
            })
            .collect();
        assert_eq!(beat, again);
        assert_eq!(start.elapsed(), Duration::from_secs(10));

        shutdown.cancel();
        assert!(
            next(&mut reports).await.is_none(),
            "the stream ends at shutdown"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn when_another_instance_has_gone_the_list_goes_again_at_once_and_once_more_later() {
        let mut inv = inventory();
        inv.set_health("GPU-0", Health::Unhealthy, Some("XID 79".into()));
        let (_tx, rx) = watch::channel(view(&inv));
        let (gone, resend) = watch::channel(0_u64);
        let service = HealthService::new(
            rx,
            config(Duration::from_secs(10)),
            CancellationToken::new(),
        )
        .with_resend(resend);
        let mut reports = service.stream(lists);
        let first = next(&mut reports).await.expect("first list");
        let start = tokio::time::Instant::now();
        // The other pod of a rolling update stops: the kubelet forgets the driver's health.
        gone.send_modify(|n| *n += 1);
        let now = next(&mut reports).await.expect("sent again");
        assert_eq!(start.elapsed(), Duration::ZERO, "at once");
        let later = next(&mut reports).await.expect("and once more");
        assert_eq!(start.elapsed(), RESEND_AGAIN);
        for list in [&now, &later] {
            assert!(same_but_the_time(&first, list), "the same list: {list:?}");
        }
        let beat = next(&mut reports).await.expect("then the heartbeat");
        assert_eq!(start.elapsed(), Duration::from_secs(10));
        assert_eq!((beat[0].health, beat[0].message.as_str()), (2, "XID 79"));
        // Nobody left to tell of others: the stream goes on with its heartbeat.
        drop(gone);
        let beat = next(&mut reports).await.expect("the next heartbeat");
        assert_eq!(start.elapsed(), Duration::from_secs(20));
        assert_eq!(beat[0].health, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn beside_another_instance_the_list_goes_every_second_and_again_when_it_has_gone() {
        let (_tx, rx) = watch::channel(view(&inventory()));
        let (others, others_rx) = watch::channel(false);
        let service = HealthService::new(
            rx,
            config(Duration::from_secs(10)),
            CancellationToken::new(),
        )
        .with_others(others_rx);
        let mut reports = service.stream(lists);
        next(&mut reports).await.expect("first list");
        let start = tokio::time::Instant::now();
        others.send_replace(true);
        for second in 1..=3 {
            next(&mut reports).await.expect("a quick heartbeat");
            assert_eq!(start.elapsed(), Duration::from_secs(second));
        }
        // It goes: the list at once, once more later, then the usual heartbeat (10 s from the first list).
        others.send_replace(false);
        next(&mut reports).await.expect("at once");
        assert_eq!(start.elapsed(), Duration::from_secs(3));
        next(&mut reports).await.expect("once more");
        assert_eq!(start.elapsed(), Duration::from_secs(3) + RESEND_AGAIN);
        next(&mut reports).await.expect("the heartbeat");
        assert_eq!(start.elapsed(), Duration::from_secs(10));
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_the_kubelet_cannot_see_waits_for_the_heartbeat() {
        let mut inv = inventory();
        inv.set_health("GPU-0", Health::Unhealthy, Some("XID 79".into()));
        let (tx, rx) = watch::channel(view(&inv));
        let service = HealthService::new(
            rx,
            config(Duration::from_secs(10)),
            CancellationToken::new(),
        );
        let mut reports = service.stream(lists);
        let first = next(&mut reports).await.expect("first list");
        assert_eq!(first[0].health, 2);

        // The monitor's conditions arrive: the device's taints change, its health and message do not.
        let mut tainted = build(&inv, None, "gpu.nvidia.com");
        tainted[0].taints[0].key = "gpu.nvidia.com/xid".into();
        tainted[0].taints[0].value = Some("79".into());
        tx.send_replace(Arc::new(tainted));
        let start = tokio::time::Instant::now();
        let beat = next(&mut reports).await.expect("heartbeat");
        assert_eq!(
            start.elapsed(),
            Duration::from_secs(10),
            "not sent before the heartbeat"
        );
        assert_eq!((beat[0].health, beat[0].message.as_str()), (2, "XID 79"));

        // A change it can see goes at once.
        inv.set_health("GPU-1", Health::Unhealthy, Some("XID 48".into()));
        tx.send_replace(view(&inv));
        let start = tokio::time::Instant::now();
        let changed = next(&mut reports).await.expect("the change");
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert_eq!(
            (changed[1].health, changed[1].message.as_str()),
            (2, "XID 48")
        );
    }

    #[tokio::test]
    async fn a_stream_past_the_cap_ends_the_oldest_and_a_closed_one_gives_its_place_back() {
        let (_tx, rx) = watch::channel(view(&inventory()));
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let service = HealthService::new(rx, config(HEARTBEAT), CancellationToken::new())
            .with_metrics(metrics.clone());
        let mut open: std::collections::VecDeque<_> = (0..MAX_STREAMS)
            .map(|_| service.stream(v1_message))
            .collect();
        // Each has its first list.
        for stream in &mut open {
            assert!(matches!(stream.next().await, Some(Ok(_))));
        }
        // The kubelet, after someone left eight streams open: its stream is served, the oldest ends.
        let mut kubelet = service.stream(v1_message);
        assert!(matches!(kubelet.next().await, Some(Ok(_))));
        let mut oldest = open.pop_front().expect("eight open");
        assert!(oldest.next().await.is_none(), "the oldest stream ended");
        assert_eq!(service.open.held(), MAX_STREAMS);
        // The others stay open; one closed frees its place, and the next stream ends none.
        drop(open.pop_back());
        assert_eq!(service.open.held(), MAX_STREAMS - 1);
        let _another = service.stream(v1_message);
        let mut second_oldest = open.pop_front().expect("six open");
        let still_open =
            tokio::time::timeout(Duration::from_millis(50), second_oldest.next()).await;
        assert!(still_open.is_err(), "a stream within the cap stays open");
        // The one ended to make room is counted.
        let text = metrics.render([], true, 0);
        assert!(
            text.contains("gpu_device_plugin_dra_health_streams_ended_total 1"),
            "{text}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_gone_source_keeps_the_last_list_on_the_heartbeat() {
        let (tx, rx) = watch::channel(view(&inventory()));
        let service = HealthService::new(
            rx,
            config(Duration::from_secs(10)),
            CancellationToken::new(),
        );
        let mut reports = service.stream(lists);
        assert!(next(&mut reports).await.is_some());
        drop(tx);
        for _ in 0..3 {
            let list = next(&mut reports).await.expect("the stream stays open");
            assert_eq!(list.len(), 2);
        }
    }
}
