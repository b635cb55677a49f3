//! The measures. Each waits for what the kubelet side receives — never for the plugin's logs — so any plugin
//! can be measured.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::fault::{faults_on_one_instance, first_node_condition_since, one_fault};
use crate::process::ProcSample;
use crate::report::Report;
use crate::rig::{Plugin, Rig, WAIT, mig_uuid, uuid};
use crate::{Args, Counts, Measure};

/// XIDs every plugin's default policy ignores (NVIDIA's list and the catalog agree): storm material.
const HARMLESS_XIDS: [u64; 3] = [13, 31, 43];

pub(crate) async fn all(
    rig: &Rig,
    args: &Args,
    counts: Counts,
    report: &mut Report,
) -> anyhow::Result<()> {
    let devices = args.devices.max(1);

    // 0. the machine itself
    if args.runs(Measure::Floor) {
        floor(counts, "at the start", report).await?;
    }

    // 3. start-up
    if args.runs(Measure::Startup) {
        // One start before the counted ones: the first exec of the binary in a run maps pages no process has
        // touched since it was written or last ran (measured: 10–17 ms, against 3–4 ms after), which a node
        // pays once per image pull, not per restart. Reported apart.
        let (mut to_register, mut to_list) = (Vec::new(), Vec::new());
        let mut first = None;
        for _ in 0..=counts.starts {
            let n = rig.next_registration().await;
            let spawned = Instant::now();
            let plugin = rig.spawn(devices)?;
            let (registered, listed) = rig.wait_registered(n, &plugin).await?;
            plugin.stop().await;
            let took = registered.saturating_duration_since(spawned);
            if first.is_none() {
                first = Some(took);
                continue;
            }
            to_register.push(took);
            to_list.push(listed.saturating_duration_since(spawned));
        }
        report.latency("start-up: spawn → Register received", &to_register);
        report.latency("start-up: spawn → first ListAndWatch list", &to_list);
        if let Some(first) = first {
            report.value(
                "start-up: the run's first start (not counted above) → Register",
                first.as_secs_f64() * 1000.0,
                "ms",
            );
        }
    }

    // 8. surge hand-over
    if args.runs(Measure::Surge) {
        surge(rig, devices, counts.surges, report).await?;
    }

    let shared = [
        Measure::Allocate,
        Measure::Preferred,
        Measure::Prestart,
        Measure::Restart,
        Measure::Idle,
        Measure::Soak,
        Measure::Storm,
    ];
    if shared.iter().any(|&m| args.runs(m)) {
        let n = rig.next_registration().await;
        let plugin = rig.spawn(devices)?;
        rig.wait_registered(n, &plugin).await?;
        on_one_instance(rig, args, &plugin, devices, counts, report).await?;
        plugin.stop().await;
    }

    // 1. fault → kubelet, with the floor again right before it: the machine's slow spells come and go
    // within a run.
    if args.runs(Measure::Floor) && args.runs(Measure::Fault) {
        floor(counts, "before the fault measures", report).await?;
    }
    for n in [devices, args.large_devices] {
        if n == 0 || !args.runs(Measure::Fault) {
            continue;
        }
        let (samples, missed) = fault_latency(rig, n, counts.faults).await?;
        report.latency(
            &format!("fault (XID 79) → kubelet sees Unhealthy, {n} GPUs"),
            &samples,
        );
        report.check(
            &format!("every fault seen, {n} GPUs"),
            missed == 0,
            format!("{} of {}", samples.len(), counts.faults),
        );
    }
    if args.runs(Measure::Surfaces) && rig.is_ours() {
        surfaces(rig, devices, counts.faults, report).await?;
    }
    if args.runs(Measure::Replicas) && rig.is_ours() {
        replicas(rig, devices, &counts, report).await?;
    }
    if args.runs(Measure::Mig) && rig.is_ours() {
        mig(rig, devices, &counts, report).await?;
    }
    if args.runs(Measure::Abuse) && rig.is_ours() {
        crate::abuse::abuse(rig, devices, &counts, report).await?;
    }
    if args.runs(Measure::Dra) && rig.is_ours() {
        crate::dra::dra(rig, devices, &counts, report).await?;
    }
    Ok(())
}

/// Each GPU's MIG devices in the `mig` measure: two profiles, so two resources, each its own registration
/// and its own view of the one inventory.
const MIG_LAYOUT: [&str; 7] = [
    "1g.10gb",
    "1g.10gb",
    "1g.10gb",
    "1g.10gb",
    "1g.10gb",
    "1g.10gb",
    "1g.10gb+me",
];
const MIG_PER_GPU: usize = MIG_LAYOUT.len();

/// The resource of a MIG device of the `mig` measure's layout.
fn mig_resource(j: usize) -> &'static str {
    if MIG_LAYOUT[j] == "1g.10gb" {
        "nvidia.com/mig-1g.10gb"
    } else {
        "nvidia.com/mig-1g.10gb.me"
    }
}

/// `migStrategy: mixed` on GPUs each cut into `MIG_PER_GPU` MIG devices of two profiles: spawn → the
/// kubelet's first full lists of both resources, and an XID 48 attributed to one MIG device → the first list
/// showing it Unhealthy; then every other MIG device must be as it was (the fault is that instance's alone).
async fn mig(
    rig: &Rig,
    devices: usize,
    counts: &Counts,
    report: &mut Report,
) -> anyhow::Result<()> {
    let listed = devices * MIG_PER_GPU;
    let resources = [mig_resource(0), mig_resource(MIG_PER_GPU - 1)];
    let args = ["--mig-strategy".to_string(), "mixed".to_string()];
    let (mut starts, mut faults) = (Vec::new(), Vec::new());
    let mut missed = 0;
    let mut attributed = true;
    while faults.len() + missed < counts.faults {
        let n = rig.next_registration().await;
        let spawned = Instant::now();
        let plugin = rig.spawn_on(devices, Some(&MIG_LAYOUT), None, &args, &[])?;
        let kubelet = rig.kubelet.lock().await;
        kubelet
            .wait_registrations(n + 1, WAIT)
            .await
            .with_context(|| format!("no registration #{n}; plugin log:\n{}", plugin.log()))?;
        let mut last = spawned;
        for resource in resources {
            let expected = devices
                * (0..MIG_PER_GPU)
                    .filter(|&j| mig_resource(j) == resource)
                    .count();
            let first = kubelet
                .wait_list_of(resource, "every MIG device listed healthy", WAIT, |l| {
                    l.registration >= n && l.allocatable() == expected
                })
                .await
                .with_context(|| {
                    format!("MIG devices not all listed; plugin log:\n{}", plugin.log())
                })?;
            last = last.max(first.received_at.unwrap_or(spawned));
        }
        starts.push(last.saturating_duration_since(spawned));
        // One fault per MIG device of this instance, spread over the GPUs.
        let budget = listed.min(counts.faults - faults.len() - missed);
        for k in 0..budget {
            let (gpu, j) = (k % devices, k / devices);
            let id = mig_uuid(gpu, j);
            let injected = rig.inject(&[format!("xid {id} 48")])?;
            let list = kubelet
                .wait_list_of(mig_resource(j), "the MIG device Unhealthy", WAIT, |l| {
                    l.registration >= n && l.health(&id) == Some("Unhealthy")
                })
                .await
                .ok();
            match list {
                Some(list) => {
                    let other = resources
                        .iter()
                        .find(|r| **r != mig_resource(j))
                        .map(|r| kubelet.list_of(r))
                        .unwrap_or_default();
                    let unhealthy = [&list, &other]
                        .iter()
                        .flat_map(|l| &l.devices)
                        .filter(|d| d.health == "Unhealthy")
                        .count();
                    attributed &= unhealthy == k + 1;
                    if let Some(at) = list.received_at {
                        faults.push(at.saturating_duration_since(injected));
                    }
                }
                None => missed += 1,
            }
        }
        drop(kubelet);
        plugin.stop().await;
    }
    report.latency(
        &format!(
            "start-up with {devices} GPUs × {MIG_PER_GPU} MIG devices (mixed, 2 profiles): spawn → both full lists"
        ),
        &starts,
    );
    report.latency(
        &format!(
            "fault (XID 48 on one MIG device) → kubelet sees it Unhealthy, {listed} MIG devices in 2 resources"
        ),
        &faults,
    );
    report.check(
        "mig: every fault seen, only the MIG device it names Unhealthy",
        missed == 0 && attributed,
        format!(
            "{} of {}, attributed: {attributed}",
            faults.len(),
            counts.faults
        ),
    );
    Ok(())
}

/// Replicas per GPU in the `replicas` measure.
const REPLICAS: usize = 100;

/// Time-slicing with NVIDIA's config file, `REPLICAS` per GPU: spawn → the kubelet's first full list of
/// every replica, and XID 79 on a GPU → the first list showing all of its replicas Unhealthy (they change
/// together or not at all: the same list carries them).
async fn replicas(
    rig: &Rig,
    devices: usize,
    counts: &Counts,
    report: &mut Report,
) -> anyhow::Result<()> {
    let config = rig.work_dir().join("time-slicing.yaml");
    std::fs::write(
        &config,
        format!(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: {REPLICAS}\n"
        ),
    )?;
    let envs = [("CONFIG_FILE", config.as_os_str())];
    let listed = devices * REPLICAS;
    let (mut starts, mut faults) = (Vec::new(), Vec::new());
    let mut missed = 0;
    let mut all_together = true;
    while faults.len() + missed < counts.faults {
        let n = rig.next_registration().await;
        let spawned = Instant::now();
        let plugin = rig.spawn_with(devices, None, &[], &envs)?;
        rig.wait_registered(n, &plugin).await?;
        let kubelet = rig.kubelet.lock().await;
        let first = kubelet
            .wait_list("every replica listed healthy", WAIT, |l| {
                l.registration >= n && l.allocatable() == listed
            })
            .await
            .with_context(|| format!("replicas not all listed; plugin log:\n{}", plugin.log()))?;
        if let Some(at) = first.received_at {
            starts.push(at.saturating_duration_since(spawned));
        }
        for i in 0..devices.min(counts.faults - faults.len() - missed) {
            let id = uuid(i);
            let prefix = format!("{id}::");
            let injected = rig.inject(&[format!("xid {id} 79")])?;
            let list = kubelet
                .wait_list("a replica Unhealthy", WAIT, |l| {
                    l.registration >= n
                        && l.devices
                            .iter()
                            .any(|d| d.id.starts_with(&prefix) && d.health == "Unhealthy")
                })
                .await
                .ok();
            match list {
                Some(list) => {
                    let unhealthy = list
                        .devices
                        .iter()
                        .filter(|d| d.id.starts_with(&prefix) && d.health == "Unhealthy")
                        .count();
                    all_together &= unhealthy == REPLICAS;
                    if let Some(at) = list.received_at {
                        faults.push(at.saturating_duration_since(injected));
                    }
                }
                None => missed += 1,
            }
        }
        drop(kubelet);
        plugin.stop().await;
    }
    report.latency(
        &format!("start-up with {devices} GPUs × {REPLICAS} replicas: spawn → first full list"),
        &starts,
    );
    report.latency(
        &format!(
            "fault (XID 79) → kubelet sees all {REPLICAS} replicas of the GPU Unhealthy, {listed} devices"
        ),
        &faults,
    );
    report.check(
        "replicas: every fault seen, all of a GPU's replicas in the same list",
        missed == 0 && all_together,
        format!(
            "{} of {}, together: {all_together}",
            faults.len(),
            counts.faults
        ),
    );
    Ok(())
}

/// Fault → kubelet with every other road on and with all of them off, one instance of each in turn, so that
/// both see the same machine; either way a pod holds every GPU (eight Allocates before the faults). "On":
/// HTTP on an ephemeral port, the fake kubelet's pod-resources API, and Events and the node condition going
/// to a recording API server (per burst of faults: a pod-resources List, a Node and a pod Event per fault, a
/// condition patch); faults start once the instance has written its first node condition (its API client is
/// built). "Off": `--http-addr '' --pod-resources-socket '' --kube-api=false`.
async fn surfaces(
    rig: &Rig,
    devices: usize,
    count: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    use fake_kubelet::apiserver::FakeApiServer;
    const NODE: &str = "bench-node";
    let pod_resources = rig.work_dir().join("pod-resources.sock");
    rig.kubelet
        .lock()
        .await
        .serve_pod_resources(&pod_resources)?;
    let api = FakeApiServer::start().await?;
    api.add_node(NODE);
    api.add_pod("bench", "trainer-0");
    let kubeconfig = rig.work_dir().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let path = |p: &std::path::Path| p.to_string_lossy().into_owned();
    let on: Vec<String> = [
        "--http-addr",
        "127.0.0.1:0",
        "--pod-resources-socket",
        &path(&pod_resources),
        "--kubeconfig",
        &path(&kubeconfig),
    ]
    .map(String::from)
    .to_vec();
    let off: Vec<String> = [
        "--http-addr",
        "",
        "--pod-resources-socket",
        "",
        "--kube-api=false",
    ]
    .map(String::from)
    .to_vec();
    let node_env = [("NODE_NAME", std::ffi::OsStr::new(NODE))];
    let (mut with, mut without) = (Vec::new(), Vec::new());
    let mut missed = 0;
    let mut events_before = 0;
    let mut events_missing = None;
    // Resident memory after an instance's faults, the most of any instance, with and without.
    let (mut rss_on, mut rss_off) = (0u64, 0u64);
    while with.len() + without.len() + missed < 2 * count {
        for surfaces_on in [false, true] {
            let want = count.saturating_sub(if surfaces_on {
                with.len()
            } else {
                without.len()
            });
            if want == 0 {
                continue;
            }
            let n = rig.next_registration().await;
            // The API server's requests so far: this instance's are the ones after.
            let mark = api.requests().len();
            let plugin = if surfaces_on {
                rig.spawn_with(devices, None, &on, &node_env)?
            } else {
                rig.spawn_with(devices, None, &off, &[])?
            };
            rig.wait_registered(n, &plugin).await?;
            let kubelet = rig.kubelet.lock().await;
            kubelet
                .wait_list("every GPU listed healthy", WAIT, |l| {
                    l.registration >= n && l.allocatable() == devices
                })
                .await?;
            if surfaces_on {
                // Steady state: the API client is built (its TLS set-up is tens of milliseconds of CPU right
                // after registration) once the instance has written its first node condition. Only a patch
                // made after this instance started counts: the earlier instances' patches are in the record too.
                first_node_condition_since(&api, mark).await?;
            }
            // One pod holds every GPU, so that each fault has a pod to tell (both ways: the same kubelet calls).
            kubelet.remove_pod("bench", "trainer-0");
            for i in 0..devices {
                let id = uuid(i);
                kubelet
                    .allocate_to("bench", "trainer-0", &format!("worker-{i}"), &[&id])
                    .await?;
            }
            for i in 0..devices.min(want) {
                let id = uuid(i);
                match one_fault(rig, &kubelet, n, &id).await? {
                    Some(took) => {
                        if surfaces_on {
                            with.push(took);
                        } else {
                            without.push(took);
                        }
                    }
                    None => missed += 1,
                }
            }
            drop(kubelet);
            if let Ok(sample) = ProcSample::read(plugin.pid()) {
                let rss = if surfaces_on {
                    &mut rss_on
                } else {
                    &mut rss_off
                };
                *rss = (*rss).max(sample.rss_kib);
            }
            if surfaces_on {
                // The API side really ran: two Events per fault (the Node and the pod) reached the API server.
                let wanted = events_before + 2 * devices.min(want);
                let seen = api
                    .wait_for("the Events of this instance's faults", WAIT, |r| {
                        r.iter().filter(|r| r.path.ends_with("/events")).count() >= wanted
                    })
                    .await
                    .is_ok();
                if !seen {
                    events_missing = Some(wanted);
                }
                events_before = wanted;
            }
            plugin.stop().await;
        }
    }
    report.latency(
        &format!("fault (XID 79) → kubelet sees Unhealthy, {devices} GPUs, every surface off"),
        &without,
    );
    report.latency(
        &format!(
            "fault (XID 79) → kubelet sees Unhealthy, {devices} GPUs, every surface on (HTTP, pod-resources, Events, node condition)"
        ),
        &with,
    );
    report.value(
        "RSS after the faults, every surface off",
        rss_off as f64 / 1024.0,
        "MiB",
    );
    report.value(
        "RSS after the faults, every surface on",
        rss_on as f64 / 1024.0,
        "MiB",
    );
    report.check(
        "surfaces on: every fault's Events (Node and pod) reached the API server",
        events_missing.is_none(),
        events_missing.map_or_else(String::new, |n| format!("fewer than {n} Events")),
    );
    report.check(
        "surfaces: every fault seen",
        missed == 0,
        format!("{missed} missed"),
    );
    Ok(())
}

/// GetPreferredAllocation calls measured (fewer than Allocate's: on a fake library that held a lock across
/// the event thread's wait, each took up to that wait's 5 s).
const PREFERRED_CALLS: usize = 200;

/// The measures that share one plugin instance, in an order where none disturbs the next: Allocate,
/// kubelet restarts, idle, many restarts, then the storm.
async fn on_one_instance(
    rig: &Rig,
    args: &Args,
    plugin: &Plugin,
    devices: usize,
    counts: Counts,
    report: &mut Report,
) -> anyhow::Result<()> {
    let pid = plugin.pid();

    // 6. Allocate
    if args.runs(Measure::Allocate) {
        let mut allocs = Vec::with_capacity(counts.allocates);
        let kubelet = rig.kubelet.lock().await;
        for i in 0..counts.allocates {
            let id = uuid(i % devices);
            let started = Instant::now();
            kubelet.allocate(&[&[id.as_str()]]).await.with_context(|| {
                format!("Allocate of {id} failed; plugin log:\n{}", plugin.log())
            })?;
            allocs.push(started.elapsed());
        }
        report.latency("Allocate, 1 device", &allocs);
    }

    // 6a. GetPreferredAllocation, which the kubelet calls and waits for (without a timeout) before admitting
    // each pod; the plugin's NVML event thread is in its wait meanwhile, as it is whenever no fault comes.
    if args.runs(Measure::Preferred) {
        let ids: Vec<String> = (0..devices).map(uuid).collect();
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        let size = devices.min(2);
        let mut calls = Vec::with_capacity(counts.allocates);
        let kubelet = rig.kubelet.lock().await;
        for _ in 0..counts.allocates.min(PREFERRED_CALLS) {
            let started = Instant::now();
            match kubelet.preferred_allocation(&ids, &[], size as i32).await {
                Ok(chosen) if chosen.len() == size => calls.push(started.elapsed()),
                Ok(chosen) => anyhow::bail!(
                    "GetPreferredAllocation chose {chosen:?}, not {size} devices; plugin log:\n{}",
                    plugin.log()
                ),
                Err(status) if status.code() == tonic::Code::Unimplemented => break,
                Err(status) => anyhow::bail!(
                    "GetPreferredAllocation failed: {status}; plugin log:\n{}",
                    plugin.log()
                ),
            }
        }
        if calls.is_empty() {
            report.value("GetPreferredAllocation: not offered by the plugin", 0.0, "");
        } else {
            report.latency(
                &format!(
                    "GetPreferredAllocation, {size} of {devices} devices, event thread waiting"
                ),
                &calls,
            );
        }
    }

    // 6b. PreStartContainer, as the kubelet calls it before a container holding every GPU starts
    if args.runs(Measure::Prestart) {
        let ids: Vec<String> = (0..devices).map(uuid).collect();
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        let mut calls = Vec::with_capacity(counts.allocates);
        let kubelet = rig.kubelet.lock().await;
        for _ in 0..counts.allocates {
            let started = Instant::now();
            let called = kubelet.start_container(&ids).await.with_context(|| {
                format!("PreStartContainer failed; plugin log:\n{}", plugin.log())
            })?;
            if !called {
                break;
            }
            calls.push(started.elapsed());
        }
        if calls.is_empty() {
            report.value("PreStartContainer: not requested by the plugin", 0.0, "");
        } else {
            report.latency(&format!("PreStartContainer, {devices} devices"), &calls);
        }
    }

    // 2. kubelet restart → Register
    if args.runs(Measure::Restart) {
        let restarts = restart_kubelet(rig, plugin, counts.restarts).await?;
        report.latency("kubelet restart → Register received", &restarts);
    }

    // 4. idle footprint
    if args.runs(Measure::Idle) {
        let before = ProcSample::read(pid)?;
        tokio::time::sleep(counts.idle).await;
        let after = ProcSample::read(pid)?;
        let secs = counts.idle.as_secs_f64();
        report.value("idle: RSS", after.rss_kib as f64 / 1024.0, "MiB");
        report.value(
            "idle: of which anonymous (heap, stacks; the rest is code pages)",
            after.rss_anon_kib as f64 / 1024.0,
            "MiB",
        );
        report.value("idle: threads", after.threads as f64, "");
        let cpu = format!("idle: CPU time over {secs:.0} s");
        let wakeups = "idle: voluntary context switches (wake-ups)";
        after.report_idle(&before, counts.idle, report, [&cpu, wakeups]);
    }

    // 7. footprint after many kubelet restarts
    if args.runs(Measure::Soak) {
        rss_after_restarts(rig, plugin, counts.soak_restarts, report).await?;
    }

    // 5. event storm
    if args.runs(Measure::Storm) {
        storm(rig, plugin, devices, counts, report).await?;
    }
    Ok(())
}

/// A rolling update with surge, repeated: a new instance starts beside the running one (same state
/// directory), registers and lists; then the old one gets SIGTERM. On the legacy device manager (kubelets up
/// to 1.36) the end of the old one's stream cuts the new one off and every GPU counts as unhealthy until the
/// new one registers again. Each sample runs from the SIGTERM to the kubelet holding the full Healthy list
/// from a registration newer than the new instance's first. A plugin that never registers again stops the
/// measure at its first hand-over, with a failed check.
async fn surge(rig: &Rig, devices: usize, count: usize, report: &mut Report) -> anyhow::Result<()> {
    let state = tempfile::tempdir()?;
    let n = rig.next_registration().await;
    let mut old = rig.spawn_with_state(devices, Some(state.path()))?;
    rig.wait_registered(n, &old).await?;
    let mut samples = Vec::with_capacity(count);
    let mut failure = None;
    for i in 0..count {
        let n = rig.next_registration().await;
        let new = rig.spawn_with_state(devices, Some(state.path()))?;
        rig.wait_registered(n, &new).await?;
        let held = {
            let kubelet = rig.kubelet.lock().await;
            let stopped = Instant::now();
            old.terminate();
            kubelet
                .wait_list("the new instance's list after the hand-over", WAIT, |l| {
                    l.registration > n
                        && l.messages >= 1
                        && !l.disconnected
                        && l.devices.len() == devices
                        && l.allocatable() == devices
                })
                .await
                .map(|l| {
                    l.received_at
                        .map(|at| at.saturating_duration_since(stopped))
                })
        };
        old.stop().await;
        old = new;
        match held {
            Ok(Some(took)) => samples.push(took),
            _ => {
                failure = Some(format!(
                    "hand-over {}: no full Healthy list within {WAIT:?}; new instance's log:\n{}",
                    i + 1,
                    old.log()
                ));
                break;
            }
        }
    }
    old.stop().await;
    report.latency(
        "surge hand-over, legacy kubelet: old instance SIGTERMed → full Healthy list again",
        &samples,
    );
    let detail = failure.unwrap_or_else(|| format!("{} of {count}", samples.len()));
    report.check(
        "every surge hand-over ended with the full list",
        samples.len() == count,
        detail,
    );
    Ok(())
}

async fn restart_kubelet(
    rig: &Rig,
    plugin: &Plugin,
    count: usize,
) -> anyhow::Result<Vec<Duration>> {
    let mut samples = Vec::with_capacity(count);
    let mut kubelet = rig.kubelet.lock().await;
    for i in 0..count {
        let (_, took) = kubelet.restart_and_wait(WAIT).await.with_context(|| {
            format!(
                "restart {}: no registration; plugin log:\n{}",
                i + 1,
                plugin.log()
            )
        })?;
        // At least one registration per restart; a second one is possible when the clean-up of the
        // directory races the plugin's re-bind. The newest wins.
        let n = kubelet.registrations().len();
        kubelet
            .wait_list("list after restart", WAIT, |l| {
                l.registration >= n && l.messages >= 1
            })
            .await
            .with_context(|| {
                format!("restart {}: no list; plugin log:\n{}", i + 1, plugin.log())
            })?;
        samples.push(took);
    }
    Ok(samples)
}

async fn rss_after_restarts(
    rig: &Rig,
    plugin: &Plugin,
    count: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    let before = ProcSample::read(plugin.pid())?;
    report.value(
        "before the kubelet restarts: RSS",
        before.rss_kib as f64 / 1024.0,
        "MiB",
    );
    // RSS after each third, to tell growth that levels off from growth that goes on.
    let mut done = 0;
    let mut after = before;
    for third in 1..=3 {
        let upto = count * third / 3;
        restart_kubelet(rig, plugin, upto - done).await?;
        done = upto;
        after = ProcSample::read(plugin.pid())?;
        report.value(
            &format!("after {done} kubelet restarts: RSS"),
            after.rss_kib as f64 / 1024.0,
            "MiB",
        );
    }
    report.value(
        "before the kubelet restarts: threads",
        before.threads as f64,
        "",
    );
    report.value(
        &format!("after {done} kubelet restarts: threads"),
        after.threads as f64,
        "",
    );
    Ok(())
}

async fn floor(counts: Counts, when: &str, report: &mut Report) -> anyhow::Result<()> {
    let count = counts.floor;
    let samples = tokio::task::spawn_blocking(move || wakeup_floor(count)).await??;
    report.latency(
        &format!("machine: one thread wakes another (pipe, 1 ms apart), {when}"),
        &samples,
    );
    Ok(())
}

/// The machine's own floor for every latency here: how long one thread takes to wake another that waits in
/// a blocking read, with the processors idle in between, as they are between faults. Each sample of the
/// fault → kubelet measure crosses several such wake-ups (driver to plugin, plugin thread to thread, plugin
/// to kubelet).
fn wakeup_floor(count: usize) -> anyhow::Result<Vec<Duration>> {
    use std::io::{Read, Write};
    let (mut reader, mut writer) = std::io::pipe()?;
    let woken = std::thread::spawn(move || {
        let mut at = Vec::with_capacity(count);
        let mut byte = [0u8; 1];
        while reader.read_exact(&mut byte).is_ok() {
            at.push(Instant::now());
        }
        at
    });
    let mut sent = Vec::with_capacity(count);
    for _ in 0..count {
        // Pacing, so that the reader is asleep and the processors idle: a load generator, not synchronisation.
        std::thread::sleep(Duration::from_millis(1));
        sent.push(Instant::now());
        writer.write_all(&[1])?;
    }
    drop(writer);
    let woken = woken
        .join()
        .map_err(|_| anyhow::anyhow!("the woken thread failed"))?;
    Ok(sent
        .iter()
        .zip(&woken)
        .map(|(s, w)| w.saturating_duration_since(*s))
        .collect())
}

async fn storm(
    rig: &Rig,
    plugin: &Plugin,
    devices: usize,
    counts: Counts,
    report: &mut Report,
) -> anyhow::Result<()> {
    let messages_before = rig.kubelet.lock().await.list().total_messages;
    let cpu_before = ProcSample::read(plugin.pid())?.cpu;
    let events = rig.events();
    let rate = counts.storm_rate as usize;
    let duration = counts.storm;
    // Paced in 1 ms slices: a load generator, not synchronisation.
    let written = tokio::task::spawn_blocking(move || -> anyhow::Result<usize> {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new().append(true).open(&events)?;
        let per_ms = (rate / 1000).max(1);
        let slices = duration.as_millis() as usize;
        let start = Instant::now();
        let mut n = 0;
        for slice in 0..slices {
            let mut text = String::new();
            for _ in 0..per_ms {
                text.push_str(&format!(
                    "xid {} {}\n",
                    uuid(n % devices),
                    HARMLESS_XIDS[n % HARMLESS_XIDS.len()]
                ));
                n += 1;
            }
            file.write_all(text.as_bytes())?;
            let next = start + Duration::from_millis(slice as u64 + 1);
            if let Some(wait) = next.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        Ok(n)
    })
    .await??;
    let target = uuid(0);
    let fatal_at = rig.inject(&[format!("xid {target} 79")])?;
    let kubelet = rig.kubelet.lock().await;
    let list = kubelet
        .wait_list("the fatal XID after the storm", WAIT, |l| {
            l.health(&target) == Some("Unhealthy")
        })
        .await
        .with_context(|| format!("the fatal XID never arrived; plugin log:\n{}", plugin.log()))?;
    let fatal = list
        .received_at
        .map(|t| t.saturating_duration_since(fatal_at));
    let sample = ProcSample::read(plugin.pid())?;
    report.value(
        &format!("storm: XID events written ({} /s)", counts.storm_rate),
        written as f64,
        "",
    );
    report.value(
        "storm: ListAndWatch messages received",
        (list.total_messages - messages_before) as f64,
        "",
    );
    report.value(
        "storm: peak RSS (VmHWM)",
        sample.hwm_kib as f64 / 1024.0,
        "MiB",
    );
    report.value(
        "storm: plugin CPU time for the whole storm",
        sample.cpu.saturating_sub(cpu_before).as_secs_f64() * 1000.0,
        "ms",
    );
    report.latency(
        "storm: final fatal XID → kubelet sees Unhealthy",
        &fatal.into_iter().collect::<Vec<_>>(),
    );
    let wrong: Vec<String> = (0..devices)
        .filter_map(|i| {
            let id = uuid(i);
            let want = if i == 0 { "Unhealthy" } else { "Healthy" };
            (list.health(&id) != Some(want)).then(|| format!("{id} is {:?}", list.health(&id)))
        })
        .collect();
    let exact = wrong.is_empty() && list.devices.len() == devices;
    report.check("storm: final list exactly right", exact, wrong.join(", "));
    Ok(())
}

async fn fault_latency(
    rig: &Rig,
    devices: usize,
    count: usize,
) -> anyhow::Result<(Vec<Duration>, usize)> {
    let mut samples = Vec::with_capacity(count);
    let mut missed = 0;
    // Each GPU faults once per plugin instance (a plugin need not recover), so a run needs a fresh instance
    // every `devices` faults.
    while samples.len() + missed < count {
        let want = devices.min(count - samples.len() - missed);
        missed += faults_on_one_instance(rig, devices, want, &mut samples).await?;
        if samples.is_empty() && missed > 0 {
            bail!("the plugin reported none of the faults");
        }
    }
    Ok((samples, missed))
}
