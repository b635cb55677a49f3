//! The fault path as every measure drives it: XID 79 written to the fake library, timed to the list the
//! kubelet side receives that shows the GPU Unhealthy; a fresh instance faulted GPU by GPU; every GPU
//! listed Healthy before the first fault. Below the measures that share it (`measure`, `abuse`, `dra`).

use std::time::Duration;

use anyhow::Context;

use crate::rig::{Plugin, Rig, WAIT, uuid};

/// XID 79 on `id`: the time from the write to the kubelet holding a list from registration `n` or later
/// that shows it Unhealthy, or `None` if none came.
pub(crate) async fn one_fault(
    rig: &Rig,
    kubelet: &fake_kubelet::FakeKubelet,
    n: usize,
    id: &str,
) -> anyhow::Result<Option<Duration>> {
    one_fault_within(rig, kubelet, n, id, WAIT).await
}

/// As [`one_fault`], waiting `limit` at most.
pub(crate) async fn one_fault_within(
    rig: &Rig,
    kubelet: &fake_kubelet::FakeKubelet,
    n: usize,
    id: &str,
    limit: Duration,
) -> anyhow::Result<Option<Duration>> {
    let injected = rig.inject(&[format!("xid {id} 79")])?;
    let list = kubelet
        .wait_list("fault", limit, |l| {
            l.registration >= n && l.health(id) == Some("Unhealthy")
        })
        .await
        .ok();
    Ok(list
        .and_then(|l| l.received_at)
        .map(|at| at.saturating_duration_since(injected)))
}

/// One fresh plugin instance on `devices` GPUs, registered and listing them all Healthy, then XID 79 on
/// each of the first `want` GPUs in turn, timed as [`one_fault`] times it into `samples`; returns how many
/// were not seen.
pub(crate) async fn faults_on_one_instance(
    rig: &Rig,
    devices: usize,
    want: usize,
    samples: &mut Vec<Duration>,
) -> anyhow::Result<usize> {
    faults_on_one_instance_with(rig, devices, want, samples, None).await
}

/// As [`faults_on_one_instance`]; with `Some((args, api))`, the plugin started with `args` added to its
/// command line (those that give it `api`), and the faults begin once it has written its first node
/// condition there: its API client built (the client's TLS set-up is tens of milliseconds of CPU right after
/// registration), as a DRA instance's is by the time it is ready.
pub(crate) async fn faults_on_one_instance_with(
    rig: &Rig,
    devices: usize,
    want: usize,
    samples: &mut Vec<Duration>,
    with_api: Option<(&[String], &fake_kubelet::apiserver::FakeApiServer)>,
) -> anyhow::Result<usize> {
    let mut missed = 0;
    let n = rig.next_registration().await;
    let mark = with_api.map_or(0, |(_, api)| api.requests().len());
    let plugin = rig.spawn_with(devices, None, with_api.map_or(&[], |(args, _)| args), &[])?;
    rig.wait_registered(n, &plugin).await?;
    wait_all_healthy(rig, n, devices, &plugin).await?;
    if let Some((_, api)) = with_api {
        first_node_condition_since(api, mark).await?;
    }
    {
        let kubelet = rig.kubelet.lock().await;
        for i in 0..devices.min(want) {
            let id = uuid(i);
            match one_fault(rig, &kubelet, n, &id).await? {
                Some(took) => samples.push(took),
                None => missed += 1,
            }
        }
    }
    plugin.stop().await;
    Ok(missed)
}

/// Waits for a node condition patched after the API server's first `mark` requests: an instance started
/// then has built its API client.
pub(crate) async fn first_node_condition_since(
    api: &fake_kubelet::apiserver::FakeApiServer,
    mark: usize,
) -> anyhow::Result<()> {
    api.wait_for("this instance's first node condition", WAIT, |r| {
        r.iter()
            .skip(mark)
            .any(|r| r.method == "PATCH" && r.path.ends_with("/status"))
    })
    .await
    .map(|_| ())
    .map_err(anyhow::Error::msg)
}

/// Waits until the kubelet's list from registration `registration` on shows all `devices` GPUs Healthy.
pub(crate) async fn wait_all_healthy(
    rig: &Rig,
    registration: usize,
    devices: usize,
    plugin: &Plugin,
) -> anyhow::Result<()> {
    rig.kubelet
        .lock()
        .await
        .wait_list("every GPU listed healthy", WAIT, |l| {
            l.registration >= registration && l.allocatable() == devices
        })
        .await
        .with_context(|| {
            format!(
                "not all {devices} GPUs healthy at start; plugin log:\n{}",
                plugin.log()
            )
        })?;
    Ok(())
}
