//! `gpu-device-plugin`: the node agent. Parses settings, opens the device source, serves its GPUs on each
//! road (the device plugin, DRA) with the Kubernetes API side and the side surfaces, until SIGTERM or SIGINT,
//! or a SIGHUP's restart in place. The other commands are in [`gpu_device_plugin::commands`].

use anyhow::{Context, bail};
use std::process::ExitCode;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

use futures_util::StreamExt as _;
use gpu_device_plugin::cluster::{ApiAccess, ApiStop};
use gpu_device_plugin::commands::{self, fail, init_logging, one_line, settings_or_exit};
use gpu_device_plugin::config::{self, Settings};
use gpu_device_plugin::devices;
use gpu_device_plugin::dra::{self, DraError, registration::DraStatus};
use gpu_device_plugin::fence;
use gpu_device_plugin::http;
use gpu_device_plugin::kubelet;
use gpu_device_plugin::kubelet::pods::PodResources;
use gpu_device_plugin::metrics::Metrics;
use gpu_device_plugin::monitor;
use gpu_device_plugin::reload::{self, handover, signals};
use gpu_device_plugin::roads;
use gpu_device_plugin::sources::DeviceSource;

fn main() -> ExitCode {
    if let Some(exit) = commands::dispatch() {
        return exit;
    }
    let argv: Vec<_> = std::env::args_os().collect();
    let settings = match settings_or_exit(&argv) {
        Ok(settings) => settings,
        Err(exit) => return exit,
    };
    init_logging(settings.log_format);
    gpu_device_plugin::util::limits::raise_open_files_at_start();
    gpu_device_plugin::util::runtime::exit_on_panic();
    for warning in &settings.warnings {
        tracing::warn!("{warning}");
    }
    // One thread runs everything async: the plugin's work is small and bursty, and handing a fault from task
    // to task on one thread avoids cross-thread wake-ups on its way to the kubelet. Blocking work (NVML,
    // checkpoint writes) runs on threads of its own.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => return fail(&format!("cannot start the async runtime: {e}")),
    };
    let outcome = runtime.block_on(run(settings));
    // A checkpoint write still being retried (a failing disk) must not hold the exit: shutdown already gave
    // it its time.
    runtime.shutdown_timeout(std::time::Duration::from_millis(100));
    match outcome {
        Ok(Stopped::Shutdown) => ExitCode::SUCCESS,
        Ok(Stopped::Reload { watcher }) => restart_in_place(watcher),
        Err(e) => fail(&one_line(&e)),
    }
}

/// Why the plugin stopped serving.
enum Stopped {
    /// SIGTERM or SIGINT.
    Shutdown,
    /// SIGHUP with a config that loads: start again with it, taking over from the watcher (its process ID)
    /// that covers the restart, where one was started.
    Reload {
        /// The watcher's process ID.
        watcher: Option<u32>,
    },
}

/// Runs this program again in this process (see [`reload::restart_in_place`]).
fn restart_in_place(watcher: Option<u32>) -> ExitCode {
    tracing::info!("restarting with the new config");
    let e = reload::restart_in_place(watcher);
    fail(&format!("cannot restart after SIGHUP: {e}"))
}

/// How long shutdown waits for the side surfaces' thread to end.
const SIDE_EXIT: std::time::Duration = std::time::Duration::from_secs(1);

/// How long shutdown waits for the node condition to be left Unknown (a read and a patch; the pod's grace
/// period is 10 s).
const LEAVE_CONDITION: std::time::Duration = std::time::Duration::from_secs(3);

/// How long shutdown waits for the last checkpoint write (well within the 2 s a DaemonSet update allows).
const FLUSH_AT_EXIT: std::time::Duration = std::time::Duration::from_millis(500);

/// The plugin from start to stop: the device source and its monitor, one kubelet registration per
/// resource, the DRA side, the Kubernetes API side, the side surfaces on their own thread, then serving until
/// shutdown.
async fn run(settings: Settings) -> anyhow::Result<Stopped> {
    // Signals first: SIGHUP's default action would kill the process.
    let shutdown = CancellationToken::new();
    let gate = signals::GateSlot::default();
    let reload = signals::spawn(shutdown.clone(), gate.clone())?;
    check_directories(&settings)?;
    let Some(source) = open_source(&settings, &shutdown).await? else {
        // SIGTERM (or a SIGHUP whose config loads) while NVML was loading.
        if let Some(&watcher) = reload.get() {
            return Ok(Stopped::Reload { watcher });
        }
        tracing::info!("stopped while NVML was loading");
        return Ok(Stopped::Shutdown);
    };
    settings.log_start(source.driver_version());
    let metrics = Arc::new(Metrics::new());
    let mut monitor_config = settings.monitor.clone();
    monitor_config.metrics = metrics.clone();
    let monitored = monitor::spawn_monitored(source, monitor_config)
        .context("cannot start the device source")?;

    // One road per GPU: those served through DRA are not in the device plugin's view.
    let roads = roads::Roads::split(&settings, &monitored.inventory, &monitored.unserved)?;
    let (plan, plugins) = roads::plugins_for(&settings, &roads.device_plugin, &metrics)?;
    let links: Vec<_> = plugins.iter().map(|(p, _)| p.status.subscribe()).collect();
    // An unusable --kubeconfig stops the plugin here, before it registers; no API access at all is one line
    // and everything else goes on (but DRA, which cannot work without it).
    let api = ApiAccess::resolve(&settings.cluster).await?;
    let dra_status = settings.dra.as_ref().map(|dra| {
        tokio::sync::watch::Sender::new(DraStatus {
            driver: dra.driver.clone(),
            ..Default::default()
        })
    });
    let dra = start_dra(
        &settings,
        &roads,
        api.as_ref(),
        dra_status.as_ref(),
        &monitored,
        &metrics,
        &shutdown,
    )?;
    let pods = roads::pod_resources(&settings, &plugins, &monitored);
    let api_stop = api.map(|api| {
        start_api(
            api,
            links.first().cloned(),
            &monitored,
            pods.clone(),
            dra_status.as_ref(),
            &metrics,
        )
    });
    if let Some(heartbeat) = monitored.heartbeat.clone() {
        heartbeat.watch(settings.stuck_after);
    }
    let context = http::Context {
        devices: monitored.handle.clone(),
        kubelet: links,
        resources: plan,
        policy: http::status::PolicySummary::of(&settings.monitor.policy),
        event_thread: monitored.heartbeat.clone(),
        stuck_after: settings.stuck_after,
        metrics,
        pods: pods.clone(),
        unserved: monitored.unserved.clone(),
        dra: settings
            .dra
            .as_ref()
            .zip(dra_status.as_ref())
            .map(|(dra, status)| http::DraSurface {
                gpus: dra.gpus.clone(),
                status: status.subscribe(),
            }),
    };
    let side = start_side_surfaces(&settings, &monitored, context, &shutdown)?;
    // From here a SIGHUP's new config is weighed against what each road holds.
    let _set = gate.set(reload::Gate {
        inventory: monitored.inventory.clone(),
        unserved: monitored.unserved.clone(),
        dra: settings.dra.as_ref().map(|d| d.gpus.clone()),
        claims: dra_status
            .as_ref()
            .map(tokio::sync::watch::Sender::subscribe),
        pods,
        watcher: signals::handover_watcher,
    });
    let failed = serve(plugins, dra, &shutdown).await;
    stop(&monitored, side, failed, reload.get().copied(), api_stop).await
}

/// Settles the directories now, so that a bad one is reported before anything starts; with every GPU served
/// through DRA the device plugin never registers, and the kubelet's device plugin directory is not needed.
fn check_directories(settings: &Settings) -> anyhow::Result<()> {
    config::prepare_state_dir(&settings.state_dir)?;
    let dra_only = settings
        .dra
        .as_ref()
        .is_some_and(|d| matches!(d.gpus, devices::selection::DraSelection::All));
    if !dra_only {
        kubelet::socket_path_for(&settings.plugin_config(&settings.resource_name))?;
    }
    Ok(())
}

/// The device source the settings name (`None` when told to stop while NVML loads), taking over from the
/// watcher of a SIGHUP's restart where this image is one.
async fn open_source(
    settings: &Settings,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<Box<dyn DeviceSource>>> {
    let source =
        gpu_device_plugin::sources::open::open(&settings.source_choice(), shutdown).await?;
    let Some(watcher) = handover::HandedOver::watcher_from_env() else {
        return Ok(source);
    };
    // Restarted by a SIGHUP: what the watcher saw since the old image stopped watching comes next.
    Ok(source.map(|source| {
        Box::new(handover::HandedOver::new(
            source,
            handover::socket_path(&settings.state_dir),
            Some(watcher),
        )) as Box<dyn DeviceSource>
    }))
}

/// The end of a run: the checkpoint flushed and the side surfaces joined (each within its bound), then why
/// the plugin stopped; stopping for good (a rollback, the DaemonSet deleted) leaves the node condition
/// Unknown, as nothing watches any more.
async fn stop(
    monitored: &monitor::Monitored,
    side: gpu_device_plugin::util::runtime::SideRuntime,
    failed: Option<anyhow::Error>,
    reload: Option<Option<u32>>,
    api_stop: Option<ApiStop>,
) -> anyhow::Result<Stopped> {
    // The checkpoint holds what the kubelet was last told before the process goes: a write still queued when
    // the runtime stops would never run.
    if tokio::time::timeout(FLUSH_AT_EXIT, monitored.handle.flush())
        .await
        .is_err()
    {
        tracing::warn!(
            "the health checkpoint was not written within {FLUSH_AT_EXIT:?} of shutdown"
        );
    }
    // Bounded: a side task stuck in a blocking call must not keep the plugin from exiting.
    if tokio::time::timeout(SIDE_EXIT, side.join()).await.is_err() {
        tracing::warn!(
            "the side surfaces' thread did not end within {SIDE_EXIT:?} of shutdown; leaving it"
        );
    }
    if let Some(e) = failed {
        return Err(e);
    }
    if let Some(watcher) = reload {
        return Ok(Stopped::Reload { watcher });
    }
    if let Some(api_stop) = api_stop {
        api_stop.leave_condition(LEAVE_CONDITION).await;
    }
    tracing::info!("stopped");
    Ok(Stopped::Shutdown)
}

/// The DRA side on a thread of its own, when `--dra` is on (it resolves when it stops); DRA without the
/// Kubernetes API stops the start.
fn start_dra(
    settings: &Settings,
    roads: &roads::Roads,
    api: Option<&ApiAccess>,
    status: Option<&tokio::sync::watch::Sender<DraStatus>>,
    monitored: &monitor::Monitored,
    metrics: &Arc<Metrics>,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<tokio::sync::oneshot::Receiver<Result<(), DraError>>>> {
    let (Some(dra), Some(devices), Some(status)) = (&settings.dra, &roads.dra, status) else {
        return Ok(None);
    };
    let Some(api) = api else {
        bail!(
            "--dra needs the Kubernetes API (claims are read from it): run in a pod with a service account, \
             or give --kubeconfig"
        )
    };
    let started = dra::spawn(
        settings.dra_config(dra, api.node()),
        devices.clone(),
        Some(dra::view::Conditions {
            monitor: monitored.handle.clone(),
            devices: monitored.devices.follow(),
        }),
        api.client_config(),
        status.clone(),
        metrics.clone(),
        shutdown.clone(),
    )
    .context("cannot start the DRA side's thread")?;
    Ok(Some(started))
}

/// The Kubernetes API side: Events, the node condition and the fence annotation. It starts once the
/// kubelet's first registration is accepted, or after a couple of seconds without one; health changes
/// meanwhile are reported then.
fn start_api(
    api: ApiAccess,
    kubelet: Option<tokio::sync::watch::Receiver<kubelet::KubeletStatus>>,
    monitored: &monitor::Monitored,
    pods: Option<Arc<PodResources>>,
    dra_status: Option<&tokio::sync::watch::Sender<DraStatus>>,
    metrics: &Arc<Metrics>,
) -> ApiStop {
    let registered = async move {
        if let Some(kubelet) = kubelet {
            let _either = kubelet::registered_or_late(kubelet).await;
        }
    };
    let before = monitored.inventory.borrow().clone();
    api.spawn(
        registered,
        before,
        monitored.inventory.clone(),
        gpu_device_plugin::cluster::DeviceUsers {
            pods,
            claims: dra_status.map(|status| {
                let users: Arc<dyn gpu_device_plugin::cluster::ClaimUsers> =
                    Arc::new(dra::claims::PreparedFor::new(status.subscribe()));
                users
            }),
        },
        metrics.clone(),
        Some(fence::annotation::follower(monitored.handle.clone())),
    )
}

/// The bulkhead: every side surface (HTTP, the control socket, the fence directory) runs on a thread and
/// runtime of its own, so that nothing they meet (slow clients, a stuck file, a flood of requests) takes a
/// turn from the monitor and the kubelet streams on this one.
fn start_side_surfaces(
    settings: &Settings,
    monitored: &monitor::Monitored,
    context: http::Context,
    shutdown: &CancellationToken,
) -> anyhow::Result<gpu_device_plugin::util::runtime::SideRuntime> {
    let side =
        gpu_device_plugin::util::runtime::SideRuntime::start("side-surfaces", shutdown.clone())
            .context("cannot start the side surfaces' thread")?;
    let _inside = side.enter();
    if let Some(addr) = settings.http_addr {
        http::spawn(addr, context, shutdown.clone());
    }
    if let Err(e) = gpu_device_plugin::fence::control::spawn(
        &settings.state_dir,
        monitored.handle.clone(),
        shutdown.clone(),
    ) {
        tracing::warn!(error = %e, "no control socket: gpu-device-plugin fence and release cannot reach this plugin");
    }
    if let Some(dir) = &settings.fence_dir {
        gpu_device_plugin::fence::dir::spawn(
            dir.clone(),
            monitored.handle.clone(),
            shutdown.clone(),
        )?;
    }
    Ok(side)
}

/// Serves every resource until shutdown; one that cannot be served stops them all (the DaemonSet restarts
/// the pod), as a node half-served would hide the other half's capacity without a word. Returns the first
/// failure.
async fn serve(
    plugins: roads::Plugins,
    dra: Option<tokio::sync::oneshot::Receiver<Result<(), DraError>>>,
    shutdown: &CancellationToken,
) -> Option<anyhow::Error> {
    let mut served: futures_util::stream::FuturesUnordered<
        std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>> + Send>>,
    > = plugins
        .into_iter()
        .map(|(plugin, inventory)| {
            let run = kubelet::run(plugin, inventory, shutdown.clone());
            Box::pin(async move { run.await.map_err(anyhow::Error::from) }) as _
        })
        .collect();
    if let Some(dra) = dra {
        served.push(Box::pin(async move {
            match dra.await {
                Ok(result) => result.map_err(anyhow::Error::from),
                Err(_) => Err(anyhow::anyhow!(
                    "the DRA side's thread ended without a word"
                )),
            }
        }));
    }
    let mut failed = None;
    while let Some(result) = served.next().await {
        if let Err(e) = result {
            shutdown.cancel();
            failed.get_or_insert(e);
        }
    }
    failed
}
