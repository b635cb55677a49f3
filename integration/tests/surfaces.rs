//! The roads that show a GPU's health besides the kubelet: the HTTP surfaces (`/healthz`, `/readyz`,
//! `/status`) and the `status` command, against the real binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use fake_kubelet::FakeKubelet;
use gpu_device_plugin::http;
use gpu_device_plugin::sources::simulated::simulated_uuid;
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
        row.contains("Unhealthy") && row.ends_with("xid-79"),
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
    let parsed: gpu_device_plugin::http::status::Report = serde_json::from_str(&json)?;
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

/// The value of the sample `name` (a counter's with or without `_total`) whose labels include `labels`.
fn sample(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape
        .samples
        .iter()
        .find(|s| {
            (s.metric == name || s.metric.strip_suffix("_total") == Some(name))
                && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v))
        })
        .and_then(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => Some(v),
            _ => None,
        })
}

/// Scrapes `/metrics`: checks the text line by line (every sample line is a name, optional labels and a
/// number; the exposition ends with `# EOF`) and parses it.
async fn scrape(addr: &str) -> (String, prometheus_parse::Scrape) {
    let (status, text) = get(addr, "/metrics").await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(text.ends_with("# EOF\n"), "{text}");
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (series, value) = line.rsplit_once(' ').unwrap_or_default();
        assert!(
            !series.is_empty() && value.parse::<f64>().is_ok(),
            "not a sample line: {line:?}"
        );
    }
    let parsed = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
        .expect("Prometheus text");
    (text, parsed)
}

#[tokio::test]
async fn metrics_parse_and_count_faults_transitions_and_kubelet_calls() -> TestResult {
    let support::ScriptedNode {
        kubelet,
        plugin,
        faults,
        dir: _dir,
    } = support::ScriptedNode::start(4, &[]).await?;
    let addr = plugin.http_addr().await.ok_or("no HTTP address")?;
    let (_, before) = scrape(&addr).await;
    assert_eq!(sample(&before, "gpu_device_plugin_xid_events", &[]), None);
    assert_eq!(
        sample(
            &before,
            "gpu_device_plugin_device_healthy",
            &[("device", &gpu(1))]
        ),
        Some(1.0)
    );

    // A harmless XID, then a fatal one; events are handled in order.
    support::append(
        &faults,
        &[format!("xid {} 13", gpu(0)), format!("xid {} 79", gpu(1))],
    );
    kubelet
        .wait_list("GPU 1 unhealthy", WAIT, |l| {
            l.health(&gpu(1)) == Some("Unhealthy")
        })
        .await?;
    kubelet.allocate(&[&[&gpu(0)]]).await?;
    assert!(kubelet.allocate(&[&[&gpu(1)]]).await.is_err());
    assert!(kubelet.start_container(&[&gpu(1)]).await.is_err());

    let (text, after) = scrape(&addr).await;
    let value = |name: &str, labels: &[(&str, &str)]| sample(&after, name, labels);
    assert_eq!(
        value(
            "gpu_device_plugin_device_healthy",
            &[("device", &gpu(1)), ("index", "1")]
        ),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        value("gpu_device_plugin_device_healthy", &[("device", &gpu(0))]),
        Some(1.0)
    );
    assert_eq!(
        value("gpu_device_plugin_xid_events", &[("xid", "79")]),
        Some(1.0)
    );
    assert_eq!(
        value("gpu_device_plugin_xid_events", &[("xid", "13")]),
        Some(1.0)
    );
    assert_eq!(
        value(
            "gpu_device_plugin_devices_with_condition",
            &[("kind", "xid")]
        ),
        Some(2.0)
    );
    assert_eq!(
        value(
            "gpu_device_plugin_health_transitions",
            &[("to", "Unhealthy")]
        ),
        Some(1.0)
    );
    let calls = |method: &str, code: &str| {
        value(
            "gpu_device_plugin_kubelet_calls",
            &[("method", method), ("code", code)],
        )
    };
    assert_eq!(calls("Allocate", "Ok"), Some(1.0), "{text}");
    assert_eq!(calls("Allocate", "FailedPrecondition"), Some(1.0));
    assert_eq!(calls("PreStartContainer", "FailedPrecondition"), Some(1.0));
    assert_eq!(
        value("gpu_device_plugin_kubelet_registrations", &[]),
        Some(1.0)
    );
    assert_eq!(
        value("gpu_device_plugin_kubelet_registered", &[]),
        Some(1.0)
    );
    assert_eq!(
        value("gpu_device_plugin_list_and_watch_streams", &[]),
        Some(1.0)
    );
    assert!(
        text.contains("gpu_device_plugin_event_to_published_seconds_count 1\n"),
        "{text}"
    );
    assert!(
        text.contains("gpu_device_plugin_build_info{version="),
        "{text}"
    );

    // A kubelet restart: one more registration, from a new kubelet.sock.
    let mut kubelet = kubelet;
    kubelet.restart_and_wait(WAIT).await?;
    let regs = kubelet.registrations().len();
    kubelet
        .wait_list("the list after the restart", WAIT, |l| {
            l.registration == regs && l.messages >= 1
        })
        .await?;
    // The kubelet can have the list before the plugin has read the answer to its Register: the counters
    // move with the log line that says so.
    plugin
        .wait_log(WAIT, |l| {
            l.matches("registered with the kubelet").count() >= 2
        })
        .await
        .ok_or("the plugin never saw its second registration accepted")?;
    let (text, restarted) = scrape(&addr).await;
    // At least the one after the restart (a registration racing the restart may add one).
    assert!(
        sample(&restarted, "gpu_device_plugin_kubelet_registrations", &[]) >= Some(2.0),
        "{text}"
    );
    assert_eq!(
        sample(&restarted, "gpu_device_plugin_kubelet_restarts", &[]),
        Some(1.0),
        "{text}"
    );
    Ok(())
}

/// Waits until at least `count` of `streams` have been closed by the server (a read ends: EOF or reset;
/// none of them was answered, so a read that ends is a close); how many were, or `None` past `timeout`.
async fn closed_by_server(
    streams: &mut [tokio::net::TcpStream],
    count: usize,
    timeout: std::time::Duration,
) -> Option<usize> {
    use futures_util::StreamExt as _;
    use tokio::io::AsyncReadExt as _;
    let mut reads: futures_util::stream::FuturesUnordered<_> = streams
        .iter_mut()
        .map(|s| async move {
            let mut byte = [0u8; 1];
            s.read(&mut byte).await
        })
        .collect();
    let counted = async {
        let mut closed = 0;
        while closed < count {
            let _closed = reads.next().await?;
            closed += 1;
        }
        Some(closed)
    };
    tokio::time::timeout(timeout, counted).await.ok()?
}

/// Scrapes until `/metrics` says no HTTP connection is open but the scrape itself (the plugin has seen
/// every client close); the scrape then.
async fn scrape_when_alone(addr: &str) -> Option<prometheus_parse::Scrape> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let (_, scraped) = scrape(addr).await;
        if sample(&scraped, "gpu_device_plugin_http_connections_open", &[]) == Some(1.0) {
            return Some(scraped);
        }
        if tokio::time::Instant::now() > deadline {
            return None;
        }
    }
}

#[tokio::test]
async fn a_flood_of_half_open_http_connections_is_capped_and_its_memory_handed_back() -> TestResult
{
    support::raise_own_open_files();
    let dir = tempfile::tempdir()?;
    let kubelet = FakeKubelet::start(dir.path()).await?;
    let plugin = PluginProcess::spawn(dir.path(), &["--simulate", "4"]);
    kubelet.wait_registrations(1, WAIT).await?;
    let addr = plugin.http_addr().await.ok_or("no HTTP address")?;
    let pid = plugin.child.id().ok_or("the plugin exited")?;
    // Every path a scrape and a report take, once, so that what follows measures the connections alone.
    let _ = scrape(&addr).await;
    let _ = get(&addr, "/status").await;
    let before = support::rss_kib(pid).ok_or("no VmRSS")?;

    const FLOOD: usize = 2000;
    let cap = http::MAX_CONNECTIONS;
    let started = std::time::Instant::now();
    let (mut held, reset) = support::half_open_http(&addr, FLOOD).await;
    let closed = closed_by_server(&mut held, (FLOOD - cap).saturating_sub(reset), WAIT).await;
    let took = started.elapsed();
    let during = support::rss_kib(pid).ok_or("no VmRSS")?;
    let fds = plugin.open_files().unwrap_or_default();
    println!(
        "{FLOOD} half-open connections in {took:?}: VmRSS {before} KiB before, {during} KiB during; {fds} descriptors"
    );
    assert!(
        closed.is_some(),
        "past the cap of {cap}, the oldest connections must be closed at once\n{}",
        plugin.log()
    );
    assert!(fds < cap + 64, "{fds} descriptors held");
    assert!(
        during < before + 8 * 1024,
        "{FLOOD} half-open connections took {} KiB",
        during - before
    );

    drop(held);
    let scraped = scrape_when_alone(&addr)
        .await
        .ok_or("the plugin never saw the clients close")?;
    // The memory is handed back when the last connection of the burst closes, which may be the one that
    // scrape used (it is still closing when the scrape returns): look until it is, or until WAIT.
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut after = support::rss_kib(pid).ok_or("no VmRSS")?;
    while after > before + 1024 && tokio::time::Instant::now() < deadline {
        let _ = scrape(&addr).await;
        after = support::rss_kib(pid).ok_or("no VmRSS")?;
    }
    println!("after they closed: VmRSS {after} KiB");
    let evicted =
        sample(&scraped, "gpu_device_plugin_http_connections_evicted", &[]).unwrap_or_default();
    assert!(evicted >= (FLOOD - cap) as f64, "{evicted} evicted");
    assert!(
        after <= before + 1024,
        "VmRSS {before} KiB before the flood, {after} KiB after it ended"
    );
    // And the port serves again.
    let (status, _) = get(&addr, "/healthz").await;
    assert_eq!(status, StatusCode::OK);
    Ok(())
}

#[tokio::test]
async fn the_soft_open_file_limit_is_raised_to_the_hard_one_at_start() -> TestResult {
    let dir = tempfile::tempdir()?;
    let plugin = PluginProcess::spawn_with_nofile(dir.path(), &["--simulate", "1"], &[], 64, None);
    plugin
        .wait_log(WAIT, |l| l.contains("control socket for fence and release"))
        .await
        .ok_or_else(|| format!("the plugin did not start\n{}", plugin.log()))?;
    let (soft, hard) = plugin.open_files_limit().ok_or("no /proc limits")?;
    assert!(
        hard > 64,
        "the test needs a hard limit above 64, not {hard}"
    );
    assert_eq!(soft, hard, "{}", plugin.log());
    assert!(plugin.log().contains("soft_was=64"), "{}", plugin.log());
    Ok(())
}

#[tokio::test]
async fn healthz_a_kubelet_restart_and_an_xid_get_through_while_more_half_open_http_connections_than_the_cap_are_held()
-> TestResult {
    support::raise_own_open_files();
    let mut node = support::NvmlNode::start(None, &[]).await?;
    // A small hard limit, which raising the soft one cannot help: the HTTP cap is an eighth of it.
    const LIMIT: u64 = 256;
    node.restart_plugin_with_nofile(LIMIT, LIMIT).await?;
    assert_eq!(node.plugin.open_files_limit(), Some((LIMIT, LIMIT)));
    let addr = node.plugin.http_addr().await.ok_or("no HTTP address")?;
    let registrations = node.kubelet.registrations().len();

    // More connections than the plugin may hold descriptors, none finishing its headers. A plugin that ran
    // out of descriptors stops accepting, and past its accept queue the connects hang: bounded here.
    let flood = support::half_open_http(&addr, 2 * LIMIT as usize);
    let (held, _reset) = tokio::time::timeout(WAIT, flood).await.map_err(|_| {
        format!(
            "the plugin stopped accepting HTTP connections\n{}",
            node.plugin.log()
        )
    })?;
    // The kubelet's liveness probe is answered at once (well within its 2 s timeout), not after the
    // flood's header timeout: the oldest half-open connection makes room for it.
    let probe = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        http::get(&addr, "/healthz"),
    )
    .await
    .map_err(|_| {
        format!(
            "/healthz did not answer within 2 s during the flood\n{}",
            node.plugin.log()
        )
    })??;
    assert_eq!(probe.0, StatusCode::OK);
    node.kubelet
        .restart_and_wait(WAIT)
        .await
        .map_err(|e| format!("{e}\n{}", node.plugin.log()))?;
    node.kubelet
        .wait_list("the list after the kubelet restart", WAIT, |l| {
            l.registration > registrations && l.messages >= 1
        })
        .await?;
    let gpu1 = support::fake_nvml_gpu(1);
    node.inject(&[format!("xid {gpu1} 79")]);
    node.wait_unhealthy(&gpu1).await?;
    println!(
        "{} descriptors held with {} half-open connections",
        node.plugin.open_files().unwrap_or_default(),
        held.len()
    );
    Ok(())
}

#[tokio::test]
async fn when_a_second_instance_on_the_state_directory_exits_fence_reaches_the_first() -> TestResult
{
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    let state_arg = state.to_string_lossy().into_owned();
    let args = ["--simulate", "2", "--state-dir", state_arg.as_str()];
    let (kubelet1, kubelet2) = (dir.path().join("kubelet-1"), dir.path().join("kubelet-2"));
    std::fs::create_dir(&kubelet1)?;
    std::fs::create_dir(&kubelet2)?;
    let first = PluginProcess::spawn(&kubelet1, &args);
    first
        .wait_log(WAIT, |l| l.contains("control socket for fence and release"))
        .await
        .ok_or_else(|| {
            format!(
                "the first did not serve its control socket\n{}",
                first.log()
            )
        })?;
    // The second instance (a rolling update's new pod) replaces the socket, then exits and removes it.
    let mut second = PluginProcess::spawn(&kubelet2, &args);
    second
        .wait_log(WAIT, |l| l.contains("control socket for fence and release"))
        .await
        .ok_or_else(|| {
            format!(
                "the second did not serve its control socket\n{}",
                second.log()
            )
        })?;
    second.signal(nix::sys::signal::Signal::SIGTERM);
    second
        .wait_exit(WAIT)
        .await
        .ok_or("the second did not stop")?;

    first
        .wait_log(WAIT, |l| l.contains("bound it again"))
        .await
        .ok_or_else(|| {
            format!(
                "the first never bound its control socket again\n{}",
                first.log()
            )
        })?;
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"))
        .args(["fence", &gpu(1), "--reason", "reseated", "--state-dir"])
        .arg(&state)
        .env_remove("RUST_LOG")
        .output()
        .await?;
    let (out, err) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(output.status.success(), "{out}{err}");
    assert_eq!(out.trim(), format!("fenced {}: Unhealthy", gpu(1)));
    first
        .wait_log(WAIT, |l| l.contains("fenced by an operator"))
        .await
        .ok_or("the fence did not reach the first instance")?;
    Ok(())
}

/// Reads `stream` until the server closes it; how long that took from `since`, or `None` past `timeout`.
async fn closed_after(
    stream: &mut tokio::net::TcpStream,
    since: std::time::Instant,
    timeout: std::time::Duration,
) -> Option<std::time::Duration> {
    use tokio::io::AsyncReadExt as _;
    let mut sent = Vec::new();
    let _closed = tokio::time::timeout(timeout, stream.read_to_end(&mut sent))
        .await
        .ok()?;
    Some(since.elapsed())
}

#[tokio::test]
async fn an_http_client_that_never_finishes_its_headers_is_closed_after_the_header_timeout()
-> TestResult {
    let dir = tempfile::tempdir()?;
    let plugin = PluginProcess::spawn(dir.path(), &["--simulate", "1"]);
    let addr = plugin.http_addr().await.ok_or("no HTTP address")?;
    let started = std::time::Instant::now();
    // One that starts a request and stops, and one that sends nothing at all.
    let (mut held, _reset) = support::half_open_http(&addr, 1).await;
    held.push(tokio::net::TcpStream::connect(&addr).await?);
    let limit = http::HEADER_READ + WAIT;
    for stream in &mut held {
        let took = closed_after(stream, started, limit)
            .await
            .ok_or_else(|| format!("not closed within {limit:?}\n{}", plugin.log()))?;
        println!("closed after {took:?}");
        // The server's clock starts once it accepts, after the connect that ours started before.
        assert!(took >= http::HEADER_READ, "closed after {took:?}");
    }
    Ok(())
}

#[tokio::test]
async fn a_fence_reason_and_user_with_control_characters_cannot_forge_a_log_line() -> TestResult {
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    let state_arg = state.to_string_lossy().into_owned();
    let plugin = PluginProcess::spawn(dir.path(), &["--simulate", "2", "--state-dir", &state_arg]);
    plugin
        .wait_log(WAIT, |l| l.contains("control socket for fence and release"))
        .await
        .ok_or_else(|| format!("no control socket\n{}", plugin.log()))?;
    let forged =
        "1999-12-31T23:59:59.000000Z  INFO gpu_device_plugin::monitor: released by an operator";
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_gpu-device-plugin"))
        .args(["fence", &gpu(1), "--reason"])
        .arg(format!("burn-in\n{forged}"))
        .arg("--state-dir")
        .arg(&state)
        .env_remove("RUST_LOG")
        .env("SUDO_USER", "eve\r\u{1b}[2K")
        .output()
        .await?;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let log = plugin
        .wait_log(WAIT, |l| l.contains("fenced by an operator"))
        .await
        .ok_or("the fence did not reach the plugin")?;
    let line = log
        .lines()
        .find(|l| l.contains("fenced by an operator"))
        .unwrap_or_default();
    assert!(line.contains(&format!("burn-in\\n{forged}")), "{line}");
    assert!(line.contains("eve\\r\\u{1b}[2K"), "{line}");
    assert!(
        !log.lines().any(|l| l.starts_with("1999-12-31T23:59:59")),
        "a forged line in the log:\n{log}"
    );
    assert!(!log.contains(['\r', '\u{1b}']), "{log}");
    Ok(())
}

/// One raw HTTP/1.1 exchange: the status line and headers (names lower-cased) of the answer to `method path`
/// with `accept`.
async fn answer_headers(
    addr: &str,
    method: &str,
    path: &str,
    accept: &str,
) -> (String, Vec<(String, String)>) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\naccept: {accept}\r\ncontent-length: 0\r\n\
         connection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut raw))
        .await
        .expect("an answer in time")
        .expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let head = text.split("\r\n\r\n").next().unwrap_or_default();
    let mut lines = head.lines();
    let status = lines.next().unwrap_or_default().to_string();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    (status, headers)
}

#[tokio::test]
async fn every_http_answer_errors_included_carries_a_content_security_policy_and_nosniff()
-> TestResult {
    let dir = tempfile::tempdir()?;
    // No kubelet: /readyz answers 503, an error answer like the others.
    let plugin = PluginProcess::spawn(dir.path(), &["--simulate", "1"]);
    let addr = plugin
        .http_addr()
        .await
        .ok_or_else(|| format!("no HTTP address in the log\n{}", plugin.log()))?;
    let asks = [
        ("GET", "/healthz", "*/*", "200"),
        ("GET", "/readyz", "*/*", "503"),
        ("GET", "/status", "application/json", "200"),
        ("GET", "/status", "text/html", "200"),
        ("GET", "/metrics", "*/*", "200"),
        ("GET", "/nothing-here", "*/*", "404"),
        ("POST", "/healthz", "*/*", "405"),
        ("DELETE", "/status", "text/html", "405"),
    ];
    for (method, path, accept, code) in asks {
        let (status, headers) = answer_headers(&addr, method, path, accept).await;
        assert!(status.contains(code), "{method} {path}: {status}");
        let header = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(
            header("x-content-type-options"),
            Some("nosniff"),
            "{method} {path} ({status}): {headers:?}"
        );
        let policy = header("content-security-policy").unwrap_or_default();
        assert!(
            policy.contains("default-src 'none'") && policy.contains("frame-ancestors 'none'"),
            "{method} {path} ({status}): {headers:?}"
        );
    }
    Ok(())
}
