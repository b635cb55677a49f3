//! NVIDIA's settings, from its file, flags and variables, checked and applied to this plugin's own.

use super::*;

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
pub(super) fn file_key(setting: &str) -> Option<&'static str> {
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
pub(super) fn check_annotation_prefix(prefix: &str) -> Result<(), &'static str> {
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
    let invalid = |Refusal {
                       setting,
                       value,
                       why,
                   }: Refusal| {
        let key = file_key(setting);
        match (&settings.config_file, key) {
            (Some(path), Some(key)) if settings.from_file.contains(key) => ConfigError::ParseFile {
                path: path.clone(),
                message: format!(
                    "{key} \"{}\": {why}",
                    crate::util::text::shown(&value, crate::util::text::SHOWN_MAX)
                ),
            },
            _ => ConfigError::Invalid {
                setting,
                value,
                why,
            },
        }
    };
    let mut warnings = Vec::new();
    let (mig_strategy, ids) = strategies(settings, &mut warnings).map_err(invalid)?;
    let imex_channel_ids: Vec<u32> = match settings.imex_channel_ids.as_deref() {
        None | Some([]) => Vec::new(),
        Some([0]) => vec![0],
        Some(ids) => {
            let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
            return Err(invalid(Refusal::new(
                "channelIDs (--imex-channel-ids, IMEX_CHANNEL_IDS)",
                &format!("[{}]", ids.join(", ")),
                "must be [] or [0]: NVIDIA's plugin supports IMEX channel 0 only",
            )));
        }
    };
    // The driver's root on the host: where device specs' host paths are, unless a dev root is given.
    let driver_root = match settings.driver_root.as_deref() {
        None | Some("") => PathBuf::from("/"),
        Some(root) if std::path::Path::new(root).is_absolute() => PathBuf::from(root),
        Some(root) => {
            return Err(invalid(Refusal::new(
                "nvidiaDriverRoot (--driver-root, NVIDIA_DRIVER_ROOT)",
                root,
                "must be an absolute path on the host, e.g. / or /run/nvidia/driver",
            )));
        }
    };
    let lists = device_lists(settings).map_err(invalid)?;
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
    let mps_root = mps_root(settings, mig_strategy).map_err(invalid)?;
    Ok(Applied {
        envvar: lists.envvar,
        cdi: lists.cdi,
        volume_mounts: lists.volume_mounts,
        cdi_annotations: lists.cdi_annotations,
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

/// A value [`apply`] refuses: the setting (its file key, flag and variable), the value and why.
pub(super) struct Refusal {
    setting: &'static str,
    value: String,
    why: String,
}

impl Refusal {
    fn new(setting: &'static str, value: &str, why: &str) -> Refusal {
        Refusal {
            setting,
            value: value.into(),
            why: why.into(),
        }
    }
}

/// The MIG strategy and the device IDs, with the discovery strategy and the allocation policy checked.
pub(super) fn strategies(
    settings: &NvidiaSettings,
    warnings: &mut Vec<String>,
) -> Result<(MigStrategy, crate::devices::naming::IdStrategy), Refusal> {
    let mig_strategy = match settings.mig_strategy.as_deref() {
        None => MigStrategy::None,
        Some(s) => MigStrategy::parse(s).ok_or_else(|| {
            Refusal::new(
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
            return Err(Refusal::new(
                "deviceIDStrategy (--device-id-strategy, DEVICE_ID_STRATEGY)",
                s,
                "must be uuid or index",
            ));
        }
    };
    match settings.device_discovery_strategy.as_deref() {
        None | Some("auto" | "nvml") => {}
        Some("tegra") => {
            return Err(Refusal::new(
                "deviceDiscoveryStrategy (--device-discovery-strategy, DEVICE_DISCOVERY_STRATEGY)",
                "tegra",
                "Tegra systems (Jetson, Thor) have no NVML, and this plugin finds and watches GPUs through NVML \
                 only; use auto or nvml on NVML systems",
            ));
        }
        Some(s) => {
            return Err(Refusal::new(
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
            return Err(Refusal::new(
                "sharedDevicesAllocationPolicy (--shared-devices-allocation-policy, SHARED_DEVICES_ALLOCATION_POLICY)",
                s,
                "must be distributed or packed",
            ));
        }
    }
    Ok((mig_strategy, ids))
}

/// How Allocate hands devices over, as `deviceListStrategy` says (envvar alone when it is not given).
pub(super) struct DeviceLists {
    envvar: bool,
    cdi: bool,
    volume_mounts: bool,
    cdi_annotations: Option<String>,
}

/// `deviceListStrategy`, each entry checked (and `cdiAnnotationPrefix` with `cdi-annotations`).
pub(super) fn device_lists(settings: &NvidiaSettings) -> Result<DeviceLists, Refusal> {
    let mut lists = DeviceLists {
        envvar: true,
        cdi: false,
        volume_mounts: false,
        cdi_annotations: None,
    };
    let Some(list) = &settings.device_list_strategy else {
        return Ok(lists);
    };
    lists.envvar = false;
    if list.is_empty() {
        return Err(Refusal::new(
            "deviceListStrategy (--device-list-strategy, DEVICE_LIST_STRATEGY)",
            "",
            "must name at least one strategy",
        ));
    }
    for strategy in list {
        match strategy.as_str() {
            "envvar" => lists.envvar = true,
            "cdi-cri" => lists.cdi = true,
            "volume-mounts" => lists.volume_mounts = true,
            "cdi-annotations" => {
                let prefix = settings
                    .cdi_annotation_prefix
                    .clone()
                    .unwrap_or_else(|| DEFAULT_CDI_ANNOTATION_PREFIX.into());
                check_annotation_prefix(&prefix).map_err(|why| {
                    Refusal::new(
                        "cdiAnnotationPrefix (--cdi-annotation-prefix, CDI_ANNOTATION_PREFIX)",
                        &prefix,
                        why,
                    )
                })?;
                lists.cdi_annotations = Some(prefix);
            }
            s => {
                return Err(Refusal::new(
                    "deviceListStrategy (--device-list-strategy, DEVICE_LIST_STRATEGY)",
                    s,
                    "must be envvar, volume-mounts, cdi-annotations or cdi-cri",
                ));
            }
        }
    }
    Ok(lists)
}

/// The MPS control daemon's root on the host, which sharing through MPS needs; MPS beside MIG devices served
/// as `mixed` refused.
pub(super) fn mps_root(
    settings: &NvidiaSettings,
    mig_strategy: MigStrategy,
) -> Result<Option<PathBuf>, Refusal> {
    if let Some(sharing) = &settings.sharing
        && sharing.kind == ShareKind::Mps
        && mig_strategy == MigStrategy::Mixed
    {
        return Err(Refusal::new(
            "migStrategy (--mig-strategy, MIG_STRATEGY)",
            "mixed",
            "MPS cannot share MIG devices, and mixed serves them (use none or single, or time-slicing)",
        ));
    }
    Ok(match (&settings.sharing, settings.mps_root.as_deref()) {
        (Some(sharing), root) if sharing.kind == ShareKind::Mps => match root {
            Some(root) if root.starts_with('/') => Some(PathBuf::from(root)),
            Some(root) => {
                return Err(Refusal::new(
                    "mpsRoot (--mps-root, MPS_ROOT)",
                    root,
                    "must be an absolute path",
                ));
            }
            None => {
                return Err(Refusal::new(
                    "mpsRoot (--mps-root, MPS_ROOT)",
                    "",
                    "sharing.mps needs the MPS control daemon's root on the host (e.g. /run/nvidia/mps)",
                ));
            }
        },
        _ => None,
    })
}
