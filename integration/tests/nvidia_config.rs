//! NVIDIA's config file (`version: v1`) and environment variables, against the binary: a file written for
//! NVIDIA's plugin loads, what it ignores is named in one warning each, and its settings change what Allocate
//! returns as they do for NVIDIA's plugin, with flag > environment > file.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use std::ffi::OsStr;

use fake_kubelet::FakeKubelet;
use gpu_device_plugin::devices::simulated::simulated_uuid;
use support::{PluginProcess, TestResult, WAIT};

/// A file as NVIDIA's Helm chart users write it, with keys of GPU feature discovery, a `resources` section
/// NVIDIA's plugin ignores, and our own `health` section beside them.
const NVIDIA_FILE: &str = "\
version: v1
flags:
  migStrategy: none
  failOnInitError: true
  nvidiaDriverRoot: /
  gdsEnabled: true
  plugin:
    passDeviceSpecs: false
    deviceListStrategy: [envvar, cdi-cri]
    deviceIDStrategy: uuid
  gfd:
    oneshot: false
    sleepInterval: 60s
resources:
  gpus:
  - pattern: '*'
    name: gpu
health:
  quietPeriod: 5m
";

async fn start(
    envs: &[(&str, &OsStr)],
) -> Result<(FakeKubelet, PluginProcess, tempfile::TempDir), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, NVIDIA_FILE)?;
    let kubelet = FakeKubelet::start(dir.path()).await?;
    let mut all = vec![("CONFIG_FILE", config.as_os_str())];
    all.extend_from_slice(envs);
    let plugin = PluginProcess::spawn_with_env(dir.path(), &["--simulate", "2"], &all);
    kubelet
        .wait_list("2 GPUs", WAIT, |l| l.allocatable() == 2)
        .await
        .map_err(|e| format!("{e}\n{}", plugin.log()))?;
    Ok((kubelet, plugin, dir))
}

#[tokio::test]
async fn nvidias_config_file_loads_warns_about_what_it_ignores_and_shapes_allocate() -> TestResult {
    let (kubelet, plugin, _dir) = start(&[]).await?;
    let id = simulated_uuid(0);
    let response = kubelet.allocate(&[&[&id]]).await?;
    let container = &response.container_responses[0];
    assert_eq!(container.envs.get("NVIDIA_VISIBLE_DEVICES"), Some(&id));
    assert_eq!(
        container.envs.get("NVIDIA_GDS").map(String::as_str),
        Some("enabled")
    );
    let cdi: Vec<&str> = container
        .cdi_devices
        .iter()
        .map(|d| d.name.as_str())
        .collect();
    assert_eq!(cdi, [format!("nvidia.com/gpu={id}")]);
    let log = plugin.log();
    for key in ["config key flags.gfd", "config key resources"] {
        assert_eq!(
            log.lines().filter(|l| l.contains(key)).count(),
            1,
            "{key}:\n{log}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn nvidias_environment_variables_win_over_its_config_file() -> TestResult {
    let (kubelet, _plugin, _dir) = start(&[
        ("DEVICE_LIST_STRATEGY", OsStr::new("cdi-cri")),
        ("GDS_ENABLED", OsStr::new("false")),
        ("MOFED_ENABLED", OsStr::new("1")),
    ])
    .await?;
    let id = simulated_uuid(1);
    let response = kubelet.allocate(&[&[&id]]).await?;
    let container = &response.container_responses[0];
    // Only CDI: no NVIDIA_VISIBLE_DEVICES, as NVIDIA's plugin sets none when every strategy is CDI.
    assert_eq!(
        container.envs.get("NVIDIA_VISIBLE_DEVICES"),
        None,
        "{container:?}"
    );
    assert_eq!(container.envs.get("NVIDIA_GDS"), None);
    assert_eq!(
        container.envs.get("NVIDIA_MOFED").map(String::as_str),
        Some("enabled")
    );
    assert_eq!(container.cdi_devices.len(), 1);
    Ok(())
}

#[tokio::test]
async fn the_volume_mounts_strategy_lists_devices_as_mounts() -> TestResult {
    let (kubelet, _plugin, _dir) =
        start(&[("DEVICE_LIST_STRATEGY", OsStr::new("volume-mounts"))]).await?;
    let ids = [simulated_uuid(0), simulated_uuid(1)];
    let response = kubelet.allocate(&[&[&ids[0], &ids[1]]]).await?;
    let container = &response.container_responses[0];
    assert_eq!(
        container
            .envs
            .get("NVIDIA_VISIBLE_DEVICES")
            .map(String::as_str),
        Some("/var/run/nvidia-container-devices")
    );
    let mounts: Vec<(&str, &str)> = container
        .mounts
        .iter()
        .map(|m| (m.host_path.as_str(), m.container_path.as_str()))
        .collect();
    let want: Vec<(&str, String)> = ids
        .iter()
        .map(|id| {
            (
                "/dev/null",
                format!("/var/run/nvidia-container-devices/{id}"),
            )
        })
        .collect();
    assert_eq!(
        mounts,
        want.iter()
            .map(|(h, c)| (*h, c.as_str()))
            .collect::<Vec<_>>()
    );
    assert!(container.cdi_devices.is_empty());
    Ok(())
}
