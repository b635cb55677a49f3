//! GPUs served through DRA: the real binary on simulated GPUs against the fake kubelet's DRA side and the
//! fake API server (claims, ResourceSlices), over real Unix sockets and HTTP.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use std::path::{Path, PathBuf};

use fake_kubelet::apiserver::{AllocationResult, FakeApiServer};
use fake_kubelet::dra::{Health, KubeletVersion, Pod, PodClaim};
use fake_kubelet::{DraKubelet, DraOptions};
use gpu_device_plugin::http;
use gpu_device_plugin::sources::simulated::simulated_uuid;
use hyper::StatusCode;
use serde_json::Value;
use support::{PluginProcess, TestResult, WAIT, append};

const NODE: &str = "gpu-node-1";
const DRIVER: &str = "gpu.nvidia.com";

/// A node with the plugin serving its simulated GPUs through DRA.
struct DraNode {
    api: FakeApiServer,
    kubelet: DraKubelet,
    plugin: PluginProcess,
    root: tempfile::TempDir,
    faults: PathBuf,
    state: PathBuf,
    args: Vec<String>,
}

impl DraNode {
    async fn start(gpus: usize, dra: &str) -> Result<DraNode, Box<dyn std::error::Error>> {
        Self::start_with(gpus, dra, |o| o, |_| {}).await
    }

    /// As [`DraNode::start`], with the fake kubelet's options changed by `options` and the API server set
    /// up by `api_setup` before the plugin starts.
    async fn start_with(
        gpus: usize,
        dra: &str,
        options: impl FnOnce(DraOptions) -> DraOptions,
        api_setup: impl FnOnce(&FakeApiServer),
    ) -> Result<DraNode, Box<dyn std::error::Error>> {
        Self::start_with_args(gpus, dra, options, api_setup, &[]).await
    }

    /// As [`DraNode::start_with`], with `extra` added to the plugin's command line.
    async fn start_with_args(
        gpus: usize,
        dra: &str,
        options: impl FnOnce(DraOptions) -> DraOptions,
        api_setup: impl FnOnce(&FakeApiServer),
        extra: &[&str],
    ) -> Result<DraNode, Box<dyn std::error::Error>> {
        let node = Self::launch(gpus, dra, options, api_setup, extra).await?;
        node.kubelet
            .wait_registered(DRIVER, WAIT)
            .await
            .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
        Ok(node)
    }

    /// As [`DraNode::start_with_args`], without waiting for the kubelet to register the plugin.
    async fn launch(
        gpus: usize,
        dra: &str,
        options: impl FnOnce(DraOptions) -> DraOptions,
        api_setup: impl FnOnce(&FakeApiServer),
        extra: &[&str],
    ) -> Result<DraNode, Box<dyn std::error::Error>> {
        let root = tempfile::tempdir()?;
        // With every GPU served through DRA the device plugin's directory is not needed: none is made.
        let device_plugins = (dra != "all").then_some("device-plugins");
        for dir in ["plugins_registry", "plugins"]
            .into_iter()
            .chain(device_plugins)
        {
            std::fs::create_dir_all(root.path().join(dir))?;
        }
        let api = FakeApiServer::start().await?;
        api.add_node(NODE);
        api_setup(&api);
        let kubeconfig = root.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig)?;
        let kubelet = DraKubelet::start_with(
            root.path(),
            options(
                DraOptions::default()
                    .api_server(&api, NODE)
                    .first_backoff(std::time::Duration::from_millis(50)),
            ),
        )?;
        let faults = root.path().join("faults");
        std::fs::write(&faults, "")?;
        let state = root.path().join("state");
        let path = |p: &Path| p.to_string_lossy().into_owned();
        // An empty `dra`: the setting comes from the config file the extra arguments name.
        let dra_flag = (!dra.is_empty()).then(|| ["--dra".to_string(), dra.to_string()]);
        let args = vec![
            "--simulate".to_string(),
            gpus.to_string(),
            "--simulate-events".into(),
            path(&faults),
        ]
        .into_iter()
        .chain(dra_flag.into_iter().flatten())
        .chain([
            "--kubeconfig".into(),
            path(&kubeconfig),
            "--node-name".into(),
            NODE.into(),
            "--kubelet-registrar-directory-path".into(),
            path(&root.path().join("plugins_registry")),
            "--kubelet-plugins-directory-path".into(),
            path(&root.path().join("plugins")),
            "--state-dir".into(),
            path(&state),
        ])
        .chain(extra.iter().map(|a| a.to_string()))
        .collect::<Vec<String>>();
        let plugin = spawn(root.path(), &args);
        let node = DraNode {
            api,
            kubelet,
            plugin,
            root,
            faults,
            state,
            args,
        };
        Ok(node)
    }

    fn inject(&self, line: String) {
        append(&self.faults, &[line]);
    }

    /// A pod `<name>-0` in `ml` whose container `main` uses the claim `<name>-gpu`, made in the API server
    /// and allocated `device`.
    fn pod_with_claim(&self, name: &str, device: &str) -> Pod {
        let claim = format!("{name}-gpu");
        let uid = self.api.add_claim(
            "ml",
            &claim,
            vec![AllocationResult::new("gpu", DRIVER, NODE, device)],
        );
        Pod::new("ml", &format!("{name}-0")).claim(
            PodClaim::new("gpu", &uid)
                .resource_claim(&claim)
                .used_by("main", "gpu"),
        )
    }

    /// Has the kubelet prepare `pod` and checks that its container `main` was given simulated GPU `gpu`.
    async fn prepared_with_gpu(&self, pod: &Pod, gpu: usize) -> TestResult {
        self.kubelet
            .prepare_pod(pod)
            .await
            .map_err(|e| format!("{e}\n{}", self.plugin.log()))?;
        assert_eq!(
            self.kubelet.cdi_devices(pod, "main"),
            vec![format!("nvidia.com/gpu={}", simulated_uuid(gpu))]
        );
        Ok(())
    }

    /// Stops the plugin (SIGTERM) and starts it again on the same state directory.
    async fn restart_plugin(&mut self) -> TestResult {
        self.plugin.signal(nix::sys::signal::Signal::SIGTERM);
        self.plugin
            .wait_exit(WAIT)
            .await
            .ok_or("the plugin did not stop")?;
        self.plugin = spawn(self.root.path(), &self.args);
        Ok(())
    }

    /// The devices of the node's slices, by name.
    async fn slice_devices(
        &self,
        what: &str,
        pred: impl Fn(&[Value]) -> bool,
    ) -> Result<Vec<Value>, String> {
        let devices_of = |slices: &[Value]| -> Vec<Value> {
            slices
                .iter()
                .filter(|s| s["spec"]["nodeName"] == NODE && s["spec"]["driver"] == DRIVER)
                .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
                .collect()
        };
        let slices = self
            .api
            .wait_for_slices(what, WAIT, |slices| pred(&devices_of(slices)))
            .await
            .map_err(|e| format!("{e}\n{}", self.plugin.log()))?;
        Ok(devices_of(&slices))
    }

    /// Waits until the slice gives device `name` a taint with `key`; returns the devices then, and the
    /// taint's value and effect.
    async fn slice_taint(
        &self,
        name: &str,
        key: &str,
    ) -> Result<(Vec<Value>, (Option<String>, Option<String>)), String> {
        let devices = self
            .slice_devices(&format!("{name} tainted {key}"), |d| {
                taint(d, name, key).is_some()
            })
            .await?;
        let found = taint(&devices, name, key).ok_or("taint")?;
        let value_and_effect = (
            found["value"].as_str().map(String::from),
            found["effect"].as_str().map(String::from),
        );
        Ok((devices, value_and_effect))
    }
}

fn spawn(root: &Path, args: &[String]) -> PluginProcess {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    PluginProcess::spawn(&root.join("device-plugins"), &args)
}

fn device<'a>(devices: &'a [Value], name: &str) -> Option<&'a Value> {
    devices.iter().find(|d| d["name"] == name)
}

/// The taint with `key` of device `name`, if it has one.
fn taint<'a>(devices: &'a [Value], name: &str, key: &str) -> Option<&'a Value> {
    device(devices, name)?["taints"]
        .as_array()?
        .iter()
        .find(|t| t["key"] == key)
}

/// The one resource of the pod's status for container `main`.
fn pod_resource(status: &Value) -> Option<&Value> {
    status.as_array()?.iter().find(|c| c["name"] == "main")?["allocatedResourcesStatus"]
        .as_array()?
        .first()?["resources"]
        .as_array()?
        .first()
}

fn training_pod(claim_uid: &str) -> Pod {
    Pod::new("ml", "train-0").claim(
        PodClaim::new("gpu", claim_uid)
            .resource_claim("train-gpu")
            .used_by("main", "gpu"),
    )
}

#[tokio::test]
async fn a_fault_on_a_claimed_gpu_reaches_the_pods_status_an_event_on_the_pod_its_slice_taint_and_all_clear_on_recovery()
-> TestResult {
    let node = DraNode::start(4, "all").await?;
    let devices = node
        .slice_devices("every GPU published", |d| d.len() == 4)
        .await?;
    let gpu1 = device(&devices, "gpu-1").ok_or("gpu-1 published")?;
    assert_eq!(gpu1["attributes"]["type"]["string"], "gpu");
    assert_eq!(gpu1["attributes"]["uuid"]["string"], simulated_uuid(1));
    assert_eq!(
        gpu1["attributes"]["productName"]["string"],
        "NVIDIA H100 80GB HBM3"
    );
    assert!(
        gpu1.get("taints").is_none(),
        "a Healthy GPU carries no taint"
    );

    let uid = node.api.add_claim(
        "ml",
        "train-gpu",
        vec![AllocationResult::new("gpu", DRIVER, NODE, "gpu-1")],
    );
    // The scheduler reserves the claim for the pod before the kubelet prepares it.
    let pod_uid = node.api.add_pod("ml", "train-0");
    assert!(
        node.api
            .reserve_claim("ml", "train-gpu", "train-0", &pod_uid)
    );
    let pod = training_pod(&uid);
    node.kubelet
        .prepare_pod(&pod)
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    let cdi = node.kubelet.cdi_devices(&pod, "main");
    assert_eq!(cdi, vec![format!("nvidia.com/gpu={}", simulated_uuid(1))]);
    let healthy = node
        .kubelet
        .wait_allocated_resources_status(&pod, "the claimed GPU Healthy", WAIT, |s| {
            pod_resource(s).is_some_and(|r| r["health"] == "Healthy")
        })
        .await?;
    assert_eq!(
        pod_resource(&healthy).map(|r| r["resourceID"].clone()),
        Some(Value::String(format!(
            "nvidia.com/gpu={}",
            simulated_uuid(1)
        ))),
        "the pod status names the GPU by its UUID"
    );

    node.inject(format!("xid {} 79", simulated_uuid(1)));
    let faulted = node
        .kubelet
        .wait_allocated_resources_status(&pod, "the fault in the pod's status", WAIT, |s| {
            pod_resource(s).is_some_and(|r| r["health"] == "Unhealthy")
        })
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    let message = pod_resource(&faulted)
        .and_then(|r| r["message"].as_str())
        .ok_or("a message")?
        .to_string();
    assert!(message.contains("XID 79"), "{message}");
    assert!(message.chars().count() <= 1024, "{message}");
    // `kubectl describe pod` shows it too: a Warning Event on the pod, naming the claim.
    let note = pod_event(&node, "GPUUnhealthy").await?;
    assert_eq!(note["regarding"]["uid"], pod_uid.as_str());
    let text = note["note"].as_str().unwrap_or_default();
    assert!(
        text.contains("used by claim train-gpu") && text.contains("XID 79"),
        "{text}"
    );

    let (tainted, xid) = node.slice_taint("gpu-1", "gpu.nvidia.com/xid").await?;
    assert_eq!(xid, (Some("79".into()), Some("NoSchedule".into())));
    assert!(
        taint(&tainted, "gpu-0", "gpu.nvidia.com/xid").is_none(),
        "only the GPU at fault"
    );

    // Another claim given the faulted GPU now is refused with the reason.
    let late = node.api.add_claim(
        "ml",
        "late-gpu",
        vec![AllocationResult::new("gpu", DRIVER, NODE, "gpu-1")],
    );
    let late_pod = Pod::new("ml", "late-0").claim(
        PodClaim::new("gpu", &late)
            .resource_claim("late-gpu")
            .used_by("main", "gpu"),
    );
    let refused = node
        .kubelet
        .prepare_pod(&late_pod)
        .await
        .err()
        .ok_or("refused")?;
    assert!(refused.to_string().contains("Unhealthy"), "{refused}");

    // The driver resets the GPU: recovery reaches the pod status and the taint goes.
    node.inject(format!("action {} 1", simulated_uuid(1)));
    node.inject(format!("action {} 0", simulated_uuid(1)));
    node.kubelet
        .wait_allocated_resources_status(&pod, "recovery in the pod's status", WAIT, |s| {
            pod_resource(s).is_some_and(|r| r["health"] == "Healthy")
        })
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    node.slice_devices("gpu-1's taint removed", |d| {
        device(d, "gpu-1").is_some_and(|g| g.get("taints").is_none())
    })
    .await?;
    let back = pod_event(&node, "GPURecovered").await?;
    assert!(
        back["note"]
            .as_str()
            .is_some_and(|n| n.contains("used by claim train-gpu: Healthy again")),
        "{back}"
    );
    Ok(())
}

#[tokio::test]
async fn deleted_dra_sockets_are_bound_again_and_the_kubelet_registers_the_plugin_again()
-> TestResult {
    let node = DraNode::start(1, "all").await?;
    let registered = |a: &Vec<fake_kubelet::dra::RegistrationAttempt>| {
        a.iter()
            .filter(|a| matches!(a.outcome, fake_kubelet::dra::Outcome::Registered(_)))
            .count()
    };
    // The first registration counted once it is done: the kubelet records an attempt after telling the
    // plugin, which is after `start` saw the driver registered.
    let before = registered(
        &node
            .kubelet
            .wait_attempts("the first registration", WAIT, |a| registered(a) > 0)
            .await?,
    );
    // Someone cleans the kubelet's directories up under the running plugin.
    let plugins = node
        .root
        .path()
        .join("plugins")
        .join(DRIVER)
        .join("dra.sock");
    let registry = node
        .root
        .path()
        .join("plugins_registry")
        .join(format!("{DRIVER}-reg.sock"));
    std::fs::remove_file(&plugins)?;
    std::fs::remove_file(&registry)?;
    node.kubelet
        .wait_attempts("the plugin registered again", WAIT, |a| {
            registered(a) > before
        })
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    // Said in the log (which reaches the test through a pipe of its own, maybe after the registration).
    node.plugin
        .wait_log(WAIT, |l| l.contains("DRA socket was gone: bound again"))
        .await
        .ok_or("the rebinding is logged")?;
    // The kubelet reaches the plugin through the new sockets.
    node.prepared_with_gpu(&node.pod_with_claim("train", "gpu-0"), 0)
        .await?;
    // Its plugin watcher, told of each socket before the registration that followed, saw nothing it could
    // not look at (a temporary socket renamed in its sight is an error line in the kubelet's log).
    assert_eq!(node.kubelet.watcher_errors(), Vec::<String>::new());
    // Both sockets, the registration's through its relay, hold a bounded number of requests per client.
    for socket in [&plugins, &registry] {
        assert_eq!(
            support::advertised_max_streams(socket).await?,
            Some(gpu_device_plugin::util::bounded::KUBELET_SOCKET_STREAMS),
            "{}",
            socket.display()
        );
    }
    Ok(())
}

/// `dra.sock` and the registration socket replaced in one rename by a FIFO, a file, a dead socket or a
/// dangling link are bound again at once, as a deleted one is: before, the plugin said "another process has
/// bound…" and never bound them again (still gone 33 s later), so the kubelet could neither call the driver
/// nor register it again.
#[tokio::test]
async fn dra_sockets_replaced_by_a_fifo_a_file_a_dead_socket_or_a_dangling_link_are_bound_again()
-> TestResult {
    use std::os::unix::fs::FileTypeExt as _;
    let node = DraNode::start(1, "all").await?;
    let sockets = [
        node.root
            .path()
            .join("plugins")
            .join(DRIVER)
            .join("dra.sock"),
        node.root
            .path()
            .join("plugins_registry")
            .join(format!("{DRIVER}-reg.sock")),
    ];
    for kind in ["fifo", "file", "dead socket", "dangling link"] {
        for socket in &sockets {
            // Made out of the watched directories, then renamed over the socket.
            let made = node.root.path().join("replacement");
            match kind {
                "fifo" => rustix::fs::mknodat(
                    rustix::fs::CWD,
                    &made,
                    rustix::fs::FileType::Fifo,
                    rustix::fs::Mode::from_raw_mode(0o600),
                    0,
                )?,
                "file" => std::fs::write(&made, "not a socket")?,
                "dead socket" => drop(std::os::unix::net::UnixListener::bind(&made)?),
                _ => std::os::unix::fs::symlink(node.root.path().join("nowhere"), &made)?,
            }
            std::fs::rename(&made, socket)?;
            let deadline = std::time::Instant::now() + WAIT;
            loop {
                let bound = std::fs::symlink_metadata(socket)
                    .is_ok_and(|m| m.file_type().is_socket())
                    && std::os::unix::net::UnixStream::connect(socket).is_ok();
                if bound {
                    break;
                }
                if std::time::Instant::now() > deadline {
                    return Err(format!(
                        "{} replaced by a {kind} was not bound again\n{}",
                        socket.display(),
                        node.plugin.log()
                    )
                    .into());
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    }
    node.plugin
        .wait_log(WAIT, |l| {
            l.contains("DRA socket was replaced by a FIFO: bound again")
        })
        .await
        .ok_or("the rebinding is said")?;
    // The kubelet reaches the driver through the new DRA socket.
    node.prepared_with_gpu(&node.pod_with_claim("train", "gpu-0"), 0)
        .await?;
    Ok(())
}

/// Someone cleans up the kubelet's directories more thoroughly than deleting sockets: the driver's directory
/// moved away with its socket, the registration's directory replaced by a file. The plugin makes the
/// directory again and binds its socket there at once (not at the 30 s check), watches the new directory,
/// says why while it cannot, and keeps running throughout; the kubelet prepares through the new socket.
#[tokio::test]
async fn replaced_socket_directories_are_made_again_and_watched_and_the_plugin_keeps_serving()
-> TestResult {
    let mut node = DraNode::start(1, "all").await?;
    let root = node.root.path().to_path_buf();
    let driver_dir = root.join("plugins").join(DRIVER);
    let socket = driver_dir.join("dra.sock");
    let rebound =
        |n: usize| move |log: &str| log.matches("DRA socket was gone: bound again").count() >= n;
    let is_socket = |p: &Path| {
        use std::os::unix::fs::FileTypeExt as _;
        std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket())
    };

    std::fs::rename(&driver_dir, root.join("plugins").join("moved"))?;
    node.plugin
        .wait_log(WAIT, rebound(1))
        .await
        .ok_or_else(|| format!("not bound again in a new directory\n{}", node.plugin.log()))?;
    assert!(is_socket(&socket), "{} is not a socket", socket.display());
    // The new directory is the one watched: a socket deleted there is bound again at once.
    node.plugin
        .wait_log(WAIT, |l| l.contains("watching the new one"))
        .await
        .ok_or_else(|| format!("the new directory is not watched\n{}", node.plugin.log()))?;
    std::fs::remove_file(&socket)?;
    node.plugin
        .wait_log(WAIT, rebound(2))
        .await
        .ok_or_else(|| {
            format!(
                "not bound again in the new directory\n{}",
                node.plugin.log()
            )
        })?;
    assert!(is_socket(&socket));
    // The kubelet reaches the plugin through it.
    node.prepared_with_gpu(&node.pod_with_claim("train", "gpu-0"), 0)
        .await?;

    // The registration's directory and a file swapped in one step: nothing can be bound there.
    let registry = root.join("plugins_registry");
    let blocker = root.join("blocker");
    std::fs::write(&blocker, "not a directory")?;
    rustix::fs::renameat_with(
        rustix::fs::CWD,
        &registry,
        rustix::fs::CWD,
        &blocker,
        rustix::fs::RenameFlags::EXCHANGE,
    )?;
    node.plugin
        .wait_log(WAIT, |l| l.contains("cannot bind the DRA socket again"))
        .await
        .ok_or_else(|| format!("the failure is not said\n{}", node.plugin.log()))?;
    // The file gone, the directory is made again and the socket bound in it; the process never stopped.
    std::fs::remove_file(&registry)?;
    node.plugin
        .wait_log(WAIT, rebound(3))
        .await
        .ok_or_else(|| format!("not bound again after the file went\n{}", node.plugin.log()))?;
    assert!(is_socket(&registry.join(format!("{DRIVER}-reg.sock"))));
    assert!(
        node.plugin.child.try_wait()?.is_none(),
        "the plugin stopped:\n{}",
        node.plugin.log()
    );

    Ok(())
}

/// The ResourceSlices' watch waits out a quiet node: it is not cut by the 15 s timeout of the plugin's API
/// calls (which made it fail, warn and list the slices again every 15 s on a node without news).
#[tokio::test]
async fn the_slices_watch_outlasts_a_quiet_spell_longer_than_the_call_timeout() -> TestResult {
    let node = DraNode::start(1, "all").await?;
    node.slice_devices("the GPU published", |d| d.len() == 1)
        .await?;
    let watches = |requests: &[fake_kubelet::apiserver::Recorded]| {
        requests
            .iter()
            .filter(|r| {
                r.method == "GET"
                    && r.path.ends_with("/resourceslices")
                    && r.query.contains("watch=true")
            })
            .count()
    };
    // The watch begins after the list the first write was made from.
    node.api
        .wait_for("the slices watched", WAIT, |r| watches(r) == 1)
        .await?;
    // Nothing happens on the node for longer than the call timeout.
    let again = node
        .api
        .wait_for("a second watch", WAIT, |r| watches(r) > 1)
        .await;
    assert!(
        again.is_err(),
        "the watch was made again on a quiet node:\n{}",
        node.plugin.log()
    );
    assert!(
        !node
            .plugin
            .log()
            .contains("cannot watch this node's ResourceSlices"),
        "{}",
        node.plugin.log()
    );
    Ok(())
}

/// A flood of connections to the DRA socket that never send anything, or a few bytes and then nothing: no
/// more than the cap are held at once (the oldest silent one is closed past it), each is closed within 10 s, and the kubelet's connection, which
/// speaks, keeps its place: its health stream carries a fault meanwhile, and the descriptors are given back.
#[tokio::test]
async fn silent_connections_to_the_dra_socket_are_capped_and_closed_and_the_kubelets_stays()
-> TestResult {
    let node = DraNode::start(1, "all").await?;
    node.kubelet
        .wait_device_health((DRIVER, NODE, "gpu-0"), WAIT, |h| {
            h.health == Health::Healthy
        })
        .await?;
    let fds_before = node.plugin.open_files().ok_or("no /proc fd count")?;
    let socket = node
        .root
        .path()
        .join("plugins")
        .join(DRIVER)
        .join("dra.sock");
    let mut silent = Vec::new();
    for n in 0..150 {
        let mut connection = tokio::net::UnixStream::connect(&socket).await?;
        // Half of them say a few bytes of the HTTP/2 preface and stop: not yet a client.
        if n % 2 == 0 {
            use tokio::io::AsyncWriteExt as _;
            connection.write_all(b"PRI * ").await?;
        }
        silent.push(connection);
    }
    node.inject(format!("xid {} 79", simulated_uuid(0)));
    node.kubelet
        .wait_device_health((DRIVER, NODE, "gpu-0"), WAIT, |h| {
            h.health == Health::Unhealthy
        })
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    // Every silent one is closed by the plugin, and the descriptors given back.
    support::all_closed_by(&node.plugin, &mut silent, fds_before).await?;
    // The kubelet's health stream was never cut.
    let streams = node.kubelet.health_streams();
    assert!(
        !streams
            .iter()
            .any(|s| matches!(s.event, fake_kubelet::dra::StreamEvent::Ended(_))),
        "{streams:?}"
    );
    // Each one closed is counted, and only those.
    let addr = node.plugin.http_addr().await.ok_or("HTTP address")?;
    let (_, metrics) = http::get(&addr, "/metrics").await?;
    let metrics = String::from_utf8_lossy(&metrics);
    let line = "gpu_device_plugin_socket_connections_evicted_total{socket=\"DRA socket\"} 150";
    assert!(metrics.contains(line), "{line} not in\n{metrics}");
    Ok(())
}

/// A rolling update with the sockets named after each pod (kubelets 1.33+): the new pod registers beside
/// the old one on the same state directory, the kubelet calls the newest, and claims prepared by either are
/// unprepared by the other; once the old pod stops, the new one serves alone, its health stream included.
#[tokio::test]
async fn two_pods_of_a_rolling_update_serve_side_by_side_from_one_record() -> TestResult {
    let node =
        DraNode::start_with_args(2, "all", |o| o, |_| {}, &["--dra-pod-uid", "0ld-pod"]).await?;
    let plugins = node.root.path().join("plugins").join(DRIVER);
    assert!(plugins.join("dra-0ld-pod.sock").exists());
    let train_pod = node.pod_with_claim("train", "gpu-0");
    node.kubelet
        .prepare_pod(&train_pod)
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;

    // The new pod, on the same node and state directory, under its own names.
    let mut args = node.args.clone();
    let at = args
        .iter()
        .position(|a| a == "0ld-pod")
        .ok_or("the old pod's UID")?;
    args[at] = "new-pod".into();
    let mut new = spawn(node.root.path(), &args);
    node.kubelet
        .wait_attempts("both pods registered", WAIT, |a| {
            a.iter()
                .filter(|a| matches!(a.outcome, fake_kubelet::dra::Outcome::Registered(_)))
                .count()
                >= 2
        })
        .await
        .map_err(|e| format!("{e}\n{}", new.log()))?;
    assert!(plugins.join("dra-new-pod.sock").exists());
    // The kubelet calls the newest: the old pod's claim is unprepared there, from the shared record.
    let errors = node
        .kubelet
        .end_pod(&train_pod)
        .await
        .map_err(|e| format!("{e}\n{}", new.log()))?;
    assert!(errors.is_empty(), "{errors:?}");
    assert!(
        new.log().contains("unprepared"),
        "the new pod did not unprepare it:\n{}",
        new.log()
    );
    // The device is free again for another claim, prepared by the new pod.
    let serve_pod = node.pod_with_claim("serve", "gpu-0");
    node.kubelet
        .prepare_pod(&serve_pod)
        .await
        .map_err(|e| format!("{e}\n{}", new.log()))?;

    // The old pod stops (its sockets with it); the new one serves alone, and a fault reaches the pod.
    node.plugin.signal(nix::sys::signal::Signal::SIGTERM);
    let mut old = node.plugin;
    old.wait_exit(WAIT)
        .await
        .ok_or("the old pod did not stop")?;
    assert!(!plugins.join("dra-0ld-pod.sock").exists());
    append(&node.faults, &[format!("xid {} 79", simulated_uuid(0))]);
    node.kubelet
        .wait_device_health((DRIVER, NODE, "gpu-0"), WAIT, |h| {
            h.health == Health::Unhealthy
        })
        .await
        .map_err(|e| format!("{e}\n{}", new.log()))?;
    let errors = node
        .kubelet
        .end_pod(&serve_pod)
        .await
        .map_err(|e| format!("{e}\n{}", new.log()))?;
    assert!(errors.is_empty(), "{errors:?}");
    new.signal(nix::sys::signal::Signal::SIGTERM);
    new.wait_exit(WAIT)
        .await
        .ok_or("the new pod did not stop")?;
    Ok(())
}

/// The two pods of a rolling update each hear of faults for themselves, and may differ (a fault seen by one
/// first, a fence set on one pod alone): only one writes the node's ResourceSlices at a time, the other
/// waiting for it to stop, instead of both rewriting each other's.
#[tokio::test]
async fn of_the_two_pods_of_a_rolling_update_one_writes_the_slices_until_it_stops() -> TestResult {
    let node =
        DraNode::start_with_args(2, "all", |o| o, |_| {}, &["--dra-pod-uid", "0ld-pod"]).await?;
    node.slice_devices("both GPUs published", |d| d.len() == 2)
        .await?;
    // The new pod, on the same state directory, with a fault file of its own: it hears of a fault the old
    // pod does not.
    let new_faults = node.root.path().join("new-faults");
    std::fs::write(&new_faults, "")?;
    let old_faults = node.faults.to_string_lossy().into_owned();
    let args: Vec<String> = node
        .args
        .iter()
        .map(|a| match a.as_str() {
            "0ld-pod" => "new-pod".to_string(),
            a if a == old_faults => new_faults.to_string_lossy().into_owned(),
            a => a.to_string(),
        })
        .collect();
    let mut new = spawn(node.root.path(), &args);
    new.wait_log(WAIT, |l| l.contains("writes them once it stops"))
        .await
        .ok_or_else(|| format!("the new pod does not wait for the slices\n{}", new.log()))?;
    append(&new_faults, &[format!("xid {} 79", simulated_uuid(0))]);
    new.wait_log(WAIT, |l| l.contains("device health changed"))
        .await
        .ok_or("the new pod heard of the fault")?;
    let tainted = |r: &[fake_kubelet::apiserver::Recorded]| {
        r.iter().any(|r| {
            r.path.contains("resourceslices") && r.body["spec"].to_string().contains("taints")
        })
    };
    let written = node
        .api
        .wait_for(
            "a taint written",
            std::time::Duration::from_secs(1),
            tainted,
        )
        .await;
    assert!(
        written.is_err(),
        "the new pod wrote the slices while the old one runs"
    );
    // The old pod stops: the new one writes the slices, with its fault, at once.
    node.plugin.signal(nix::sys::signal::Signal::SIGTERM);
    let mut old = node.plugin;
    old.wait_exit(WAIT)
        .await
        .ok_or("the old pod did not stop")?;
    node.api
        .wait_for("the new pod's taint written", WAIT, tainted)
        .await
        .map_err(|e| format!("{e}\n{}", new.log()))?;
    new.signal(nix::sys::signal::Signal::SIGTERM);
    new.wait_exit(WAIT)
        .await
        .ok_or("the new pod did not stop")?;
    Ok(())
}

/// The new pod of a rolling update beside `node`'s (started with `--dra-pod-uid 0ld-pod`), on the same state
/// directory under its own UID, once the kubelet has its health stream's first report.
async fn new_pod_streaming(node: &DraNode) -> Result<PluginProcess, String> {
    let args: Vec<String> = node
        .args
        .iter()
        .map(|a| {
            if a == "0ld-pod" {
                "new-pod".to_string()
            } else {
                a.clone()
            }
        })
        .collect();
    let new = spawn(node.root.path(), &args);
    let endpoint = node
        .root
        .path()
        .join("plugins")
        .join(DRIVER)
        .join("dra-new-pod.sock");
    node.kubelet
        .wait_health_streams("the new pod's stream", WAIT, |events| {
            events.iter().any(|e| {
                e.endpoint == endpoint
                    && matches!(e.event, fake_kubelet::dra::StreamEvent::Report(_))
            })
        })
        .await
        .map_err(|e| format!("{e}\n{}", new.log()))?;
    Ok(new)
}

/// The kubelet forgets a driver's whole health when one of its instances' streams ends: at the end of a
/// rolling update, the old pod's stop takes the new pod's reports with it. The new pod sends its list again
/// as soon as the old one is gone, so a faulty GPU's pod shows the fault again at once, not one heartbeat
/// (10 s) later.
#[tokio::test]
async fn at_the_end_of_a_rolling_update_the_new_pod_tells_the_kubelet_its_health_again()
-> TestResult {
    let node =
        DraNode::start_with_args(2, "all", |o| o, |_| {}, &["--dra-pod-uid", "0ld-pod"]).await?;
    node.inject(format!("xid {} 79", simulated_uuid(0)));
    node.kubelet
        .wait_device_health((DRIVER, NODE, "gpu-0"), WAIT, |h| {
            h.health == Health::Unhealthy
        })
        .await?;
    let mut new = new_pod_streaming(&node).await?;
    // The new pod has the fault too (from the checkpoint the old one wrote).
    node.kubelet
        .wait_device_health((DRIVER, NODE, "gpu-0"), WAIT, |h| {
            h.health == Health::Unhealthy
        })
        .await?;

    let stopping = std::time::Instant::now();
    node.plugin.signal(nix::sys::signal::Signal::SIGTERM);
    let mut old = node.plugin;
    old.wait_exit(WAIT)
        .await
        .ok_or("the old pod did not stop")?;
    // Well within the new pod's heartbeat: its list came at once, after the old pod's stream had ended.
    gpu0_unhealthy_again_after(&node.kubelet, stopping, &new, "the old pod stopped").await?;
    new.signal(nix::sys::signal::Signal::SIGTERM);
    new.wait_exit(WAIT)
        .await
        .ok_or("the new pod did not stop")?;
    Ok(())
}

/// A new pod that fails beside the old one (a bad rollout, killed over and over): each time its stream ends
/// the kubelet forgets the driver's health, the old pod's reports with it. While another instance serves
/// beside it, the old pod sends its list every second, so the GPUs' health is back within a second, not one
/// heartbeat (10 s) later.
#[tokio::test]
async fn a_new_pod_that_dies_beside_the_old_one_costs_the_kubelet_its_health_for_a_second_at_most()
-> TestResult {
    let node =
        DraNode::start_with_args(2, "all", |o| o, |_| {}, &["--dra-pod-uid", "0ld-pod"]).await?;
    let mut new = new_pod_streaming(&node).await?;
    // A fault both pods hear of: each sends it, and the old pod's next heartbeat would be 10 s away.
    node.inject(format!("xid {} 79", simulated_uuid(0)));
    node.kubelet
        .wait_device_health((DRIVER, NODE, "gpu-0"), WAIT, |h| {
            h.health == Health::Unhealthy
        })
        .await?;
    new.wait_log(WAIT, |l| l.contains("device health changed"))
        .await
        .ok_or("the new pod heard of the fault")?;
    node.plugin
        .wait_log(WAIT, |l| {
            l.contains("another instance of the driver serves")
        })
        .await
        .ok_or("the old pod did not see the new one")?;

    let killed = std::time::Instant::now();
    new.signal(nix::sys::signal::Signal::SIGKILL);
    new.wait_exit(WAIT).await.ok_or("the new pod did not die")?;
    gpu0_unhealthy_again_after(&node.kubelet, killed, &node.plugin, "the new pod died").await
}

/// Waits up to 5 s (within a heartbeat) for the kubelet to show GPU 0 Unhealthy with XID 79 from a report it
/// took after `after` (when `what` happened and the kubelet forgot the driver's health); `sender`'s log
/// goes with a failure.
async fn gpu0_unhealthy_again_after(
    kubelet: &DraKubelet,
    after: std::time::Instant,
    sender: &PluginProcess,
    what: &str,
) -> TestResult {
    // A report from after it: until the kubelet takes in the stream's end, it still shows the one before.
    let (health, _since) = kubelet
        .wait_device_health_since(
            (DRIVER, NODE, "gpu-0"),
            std::time::Duration::from_secs(5),
            |h, since| h.health == Health::Unhealthy && since.is_some_and(|since| since > after),
        )
        .await
        .map_err(|e| {
            format!(
                "no report of GPU 0 Unhealthy taken after {what} ({e}): the health shown is from before, or \
                 none\n{}",
                sender.log()
            )
        })?;
    assert!(health.message.contains("79"), "{health:?}");
    Ok(())
}

/// One GPU shared by two pods through one ResourceClaim (DRA's way to share a device between pods): both get
/// the same GPU, a fault reaches both pods' status, and the claim stays prepared until the last pod ends.
#[tokio::test]
async fn a_claim_shared_by_two_pods_gives_both_the_gpu_and_its_fault() -> TestResult {
    let node = DraNode::start(1, "all").await?;
    let first = node.pod_with_claim("shared", "gpu-0");
    let uid = first.claims[0].uid.clone();
    let second = Pod::new("ml", "shared-1").claim(
        PodClaim::new("gpu", &uid)
            .resource_claim("shared-gpu")
            .used_by("main", "gpu"),
    );
    node.prepared_with_gpu(&first, 0).await?;
    node.prepared_with_gpu(&second, 0).await?;
    node.inject(format!("xid {} 79", simulated_uuid(0)));
    for pod in [&first, &second] {
        node.kubelet
            .wait_allocated_resources_status(pod, "the fault", WAIT, |s| {
                pod_resource(s).is_some_and(|r| r["health"] == "Unhealthy")
            })
            .await?;
    }
    // The first pod ends: the claim stays prepared for the second; then the second ends and it goes.
    assert!(node.kubelet.end_pod(&first).await?.is_empty());
    assert!(node.kubelet.prepared(&uid).is_some());
    assert!(node.kubelet.end_pod(&second).await?.is_empty());
    assert!(node.kubelet.prepared(&uid).is_none());
    assert!(
        node.plugin.log().contains("unprepared"),
        "{}",
        node.plugin.log()
    );
    Ok(())
}

/// A claim written for NVIDIA's DRA driver that asks for MPS through its `GpuConfig`: this plugin does not
/// serve MPS, so the pod does not start, with what to change, instead of getting a GPU without it; a claim
/// whose configuration asks for nothing to be done (time-slicing at the GPU's default) gets the same GPU.
#[tokio::test]
async fn a_claim_asking_for_mps_is_refused_with_what_to_change_and_one_asking_nothing_is_served()
-> TestResult {
    let node = DraNode::start(1, "all").await?;
    let gpu_config = |source: &str, sharing: Value| {
        serde_json::json!({"source": source, "requests": [], "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": sharing}}})
    };
    let mps = node.pod_with_claim("mps", "gpu-0");
    assert!(node.api.configure_claim(
        "ml",
        "mps-gpu",
        vec![gpu_config(
            "FromClaim",
            serde_json::json!({"strategy": "MPS"})
        )]
    ));
    let why = node
        .kubelet
        .prepare_pod(&mps)
        .await
        .expect_err("MPS is not served")
        .to_string();
    assert!(
        why.contains("has a GpuConfig that asks for MPS") && why.contains("change the claim"),
        "{why}"
    );
    // The DeviceClass asks for MPS, the claim for time-slicing at the default: the claim's wins.
    let shared = node.pod_with_claim("shared", "gpu-0");
    assert!(node.api.configure_claim(
        "ml",
        "shared-gpu",
        vec![
            gpu_config("FromClass", serde_json::json!({"strategy": "MPS"})),
            gpu_config(
                "FromClaim",
                serde_json::json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Default"}})
            ),
        ]
    ));
    node.prepared_with_gpu(&shared, 0).await?;
    Ok(())
}

/// A claim's value echoed in its refusal reaches the kubelet escaped and cut to a few kilobytes: a megabyte
/// echoed whole made the kubelet's answer a megabyte a claim (past 4 MiB its read fails with
/// RESOURCE_EXHAUSTED instead of the reason).
#[tokio::test]
async fn a_huge_claim_value_echoed_in_a_refusal_reaches_the_kubelet_escaped_and_small() -> TestResult
{
    let node = DraNode::start(1, "all").await?;
    let strategy = format!("\u{202E}{}\n", "x".repeat(600 * 1024));
    let pod = node.pod_with_claim("huge", "gpu-0");
    assert!(node.api.configure_claim(
        "ml",
        "huge-gpu",
        vec![
            serde_json::json!({"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER,
            "parameters": {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                           "sharing": {"strategy": strategy}}}})
        ]
    ));
    let why = node
        .kubelet
        .prepare_pod(&pod)
        .await
        .expect_err("an unknown strategy is refused")
        .to_string();
    assert!(
        why.contains("unknown sharing strategy"),
        "{}",
        &why[..why.len().min(300)]
    );
    assert!(why.contains("more bytes)"), "not cut: {} bytes", why.len());
    assert!(why.len() < 8 * 1024, "{} bytes", why.len());
    assert!(
        !why.contains('\u{202E}'),
        "a right-to-left override reached the kubelet raw"
    );
    Ok(())
}

/// A call that names claims the API server does not hold (a flood of them, or a kubelet racing a deletion):
/// every claim is refused with why, but the log says at most 20 of a burst, not one line each.
#[tokio::test]
async fn refusals_of_a_burst_of_missing_claims_are_answered_each_and_said_within_a_budget()
-> TestResult {
    use gpu_device_plugin::api::dra::v1;
    let node = DraNode::start(1, "all").await?;
    let endpoint = node
        .root
        .path()
        .join("plugins")
        .join(DRIVER)
        .join("dra.sock");
    let mut client = v1::dra_plugin_client::DraPluginClient::new(
        gpu_device_plugin::util::uds::connect(&endpoint).await?,
    );
    let claims: Vec<v1::Claim> = (0..100)
        .map(|i| v1::Claim {
            namespace: "ml".into(),
            uid: format!("missing-{i}"),
            name: format!("missing-{i}"),
        })
        .collect();
    let answer = client
        .node_prepare_resources(v1::NodePrepareResourcesRequest { claims })
        .await?
        .into_inner();
    assert_eq!(answer.claims.len(), 100);
    assert!(
        answer
            .claims
            .values()
            .all(|c| c.error.contains("not in the API server"))
    );
    let said = node
        .plugin
        .wait_log(WAIT, |l| l.matches("claim not prepared").count() >= 20)
        .await
        .ok_or("the refusals are said")?
        .matches("claim not prepared")
        .count();
    assert_eq!(said, 20, "{}", node.plugin.log());
    Ok(())
}

/// The first Event with `reason` on a pod in namespace `ml`, as the API server took it.
async fn pod_event(node: &DraNode, reason: &str) -> Result<Value, String> {
    let is_it = |r: &fake_kubelet::apiserver::Recorded| {
        r.method == "POST"
            && r.path == "/apis/events.k8s.io/v1/namespaces/ml/events"
            && r.body["reason"] == reason
            && r.status == 201
    };
    let requests = node
        .api
        .wait_for(&format!("a {reason} Event on the pod"), WAIT, |r| {
            r.iter().any(is_it)
        })
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    Ok(requests
        .into_iter()
        .find(is_it)
        .map(|r| r.body)
        .unwrap_or_default())
}

#[tokio::test]
async fn a_restarted_plugin_keeps_its_claims_and_health_and_a_kubelet_restart_gets_slices_and_stream_again()
-> TestResult {
    let mut node = DraNode::start(2, "all").await?;
    node.slice_devices("both GPUs published", |d| d.len() == 2)
        .await?;
    let uid = node.api.add_claim(
        "ml",
        "train-gpu",
        vec![AllocationResult::new("gpu", DRIVER, NODE, "gpu-0")],
    );
    let pod = training_pod(&uid);
    node.kubelet.prepare_pod(&pod).await?;
    node.inject(format!("xid {} 79", simulated_uuid(0)));
    node.kubelet
        .wait_allocated_resources_status(&pod, "the fault", WAIT, |s| {
            pod_resource(s).is_some_and(|r| r["health"] == "Unhealthy")
        })
        .await?;
    assert!(node.state.join("dra-prepared-claims.json").is_file());

    // The plugin restarts: it registers again, the fault is still there (the checkpoint), and the claim it
    // prepared before still holds its GPU.
    node.restart_plugin().await?;
    node.kubelet
        .wait_attempts("a second registration", WAIT, |a| {
            a.iter()
                .filter(|a| matches!(a.outcome, fake_kubelet::dra::Outcome::Registered(_)))
                .count()
                >= 2
        })
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    node.kubelet
        .wait_allocated_resources_status(&pod, "the fault kept across the restart", WAIT, |s| {
            pod_resource(s).is_some_and(|r| {
                r["health"] == "Unhealthy"
                    && r["message"].as_str().is_some_and(|m| m.contains("XID 79"))
            })
        })
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    node.inject(format!("action {} 1", simulated_uuid(0)));
    node.inject(format!("action {} 0", simulated_uuid(0)));
    node.kubelet
        .wait_allocated_resources_status(&pod, "recovered", WAIT, |s| {
            pod_resource(s).is_some_and(|r| r["health"] == "Healthy")
        })
        .await?;
    let other_pod = node.pod_with_claim("other", "gpu-0");
    let held = node
        .kubelet
        .prepare_pod(&other_pod)
        .await
        .err()
        .ok_or("refused")?;
    assert!(
        held.to_string().contains("ml/train-gpu"),
        "names the holder: {held}"
    );

    // The pod ends: unprepare works on the restarted plugin, and the GPU is free for the other claim.
    let errors = node.kubelet.end_pod(&pod).await?;
    assert!(errors.is_empty(), "{errors:?}");
    node.kubelet.prepare_pod(&other_pod).await?;

    // The kubelet restarts: it wipes the node's slices; the plugin writes them again, and the health stream
    // is open again.
    let streams_before = node.kubelet.health_streams().len();
    node.kubelet.restart();
    node.kubelet
        .wait_wipes("the kubelet's wipe at start", WAIT, |w| !w.is_empty())
        .await?;
    node.slice_devices("slices written again after the wipe", |d| d.len() == 2)
        .await?;
    node.kubelet
        .wait_health_streams("the health stream opened again", WAIT, |events| {
            events.len() > streams_before
                && events[streams_before..]
                    .iter()
                    .any(|e| matches!(e.event, fake_kubelet::dra::StreamEvent::Report(_)))
        })
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    Ok(())
}

/// The prepared-claim record is a cache: one made unreadable under the running plugin (garbage, here)
/// never frees a GPU a claim holds. Before, the plugin took it for "nothing prepared" and gave the GPU to the
/// next claim.
#[tokio::test]
async fn a_record_made_unreadable_under_the_running_plugin_never_gives_a_held_gpu_to_another_claim()
-> TestResult {
    let node = DraNode::start(2, "all").await?;
    let train = node.pod_with_claim("train", "gpu-0");
    node.prepared_with_gpu(&train, 0).await?;
    std::fs::write(node.state.join("dra-prepared-claims.json"), "\u{1}garbage")?;
    let other = node.pod_with_claim("other", "gpu-0");
    let held = node
        .kubelet
        .prepare_pod(&other)
        .await
        .err()
        .ok_or_else(|| format!("claim B got claim A's GPU\n{}", node.plugin.log()))?;
    assert!(
        held.to_string().contains("ml/train-gpu"),
        "names the holder: {held}"
    );
    // Written again from what the plugin holds; the garbage kept beside it, to look at.
    let record = std::fs::read_to_string(node.state.join("dra-prepared-claims.json"))?;
    assert!(record.contains("train-gpu"), "{record}");
    let aside = std::fs::read_dir(&node.state)?
        .filter_map(Result::ok)
        .any(|e| e.file_name().to_string_lossy().contains(".unreadable-"));
    assert!(aside, "the unreadable record is kept beside");
    Ok(())
}

/// A rolling update to a later version shares the state directory, and the later version may write the
/// record in a newer format. A plugin that starts on such a record (a rollback, or a restart of the old
/// pod) leaves it untouched and learns what the node's GPUs hold from the API server: a claim reserved for
/// a pod keeps its GPU.
#[tokio::test]
async fn a_plugin_starting_on_a_newer_record_leaves_it_untouched_and_keeps_the_gpus_claims_hold()
-> TestResult {
    let mut node = DraNode::start(2, "all").await?;
    let train = node.pod_with_claim("train", "gpu-0");
    node.prepared_with_gpu(&train, 0).await?;
    assert!(
        node.api
            .reserve_claim("ml", "train-gpu", "train-0", "pod-uid-1")
    );
    let newer = r#"{"version":2,"claims":{"a":{"held":["gpu-0"]}},"written":"by a later version"}"#;
    let path = node.state.join("dra-prepared-claims.json");
    std::fs::write(&path, newer)?;
    node.restart_plugin().await?;
    node.kubelet
        .wait_attempts("registered again", WAIT, |a| {
            a.iter()
                .filter(|a| matches!(a.outcome, fake_kubelet::dra::Outcome::Registered(_)))
                .count()
                >= 2
        })
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    let other = node.pod_with_claim("other", "gpu-0");
    let held = node
        .kubelet
        .prepare_pod(&other)
        .await
        .err()
        .ok_or_else(|| format!("claim B got claim A's GPU\n{}", node.plugin.log()))?;
    assert!(
        held.to_string().contains("ml/train-gpu"),
        "names the holder: {held}"
    );
    // Another GPU is still served, and the record stays as the later version wrote it.
    node.prepared_with_gpu(&node.pod_with_claim("serve", "gpu-1"), 1)
        .await?;
    assert_eq!(std::fs::read_to_string(&path)?, newer);
    node.plugin
        .wait_log(WAIT, |l| l.contains("newer format"))
        .await
        .ok_or("said in the log")?;
    Ok(())
}

/// An answer from the API server is read up to a cap: a 100 MB answer to one claim read (something other
/// than the API server at its address; the API server stores at most 1.5 MiB an object) fails that claim,
/// saying so, and leaves the plugin's memory where it was. Before, a 200 MB answer took it to 211 MB.
#[tokio::test]
async fn an_oversized_answer_from_the_api_server_fails_the_claim_and_costs_no_memory() -> TestResult
{
    let node = DraNode::start(1, "all").await?;
    let pod = node.pod_with_claim("huge", "gpu-0");
    // Past the 64 MiB the plugin may hold, so that reading it whole would show in the peak below.
    assert!(node.api.inflate_claim("ml", "huge-gpu", 72 * 1024 * 1024));
    // The list of every claim reads the oversized one too, and may take longer than a call waits, or than
    // the API client waits for an answer (the fake API server serialises 72 MB per request, slowly in a
    // debug build on a busy machine): the kubelet asks again, and learns why.
    let mut refused = String::new();
    for _ in 0..5 {
        refused = node
            .kubelet
            .prepare_pod(&pod)
            .await
            .err()
            .ok_or("prepared from an oversized answer")?
            .to_string();
        if !refused.contains("is not done yet") && !refused.contains("did not answer") {
            break;
        }
    }
    assert!(refused.contains("larger than 4 MiB"), "{refused}");
    let pid = node.plugin.child.id().ok_or("plugin running")?;
    let peak = support::peak_rss_kib(pid).ok_or("peak RSS")?;
    assert!(
        peak < 64 * 1024,
        "peak RSS {peak} KiB after a 100 MB answer"
    );
    Ok(())
}

/// The cluster-wide ResourceClaim list (what a freshly started plugin must know before it hands out a
/// device) slower than the kubelet's deadline: each page answered after 0.5 s, 16 pages (8 s), and a kubelet
/// whose calls carry a 4 s deadline and that asks again as soon as a call fails. Each call is refused before
/// its deadline, saying the list is not done yet; the list goes on without the calls, once; the call after
/// it is done prepares the claim. The API server is asked for each page once: one list, whatever the calls.
/// Before, the list ran inside the call: no call was answered in time, and each one began the list again
/// from page 1 (6 calls, 6 lists, none done).
#[tokio::test]
async fn a_claims_list_slower_than_the_kubelets_deadline_is_refused_in_time_listed_once_and_the_retry_prepared()
-> TestResult {
    use std::time::{Duration, Instant};
    const PER_PAGE: Duration = Duration::from_millis(500);
    const DEADLINE: Duration = Duration::from_secs(4);
    // The plugin asks for 100 claims a page: 1 500 other nodes' claims and the pod's make 16 pages.
    const PAGES: usize = 16;
    const LIST: &str = "/apis/resource.k8s.io/v1/resourceclaims";
    let node = DraNode::start_with(
        1,
        "all",
        |o| o.call_timeout(DEADLINE),
        |api| {
            for i in 0..(PAGES - 1) * 100 {
                api.add_claim(
                    &format!("team-{}", i % 40),
                    &format!("job-{i}"),
                    vec![AllocationResult::new(
                        "gpu",
                        DRIVER,
                        &format!("node-{}", i % 250),
                        "gpu-0",
                    )],
                );
            }
            api.slow_claim_lists(PER_PAGE);
        },
    )
    .await?;
    let pod = node.pod_with_claim("slow", "gpu-0");
    let pages = |api: &FakeApiServer| {
        api.requests()
            .into_iter()
            .filter(|r| r.method == "GET" && r.path == LIST)
            .collect::<Vec<_>>()
    };
    assert!(pages(&node.api).is_empty(), "listed before any prepare");

    // The kubelet calls, and asks again at once each time a call fails.
    let mut refused: Vec<(Duration, usize)> = Vec::new();
    let last = loop {
        let call = Instant::now();
        let answer = node.kubelet.prepare_pod(&pod).await;
        let took = call.elapsed();
        let Err(e) = answer else {
            break took;
        };
        let e = e.to_string();
        assert!(
            took < DEADLINE,
            "answered after {took:?}, past the kubelet's {DEADLINE:?}: {e}\n{}",
            node.plugin.log()
        );
        assert!(
            e.contains("the list of the cluster's ResourceClaims")
                && e.contains("is not done yet")
                && e.contains("the kubelet asks again"),
            "{e}\n{}",
            node.plugin.log()
        );
        refused.push((took, pages(&node.api).len()));
        assert!(
            refused.len() <= 6,
            "still refused after {refused:?} (time, pages answered)\n{}",
            node.plugin.log()
        );
    };
    // At least 8 s of pages against 3.2 s a call (the deadline less a fifth): the first two calls at least
    // could not have it, and the list went on while they were refused.
    assert!(refused.len() >= 2, "{refused:?}");
    assert!(
        refused.windows(2).all(|w| w[0].1 <= w[1].1) && refused.iter().all(|r| r.1 < PAGES),
        "{refused:?}"
    );
    assert_eq!(
        node.kubelet.cdi_devices(&pod, "main"),
        vec![format!("nvidia.com/gpu={}", simulated_uuid(0))]
    );

    // One list: begun once (one page without a continue token), no page asked twice, every page answered
    // by the time the call that prepared the claim was answered (in time too).
    let listed = pages(&node.api);
    let token = |query: &str| {
        query
            .split('&')
            .find_map(|p| p.strip_prefix("continue="))
            .unwrap_or("")
            .to_string()
    };
    let tokens: Vec<String> = listed.iter().map(|r| token(&r.query)).collect();
    let distinct: std::collections::BTreeSet<&String> = tokens.iter().collect();
    assert_eq!(
        (
            listed.len(),
            tokens.iter().filter(|t| t.is_empty()).count(),
            distinct.len()
        ),
        (PAGES, 1, PAGES),
        "pages asked, lists begun, distinct pages: {tokens:?}"
    );
    assert!(listed.iter().all(|r| r.status == 200), "{listed:#?}");
    assert!(last < DEADLINE, "prepared after {last:?}");
    Ok(())
}

#[tokio::test]
async fn split_by_gpu_no_gpu_is_served_by_both_roads() -> TestResult {
    let node = DraNode::start(3, "1").await?;
    let dp = fake_kubelet::FakeKubelet::start(&node.root.path().join("device-plugins")).await?;
    let list = dp
        .wait_list("the device plugin's list", WAIT, |l| l.devices.len() == 2)
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    let listed: Vec<String> = list.devices.iter().map(|d| d.id.clone()).collect();
    assert_eq!(listed, vec![simulated_uuid(0), simulated_uuid(2)]);
    let devices = node
        .slice_devices("GPU 1 published", |d| !d.is_empty())
        .await?;
    let names: Vec<&str> = devices.iter().filter_map(|d| d["name"].as_str()).collect();
    assert_eq!(names, vec!["gpu-1"], "only GPU 1 through DRA");

    // A fault on the DRA GPU reaches DRA and leaves the device plugin's list as it is.
    node.inject(format!("xid {} 79", simulated_uuid(1)));
    node.kubelet
        .wait_device_health((DRIVER, NODE, "gpu-1"), WAIT, |h| {
            h.health == fake_kubelet::dra::Health::Unhealthy
        })
        .await?;
    let after = dp.list();
    assert_eq!(
        after.allocatable(),
        2,
        "the device plugin's GPUs stay Healthy"
    );
    Ok(())
}

#[tokio::test]
async fn a_dra_setting_naming_a_gpu_the_node_lacks_stops_the_start_with_the_reason() -> TestResult {
    let dir = tempfile::tempdir()?;
    let api = FakeApiServer::start().await?;
    api.add_node(NODE);
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let kubeconfig = kubeconfig.to_string_lossy().into_owned();
    let mut plugin = PluginProcess::spawn(
        dir.path(),
        &[
            "--simulate",
            "2",
            "--dra",
            "0,7",
            "--kubeconfig",
            &kubeconfig,
            "--node-name",
            NODE,
        ],
    );
    let status = plugin.wait_exit(WAIT).await.ok_or("exits")?;
    assert!(!status.success());
    let log = plugin.log();
    assert!(log.contains("GPU 7") && log.contains("0 (GPU-"), "{log}");
    Ok(())
}

/// `gpu-device-plugin <args>` with the node's state directory.
fn command(node: &DraNode, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"))
        .args(args)
        .arg("--state-dir")
        .arg(&node.state)
        .env_remove("RUST_LOG")
        .output()
        .expect("run gpu-device-plugin")
}

#[tokio::test]
async fn status_shows_dra_devices_and_their_claims_and_a_fence_taints_the_gpu_until_released()
-> TestResult {
    let node = DraNode::start(2, "all").await?;
    node.slice_devices("both GPUs published", |d| d.len() == 2)
        .await?;
    let uid = node.api.add_claim(
        "ml",
        "train-gpu",
        vec![AllocationResult::new("gpu", DRIVER, NODE, "gpu-0")],
    );
    node.kubelet.prepare_pod(&training_pod(&uid)).await?;

    let addr = node.plugin.http_addr().await.ok_or("HTTP address")?;
    let (ready, why) = http::get(&addr, "/readyz").await?;
    assert_eq!(ready, StatusCode::OK, "{}", String::from_utf8_lossy(&why));
    let (code, body) = http::get(&addr, "/status").await?;
    assert_eq!(code, StatusCode::OK);
    let status: Value = serde_json::from_slice(&body)?;
    let gpu0 = &status["devices"][0];
    assert_eq!(gpu0["dra"]["device"], "gpu-0");
    assert_eq!(gpu0["dra"]["driver"], DRIVER);
    assert_eq!(gpu0["dra"]["claim"], "ml/train-gpu");
    assert!(status["devices"][1]["dra"].get("claim").is_none());
    assert_eq!(status["dra"]["registered"], true);
    let (_, metrics) = http::get(&addr, "/metrics").await?;
    let metrics = String::from_utf8_lossy(&metrics);
    for line in [
        "gpu_device_plugin_kubelet_calls_total{method=\"PrepareClaim\",code=\"Ok\"} 1",
        "gpu_device_plugin_kubernetes_api_writes_total{request=\"resource_slice\",result=\"ok\"}",
        "gpu_device_plugin_device_healthy{resource=\"gpu.nvidia.com\"",
    ] {
        assert!(metrics.contains(line), "{line} not in\n{metrics}");
    }
    // Every write of ours the API server took counted once, and nothing else: a reconcile that found the
    // slice as wanted (the watch telling of our own write) is no write. (The kubelet's wipe at its start is a
    // delete of the whole collection; ours name their slice.)
    let counted: f64 = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                "gpu_device_plugin_kubernetes_api_writes_total{request=\"resource_slice\",result=\"ok\"} ",
            )
        })
        .ok_or("no resource_slice writes in /metrics")?
        .parse()?;
    let taken = node
        .api
        .requests()
        .iter()
        .filter(|r| {
            (r.method == "POST" && r.path.ends_with("/resourceslices")
                || ["PUT", "DELETE"].contains(&r.method.as_str())
                    && r.path.contains("/resourceslices/"))
                && r.status < 300
        })
        .count();
    assert_eq!(counted, taken as f64, "{metrics}");
    let table = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"))
        .args(["status", "--addr", &addr])
        .output()?;
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("claim ml/train-gpu"), "{table}");
    assert!(
        table.contains("DRA: registered as gpu.nvidia.com"),
        "{table}"
    );

    // An operator fences GPU 1: the health stream says so with the reason, and the slice keeps new claims
    // off it; released, both clear.
    let fenced = command(
        &node,
        &["fence", &simulated_uuid(1), "--reason", "burn-in failed"],
    );
    assert!(
        fenced.status.success(),
        "{}",
        String::from_utf8_lossy(&fenced.stderr)
    );
    let health = node
        .kubelet
        .wait_device_health((DRIVER, NODE, "gpu-1"), WAIT, |h| {
            h.health == Health::Unhealthy
        })
        .await?;
    assert!(
        health.message.contains("burn-in failed"),
        "{}",
        health.message
    );
    let (_, (_, effect)) = node.slice_taint("gpu-1", "gpu.nvidia.com/fenced").await?;
    assert_eq!(effect.as_deref(), Some("NoSchedule"));
    let released = command(&node, &["release", &simulated_uuid(1)]);
    assert!(
        released.status.success(),
        "{}",
        String::from_utf8_lossy(&released.stderr)
    );
    node.kubelet
        .wait_device_health((DRIVER, NODE, "gpu-1"), WAIT, |h| {
            h.health == Health::Healthy
        })
        .await?;
    node.slice_devices("gpu-1's fence taint removed", |d| {
        device(d, "gpu-1").is_some_and(|g| g.get("taints").is_none())
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn each_kubelet_version_gets_the_services_it_knows_and_the_fault() -> TestResult {
    let versions = [
        (KubeletVersion::V1_34, "v1alpha1"),
        (KubeletVersion::V1_36, "v1alpha1"),
        (KubeletVersion::V1_37, "v1"),
    ];
    for (version, health_service) in versions {
        let node = DraNode::start_with(
            1,
            "all",
            |o| o.version(version).resource_health_status(true),
            |_| {},
        )
        .await?;
        let registration = node.kubelet.wait_registered(DRIVER, WAIT).await?;
        assert_eq!(
            registration.service.advertised_name(),
            "v1.DRAPlugin",
            "{version:?}"
        );
        let watched = registration
            .health
            .map(|h| h.advertised_name())
            .unwrap_or_default();
        assert!(
            watched.starts_with(health_service),
            "{version:?}: {watched}"
        );
        node.inject(format!("xid {} 79", simulated_uuid(0)));
        node.kubelet
            .wait_device_health((DRIVER, NODE, "gpu-0"), WAIT, |h| {
                h.health == Health::Unhealthy
            })
            .await
            .map_err(|e| format!("{version:?}: {e}\n{}", node.plugin.log()))?;
    }
    Ok(())
}

#[tokio::test]
async fn an_api_server_that_drops_device_taints_is_said_once() -> TestResult {
    let node = DraNode::start_with(2, "all", |o| o, |api| api.drop_device_taints(true)).await?;
    node.slice_devices("both GPUs published", |d| d.len() == 2)
        .await?;
    let said = "dropped the device taints";
    for gpu in 0..2 {
        node.inject(format!("xid {} 79", simulated_uuid(gpu)));
        node.kubelet
            .wait_device_health((DRIVER, NODE, &format!("gpu-{gpu}")), WAIT, |h| {
                h.health == Health::Unhealthy
            })
            .await?;
    }
    node.plugin
        .wait_log(WAIT, |log| log.contains(said))
        .await
        .ok_or_else(|| {
            let writes: Vec<String> = node
                .api
                .requests()
                .iter()
                .filter(|r| r.path.contains("resourceslices"))
                .map(|r| format!("{} {} {}", r.method, r.path, r.body["spec"]["devices"]))
                .collect();
            format!(
                "the dropped taints said\n{}\n{}",
                writes.join("\n"),
                node.plugin.log()
            )
        })?;
    // Both faults sent (the API server keeps neither taint).
    node.api
        .wait_for("the faults written", WAIT, |requests| {
            requests.iter().any(|r| {
                r.method == "PUT"
                    && r.body["spec"]["devices"][0].get("taints").is_some()
                    && r.body["spec"]["devices"][1].get("taints").is_some()
            })
        })
        .await?;
    // What the API server made of the writes is not taken for a change to write again, nor is the watch's
    // news of the first write when it comes after the second: no write of the same devices again follows
    // (one would follow the watch event at once; a second is given). A write with news (a condition the
    // monitor adds late on a busy machine) is no rewrite.
    let puts = |requests: &[fake_kubelet::apiserver::Recorded]| {
        requests
            .iter()
            .filter(|r| r.path.contains("resourceslices") && r.method == "PUT")
            .map(|r| r.body["spec"]["devices"].clone())
            .collect::<Vec<_>>()
    };
    let written = puts(&node.api.requests()).len();
    let rewritten = node
        .api
        .wait_for("a rewrite", std::time::Duration::from_secs(1), |r| {
            puts(r)
                .windows(2)
                .skip(written.saturating_sub(1))
                .any(|w| w[0] == w[1])
        })
        .await;
    assert!(
        rewritten.is_err(),
        "the slice was written again for nothing: {:?}",
        &puts(&node.api.requests())[written.saturating_sub(1)..]
    );
    // The recovery is the next write.
    node.inject(format!("action {} 1", simulated_uuid(0)));
    node.inject(format!("action {} 0", simulated_uuid(0)));
    node.kubelet
        .wait_device_health((DRIVER, NODE, "gpu-0"), WAIT, |h| {
            h.health == Health::Healthy
        })
        .await?;
    let requests = node
        .api
        .wait_for("the recovery written", WAIT, |requests| {
            requests.iter().any(|r| {
                r.method == "PUT"
                    && r.body["spec"]["devices"][0].get("taints").is_none()
                    && r.body["spec"]["devices"][1].get("taints").is_some()
            })
        })
        .await?;
    // Each write carried a change (the recovery action's start, its end): none repeats the one before.
    let specs: Vec<&Value> = requests
        .iter()
        .filter(|r| r.path.contains("resourceslices") && r.method == "PUT")
        .map(|r| &r.body["spec"]["devices"])
        .collect();
    assert!(
        specs.windows(2).all(|w| w[0] != w[1]),
        "a slice written twice the same"
    );
    let count = puts(&requests).len();
    assert!(count <= written + 2, "{count} writes");
    assert_eq!(
        node.plugin.log().matches(said).count(),
        1,
        "{}",
        node.plugin.log()
    );
    Ok(())
}

/// An API server's watch behind its writes (its watch cache lagging, or the watch being listed again): the
/// slice the plugin made is not yet in what it watches when the next change comes. The change is written over
/// the slice the plugin made, not sent as a second create the API server refuses (409) and retried with a
/// backoff while the fault waits; once the watch catches up nothing is written again.
#[tokio::test]
async fn a_slice_made_before_the_watch_tells_of_it_takes_the_next_change_at_once() -> TestResult {
    let node = DraNode::start_with(2, "all", |o| o, |api| api.lag_slice_watches(true)).await?;
    node.slice_devices("both GPUs published", |d| d.len() == 2)
        .await?;
    node.inject(format!("xid {} 79", simulated_uuid(0)));
    let (_, xid) = node.slice_taint("gpu-0", "gpu.nvidia.com/xid").await?;
    assert_eq!(xid, (Some("79".into()), Some("NoSchedule".into())));
    let slice_writes = |r: &fake_kubelet::apiserver::Recorded| {
        r.path.contains("resourceslices") && (r.method == "POST" || r.method == "PUT")
    };
    // Recorded once answered, which may be after the slice is stored.
    let writes: Vec<(String, u16)> = node
        .api
        .wait_for("the second write recorded", WAIT, |r| {
            r.iter().filter(|r| slice_writes(r)).count() >= 2
        })
        .await?
        .iter()
        .filter(|r| slice_writes(r))
        .map(|r| (r.method.clone(), r.status))
        .collect();
    assert_eq!(
        writes,
        [("POST".to_string(), 201), ("PUT".to_string(), 200)],
        "one create, then the fault written over it"
    );
    // The watch catches up with both writes: both are known as the plugin's own, nothing is written again.
    node.api.lag_slice_watches(false);
    let rewritten = node
        .api
        .wait_for(
            "a write after the watch caught up",
            std::time::Duration::from_secs(1),
            |r| r.iter().filter(|r| slice_writes(r)).count() > 2,
        )
        .await;
    assert!(rewritten.is_err(), "written again for nothing");
    Ok(())
}

/// Someone else writes the plugin's slice (another writer, an operator's edit) while the plugin's watch is
/// behind: the plugin's next write meets a conflict and writes over what is there at once, instead of trying
/// again, after a growing backoff, at a version the watch has not caught up with.
#[tokio::test]
async fn a_slice_someone_else_wrote_takes_the_next_fault_at_once() -> TestResult {
    let node = DraNode::start(2, "all").await?;
    node.slice_devices("both GPUs published", |d| d.len() == 2)
        .await?;
    node.api.lag_slice_watches(true);
    let name = node.api.slices()[0]["metadata"]["name"]
        .as_str()
        .ok_or("the slice's name")?
        .to_string();
    assert!(node.api.edit_slice(&name, |slice| {
        slice["spec"]["devices"][0]["attributes"]["productName"] =
            serde_json::json!({"string": "edited"});
    }));
    node.inject(format!("xid {} 79", simulated_uuid(0)));
    let (devices, xid) = node.slice_taint("gpu-0", "gpu.nvidia.com/xid").await?;
    assert_eq!(xid, (Some("79".into()), Some("NoSchedule".into())));
    // The edit is gone with it: the plugin's view of its GPUs stands.
    let gpu0 = device(&devices, "gpu-0").ok_or("gpu-0")?;
    assert_ne!(gpu0["attributes"]["productName"]["string"], "edited");
    // The conflict answered by writing over the edit at once: no failed write, no backoff.
    assert!(
        !node
            .plugin
            .log()
            .contains("cannot write the ResourceSlices"),
        "{}",
        node.plugin.log()
    );
    node.api.lag_slice_watches(false);
    Ok(())
}

#[tokio::test]
async fn a_fault_that_leaves_the_gpu_healthy_still_reaches_the_health_stream_and_the_slice()
-> TestResult {
    let node = DraNode::start(2, "all").await?;
    node.slice_devices("both GPUs published", |d| d.len() == 2)
        .await?;
    // XID 31 (an application's memory fault) is recorded without taking the GPU out of service: nothing
    // changes in the device list, and the note must still reach the pod status and the slice.
    node.inject(format!("xid {} 31", simulated_uuid(0)));
    // Sooner than the view's 10 s refresh: on the change itself.
    let sooner = std::time::Duration::from_secs(5);
    let health = node
        .kubelet
        .wait_device_health((DRIVER, NODE, "gpu-0"), sooner, |h| {
            h.message.contains("XID 31")
        })
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    assert_eq!(health.health, Health::Healthy);
    let (_, xid) = node.slice_taint("gpu-0", "gpu.nvidia.com/xid").await?;
    assert_eq!(xid, (Some("31".into()), Some("None".into())));
    Ok(())
}

#[tokio::test]
async fn slices_that_cannot_be_watched_are_said_once_retried_with_a_backoff_and_written_when_allowed()
-> TestResult {
    let node = DraNode::start_with(2, "all", |o| o, |api| api.forbid(true)).await?;
    let said = "cannot watch this node's ResourceSlices";
    let lists = |requests: &[fake_kubelet::apiserver::Recorded]| {
        requests
            .iter()
            .filter(|r| r.path.ends_with("/resourceslices") && r.method == "GET")
            .count()
    };
    let requests = node
        .api
        .wait_for("the watch tried three times", WAIT, |r| lists(r) >= 3)
        .await?;
    // A backoff, not a loop: three tries take more than the first wait (0.8 s) and fewer than a hundred
    // requests were made meanwhile.
    let tries: Vec<_> = requests
        .iter()
        .filter(|r| r.path.ends_with("/resourceslices") && r.method == "GET")
        .map(|r| r.at)
        .collect();
    assert!(tries[2].duration_since(tries[0]) >= std::time::Duration::from_millis(500));
    assert!(requests.len() < 100, "{} requests", requests.len());
    node.plugin
        .wait_log(WAIT, |log| log.contains(said))
        .await
        .ok_or("said")?;
    assert_eq!(
        node.plugin.log().matches(said).count(),
        1,
        "{}",
        node.plugin.log()
    );
    assert!(
        node.plugin.log().contains("resourceslices"),
        "names what is missing"
    );

    node.api.forbid(false);
    node.slice_devices("written once allowed", |d| d.len() == 2)
        .await?;
    let owners: Vec<Value> = node
        .api
        .slices()
        .iter()
        .map(|s| s["metadata"]["ownerReferences"][0]["kind"].clone())
        .collect();
    assert_eq!(owners, vec![Value::from("Node")], "owned by the Node");
    Ok(())
}

#[tokio::test]
async fn a_registration_directory_that_cannot_be_made_stops_the_plugin_with_the_path() -> TestResult
{
    let dir = tempfile::tempdir()?;
    let api = FakeApiServer::start().await?;
    api.add_node(NODE);
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let kubeconfig = kubeconfig.to_string_lossy().into_owned();
    // A file where the registry directory should be.
    let blocked = dir.path().join("plugins_registry");
    std::fs::write(&blocked, "")?;
    let blocked = blocked.to_string_lossy().into_owned();
    let plugins = dir.path().join("plugins").to_string_lossy().into_owned();
    let mut plugin = PluginProcess::spawn(
        dir.path(),
        &[
            "--simulate",
            "1",
            "--dra",
            "all",
            "--kubeconfig",
            &kubeconfig,
            "--node-name",
            NODE,
            "--kubelet-registrar-directory-path",
            &format!("{blocked}/sub"),
            "--kubelet-plugins-directory-path",
            &plugins,
        ],
    );
    let status = plugin.wait_exit(WAIT).await.ok_or("exits")?;
    assert!(!status.success());
    let log = plugin.log();
    assert!(log.contains("plugins_registry/sub"), "{log}");
    assert!(
        !dir.path().join("plugins/gpu.nvidia.com/dra.sock").exists(),
        "the DRA socket is removed when the plugin stops"
    );
    Ok(())
}

/// A 1.36 kubelet's plugin watcher registers a new socket at its next pass, up to a second later; a slice
/// published before that let the scheduler bind a pod the kubelet then failed with "DRA driver gpu.nvidia.com
/// is not registered" (seen on a real 1.36 node, the pod started 10 s later). The slices wait for the
/// registration.
#[tokio::test]
async fn slices_go_out_only_once_the_kubelet_has_registered_the_driver() -> TestResult {
    let node = DraNode::launch(2, "all", |o| o.hold_registrations(), |_| {}, &[]).await?;
    let registry = node.root.path().join("plugins_registry");
    let socket = format!("{DRIVER}-reg.sock");
    support::wait_for_file(&registry, WAIT, |n| n == socket)
        .await
        .ok_or_else(|| format!("no registration socket\n{}", node.plugin.log()))?;
    // The socket is in place and the kubelet has not registered it: no slice in the next 2 s (before the
    // change, the slice went out within milliseconds of the start).
    let early = node
        .api
        .wait_for_slices(
            "a slice before the registration",
            std::time::Duration::from_secs(2),
            |s| !s.is_empty(),
        )
        .await;
    assert!(
        early.is_err(),
        "a ResourceSlice was published before the kubelet registered the driver"
    );
    let released = std::time::Instant::now();
    node.kubelet.release_registrations();
    node.kubelet.wait_registered(DRIVER, WAIT).await?;
    let devices = node
        .slice_devices("both GPUs published", |d| d.len() == 2)
        .await?;
    assert_eq!(devices.len(), 2);
    // The fake API server stores a slice before it records the request: wait for the record too.
    let is_create = |r: &fake_kubelet::apiserver::Recorded| {
        r.method == "POST" && r.path.ends_with("/resourceslices")
    };
    let requests = node
        .api
        .wait_for("the ResourceSlice's creation recorded", WAIT, |r| {
            r.iter().any(is_create)
        })
        .await?;
    let first_write = requests
        .iter()
        .find(|r| is_create(r))
        .ok_or("no ResourceSlice was created")?;
    assert!(
        first_write.at >= released,
        "the first ResourceSlice went out before the registration was let through"
    );
    Ok(())
}

/// A change of `dra` by SIGHUP while a GPU is in use on the road it leaves is refused with what to drain, and
/// the running config kept; once drained, the same change goes through. Both ways: a claim prepared through
/// DRA, and a pod's container holding a device-plugin GPU.
#[tokio::test]
async fn a_switch_of_roads_by_sighup_waits_until_the_road_it_leaves_holds_nothing() -> TestResult {
    let config_dir = tempfile::tempdir()?;
    let config = config_dir.path().join("config.yaml");
    std::fs::write(&config, "dra: \"0\"\n")?;
    let pods_socket = config_dir.path().join("pod-resources.sock");
    let (config_arg, pods_arg) = (
        config.to_string_lossy().into_owned(),
        pods_socket.to_string_lossy().into_owned(),
    );
    let node = DraNode::start_with_args(
        2,
        "",
        |o| o,
        |_| {},
        &["--config", &config_arg, "--pod-resources-socket", &pods_arg],
    )
    .await?;
    let mut dp = fake_kubelet::FakeKubelet::start(&node.root.path().join("device-plugins")).await?;
    dp.serve_pod_resources(&pods_socket)?;
    dp.wait_list("GPU 1 through the device plugin", WAIT, |l| {
        l.devices.len() == 1
    })
    .await
    .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    let refusals = |log: &str| log.matches("new config refused").count();

    // DRA → the device plugin while claim ml/a-gpu holds gpu-0: refused, gpu-0 stays off the device plugin.
    let pod = node.pod_with_claim("a", "gpu-0");
    node.prepared_with_gpu(&pod, 0).await?;
    std::fs::write(&config, "dra: off\n")?;
    node.plugin.signal(nix::sys::signal::Signal::SIGHUP);
    let refused = node
        .plugin
        .wait_log(WAIT, |l| refusals(l) == 1)
        .await
        .unwrap_or_else(|| node.plugin.log());
    let line = refused
        .lines()
        .find(|l| l.contains("new config refused"))
        .unwrap_or_default();
    assert!(
        line.contains("GPU 0") && line.contains("claim ml/a-gpu") && line.contains("from 0 to off"),
        "{refused}"
    );
    assert_eq!(dp.registrations().len(), 1, "no restart: {refused}");
    assert_eq!(dp.list().devices.len(), 1, "gpu-0 not on both roads");

    // The claim's pod ended: the same change goes through, and the device plugin serves both GPUs.
    node.kubelet.end_pod(&pod).await?;
    node.plugin.signal(nix::sys::signal::Signal::SIGHUP);
    dp.wait_list("both GPUs through the device plugin", WAIT, |l| {
        l.registration >= 2 && l.devices.len() == 2
    })
    .await
    .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;

    // The device plugin → DRA while a pod's container holds GPU 1: refused, naming the pod.
    dp.allocate_to("ml", "trainer", "main", &[&simulated_uuid(1)])
        .await?;
    std::fs::write(&config, "dra: all\n")?;
    node.plugin.signal(nix::sys::signal::Signal::SIGHUP);
    let refused = node
        .plugin
        .wait_log(WAIT, |l| refusals(l) == 2)
        .await
        .unwrap_or_else(|| node.plugin.log());
    let line = refused
        .lines()
        .filter(|l| l.contains("new config refused"))
        .nth(1)
        .unwrap_or_default();
    assert!(
        line.contains("GPU 1") && line.contains("ml/trainer (main)"),
        "{refused}"
    );
    assert!(!line.contains("GPU 0 "), "GPU 0 is free: {line}");

    // The pod gone: every GPU moves to DRA.
    assert!(dp.remove_pod("ml", "trainer"));
    node.plugin.signal(nix::sys::signal::Signal::SIGHUP);
    node.slice_devices("both GPUs through DRA", |d| d.len() == 2)
        .await?;
    Ok(())
}

/// A change of `dra` across a restart (a rollout with a new config, which no SIGHUP weighed): a GPU the DRA
/// record still holds for a prepared claim stays off the device plugin, said with its claim, and the others
/// are served.
#[tokio::test]
async fn a_gpu_the_dra_record_holds_stays_off_the_device_plugin_after_a_restart_without_dra()
-> TestResult {
    let config_dir = tempfile::tempdir()?;
    let config = config_dir.path().join("config.yaml");
    std::fs::write(&config, "dra: \"0\"\n")?;
    let config_arg = config.to_string_lossy().into_owned();
    let mut node =
        DraNode::start_with_args(2, "", |o| o, |_| {}, &["--config", &config_arg]).await?;
    let dp = fake_kubelet::FakeKubelet::start(&node.root.path().join("device-plugins")).await?;
    dp.wait_list("GPU 1 through the device plugin", WAIT, |l| {
        l.devices.len() == 1
    })
    .await
    .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    let pod = node.pod_with_claim("a", "gpu-0");
    node.prepared_with_gpu(&pod, 0).await?;

    // The pod's config says DRA off, and the plugin is restarted with it: gpu-0 is still prepared for the claim.
    std::fs::write(&config, "dra: off\n")?;
    node.restart_plugin().await?;
    let list = dp
        .wait_list("the restarted plugin's list", WAIT, |l| l.registration >= 2)
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    let listed: Vec<&str> = list.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(
        listed,
        vec![simulated_uuid(1).as_str()],
        "gpu-0 is held by a claim: {}",
        node.plugin.log()
    );
    let said = node
        .plugin
        .wait_log(WAIT, |l| {
            l.contains("kept off the device plugin") && l.contains("ml/a-gpu")
        })
        .await;
    assert!(said.is_some(), "{}", node.plugin.log());
    Ok(())
}
