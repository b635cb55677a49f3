//! The command line: clap's types for every flag (each with its environment variable), and the one line a
//! command-line error is told in.

use super::*;

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

/// A boolean as NVIDIA's plugin (Go's `strconv.ParseBool`) reads one: 1, t, T, TRUE, true, True and the
/// same for false.
pub(super) fn parse_go_bool(value: &str) -> Result<bool, String> {
    match value {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(format!("{value:?} is not a boolean (true or false)")),
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
