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

mod apply;
mod decode;
#[cfg(test)]
mod tests;
mod yaml11;

pub use apply::{Applied, DEFAULT_CDI_ANNOTATION_PREFIX, apply};
pub use decode::load;
// What the decoder and the checks share, by name.
#[allow(unused_imports)]
use {apply::*, decode::*};

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
