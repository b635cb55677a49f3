//! NVIDIA's flags and environment variables that concern where the driver is (the GPU operator's driver
//! container), IMEX channels and CDI spec generation, against the binary: each applied as NVIDIA's plugin
//! applies it, or accepted with one warning that says it has no effect here and why.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use std::ffi::OsStr;

use fake_kubelet::FakeKubelet;
use gpu_device_plugin::sources::simulated::simulated_uuid;
use support::{PluginProcess, TestResult, WAIT};

/// A driver root as the GPU operator's driver container mounts it into the plugin's pod: NVML's library in
/// one of the directories NVIDIA's plugin searches, and IMEX channel 0's device node under `dev/` (a link
/// to /dev/null: any character device passes the check).
fn driver_root(with_library: bool, with_imex: bool) -> std::io::Result<tempfile::TempDir> {
    let root = tempfile::tempdir()?;
    if with_library {
        let dir = root.path().join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&dir)?;
        std::os::unix::fs::symlink(support::fake_nvml_lib(), dir.join("libnvidia-ml.so.1"))?;
    }
    if with_imex {
        let dir = root.path().join("dev/nvidia-caps-imex-channels");
        std::fs::create_dir_all(&dir)?;
        std::os::unix::fs::symlink("/dev/null", dir.join("channel0"))?;
    }
    Ok(root)
}

#[tokio::test]
async fn nvml_is_loaded_from_the_driver_root_mounted_in_the_container() -> TestResult {
    let root = driver_root(true, false)?;
    let dir = tempfile::tempdir()?;
    let kubelet = FakeKubelet::start(dir.path()).await?;
    // No --nvml-lib and nothing on the loader's path: the library is found only under the driver root.
    let plugin = PluginProcess::spawn_with_env(
        dir.path(),
        &[],
        &[("CONTAINER_DRIVER_ROOT", root.path().as_os_str())],
    );
    let list = kubelet
        .wait_list("the fake's GPUs", WAIT, |l| l.allocatable() > 0)
        .await
        .map_err(|e| format!("{e}\n{}", plugin.log()))?;
    // The fake library's default node: four GPUs, watched through NVML.
    assert_eq!(list.allocatable(), 4, "{}", plugin.log());
    assert!(
        plugin.log().contains(&*root.path().to_string_lossy()),
        "the log names the library it loaded:\n{}",
        plugin.log()
    );
    Ok(())
}

#[tokio::test]
async fn an_imex_channel_from_nvidias_variables_reaches_every_container() -> TestResult {
    let root = driver_root(false, true)?;
    let dir = tempfile::tempdir()?;
    let kubelet = FakeKubelet::start(dir.path()).await?;
    let envs: [(&str, &OsStr); 3] = [
        ("IMEX_CHANNEL_IDS", OsStr::new("0")),
        ("IMEX_REQUIRED", OsStr::new("true")),
        ("DRIVER_ROOT_CTR_PATH", root.path().as_os_str()),
    ];
    let plugin = PluginProcess::spawn_with_env(dir.path(), &["--simulate", "2"], &envs);
    kubelet
        .wait_list("the first list", WAIT, |l| l.allocatable() == 2)
        .await
        .map_err(|e| format!("{e}\n{}", plugin.log()))?;
    let response = kubelet
        .allocate(&[&[&simulated_uuid(0)], &[&simulated_uuid(1)]])
        .await?;
    for container in &response.container_responses {
        assert_eq!(
            container
                .envs
                .get("NVIDIA_IMEX_CHANNELS")
                .map(String::as_str),
            Some("0")
        );
    }
    Ok(())
}

#[test]
fn a_required_imex_channel_that_is_missing_refuses_the_start_in_one_line() -> TestResult {
    let root = driver_root(false, false)?;
    let state = tempfile::tempdir()?;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"))
        .args([
            "--simulate",
            "1",
            "--imex-channel-ids",
            "0",
            "--imex-required",
        ])
        .arg("--state-dir")
        .arg(state.path())
        .env("DRIVER_ROOT_CTR_PATH", root.path())
        .env_remove("RUST_LOG")
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("IMEX channel") && stderr.contains("channel0"),
        "{stderr}"
    );
    Ok(())
}

#[tokio::test]
async fn nvidias_cdi_generation_variables_are_accepted_with_one_warning_each() -> TestResult {
    let dir = tempfile::tempdir()?;
    let kubelet = FakeKubelet::start(dir.path()).await?;
    let envs: [(&str, &OsStr); 4] = [
        ("NVIDIA_CTK_PATH", OsStr::new("/usr/bin/nvidia-ctk")),
        ("CDI_FEATURE_FLAGS", OsStr::new("a,b")),
        ("CDI_DISABLE_HOOKS", OsStr::new("all")),
        ("DEVICE_LIST_STRATEGY", OsStr::new("envvar,volume-mounts")),
    ];
    let plugin = PluginProcess::spawn_with_env(dir.path(), &["--simulate", "1"], &envs);
    kubelet
        .wait_list("the first list", WAIT, |l| l.allocatable() == 1)
        .await
        .map_err(|e| format!("{e}\n{}", plugin.log()))?;
    let log = plugin.log();
    for setting in [
        "--nvidia-cdi-hook-path",
        "--cdi-feature-flags",
        "--cdi-disable-hooks",
    ] {
        let said: Vec<&str> = log.lines().filter(|l| l.contains(setting)).collect();
        assert_eq!(said.len(), 1, "{setting}:\n{log}");
        assert!(said[0].contains("no effect here"), "{}", said[0]);
    }
    Ok(())
}
