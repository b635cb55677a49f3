//! `gpu-device-plugin`: the node agent. Parses settings, picks the device source, runs the kubelet side and
//! the HTTP surfaces until SIGTERM or SIGINT. `gpu-device-plugin status` reads a running agent's `/status`.

use anyhow::{Context, bail};
use std::io::IsTerminal;
use std::process::ExitCode;
use tokio_util::sync::CancellationToken;

use futures_util::StreamExt as _;
use gpu_device_plugin::cluster::ApiAccess;
use gpu_device_plugin::config::{self, LogFormat, Settings};
use gpu_device_plugin::devices;
use gpu_device_plugin::devices::allocation::MpsDirs;
use gpu_device_plugin::devices::mig::ResourceNaming;
use gpu_device_plugin::devices::resources::ResourcePlan;
use gpu_device_plugin::dra::DraError;
use gpu_device_plugin::fence;
use gpu_device_plugin::http;
use gpu_device_plugin::kubelet::pods::PodResources;
use gpu_device_plugin::kubelet::{self, PluginConfig};
use gpu_device_plugin::metrics::Metrics;
use gpu_device_plugin::monitor;
use gpu_device_plugin::sources::DeviceSource;
use gpu_device_plugin::sources::nvml::{self, NvmlGpus, NvmlInitError, UnmonitoredGpus};
use gpu_device_plugin::sources::simulated::SimulatedGpus;
use std::sync::Arc;

fn main() -> ExitCode {
    match std::env::args_os()
        .nth(1)
        .as_deref()
        .and_then(|a| a.to_str())
    {
        Some("status") => return status_command(),
        Some(command @ ("fence" | "release")) => return control_command(command == "fence"),
        Some("check-config") => return check_config_command(),
        Some(config::reload::SUBCOMMAND) => return reload_check_command(),
        Some(nvml::library::TRIAL_LOAD) => return nvml::library::trial_load_command(),
        _ => {}
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
        Ok(Stopped::Reload) => restart_in_place(),
        Err(e) => fail(&one_line(&e)),
    }
}

/// Why the plugin stopped serving.
enum Stopped {
    /// SIGTERM or SIGINT.
    Shutdown,
    /// SIGHUP with a config that loads: start again with it.
    Reload,
}

/// Runs this program again in this process (same PID, arguments and environment), which reads the config
/// anew; health state carries over in the checkpoint, flushed at shutdown.
fn restart_in_place() -> ExitCode {
    use std::os::unix::process::CommandExt as _;
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return fail(&format!("cannot restart after SIGHUP: {e}")),
    };
    tracing::info!("restarting with the new config");
    let e = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .exec();
    fail(&format!("cannot restart after SIGHUP: {e}"))
}

/// How long shutdown waits for the side surfaces' thread to end.
const SIDE_EXIT: std::time::Duration = std::time::Duration::from_secs(1);

/// How long shutdown waits for the node condition to be left Unknown (a read and a patch; the pod's grace
/// period is 10 s).
const LEAVE_CONDITION: std::time::Duration = std::time::Duration::from_secs(3);

/// How long shutdown waits for the last checkpoint write (well within the 2 s a DaemonSet update allows).
const FLUSH_AT_EXIT: std::time::Duration = std::time::Duration::from_millis(500);

/// The settings `argv` and the environment give, or how the process ends: a refusal in one line, or
/// `--help` / `--version` printed.
fn settings_or_exit(argv: &[std::ffi::OsString]) -> Result<Settings, ExitCode> {
    match Settings::from_args(argv) {
        Ok(Ok(settings)) => Ok(settings),
        Ok(Err(e)) => Err(fail(&e.to_string())),
        Err(e) if e.use_stderr() => Err(fail(&config::usage_error_line(&e, argv))),
        Err(e) => {
            // --help and --version.
            let _printed = e.print();
            Err(ExitCode::SUCCESS)
        }
    }
}

/// An error and its causes in one line, each cause left out where the text before already says it (most
/// errors here name their cause in their own message).
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !line.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
    }
    line
}

/// A refusal: one line on stderr, whatever outside text the message holds (see
/// [`gpu_device_plugin::util::text::shown`]).
fn fail(message: &str) -> ExitCode {
    use gpu_device_plugin::util::text::{LINE_MAX, shown};
    eprintln!("gpu-device-plugin: error: {}", shown(message, LINE_MAX));
    ExitCode::FAILURE
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        // Fields quote outside text (names, reasons, errors from other processes): each shown escaped.
        LogFormat::Text => builder
            .with_writer(std::io::stderr)
            .fmt_fields(gpu_device_plugin::util::text::log_fields())
            .init(),
        // JSON escapes control characters; the writer escapes the bidirectional overrides JSON leaves.
        LogFormat::Json => builder
            .with_writer(|| gpu_device_plugin::util::text::JsonLogWriter(std::io::stderr()))
            .json()
            .flatten_event(true)
            .init(),
    }
}

/// The plugin from start to stop: the device source and its monitor, one kubelet registration per
/// resource, the Kubernetes API side, the side surfaces on their own thread, then serving until shutdown.
async fn run(settings: Settings) -> anyhow::Result<Stopped> {
    // Signals first: SIGHUP's default action would kill the process.
    let shutdown = CancellationToken::new();
    let reload = spawn_signal_handler(shutdown.clone())?;
    config::prepare_state_dir(&settings.state_dir)?;
    // Settle the directory now, so that a bad one is reported before anything starts; with every GPU served
    // through DRA the device plugin never registers, and the kubelet's device plugin directory is not needed.
    let dra_only = settings.dra.as_ref().is_some_and(|d| {
        matches!(
            d.gpus,
            gpu_device_plugin::devices::selection::DraSelection::All
        )
    });
    if !dra_only {
        kubelet::socket_path_for(&plugin_config(&settings, &settings.resource_name))?;
    }

    let Some(source) = open_source(&settings, &shutdown).await? else {
        // SIGTERM (or a SIGHUP whose config loads) while NVML was loading.
        if reload.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(Stopped::Reload);
        }
        tracing::info!("stopped while NVML was loading");
        return Ok(Stopped::Shutdown);
    };
    log_start(&settings, source.driver_version());
    let metrics = Arc::new(Metrics::new());
    let mut monitor_config = settings.monitor.clone();
    monitor_config.metrics = metrics.clone();
    let monitored = monitor::spawn_monitored(source, monitor_config)
        .context("cannot start the device source")?;

    // One road per GPU: those served through DRA are not in the device plugin's view.
    let roads = Roads::split(&settings, &monitored.inventory, &monitored.unserved)?;
    let (plan, plugins) = plugins_for(&settings, &roads.device_plugin, &metrics)?;
    let links: Vec<_> = plugins.iter().map(|(p, _)| p.status.subscribe()).collect();

    // An unusable --kubeconfig stops the plugin here, before it registers; no API access at all is one line
    // and everything else goes on (but DRA, which cannot work without it).
    let api = ApiAccess::resolve(&settings.cluster).await?;
    let dra_status = settings.dra.as_ref().map(|dra| {
        tokio::sync::watch::Sender::new(gpu_device_plugin::dra::registration::DraStatus {
            driver: dra.driver.clone(),
            ..Default::default()
        })
    });
    let dra = match (&settings.dra, &roads.dra, &api, &dra_status) {
        // On a thread of its own; resolves when it stops.
        (Some(dra), Some(devices), Some(api), Some(status)) => Some(
            gpu_device_plugin::dra::spawn(
                dra_config(&settings, dra, api),
                devices.clone(),
                Some(gpu_device_plugin::dra::view::Conditions {
                    monitor: monitored.handle.clone(),
                    devices: monitored.devices.follow(),
                }),
                api.client_config(),
                status.clone(),
                metrics.clone(),
                shutdown.clone(),
            )
            .context("cannot start the DRA side's thread")?,
        ),
        (Some(_), _, None, _) => bail!(
            "--dra needs the Kubernetes API (claims are read from it): run in a pod with a service account, \
             or give --kubeconfig"
        ),
        _ => None,
    };
    let pods = pod_resources(&settings, &plugins, &monitored);
    let api_stop = api.map(|api| {
        // The kubelet first: the API client starts once the first registration is accepted, or after a
        // couple of seconds without one. Health changes meanwhile are reported then.
        let kubelet = links.first().cloned();
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
                pods: pods.clone(),
                claims: dra_status.as_ref().map(|status| {
                    let users: Arc<dyn gpu_device_plugin::cluster::ClaimUsers> = Arc::new(
                        gpu_device_plugin::dra::claims::PreparedFor::new(status.subscribe()),
                    );
                    users
                }),
            },
            metrics.clone(),
            Some(fence::annotation::follower(monitored.handle.clone())),
        )
    });

    if let Some(heartbeat) = monitored.heartbeat.clone() {
        heartbeat.watch(settings.stuck_after);
    }
    let side = start_side_surfaces(
        &settings,
        &monitored,
        http::Context {
            devices: monitored.handle.clone(),
            kubelet: links,
            resources: plan,
            policy: gpu_device_plugin::http::status::PolicySummary::of(&settings.monitor.policy),
            event_thread: monitored.heartbeat.clone(),
            stuck_after: settings.stuck_after,
            metrics,
            pods,
            unserved: monitored.unserved.clone(),
            dra: settings
                .dra
                .as_ref()
                .zip(dra_status.as_ref())
                .map(|(dra, status)| http::DraSurface {
                    gpus: dra.gpus.clone(),
                    status: status.subscribe(),
                }),
        },
        &shutdown,
    )?;
    let failed = serve(plugins, dra, &shutdown).await;

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
    if reload.load(std::sync::atomic::Ordering::SeqCst) {
        return Ok(Stopped::Reload);
    }
    // Stopping for good (a rollback, the DaemonSet deleted): the node condition must not go on claiming
    // what nothing watches any more.
    if let Some(api_stop) = api_stop {
        api_stop.leave_condition(LEAVE_CONDITION).await;
    }
    tracing::info!("stopped");
    Ok(Stopped::Shutdown)
}

/// How long loading and initialising NVML may take. The driver answers in seconds on a node of eight GPUs;
/// a load that does not end (a library on a hung mount, a driver that never answers `nvmlInit`) is then
/// taken as NVML not loading, as `--fail-on-init-error` says.
const NVML_LOAD_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Loads NVML on a thread of its own, for at most [`NVML_LOAD_LIMIT`], while SIGTERM is answered: `None`
/// when the plugin is told to stop meanwhile.
async fn open_nvml(
    settings: &Settings,
    shutdown: &CancellationToken,
) -> Option<Result<NvmlGpus, NvmlInitError>> {
    let library = gpu_device_plugin::util::text::shown(
        &settings.nvml.library.to_string_lossy(),
        gpu_device_plugin::util::text::SHOWN_MAX,
    );
    let failed = |cause: String| NvmlInitError::Load {
        library: library.clone(),
        cause,
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let options = settings.nvml.clone();
    let started = std::thread::Builder::new()
        .name("nvml-load".into())
        .spawn(move || {
            let _gave_up = tx.send(NvmlGpus::open(options));
        });
    if let Err(e) = started {
        return Some(Err(failed(format!(
            "cannot start a thread to load it: {e}"
        ))));
    }
    tokio::select! {
        loaded = tokio::time::timeout(NVML_LOAD_LIMIT, rx) => Some(match loaded {
            Ok(Ok(opened)) => opened,
            Ok(Err(_)) => Err(failed("its loading thread ended without an answer".into())),
            Err(_) => Err(failed(format!(
                "loading and initialising it took more than {} s",
                NVML_LOAD_LIMIT.as_secs()
            ))),
        }),
        () = shutdown.cancelled() => None,
    }
}

/// Where the GPUs come from: simulated GPUs when asked, else NVML; without NVML, the driver's GPUs unmonitored
/// or a refusal to start, as `--fail-on-init-error` says. `None` when the plugin is told to stop while NVML
/// loads.
async fn open_source(
    settings: &Settings,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<Box<dyn DeviceSource>>> {
    if let Some(count) = settings.simulate {
        // The control handle is for tests; from the command line faults come from the fault script.
        let (gpus, _control) = SimulatedGpus::new(count);
        return Ok(Some(match &settings.simulate_events {
            Some(script) => Box::new(gpus.with_fault_script(script)),
            None => Box::new(gpus),
        }));
    }
    let Some(opened) = open_nvml(settings, shutdown).await else {
        return Ok(None);
    };
    Ok(Some(match opened {
        Ok(gpus) => Box::new(gpus),
        Err(e) if settings.fail_on_init_error => {
            bail!("{e}; set --fail-on-init-error=false to serve the driver's GPUs unmonitored")
        }
        Err(e) => {
            tracing::warn!(error = %e, "NVML unavailable; serving the driver's GPUs unmonitored");
            Box::new(UnmonitoredGpus::from_procfs(&settings.nvml, e.to_string()))
        }
    }))
}

/// Each resource's registration settings, with the view of the inventory it lists.
type Plugins = Vec<(PluginConfig, devices::InventoryWatch)>;

/// The devices each road serves: the device plugin's view, and DRA's when it is on. A GPU is in one of them.
struct Roads {
    device_plugin: devices::InventoryWatch,
    dra: Option<devices::InventoryWatch>,
}

impl Roads {
    /// Splits the inventory by `--dra`; a selection naming a GPU the node does not have stops the start.
    fn split(
        settings: &Settings,
        inventory: &devices::InventoryWatch,
        unserved: &[devices::Unserved],
    ) -> anyhow::Result<Roads> {
        let Some(dra) = &settings.dra else {
            return Ok(Roads {
                device_plugin: inventory.clone(),
                dra: None,
            });
        };
        dra.gpus
            .check(&inventory.borrow(), unserved)
            .map_err(|why| anyhow::anyhow!("{why}"))?;
        let (mine, theirs) = (dra.gpus.clone(), dra.gpus.clone());
        // Every GPU through DRA: the monitor's own inventory, so that a fault wakes the DRA side as it is
        // published, not once a task on the monitor's thread has copied it out.
        let dra_devices = match dra.gpus {
            devices::selection::DraSelection::All => inventory.clone(),
            _ => devices::subset_watch(inventory.clone(), move |i| theirs.serves(i)),
        };
        Ok(Roads {
            device_plugin: devices::subset_watch(inventory.clone(), move |i| !mine.serves(i)),
            dra: Some(dra_devices),
        })
    }
}

/// The DRA side's settings: the node's pool, the CDI kind Allocate uses, the state directory and boot id the
/// health checkpoint uses.
fn dra_config(
    settings: &Settings,
    dra: &config::DraSettings,
    api: &ApiAccess,
) -> gpu_device_plugin::dra::DraConfig {
    gpu_device_plugin::dra::DraConfig {
        driver: dra.driver.clone(),
        registry_dir: dra.registry_dir.clone(),
        plugins_dir: dra.plugins_dir.clone(),
        pool: api.node().to_string(),
        cdi_kind: settings.allocate.cdi_kind.clone(),
        state_dir: settings.state_dir.clone(),
        boot_id: monitor::checkpoint::read_boot_id(&settings.monitor.boot_id_path),
        heartbeat: gpu_device_plugin::dra::health::HEARTBEAT,
        pod_uid: dra.pod_uid.clone(),
    }
}

/// One registration per resource: whole GPUs, under migStrategy mixed each MIG profile, and each name shared
/// devices are served under; each with its socket, its view of the inventory, and its device list checked
/// against the kubelet's message limit.
fn plugins_for(
    settings: &Settings,
    inventory: &devices::InventoryWatch,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<(Arc<ResourcePlan>, Plugins)> {
    let (plan, warnings) = plan_resources(settings, &inventory.borrow())?;
    let plan = Arc::new(plan);
    // Every GPU served through DRA: the device plugin does not register (a resource with no device would
    // still be one the scheduler counts on this node).
    if settings.dra.is_some() && inventory.borrow().is_empty() {
        return Ok((plan, Vec::new()));
    }
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    let several = plan.resources().len() > 1;
    let mut plugins = Vec::new();
    for (position, served) in plan.resources().iter().enumerate() {
        let mut plugin = plugin_config(settings, &served.name);
        plugin.allocate.naming = served.naming.clone();
        plugin.allocate.mps = match (&settings.mps_root, served.mps) {
            (Some(root), true) => Some(MpsDirs::new(root, &served.name)),
            _ => None,
        };
        if position > 0 {
            plugin.socket_name = settings
                .socket_name
                .as_ref()
                .map(|n| socket_name_for(n, &served.name));
        }
        let socket = kubelet::socket_path_for(&plugin)?;
        plugin.socket_name = socket.file_name().map(|n| n.to_string_lossy().into_owned());
        plugin.metrics = metrics.clone();
        let inventory = if several {
            let plan = plan.clone();
            devices::subset_watch(inventory.clone(), move |info| plan.serves(position, info))
        } else {
            inventory.clone()
        };
        let size = kubelet::server::check_list_size(
            &served.name,
            &inventory.borrow(),
            &plugin.allocate.naming,
        )?;
        tracing::debug!(resource = %served.name, bytes = size, "largest device list");
        plugins.push((plugin, inventory));
    }
    Ok((plan, plugins))
}

/// The kubelet's pod-resources client for every resource served, unless turned off.
fn pod_resources(
    settings: &Settings,
    plugins: &Plugins,
    monitored: &monitor::Monitored,
) -> Option<Arc<PodResources>> {
    let socket = settings.pod_resources_socket.as_ref()?;
    let (first, others) = plugins.split_first()?;
    let mut pods = PodResources::new(socket, first.0.resource_name.clone())
        .with_naming(first.0.allocate.naming.clone(), monitored.inventory.clone());
    for (plugin, _) in others {
        pods = pods.with_resource(
            plugin.resource_name.clone(),
            plugin.allocate.naming.clone(),
            monitored.inventory.clone(),
        );
    }
    Some(Arc::new(pods))
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
    plugins: Plugins,
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

/// One line at start with what is asked first when a node misbehaves: the version, the driver, how devices
/// are handed to containers and the health policy in force.
fn log_start(settings: &Settings, driver: Option<String>) {
    let allocate = &settings.allocate;
    let mut lists = Vec::new();
    if allocate.volume_mounts {
        lists.push("volume-mounts");
    } else if allocate.envvar {
        lists.push("envvar");
    }
    if allocate.cdi_annotations.is_some() {
        lists.push("cdi-annotations");
    }
    if allocate.cdi {
        lists.push("cdi-cri");
    }
    let driver = match (driver, settings.simulate) {
        (Some(version), _) => version,
        (None, Some(_)) => "none (simulated GPUs)".into(),
        (None, None) => "unknown".into(),
    };
    let policy = gpu_device_plugin::http::status::PolicySummary::of(&settings.monitor.policy);
    tracing::info!(
        version = %env!("CARGO_PKG_VERSION"),
        driver = %driver,
        resource = %settings.resource_name,
        mig_strategy = %settings.nvml.mig_strategy,
        device_list_strategy = %lists.join(","),
        device_id_strategy = %match allocate.naming.ids {
            gpu_device_plugin::devices::naming::IdStrategy::Uuid => "uuid",
            gpu_device_plugin::devices::naming::IdStrategy::Index => "index",
        },
        device_specs = allocate.device_specs,
        xid_policy = %policy.xid_policy,
        dp_disable_healthchecks = policy.dp_disable_healthchecks.as_deref(),
        dp_enable_healthchecks = policy.dp_enable_healthchecks.as_deref(),
        quiet_period = %policy.quiet_period,
        dra = %settings
            .dra
            .as_ref()
            .map_or("off".to_string(), |d| format!("{} as {}", d.gpus, d.driver)),
        "gpu-device-plugin starting"
    );
}

/// The kubelet side's settings for `resource`.
fn plugin_config(settings: &Settings, resource: &str) -> PluginConfig {
    let mut plugin = PluginConfig::new(&settings.kubelet_dir, resource);
    plugin.socket_name = settings.socket_name.clone();
    plugin.allocate = settings.allocate.clone();
    plugin.pre_start_check = settings.pre_start_check;
    plugin
}

/// `--socket-name` for another resource of the process: `<stem>-<resource without domain>.sock`.
fn socket_name_for(name: &str, resource: &str) -> String {
    let stem = name.strip_suffix(".sock").unwrap_or(name);
    let short = resource.rsplit('/').next().unwrap_or(resource);
    format!("{stem}-{short}.sock")
}

/// SIGTERM (the kubelet stopping the pod) and SIGINT (Ctrl-C) both start a clean shutdown. SIGHUP (config
/// reloaders) reads the config again: one that does not load is refused with one error line and the plugin
/// goes on as it is; one that loads stops the plugin cleanly and the returned flag says to start it again.
///
/// The new config is read and checked in a process of its own at a lower priority (see
/// [`config::reload`]), never on this runtime, which carries faults to the kubelet: a huge or pathological
/// file costs that process alone, which is refused and killed past [`RELOAD_CHECK_LIMIT`], and SIGTERM is
/// answered meanwhile. One check runs at a time; a SIGHUP during one is said and ignored.
fn spawn_signal_handler(
    shutdown: CancellationToken,
) -> anyhow::Result<Arc<std::sync::atomic::AtomicBool>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("cannot install the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot install the SIGINT handler")?;
    let mut hup = signal(SignalKind::hangup()).context("cannot install the SIGHUP handler")?;
    let reload = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reloading = reload.clone();
    tokio::spawn(async move {
        // The check of the config a SIGHUP asked for, while one runs: never more than one at a time.
        let mut checking: Option<ConfigCheck> = None;
        loop {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
                _ = hup.recv() => {
                    if checking.is_some() {
                        tracing::warn!(signal = "SIGHUP", "the config of an earlier SIGHUP is still being read; this one is ignored");
                        continue;
                    }
                    checking = Some(Box::pin(config::reload::check_in_child(reload_check(), RELOAD_CHECK_LIMIT)));
                    continue;
                }
                outcome = config_checked(&mut checking) => {
                    checking = None;
                    match outcome {
                        Ok(()) => {
                            tracing::info!(signal = "SIGHUP", "config loads; restarting with it");
                            reloading.store(true, std::sync::atomic::Ordering::SeqCst);
                            shutdown.cancel();
                            return;
                        }
                        Err(e) => tracing::error!(signal = "SIGHUP", "new config refused, the running one is kept: {e}"),
                    }
                    continue;
                }
            };
            tracing::info!(signal = name, "shutting down");
            shutdown.cancel();
            return;
        }
    });
    Ok(reload)
}

/// How long reading and checking the config after a SIGHUP may take before it is refused and its process
/// killed.
const RELOAD_CHECK_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// This process's own binary, run as `reload-check` with this process's arguments (its environment is
/// inherited): the same settings a restart would read.
fn reload_check() -> tokio::process::Command {
    let mut command = tokio::process::Command::new("/proc/self/exe");
    command
        .arg(config::reload::SUBCOMMAND)
        .args(std::env::args_os().skip(1));
    command
}

/// `gpu-device-plugin reload-check [FLAGS]` (hidden; the plugin runs it on SIGHUP): loads the settings
/// these flags and this environment give, at a lower priority, and exits non-zero with the one line a
/// start would give when they do not load.
fn reload_check_command() -> ExitCode {
    gpu_device_plugin::util::runtime::lower_priority();
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    argv.remove(1);
    match settings_or_exit(&argv) {
        Ok(_) => ExitCode::SUCCESS,
        Err(exit) => exit,
    }
}

/// A config check in progress: whether the config loads, or why not in one line.
type ConfigCheck = std::pin::Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

/// The outcome of the config check in progress; pending while there is none.
async fn config_checked(checking: &mut Option<ConfigCheck>) -> Result<(), String> {
    match checking {
        Some(check) => check.await,
        None => std::future::pending().await,
    }
}

/// `gpu-device-plugin status`: a running agent's devices, as a table or JSON.
#[derive(Debug, clap::Parser)]
#[command(
    name = "gpu-device-plugin status",
    about = "Show a running gpu-device-plugin's devices, their health and messages"
)]
struct StatusArgs {
    /// The agent's --http-addr
    #[arg(long, default_value = http::DEFAULT_ADDR, value_name = "HOST:PORT")]
    addr: String,
    /// Print the report as JSON (for scripts)
    #[arg(long)]
    json: bool,
    /// Keep following: print the report again whenever it changes (every 2 s at most)
    #[arg(long)]
    watch: bool,
}

#[derive(Debug, clap::Parser)]
#[command(
    name = "gpu-device-plugin fence",
    about = "Take a GPU (or every MIG device of a GPU) out of service until it is released: the running plugin \
             lists it Unhealthy with the reason, and keeps it so across restarts and reboots"
)]
struct FenceArgs {
    /// The GPU or MIG device UUID, or its NVML index as nvidia-smi shows it (a GPU's UUID or index fences
    /// all its MIG devices)
    device: String,
    /// Why, as operators will read it in the device's message (required; asked for by the plugin, so that
    /// its refusal names the command that works)
    #[arg(long)]
    reason: Option<String>,
    /// The running plugin's --state-dir (its control socket is there)
    #[arg(long, env = "GPU_DEVICE_PLUGIN_STATE_DIR", default_value = config::DEFAULT_STATE_DIR, value_name = "DIR")]
    state_dir: std::path::PathBuf,
}

#[derive(Debug, clap::Parser)]
#[command(
    name = "gpu-device-plugin release",
    about = "Put a fenced GPU back in service, or clear one condition stuck on a repaired GPU (--condition)"
)]
struct ReleaseArgs {
    /// The GPU or MIG device UUID, or its NVML index as nvidia-smi shows it
    device: String,
    /// Why (logged with who released it)
    #[arg(long)]
    reason: Option<String>,
    /// The condition to clear instead of the fence: xid-<N>, ecc-dbe, gpu-lost, ecc-sbe-burst,
    /// recovery-action, unmonitored (a `recover: never` one is logged at warn level)
    #[arg(long, value_name = "CONDITION")]
    condition: Option<String>,
    /// The running plugin's --state-dir (its control socket is there)
    #[arg(long, env = "GPU_DEVICE_PLUGIN_STATE_DIR", default_value = config::DEFAULT_STATE_DIR, value_name = "DIR")]
    state_dir: std::path::PathBuf,
}

/// How a command ends on a command-line error: one line and a failure, or the help or version printed.
fn usage_exit(error: &clap::Error) -> ExitCode {
    if error.use_stderr() {
        let argv: Vec<_> = std::env::args_os().skip(1).collect();
        return fail(&config::usage_error_line(error, &argv));
    }
    let _printed = error.print();
    ExitCode::SUCCESS
}

/// The one-thread runtime a command (`status`, `fence`, `release`) runs on.
fn command_runtime() -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| fail(&format!("cannot start the async runtime: {e}")))
}

/// `gpu-device-plugin fence` and `release`: one request to the running plugin's control socket.
fn control_command(fence: bool) -> ExitCode {
    use clap::Parser as _;
    let argv = subcommand_argv();
    let parsed = if fence {
        FenceArgs::try_parse_from(argv).map(|a| {
            let request = gpu_device_plugin::fence::control::ControlRequest {
                device: a.device,
                reason: a.reason,
                ..Default::default()
            };
            (a.state_dir, request)
        })
    } else {
        ReleaseArgs::try_parse_from(argv).map(|a| {
            let request = gpu_device_plugin::fence::control::ControlRequest {
                device: a.device,
                reason: a.reason,
                condition: a.condition,
                ..Default::default()
            };
            (a.state_dir, request)
        })
    };
    let (state_dir, mut request) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => return usage_exit(&e),
    };
    request.user = ["SUDO_USER", "USER", "LOGNAME"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|u| !u.is_empty()));
    let runtime = match command_runtime() {
        Ok(runtime) => runtime,
        Err(exit) => return exit,
    };
    match runtime.block_on(gpu_device_plugin::fence::control::send(
        &state_dir, fence, &request,
    )) {
        Ok(devices) => {
            let done = if fence { "fenced" } else { "released" };
            for device in devices {
                println!("{done} {}: {}", device.id, device.health);
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e.to_string()),
    }
}

/// `gpu-device-plugin check-config [FILE] [FLAGS]`: the settings a start with the same file, flags and
/// environment would run with, and every warning, without starting; a refusal exits non-zero with the same
/// line a start would give. No GPU is touched unless asked: with `--simulate N` or `--nvml-lib`, the GPUs
/// are discovered and the resources planned on them (sharing, MIG, the kubelet's message-size limit).
fn check_config_command() -> ExitCode {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    argv.remove(1);
    if argv.iter().skip(1).any(|a| a == "--help" || a == "-h") {
        println!(
            "Usage: gpu-device-plugin check-config [FILE] [OPTIONS]\n\n\
             Prints the settings a start with this config file (ours or NVIDIA's), these flags and this\n\
             environment would run with, and every warning; exits non-zero with the reason when a start\n\
             would be refused. Takes every option the plugin takes (see gpu-device-plugin --help). GPUs are\n\
             planned against only with --simulate N or --nvml-lib PATH."
        );
        return ExitCode::SUCCESS;
    }
    if let Some(first) = argv.get(1)
        && !first.to_string_lossy().starts_with('-')
    {
        let file = argv.remove(1);
        argv.splice(1..1, ["--config".into(), file]);
    }
    let asked = |flag: &str, env: &str| {
        argv.iter().any(|a| {
            a.to_str()
                .is_some_and(|a| a == flag || a.starts_with(&format!("{flag}=")))
        }) || std::env::var_os(env).is_some_and(|v| !v.is_empty())
    };
    let with_gpus = asked("--simulate", "GPU_DEVICE_PLUGIN_SIMULATE")
        || asked("--nvml-lib", "GPU_DEVICE_PLUGIN_NVML_LIB");
    let settings = match settings_or_exit(&argv) {
        Ok(settings) => settings,
        Err(exit) => return exit,
    };
    print!("{}", settings.describe());
    for warning in &settings.warnings {
        println!("warning: {warning}");
    }
    if !with_gpus {
        println!(
            "(no GPUs looked at: give --simulate N or --nvml-lib PATH to plan the resources on GPUs)"
        );
        return ExitCode::SUCCESS;
    }
    match plan_on_gpus(&settings) {
        Ok(lines) => {
            print!("{lines}");
            ExitCode::SUCCESS
        }
        Err(e) => fail(&one_line(&e)),
    }
}

/// The resources `settings` serve `inventory` under, and the plan's warnings.
fn plan_resources(
    settings: &Settings,
    inventory: &devices::Inventory,
) -> Result<(ResourcePlan, Vec<String>), gpu_device_plugin::devices::resources::PlanError> {
    let natural = ResourceNaming {
        strategy: settings.nvml.mig_strategy,
        base: settings.resource_name.clone(),
    };
    ResourcePlan::build(
        &natural,
        settings.allocate.naming.ids,
        settings.sharing.as_ref(),
        inventory,
    )
}

/// The resources `settings` would serve on this node's GPUs (or simulated ones), one line each, with the
/// plan's warnings; an error where a start would be refused.
fn plan_on_gpus(settings: &Settings) -> anyhow::Result<String> {
    let mut source: Box<dyn DeviceSource> = match settings.simulate {
        Some(count) => Box::new(SimulatedGpus::new(count).0),
        None => Box::new(NvmlGpus::open(settings.nvml.clone())?),
    };
    let found = devices::Inventory::new(source.discover()?);
    let mut out = format!("devices found: {}\n", found.len());
    // One road per GPU: the device plugin plans what DRA does not serve.
    let inventory = match &settings.dra {
        Some(dra) => {
            dra.gpus
                .check(&found, &source.unserved())
                .map_err(|why| anyhow::anyhow!("{why}"))?;
            let through_dra = found.subset(|i| dra.gpus.serves(i), None);
            let names: Vec<String> = through_dra
                .devices()
                .iter()
                .map(|d| gpu_device_plugin::dra::names::device_name(&d.info))
                .collect();
            out.push_str(&format!(
                "serves through DRA as {}: {} devices ({})\n",
                dra.driver,
                names.len(),
                names.join(", ")
            ));
            found.subset(|i| !dra.gpus.serves(i), None)
        }
        None => found,
    };
    if settings.dra.is_some() && inventory.is_empty() {
        out.push_str("the device plugin does not register: every GPU is served through DRA\n");
        return Ok(out);
    }
    let (plan, warnings) = plan_resources(settings, &inventory)?;
    for (position, served) in plan.resources().iter().enumerate() {
        let subset = inventory.subset(|info| plan.serves(position, info), None);
        let devices = subset.len();
        kubelet::server::check_list_size(&served.name, &subset, &served.naming)?;
        let listed = kubelet::server::list_response(&subset, &served.naming)
            .devices
            .len();
        out.push_str(&format!(
            "serves {}: {devices} devices, {listed} listed to the kubelet\n",
            served.name
        ));
    }
    for warning in warnings {
        // A plan's warning may quote every entry of a list from the file.
        out.push_str(&format!(
            "warning: {}\n",
            gpu_device_plugin::util::text::shown(&warning, gpu_device_plugin::util::text::LINE_MAX)
        ));
    }
    Ok(out)
}

/// A subcommand's arguments for its parser, whose usage then reads `gpu-device-plugin <subcommand> ...`.
fn subcommand_argv() -> Vec<std::ffi::OsString> {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    if let Some(first) = argv.first_mut() {
        let mut named = std::ffi::OsString::from("gpu-device-plugin ");
        named.push(&*first);
        *first = named;
    }
    argv
}

fn status_command() -> ExitCode {
    use clap::Parser as _;
    let args = match StatusArgs::try_parse_from(subcommand_argv()) {
        Ok(args) => args,
        Err(e) => return usage_exit(&e),
    };
    let runtime = match command_runtime() {
        Ok(runtime) => runtime,
        Err(exit) => return exit,
    };
    runtime.block_on(async {
        let mut last = None;
        loop {
            let report = match http::fetch_report(&args.addr).await {
                Ok(report) => report,
                Err(e) => return fail(&e.to_string()),
            };
            if last.as_ref() != Some(&report) {
                let text = if args.json {
                    serde_json::to_string_pretty(&report).unwrap_or_default() + "\n"
                } else {
                    report.table()
                };
                if last.is_some() {
                    println!("---");
                }
                print!("{text}");
                last = Some(report);
            }
            if !args.watch {
                return ExitCode::SUCCESS;
            }
            tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        }
    })
}
