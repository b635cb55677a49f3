//! Settings from the command line, the environment and the config file, checked once at start.
//!
//! Precedence: a flag, then its environment variable, then the `--config` file, then the default. Every
//! problem is one [`ConfigError`] naming the setting and the bad value.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::{Parser, ValueEnum};
use serde::Deserialize;

use crate::allocation::AllocateOptions;
use crate::health::checkpoint;
use crate::health::monitor::MonitorConfig;
use crate::health::{HealthConfig, Policy};
use crate::nvml::NvmlOptions;

pub mod nvidia;

/// Default kubelet device plugin directory.
pub const DEFAULT_KUBELET_DIR: &str = "/var/lib/kubelet/device-plugins";
/// Default resource name, the one NVIDIA's plugin serves.
pub const DEFAULT_RESOURCE_NAME: &str = "nvidia.com/gpu";
/// Default directory for the plugin's own state.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/gpu-device-plugin";

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log pipelines.
    Json,
}

/// Command line. Every flag can also be set from the environment variable named in its help.
#[derive(Debug, Parser)]
#[command(
    name = "gpu-device-plugin",
    version,
    about = "Kubernetes device plugin for NVIDIA GPUs",
    after_help = "`gpu-device-plugin status` shows a running plugin's devices, their health and messages \
                  (see `gpu-device-plugin status --help`)."
)]
pub struct Args {
    /// Kubelet device plugin directory [default: /var/lib/kubelet/device-plugins]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_KUBELET_DIR", value_name = "DIR")]
    pub kubelet_dir: Option<PathBuf>,

    /// Extended resource name to advertise [default: nvidia.com/gpu]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_RESOURCE_NAME", value_name = "NAME")]
    pub resource_name: Option<String>,

    /// Directory for the plugin's own state [default: /var/lib/gpu-device-plugin]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_STATE_DIR", value_name = "DIR")]
    pub state_dir: Option<PathBuf>,

    /// YAML config file; flags and environment variables override it
    #[arg(long, env = "GPU_DEVICE_PLUGIN_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Log format [default: text]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_LOG_FORMAT", value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,

    /// Serve N simulated GPUs instead of real ones, to try the plugin without a GPU
    #[arg(long, env = "GPU_DEVICE_PLUGIN_SIMULATE", value_name = "N")]
    pub simulate: Option<usize>,

    /// With --simulate: follow this fault script (created if missing); append `xid <uuid> 79` and the like
    #[arg(long, env = "GPU_DEVICE_PLUGIN_SIMULATE_EVENTS", value_name = "FILE")]
    pub simulate_events: Option<PathBuf>,

    /// NVML library to load [default: libnvidia-ml.so.1, found the way the dynamic loader finds it]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_NVML_LIB", value_name = "PATH")]
    pub nvml_lib: Option<PathBuf>,

    /// Exit when NVML cannot be loaded; false serves the driver's GPUs as unmonitored [default: true]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_FAIL_ON_INIT_ERROR", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub fail_on_init_error: Option<bool>,

    /// Root of sysfs, where GPU NUMA nodes are read [default: /sys]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_SYSFS_ROOT", value_name = "DIR")]
    pub sysfs_root: Option<PathBuf>,

    /// Root of procfs, where the driver lists GPUs when NVML is unavailable [default: /proc]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_PROC_ROOT", value_name = "DIR")]
    pub proc_root: Option<PathBuf>,

    /// XIDs to ignore, `xids` (every XID) or `all` (every health check), as NVIDIA's plugin reads it
    #[arg(long, env = "DP_DISABLE_HEALTHCHECKS", value_name = "LIST")]
    pub disable_healthchecks: Option<String>,

    /// XIDs that always make a GPU Unhealthy, over every ignore, as NVIDIA's plugin reads it
    #[arg(long, env = "DP_ENABLE_HEALTHCHECKS", value_name = "LIST")]
    pub enable_healthchecks: Option<String>,

    /// File holding this boot's id, to recognise reboots [default: /proc/sys/kernel/random/boot_id]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_BOOT_ID_FILE", value_name = "FILE")]
    pub boot_id_file: Option<PathBuf>,

    /// Socket file name in the kubelet directory [default: unique per process, gpu-device-plugin-<random>.sock]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_SOCKET_NAME", value_name = "NAME")]
    pub socket_name: Option<String>,

    /// Return CDI device names (<cdi-kind>=<id>) from Allocate [default: false]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_CDI", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub cdi: Option<bool>,

    /// CDI kind used in CDI device names [default: nvidia.com/gpu]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_CDI_KIND", value_name = "KIND")]
    pub cdi_kind: Option<String>,

    /// Return device specs for the GPU's device nodes that exist [default: false]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_DEVICE_SPECS", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub device_specs: Option<bool>,

    /// Where the device nodes are on the host, as NVIDIA's plugin reads it: device specs name
    /// DIR/dev/nvidiaN as their host path (e.g. /run/nvidia/driver under the GPU operator) [default: /]
    #[arg(long, env = "NVIDIA_DEV_ROOT", value_name = "DIR")]
    pub dev_root: Option<PathBuf>,

    /// Where this process sees the host's root file system (e.g. /host in a pod); only used to check which
    /// device nodes exist [default: /]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_HOST_ROOT", value_name = "DIR")]
    pub host_root: Option<PathBuf>,

    /// Address of the HTTP surfaces (/healthz, /readyz, /status); empty turns them off [default: 127.0.0.1:9412]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_HTTP_ADDR", value_name = "HOST:PORT")]
    pub http_addr: Option<String>,

    /// /healthz turns red when a GPU's NVML event thread has not come round its loop for this long (stuck in
    /// the driver) [default: 30s]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_STUCK_AFTER", value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub stuck_after: Option<std::time::Duration>,

    /// Have the kubelet ask before every container start, and refuse a start on an Unhealthy GPU with its
    /// health message (PreStartContainer) [default: true]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_PRE_START_CHECK", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub pre_start_check: Option<bool>,

    /// The kubelet's pod-resources socket, to tell which pods hold a device; empty turns the lookup off
    /// [default: /var/lib/kubelet/pod-resources/kubelet.sock]
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_POD_RESOURCES_SOCKET",
        value_name = "PATH"
    )]
    pub pod_resources_socket: Option<String>,

    /// Report to the Kubernetes API (Events, the GPUUnhealthy node condition) when it can be reached
    /// [default: true]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_KUBE_API", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub kube_api: Option<bool>,

    /// A kubeconfig for the API server [default: the pod's service account]
    #[arg(long, env = "KUBECONFIG", value_name = "FILE")]
    pub kubeconfig: Option<String>,

    /// A directory where detectors report faulty GPUs, one JSON file each ({"device", "reason", "by"}):
    /// a file fences its GPU, removing it releases the GPU [default: none]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_FENCE_DIR", value_name = "DIR")]
    pub fence_dir: Option<PathBuf>,

    /// The node's name, for its Events and condition (from the downward API: spec.nodeName)
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,

    /// Config file, as NVIDIA's plugin names the flag (either format; see --config)
    #[arg(
        long,
        env = "CONFIG_FILE",
        value_name = "FILE",
        help_heading = "NVIDIA's device plugin's flags"
    )]
    pub config_file: Option<PathBuf>,

    /// MIG strategy: none (whole GPUs), single (MIG devices as the GPU resource) or mixed (a resource per MIG profile) [default: none]
    #[arg(
        long,
        env = "MIG_STRATEGY",
        value_name = "STRATEGY",
        help_heading = "NVIDIA's device plugin's flags"
    )]
    pub mig_strategy: Option<String>,

    /// Same as --device-specs
    #[arg(long, env = "PASS_DEVICE_SPECS", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool, help_heading = "NVIDIA's device plugin's flags")]
    pub pass_device_specs: Option<bool>,

    /// How Allocate names the devices: envvar, volume-mounts, cdi-annotations, cdi-cri, comma-separated [default: envvar]
    #[arg(
        long,
        env = "DEVICE_LIST_STRATEGY",
        value_name = "LIST",
        help_heading = "NVIDIA's device plugin's flags"
    )]
    pub device_list_strategy: Option<String>,

    /// Device IDs: uuid or index [default: uuid]
    #[arg(
        long,
        env = "DEVICE_ID_STRATEGY",
        value_name = "STRATEGY",
        help_heading = "NVIDIA's device plugin's flags"
    )]
    pub device_id_strategy: Option<String>,

    /// Prefix of the CDI annotation keys with --device-list-strategy cdi-annotations [default: cdi.k8s.io/]
    #[arg(
        long,
        env = "CDI_ANNOTATION_PREFIX",
        value_name = "PREFIX",
        help_heading = "NVIDIA's device plugin's flags"
    )]
    pub cdi_annotation_prefix: Option<String>,

    /// The driver's root on the host: / (others are not supported yet; use --nvml-lib and --dev-root) [default: /]
    #[arg(
        long,
        env = "NVIDIA_DRIVER_ROOT",
        value_name = "DIR",
        help_heading = "NVIDIA's device plugin's flags"
    )]
    pub driver_root: Option<String>,

    /// Allocate adds NVIDIA_GDRCOPY=enabled [default: false]
    #[arg(long, env = "GDRCOPY_ENABLED", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool, help_heading = "NVIDIA's device plugin's flags")]
    pub gdrcopy_enabled: Option<bool>,

    /// Allocate adds NVIDIA_GDS=enabled [default: false]
    #[arg(long, env = "GDS_ENABLED", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool, help_heading = "NVIDIA's device plugin's flags")]
    pub gds_enabled: Option<bool>,

    /// Allocate adds NVIDIA_MOFED=enabled [default: false]
    #[arg(long, env = "MOFED_ENABLED", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool, help_heading = "NVIDIA's device plugin's flags")]
    pub mofed_enabled: Option<bool>,

    /// With MPS sharing: the MPS control daemon's root on the host (its pipe and shm directories)
    #[arg(
        long,
        env = "MPS_ROOT",
        value_name = "DIR",
        help_heading = "NVIDIA's device plugin's flags"
    )]
    pub mps_root: Option<String>,

    /// How replicas are chosen: distributed (spread over the GPUs; packed is not supported) [default: distributed]
    #[arg(
        long,
        env = "SHARED_DEVICES_ALLOCATION_POLICY",
        value_name = "POLICY",
        help_heading = "NVIDIA's device plugin's flags"
    )]
    pub shared_devices_allocation_policy: Option<String>,

    /// Device discovery: auto or nvml (tegra is not supported) [default: auto]
    #[arg(
        long,
        env = "DEVICE_DISCOVERY_STRATEGY",
        value_name = "STRATEGY",
        help_heading = "NVIDIA's device plugin's flags"
    )]
    pub device_discovery_strategy: Option<String>,
}

/// A boolean as NVIDIA's plugin (Go's `strconv.ParseBool`) reads one: 1, t, T, TRUE, true, True and the
/// same for false.
fn parse_go_bool(value: &str) -> Result<bool, String> {
    match value {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(format!("{value:?} is not a boolean (true or false)")),
    }
}

/// The config file: the same settings as the flags, camelCase. Unknown keys are an error, so a typo is
/// caught rather than silently ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FileConfig {
    /// See `--kubelet-dir`.
    pub kubelet_dir: Option<PathBuf>,
    /// See `--resource-name`.
    pub resource_name: Option<String>,
    /// See `--state-dir`.
    pub state_dir: Option<PathBuf>,
    /// See `--log-format`.
    pub log_format: Option<LogFormat>,
    /// See `--simulate`.
    pub simulate: Option<usize>,
    /// See `--simulate-events`.
    pub simulate_events: Option<PathBuf>,
    /// See `--nvml-lib`.
    pub nvml_lib: Option<PathBuf>,
    /// See `--fail-on-init-error`.
    pub fail_on_init_error: Option<bool>,
    /// See `--sysfs-root`.
    pub sysfs_root: Option<PathBuf>,
    /// See `--proc-root`.
    pub proc_root: Option<PathBuf>,
    /// See `--socket-name`.
    pub socket_name: Option<String>,
    /// See `--boot-id-file`.
    pub boot_id_file: Option<PathBuf>,
    /// The health policy.
    pub health: Option<HealthConfig>,
    /// See `--cdi`.
    pub cdi: Option<bool>,
    /// See `--cdi-kind`.
    pub cdi_kind: Option<String>,
    /// See `--device-specs`.
    pub device_specs: Option<bool>,
    /// See `--dev-root`.
    pub dev_root: Option<PathBuf>,
    /// See `--host-root`.
    pub host_root: Option<PathBuf>,
    /// See `--pre-start-check`.
    pub pre_start_check: Option<bool>,
    /// See `--http-addr`.
    pub http_addr: Option<String>,
    /// See `--pod-resources-socket`.
    pub pod_resources_socket: Option<PathBuf>,
    /// See `--kube-api`.
    pub kube_api: Option<bool>,
    /// See `--kubeconfig`.
    pub kubeconfig: Option<PathBuf>,
    /// See `--stuck-after`.
    #[serde(default, with = "humantime_serde")]
    pub stuck_after: Option<std::time::Duration>,
    /// See `--fence-dir`.
    pub fence_dir: Option<PathBuf>,
}

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
    /// Settings read and ignored (keys of NVIDIA's config file it ignores too), one line each, for the log.
    pub warnings: Vec<String>,
}

/// A setting that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {}: {source}", .path.display())]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The config file is not valid YAML for our settings.
    #[error("config file {}: {message}", .path.display())]
    ParseFile {
        /// The file.
        path: PathBuf,
        /// What the parser said, including the key and line.
        message: String,
    },
    /// A setting has a value that cannot work.
    #[error("invalid {setting} {value:?}: {why}")]
    Invalid {
        /// Flag name of the setting.
        setting: &'static str,
        /// The value given.
        value: String,
        /// Why it is invalid.
        why: String,
    },
}

impl Settings {
    /// Merges flags/environment over the config file over defaults, and checks the result.
    pub fn resolve(args: Args) -> Result<Self, ConfigError> {
        let loaded = match args.config.as_ref().or(args.config_file.as_ref()) {
            Some(path) => load_file(path)?,
            None => nvidia::Loaded::default(),
        };
        let (file, warnings) = (loaded.file, loaded.warnings);
        let fail_on_init_error_env = match std::env::var("FAIL_ON_INIT_ERROR") {
            Ok(value) => Some(parse_go_bool(&value).map_err(|why| ConfigError::Invalid {
                setting: "FAIL_ON_INIT_ERROR",
                value,
                why,
            })?),
            Err(_) => None,
        };
        let nvidia = nvidia::apply(
            &nvidia::NvidiaSettings {
                mig_strategy: args.mig_strategy,
                driver_root: args.driver_root,
                device_list_strategy: args.device_list_strategy.map(|list| {
                    list.split(',')
                        .map(|s| s.trim().to_string())
                        .filter(|s| !s.is_empty())
                        .collect()
                }),
                device_id_strategy: args.device_id_strategy,
                gdrcopy: args.gdrcopy_enabled,
                gds: args.gds_enabled,
                mofed: args.mofed_enabled,
                device_discovery_strategy: args.device_discovery_strategy,
                sharing: None,
                mps_root: args.mps_root,
                shared_devices_allocation_policy: args.shared_devices_allocation_policy,
                cdi_annotation_prefix: args.cdi_annotation_prefix,
                ..nvidia::NvidiaSettings::default()
            }
            .or(loaded.nvidia),
        )?;
        let resource_name = args
            .resource_name
            .or(file.resource_name)
            .unwrap_or_else(|| DEFAULT_RESOURCE_NAME.into());
        check_extended_resource_name(&resource_name)?;
        let simulate = args.simulate.or(file.simulate);
        let simulate_events = args.simulate_events.or(file.simulate_events);
        if let (Some(path), None) = (&simulate_events, simulate) {
            return Err(ConfigError::Invalid {
                setting: "--simulate-events",
                value: path.display().to_string(),
                why: "only simulated GPUs follow a fault script; add --simulate N".into(),
            });
        }
        let socket_name = args.socket_name.or(file.socket_name);
        if let Some(name) = &socket_name {
            check_socket_name(name)?;
        }
        let state_dir = args
            .state_dir
            .or(file.state_dir)
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
        let defaults = AllocateOptions::default();
        let nvml_defaults = NvmlOptions::default();
        let allocate = AllocateOptions {
            envvar: nvidia.envvar,
            naming: nvidia.naming.clone(),
            volume_mounts: nvidia.volume_mounts,
            cdi_annotations: nvidia.cdi_annotations,
            cdi: args.cdi.or(file.cdi).unwrap_or(nvidia.cdi),
            cdi_kind: args.cdi_kind.or(file.cdi_kind).unwrap_or(defaults.cdi_kind),
            device_specs: args
                .device_specs
                .or(args.pass_device_specs)
                .or(file.device_specs)
                .unwrap_or(defaults.device_specs),
            dev_root: args
                .dev_root
                .or(file.dev_root)
                .unwrap_or(nvidia.driver_root),
            extra_envs: nvidia.extra_envs,
            // Per resource, once the resources are known.
            mps: None,
            host_root: args
                .host_root
                .or(file.host_root)
                .unwrap_or(defaults.host_root),
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
        Ok(Settings {
            kubelet_dir: args
                .kubelet_dir
                .or(file.kubelet_dir)
                .unwrap_or_else(|| DEFAULT_KUBELET_DIR.into()),
            resource_name,
            sharing: nvidia.sharing,
            mps_root: nvidia.mps_root,
            state_dir: state_dir.clone(),
            log_format: args
                .log_format
                .or(file.log_format)
                .unwrap_or(LogFormat::Text),
            simulate,
            simulate_events,
            socket_name,
            nvml: NvmlOptions {
                mig_strategy: nvidia.mig_strategy,
                library: args
                    .nvml_lib
                    .or(file.nvml_lib)
                    .unwrap_or(nvml_defaults.library),
                sysfs_root: args
                    .sysfs_root
                    .or(file.sysfs_root)
                    .unwrap_or(nvml_defaults.sysfs_root),
                proc_root: args
                    .proc_root
                    .or(file.proc_root)
                    .unwrap_or(nvml_defaults.proc_root),
            },
            fail_on_init_error: args
                .fail_on_init_error
                .or(fail_on_init_error_env)
                .or(file.fail_on_init_error)
                .unwrap_or(true),
            monitor: MonitorConfig {
                policy,
                state_dir: Some(state_dir.clone()),
                boot_id_path: args
                    .boot_id_file
                    .or(file.boot_id_file)
                    .unwrap_or_else(|| checkpoint::DEFAULT_BOOT_ID_PATH.into()),
                metrics: None,
            },
            allocate,
            pre_start_check: args
                .pre_start_check
                .or(file.pre_start_check)
                .unwrap_or(true),
            stuck_after: match args.stuck_after.or(file.stuck_after) {
                Some(d) if d < std::time::Duration::from_secs(3) => {
                    return Err(ConfigError::Invalid {
                        setting: "--stuck-after",
                        value: humantime::format_duration(d).to_string(),
                        why: "must be at least 3s: the NVML event wait itself lasts up to 2s"
                            .into(),
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
            },
            pod_resources_socket: match args
                .pod_resources_socket
                .map(PathBuf::from)
                .or(file.pod_resources_socket)
            {
                Some(path) if path.as_os_str().is_empty() => None,
                Some(path) => Some(path),
                None => Some(crate::api::pod_resources::DEFAULT_SOCKET.into()),
            },
            fence_dir: match args
                .fence_dir
                .or(file.fence_dir)
                .filter(|d| !d.as_os_str().is_empty())
            {
                Some(dir) if !dir.is_dir() => {
                    return Err(ConfigError::Invalid {
                        setting: "fenceDir (--fence-dir, GPU_DEVICE_PLUGIN_FENCE_DIR)",
                        value: dir.display().to_string(),
                        why: "not a directory (detectors' reports are read from an existing one)"
                            .into(),
                    });
                }
                dir => dir,
            },
            cluster: crate::cluster::ClusterConfig {
                enabled: args.kube_api.or(file.kube_api).unwrap_or(true),
                kubeconfig: args
                    .kubeconfig
                    .map(PathBuf::from)
                    .or(file.kubeconfig)
                    .filter(|p| !p.as_os_str().is_empty()),
                node_name: args.node_name.filter(|n| !n.is_empty()),
                budget: crate::cluster::EventBudget::default(),
            },
            warnings,
            http_addr: parse_http_addr(
                args.http_addr
                    .or(file.http_addr)
                    .as_deref()
                    .unwrap_or(crate::http::DEFAULT_ADDR),
            )?,
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

/// A command-line error from clap as one line (what shows up in `kubectl logs` and event messages; clap's
/// own spans several, with tips and usage). Where the bad value came from an environment variable rather
/// than the flag, the line names the variable: in a DaemonSet, that is where the operator has to look.
pub fn usage_error_line(error: &clap::Error, argv: &[OsString]) -> String {
    use clap::CommandFactory;
    use clap::error::{ContextKind, ContextValue};

    let rendered = error.render().to_string();
    // The message is the first paragraph (a list of missing arguments continues it on indented lines).
    let message: Vec<&str> = rendered
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect();
    let first = message.join(" ");
    let mut line = first.strip_prefix("error: ").unwrap_or(&first).to_string();
    if line.is_empty() {
        line = "invalid arguments".into();
    }
    let flag = match error.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(arg)) => arg.split([' ', '=']).next().unwrap_or_default(),
        _ => "",
    };
    let long = flag.strip_prefix("--").unwrap_or_default();
    let given = |a: &OsString| {
        a.to_str()
            .is_some_and(|a| a == flag || a.strip_prefix(flag).is_some_and(|v| v.starts_with('=')))
    };
    let command = Args::command();
    let env = command
        .get_arguments()
        .find(|a| !long.is_empty() && a.get_long() == Some(long))
        .and_then(|a| a.get_env());
    if let Some(env) = env
        && !argv.iter().skip(1).any(given)
        && let Some(value) = std::env::var_os(env)
    {
        let value = crate::text::cut_bytes(&value.to_string_lossy(), 80);
        line = format!(
            "{line}: the value {value:?} comes from the environment variable {}",
            env.to_string_lossy()
        );
    }
    format!("{line} (see --help)")
}

/// `HOST:PORT` with an IP address (the surfaces are bound before any name service could be relied on), or
/// empty for off.
fn parse_http_addr(value: &str) -> Result<Option<std::net::SocketAddr>, ConfigError> {
    if value.trim().is_empty() {
        return Ok(None);
    }
    value.parse().map(Some).map_err(|_| ConfigError::Invalid {
        setting: "--http-addr",
        value: value.into(),
        why:
            "not an IP address and port (e.g. 127.0.0.1:9412 or 0.0.0.0:9412; empty turns HTTP off)"
                .into(),
    })
}

/// The largest config file read. NVIDIA's and ours are a few kilobytes; past this a file is a mistake (or
/// worse), and reading it would cost memory and parse time on a node agent.
pub const MAX_CONFIG_BYTES: u64 = 1024 * 1024;

/// The deepest nesting of flow collections (`[...]`, `{...}`) a config file may have. Real ones nest two or
/// three deep; the YAML parser's time grows with the square of a file nested thousands deep (a 200 KB file
/// took seconds), so such a file is refused before it is parsed.
pub const MAX_FLOW_DEPTH: usize = 32;

/// Reads the config file, in our format or NVIDIA's. NVIDIA's is recognised by its top-level keys (`version`,
/// `flags`, `sharing`, `resources`, `imex`, in any case, as NVIDIA's decoder matches them), with or without
/// `version:`; anything else is ours, read strictly.
fn load_file(path: &Path) -> Result<nvidia::Loaded, ConfigError> {
    let text = read_config_text(path)?;
    if text.trim().is_empty() {
        return Ok(nvidia::Loaded::default());
    }
    let parse = |e: serde_norway::Error| ConfigError::ParseFile {
        path: path.to_owned(),
        message: e.to_string().replace('\n', " "),
    };
    if let Some(line) = too_deep(&text, MAX_FLOW_DEPTH) {
        return Err(ConfigError::ParseFile {
            path: path.to_owned(),
            message: format!(
                "nests [ ] and {{ }} collections more than {MAX_FLOW_DEPTH} deep (line {line}); refused before parsing"
            ),
        });
    }
    match nvidia::document(&text) {
        Ok(document) if nvidia::is_nvidias(&document) => {
            return nvidia::load(&document, &text, path);
        }
        Ok(_) => {}
        // Not YAML to NVIDIA's (YAML 1.1) reader: its message where the file looks like NVIDIA's, else our
        // own parser's below.
        Err(message) => {
            let looks_nvidias = serde_norway::from_str::<serde_norway::Value>(&text)
                .ok()
                .and_then(|v| serde_json::to_value(v).ok())
                .is_some_and(|v| nvidia::is_nvidias(&v));
            if looks_nvidias {
                return Err(ConfigError::ParseFile {
                    path: path.to_owned(),
                    message,
                });
            }
        }
    }
    // Ours: parsed from the text, so that an error names its line.
    Ok(nvidia::Loaded {
        file: serde_norway::from_str(&text).map_err(parse)?,
        ..nvidia::Loaded::default()
    })
}

/// The config file's text: a regular file (a FIFO or device would block the read) of at most
/// [`MAX_CONFIG_BYTES`], in UTF-8.
fn read_config_text(path: &Path) -> Result<String, ConfigError> {
    use std::io::Read as _;
    let read_error = |source: std::io::Error| ConfigError::ReadFile {
        path: path.to_owned(),
        source,
    };
    // Followed through links: a ConfigMap mount is a link to a regular file.
    let metadata = std::fs::metadata(path).map_err(read_error)?;
    if !metadata.is_file() {
        return Err(read_error(std::io::Error::other("not a regular file")));
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .map_err(read_error)?
        .take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(read_error(std::io::Error::other(format!(
            "larger than {MAX_CONFIG_BYTES} bytes (a config file is a few kilobytes)"
        ))));
    }
    String::from_utf8(bytes)
        .map_err(|e| read_error(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))
}

/// The line where `text` first nests flow collections deeper than `max`, if it does. Brackets inside quoted
/// scalars and comments do not count.
fn too_deep(text: &str, max: usize) -> Option<usize> {
    let mut depth = 0usize;
    // A quoted scalar may go on over several lines: the brackets in it are text.
    let mut quote: Option<char> = None;
    for (number, line) in text.lines().enumerate() {
        let mut previous = ' ';
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            match quote {
                Some('"') if c == '\\' => {
                    chars.next();
                }
                Some(q) if c == q => {
                    // '' inside a single-quoted scalar is a quote, not its end.
                    if q == '\'' && chars.peek() == Some(&'\'') {
                        chars.next();
                    } else {
                        quote = None;
                    }
                }
                Some(_) => {}
                None => match c {
                    '#' if previous.is_whitespace() => break,
                    '"' | '\'' if previous.is_whitespace() || "[{,:-".contains(previous) => {
                        quote = Some(c);
                    }
                    '[' | '{' => {
                        depth += 1;
                        if depth > max {
                            return Some(number + 1);
                        }
                    }
                    ']' | '}' => depth = depth.saturating_sub(1),
                    _ => {}
                },
            }
            previous = c;
        }
    }
    None
}

/// Makes sure the state directory exists and is writable, so a read-only mount is reported at start rather
/// than at the first health change.
pub fn prepare_state_dir(dir: &Path) -> Result<(), ConfigError> {
    let invalid = |why: String| ConfigError::Invalid {
        setting: "--state-dir",
        value: dir.display().to_string(),
        why,
    };
    std::fs::create_dir_all(dir).map_err(|e| invalid(format!("cannot create it: {e}")))?;
    let probe = dir.join(format!(".write-check-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| invalid(format!("not writable: {e}")))?;
    let _gone = std::fs::remove_file(&probe);
    Ok(())
}

/// The kubelet accepts only extended resource names: `domain/name`, the domain a DNS subdomain outside
/// `kubernetes.io`, the name a qualified-name part.
pub fn check_extended_resource_name(name: &str) -> Result<(), ConfigError> {
    let invalid = |why: &str| ConfigError::Invalid {
        setting: "--resource-name",
        value: name.to_string(),
        why: format!("{why} (an extended resource name is domain/name, e.g. nvidia.com/gpu)"),
    };
    let Some((domain, short)) = name.split_once('/') else {
        return Err(invalid("no domain"));
    };
    if !is_dns_subdomain(domain) {
        return Err(invalid("the domain is not a lowercase DNS name"));
    }
    if domain == "kubernetes.io" || domain.ends_with(".kubernetes.io") {
        return Err(invalid(
            "the kubernetes.io domain is reserved for native resources",
        ));
    }
    if !is_name_part(short) {
        return Err(invalid(
            "the name must be 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit",
        ));
    }
    Ok(())
}

fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

fn is_name_part(s: &str) -> bool {
    let bytes = s.as_bytes();
    match (bytes.first(), bytes.last()) {
        (Some(first), Some(last)) => {
            s.len() <= 63
                && first.is_ascii_alphanumeric()
                && last.is_ascii_alphanumeric()
                && bytes
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        }
        _ => false,
    }
}

fn check_socket_name(name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || name.contains('/') || name == "kubelet.sock" || name.starts_with('.') {
        return Err(ConfigError::Invalid {
            setting: "--socket-name",
            value: name.into(),
            why: "must be a plain file name other than kubelet.sock, not starting with '.'".into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
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

    fn settings(argv: &[&str]) -> Result<Settings, String> {
        let argv = std::iter::once("gpu-device-plugin").chain(argv.iter().copied());
        match Settings::from_args(argv) {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(e.to_string()),
        }
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
        Ok(())
    }
}

#[cfg(test)]
mod readme_tests {
    use super::*;

    /// The health config example in the README is what operators copy: it must load as written.
    #[test]
    fn the_readme_health_config_example_loads() -> Result<(), Box<dyn std::error::Error>> {
        let readme = include_str!("../README.md");
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
