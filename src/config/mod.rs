//! Settings from the command line, the environment and the config file, checked once at start.
//!
//! Precedence: a flag, then its environment variable, then the `--config` file, then the default. Every
//! problem is one [`ConfigError`] naming the setting and the bad value.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::{Parser, ValueEnum};
use serde::Deserialize;

use crate::devices::allocation::AllocateOptions;
use crate::health::{HealthConfig, Policy};
use crate::monitor::MonitorConfig;
use crate::sources::nvml::NvmlOptions;

pub mod nvidia;
pub mod reload;
mod start;
pub use start::socket_name_for;

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
    disable_version_flag = true,
    // A flag given twice takes its last value, as NVIDIA's plugin (and Go's flag packages) read it; list
    // flags (--device-list-strategy) add up instead.
    args_override_self = true,
    override_usage = "gpu-device-plugin [OPTIONS]\n       \
                      gpu-device-plugin check-config [FILE] [OPTIONS]\n       \
                      gpu-device-plugin status [--addr HOST:PORT] [--json] [--watch]\n       \
                      gpu-device-plugin fence <DEVICE> --reason <TEXT>\n       \
                      gpu-device-plugin release <DEVICE> [--condition <CONDITION>]",
    about = "Kubernetes device plugin for NVIDIA GPUs",
    after_help = "`gpu-device-plugin status` shows a running plugin's devices, their health and messages \
                  (see `gpu-device-plugin status --help`)."
)]
pub struct Args {
    /// Print the version (-v as NVIDIA's plugin spells it, or -V)
    #[arg(short = 'v', long, short_alias = 'V', action = clap::ArgAction::Version)]
    version: Option<bool>,

    /// Kubelet device plugin directory [default: /var/lib/kubelet/device-plugins]
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_KUBELET_DIR",
        value_name = "DIR",
        help_heading = "Kubelet"
    )]
    pub kubelet_dir: Option<PathBuf>,

    /// Extended resource name to advertise [default: nvidia.com/gpu]
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_RESOURCE_NAME",
        value_name = "NAME",
        help_heading = "Kubelet"
    )]
    pub resource_name: Option<String>,

    /// Directory for the plugin's own state [default: /var/lib/gpu-device-plugin]
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_STATE_DIR",
        value_name = "DIR",
        help_heading = "GPUs and health"
    )]
    pub state_dir: Option<PathBuf>,

    /// YAML config file; flags and environment variables override it
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_CONFIG",
        value_name = "FILE",
        help_heading = "GPUs and health"
    )]
    pub config: Option<PathBuf>,

    /// Log format [default: text]
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_LOG_FORMAT",
        value_name = "FORMAT",
        help_heading = "Where health shows, and operator inputs"
    )]
    pub log_format: Option<LogFormat>,

    /// Serve N simulated GPUs instead of real ones, to try the plugin without a GPU
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_SIMULATE",
        value_name = "N",
        help_heading = "Testing and trying out"
    )]
    pub simulate: Option<usize>,

    /// With --simulate: follow this fault script (created if missing); append `xid <uuid> 79` and the like
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_SIMULATE_EVENTS",
        value_name = "FILE",
        help_heading = "Testing and trying out"
    )]
    pub simulate_events: Option<PathBuf>,

    /// NVML library to load [default: libnvidia-ml.so.1, found the way the dynamic loader finds it]
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_NVML_LIB",
        value_name = "PATH",
        help_heading = "GPUs and health"
    )]
    pub nvml_lib: Option<PathBuf>,

    /// Exit when NVML cannot be loaded; false serves the driver's GPUs as unmonitored (also read from
    /// NVIDIA's FAIL_ON_INIT_ERROR) [default: true]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_FAIL_ON_INIT_ERROR", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool, help_heading = "GPUs and health")]
    pub fail_on_init_error: Option<bool>,

    /// Root of sysfs, where GPU NUMA nodes and PCIe roots are read [default: /sys]
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_SYSFS_ROOT",
        value_name = "DIR",
        help_heading = "Testing and trying out"
    )]
    pub sysfs_root: Option<PathBuf>,

    /// Root of procfs, where the driver lists GPUs when NVML is unavailable [default: /proc]
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_PROC_ROOT",
        value_name = "DIR",
        help_heading = "Testing and trying out"
    )]
    pub proc_root: Option<PathBuf>,

    /// XIDs to ignore, `xids` (every XID) or `all` (every health check), as NVIDIA's plugin reads it
    #[arg(
        long,
        env = "DP_DISABLE_HEALTHCHECKS",
        value_name = "LIST",
        help_heading = "GPUs and health"
    )]
    pub disable_healthchecks: Option<String>,

    /// XIDs that always make a GPU Unhealthy, over every ignore, as NVIDIA's plugin reads it
    #[arg(
        long,
        env = "DP_ENABLE_HEALTHCHECKS",
        value_name = "LIST",
        help_heading = "GPUs and health"
    )]
    pub enable_healthchecks: Option<String>,

    /// File holding this boot's id, to recognise reboots [default: /proc/sys/kernel/random/boot_id]
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_BOOT_ID_FILE",
        value_name = "FILE",
        help_heading = "Testing and trying out"
    )]
    pub boot_id_file: Option<PathBuf>,

    /// Socket file name in the kubelet directory [default: unique per process, gpu-device-plugin-<random>.sock]
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_SOCKET_NAME",
        value_name = "NAME",
        help_heading = "Testing and trying out"
    )]
    pub socket_name: Option<String>,

    /// Return CDI device names (<cdi-kind>=<id>) from Allocate [default: false]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_CDI", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool, help_heading = "Allocate")]
    pub cdi: Option<bool>,

    /// CDI kind used in CDI device names [default: nvidia.com/gpu]
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_CDI_KIND",
        value_name = "KIND",
        help_heading = "Allocate"
    )]
    pub cdi_kind: Option<String>,

    /// Return device specs for the GPU's device nodes that exist [default: false]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_DEVICE_SPECS", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool, help_heading = "Allocate")]
    pub device_specs: Option<bool>,

    /// Where this process sees the host's root file system (e.g. /host in a pod); only used to check which
    /// device nodes exist [default: /]
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_HOST_ROOT",
        value_name = "DIR",
        help_heading = "Allocate"
    )]
    pub host_root: Option<PathBuf>,

    /// Address of the HTTP endpoints (/healthz, /readyz, /status, /metrics); empty turns them off [default: 127.0.0.1:9412]
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_HTTP_ADDR",
        value_name = "HOST:PORT",
        help_heading = "Where health shows, and operator inputs"
    )]
    pub http_addr: Option<String>,

    /// /healthz turns red when a GPU's NVML event thread has not come round its loop for this long (stuck in
    /// the driver) [default: 30s]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_STUCK_AFTER", value_name = "DURATION", value_parser = humantime::parse_duration, help_heading = "GPUs and health")]
    pub stuck_after: Option<std::time::Duration>,

    /// Have the kubelet ask before every container start, and refuse a start on an Unhealthy GPU with its
    /// health message (PreStartContainer) [default: true]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_PRE_START_CHECK", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool, help_heading = "Kubelet")]
    pub pre_start_check: Option<bool>,

    /// The kubelet's pod-resources socket, to tell which pods hold a device; empty turns the lookup off
    /// [default: /var/lib/kubelet/pod-resources/kubelet.sock]
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_POD_RESOURCES_SOCKET",
        value_name = "PATH",
        help_heading = "Kubelet"
    )]
    pub pod_resources_socket: Option<String>,

    /// Report to the Kubernetes API (Events, the GPUUnhealthy node condition) when it can be reached
    /// [default: true]
    #[arg(long, env = "GPU_DEVICE_PLUGIN_KUBE_API", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool, help_heading = "Where health shows, and operator inputs")]
    pub kube_api: Option<bool>,

    /// A kubeconfig for the API server [default: the pod's service account]
    #[arg(
        long,
        env = "KUBECONFIG",
        value_name = "FILE",
        help_heading = "Where health shows, and operator inputs"
    )]
    pub kubeconfig: Option<String>,

    /// A directory where detectors report faulty GPUs, one JSON file each ({"device", "reason", "by"}):
    /// a file fences its GPU, removing it releases the GPU [default: none]
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_FENCE_DIR",
        value_name = "DIR",
        help_heading = "Where health shows, and operator inputs"
    )]
    pub fence_dir: Option<PathBuf>,

    /// The node's name, for its Events and condition (from the downward API: spec.nodeName)
    #[arg(
        long,
        env = "NODE_NAME",
        value_name = "NAME",
        help_heading = "Where health shows, and operator inputs"
    )]
    pub node_name: Option<String>,

    /// Serve GPUs through Dynamic Resource Allocation instead of the device plugin: all, or a list of GPU
    /// indices and UUIDs (the others stay with the device plugin; a GPU is never served by both) [default: off]
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_DRA",
        value_name = "all|GPUS",
        help_heading = "DRA"
    )]
    pub dra: Option<String>,

    /// The DRA driver name devices are published under [default: gpu.nvidia.com]
    #[arg(
        long,
        env = "GPU_DEVICE_PLUGIN_DRA_DRIVER_NAME",
        value_name = "NAME",
        help_heading = "DRA"
    )]
    pub dra_driver_name: Option<String>,

    /// The kubelet's plugin registration directory [default: /var/lib/kubelet/plugins_registry]
    #[arg(
        long,
        env = "KUBELET_REGISTRAR_DIRECTORY_PATH",
        value_name = "DIR",
        help_heading = "DRA"
    )]
    pub kubelet_registrar_directory_path: Option<PathBuf>,

    /// The kubelet's DRA plugins directory [default: /var/lib/kubelet/plugins]
    #[arg(
        long,
        env = "KUBELET_PLUGINS_DIRECTORY_PATH",
        value_name = "DIR",
        help_heading = "DRA"
    )]
    pub kubelet_plugins_directory_path: Option<PathBuf>,

    /// This pod's UID (the downward API's metadata.uid): the DRA sockets are named after it, so that the two
    /// pods of a rolling update serve side by side (kubelets 1.33+) [default: fixed names, one pod at a time]
    #[arg(long, env = "POD_UID", value_name = "UID", help_heading = "DRA")]
    pub dra_pod_uid: Option<String>,

    /// NVIDIA's device plugin's flags and variables, under their own heading.
    #[command(flatten)]
    pub nvidia: nvidia::NvidiaFlags,
}

/// Where NVIDIA's plugin expects the host's driver root in its container (`--driver-root-ctr-path`).
pub const DEFAULT_CONTAINER_DRIVER_ROOT: &str = "/driver-root";

/// The kubelet directory NVIDIA's `--kubelet-socket` names: the socket's directory, when the socket is the
/// kubelet's `kubelet.sock` (the only name a kubelet registers plugins on).
fn kubelet_dir_of_socket(socket: Option<&Path>) -> Result<Option<PathBuf>, ConfigError> {
    let Some(socket) = socket else {
        return Ok(None);
    };
    let invalid = |why: &str| ConfigError::Invalid {
        setting: "--kubelet-socket (KUBELET_SOCKET)",
        value: socket.display().to_string(),
        why: why.into(),
    };
    if socket.as_os_str().is_empty() {
        return Err(invalid(
            "empty: NVIDIA's plugin then never registers with the kubelet, and this plugin always does; \
             leave it unset or give the kubelet's socket",
        ));
    }
    match (socket.parent(), socket.file_name()) {
        (Some(dir), Some(name)) if name == crate::api::KUBELET_SOCKET && socket.is_absolute() => {
            Ok(Some(dir.to_path_buf()))
        }
        _ => Err(invalid(
            "must be an absolute path ending in kubelet.sock, the kubelet's registration socket in its \
             device plugin directory (or give that directory with --kubelet-dir)",
        )),
    }
}

/// NVIDIA's `--imex-channel-ids`: none or channel 0, the only one NVIDIA's plugin supports.
fn imex_channel_ids(given: &[String]) -> Result<Vec<u32>, ConfigError> {
    let mut ids = Vec::new();
    for text in given.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        let id = text.parse::<u32>().map_err(|_| ConfigError::Invalid {
            setting: "--imex-channel-ids (IMEX_CHANNEL_IDS)",
            value: text.into(),
            why: "not a channel number".into(),
        })?;
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    if ids.iter().any(|&id| id != 0) {
        return Err(ConfigError::Invalid {
            setting: "--imex-channel-ids (IMEX_CHANNEL_IDS)",
            value: given.join(","),
            why: "only channel 0 is supported (as by NVIDIA's plugin): give 0, or nothing".into(),
        });
    }
    Ok(ids)
}

/// The IMEX channels whose device node is a character device in one of `dev_dirs` (the container driver
/// root's `dev`, this container's `/dev`, the host's dev root): those every container gets. A missing one
/// is left out with a warning, or refuses the start when channels are `required`, as NVIDIA's plugin does.
fn find_imex_channels(
    ids: &[u32],
    required: bool,
    dev_dirs: &[PathBuf],
    warnings: &mut Vec<String>,
) -> Result<Vec<u32>, ConfigError> {
    use std::os::unix::fs::FileTypeExt as _;
    let mut found = Vec::new();
    for &id in ids {
        let node = crate::devices::allocation::imex_channel_node(id);
        let relative = node.strip_prefix("/dev").unwrap_or(&node);
        let mut places: Vec<PathBuf> = Vec::new();
        for place in dev_dirs.iter().map(|d| d.join(relative)) {
            if !places.contains(&place) {
                places.push(place);
            }
        }
        let present = places
            .iter()
            .any(|p| std::fs::metadata(p).is_ok_and(|m| m.file_type().is_char_device()));
        if present {
            found.push(id);
            continue;
        }
        let looked: Vec<String> = places.iter().map(|p| p.display().to_string()).collect();
        if required {
            return Err(ConfigError::Invalid {
                setting: "IMEX channel (--imex-channel-ids, --imex-required)",
                value: id.to_string(),
                why: format!(
                    "required, and no character device at {}: is the node's IMEX daemon running and \
                     the channel created?",
                    looked.join(", ")
                ),
            });
        }
        warnings.push(format!(
            "IMEX channel {id}: no character device at {}; containers get no IMEX channel (as with \
             NVIDIA's plugin; --imex-required refuses the start instead)",
            looked.join(", ")
        ));
    }
    Ok(found)
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
    /// See `--dra`.
    pub dra: Option<String>,
    /// See `--dra-driver-name`.
    pub dra_driver_name: Option<String>,
    /// See `--kubelet-registrar-directory-path`.
    pub kubelet_registrar_directory_path: Option<PathBuf>,
    /// See `--kubelet-plugins-directory-path`.
    pub kubelet_plugins_directory_path: Option<PathBuf>,
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

use crate::util::text::{LINE_MAX, SHOWN_MAX, shown};

/// A path from outside as a line shows it (see [`shown`]).
fn shown_path(path: &Path) -> String {
    shown(&path.to_string_lossy(), SHOWN_MAX)
}

/// A setting that cannot be used. Its text shows every value from outside through [`shown`]: a 1 MB value
/// or a key holding an escape is one short line.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {}: {}", shown_path(.path), shown(&.source.to_string(), SHOWN_MAX))]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The config file is not valid YAML for our settings.
    #[error("config file {}: {}", shown_path(.path), shown(.message, LINE_MAX))]
    ParseFile {
        /// The file.
        path: PathBuf,
        /// What the parser said, including the key and line.
        message: String,
    },
    /// A setting has a value that cannot work.
    #[error("invalid {setting} \"{}\": {}", shown(.value, SHOWN_MAX), shown(.why, LINE_MAX))]
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

    /// The effective settings as `check-config` prints them: one `name: value` line each, in the order
    /// an operator reviews a rollout (what the kubelet sees, how Allocate answers, health, surfaces).
    pub fn describe(&self) -> String {
        let on = |b: bool| if b { "on" } else { "off" };
        let path = |p: &Path| p.display().to_string();
        let a = &self.allocate;
        let mut allocate = Vec::new();
        if a.envvar {
            allocate.push("NVIDIA_VISIBLE_DEVICES (envvar)".to_string());
        }
        if a.volume_mounts {
            allocate.push("volume mounts".into());
        }
        if a.cdi {
            allocate.push(format!("CDI names (kind {})", a.cdi_kind));
        }
        if let Some(prefix) = &a.cdi_annotations {
            allocate.push(format!("CDI annotations (prefix {prefix})"));
        }
        if a.device_specs {
            allocate.push(format!(
                "device specs (dev root {}, checked under {})",
                path(&a.dev_root),
                path(&a.host_root)
            ));
        }
        let sharing = match &self.sharing {
            None => "none".to_string(),
            Some(sharing) => {
                let kind = match sharing.kind {
                    nvidia::ShareKind::TimeSlicing => "time-slicing",
                    nvidia::ShareKind::Mps => "MPS",
                };
                let each: Vec<String> = sharing
                    .resources
                    .iter()
                    .map(|r| {
                        let devices = match &r.devices {
                            nvidia::DeviceSelection::All => "all devices".to_string(),
                            nvidia::DeviceSelection::Count(n) => format!("the first {n} devices"),
                            nvidia::DeviceSelection::List(l) => format!("devices {}", l.join(", ")),
                        };
                        let under = r
                            .rename
                            .as_ref()
                            .map(|n| format!(" as {n}"))
                            .unwrap_or_default();
                        format!("{} × {} replicas{under} ({devices})", r.name, r.replicas)
                    })
                    .collect();
                format!(
                    "{kind}: {}{}",
                    each.join("; "),
                    if sharing.fail_requests_greater_than_one {
                        ", more than one replica per container refused"
                    } else {
                        ""
                    }
                )
            }
        };
        let policy = crate::http::status::PolicySummary::of(&self.monitor.policy);
        let mut policy_line = format!(
            "XIDs by the {} policy, recovery after {} quiet, probes every {}, recovery action read every {}",
            policy.xid_policy,
            policy.quiet_period,
            policy.probe_interval,
            policy.recovery_action_interval
        );
        if let Some(list) = &policy.dp_disable_healthchecks {
            policy_line.push_str(&format!(", DP_DISABLE_HEALTHCHECKS={list}"));
        }
        if let Some(list) = &policy.dp_enable_healthchecks {
            policy_line.push_str(&format!(", DP_ENABLE_HEALTHCHECKS={list}"));
        }
        let imex = if a.imex_channels.is_empty() {
            "none".to_string()
        } else {
            a.imex_channels
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let extra: Vec<String> = a
            .extra_envs
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let gpus = match self.simulate {
            Some(n) => format!("{n} simulated"),
            None => format!(
                "NVML ({}), {}",
                path(&self.nvml.library),
                if self.fail_on_init_error {
                    "exit when it cannot be loaded"
                } else {
                    "served unmonitored when it cannot be loaded"
                }
            ),
        };
        let lines = [
            ("kubelet directory", path(&self.kubelet_dir)),
            ("resource", self.resource_name.clone()),
            ("GPUs", gpus),
            (
                "MIG strategy",
                format!("{:?}", self.nvml.mig_strategy).to_lowercase(),
            ),
            ("device IDs", format!("{:?}", a.naming.ids).to_lowercase()),
            ("sharing", sharing),
            ("Allocate answers with", allocate.join(", ")),
            (
                "Allocate adds",
                if extra.is_empty() {
                    "nothing".into()
                } else {
                    extra.join(" ")
                },
            ),
            ("IMEX channels", imex),
            ("health policy", policy_line),
            ("pre-start health check", on(self.pre_start_check).into()),
            ("state directory", path(&self.state_dir)),
            (
                "HTTP endpoints",
                self.http_addr.map_or("off".into(), |a| a.to_string()),
            ),
            (
                "fence directory",
                self.fence_dir.as_deref().map_or("none".into(), path),
            ),
            ("Kubernetes API", on(self.cluster.enabled).into()),
            (
                "DRA",
                self.dra.as_ref().map_or("off".into(), |d| {
                    format!(
                        "{} as driver {} (registration in {}, sockets in {})",
                        d.gpus,
                        d.driver,
                        path(&d.registry_dir),
                        path(&d.plugins_dir)
                    )
                }),
            ),
        ];
        // Values hold paths, names and lists from outside: each line printed as itself and one line.
        lines
            .iter()
            .map(|(name, value)| format!("{name}: {}\n", shown(value, LINE_MAX)))
            .collect()
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

/// The config file's settings: `--config`, else NVIDIA's `--config-file` (either format, see [`load_file`]);
/// with neither, none.
fn read_config_file(args: &Args) -> Result<nvidia::Loaded, ConfigError> {
    match args.config.as_ref().or(args.nvidia.config_file.as_ref()) {
        Some(path) => load_file(path),
        None => Ok(nvidia::Loaded::default()),
    }
}

/// NVIDIA's settings as this plugin runs them, and what NVIDIA's flags and variables say about settings of
/// ours.
struct Nvidia {
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
fn merge_nvidia(
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
struct Kubelet {
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
fn kubelet_settings(
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
struct TryingOut {
    /// See [`Settings::simulate`].
    simulate: Option<usize>,
    /// See [`Settings::simulate_events`].
    simulate_events: Option<PathBuf>,
    /// See [`Settings::socket_name`].
    socket_name: Option<String>,
}

/// Decides whether simulated GPUs are served and which fault script they follow (only simulated GPUs
/// follow one), and whether the socket has a fixed name.
fn trying_out_settings(args: &Args, file: &FileConfig) -> Result<TryingOut, ConfigError> {
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
struct GpusAndHealth {
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
fn gpu_and_health_settings(
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
fn allocate_settings(
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
struct Surfaces {
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
fn dra_settings(
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

/// The node's name (`NODE_NAME`), none when not given: a name the API server could hold for a Node (a
/// DNS-1123 subdomain), since it goes into the API's URL paths (`/api/v1/nodes/<name>`) and field selectors,
/// where `../x` would name another path.
fn node_name(name: Option<&str>) -> Result<Option<String>, ConfigError> {
    match name.filter(|n| !n.is_empty()) {
        None => Ok(None),
        Some(name) if crate::util::text::is_dns_subdomain(name) => Ok(Some(name.to_string())),
        Some(name) => Err(ConfigError::Invalid {
            setting: "--node-name (NODE_NAME)",
            value: name.to_string(),
            why: "not a node's name: lower-case letters, digits, '-' and '.', at most 253 bytes (give                   spec.nodeName from the downward API)"
                .into(),
        }),
    }
}

/// The pod's UID the DRA sockets are named after: none when not given (or given empty), else one a socket
/// name can carry.
fn pod_uid(uid: Option<&str>) -> Result<Option<String>, ConfigError> {
    let Some(uid) = uid.filter(|u| !u.is_empty()) else {
        return Ok(None);
    };
    let fits = uid.len() <= 64
        && uid
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if fits {
        Ok(Some(uid.to_string()))
    } else {
        Err(ConfigError::Invalid {
            setting: "--dra-pod-uid",
            value: shown(uid, 80),
            why: "a pod UID is at most 64 lower-case letters, digits and '-' (give metadata.uid from the \
                  downward API)"
                .into(),
        })
    }
}

fn surface_settings(args: &Args, file: &FileConfig) -> Result<Surfaces, ConfigError> {
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
        let value = crate::util::text::cut_bytes(&value.to_string_lossy(), 80);
        line = format!(
            "{line}: the value {value:?} comes from the environment variable {}",
            env.to_string_lossy()
        );
    }
    // clap's "a similar argument exists" tip, kept on the one line.
    let suggested = match error.get(ContextKind::SuggestedArg) {
        Some(ContextValue::String(arg)) => Some(arg.clone()),
        Some(ContextValue::StyledStr(arg)) => Some(arg.to_string()),
        _ => None,
    };
    if let Some(arg) = suggested {
        let arg = arg.split_whitespace().next().unwrap_or_default();
        line = format!("{line}; did you mean {arg}?");
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
            let looks_nvidias = nvidia::names_nvidias_keys(&text)
                || serde_norway::from_str::<serde_norway::Value>(&text)
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
    if let Some(existing) = dir
        .ancestors()
        .find(|p| std::fs::symlink_metadata(p).is_ok())
        .filter(|p| !p.is_dir())
    {
        return Err(invalid(format!(
            "{} is a file, not a directory: remove it or give another --state-dir",
            existing.display()
        )));
    }
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
    if !crate::util::text::is_dns_subdomain(domain) {
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
}

#[cfg(test)]
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
