//! NVIDIA's device plugin config file, version `v1`, read as a second format beside ours, with NVIDIA's flags and
//! environment variables for the same settings.
//!
//! The file is decoded as NVIDIA's plugin decodes it (`sigs.k8s.io/yaml`): YAML 1.1 turned into JSON
//! ([`yaml11`]), then matched to its settings the way Go's `encoding/json` matches struct fields: a key
//! spelled exactly wins, else one that differs only in case (`MigStrategy`, `deviceIdStrategy`) sets the
//! same setting. Under `sharing.timeSlicing` and `sharing.mps` NVIDIA's own decoder looks keys up exactly
//! as spelled, and so does this one. A file without `version:` is v1, as it is for NVIDIA's plugin.
//!
//! Every file NVIDIA's plugin accepts loads. Keys NVIDIA ignores, keys of its other components
//! (`flags.gfd`) and unknown keys are one warning each that says what happens (for a typo: the default, and
//! the key it probably meant); a setting that would change behaviour and that this plugin does not do is
//! refused by name with the reason, never dropped. Our own `health:` section may sit in the same file.

mod yaml11;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::devices::mig::MigStrategy;
pub use crate::devices::sharing::{
    DeviceSelection, MAX_LISTED_REPLICAS, MIN_LISTED_DEVICE_BYTES, ShareKind, SharedResource,
    Sharing,
};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::{ConfigError, FileConfig};
use crate::health::HealthConfig;

/// The CDI kind of the names Allocate returns under NVIDIA's `cdi-cri` strategy: the one in the CDI specs
/// `nvidia-ctk cdi generate` writes (NVIDIA's plugin uses names of a spec it writes itself, which this plugin
/// does not write).
pub const CDI_KIND: &str = "nvidia.com/gpu";

/// The keys at the top of NVIDIA's v1 file (its Go `Config` struct). A file with any of them (in any case)
/// is NVIDIA's, with or without `version:`; ours has none of them.
const TOP_KEYS: &[&str] = &["version", "flags", "resources", "sharing", "imex"];
/// Our own section, allowed in NVIDIA's file too (spelled exactly: it is read by our decoder).
const OURS: &str = "health";
/// `flags` (Go's `CommandLineFlags`).
const FLAG_KEYS: &[&str] = &[
    "migStrategy",
    "failOnInitError",
    "mpsRoot",
    "nvidiaDriverRoot",
    "nvidiaDevRoot",
    "gdrcopyEnabled",
    "gdsEnabled",
    "mofedEnabled",
    "useNodeFeatureAPI",
    "deviceDiscoveryStrategy",
    "plugin",
    "gfd",
];
/// `flags.plugin` (Go's `PluginCommandLineFlags`).
const PLUGIN_KEYS: &[&str] = &[
    "passDeviceSpecs",
    "deviceListStrategy",
    "deviceIDStrategy",
    "cdiAnnotationPrefix",
    "nvidiaCTKPath",
    "containerDriverRoot",
    "sharedDevicesAllocationPolicy",
];
const SHARING_KEYS: &[&str] = &["timeSlicing", "mps"];
/// `sharing.timeSlicing` and `sharing.mps`: NVIDIA's decoder looks these up exactly as spelled.
const SPEC_KEYS: &[&str] = &["renameByDefault", "failRequestsGreaterThanOne", "resources"];
/// `sharing.*.resources[]`: looked up exactly as spelled, as above.
const RESOURCE_KEYS: &[&str] = &["name", "rename", "devices", "replicas"];
const IMEX_KEYS: &[&str] = &["channelIDs", "required"];

/// NVIDIA's device plugin's flags and environment variables, spelled as NVIDIA's plugin spells them, so that
/// a DaemonSet written for NVIDIA's plugin starts this one unchanged. Flattened into [`super::Args`], so
/// that `--help` lists them under a heading of their own, apart from ours.
#[derive(Debug, clap::Args)]
#[command(next_help_heading = "NVIDIA's device plugin's flags")]
pub struct NvidiaFlags {
    /// Where the device nodes are on the host, as NVIDIA's plugin reads it: device specs name
    /// DIR/dev/nvidiaN as their host path (e.g. /run/nvidia/driver under the GPU operator) [default: the
    /// driver root]
    #[arg(
        long,
        visible_alias = "nvidia-dev-root",
        env = "NVIDIA_DEV_ROOT",
        value_name = "DIR"
    )]
    pub dev_root: Option<PathBuf>,

    /// Config file, as NVIDIA's plugin names the flag (either format; see --config)
    #[arg(long, env = "CONFIG_FILE", value_name = "FILE")]
    pub config_file: Option<PathBuf>,

    /// MIG strategy: none (whole GPUs), single (MIG devices as the GPU resource) or mixed (a resource per MIG profile) [default: none]
    #[arg(long, env = "MIG_STRATEGY", value_name = "STRATEGY")]
    pub mig_strategy: Option<String>,

    /// Same as --device-specs
    #[arg(long, env = "PASS_DEVICE_SPECS", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = super::parse_go_bool)]
    pub pass_device_specs: Option<bool>,

    /// How Allocate names the devices: envvar, volume-mounts, cdi-annotations, cdi-cri; comma-separated or
    /// the flag given again [default: envvar]
    #[arg(
        long,
        env = "DEVICE_LIST_STRATEGY",
        value_name = "LIST",
        value_delimiter = ',',
        action = clap::ArgAction::Append
    )]
    pub device_list_strategy: Vec<String>,

    /// Device IDs: uuid or index [default: uuid]
    #[arg(long, env = "DEVICE_ID_STRATEGY", value_name = "STRATEGY")]
    pub device_id_strategy: Option<String>,

    /// Prefix of the CDI annotation keys with --device-list-strategy cdi-annotations [default: cdi.k8s.io/]
    #[arg(long, env = "CDI_ANNOTATION_PREFIX", value_name = "PREFIX")]
    pub cdi_annotation_prefix: Option<String>,

    /// The driver's root on the host, e.g. /run/nvidia/driver with the GPU operator's driver container: the
    /// dev root's default [default: /]
    #[arg(
        long,
        visible_alias = "nvidia-driver-root",
        env = "NVIDIA_DRIVER_ROOT",
        value_name = "DIR"
    )]
    pub driver_root: Option<String>,

    /// Allocate adds NVIDIA_GDRCOPY=enabled [default: false]
    #[arg(long, env = "GDRCOPY_ENABLED", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = super::parse_go_bool)]
    pub gdrcopy_enabled: Option<bool>,

    /// Allocate adds NVIDIA_GDS=enabled [default: false]
    #[arg(long, env = "GDS_ENABLED", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = super::parse_go_bool)]
    pub gds_enabled: Option<bool>,

    /// Allocate adds NVIDIA_MOFED=enabled [default: false]
    #[arg(long, env = "MOFED_ENABLED", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = super::parse_go_bool)]
    pub mofed_enabled: Option<bool>,

    /// With MPS sharing: the MPS control daemon's root on the host (its pipe and shm directories)
    #[arg(long, env = "MPS_ROOT", value_name = "DIR")]
    pub mps_root: Option<String>,

    /// How replicas are chosen: distributed (spread over the GPUs) or packed (accepted with a warning: replicas are still spread) [default: distributed]
    #[arg(long, env = "SHARED_DEVICES_ALLOCATION_POLICY", value_name = "POLICY")]
    pub shared_devices_allocation_policy: Option<String>,

    /// Device discovery: auto or nvml (tegra is refused: there is no NVML on Tegra) [default: auto]
    #[arg(long, env = "DEVICE_DISCOVERY_STRATEGY", value_name = "STRATEGY")]
    pub device_discovery_strategy: Option<String>,

    /// Where the driver root is mounted in this container: NVML is loaded from under it (lib64 and lib
    /// directories, as NVIDIA's plugin searches them) when --nvml-lib is not given, and IMEX channels are
    /// looked for under its dev/; a directory that is not there is passed over (also read from
    /// CONTAINER_DRIVER_ROOT) [default: /driver-root]
    #[arg(
        long,
        visible_alias = "container-driver-root",
        env = "DRIVER_ROOT_CTR_PATH",
        value_name = "DIR"
    )]
    pub driver_root_ctr_path: Option<PathBuf>,

    /// IMEX channels every container gets (NVIDIA supports channel 0 only): comma-separated or the flag
    /// given again [default: none]
    #[arg(long, env = "IMEX_CHANNEL_IDS", value_name = "IDS", value_delimiter = ',', action = clap::ArgAction::Append)]
    pub imex_channel_ids: Vec<String>,

    /// Refuse to start when a requested IMEX channel's device node is missing (otherwise it is left out,
    /// with a warning) [default: false]
    #[arg(long, env = "IMEX_REQUIRED", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = super::parse_go_bool)]
    pub imex_required: Option<bool>,

    /// The kubelet's registration socket; its directory is the kubelet directory (see --kubelet-dir); its
    /// name must be kubelet.sock [default: /var/lib/kubelet/device-plugins/kubelet.sock]
    #[arg(long, env = "KUBELET_SOCKET", value_name = "PATH")]
    pub kubelet_socket: Option<String>,

    /// Accepted, no effect: the NVIDIA CDI hook used in CDI specs, which this plugin does not write (also
    /// read from NVIDIA_CTK_PATH)
    #[arg(
        long,
        visible_alias = "nvidia-ctk-path",
        env = "NVIDIA_CDI_HOOK_PATH",
        value_name = "PATH"
    )]
    pub nvidia_cdi_hook_path: Option<String>,

    /// Accepted, no effect: feature flags of CDI spec generation, which this plugin does not do
    #[arg(long, env = "CDI_FEATURE_FLAGS", value_name = "LIST", value_delimiter = ',', action = clap::ArgAction::Append)]
    pub cdi_feature_flags: Vec<String>,

    /// Accepted, no effect: OCI hooks left out of generated CDI specs, which this plugin does not write
    #[arg(long, env = "CDI_DISABLE_HOOKS", value_name = "LIST", value_delimiter = ',', action = clap::ArgAction::Append)]
    pub cdi_disable_hooks: Vec<String>,
}

impl NvidiaFlags {
    /// NVIDIA's settings as these flags and their variables give them, to be merged over the file's
    /// ([`NvidiaSettings::or`]). `imex_channel_ids` is `--imex-channel-ids` as checked by the caller; none
    /// leaves the file's channels in place.
    pub fn settings(&self, imex_channel_ids: &[u32]) -> NvidiaSettings {
        NvidiaSettings {
            mig_strategy: self.mig_strategy.clone(),
            driver_root: self.driver_root.clone(),
            device_list_strategy: (!self.device_list_strategy.is_empty()).then(|| {
                self.device_list_strategy
                    .iter()
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            }),
            device_id_strategy: self.device_id_strategy.clone(),
            gdrcopy: self.gdrcopy_enabled,
            gds: self.gds_enabled,
            mofed: self.mofed_enabled,
            device_discovery_strategy: self.device_discovery_strategy.clone(),
            sharing: None,
            mps_root: self.mps_root.clone(),
            shared_devices_allocation_policy: self.shared_devices_allocation_policy.clone(),
            cdi_annotation_prefix: self.cdi_annotation_prefix.clone(),
            imex_channel_ids: (!imex_channel_ids.is_empty())
                .then(|| imex_channel_ids.iter().map(|&id| i64::from(id)).collect()),
            imex_required: self.imex_required,
            ..NvidiaSettings::default()
        }
    }

    /// One warning for each of NVIDIA's settings given that means nothing here, saying why.
    pub fn without_effect(&self) -> Vec<String> {
        let set = |name: &str| std::env::var_os(name).is_some_and(|v| !v.is_empty());
        let cdi_specs = "no effect here: it shapes the CDI specs NVIDIA's plugin writes, and this plugin writes \
                         none (it names devices in CDI form, with --cdi or deviceListStrategy cdi-cri or \
                         cdi-annotations; the specs come from the NVIDIA container toolkit)";
        [
            (
                "--nvidia-cdi-hook-path (NVIDIA_CDI_HOOK_PATH, NVIDIA_CTK_PATH)",
                self.nvidia_cdi_hook_path.is_some() || set("NVIDIA_CTK_PATH"),
            ),
            (
                "--cdi-feature-flags (CDI_FEATURE_FLAGS)",
                !self.cdi_feature_flags.is_empty(),
            ),
            (
                "--cdi-disable-hooks (CDI_DISABLE_HOOKS)",
                !self.cdi_disable_hooks.is_empty(),
            ),
        ]
        .into_iter()
        .filter(|(_, given)| *given)
        .map(|(setting, _)| format!("{setting}: {cdi_specs}"))
        .collect()
    }
}

/// NVIDIA's settings that are not ours by another name, merged from its flags, environment and file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NvidiaSettings {
    /// `migStrategy`.
    pub mig_strategy: Option<String>,
    /// `nvidiaDriverRoot`.
    pub driver_root: Option<String>,
    /// `deviceListStrategy`, each entry.
    pub device_list_strategy: Option<Vec<String>>,
    /// `deviceIDStrategy`.
    pub device_id_strategy: Option<String>,
    /// `gdrcopyEnabled`, `gdsEnabled`, `mofedEnabled`.
    pub gdrcopy: Option<bool>,
    /// See `gdrcopy`.
    pub gds: Option<bool>,
    /// See `gdrcopy`.
    pub mofed: Option<bool>,
    /// `deviceDiscoveryStrategy`.
    pub device_discovery_strategy: Option<String>,
    /// `sharing.timeSlicing` or `sharing.mps` (file only).
    pub sharing: Option<Sharing>,
    /// `mpsRoot`: where NVIDIA's MPS control daemon keeps its pipe and shm directories on the host.
    pub mps_root: Option<String>,
    /// `sharedDevicesAllocationPolicy`.
    pub shared_devices_allocation_policy: Option<String>,
    /// `cdiAnnotationPrefix`.
    pub cdi_annotation_prefix: Option<String>,
    /// `imex.channelIDs` (`--imex-channel-ids`, `IMEX_CHANNEL_IDS`): the IMEX channels every container given
    /// a GPU gets, as NVIDIA's plugin adds them; `null` in the file is none, as for NVIDIA. Checked in
    /// [`apply`]: NVIDIA's plugin supports channel 0 only.
    pub imex_channel_ids: Option<Vec<i64>>,
    /// `imex.required` (`--imex-required`, `IMEX_REQUIRED`).
    pub imex_required: Option<bool>,
    /// `flags.plugin.containerDriverRoot` (`--driver-root-ctr-path`): where the host's driver root is mounted
    /// in the plugin's container; NVML is looked for under it.
    pub container_driver_root: Option<String>,
    /// The config file these settings were (partly) read from, to name it in an error about one of them.
    pub config_file: Option<PathBuf>,
    /// The settings (by their key in NVIDIA's file, e.g. `flags.migStrategy`) whose value came from
    /// `config_file`: an invalid one is refused naming the file and key, not a flag the user never gave.
    pub from_file: BTreeSet<&'static str>,
}

impl NvidiaSettings {
    /// Each field from `self` where it is set, else from `under`.
    pub fn or(self, under: NvidiaSettings) -> NvidiaSettings {
        let from_file: BTreeSet<&'static str> = under
            .from_file
            .iter()
            .copied()
            .filter(|key| !self.is_set(key))
            .chain(self.from_file.iter().copied())
            .collect();
        NvidiaSettings {
            mig_strategy: self.mig_strategy.or(under.mig_strategy),
            driver_root: self.driver_root.or(under.driver_root),
            device_list_strategy: self.device_list_strategy.or(under.device_list_strategy),
            device_id_strategy: self.device_id_strategy.or(under.device_id_strategy),
            gdrcopy: self.gdrcopy.or(under.gdrcopy),
            gds: self.gds.or(under.gds),
            mofed: self.mofed.or(under.mofed),
            device_discovery_strategy: self
                .device_discovery_strategy
                .or(under.device_discovery_strategy),
            sharing: self.sharing.or(under.sharing),
            mps_root: self.mps_root.or(under.mps_root),
            shared_devices_allocation_policy: self
                .shared_devices_allocation_policy
                .or(under.shared_devices_allocation_policy),
            cdi_annotation_prefix: self.cdi_annotation_prefix.or(under.cdi_annotation_prefix),
            imex_channel_ids: self.imex_channel_ids.or(under.imex_channel_ids),
            imex_required: self.imex_required.or(under.imex_required),
            container_driver_root: self.container_driver_root.or(under.container_driver_root),
            config_file: self.config_file.or(under.config_file),
            from_file,
        }
    }

    /// Whether the setting with file key `key` has a value here.
    fn is_set(&self, key: &str) -> bool {
        match key {
            MIG_STRATEGY => self.mig_strategy.is_some(),
            DEVICE_ID_STRATEGY => self.device_id_strategy.is_some(),
            DEVICE_LIST_STRATEGY => self.device_list_strategy.is_some(),
            DISCOVERY => self.device_discovery_strategy.is_some(),
            POLICY => self.shared_devices_allocation_policy.is_some(),
            ANNOTATION_PREFIX => self.cdi_annotation_prefix.is_some(),
            DRIVER_ROOT => self.driver_root.is_some(),
            MPS_ROOT => self.mps_root.is_some(),
            CHANNEL_IDS => self.imex_channel_ids.is_some(),
            _ => false,
        }
    }
}

const MIG_STRATEGY: &str = "flags.migStrategy";
const DEVICE_ID_STRATEGY: &str = "flags.plugin.deviceIDStrategy";
const DEVICE_LIST_STRATEGY: &str = "flags.plugin.deviceListStrategy";
const DISCOVERY: &str = "flags.deviceDiscoveryStrategy";
const POLICY: &str = "flags.plugin.sharedDevicesAllocationPolicy";
const ANNOTATION_PREFIX: &str = "flags.plugin.cdiAnnotationPrefix";
const DRIVER_ROOT: &str = "flags.nvidiaDriverRoot";
const MPS_ROOT: &str = "flags.mpsRoot";
const CHANNEL_IDS: &str = "imex.channelIDs";

/// What NVIDIA's file gives: our settings it maps to, NVIDIA's own, and warnings to log.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Our settings it sets.
    pub file: FileConfig,
    /// NVIDIA's settings without a flag of ours.
    pub nvidia: NvidiaSettings,
    /// Keys read and ignored, one line each.
    pub warnings: Vec<String>,
}

/// The file's text as NVIDIA's decoder sees it (YAML 1.1 as JSON); `Err` with the parser's message (and
/// line) where it is not YAML.
pub fn document(text: &str) -> Result<Value, String> {
    yaml11::to_json(text)
}

/// Whether a document (from [`document`]) is NVIDIA's format: a mapping with `version` or any other of the
/// top-level keys of NVIDIA's v1 file, in any case, as NVIDIA's decoder matches them. Our own format has
/// none of them.
pub fn is_nvidias(document: &Value) -> bool {
    document.as_object().is_some_and(|map| {
        map.keys()
            .any(|key| TOP_KEYS.iter().any(|k| k.eq_ignore_ascii_case(key)))
    })
}

/// Whether `text` starts a line with one of NVIDIA's top-level keys (`version:`, `flags:`, ...), unindented
/// and maybe quoted: NVIDIA's file for certain, even where no YAML reader takes it (a null key, a list as a
/// key, a syntax error), so that its refusal is the YAML 1.1 reader's reason and not our format's "unknown
/// field `version`". None of these keys is a key of ours.
pub fn names_nvidias_keys(text: &str) -> bool {
    text.lines().any(|line| {
        let Some((key, _)) = line.split_once(':') else {
            return false;
        };
        let key = key.trim_end().trim_matches(|c| c == '"' || c == '\'');
        !line.starts_with(char::is_whitespace)
            && TOP_KEYS.iter().any(|k| k.eq_ignore_ascii_case(key))
    })
}

/// Reads NVIDIA's file: `document` is its text as [`document`] gives it, `text` the text itself (for our
/// `health:` section, read by our own decoder). Errors name the file and the key.
pub fn load(document: &Value, text: &str, path: &Path) -> Result<Loaded, ConfigError> {
    let bad = |message: String| ConfigError::ParseFile {
        path: path.to_owned(),
        message,
    };
    let mut warnings = Vec::new();
    let Some(top) = document.as_object() else {
        return Err(bad(format!(
            "NVIDIA's format is a mapping at the top, found {}",
            yaml11::describe(document)
        )));
    };
    let top = Level::read(top, "", TOP_KEYS, Match::AnyCase, &[OURS], &mut warnings);
    let version = match top.get("version") {
        None | Some(Value::Null) => String::new(),
        // A number or boolean lands in Go's string field as its text (sigs.k8s.io/yaml does that at the
        // top level only).
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bool(b)) => b.to_string(),
        Some(Value::Number(n)) => n.to_string(),
        Some(other) => {
            return Err(bad(format!(
                "version: expected a string, found {}",
                yaml11::describe(other)
            )));
        }
    };
    if !version.is_empty() && version != "v1" {
        return Err(bad(format!(
            "version {version:?} is not supported: this plugin reads version v1 of NVIDIA's format (the only one \
             NVIDIA's plugin reads; a file without version is v1), and its own format, which has no version key"
        )));
    }

    let flags = object(top.get("flags"), "flags").map_err(bad)?;
    let flags = Level::read_opt(flags, "flags.", FLAG_KEYS, Match::AnyCase, &mut warnings);
    let plugin = object(flags.get("plugin"), "flags.plugin").map_err(bad)?;
    let plugin = Level::read_opt(
        plugin,
        "flags.plugin.",
        PLUGIN_KEYS,
        Match::AnyCase,
        &mut warnings,
    );
    let mut nvidia = NvidiaSettings {
        config_file: Some(path.to_owned()),
        ..NvidiaSettings::default()
    };
    let get_string =
        |level: &Level<'_>, key: &'static str| -> Result<Option<String>, ConfigError> {
            string(level.get(key), &level.path(key)).map_err(bad)
        };
    let get_bool = |level: &Level<'_>, key: &'static str| -> Result<Option<bool>, ConfigError> {
        boolean(level.get(key), &level.path(key)).map_err(bad)
    };
    nvidia.mig_strategy = get_string(&flags, "migStrategy")?;
    nvidia.driver_root = get_string(&flags, "nvidiaDriverRoot")?;
    nvidia.mps_root = get_string(&flags, "mpsRoot")?;
    nvidia.gdrcopy = get_bool(&flags, "gdrcopyEnabled")?;
    nvidia.gds = get_bool(&flags, "gdsEnabled")?;
    nvidia.mofed = get_bool(&flags, "mofedEnabled")?;
    nvidia.device_discovery_strategy = get_string(&flags, "deviceDiscoveryStrategy")?;
    nvidia.device_id_strategy = get_string(&plugin, "deviceIDStrategy")?;
    nvidia.cdi_annotation_prefix = get_string(&plugin, "cdiAnnotationPrefix")?;
    nvidia.shared_devices_allocation_policy = get_string(&plugin, "sharedDevicesAllocationPolicy")?;
    nvidia.device_list_strategy = match plugin.get("deviceListStrategy") {
        None | Some(Value::Null) => None,
        Some(Value::String(one)) => Some(vec![one.clone()]),
        Some(Value::Array(many)) => Some(
            many.iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(bad(format!(
                        "{DEVICE_LIST_STRATEGY}: expected a string or a list of strings, found {} in the list",
                        yaml11::describe(other)
                    ))),
                })
                .collect::<Result<_, _>>()?,
        ),
        Some(other) => {
            return Err(bad(format!(
                "{DEVICE_LIST_STRATEGY}: expected a string or a list of strings, found {}",
                yaml11::describe(other)
            )));
        }
    };
    let file = FileConfig {
        fail_on_init_error: get_bool(&flags, "failOnInitError")?,
        dev_root: get_string(&flags, "nvidiaDevRoot")?.map(PathBuf::from),
        device_specs: get_bool(&plugin, "passDeviceSpecs")?,
        health: health(&top, text).map_err(bad)?,
        ..FileConfig::default()
    };

    let mut ignored = |key: &str, why: &str| warnings.push(format!("config key {key}: {why}"));
    if flags.get("gfd").is_some() {
        ignored(
            "flags.gfd",
            "GPU feature discovery's settings; no effect on a device plugin (NVIDIA's plugin drops them too)",
        );
    }
    if get_bool(&flags, "useNodeFeatureAPI")?.is_some() {
        ignored(
            "flags.useNodeFeatureAPI",
            "GPU feature discovery's setting; no effect on a device plugin (NVIDIA's plugin does not read it either)",
        );
    }
    if top.get("resources").is_some_and(|v| !v.is_null()) {
        ignored(
            "resources",
            "NVIDIA's plugin v0.20 ignores it (resources keep their default names); so does this one",
        );
    }
    if let Some(ctk) = get_string(&plugin, "nvidiaCTKPath")? {
        ignored(
            &format!("flags.plugin.nvidiaCTKPath ({ctk})"),
            "used by NVIDIA's plugin to write CDI specs, which this plugin does not write; no effect",
        );
    }
    nvidia.container_driver_root = get_string(&plugin, "containerDriverRoot")?;
    for (key, value) in [
        (MIG_STRATEGY, nvidia.mig_strategy.is_some()),
        (DEVICE_ID_STRATEGY, nvidia.device_id_strategy.is_some()),
        (DEVICE_LIST_STRATEGY, nvidia.device_list_strategy.is_some()),
        (DISCOVERY, nvidia.device_discovery_strategy.is_some()),
        (POLICY, nvidia.shared_devices_allocation_policy.is_some()),
        (ANNOTATION_PREFIX, nvidia.cdi_annotation_prefix.is_some()),
        (DRIVER_ROOT, nvidia.driver_root.is_some()),
        (MPS_ROOT, nvidia.mps_root.is_some()),
    ] {
        if value {
            nvidia.from_file.insert(key);
        }
    }

    let sharing = object(top.get("sharing"), "sharing").map_err(bad)?;
    let sharing = Level::read_opt(
        sharing,
        "sharing.",
        SHARING_KEYS,
        Match::AnyCase,
        &mut warnings,
    );
    // timeSlicing is a struct in NVIDIA's Config (null still runs its decoder, which then finds no
    // resources); mps a pointer (null is no MPS).
    let time_slicing = sharing
        .get("timeSlicing")
        .map(|spec| replicated(ShareKind::TimeSlicing, spec, &mut warnings))
        .transpose()
        .map_err(bad)?;
    let mps = match sharing.get("mps") {
        None | Some(Value::Null) => None,
        Some(spec) => Some(replicated(ShareKind::Mps, spec, &mut warnings).map_err(bad)?),
    };
    nvidia.sharing = match (time_slicing, mps) {
        (Some(_), Some(mps)) => {
            warnings.push(
                "config key sharing.timeSlicing: ignored: sharing.mps is set too, and NVIDIA's plugin then \
                 shares through MPS only; so does this one"
                    .into(),
            );
            Some(mps)
        }
        (time_slicing, mps) => mps.or(time_slicing),
    };

    let imex = object(top.get("imex"), "imex").map_err(bad)?;
    let imex = Level::read_opt(imex, "imex.", IMEX_KEYS, Match::AnyCase, &mut warnings);
    nvidia.imex_required = get_bool(&imex, "required")?;
    nvidia.imex_channel_ids = match imex.get("channelIDs") {
        None | Some(Value::Null) => None,
        Some(Value::Array(ids)) => Some(
            ids.iter()
                .map(|id| {
                    integer(id).ok_or_else(|| {
                        bad(format!(
                            "{CHANNEL_IDS}: expected a list of channel numbers, found {} in it",
                            yaml11::describe(id)
                        ))
                    })
                })
                .collect::<Result<_, _>>()?,
        ),
        Some(other) => {
            return Err(bad(format!(
                "{CHANNEL_IDS}: expected a list of channel numbers, found {}",
                yaml11::describe(other)
            )));
        }
    };
    if nvidia.imex_channel_ids.is_some() {
        nvidia.from_file.insert(CHANNEL_IDS);
    }
    Ok(Loaded {
        file,
        nvidia,
        warnings,
    })
}

/// Our `health:` section, read by our own (YAML 1.2, strict) decoder so that it means what it means in our
/// format; errors name its line.
fn health(top: &Level<'_>, text: &str) -> Result<Option<HealthConfig>, String> {
    if top.ours.is_empty() {
        return Ok(None);
    }
    /// The rest of the file is NVIDIA's: not denied here.
    #[derive(Deserialize)]
    struct Ours {
        health: Option<HealthConfig>,
    }
    serde_norway::from_str::<Ours>(text)
        .map(|ours| ours.health)
        .map_err(|e| e.to_string().replace('\n', " "))
}

/// How the keys of one level are matched to settings.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Match {
    /// As Go's `encoding/json`: the key spelled exactly, else one equal but for case.
    AnyCase,
    /// As NVIDIA's own decoders under `sharing.*` do: exactly as spelled.
    Exact,
}

/// One mapping of NVIDIA's file, its keys matched to the settings of that level.
struct Level<'v> {
    prefix: &'static str,
    found: Vec<(&'static str, &'v Value)>,
    /// Keys of ours (exact) present at this level.
    ours: Vec<&'static str>,
}

impl<'v> Level<'v> {
    fn read_opt(
        map: Option<&'v Map<String, Value>>,
        prefix: &'static str,
        known: &'static [&'static str],
        matching: Match,
        warnings: &mut Vec<String>,
    ) -> Level<'v> {
        match map {
            Some(map) => Level::read(map, prefix, known, matching, &[], warnings),
            None => Level {
                prefix,
                found: Vec::new(),
                ours: Vec::new(),
            },
        }
    }

    /// Matches `map`'s keys to `known` settings, warning about every key that sets nothing (with the
    /// setting it probably meant) and about two keys that set the same setting.
    fn read(
        map: &'v Map<String, Value>,
        prefix: &'static str,
        known: &'static [&'static str],
        matching: Match,
        ours: &[&'static str],
        warnings: &mut Vec<String>,
    ) -> Level<'v> {
        let mut level = Level {
            prefix,
            found: Vec::new(),
            ours: Vec::new(),
        };
        // Go decodes the keys in sorted (byte) order, each overwriting what an earlier one set.
        let mut keys: Vec<(&String, &Value)> = map.iter().collect();
        keys.sort_by(|a, b| a.0.cmp(b.0));
        let mut setters: Vec<(&'static str, Vec<&str>)> = Vec::new();
        for (key, value) in keys {
            if let Some(&mine) = ours.iter().find(|o| **o == key.as_str()) {
                level.ours.push(mine);
                continue;
            }
            let exact = known.iter().find(|k| **k == key.as_str());
            let folded = known.iter().find(|k| k.eq_ignore_ascii_case(key));
            let field = match (exact, folded, matching) {
                (Some(k), _, _) | (None, Some(k), Match::AnyCase) => *k,
                (None, Some(k), Match::Exact) => {
                    warnings.push(format!(
                        "config key {prefix}{key}: ignored: NVIDIA's plugin reads the keys under {} exactly as \
                         spelled, so this one sets nothing there either (did you mean {prefix}{k}?)",
                        prefix.trim_end_matches('.')
                    ));
                    continue;
                }
                (None, None, _) => {
                    let hint = suggestion(key, known.iter().chain(ours.iter()).copied())
                        .map(|k| format!(" (did you mean {prefix}{k}?)"))
                        .unwrap_or_default();
                    let what = if prefix.is_empty() {
                        "not a key of NVIDIA's v1 format".to_string()
                    } else {
                        format!(
                            "not a key of {} in NVIDIA's v1 format",
                            prefix.trim_end_matches('.')
                        )
                    };
                    warnings.push(format!(
                        "config key {prefix}{key}: {what}; ignored, as NVIDIA's plugin ignores it (what it would \
                         set keeps its default){hint}"
                    ));
                    continue;
                }
            };
            level.found.retain(|(f, _)| *f != field);
            level.found.push((field, value));
            match setters.iter_mut().find(|(f, _)| *f == field) {
                Some((_, keys)) => keys.push(key),
                None => setters.push((field, vec![key])),
            }
        }
        for (_, keys) in setters.iter().filter(|(_, keys)| keys.len() > 1) {
            let used = keys.last().copied().unwrap_or_default();
            let all: Vec<String> = keys.iter().map(|k| format!("{prefix}{k}")).collect();
            warnings.push(format!(
                "config keys {} set the same setting; the value of {prefix}{used} is used, as NVIDIA's plugin uses \
                 it (the last in byte order)",
                all.join(" and ")
            ));
        }
        level
    }

    fn get(&self, field: &str) -> Option<&'v Value> {
        self.found
            .iter()
            .find(|(f, _)| *f == field)
            .map(|(_, v)| *v)
    }

    fn path(&self, field: &str) -> String {
        format!("{}{field}", self.prefix)
    }
}

/// The known key closest to a mistyped one, when it is close enough to be what was meant.
fn suggestion<'k>(key: &str, known: impl Iterator<Item = &'k str>) -> Option<&'k str> {
    let key = key.to_ascii_lowercase();
    known
        .map(|k| (strsim::levenshtein(&key, &k.to_ascii_lowercase()), k))
        .filter(|(distance, k)| *distance <= 3.max(k.len() / 4) && *distance < k.len())
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, k)| k)
}

/// A mapping value: `None` for absent or null (Go leaves the struct as it is).
fn object<'v>(
    value: Option<&'v Value>,
    key: &str,
) -> Result<Option<&'v Map<String, Value>>, String> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(map)) => Ok(Some(map)),
        Some(other) => Err(format!(
            "{key}: expected a mapping, found {}",
            yaml11::describe(other)
        )),
    }
}

/// A string setting: Go's `*string`, which takes a JSON string only (no number, no boolean).
fn string(value: Option<&Value>, key: &str) -> Result<Option<String>, String> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Bool(b)) => Err(format!(
            "{key}: expected a string, found the boolean {b} (NVIDIA's plugin reads YAML 1.1, where an unquoted \
             yes/no/on/off/y/n is a boolean, and refuses it here too; quote the value)"
        )),
        Some(other) => Err(format!(
            "{key}: expected a string, found {} (NVIDIA's plugin refuses it too; quote the value)",
            yaml11::describe(other)
        )),
    }
}

/// A boolean setting: Go's `*bool`, which takes a JSON boolean only (`"true"` in quotes is a string).
fn boolean(value: Option<&Value>, key: &str) -> Result<Option<bool>, String> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(format!(
            "{key}: expected true or false, found {} (NVIDIA's plugin refuses it too)",
            yaml11::describe(other)
        )),
    }
}

/// A JSON number Go's `encoding/json` puts in an `int`: a whole number (`2.0` is 2, as `json.Marshal` writes
/// it `2`).
fn integer(value: &Value) -> Option<i64> {
    let Value::Number(n) = value else { return None };
    n.as_i64().or_else(|| {
        n.as_f64()
            .filter(|f| f.fract() == 0.0 && f.abs() < 9.0e18)
            .map(|f| f as i64)
    })
}

/// `sharing.timeSlicing` or `sharing.mps`, checked as NVIDIA's decoder checks it: at least one resource,
/// each with a name and at least 2 replicas, `devices` as `all`, a count above 0 or a list of indices and
/// UUIDs; keys looked up exactly as spelled.
fn replicated(
    kind: ShareKind,
    spec: &Value,
    warnings: &mut Vec<String>,
) -> Result<Sharing, String> {
    let section = match kind {
        ShareKind::TimeSlicing => "sharing.timeSlicing",
        ShareKind::Mps => "sharing.mps",
    };
    let prefix = match kind {
        ShareKind::TimeSlicing => "sharing.timeSlicing.",
        ShareKind::Mps => "sharing.mps.",
    };
    let invalid = |key: String, why: &str| format!("{section}{key}: {why}");
    let spec = match spec {
        Value::Object(map) => Some(map),
        Value::Null => None,
        other => {
            return Err(invalid(
                String::new(),
                &format!("expected a mapping, found {}", yaml11::describe(other)),
            ));
        }
    };
    let spec = Level::read_opt(spec, prefix, SPEC_KEYS, Match::Exact, warnings);
    let rename_by_default = match spec.get("renameByDefault") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(invalid(
                ".renameByDefault".into(),
                &format!("expected true or false, found {}", yaml11::describe(other)),
            ));
        }
    };
    let fail_requests = boolean(
        spec.get("failRequestsGreaterThanOne"),
        &format!("{prefix}failRequestsGreaterThanOne"),
    )?;
    let entries = match spec.get("resources") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(entries)) => entries.iter().collect(),
        Some(other) => {
            return Err(invalid(
                ".resources".into(),
                &format!("expected a list, found {}", yaml11::describe(other)),
            ));
        }
    };
    if entries.is_empty() {
        return Err(invalid(".resources".into(), "no resources specified"));
    }
    let mut resources: Vec<SharedResource> = Vec::with_capacity(entries.len());
    let mut names = std::collections::HashSet::with_capacity(entries.len());
    for (i, entry) in entries.into_iter().enumerate() {
        let at = |key: &str| format!(".resources[{i}]{key}");
        let entry = match entry {
            Value::Object(map) => Some(map),
            Value::Null => None,
            other => {
                return Err(invalid(
                    at(""),
                    &format!("expected a mapping, found {}", yaml11::describe(other)),
                ));
            }
        };
        let entry_prefix: &'static str = match kind {
            ShareKind::TimeSlicing => "sharing.timeSlicing.resources[].",
            ShareKind::Mps => "sharing.mps.resources[].",
        };
        let raw = entry;
        let entry = Level::read_opt(entry, entry_prefix, RESOURCE_KEYS, Match::Exact, warnings);
        let name = match entry.get("name") {
            None => None,
            Some(Value::Null) => Some(String::new()),
            Some(Value::String(s)) => Some(s.clone()),
            Some(other) => {
                return Err(invalid(
                    at(".name"),
                    &format!("expected a string, found {}", yaml11::describe(other)),
                ));
            }
        };
        let name = name
            .filter(|n| !n.is_empty())
            .ok_or_else(|| invalid(at(".name"), "no resource name specified"))?;
        let name = full_resource_name(&name).map_err(|why| invalid(at(".name"), &why))?;
        // A set, not a search of the entries so far: the list may hold tens of thousands of entries.
        if !names.insert(name.clone()) {
            return Err(invalid(
                at(".name"),
                &format!("{name} is shared twice; give each resource one entry"),
            ));
        }
        let rename = match entry.get("rename") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.is_empty() => None,
            Some(Value::String(s)) => {
                Some(full_resource_name(s).map_err(|why| invalid(at(".rename"), &why))?)
            }
            Some(other) => {
                return Err(invalid(
                    at(".rename"),
                    &format!("expected a string, found {}", yaml11::describe(other)),
                ));
            }
        };
        let rename = match rename {
            Some(rename) => Some(rename),
            None if rename_by_default => Some(format!("{name}.shared")),
            None => None,
        }
        .filter(|rename| *rename != name);
        let replicas = match entry.get("replicas") {
            None => {
                // A key meant as `replicas` (`replica`, `Replicas`) is only warned about, and the refusal
                // comes first: it says which key was meant.
                let meant = raw
                    .into_iter()
                    .flat_map(|map| map.keys())
                    .find(|k| suggestion(k, ["replicas"].into_iter()).is_some());
                let why = match meant {
                    Some(key) => format!(
                        "no replicas specified (the entry has {}: did you mean replicas?)",
                        crate::util::text::shown(key, crate::util::text::SHOWN_MAX)
                    ),
                    None => "no replicas specified".to_string(),
                };
                return Err(invalid(at(".replicas"), &why));
            }
            // Go leaves the int at 0.
            Some(Value::Null) => 0,
            Some(value) => integer(value).ok_or_else(|| {
                invalid(
                    at(".replicas"),
                    &format!("expected a whole number, found {}", yaml11::describe(value)),
                )
            })?,
        };
        let replicas = match usize::try_from(replicas) {
            Ok(n) if n < 2 => {
                return Err(invalid(at(".replicas"), "number of replicas must be >= 2"));
            }
            Err(_) => return Err(invalid(at(".replicas"), "number of replicas must be >= 2")),
            Ok(n) if n > MAX_LISTED_REPLICAS => {
                return Err(invalid(
                    at(".replicas"),
                    &format!(
                        "{n} replicas of a single device already make a device list larger than the 4194304 \
                         bytes the kubelet accepts in one message (each listed replica takes at least \
                         {MIN_LISTED_DEVICE_BYTES} bytes); at most {MAX_LISTED_REPLICAS}"
                    ),
                ));
            }
            Ok(n) => n,
        };
        let devices =
            device_selection(entry.get("devices")).map_err(|why| invalid(at(".devices"), &why))?;
        resources.push(SharedResource {
            name,
            rename,
            replicas,
            devices,
        });
    }
    Ok(Sharing {
        kind,
        // MPS refuses more than one replica per container unless told otherwise; time-slicing allows it.
        fail_requests_greater_than_one: fail_requests.unwrap_or(kind == ShareKind::Mps),
        resources,
    })
}

/// A resource name of a sharing entry in full: one without a domain is in `nvidia.com`, as NVIDIA reads it.
fn full_resource_name(name: &str) -> Result<String, String> {
    let full = if name.contains('/') {
        name.to_string()
    } else {
        format!("nvidia.com/{name}")
    };
    super::check_extended_resource_name(&full).map_err(|e| match e {
        ConfigError::Invalid { why, .. } => format!("{full:?}: {why}"),
        other => other.to_string(),
    })?;
    Ok(full)
}

/// `items` without repeats, each where it first appears, in one pass: a list from the config file may hold
/// about 100 000 entries within the file's size limit, and comparing each with every earlier one took
/// 15 s.
fn first_of_each<T: Eq + std::hash::Hash + Clone>(items: Vec<T>) -> Vec<T> {
    let mut seen = std::collections::HashSet::with_capacity(items.len());
    items
        .into_iter()
        .filter(|item| seen.insert(item.clone()))
        .collect()
}

/// `devices` as NVIDIA's plugin reads it: `all`, a count above 0, or a list whose entries are GPU indices
/// (numbers or strings), MIG indices `<gpu>:<mig>`, or GPU and MIG UUIDs.
fn device_selection(devices: Option<&Value>) -> Result<DeviceSelection, String> {
    let entry = |value: &Value| -> Result<String, String> {
        let text = match value {
            Value::Number(n) => n
                .as_u64()
                .map(|n| n.to_string())
                .ok_or_else(|| format!("{n} is not a device index"))?,
            Value::String(s) => s.clone(),
            other => {
                return Err(format!(
                    "{} is not a device index or UUID",
                    yaml11::describe(other)
                ));
            }
        };
        let is_index = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        let is_mig_index = || {
            text.split_once(':')
                .is_some_and(|(g, m)| is_index(g) && is_index(m))
        };
        let is_uuid = ["GPU-", "MIG-"]
            .iter()
            .any(|p| text.strip_prefix(p).is_some_and(|rest| !rest.is_empty()));
        if is_index(&text) || is_mig_index() || is_uuid {
            Ok(text)
        } else {
            Err(format!(
                "{text:?} is not a GPU index, a MIG index (<gpu>:<mig>) or a GPU/MIG UUID"
            ))
        }
    };
    match devices {
        None | Some(Value::Null) => Ok(DeviceSelection::All),
        Some(Value::String(all)) if all == "all" => Ok(DeviceSelection::All),
        Some(Value::String(other)) => Err(format!(
            "{other:?}: the only string allowed is all (or give a count or a list)"
        )),
        Some(Value::Number(n)) => match integer(&Value::Number(n.clone())) {
            Some(count) if count > 0 => Ok(DeviceSelection::Count(
                usize::try_from(count).unwrap_or(usize::MAX),
            )),
            _ => Err(format!("{n}: a count of devices must be > 0")),
        },
        Some(Value::Array(list)) if !list.is_empty() => {
            let refs = list.iter().map(entry).collect::<Result<Vec<_>, _>>()?;
            Ok(DeviceSelection::List(first_of_each(refs)))
        }
        Some(Value::Array(_)) => {
            Err("an empty list shares nothing; leave devices out for all".into())
        }
        Some(other) => Err(format!(
            "{}: must be all, a count or a list",
            yaml11::describe(other)
        )),
    }
}

/// What NVIDIA's settings make this plugin do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// Allocate sets `NVIDIA_VISIBLE_DEVICES` (strategy `envvar`).
    pub envvar: bool,
    /// Allocate returns CDI names in `cdi_devices` (strategy `cdi-cri`).
    pub cdi: bool,
    /// Allocate lists the devices as mounts (strategy `volume-mounts`).
    pub volume_mounts: bool,
    /// Allocate puts the CDI names in an annotation under this prefix (strategy `cdi-annotations`).
    pub cdi_annotations: Option<String>,
    /// Environment variables every Allocate adds (`NVIDIA_GDRCOPY=enabled`, …).
    pub extra_envs: Vec<(String, String)>,
    /// The driver root, where `--dev-root` defaults to.
    pub driver_root: PathBuf,
    /// How devices are named to the kubelet.
    pub naming: crate::devices::naming::Naming,
    /// Which devices are shared, and how.
    pub sharing: Option<Sharing>,
    /// The MPS root on the host, with `sharing.mps`.
    pub mps_root: Option<PathBuf>,
    /// How GPUs in MIG mode are served.
    pub mig_strategy: MigStrategy,
    /// IMEX channels every container given a device gets (`imex.channelIDs`): empty, or `[0]`, the only
    /// channel NVIDIA's plugin supports. NVIDIA's plugin adds the channel's device node
    /// (`/dev/nvidia-caps-imex-channels/channel<N>`) to each Allocate where it exists, and skips it where
    /// it does not, unless `imex_required`.
    pub imex_channel_ids: Vec<u32>,
    /// `imex.required`: a listed channel whose device node is missing fails Allocate instead of being
    /// skipped. With no channels it asks for nothing (NVIDIA's plugin accepts it so).
    pub imex_required: bool,
    /// Settings accepted that do less here than in NVIDIA's plugin, one line each saying what happens
    /// instead, for the log.
    pub warnings: Vec<String>,
}

/// The key in NVIDIA's file of the setting named `setting` in a refusal (`migStrategy (--mig-strategy, …)`).
fn file_key(setting: &str) -> Option<&'static str> {
    let name = setting.split(' ').next()?;
    [
        MIG_STRATEGY,
        DEVICE_ID_STRATEGY,
        DEVICE_LIST_STRATEGY,
        DISCOVERY,
        POLICY,
        ANNOTATION_PREFIX,
        DRIVER_ROOT,
        MPS_ROOT,
        CHANNEL_IDS,
    ]
    .into_iter()
    .find(|key| key.rsplit('.').next() == Some(name))
}

/// NVIDIA's default prefix of the CDI annotations (`cdi-annotations` strategy).
pub const DEFAULT_CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";

/// An annotation key is `<prefix>nvidia-device-plugin_<uuid>`: the prefix must be a DNS subdomain and a `/`.
fn check_annotation_prefix(prefix: &str) -> Result<(), &'static str> {
    let Some(domain) = prefix.strip_suffix('/') else {
        return Err("must end with '/' (e.g. cdi.k8s.io/)");
    };
    if !crate::util::text::is_dns_subdomain(domain) {
        return Err("must be a DNS subdomain followed by '/' (e.g. cdi.k8s.io/)");
    }
    Ok(())
}

/// Checks NVIDIA's settings, refusing by name what this plugin does not do.
pub fn apply(settings: &NvidiaSettings) -> Result<Applied, ConfigError> {
    // A value from the config file is refused naming the file and its key there; one from a flag or
    // variable naming those.
    let invalid = |setting: &'static str, value: &str, why: &str| {
        let key = file_key(setting);
        match (&settings.config_file, key) {
            (Some(path), Some(key)) if settings.from_file.contains(key) => ConfigError::ParseFile {
                path: path.clone(),
                message: format!(
                    "{key} \"{}\": {why}",
                    crate::util::text::shown(value, crate::util::text::SHOWN_MAX)
                ),
            },
            _ => ConfigError::Invalid {
                setting,
                value: value.into(),
                why: why.into(),
            },
        }
    };
    let mut warnings = Vec::new();
    let mig_strategy = match settings.mig_strategy.as_deref() {
        None => MigStrategy::None,
        Some(s) => MigStrategy::parse(s).ok_or_else(|| {
            invalid(
                "migStrategy (--mig-strategy, MIG_STRATEGY)",
                s,
                "must be none, single or mixed",
            )
        })?,
    };
    let ids = match settings.device_id_strategy.as_deref() {
        None | Some("uuid") => crate::devices::naming::IdStrategy::Uuid,
        Some("index") => crate::devices::naming::IdStrategy::Index,
        Some(s) => {
            return Err(invalid(
                "deviceIDStrategy (--device-id-strategy, DEVICE_ID_STRATEGY)",
                s,
                "must be uuid or index",
            ));
        }
    };
    match settings.device_discovery_strategy.as_deref() {
        None | Some("auto" | "nvml") => {}
        Some("tegra") => {
            return Err(invalid(
                "deviceDiscoveryStrategy (--device-discovery-strategy, DEVICE_DISCOVERY_STRATEGY)",
                "tegra",
                "Tegra systems (Jetson, Thor) have no NVML, and this plugin finds and watches GPUs through NVML \
                 only; use auto or nvml on NVML systems",
            ));
        }
        Some(s) => {
            return Err(invalid(
                "deviceDiscoveryStrategy (--device-discovery-strategy, DEVICE_DISCOVERY_STRATEGY)",
                s,
                "must be auto, nvml or tegra",
            ));
        }
    }
    match settings.shared_devices_allocation_policy.as_deref() {
        None | Some("distributed") => {}
        // NVIDIA's plugin then answers GetPreferredAllocation for replicas with the GPUs already holding the
        // most allocated replicas; this one's answer (src/allocation.rs) does not weigh other pods' replicas.
        Some("packed") => warnings.push(
            "sharedDevicesAllocationPolicy packed: accepted, but not applied: the replicas this plugin prefers \
             for a container are spread over the GPUs (distributed), where NVIDIA's plugin would prefer the GPUs \
             already holding the most allocated replicas; the kubelet may still allocate any replicas"
                .to_string(),
        ),
        Some(s) => {
            return Err(invalid(
                "sharedDevicesAllocationPolicy (--shared-devices-allocation-policy, SHARED_DEVICES_ALLOCATION_POLICY)",
                s,
                "must be distributed or packed",
            ));
        }
    }
    let imex_channel_ids: Vec<u32> = match settings.imex_channel_ids.as_deref() {
        None | Some([]) => Vec::new(),
        Some([0]) => vec![0],
        Some(ids) => {
            let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
            return Err(invalid(
                "channelIDs (--imex-channel-ids, IMEX_CHANNEL_IDS)",
                &format!("[{}]", ids.join(", ")),
                "must be [] or [0]: NVIDIA's plugin supports IMEX channel 0 only",
            ));
        }
    };
    // The driver's root on the host: where device specs' host paths are, unless a dev root is given.
    let driver_root = match settings.driver_root.as_deref() {
        None | Some("") => PathBuf::from("/"),
        Some(root) if std::path::Path::new(root).is_absolute() => PathBuf::from(root),
        Some(root) => {
            return Err(invalid(
                "nvidiaDriverRoot (--driver-root, NVIDIA_DRIVER_ROOT)",
                root,
                "must be an absolute path on the host, e.g. / or /run/nvidia/driver",
            ));
        }
    };
    let (mut envvar, mut cdi, mut volume_mounts) = (true, false, false);
    let mut cdi_annotations = None;
    if let Some(list) = &settings.device_list_strategy {
        envvar = false;
        if list.is_empty() {
            return Err(invalid(
                "deviceListStrategy (--device-list-strategy, DEVICE_LIST_STRATEGY)",
                "",
                "must name at least one strategy",
            ));
        }
        for strategy in list {
            match strategy.as_str() {
                "envvar" => envvar = true,
                "cdi-cri" => cdi = true,
                "volume-mounts" => volume_mounts = true,
                "cdi-annotations" => {
                    let prefix = settings
                        .cdi_annotation_prefix
                        .clone()
                        .unwrap_or_else(|| DEFAULT_CDI_ANNOTATION_PREFIX.into());
                    check_annotation_prefix(&prefix).map_err(|why| {
                        invalid(
                            "cdiAnnotationPrefix (--cdi-annotation-prefix, CDI_ANNOTATION_PREFIX)",
                            &prefix,
                            why,
                        )
                    })?;
                    cdi_annotations = Some(prefix);
                }
                s => {
                    return Err(invalid(
                        "deviceListStrategy (--device-list-strategy, DEVICE_LIST_STRATEGY)",
                        s,
                        "must be envvar, volume-mounts, cdi-annotations or cdi-cri",
                    ));
                }
            }
        }
    }
    let extra_envs = [
        (settings.gdrcopy, "NVIDIA_GDRCOPY"),
        (settings.gds, "NVIDIA_GDS"),
        (settings.mofed, "NVIDIA_MOFED"),
    ]
    .into_iter()
    .filter(|(on, _)| *on == Some(true))
    .map(|(_, name)| (name.to_string(), "enabled".to_string()))
    .collect();
    let naming = crate::devices::naming::Naming {
        ids,
        ..crate::devices::naming::Naming::default()
    };
    if let Some(sharing) = &settings.sharing
        && sharing.kind == ShareKind::Mps
        && mig_strategy == MigStrategy::Mixed
    {
        return Err(invalid(
            "migStrategy (--mig-strategy, MIG_STRATEGY)",
            "mixed",
            "MPS cannot share MIG devices, and mixed serves them (use none or single, or time-slicing)",
        ));
    }
    let mps_root = match (&settings.sharing, settings.mps_root.as_deref()) {
        (Some(sharing), root) if sharing.kind == ShareKind::Mps => match root {
            Some(root) if root.starts_with('/') => Some(PathBuf::from(root)),
            Some(root) => {
                return Err(invalid(
                    "mpsRoot (--mps-root, MPS_ROOT)",
                    root,
                    "must be an absolute path",
                ));
            }
            None => {
                return Err(invalid(
                    "mpsRoot (--mps-root, MPS_ROOT)",
                    "",
                    "sharing.mps needs the MPS control daemon's root on the host (e.g. /run/nvidia/mps)",
                ));
            }
        },
        _ => None,
    };
    Ok(Applied {
        envvar,
        cdi,
        volume_mounts,
        cdi_annotations,
        extra_envs,
        driver_root,
        naming,
        sharing: settings.sharing.clone(),
        mps_root,
        mig_strategy,
        imex_channel_ids,
        imex_required: settings.imex_required.unwrap_or(false),
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A list entry that counts how often it is compared or hashed: the work a list costs.
    #[derive(Clone)]
    struct Counted(u32, std::rc::Rc<std::cell::Cell<u64>>);

    impl PartialEq for Counted {
        fn eq(&self, other: &Self) -> bool {
            self.1.set(self.1.get() + 1);
            self.0 == other.0
        }
    }

    impl Eq for Counted {}

    impl std::hash::Hash for Counted {
        fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
            self.1.set(self.1.get() + 1);
            self.0.hash(state);
        }
    }

    #[test]
    fn a_long_device_list_costs_a_few_steps_per_entry_not_one_per_pair() {
        let work = std::rc::Rc::new(std::cell::Cell::new(0));
        let n = 100_000u32;
        let list: Vec<Counted> = (0..n)
            .chain([7, 7, 99_999])
            .map(|i| Counted(i, work.clone()))
            .collect();
        let kept: Vec<u32> = first_of_each(list).iter().map(|c| c.0).collect();
        assert_eq!(
            kept,
            (0..n).collect::<Vec<_>>(),
            "repeats left out, order kept"
        );
        // Comparing each entry with the ones before it would be about n²/2 = 5·10⁹ steps.
        assert!(
            work.get() <= 4 * u64::from(n),
            "{} steps for {n} entries",
            work.get()
        );
    }

    #[test]
    fn a_device_list_keeps_each_entry_once_in_order() {
        let list = serde_json::json!([3, "GPU-a", "3", 1, "GPU-a"]);
        match device_selection(Some(&list)) {
            Ok(DeviceSelection::List(refs)) => assert_eq!(refs, ["3", "GPU-a", "1"]),
            other => panic!("{other:?}"),
        }
    }

    fn load_str(yaml: &str) -> Result<Loaded, ConfigError> {
        let document = document(yaml).map_err(|message| ConfigError::ParseFile {
            path: "test.yaml".into(),
            message,
        })?;
        assert!(is_nvidias(&document), "{yaml}");
        load(&document, yaml, std::path::Path::new("test.yaml"))
    }

    fn err_of(result: Result<impl std::fmt::Debug, ConfigError>) -> String {
        result.err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn a_mistyped_replicas_key_is_refused_with_the_key_meant() {
        let e = err_of(load_str(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replica: 4\n",
        ));
        assert!(
            e.contains("resources[0].replicas: no replicas specified (the entry has replica: did you mean replicas?)"),
            "{e}"
        );
        let e = err_of(load_str(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      count: 4\n",
        ));
        assert!(e.ends_with("no replicas specified"), "{e}");
    }

    #[test]
    fn an_exact_duplicate_key_is_refused_naming_it() {
        for yaml in [
            "version: v1\nflags:\n  migStrategy: none\n  migStrategy: mixed\n",
            "version: v1\nversion: v1\n",
            "version: v1\nflags: {migStrategy: none, migStrategy: mixed}\n",
        ] {
            let e = document(yaml).err().unwrap_or_default();
            assert!(e.contains("is given twice in one mapping"), "{yaml:?}: {e}");
            let key = if yaml.contains("flags") {
                "migStrategy"
            } else {
                "version"
            };
            assert!(e.contains(&format!("the key {key} ")), "{e}");
        }
        // A merge (`<<`) may set a key the mapping sets again: that is what merges are for.
        assert!(document("base: &b {a: 1}\nx:\n  <<: *b\n  a: 2\n").is_ok());
    }

    #[test]
    fn a_resource_shared_twice_in_a_long_list_is_refused() {
        // 15 000 entries (75 000 values, within the reader's limit), each name looked up in a set rather
        // than compared with every earlier one.
        let mut yaml = String::from("version: v1\nsharing:\n  timeSlicing:\n    resources:\n");
        for i in 0..15_000 {
            yaml.push_str(&format!(
                "    - name: example.com/r{i}\n      replicas: 2\n"
            ));
        }
        assert!(load_str(&yaml).is_ok());
        yaml.push_str("    - name: example.com/r7\n      replicas: 2\n");
        let e = err_of(load_str(&yaml));
        assert!(
            e.contains("resources[15000].name") && e.contains("shared twice"),
            "{e}"
        );
    }

    #[test]
    fn a_full_file_of_nvidias_flags_maps_to_ours_and_names_what_it_ignores()
    -> Result<(), ConfigError> {
        let loaded = load_str(
            "version: v1\n\
             flags:\n  migStrategy: none\n  failOnInitError: false\n  nvidiaDriverRoot: /\n  nvidiaDevRoot: /\n  \
             gdsEnabled: true\n  useNodeFeatureAPI: false\n  \
             plugin:\n    passDeviceSpecs: true\n    deviceListStrategy: [envvar, cdi-cri]\n    deviceIDStrategy: uuid\n    \
             cdiAnnotationPrefix: cdi.k8s.io/\n    nvidiaCTKPath: /usr/bin/nvidia-ctk\n    someFutureFlag: 1\n  \
             gfd:\n    oneshot: false\n\
             resources:\n  gpus:\n  - pattern: '*'\n    name: gpu\n\
             health:\n  quietPeriod: 5m\n",
        )?;
        assert_eq!(loaded.file.fail_on_init_error, Some(false));
        assert_eq!(loaded.file.device_specs, Some(true));
        assert_eq!(loaded.file.dev_root, Some(PathBuf::from("/")));
        assert!(loaded.file.health.is_some());
        let applied = apply(&loaded.nvidia)?;
        assert!(applied.envvar && applied.cdi);
        assert_eq!(
            applied.extra_envs,
            [("NVIDIA_GDS".to_string(), "enabled".to_string())]
        );
        let warned = loaded.warnings.join("\n");
        for key in [
            "flags.gfd",
            "flags.useNodeFeatureAPI",
            "resources",
            "flags.plugin.someFutureFlag",
            "flags.plugin.nvidiaCTKPath",
        ] {
            assert!(
                warned.contains(&format!("config key {key}")),
                "{key} not warned:\n{warned}"
            );
        }
        assert_eq!(loaded.warnings.len(), 5, "{warned}");
        Ok(())
    }

    #[test]
    fn settings_not_done_yet_are_refused_by_name() {
        let cases = [
            ("flags:\n  migStrategy: many\n", "migStrategy"),
            (
                "flags:\n  plugin:\n    deviceListStrategy: cdi-annotations\n    cdiAnnotationPrefix: Bad_Prefix\n",
                "cdiAnnotationPrefix",
            ),
            (
                "flags:\n  plugin:\n    deviceIDStrategy: serial\n",
                "deviceIDStrategy",
            ),
            (
                "flags:\n  nvidiaDriverRoot: run/nvidia/driver\n",
                "nvidiaDriverRoot",
            ),
            (
                "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 1\n",
                "replicas must be >= 2",
            ),
            (
                "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n      devices: [0, first]\n",
                "resources[0].devices",
            ),
            (
                "sharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n      replicas: 2\n      devices: 0\n",
                "count of devices must be > 0",
            ),
            (
                "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n      devices: some\n",
                "only string allowed is all",
            ),
            (
                "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n    - name: gpu\n      replicas: 3\n",
                "resources[1].name",
            ),
            (
                "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n    - name: nvidia.com/mig-1g.10gb\n      replicas: 2\n",
                "no replicas specified",
            ),
            (
                "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/-bad\n      replicas: 2\n",
                "resources[0].name",
            ),
            (
                "flags:\n  migStrategy: mixed\n  mpsRoot: /run/nvidia/mps\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n",
                "MPS cannot share MIG devices",
            ),
            (
                "sharing:\n  timeSlicing:\n    resources: []\n",
                "no resources",
            ),
            (
                "sharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n",
                "mpsRoot",
            ),
            ("imex:\n  channelIDs: [0, 1]\n", "channelIDs"),
            (
                "flags:\n  plugin:\n    sharedDevicesAllocationPolicy: tightly\n",
                "sharedDevicesAllocationPolicy",
            ),
            ("flags:\n  deviceDiscoveryStrategy: tegra\n", "no NVML"),
        ];
        for (yaml, named) in cases {
            let result = load_str(&format!("version: v1\n{yaml}"))
                .and_then(|loaded| apply(&loaded.nvidia).map(|_| ()));
            let err = result.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains(named), "{yaml}: {err:?} does not name {named}");
        }
    }

    #[test]
    fn several_shared_resources_with_subsets_and_renames_are_read() -> Result<(), ConfigError> {
        let loaded = load_str(
            "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n    \
             - name: gpu\n      replicas: 4\n      devices: 2\n    \
             - name: nvidia.com/mig-1g.10gb\n      replicas: 3\n      rename: mig-small\n      \
             devices: [0, '1:2', GPU-8e3f, MIG-aa]\n",
        )?;
        let sharing = apply(&loaded.nvidia)?.sharing.ok_or(ConfigError::Invalid {
            setting: "test",
            value: String::new(),
            why: "no sharing".into(),
        })?;
        assert_eq!(sharing.kind, ShareKind::TimeSlicing);
        assert!(!sharing.fail_requests_greater_than_one);
        assert_eq!(
            sharing.resources,
            [
                SharedResource {
                    name: "nvidia.com/gpu".into(),
                    rename: Some("nvidia.com/gpu.shared".into()),
                    replicas: 4,
                    devices: DeviceSelection::Count(2),
                },
                SharedResource {
                    name: "nvidia.com/mig-1g.10gb".into(),
                    rename: Some("nvidia.com/mig-small".into()),
                    replicas: 3,
                    devices: DeviceSelection::List(vec![
                        "0".into(),
                        "1:2".into(),
                        "GPU-8e3f".into(),
                        "MIG-aa".into()
                    ]),
                },
            ]
        );
        Ok(())
    }

    #[test]
    fn a_bad_value_type_is_an_error_naming_the_key() {
        let err = load_str("version: v1\nflags:\n  failOnInitError: maybe\n")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("failOnInitError"), "{err}");
    }

    #[test]
    fn keys_differing_only_in_case_set_the_setting_as_in_nvidias_decoder() -> Result<(), ConfigError>
    {
        let loaded = load_str(
            "Version: v1\nFlags:\n  MigStrategy: single\n  useNodeFeatureAPI: true\n  Plugin:\n    \
             deviceIdStrategy: index\n    PassDeviceSpecs: true\nIMEX:\n  channelIds: [0]\n",
        )?;
        assert_eq!(loaded.nvidia.mig_strategy.as_deref(), Some("single"));
        assert_eq!(loaded.nvidia.device_id_strategy.as_deref(), Some("index"));
        assert_eq!(loaded.file.device_specs, Some(true));
        assert_eq!(loaded.nvidia.imex_channel_ids, Some(vec![0]));
        // The only warning: useNodeFeatureAPI is feature discovery's, not a typo.
        assert_eq!(loaded.warnings.len(), 1, "{:?}", loaded.warnings);
        assert!(loaded.warnings[0].contains("flags.useNodeFeatureAPI: GPU feature discovery"));
        let applied = apply(&loaded.nvidia)?;
        assert_eq!(applied.mig_strategy, MigStrategy::Single);
        assert_eq!(
            applied.naming.ids,
            crate::devices::naming::IdStrategy::Index
        );
        Ok(())
    }

    #[test]
    fn two_spellings_of_one_key_use_the_last_in_byte_order_and_say_so() -> Result<(), ConfigError> {
        let loaded = load_str("flags:\n  migStrategy: mixed\n  MigStrategy: single\n")?;
        assert_eq!(loaded.nvidia.mig_strategy.as_deref(), Some("mixed"));
        let warned = loaded.warnings.join("\n");
        assert!(
            warned.contains("flags.MigStrategy and flags.migStrategy set the same setting")
                && warned.contains("the value of flags.migStrategy is used"),
            "{warned}"
        );
        Ok(())
    }

    #[test]
    fn yaml_1_1_booleans_are_booleans_and_one_in_a_string_setting_is_refused()
    -> Result<(), ConfigError> {
        let loaded = load_str(
            "flags:\n  failOnInitError: no\n  gdsEnabled: on\n  mofedEnabled: Off\n  plugin:\n    \
             passDeviceSpecs: yes\n",
        )?;
        assert_eq!(loaded.file.fail_on_init_error, Some(false));
        assert_eq!(loaded.file.device_specs, Some(true));
        assert_eq!(
            (loaded.nvidia.gds, loaded.nvidia.mofed),
            (Some(true), Some(false))
        );
        // NVIDIA's decoder puts a boolean in no string setting (under flags): refused, naming the key.
        let err = err_of(load_str("flags:\n  migStrategy: no\n"));
        assert!(
            err.contains("test.yaml")
                && err.contains("flags.migStrategy: expected a string, found the boolean false")
                && err.contains("quote"),
            "{err}"
        );
        // A quoted "true" is a string, which a boolean setting refuses, as NVIDIA's does.
        let err = err_of(load_str("flags:\n  failOnInitError: 'true'\n"));
        assert!(
            err.contains("flags.failOnInitError: expected true or false"),
            "{err}"
        );
        Ok(())
    }

    #[test]
    fn a_file_without_version_is_nvidias_when_it_has_nvidias_keys_and_ours_otherwise()
    -> Result<(), String> {
        for nvidias in [
            "flags:\n  migStrategy: none\n",
            "sharing:\n  timeSlicing:\n    resources: []\n",
            "imex: {}\n",
            "Resources: {}\n",
            "version: v1\n",
        ] {
            assert!(is_nvidias(&document(nvidias)?), "{nvidias}");
        }
        for ours in [
            "resourceName: nvidia.com/gpu\n",
            "health:\n  quietPeriod: 5m\n",
            "",
        ] {
            assert!(!is_nvidias(&document(ours)?), "{ours}");
        }
        Ok(())
    }

    #[test]
    fn a_version_other_than_v1_is_refused_naming_it_and_what_is_read() {
        let err = err_of(load_str("version: v2\nflags: {}\n"));
        assert!(
            err.contains("version \"v2\" is not supported")
                && err.contains("reads version v1 of NVIDIA's format")
                && !err.contains("unknown field"),
            "{err}"
        );
        // Empty is v1, as NVIDIA's plugin reads it.
        assert!(load_str("version: ''\nflags: {}\n").is_ok());
    }

    #[test]
    fn a_typo_is_one_warning_with_the_key_meant_and_the_default_runs() -> Result<(), ConfigError> {
        let loaded = load_str(
            "flags:\n  migStrateg: mixed\n  plugin:\n    deviceListStrategie: cdi-cri\nsharring: {}\n\
             sharing:\n  timeSlicing:\n    renamebydefault: true\n    resources:\n    - name: gpu\n      \
             replicas: 2\n      replica: 3\n",
        )?;
        assert_eq!(loaded.nvidia.mig_strategy, None);
        assert_eq!(loaded.nvidia.device_list_strategy, None);
        let warned = loaded.warnings.join("\n");
        for (key, meant) in [
            ("flags.migStrateg", "flags.migStrategy"),
            (
                "flags.plugin.deviceListStrategie",
                "flags.plugin.deviceListStrategy",
            ),
            ("sharring", "sharing"),
            (
                "sharing.timeSlicing.renamebydefault",
                "sharing.timeSlicing.renameByDefault",
            ),
            (
                "sharing.timeSlicing.resources[].replica",
                "sharing.timeSlicing.resources[].replicas",
            ),
        ] {
            assert!(
                warned.contains(&format!("config key {key}:"))
                    && warned.contains(&format!("(did you mean {meant}?)")),
                "{key}:\n{warned}"
            );
        }
        assert!(
            !warned.contains("ignored as NVIDIA's plugin ignores it"),
            "{warned}"
        );
        assert_eq!(loaded.warnings.len(), 5, "{warned}");
        // renameByDefault spelled in another case sets nothing: NVIDIA looks it up exactly.
        let sharing = loaded.nvidia.sharing.ok_or(ConfigError::Invalid {
            setting: "test",
            value: String::new(),
            why: "no sharing".into(),
        })?;
        assert_eq!(sharing.resources[0].rename, None);
        Ok(())
    }

    #[test]
    fn packed_allocation_is_accepted_with_a_warning_saying_what_happens_here()
    -> Result<(), ConfigError> {
        let loaded = load_str("flags:\n  plugin:\n    sharedDevicesAllocationPolicy: packed\n")?;
        let applied = apply(&loaded.nvidia)?;
        assert_eq!(applied.warnings.len(), 1);
        assert!(
            applied.warnings[0].contains("packed: accepted, but not applied")
                && applied.warnings[0].contains("spread over the GPUs"),
            "{:?}",
            applied.warnings
        );
        Ok(())
    }

    #[test]
    fn replicas_above_1024_are_read_and_only_a_count_no_kubelet_list_holds_is_refused()
    -> Result<(), ConfigError> {
        let file = |n: usize| {
            format!(
                "sharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n      replicas: {n}\n"
            )
        };
        let loaded = load_str(&file(5000))?;
        assert_eq!(
            loaded.nvidia.sharing.map(|s| s.resources[0].replicas),
            Some(5000)
        );
        assert!(load_str(&file(MAX_LISTED_REPLICAS)).is_ok());
        let err = err_of(load_str(&file(MAX_LISTED_REPLICAS + 1)));
        assert!(
            err.contains("resources[0].replicas")
                && err.contains("4194304 bytes the kubelet accepts")
                && err.contains(&format!("at most {MAX_LISTED_REPLICAS}")),
            "{err}"
        );
        Ok(())
    }

    #[test]
    fn time_slicing_and_mps_together_share_through_mps_and_say_time_slicing_is_ignored()
    -> Result<(), ConfigError> {
        let loaded = load_str(
            "sharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n      replicas: 4\n  mps:\n    \
             resources:\n    - name: gpu\n      replicas: 2\n",
        )?;
        let sharing = loaded.nvidia.sharing.clone();
        assert_eq!(sharing.as_ref().map(|s| s.kind), Some(ShareKind::Mps));
        assert_eq!(sharing.map(|s| s.resources[0].replicas), Some(2));
        let warned = loaded.warnings.join("\n");
        assert!(
            warned.contains("config key sharing.timeSlicing: ignored: sharing.mps is set too"),
            "{warned}"
        );
        // Errors in the ignored section still refuse the file, as NVIDIA's decoder reads both.
        let err = err_of(load_str(
            "sharing:\n  timeSlicing:\n    resources: []\n  mps:\n    resources:\n    - name: gpu\n      \
             replicas: 2\n",
        ));
        assert!(err.contains("no resources specified"), "{err}");
        Ok(())
    }

    #[test]
    fn imex_channels_are_read_checked_and_carried_through() -> Result<(), ConfigError> {
        let applied = apply(&load_str("imex:\n  channelIDs: [0]\n  required: yes\n")?.nvidia)?;
        assert_eq!(
            (applied.imex_channel_ids, applied.imex_required),
            (vec![0], true)
        );
        // Required with no channels, and null channels: accepted, as NVIDIA's plugin accepts them.
        let applied = apply(&load_str("imex:\n  required: true\n")?.nvidia)?;
        assert_eq!(
            (applied.imex_channel_ids, applied.imex_required),
            (vec![], true)
        );
        let applied = apply(&load_str("imex:\n  channelIDs: null\n")?.nvidia)?;
        assert!(applied.imex_channel_ids.is_empty());
        let err = err_of(load_str("imex:\n  channelIDs: [1]\n").and_then(|l| apply(&l.nvidia)));
        assert!(
            err.contains("test.yaml")
                && err.contains("imex.channelIDs \"[1]\"")
                && err.contains("channel 0 only"),
            "{err}"
        );
        let err = err_of(load_str("imex:\n  channelIDs: [zero]\n"));
        assert!(
            err.contains("imex.channelIDs: expected a list of channel numbers"),
            "{err}"
        );
        Ok(())
    }

    #[test]
    fn an_invalid_value_from_the_file_names_the_file_and_one_from_a_flag_the_flag()
    -> Result<(), ConfigError> {
        let loaded = load_str("flags:\n  migStrategy: many\n")?;
        let err = err_of(apply(&loaded.nvidia));
        assert_eq!(
            err,
            "config file test.yaml: flags.migStrategy \"many\": must be none, single or mixed"
        );
        // The same value given as a flag over the file's: the flag is named.
        let flags = NvidiaSettings {
            mig_strategy: Some("many".into()),
            ..NvidiaSettings::default()
        };
        let err = err_of(apply(&flags.or(loaded.nvidia)));
        assert!(
            err.starts_with("invalid migStrategy (--mig-strategy"),
            "{err}"
        );
        // A valid flag over an invalid file value runs, as NVIDIA's plugin checks the merged settings.
        let loaded = load_str("flags:\n  migStrategy: many\n")?;
        let flags = NvidiaSettings {
            mig_strategy: Some("single".into()),
            ..NvidiaSettings::default()
        };
        assert_eq!(
            apply(&flags.or(loaded.nvidia))?.mig_strategy,
            MigStrategy::Single
        );
        Ok(())
    }
}
