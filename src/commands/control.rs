//! `gpu-device-plugin fence` and `release`: one request to the running plugin's control socket.

use std::process::ExitCode;

use super::{command_runtime, fail, subcommand_argv, usage_exit};
use crate::config;

#[derive(Debug, clap::Parser)]
#[command(
    name = "gpu-device-plugin fence",
    about = "Take a GPU (or every MIG device of a GPU) out of service until it is released: the running plugin \
             lists it Unhealthy with the reason, and keeps it so across restarts and reboots"
)]
struct FenceArgs {
    /// The GPU or MIG device UUID, or its NVML index as nvidia-smi shows it (a GPU's UUID or index fences
    /// all its MIG devices)
    device: String,
    /// Why, as operators will read it in the device's message (required; asked for by the plugin, so that
    /// its refusal names the command that works)
    #[arg(long)]
    reason: Option<String>,
    /// The running plugin's --state-dir (its control socket is there)
    #[arg(long, env = "GPU_DEVICE_PLUGIN_STATE_DIR", default_value = config::DEFAULT_STATE_DIR, value_name = "DIR")]
    state_dir: std::path::PathBuf,
}

#[derive(Debug, clap::Parser)]
#[command(
    name = "gpu-device-plugin release",
    about = "Put a fenced GPU back in service, or clear one condition stuck on a repaired GPU (--condition)"
)]
struct ReleaseArgs {
    /// The GPU or MIG device UUID, or its NVML index as nvidia-smi shows it
    device: String,
    /// Why (logged with who released it)
    #[arg(long)]
    reason: Option<String>,
    /// The condition to clear instead of the fence: xid-<N>, ecc-dbe, gpu-lost, ecc-sbe-burst,
    /// recovery-action, unmonitored (a `recover: never` one is logged at warn level)
    #[arg(long, value_name = "CONDITION")]
    condition: Option<String>,
    /// The running plugin's --state-dir (its control socket is there)
    #[arg(long, env = "GPU_DEVICE_PLUGIN_STATE_DIR", default_value = config::DEFAULT_STATE_DIR, value_name = "DIR")]
    state_dir: std::path::PathBuf,
}

/// `gpu-device-plugin fence` and `release`: one request to the running plugin's control socket.
pub fn run(fence: bool) -> ExitCode {
    use clap::Parser as _;
    let argv = subcommand_argv();
    let parsed = if fence {
        FenceArgs::try_parse_from(argv).map(|a| {
            let request = crate::fence::control::ControlRequest {
                device: a.device,
                reason: a.reason,
                ..Default::default()
            };
            (a.state_dir, request)
        })
    } else {
        ReleaseArgs::try_parse_from(argv).map(|a| {
            let request = crate::fence::control::ControlRequest {
                device: a.device,
                reason: a.reason,
                condition: a.condition,
                ..Default::default()
            };
            (a.state_dir, request)
        })
    };
    let (state_dir, mut request) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => return usage_exit(&e),
    };
    request.user = ["SUDO_USER", "USER", "LOGNAME"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|u| !u.is_empty()));
    let runtime = match command_runtime() {
        Ok(runtime) => runtime,
        Err(exit) => return exit,
    };
    match runtime.block_on(crate::fence::control::send(&state_dir, fence, &request)) {
        Ok(devices) => {
            let done = if fence { "fenced" } else { "released" };
            for device in devices {
                println!("{done} {}: {}", device.id, device.health);
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e.to_string()),
    }
}
