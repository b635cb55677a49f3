//! SIGHUP, as config reloaders send it: a config that does not load is refused and the plugin goes on; one
//! that loads restarts the plugin in place with it, keeping every GPU's health.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use nix::sys::signal::Signal;
use std::time::Duration;
use support::{NvmlNode, ScriptedNode, TestResult, WAIT, fake_nvml_gpu};

#[tokio::test]
async fn sighup_refuses_a_bad_config_and_restarts_with_a_good_one_keeping_health() -> TestResult {
    let config_dir = tempfile::tempdir()?;
    let config = config_dir.path().join("config.yaml");
    std::fs::write(&config, "health:\n  quietPeriod: 10m\n")?;
    let config_arg = config.to_string_lossy().into_owned();
    let node = ScriptedNode::start(2, &["--config", &config_arg]).await?;
    let gpu = node.kubelet.list().devices[1].id.clone();
    node.inject(&[format!("xid {gpu} 79")]);
    node.kubelet
        .wait_list("GPU 1 Unhealthy", WAIT, |l| {
            l.health(&gpu) == Some("Unhealthy")
        })
        .await?;
    let pid = node.plugin.child.id();

    // A config that does not load: one error line naming the key, still serving.
    std::fs::write(&config, "health:\n  quietPeriod: 10m\n  bogus: 1\n")?;
    node.plugin.signal(Signal::SIGHUP);
    let refused = node
        .plugin
        .wait_log(WAIT, |l| {
            l.contains("new config refused") && l.contains("bogus")
        })
        .await;
    assert!(refused.is_some(), "{}", node.plugin.log());
    assert_eq!(
        node.kubelet.registrations().len(),
        1,
        "no restart on a bad config"
    );

    // A config that loads: the plugin restarts in place (same process), registers again, and the GPU that
    // failed before is Unhealthy in the new instance's first list.
    std::fs::write(&config, "health:\n  quietPeriod: 20m\n")?;
    node.plugin.signal(Signal::SIGHUP);
    node.kubelet.wait_registrations(2, WAIT).await?;
    let list = node
        .kubelet
        .wait_list("the restarted plugin's list", WAIT, |l| {
            l.devices.len() == 2
        })
        .await?;
    assert_eq!(
        list.health(&gpu),
        Some("Unhealthy"),
        "{}",
        node.plugin.log()
    );
    assert_eq!(node.plugin.child.id(), pid, "restarted in the same process");
    let restarted = node
        .plugin
        .wait_log(WAIT, |l| l.contains("restarting with the new config"))
        .await;
    assert!(restarted.is_some(), "{}", node.plugin.log());
    Ok(())
}

#[tokio::test]
async fn sighup_with_a_huge_or_deeply_nested_config_refuses_it_and_faults_still_reach_the_kubelet()
-> TestResult {
    let config_dir = tempfile::tempdir()?;
    let config = config_dir.path().join("config.yaml");
    std::fs::write(&config, "health:\n  quietPeriod: 10m\n")?;
    let config_arg = config.to_string_lossy().into_owned();
    let node = ScriptedNode::start(2, &["--config", &config_arg]).await?;
    let gpus: Vec<String> = node
        .kubelet
        .list()
        .devices
        .iter()
        .map(|d| d.id.clone())
        .collect();

    // 400 KB of nesting: the YAML parser alone took longer than a test waits for such a file, and did it on
    // the thread that carries faults to the kubelet.
    let nested = 100_000;
    std::fs::write(&config, "{a: ".repeat(nested) + &"}".repeat(nested))?;
    node.plugin.signal(Signal::SIGHUP);
    node.inject(&[format!("xid {} 79", gpus[0])]);
    node.kubelet
        .wait_list("GPU 0 Unhealthy after the SIGHUP", WAIT, |l| {
            l.health(&gpus[0]) == Some("Unhealthy")
        })
        .await?;
    let refused = node
        .plugin
        .wait_log(WAIT, |l| {
            l.contains("new config refused") && l.contains("more than 32 deep")
        })
        .await;
    assert!(refused.is_some(), "{}", node.plugin.log());

    // 10 MB: refused by its size, without reading it all.
    std::fs::write(&config, "# padding line\n".repeat(700_000))?;
    node.plugin.signal(Signal::SIGHUP);
    node.inject(&[format!("xid {} 79", gpus[1])]);
    node.kubelet
        .wait_list("GPU 1 Unhealthy after the SIGHUP", WAIT, |l| {
            l.health(&gpus[1]) == Some("Unhealthy")
        })
        .await?;
    let refused = node
        .plugin
        .wait_log(WAIT, |l| {
            l.contains("new config refused") && l.contains("larger than 1048576 bytes")
        })
        .await;
    assert!(refused.is_some(), "{}", node.plugin.log());
    assert_eq!(
        node.kubelet.registrations().len(),
        1,
        "no restart on a refused config"
    );
    Ok(())
}

/// Faults raised all through a reload, from the SIGHUP until the restarted plugin has registered and after:
/// each reaches the kubelet. Between the old image's last event wait and the new image's first, only the
/// watcher started before the restart sees them (NVML delivers an event only to sets registered when it
/// happens; the fake library does the same).
#[tokio::test]
async fn faults_raised_all_through_a_reload_each_reach_the_kubelet() -> TestResult {
    const GPUS: usize = 256;
    let devices: Vec<String> = (0..GPUS)
        .map(|i| format!(r#"{{"uuid":"{}"}}"#, fake_nvml_gpu(i)))
        .collect();
    let gpus = format!(r#"{{"devices":[{}]}}"#, devices.join(","));
    let config_dir = tempfile::tempdir()?;
    let config = config_dir.path().join("config.yaml");
    std::fs::write(&config, "health:\n  quietPeriod: 10m\n")?;
    let config_arg = config.to_string_lossy().into_owned();
    let node = NvmlNode::start(Some(&gpus), &["--config", &config_arg]).await?;
    node.kubelet
        .wait_list("every GPU listed", WAIT, |l| l.allocatable() == GPUS)
        .await?;

    std::fs::write(&config, "health:\n  quietPeriod: 20m\n")?;
    node.plugin.signal(Signal::SIGHUP);
    // From here the old image stops watching: faults go on, paced, until well after the new one registered.
    let decided = node
        .plugin
        .wait_log(WAIT, |l| l.contains("config loads; restarting with it"))
        .await;
    assert!(decided.is_some(), "{}", node.plugin.log());
    let mut raised = Vec::new();
    let mut registered_at = None;
    for i in 0..GPUS {
        node.inject(&[format!("xid {} 79", fake_nvml_gpu(i))]);
        raised.push(fake_nvml_gpu(i));
        if registered_at.is_none() && node.kubelet.registrations().len() >= 2 {
            registered_at = Some(i);
        }
        if registered_at.is_some_and(|at| i >= at + 8) {
            break;
        }
        // Pacing, not synchronisation: the faults spread over the whole restart.
        tokio::time::sleep(Duration::from_millis(4)).await;
    }
    assert!(
        registered_at.is_some(),
        "the restarted plugin had not registered after {GPUS} faults: {}",
        node.plugin.log()
    );
    let unhealthy = node
        .kubelet
        .wait_list("every GPU faulted during the reload Unhealthy", WAIT, |l| {
            raised.iter().all(|g| l.health(g) == Some("Unhealthy"))
        })
        .await;
    if let Err(e) = unhealthy {
        let list = node.kubelet.list();
        let missed: Vec<&String> = raised
            .iter()
            .filter(|g| list.health(g) != Some("Unhealthy"))
            .collect();
        panic!(
            "{e}: {} of {} faults lost: {missed:?}\n{}",
            missed.len(),
            raised.len(),
            node.plugin.log()
        );
    }
    let took = node
        .plugin
        .wait_log(WAIT, |l| {
            l.contains("took the events seen while restarting")
        })
        .await;
    assert!(took.is_some(), "{}", node.plugin.log());
    Ok(())
}
