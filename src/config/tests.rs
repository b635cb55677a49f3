//! The settings' tests: flags, the environment, the config file and `check-config`, as a start reads them.

#[test]
fn config_files_nested_too_deep_or_too_large_are_refused_before_parsing()
-> Result<(), Box<dyn std::error::Error>> {
    use super::{MAX_CONFIG_BYTES, MAX_FLOW_DEPTH, load_file, too_deep};
    assert_eq!(too_deep("a: [1, {b: [2]}]\n", MAX_FLOW_DEPTH), None);
    assert_eq!(too_deep("a: \"[[[[\"\nb: '[[[''[['\n# [[[[\n", 2), None);
    assert_eq!(too_deep("a: 1\nb: [[[\n", 2), Some(2));
    let dir = tempfile::tempdir()?;
    let deep = dir.path().join("deep.yaml");
    let nested = 20_000;
    std::fs::write(&deep, "{a: ".repeat(nested) + &"}".repeat(nested))?;
    let started = std::time::Instant::now();
    let e = load_file(&deep)
        .err()
        .ok_or("a deep file loads")?
        .to_string();
    assert!(e.contains("more than 32 deep (line 1)"), "{e}");
    // Refused without parsing (the parser took seconds on this file); a generous bound.
    assert!(started.elapsed() < std::time::Duration::from_secs(1));
    let large = dir.path().join("large.yaml");
    let line = "# padding\n";
    std::fs::write(
        &large,
        line.repeat(usize::try_from(MAX_CONFIG_BYTES)? / line.len() + 1),
    )?;
    let e = load_file(&large)
        .err()
        .ok_or("a large file loads")?
        .to_string();
    assert!(e.contains("larger than 1048576 bytes"), "{e}");
    let fifo = dir.path().join("fifo.yaml");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status()?;
    assert!(made.success());
    let e = load_file(&fifo).err().ok_or("a FIFO loads")?.to_string();
    assert!(e.contains("not a regular file"), "{e}");
    Ok(())
}

use super::*;
use clap::CommandFactory;

#[test]
fn nvidias_files_no_yaml_reader_takes_are_refused_with_the_yaml_1_1_readers_reason() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    for (yaml, reason) in [
        ("version: v1\n~: x\n", "a mapping key is null"),
        (
            "version: v1\nflags:\n  [a]: b\n",
            "a mapping key is a list or mapping",
        ),
        ("version: v1\nflags: {migStrategy: none\n", "line 2"),
        (
            "\"version\": v1\nflags:\n  migStrategy: none\n  migStrategy: none\n",
            "given twice",
        ),
    ] {
        let file = dir.path().join("config.yaml");
        std::fs::write(&file, yaml).unwrap_or_else(|e| panic!("{e}"));
        let e = load_file(&file)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(!e.contains("unknown field"), "{yaml:?}: {e}");
        assert!(e.contains(reason), "{yaml:?}: {e}");
    }
}

fn settings(argv: &[&str]) -> Result<Settings, String> {
    let argv = std::iter::once("gpu-device-plugin").chain(argv.iter().copied());
    match Settings::from_args(argv) {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(e.to_string()),
        Err(e) => Err(e.to_string()),
    }
}

#[test]
fn every_nvidia_flag_is_accepted_and_applied_or_warned_about() -> Result<(), String> {
    let s = settings(&[
        "--nvidia-driver-root",
        "/run/nvidia/driver",
        "--nvidia-cdi-hook-path",
        "/usr/bin/nvidia-cdi-hook",
        "--nvidia-ctk-path",
        "/usr/bin/nvidia-ctk",
        "--container-driver-root",
        "/nonexistent-driver-root",
        "--imex-channel-ids",
        "0",
        "--imex-required=false",
        "--kubelet-socket",
        "/var/lib/kubelet/device-plugins/kubelet.sock",
        "--cdi-feature-flags",
        "a,b",
        "--cdi-disable-hooks",
        "all",
        "--device-list-strategy",
        "envvar",
        "--device-list-strategy",
        "volume-mounts",
        "--mig-strategy",
        "mixed",
        "--mig-strategy",
        "none",
    ])?;
    // The driver root is the dev root's default: device specs' host paths are under it.
    assert_eq!(s.allocate.dev_root, PathBuf::from("/run/nvidia/driver"));
    // The flag given twice adds up (a list) or takes the last value.
    assert!(s.allocate.envvar && s.allocate.volume_mounts);
    assert_eq!(s.nvml.mig_strategy, crate::devices::mig::MigStrategy::None);
    assert_eq!(
        s.kubelet_dir,
        PathBuf::from("/var/lib/kubelet/device-plugins")
    );
    // No IMEX device node on this machine, not required: left out, said once.
    assert!(s.allocate.imex_channels.is_empty());
    for said in [
        "--nvidia-cdi-hook-path",
        "--cdi-feature-flags",
        "--cdi-disable-hooks",
        "IMEX channel 0",
    ] {
        assert_eq!(
            s.warnings.iter().filter(|w| w.contains(said)).count(),
            1,
            "{said}: {:?}",
            s.warnings
        );
    }
    let dev = settings(&[
        "--driver-root",
        "/run/nvidia/driver",
        "--nvidia-dev-root",
        "/",
    ])?;
    assert_eq!(dev.allocate.dev_root, PathBuf::from("/"));
    Ok(())
}

#[test]
fn dash_v_prints_the_version_as_nvidias_plugin_does() {
    for flag in ["-v", "-V", "--version"] {
        let kind = Args::try_parse_from(["gpu-device-plugin", flag])
            .err()
            .map(|e| e.kind());
        assert_eq!(kind, Some(clap::error::ErrorKind::DisplayVersion), "{flag}");
    }
}

#[test]
fn the_kubelet_socket_names_the_kubelet_directory_or_is_refused_with_the_reason() {
    let s = settings(&[
        "--kubelet-socket",
        "/var/lib/k0s/kubelet/device-plugins/kubelet.sock",
    ]);
    assert_eq!(
        s.map(|s| s.kubelet_dir),
        Ok(PathBuf::from("/var/lib/k0s/kubelet/device-plugins"))
    );
    for (argv, says) in [
        (vec!["--kubelet-socket", ""], "never registers"),
        (
            vec!["--kubelet-socket", "/run/other.sock"],
            "ending in kubelet.sock",
        ),
        (vec!["--kubelet-socket", "kubelet.sock"], "absolute path"),
        (
            vec!["--kubelet-socket", "/a/kubelet.sock", "--kubelet-dir", "/b"],
            "not in the kubelet directory",
        ),
    ] {
        let e = settings(&argv).err().unwrap_or_default();
        assert!(
            e.contains(says) && e.contains("--kubelet-socket"),
            "{argv:?}: {e}"
        );
    }
}

#[test]
fn imex_channel_0_is_found_under_the_container_driver_root_or_refused_when_required()
-> Result<(), Box<dyn std::error::Error>> {
    let root = tempfile::tempdir()?;
    let ctr_root = root.path().to_string_lossy().into_owned();
    let required = [
        "--imex-channel-ids",
        "0",
        "--imex-required",
        "--container-driver-root",
    ];
    let e = settings(&[&required[..], &[&ctr_root]].concat())
        .err()
        .unwrap_or_default();
    assert!(e.contains("IMEX channel") && e.contains("required"), "{e}");
    assert!(
        e.contains(&format!(
            "{ctr_root}/dev/nvidia-caps-imex-channels/channel0"
        )),
        "{e}"
    );
    // The channel's device node (any character device will do for the check).
    let channels = root.path().join("dev/nvidia-caps-imex-channels");
    std::fs::create_dir_all(&channels)?;
    std::os::unix::fs::symlink("/dev/null", channels.join("channel0"))?;
    let s = settings(&[&required[..], &[&ctr_root]].concat())?;
    assert_eq!(s.allocate.imex_channels, vec![0]);
    // A regular file is not a device node.
    std::fs::remove_file(channels.join("channel0"))?;
    std::fs::write(channels.join("channel0"), "")?;
    assert!(settings(&[&required[..], &[&ctr_root]].concat()).is_err());
    for bad in ["1", "x", "0,1"] {
        let e = settings(&["--imex-channel-ids", bad])
            .err()
            .unwrap_or_default();
        assert!(e.contains("--imex-channel-ids"), "{bad}: {e}");
    }
    Ok(())
}

#[test]
fn nvml_is_loaded_from_under_the_container_driver_root_unless_a_library_is_given()
-> Result<(), Box<dyn std::error::Error>> {
    let root = tempfile::tempdir()?;
    let lib_dir = root.path().join("usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib_dir)?;
    std::fs::write(lib_dir.join("libnvidia-ml.so.1"), "")?;
    let ctr_root = root.path().to_string_lossy().into_owned();
    let s = settings(&["--driver-root-ctr-path", &ctr_root])?;
    assert_eq!(s.nvml.library, lib_dir.join("libnvidia-ml.so.1"));
    let s = settings(&[
        "--driver-root-ctr-path",
        &ctr_root,
        "--nvml-lib",
        "/x/libnvidia-ml.so.1",
    ])?;
    assert_eq!(s.nvml.library, PathBuf::from("/x/libnvidia-ml.so.1"));
    // Nothing there: the dynamic loader's search, as before.
    let s = settings(&["--driver-root-ctr-path", "/nonexistent-driver-root"])?;
    assert_eq!(s.nvml.library, PathBuf::from("libnvidia-ml.so.1"));
    assert!(settings(&["--driver-root", "run/nvidia/driver"]).is_err());
    Ok(())
}

#[test]
fn defaults_match_the_cli_contract() {
    let s = settings(&[]).map_err(|e| e.to_string());
    let s = s.as_ref().map(|s| {
        (
            s.kubelet_dir.clone(),
            s.resource_name.clone(),
            s.state_dir.clone(),
        )
    });
    assert_eq!(
        s,
        Ok((
            DEFAULT_KUBELET_DIR.into(),
            DEFAULT_RESOURCE_NAME.into(),
            DEFAULT_STATE_DIR.into()
        ))
    );
}

#[test]
fn extended_resource_names_are_checked() {
    for good in ["nvidia.com/gpu", "example.com/a_b.c-1", "x/y"] {
        assert!(check_extended_resource_name(good).is_ok(), "{good}");
    }
    for bad in [
        "gpu",
        "kubernetes.io/gpu",
        "foo.kubernetes.io/gpu",
        "Nvidia.com/gpu",
        "nvidia.com/",
        "a/b/c",
        "/gpu",
    ] {
        assert!(check_extended_resource_name(bad).is_err(), "{bad}");
    }
}

#[test]
fn config_file_fills_in_what_flags_leave_out() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("c.yaml");
    std::fs::write(
        &file,
        "resourceName: example.com/gpu\ncdi: true\nkubeletDir: /from/file\n",
    )?;
    let file = file.to_string_lossy().into_owned();
    let s = settings(&["--config", &file, "--kubelet-dir", "/from/flag"])?;
    assert_eq!(s.resource_name, "example.com/gpu");
    assert!(s.allocate.cdi);
    assert_eq!(s.kubelet_dir, PathBuf::from("/from/flag"));
    Ok(())
}

#[test]
fn unknown_config_key_is_named_in_the_error() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("c.yaml");
    std::fs::write(&file, "resourceNmae: example.com/gpu\n")?;
    let err = settings(&["--config", &file.to_string_lossy()])
        .err()
        .unwrap_or_default();
    assert!(err.contains("resourceNmae"), "{err}");
    Ok(())
}

#[test]
fn dev_root_comes_from_nvidias_variable_and_host_root_is_separate() {
    let s = settings(&["--dev-root", "/run/nvidia/driver", "--host-root", "/host"]);
    let roots = s.map(|s| (s.allocate.dev_root, s.allocate.host_root));
    assert_eq!(
        roots,
        Ok((PathBuf::from("/run/nvidia/driver"), PathBuf::from("/host")))
    );
    let err = settings(&["--host-root", "host"]).err().unwrap_or_default();
    assert!(
        err.contains("--host-root") && err.contains("absolute"),
        "{err}"
    );
    let flag = Args::command()
        .get_arguments()
        .find(|a| a.get_id() == "dev_root")
        .and_then(|a| a.get_env().map(|e| e.to_string_lossy().into_owned()));
    assert_eq!(flag.as_deref(), Some("NVIDIA_DEV_ROOT"));
}

#[test]
fn the_http_address_defaults_to_loopback_and_can_be_turned_off() {
    let addr = |argv: &[&str]| settings(argv).map(|s| s.http_addr.map(|a| a.to_string()));
    assert_eq!(addr(&[]), Ok(Some("127.0.0.1:9412".into())));
    assert_eq!(addr(&["--http-addr", ""]), Ok(None));
    assert_eq!(
        addr(&["--http-addr", "0.0.0.0:8080"]),
        Ok(Some("0.0.0.0:8080".into()))
    );
    let err = addr(&["--http-addr", "localhost"])
        .err()
        .unwrap_or_default();
    assert!(err.contains("--http-addr"), "{err}");
}

#[test]
fn dra_is_off_by_default_and_refused_without_what_it_needs() {
    let off = settings(&["--node-name", "gpu-7"]).map(|s| s.dra);
    assert_eq!(off, Ok(None));
    let on = settings(&["--dra", "all", "--node-name", "gpu-7"]).map(|s| s.dra);
    assert_eq!(
        on,
        Ok(Some(DraSettings {
            gpus: crate::devices::selection::DraSelection::All,
            driver: "gpu.nvidia.com".into(),
            registry_dir: PathBuf::from("/var/lib/kubelet/plugins_registry"),
            plugins_dir: PathBuf::from("/var/lib/kubelet/plugins"),
            pod_uid: None,
        }))
    );
    let named = settings(&[
        "--dra",
        "all",
        "--node-name",
        "gpu-7",
        "--dra-pod-uid",
        "6b1e52a0-3c4d-4e5f-8a9b-0c1d2e3f4a5b",
    ])
    .map(|s| s.dra.and_then(|d| d.pod_uid));
    assert_eq!(
        named,
        Ok(Some("6b1e52a0-3c4d-4e5f-8a9b-0c1d2e3f4a5b".into()))
    );
    let refused = |argv: &[&str], says: &str| {
        let why = settings(argv).map(|_| ()).expect_err("refused");
        assert!(why.contains(says), "{argv:?}: {why}");
    };
    refused(&["--dra", "all", "--node-name", ""], "NODE_NAME");
    for bad in [
        "../x",
        "node/../../x",
        "Node-A",
        "a..b",
        "-a",
        &"a".repeat(254),
    ] {
        refused(&[&format!("--node-name={bad}")], "--node-name (NODE_NAME)");
    }
    assert!(settings(&["--node-name", "gpu-7.zone-b.example"]).is_ok());
    refused(
        &[
            "--dra",
            "all",
            "--node-name",
            "n",
            "--dra-pod-uid",
            "../../etc",
        ],
        "--dra-pod-uid",
    );
    refused(
        &["--dra", "0,1", "--node-name", "n", "--kube-api=false"],
        "needs the Kubernetes API",
    );
    refused(&["--dra", "0:1", "--node-name", "n"], "MIG device");
    refused(
        &[
            "--dra",
            "all",
            "--node-name",
            "n",
            "--dra-driver-name",
            "GPU_driver",
        ],
        "DNS subdomain",
    );
    refused(
        &[
            "--dra",
            "all",
            "--node-name",
            "n",
            "--kubelet-plugins-directory-path",
            "plugins",
        ],
        "absolute",
    );
}

#[test]
fn dra_comes_from_the_config_file_too_and_check_config_says_it()
-> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("c.yaml");
    std::fs::write(
        &file,
        "dra: \"1,GPU-abc\"\ndraDriverName: gpu.example.com\nkubeletRegistrarDirectoryPath: /reg\n",
    )?;
    let file = file.to_string_lossy().into_owned();
    let s = settings(&["--config", &file, "--node-name", "n"])?;
    let dra = s.dra.clone().ok_or("DRA on")?;
    assert_eq!(
        dra.gpus,
        crate::devices::selection::DraSelection::Gpus(vec!["1".into(), "GPU-abc".into()])
    );
    assert_eq!(dra.driver, "gpu.example.com");
    assert_eq!(dra.registry_dir, PathBuf::from("/reg"));
    assert!(
        s.describe().contains(
            "DRA: GPUs 1, GPU-abc as driver gpu.example.com (registration in /reg, sockets in /var/lib/kubelet/plugins)"
        ),
        "{}",
        s.describe()
    );
    Ok(())
}

#[test]
fn the_api_roads_can_each_be_turned_off_and_an_empty_value_means_off() {
    let s = settings(&[
        "--pod-resources-socket",
        "",
        "--kubeconfig",
        "",
        "--kube-api=false",
        "--node-name",
        "gpu-7",
    ]);
    let s = s.as_ref().map(|s| (&s.pod_resources_socket, &s.cluster));
    assert_eq!(
        s.map(|(pods, cluster)| (pods.clone(), cluster.enabled, cluster.kubeconfig.clone())),
        Ok((None, false, None))
    );
    assert_eq!(
        s.map(|(_, c)| c.node_name.clone()),
        Ok(Some("gpu-7".into()))
    );
    let pods =
        settings(&["--pod-resources-socket", "/run/pr.sock"]).map(|s| s.pod_resources_socket);
    assert_eq!(pods, Ok(Some(PathBuf::from("/run/pr.sock"))));
}

#[test]
fn unwritable_state_dir_is_reported() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let blocker = dir.path().join("file");
    std::fs::write(&blocker, b"")?;
    let err = prepare_state_dir(&blocker.join("state"))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("--state-dir"), "{err}");
    // A state directory that is a file says so, naming the file.
    for path in [blocker.clone(), blocker.join("state")] {
        let err = prepare_state_dir(&path)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains(&format!("{} is a file, not a directory", blocker.display())),
            "{err}"
        );
    }
    Ok(())
}

#[test]
fn our_boolean_settings_read_booleans_as_nvidias_do() {
    for (value, want) in [
        ("1", true),
        ("t", true),
        ("TRUE", true),
        ("0", false),
        ("False", false),
    ] {
        let s = settings(&[&format!("--cdi={value}"), "--kube-api", value]);
        assert_eq!(
            s.map(|s| (s.allocate.cdi, s.cluster.enabled)),
            Ok((want, want)),
            "{value}"
        );
    }
    assert!(settings(&["--cdi=yes"]).is_err());
}

mod readme_tests {
    use super::*;

    /// The health config example in the README is what operators copy: it must load as written.
    #[test]
    fn the_readme_health_config_example_loads() -> Result<(), Box<dyn std::error::Error>> {
        let readme = include_str!("../../README.md");
        let start = readme
            .find("```yaml\nhealth:")
            .ok_or("no health example in README.md")?
            + "```yaml\n".len();
        let end = start + readme[start..].find("```").ok_or("unterminated example")?;
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("config.yaml");
        std::fs::write(&file, &readme[start..end])?;
        let argv = [
            "gpu-device-plugin",
            "--config",
            file.to_str().ok_or("path")?,
        ];
        let settings = Settings::from_args(argv)??;
        let policy = &settings.monitor.policy;
        assert_eq!(policy.quiet_period, std::time::Duration::from_secs(600));
        assert_eq!(
            policy.recover(&crate::health::ConditionKind::Xid(79)),
            crate::health::Recover::Never
        );
        Ok(())
    }
}
