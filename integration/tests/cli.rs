//! The command line contract: bad input is one clear line on stderr and a non-zero exit, never a panic.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::{Command, Output};

fn run(args: &[&str], envs: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"))
        .args(args)
        .envs(envs.iter().copied())
        .env_remove("RUST_LOG")
        .output()
        .expect("run gpu-device-plugin")
}

/// Asserts a failed run printed exactly one line on stderr containing every `needles` and no panic.
fn assert_one_line_error(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure, got {:?}; stderr: {stderr}",
        out.status
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    let lines: Vec<_> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {stderr}");
    for needle in needles {
        assert!(
            lines[0].contains(needle),
            "{needle:?} not in {:?}",
            lines[0]
        );
    }
}

fn state_arg(dir: &tempfile::TempDir) -> String {
    dir.path().join("state").to_string_lossy().into_owned()
}

#[test]
fn unknown_flag_is_one_line_and_a_non_zero_exit() {
    let out = run(&["--no-such-flag"], &[]);
    assert_one_line_error(&out, &["--no-such-flag"]);
}

#[test]
fn a_mistyped_flag_is_answered_with_the_flag_meant() {
    let out = run(&["--kubelet-dri", "/x"], &[]);
    assert_one_line_error(&out, &["--kubelet-dri", "did you mean --kubelet-dir?"]);
}

#[test]
fn non_extended_resource_name_is_refused_naming_it() {
    let out = run(&["--resource-name", "gpu", "--simulate", "1"], &[]);
    assert_one_line_error(&out, &["--resource-name", "\"gpu\""]);
    let out = run(&["--resource-name", "kubernetes.io/gpu"], &[]);
    assert_one_line_error(&out, &["kubernetes.io"]);
}

#[test]
fn settings_come_from_environment_variables_too() {
    let out = run(&[], &[("GPU_DEVICE_PLUGIN_RESOURCE_NAME", "not-extended")]);
    assert_one_line_error(&out, &["not-extended"]);
    let out = run(&[], &[("GPU_DEVICE_PLUGIN_LOG_FORMAT", "xml")]);
    assert_one_line_error(&out, &["xml"]);
}

#[test]
fn a_bad_value_from_an_environment_variable_names_the_variable() {
    let out = run(&[], &[("GPU_DEVICE_PLUGIN_FAIL_ON_INIT_ERROR", "")]);
    assert_one_line_error(&out, &["GPU_DEVICE_PLUGIN_FAIL_ON_INIT_ERROR"]);
    let out = run(&[], &[("GPU_DEVICE_PLUGIN_STUCK_AFTER", "")]);
    assert_one_line_error(
        &out,
        &["environment variable GPU_DEVICE_PLUGIN_STUCK_AFTER"],
    );
    let out = run(&[], &[("PASS_DEVICE_SPECS", "maybe")]);
    assert_one_line_error(
        &out,
        &["\"maybe\"", "environment variable PASS_DEVICE_SPECS"],
    );
    // The flag wins over the variable, and the error is about the flag.
    let out = run(
        &["--stuck-after", ""],
        &[("GPU_DEVICE_PLUGIN_STUCK_AFTER", "10s")],
    );
    assert_one_line_error(&out, &["--stuck-after"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("environment variable"), "{stderr}");
}

#[test]
fn unwritable_state_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"").unwrap();
    let state = file.join("state").to_string_lossy().into_owned();
    let out = run(
        &[
            "--simulate",
            "1",
            "--state-dir",
            &state,
            "--kubelet-dir",
            "/",
        ],
        &[],
    );
    assert_one_line_error(&out, &["--state-dir", &state]);
}

#[test]
fn missing_kubelet_dir_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir
        .path()
        .join("device-plugins")
        .to_string_lossy()
        .into_owned();
    let out = run(
        &[
            "--simulate",
            "1",
            "--kubelet-dir",
            &missing,
            "--state-dir",
            &state_arg(&dir),
        ],
        &[],
    );
    assert_one_line_error(&out, &[&missing, "does not exist"]);
}

#[test]
fn kubelet_dir_too_long_for_a_socket_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let long = dir.path().join("d".repeat(90));
    std::fs::create_dir(&long).unwrap();
    let long = long.to_string_lossy().into_owned();
    let out = run(
        &[
            "--simulate",
            "1",
            "--kubelet-dir",
            &long,
            "--state-dir",
            &state_arg(&dir),
        ],
        &[],
    );
    assert_one_line_error(&out, &["107-byte"]);
}

#[test]
fn unwritable_kubelet_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = dir.path().join("device-plugins");
    std::fs::create_dir(&kubelet).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&kubelet, std::fs::Permissions::from_mode(0o500)).unwrap();
    // root ignores directory permissions; the check only means something for an unprivileged user.
    if std::fs::write(kubelet.join("probe"), b"").is_ok() {
        eprintln!("skipped: running as root, directory permissions are not enforced");
        return;
    }
    let kubelet = kubelet.to_string_lossy().into_owned();
    let out = run(
        &[
            "--simulate",
            "1",
            "--kubelet-dir",
            &kubelet,
            "--state-dir",
            &state_arg(&dir),
        ],
        &[],
    );
    assert_one_line_error(&out, &["cannot bind", &kubelet]);
}

#[test]
fn unknown_config_key_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, "resourceName: nvidia.com/gpu\nsimulat: 3\n").unwrap();
    let out = run(&["--config", &config.to_string_lossy()], &[]);
    assert_one_line_error(&out, &["simulat", "config.yaml"]);
}

#[test]
fn a_duration_too_long_to_count_with_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    for key in ["quietPeriod", "probeInterval", "recoveryActionInterval"] {
        // Near u64::MAX seconds: once a panic deep in the health monitor, which then watched nothing.
        std::fs::write(
            &config,
            format!("simulate: 1\nhealth:\n  {key}: 18446744073709551615s\n"),
        )
        .unwrap();
        let out = run(&["--config", &config.to_string_lossy()], &[]);
        assert_one_line_error(&out, &[&format!("health.{key}"), "at most 30days"]);
    }
    std::fs::write(
        &config,
        "simulate: 1\nhealth:\n  sbeBurst: {count: 3, window: 400days}\n",
    )
    .unwrap();
    let out = run(&["--config", &config.to_string_lossy()], &[]);
    assert_one_line_error(&out, &["health.sbeBurst.window", "at most 30days"]);
    let out = run(&["--simulate", "1", "--stuck-after", "1000000h"], &[]);
    assert_one_line_error(&out, &["--stuck-after", "at most 30days"]);
}

#[test]
fn a_kubelet_dir_that_is_a_file_is_reported_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("device-plugins");
    std::fs::write(&file, "").unwrap();
    let out = run(
        &[
            "--simulate",
            "1",
            "--kubelet-dir",
            &file.to_string_lossy(),
            "--state-dir",
            &dir.path().join("state").to_string_lossy(),
        ],
        &[],
    );
    assert_one_line_error(&out, &["is not a directory", &file.to_string_lossy()]);
}

#[test]
fn a_fault_script_without_simulated_gpus_is_refused() {
    let out = run(&["--simulate-events", "/tmp/faults"], &[]);
    assert_one_line_error(&out, &["--simulate-events", "--simulate N"]);
}

#[test]
fn nvidias_settings_not_supported_yet_are_refused_by_name_from_flag_env_or_file() {
    let dir = tempfile::tempdir().unwrap();
    let state = state_arg(&dir);
    // A kubelet directory that does not exist: a setting accepted by mistake ends the run with another
    // error instead of serving.
    let missing = dir.path().join("no-kubelet-dir");
    let missing = missing.to_str().unwrap();
    let base = [
        "--simulate",
        "1",
        "--state-dir",
        state.as_str(),
        "--kubelet-dir",
        missing,
    ];
    let out = run(&[&base[..], &["--mig-strategy", "many"]].concat(), &[]);
    assert_one_line_error(&out, &["migStrategy", "many", "none, single or mixed"]);
    let out = run(&base, &[("NVIDIA_DRIVER_ROOT", "run/nvidia/driver")]);
    assert_one_line_error(&out, &["nvidiaDriverRoot", "run/nvidia/driver", "absolute"]);
    let out = run(
        &base,
        &[
            ("DEVICE_LIST_STRATEGY", "cdi-annotations"),
            ("CDI_ANNOTATION_PREFIX", "Not A Domain"),
        ],
    );
    assert_one_line_error(&out, &["cdiAnnotationPrefix", "Not A Domain"]);
    let out = run(&base, &[("FAIL_ON_INIT_ERROR", "perhaps")]);
    assert_one_line_error(&out, &["FAIL_ON_INIT_ERROR", "perhaps"]);
    let config = dir.path().join("nvidia.yaml");
    std::fs::write(
        &config,
        "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n",
    )
    .unwrap();
    let out = run(&base, &[("CONFIG_FILE", config.to_str().unwrap())]);
    assert_one_line_error(&out, &["mpsRoot", "MPS control daemon"]);
    std::fs::write(
        &config,
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n      replicas: 4\n      devices: [0, first]\n",
    )
    .unwrap();
    let out = run(&base, &[("CONFIG_FILE", config.to_str().unwrap())]);
    assert_one_line_error(
        &out,
        &["sharing.timeSlicing.resources[0].devices", "\"first\""],
    );
}

/// Starts the plugin on `gpus` simulated GPUs with NVIDIA's config file `yaml`, expecting it to stop before it
/// registers: its last stderr line, and the sockets left in the kubelet directory.
fn refused_at_start(gpus: &str, yaml: &str) -> (String, usize) {
    let dir = tempfile::tempdir().unwrap();
    let kubelet_dir = dir.path().join("device-plugins");
    std::fs::create_dir(&kubelet_dir).unwrap();
    let config = dir.path().join("nvidia.yaml");
    std::fs::write(&config, yaml).unwrap();
    let out = run(
        &[
            "--simulate",
            gpus,
            "--http-addr",
            "",
            "--kubelet-dir",
            kubelet_dir.to_str().unwrap(),
            "--state-dir",
            dir.path().join("state").to_str().unwrap(),
            "--config-file",
            config.to_str().unwrap(),
        ],
        &[],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    let sockets = std::fs::read_dir(&kubelet_dir).unwrap().count();
    (
        stderr.lines().last().unwrap_or_default().to_string(),
        sockets,
    )
}

#[test]
fn a_device_list_larger_than_the_kubelet_accepts_stops_the_plugin_before_it_registers() {
    // 80 GPUs with 1024 replicas each: 81 920 devices, about 5 MB encoded.
    let (last, sockets) = refused_at_start(
        "80",
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 1024\n",
    );
    assert!(
        last.contains("the device list of nvidia.com/gpu is")
            && last.contains("(81920 devices), more than the 4194304 bytes the kubelet accepts"),
        "{last}"
    );
    assert_eq!(sockets, 0, "no socket left behind");
}

#[test]
fn check_config_prints_the_effective_settings_and_plans_sharing_on_simulated_gpus() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.yaml");
    std::fs::write(
        &file,
        "version: v1\nflags:\n  gfd:\n    oneshot: true\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n",
    )
    .unwrap();
    let state = dir.path().join("state");
    let state = state.to_str().unwrap();
    let file = file.to_str().unwrap();
    let out = run(
        &[
            "check-config",
            file,
            "--simulate",
            "2",
            "--state-dir",
            state,
        ],
        &[],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "sharing: time-slicing: nvidia.com/gpu × 4 replicas (all devices)",
        "serves nvidia.com/gpu: 2 devices, 8 listed to the kubelet",
        "warning: config key flags.gfd",
    ] {
        assert!(stdout.contains(line), "{line:?} not in:\n{stdout}");
    }
    // A check starts nothing and touches no GPU: no state directory, no NVML without --nvml-lib.
    assert!(!std::path::Path::new(state).exists());
    let out = run(&["check-config", file, "--state-dir", state], &[]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("no GPUs looked at"));
}

#[test]
fn check_config_refuses_what_a_start_would_refuse_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.yaml");
    std::fs::write(&file, "version: v1\nflags:\n  migStrategy: sideways\n").unwrap();
    let out = run(&["check-config", file.to_str().unwrap()], &[]);
    assert_one_line_error(&out, &["sideways"]);
    let out = run(&["check-config", "--resource-name", "gpu"], &[]);
    assert_one_line_error(&out, &["--resource-name", "\"gpu\""]);
}

#[test]
fn help_groups_the_flags_by_role_and_names_every_subcommand() {
    let out = run(&["--help"], &[]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    let usage: String = help
        .lines()
        .skip_while(|l| !l.starts_with("Usage:"))
        .take_while(|l| !l.is_empty())
        .collect();
    for sub in ["check-config", "status", "fence", "release"] {
        assert!(
            usage.contains(&format!("gpu-device-plugin {sub}")),
            "{sub}: {usage}"
        );
    }
    let at = |text: &str| {
        help.find(text)
            .unwrap_or_else(|| panic!("{text:?} not in --help"))
    };
    // Test-only flags sit apart from the production ones, NVIDIA's under their own heading.
    assert!(at("Testing and trying out:") < at("--simulate <N>"));
    assert!(at("Kubelet:") < at("--kubelet-dir") && at("--kubelet-dir") < at("GPUs and health:"));
    let nvidia = at("NVIDIA's device plugin's flags:");
    for flag in [
        "--imex-channel-ids",
        "--driver-root-ctr-path",
        "--kubelet-socket",
        "--mig-strategy",
    ] {
        assert!(at(flag) > nvidia, "{flag} is not under NVIDIA's heading");
    }
    for sub in ["status", "fence", "release"] {
        let out = run(&[sub, "--help"], &[]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains(&format!("Usage: gpu-device-plugin {sub}")),
            "{text}"
        );
    }
}

#[test]
fn check_config_says_which_gpus_go_through_dra_and_which_through_the_device_plugin() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let state = state.to_str().unwrap();
    let split = run(
        &[
            "check-config",
            "--simulate",
            "3",
            "--dra",
            "1",
            "--node-name",
            "n",
            "--state-dir",
            state,
        ],
        &[],
    );
    let stdout = String::from_utf8_lossy(&split.stdout);
    assert!(
        split.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&split.stderr)
    );
    for line in [
        "DRA: GPU 1 as driver gpu.nvidia.com",
        "serves through DRA as gpu.nvidia.com: 1 devices (gpu-1)",
        "serves nvidia.com/gpu: 2 devices, 2 listed to the kubelet",
    ] {
        assert!(stdout.contains(line), "{line:?} not in:\n{stdout}");
    }
    let all = run(
        &[
            "check-config",
            "--simulate",
            "3",
            "--dra",
            "all",
            "--node-name",
            "n",
            "--state-dir",
            state,
        ],
        &[],
    );
    let stdout = String::from_utf8_lossy(&all.stdout);
    assert!(
        stdout.contains("the device plugin does not register"),
        "{stdout}"
    );
    let missing = run(
        &[
            "check-config",
            "--simulate",
            "3",
            "--dra",
            "5",
            "--node-name",
            "n",
            "--state-dir",
            state,
        ],
        &[],
    );
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("GPU 5"));
}

#[test]
fn check_config_shows_outside_keys_and_values_escaped_one_line_each() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.yaml");
    // NVIDIA's format warns about a key it does not know: this one holds an escape and a right-to-left
    // override.
    std::fs::write(
        &file,
        "version: v1\nflags:\n  \"mig\\e[31m\\u202Eevil\": x\n",
    )
    .unwrap();
    let state = state_arg(&dir);
    let out = run(
        &[
            "check-config",
            file.to_str().unwrap(),
            "--state-dir",
            &state,
        ],
        &[
            ("NVIDIA_DRIVER_ROOT", "/run/nvidia\nforged: line"),
            ("PASS_DEVICE_SPECS", "true"),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !stdout.contains('\u{1b}') && !stdout.contains('\u{202E}'),
        "{stdout}"
    );
    assert!(
        !stdout.lines().any(|l| l.starts_with("forged")),
        "a line forged:\n{stdout}"
    );
    for shown in ["mig\\u{1b}[31m\\u{202e}evil", "/run/nvidia\\nforged: line"] {
        assert!(stdout.contains(shown), "{shown:?} not in:\n{stdout}");
    }
}

#[test]
fn a_megabyte_config_value_is_refused_in_one_short_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.yaml");
    let value = "s".repeat((1 << 20) - 64);
    std::fs::write(
        &file,
        format!("version: v1\nflags:\n  migStrategy: {value}\n"),
    )
    .unwrap();
    let out = run(&["check-config", file.to_str().unwrap()], &[]);
    assert_one_line_error(&out, &["migStrategy", "more bytes)"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.len() < 2048, "{} bytes", stderr.len());
}

#[test]
fn a_node_name_that_is_no_nodes_name_stops_the_start_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let state = state_arg(&dir);
    let out = run(
        &["--simulate", "1", "--state-dir", &state],
        &[("NODE_NAME", "../x")],
    );
    assert_one_line_error(&out, &["NODE_NAME", "\"../x\"", "not a node's name"]);
}

#[test]
fn a_relative_container_driver_root_is_refused_as_a_relative_driver_root_is() {
    let out = run(&["check-config"], &[("NVIDIA_DRIVER_ROOT", "run/nvidia")]);
    assert_one_line_error(&out, &["NVIDIA_DRIVER_ROOT", "absolute"]);
    let out = run(
        &["check-config"],
        &[("CONTAINER_DRIVER_ROOT", "driver-root")],
    );
    assert_one_line_error(
        &out,
        &["CONTAINER_DRIVER_ROOT", "\"driver-root\"", "absolute"],
    );
}
