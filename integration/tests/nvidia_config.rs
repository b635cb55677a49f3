//! NVIDIA's config file (`version: v1`) and environment variables, against the binary: a file written for
//! NVIDIA's plugin loads, what it ignores is named in one warning each, and its settings change what Allocate
//! returns as they do for NVIDIA's plugin, with flag > environment > file.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use std::ffi::OsStr;

use fake_kubelet::FakeKubelet;
use gpu_device_plugin::sources::simulated::simulated_uuid;
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

/// A container response's mounts as (host path, container path).
fn mounts_of(container: &gpu_device_plugin::api::ContainerAllocateResponse) -> Vec<(&str, &str)> {
    container
        .mounts
        .iter()
        .map(|m| (m.host_path.as_str(), m.container_path.as_str()))
        .collect()
}

async fn start(
    envs: &[(&str, &OsStr)],
) -> Result<(FakeKubelet, PluginProcess, tempfile::TempDir), Box<dyn std::error::Error>> {
    start_with(NVIDIA_FILE, 2, envs).await
}

/// The plugin on `gpus` simulated GPUs with NVIDIA's config file `file` (fault script: `<dir>/faults`),
/// registered, its first list received.
async fn start_with(
    file: &str,
    gpus: usize,
    envs: &[(&str, &OsStr)],
) -> Result<(FakeKubelet, PluginProcess, tempfile::TempDir), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, file)?;
    let faults = dir.path().join("faults");
    let kubelet = FakeKubelet::start(dir.path()).await?;
    let mut all = vec![("CONFIG_FILE", config.as_os_str())];
    all.extend_from_slice(envs);
    let (count, faults) = (gpus.to_string(), faults.to_string_lossy().into_owned());
    let plugin = PluginProcess::spawn_with_env(
        dir.path(),
        &["--simulate", &count, "--simulate-events", &faults],
        &all,
    );
    kubelet
        .wait_list("the first list", WAIT, |l| {
            l.messages >= 1 && l.allocatable() > 0
        })
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
    let mounts = mounts_of(container);
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

const TIME_SLICING: &str = "\
version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
";

#[tokio::test]
async fn time_slicing_lists_replicas_and_a_fault_takes_every_replica_of_its_gpu_in_one_list()
-> TestResult {
    let (kubelet, plugin, dir) = start_with(TIME_SLICING, 2, &[]).await?;
    let registered = kubelet.registrations();
    assert_eq!(
        registered.last().map(|r| r.resource_name.as_str()),
        Some("nvidia.com/gpu.shared")
    );
    let (gpu0, gpu1) = (simulated_uuid(0), simulated_uuid(1));
    let listed: Vec<String> = kubelet
        .list()
        .devices
        .iter()
        .map(|d| d.id.clone())
        .collect();
    let want: Vec<String> = [&gpu0, &gpu1]
        .iter()
        .flat_map(|g| (0..4).map(move |n| format!("{g}::{n}")))
        .collect();
    assert_eq!(listed, want);

    // A replica is its GPU; more than one replica per container is refused with NVIDIA's message.
    let response = kubelet.allocate(&[&[&format!("{gpu0}::2")]]).await?;
    assert_eq!(
        response.container_responses[0]
            .envs
            .get("NVIDIA_VISIBLE_DEVICES"),
        Some(&gpu0)
    );
    let refused = kubelet
        .allocate(&[&[&format!("{gpu0}::0"), &format!("{gpu1}::0")]])
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused
            .message()
            .contains("maximum request size for shared resources is 1; found 2"),
        "{}",
        refused.message()
    );
    // Replicas of one GPU in two containers of a pod are fine.
    kubelet
        .allocate(&[&[&format!("{gpu1}::0")], &[&format!("{gpu1}::1")]])
        .await?;

    // The kubelet's preference: replicas spread over the GPUs.
    let ids: Vec<&str> = want.iter().map(String::as_str).collect();
    let preferred = kubelet.preferred_allocation(&ids, &[], 2).await?;
    let gpus: std::collections::BTreeSet<&str> = preferred
        .iter()
        .filter_map(|id| id.split_once("::").map(|(g, _)| g))
        .collect();
    assert_eq!(gpus.len(), 2, "{preferred:?}");

    // XID 79 on GPU 0: the first list that shows any of its replicas Unhealthy shows all four, and GPU 1's
    // four Healthy.
    let mut lists = kubelet.watch_list();
    lists.borrow_and_update();
    support::append(&dir.path().join("faults"), &[format!("xid {gpu0} 79")]);
    let list = tokio::time::timeout(WAIT, async {
        loop {
            lists.changed().await.ok()?;
            let list = lists.borrow_and_update().clone();
            if list.devices.iter().any(|d| d.health == "Unhealthy") {
                return Some(list);
            }
        }
    })
    .await
    .ok()
    .flatten()
    .ok_or_else(|| format!("no Unhealthy replica\n{}", plugin.log()))?;
    for device in &list.devices {
        let on_gpu0 = device.id.starts_with(&format!("{gpu0}::"));
        assert_eq!(device.health == "Unhealthy", on_gpu0, "{:?}", list.devices);
    }
    assert_eq!(list.allocatable(), 4);
    // A replica of the failed GPU is refused, naming the GPU.
    let refused = kubelet
        .allocate(&[&[&format!("{gpu0}::3")]])
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(refused.message().contains(&gpu0), "{}", refused.message());
    Ok(())
}

#[tokio::test]
async fn index_ids_name_gpus_by_position() -> TestResult {
    let (kubelet, _plugin, _dir) = start_with(
        "version: v1\n",
        2,
        &[("DEVICE_ID_STRATEGY", OsStr::new("index"))],
    )
    .await?;
    let listed: Vec<String> = kubelet
        .list()
        .devices
        .iter()
        .map(|d| d.id.clone())
        .collect();
    assert_eq!(listed, ["0", "1"]);
    let response = kubelet.allocate(&[&["1"]]).await?;
    assert_eq!(
        response.container_responses[0]
            .envs
            .get("NVIDIA_VISIBLE_DEVICES"),
        Some(&simulated_uuid(1))
    );
    let unknown = kubelet.allocate(&[&["2"]]).await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::InvalidArgument);
    Ok(())
}

/// MPS: replicas as with time-slicing, one per container unless the file says otherwise, and every container
/// gets the MPS control daemon's pipe directory and shared memory as NVIDIA's plugin passes them.
#[tokio::test]
async fn mps_passes_the_control_daemons_directories_and_one_replica_per_container() -> TestResult {
    let file = "\
version: v1
flags:
  mpsRoot: /run/nvidia/mps
sharing:
  mps:
    resources:
    - name: nvidia.com/gpu
      replicas: 3
";
    let (kubelet, _plugin, _dir) = start_with(file, 2, &[]).await?;
    assert_eq!(kubelet.list().devices.len(), 6);
    let gpu = simulated_uuid(1);
    let response = kubelet.allocate(&[&[&format!("{gpu}::2")]]).await?;
    let container = &response.container_responses[0];
    assert_eq!(container.envs.get("NVIDIA_VISIBLE_DEVICES"), Some(&gpu));
    assert_eq!(
        container
            .envs
            .get("CUDA_MPS_PIPE_DIRECTORY")
            .map(String::as_str),
        Some("/mps/nvidia.com/gpu/pipe")
    );
    let mounts = mounts_of(container);
    assert_eq!(
        mounts,
        [
            (
                "/run/nvidia/mps/nvidia.com/gpu/pipe",
                "/mps/nvidia.com/gpu/pipe"
            ),
            ("/run/nvidia/mps/shm", "/dev/shm"),
        ]
    );
    let two = kubelet
        .allocate(&[&[&format!("{gpu}::0"), &format!("{gpu}::1")]])
        .await
        .unwrap_err();
    assert_eq!(two.code(), tonic::Code::InvalidArgument);
    Ok(())
}

#[tokio::test]
async fn the_cdi_annotations_strategy_puts_the_cdi_names_in_an_annotation() -> TestResult {
    let (kubelet, _plugin, _dir) = start_with(
        NVIDIA_FILE,
        3,
        &[
            ("DEVICE_LIST_STRATEGY", OsStr::new("cdi-annotations")),
            ("CDI_ANNOTATION_PREFIX", OsStr::new("cdi.example.com/")),
        ],
    )
    .await?;
    let ids = [simulated_uuid(0), simulated_uuid(2)];
    let response = kubelet.allocate(&[&[&ids[0], &ids[1]]]).await?;
    let container = &response.container_responses[0];
    assert_eq!(
        container.envs.get("NVIDIA_VISIBLE_DEVICES"),
        None,
        "{container:?}"
    );
    assert!(container.cdi_devices.is_empty(), "{container:?}");
    assert_eq!(container.annotations.len(), 1, "{container:?}");
    let (key, value) = container.annotations.iter().next().ok_or("no annotation")?;
    let uuid = key
        .strip_prefix("cdi.example.com/nvidia-device-plugin_")
        .ok_or_else(|| format!("key {key}"))?;
    assert_eq!(uuid.len(), 36, "{key}");
    assert_eq!(
        value,
        &format!("nvidia.com/gpu={},nvidia.com/gpu={}", ids[0], ids[1])
    );
    // Each response has a key of its own.
    let again = kubelet.allocate(&[&[&ids[0]]]).await?;
    assert!(
        !again.container_responses[0].annotations.contains_key(key),
        "{again:?}"
    );
    Ok(())
}

/// NVIDIA's sample files (written from its documented v1 schema), each with the node it runs on.
const FIXTURES: &[(&str, &str)] = &[
    (
        "time-slicing.yaml",
        include_str!("fixtures/nvidia/time-slicing.yaml"),
    ),
    (
        "time-slicing-renamed.yaml",
        include_str!("fixtures/nvidia/time-slicing-renamed.yaml"),
    ),
    ("mps.yaml", include_str!("fixtures/nvidia/mps.yaml")),
    (
        "helm-values-style.yaml",
        include_str!("fixtures/nvidia/helm-values-style.yaml"),
    ),
    ("imex.yaml", include_str!("fixtures/nvidia/imex.yaml")),
    (
        "several-node-kinds.yaml",
        include_str!("fixtures/nvidia/several-node-kinds.yaml"),
    ),
    (
        "packed-and-both-sharings.yaml",
        include_str!("fixtures/nvidia/packed-and-both-sharings.yaml"),
    ),
];

fn fixture(name: &str) -> &'static str {
    FIXTURES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, text)| *text)
        .unwrap_or_else(|| panic!("no fixture {name}"))
}

/// On two GPUs, each sample file registers the resource NVIDIA's plugin would and lists as many devices.
#[tokio::test]
async fn nvidias_sample_files_register_the_resource_and_device_count_nvidias_plugin_would()
-> TestResult {
    let expected = [
        ("time-slicing.yaml", "nvidia.com/gpu", 20),
        ("time-slicing-renamed.yaml", "nvidia.com/gpu.shared", 8),
        ("mps.yaml", "nvidia.com/gpu", 6),
        ("helm-values-style.yaml", "nvidia.com/gpu", 2),
        ("imex.yaml", "nvidia.com/gpu", 2),
        // GPU 0 shared twice, GPU 1 (not listed) whole; the other entries name other nodes' devices.
        ("several-node-kinds.yaml", "nvidia.com/gpu", 3),
        // MPS wins over time-slicing: 2 replicas each, not 8.
        ("packed-and-both-sharings.yaml", "nvidia.com/gpu", 4),
    ];
    assert_eq!(expected.len(), FIXTURES.len());
    // The node has IMEX channel 0 (imex.yaml requires it): its device node under the driver root as the
    // plugin's container sees it (a link to /dev/null: any character device passes the check).
    let driver_root = tempfile::tempdir()?;
    let channels = driver_root.path().join("dev/nvidia-caps-imex-channels");
    std::fs::create_dir_all(&channels)?;
    std::os::unix::fs::symlink("/dev/null", channels.join("channel0"))?;
    let envs = [("DRIVER_ROOT_CTR_PATH", driver_root.path().as_os_str())];
    for (name, resource, count) in expected {
        let (kubelet, plugin, _dir) = start_with(fixture(name), 2, &envs).await?;
        let registered = kubelet.registrations();
        assert_eq!(
            registered.last().map(|r| r.resource_name.as_str()),
            Some(resource),
            "{name}\n{}",
            plugin.log()
        );
        assert_eq!(
            kubelet.list().devices.len(),
            count,
            "{name}\n{}",
            plugin.log()
        );
    }
    Ok(())
}

/// No `version:`, `yes`/`no`/`off`, `MigStrategy`, `deviceIdStrategy`: read as NVIDIA's plugin reads them
/// (index IDs, device specs off), with no key reported unknown.
#[tokio::test]
async fn a_file_without_version_with_yaml_1_1_booleans_and_case_variant_keys_is_read_as_nvidia_reads_it()
-> TestResult {
    let (kubelet, plugin, _dir) = start_with(fixture("helm-values-style.yaml"), 2, &[]).await?;
    let listed: Vec<String> = kubelet
        .list()
        .devices
        .iter()
        .map(|d| d.id.clone())
        .collect();
    assert_eq!(listed, ["0", "1"]);
    let response = kubelet.allocate(&[&["1"]]).await?;
    let container = &response.container_responses[0];
    assert_eq!(
        container.envs.get("NVIDIA_VISIBLE_DEVICES"),
        Some(&simulated_uuid(1))
    );
    assert!(container.devices.is_empty(), "{container:?}");
    let log = plugin.log();
    assert!(
        !log.contains("not a key of") && !log.contains("did you mean"),
        "{log}"
    );
    assert!(log.contains("config key flags.useNodeFeatureAPI"), "{log}");
    Ok(())
}

/// `devices` naming GPUs of other nodes: one warning naming them, and the GPU that matches is shared.
#[tokio::test]
async fn devices_of_other_nodes_are_one_warning_naming_them_and_the_matching_gpu_is_shared()
-> TestResult {
    let (kubelet, plugin, _dir) = start_with(fixture("several-node-kinds.yaml"), 2, &[]).await?;
    let (gpu0, gpu1) = (simulated_uuid(0), simulated_uuid(1));
    let listed: Vec<String> = kubelet
        .list()
        .devices
        .iter()
        .map(|d| d.id.clone())
        .collect();
    assert_eq!(listed, [format!("{gpu0}::0"), format!("{gpu0}::1"), gpu1]);
    let log = plugin.log();
    let warned: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("match no device"))
        .collect();
    assert_eq!(warned.len(), 1, "{log}");
    assert!(
        warned[0].contains("devices 7, GPU-00000000-0000-0000-0000-00000000beef")
            && warned[0].contains("sharing the 1 that match"),
        "{log}"
    );
    Ok(())
}

/// Runs the binary on `gpus` simulated GPUs with NVIDIA's file `yaml`, expecting it to stop before it
/// registers: its last stderr line.
fn refusal(gpus: &str, yaml: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("nvidia.yaml");
    std::fs::write(&config, yaml).unwrap();
    let kubelet_dir = dir.path().join("device-plugins");
    std::fs::create_dir(&kubelet_dir).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"))
        .args(["--simulate", gpus, "--http-addr", "", "--kubelet-dir"])
        .arg(&kubelet_dir)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--config-file")
        .arg(&config)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{stderr}");
    assert_eq!(
        std::fs::read_dir(&kubelet_dir).unwrap().count(),
        0,
        "no socket"
    );
    stderr.lines().last().unwrap_or_default().to_string()
}

#[test]
fn version_v2_is_refused_naming_the_version_and_the_one_supported() {
    let last = refusal("1", "version: v2\nflags:\n  migStrategy: none\n");
    assert!(
        last.contains("nvidia.yaml")
            && last.contains("version \"v2\" is not supported")
            && last.contains("version v1"),
        "{last}"
    );
}

#[test]
fn a_replica_count_past_1024_reaches_the_kubelet_size_check_not_a_config_error() {
    // 20 GPUs with 5000 replicas each: 100 000 devices, more than one kubelet message holds.
    let last = refusal(
        "20",
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n      replicas: 5000\n",
    );
    assert!(
        last.contains("the device list of nvidia.com/gpu is")
            && last.contains("(100000 devices), more than the 4194304 bytes the kubelet accepts"),
        "{last}"
    );
}

#[test]
fn a_mig_strategy_error_in_the_file_names_the_file_and_key() {
    let last = refusal("1", "flags:\n  migStrategy: many\n");
    assert!(
        last.contains("nvidia.yaml: flags.migStrategy \"many\": must be none, single or mixed"),
        "{last}"
    );
}
