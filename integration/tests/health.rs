//! The health policy on the real NVML code path (the plugin binary on the fake libnvidia-ml) against the fake
//! kubelet: XID policies, NVIDIA's DP_* variables, recovery, the checkpoint across restarts and reboots.
//! Quiet periods are set short in the config and waited for as events (the kubelet's next list), never slept.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use support::{NvmlNode, TestResult, fake_nvml_gpu as gpu};

/// A health config, written into the node's directory and passed with `--config`.
fn with_config(dir: &std::path::Path, yaml: &str) -> std::path::PathBuf {
    let path = dir.join("config.yaml");
    std::fs::write(&path, yaml).expect("write config");
    path
}

/// A node whose plugin reads `yaml` as its config file. The config lives in a directory of its own (it has
/// to exist before the plugin starts), returned to be kept as long as the node.
async fn node_with(
    yaml: &str,
) -> Result<(NvmlNode, tempfile::TempDir), Box<dyn std::error::Error>> {
    let config_dir = tempfile::tempdir()?;
    let config = with_config(config_dir.path(), yaml);
    let node = NvmlNode::start(None, &["--config", config.to_str().unwrap()]).await?;
    Ok((node, config_dir))
}

#[tokio::test]
async fn xid_policy_nvidia_flips_xids_13_94_and_109_to_nvidias_behaviour() -> TestResult {
    let (node, _config) = node_with("health:\n  xidPolicy: nvidia\n").await?;
    let (g0, g1, g2) = (gpu(0), gpu(1), gpu(2));
    let list = node
        .list_after(&[
            format!("xid {g0} 13"),
            format!("xid {g1} 94"),
            format!("xid {g2} 109"),
        ])
        .await?;
    assert_eq!(
        list.health(&g0),
        Some("Healthy"),
        "13 is ignored by NVIDIA's list"
    );
    assert_eq!(
        list.health(&g1),
        Some("Unhealthy"),
        "94 is not on NVIDIA's list"
    );
    assert_eq!(
        list.health(&g2),
        Some("Healthy"),
        "109 is ignored by NVIDIA's list"
    );
    Ok(())
}

#[tokio::test]
async fn dp_disable_and_enable_healthchecks_mean_what_they_mean_for_nvidias_plugin() -> TestResult {
    let node = NvmlNode::start(
        None,
        &[
            "--disable-healthchecks",
            "48,109",
            "--enable-healthchecks",
            "13",
        ],
    )
    .await?;
    let list = node
        .list_after(&[
            format!("xid {} 48", gpu(0)),
            format!("xid {} 109", gpu(1)),
            format!("xid {} 13", gpu(2)),
        ])
        .await?;
    assert_eq!(list.health(&gpu(0)), Some("Healthy"));
    assert_eq!(list.health(&gpu(1)), Some("Healthy"));
    assert_eq!(list.health(&gpu(2)), Some("Unhealthy"), "forced on");
    Ok(())
}

#[tokio::test]
async fn dp_disable_healthchecks_is_read_from_the_environment() -> TestResult {
    // The variable reaches the plugin through the environment, as in NVIDIA's DaemonSets.
    let dir = tempfile::tempdir()?;
    let config = with_config(dir.path(), "health:\n  xidPolicy: catalog\n");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"))
        .args([
            "--config",
            config.to_str().unwrap(),
            "--simulate",
            "1",
            "--kubelet-dir",
            "/nonexistent",
        ])
        .env("DP_DISABLE_HEALTHCHECKS", "13,not-a-number")
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("DP_DISABLE_HEALTHCHECKS") && stderr.contains("not-a-number"),
        "{stderr}"
    );
    Ok(())
}

#[tokio::test]
async fn recovery_action_1_makes_the_gpu_unhealthy_and_0_brings_it_back() -> TestResult {
    let node = NvmlNode::start(None, &[]).await?;
    node.inject(&[format!("action {} 1", gpu(1))]);
    node.wait_unhealthy(&gpu(1)).await?;
    let err = node.refusal(&gpu(1)).await?;
    assert!(
        err.message().contains("GPU reset required"),
        "{}",
        err.message()
    );
    node.inject(&[format!("action {} 0", gpu(1))]);
    node.wait_health(&gpu(1), "Healthy").await?;
    node.kubelet.allocate(&[&[&gpu(1)]]).await?;
    Ok(())
}

#[tokio::test]
async fn a_reset_class_xid_recovers_after_the_quiet_period_and_a_successful_probe() -> TestResult {
    let (node, _config) =
        node_with("health:\n  quietPeriod: 300ms\n  probeInterval: 100ms\n").await?;
    node.inject(&[format!("xid {} 109", gpu(2))]);
    node.wait_unhealthy(&gpu(2)).await?;
    node.wait_health(&gpu(2), "Healthy").await?;
    Ok(())
}

#[tokio::test]
async fn a_lost_gpu_comes_back_after_restore() -> TestResult {
    let (node, _config) =
        node_with("health:\n  quietPeriod: 200ms\n  probeInterval: 100ms\n").await?;
    node.inject(&[format!("lost {}", gpu(0))]);
    node.wait_unhealthy(&gpu(0)).await?;
    // While lost, probes fail and it stays Unhealthy; GPU 1 recovering from XID 62 (same quiet period,
    // later) shows probes have run meanwhile.
    node.inject(&[format!("xid {} 62", gpu(1))]);
    node.wait_unhealthy(&gpu(1)).await?;
    let list = node.wait_health(&gpu(1), "Healthy").await?;
    assert_eq!(
        list.health(&gpu(0)),
        Some("Unhealthy"),
        "a lost GPU must not recover before it answers"
    );
    node.inject(&[format!("restore {}", gpu(0))]);
    node.wait_health(&gpu(0), "Healthy").await?;
    Ok(())
}

#[tokio::test]
async fn recover_never_holds_while_others_recover() -> TestResult {
    let (node, _config) = node_with(
        "health:\n  quietPeriod: 200ms\n  probeInterval: 100ms\n  conditions:\n    xid-109: {recover: never}\n",
    )
    .await?;
    node.inject(&[format!("xid {} 109", gpu(0)), format!("xid {} 62", gpu(1))]);
    node.wait_unhealthy(&gpu(1)).await?;
    let list = node.wait_health(&gpu(1), "Healthy").await?;
    assert_eq!(list.health(&gpu(0)), Some("Unhealthy"));
    Ok(())
}

#[tokio::test]
async fn a_plugin_restart_keeps_an_unhealthy_gpu_unhealthy_with_its_message() -> TestResult {
    let mut node = NvmlNode::start(None, &[]).await?;
    node.inject(&[format!("xid {} 79", gpu(2))]);
    node.wait_unhealthy(&gpu(2)).await?;
    let before = node.refusal(&gpu(2)).await?.message().to_string();

    let first = node.restart_plugin().await?;
    assert_eq!(
        first.health(&gpu(2)),
        Some("Unhealthy"),
        "the first list after the restart already knows"
    );
    assert_eq!(first.allocatable(), 3);
    let after = node.refusal(&gpu(2)).await?.message().to_string();
    assert_eq!(after, before, "same message, with the original times");
    Ok(())
}

/// A `recover: never` double-bit ECC error on GPU 2, then a plugin start while GPU 2 does not answer NVML
/// (named from the driver's list or not, as `named`), then a start once it answers again: the fault must
/// hold throughout.
async fn a_recover_never_fault_survives_a_start_while_its_gpu_is_silent(named: bool) -> TestResult {
    let config_dir = tempfile::tempdir()?;
    let config = with_config(
        config_dir.path(),
        "health:\n  conditions:\n    ecc-dbe: {recover: never}\n",
    );
    let mut node = NvmlNode::start(
        None,
        &[
            "--config",
            config.to_str().unwrap(),
            "--proc-root",
            "{dir}/proc",
        ],
    )
    .await?;
    if named {
        support::write_driver_gpu_list(&node.dir.path().join("proc"), 4);
    }
    node.inject(&[format!("dbe {}", gpu(2))]);
    node.wait_unhealthy(&gpu(2)).await?;
    node.stop_plugin().await?;

    node.inject(&[format!("lost {}", gpu(2))]);
    let silent = node.start_plugin().await?;
    let expected = if named { Some("Unhealthy") } else { None };
    assert_eq!(silent.health(&gpu(2)), expected, "{}", node.plugin.log());
    assert_eq!(silent.allocatable(), 3);
    node.stop_plugin().await?;

    node.inject(&[format!("restore {}", gpu(2))]);
    let back = node.start_plugin().await?;
    assert_eq!(
        back.health(&gpu(2)),
        Some("Unhealthy"),
        "{}",
        node.plugin.log()
    );
    assert_eq!(back.allocatable(), 3);
    let refusal = node.refusal(&gpu(2)).await?;
    assert!(refusal.message().contains("ECC"), "{}", refusal.message());
    Ok(())
}

#[tokio::test]
async fn a_recover_never_fault_survives_a_start_while_its_gpu_is_silent_and_named_by_the_driver()
-> TestResult {
    a_recover_never_fault_survives_a_start_while_its_gpu_is_silent(true).await
}

#[tokio::test]
async fn a_recover_never_fault_survives_a_start_while_its_gpu_is_silent_and_unnamed() -> TestResult
{
    a_recover_never_fault_survives_a_start_while_its_gpu_is_silent(false).await
}

#[tokio::test]
async fn a_new_boot_drops_conditions_a_reboot_resolves() -> TestResult {
    let mut node = NvmlNode::start(None, &[]).await?;
    node.inject(&[format!("xid {} 79", gpu(2))]);
    node.wait_unhealthy(&gpu(2)).await?;
    std::fs::write(node.dir.path().join("boot_id"), "boot-2\n")?;
    let first = node.restart_plugin().await?;
    assert_eq!(first.allocatable(), 4, "the reboot resolved XID 79");
    assert!(
        node.plugin.log().contains("rebooted"),
        "{}",
        node.plugin.log()
    );
    Ok(())
}

#[tokio::test]
async fn a_corrupt_checkpoint_means_a_fresh_start_with_a_warning() -> TestResult {
    let mut node = NvmlNode::start(None, &[]).await?;
    node.inject(&[format!("xid {} 79", gpu(2))]);
    node.wait_unhealthy(&gpu(2)).await?;
    // Stopped, the plugin has finished writing; then the file is damaged, as by a disk fault.
    node.stop_plugin().await?;
    let checkpoint = node.dir.path().join("state/health-checkpoint.json");
    assert!(std::fs::read_to_string(&checkpoint)?.contains(&gpu(2)));
    std::fs::write(&checkpoint, b"{\"version\": 1, \"devices\": {\"GPU-")?;
    let first = node.start_plugin().await?;
    assert_eq!(first.allocatable(), 4);
    let log = node.plugin.log();
    assert!(
        log.contains("ignoring the health checkpoint") && log.contains("corrupt"),
        "{log}"
    );
    // And it keeps working: the next fault is saved in a good checkpoint again.
    node.inject(&[format!("xid {} 79", gpu(1))]);
    node.wait_unhealthy(&gpu(1)).await?;
    node.stop_plugin().await?;
    let text = std::fs::read_to_string(&checkpoint)?;
    assert!(text.contains(&gpu(1)), "{text}");
    // The damaged file was kept aside, not overwritten: what it held is still there to look at.
    let aside: Vec<_> = std::fs::read_dir(node.dir.path().join("state"))?
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("health-checkpoint.json.unreadable-")
        })
        .collect();
    assert_eq!(aside.len(), 1, "{log}");
    assert_eq!(
        std::fs::read(aside[0].path())?,
        b"{\"version\": 1, \"devices\": {\"GPU-"
    );
    Ok(())
}

/// A checkpoint from a newer version (after a rollback) is kept aside too, and a time past year 9999 in a
/// checkpoint (a damaged or hand-edited file) is read as the end of 9999, not a crash at every start.
#[tokio::test]
async fn a_newer_checkpoint_is_kept_and_a_far_future_time_does_not_crash() -> TestResult {
    let mut node = NvmlNode::start(None, &[]).await?;
    node.inject(&[format!("xid {} 79", gpu(2))]);
    node.wait_unhealthy(&gpu(2)).await?;
    node.stop_plugin().await?;
    let checkpoint = node.dir.path().join("state/health-checkpoint.json");
    let saved = std::fs::read_to_string(&checkpoint)?;
    let (far, set) = with_times(&saved, 99_999_999_999_999_999);
    assert!(set >= 3, "{saved}");
    std::fs::write(&checkpoint, &far)?;
    let first = node.start_plugin().await?;
    assert_eq!(
        first.health(&gpu(2)),
        Some("Unhealthy"),
        "{}",
        node.plugin.log()
    );
    node.stop_plugin().await?;
    let mut value: serde_json::Value = serde_json::from_str(&saved)?;
    value["version"] = 2.into();
    let newer = value.to_string();
    std::fs::write(&checkpoint, &newer)?;
    let first = node.start_plugin().await?;
    assert_eq!(first.allocatable(), 4);
    let kept = std::fs::read_dir(node.dir.path().join("state"))?
        .filter_map(Result::ok)
        .find(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("health-checkpoint.json.unreadable-")
        })
        .ok_or("the newer checkpoint was not kept aside")?;
    assert_eq!(std::fs::read_to_string(kept.path())?, newer);
    Ok(())
}

/// Every `…Ms` time in a checkpoint's JSON set to `ms`; returns the new JSON and how many were set.
fn with_times(json: &str, ms: u64) -> (String, usize) {
    fn walk(value: &mut serde_json::Value, ms: u64, set: &mut usize) {
        match value {
            serde_json::Value::Object(map) => {
                for (key, v) in map.iter_mut() {
                    if key.ends_with("Ms") && v.is_u64() {
                        *v = ms.into();
                        *set += 1;
                    } else {
                        walk(v, ms, set);
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(|v| walk(v, ms, set)),
            _ => {}
        }
    }
    let mut value: serde_json::Value = serde_json::from_str(json).expect("checkpoint JSON");
    let mut set = 0;
    walk(&mut value, ms, &mut set);
    (value.to_string(), set)
}

#[test]
fn config_errors_name_the_key() {
    let dir = tempfile::tempdir().unwrap();
    for (yaml, key) in [
        (
            "health:\n  conditions:\n    ecc-tbe: {effect: none}\n",
            "health.conditions.ecc-tbe",
        ),
        ("health:\n  quietPeriodd: 1m\n", "quietPeriodd"),
        ("health:\n  quietPeriod: soon\n", "quietPeriod"),
        ("health:\n  xidPolicy: strict\n", "xidPolicy"),
        (
            "health:\n  conditions:\n    gpu-lost: {recover: sometimes}\n",
            "recover",
        ),
    ] {
        let config = with_config(dir.path(), yaml);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"))
            .args(["--config", config.to_str().unwrap(), "--simulate", "1"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{yaml}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains(key), "{key} not in {stderr}");
    }
}
