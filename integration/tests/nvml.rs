//! The real binary on the real NVML code path (nvml-wrapper loading the fake libnvidia-ml), against the fake
//! kubelet: faults appended to the fake's event file reach the kubelet as the health policy says.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use std::ffi::OsStr;

use fake_kubelet::FakeKubelet;
use support::{
    NvmlNode, PluginProcess, TestResult, WAIT, fake_nvml_gpu as gpu, fake_nvml_lib, peak_rss_kib,
};
use tonic::Code;

#[tokio::test]
async fn xid_79_reaches_the_kubelet_as_unhealthy_and_allocate_refuses_the_gpu() -> TestResult {
    let node = NvmlNode::start(None, &[]).await?;
    let first = node.kubelet.list();
    assert_eq!(first.devices.len(), 4);
    assert_eq!(first.allocatable(), 4);

    node.inject(&[format!("xid {} 79", gpu(1))]);
    let list = node.wait_unhealthy(&gpu(1)).await?;
    assert_eq!(list.allocatable(), 3);

    let err = node.refusal(&gpu(1)).await?;
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains(&gpu(1)) && err.message().contains("XID 79"),
        "{}",
        err.message()
    );
    node.kubelet.allocate(&[&[&gpu(0)]]).await?;
    Ok(())
}

#[tokio::test]
async fn application_xids_13_and_94_leave_the_gpu_healthy() -> TestResult {
    let node = NvmlNode::start(None, &[]).await?;
    let health = node
        .health_of_gpu0_after(&[format!("xid {} 13", gpu(0)), format!("xid {} 94", gpu(0))])
        .await?;
    assert_eq!(health, "Healthy");
    Ok(())
}

#[tokio::test]
async fn xid_109_needs_a_reset_so_the_gpu_is_unhealthy() -> TestResult {
    let node = NvmlNode::start(None, &[]).await?;
    node.inject(&[format!("xid {} 109", gpu(2))]);
    node.wait_unhealthy(&gpu(2)).await?;
    Ok(())
}

#[tokio::test]
async fn double_bit_ecc_makes_the_gpu_unhealthy_and_single_bit_does_not() -> TestResult {
    let node = NvmlNode::start(None, &[]).await?;
    assert_eq!(
        node.health_of_gpu0_after(&[format!("sbe {}", gpu(0))])
            .await?,
        "Healthy"
    );
    node.inject(&[format!("dbe {}", gpu(0))]);
    node.wait_unhealthy(&gpu(0)).await?;
    Ok(())
}

#[tokio::test]
async fn a_lost_gpu_is_unhealthy_as_gpu_lost() -> TestResult {
    let node = NvmlNode::start(None, &[]).await?;
    node.inject(&[format!("lost {}", gpu(2))]);
    let list = node.wait_unhealthy(&gpu(2)).await?;
    assert_eq!(list.allocatable(), 3);
    let err = node.refusal(&gpu(2)).await?;
    assert!(
        err.message().contains("stopped answering"),
        "{}",
        err.message()
    );
    let logged = node.plugin.wait_log(WAIT, |l| l.contains("gpu-lost")).await;
    assert!(logged.is_some(), "{}", node.plugin.log());
    Ok(())
}

/// CPU time (user + system) the process has used so far, in clock ticks.
fn cpu_ticks(pid: u32) -> Result<u64, Box<dyn std::error::Error>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) end with ')'; utime and stime are 14th and 15th.
    let after = stat.rsplit_once(')').ok_or("no command name")?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    Ok(fields.get(11).ok_or("no utime")?.parse::<u64>()?
        + fields.get(12).ok_or("no stime")?.parse::<u64>()?)
}

#[tokio::test]
async fn a_lost_gpu_does_not_spin_the_event_thread_and_the_others_stay_watched() -> TestResult {
    let node = NvmlNode::start(None, &[]).await?;
    node.inject(&[format!("lost {}", gpu(2))]);
    node.wait_unhealthy(&gpu(2)).await?;
    // The driver answers GPU_IS_LOST to every wait on a set holding the lost GPU: a loop that waits again at
    // once burns a core. Measured over one second: a waiting plugin uses a few ticks of 100.
    let pid = node.plugin.child.id().ok_or("plugin exited")?;
    let before = cpu_ticks(pid)?;
    // A measurement window, not a wait for an event.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let used = cpu_ticks(pid)? - before;
    assert!(used < 30, "{used} ticks of CPU in 1 s with a lost GPU");
    // Another GPU's fault still arrives.
    node.inject(&[format!("xid {} 79", gpu(0))]);
    let list = node.wait_unhealthy(&gpu(0)).await?;
    assert_eq!(list.health(&gpu(1)), Some("Healthy"));
    Ok(())
}

#[tokio::test]
async fn a_lost_gpu_that_answers_again_is_watched_again() -> TestResult {
    let node = NvmlNode::start(None, &[]).await?;
    node.inject(&[format!("lost {}", gpu(2))]);
    node.wait_unhealthy(&gpu(2)).await?;
    restored_and_watched_again(&node, 2).await
}

/// Restores GPU `index`, which is lost; waits until it is watched again and checks that its next fault is
/// seen (the GPU is still Unhealthy from the loss, so the log is looked at for the condition).
async fn restored_and_watched_again(node: &NvmlNode, index: usize) -> TestResult {
    node.inject(&[format!("restore {}", gpu(index))]);
    let watched = node
        .plugin
        .wait_log(WAIT, |l| l.contains("its events are watched again"))
        .await;
    assert!(watched.is_some(), "{}", node.plugin.log());
    node.inject(&[format!("xid {} 48", gpu(index))]);
    let id = gpu(index);
    let seen = node
        .plugin
        .wait_log(WAIT, |l| l.contains("xid-48") && l.contains(&id))
        .await;
    assert!(seen.is_some(), "{}", node.plugin.log());
    Ok(())
}

#[tokio::test]
async fn a_lost_gpu_is_watched_again_while_other_gpus_keep_the_event_wait_busy() -> TestResult {
    let node = NvmlNode::start(None, &[]).await?;
    node.inject(&[format!("lost {}", gpu(2))]);
    node.wait_unhealthy(&gpu(2)).await?;
    node.inject(&[format!("restore {}", gpu(2))]);
    // Harmless XIDs on GPU 0 every 20 ms: the event wait never times out while they come.
    let watched_again = |l: &str| l.contains("its events are watched again");
    let started = std::time::Instant::now();
    while !watched_again(&node.plugin.log()) && started.elapsed() < WAIT {
        node.inject(&[format!("xid {} 13", gpu(0))]);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(watched_again(&node.plugin.log()), "{}", node.plugin.log());
    Ok(())
}

#[tokio::test]
async fn a_gpu_lost_when_the_plugin_starts_is_watched_once_it_answers() -> TestResult {
    // Found by the soak: a GPU lost at start was never put in the event set, so after it came back its
    // faults went unseen for the life of the process.
    let mut node = NvmlNode::start(None, &["--proc-root", "{dir}/proc"]).await?;
    support::write_driver_gpu_list(&node.dir.path().join("proc"), 4);
    node.stop_plugin().await?;
    node.inject(&[format!("lost {}", gpu(1))]);
    node.start_plugin().await?;
    node.wait_unhealthy(&gpu(1)).await?;
    restored_and_watched_again(&node, 1).await
}

#[tokio::test]
async fn a_gpu_registered_without_dbe_support_gets_no_dbe() -> TestResult {
    let config = format!(
        r#"{{"devices":[{{"uuid":"{}","supported_events":["xid","sbe"]}},{{"uuid":"{}"}},{{"uuid":"{}"}},{{"uuid":"{}"}}]}}"#,
        gpu(0),
        gpu(1),
        gpu(2),
        gpu(3)
    );
    let node = NvmlNode::start(Some(&config), &[]).await?;
    assert_eq!(
        node.health_of_gpu0_after(&[format!("dbe {}", gpu(0))])
            .await?,
        "Healthy"
    );
    // XIDs still arrive from the same GPU.
    node.inject(&[format!("xid {} 79", gpu(0))]);
    node.wait_unhealthy(&gpu(0)).await?;
    Ok(())
}

#[tokio::test]
async fn a_malformed_event_line_is_skipped_and_the_plugin_keeps_going() -> TestResult {
    let node = NvmlNode::start(None, &[]).await?;
    node.inject(&[
        "xid not-enough".to_string(),
        "explode GPU-x".to_string(),
        format!("xid {} 79", gpu(1)),
    ]);
    node.wait_unhealthy(&gpu(1)).await?;
    assert_eq!(node.kubelet.list().allocatable(), 3);
    Ok(())
}

#[tokio::test]
async fn every_transition_is_one_structured_log_event() -> TestResult {
    let node = NvmlNode::start(None, &["--log-format", "json"]).await?;
    node.inject(&[
        format!("xid {} 13", gpu(1)),
        format!("xid {} 79", gpu(1)),
        format!("xid {} 79", gpu(1)),
    ]);
    node.wait_unhealthy(&gpu(1)).await?;
    // The log line follows the list the kubelet got.
    let log = node
        .plugin
        .wait_log(WAIT, |l| l.contains("device health changed"))
        .await
        .unwrap_or_else(|| node.plugin.log());
    let transitions: Vec<serde_json::Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["message"] == "device health changed")
        .collect();
    assert_eq!(transitions.len(), 1, "{log}");
    let t = &transitions[0];
    assert_eq!(
        (t["device"].as_str(), t["old"].as_str(), t["new"].as_str()),
        (Some(gpu(1).as_str()), Some("Healthy"), Some("Unhealthy"))
    );
    assert_eq!(t["conditions"], "xid-13,xid-79");
    // Taken out of service is a warning, whatever took it out: alerting on warn sees it.
    assert_eq!(t["level"], "WARN", "{log}");
    let message = t["health_message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("Unhealthy: XID 79: the GPU has fallen off the bus"),
        "{message}"
    );
    assert!(
        message.contains("Also recorded, not affecting health: XID 13"),
        "{message}"
    );
    Ok(())
}

#[tokio::test]
async fn a_storm_of_3000_harmless_xids_then_a_fatal_one_gets_the_fatal_one_through_and_stays_small()
-> TestResult {
    let node = NvmlNode::start(None, &[]).await?;
    let mut lines: Vec<String> = (0..3000)
        .map(|i| format!("xid {} {}", gpu(i % 3), [13, 31, 43][i % 3]))
        .collect();
    lines.push(format!("xid {} 79", gpu(3)));
    node.inject(&lines);
    let list = node.wait_unhealthy(&gpu(3)).await?;
    assert_eq!(
        list.allocatable(),
        3,
        "the harmless XIDs must leave GPUs 0-2 healthy"
    );
    let pid = node.plugin.child.id().expect("plugin running");
    let peak = peak_rss_kib(pid).expect("VmHWM");
    eprintln!("peak RSS after the storm: {peak} KiB");
    assert!(peak < 64 * 1024, "peak RSS {peak} KiB");
    Ok(())
}

#[tokio::test]
async fn without_an_nvml_library_the_plugin_exits_with_one_clear_line() -> TestResult {
    let dir = tempfile::tempdir()?;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"))
        .args([
            "--nvml-lib",
            "/nonexistent/libnvidia-ml.so.1",
            "--kubelet-dir",
        ])
        .arg(dir.path())
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env_remove("RUST_LOG")
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let lines: Vec<_> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains("/nonexistent/libnvidia-ml.so.1")
            && lines[0].contains("--fail-on-init-error"),
        "{stderr}"
    );
    Ok(())
}

#[tokio::test]
async fn without_nvml_and_fail_on_init_error_false_the_drivers_gpus_are_served_unmonitored()
-> TestResult {
    let dir = tempfile::tempdir()?;
    let kubelet_dir = dir.path().join("device-plugins");
    std::fs::create_dir(&kubelet_dir)?;
    let gpus = dir.path().join("proc/driver/nvidia/gpus/0000:17:00.0");
    std::fs::create_dir_all(&gpus)?;
    std::fs::write(
        gpus.join("information"),
        "Model: \t NVIDIA H100\nGPU UUID: \t GPU-from-procfs\nDevice Minor: \t 0\n",
    )?;
    // A second GPU whose information the driver has not filled in: left out, and the log says which.
    let uninitialised = dir.path().join("proc/driver/nvidia/gpus/0000:18:00.0");
    std::fs::create_dir_all(&uninitialised)?;
    std::fs::write(uninitialised.join("information"), "Model: \t NVIDIA H100\n")?;
    let proc_root = dir.path().join("proc");
    let kubelet = FakeKubelet::start(&kubelet_dir).await?;
    let plugin = PluginProcess::spawn(
        &kubelet_dir,
        &[
            "--nvml-lib",
            "/nonexistent/libnvidia-ml.so.1",
            "--fail-on-init-error=false",
            "--proc-root",
            proc_root.to_str().unwrap(),
        ],
    );
    let list = kubelet
        .wait_list("the driver's GPU", WAIT, |l| !l.devices.is_empty())
        .await
        .map_err(|e| format!("{e}\n{}", plugin.log()))?;
    assert_eq!(list.health("GPU-from-procfs"), Some("Healthy"));
    assert_eq!(list.devices.len(), 1);
    // Logged before the GPUs were listed, so it is in the log by now: health is not watched, and why.
    let log = plugin.log();
    assert!(
        log.contains("unmonitored") && log.contains("/nonexistent/libnvidia-ml.so.1"),
        "{log}"
    );
    assert!(
        log.contains("0000:18:00.0/information") && log.contains("left out"),
        "{log}"
    );
    drop(dir);
    Ok(())
}

/// Loads the fake in this process through nvml-wrapper and checks what NVML clients read from it: the
/// struct layouts (PCI info, memory, field values) and the answers other device plugins ask for.
#[test]
fn the_fake_library_answers_nvml_calls_with_nvml_struct_layouts() -> TestResult {
    use nvml_wrapper::Nvml;
    use nvml_wrapper::enum_wrappers::device::TopologyLevel;
    use nvml_wrapper::enums::device::SampleValue;
    use nvml_wrapper::error::NvmlError;
    use nvml_wrapper::structs::device::FieldId;

    let lib = fake_nvml_lib();
    let nvml = Nvml::builder().lib_path(lib.as_os_str()).init()?;
    assert_eq!(nvml.sys_driver_version()?, "580.65.06");
    assert_eq!(nvml.sys_cuda_driver_version()?, 13000);
    assert_eq!(nvml.device_count()?, 4);

    let device = nvml.device_by_index(1)?;
    assert_eq!(device.uuid()?, gpu(1));
    assert_eq!(nvml.device_by_uuid(gpu(1))?.index()?, 1);
    assert_eq!(device.name()?, "NVIDIA H100 80GB HBM3");
    assert_eq!(device.minor_number()?, 1);
    let pci = device.pci_info()?;
    assert_eq!(
        (pci.bus_id.as_str(), pci.domain, pci.bus, pci.device),
        ("00000000:01:00.0", 0, 1, 0)
    );
    assert_eq!(device.memory_info()?.total, 81559 * 1024 * 1024);
    let cc = device.cuda_compute_capability()?;
    assert_eq!((cc.major, cc.minor), (9, 0));
    assert_eq!(device.mig_mode()?.current, 0);
    let other = nvml.device_by_index(2)?;
    assert_eq!(device.topology_common_ancestor(other)?, TopologyLevel::Node);
    assert!(matches!(
        device.link_wrapper_for(0).is_active(),
        Err(NvmlError::NotSupported)
    ));

    // NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: None (0) until an `action` command says otherwise.
    let values = device.field_values_for(&[FieldId(230), FieldId(1)])?;
    let action = values[0].as_ref().map(|s| &s.value);
    assert!(matches!(action, Ok(Ok(SampleValue::U32(0)))), "{action:?}");
    assert!(matches!(
        values[1].as_ref().map(|s| &s.value),
        Ok(Err(NvmlError::NotSupported))
    ));

    let set = nvml.create_event_set()?;
    assert!(
        matches!(set.wait(1), Err(NvmlError::Timeout)),
        "no events without a fault script"
    );
    Ok(())
}

#[tokio::test]
async fn a_gpu_that_does_not_answer_at_start_is_listed_by_its_uuid_unhealthy_not_a_crash()
-> TestResult {
    let mut node = NvmlNode::start(None, &["--proc-root", "{dir}/proc"]).await?;
    support::write_driver_gpu_list(&node.dir.path().join("proc"), 4);
    node.stop_plugin().await?;
    // GPU 1 falls off the bus while the plugin is away: NVML counts it but cannot open it.
    node.inject(&[format!("lost {}", gpu(1))]);
    let list = node.start_plugin().await?;
    assert_eq!(
        list.health(&gpu(1)),
        Some("Unhealthy"),
        "named from the driver's information file\n{}",
        node.plugin.log()
    );
    assert_eq!(list.devices.len(), 4, "no device the kubelet never had");
    assert_eq!(list.allocatable(), 3);
    Ok(())
}

#[tokio::test]
async fn a_silent_gpu_the_driver_does_not_name_is_not_served_under_a_made_up_id() -> TestResult {
    // No driver GPU list under this proc root: nothing tells which GPU index 1 is.
    let mut node = NvmlNode::start(None, &["--proc-root", "{dir}/proc"]).await?;
    node.stop_plugin().await?;
    node.inject(&[format!("lost {}", gpu(1))]);
    let list = node.start_plugin().await?;
    let ids: Vec<&str> = list.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids.len(), 3, "{ids:?}");
    assert!(!ids.contains(&gpu(1).as_str()), "{ids:?}");
    assert!(ids.iter().all(|id| id.starts_with("GPU-fa4e")), "{ids:?}");
    let log = node.plugin.log();
    assert!(
        log.contains("index=1") && log.contains("not served"),
        "{log}"
    );
    // Status numbers the GPUs as NVML does, and lists the silent one with why: nobody reads GPU 2 as 1.
    let addr = node
        .plugin
        .http_addr()
        .await
        .ok_or_else(|| format!("no HTTP address\n{}", node.plugin.log()))?;
    let report = gpu_device_plugin::http::fetch_report(&addr).await?;
    let shown: Vec<(usize, &str)> = report
        .devices
        .iter()
        .map(|d| (d.index, d.id.as_str()))
        .collect();
    let (g0, g2, g3) = (gpu(0), gpu(2), gpu(3));
    assert_eq!(
        shown,
        [(0, g0.as_str()), (2, g2.as_str()), (3, g3.as_str())]
    );
    assert_eq!(report.unserved.len(), 1, "{:?}", report.unserved);
    assert_eq!(report.unserved[0].index, Some(1));
    assert!(
        report.unserved[0].why.contains("does not answer NVML"),
        "{:?}",
        report.unserved
    );
    let table = report.table();
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("1 ") && l.contains("not served")),
        "{table}"
    );
    Ok(())
}

#[tokio::test]
async fn a_fault_the_moment_the_kubelet_first_sees_the_gpus_is_not_lost() -> TestResult {
    // A slow driver: each event registration takes 300 ms. The plugin must not list a GPU to the kubelet
    // before it watches that GPU's events, or a fault in between would be lost for good.
    let node = Unwatched::start("", &[("FAKE_NVML_REGISTER_DELAY_MS", OsStr::new("300"))]).await?;
    let first = node
        .kubelet
        .wait_list("the first list", WAIT, |l| l.messages >= 1)
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    assert_eq!(first.allocatable(), 4);
    support::append(&node.events, &[format!("xid {} 79", gpu(3))]);
    let list = node
        .kubelet
        .wait_list("the fault", WAIT, |l| {
            l.health(&gpu(3)) == Some("Unhealthy")
        })
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    assert_eq!(list.allocatable(), 3);
    Ok(())
}

/// The fake kubelet and the plugin binary on the fake NVML library, not yet waited for (unlike
/// [`NvmlNode`]): for tests that look at the plugin's very first list.
struct Unwatched {
    kubelet: FakeKubelet,
    plugin: PluginProcess,
    events: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Unwatched {
    /// Starts with `history` already in the fake's event file and `envs` added to the plugin's.
    async fn start(
        history: &str,
        envs: &[(&str, &OsStr)],
    ) -> Result<Unwatched, Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let kubelet_dir = dir.path().join("device-plugins");
        std::fs::create_dir(&kubelet_dir)?;
        let events = dir.path().join("events");
        std::fs::write(&events, history)?;
        let kubelet = FakeKubelet::start(&kubelet_dir).await?;
        let lib = fake_nvml_lib();
        let mut all = vec![("FAKE_NVML_EVENTS", events.as_os_str())];
        all.extend_from_slice(envs);
        let plugin = PluginProcess::spawn_with_env(
            &kubelet_dir,
            &["--nvml-lib", lib.to_str().ok_or("non-UTF-8 path")?],
            &all,
        );
        Ok(Unwatched {
            kubelet,
            plugin,
            events,
            _dir: dir,
        })
    }
}

/// `/healthz` of the plugin at `addr`: status code and body.
async fn healthz_at(addr: &str) -> (u16, String) {
    let (status, body) = gpu_device_plugin::http::get(addr, "/healthz")
        .await
        .expect("the plugin answers HTTP");
    (status.as_u16(), String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn healthz_turns_red_when_the_nvml_event_thread_is_stuck_in_the_driver() -> TestResult {
    let flags = tempfile::tempdir()?;
    let hang = flags.path().join("hang");
    let node = NvmlNode::start_with_env(
        None,
        &["--stuck-after", "3s"],
        &[("FAKE_NVML_HANG_FILE", hang.clone())],
    )
    .await?;
    let addr = node
        .plugin
        .http_addr()
        .await
        .ok_or_else(|| format!("no HTTP address\n{}", node.plugin.log()))?;
    let healthz = || healthz_at(&addr);
    assert_eq!(healthz().await, (200, "ok\n".to_string()));

    // The driver stops answering: the next event wait never returns.
    std::fs::write(&hang, "")?;
    node.plugin
        .wait_log(WAIT, |l| l.contains("the NVML event thread is stuck"))
        .await
        .ok_or_else(|| format!("the stuck thread was never noticed\n{}", node.plugin.log()))?;
    let (status, body) = healthz().await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("NVML event thread has been stuck"), "{body}");
    Ok(())
}

#[tokio::test]
async fn an_event_wait_failing_on_every_call_makes_the_gpus_unmonitored_until_it_works_again()
-> TestResult {
    let flags = tempfile::tempdir()?;
    let fails = flags.path().join("fails");
    let node = NvmlNode::start_with_env(None, &[], &[("FAKE_NVML_WAIT_FAILS_FILE", fails.clone())])
        .await?;
    let addr = node
        .plugin
        .http_addr()
        .await
        .ok_or_else(|| format!("no HTTP address\n{}", node.plugin.log()))?;
    let healthz = || healthz_at(&addr);
    std::fs::write(&fails, "")?;
    node.plugin
        .wait_log(WAIT, |log| {
            // Each GPU's thread finds it out on its own, in no set order.
            (0..4).all(|i| {
                log.lines()
                    .any(|l| l.contains("conditions=unmonitored") && l.contains(&gpu(i)))
            })
        })
        .await
        .ok_or_else(|| format!("the GPUs were never unmonitored\n{}", node.plugin.log()))?;
    let (status, body) = healthz().await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("every NVML event wait fails"), "{body}");
    let report = gpu_device_plugin::http::fetch_report(&addr).await?;
    for device in &report.devices {
        assert_eq!(device.health, "Healthy", "unmonitored is not a fault");
        assert!(
            device
                .message
                .as_deref()
                .is_some_and(|m| m.contains("fails on every call")),
            "{device:?}"
        );
    }

    // The waits work again: the condition ends, /healthz is green, faults are seen again.
    std::fs::remove_file(&fails)?;
    node.plugin
        .wait_log(WAIT, |log| {
            log.matches("NVML event waits work again").count() >= 4
        })
        .await
        .ok_or_else(|| format!("never watched again\n{}", node.plugin.log()))?;
    // The threads say so before the monitor has taken the last of their news: asked until it has.
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut answer = healthz().await;
    while answer != (200, "ok\n".to_string()) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        answer = healthz().await;
    }
    assert_eq!(answer, (200, "ok\n".to_string()));
    node.inject(&[format!("xid {} 79", gpu(1))]);
    node.wait_unhealthy(&gpu(1)).await?;
    Ok(())
}

/// The GPU whose loss or return a fault on [`FAULTED`] falls around.
const CHANGED: usize = 1;
/// The GPU that takes the fault.
const FAULTED: usize = 2;

/// How the fake driver orders a lost GPU's GPU_IS_LOST and the events queued before it: the real driver may
/// answer either way.
#[derive(Debug, Clone, Copy)]
enum Order {
    /// The queued events first, then GPU_IS_LOST (the fake's default).
    QueuedFirst,
    /// GPU_IS_LOST at once, the queued events left waiting (`FAKE_NVML_LOST_FIRST`).
    LostFirst,
}

/// When the fault is written, next to the line that loses or restores the other GPU.
#[derive(Debug, Clone, Copy)]
enum When {
    JustBefore,
    SameWrite,
    JustAfter,
}

/// The plugin on the fake driver ordering its answers as `order`, with double-bit ECC errors `recover: never`
/// (so that the one fault the test raises is the GPU's only Unhealthy condition for the test's life). The
/// directory holds the config file.
async fn node_ordered(
    order: Order,
) -> Result<(NvmlNode, tempfile::TempDir), Box<dyn std::error::Error>> {
    let config_dir = tempfile::tempdir()?;
    let config = config_dir.path().join("config.yaml");
    std::fs::write(
        &config,
        "health:\n  conditions:\n    ecc-dbe: {recover: never}\n",
    )?;
    let config = config.to_str().ok_or("non-UTF-8 path")?;
    let envs = match order {
        Order::QueuedFirst => vec![],
        Order::LostFirst => vec![("FAKE_NVML_LOST_FIRST", std::path::PathBuf::from("1"))],
    };
    let node = NvmlNode::start_with_env(None, &["--config", config], &envs).await?;
    Ok((node, config_dir))
}

/// Writes `change` (a `lost` or `restore` line) and `fault` as `when` says: two writes, or one.
fn write_around(node: &NvmlNode, change: String, fault: String, when: When) -> std::io::Result<()> {
    match when {
        When::JustBefore => {
            node.inject(&[fault]);
            node.inject(&[change]);
        }
        When::SameWrite => write_at_once(node, &[change, fault])?,
        When::JustAfter => {
            node.inject(&[change]);
            node.inject(&[fault]);
        }
    }
    Ok(())
}

/// Appends `lines` to the fake's event file in one `write`, so that the driver takes them in together
/// (`NvmlNode::inject` writes line by line).
fn write_at_once(node: &NvmlNode, lines: &[String]) -> std::io::Result<()> {
    use std::io::Write;
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::OpenOptions::new()
        .append(true)
        .open(&node.events)?
        .write_all(text.as_bytes())
}

/// How many times the plugin counted double-bit ECC errors on GPU `index`, once every event raised on it so far
/// has been taken: a harmless XID 13 on the same GPU comes after them (a GPU's events arrive in order), so
/// once it is recorded, a fault delivered twice would have been counted twice.
async fn dbe_count(node: &NvmlNode, index: usize) -> Result<u64, Box<dyn std::error::Error>> {
    let id = gpu(index);
    node.inject(&[format!("xid {id} 13")]);
    node.plugin
        .wait_log(WAIT, |log| {
            log.lines().any(|l| l.contains(&id) && l.contains("xid-13"))
        })
        .await
        .ok_or_else(|| {
            format!(
                "the marker XID on {id} was never recorded\n{}",
                node.plugin.log()
            )
        })?;
    let addr = node.plugin.http_addr().await.ok_or("no HTTP address")?;
    let report = gpu_device_plugin::http::fetch_report(&addr).await?;
    let device = report
        .devices
        .iter()
        .find(|d| d.id == id)
        .ok_or("the GPU is missing from /status")?;
    Ok(device
        .conditions
        .iter()
        .filter(|c| c.kind == "ecc-dbe")
        .map(|c| c.count)
        .sum())
}

/// A double-bit ECC error on one GPU written `when` another GPU is lost: the kubelet sees the faulted GPU
/// Unhealthy, and the plugin counts the error once.
async fn a_fault_around_another_gpus_loss(order: Order, when: When) -> TestResult {
    let (node, _config) = node_ordered(order).await?;
    write_around(
        &node,
        format!("lost {}", gpu(CHANGED)),
        format!("dbe {}", gpu(FAULTED)),
        when,
    )?;
    node.wait_unhealthy(&gpu(FAULTED)).await?;
    node.wait_unhealthy(&gpu(CHANGED)).await?;
    assert_eq!(dbe_count(&node, FAULTED).await?, 1, "{}", node.plugin.log());
    Ok(())
}

/// As [`a_fault_around_another_gpus_loss`], around the lost GPU's return.
async fn a_fault_around_another_gpus_return(order: Order, when: When) -> TestResult {
    let (node, _config) = node_ordered(order).await?;
    node.inject(&[format!("lost {}", gpu(CHANGED))]);
    node.wait_unhealthy(&gpu(CHANGED)).await?;
    write_around(
        &node,
        format!("restore {}", gpu(CHANGED)),
        format!("dbe {}", gpu(FAULTED)),
        when,
    )?;
    node.wait_unhealthy(&gpu(FAULTED)).await?;
    assert_eq!(dbe_count(&node, FAULTED).await?, 1, "{}", node.plugin.log());
    Ok(())
}

#[tokio::test]
async fn a_fault_just_before_another_gpu_is_lost_reaches_the_kubelet_once() -> TestResult {
    a_fault_around_another_gpus_loss(Order::QueuedFirst, When::JustBefore).await
}

#[tokio::test]
async fn a_fault_in_the_same_write_as_another_gpus_loss_reaches_the_kubelet_once() -> TestResult {
    a_fault_around_another_gpus_loss(Order::QueuedFirst, When::SameWrite).await
}

#[tokio::test]
async fn a_fault_just_after_another_gpu_is_lost_reaches_the_kubelet_once() -> TestResult {
    a_fault_around_another_gpus_loss(Order::QueuedFirst, When::JustAfter).await
}

#[tokio::test]
async fn a_fault_just_before_another_gpu_is_lost_reaches_the_kubelet_once_when_the_driver_tells_the_loss_first()
-> TestResult {
    a_fault_around_another_gpus_loss(Order::LostFirst, When::JustBefore).await
}

#[tokio::test]
async fn a_fault_in_the_same_write_as_another_gpus_loss_reaches_the_kubelet_once_when_the_driver_tells_the_loss_first()
-> TestResult {
    a_fault_around_another_gpus_loss(Order::LostFirst, When::SameWrite).await
}

#[tokio::test]
async fn a_fault_just_after_another_gpu_is_lost_reaches_the_kubelet_once_when_the_driver_tells_the_loss_first()
-> TestResult {
    a_fault_around_another_gpus_loss(Order::LostFirst, When::JustAfter).await
}

#[tokio::test]
async fn a_fault_just_before_a_lost_gpu_comes_back_reaches_the_kubelet_once() -> TestResult {
    a_fault_around_another_gpus_return(Order::QueuedFirst, When::JustBefore).await
}

#[tokio::test]
async fn a_fault_in_the_same_write_as_a_lost_gpus_return_reaches_the_kubelet_once() -> TestResult {
    a_fault_around_another_gpus_return(Order::QueuedFirst, When::SameWrite).await
}

#[tokio::test]
async fn a_fault_just_after_a_lost_gpu_comes_back_reaches_the_kubelet_once() -> TestResult {
    a_fault_around_another_gpus_return(Order::QueuedFirst, When::JustAfter).await
}

#[tokio::test]
async fn a_fault_just_before_a_lost_gpu_comes_back_reaches_the_kubelet_once_when_the_driver_tells_the_loss_first()
-> TestResult {
    a_fault_around_another_gpus_return(Order::LostFirst, When::JustBefore).await
}

#[tokio::test]
async fn a_fault_in_the_same_write_as_a_lost_gpus_return_reaches_the_kubelet_once_when_the_driver_tells_the_loss_first()
-> TestResult {
    a_fault_around_another_gpus_return(Order::LostFirst, When::SameWrite).await
}

#[tokio::test]
async fn a_fault_just_after_a_lost_gpu_comes_back_reaches_the_kubelet_once_when_the_driver_tells_the_loss_first()
-> TestResult {
    a_fault_around_another_gpus_return(Order::LostFirst, When::JustAfter).await
}

/// A double-bit ECC error on a GPU in the same write as its own loss, then its return: the error is counted
/// once, whichever the driver told first (told the loss first, the error waits in the GPU's event set until
/// the GPU answers again).
async fn a_gpus_own_fault_before_its_loss(order: Order) -> TestResult {
    let (node, _config) = node_ordered(order).await?;
    let id = gpu(CHANGED);
    write_at_once(&node, &[format!("dbe {id}"), format!("lost {id}")])?;
    node.wait_unhealthy(&id).await?;
    node.inject(&[format!("restore {id}")]);
    node.plugin
        .wait_log(WAIT, |l| l.contains("its events are watched again"))
        .await
        .ok_or_else(|| format!("never watched again\n{}", node.plugin.log()))?;
    assert_eq!(dbe_count(&node, CHANGED).await?, 1, "{}", node.plugin.log());
    Ok(())
}

#[tokio::test]
async fn a_fault_in_the_same_write_as_its_own_gpus_loss_is_counted_once() -> TestResult {
    a_gpus_own_fault_before_its_loss(Order::QueuedFirst).await
}

#[tokio::test]
async fn a_fault_in_the_same_write_as_its_own_gpus_loss_is_counted_once_it_answers_when_the_driver_tells_the_loss_first()
-> TestResult {
    a_gpus_own_fault_before_its_loss(Order::LostFirst).await
}

/// The real NVML source in this process on the fake's default GPUs, with a sysfs root where GPU 1 is linked
/// under a root complex: every fact a ResourceSlice publishes comes from the driver.
#[test]
fn the_nvml_source_reads_each_gpus_facts_from_the_driver() -> TestResult {
    use gpu_device_plugin::devices::facts::DeviceFacts;
    use gpu_device_plugin::sources::DeviceSource;
    use gpu_device_plugin::sources::nvml::{NvmlGpus, NvmlOptions};

    let sysfs = tempfile::tempdir()?;
    let device = sysfs
        .path()
        .join("devices/pci0000:00/0000:00:03.0/0000:01:00.0");
    std::fs::create_dir_all(&device)?;
    std::fs::write(device.join("numa_node"), "1\n")?;
    let links = sysfs.path().join("bus/pci/devices");
    std::fs::create_dir_all(&links)?;
    std::os::unix::fs::symlink(
        "../../../devices/pci0000:00/0000:00:03.0/0000:01:00.0",
        links.join("0000:01:00.0"),
    )?;
    let mut source = NvmlGpus::open(NvmlOptions {
        library: fake_nvml_lib(),
        sysfs_root: sysfs.path().to_path_buf(),
        ..NvmlOptions::default()
    })?;
    let devices = source.discover()?;
    assert_eq!(devices.len(), 4);
    let gpu1 = &devices[1];
    assert_eq!(
        (gpu1.id.as_str(), gpu1.numa_node),
        (gpu(1).as_str(), Some(1))
    );
    assert_eq!(
        gpu1.facts.as_deref(),
        Some(&DeviceFacts {
            minor: Some(1),
            product_name: Some("NVIDIA H100 80GB HBM3".into()),
            brand: Some("Nvidia".into()),
            architecture: Some("Hopper".into()),
            cuda_compute_capability: Some((9, 0)),
            memory_bytes: Some(81559 * 1024 * 1024),
            pci_bus_id: Some("0000:01:00.0".into()),
            pcie_root: Some("pci0000:00".into()),
            driver_version: Some("580.65.06".into()),
            cuda_driver_version: Some("13.0".into()),
            mig: None,
        })
    );
    // GPU 3 is not in this sysfs: no root complex, everything else as the driver says.
    let gpu3 = devices[3].facts.as_deref().ok_or("GPU 3 without facts")?;
    assert_eq!(
        (
            gpu3.minor,
            gpu3.pci_bus_id.as_deref(),
            gpu3.pcie_root.as_deref()
        ),
        (Some(3), Some("0000:03:00.0"), None)
    );
    Ok(())
}

/// The report's facts of device `id`.
fn reported_facts(
    report: &gpu_device_plugin::http::status::Report,
    id: &str,
) -> Result<gpu_device_plugin::devices::facts::DeviceFacts, String> {
    let device = report
        .devices
        .iter()
        .find(|d| d.id == id)
        .ok_or_else(|| format!("{id} missing from /status"))?;
    device
        .facts
        .clone()
        .ok_or_else(|| format!("{id} has no facts in /status"))
}

#[tokio::test]
async fn facts_the_driver_cannot_give_are_left_out_and_the_gpu_is_still_served() -> TestResult {
    // GPU 0 supports none of the fact queries; GPU 1 is an A100, to tell facts read from the driver from
    // defaults.
    let config = format!(
        r#"{{"devices":[
            {{"uuid":"{}","not_supported":["nvmlDeviceGetName","nvmlDeviceGetBrand","nvmlDeviceGetArchitecture",
              "nvmlDeviceGetCudaComputeCapability","nvmlDeviceGetMemoryInfo","nvmlDeviceGetPciInfo_v3"]}},
            {{"uuid":"{}","name":"NVIDIA A100-SXM4-80GB","architecture":"ampere","brand":"tesla",
              "cuda_compute_capability":"8.0","memory_mib":81920,"pci_bus_id":"00000000:B1:00.0"}}]}}"#,
        gpu(0),
        gpu(1)
    );
    // A sysfs of its own (empty): nothing of the machine the test runs on.
    let node = NvmlNode::start(Some(&config), &["--sysfs-root", "{dir}/sys"]).await?;
    let list = node
        .kubelet
        .wait_list("both GPUs", WAIT, |l| l.devices.len() == 2)
        .await?;
    assert_eq!(list.allocatable(), 2, "a GPU without facts is served");
    let addr = node.plugin.http_addr().await.ok_or("no HTTP address")?;
    let report = gpu_device_plugin::http::fetch_report(&addr).await?;
    let bare = reported_facts(&report, &gpu(0))?;
    assert_eq!(
        bare,
        gpu_device_plugin::devices::facts::DeviceFacts {
            minor: Some(0),
            driver_version: Some("580.65.06".into()),
            cuda_driver_version: Some("13.0".into()),
            ..Default::default()
        }
    );
    let a100 = reported_facts(&report, &gpu(1))?;
    assert_eq!(
        (
            a100.product_name.as_deref(),
            a100.architecture.as_deref(),
            a100.brand.as_deref(),
            a100.cuda_compute_capability,
            a100.memory_bytes,
            a100.pci_bus_id.as_deref(),
        ),
        (
            Some("NVIDIA A100-SXM4-80GB"),
            Some("Ampere"),
            Some("Tesla"),
            Some((8, 0)),
            Some(81920 * 1024 * 1024),
            Some("0000:b1:00.0")
        )
    );
    assert_eq!(a100.pcie_root, None, "not in this sysfs");
    Ok(())
}

/// Runs the plugin on `library` with `--fail-on-init-error` as given (and `envs`), to its exit; its stderr.
fn exit_on_library(
    library: &std::path::Path,
    envs: &[(&str, &OsStr)],
) -> (std::process::ExitStatus, String) {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"))
        .arg("--nvml-lib")
        .arg(library)
        .arg("--kubelet-dir")
        .arg(dir.path())
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env_remove("RUST_LOG")
        .envs(envs.iter().copied())
        .output()
        .unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A length that cuts the 64-bit little-endian shared object `image` pages before the end of the segments the
/// loader maps (a copy cut after them, in the debug sections, still loads; one cut here was a SIGBUS inside
/// the load).
fn inside_last_segment(image: &[u8]) -> usize {
    let read = |at: usize, width: usize| {
        image[at..at + width]
            .iter()
            .rev()
            .fold(0u64, |v, b| (v << 8) | u64::from(*b)) as usize
    };
    let (table, count) = (read(32, 8), read(56, 2));
    let end = (0..count)
        .map(|i| table + 56 * i)
        .filter(|&at| read(at, 4) == 1)
        .map(|at| read(at + 8, 8) + read(at + 32, 8))
        .max()
        .unwrap();
    end - 3 * 4096
}

/// Asserts the plugin exited as `--fail-on-init-error` documents (status 1, one line, the flag named) with
/// `says` in its line, not by a signal.
fn assert_refused_in_one_line(status: std::process::ExitStatus, stderr: &str, says: &str) {
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(status.signal(), None, "killed by a signal: {stderr}");
    assert_eq!(status.code(), Some(1), "{stderr}");
    let lines: Vec<_> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains(says) && lines[0].contains("--fail-on-init-error"),
        "{says:?} not in {stderr}"
    );
}

#[test]
fn a_truncated_nvml_library_is_refused_in_one_line_not_a_sigbus() {
    let dir = tempfile::tempdir().unwrap();
    let whole = std::fs::read(fake_nvml_lib()).unwrap();
    let truncated = dir.path().join("libnvidia-ml.so.1");
    std::fs::write(&truncated, &whole[..inside_last_segment(&whole)]).unwrap();
    let (status, stderr) = exit_on_library(&truncated, &[]);
    assert_refused_in_one_line(status, &stderr, "is not a whole shared library");
    assert!(stderr.contains("past its"), "{stderr}");
}

/// Field `width` bytes wide at `at` of a little-endian image.
fn le(image: &[u8], at: usize, width: usize) -> u64 {
    image[at..at + width]
        .iter()
        .rev()
        .fold(0u64, |v, b| (v << 8) | u64::from(*b))
}

/// The program headers of the 64-bit little-endian `image`: (type, offset, address, size in the file).
fn program_headers(image: &[u8]) -> Vec<(u64, usize, u64, usize)> {
    let (table, count) = (le(image, 32, 8) as usize, le(image, 56, 2) as usize);
    (0..count)
        .map(|i| table + 56 * i)
        .map(|at| {
            (
                le(image, at, 4),
                le(image, at + 8, 8) as usize,
                le(image, at + 16, 8),
                le(image, at + 32, 8) as usize,
            )
        })
        .collect()
}

/// Writes the three damaged copies of the fake library that passed the old check and crashed the loader
/// inside `dir`: a full-size copy with only its first 200 kB written, one whose dynamic section points its
/// string and symbol tables out of range, and its first 200 kB followed by a 64 GiB hole.
fn damaged_libraries(dir: &std::path::Path) -> Vec<(&'static str, std::path::PathBuf)> {
    let whole = std::fs::read(fake_nvml_lib()).unwrap();
    let written = 200 * 1024;
    let (_, dynamic, _, size) = program_headers(&whole)
        .into_iter()
        .find(|(kind, ..)| *kind == 2)
        .unwrap();
    assert!(
        dynamic > written,
        "the fake's dynamic section lies past 200 kB"
    );
    let half = dir.join("half-written.so");
    let mut bytes = whole[..written].to_vec();
    bytes.resize(whole.len(), 0);
    std::fs::write(&half, &bytes).unwrap();
    let out_of_range = dir.join("tables-out-of-range.so");
    let mut bytes = whole.clone();
    for at in (dynamic..dynamic + size).step_by(16) {
        if matches!(le(&bytes, at, 8), 5 | 6) {
            let moved = le(&bytes, at + 8, 8) + 0x7fff_0000_0000;
            bytes[at + 8..at + 16].copy_from_slice(&moved.to_le_bytes());
        }
    }
    std::fs::write(&out_of_range, &bytes).unwrap();
    let hole = dir.join("hole.so");
    std::fs::write(&hole, &whole[..written]).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&hole)
        .unwrap()
        .set_len(64 << 30)
        .unwrap();
    vec![
        ("half-written", half),
        ("tables out of range", out_of_range),
        ("64 GiB hole", hole),
    ]
}

#[test]
fn a_half_written_a_dangling_or_a_holed_nvml_library_is_refused_in_one_line_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    for (shape, library) in damaged_libraries(dir.path()) {
        let (status, stderr) = exit_on_library(&library, &[]);
        assert_refused_in_one_line(status, &stderr, "is not a whole shared library");
        assert!(
            stderr.contains(library.to_str().unwrap()),
            "{shape}: the file is not named: {stderr}"
        );
    }
}

#[test]
fn a_library_that_crashes_the_loader_is_caught_by_the_trial_load_and_refused_in_one_line() {
    // Whole and well-formed, but its start-up code (DT_INIT) is an invalid instruction: nothing in the file
    // says it will crash; only loading it does.
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = std::fs::read(fake_nvml_lib()).unwrap();
    let headers = program_headers(&bytes);
    let (_, dynamic, _, size) = headers.iter().copied().find(|h| h.0 == 2).unwrap();
    let init = (dynamic..dynamic + size)
        .step_by(16)
        .find(|&at| le(&bytes, at, 8) == 12)
        .map(|at| le(&bytes, at + 8, 8))
        .unwrap();
    let (_, offset, address, _) = headers
        .iter()
        .copied()
        .find(|&(kind, _, address, size)| {
            kind == 1 && address <= init && init < address + size as u64
        })
        .unwrap();
    let at = offset + (init - address) as usize;
    bytes[at..at + 2].copy_from_slice(&[0x0f, 0x0b]); // ud2
    let library = dir.path().join("libnvidia-ml.so.1");
    std::fs::write(&library, &bytes).unwrap();
    let (status, stderr) = exit_on_library(&library, &[]);
    assert_refused_in_one_line(
        status,
        &stderr,
        "crashed the dynamic loader when loaded in a trial process (killed by SIGILL)",
    );
    assert!(stderr.contains(library.to_str().unwrap()), "{stderr}");
}

#[tokio::test]
async fn a_damaged_library_with_fail_on_init_error_false_serves_unmonitored_with_one_warning()
-> TestResult {
    let dir = tempfile::tempdir()?;
    for (shape, library) in damaged_libraries(dir.path()) {
        let kubelet_dir = dir
            .path()
            .join(format!("device-plugins-{}", shape.replace(' ', "-")));
        std::fs::create_dir(&kubelet_dir)?;
        let _kubelet = FakeKubelet::start(&kubelet_dir).await?;
        let plugin = PluginProcess::spawn(
            &kubelet_dir,
            &[
                "--nvml-lib",
                library.to_str().unwrap(),
                "--fail-on-init-error=false",
                "--proc-root",
                dir.path().join("proc").to_str().unwrap(),
            ],
        );
        let log = plugin
            .wait_log(WAIT, |l| l.contains("NVML unavailable"))
            .await
            .ok_or_else(|| format!("{shape}: {}", plugin.log()))?;
        let warned: Vec<_> = log
            .lines()
            .filter(|l| l.contains("NVML unavailable"))
            .collect();
        assert_eq!(warned.len(), 1, "{shape}: {log}");
        assert!(
            warned[0].contains("is not a whole shared library"),
            "{shape}: {log}"
        );
    }
    Ok(())
}

#[test]
fn a_fifo_a_directory_or_garbage_as_the_nvml_library_is_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.so");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let (status, stderr) = exit_on_library(&fifo, &[]);
    assert_refused_in_one_line(status, &stderr, "is a FIFO, not a regular file");
    let (status, stderr) = exit_on_library(dir.path(), &[]);
    assert_refused_in_one_line(status, &stderr, "is a directory, not a regular file");
    let garbage = dir.path().join("garbage.so");
    std::fs::write(&garbage, vec![0x17u8; 100_000]).unwrap();
    let (status, stderr) = exit_on_library(&garbage, &[]);
    assert_refused_in_one_line(status, &stderr, "no ELF header");
    // Given by name, as by default: the file the loader would find on LD_LIBRARY_PATH is the one checked.
    let by_name = tempfile::tempdir().unwrap();
    std::fs::rename(&fifo, by_name.path().join("libnvidia-ml.so.1")).unwrap();
    let (status, stderr) = exit_on_library(
        std::path::Path::new("libnvidia-ml.so.1"),
        &[("LD_LIBRARY_PATH", by_name.path().as_os_str())],
    );
    assert_refused_in_one_line(status, &stderr, "is a FIFO");
}

#[tokio::test]
async fn a_truncated_library_with_fail_on_init_error_false_serves_unmonitored_with_one_warning()
-> TestResult {
    let dir = tempfile::tempdir()?;
    let whole = std::fs::read(fake_nvml_lib())?;
    let truncated = dir.path().join("libnvidia-ml.so.1");
    std::fs::write(&truncated, &whole[..inside_last_segment(&whole)])?;
    let kubelet_dir = dir.path().join("device-plugins");
    std::fs::create_dir(&kubelet_dir)?;
    let _kubelet = FakeKubelet::start(&kubelet_dir).await?;
    let plugin = PluginProcess::spawn(
        &kubelet_dir,
        &[
            "--nvml-lib",
            truncated.to_str().unwrap(),
            "--fail-on-init-error=false",
            "--proc-root",
            dir.path().join("proc").to_str().unwrap(),
        ],
    );
    let log = plugin
        .wait_log(WAIT, |l| l.contains("NVML unavailable"))
        .await
        .ok_or_else(|| plugin.log())?;
    let warned: Vec<_> = log
        .lines()
        .filter(|l| l.contains("NVML unavailable"))
        .collect();
    assert_eq!(warned.len(), 1, "{log}");
    assert!(warned[0].contains("is not a whole shared library"), "{log}");
    Ok(())
}

#[tokio::test]
async fn sigterm_while_nvml_is_loading_stops_the_plugin() -> TestResult {
    let dir = tempfile::tempdir()?;
    let hang = dir.path().join("hang");
    std::fs::write(&hang, b"")?;
    let kubelet_dir = dir.path().join("device-plugins");
    std::fs::create_dir(&kubelet_dir)?;
    let mut plugin = PluginProcess::spawn_with_env(
        &kubelet_dir,
        &["--nvml-lib", fake_nvml_lib().to_str().unwrap()],
        &[("FAKE_NVML_INIT_HANG_FILE", hang.as_os_str())],
    );
    // The load is under way once the fake's nvmlInit says it was entered.
    let entered = support::wait_for_file(dir.path(), WAIT, |n| n == "hang.entered").await;
    assert!(
        entered.is_some(),
        "nvmlInit never entered: {}",
        plugin.log()
    );
    plugin.signal(nix::sys::signal::Signal::SIGTERM);
    let status = plugin.wait_exit(WAIT).await.ok_or_else(|| plugin.log())?;
    assert!(status.success(), "{status:?}: {}", plugin.log());
    assert!(
        plugin.log().contains("stopped while NVML was loading"),
        "{}",
        plugin.log()
    );
    Ok(())
}

#[tokio::test]
async fn two_thousand_distinct_xids_keep_series_status_and_checkpoint_bounded() -> TestResult {
    let node = NvmlNode::start(None, &[]).await?;
    let addr = node
        .plugin
        .http_addr()
        .await
        .ok_or_else(|| node.plugin.log())?;
    // XID 79 (the GPU has fallen off the bus), then 1 999 values a broken driver might raise: 2 000 in all.
    let mut lines = vec![format!("xid {} 79", gpu(1))];
    lines.extend((1001..=2999).map(|xid| format!("xid {} {xid}", gpu(1))));
    node.inject(&lines);
    let checkpoint = node.dir.path().join("state").join("health-checkpoint.json");
    let has_last = |text: &str| {
        serde_json::from_str::<serde_json::Value>(text)
            .ok()
            .and_then(|v| {
                let conditions = v["devices"][gpu(1)]["conditions"].as_array()?.clone();
                conditions.iter().any(|c| c["value"] == 2999).then_some(())
            })
            .is_some()
    };
    let saved = support::wait_for_content(&checkpoint, WAIT, has_last)
        .await
        .ok_or_else(|| {
            format!(
                "the last XID never reached the checkpoint\n{}",
                node.plugin.log()
            )
        })?;
    node.wait_unhealthy(&gpu(1)).await?;

    let (status, metrics) = gpu_device_plugin::http::get(&addr, "/metrics").await?;
    assert!(status.is_success());
    let metrics = String::from_utf8_lossy(&metrics).into_owned();
    let series = metrics.lines().filter(|l| !l.starts_with('#')).count();
    let conditions = metrics
        .lines()
        .filter(|l| l.starts_with("gpu_device_plugin_device_condition{"))
        .count();
    let xid_series = metrics
        .lines()
        .filter(|l| l.starts_with("gpu_device_plugin_xid_events_total{"))
        .count();
    let (_, report) = gpu_device_plugin::http::get(&addr, "/status").await?;
    println!(
        "2 000 distinct XIDs: {series} series ({conditions} device_condition, {xid_series} xid_events), \
         /status {} bytes, checkpoint {} bytes",
        report.len(),
        saved.len()
    );
    assert!(conditions <= 16, "{conditions} condition series");
    assert_eq!(xid_series, 2, "XID 79 and xid=\"other\":\n{metrics}");
    assert!(series <= 100, "{series} series");
    assert!(
        report.len() <= 32 * 1024,
        "/status is {} bytes",
        report.len()
    );
    assert!(
        saved.len() <= 16 * 1024,
        "the checkpoint is {} bytes",
        saved.len()
    );
    // The fatal XID still holds the GPU, named first in its message.
    let status = String::from_utf8_lossy(&report);
    assert!(status.contains("XID 79"), "{status}");
    assert!(status.contains("other XIDs"), "{status}");
    Ok(())
}
