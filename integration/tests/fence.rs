//! Operators fencing and releasing GPUs, against the binary on the fake NVML library: by command over the
//! control socket, and by a detector's report in the fence directory. A fence keeps the GPU Unhealthy with
//! its reason, through plugin restarts and reboots, until released.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use std::os::unix::fs::PermissionsExt as _;
use std::process::Output;

use support::{NvmlNode, TestResult, WAIT, fake_nvml_gpu as gpu};

/// `gpu-device-plugin <args>` with the node's state directory.
fn command(node: &NvmlNode, args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"))
        .args(args)
        .arg("--state-dir")
        .arg(node.dir.path().join("state"))
        .env_remove("RUST_LOG")
        .env("USER", "alice")
        .output()
        .expect("run gpu-device-plugin")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The one error line of a failed command.
fn error_line(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "expected a failure: {}", stdout(out));
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

#[tokio::test]
async fn a_fence_by_command_holds_through_restarts_and_reboots_until_released() -> TestResult {
    let mut node = NvmlNode::start(None, &[]).await?;
    let socket = node.dir.path().join("state/control.sock");
    let mode = std::fs::metadata(&socket)?.permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the control socket is the plugin user's only");

    let out = command(
        &node,
        &["fence", &gpu(2), "--reason", "burn-in failed on 2026-11-24"],
    );
    assert!(out.status.success(), "{:?}", out);
    assert_eq!(stdout(&out).trim(), format!("fenced {}: Unhealthy", gpu(2)));
    let list = node.wait_unhealthy(&gpu(2)).await?;
    assert_eq!(list.allocatable(), 3);
    let refusal = node.refusal(&gpu(2)).await?;
    let message = refusal.message();
    assert!(
        message.contains("fenced by alice (uid 0)")
            && message.contains("burn-in failed on 2026-11-24"),
        "{message}"
    );

    // /metrics counts it, /status says who and why.
    let addr = node.plugin.http_addr().await.ok_or("no HTTP address")?;
    let (_, metrics) = gpu_device_plugin::http::get(&addr, "/metrics").await?;
    let metrics = String::from_utf8_lossy(&metrics).into_owned();
    assert!(
        metrics
            .lines()
            .any(|l| l.contains("devices_with_condition{kind=\"fenced\"}") && l.ends_with(" 1")),
        "{metrics}"
    );
    let (_, status) = gpu_device_plugin::http::get(&addr, "/status").await?;
    let status: serde_json::Value = serde_json::from_slice(&status)?;
    let fenced = status["devices"]
        .as_array()
        .and_then(|d| d.iter().find(|d| d["id"] == gpu(2)))
        .map(|d| d["conditions"][0].clone())
        .unwrap_or_default();
    assert_eq!(fenced["kind"], "fenced");
    assert_eq!(fenced["recover"], "never");
    assert!(
        fenced["detail"]
            .as_str()
            .is_some_and(|d| d.starts_with("by alice (uid 0)")
                && d.ends_with("burn-in failed on 2026-11-24")),
        "{fenced}"
    );

    let first = node.restart_plugin().await?;
    assert_eq!(
        first.health(&gpu(2)),
        Some("Unhealthy"),
        "kept across a restart"
    );
    std::fs::write(node.dir.path().join("boot_id"), "boot-2\n")?;
    let first = node.restart_plugin().await?;
    assert_eq!(
        first.health(&gpu(2)),
        Some("Unhealthy"),
        "an operator's decision outlives a reboot\n{}",
        node.plugin.log()
    );

    let out = command(&node, &["release", &gpu(2), "--reason", "passed burn-in"]);
    assert!(out.status.success(), "{:?}", out);
    assert_eq!(stdout(&out).trim(), format!("released {}: Healthy", gpu(2)));
    let list = node.wait_health(&gpu(2), "Healthy").await?;
    assert_eq!(list.allocatable(), 4);
    let log = node.plugin.log();
    assert!(
        log.contains("passed burn-in") && log.contains("alice"),
        "{log}"
    );
    Ok(())
}

#[tokio::test]
async fn fence_and_release_refuse_what_they_cannot_do_with_one_line() -> TestResult {
    let node = NvmlNode::start(None, &[]).await?;
    let unknown = error_line(&command(&node, &["fence", "GPU-no-such", "--reason", "x"]));
    assert!(
        unknown.contains("no device GPU-no-such") && unknown.contains(&gpu(0)),
        "{unknown}"
    );
    let no_reason = error_line(&command(&node, &["fence", &gpu(0)]));
    assert!(no_reason.contains("--reason"), "{no_reason}");
    let not_fenced = error_line(&command(&node, &["release", &gpu(0)]));
    assert!(
        not_fenced.contains("has no fenced condition"),
        "{not_fenced}"
    );
    let bad = error_line(&command(
        &node,
        &["release", &gpu(0), "--condition", "xid-abc"],
    ));
    assert!(bad.contains("xid-abc"), "{bad}");
    let list = node.kubelet.list();
    assert_eq!(list.allocatable(), 4, "nothing changed");

    // No plugin on that state directory.
    let nobody = tempfile::tempdir()?;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"))
        .args(["fence", &gpu(0), "--reason", "x", "--state-dir"])
        .arg(nobody.path())
        .output()?;
    let line = error_line(&out);
    assert!(line.contains("not running"), "{line}");
    Ok(())
}

#[tokio::test]
async fn a_recover_never_condition_is_released_only_when_named_and_is_logged_at_warn() -> TestResult
{
    let config = tempfile::tempdir()?;
    let path = config.path().join("config.yaml");
    std::fs::write(
        &path,
        "health:\n  conditions:\n    ecc-dbe: {recover: never}\n",
    )?;
    let node = NvmlNode::start(None, &["--config", path.to_str().unwrap()]).await?;
    node.inject(&[format!("dbe {}", gpu(1))]);
    node.wait_unhealthy(&gpu(1)).await?;

    let plain = error_line(&command(&node, &["release", &gpu(1)]));
    assert!(
        plain.contains("has no fenced condition") && plain.contains("ecc-dbe"),
        "{plain}"
    );
    let out = command(
        &node,
        &[
            "release",
            &gpu(1),
            "--condition",
            "ecc-dbe",
            "--reason",
            "GPU replaced",
        ],
    );
    assert!(out.status.success(), "{:?}", out);
    node.wait_health(&gpu(1), "Healthy").await?;
    let warned = node
        .plugin
        .wait_log(WAIT, |log| {
            log.lines().any(|l| {
                l.contains("WARN") && l.contains("recover: never") && l.contains("GPU replaced")
            })
        })
        .await;
    assert!(warned.is_some(), "{}", node.plugin.log());
    Ok(())
}

/// Writes a detector's report as a detector should: a hidden temporary file renamed into place.
fn report(dir: &std::path::Path, name: &str, json: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, json).expect("write the report");
    std::fs::rename(&tmp, dir.join(name)).expect("rename the report into place");
}

#[tokio::test]
async fn a_report_in_the_fence_directory_fences_until_it_is_removed() -> TestResult {
    let fence = tempfile::tempdir()?;
    std::fs::write(fence.path().join("broken.json"), "{not json")?;
    let mut node = NvmlNode::start(None, &["--fence-dir", fence.path().to_str().unwrap()]).await?;
    let json = format!(
        r#"{{"device": "{}", "reason": "SXID 20034 on NVSwitch 3", "by": "nvswitch-watch"}}"#,
        gpu(1)
    );
    report(fence.path(), "gpu1.json", &json);
    node.wait_unhealthy(&gpu(1)).await?;
    let refusal = node.refusal(&gpu(1)).await?;
    assert!(
        refusal.message().contains("SXID 20034 on NVSwitch 3")
            && refusal.message().contains("nvswitch-watch"),
        "{}",
        refusal.message()
    );
    let log = node.plugin.log();
    assert!(
        log.contains("broken.json") && log.contains("fence report ignored"),
        "{log}"
    );

    std::fs::remove_file(fence.path().join("gpu1.json"))?;
    let list = node.wait_health(&gpu(1), "Healthy").await?;
    assert_eq!(list.allocatable(), 4);

    // Reported again, then the report removed while the plugin is stopped: released at its next start.
    report(fence.path(), "gpu1.json", &json);
    node.wait_unhealthy(&gpu(1)).await?;
    node.stop_plugin().await?;
    std::fs::remove_file(fence.path().join("gpu1.json"))?;
    node.start_plugin().await?;
    node.wait_health(&gpu(1), "Healthy").await?;
    Ok(())
}

#[tokio::test]
async fn a_fence_by_command_is_not_released_by_the_fence_directory() -> TestResult {
    let fence = tempfile::tempdir()?;
    let node = NvmlNode::start(None, &["--fence-dir", fence.path().to_str().unwrap()]).await?;
    let out = command(&node, &["fence", &gpu(3), "--reason", "under maintenance"]);
    assert!(out.status.success(), "{:?}", out);
    node.wait_unhealthy(&gpu(3)).await?;
    // Any change in the directory makes the plugin look at it again; the command's fence is not its own.
    let json = format!(r#"{{"device": "{}", "reason": "thermal"}}"#, gpu(0));
    report(fence.path(), "gpu0.json", &json);
    let list = node.wait_unhealthy(&gpu(0)).await?;
    assert_eq!(list.health(&gpu(3)), Some("Unhealthy"));
    std::fs::remove_file(fence.path().join("gpu0.json"))?;
    let list = node.wait_health(&gpu(0), "Healthy").await?;
    assert_eq!(
        list.health(&gpu(3)),
        Some("Unhealthy"),
        "{}",
        node.plugin.log()
    );
    Ok(())
}
