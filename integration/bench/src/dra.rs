//! DRA (issue 26): this workspace's plugin serving every GPU through DRA (`--dra all`), registered with the
//! fake kubelet's DRA side, which is linked to the fake API server as a kubelet is to its API server.
//!
//! - **fault → health stream**: XID 79 on a GPU → the kubelet taking in the health stream's report that says
//!   that device is Unhealthy. Time-stamped where the report is received: on the fake kubelet's own thread,
//!   as it takes the report into its health cache ([`DraKubelet::wait_device_health_since`]), so the bench's
//!   wake-up is not in the sample. The stream is the one the kubelet opens (`v1alpha1`, a 1.36 kubelet).
//! - **fault → slice taint**: the same fault → the API server receiving the ResourceSlice write whose device
//!   carries the `NoSchedule` taint `gpu.nvidia.com/xid=79`. Time-stamped at the request's arrival at the
//!   fake API server (its recorded `at`, taken before the body is read and the slice stored); the fault
//!   counts as seen once the server holds that slice.
//! - **prepare**: `NodePrepareResources` for a fresh allocated claim (read from the API server, recorded in
//!   the state directory's file before the answer), again for the same claim (answered from the
//!   record), and `NodeUnprepareResources`, each a round trip on a v1 client of the bench's own on the DRA
//!   socket, as the Allocate measure times its calls.
//!
//! Beside them, the device plugin's fault → kubelet, with one instance of each mode in turn, so that both see
//! the same machine. Each GPU faults once per instance (a plugin need not recover), as in `fault_latency`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use fake_kubelet::apiserver::{AllocationResult, FakeApiServer, Recorded};
use fake_kubelet::dra::{DraKubelet, DraOptions, Health};
use gpu_device_plugin::api::dra::v1;
use serde_json::Value;

use crate::Counts;
use crate::fault::{faults_on_one_instance, faults_on_one_instance_with};
use crate::process::ProcSample;
use crate::report::{Report, Stats};
use crate::rig::{Plugin, Rig, WAIT, uuid};

/// The driver name the plugin publishes under by default (NVIDIA's DRA driver's).
const DRIVER: &str = "gpu.nvidia.com";
/// The node, and so the pool.
const NODE: &str = "bench-node";
/// Where the claims live.
const NAMESPACE: &str = "bench";
/// The taint a fatal XID puts on its device.
const TAINT_KEY: &str = "gpu.nvidia.com/xid";
/// A fault not seen on a road within this is counted as missed, not waited for.
const LIMIT: Duration = Duration::from_secs(5);

/// The DRA side of the rig: the API server, the kubelet's DRA side, and the plugin's flags pointing at them.
struct DraRig {
    api: FakeApiServer,
    kubelet: DraKubelet,
    args: Vec<String>,
    /// The flags that give a device plugin instance the same API server (Events, the node condition), as
    /// the DRA instances have it.
    api_args: Vec<String>,
    /// `<plugins dir>/<driver>/dra.sock`, where the plugin serves the DRA API.
    endpoint: PathBuf,
}

/// A DRA instance ready for faults: registered, its slices written clean, every GPU reported Healthy.
struct Ready {
    plugin: Plugin,
    /// Published device name by GPU UUID, as the slice says.
    names: BTreeMap<String, String>,
}

/// What one road saw of the faults.
#[derive(Default)]
struct Road {
    samples: Vec<Duration>,
    missed: usize,
    /// Set once a whole instance's faults were missed and none was ever seen: later faults are counted as
    /// missed without waiting.
    dead: bool,
}

impl Road {
    fn take(&mut self, sample: Option<Duration>) {
        match sample {
            Some(took) => self.samples.push(took),
            None => self.missed += 1,
        }
    }

    /// After an instance whose faults this road saw `seen` of `tried`.
    fn instance_done(&mut self, seen: usize, tried: usize) {
        self.dead |= tried > 0 && seen == 0 && self.samples.is_empty();
    }
}

/// The DRA measure: faults (both roads, and the device plugin's), then prepares.
pub(crate) async fn dra(
    rig: &Rig,
    devices: usize,
    counts: &Counts,
    report: &mut Report,
) -> anyhow::Result<()> {
    let api = FakeApiServer::start().await?;
    api.add_node(NODE);
    let kubeconfig = rig.work_dir().join("dra-kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let root = rig.work_dir().join("dra-kubelet");
    let kubelet = DraKubelet::start_with(&root, DraOptions::default().api_server(&api, NODE))
        .context("cannot start the fake kubelet's DRA side")?;
    let path = |p: PathBuf| p.to_string_lossy().into_owned();
    let api_args: Vec<String> = vec![
        "--kubeconfig".into(),
        path(kubeconfig),
        "--node-name".into(),
        NODE.into(),
    ];
    let mut args: Vec<String> = vec!["--dra".into(), "all".into()];
    args.extend(api_args.iter().cloned());
    args.extend([
        "--kubelet-registrar-directory-path".into(),
        path(root.join("plugins_registry")),
        "--kubelet-plugins-directory-path".into(),
        path(root.join("plugins")),
    ]);
    let dra = DraRig {
        endpoint: root.join("plugins").join(DRIVER).join("dra.sock"),
        api,
        kubelet,
        args,
        api_args,
    };
    faults(
        rig,
        &dra,
        devices,
        (counts.faults, counts.abuse_idle),
        report,
    )
    .await?;
    prepares(rig, &dra, devices, counts.dra_prepares, report).await
}

impl DraRig {
    /// Starts a DRA instance on `devices` GPUs and waits until it is ready for faults.
    async fn start(&self, rig: &Rig, devices: usize) -> anyhow::Result<Ready> {
        // The previous instance's connection gone first: the end of its health stream clears what the
        // kubelet knew of the driver, which must not land after this instance's first report.
        self.kubelet
            .wait_connected(DRIVER, false, WAIT)
            .await
            .context("the previous DRA instance is still connected")?;
        let plugin = rig.spawn_with(devices, None, &self.args, &[])?;
        match self.ready(devices).await {
            Ok(names) => Ok(Ready { plugin, names }),
            Err(e) => {
                let log = plugin.log();
                plugin.stop().await;
                Err(e.context(format!(
                    "DRA instance not ready; kubelet: registrations {:?}, health streams {:?}; slices: {}; \
                     plugin log:\n{log}",
                    self.kubelet.registrations(),
                    self.kubelet.health_streams(),
                    Value::Array(self.api.slices()),
                )))
            }
        }
    }

    /// Registered with its connection up, the slices holding all `devices` GPUs without a taint (written by
    /// this instance: the previous one's carry its faults' taints), and the health stream reporting each
    /// Healthy. Returns the names the slice gives the GPUs.
    async fn ready(&self, devices: usize) -> anyhow::Result<BTreeMap<String, String>> {
        self.kubelet.wait_connected(DRIVER, true, WAIT).await?;
        let slices = self
            .api
            .wait_for_slices("every GPU published without a taint", WAIT, |s| {
                clean_names(s).is_some_and(|n| n.len() == devices)
            })
            .await
            .map_err(anyhow::Error::msg)?;
        let names = clean_names(&slices).unwrap_or_default();
        for name in names.values() {
            self.kubelet
                .wait_device_health((DRIVER, NODE, name), WAIT, |h| h.health == Health::Healthy)
                .await?;
        }
        Ok(names)
    }
}

/// Published device name by UUID, from this node's slices of the driver, if no device carries a taint.
fn clean_names(slices: &[Value]) -> Option<BTreeMap<String, String>> {
    let mut names = BTreeMap::new();
    for device in ours(slices).flat_map(devices_of) {
        if device["taints"].as_array().is_some_and(|t| !t.is_empty()) {
            return None;
        }
        let (Some(uuid), Some(name)) = (
            device["attributes"]["uuid"]["string"].as_str(),
            device["name"].as_str(),
        ) else {
            continue;
        };
        names.insert(uuid.to_string(), name.to_string());
    }
    Some(names)
}

/// The slices of this node and driver.
fn ours(slices: &[Value]) -> impl Iterator<Item = &Value> {
    slices
        .iter()
        .filter(|s| s["spec"]["nodeName"] == NODE && s["spec"]["driver"] == DRIVER)
}

fn devices_of(slice: &Value) -> impl Iterator<Item = &Value> {
    slice["spec"]["devices"].as_array().into_iter().flatten()
}

/// Whether `slice` (stored, or a request's body) gives `device` the fatal XID's taint.
fn carries_taint(slice: &Value, device: &str) -> bool {
    slice["spec"]["nodeName"] == NODE
        && slice["spec"]["driver"] == DRIVER
        && devices_of(slice).any(|d| {
            d["name"] == device
                && d["taints"].as_array().is_some_and(|taints| {
                    taints.iter().any(|t| {
                        t["key"] == TAINT_KEY && t["value"] == "79" && t["effect"] == "NoSchedule"
                    })
                })
        })
}

/// A ResourceSlice created or replaced.
fn is_slice_write(r: &Recorded) -> bool {
    (r.method == "PUT" || r.method == "POST")
        && r.path
            .starts_with("/apis/resource.k8s.io/v1/resourceslices")
        && (200..300).contains(&r.status)
}

/// Fault → health stream and fault → slice taint on DRA instances, and fault → kubelet on device plugin
/// instances, one instance of each in turn.
async fn faults(
    rig: &Rig,
    dra: &DraRig,
    devices: usize,
    (count, idle_for): (usize, Duration),
    report: &mut Report,
) -> anyhow::Result<()> {
    let (mut health, mut taint) = (Road::default(), Road::default());
    let mut own = Road::default();
    let mut idle = None;
    let mut device_plugin = Vec::new();
    let mut device_plugin_missed = 0;
    // The device plugin with the same API access as the DRA instances (Events and the node condition on
    // every fault, written beside the fault path).
    let mut with_api = Vec::new();
    let mut with_api_missed = 0;
    let mut said = (false, false);
    while health.samples.len() + health.missed < count
        || device_plugin.len() + device_plugin_missed < count
        || with_api.len() + with_api_missed < count
    {
        let want = devices.min(count - health.samples.len() - health.missed);
        if want > 0 {
            let ready = dra.start(rig, devices).await?;
            // The first instance, published, registered and streaming, left alone for a while.
            if idle.is_none() {
                let pid = ready.plugin.pid();
                let before = ProcSample::read(pid)?;
                tokio::time::sleep(idle_for).await;
                idle = Some((before, ProcSample::read(pid)?));
            }
            let (health_before, taint_before) = (health.samples.len(), taint.samples.len());
            let own_before = own.samples.len();
            let own_stream = OwnStream::open(&dra.endpoint).await?;
            for i in 0..want {
                let id = uuid(i);
                let Some(name) = ready.names.get(&id) else {
                    anyhow::bail!("GPU {id} is not in the slice: {:?}", ready.names);
                };
                let (on_stream, in_slice, on_own) =
                    dra_fault(rig, dra, &id, name, (&health, &taint), &own_stream).await?;
                own.take(on_own);
                if on_stream.is_none() && !health.dead && !said.0 {
                    said.0 = true;
                    eprintln!(
                        "bench: dra: XID 79 on {id} ({name}) not on the health stream within {LIMIT:?}; the \
                         kubelet reads {:?}; plugin log:\n{}",
                        dra.kubelet.device_health(DRIVER, NODE, name),
                        ready.plugin.log()
                    );
                }
                if in_slice.is_none() && !taint.dead && !said.1 {
                    said.1 = true;
                    eprintln!(
                        "bench: dra: XID 79 on {id} ({name}): no slice write with its taint within {LIMIT:?}, or \
                         the server does not hold it; slices: {}; plugin log:\n{}",
                        Value::Array(dra.api.slices()),
                        ready.plugin.log()
                    );
                }
                health.take(on_stream);
                taint.take(in_slice);
            }
            health.instance_done(health.samples.len() - health_before, want);
            own.instance_done(own.samples.len() - own_before, want);
            taint.instance_done(taint.samples.len() - taint_before, want);
            ready.plugin.stop().await;
        }
        let want = devices.min(count - device_plugin.len() - device_plugin_missed);
        if want > 0 {
            device_plugin_missed +=
                faults_on_one_instance(rig, devices, want, &mut device_plugin).await?;
        }
        let want = devices.min(count - with_api.len() - with_api_missed);
        if want > 0 {
            with_api_missed += faults_on_one_instance_with(
                rig,
                devices,
                want,
                &mut with_api,
                Some((&dra.api_args, &dra.api)),
            )
            .await?;
        }
    }
    report.latency(
        &format!(
            "DRA comparison: device plugin, fault (XID 79) → kubelet sees Unhealthy, {devices} GPUs"
        ),
        &device_plugin,
    );
    report.latency(
        &format!(
            "DRA comparison: device plugin with API access (Events, node condition), fault (XID 79) → kubelet sees Unhealthy, {devices} GPUs"
        ),
        &with_api,
    );
    report.latency(
        &format!(
            "DRA: fault (XID 79) → health stream's Unhealthy report received by the kubelet, {devices} GPUs"
        ),
        &health.samples,
    );
    report.latency(
        &format!(
            "DRA: fault (XID 79) → the same report received by a health stream client of the bench's own, {devices} GPUs"
        ),
        &own.samples,
    );
    report.latency(
        &format!(
            "DRA: fault (XID 79) → ResourceSlice write with the NoSchedule taint arrives at the API server, {devices} GPUs"
        ),
        &taint.samples,
    );
    if let Some((before, after)) = idle {
        let secs = idle_for.as_secs_f64();
        let cpu = format!(
            "DRA: idle CPU time over {secs:.0} s (slices published, health stream open, {devices} GPUs)"
        );
        let wakeups = "DRA: idle voluntary context switches (wake-ups)";
        after.report_idle(&before, idle_for, report, [&cpu, wakeups]);
    }
    let p99 = |s: &[Duration]| Stats::of(s).map_or(f64::NAN, |s| s.p99);
    let base = p99(&device_plugin);
    report.value(
        "DRA: health stream p99 ÷ device plugin p99 (target ≤ 2)",
        p99(&health.samples) / base,
        "×",
    );
    report.value(
        "DRA: slice taint p99 ÷ device plugin p99 (target ≤ 2)",
        p99(&taint.samples) / base,
        "×",
    );
    report.value(
        "DRA: health stream p99 ÷ device plugin with API access p99",
        p99(&health.samples) / p99(&with_api),
        "×",
    );
    let seen = |road: &Road| format!("{} of {count}", road.samples.len());
    report.check(
        "DRA comparison: device plugin, every fault seen",
        device_plugin_missed == 0,
        format!("{} of {count}", device_plugin.len()),
    );
    report.check(
        "DRA comparison: device plugin with API access, every fault seen",
        with_api_missed == 0,
        format!("{} of {count}", with_api.len()),
    );
    report.check(
        "DRA: every fault on the health stream",
        health.missed == 0,
        seen(&health),
    );
    report.check(
        "DRA: every fault on the bench's own health stream",
        own.missed == 0,
        seen(&own),
    );
    report.check(
        "DRA: every fault's taint in the ResourceSlice",
        taint.missed == 0,
        seen(&taint),
    );
    Ok(())
}

/// XID 79 on GPU `id` (published as `name`): the time to the health stream's Unhealthy report and to the
/// slice write with its taint, each `None` if not seen within [`LIMIT`] (or not waited for on a dead road).
async fn dra_fault(
    rig: &Rig,
    dra: &DraRig,
    id: &str,
    name: &str,
    (health, taint): (&Road, &Road),
    own: &OwnStream,
) -> anyhow::Result<(Option<Duration>, Option<Duration>, Option<Duration>)> {
    // The requests so far: this fault's slice write is among the ones after.
    let mark = dra.api.requests().len();
    let injected = rig.inject(&[format!("xid {id} 79")])?;
    let on_stream = if health.dead {
        None
    } else {
        dra.kubelet
            .wait_device_health_since((DRIVER, NODE, name), LIMIT, |h, _| {
                h.health == Health::Unhealthy
            })
            .await
            .ok()
            .and_then(|(_, since)| since)
            .map(|at| at.saturating_duration_since(injected))
    };
    let in_slice = if taint.dead {
        None
    } else {
        // Waited for among the requests, not the stored slices: the server stores a slice before it records
        // the request that wrote it.
        let written = |requests: &[Recorded]| -> Option<Instant> {
            requests
                .get(mark..)
                .unwrap_or_default()
                .iter()
                .filter(|r| is_slice_write(r) && carries_taint(&r.body, name))
                .map(|r| r.at)
                .min()
        };
        match dra
            .api
            .wait_for("the fault's slice write", LIMIT, |r| written(r).is_some())
            .await
        {
            // Answered 2xx, so the server holds it; checked all the same.
            Ok(requests) if dra.api.slices().iter().any(|s| carries_taint(s, name)) => {
                written(&requests).map(|at| at.saturating_duration_since(injected))
            }
            _ => None,
        }
    };
    let on_own = own
        .first_unhealthy(name, LIMIT)
        .await
        .map(|at| at.saturating_duration_since(injected));
    Ok((on_stream, in_slice, on_own))
}

/// A health stream (`v1alpha1`) of the bench's own on the plugin's DRA socket, beside the fake kubelet's:
/// the time each device was first reported Unhealthy, stamped on the bench's thread as the report is
/// decoded. Without the fake kubelet's own handling, it shows the plugin's share of the health stream's
/// latency.
struct OwnStream {
    first: tokio::sync::watch::Receiver<BTreeMap<String, Instant>>,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for OwnStream {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl OwnStream {
    async fn open(endpoint: &std::path::Path) -> anyhow::Result<OwnStream> {
        use gpu_device_plugin::api::dra::health_v1alpha1 as h;
        let channel = gpu_device_plugin::util::uds::connect(endpoint)
            .await
            .with_context(|| format!("cannot connect to {}", endpoint.display()))?;
        let mut stream = h::dra_resource_health_client::DraResourceHealthClient::new(channel)
            .node_watch_resources(h::NodeWatchResourcesRequest {})
            .await
            .context("the bench's own health stream")?
            .into_inner();
        let (tx, first) = tokio::sync::watch::channel(BTreeMap::new());
        let reader = tokio::spawn(async move {
            while let Ok(Some(report)) = stream.message().await {
                let now = Instant::now();
                tx.send_modify(|first| {
                    for d in &report.devices {
                        if d.health == h::HealthStatus::Unhealthy as i32
                            && let Some(id) = &d.device
                        {
                            first.entry(id.device_name.clone()).or_insert(now);
                        }
                    }
                });
            }
        });
        Ok(OwnStream { first, reader })
    }

    /// When `device` was first reported Unhealthy, waiting up to `limit`.
    async fn first_unhealthy(&self, device: &str, limit: Duration) -> Option<Instant> {
        let mut first = self.first.clone();
        let found = tokio::time::timeout(limit, first.wait_for(|f| f.contains_key(device))).await;
        found.ok()?.ok().and_then(|f| f.get(device).copied())
    }
}

/// `count` allocated claims, each on one GPU in turn, prepared fresh, prepared again, and unprepared, on one
/// DRA instance; every answer checked (the claim's GPU, its CDI device `nvidia.com/gpu=<UUID>`, no error).
async fn prepares(
    rig: &Rig,
    dra: &DraRig,
    devices: usize,
    count: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    let ready = dra.start(rig, devices).await?;
    let channel = gpu_device_plugin::util::uds::connect(&dra.endpoint)
        .await
        .with_context(|| format!("cannot connect to {}", dra.endpoint.display()))?;
    let mut client = v1::dra_plugin_client::DraPluginClient::new(channel);
    let gpus: Vec<(&String, &String)> = ready.names.iter().collect();
    let (mut fresh, mut again, mut unprepared) = (Vec::new(), Vec::new(), Vec::new());
    let mut failures: Vec<String> = Vec::new();
    for n in 0..count {
        let (uuid, device) = gpus[n % gpus.len()];
        let name = format!("claim-{n}");
        let uid = dra.api.add_claim(
            NAMESPACE,
            &name,
            vec![AllocationResult::new("gpu", DRIVER, NODE, device)],
        );
        let claim = v1::Claim {
            namespace: NAMESPACE.into(),
            uid: uid.clone(),
            name: name.clone(),
        };
        let cdi = format!("nvidia.com/gpu={uuid}");
        for samples in [&mut fresh, &mut again] {
            let request = v1::NodePrepareResourcesRequest {
                claims: vec![claim.clone()],
            };
            let start = Instant::now();
            let answer = client.node_prepare_resources(request).await;
            let took = start.elapsed();
            let wrong = match answer {
                Err(status) => Some(format!("failed: {status}")),
                Ok(answer) => {
                    let answer = answer.into_inner();
                    match answer.claims.get(&uid) {
                        None => Some(format!("no entry for the claim: {answer:?}")),
                        Some(a) if !a.error.is_empty() => Some(a.error.clone()),
                        Some(a) => {
                            let right = a.devices.len() == 1
                                && a.devices[0].device_name == *device
                                && a.devices[0].pool_name == NODE
                                && a.devices[0].cdi_device_ids.first() == Some(&cdi);
                            (!right).then(|| format!("not {device} ({cdi}): {:?}", a.devices))
                        }
                    }
                }
            };
            match wrong {
                None => samples.push(took),
                Some(why) => failures.push(format!("prepare of {name}: {why}")),
            }
        }
        let request = v1::NodeUnprepareResourcesRequest {
            claims: vec![claim],
        };
        let start = Instant::now();
        let answer = client.node_unprepare_resources(request).await;
        let took = start.elapsed();
        let wrong = match answer {
            Err(status) => Some(format!("failed: {status}")),
            Ok(answer) => match answer.into_inner().claims.get(&uid) {
                None => Some("no entry for the claim".to_string()),
                Some(a) if !a.error.is_empty() => Some(a.error.clone()),
                Some(_) => None,
            },
        };
        match wrong {
            None => unprepared.push(took),
            Some(why) => failures.push(format!("unprepare of {name}: {why}")),
        }
        dra.api.delete_claim(NAMESPACE, &name);
    }
    if !failures.is_empty() {
        eprintln!(
            "bench: dra: {} prepare or unprepare calls failed, the first: {}; plugin log:\n{}",
            failures.len(),
            failures[0],
            ready.plugin.log()
        );
    }
    ready.plugin.stop().await;
    report.latency(
        "DRA: NodePrepareResources, fresh claim (claim read from the local API server, record written), round trip",
        &fresh,
    );
    report.latency(
        "DRA: NodePrepareResources, claim already prepared (answered from the record), round trip",
        &again,
    );
    report.latency("DRA: NodeUnprepareResources, round trip", &unprepared);
    let p99 = Stats::of(&fresh).map_or(f64::NAN, |s| s.p99);
    report.value(
        "DRA: fresh prepare p99 (target ≤ 5 ms without API latency)",
        p99,
        "ms",
    );
    report.check(
        "DRA: every prepare answered with its GPU, every unprepare done",
        failures.is_empty(),
        format!(
            "{} of {count} fresh, {} of {count} again, {} of {count} unprepared{}",
            fresh.len(),
            again.len(),
            unprepared.len(),
            // One line of a Markdown table.
            failures.first().map_or(String::new(), |f| format!(
                "; first failure: {}",
                f.replace(['\n', '|'], " ")
            ))
        ),
    );
    Ok(())
}
