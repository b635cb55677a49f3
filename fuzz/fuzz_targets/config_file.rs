//! The config file, in this plugin's format and NVIDIA's `version: v1`: read and resolved as at start, and
//! its sharing planned against a node of four GPUs. Any input may be refused; none may panic.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use gpu_device_plugin::config::Settings;
use gpu_device_plugin::devices::mig::ResourceNaming;
use gpu_device_plugin::devices::{DeviceInfo, Inventory};
use gpu_device_plugin::devices::resources::ResourcePlan;
use libfuzzer_sys::fuzz_target;

/// One file, rewritten for every input (the plugin reads its config from a path).
fn config_path() -> &'static PathBuf {
    static FILE: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    let (_dir, path) = FILE.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("config.yaml");
        (dir, path)
    });
    path
}

fn gpu(index: usize) -> DeviceInfo {
    DeviceInfo {
        id: format!("GPU-fa4e0000-0000-4000-8000-{index:012x}"),
        index: Some(index.to_string()),
        ..DeviceInfo::default()
    }
}

fuzz_target!(|data: &[u8]| {
    let path = config_path();
    std::fs::write(path, data).expect("write the config file");
    let argv = [
        "gpu-device-plugin".as_ref(),
        "--config".as_ref(),
        path.as_os_str(),
        "--simulate".as_ref(),
        "4".as_ref(),
    ];
    let Ok(Ok(settings)) = Settings::from_args(argv) else {
        return;
    };
    let inventory = Inventory::new((0..4).map(gpu));
    let natural = ResourceNaming {
        strategy: settings.nvml.mig_strategy,
        base: settings.resource_name.clone(),
    };
    let _plan = ResourcePlan::build(
        &natural,
        settings.allocate.naming.ids,
        settings.sharing.as_ref(),
        &inventory,
    );
});
