//! The abuse measure's claims flood (issue 39): the plugin serving half its GPUs through DRA and half
//! through the device plugin, and fault → kubelet on both roads measured quiet and under a flood of prepares
//! of large ResourceClaims (1 MB each, within the 1.5 MiB the API server stores) sent to its DRA socket by
//! threads of the bench at a lower priority, as a separate process would. Each prepare makes the plugin
//! read and parse one claim from the API server (the claims are allocated a device the node does not
//! publish, so each is refused after the read, recorded nowhere, and read again next time). Also the
//! plugin's RSS before the flood, at its peak and once it has ended and the plugin is idle again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use fake_kubelet::apiserver::{AllocationResult, FakeApiServer};
use fake_kubelet::dra::{DraKubelet, DraOptions, Health};
use gpu_device_plugin::api::dra::v1;

use crate::Counts;
use crate::process::{self, ProcSample};
use crate::report::{MemoryLabels, Report, Stats};
use crate::rig::{Plugin, Rig, WAIT, uuid};

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "flood-node";
const NAMESPACE: &str = "flood";
/// Claims the flood prepares, round-robin; each is read from the API server at every prepare.
const CLAIMS: usize = 32;
/// Each claim's padding: a claim of about 1 MB.
const CLAIM_BYTES: usize = 1_000_000;
/// Threads sending prepares, each one call at a time.
const FLOODERS: usize = 8;
/// Nice value of the flood's threads: below the plugin, as the flood ran.
const FLOOD_NICE: i32 = 10;
/// A fault not seen within this is missed.
const LIMIT: Duration = Duration::from_secs(5);
/// How long the plugin may take to be idle again (no CPU tick in [`QUIET_WINDOW`]) after the flood.
const SETTLE_LIMIT: Duration = Duration::from_secs(5);
const QUIET_WINDOW: Duration = Duration::from_millis(500);
/// Whether the first prepare's answer was said (once a run).
static SAID: AtomicBool = AtomicBool::new(false);
/// Prepares answered before the faults begin: the flood is under way.
const FLOOD_UNDER_WAY: u64 = 16;

/// Fault → kubelet on each road, quiet and under the flood, and the plugin's memory around the flood.
pub(crate) async fn claims_flood(
    rig: &Rig,
    devices: usize,
    counts: &Counts,
    report: &mut Report,
) -> anyhow::Result<()> {
    if devices < 2 {
        eprintln!("bench: abuse: claims flood needs 2 GPUs or more (one per road); skipped");
        return Ok(());
    }
    let api = FakeApiServer::start().await?;
    api.add_node(NODE);
    let kubeconfig = rig.work_dir().join("flood-kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let root = rig.work_dir().join("flood-kubelet");
    let kubelet = DraKubelet::start_with(&root, DraOptions::default().api_server(&api, NODE))
        .context("cannot start the fake kubelet's DRA side")?;
    // The upper half of the GPUs through DRA, the lower half through the device plugin.
    let dra_gpus: Vec<usize> = (devices / 2..devices).collect();
    let dp_gpus: Vec<usize> = (0..devices / 2).collect();
    let path = |p: &Path| p.to_string_lossy().into_owned();
    let args: Vec<String> = vec![
        "--dra".into(),
        dra_gpus
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(","),
        "--kubeconfig".into(),
        path(&kubeconfig),
        "--node-name".into(),
        NODE.into(),
        "--kubelet-registrar-directory-path".into(),
        path(&root.join("plugins_registry")),
        "--kubelet-plugins-directory-path".into(),
        path(&root.join("plugins")),
    ];
    let endpoint = root.join("plugins").join(DRIVER).join("dra.sock");
    let claims: Vec<v1::Claim> = (0..CLAIMS)
        .map(|i| {
            let name = format!("flood-{i}");
            let uid = api.add_claim(
                NAMESPACE,
                &name,
                vec![AllocationResult::new("gpu", DRIVER, NODE, "gpu-not-here")],
            );
            api.inflate_claim(NAMESPACE, &name, CLAIM_BYTES);
            v1::Claim {
                namespace: NAMESPACE.into(),
                uid,
                name,
            }
        })
        .collect();
    let claims = Arc::new(claims);

    let count = counts.faults;
    let (mut dra_quiet, mut dra_flood) = (Vec::new(), Vec::new());
    let (mut dp_quiet, mut dp_flood) = (Vec::new(), Vec::new());
    let mut missed = (0usize, 0usize);
    let mut memory: Vec<(u64, u64, u64)> = Vec::new();
    let mut settled = 0usize;
    let mut prepares = (0u64, Duration::ZERO);
    let mut rounds = 0;
    while dra_flood.len() + dp_flood.len() + missed.1 < count && rounds < 2 * count {
        rounds += 1;
        for flood in [false, true] {
            kubelet
                .wait_connected(DRIVER, false, WAIT)
                .await
                .context("the previous instance is still connected")?;
            let n = rig.next_registration().await;
            let mut plugin = rig.spawn_with(devices, None, &args, &[])?;
            let names = match ready(rig, &kubelet, &api, n, (&dra_gpus, &dp_gpus), &plugin).await {
                Ok(names) => names,
                Err(e) => {
                    let log = plugin.log();
                    plugin.stop().await;
                    return Err(e.context(format!("instance not ready; plugin log:\n{log}")));
                }
            };
            let pid = plugin.pid();
            let before = ProcSample::read(pid)?;
            let running = if flood {
                Some(Flood::start(&endpoint, claims.clone()).await?)
            } else {
                None
            };
            let (dra_samples, dp_samples) = if flood {
                (&mut dra_flood, &mut dp_flood)
            } else {
                (&mut dra_quiet, &mut dp_quiet)
            };
            for gpu in &dra_gpus {
                let id = uuid(*gpu);
                let name = names.get(&id).context("a DRA GPU is not in the slice")?;
                let injected = rig.inject(&[format!("xid {id} 79")])?;
                let seen = kubelet
                    .wait_device_health_since((DRIVER, NODE, name), LIMIT, |h, _| {
                        h.health == Health::Unhealthy
                    })
                    .await
                    .ok()
                    .and_then(|(_, since)| since)
                    .map(|at| at.saturating_duration_since(injected));
                match seen {
                    Some(took) => dra_samples.push(took),
                    None if flood => missed.1 += 1,
                    None => missed.0 += 1,
                }
            }
            {
                let dp = rig.kubelet.lock().await;
                for gpu in &dp_gpus {
                    let id = uuid(*gpu);
                    match crate::fault::one_fault_within(rig, &dp, n, &id, LIMIT).await? {
                        Some(took) => dp_samples.push(took),
                        None if flood => missed.1 += 1,
                        None => missed.0 += 1,
                    }
                }
            }
            if let Some(running) = running {
                let (answered, over) = running.stop().await;
                prepares.0 += answered;
                prepares.1 += over;
                settled += usize::from(process::settle(pid, QUIET_WINDOW, SETTLE_LIMIT).await);
                if let Ok(after) = ProcSample::read(pid) {
                    memory.push((before.rss_kib, after.hwm_kib, after.rss_kib));
                }
            }
            if let Ok(Some(status)) = plugin.child.try_wait() {
                anyhow::bail!(
                    "the plugin exited ({status}) during the claims flood; its log:\n{}",
                    plugin.log()
                );
            }
            plugin.stop().await;
        }
    }

    let dra_n = dra_gpus.len();
    let dp_n = dp_gpus.len();
    let flood = format!(
        "{FLOODERS} threads at nice +{FLOOD_NICE} preparing {CLAIMS} claims of {:.0} MB in turn",
        CLAIM_BYTES as f64 / 1e6
    );
    report.latency(
        &format!(
            "abuse: claims flood: fault (XID 79) → DRA health stream's Unhealthy report at the kubelet, {dra_n} DRA GPUs, quiet"
        ),
        &dra_quiet,
    );
    report.latency(
        &format!(
            "abuse: claims flood: fault (XID 79) → DRA health stream's Unhealthy report at the kubelet, under a flood ({flood})"
        ),
        &dra_flood,
    );
    report.latency(
        &format!(
            "abuse: claims flood: fault (XID 79) → device plugin's kubelet sees Unhealthy, {dp_n} device-plugin GPUs beside them, quiet"
        ),
        &dp_quiet,
    );
    report.latency(
        "abuse: claims flood: fault (XID 79) → device plugin's kubelet sees Unhealthy, under the flood",
        &dp_flood,
    );
    let p99 = |s: &[Duration]| Stats::of(s).map_or(f64::NAN, |s| s.p99);
    report.value(
        "abuse: claims flood: DRA health stream p99 under the flood (target ≤ 10 ms)",
        p99(&dra_flood),
        "ms",
    );
    report.value(
        "abuse: claims flood: device plugin p99, under the flood ÷ quiet (target ≤ 1)",
        p99(&dp_flood) / p99(&dp_quiet),
        "×",
    );
    report.value(
        "abuse: claims flood: prepares answered during the flood",
        if prepares.1.is_zero() {
            0.0
        } else {
            prepares.0 as f64 / prepares.1.as_secs_f64()
        },
        "/s",
    );
    if !memory.is_empty() {
        report.memory(
            &memory,
            &MemoryLabels {
                before: "abuse: claims flood: RSS before the flood (largest)",
                peak: "abuse: claims flood: peak RSS during the flood (VmHWM, largest)",
                after: None,
                growth: "abuse: claims flood: RSS after − before the flood, idle again (largest; target ≤ 5 MB)",
            },
        );
        report.value(
            &format!(
                "abuse: claims flood: instances idle again within {} s, of {}",
                SETTLE_LIMIT.as_secs(),
                memory.len()
            ),
            settled as f64,
            "",
        );
    }
    report.value(
        "abuse: claims flood: faults missed, quiet",
        missed.0 as f64,
        "",
    );
    report.value(
        "abuse: claims flood: faults missed, under the flood",
        missed.1 as f64,
        "",
    );
    Ok(())
}

/// The instance registered on both roads, every GPU Healthy on each; the DRA GPUs' published names by
/// UUID.
async fn ready(
    rig: &Rig,
    kubelet: &DraKubelet,
    api: &FakeApiServer,
    n: usize,
    (dra_gpus, dp_gpus): (&[usize], &[usize]),
    plugin: &Plugin,
) -> anyhow::Result<BTreeMap<String, String>> {
    rig.wait_registered(n, plugin).await?;
    {
        let dp = rig.kubelet.lock().await;
        dp.wait_list("every device-plugin GPU Healthy", WAIT, |l| {
            l.registration >= n
                && dp_gpus
                    .iter()
                    .all(|g| l.health(&uuid(*g)) == Some("Healthy"))
        })
        .await?;
    }
    kubelet.wait_connected(DRIVER, true, WAIT).await?;
    let wanted: Vec<String> = dra_gpus.iter().map(|g| uuid(*g)).collect();
    let slices = api
        .wait_for_slices("every DRA GPU published without a taint", WAIT, |s| {
            clean_names(s).is_some_and(|names| wanted.iter().all(|id| names.contains_key(id)))
        })
        .await
        .map_err(anyhow::Error::msg)?;
    let names = clean_names(&slices).unwrap_or_default();
    for name in names.values() {
        kubelet
            .wait_device_health((DRIVER, NODE, name), WAIT, |h| h.health == Health::Healthy)
            .await?;
    }
    Ok(names)
}

/// Published device name by UUID, from this node's slices, if no device carries a taint.
fn clean_names(slices: &[serde_json::Value]) -> Option<BTreeMap<String, String>> {
    let mut names = BTreeMap::new();
    let devices = slices
        .iter()
        .filter(|s| s["spec"]["nodeName"] == NODE && s["spec"]["driver"] == DRIVER)
        .flat_map(|s| s["spec"]["devices"].as_array().into_iter().flatten());
    for device in devices {
        if device["taints"].as_array().is_some_and(|t| !t.is_empty()) {
            return None;
        }
        if let (Some(uuid), Some(name)) = (
            device["attributes"]["uuid"]["string"].as_str(),
            device["name"].as_str(),
        ) {
            names.insert(uuid.to_string(), name.to_string());
        }
    }
    Some(names)
}

/// The flood's threads, each with a runtime and a connection of its own.
struct Flood {
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicU64>,
    threads: Vec<std::thread::JoinHandle<()>>,
    started: Instant,
}

impl Flood {
    /// Starts the flood on the DRA socket at `endpoint` and waits until it is under way.
    async fn start(endpoint: &Path, claims: Arc<Vec<v1::Claim>>) -> anyhow::Result<Flood> {
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicU64::new(0));
        let mut threads = Vec::new();
        for t in 0..FLOODERS {
            let (stop, answered, claims) = (stop.clone(), answered.clone(), claims.clone());
            let endpoint: PathBuf = endpoint.to_path_buf();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("flood-{t}"))
                    .spawn(move || {
                        super::lower_priority(FLOOD_NICE);
                        let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                        else {
                            return;
                        };
                        runtime.block_on(prepare_in_a_loop(endpoint, claims, t, stop, answered));
                    })?,
            );
        }
        let flood = Flood {
            stop,
            answered,
            threads,
            started: Instant::now(),
        };
        let deadline = Instant::now() + WAIT;
        while flood.answered.load(Ordering::Relaxed) < FLOOD_UNDER_WAY {
            if Instant::now() > deadline {
                eprintln!("bench: abuse: the claims flood did not get under way within {WAIT:?}");
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(flood)
    }

    /// Stops the flood; the prepares answered and how long it ran.
    async fn stop(self) -> (u64, Duration) {
        self.stop.store(true, Ordering::Relaxed);
        let over = self.started.elapsed();
        for thread in self.threads {
            let _joined = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        (self.answered.load(Ordering::Relaxed), over)
    }
}

/// One flood thread: prepares of the claims in turn (starting at its own), one call at a time, until
/// `stop`; a failed call connects again.
async fn prepare_in_a_loop(
    endpoint: PathBuf,
    claims: Arc<Vec<v1::Claim>>,
    first: usize,
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicU64>,
) {
    let mut next = first;
    while !stop.load(Ordering::Relaxed) {
        let Ok(channel) = gpu_device_plugin::util::uds::connect(&endpoint).await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let mut client = v1::dra_plugin_client::DraPluginClient::new(channel);
        while !stop.load(Ordering::Relaxed) {
            let claim = claims[next % claims.len()].clone();
            next += 1;
            let call = client.node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: vec![claim],
            });
            match tokio::time::timeout(LIMIT, call).await {
                Ok(Ok(answer)) => {
                    if answered.fetch_add(1, Ordering::Relaxed) == 0
                        && !SAID.swap(true, Ordering::Relaxed)
                    {
                        // What a prepare of the flood gets: the refusal after the claim was read.
                        let errors: Vec<String> = answer
                            .into_inner()
                            .claims
                            .into_values()
                            .map(|c| c.error)
                            .collect();
                        eprintln!(
                            "bench: abuse: claims flood: the first prepare's answer: {errors:?}"
                        );
                    }
                }
                _ => break,
            }
        }
    }
}
