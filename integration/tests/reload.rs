//! SIGHUP, as config reloaders send it: a config that does not load is refused and the plugin goes on; one
//! that loads restarts the plugin in place with it, keeping every GPU's health.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use nix::sys::signal::Signal;
use support::{ScriptedNode, TestResult, WAIT};

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
