//! Switching a live node from another device plugin to this one: the resource name and the device IDs (GPU
//! UUIDs) are the same, so the kubelet's record of which running container holds which GPU stays valid. The
//! plugin that was there is played by a minimal plugin of the shape NVIDIA's has at the API (a fixed socket
//! `nvidia-gpu.sock`, `nvidia.com/gpu`, GPU UUIDs as IDs, `NVIDIA_VISIBLE_DEVICES` from Allocate, no
//! PreStartContainer); the kubelet is the fake one, admitting containers as the device manager does.
//!
//! Also: the deploy manifests' own files (the base config file, the kind overlay's fake GPU list) load as the
//! DaemonSet uses them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use fake_kubelet::apiserver::FakeApiServer;
use fake_kubelet::{DeviceManager, FakeKubelet};
use gpu_device_plugin::api::device_plugin_server::{DevicePlugin, DevicePluginServer};
use gpu_device_plugin::api::registration_client::RegistrationClient;
use gpu_device_plugin::api::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, Device, DevicePluginOptions,
    Empty, ListAndWatchResponse, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse, RegisterRequest,
};
use gpu_device_plugin::sources::simulated::simulated_uuid;
use support::{PluginProcess, TestResult, WAIT};
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

const GPUS: usize = 8;
const NODE: &str = "gpu-node-1";
const RESOURCE: &str = "nvidia.com/gpu";

/// The plugin that was on the node before: serves the same GPUs under the same resource and IDs.
struct OtherPlugin {
    ids: Vec<String>,
    stop: CancellationToken,
}

type ListStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for OtherPlugin {
    type ListAndWatchStream = ListStream;

    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions::default()))
    }

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let list = ListAndWatchResponse {
            devices: self
                .ids
                .iter()
                .map(|id| Device {
                    id: id.clone(),
                    health: "Healthy".into(),
                    topology: None,
                })
                .collect(),
        };
        // One list, then open until the plugin stops (its stream then ends, as a process exiting ends it).
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let stop = self.stop.clone();
        tokio::spawn(async move {
            if tx.send(Ok(list)).await.is_ok() {
                stop.cancelled().await;
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Err(Status::unimplemented("not offered"))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let container_responses = request
            .into_inner()
            .container_requests
            .into_iter()
            .map(|c| ContainerAllocateResponse {
                envs: [(
                    "NVIDIA_VISIBLE_DEVICES".to_string(),
                    c.devices_ids.join(","),
                )]
                .into(),
                ..Default::default()
            })
            .collect();
        Ok(Response::new(AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// Serves the other plugin on `<dir>/nvidia-gpu.sock` and registers it; returns the token that stops it.
async fn start_other_plugin(
    dir: &Path,
    ids: Vec<String>,
) -> Result<CancellationToken, Box<dyn std::error::Error>> {
    let socket = dir.join("nvidia-gpu.sock");
    let _ = std::fs::remove_file(&socket);
    let listener = tokio::net::UnixListener::bind(&socket)?;
    let stop = CancellationToken::new();
    let service = DevicePluginServer::new(OtherPlugin {
        ids,
        stop: stop.clone(),
    });
    let shutdown = stop.clone();
    tokio::spawn(async move {
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
        let _ = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, shutdown.cancelled_owned())
            .await;
        let _ = std::fs::remove_file(socket);
    });
    let channel = gpu_device_plugin::util::uds::connect(&dir.join("kubelet.sock")).await?;
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: gpu_device_plugin::api::VERSION.into(),
            endpoint: "nvidia-gpu.sock".into(),
            resource_name: RESOURCE.into(),
            options: Some(DevicePluginOptions::default()),
        })
        .await?;
    Ok(stop)
}

fn visible(response: &AllocateResponse) -> Vec<String> {
    let mut ids: Vec<String> = response.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"]
        .split(',')
        .map(String::from)
        .collect();
    ids.sort();
    ids
}

/// The switch, in the order given: `overlap` starts ours before the other plugin stops (two DaemonSets'
/// pods side by side for a moment); otherwise the other plugin stops first.
async fn switch(manager: DeviceManager, overlap: bool) -> TestResult {
    let dir = tempfile::tempdir()?;
    let pod_resources = dir.path().join("pod-resources.sock");
    let mut kubelet = FakeKubelet::start_as(dir.path(), manager).await?;
    kubelet.serve_pod_resources(&pod_resources)?;
    let api = FakeApiServer::start().await?;
    api.add_node(NODE);
    api.add_pod("ml", "train-0");
    api.add_pod("web", "infer-0");
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let ids: Vec<String> = (0..GPUS).map(simulated_uuid).collect();

    // Before: the other plugin serves the node; two pods run on three of its GPUs.
    let other = start_other_plugin(dir.path(), ids.clone()).await?;
    kubelet
        .wait_list("the other plugin's 8 GPUs", WAIT, |l| {
            l.allocatable() == GPUS
        })
        .await?;
    let (train, response) = kubelet.admit("ml", "train-0", "trainer", 2).await?;
    assert_eq!(visible(&response), train);
    let (infer, _) = kubelet.admit("web", "infer-0", "server", 1).await?;
    let held: Vec<String> = train.iter().chain(&infer).cloned().collect();

    // The switch.
    let faults = dir.path().join("faults");
    let path = |p: &Path| p.to_string_lossy().into_owned();
    let (faults_arg, pods_arg, kubeconfig_arg) =
        (path(&faults), path(&pod_resources), path(&kubeconfig));
    let start_ours = || {
        PluginProcess::spawn_with_env(
            dir.path(),
            &[
                "--simulate",
                "8",
                "--simulate-events",
                &faults_arg,
                "--pod-resources-socket",
                &pods_arg,
                "--kubeconfig",
                &kubeconfig_arg,
            ],
            &[("NODE_NAME", OsStr::new(NODE))],
        )
    };
    let registrations_before = kubelet.registrations().len();
    let ours = if overlap {
        let ours = start_ours();
        kubelet
            .wait_list("this plugin's first list", WAIT, |l| {
                l.registration > registrations_before && l.messages >= 1
            })
            .await
            .map_err(|e| format!("{e}\n{}", ours.log()))?;
        other.cancel();
        // A kubelet up to 1.36 cuts ours off when the other's stream ends (ours then registers again); a newer
        // one only lets the other's client go.
        if manager == DeviceManager::Legacy {
            kubelet
                .wait_list("the other plugin's stream ended", WAIT, |l| {
                    l.cut_by_other >= 1
                })
                .await?;
        }
        ours
    } else {
        other.cancel();
        kubelet
            .wait_list("the other plugin gone", WAIT, |l| l.allocatable() == 0)
            .await?;
        start_ours()
    };
    let ours_registered = kubelet
        .wait_list("all 8 GPUs Healthy from this plugin", WAIT, |l| {
            l.allocatable() == GPUS
                && !l.disconnected
                && kubelet
                    .registrations()
                    .get(l.registration.saturating_sub(1))
                    .is_some_and(|r| r.endpoint.starts_with("gpu-device-plugin-"))
        })
        .await
        .map_err(|e| format!("{e}\n{}", ours.log()))?;
    assert_eq!(ours_registered.devices.len(), GPUS);

    // The running pods keep their GPUs: the kubelet's record is untouched, and this plugin's /status shows
    // them as the holders.
    let (_, status) = ours_status(&ours).await?;
    for id in &train {
        assert_eq!(holders(&status, id), ["ml/train-0 (trainer)"], "{status}");
    }
    assert_eq!(
        holders(&status, &infer[0]),
        ["web/infer-0 (server)"],
        "{status}"
    );

    // A new pod gets the five GPUs nobody holds, through this plugin; then there are none left.
    let (fresh, response) = kubelet
        .admit("ml", "train-1", "trainer", GPUS - held.len())
        .await?;
    assert_eq!(visible(&response), {
        let mut f = fresh.clone();
        f.sort();
        f
    });
    assert!(
        fresh.iter().all(|id| !held.contains(id)),
        "{fresh:?} overlaps {held:?}"
    );
    let none_left = kubelet
        .admit("ml", "train-2", "trainer", 1)
        .await
        .unwrap_err();
    assert_eq!(none_left.code(), tonic::Code::ResourceExhausted);

    // A GPU the running pod got from the other plugin fails: the kubelet sees it Unhealthy and the pod that
    // holds it is told, with the message.
    let failing = &train[0];
    support::append(&faults, &[format!("xid {failing} 79")]);
    kubelet
        .wait_list("the held GPU Unhealthy", WAIT, |l| {
            l.health(failing) == Some("Unhealthy")
        })
        .await?;
    let requests = api
        .wait_for("a Warning Event on the pod holding it", WAIT, |r| {
            r.iter().any(|r| {
                r.path == "/apis/events.k8s.io/v1/namespaces/ml/events"
                    && r.body["reason"] == "GPUUnhealthy"
                    && r.body["regarding"]["name"] == "train-0"
            })
        })
        .await
        .map_err(|e| format!("{e}\n{}", ours.log()))?;
    let event = requests
        .iter()
        .find(|r| {
            r.path.ends_with("/namespaces/ml/events") && r.body["regarding"]["name"] == "train-0"
        })
        .expect("found above");
    let note = event.body["note"].as_str().unwrap_or_default();
    assert!(
        note.contains(failing.as_str()) && note.contains("XID 79"),
        "{note}"
    );
    Ok(())
}

async fn ours_status(
    plugin: &PluginProcess,
) -> Result<(String, serde_json::Value), Box<dyn std::error::Error>> {
    let addr = plugin
        .http_addr()
        .await
        .ok_or("no HTTP address in the log")?;
    let (_, body) = gpu_device_plugin::http::get(&addr, "/status").await?;
    Ok((addr, serde_json::from_slice(&body)?))
}

fn holders(status: &serde_json::Value, id: &str) -> Vec<String> {
    status["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|d| d["id"] == id)
        .and_then(|d| d["pods"].as_array())
        .into_iter()
        .flatten()
        .map(|p| {
            format!(
                "{}/{} ({})",
                p["namespace"].as_str().unwrap_or(""),
                p["pod"].as_str().unwrap_or(""),
                p["container"].as_str().unwrap_or("")
            )
        })
        .collect()
}

#[tokio::test]
async fn taking_over_after_the_other_plugin_stopped_keeps_running_pods_and_serves_the_rest()
-> TestResult {
    switch(DeviceManager::Legacy, false).await
}

#[tokio::test]
async fn taking_over_side_by_side_on_a_kubelet_up_to_1_36_keeps_running_pods_and_serves_the_rest()
-> TestResult {
    // The other plugin's stream ending makes this kubelet disconnect the client in use, which is ours by
    // then: the plugin registers again and the node keeps its GPUs.
    switch(DeviceManager::Legacy, true).await
}

#[tokio::test]
async fn taking_over_side_by_side_on_a_newer_kubelet_keeps_running_pods_and_serves_the_rest()
-> TestResult {
    switch(DeviceManager::MultiClient, true).await
}

fn manifest(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("manifests")
        .join(path)
}

/// The DaemonSet's config file and the kind overlay's fake GPUs, as the kind e2e uses them: the plugin loads
/// both and lists those 8 GPUs.
#[tokio::test]
async fn the_manifests_config_file_and_fake_gpu_list_load() -> TestResult {
    let gpus = std::fs::read_to_string(manifest("overlays/kind-e2e/gpus.json"))?;
    let listed: serde_json::Value = serde_json::from_str(&gpus)?;
    let config = manifest("base/config.yaml");
    let node =
        support::NvmlNode::start(Some(&gpus), &["--config", &config.to_string_lossy()]).await?;
    let list = node
        .kubelet
        .wait_list("the 8 GPUs of the kind overlay", WAIT, |l| {
            l.allocatable() == GPUS
        })
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    let mut want: Vec<&str> = listed["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d["uuid"].as_str())
        .collect();
    want.sort_unstable();
    let mut got: Vec<&str> = list.devices.iter().map(|d| d.id.as_str()).collect();
    got.sort_unstable();
    assert_eq!(got, want);
    Ok(())
}

/// This plugin on 8 simulated GPUs on a kubelet up to 1.36, and another plugin of the resource that has
/// registered after it and so taken the resource.
struct TakenOver {
    kubelet: FakeKubelet,
    ours: PluginProcess,
    /// Cancelled to stop the other plugin (its socket removed, as a plugin that stops removes its own).
    other: CancellationToken,
    /// The registrations once the other plugin's was accepted.
    others: usize,
}

async fn taken_over(dir: &Path) -> Result<TakenOver, Box<dyn std::error::Error>> {
    let kubelet = FakeKubelet::start_as(dir, DeviceManager::Legacy).await?;
    let ours = PluginProcess::spawn(dir, &["--simulate", "8"]);
    kubelet
        .wait_list("this plugin's 8 GPUs", WAIT, |l| l.allocatable() == GPUS)
        .await
        .map_err(|e| format!("{e}\n{}", ours.log()))?;
    let before = kubelet.registrations().len();
    let other = start_other_plugin(dir, (0..GPUS).map(simulated_uuid).collect()).await?;
    kubelet
        .wait_list("the other plugin's list", WAIT, |l| {
            l.registration > before && l.messages >= 1
        })
        .await?;
    let others = kubelet.registrations().len();
    Ok(TakenOver {
        kubelet,
        ours,
        other,
        others,
    })
}

/// On a kubelet up to 1.36, another plugin of the resource that registers after this one becomes the
/// resource's only client, and this plugin's stream is left open. When the other plugin stops, the kubelet
/// drops its client and every GPU of the resource with it; nothing tells this plugin, whose stream is still
/// open, so it must see the other plugin's socket go and register again (seen on a real 1.36.2 kubelet:
/// 0 allocatable GPUs until the plugin was restarted).
#[tokio::test]
async fn another_plugin_of_the_resource_that_registers_after_this_one_and_stops_leaves_the_gpus_served()
-> TestResult {
    let dir = tempfile::tempdir()?;
    let TakenOver {
        kubelet,
        ours,
        other,
        others,
    } = taken_over(dir.path()).await?;

    other.cancel();
    let list = kubelet
        .wait_list("all 8 GPUs Healthy from this plugin again", WAIT, |l| {
            l.registration > others
                && l.allocatable() == GPUS
                && !l.disconnected
                && kubelet
                    .registrations()
                    .get(l.registration - 1)
                    .is_some_and(|r| r.endpoint.starts_with("gpu-device-plugin-"))
        })
        .await
        .map_err(|e| format!("{e}\n{}", ours.log()))?;
    assert_eq!(list.devices.len(), GPUS);
    Ok(())
}

/// Other plugins' sockets removed in a loop (a root process in the kubelet's directory) make this plugin
/// register again at most once a second, not once per removal, and it stays registered with its GPUs. Each
/// socket accepts a connection before it goes, as a plugin's does: one that never did would not count.
#[tokio::test]
async fn other_plugins_sockets_removed_in_a_loop_cost_at_most_a_registration_a_second() -> TestResult
{
    let dir = tempfile::tempdir()?;
    let kubelet = FakeKubelet::start_as(dir.path(), DeviceManager::Legacy).await?;
    let ours = PluginProcess::spawn(dir.path(), &["--simulate", "8"]);
    kubelet
        .wait_list("this plugin's 8 GPUs", WAIT, |l| l.allocatable() == GPUS)
        .await
        .map_err(|e| format!("{e}\n{}", ours.log()))?;
    let before = kubelet.registrations().len();
    let started = std::time::Instant::now();
    for i in 0..300 {
        let path = dir.path().join(format!("other-{i}.sock"));
        let listener = tokio::net::UnixListener::bind(&path)?;
        // The plugin's look at it.
        tokio::time::timeout(WAIT, listener.accept())
            .await
            .map_err(|_| format!("socket {i} never looked at\n{}", ours.log()))??;
        std::fs::remove_file(&path)?;
        drop(listener);
        // The removals spread over a second or more, each seen on its own.
        tokio::time::sleep(std::time::Duration::from_millis(3)).await;
    }
    // The last removal's registration, held back to a second after the one before, comes.
    kubelet
        .wait_registrations(before + 1, WAIT)
        .await
        .map_err(|e| format!("{e}\n{}", ours.log()))?;
    let list = kubelet
        .wait_list("all 8 GPUs Healthy from this plugin", WAIT, |l| {
            l.allocatable() == GPUS && !l.disconnected
        })
        .await?;
    assert_eq!(list.devices.len(), GPUS);
    let made = kubelet.registrations().len() - before;
    let allowed = started.elapsed().as_secs() as usize + 1;
    assert!(
        made <= allowed,
        "{made} registrations for 300 removals in {:?} (at most {allowed})\n{}",
        started.elapsed(),
        ours.log()
    );
    Ok(())
}

/// Records from now on whether the kubelet's list of the resource ever had fewer than `gpus` allocatable.
fn record_dips(kubelet: &FakeKubelet, gpus: usize) -> tokio::task::JoinHandle<bool> {
    let mut lists = kubelet.watch_list();
    tokio::spawn(async move {
        loop {
            if lists.borrow_and_update().allocatable() < gpus {
                return true;
            }
            if lists.changed().await.is_err() {
                return false;
            }
        }
    })
}

/// A socket bound and never listened on: it refuses every connection, as a plugin's never does once it
/// serves.
fn bound_not_listening(path: &Path) -> Result<std::os::fd::OwnedFd, Box<dyn std::error::Error>> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, bind, socket};
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::empty(),
        None,
    )?;
    bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &UnixAddr::new(path)?)?;
    Ok(fd)
}

/// Paths in the kubelet's directory that cannot have been a plugin (a regular file named `*.sock`, a
/// socket nobody listens on: the kubelet dials a plugin back before it accepts its registration) made and
/// removed every 0.1 s make no registration, and the GPUs stay Healthy throughout on a kubelet up to 1.36.
/// A socket that accepted a connection, as every plugin's does before it registers, still counts: its
/// removal, after the loop, makes exactly one.
#[tokio::test]
async fn sockets_that_cannot_have_been_a_plugin_made_and_removed_in_a_loop_make_no_registration()
-> TestResult {
    let dir = tempfile::tempdir()?;
    let kubelet = FakeKubelet::start_as(dir.path(), DeviceManager::Legacy).await?;
    let ours = PluginProcess::spawn(dir.path(), &["--simulate", "8"]);
    kubelet
        .wait_list("this plugin's 8 GPUs", WAIT, |l| l.allocatable() == GPUS)
        .await
        .map_err(|e| format!("{e}\n{}", ours.log()))?;
    let before = kubelet.registrations().len();
    let dips = record_dips(&kubelet, GPUS);
    for i in 0..30 {
        let file = dir.path().join(format!("x-{i}.sock"));
        std::fs::write(&file, b"")?;
        let quiet = dir.path().join(format!("quiet-{i}.sock"));
        let socket = bound_not_listening(&quiet)?;
        // The loop's pace, not a wait for anything.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        std::fs::remove_file(&file)?;
        std::fs::remove_file(&quiet)?;
        drop(socket);
    }
    // Every removal's registration would have come by now but the last's, held back to a second after the
    // one before.
    let during = kubelet.registrations().len() - before;
    assert_eq!(during, 0, "registrations during the loop\n{}", ours.log());
    // A socket that accepts: the plugin's look at it is the accept, and its removal makes one registration,
    // after every removal of the loop was seen.
    let accepting = dir.path().join("accepting.sock");
    let listener = tokio::net::UnixListener::bind(&accepting)?;
    tokio::time::timeout(WAIT, listener.accept())
        .await
        .map_err(|_| format!("the plugin never looked at a new socket\n{}", ours.log()))??;
    std::fs::remove_file(&accepting)?;
    drop(listener);
    kubelet
        .wait_registrations(before + 1, WAIT)
        .await
        .map_err(|e| format!("{e}\n{}", ours.log()))?;
    kubelet
        .wait_list("8 GPUs from the new registration", WAIT, |l| {
            l.registration == before + 1 && l.allocatable() == GPUS
        })
        .await?;
    dips.abort();
    let dipped = dips.await.unwrap_or(false);
    let made = kubelet.registrations().len() - before;
    assert_eq!(
        made,
        1,
        "registrations for the loop and one socket that accepted\n{}",
        ours.log()
    );
    assert!(
        !dipped,
        "the kubelet's list lost a GPU during the loop\n{}",
        ours.log()
    );
    Ok(())
}

/// Whether process `pid` is stopped (state `T` in `/proc/<pid>/stat`).
fn stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('T'))
        })
        .unwrap_or(false)
}

/// Waits, at most `WAIT`, for `done`, looking every 10 ms (what is waited for makes no event to wait on).
async fn until(what: &str, done: impl Fn() -> bool) -> Result<(), String> {
    let deadline = std::time::Instant::now() + WAIT;
    while !done() {
        if std::time::Instant::now() > deadline {
            return Err(format!("{what}: not within {WAIT:?}"));
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    Ok(())
}

/// On a kubelet up to 1.36, another plugin of the resource takes it from this one; then the socket
/// directory's inotify queue overflows (the plugin held stopped, as a process starved of the processor is,
/// while more events than the queue holds happen there), and the other plugin stops, its socket's removal
/// lost with the overflow. The plugin registers again within a few seconds of reading its queue: the GPUs
/// are served again, not left with the gone plugin.
#[tokio::test]
async fn another_plugins_exit_lost_in_an_inotify_overflow_still_leaves_the_gpus_served()
-> TestResult {
    let dir = tempfile::tempdir()?;
    let TakenOver {
        kubelet,
        ours,
        other,
        others,
    } = taken_over(dir.path()).await?;

    let pid = ours.child.id().ok_or("the plugin exited")?;
    ours.signal(nix::sys::signal::Signal::SIGSTOP);
    until("the plugin stopped", || stopped(pid)).await?;
    // More events than the queue holds: a file made and removed is four (create, open, close, delete).
    let queued: usize = std::fs::read_to_string("/proc/sys/fs/inotify/max_queued_events")?
        .trim()
        .parse()?;
    let flood = dir.path().join("flood");
    for i in 0..queued / 2 {
        let path = flood.with_file_name(format!("flood-{i}"));
        std::fs::write(&path, b"")?;
        std::fs::remove_file(&path)?;
    }
    other.cancel();
    let socket = dir.path().join("nvidia-gpu.sock");
    until("the other plugin's socket removed", || !socket.exists()).await?;
    kubelet
        .wait_list("the other plugin's client dropped", WAIT, |l| {
            l.disconnected
        })
        .await?;

    let resumed = std::time::Instant::now();
    ours.signal(nix::sys::signal::Signal::SIGCONT);
    let list = kubelet
        .wait_list("all 8 GPUs Healthy from this plugin again", WAIT, |l| {
            l.registration > others
                && l.allocatable() == GPUS
                && !l.disconnected
                && kubelet
                    .registrations()
                    .get(l.registration - 1)
                    .is_some_and(|r| r.endpoint.starts_with("gpu-device-plugin-"))
        })
        .await
        .map_err(|e| format!("{e}\n{}", ours.log()))?;
    assert_eq!(list.devices.len(), GPUS);
    assert!(
        resumed.elapsed() < std::time::Duration::from_secs(3),
        "served again {:?} after the plugin resumed\n{}",
        resumed.elapsed(),
        ours.log()
    );
    // The overflow did happen: the plugin says so.
    assert!(
        ours.log().contains("inotify queue overflowed"),
        "{}",
        ours.log()
    );
    Ok(())
}
