//! The roads that show a GPU's health besides the kubelet: the HTTP surfaces (`/healthz`, `/readyz`,
//! `/status`) and the `status` command, against the real binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use fake_kubelet::FakeKubelet;
use gpu_device_plugin::devices::simulated::simulated_uuid;
use gpu_device_plugin::http;
use hyper::StatusCode;
use support::{PluginProcess, TestResult, WAIT};

fn gpu(i: usize) -> String {
    simulated_uuid(i)
}

async fn get(addr: &str, path: &str) -> (StatusCode, String) {
    let (status, body) = http::get(addr, path)
        .await
        .expect("the plugin answers HTTP");
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Runs `gpu-device-plugin status` with `args`; its exit success, stdout and stderr.
async fn status_command(args: &[&str]) -> (bool, String, String) {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"))
        .arg("status")
        .args(args)
        .output()
        .await
        .expect("run gpu-device-plugin status");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn readyz_follows_the_kubelet_and_status_shows_a_fault_with_its_conditions() -> TestResult {
    let dir = tempfile::tempdir()?;
    let faults = dir.path().join("faults");
    let faults_arg = faults.to_string_lossy().into_owned();
    // The plugin first: it serves, but no kubelet has registered it.
    let plugin = PluginProcess::spawn(
        dir.path(),
        &["--simulate", "4", "--simulate-events", &faults_arg],
    );
    let addr = plugin
        .http_addr()
        .await
        .ok_or_else(|| format!("no HTTP address in the log\n{}", plugin.log()))?;
    let (status, body) = get(&addr, "/healthz").await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "ok\n"));
    let (status, body) = get(&addr, "/readyz").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body.contains("not registered with the kubelet"), "{body}");

    let kubelet = FakeKubelet::start(dir.path()).await?;
    kubelet
        .wait_list("4 devices", WAIT, |l| l.allocatable() == 4)
        .await?;
    support::append(&faults, &[format!("xid {} 79", gpu(2))]);
    kubelet
        .wait_list("GPU 2 unhealthy", WAIT, |l| {
            l.health(&gpu(2)) == Some("Unhealthy")
        })
        .await?;
    // The kubelet has the list; the stream it holds is counted once its own bookkeeping is done.
    plugin
        .wait_log(WAIT, |l| l.contains("registered with the kubelet"))
        .await
        .ok_or("never registered")?;
    let (status, body) = get(&addr, "/readyz").await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "ready\n"));

    let report = http::fetch_report(&addr).await?;
    assert_eq!(report.devices.len(), 4);
    let d = &report.devices[2];
    assert_eq!(
        (d.id.as_str(), d.index, d.health.as_str()),
        (gpu(2).as_str(), 2, "Unhealthy")
    );
    let message = d.message.clone().unwrap_or_default();
    assert!(
        message.starts_with("Unhealthy: XID 79: the GPU has fallen off the bus"),
        "{message}"
    );
    assert_eq!(d.conditions.len(), 1);
    let c = &d.conditions[0];
    assert_eq!(
        (
            c.kind.as_str(),
            c.value,
            c.effect.as_str(),
            c.recover.as_str(),
            c.count
        ),
        ("xid", Some(79), "Unhealthy", "auto", 1)
    );
    assert!(report.devices[0].message.is_none() && report.devices[0].conditions.is_empty());
    let k = &report.kubelet;
    assert!(k.registered && k.pre_start_check);
    assert_eq!((k.streams_open, k.registrations), (1, 1));
    assert_eq!(k.resource, "nvidia.com/gpu");
    assert!(
        k.endpoint.starts_with("gpu-device-plugin-"),
        "{}",
        k.endpoint
    );
    assert_eq!(report.policy.xid_policy, "catalog");
    assert_eq!(report.policy.quiet_period, "10m");

    // The command an operator runs.
    let (ok, table, err) = status_command(&["--addr", &addr]).await;
    assert!(ok, "{err}");
    assert!(table.starts_with("INDEX  DEVICE"), "{table}");
    let row = table
        .lines()
        .find(|l| l.contains(&gpu(2)))
        .unwrap_or_default();
    assert!(
        row.contains("Unhealthy") && row.ends_with("xid=79"),
        "{table}"
    );
    assert!(
        table.contains("4 devices, 1 Unhealthy; kubelet: registered"),
        "{table}"
    );
    assert!(
        table.contains("Unhealthy: XID 79: the GPU has fallen off the bus"),
        "{table}"
    );
    let (ok, json, err) = status_command(&["--addr", &addr, "--json"]).await;
    assert!(ok, "{err}");
    let parsed: gpu_device_plugin::status::Report = serde_json::from_str(&json)?;
    assert_eq!(parsed.devices[2].health, "Unhealthy");

    // The kubelet goes away: not ready any more.
    drop(kubelet);
    let (status, _) = get(&addr, "/readyz").await;
    let not_ready = if status == StatusCode::OK {
        // Its stream's end reaches the plugin a moment later; the log says when.
        plugin
            .wait_log(WAIT, |l| l.contains("closed our ListAndWatch stream"))
            .await
            .ok_or("the plugin never saw the kubelet go")?;
        get(&addr, "/readyz").await.0
    } else {
        status
    };
    assert_eq!(not_ready, StatusCode::SERVICE_UNAVAILABLE);
    Ok(())
}

#[tokio::test]
async fn the_status_command_says_in_one_line_when_nothing_answers() {
    // A port nothing listens on: bind one, note it, let it go.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .to_string();
    let (ok, out, err) = status_command(&["--addr", &addr]).await;
    assert!(!ok, "{out}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with(&format!(
            "gpu-device-plugin: error: cannot reach the plugin at {addr}"
        )),
        "{err}"
    );
}

#[tokio::test]
async fn http_can_be_turned_off() -> TestResult {
    let dir = tempfile::tempdir()?;
    let kubelet = FakeKubelet::start(dir.path()).await?;
    let plugin = PluginProcess::spawn(dir.path(), &["--simulate", "1", "--http-addr", ""]);
    kubelet.wait_registrations(1, WAIT).await?;
    assert!(!plugin.log().contains("serving HTTP"), "{}", plugin.log());
    Ok(())
}
