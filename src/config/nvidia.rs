//! NVIDIA's device plugin config file, version `v1`, read as a second format beside ours, with NVIDIA's flags and
//! environment variables for the same settings. Every file NVIDIA's plugin accepts loads: keys NVIDIA ignores,
//! keys of its other components (`flags.gfd`) and unknown keys are listed as warnings; a setting that would
//! change behaviour and that this plugin does not do yet is refused by name, never dropped. Our own `health:`
//! section may sit in the same file.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::devices::mig::MigStrategy;
use serde::Deserialize;
use serde_norway::Value;

use super::{ConfigError, FileConfig};
use crate::health::HealthConfig;

/// The CDI kind of the names Allocate returns under NVIDIA's `cdi-cri` strategy: the one in the CDI specs
/// `nvidia-ctk cdi generate` writes (NVIDIA's plugin uses names of a spec it writes itself, which this plugin
/// does not write).
pub const CDI_KIND: &str = "nvidia.com/gpu";

/// Top level of a `version: v1` file.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct V1 {
    /// `v1`, checked before.
    #[allow(dead_code)]
    version: String,
    #[serde(default)]
    flags: Flags,
    resources: Option<Value>,
    sharing: Option<SharingSection>,
    imex: Option<Imex>,
    /// Ours.
    health: Option<HealthConfig>,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Flags {
    mig_strategy: Option<String>,
    fail_on_init_error: Option<bool>,
    mps_root: Option<String>,
    nvidia_driver_root: Option<String>,
    nvidia_dev_root: Option<String>,
    gdrcopy_enabled: Option<bool>,
    gds_enabled: Option<bool>,
    mofed_enabled: Option<bool>,
    use_node_feature_api: Option<Value>,
    device_discovery_strategy: Option<String>,
    #[serde(default)]
    plugin: PluginFlags,
    gfd: Option<Value>,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PluginFlags {
    pass_device_specs: Option<bool>,
    device_list_strategy: Option<StringOrList>,
    #[serde(rename = "deviceIDStrategy")]
    device_id_strategy: Option<String>,
    cdi_annotation_prefix: Option<String>,
    #[serde(rename = "nvidiaCTKPath")]
    nvidia_ctk_path: Option<String>,
    container_driver_root: Option<String>,
    shared_devices_allocation_policy: Option<String>,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum StringOrList {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SharingSection {
    time_slicing: Option<SharingSpec>,
    mps: Option<SharingSpec>,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SharingSpec {
    rename_by_default: Option<bool>,
    fail_requests_greater_than_one: Option<bool>,
    resources: Option<Vec<ReplicatedResource>>,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReplicatedResource {
    name: Option<String>,
    rename: Option<String>,
    devices: Option<Value>,
    replicas: Option<i64>,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

/// How replicas share a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShareKind {
    /// `sharing.timeSlicing`.
    TimeSlicing,
    /// `sharing.mps`: the containers talk to NVIDIA's MPS control daemon for the resource.
    Mps,
}

/// Sharing as NVIDIA's file states it (`sharing.timeSlicing` or `sharing.mps`), checked: which devices of
/// which resources are listed as replicas, and under which name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sharing {
    /// Time-slicing or MPS.
    pub kind: ShareKind,
    /// Refuse a container asking for more than one replica.
    pub fail_requests_greater_than_one: bool,
    /// The shared resources, each named once.
    pub resources: Vec<SharedResource>,
}

/// One entry of `sharing.*.resources`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedResource {
    /// The resource whose devices are shared (`nvidia.com/gpu`, `nvidia.com/mig-1g.10gb`; a name without a
    /// domain is in `nvidia.com`, as NVIDIA reads it).
    pub name: String,
    /// The resource the replicas are served under instead (`rename`, or `<name>.shared` with
    /// `renameByDefault`); `None`: under `name`.
    pub rename: Option<String>,
    /// Devices listed per shared device, at least 2.
    pub replicas: usize,
    /// Which of the resource's devices are shared.
    pub devices: DeviceSelection,
}

/// `devices` of a shared resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSelection {
    /// `all` (or left out).
    All,
    /// The first N devices of the resource, in NVML index order.
    Count(usize),
    /// These devices, each by index (`0`, `<gpu>:<mig>` for a MIG device) or UUID (`GPU-…`, `MIG-…`).
    List(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Imex {
    #[serde(rename = "channelIDs", default)]
    channel_ids: Vec<Value>,
    required: Option<bool>,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
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
}

impl NvidiaSettings {
    /// Each field from `self` where it is set, else from `under`.
    pub fn or(self, under: NvidiaSettings) -> NvidiaSettings {
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
        }
    }
}

/// What a `version: v1` file gives: our settings it maps to, NVIDIA's own, and warnings to log.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Our settings it sets.
    pub file: FileConfig,
    /// NVIDIA's settings without a flag of ours.
    pub nvidia: NvidiaSettings,
    /// Keys read and ignored, one line each.
    pub warnings: Vec<String>,
}

/// Whether a parsed YAML document is NVIDIA's format: it says `version: v1`.
pub fn is_v1(document: &Value) -> bool {
    document.get("version").and_then(Value::as_str) == Some("v1")
}

/// Reads a `version: v1` file's text (errors name the key and line).
pub fn load(text: &str, path: &std::path::Path) -> Result<Loaded, ConfigError> {
    let v1: V1 = serde_norway::from_str(text).map_err(|e| ConfigError::ParseFile {
        path: path.to_owned(),
        message: e.to_string().replace('\n', " "),
    })?;
    let mut warnings = Vec::new();
    let mut ignored = |key: String, why: &str| warnings.push(format!("config key {key}: {why}"));
    for key in v1.other.keys() {
        ignored(
            key.clone(),
            "unknown to NVIDIA's v1 format; ignored as NVIDIA's plugin ignores it",
        );
    }
    for key in v1.flags.other.keys() {
        ignored(
            format!("flags.{key}"),
            "unknown; ignored as NVIDIA's plugin ignores it",
        );
    }
    for key in v1.flags.plugin.other.keys() {
        ignored(
            format!("flags.plugin.{key}"),
            "unknown; ignored as NVIDIA's plugin ignores it",
        );
    }
    if v1.flags.gfd.is_some() {
        ignored("flags.gfd".into(), "GPU feature discovery's; ignored");
    }
    if v1.flags.use_node_feature_api.is_some() {
        ignored(
            "flags.useNodeFeatureAPI".into(),
            "GPU feature discovery's; ignored",
        );
    }
    if v1.resources.is_some() {
        ignored(
            "resources".into(),
            "NVIDIA's plugin v0.20 parses and ignores it; so does this one",
        );
    }
    if let Some(path) = &v1.flags.plugin.nvidia_ctk_path {
        ignored(
            format!("flags.plugin.nvidiaCTKPath ({path})"),
            "used to write CDI specs, which this plugin does not write; ignored",
        );
    }
    let invalid = |setting: &'static str, value: String, why: &str| ConfigError::Invalid {
        setting,
        value,
        why: why.into(),
    };
    if let Some(sharing) = &v1.sharing {
        for key in sharing.other.keys() {
            ignored(
                format!("sharing.{key}"),
                "unknown sharing kind (NVIDIA's are timeSlicing and mps); ignored as NVIDIA's plugin ignores it",
            );
        }
    }
    let sharing = match v1.sharing.map(|s| (s.time_slicing, s.mps)) {
        Some((Some(_), Some(_))) => {
            return Err(invalid(
                "config key",
                "sharing".into(),
                "at most one of timeSlicing and mps may be used",
            ));
        }
        Some((Some(spec), None)) => Some(sharing(ShareKind::TimeSlicing, spec, &mut ignored)?),
        Some((None, Some(spec))) => Some(sharing(ShareKind::Mps, spec, &mut ignored)?),
        _ => None,
    };
    if let Some(imex) = &v1.imex {
        if !imex.channel_ids.is_empty() || imex.required == Some(true) {
            return Err(invalid(
                "config key",
                "imex".into(),
                "IMEX channels are not supported; remove the section",
            ));
        }
        for key in imex.other.keys() {
            ignored(
                format!("imex.{key}"),
                "unknown; ignored as NVIDIA's plugin ignores it",
            );
        }
    }
    let flags = v1.flags;
    let plugin = flags.plugin;
    let device_list_strategy = plugin.device_list_strategy.map(|s| match s {
        StringOrList::One(one) => vec![one],
        StringOrList::Many(many) => many,
    });
    let file = FileConfig {
        fail_on_init_error: flags.fail_on_init_error,
        dev_root: flags.nvidia_dev_root.map(PathBuf::from),
        device_specs: plugin.pass_device_specs,
        health: v1.health,
        ..FileConfig::default()
    };
    // A setting that only acts together with one refused above: accepted.
    let _ = plugin.container_driver_root;
    Ok(Loaded {
        file,
        nvidia: NvidiaSettings {
            mig_strategy: flags.mig_strategy,
            driver_root: flags.nvidia_driver_root,
            device_list_strategy,
            device_id_strategy: plugin.device_id_strategy,
            gdrcopy: flags.gdrcopy_enabled,
            gds: flags.gds_enabled,
            mofed: flags.mofed_enabled,
            device_discovery_strategy: flags.device_discovery_strategy,
            sharing,
            mps_root: flags.mps_root,
            shared_devices_allocation_policy: plugin.shared_devices_allocation_policy,
            cdi_annotation_prefix: plugin.cdi_annotation_prefix,
        },
        warnings,
    })
}

/// More replicas than this per device is surely a mistake (and a list the kubelet would struggle with).
const MAX_REPLICAS: i64 = 1024;

/// Checks `sharing.timeSlicing` or `sharing.mps` as NVIDIA's plugin does: at least one resource, each with a
/// name and replicas of at least 2, `devices` as `all`, a count above 0 or a list of indices and UUIDs.
fn sharing(
    kind: ShareKind,
    spec: SharingSpec,
    ignored: &mut impl FnMut(String, &str),
) -> Result<Sharing, ConfigError> {
    let section = match kind {
        ShareKind::TimeSlicing => "sharing.timeSlicing",
        ShareKind::Mps => "sharing.mps",
    };
    let invalid = |key: String, why: &str| ConfigError::Invalid {
        setting: "config key",
        value: format!("{section}{key}"),
        why: why.into(),
    };
    for key in spec.other.keys() {
        ignored(
            format!("{section}.{key}"),
            "unknown; ignored as NVIDIA's plugin ignores it",
        );
    }
    let entries = spec.resources.unwrap_or_default();
    if entries.is_empty() {
        return Err(invalid(".resources".into(), "no resources specified"));
    }
    let rename_by_default = spec.rename_by_default.unwrap_or(false);
    let mut resources: Vec<SharedResource> = Vec::with_capacity(entries.len());
    for (i, entry) in entries.into_iter().enumerate() {
        let at = |key: &str| format!(".resources[{i}]{key}");
        for key in entry.other.keys() {
            ignored(
                format!("{section}{}", at(&format!(".{key}"))),
                "unknown; ignored as NVIDIA's plugin ignores it",
            );
        }
        let name = entry
            .name
            .filter(|n| !n.is_empty())
            .ok_or_else(|| invalid(at(".name"), "no resource name specified"))?;
        let name = full_resource_name(&name).map_err(|why| invalid(at(".name"), &why))?;
        if resources.iter().any(|r| r.name == name) {
            return Err(invalid(
                at(".name"),
                &format!("{name} is shared twice; give each resource one entry"),
            ));
        }
        let rename = match entry.rename.filter(|r| !r.is_empty()) {
            Some(rename) => {
                Some(full_resource_name(&rename).map_err(|why| invalid(at(".rename"), &why))?)
            }
            None if rename_by_default => Some(format!("{name}.shared")),
            None => None,
        }
        .filter(|rename| *rename != name);
        let replicas = match entry.replicas {
            Some(n) if (2..=MAX_REPLICAS).contains(&n) => usize::try_from(n).unwrap_or(2),
            Some(n) if n > MAX_REPLICAS => {
                return Err(invalid(
                    at(".replicas"),
                    &format!("{n} replicas per device; at most {MAX_REPLICAS}"),
                ));
            }
            Some(_) => return Err(invalid(at(".replicas"), "number of replicas must be >= 2")),
            None => return Err(invalid(at(".replicas"), "no replicas specified")),
        };
        let devices = device_selection(entry.devices.as_ref())
            .map_err(|why| invalid(at(".devices"), &why))?;
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
        fail_requests_greater_than_one: spec
            .fail_requests_greater_than_one
            .unwrap_or(kind == ShareKind::Mps),
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
            other => return Err(format!("{other:?} is not a device index or UUID")),
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
        Some(Value::Number(n)) => match n.as_u64() {
            Some(count) if count > 0 => Ok(DeviceSelection::Count(
                usize::try_from(count).unwrap_or(usize::MAX),
            )),
            _ => Err(format!("{n}: a count of devices must be > 0")),
        },
        Some(Value::Sequence(list)) if !list.is_empty() => {
            let mut refs = Vec::with_capacity(list.len());
            for value in list {
                let text = entry(value)?;
                if !refs.contains(&text) {
                    refs.push(text);
                }
            }
            Ok(DeviceSelection::List(refs))
        }
        Some(Value::Sequence(_)) => {
            Err("an empty list shares nothing; leave devices out for all".into())
        }
        Some(other) => Err(format!("{other:?}: must be all, a count or a list")),
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
    pub naming: crate::naming::Naming,
    /// Which devices are shared, and how.
    pub sharing: Option<Sharing>,
    /// The MPS root on the host, with `sharing.mps`.
    pub mps_root: Option<PathBuf>,
    /// How GPUs in MIG mode are served.
    pub mig_strategy: MigStrategy,
}

/// NVIDIA's default prefix of the CDI annotations (`cdi-annotations` strategy).
pub const DEFAULT_CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";

/// An annotation key is `<prefix>nvidia-device-plugin_<uuid>`: the prefix must be a DNS subdomain and a `/`.
fn check_annotation_prefix(prefix: &str) -> Result<(), &'static str> {
    let Some(domain) = prefix.strip_suffix('/') else {
        return Err("must end with '/' (e.g. cdi.k8s.io/)");
    };
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if domain.is_empty() || domain.len() > 253 || !domain.split('.').all(label_ok) {
        return Err("must be a DNS subdomain followed by '/' (e.g. cdi.k8s.io/)");
    }
    Ok(())
}

/// Checks NVIDIA's settings, refusing by name what this plugin does not do.
pub fn apply(settings: &NvidiaSettings) -> Result<Applied, ConfigError> {
    let invalid = |setting: &'static str, value: &str, why: &str| ConfigError::Invalid {
        setting,
        value: value.into(),
        why: why.into(),
    };
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
        None | Some("uuid") => crate::naming::IdStrategy::Uuid,
        Some("index") => crate::naming::IdStrategy::Index,
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
        Some(s) => {
            return Err(invalid(
                "deviceDiscoveryStrategy (--device-discovery-strategy, DEVICE_DISCOVERY_STRATEGY)",
                s,
                "only NVML discovery (auto, nvml) is supported",
            ));
        }
    }
    match settings.shared_devices_allocation_policy.as_deref() {
        None | Some("distributed") => {}
        Some(s) => {
            return Err(invalid(
                "sharedDevicesAllocationPolicy (--shared-devices-allocation-policy, SHARED_DEVICES_ALLOCATION_POLICY)",
                s,
                "only distributed (replicas spread over the GPUs) is supported",
            ));
        }
    }
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
    let naming = crate::naming::Naming {
        ids,
        ..crate::naming::Naming::default()
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
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_str(yaml: &str) -> Result<Loaded, ConfigError> {
        let document: Value = serde_norway::from_str(yaml).map_err(|e| ConfigError::ParseFile {
            path: "test.yaml".into(),
            message: e.to_string(),
        })?;
        assert!(is_v1(&document));
        load(yaml, std::path::Path::new("test.yaml"))
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
            (
                "sharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n",
                "at most one of timeSlicing and mps",
            ),
            ("imex:\n  channelIDs: [0]\n", "imex"),
            (
                "flags:\n  plugin:\n    sharedDevicesAllocationPolicy: packed\n",
                "sharedDevicesAllocationPolicy",
            ),
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
}
