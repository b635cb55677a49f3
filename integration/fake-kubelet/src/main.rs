//! `fake-kubelet`: the fake kubelet device manager as a program, for trying a device plugin by hand or from a
//! test written in another language. It serves `kubelet.sock` in `--dir` and prints one line per event on
//! stdout: `registered <n> <resource> <endpoint>`, then `list <n> <healthy>/<devices>` whenever the
//! resource's device list changes, and `disconnected <n>` when the device manager drops the client in use.
//! SIGTERM or SIGINT stops it.

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
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
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
