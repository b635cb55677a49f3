//! The plugin doing its job on simulated GPUs, against a fake kubelet, with no GPU and no node:
//! registration, the device list, Allocate, GPU faults injected through a fault script reaching the kubelet,
//! a kubelet restart that keeps the fault, and recovery when the driver says the GPU is usable again.
//!
//! Run with `cargo run --example demo`.

use std::error::Error;
use std::time::{Duration, Instant};

use fake_kubelet::{FakeKubelet, ListState};
use gpu_device_plugin::kubelet::{self, PluginConfig};
use gpu_device_plugin::monitor::{self, MonitorConfig};
use gpu_device_plugin::sources::simulated::{SimulatedGpus, simulated_uuid};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(10);

fn show(list: &ListState) {
    for d in &list.devices {
        let numa = d
            .topology
            .as_ref()
            .and_then(|t| t.nodes.first())
            .map_or("-".to_string(), |n| n.id.to_string());
        println!("    {}  NUMA {numa}  {}", d.id, d.health);
    }
    println!(
        "    allocatable: {} of {}",
        list.allocatable(),
        list.devices.len()
    );
}

/// Appends one fault command to the script, as `echo ... >> faults` would.
fn append(script: &std::path::Path, line: &str) -> std::io::Result<()> {
    use std::io::Write;
    println!("   $ echo '{line}' >> {}", script.display());
    let mut file = std::fs::OpenOptions::new().append(true).open(script)?;
    writeln!(file, "{line}")
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_target(false)
        .init();

    let dir = tempfile::tempdir()?;
    println!("\n== fake kubelet serving {}", dir.path().display());
    let mut kubelet = FakeKubelet::start(dir.path()).await?;

    println!("\n== plugin starting with 8 simulated GPUs");
    let script = dir.path().join("faults");
    println!(
        "   faults are injected by appending to {}",
        script.display()
    );
    let (gpus, _control) = SimulatedGpus::new(8);
    let gpus = gpus.with_fault_script(&script);
    let inventory = monitor::spawn(Box::new(gpus), MonitorConfig::in_memory())?;
    let shutdown = CancellationToken::new();
    let config = PluginConfig::new(dir.path(), "nvidia.com/gpu");
    let plugin = tokio::spawn(kubelet::run(config, inventory, shutdown.clone()));

    let regs = kubelet.wait_registrations(1, WAIT).await?;
    println!(
        "\n== kubelet: {} registered at {}",
        regs[0].resource_name, regs[0].endpoint
    );
    let list = kubelet
        .wait_list("first list", WAIT, |l| !l.devices.is_empty())
        .await?;
    println!("== kubelet: ListAndWatch");
    show(&list);

    let gpu = simulated_uuid;
    let (g0, g1, g3) = (gpu(0), gpu(1), gpu(3));
    let chosen = kubelet
        .preferred_allocation(
            &list
                .devices
                .iter()
                .map(|d| d.id.as_str())
                .collect::<Vec<_>>(),
            &[],
            4,
        )
        .await?;
    println!(
        "\n== kubelet: GetPreferredAllocation for 4 GPUs -> one NUMA node:\n    {}",
        chosen.join("\n    ")
    );
    let response = kubelet.allocate(&[&[&g0, &g1]]).await?;
    let env = &response.container_responses[0].envs;
    println!(
        "\n== kubelet: Allocate [{g0}, {g1}]\n    NVIDIA_VISIBLE_DEVICES={}",
        env.get("NVIDIA_VISIBLE_DEVICES").map_or("", String::as_str)
    );

    println!("\n== GPU {g1} reports XID 13 (an application fault: the GPU stays Healthy)");
    append(&script, &format!("xid {g1} 13"))?;
    println!("\n== GPU {g3} reports XID 79 (fallen off the bus)");
    let faulted = Instant::now();
    append(&script, &format!("xid {g3} 79"))?;
    let list = kubelet
        .wait_list("fault seen", WAIT, |l| l.health(&g3) == Some("Unhealthy"))
        .await?;
    println!(
        "== kubelet: ListAndWatch ({:?} after the fault)",
        faulted.elapsed()
    );
    show(&list);
    match kubelet.allocate(&[&[&g3]]).await {
        Ok(_) => println!("    Allocate of the faulty GPU succeeded (unexpected)"),
        Err(status) => println!(
            "\n== kubelet: Allocate [{g3}] -> {:?}: {}",
            status.code(),
            status.message()
        ),
    }

    println!("\n== kubelet restarts (deletes every socket, re-creates kubelet.sock)");
    let restarted = Instant::now();
    kubelet.restart()?;
    let regs = kubelet.wait_registrations(2, WAIT).await?;
    println!(
        "== kubelet: registered again after {:?}",
        regs[1].received_at - restarted
    );
    let list = kubelet
        .wait_list("list after restart", WAIT, |l| {
            l.registration >= 2 && l.messages > 0
        })
        .await?;
    println!("== kubelet: ListAndWatch on the new stream (the fault is remembered)");
    show(&list);

    println!(
        "\n== the GPU is reset: the driver's recovery action goes to 1 (GPU reset) and back to 0 (None)"
    );
    append(&script, &format!("action {g3} 1"))?;
    append(&script, &format!("action {g3} 0"))?;
    let list = kubelet
        .wait_list("recovery", WAIT, |l| l.health(&g3) == Some("Healthy"))
        .await?;
    println!("== kubelet: ListAndWatch (the GPU is back)");
    show(&list);

    println!("\n== plugin shutting down");
    shutdown.cancel();
    plugin.await??;
    let left: Vec<_> = std::fs::read_dir(dir.path())?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    println!("== left in the directory: {left:?}\n");
    Ok(())
}
