//! The settings the plugin runs with, resolved phase by phase from the flags, the environment, the config
//! file and NVIDIA's flags and variables.

use super::*;

/// Checked settings the plugin runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Kubelet device plugin directory.
    pub kubelet_dir: PathBuf,
    /// Extended resource name of whole GPUs (before sharing renames it).
    pub resource_name: String,
    /// Which devices are shared, and how (NVIDIA's `sharing` section).
    pub sharing: Option<nvidia::Sharing>,
    /// With MPS sharing: the MPS control daemon's root on the host.
    pub mps_root: Option<PathBuf>,
    /// The plugin's state directory; exists and is writable.
    pub state_dir: PathBuf,
    /// Log format.
    pub log_format: LogFormat,
    /// Number of simulated GPUs, if simulating.
    pub simulate: Option<usize>,
    /// Fault script the simulated GPUs follow.
    pub simulate_events: Option<PathBuf>,
    /// Fixed socket name, if any.
    pub socket_name: Option<String>,
    /// Where NVML and the kernel's GPU views are.
    pub nvml: NvmlOptions,
    /// Whether an NVML that cannot be loaded stops the plugin.
    pub fail_on_init_error: bool,
    /// Health policy, checkpoint location and boot id.
    pub monitor: MonitorConfig,
    /// Allocate response options.
    pub allocate: AllocateOptions,
    /// Whether the kubelet calls PreStartContainer (the health gate) before each container start.
    pub pre_start_check: bool,
    /// Where the HTTP surfaces listen; `None` turns them off.
    pub http_addr: Option<std::net::SocketAddr>,
    /// How long a GPU's NVML event thread may go silent before `/healthz` calls it stuck.
    pub stuck_after: std::time::Duration,
    /// The kubelet's pod-resources socket; `None` turns the lookup off.
    pub pod_resources_socket: Option<PathBuf>,
    /// Where detectors' fence reports are read from, if anywhere.
    pub fence_dir: Option<PathBuf>,
    /// The Kubernetes API side.
    pub cluster: crate::cluster::ClusterConfig,
    /// The GPUs served through DRA, and how; `None` when every GPU goes through the device plugin.
    pub dra: Option<DraSettings>,
    /// Settings read and ignored (keys of NVIDIA's config file it ignores too), one line each, for the log.
    pub warnings: Vec<String>,
}

/// How GPUs are served through DRA.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraSettings {
    /// Which GPUs.
    pub gpus: crate::devices::selection::DraSelection,
    /// The driver name.
    pub driver: String,
    /// The kubelet's plugin registration directory.
    pub registry_dir: PathBuf,
    /// The kubelet's DRA plugins directory.
    pub plugins_dir: PathBuf,
    /// The pod's UID the sockets are named after, if given.
    pub pod_uid: Option<String>,
}

impl Settings {
    /// Merges flags/environment over the config file over defaults, and checks the result. The phases run
    /// in the order below, and the first setting refused is the one reported.
    pub fn resolve(args: Args) -> Result<Self, ConfigError> {
        let nvidia::Loaded {
            file,
            nvidia: nvidia_file,
            mut warnings,
        } = read_config_file(&args)?;
        let nvidia = merge_nvidia(&args, nvidia_file, &mut warnings)?;
        let kubelet = kubelet_settings(&args, &file, &nvidia)?;
        let trying_out = trying_out_settings(&args, &file)?;
        let gpus = gpu_and_health_settings(&args, &file, &nvidia)?;
        let allocate = allocate_settings(&args, &file, &nvidia, &mut warnings)?;
        let surfaces = surface_settings(&args, &file)?;
        let dra = dra_settings(&args, &file, &surfaces.cluster)?;
        let mut nvml = gpus.nvml;
        nvml.dra = dra.as_ref().map(|d| d.gpus.clone());
        if dra.is_some() && nvidia.applied.sharing.is_some() {
            warnings.push(
                "sharing (time-slicing, MPS) applies to the GPUs served through the device plugin only; \
                 GPUs served through DRA are handed out whole"
                    .into(),
            );
        }
        Ok(Settings {
            kubelet_dir: kubelet.dir,
            resource_name: kubelet.resource_name,
            sharing: nvidia.applied.sharing,
            mps_root: nvidia.applied.mps_root,
            state_dir: gpus.state_dir,
            log_format: surfaces.log_format,
            simulate: trying_out.simulate,
            simulate_events: trying_out.simulate_events,
            socket_name: trying_out.socket_name,
            nvml,
            fail_on_init_error: gpus.fail_on_init_error,
            monitor: gpus.monitor,
            allocate,
            pre_start_check: kubelet.pre_start_check,
            http_addr: surfaces.http_addr,
            stuck_after: surfaces.stuck_after,
            pod_resources_socket: kubelet.pod_resources_socket,
            fence_dir: surfaces.fence_dir,
            cluster: surfaces.cluster,
            dra,
            // Warnings name keys and values from the file: each one line, as itself, in the log and
            // check-config alike.
            warnings: warnings.iter().map(|w| shown(w, LINE_MAX)).collect(),
        })
    }

    /// Parses `argv` (with the environment) and resolves it. Clap's own errors (unknown flag, bad value)
    /// come back as `Err(clap::Error)` for the caller to print.
    pub fn from_args<I, T>(argv: I) -> Result<Result<Self, ConfigError>, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        Ok(Settings::resolve(Args::try_parse_from(argv)?))
    }
}

/// NVIDIA's settings as this plugin runs them, and what NVIDIA's flags and variables say about settings of
/// ours.
pub(super) struct Nvidia {
    /// NVIDIA's flags over its config file, checked.
    applied: nvidia::Applied,
    /// The directory of `--kubelet-socket`, under `--kubelet-dir` and over the file's.
    kubelet_dir: Option<PathBuf>,
    /// Where the host's driver root is mounted in this container: NVML and IMEX channels are looked for
    /// under it.
    container_driver_root: PathBuf,
    /// NVIDIA's `FAIL_ON_INIT_ERROR`, under `--fail-on-init-error` and over the file's.
    fail_on_init_error: Option<bool>,
}

/// Decides NVIDIA's settings: its flags and variables over its config file, checked by [`nvidia::apply`].
/// Its `--kubelet-socket` must agree with our `--kubelet-dir`, since both name the kubelet's directory.
/// Warnings go to `warnings`: NVIDIA's settings that have no effect here, then those `apply` gives.
pub(super) fn merge_nvidia(
    args: &Args,
    from_file: nvidia::NvidiaSettings,
    warnings: &mut Vec<String>,
) -> Result<Nvidia, ConfigError> {
    let flags = &args.nvidia;
    warnings.extend(flags.without_effect());
    let kubelet_dir = kubelet_dir_of_socket(flags.kubelet_socket.as_deref().map(Path::new))?;
    if let (Some(dir), Some(from_socket)) = (&args.kubelet_dir, &kubelet_dir)
        && dir != from_socket
    {
        return Err(ConfigError::Invalid {
            setting: "--kubelet-socket (KUBELET_SOCKET)",
            value: from_socket
                .join(crate::api::KUBELET_SOCKET)
                .display()
                .to_string(),
            why: format!(
                "not in the kubelet directory given by --kubelet-dir ({}); give one of them",
                dir.display()
            ),
        });
    }
    let container_driver_root = flags
        .driver_root_ctr_path
        .clone()
        .or_else(|| {
            std::env::var_os("CONTAINER_DRIVER_ROOT")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        })
        .or_else(|| from_file.container_driver_root.clone().map(PathBuf::from))
        .filter(|root| !root.as_os_str().is_empty())
        .unwrap_or_else(|| DEFAULT_CONTAINER_DRIVER_ROOT.into());
    // NVML and the IMEX channels are looked for under it: a relative path would be taken from wherever the
    // process runs, as a relative nvidiaDriverRoot would on the host.
    if !container_driver_root.is_absolute() {
        return Err(ConfigError::Invalid {
            setting: "containerDriverRoot (--driver-root-ctr-path, DRIVER_ROOT_CTR_PATH, CONTAINER_DRIVER_ROOT)",
            value: container_driver_root.to_string_lossy().into_owned(),
            why: "must be an absolute path in this container, e.g. /driver-root".into(),
        });
    }
    let imex_ids = imex_channel_ids(&flags.imex_channel_ids)?;
    let fail_on_init_error = match std::env::var("FAIL_ON_INIT_ERROR") {
        Ok(value) => Some(parse_go_bool(&value).map_err(|why| ConfigError::Invalid {
            setting: "FAIL_ON_INIT_ERROR",
            value,
            why,
        })?),
        Err(_) => None,
    };
    let applied = nvidia::apply(&flags.settings(&imex_ids).or(from_file))?;
    warnings.extend(applied.warnings.iter().cloned());
    Ok(Nvidia {
        applied,
        kubelet_dir,
        container_driver_root,
        fail_on_init_error,
    })
}

/// What the kubelet is told, and where.
pub(super) struct Kubelet {
    /// See [`Settings::kubelet_dir`].
    dir: PathBuf,
    /// See [`Settings::resource_name`].
    resource_name: String,
    /// See [`Settings::pre_start_check`].
    pre_start_check: bool,
    /// See [`Settings::pod_resources_socket`].
    pod_resources_socket: Option<PathBuf>,
}

/// Decides the kubelet side: its directory (`--kubelet-dir`, else NVIDIA's `--kubelet-socket`, else the
/// file), the resource name (checked as Kubernetes checks it), the PreStartContainer gate, and the
/// pod-resources socket (empty turns the lookup off).
pub(super) fn kubelet_settings(
    args: &Args,
    file: &FileConfig,
    nvidia: &Nvidia,
) -> Result<Kubelet, ConfigError> {
    let resource_name = args
        .resource_name
        .clone()
        .or_else(|| file.resource_name.clone())
        .unwrap_or_else(|| DEFAULT_RESOURCE_NAME.into());
    check_extended_resource_name(&resource_name)?;
    Ok(Kubelet {
        dir: args
            .kubelet_dir
            .clone()
            .or_else(|| nvidia.kubelet_dir.clone())
            .or_else(|| file.kubelet_dir.clone())
            .unwrap_or_else(|| DEFAULT_KUBELET_DIR.into()),
        resource_name,
        pre_start_check: args
            .pre_start_check
            .or(file.pre_start_check)
            .unwrap_or(true),
        pod_resources_socket: match args
            .pod_resources_socket
            .clone()
            .map(PathBuf::from)
            .or_else(|| file.pod_resources_socket.clone())
        {
            Some(path) if path.as_os_str().is_empty() => None,
            Some(path) => Some(path),
            None => Some(crate::api::pod_resources::DEFAULT_SOCKET.into()),
        },
    })
}

/// The settings for trying the plugin out without a GPU, and for tests.
pub(super) struct TryingOut {
    /// See [`Settings::simulate`].
    simulate: Option<usize>,
    /// See [`Settings::simulate_events`].
    simulate_events: Option<PathBuf>,
    /// See [`Settings::socket_name`].
    socket_name: Option<String>,
}

/// Decides whether simulated GPUs are served and which fault script they follow (only simulated GPUs
/// follow one), and whether the socket has a fixed name.
pub(super) fn trying_out_settings(
    args: &Args,
    file: &FileConfig,
) -> Result<TryingOut, ConfigError> {
    let simulate = args.simulate.or(file.simulate);
    let simulate_events = args
        .simulate_events
        .clone()
        .or_else(|| file.simulate_events.clone());
    if let (Some(path), None) = (&simulate_events, simulate) {
        return Err(ConfigError::Invalid {
            setting: "--simulate-events",
            value: path.display().to_string(),
            why: "only simulated GPUs follow a fault script; add --simulate N".into(),
        });
    }
    let socket_name = args
        .socket_name
        .clone()
        .or_else(|| file.socket_name.clone());
    if let Some(name) = &socket_name {
        check_socket_name(name)?;
    }
    Ok(TryingOut {
        simulate,
        simulate_events,
        socket_name,
    })
}

/// How the GPUs are found and watched.
pub(super) struct GpusAndHealth {
    /// See [`Settings::state_dir`].
    state_dir: PathBuf,
    /// See [`Settings::nvml`].
    nvml: NvmlOptions,
    /// See [`Settings::fail_on_init_error`].
    fail_on_init_error: bool,
    /// See [`Settings::monitor`].
    monitor: MonitorConfig,
}

/// Decides where NVML and the kernel's GPU views are (NVML under the container driver root unless
/// `--nvml-lib` names one), whether an NVML that cannot be loaded stops the plugin (ours, then NVIDIA's
/// variable, then the file), and the health policy: the file's `health` section with NVIDIA's
/// `DP_DISABLE_HEALTHCHECKS` and `DP_ENABLE_HEALTHCHECKS` over it.
pub(super) fn gpu_and_health_settings(
    args: &Args,
    file: &FileConfig,
    nvidia: &Nvidia,
) -> Result<GpusAndHealth, ConfigError> {
    let state_dir = args
        .state_dir
        .clone()
        .or_else(|| file.state_dir.clone())
        .unwrap_or_else(|| DEFAULT_STATE_DIR.into());
    let policy = Policy::new(
        &file.health.clone().unwrap_or_default(),
        args.disable_healthchecks.as_deref(),
        args.enable_healthchecks.as_deref(),
    )
    .map_err(|e| ConfigError::Invalid {
        setting: if e.key.starts_with("DP_") {
            "environment variable"
        } else {
            "config key"
        },
        value: e.key,
        why: e.why,
    })?;
    let nvml_defaults = NvmlOptions::default();
    let or_file = |flag: &Option<PathBuf>, in_file: &Option<PathBuf>| {
        flag.clone().or_else(|| in_file.clone())
    };
    Ok(GpusAndHealth {
        nvml: NvmlOptions {
            mig_strategy: nvidia.applied.mig_strategy,
            library: or_file(&args.nvml_lib, &file.nvml_lib)
                .or_else(|| crate::sources::nvml::library_under(&nvidia.container_driver_root))
                .unwrap_or(nvml_defaults.library),
            sysfs_root: or_file(&args.sysfs_root, &file.sysfs_root)
                .unwrap_or(nvml_defaults.sysfs_root),
            proc_root: or_file(&args.proc_root, &file.proc_root).unwrap_or(nvml_defaults.proc_root),
            // Set once the DRA settings are read.
            dra: None,
        },
        fail_on_init_error: args
            .fail_on_init_error
            .or(nvidia.fail_on_init_error)
            .or(file.fail_on_init_error)
            .unwrap_or(true),
        monitor: MonitorConfig {
            policy,
            state_dir: Some(state_dir.clone()),
            boot_id_path: or_file(&args.boot_id_file, &file.boot_id_file)
                .unwrap_or_else(|| crate::monitor::checkpoint::DEFAULT_BOOT_ID_PATH.into()),
            metrics: crate::metrics::Metrics::off(),
        },
        state_dir,
    })
}

/// Decides how Allocate answers: NVIDIA's device list strategy and added variables; CDI names and device
/// specs (ours, then NVIDIA's `--pass-device-specs`, then the file); the dev root (defaulting to NVIDIA's
/// driver root) and host root, both absolute; and the IMEX channels found on this node, each missing one a
/// warning in `warnings` or, when required, a refused start.
pub(super) fn allocate_settings(
    args: &Args,
    file: &FileConfig,
    nvidia: &Nvidia,
    warnings: &mut Vec<String>,
) -> Result<AllocateOptions, ConfigError> {
    let defaults = AllocateOptions::default();
    let applied = &nvidia.applied;
    let mut allocate = AllocateOptions {
        envvar: applied.envvar,
        naming: applied.naming.clone(),
        volume_mounts: applied.volume_mounts,
        cdi_annotations: applied.cdi_annotations.clone(),
        cdi: args.cdi.or(file.cdi).unwrap_or(applied.cdi),
        cdi_kind: args
            .cdi_kind
            .clone()
            .or_else(|| file.cdi_kind.clone())
            .unwrap_or(defaults.cdi_kind),
        device_specs: args
            .device_specs
            .or(args.nvidia.pass_device_specs)
            .or(file.device_specs)
            .unwrap_or(defaults.device_specs),
        dev_root: args
            .nvidia
            .dev_root
            .clone()
            .or_else(|| file.dev_root.clone())
            .unwrap_or_else(|| applied.driver_root.clone()),
        extra_envs: applied.extra_envs.clone(),
        // Per resource, once the resources are known.
        mps: None,
        host_root: args
            .host_root
            .clone()
            .or_else(|| file.host_root.clone())
            .unwrap_or(defaults.host_root),
        // Once the roots are known, below.
        imex_channels: Vec::new(),
    };
    for (setting, dir) in [
        ("--dev-root", &allocate.dev_root),
        ("--host-root", &allocate.host_root),
    ] {
        if !dir.is_absolute() {
            return Err(ConfigError::Invalid {
                setting,
                value: dir.display().to_string(),
                why: "must be an absolute path".into(),
            });
        }
    }
    if allocate.cdi && !allocate.cdi_kind.contains('/') {
        return Err(ConfigError::Invalid {
            setting: "--cdi-kind",
            value: allocate.cdi_kind,
            why: "a CDI kind is vendor/class, e.g. nvidia.com/gpu".into(),
        });
    }
    allocate.imex_channels = find_imex_channels(
        &applied.imex_channel_ids,
        applied.imex_required,
        &[
            nvidia.container_driver_root.join("dev"),
            PathBuf::from("/dev"),
            crate::devices::allocation::under(&allocate.host_root, &allocate.dev_root.join("dev")),
        ],
        warnings,
    )?;
    Ok(allocate)
}

/// The roads that show health and the operator inputs.
pub(super) struct Surfaces {
    /// See [`Settings::log_format`].
    log_format: LogFormat,
    /// See [`Settings::stuck_after`].
    stuck_after: std::time::Duration,
    /// See [`Settings::fence_dir`].
    fence_dir: Option<PathBuf>,
    /// See [`Settings::cluster`].
    cluster: crate::cluster::ClusterConfig,
    /// See [`Settings::http_addr`].
    http_addr: Option<std::net::SocketAddr>,
}

/// Decides the log format; when `/healthz` calls an NVML event thread stuck (from 3s, which the event wait
/// itself may take, to the policy's longest duration); the fence directory, which must exist; the
/// Kubernetes API side (an empty kubeconfig or node name is none); and the HTTP address (empty is off).
/// The DRA settings: which GPUs, under which driver name, where the kubelet looks. DRA needs the API server
/// (claims are read from it, devices published in it) and the node's name (the pool is named after it).
pub(super) fn dra_settings(
    args: &Args,
    file: &FileConfig,
    cluster: &crate::cluster::ClusterConfig,
) -> Result<Option<DraSettings>, ConfigError> {
    let value = args
        .dra
        .clone()
        .or_else(|| file.dra.clone())
        .unwrap_or_default();
    let invalid = |why: String| ConfigError::Invalid {
        setting: "--dra (GPU_DEVICE_PLUGIN_DRA)",
        value: value.clone(),
        why,
    };
    let Some(gpus) = crate::devices::selection::DraSelection::parse(&value).map_err(invalid)?
    else {
        return Ok(None);
    };
    if !cluster.enabled {
        return Err(invalid(
            "DRA needs the Kubernetes API (claims are read from it, devices published in it), and \
             --kube-api is off"
                .into(),
        ));
    }
    if cluster.node_name.as_deref().is_none_or(str::is_empty) {
        return Err(invalid(
            "DRA needs the node's name (NODE_NAME, from the downward API spec.nodeName): devices are \
             published in a pool named after it"
                .into(),
        ));
    }
    let driver = args
        .dra_driver_name
        .clone()
        .or_else(|| file.dra_driver_name.clone())
        .unwrap_or_else(|| crate::dra::DEFAULT_DRIVER.to_string());
    if driver.len() > 63 || !crate::util::text::is_dns_subdomain(&driver) {
        return Err(ConfigError::Invalid {
            setting: "--dra-driver-name",
            value: driver,
            why: "a driver name is a DNS subdomain of at most 63 characters (e.g. gpu.example.com)"
                .into(),
        });
    }
    let dir = |flag: Option<&PathBuf>, file: Option<&PathBuf>, default: &str, setting| {
        let dir = flag
            .or(file)
            .cloned()
            .unwrap_or_else(|| PathBuf::from(default));
        if dir.is_absolute() {
            Ok(dir)
        } else {
            Err(ConfigError::Invalid {
                setting,
                value: dir.display().to_string(),
                why: "must be an absolute path".into(),
            })
        }
    };
    Ok(Some(DraSettings {
        gpus,
        driver,
        registry_dir: dir(
            args.kubelet_registrar_directory_path.as_ref(),
            file.kubelet_registrar_directory_path.as_ref(),
            crate::dra::DEFAULT_REGISTRY_DIR,
            "--kubelet-registrar-directory-path",
        )?,
        plugins_dir: dir(
            args.kubelet_plugins_directory_path.as_ref(),
            file.kubelet_plugins_directory_path.as_ref(),
            crate::dra::DEFAULT_PLUGINS_DIR,
            "--kubelet-plugins-directory-path",
        )?,
        pod_uid: pod_uid(args.dra_pod_uid.as_deref())?,
    }))
}

pub(super) fn surface_settings(args: &Args, file: &FileConfig) -> Result<Surfaces, ConfigError> {
    let stuck_after = match args.stuck_after.or(file.stuck_after) {
        Some(d) if d < std::time::Duration::from_secs(3) => {
            return Err(ConfigError::Invalid {
                setting: "--stuck-after",
                value: humantime::format_duration(d).to_string(),
                why: "must be at least 3s: the NVML event wait itself lasts up to 2s".into(),
            });
        }
        Some(d) if d > crate::health::policy::MAX_DURATION => {
            return Err(ConfigError::Invalid {
                setting: "--stuck-after",
                value: humantime::format_duration(d).to_string(),
                why: format!(
                    "must be at most {}",
                    humantime::format_duration(crate::health::policy::MAX_DURATION)
                ),
            });
        }
        Some(d) => d,
        None => std::time::Duration::from_secs(30),
    };
    let fence_dir = match args
        .fence_dir
        .clone()
        .or_else(|| file.fence_dir.clone())
        .filter(|d| !d.as_os_str().is_empty())
    {
        Some(dir) if !dir.is_dir() => {
            return Err(ConfigError::Invalid {
                setting: "fenceDir (--fence-dir, GPU_DEVICE_PLUGIN_FENCE_DIR)",
                value: dir.display().to_string(),
                why: "not a directory (detectors' reports are read from an existing one)".into(),
            });
        }
        dir => dir,
    };
    let cluster = crate::cluster::ClusterConfig {
        enabled: args.kube_api.or(file.kube_api).unwrap_or(true),
        kubeconfig: args
            .kubeconfig
            .clone()
            .map(PathBuf::from)
            .or_else(|| file.kubeconfig.clone())
            .filter(|p| !p.as_os_str().is_empty()),
        node_name: node_name(args.node_name.as_deref())?,
        budget: crate::cluster::EventBudget::default(),
    };
    let http_addr = parse_http_addr(
        args.http_addr
            .as_deref()
            .or(file.http_addr.as_deref())
            .unwrap_or(crate::http::DEFAULT_ADDR),
    )?;
    Ok(Surfaces {
        log_format: args
            .log_format
            .or(file.log_format)
            .unwrap_or(LogFormat::Text),
        stuck_after,
        fence_dir,
        cluster,
        http_addr,
    })
}
