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
    assert!(
        unknown.contains(&format!("run: gpu-device-plugin fence {}", gpu(0))),
        "{unknown}"
    );
    let no_reason = error_line(&command(&node, &["fence", &gpu(0)]));
    assert!(
        no_reason.contains(&format!("run: gpu-device-plugin fence {} --reason", gpu(0))),
        "{no_reason}"
    );
    let not_fenced = error_line(&command(&node, &["release", &gpu(0)]));
    assert!(
        not_fenced.contains(&format!(
            "no condition fenced on {}; conditions there: none",
            gpu(0)
        )),
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
async fn a_gpu_is_fenced_and_released_by_its_nvml_index_and_conditions_are_named_as_status_shows_them()
-> TestResult {
    let node = NvmlNode::start(None, &[]).await?;
    let out = command(&node, &["fence", "2", "--reason", "pulled for RMA"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stdout(&out).trim(), format!("fenced {}: Unhealthy", gpu(2)));
    node.wait_unhealthy(&gpu(2)).await?;
    let out = command(&node, &["release", "2"]);
    assert!(out.status.success(), "{out:?}");
    node.wait_health(&gpu(2), "Healthy").await?;

    node.inject(&[format!("xid {} 79", gpu(1))]);
    node.wait_unhealthy(&gpu(1)).await?;
    // The name `release` takes is the one the error shows, and the one `status` shows.
    let wrong = error_line(&command(&node, &["release", "1", "--condition", "xid-80"]));
    assert!(
        wrong.contains(&format!(
            "no condition xid-80 on {}; conditions there: xid-79 — run: gpu-device-plugin release {} --condition xid-79",
            gpu(1),
            gpu(1)
        )),
        "{wrong}"
    );
    // As earlier versions showed it, `xid=79` is read too.
    let out = command(&node, &["release", "1", "--condition", "xid=79"]);
    assert!(out.status.success(), "{out:?}");
    node.wait_health(&gpu(1), "Healthy").await?;
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
        plain.contains(&format!(
            "no condition fenced on {}; conditions there: ecc-dbe — run: gpu-device-plugin release {} --condition ecc-dbe",
            gpu(1),
            gpu(1)
        )),
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

/// `mkfifo path`: a named pipe, which blocks whoever opens it for reading until a writer comes.
fn mkfifo(path: &std::path::Path) {
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("run mkfifo");
    assert!(status.success(), "mkfifo {}", path.display());
}

/// A report of `gpu`'s fence with `reason`.
fn fence_json(gpu: &str, reason: &str) -> String {
    format!(r#"{{"device": "{gpu}", "reason": "{reason}", "by": "burn-in"}}"#)
}

#[tokio::test]
async fn a_fifo_in_the_fence_directory_at_start_is_skipped_and_holds_up_nothing() -> TestResult {
    let fence = tempfile::tempdir()?;
    mkfifo(&fence.path().join("pipe.json"));
    // Opened for reading, a FIFO blocks until a writer comes: that kept the plugin from registering, and
    // since the side surfaces have a thread of their own, stalled that thread (HTTP, the control socket).
    let mut node = NvmlNode::start(None, &["--fence-dir", fence.path().to_str().unwrap()]).await?;
    report(
        fence.path(),
        "gpu1.json",
        &fence_json(&gpu(1), "burn-in failed"),
    );
    node.wait_unhealthy(&gpu(1)).await?;
    node.inject(&[format!("xid {} 79", gpu(3))]);
    node.wait_unhealthy(&gpu(3)).await?;
    let log = node.plugin.log();
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("pipe.json") && l.contains("regular file")),
        "{log}"
    );
    node.stop_plugin().await?;
    Ok(())
}

#[tokio::test]
async fn a_fifo_created_in_the_fence_directory_while_running_leaves_faults_health_and_sigterm_working()
-> TestResult {
    let fence = tempfile::tempdir()?;
    let mut node = NvmlNode::start(None, &["--fence-dir", fence.path().to_str().unwrap()]).await?;
    let addr = node.plugin.http_addr().await.ok_or("no HTTP address")?;
    mkfifo(&fence.path().join("pipe.json"));
    // A report after the FIFO: once it fences GPU 2, the directory has been read with the FIFO in it.
    report(
        fence.path(),
        "gpu2.json",
        &fence_json(&gpu(2), "burn-in failed"),
    );
    node.wait_unhealthy(&gpu(2)).await?;
    node.inject(&[format!("xid {} 79", gpu(3))]);
    node.wait_unhealthy(&gpu(3)).await?;
    let (status, body) = gpu_device_plugin::http::get(&addr, "/healthz").await?;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let out = command(&node, &["fence", &gpu(0), "--reason", "maintenance"]);
    assert!(out.status.success(), "{out:?}");
    node.wait_unhealthy(&gpu(0)).await?;
    node.stop_plugin().await?;
    Ok(())
}

#[tokio::test]
async fn an_idle_fence_directory_costs_next_to_no_cpu() -> TestResult {
    let fence = tempfile::tempdir()?;
    let node = NvmlNode::start(None, &["--fence-dir", fence.path().to_str().unwrap()]).await?;
    report(
        fence.path(),
        "gpu1.json",
        &fence_json(&gpu(1), "burn-in failed"),
    );
    node.wait_unhealthy(&gpu(1)).await?;
    let pid = node.plugin.child.id().ok_or("plugin exited")?;
    let before = support::cpu_ticks(pid).ok_or("no /proc/<pid>/stat")?;
    let reads_before = node.plugin.log().matches("fence directory read").count();
    // Not a wait for anything: the span over which CPU time is measured. Each read of the directory used
    // to wake the next, which took 290 of the 300 ticks of 3 s.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let used = support::cpu_ticks(pid).ok_or("no /proc/<pid>/stat")? - before;
    let reads = node.plugin.log().matches("fence directory read").count() - reads_before;
    assert!(
        used < 30,
        "{used} clock ticks in 3 s, idle\n{}",
        node.plugin.log()
    );
    assert!(reads <= 1, "{reads} reads of an idle directory");
    Ok(())
}

#[tokio::test]
async fn a_fence_is_held_while_its_directory_cannot_be_read_and_a_recreated_directory_is_watched()
-> TestResult {
    let parent = tempfile::tempdir()?;
    let fence = parent.path().join("fence");
    std::fs::create_dir(&fence)?;
    report(&fence, "gpu1.json", &fence_json(&gpu(1), "burn-in failed"));
    let node = NvmlNode::start(None, &["--fence-dir", fence.to_str().unwrap()]).await?;
    node.wait_unhealthy(&gpu(1)).await?;

    let healthy = support::record_health(&node.kubelet, &gpu(1), "Healthy");
    // The directory replaced by a file: nothing can be read there, which says nothing about the reports.
    std::fs::rename(&fence, parent.path().join("fence.old"))?;
    std::fs::write(&fence, "not a directory")?;
    let warned = node
        .plugin
        .wait_log(WAIT, |log| {
            log.lines()
                .any(|l| l.contains("WARN") && l.contains("cannot read the fence directory"))
        })
        .await;
    assert!(warned.is_some(), "{}", node.plugin.log());
    // Long enough for a release to reach the kubelet: a fault on another GPU, handled after it.
    node.inject(&[format!("xid {} 79", gpu(3))]);
    let list = node.wait_unhealthy(&gpu(3)).await?;
    assert_eq!(
        list.health(&gpu(1)),
        Some("Unhealthy"),
        "{}",
        node.plugin.log()
    );
    // Read again every second while it cannot be: three tries, none releasing, and one warning for them
    // all.
    let retried = node
        .plugin
        .wait_log(WAIT, |log| {
            log.matches("fence directory read: unreadable").count() >= 3
        })
        .await;
    let log = retried.ok_or_else(|| node.plugin.log())?;
    assert!(
        !healthy.stop(),
        "GPU 1 was listed Healthy while its fence directory could not be read\n{log}"
    );
    let warnings = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("cannot read the fence directory"))
        .count();
    assert_eq!(warnings, 1, "{log}");

    // A new directory in its place is watched: its reports are read, and a report gone releases its fence.
    std::fs::remove_file(&fence)?;
    std::fs::create_dir(&fence)?;
    report(&fence, "gpu2.json", &fence_json(&gpu(2), "NVLink errors"));
    node.wait_unhealthy(&gpu(2)).await?;
    node.wait_health(&gpu(1), "Healthy").await?;
    report(&fence, "gpu0.json", &fence_json(&gpu(0), "thermal"));
    node.wait_unhealthy(&gpu(0)).await?;
    Ok(())
}

#[tokio::test]
async fn a_report_rewritten_in_place_keeps_its_gpu_unhealthy_throughout() -> TestResult {
    let fence = tempfile::tempdir()?;
    let file = fence.path().join("gpu1.json");
    let json = fence_json(&gpu(1), "burn-in failed");
    std::fs::write(&file, &json)?;
    let node = NvmlNode::start(None, &["--fence-dir", fence.path().to_str().unwrap()]).await?;
    node.wait_unhealthy(&gpu(1)).await?;
    let healthy = support::record_health(&node.kubelet, &gpu(1), "Healthy");
    // A report of another GPU after each rewrite: once the kubelet sees it, the directory was read with the
    // report half written.
    let marker = |n: usize| {
        let gpu = gpu([2, 3, 0][n]);
        report(
            fence.path(),
            &format!("marker{n}.json"),
            &fence_json(&gpu, "marker"),
        );
        gpu
    };
    for (n, partial) in ["", "{\"device\": \"GPU-", "   "].into_iter().enumerate() {
        // Truncated (and closed, which wakes the plugin), then half written: the state a reader sees
        // between a detector's truncate and its write.
        std::fs::write(&file, partial)?;
        let marked = marker(n);
        node.wait_unhealthy(&marked).await?;
        assert_eq!(
            node.kubelet.list().health(&gpu(1)),
            Some("Unhealthy"),
            "after {partial:?}\n{}",
            node.plugin.log()
        );
        std::fs::write(&file, &json)?;
    }
    assert!(
        !healthy.stop(),
        "GPU 1 was listed Healthy while its report was rewritten\n{}",
        node.plugin.log()
    );
    std::fs::remove_file(&file)?;
    node.wait_health(&gpu(1), "Healthy").await?;
    Ok(())
}

#[tokio::test]
async fn a_bad_report_rewritten_thousands_of_times_is_warned_about_a_bounded_number_of_times()
-> TestResult {
    let fence = tempfile::tempdir()?;
    let node = NvmlNode::start(None, &["--fence-dir", fence.path().to_str().unwrap()]).await?;
    let reads_before = node.plugin.log().matches("fence directory read").count();
    let started = std::time::Instant::now();
    let file = fence.path().join("broken.json");
    for n in 0..2000 {
        std::fs::write(&file, format!("{{not json {n}"))?;
    }
    // The last change is never missed, however fast the ones before it came.
    std::fs::write(&file, fence_json(&gpu(1), "burn-in failed"))?;
    node.wait_unhealthy(&gpu(1)).await?;
    let elapsed = started.elapsed();
    let log = node.plugin.log();
    // Warnings about the unreadable report; the fence it finally sets is a warning of its own (out of
    // service), which names the file too.
    let warnings = log
        .lines()
        .filter(|l| {
            l.contains("WARN") && l.contains("broken.json") && !l.contains("device health changed")
        })
        .count();
    assert!(warnings <= 2, "{warnings} warnings\n{log}");
    // Ten readings a second at most, and one that may have begun since.
    let reads = log.matches("fence directory read").count() - reads_before;
    let most = (elapsed.as_secs_f64() * 10.0).ceil() as usize + 2;
    assert!(
        reads <= most,
        "{reads} readings in {elapsed:?} for 2001 writes (at most {most})"
    );
    Ok(())
}

#[tokio::test]
async fn a_fence_directory_removed_and_made_again_at_once_is_watched_again() -> TestResult {
    let parent = tempfile::tempdir()?;
    let fence = parent.path().join("fence");
    std::fs::create_dir(&fence)?;
    let node = NvmlNode::start(None, &["--fence-dir", fence.to_str().unwrap()]).await?;
    report(&fence, "gpu1.json", &fence_json(&gpu(1), "burn-in failed"));
    node.wait_unhealthy(&gpu(1)).await?;
    std::fs::remove_file(fence.join("gpu1.json"))?;
    node.wait_health(&gpu(1), "Healthy").await?;
    let reads = node.plugin.log().matches("fence directory read").count();
    let inode = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&fence)?);
    // Removed and made again before the plugin looks: ext4 and tmpfs hand the same inode number out again,
    // yet the kernel has dropped the watch on the one removed.
    std::fs::remove_dir(&fence)?;
    std::fs::create_dir(&fence)?;
    let again = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&fence)?);
    // The removal wakes the plugin, which reads the new, empty directory; only a report written after that
    // reading shows whether the new directory is watched.
    let read = node
        .plugin
        .wait_log(WAIT, |log| {
            log.matches("fence directory read").count() > reads
        })
        .await;
    assert!(read.is_some(), "{}", node.plugin.log());
    report(&fence, "gpu2.json", &fence_json(&gpu(2), "NVLink errors"));
    node.wait_unhealthy(&gpu(2))
        .await
        .map_err(|e| format!("{e}\n(inode {inode}, then {again})"))?;
    Ok(())
}

#[tokio::test]
async fn twenty_thousand_reports_cost_bounded_memory_and_log_lines_and_do_not_hold_up_faults()
-> TestResult {
    let fence = tempfile::tempdir()?;
    for n in 0..20_000 {
        let json = format!(r#"{{"device": "GPU-elsewhere-{n}", "reason": "not here"}}"#);
        std::fs::write(fence.path().join(format!("r{n:05}.json")), json)?;
    }
    // First by name, so within any cap on how many reports are read.
    std::fs::write(
        fence.path().join("a.json"),
        fence_json(&gpu(1), "burn-in failed"),
    )?;
    let node = NvmlNode::start(None, &["--fence-dir", fence.path().to_str().unwrap()]).await?;
    node.wait_unhealthy(&gpu(1)).await?;
    node.inject(&[format!("xid {} 79", gpu(3))]);
    node.wait_unhealthy(&gpu(3)).await?;
    // Read again after its first reading has been dealt with in full.
    std::fs::remove_file(fence.path().join("a.json"))?;
    node.wait_health(&gpu(1), "Healthy").await?;
    let log = node.plugin.log();
    let warnings = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("fence"))
        .count();
    assert!(warnings <= 30, "{warnings} warnings");
    assert!(
        log.contains("not read"),
        "the reports past the cap are said to be unread\n{log}"
    );
    let pid = node.plugin.child.id().ok_or("plugin exited")?;
    let peak = support::peak_rss_kib(pid).ok_or("no VmHWM")?;
    assert!(peak < 64 * 1024, "peak RSS {peak} KiB");
    Ok(())
}

#[tokio::test]
async fn reports_and_file_names_cannot_forge_log_lines_or_reach_a_terminal_raw() -> TestResult {
    let fence = tempfile::tempdir()?;
    let node = NvmlNode::start(None, &["--fence-dir", fence.path().to_str().unwrap()]).await?;
    let forged = "1999-01-01T00:00:00.000000Z  INFO forged";
    let json = format!(
        r#"{{"device": "{}", "reason": "thermal\n{forged}", "by": "det\u001b[2Jector"}}"#,
        gpu(1)
    );
    report(fence.path(), "gpu1.json", &json);
    std::fs::write(
        fence.path().join(format!("evil\n{forged}.json")),
        fence_json(&gpu(2), "named badly"),
    )?;
    std::fs::write(
        fence.path().join("unknown.json"),
        format!(r#"{{"device": "GPU-\u001b[2J\n{forged}", "reason": "x"}}"#),
    )?;
    node.wait_unhealthy(&gpu(1)).await?;
    let warned = node
        .plugin
        .wait_log(WAIT, |log| {
            log.contains("forged.json") && log.contains("unknown.json")
        })
        .await;
    let log = warned.ok_or_else(|| node.plugin.log())?;
    assert!(
        !log.lines().any(|l| l.starts_with("1999-01-01")),
        "a forged line\n{log}"
    );
    assert!(!log.contains('\u{1b}'), "an escape reached the log\n{log}");
    assert!(
        log.contains("evil\\n1999"),
        "the name is said escaped\n{log}"
    );
    let refusal = node.refusal(&gpu(1)).await?;
    assert!(
        refusal.message().contains("thermal\\n1999") && !refusal.message().contains('\u{1b}'),
        "{}",
        refusal.message()
    );
    assert_eq!(
        node.kubelet.list().health(&gpu(2)),
        Some("Healthy"),
        "a report whose name holds a newline is not applied"
    );
    Ok(())
}

/// A client that half-closes its side of the control socket once its request is sent (as `curl` over a
/// socket or a script with `shutdown(SHUT_WR)` does) gets its answer. Before, its fence was applied and it
/// got no answer.
#[tokio::test]
async fn a_control_client_that_half_closes_after_its_request_gets_its_answer() -> TestResult {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let node = NvmlNode::start(None, &[]).await?;
    let socket = node.dir.path().join("state/control.sock");
    let body = format!(r#"{{"device":"{}","reason":"half-closed client"}}"#, gpu(1));
    let request = format!(
        "POST /fence HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut stream = tokio::net::UnixStream::connect(&socket).await?;
    stream.write_all(request.as_bytes()).await?;
    stream.shutdown().await?;
    let mut answer = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut answer)).await??;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    assert!(
        answer.contains(&gpu(1)) && answer.contains("Unhealthy"),
        "{answer}"
    );
    node.wait_unhealthy(&gpu(1)).await?;
    Ok(())
}
