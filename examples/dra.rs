//! The plugin serving simulated GPUs through DRA, with no GPU and no node: the fake kubelet's DRA side finds
//! and registers it, the fake API server gets its ResourceSlice, a pod's claim is prepared, a GPU fault
//! reaches the pod's status (`allocatedResourcesStatus`, as the kubelet computes it) and the slice's taints,
//! and recovery clears both.
//!
//! Run with `cargo run --example dra`.

use std::error::Error;
use std::time::Duration;

use fake_kubelet::apiserver::{AllocationResult, FakeApiServer};
use fake_kubelet::dra::{Health, Pod, PodClaim};
use fake_kubelet::{DraKubelet, DraOptions};
use gpu_device_plugin::dra::registration::DraStatus;
use gpu_device_plugin::dra::{self, DraConfig};
use gpu_device_plugin::metrics::Metrics;
use gpu_device_plugin::monitor::{self, MonitorConfig};
use gpu_device_plugin::sources::simulated::{SimulatedGpus, simulated_uuid};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(10);
const NODE: &str = "demo-node";
const DRIVER: &str = "gpu.nvidia.com";

/// Appends one fault command to the script, as `echo ... >> faults` would.
fn append(script: &std::path::Path, line: &str) -> std::io::Result<()> {
    use std::io::Write;
    println!("   $ echo '{line}' >> {}", script.display());
    let mut file = std::fs::OpenOptions::new().append(true).open(script)?;
    writeln!(file, "{line}")
}

/// The pod's `status.containerStatuses[].allocatedResourcesStatus`, as `kubectl get pod -o yaml` would show it.
fn show_status(status: &Value) -> Result<(), Box<dyn Error>> {
    for line in serde_json::to_string_pretty(status)?.lines() {
        println!("    {line}");
    }
    Ok(())
}

/// The taints of device `name` in the node's slices.
fn taints(api: &FakeApiServer, name: &str) -> Vec<String> {
    api.slices()
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .filter(|d| d["name"] == name)
        .flat_map(|d| d["taints"].as_array().cloned().unwrap_or_default())
        .map(|t| {
            format!(
                "{}={}:{}",
                t["key"].as_str().unwrap_or_default(),
                t["value"].as_str().unwrap_or_default(),
                t["effect"].as_str().unwrap_or_default()
            )
        })
        .collect()
}

fn health_of(status: &Value) -> String {
    status[0]["allocatedResourcesStatus"][0]["resources"][0]["health"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_target(false)
        .init();

    let dir = tempfile::tempdir()?;
    let api = FakeApiServer::start().await?;
    api.add_node(NODE);
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    println!("\n== fake API server at {} (node {NODE})", api.url());
    let kubelet = DraKubelet::start_with(dir.path(), DraOptions::default().api_server(&api, NODE))?;
    println!(
        "== fake kubelet (1.36) watching {}",
        dir.path().join("plugins_registry").display()
    );

    println!("\n== plugin serving 4 simulated GPUs through DRA");
    let script = dir.path().join("faults");
    let (gpus, _control) = SimulatedGpus::new(4);
    let monitored = monitor::spawn_monitored(
        Box::new(gpus.with_fault_script(&script)),
        MonitorConfig::in_memory(),
    )?;
    let shutdown = CancellationToken::new();
    let kube = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::read_from(&kubeconfig)?,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    let config = DraConfig {
        driver: DRIVER.into(),
        registry_dir: dir.path().join("plugins_registry"),
        plugins_dir: dir.path().join("plugins"),
        pool: NODE.into(),
        cdi_kind: "nvidia.com/gpu".into(),
        state_dir: dir.path().join("state"),
        boot_id: None,
        heartbeat: dra::health::HEARTBEAT,
        pod_uid: None,
    };
    std::fs::create_dir_all(&config.state_dir)?;
    let stopped = dra::spawn(
        config,
        monitored.inventory.clone(),
        Some(dra::view::Conditions {
            monitor: monitored.handle.clone(),
            devices: monitored.devices.follow(),
        }),
        kube,
        tokio::sync::watch::Sender::new(DraStatus::default()),
        Metrics::off(),
        shutdown.clone(),
    )?;

    let registration = kubelet.wait_registered(DRIVER, WAIT).await?;
    println!(
        "\n== kubelet: DRA driver {} registered, {} on {}, health stream {}",
        registration.driver,
        registration.service.advertised_name(),
        registration.endpoint.display(),
        registration.health.map_or("none", |h| h.advertised_name())
    );
    let slices = api
        .wait_for_slices("the node's slice", WAIT, |s| !s.is_empty())
        .await?;
    println!(
        "== API server: ResourceSlice {}",
        slices[0]["metadata"]["name"]
    );
    for d in slices[0]["spec"]["devices"]
        .as_array()
        .cloned()
        .unwrap_or_default()
    {
        println!(
            "    {}  {}  {}",
            d["name"].as_str().unwrap_or_default(),
            d["attributes"]["uuid"]["string"]
                .as_str()
                .unwrap_or_default(),
            d["attributes"]["productName"]["string"]
                .as_str()
                .unwrap_or_default()
        );
    }

    let uid = api.add_claim(
        "ml",
        "train-gpu",
        vec![AllocationResult::new("gpu", DRIVER, NODE, "gpu-1")],
    );
    let pod = Pod::new("ml", "train-0").claim(
        PodClaim::new("gpu", &uid)
            .resource_claim("train-gpu")
            .used_by("main", "gpu"),
    );
    kubelet.prepare_pod(&pod).await?;
    println!(
        "\n== kubelet: pod ml/train-0 with claim train-gpu (gpu-1) prepared; container main gets CDI devices:\n    {}",
        kubelet.cdi_devices(&pod, "main").join("\n    ")
    );
    let status = kubelet
        .wait_allocated_resources_status(&pod, "Healthy", WAIT, |s| health_of(s) == "Healthy")
        .await?;
    println!("== the pod's allocatedResourcesStatus:");
    show_status(&status)?;

    let g1 = simulated_uuid(1);
    println!("\n== GPU 1 falls off the bus (XID 79)");
    append(&script, &format!("xid {g1} 79"))?;
    let status = kubelet
        .wait_allocated_resources_status(&pod, "Unhealthy", WAIT, |s| health_of(s) == "Unhealthy")
        .await?;
    println!("== the pod's allocatedResourcesStatus, from the DRA health stream:");
    show_status(&status)?;
    api.wait_for_slices("the taint", WAIT, |_| !taints(&api, "gpu-1").is_empty())
        .await?;
    println!(
        "== gpu-1's taints in the ResourceSlice: {}",
        taints(&api, "gpu-1").join(", ")
    );

    println!(
        "\n== the GPU is reset: the driver's recovery action goes to 1 (GPU reset) and back to 0 (None)"
    );
    append(&script, &format!("action {g1} 1"))?;
    append(&script, &format!("action {g1} 0"))?;
    let status = kubelet
        .wait_allocated_resources_status(&pod, "Healthy again", WAIT, |s| health_of(s) == "Healthy")
        .await?;
    println!("== the pod's allocatedResourcesStatus:");
    show_status(&status)?;
    api.wait_for_slices("the taint gone", WAIT, |_| taints(&api, "gpu-1").is_empty())
        .await?;
    println!("== gpu-1's taints in the ResourceSlice: none");
    let health = kubelet.device_health(DRIVER, NODE, "gpu-1");
    assert_eq!(health.health, Health::Healthy);

    let failed = kubelet.end_pod(&pod).await?;
    println!(
        "\n== kubelet: pod ended, claim unprepared{}",
        if failed.is_empty() {
            ""
        } else {
            " (with errors)"
        }
    );
    shutdown.cancel();
    match tokio::time::timeout(WAIT, stopped).await {
        Ok(Ok(Ok(()))) => println!("== plugin stopped"),
        Ok(Ok(Err(e))) => println!("== plugin stopped: {e}"),
        _ => println!("== plugin did not stop in time"),
    }
    Ok(())
}
