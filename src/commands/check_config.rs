//! `gpu-device-plugin check-config`: the settings a start would run with, and on GPUs (simulated or through
//! NVML) the resources it would serve.

use std::process::ExitCode;

use super::{fail, one_line, settings_or_exit};
use crate::config::Settings;
use crate::devices;
use crate::kubelet;
use crate::sources::DeviceSource;
use crate::sources::nvml::NvmlGpus;
use crate::sources::simulated::SimulatedGpus;

/// `gpu-device-plugin check-config [FILE] [FLAGS]`: the settings a start with the same file, flags and
/// environment would run with, and every warning, without starting; a refusal exits non-zero with the same
/// line a start would give. No GPU is touched unless asked: with `--simulate N` or `--nvml-lib`, the GPUs
/// are discovered and the resources planned on them (sharing, MIG, the kubelet's message-size limit).
pub fn run() -> ExitCode {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    argv.remove(1);
    if argv.iter().skip(1).any(|a| a == "--help" || a == "-h") {
        println!(
            "Usage: gpu-device-plugin check-config [FILE] [OPTIONS]\n\n\
             Prints the settings a start with this config file (ours or NVIDIA's), these flags and this\n\
             environment would run with, and every warning; exits non-zero with the reason when a start\n\
             would be refused. Takes every option the plugin takes (see gpu-device-plugin --help). GPUs are\n\
             planned against only with --simulate N or --nvml-lib PATH."
        );
        return ExitCode::SUCCESS;
    }
    if let Some(first) = argv.get(1)
        && !first.to_string_lossy().starts_with('-')
    {
        let file = argv.remove(1);
        argv.splice(1..1, ["--config".into(), file]);
    }
    let asked = |flag: &str, env: &str| {
        argv.iter().any(|a| {
            a.to_str()
                .is_some_and(|a| a == flag || a.starts_with(&format!("{flag}=")))
        }) || std::env::var_os(env).is_some_and(|v| !v.is_empty())
    };
    let with_gpus = asked("--simulate", "GPU_DEVICE_PLUGIN_SIMULATE")
        || asked("--nvml-lib", "GPU_DEVICE_PLUGIN_NVML_LIB");
    let settings = match settings_or_exit(&argv) {
        Ok(settings) => settings,
        Err(exit) => return exit,
    };
    print!("{}", settings.describe());
    for warning in &settings.warnings {
        println!("warning: {warning}");
    }
    if !with_gpus {
        println!(
            "(no GPUs looked at: give --simulate N or --nvml-lib PATH to plan the resources on GPUs)"
        );
        return ExitCode::SUCCESS;
    }
    match plan_on_gpus(&settings) {
        Ok(lines) => {
            print!("{lines}");
            ExitCode::SUCCESS
        }
        Err(e) => fail(&one_line(&e)),
    }
}

/// The resources `settings` would serve on this node's GPUs (or simulated ones), one line each, with the
/// plan's warnings; an error where a start would be refused.
fn plan_on_gpus(settings: &Settings) -> anyhow::Result<String> {
    let mut source: Box<dyn DeviceSource> = match settings.simulate {
        Some(count) => Box::new(SimulatedGpus::new(count).0),
        None => Box::new(NvmlGpus::open(settings.nvml.clone())?),
    };
    let found = devices::Inventory::new(source.discover()?);
    let mut out = format!("devices found: {}\n", found.len());
    // One road per GPU: the device plugin plans what DRA does not serve.
    let inventory = match &settings.dra {
        Some(dra) => {
            dra.gpus
                .check(&found, &source.unserved())
                .map_err(|why| anyhow::anyhow!("{why}"))?;
            let through_dra = found.subset(|i| dra.gpus.serves(i), None);
            let names: Vec<String> = through_dra
                .devices()
                .iter()
                .map(|d| crate::dra::names::device_name(&d.info))
                .collect();
            out.push_str(&format!(
                "serves through DRA as {}: {} devices ({})\n",
                dra.driver,
                names.len(),
                names.join(", ")
            ));
            found.subset(|i| !dra.gpus.serves(i), None)
        }
        None => found,
    };
    if settings.dra.is_some() && inventory.is_empty() {
        out.push_str("the device plugin does not register: every GPU is served through DRA\n");
        return Ok(out);
    }
    let (plan, warnings) = settings.resource_plan(&inventory)?;
    for (position, served) in plan.resources().iter().enumerate() {
        let subset = inventory.subset(|info| plan.serves(position, info), None);
        let devices = subset.len();
        kubelet::server::check_list_size(&served.name, &subset, &served.naming)?;
        let listed = kubelet::server::list_response(&subset, &served.naming)
            .devices
            .len();
        out.push_str(&format!(
            "serves {}: {devices} devices, {listed} listed to the kubelet\n",
            served.name
        ));
    }
    for warning in warnings {
        // A plan's warning may quote every entry of a list from the file.
        out.push_str(&format!(
            "warning: {}\n",
            crate::util::text::shown(&warning, crate::util::text::LINE_MAX)
        ));
    }
    Ok(out)
}
