//! MIG on the real NVML code path: the fake libnvidia-ml with GPUs in MIG mode, the real binary, the fake
//! kubelet holding one state per resource. Resources and IDs per strategy, health per MIG device.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use std::ffi::OsStr;

use gpu_device_plugin::devices::facts::{DeviceFacts, MigCapacities, MigPlacement};

use support::{NvmlNode, PluginProcess, TestResult, WAIT, fake_nvml_gpu as gpu, fake_nvml_lib};

/// MIG device `n` of fake GPU `g`, as the fake names them when the device list gives no UUID.
fn mig(g: usize, n: usize) -> String {
    format!("MIG-fa4e0000-{g:04x}-4000-8000-{n:012x}")
}

const MIG_1G: &str = "nvidia.com/mig-1g.10gb";
const MIG_2G: &str = "nvidia.com/mig-2g.20gb";

/// GPU 0 in MIG mode with two 1g.10gb and one 2g.20gb; GPU 1 whole.
fn two_profiles_on_gpu0() -> String {
    format!(
        r#"{{"devices":[
            {{"uuid":"{}","mig":[{{"profile":"1g.10gb"}},{{"profile":"1g.10gb"}},{{"profile":"2g.20gb"}}]}},
            {{"uuid":"{}"}}]}}"#,
        gpu(0),
        gpu(1)
    )
}

/// The driver's capability minors for GPU 0's instances (GPU instance IDs 1..3, compute instance 0).
fn write_mig_minors(dir: &std::path::Path) {
    let caps = dir.join("proc/driver/nvidia-caps");
    std::fs::create_dir_all(&caps).unwrap();
    std::fs::write(
        caps.join("mig-minors"),
        "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\ngpu0/gi2/access 21\n\
         gpu0/gi2/ci0/access 22\ngpu0/gi3/access 30\ngpu0/gi3/ci0/access 31\n",
    )
    .unwrap();
}

async fn mixed_node(extra: &[&str]) -> Result<NvmlNode, Box<dyn std::error::Error>> {
    let mut args = vec!["--mig-strategy", "mixed"];
    args.extend_from_slice(extra);
    let node = NvmlNode::start(Some(&two_profiles_on_gpu0()), &args).await?;
    node.kubelet.wait_registrations(3, WAIT).await?;
    for resource in ["nvidia.com/gpu", MIG_1G, MIG_2G] {
        node.kubelet
            .wait_list_of(resource, resource, WAIT, |l| !l.devices.is_empty())
            .await?;
    }
    Ok(node)
}

fn ids(list: &fake_kubelet::ListState) -> Vec<String> {
    list.devices.iter().map(|d| d.id.clone()).collect()
}

#[tokio::test]
async fn mixed_serves_each_mig_profile_as_a_resource_and_whole_gpus_as_gpus() -> TestResult {
    let node = mixed_node(&[]).await?;
    let mut resources: Vec<String> = node
        .kubelet
        .registrations()
        .iter()
        .map(|r| r.resource_name.clone())
        .collect();
    resources.sort();
    assert_eq!(resources, ["nvidia.com/gpu", MIG_1G, MIG_2G]);
    let endpoints: std::collections::BTreeSet<String> = node
        .kubelet
        .registrations()
        .iter()
        .map(|r| r.endpoint.clone())
        .collect();
    assert_eq!(endpoints.len(), 3, "one socket per resource");
    assert_eq!(ids(&node.kubelet.list_of("nvidia.com/gpu")), [gpu(1)]);
    assert_eq!(ids(&node.kubelet.list_of(MIG_1G)), [mig(0, 0), mig(0, 1)]);
    assert_eq!(ids(&node.kubelet.list_of(MIG_2G)), [mig(0, 2)]);

    let response = node.kubelet.allocate_on(MIG_1G, &[&[&mig(0, 1)]]).await?;
    let envs = &response.container_responses[0].envs;
    assert_eq!(
        envs.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str),
        Some(mig(0, 1).as_str())
    );
    // A resource serves only its own devices.
    let err = node
        .kubelet
        .allocate_on(MIG_2G, &[&[&mig(0, 0)]])
        .await
        .expect_err("a 1g.10gb device through the 2g.20gb resource");
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");

    // /status shows each device's resource and, for a MIG device, its profile and GPU.
    let addr = node.plugin.http_addr().await.ok_or("no HTTP address")?;
    let report = gpu_device_plugin::http::fetch_report(&addr).await?;
    let device = report
        .devices
        .iter()
        .find(|d| d.id == mig(0, 2))
        .ok_or("MIG device missing from /status")?;
    assert_eq!(device.resource, MIG_2G);
    let mig_status = device.mig.as_ref().ok_or("no MIG details")?;
    assert_eq!(
        (mig_status.profile.as_str(), mig_status.parent.as_str()),
        ("2g.20gb", gpu(0).as_str())
    );
    assert_eq!(report.other_resources.len(), 2);
    Ok(())
}

#[tokio::test]
async fn an_attributed_xid_marks_its_mig_device_only_and_xid_79_every_mig_device_of_the_gpu()
-> TestResult {
    let node = mixed_node(&[]).await?;
    node.inject(&[format!("xid {} 48", mig(0, 1))]);
    let list = node
        .kubelet
        .wait_list_of(MIG_1G, "MIG 0/1 Unhealthy", WAIT, |l| {
            l.health(&mig(0, 1)) == Some("Unhealthy")
        })
        .await?;
    assert_eq!(list.health(&mig(0, 0)), Some("Healthy"));
    assert_eq!(
        node.kubelet.list_of(MIG_2G).health(&mig(0, 2)),
        Some("Healthy")
    );
    let refusal = node
        .kubelet
        .allocate_on(MIG_1G, &[&[&mig(0, 1)]])
        .await
        .expect_err("an Unhealthy MIG device");
    assert!(
        refusal.message().contains("XID 48")
            && refusal.message().contains("MIG device 1g.10gb")
            && refusal.message().contains(&gpu(0)),
        "the refusal names the profile and the GPU: {}",
        refusal.message()
    );

    node.inject(&[format!("xid {} 79", gpu(0))]);
    node.kubelet
        .wait_list_of(MIG_1G, "both 1g.10gb Unhealthy", WAIT, |l| {
            l.allocatable() == 0
        })
        .await?;
    node.kubelet
        .wait_list_of(MIG_2G, "the 2g.20gb Unhealthy", WAIT, |l| {
            l.allocatable() == 0
        })
        .await?;
    assert_eq!(
        node.kubelet.list_of("nvidia.com/gpu").health(&gpu(1)),
        Some("Healthy"),
        "the other GPU is untouched"
    );
    Ok(())
}

#[tokio::test]
async fn an_unattributed_xid_on_a_mig_gpu_marks_every_mig_device_of_it() -> TestResult {
    let node = mixed_node(&[]).await?;
    node.inject(&[format!("xid {} 48", gpu(0))]);
    node.kubelet
        .wait_list_of(MIG_2G, "the 2g.20gb Unhealthy", WAIT, |l| {
            l.allocatable() == 0
        })
        .await?;
    node.kubelet
        .wait_list_of(MIG_1G, "both 1g.10gb Unhealthy", WAIT, |l| {
            l.allocatable() == 0
        })
        .await?;
    Ok(())
}

#[tokio::test]
async fn mig_devices_get_their_gpu_and_capability_nodes_and_index_ids() -> TestResult {
    let dev = tempfile::tempdir()?;
    for node in [
        "dev/nvidia0",
        "dev/nvidiactl",
        "dev/nvidia-caps/nvidia-cap21",
        "dev/nvidia-caps/nvidia-cap22",
    ] {
        let path = dev.path().join(node);
        std::fs::create_dir_all(path.parent().unwrap())?;
        std::fs::write(path, "")?;
    }
    let dev_root = dev.path().to_str().unwrap().to_string();
    let config = two_profiles_on_gpu0();
    let kubelet_dir_root = tempfile::tempdir()?;
    write_mig_minors(kubelet_dir_root.path());
    let proc_root = kubelet_dir_root.path().join("proc");
    let node = NvmlNode::start(
        Some(&config),
        &[
            "--mig-strategy",
            "mixed",
            "--pass-device-specs",
            "--dev-root",
            &dev_root,
            "--proc-root",
            proc_root.to_str().unwrap(),
            "--device-id-strategy",
            "index",
        ],
    )
    .await?;
    let list = node
        .kubelet
        .wait_list_of(MIG_1G, "1g.10gb listed", WAIT, |l| l.devices.len() == 2)
        .await?;
    assert_eq!(ids(&list), ["0:0", "0:1"]);
    let gpus = node
        .kubelet
        .wait_list_of("nvidia.com/gpu", "GPU 1 listed", WAIT, |l| {
            !l.devices.is_empty()
        })
        .await?;
    assert_eq!(ids(&gpus), ["1"], "a whole GPU keeps its NVML index");
    let response = node.kubelet.allocate_on(MIG_1G, &[&["0:1"]]).await?;
    let container = &response.container_responses[0];
    let mut specs: Vec<&str> = container
        .devices
        .iter()
        .map(|d| d.container_path.as_str())
        .collect();
    specs.sort();
    assert_eq!(
        specs,
        [
            "/dev/nvidia-caps/nvidia-cap21",
            "/dev/nvidia-caps/nvidia-cap22",
            "/dev/nvidia0",
            "/dev/nvidiactl"
        ]
    );
    assert_eq!(
        container
            .envs
            .get("NVIDIA_VISIBLE_DEVICES")
            .map(String::as_str),
        Some(mig(0, 1).as_str()),
        "the runtime gets the MIG UUID"
    );
    Ok(())
}

#[tokio::test]
async fn single_serves_one_kind_of_mig_device_as_gpus() -> TestResult {
    let config = format!(
        r#"{{"devices":[
            {{"uuid":"{}","mig":[{{"profile":"3g.40gb"}},{{"profile":"3g.40gb"}}]}},
            {{"uuid":"{}","mig":[{{"profile":"3g.40gb"}},{{"profile":"3g.40gb"}}]}}]}}"#,
        gpu(0),
        gpu(1)
    );
    let node = NvmlNode::start(Some(&config), &["--mig-strategy", "single"]).await?;
    let list = node
        .kubelet
        .wait_list("four MIG devices as nvidia.com/gpu", WAIT, |l| {
            l.devices.len() == 4
        })
        .await?;
    assert_eq!(ids(&list), [mig(0, 0), mig(0, 1), mig(1, 0), mig(1, 1)]);
    let resources: Vec<String> = node
        .kubelet
        .registrations()
        .iter()
        .map(|r| r.resource_name.clone())
        .collect();
    assert_eq!(resources, ["nvidia.com/gpu"]);
    node.inject(&[format!("xid {} 48", mig(1, 0))]);
    let list = node.wait_unhealthy(&mig(1, 0)).await?;
    assert_eq!(list.allocatable(), 3);
    Ok(())
}

/// Runs the plugin on the fake GPUs of `config` and expects it to refuse to start; returns its log.
async fn refused_start(config: &str, strategy: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let kubelet_dir = dir.path().join("device-plugins");
    std::fs::create_dir(&kubelet_dir).unwrap();
    let gpus = dir.path().join("gpus.json");
    std::fs::write(&gpus, config).unwrap();
    let lib = fake_nvml_lib();
    let mut plugin = PluginProcess::spawn_with_env(
        &kubelet_dir,
        &[
            "--nvml-lib",
            lib.to_str().unwrap(),
            "--mig-strategy",
            strategy,
        ],
        &[("FAKE_NVML_CONFIG", OsStr::new(&gpus))],
    );
    let status = plugin.wait_exit(WAIT).await;
    let log = plugin.log();
    assert!(
        status.is_some_and(|s| !s.success()),
        "expected a failed start: {status:?}\n{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
    log
}

#[tokio::test]
async fn single_refuses_two_kinds_of_mig_device_or_mixed_mig_modes_by_name() {
    let two_kinds = format!(
        r#"{{"devices":[{{"uuid":"{}","mig":[{{"profile":"1g.10gb"}}]}},{{"uuid":"{}","mig":[{{"profile":"2g.20gb"}}]}}]}}"#,
        gpu(0),
        gpu(1)
    );
    let log = refused_start(&two_kinds, "single").await;
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.contains("one kind of MIG device")
            && last.contains("1g.10gb")
            && last.contains("2g.20gb")
            && last.contains(&gpu(1)),
        "{log}"
    );
    let modes = format!(
        r#"{{"devices":[{{"uuid":"{}","mig":[{{"profile":"1g.10gb"}}]}},{{"uuid":"{}"}}]}}"#,
        gpu(0),
        gpu(1)
    );
    let log = refused_start(&modes, "single").await;
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.contains("same MIG mode") && last.contains(&gpu(1)),
        "{log}"
    );
}

#[tokio::test]
async fn strategy_none_serves_a_mig_gpu_whole() -> TestResult {
    let node = NvmlNode::start(Some(&two_profiles_on_gpu0()), &[]).await?;
    let list = node
        .kubelet
        .wait_list("two whole GPUs", WAIT, |l| l.devices.len() == 2)
        .await?;
    assert_eq!(ids(&list), [gpu(0), gpu(1)]);
    assert_eq!(node.kubelet.registrations().len(), 1);
    Ok(())
}

#[tokio::test]
async fn nvidias_mixed_config_file_serves_mig_resources() -> TestResult {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("config1.yaml");
    std::fs::write(
        &config,
        "version: v1\nflags:\n  migStrategy: \"mixed\"\n  failOnInitError: true\n  nvidiaDriverRoot: \"/\"\n  \
         plugin:\n    passDeviceSpecs: false\n    deviceListStrategy: envvar\n    deviceIDStrategy: uuid\n",
    )?;
    let node = NvmlNode::start(
        Some(&two_profiles_on_gpu0()),
        &["--config-file", config.to_str().unwrap()],
    )
    .await?;
    node.kubelet.wait_registrations(3, WAIT).await?;
    let list = node
        .kubelet
        .wait_list_of(MIG_2G, "the 2g.20gb listed", WAIT, |l| l.devices.len() == 1)
        .await?;
    assert_eq!(ids(&list), [mig(0, 2)]);
    Ok(())
}

#[tokio::test]
async fn mig_devices_and_gpus_are_shared_each_as_configured_and_a_fault_reaches_every_replica()
-> TestResult {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("config.yaml");
    // One of the two 1g.10gb devices shared under a new name, the whole GPU shared under its own.
    std::fs::write(
        &config,
        "version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n    \
         - name: nvidia.com/mig-1g.10gb\n      rename: mig-1g.10gb.shared\n      replicas: 3\n      \
         devices: ['0:1']\n    - name: gpu\n      replicas: 2\n",
    )?;
    let node = NvmlNode::start(
        Some(&two_profiles_on_gpu0()),
        &["--config-file", config.to_str().ok_or("path")?],
    )
    .await?;
    const SHARED: &str = "nvidia.com/mig-1g.10gb.shared";
    node.kubelet.wait_registrations(4, WAIT).await?;
    for resource in ["nvidia.com/gpu", MIG_1G, MIG_2G, SHARED] {
        node.kubelet
            .wait_list_of(resource, resource, WAIT, |l| !l.devices.is_empty())
            .await?;
    }
    let replicas = |id: String, n: usize| (0..n).map(move |i| format!("{id}::{i}"));
    assert_eq!(
        ids(&node.kubelet.list_of("nvidia.com/gpu")),
        replicas(gpu(1), 2).collect::<Vec<_>>()
    );
    assert_eq!(ids(&node.kubelet.list_of(MIG_1G)), [mig(0, 0)]);
    assert_eq!(
        ids(&node.kubelet.list_of(SHARED)),
        replicas(mig(0, 1), 3).collect::<Vec<_>>()
    );
    assert_eq!(ids(&node.kubelet.list_of(MIG_2G)), [mig(0, 2)]);

    // Two replicas of the shared MIG device in one container: that one MIG device.
    let shared_ids: Vec<String> = replicas(mig(0, 1), 2).collect();
    let request: Vec<&str> = shared_ids.iter().map(String::as_str).collect();
    let response = node.kubelet.allocate_on(SHARED, &[&request]).await?;
    assert_eq!(
        response.container_responses[0]
            .envs
            .get("NVIDIA_VISIBLE_DEVICES")
            .map(String::as_str),
        Some(mig(0, 1).as_str())
    );

    // A fault attributed to the shared MIG device: its three replicas in one message, nothing else.
    node.inject(&[format!("xid {} 48", mig(0, 1))]);
    let list = node
        .kubelet
        .wait_list_of(SHARED, "every replica Unhealthy", WAIT, |l| {
            l.devices.iter().any(|d| d.health == "Unhealthy")
        })
        .await?;
    assert!(
        list.devices.iter().all(|d| d.health == "Unhealthy"),
        "every replica in the same message: {:?}",
        list.devices
    );
    let addr = node.plugin.http_addr().await.ok_or("no HTTP address")?;
    let report = gpu_device_plugin::http::fetch_report(&addr).await?;
    let of = |id: &str| report.devices.iter().find(|d| d.id == id);
    assert_eq!(of(&mig(0, 1)).map(|d| d.resource.as_str()), Some(SHARED));
    for (id, resource) in [(mig(0, 0), MIG_1G), (gpu(1), "nvidia.com/gpu")] {
        let device = of(&id).ok_or("device missing from /status")?;
        assert_eq!(
            (device.health.as_str(), device.resource.as_str()),
            ("Healthy", resource)
        );
    }
    for resource in ["nvidia.com/gpu", MIG_1G] {
        let list = node.kubelet.list_of(resource);
        assert!(
            list.devices.iter().all(|d| d.health == "Healthy"),
            "{resource}: {list:?}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn sharing_mig_devices_through_mps_is_refused_by_name() -> TestResult {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        "version: v1\nflags:\n  migStrategy: mixed\n  mpsRoot: /run/nvidia/mps\nsharing:\n  mps:\n    \
         resources:\n    - name: nvidia.com/mig-1g.10gb\n      replicas: 2\n",
    )?;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"))
        .args(["--simulate", "1", "--kubelet-dir"])
        .arg(dir.path().join("missing"))
        .args(["--config-file", config.to_str().ok_or("path")?])
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("MPS cannot share MIG devices"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    Ok(())
}

#[tokio::test]
async fn every_resource_registers_again_after_a_kubelet_restart() -> TestResult {
    let mut node = mixed_node(&[]).await?;
    node.kubelet.restart()?;
    node.kubelet.wait_registrations(6, WAIT).await?;
    for resource in ["nvidia.com/gpu", MIG_1G, MIG_2G] {
        let list = node
            .kubelet
            .wait_list_of(resource, resource, WAIT, |l| {
                l.registration > 3 && !l.devices.is_empty() && !l.disconnected
            })
            .await?;
        assert!(list.allocatable() > 0, "{resource}: {list:?}");
    }
    let mut resources: Vec<String> = node.kubelet.registrations()[3..]
        .iter()
        .map(|r| r.resource_name.clone())
        .collect();
    resources.sort();
    assert_eq!(resources, ["nvidia.com/gpu", MIG_1G, MIG_2G]);
    Ok(())
}

#[tokio::test]
async fn mig_devices_carry_their_placement_engines_and_their_gpus_facts() -> TestResult {
    // GPU 0: a 3g.40gb placed at memory slice 4 and a 1g.10gb that takes the lowest free one. GPU 1 cannot
    // say its GPU instance profiles: its MIG device is served all the same, without engine counts.
    let config = format!(
        r#"{{"devices":[
            {{"uuid":"{}","mig":[{{"profile":"3g.40gb","placement_start":4}},{{"profile":"1g.10gb"}}]}},
            {{"uuid":"{}","pci_bus_id":"00000000:2A:00.0","minor":5,
              "not_supported":["nvmlDeviceGetGpuInstanceProfileInfo"],"mig":[{{"profile":"1g.10gb"}}]}}]}}"#,
        gpu(0),
        gpu(1)
    );
    // A sysfs of its own (empty): nothing of the machine the test runs on.
    let node = NvmlNode::start(
        Some(&config),
        &["--mig-strategy", "mixed", "--sysfs-root", "{dir}/sys"],
    )
    .await?;
    node.kubelet.wait_registrations(2, WAIT).await?;
    node.kubelet
        .wait_list_of(MIG_1G, "both 1g.10gb listed", WAIT, |l| {
            l.devices.len() == 2
        })
        .await?;
    let addr = node.plugin.http_addr().await.ok_or("no HTTP address")?;
    let report = gpu_device_plugin::http::fetch_report(&addr).await?;
    let facts = |id: &str| {
        report
            .devices
            .iter()
            .find(|d| d.id == id)
            .and_then(|d| d.facts.clone())
            .ok_or(format!("{id}: no facts in /status"))
    };
    let engines = |multiprocessors, n| MigCapacities {
        multiprocessors,
        copy_engines: n,
        decoders: n,
        encoders: 0,
        jpeg_engines: n,
        ofa_engines: 0,
    };

    let big = facts(&mig(0, 0))?;
    assert_eq!(
        big.mig,
        Some(MigPlacement {
            gi_profile_id: 9,
            placement_start: 4,
            placement_size: 4,
            capacities: Some(engines(60, 3)),
        })
    );
    assert_eq!(big.memory_bytes, Some(40448 * 1024 * 1024));
    // The rest is its GPU's, as NVIDIA publishes a MIG device's attributes.
    assert_eq!(
        DeviceFacts {
            mig: None,
            memory_bytes: None,
            ..big.clone()
        },
        DeviceFacts {
            minor: Some(0),
            product_name: Some("NVIDIA H100 80GB HBM3".into()),
            brand: Some("Nvidia".into()),
            architecture: Some("Hopper".into()),
            cuda_compute_capability: Some((9, 0)),
            pci_bus_id: Some("0000:00:00.0".into()),
            driver_version: Some("580.65.06".into()),
            cuda_driver_version: Some("13.0".into()),
            ..DeviceFacts::default()
        }
    );
    let small = facts(&mig(0, 1))?;
    assert_eq!(
        small.mig,
        Some(MigPlacement {
            gi_profile_id: 19,
            placement_start: 0,
            placement_size: 1,
            capacities: Some(engines(16, 1)),
        })
    );

    let blind = facts(&mig(1, 0))?;
    assert_eq!(
        (blind.minor, blind.pci_bus_id.as_deref()),
        (Some(5), Some("0000:2a:00.0")),
        "its GPU's minor and address"
    );
    assert_eq!(
        blind.mig,
        Some(MigPlacement {
            gi_profile_id: 19,
            placement_start: 0,
            placement_size: 1,
            capacities: None,
        })
    );
    assert_eq!(
        blind.memory_bytes,
        Some(9984 * 1024 * 1024),
        "the MIG device's own memory where the profile's is unknown"
    );
    Ok(())
}

/// `check-config` on the fake library's GPUs (`config`, JSON) with `extra` arguments: its output.
fn check_config_on(config: &str, extra: &[&str]) -> String {
    check_config_with(config, extra, "", 0)
}

/// As [`check_config_on`], with the fake's event script holding `events` before the start and the driver's
/// GPU list naming `listed` GPUs.
fn check_config_with(config: &str, extra: &[&str], events: &str, listed: usize) -> String {
    let dir = tempfile::tempdir().unwrap();
    let gpus = dir.path().join("gpus.json");
    std::fs::write(&gpus, config).unwrap();
    write_mig_minors(dir.path());
    support::write_driver_gpu_list(&dir.path().join("proc"), listed);
    let script = dir.path().join("events");
    std::fs::write(&script, events).unwrap();
    let lib = fake_nvml_lib();
    let state = dir.path().join("state");
    let proc_root = dir.path().join("proc");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"))
        .arg("check-config")
        .args([
            OsStr::new("--nvml-lib"),
            lib.as_os_str(),
            OsStr::new("--proc-root"),
            proc_root.as_os_str(),
            OsStr::new("--state-dir"),
            state.as_os_str(),
            OsStr::new("--node-name"),
            OsStr::new("node-a"),
        ])
        .args(extra)
        .env("FAKE_NVML_CONFIG", &gpus)
        .env("FAKE_NVML_EVENTS", &script)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// DRA has no MIG strategy: a GPU in MIG mode served through DRA is published as its MIG devices, as NVIDIA's
/// DRA driver publishes it (claims for the `mig.nvidia.com` class find them), whatever `migStrategy` says of
/// the GPUs the device plugin serves; those keep the strategy's meaning.
#[test]
fn through_dra_a_gpu_in_mig_mode_is_its_mig_devices_whatever_the_device_plugins_strategy() {
    let all = check_config_on(&two_profiles_on_gpu0(), &["--dra", "all"]);
    let line = all
        .lines()
        .find(|l| l.starts_with("serves through DRA"))
        .unwrap_or_else(|| panic!("no DRA line in:\n{all}"));
    assert!(line.contains(": 4 devices ("), "{line}");
    assert_eq!(line.matches("gpu-0-mig-").count(), 3, "{line}");
    assert!(line.contains("gpu-1)"), "GPU 1 whole: {line}");
    assert!(
        !line.contains("gpu-0,") && !line.contains("(gpu-0)"),
        "{line}"
    );

    // Split: GPU 0 through DRA as its MIG devices; GPU 1 through the device plugin, migStrategy none.
    let split = check_config_on(&two_profiles_on_gpu0(), &["--dra", "0"]);
    assert!(
        split.contains("serves through DRA as gpu.nvidia.com: 3 devices (gpu-0-mig-"),
        "{split}"
    );
    assert!(
        split.contains("serves nvidia.com/gpu: 1 devices, 1 listed to the kubelet"),
        "{split}"
    );
    // A GPU in MIG mode without MIG devices publishes nothing, but it is on the node: naming it is no typo.
    let empty = format!(
        r#"{{"devices":[{{"uuid":"{}","mig":[]}},{{"uuid":"{}"}}]}}"#,
        gpu(0),
        gpu(1)
    );
    let nothing = check_config_on(&empty, &["--dra", "0"]);
    assert!(
        nothing.contains("serves through DRA as gpu.nvidia.com: 0 devices"),
        "{nothing}"
    );
    // The device plugin's strategy keeps its rules for its own GPUs only: under single, a GPU in MIG mode
    // served through DRA beside a whole GPU served by the device plugin is no mix of modes.
    let single = check_config_on(
        &two_profiles_on_gpu0(),
        &["--dra", "0", "--mig-strategy", "single"],
    );
    assert!(
        single.contains("serves through DRA as gpu.nvidia.com: 3 devices (gpu-0-mig-")
            && single.contains("serves nvidia.com/gpu: 1 devices"),
        "{single}"
    );
    // And the other way round: GPU 0 in MIG mode through the device plugin is whole under migStrategy none.
    let other_way = check_config_on(&two_profiles_on_gpu0(), &["--dra", "1"]);
    assert!(
        other_way.contains("serves through DRA as gpu.nvidia.com: 1 devices (gpu-1)"),
        "{other_way}"
    );
    assert!(
        other_way.contains("serves nvidia.com/gpu: 1 devices, 1 listed to the kubelet"),
        "{other_way}"
    );
}

/// A GPU that does not answer NVML at the start is named from the driver's GPU list by the GPUs that did
/// answer, whichever road serves them: with GPU 0 served through DRA, silent GPU 1 is still served, lost,
/// under its own UUID (not left unnamed, which would drop its recorded conditions).
#[test]
fn a_silent_gpu_beside_one_served_through_dra_is_named_from_the_drivers_list() {
    let two = format!(
        r#"{{"devices":[{{"uuid":"{}"}},{{"uuid":"{}"}}]}}"#,
        gpu(0),
        gpu(1)
    );
    let out = check_config_with(&two, &["--dra", "0"], &format!("lost {}\n", gpu(1)), 2);
    assert!(out.contains("devices found: 2"), "{out}");
    assert!(
        out.contains("serves through DRA as gpu.nvidia.com: 1 devices (gpu-0)")
            && out.contains("serves nvidia.com/gpu: 1 devices"),
        "{out}"
    );
}
