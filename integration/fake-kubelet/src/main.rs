//! `fake-kubelet`: the fake kubelet device manager as a program, for trying a device plugin by hand or from a
//! test written in another language. It serves `kubelet.sock` in `--dir` and prints one line per event on
//! stdout: `registered <n> <resource> <endpoint>`, then `list <n> <healthy>/<devices>` whenever the
//! resource's device list changes, and `disconnected <n>` when the device manager drops the client in use.
//! SIGTERM or SIGINT stops it.
//!
//! With `--dra-node NAME` it is the kubelet's DRA side instead, with a fake API server beside it: `--dir` is
//! the kubelet's root (it watches `plugins_registry` there), the API server's kubeconfig is written to
//! `<dir>/kubeconfig`, and it prints `registered <driver> <service> <health service>`, `slice <device>
//! <attributes> <taints>` when a published device changes, and `health <device> <health> <message>` when
//! the health stream changes what the kubelet knows of a device (read every 100 ms).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use fake_kubelet::{DeviceManager, FakeKubelet};
use tokio::signal::unix::{SignalKind, signal};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Manager {
    /// Kubelets up to 1.36: one client per resource.
    Legacy,
    /// Kubelets with kubernetes PR #135437: one client per plugin socket.
    MultiClient,
}

/// Command line.
#[derive(Debug, Parser)]
#[command(name = "fake-kubelet", about = "A kubelet device manager stand-in")]
struct Args {
    /// Device plugin directory to serve kubelet.sock in (must exist)
    #[arg(long)]
    dir: PathBuf,
    /// Which device manager to behave as
    #[arg(long, value_enum, default_value = "legacy")]
    device_manager: Manager,
    /// Be the kubelet's DRA side for node NAME, with a fake API server (see above)
    #[arg(long, value_name = "NAME")]
    dra_node: Option<String>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(node) = &args.dra_node {
        return match dra(&args.dir, node).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("fake-kubelet: error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let manager = match args.device_manager {
        Manager::Legacy => DeviceManager::Legacy,
        Manager::MultiClient => DeviceManager::MultiClient,
    };
    let kubelet = match FakeKubelet::start_as(&args.dir, manager).await {
        Ok(kubelet) => kubelet,
        Err(e) => {
            eprintln!("fake-kubelet: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        eprintln!("fake-kubelet: error: cannot install signal handlers");
        return ExitCode::FAILURE;
    };
    println!("serving {}", args.dir.join("kubelet.sock").display());
    let mut registrations = kubelet.watch_registrations();
    let mut lists = kubelet.watch_list();
    let (mut printed_registrations, mut last_list) = (0, String::new());
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            changed = registrations.changed() => {
                if changed.is_err() { break; }
                let regs = registrations.borrow_and_update().clone();
                for (i, reg) in regs.iter().enumerate().skip(printed_registrations) {
                    println!("registered {} {} {}", i + 1, reg.resource_name, reg.endpoint);
                }
                printed_registrations = regs.len();
            }
            changed = lists.changed() => {
                if changed.is_err() { break; }
                let state = lists.borrow_and_update().clone();
                let line = if state.disconnected {
                    format!("disconnected {}", state.registration)
                } else if state.messages == 0 {
                    continue;
                } else {
                    format!("list {} {}/{}", state.registration, state.allocatable(), state.devices.len())
                };
                if line != last_list {
                    println!("{line}");
                    last_list = line;
                }
            }
        }
    }
    ExitCode::SUCCESS
}

/// The DRA side and a fake API server, printing what a driver does, until SIGTERM or SIGINT.
async fn dra(dir: &std::path::Path, node: &str) -> Result<(), Box<dyn std::error::Error>> {
    use fake_kubelet::apiserver::FakeApiServer;
    use fake_kubelet::{DraKubelet, DraOptions};
    let api = FakeApiServer::start().await?;
    api.add_node(node);
    let kubeconfig = dir.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    std::fs::create_dir_all(dir.join("plugins_registry"))?;
    std::fs::create_dir_all(dir.join("plugins"))?;
    let kubelet = DraKubelet::start_with(dir, DraOptions::default().api_server(&api, node))?;
    println!("api {} kubeconfig {}", api.url(), kubeconfig.display());
    let (mut term, mut int) = (
        signal(SignalKind::terminate())?,
        signal(SignalKind::interrupt())?,
    );
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(100));
    let mut printed = std::collections::BTreeMap::<String, String>::new();
    let mut registrations = 0;
    loop {
        tokio::select! {
            _ = term.recv() => return Ok(()),
            _ = int.recv() => return Ok(()),
            _ = tick.tick() => {}
        }
        let regs = kubelet.registrations();
        for reg in regs.iter().skip(registrations) {
            println!(
                "registered {} {} {}",
                reg.driver,
                reg.service.advertised_name(),
                reg.health.map_or("none", |h| h.advertised_name())
            );
        }
        registrations = regs.len();
        for slice in api.slices() {
            let driver = slice["spec"]["driver"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let pool = slice["spec"]["pool"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            for device in slice["spec"]["devices"]
                .as_array()
                .cloned()
                .unwrap_or_default()
            {
                let name = device["name"].as_str().unwrap_or_default().to_string();
                let line = format!(
                    "slice {name} {} taints={}",
                    device["attributes"],
                    device.get("taints").cloned().unwrap_or_default()
                );
                let health = kubelet.device_health(&driver, &pool, &name);
                let health_line = format!(
                    "health {name} {} {}",
                    health.health.as_str(),
                    health.message
                );
                for line in [line, health_line] {
                    let key = line
                        .split_whitespace()
                        .take(2)
                        .collect::<Vec<_>>()
                        .join(" ");
                    if printed.get(&key) != Some(&line) {
                        println!("{line}");
                        printed.insert(key, line);
                    }
                }
            }
        }
    }
}
