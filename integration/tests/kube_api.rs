//! The roads through the Kubernetes API and the kubelet's pod-resources API, against the real binary: a GPU
//! fault becomes a Warning Event on the pod holding the GPU and on the Node and turns the node condition
//! `GPUUnhealthy` True; recovery sends Normal Events and sets it False. The recording API server checks each
//! request as the real one would and keeps the bodies, which are asserted exactly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use std::ffi::OsStr;
use std::sync::Arc;
use std::time::Duration;

use fake_kubelet::FakeKubelet;
use fake_kubelet::apiserver::{FakeApiServer, Recorded};
use gpu_device_plugin::cluster::{ApiAccess, ClusterConfig, EventBudget};
use gpu_device_plugin::devices::{DeviceInfo, Health, Inventory};
use gpu_device_plugin::http;
use gpu_device_plugin::metrics::Metrics;
use gpu_device_plugin::sources::simulated::simulated_uuid;
use serde_json::{Value, json};
use support::{PluginProcess, TestResult, WAIT};

const NODE: &str = "gpu-node-1";

/// A lost GPU that answers again is back within a fraction of a second.
const QUICK_RECOVERY: &str = "health:\n  quietPeriod: 200ms\n  probeInterval: 100ms\n";

fn gpu(i: usize) -> String {
    simulated_uuid(i)
}

fn is_event(r: &Recorded, namespace: &str, reason: &str) -> bool {
    r.method == "POST"
        && r.path == format!("/apis/events.k8s.io/v1/namespaces/{namespace}/events")
        && r.body["reason"] == reason
        && r.status == 201
}

fn condition_patches(requests: &[Recorded]) -> Vec<&Recorded> {
    requests
        .iter()
        .filter(|r| r.method == "PATCH" && r.path == format!("/api/v1/nodes/{NODE}/status"))
        .collect()
}

/// The condition a PATCH carried.
fn patched_condition(r: &Recorded) -> &Value {
    &r.body["status"]["conditions"][0]
}

/// A node with everything on: the fake kubelet with its pod-resources API, the recording API server, and the
/// binary on 4 simulated GPUs.
struct ApiNode {
    kubelet: FakeKubelet,
    api: FakeApiServer,
    plugin: PluginProcess,
    faults: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl ApiNode {
    /// Starts with a config file of `yaml`.
    async fn start(yaml: &str) -> Result<Self, Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let faults = dir.path().join("faults");
        let pod_resources = dir.path().join("pod-resources.sock");
        let mut kubelet = FakeKubelet::start(dir.path()).await?;
        kubelet.serve_pod_resources(&pod_resources)?;
        let api = FakeApiServer::start().await?;
        api.add_node(NODE);
        let kubeconfig = dir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig)?;
        let config = dir.path().join("config.yaml");
        std::fs::write(&config, yaml)?;
        let path = |p: &std::path::Path| p.to_string_lossy().into_owned();
        let (faults_arg, pods_arg, kubeconfig_arg, config_arg) = (
            path(&faults),
            path(&pod_resources),
            path(&kubeconfig),
            path(&config),
        );
        let plugin = PluginProcess::spawn_with_env(
            dir.path(),
            &[
                "--simulate",
                "4",
                "--simulate-events",
                &faults_arg,
                "--pod-resources-socket",
                &pods_arg,
                "--kubeconfig",
                &kubeconfig_arg,
                "--config",
                &config_arg,
            ],
            &[("NODE_NAME", OsStr::new(NODE))],
        );
        kubelet
            .wait_list("4 GPUs Healthy (each replica, if shared)", WAIT, |l| {
                l.allocatable() >= 4
            })
            .await
            .map_err(|e| format!("{e}\n{}", plugin.log()))?;
        Ok(ApiNode {
            kubelet,
            api,
            plugin,
            faults,
            _dir: dir,
        })
    }

    fn inject(&self, lines: &[String]) {
        support::append(&self.faults, lines);
    }

    async fn wait(
        &self,
        what: &str,
        pred: impl FnMut(&[Recorded]) -> bool,
    ) -> Result<Vec<Recorded>, String> {
        self.api
            .wait_for(what, WAIT, pred)
            .await
            .map_err(|e| format!("{e}\n{}", self.plugin.log()))
    }
}

/// Each request names the plugin and its version as its user agent: on a real API server the plugin's requests
/// showed none (the audit log's `userAgent` empty), so no log or metric of the API server could tell them apart.
#[tokio::test]
async fn every_request_names_the_plugin_as_its_user_agent() -> TestResult {
    let node = ApiNode::start(QUICK_RECOVERY).await?;
    node.inject(&[format!("lost {}", gpu(1))]);
    let requests = node
        .wait("the condition and the node's Event", |r| {
            !condition_patches(r).is_empty() && r.iter().any(|r| r.method == "POST")
        })
        .await?;
    let expected = format!("gpu-device-plugin/{}", env!("CARGO_PKG_VERSION"));
    for request in &requests {
        assert_eq!(
            request.user_agent.as_deref(),
            Some(expected.as_str()),
            "{} {}",
            request.method,
            request.path
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_fault_reaches_the_pod_and_the_node_and_recovery_clears_it() -> TestResult {
    let node = ApiNode::start(QUICK_RECOVERY).await?;
    // At start the condition is written once, False, with every GPU counted.
    let requests = node
        .wait("the first condition", |r| !condition_patches(r).is_empty())
        .await?;
    let first = condition_patches(&requests)[0];
    assert_eq!(
        first.content_type.as_deref(),
        Some("application/strategic-merge-patch+json")
    );
    let condition = patched_condition(first);
    assert_eq!(condition["type"], "GPUUnhealthy");
    assert_eq!(condition["status"], "False");
    assert_eq!(condition["reason"], "GPUsHealthy");
    assert_eq!(condition["message"], "all 4 GPUs Healthy");
    // The kubelet's own Ready condition is still there: the patch merged, it did not replace.
    assert!(node.api.node_condition(NODE, "Ready").is_some());

    // A training pod gets GPU 2.
    let uid = node.api.add_pod("ml", "train-0");
    node.kubelet
        .allocate_to("ml", "train-0", "trainer", &[&gpu(2)])
        .await?;

    node.inject(&[format!("lost {}", gpu(2))]);
    node.kubelet
        .wait_list("GPU 2 Unhealthy", WAIT, |l| {
            l.health(&gpu(2)) == Some("Unhealthy")
        })
        .await?;
    let requests = node
        .wait("Warning Events on the pod and the node", |r| {
            r.iter().any(|r| is_event(r, "ml", "GPUUnhealthy"))
                && r.iter().any(|r| is_event(r, "default", "GPUUnhealthy"))
        })
        .await?;
    let pod_event = &requests
        .iter()
        .find(|r| is_event(r, "ml", "GPUUnhealthy"))
        .unwrap()
        .body;
    assert_eq!(
        pod_event["regarding"],
        json!({"apiVersion": "v1", "kind": "Pod", "namespace": "ml", "name": "train-0", "uid": uid})
    );
    assert_eq!(pod_event["type"], "Warning");
    assert_eq!(pod_event["reportingController"], "gpu-device-plugin");
    assert_eq!(pod_event["reportingInstance"], NODE);
    let note = pod_event["note"].as_str().unwrap();
    let prefix = format!(
        "device {} (index 2), used by container trainer: Unhealthy: ",
        gpu(2)
    );
    assert!(note.starts_with(&prefix), "{note}");
    assert!(
        note.contains("fallen off the bus") || note.contains("lost"),
        "{note}"
    );

    let node_event = &requests
        .iter()
        .find(|r| is_event(r, "default", "GPUUnhealthy"))
        .unwrap()
        .body;
    assert_eq!(
        node_event["regarding"],
        json!({"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE})
    );
    let node_note = node_event["note"].as_str().unwrap();
    assert!(
        node_note.starts_with(&format!("device {} (index 2): Unhealthy: ", gpu(2))),
        "{node_note}"
    );

    let requests = node
        .wait("the condition True", |r| {
            condition_patches(r)
                .last()
                .is_some_and(|p| patched_condition(p)["status"] == "True")
        })
        .await?;
    let stored = node.api.node_condition(NODE, "GPUUnhealthy").unwrap();
    assert_eq!(stored["reason"], "GPUUnhealthy");
    let message = stored["message"].as_str().unwrap();
    assert!(
        message.starts_with(&format!(
            "1 of 4 GPUs Unhealthy. device {} (index 2): Unhealthy: ",
            gpu(2)
        )),
        "{message}"
    );
    assert!(stored["lastTransitionTime"].is_string() && stored["lastHeartbeatTime"].is_string());
    let patches_so_far = condition_patches(&requests).len();

    // /status names the pod holding the GPU, from the kubelet's pod-resources API.
    let addr = node.plugin.http_addr().await.ok_or("no HTTP address")?;
    let report = http::fetch_report(&addr).await?;
    let holders: Vec<String> = report.devices[2]
        .pods
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(holders, ["ml/train-0 (trainer)"]);
    assert!(report.devices[1].pods.is_empty());

    // The GPU answers again: after the quiet period it is back, Normal Events follow and the condition
    // goes False with a new transition time.
    node.inject(&[format!("restore {}", gpu(2))]);
    node.kubelet
        .wait_list("GPU 2 Healthy again", WAIT, |l| {
            l.health(&gpu(2)) == Some("Healthy")
        })
        .await?;
    let requests = node
        .wait("Normal Events and the condition False", |r| {
            r.iter().any(|r| is_event(r, "ml", "GPURecovered"))
                && r.iter().any(|r| is_event(r, "default", "GPURecovered"))
                && condition_patches(r)
                    .last()
                    .is_some_and(|p| patched_condition(p)["status"] == "False")
        })
        .await?;
    let recovered = &requests
        .iter()
        .find(|r| is_event(r, "ml", "GPURecovered"))
        .unwrap()
        .body;
    assert_eq!(recovered["type"], "Normal");
    assert!(
        recovered["note"]
            .as_str()
            .unwrap()
            .starts_with(&format!(
                "device {} (index 2), used by container trainer: Healthy again, back in service (was Unhealthy: ",
                gpu(2)
            )),
        "{}",
        recovered["note"]
    );
    let stored = node.api.node_condition(NODE, "GPUUnhealthy").unwrap();
    assert_eq!(
        (&stored["status"], &stored["reason"], &stored["message"]),
        (
            &json!("False"),
            &json!("GPUsHealthy"),
            &json!("all 4 GPUs Healthy")
        )
    );
    // One patch per change of state: start, True, False.
    assert_eq!(condition_patches(&requests).len(), patches_so_far + 1);
    // Every request the API server answered succeeded: nothing the real one would refuse.
    let refused: Vec<&Recorded> = requests.iter().filter(|r| r.status >= 300).collect();
    assert!(refused.is_empty(), "{refused:#?}");

    // The API server records a request before the plugin has read its answer: the counter follows a moment
    // later, on the plugin's API thread.
    let sent = |metrics: &str| {
        metrics
            .lines()
            .find(|l| {
                l.starts_with("gpu_device_plugin_kubernetes_api_writes_total")
                    && l.contains("request=\"event\"")
                    && l.contains("result=\"ok\"")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
    };
    let mut metrics = String::new();
    let counted = tokio::time::timeout(WAIT, async {
        loop {
            if let Ok((_, body)) = http::get(&addr, "/metrics").await {
                metrics = String::from_utf8_lossy(&body).into_owned();
                if sent(&metrics) >= Some(4) {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(counted.is_ok(), "{metrics}");
    assert_eq!(sent(&metrics), Some(4), "{metrics}");
    Ok(())
}

#[tokio::test]
async fn a_plugin_stopped_for_good_leaves_the_node_condition_unknown_not_a_stale_true() -> TestResult
{
    let mut node = ApiNode::start("{}\n").await?;
    node.inject(&[format!("xid {} 79", gpu(1))]);
    node.wait("the condition True", |r| {
        condition_patches(r)
            .last()
            .is_some_and(|p| p.status == 200 && patched_condition(p)["status"] == "True")
    })
    .await?;
    // A rollback: the plugin's pod is deleted.
    node.plugin.signal(nix::sys::signal::Signal::SIGTERM);
    let exit = node.plugin.wait_exit(WAIT).await;
    assert!(exit.is_some_and(|s| s.success()), "{}", node.plugin.log());
    let condition = node.api.node_condition(NODE, "GPUUnhealthy").unwrap();
    assert_eq!(condition["status"], "Unknown", "{condition}");
    assert_eq!(condition["reason"], "PluginStopped");
    let message = condition["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("GPU health is not watched by it")
            && message.contains("its last report (True): 1 of 4 GPUs Unhealthy"),
        "{message}"
    );
    Ok(())
}

#[tokio::test]
async fn a_plugin_stopped_while_its_condition_write_is_unanswered_still_leaves_it_unknown()
-> TestResult {
    let mut node = ApiNode::start("{}\n").await?;
    node.wait("the first condition", |r| !condition_patches(r).is_empty())
        .await?;
    node.api.apply_and_hold_next_status_patch();
    node.inject(&[format!("xid {} 79", gpu(1))]);
    node.wait("the condition True taken in", |r| {
        condition_patches(r)
            .last()
            .is_some_and(|p| patched_condition(p)["status"] == "True")
    })
    .await?;
    // The API server has applied the write; its answer has not reached the plugin when it is stopped.
    node.plugin.signal(nix::sys::signal::Signal::SIGTERM);
    let exit = node.plugin.wait_exit(WAIT).await;
    assert!(exit.is_some_and(|s| s.success()), "{}", node.plugin.log());
    let condition = node.api.node_condition(NODE, "GPUUnhealthy").unwrap();
    assert_eq!(condition["status"], "Unknown", "{condition}");
    let message = condition["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("its last report (True): 1 of 4 GPUs Unhealthy"),
        "{message}"
    );
    Ok(())
}

#[tokio::test]
async fn a_stopping_plugin_leaves_alone_the_condition_a_newer_instance_wrote() -> TestResult {
    let mut node = ApiNode::start("{}\n").await?;
    node.wait("the first condition", |r| !condition_patches(r).is_empty())
        .await?;
    // The new pod of a rolling update has written its own report since.
    let newer = json!({
        "type": "GPUUnhealthy", "status": "True", "reason": "GPUUnhealthy",
        "message": "1 of 4 GPUs Unhealthy. device GPU-x (index 3): Unhealthy: seen by the new pod",
        "lastHeartbeatTime": "2099-01-01T00:00:00Z", "lastTransitionTime": "2099-01-01T00:00:00Z"
    });
    node.api.set_condition(NODE, newer.clone());
    node.plugin.signal(nix::sys::signal::Signal::SIGTERM);
    let exit = node.plugin.wait_exit(WAIT).await;
    assert!(exit.is_some_and(|s| s.success()), "{}", node.plugin.log());
    assert_eq!(node.api.node_condition(NODE, "GPUUnhealthy"), Some(newer));
    assert!(
        node.plugin
            .log()
            .contains("another instance of the plugin has written it since"),
        "{}",
        node.plugin.log()
    );
    Ok(())
}

#[tokio::test]
async fn an_api_server_that_fails_for_a_while_gets_the_newest_condition_once_it_answers()
-> TestResult {
    let node = ApiNode::start("{}\n").await?;
    node.wait("the first condition", |r| !condition_patches(r).is_empty())
        .await?;
    node.api.fail_next(3);
    node.inject(&[format!("xid {} 79", gpu(1))]);
    // The kubelet has it at once, whatever the API server does.
    node.kubelet
        .wait_list("GPU 1 Unhealthy", WAIT, |l| {
            l.health(&gpu(1)) == Some("Unhealthy")
        })
        .await?;
    // The condition and the node's Event are each retried; either may land first.
    node.wait(
        "the condition True and the node's Event after the failures",
        |r| {
            r.iter().filter(|r| r.status == 503).count() == 3
                && condition_patches(r)
                    .last()
                    .is_some_and(|p| p.status == 200 && patched_condition(p)["status"] == "True")
                && r.iter().any(|r| is_event(r, "default", "GPUUnhealthy"))
        },
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn without_rbac_one_line_says_what_is_missing_and_the_kubelet_path_is_untouched() -> TestResult
{
    let node = ApiNode::start("{}\n").await?;
    node.api.forbid(true);
    node.inject(&[format!("xid {} 79", gpu(3))]);
    node.kubelet
        .wait_list("GPU 3 Unhealthy", WAIT, |l| {
            l.health(&gpu(3)) == Some("Unhealthy")
        })
        .await?;
    let log = node
        .plugin
        .wait_log(WAIT, |l| l.contains("cannot record a Kubernetes Event"))
        .await
        .ok_or_else(|| format!("no line about the Event\n{}", node.plugin.log()))?;
    assert!(
        log.contains("create and patch on events.k8s.io events"),
        "{log}"
    );
    let condition_lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("cannot write the node condition"))
        .collect();
    assert_eq!(
        condition_lines.len(),
        1,
        "said once, however often retried: {log}"
    );
    assert!(
        condition_lines[0].contains("get on nodes and patch on nodes/status"),
        "{log}"
    );
    // Allocation refuses the GPU with its message as ever.
    let err = node
        .kubelet
        .allocate(&[&[&gpu(3)]])
        .await
        .expect_err("an Unhealthy GPU is refused");
    assert!(err.message().contains("XID 79"), "{}", err.message());
    Ok(())
}

#[tokio::test]
async fn with_no_api_server_one_line_says_so_and_everything_else_works() -> TestResult {
    let node = support::ScriptedNode::start(2, &[]).await?;
    let log = node
        .plugin
        .wait_log(WAIT, |l| l.contains("no Kubernetes API access"))
        .await
        .ok_or_else(|| format!("no line about API access\n{}", node.plugin.log()))?;
    assert_eq!(log.matches("no Kubernetes API access").count(), 1);
    node.inject(&[format!("xid {} 79", gpu(0))]);
    node.kubelet
        .wait_list("GPU 0 Unhealthy", WAIT, |l| {
            l.health(&gpu(0)) == Some("Unhealthy")
        })
        .await?;
    Ok(())
}

#[tokio::test]
async fn an_unusable_kubeconfig_is_one_line_and_a_failed_start() -> TestResult {
    let dir = tempfile::tempdir()?;
    let missing = dir.path().join("missing-kubeconfig");
    let mut plugin = PluginProcess::spawn_with_env(
        dir.path(),
        &[
            "--simulate",
            "1",
            "--kubeconfig",
            &missing.to_string_lossy(),
        ],
        &[("NODE_NAME", OsStr::new(NODE))],
    );
    let status = plugin
        .wait_exit(WAIT)
        .await
        .ok_or("the plugin kept running")?;
    assert!(!status.success());
    let log = plugin.log();
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("gpu-device-plugin: error: cannot use --kubeconfig")
            && last.contains("missing-kubeconfig"),
        "{log}"
    );
    assert!(
        !dir.path().join("kubelet.sock").exists() && !log.contains("registered with the kubelet")
    );
    Ok(())
}

fn gpus(n: usize) -> Inventory {
    Inventory::new((0..n).map(|i| DeviceInfo {
        id: format!("GPU-{i}"),
        numa_node: None,
        ..DeviceInfo::default()
    }))
}

#[tokio::test]
async fn a_storm_of_faults_is_held_to_the_event_budget() -> TestResult {
    let dir = tempfile::tempdir()?;
    let api = FakeApiServer::start().await?;
    api.add_node(NODE);
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let budget = EventBudget {
        burst: 5,
        refill: Duration::from_secs(3600),
    };
    let api_access = ApiAccess::resolve(&ClusterConfig {
        enabled: true,
        kubeconfig: Some(kubeconfig),
        node_name: Some(NODE.into()),
        budget,
    })
    .await?
    .ok_or("no API access")?;
    let start = Arc::new(gpus(8));
    let (inventory, watch) = tokio::sync::watch::channel(start.clone());
    let metrics = Arc::new(Metrics::new());
    api_access.spawn(
        std::future::ready(()),
        start,
        watch,
        Default::default(),
        metrics.clone(),
        None,
    );

    // Every GPU fails at once, then every one recovers: 16 Events wanted, 5 allowed.
    inventory.send_modify(|inv| {
        let inv = Arc::make_mut(inv);
        for i in 0..8 {
            inv.set_health(
                &format!("GPU-{i}"),
                Health::Unhealthy,
                Some("Unhealthy: XID 79.".into()),
            );
        }
    });
    api.wait_for("the condition True", WAIT, |r| {
        condition_patches(r).last().is_some_and(|p| {
            patched_condition(p)["message"]
                .as_str()
                .unwrap_or("")
                .starts_with("8 of 8")
        })
    })
    .await?;
    inventory.send_modify(|inv| {
        let inv = Arc::make_mut(inv);
        for i in 0..8 {
            inv.set_health(&format!("GPU-{i}"), Health::Healthy, None);
        }
    });
    // Wait for the sender to have seen all 16: 11 dropped.
    tokio::time::timeout(WAIT, async {
        while metrics.events_dropped() < 11 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .map_err(|_| format!("dropped: {}", metrics.events_dropped()))?;
    let requests = api
        .wait_for("the condition False", WAIT, |r| {
            condition_patches(r)
                .last()
                .is_some_and(|p| patched_condition(p)["status"] == "False")
        })
        .await?;
    let events: Vec<&Recorded> = requests
        .iter()
        .filter(|r| r.path.contains("/events"))
        .collect();
    assert_eq!(events.len(), 5, "{events:#?}");
    assert_eq!(metrics.events_dropped(), 11);
    // The first five failures, each its own Event with its own note.
    let notes: Vec<&str> = events
        .iter()
        .map(|r| r.body["note"].as_str().unwrap_or(""))
        .collect();
    for (i, note) in notes.iter().enumerate() {
        assert_eq!(
            *note,
            format!("device GPU-{i} (index {i}): Unhealthy: XID 79.")
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_fault_before_the_api_client_starts_is_still_reported() -> TestResult {
    let dir = tempfile::tempdir()?;
    let api = FakeApiServer::start().await?;
    api.add_node(NODE);
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let access = ApiAccess::resolve(&ClusterConfig {
        enabled: true,
        kubeconfig: Some(kubeconfig),
        node_name: Some(NODE.into()),
        budget: EventBudget::default(),
    })
    .await?
    .ok_or("no API access")?;
    let start = Arc::new(gpus(2));
    let (inventory, watch) = tokio::sync::watch::channel(start.clone());
    let (go, registered) = tokio::sync::oneshot::channel::<()>();
    access.spawn(
        async move {
            let _ = registered.await;
        },
        start,
        watch,
        Default::default(),
        gpu_device_plugin::metrics::Metrics::off(),
        None,
    );
    // The fault comes while the plugin is still registering: nothing has been sent yet.
    inventory.send_modify(|inv| {
        Arc::make_mut(inv).set_health(
            "GPU-1",
            Health::Unhealthy,
            Some("Unhealthy: XID 79.".into()),
        );
    });
    tokio::task::yield_now().await;
    assert!(api.requests().is_empty());
    go.send(()).map_err(|()| "the reporter is gone")?;
    let requests = api
        .wait_for("the Event and the condition", WAIT, |r| {
            r.iter().any(|r| is_event(r, "default", "GPUUnhealthy"))
                && condition_patches(r)
                    .last()
                    .is_some_and(|p| patched_condition(p)["status"] == "True")
        })
        .await?;
    let event = requests
        .iter()
        .find(|r| is_event(r, "default", "GPUUnhealthy"))
        .ok_or("no Event")?;
    assert_eq!(
        event.body["note"],
        "device GPU-1 (index 1): Unhealthy: XID 79."
    );
    Ok(())
}

#[tokio::test]
async fn a_change_while_the_condition_is_being_retried_is_the_one_written() -> TestResult {
    let node = ApiNode::start("{}\n").await?;
    node.wait("the first condition", |r| !condition_patches(r).is_empty())
        .await?;
    node.api.forbid(true);
    node.inject(&[format!("xid {} 79", gpu(1))]);
    node.wait("a refused write of the condition", |r| {
        r.iter()
            .any(|r| r.status == 403 && r.path.starts_with("/api/v1/nodes/"))
    })
    .await?;
    // While the plugin backs off, a second GPU fails; then access is granted.
    node.inject(&[format!("xid {} 79", gpu(2))]);
    node.kubelet
        .wait_list("GPU 2 Unhealthy", WAIT, |l| {
            l.health(&gpu(2)) == Some("Unhealthy")
        })
        .await?;
    node.wait("the plugin trying again after the second fault", |r| {
        r.iter()
            .filter(|r| r.status == 403 && r.path.starts_with("/api/v1/nodes/"))
            .count()
            >= 2
    })
    .await?;
    node.api.forbid(false);
    node.wait("the newest condition written", |r| {
        condition_patches(r).last().is_some_and(|p| {
            p.status == 200
                && patched_condition(p)["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("2 of 4 GPUs Unhealthy."))
        })
    })
    .await?;
    Ok(())
}

/// With time-slicing the kubelet knows a GPU by its replicas; a pod holding one replica is told when the GPU
/// fails, and `/status` names it as a holder of the GPU.
#[tokio::test]
async fn a_pod_holding_a_replica_is_told_when_its_gpu_fails() -> TestResult {
    let node = ApiNode::start(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n",
    )
    .await?;
    node.api.add_pod("ml", "infer-0");
    let replica = format!("{}::1", gpu(3));
    node.kubelet
        .allocate_to("ml", "infer-0", "server", &[&replica])
        .await?;
    node.inject(&[format!("xid {} 79", gpu(3))]);
    node.kubelet
        .wait_list("both replicas of GPU 3 Unhealthy", WAIT, |l| {
            l.health(&replica) == Some("Unhealthy")
                && l.health(&format!("{}::0", gpu(3))) == Some("Unhealthy")
        })
        .await?;
    let requests = node
        .wait("a Warning Event on the pod", |r| {
            r.iter().any(|r| is_event(r, "ml", "GPUUnhealthy"))
        })
        .await?;
    let event = &requests
        .iter()
        .find(|r| is_event(r, "ml", "GPUUnhealthy"))
        .unwrap()
        .body;
    assert_eq!(event["regarding"]["name"], "infer-0");
    let note = event["note"].as_str().unwrap_or_default();
    assert!(note.contains(&gpu(3)) && note.contains("XID 79"), "{note}");
    let addr = node.plugin.http_addr().await.ok_or("no HTTP address")?;
    let (_, body) = http::get(&addr, "/status").await?;
    let status: Value = serde_json::from_slice(&body)?;
    let device = status["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|d| d["id"] == gpu(3).as_str())
        .ok_or("GPU 3 not in /status")?;
    assert_eq!(device["pods"][0]["pod"], "infer-0", "{device}");
    Ok(())
}

#[tokio::test]
async fn the_node_annotation_fences_and_releases_and_bad_entries_are_an_event_on_the_node()
-> TestResult {
    let node = ApiNode::start(QUICK_RECOVERY).await?;
    node.wait("a watch on the node", |r| {
        r.iter()
            .any(|r| r.path == "/api/v1/nodes" && r.query.contains("watch=true"))
    })
    .await?;
    let value = format!(
        "{}=burn-in failed, GPU-not-on-this-node=x, no-reason=",
        gpu(1)
    );
    node.api
        .set_annotation(NODE, "gpu-device-plugin/fenced", Some(&value));
    node.kubelet
        .wait_list("GPU 1 fenced", WAIT, |l| {
            l.health(&gpu(1)) == Some("Unhealthy")
        })
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    // What `kubectl describe node` shows: the condition names the GPU, who fenced it and why.
    let requests = node
        .wait("the condition True with the fence", |r| {
            condition_patches(r).iter().any(|p| {
                let c = patched_condition(p);
                c["status"] == "True"
                    && c["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("burn-in failed"))
            })
        })
        .await?;
    let patch = condition_patches(&requests)
        .into_iter()
        .rev()
        .find(|p| patched_condition(p)["status"] == "True")
        .unwrap();
    let message = patched_condition(patch)["message"].as_str().unwrap_or("");
    assert!(
        message.contains(&gpu(1))
            && message.contains("fenced by the node annotation gpu-device-plugin/fenced"),
        "{message}"
    );
    // The entries it could not use: one Warning Event on the Node naming them.
    let requests = node
        .wait("a Warning Event for the bad entries", |r| {
            r.iter()
                .any(|r| is_event(r, "default", "FenceAnnotationInvalid"))
        })
        .await?;
    let event = &requests
        .iter()
        .find(|r| is_event(r, "default", "FenceAnnotationInvalid"))
        .unwrap()
        .body;
    let note = event["note"].as_str().unwrap_or("");
    assert!(
        note.contains("no device GPU-not-on-this-node") && note.contains("no reason"),
        "{note}"
    );
    assert_eq!(event["type"], "Warning");

    // The entry removed: released.
    node.api
        .set_annotation(NODE, "gpu-device-plugin/fenced", None);
    node.kubelet
        .wait_list("GPU 1 released", WAIT, |l| {
            l.health(&gpu(1)) == Some("Healthy")
        })
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    assert!(node.plugin.log().contains("released by an operator"));
    Ok(())
}
