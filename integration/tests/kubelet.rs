//! The plugin against the fake kubelet over real Unix sockets: registration, device lists, health, Allocate,
//! preferred allocation, kubelet restarts and shutdown, as the kubelet would see them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use fake_kubelet::{DeviceManager, FakeKubelet};
use gpu_device_plugin::api::Empty;
use gpu_device_plugin::api::device_plugin_client::DevicePluginClient;
use gpu_device_plugin::health::Observation;
use gpu_device_plugin::kubelet::STREAM_WAIT;
use gpu_device_plugin::sources::simulated::simulated_uuid;
use gpu_device_plugin::util::uds;
use nix::sys::signal::Signal;
use support::{Node, PluginProcess, TestResult, WAIT, summary};
use tonic::Code;

fn gpu(i: usize) -> String {
    simulated_uuid(i)
}

#[tokio::test]
async fn plugin_registers_and_lists_every_simulated_gpu_healthy() -> TestResult {
    let dir = tempfile::tempdir()?;
    let kubelet = FakeKubelet::start(dir.path()).await?;
    let plugin = PluginProcess::spawn(dir.path(), &["--simulate", "8"]);

    let regs = kubelet
        .wait_registrations(1, WAIT)
        .await
        .map_err(|e| format!("{e}\n{}", plugin.log()))?;
    let reg = &regs[0];
    assert_eq!(reg.resource_name, "nvidia.com/gpu");
    assert!(reg.endpoint.starts_with("gpu-device-plugin-") && reg.endpoint.ends_with(".sock"));
    assert!(reg.dialed_options.get_preferred_allocation_available);
    assert!(reg.dialed_options.pre_start_required);
    assert_eq!(reg.options, Some(reg.dialed_options));
    let socket = dir.path().join(&reg.endpoint);
    assert_eq!(
        std::fs::metadata(&socket)?.permissions().mode() & 0o777,
        0o600
    );

    let list = kubelet
        .wait_list("8 devices", WAIT, |l| l.devices.len() == 8)
        .await?;
    assert_eq!(list.allocatable(), 8);
    let ids: Vec<_> = list.devices.iter().map(|d| d.id.clone()).collect();
    assert_eq!(ids, (0..8).map(gpu).collect::<Vec<_>>());
    let numa: Vec<_> = list
        .devices
        .iter()
        .map(|d| {
            d.topology
                .as_ref()
                .map(|t| t.nodes.iter().map(|n| n.id).collect::<Vec<_>>())
        })
        .collect();
    assert_eq!(numa[0], Some(vec![0]));
    assert_eq!(numa[7], Some(vec![1]));
    Ok(())
}

#[tokio::test]
async fn a_fatal_xid_reaches_the_kubelet_and_a_harmless_one_changes_nothing() -> TestResult {
    let node = Node::start(4).await?;
    let (kubelet, plugin) = (&node.kubelet, &node.plugin);

    // XID 13 is an application fault: recorded, the GPU stays allocatable, no new list.
    plugin.control.observe(&gpu(2), Observation::Xid(13)).await;
    plugin.control.observe(&gpu(2), Observation::Xid(79)).await;
    let list = kubelet
        .wait_list("gpu 2 unhealthy", WAIT, |l| {
            l.health(&gpu(2)) == Some("Unhealthy")
        })
        .await?;
    assert_eq!(list.allocatable(), 3);
    assert_eq!(
        list.messages, 2,
        "the first list and one for XID 79, none for XID 13"
    );
    assert!(kubelet.list().errors.is_empty());
    Ok(())
}

#[tokio::test]
async fn allocate_gives_each_container_its_gpus_with_cdi_and_device_nodes() -> TestResult {
    let dir = tempfile::tempdir()?;
    // The host's root as the plugin's pod sees it, with the device nodes where the GPU operator's driver
    // container puts them on the host.
    let host = tempfile::tempdir()?;
    let dev = host.path().join("run/nvidia/driver/dev");
    std::fs::create_dir_all(&dev)?;
    for node in ["nvidia1", "nvidia2", "nvidiactl"] {
        std::fs::write(dev.join(node), b"")?;
    }
    let kubelet = FakeKubelet::start(dir.path()).await?;
    let host_arg = host.path().to_string_lossy().into_owned();
    let _plugin = PluginProcess::spawn_with_env(
        dir.path(),
        &[
            "--simulate",
            "4",
            "--cdi",
            "--device-specs",
            "--host-root",
            &host_arg,
        ],
        &[(
            "NVIDIA_DEV_ROOT",
            std::ffi::OsStr::new("/run/nvidia/driver"),
        )],
    );
    kubelet.wait_registrations(1, WAIT).await?;

    let (a, b, c) = (gpu(1), gpu(2), gpu(3));
    let response = kubelet.allocate(&[&[&a, &b], &[&c]]).await?;
    let first = &response.container_responses[0];
    assert_eq!(
        first.envs.get("NVIDIA_VISIBLE_DEVICES"),
        Some(&format!("{a},{b}"))
    );
    let cdi: Vec<_> = first.cdi_devices.iter().map(|d| d.name.clone()).collect();
    assert_eq!(
        cdi,
        vec![format!("nvidia.com/gpu={a}"), format!("nvidia.com/gpu={b}")]
    );
    let nodes: Vec<_> = first
        .devices
        .iter()
        .map(|d| d.container_path.clone())
        .collect();
    assert_eq!(
        nodes,
        vec!["/dev/nvidia1", "/dev/nvidia2", "/dev/nvidiactl"]
    );
    // The host path is where the runtime finds the node on the host: under the dev root, not the host root.
    assert_eq!(first.devices[0].host_path, "/run/nvidia/driver/dev/nvidia1");
    let second = &response.container_responses[1];
    assert_eq!(second.envs.get("NVIDIA_VISIBLE_DEVICES"), Some(&c));
    // /dev/nvidia3 does not exist on the host, so only the control node is handed out.
    let nodes: Vec<_> = second
        .devices
        .iter()
        .map(|d| d.container_path.clone())
        .collect();
    assert_eq!(nodes, vec!["/dev/nvidiactl"]);
    Ok(())
}

#[tokio::test]
async fn allocate_rejects_bad_requests_with_codes_that_name_the_device() -> TestResult {
    let node = Node::start(4).await?;
    let kubelet = &node.kubelet;
    let (g0, g1) = (gpu(0), gpu(1));

    let err = kubelet
        .allocate(&[&[&g0, "GPU-not-here"]])
        .await
        .expect_err("unknown id refused");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("GPU-not-here"), "{}", err.message());

    let err = kubelet
        .allocate(&[&[&g0], &[&g0]])
        .await
        .expect_err("duplicate refused");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains(&g0), "{}", err.message());

    let err = kubelet
        .allocate(&[])
        .await
        .expect_err("empty request refused");
    assert_eq!(err.code(), Code::InvalidArgument);

    node.fail(&g1, 48).await?;
    let err = kubelet
        .allocate(&[&[&g0, &g1]])
        .await
        .expect_err("unhealthy refused");
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains(&g1) && err.message().contains("XID 48"),
        "{}",
        err.message()
    );
    // The device and its health once each: `device <id>: Unhealthy: XID 48: ...`.
    assert!(
        err.message()
            .starts_with(&format!("device {g1}: Unhealthy: XID 48")),
        "{}",
        err.message()
    );
    assert_eq!(err.message().matches("Unhealthy").count(), 1);

    // Nothing was lost: the healthy GPU still allocates.
    kubelet.allocate(&[&[&g0]]).await?;
    Ok(())
}

#[tokio::test]
async fn preferred_allocation_avoids_unhealthy_gpus_and_stays_on_one_numa_node() -> TestResult {
    let node = Node::start(8).await?;
    let kubelet = &node.kubelet;
    node.fail(&gpu(1), 79).await?;

    let all: Vec<String> = (0..8).map(gpu).collect();
    let available: Vec<&str> = all.iter().map(String::as_str).collect();
    // NUMA node 0 (GPUs 0-3) has three healthy GPUs: a request for three fits there exactly.
    let chosen = kubelet.preferred_allocation(&available, &[], 3).await?;
    assert_eq!(chosen, vec![gpu(0), gpu(2), gpu(3)]);
    // must_include on node 1 keeps the rest on node 1.
    let chosen = kubelet
        .preferred_allocation(&available, &[&gpu(6)], 2)
        .await?;
    assert_eq!(chosen, vec![gpu(6), gpu(4)]);

    let err = kubelet
        .preferred_allocation(&available, &[], -1)
        .await
        .expect_err("negative size refused");
    assert_eq!(err.code(), Code::InvalidArgument);
    Ok(())
}

#[tokio::test]
async fn kubelet_restart_rebinds_socket_and_registers_again_100_times_keeping_health() -> TestResult
{
    let mut node = Node::start(4).await?;
    node.fail(&gpu(3), 79).await?;
    let (kubelet, dir) = (&mut node.kubelet, node.dir.path());

    let mut latencies = Vec::new();
    for round in 2..=101 {
        let (registered, took) = kubelet
            .restart_and_wait(WAIT)
            .await
            .map_err(|e| format!("restart {}: {e}", round - 1))?;
        latencies.push(took);
        let list = kubelet
            .wait_list("list on the new stream", WAIT, |l| {
                l.registration >= round && l.messages >= 1
            })
            .await?;
        assert_eq!(list.devices.len(), 4);
        assert_eq!(
            list.health(&gpu(3)),
            Some("Unhealthy"),
            "restart {} forgot the fault",
            round - 1
        );
        assert_eq!(list.allocatable(), 3);
        assert!(dir.join(&registered.endpoint).exists());
    }
    // At least one registration per restart. More is allowed: when the kubelet's clean-up of the directory
    // races our re-bind it deletes the new socket too, we bind and register once more, and the newest
    // registration wins, as it does in the kubelet.
    assert!(kubelet.registrations().len() >= 101);
    assert!(
        kubelet.list().errors.is_empty(),
        "{:?}",
        kubelet.list().errors
    );
    eprintln!(
        "kubelet restart -> Register received: {}",
        summary(latencies)
    );
    Ok(())
}

#[tokio::test]
async fn binary_survives_100_kubelet_restarts_in_a_row() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut kubelet = FakeKubelet::start(dir.path()).await?;
    let plugin = PluginProcess::spawn(dir.path(), &["--simulate", "8"]);
    kubelet
        .wait_registrations(1, WAIT)
        .await
        .map_err(|e| format!("{e}\n{}", plugin.log()))?;
    let mut latencies = Vec::new();
    for round in 2..=101 {
        let (_, took) = kubelet
            .restart_and_wait(WAIT)
            .await
            .map_err(|e| format!("restart {}: {e}\n{}", round - 1, plugin.log()))?;
        latencies.push(took);
        kubelet
            .wait_list("8 devices on the new stream", WAIT, |l| {
                l.registration >= round && l.allocatable() == 8
            })
            .await?;
    }
    assert!(kubelet.registrations().len() >= 101);
    eprintln!(
        "binary: kubelet restart -> Register received: {}",
        summary(latencies)
    );
    Ok(())
}

#[tokio::test]
async fn plugin_started_before_the_kubelet_registers_when_it_appears() -> TestResult {
    let dir = tempfile::tempdir()?;
    let plugin = PluginProcess::spawn(dir.path(), &["--simulate", "2"]);
    // The plugin serves before any kubelet exists; wait until its socket is there.
    let socket = support::wait_for_file(dir.path(), WAIT, |n| {
        n.starts_with("gpu-device-plugin-") && n.ends_with(".sock")
    })
    .await
    .ok_or_else(|| format!("plugin never created its socket\n{}", plugin.log()))?;
    let kubelet = FakeKubelet::start(dir.path()).await?;
    let regs = kubelet
        .wait_registrations(1, WAIT)
        .await
        .map_err(|e| format!("{e}\n{}", plugin.log()))?;
    assert_eq!(regs[0].endpoint, socket);
    kubelet
        .wait_list("2 devices", WAIT, |l| l.allocatable() == 2)
        .await?;
    Ok(())
}

#[tokio::test]
async fn sigterm_ends_streams_cleanly_removes_the_socket_and_exits_zero_within_2s() -> TestResult {
    let dir = tempfile::tempdir()?;
    let kubelet = FakeKubelet::start(dir.path()).await?;
    let mut plugin = PluginProcess::spawn(dir.path(), &["--simulate", "2"]);
    let regs = kubelet.wait_registrations(1, WAIT).await?;
    kubelet
        .wait_list("2 devices", WAIT, |l| l.messages >= 1)
        .await?;
    let socket = dir.path().join(&regs[0].endpoint);
    assert!(socket.exists());

    let sent = Instant::now();
    plugin.signal(Signal::SIGTERM);
    let status = plugin.wait_exit(Duration::from_secs(2)).await;
    let took = sent.elapsed();
    assert!(
        status.is_some(),
        "still running 2 s after SIGTERM\n{}",
        plugin.log()
    );
    assert!(
        status.is_some_and(|s| s.success()),
        "exit status {status:?}\n{}",
        plugin.log()
    );
    assert!(!socket.exists(), "socket left behind");
    assert!(
        !plugin.log().contains("closed our ListAndWatch stream"),
        "its own shutdown is not the kubelet closing the stream\n{}",
        plugin.log()
    );
    let list = kubelet
        .wait_list("stream end", WAIT, |l| l.ended.is_some())
        .await?;
    assert_eq!(
        list.ended,
        Some(Ok(())),
        "stream must end cleanly, not with an error"
    );
    eprintln!("SIGTERM -> exit: {took:?}");
    Ok(())
}

/// The device plugin directory moved away and made again (`replace`), or deleted, while the plugin serves:
/// the kubelet looks at the path, so the plugin must not go on serving in the old directory unnoticed.
async fn a_replaced_kubelet_directory_stops_the_plugin_for_a_restart(replace: bool) -> TestResult {
    let root = tempfile::tempdir()?;
    let dir = root.path().join("device-plugins");
    std::fs::create_dir(&dir)?;
    let kubelet = FakeKubelet::start(&dir).await?;
    let mut plugin = PluginProcess::spawn(&dir, &["--simulate", "2"]);
    kubelet
        .wait_list("2 devices", WAIT, |l| l.messages >= 1)
        .await?;
    if replace {
        std::fs::rename(&dir, root.path().join("device-plugins.old"))?;
        std::fs::create_dir(&dir)?;
    } else {
        // Removing the directory races with the plugin putting its socket back (it binds a deleted socket
        // again, as after a kubelet restart): what was made meanwhile is removed again, as `rm -rf` run again
        // would.
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => break,
                Err(e)
                    if e.kind() == std::io::ErrorKind::DirectoryNotEmpty
                        && std::time::Instant::now() < deadline => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    let status = plugin.wait_exit(WAIT).await;
    let log = plugin.log();
    assert!(
        status.is_some_and(|s| !s.success()),
        "exit status {status:?}\n{log}"
    );
    assert!(
        log.contains("was moved, deleted or replaced") && log.contains(&*dir.to_string_lossy()),
        "{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
    Ok(())
}

#[tokio::test]
async fn a_kubelet_directory_moved_and_made_again_stops_the_plugin_for_a_restart() -> TestResult {
    a_replaced_kubelet_directory_stops_the_plugin_for_a_restart(true).await
}

#[tokio::test]
async fn a_kubelet_directory_deleted_stops_the_plugin_for_a_restart() -> TestResult {
    a_replaced_kubelet_directory_stops_the_plugin_for_a_restart(false).await
}

#[tokio::test]
async fn sigint_also_shuts_down_cleanly() -> TestResult {
    let dir = tempfile::tempdir()?;
    let kubelet = FakeKubelet::start(dir.path()).await?;
    let mut plugin = PluginProcess::spawn(dir.path(), &["--simulate", "1"]);
    let regs = kubelet.wait_registrations(1, WAIT).await?;
    plugin.signal(Signal::SIGINT);
    let status = plugin.wait_exit(Duration::from_secs(2)).await;
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}",
        plugin.log()
    );
    assert!(!dir.path().join(&regs[0].endpoint).exists());
    Ok(())
}

#[tokio::test]
async fn concurrent_watchers_each_get_every_change() -> TestResult {
    let node = Node::start(4).await?;
    let socket = node.dir.path().join(&node.registration.endpoint);

    let mut streams = Vec::new();
    for _ in 0..3 {
        let mut client = DevicePluginClient::new(uds::connect(&socket).await?);
        let mut stream = client.list_and_watch(Empty {}).await?.into_inner();
        let first = tokio::time::timeout(WAIT, stream.message())
            .await??
            .expect("first list");
        assert_eq!(first.devices.len(), 4);
        streams.push(stream);
    }
    for (i, xid) in [(0, 79), (1, 48)] {
        node.plugin
            .control
            .observe(&gpu(i), Observation::Xid(xid))
            .await;
        for stream in &mut streams {
            let list = tokio::time::timeout(WAIT, stream.message())
                .await??
                .expect("a list per change");
            let unhealthy: Vec<_> = list
                .devices
                .iter()
                .filter(|d| d.health == "Unhealthy")
                .map(|d| d.id.clone())
                .collect();
            assert_eq!(unhealthy, (0..=i).map(gpu).collect::<Vec<_>>());
        }
    }
    Ok(())
}

/// A rolling update with surge, as a DaemonSet with `maxSurge: 1` does it: the new instance starts beside
/// the old one (same state directory, as the DaemonSet's hostPath gives both), registers, then the old one is
/// stopped. Returns the kubelet, the new instance and the kubelet directory, once the test has seen the
/// hand-over through.
async fn surge(manager: DeviceManager) -> TestResult {
    let dir = tempfile::tempdir()?;
    let shared = tempfile::tempdir()?;
    let faults = shared.path().join("faults");
    let state = shared.path().join("state");
    let (faults_arg, state_arg) = (
        faults.to_string_lossy().into_owned(),
        state.to_string_lossy().into_owned(),
    );
    let args = [
        "--simulate",
        "4",
        "--simulate-events",
        &faults_arg,
        "--state-dir",
        &state_arg,
    ];
    let kubelet = FakeKubelet::start_as(dir.path(), manager).await?;
    let mut old = PluginProcess::spawn(dir.path(), &args);
    let first = kubelet
        .wait_registrations(1, WAIT)
        .await
        .map_err(|e| format!("{e}\n{}", old.log()))?;
    support::append(&faults, &[format!("xid {} 79", gpu(1))]);
    kubelet
        .wait_list("GPU 1 unhealthy", WAIT, |l| {
            l.health(&gpu(1)) == Some("Unhealthy")
        })
        .await?;
    // The old instance tells the kubelet first and writes its checkpoint right after; the new instance
    // learns the fault from the checkpoint (a fault raised before it watches the GPUs is not sent to it).
    support::wait_for_content(&state.join("health-checkpoint.json"), WAIT, |t| {
        t.contains(&gpu(1))
    })
    .await
    .ok_or_else(|| {
        format!(
            "the old instance never checkpointed the fault\n{}",
            old.log()
        )
    })?;

    let new = PluginProcess::spawn(dir.path(), &args);
    let regs = kubelet
        .wait_registrations(2, WAIT)
        .await
        .map_err(|e| format!("{e}\n{}", new.log()))?;
    assert_ne!(regs[0].endpoint, regs[1].endpoint);
    let list = kubelet
        .wait_list("the new instance's first list", WAIT, |l| {
            l.registration == 2 && l.messages >= 1
        })
        .await?;
    assert_eq!(
        list.health(&gpu(1)),
        Some("Unhealthy"),
        "the new instance forgot the fault"
    );

    old.signal(Signal::SIGTERM);
    assert!(
        old.wait_exit(WAIT).await.is_some_and(|s| s.success()),
        "{}",
        old.log()
    );
    assert!(!dir.path().join(&first[0].endpoint).exists());
    assert!(dir.path().join(&regs[1].endpoint).exists());

    let expected_registrations = match manager {
        // The kubelet cut the new instance off when the old one's stream ended; it registers again.
        DeviceManager::Legacy => 3,
        DeviceManager::MultiClient => 2,
    };
    let list = kubelet
        .wait_list(
            "the full list from the new instance after the hand-over",
            WAIT,
            |l| l.registration == expected_registrations && l.messages >= 1 && !l.disconnected,
        )
        .await
        .map_err(|e| format!("{e}: {:?}\n{}", kubelet.list(), new.log()))?;
    assert_eq!(list.devices.len(), 4);
    assert_eq!(list.health(&gpu(1)), Some("Unhealthy"));
    assert_eq!(list.allocatable(), 3);

    // A later fault reaches the kubelet from the new instance: a point after which a second registration
    // would already have shown.
    support::append(&faults, &[format!("xid {} 79", gpu(2))]);
    let list = kubelet
        .wait_list("GPU 2 unhealthy", WAIT, |l| {
            l.health(&gpu(2)) == Some("Unhealthy")
        })
        .await?;
    assert_eq!(list.registration, expected_registrations);
    let regs = kubelet.registrations();
    assert_eq!(
        regs.len(),
        expected_registrations,
        "exactly one registration follows the cut, none without one\n{}",
        new.log()
    );
    assert!(regs.iter().skip(1).all(|r| r.endpoint == regs[1].endpoint));
    let cut = kubelet.list().cut_by_other;
    let rejoined = new.log().matches("closed our ListAndWatch stream").count();
    match manager {
        DeviceManager::Legacy => assert_eq!((cut, rejoined), (1, 1), "{}", new.log()),
        DeviceManager::MultiClient => assert_eq!((cut, rejoined), (0, 0), "{}", new.log()),
    }
    kubelet.allocate(&[&[&gpu(0)]]).await?;
    let refused = kubelet.allocate(&[&[&gpu(1)]]).await.err();
    assert_eq!(refused.map(|s| s.code()), Some(Code::FailedPrecondition));
    Ok(())
}

#[tokio::test]
async fn surge_rollout_on_a_legacy_kubelet_the_new_instance_registers_again_after_the_cut()
-> TestResult {
    surge(DeviceManager::Legacy).await
}

#[tokio::test]
async fn surge_rollout_on_a_multi_client_kubelet_the_new_instance_keeps_its_stream() -> TestResult {
    surge(DeviceManager::MultiClient).await
}

/// Makes a directory event about `kubelet.sock` that changes nothing: the same socket file unlinked and
/// linked again under its name (inotify reports a creation), as a late or repeated event is.
fn relink(kubelet_socket: &std::path::Path) -> std::io::Result<()> {
    let aside = kubelet_socket.with_extension("aside");
    std::fs::hard_link(kubelet_socket, &aside)?;
    std::fs::remove_file(kubelet_socket)?;
    std::fs::hard_link(&aside, kubelet_socket)?;
    std::fs::remove_file(&aside)
}

#[tokio::test]
async fn a_directory_event_while_register_is_in_flight_leaves_exactly_one_registration()
-> TestResult {
    for manager in [DeviceManager::Legacy, DeviceManager::MultiClient] {
        let dir = tempfile::tempdir()?;
        let mut kubelet = FakeKubelet::start_as(dir.path(), manager).await?;
        kubelet.hold_registrations();
        let plugin = PluginProcess::spawn(dir.path(), &["--simulate", "2"]);
        // The kubelet has accepted the plugin and holds its answer back.
        kubelet
            .wait_registrations(1, WAIT)
            .await
            .map_err(|e| format!("{e}\n{}", plugin.log()))?;
        relink(&dir.path().join(gpu_device_plugin::api::KUBELET_SOCKET))?;
        // Our own socket removed too, as a kubelet's clean-up racing our bind does.
        let socket = kubelet.registrations()[0].endpoint.clone();
        std::fs::remove_file(dir.path().join(&socket))?;
        plugin
            .wait_log(WAIT, |l| l.contains("binding it again"))
            .await
            .ok_or_else(|| format!("the plugin did not re-bind\n{}", plugin.log()))?;
        kubelet.release_registrations();
        plugin
            .wait_log(WAIT, |l| l.contains("registered with the kubelet"))
            .await
            .ok_or_else(|| format!("Register never returned\n{}", plugin.log()))?;
        kubelet
            .wait_list("a list", WAIT, |l| l.allocatable() == 2)
            .await?;
        // A kubelet restart afterwards is the next registration; none came in between.
        let (registered, _) = kubelet.restart_and_wait(WAIT).await?;
        let regs = kubelet.registrations();
        assert_eq!(regs.len(), 2, "{manager:?}: {regs:?}\n{}", plugin.log());
        assert_eq!(regs[1].endpoint, registered.endpoint);
        assert_eq!(kubelet.clients().len(), 1, "{manager:?}");
    }
    Ok(())
}

#[tokio::test]
async fn a_kubelet_that_opens_no_stream_after_register_gets_a_new_registration() -> TestResult {
    let dir = tempfile::tempdir()?;
    let kubelet = FakeKubelet::start(dir.path()).await?;
    kubelet.open_streams(false);
    let _plugin = support::InProcessPlugin::start(dir.path(), 2);
    kubelet.wait_registrations(1, WAIT).await?;
    kubelet.open_streams(true);
    let regs = kubelet.wait_registrations(2, WAIT).await?;
    let gap = regs[1].received_at - regs[0].received_at;
    assert!(gap >= STREAM_WAIT, "registered again after {gap:?}");
    kubelet
        .wait_list("the list after registering again", WAIT, |l| {
            l.registration == 2 && l.allocatable() == 2
        })
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_container_start_on_an_unhealthy_gpu_is_refused_with_its_message_until_it_recovers()
-> TestResult {
    let node = support::ScriptedNode::start(4, &[]).await?;
    let kubelet = &node.kubelet;
    let (g0, g1, g2) = (gpu(0), gpu(1), gpu(2));
    assert!(
        kubelet.start_container(&[&g0, &g1, &g2]).await?,
        "the plugin asks to be called before a start"
    );

    // GPU 1: the driver asks for a reset; GPU 2 falls off the bus.
    node.inject(&[format!("action {g1} 1"), format!("xid {g2} 79")]);
    kubelet
        .wait_list("GPUs 1 and 2 unhealthy", WAIT, |l| l.allocatable() == 2)
        .await?;
    let refused = kubelet
        .start_container(&[&g0, &g1, &g2])
        .await
        .expect_err("a container on Unhealthy GPUs must not start");
    assert_eq!(refused.code(), Code::FailedPrecondition);
    let text = refused.message();
    assert!(
        text.starts_with(&format!(
            "device {g1}: Unhealthy: the driver reports recovery action 1 (GPU reset required)"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "device {g2}: Unhealthy: XID 79: the GPU has fallen off the bus"
        )),
        "{text}"
    );
    assert!(!text.contains(&g0), "{text}");
    // A GPU the plugin never had (gone since Allocate) is named.
    let gone = kubelet
        .start_container(&["GPU-gone"])
        .await
        .expect_err("an unknown GPU must not start");
    assert!(
        gone.message().contains("device GPU-gone is not served"),
        "{}",
        gone.message()
    );

    // The driver's recovery action returns to None: GPU 1 recovers, and the container on it starts again.
    node.inject(&[format!("action {g1} 0")]);
    kubelet
        .wait_list("GPU 1 healthy again", WAIT, |l| {
            l.health(&g1) == Some("Healthy")
        })
        .await?;
    assert!(kubelet.start_container(&[&g0, &g1]).await?);
    Ok(())
}

#[tokio::test]
async fn with_the_start_check_off_the_kubelet_never_asks() -> TestResult {
    let node = support::ScriptedNode::start(2, &["--pre-start-check=false"]).await?;
    let kubelet = &node.kubelet;
    assert!(!kubelet.registrations()[0].dialed_options.pre_start_required);
    node.inject(&[format!("xid {} 79", gpu(1))]);
    kubelet
        .wait_list("GPU 1 unhealthy", WAIT, |l| l.allocatable() == 1)
        .await?;
    assert!(
        !kubelet.start_container(&[&gpu(1)]).await?,
        "the kubelet starts the container without asking"
    );
    Ok(())
}

/// A flood of connections to the plugin's socket that never send anything (only the kubelet should connect
/// there): no more than the cap are held at once (the oldest silent one closed past it), each is closed
/// within 10 s, and the kubelet's connection, which speaks, keeps its place: its ListAndWatch carries a fault
/// meanwhile, on the same registration, and the descriptors are given back.
#[tokio::test]
async fn silent_connections_to_the_plugin_socket_are_capped_and_closed_and_the_kubelets_stays()
-> TestResult {
    let node = support::ScriptedNode::start(2, &[]).await?;
    let registration = node
        .kubelet
        .wait_list("listed", WAIT, |l| l.allocatable() == 2)
        .await?
        .registration;
    let socket = std::fs::read_dir(node.dir.path())?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("gpu-device-plugin-") && n.ends_with(".sock"))
        })
        .ok_or("the plugin's socket")?;
    let fds_before = node.plugin.open_files().ok_or("no /proc fd count")?;
    let mut silent = Vec::new();
    for _ in 0..150 {
        silent.push(tokio::net::UnixStream::connect(&socket).await?);
    }
    let id = simulated_uuid(0);
    node.inject(&[format!("xid {id} 79")]);
    let list = node
        .kubelet
        .wait_list("the fault", WAIT, |l| l.health(&id) == Some("Unhealthy"))
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    assert_eq!(
        list.registration, registration,
        "the kubelet's stream was cut"
    );
    // Every silent one is closed by the plugin, and the descriptors given back.
    support::all_closed_by(&node.plugin, &mut silent, fds_before).await?;
    // A client that sends requests and never reads the answers holds a bounded number of them open.
    assert_eq!(
        support::advertised_max_streams(&socket).await?,
        Some(gpu_device_plugin::util::bounded::KUBELET_SOCKET_STREAMS)
    );
    Ok(())
}

/// `--fail-on-init-error=false` with NVML failing its init: the driver's GPUs are served unmonitored, and
/// the plugin holds still. One registration and one stream, held while an operator's fence and release reach
/// the kubelet over it; `/healthz` green (a restart would not bring the driver back) with the reason in
/// `/status` and `/metrics`; `/readyz` by the registration.
#[tokio::test]
async fn unmonitored_gpus_stay_on_one_stream_with_healthz_green_and_the_reason_shown() -> TestResult
{
    let dir = tempfile::tempdir()?;
    let kubelet_dir = dir.path().join("device-plugins");
    std::fs::create_dir(&kubelet_dir)?;
    let proc_root = dir.path().join("proc");
    support::write_driver_gpu_list(&proc_root, 2);
    // An unknown key makes the fake library's nvmlInit fail (NVML_ERROR_UNKNOWN).
    let broken = dir.path().join("gpus.json");
    std::fs::write(&broken, r#"{"not-a-key": true}"#)?;
    let state = dir.path().join("state");
    let kubelet = FakeKubelet::start_as(&kubelet_dir, DeviceManager::Legacy).await?;
    let lib = support::fake_nvml_lib();
    let plugin = PluginProcess::spawn_with_env(
        &kubelet_dir,
        &[
            "--nvml-lib",
            lib.to_str().ok_or("utf-8 path")?,
            "--fail-on-init-error=false",
            "--proc-root",
            proc_root.to_str().ok_or("utf-8 path")?,
            "--state-dir",
            state.to_str().ok_or("utf-8 path")?,
        ],
        &[("FAKE_NVML_CONFIG", broken.as_os_str())],
    );
    let gpu0 = support::fake_nvml_gpu(0);
    kubelet
        .wait_list("the driver's 2 GPUs", WAIT, |l| l.allocatable() == 2)
        .await
        .map_err(|e| format!("{e}\n{}", plugin.log()))?;

    // An operator's fence and release travel the monitor → stream road: each is seen by the kubelet on the
    // first registration's stream.
    let fence = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"))
            .args(args)
            .arg("--state-dir")
            .arg(&state)
            .env_remove("RUST_LOG")
            .output()
    };
    let out = fence(&["fence", &gpu0, "--reason", "checking the stream"])?;
    assert!(out.status.success(), "{out:?}\n{}", plugin.log());
    kubelet
        .wait_list("the fence", WAIT, |l| l.health(&gpu0) == Some("Unhealthy"))
        .await?;
    let out = fence(&["release", &gpu0])?;
    assert!(out.status.success(), "{out:?}\n{}", plugin.log());
    let list = kubelet
        .wait_list("the release", WAIT, |l| l.allocatable() == 2)
        .await?;
    assert_eq!(
        (list.registration, kubelet.registrations().len()),
        (1, 1),
        "the plugin registered again\n{}",
        plugin.log()
    );
    assert!(list.messages >= 3, "{list:?}");

    let addr = plugin.http_addr().await.ok_or("no HTTP address")?;
    let get = |path: &'static str| {
        let addr = addr.clone();
        async move {
            let (status, body) = gpu_device_plugin::http::get(&addr, path).await?;
            Ok::<_, Box<dyn std::error::Error>>((
                status.as_u16(),
                String::from_utf8_lossy(&body).into_owned(),
            ))
        }
    };
    let (status, body) = get("/healthz").await?;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("2 of 2 devices are served unmonitored"),
        "{body}"
    );
    let (status, body) = get("/readyz").await?;
    assert_eq!((status, body.as_str()), (200, "ready\n"));
    let (status, body) = get("/status").await?;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("unmonitored") && body.contains("NVML"),
        "{body}"
    );
    let (status, body) = get("/metrics").await?;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.lines()
            .any(|l| l == "gpu_device_plugin_unmonitored_devices 2"),
        "{body}"
    );
    assert!(
        body.lines()
            .any(|l| l == "gpu_device_plugin_list_and_watch_streams 1"),
        "{body}"
    );

    // Held: no registration comes within a quiet period longer than the plugin ever waited between
    // registrations it made for a stream it took as closed (the first ones came within milliseconds).
    let again = kubelet
        .wait_registrations(2, Duration::from_secs(3))
        .await
        .map(|r| r.len());
    assert!(
        again.is_err(),
        "registered again: {again:?}\n{}",
        plugin.log()
    );
    assert_eq!(kubelet.list().registration, 1);
    // Said once.
    let log = plugin.log();
    assert_eq!(
        log.matches("serving the driver's GPUs unmonitored").count(),
        1,
        "{log}"
    );
    assert!(!log.contains("closed our ListAndWatch stream"), "{log}");
    Ok(())
}

/// On a kubelet up to 1.36, which keeps every client a registration replaces, a `*.sock` that accepts a
/// connection made and removed every 0.1 s (each removal possibly another plugin of the resource leaving)
/// makes the plugin register once
/// a second; the streams of the clients replaced are ended, so open streams stay within a small bound, and
/// the GPUs stay served.
#[tokio::test]
async fn sockets_made_and_removed_in_a_loop_leave_a_bounded_number_of_streams_open() -> TestResult {
    let dir = tempfile::tempdir()?;
    let kubelet = FakeKubelet::start_as(dir.path(), DeviceManager::Legacy).await?;
    let plugin = PluginProcess::spawn(dir.path(), &["--simulate", "2"]);
    kubelet
        .wait_list("2 GPUs", WAIT, |l| l.allocatable() == 2)
        .await
        .map_err(|e| format!("{e}\n{}", plugin.log()))?;
    let before = kubelet.registrations().len();
    let stop = tokio_util::sync::CancellationToken::new();
    let looping = {
        let (dir, stop) = (dir.path().to_path_buf(), stop.clone());
        tokio::spawn(async move {
            let mut i = 0_u64;
            while !stop.is_cancelled() {
                let path = dir.join(format!("other-{i}.sock"));
                if let Ok(listener) = tokio::net::UnixListener::bind(&path) {
                    // Accepting the plugin's look, as a plugin's socket would: one that never accepted
                    // could not have been a plugin, and its removal would not count.
                    let _ = tokio::time::timeout(WAIT, listener.accept()).await;
                    let _ = std::fs::remove_file(&path);
                    drop(listener);
                }
                i += 1;
                // The loop's pace, not a wait for anything.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    // Eight registrations, about a second apart: without a bound, eight more streams.
    let mut most = 0;
    let mut registrations = kubelet.watch_registrations();
    for n in 1..=8 {
        tokio::time::timeout(WAIT, registrations.wait_for(|r| r.len() >= before + n))
            .await
            .map_err(|_| format!("registration {n} never came\n{}", plugin.log()))??;
        most = most.max(kubelet.clients().len());
    }
    stop.cancel();
    looping.await?;
    let list = kubelet
        .wait_list("2 GPUs served after the loop", WAIT, |l| {
            l.allocatable() == 2 && !l.disconnected
        })
        .await
        .map_err(|e| format!("{e}\n{}", plugin.log()))?;
    assert_eq!(list.devices.len(), 2);
    let open = kubelet.clients().len();
    assert!(
        most <= 4 && open <= 4,
        "{most} clients open at most, {open} at the end\n{}",
        plugin.log()
    );
    Ok(())
}
