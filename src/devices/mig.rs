//! MIG devices in the device model: what a MIG device is (its GPU, its instances, its profile), how NVIDIA
//! names its profile and its resource, and the rules each MIG strategy puts on a node's layout.
//!
//! Pure: the NVML backend reads the driver and hands the facts here.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What makes a device a MIG device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigInfo {
    /// UUID of the GPU it is part of: a fault on that GPU is a fault on this device.
    pub parent: String,
    /// Profile name as NVIDIA's plugin spells it, e.g. `1g.10gb`, `1c.2g.20gb`, `1g.10gb+me`.
    pub profile: String,
    /// GPU instance ID: with the compute instance ID, what an NVML event names to attribute a fault.
    pub gpu_instance: u32,
    /// Compute instance ID.
    pub compute_instance: u32,
}

/// How MIG devices are served (NVIDIA's `migStrategy`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MigStrategy {
    /// Whole GPUs only, MIG mode or not.
    #[default]
    None,
    /// Every GPU in MIG mode with one kind of MIG device, served under the GPU resource name.
    Single,
    /// Each MIG profile a resource of its own (`nvidia.com/mig-1g.10gb`); GPUs without MIG stay whole.
    Mixed,
}

/// NVIDIA's spelling, as the flag and the config file take it.
impl std::fmt::Display for MigStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MigStrategy::None => "none",
            MigStrategy::Single => "single",
            MigStrategy::Mixed => "mixed",
        })
    }
}

impl MigStrategy {
    /// Parses NVIDIA's spelling.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "none" => Some(MigStrategy::None),
            "single" => Some(MigStrategy::Single),
            "mixed" => Some(MigStrategy::Mixed),
            _ => None,
        }
    }
}

/// `NVML_GPU_INSTANCE_PROFILE_*` indices that add an attribute to a profile's name.
mod gi_profile {
    pub const ONE_SLICE_REV1: u32 = 7;
    pub const TWO_SLICE_REV1: u32 = 8;
    pub const ONE_SLICE_GFX: u32 = 10;
    pub const TWO_SLICE_GFX: u32 = 11;
    pub const FOUR_SLICE_GFX: u32 = 12;
    pub const ONE_SLICE_NO_ME: u32 = 13;
    pub const TWO_SLICE_NO_ME: u32 = 14;
    pub const ONE_SLICE_ALL_ME: u32 = 15;
    pub const TWO_SLICE_ALL_ME: u32 = 16;
}

/// A MIG device's memory in whole GB as NVIDIA names profiles: its share of the GPU's memory rounded up to
/// an eighth, times the GPU's memory in GiB rounded up (an 80 GB GPU's 9.75 GiB instance is `10gb`).
pub fn memory_gb(mig_memory_mb: u64, gpu_memory_bytes: u64) -> u64 {
    const MIB: f64 = 1024.0 * 1024.0;
    const GIB: u64 = 1024 * 1024 * 1024;
    if gpu_memory_bytes == 0 {
        return mig_memory_mb.div_ceil(1024);
    }
    let share = (mig_memory_mb as f64 * MIB) / gpu_memory_bytes as f64;
    let share = (share * 8.0).ceil() / 8.0;
    let gpu_gb = gpu_memory_bytes.div_ceil(GIB) as f64;
    (share * gpu_gb).round() as u64
}

/// What NVML says about a MIG device that its profile name is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProfileFacts {
    /// The GPU instance's profile (`NVML_GPU_INSTANCE_PROFILE_*` index), when it could be found.
    pub gi_profile: Option<u32>,
    /// GPU slices.
    pub gpu_slices: u32,
    /// Compute slices.
    pub compute_slices: u32,
    /// The MIG device's memory, MB.
    pub memory_mb: u64,
    /// The whole GPU's memory, bytes.
    pub gpu_memory_bytes: u64,
}

/// The profile name NVIDIA's plugin gives a MIG device: `<g>g.<gb>gb`, `<c>c.<g>g.<gb>gb` when the compute
/// instance is smaller than its GPU instance, with `+me`, `+me.all`, `+gfx` or `-me` for the GPU instance
/// profiles that carry those attributes.
pub fn profile_name(facts: &ProfileFacts) -> String {
    use gi_profile::*;
    let gb = memory_gb(facts.memory_mb, facts.gpu_memory_bytes);
    let suffix = match facts.gi_profile {
        Some(ONE_SLICE_REV1 | TWO_SLICE_REV1) => "+me",
        Some(ONE_SLICE_ALL_ME | TWO_SLICE_ALL_ME) => "+me.all",
        Some(ONE_SLICE_GFX | TWO_SLICE_GFX | FOUR_SLICE_GFX) => "+gfx",
        Some(ONE_SLICE_NO_ME | TWO_SLICE_NO_ME) => "-me",
        _ => "",
    };
    if facts.compute_slices == facts.gpu_slices {
        format!("{}g.{gb}gb{suffix}", facts.gpu_slices)
    } else {
        format!(
            "{}c.{}g.{gb}gb{suffix}",
            facts.compute_slices, facts.gpu_slices
        )
    }
}

/// Which resource each device is served under: `base` (e.g. `nvidia.com/gpu`) for a whole GPU and, under
/// `single`, for a MIG device; under `mixed`, `<domain>/mig-<profile>` with `+` written `.`, as NVIDIA's plugin
/// names it (`nvidia.com/mig-1g.10gb`, `nvidia.com/mig-1g.10gb.me`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResourceNaming {
    /// The MIG strategy.
    pub strategy: MigStrategy,
    /// The resource of whole GPUs (and of MIG devices under `single`).
    pub base: String,
}

impl ResourceNaming {
    /// The resource of a device with MIG profile `profile` (`None` for a whole GPU).
    pub fn of(&self, profile: Option<&str>) -> String {
        match (self.strategy, profile) {
            (MigStrategy::Mixed, Some(profile)) => {
                let name: String = profile.chars().map(in_resource_name).collect();
                format!("{}/mig-{name}", self.domain())
            }
            _ => self.base.clone(),
        }
    }

    /// The domain MIG resources are named in: the base resource's (`nvidia.com`).
    fn domain(&self) -> &str {
        self.base.split_once('/').map_or("nvidia.com", |(d, _)| d)
    }

    /// The resource of `device`.
    pub fn of_device(&self, device: &super::DeviceInfo) -> String {
        self.of(device.mig.as_ref().map(|m| m.profile.as_str()))
    }

    /// Whether `device` is served under `resource`; the same answer as comparing with
    /// [`ResourceNaming::of_device`], without building the name (it runs for every device on every change).
    pub fn serves(&self, resource: &str, device: &super::DeviceInfo) -> bool {
        match (self.strategy, device.mig.as_ref()) {
            (MigStrategy::Mixed, Some(mig)) => resource
                .strip_prefix(self.domain())
                .and_then(|r| r.strip_prefix("/mig-"))
                .is_some_and(|name| {
                    name.len() == mig.profile.len()
                        && name
                            .chars()
                            .zip(mig.profile.chars())
                            .all(|(a, b)| a == in_resource_name(b))
                }),
            _ => resource == self.base,
        }
    }
}

/// A profile name's character in its resource name: NVIDIA writes `+` as `.` there.
fn in_resource_name(c: char) -> char {
    if c == '+' { '.' } else { c }
}

/// One GPU's MIG layout, for the strategy's checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuLayout {
    /// The GPU's UUID.
    pub id: String,
    /// MIG mode is on.
    pub mig_enabled: bool,
    /// Its MIG devices: profile name and NVML's attributes (compared under `single`).
    pub migs: Vec<(String, MigAttributes)>,
}

/// The NVML device attributes of a MIG device that `single` requires to be the same everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigAttributes {
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// GPU slices.
    pub gpu_slices: u32,
    /// Compute slices.
    pub compute_slices: u32,
    /// Memory, MB.
    pub memory_mb: u64,
}

/// A layout the strategy cannot serve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// `single` with GPUs in and out of MIG mode.
    #[error(
        "migStrategy single needs every GPU in the same MIG mode, but {on} has MIG on and {off} has it off \
         (use migStrategy mixed, or change the GPUs' MIG mode)"
    )]
    MixedModes {
        /// A GPU with MIG on.
        on: String,
        /// A GPU with MIG off.
        off: String,
    },
    /// `single` with a GPU in MIG mode that has no MIG devices.
    #[error(
        "migStrategy single: GPU {0} has MIG mode on but no MIG devices (create its GPU and compute instances, \
         or use migStrategy mixed)"
    )]
    NoMigDevices(String),
    /// `single` with MIG devices of more than one kind.
    #[error(
        "migStrategy single needs one kind of MIG device on the node, found more than one: {first} on {first_gpu} \
         and {other} on {other_gpu} (use migStrategy mixed, or give every GPU the same MIG layout)"
    )]
    NotUniform {
        /// The first kind seen.
        first: String,
        /// Where.
        first_gpu: String,
        /// A different kind.
        other: String,
        /// Where.
        other_gpu: String,
    },
}

/// Checks a node's layout against the strategy, as NVIDIA's plugin does: `single` fails on mixed MIG modes,
/// on a MIG GPU without MIG devices and on more than one kind of MIG device; `mixed` only warns about a MIG
/// GPU without MIG devices (returned, one line each).
pub fn check_layout(strategy: MigStrategy, gpus: &[GpuLayout]) -> Result<Vec<String>, LayoutError> {
    let mut warnings = Vec::new();
    if strategy == MigStrategy::None {
        return Ok(warnings);
    }
    // Asked for MIG devices where there are none: said once, with what the node gets instead, so that a
    // fleet-wide setting on a node without MIG is not mistaken for a MIG layout that failed.
    if !gpus.is_empty() && gpus.iter().all(|g| !g.mig_enabled) {
        warnings.push(format!(
            "migStrategy {strategy}: no GPU on this node has MIG mode on; all {} GPUs are served whole, as with migStrategy none",
            gpus.len()
        ));
    }
    for gpu in gpus.iter().filter(|g| g.mig_enabled && g.migs.is_empty()) {
        match strategy {
            MigStrategy::Single => return Err(LayoutError::NoMigDevices(gpu.id.clone())),
            _ => warnings.push(format!(
                "GPU {} has MIG mode on but no MIG devices: it serves nothing until its instances are created",
                gpu.id
            )),
        }
    }
    if strategy == MigStrategy::Single {
        let on = gpus.iter().find(|g| g.mig_enabled);
        let off = gpus.iter().find(|g| !g.mig_enabled);
        if let (Some(on), Some(off)) = (on, off) {
            return Err(LayoutError::MixedModes {
                on: on.id.clone(),
                off: off.id.clone(),
            });
        }
        let mut first: Option<(&str, &(String, MigAttributes))> = None;
        for gpu in gpus {
            for mig in &gpu.migs {
                match first {
                    None => first = Some((&gpu.id, mig)),
                    Some((first_gpu, kind)) if kind != mig => {
                        return Err(LayoutError::NotUniform {
                            first: kind.0.clone(),
                            first_gpu: first_gpu.to_string(),
                            other: mig.0.clone(),
                            other_gpu: gpu.id.clone(),
                        });
                    }
                    Some(_) => {}
                }
            }
        }
    }
    Ok(warnings)
}

/// The driver's MIG capability device nodes, from `<proc>/driver/nvidia-caps/mig-minors`: the path of each
/// capability (`gpu0/gi1/access`, `gpu0/gi1/ci0/access`, `config`, `monitor`) to its minor number, whose
/// node is `/dev/nvidia-caps/nvidia-cap<minor>`. Lines that do not parse are skipped; a missing file is an
/// empty map (no MIG on this node).
pub fn read_mig_minors(proc_root: &Path) -> HashMap<String, u32> {
    let path = proc_root.join("driver/nvidia-caps/mig-minors");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return HashMap::new();
    };
    text.lines()
        .filter_map(|line| {
            let (cap, minor) = line.trim().rsplit_once(' ')?;
            Some((cap.trim().to_string(), minor.parse().ok()?))
        })
        .collect()
}

/// The device nodes a container needs for a MIG device: its GPU's node and the capability nodes of its GPU
/// instance and compute instance (the GPU named by its minor number, as the driver does). Capabilities the
/// minors file lacks are left out and returned apart, for the caller to report.
pub fn device_nodes(
    minors: &HashMap<String, u32>,
    gpu_minor: Option<u32>,
    mig: &MigInfo,
) -> (Vec<PathBuf>, Vec<String>) {
    let Some(gpu) = gpu_minor else {
        return (Vec::new(), vec!["the GPU's minor number".into()]);
    };
    let mut nodes = vec![PathBuf::from(format!("/dev/nvidia{gpu}"))];
    let mut missing = Vec::new();
    let gi = format!("gpu{gpu}/gi{}/access", mig.gpu_instance);
    let ci = format!(
        "gpu{gpu}/gi{}/ci{}/access",
        mig.gpu_instance, mig.compute_instance
    );
    for cap in [gi, ci] {
        match minors.get(&cap) {
            Some(minor) => nodes.push(PathBuf::from(format!("/dev/nvidia-caps/nvidia-cap{minor}"))),
            None => missing.push(cap),
        }
    }
    (nodes, missing)
}

#[cfg(test)]
mod tests {
    use super::*;

    const H100_BYTES: u64 = 81559 * 1024 * 1024;

    fn facts(gi_profile: u32, g: u32, c: u32, mb: u64) -> ProfileFacts {
        ProfileFacts {
            gi_profile: Some(gi_profile),
            gpu_slices: g,
            compute_slices: c,
            memory_mb: mb,
            gpu_memory_bytes: H100_BYTES,
        }
    }

    #[test]
    fn profiles_are_named_as_nvidia_names_them() {
        assert_eq!(profile_name(&facts(0, 1, 1, 9984)), "1g.10gb");
        assert_eq!(profile_name(&facts(9, 1, 1, 20096)), "1g.20gb");
        assert_eq!(profile_name(&facts(1, 2, 2, 20096)), "2g.20gb");
        assert_eq!(profile_name(&facts(2, 3, 3, 40448)), "3g.40gb");
        assert_eq!(profile_name(&facts(4, 7, 7, 81152)), "7g.80gb");
        assert_eq!(profile_name(&facts(7, 1, 1, 9984)), "1g.10gb+me");
        assert_eq!(profile_name(&facts(1, 2, 1, 20096)), "1c.2g.20gb");
        assert_eq!(profile_name(&facts(13, 1, 1, 9984)), "1g.10gb-me");
        assert_eq!(profile_name(&facts(15, 1, 1, 9984)), "1g.10gb+me.all");
    }

    #[test]
    fn mixed_names_a_resource_per_profile_and_single_keeps_the_gpu_name() {
        let naming = |strategy| ResourceNaming {
            strategy,
            base: "nvidia.com/gpu".into(),
        };
        assert_eq!(
            naming(MigStrategy::Mixed).of(Some("1g.10gb+me")),
            "nvidia.com/mig-1g.10gb.me"
        );
        assert_eq!(
            naming(MigStrategy::Single).of(Some("1g.10gb")),
            "nvidia.com/gpu"
        );
        assert_eq!(naming(MigStrategy::Mixed).of(None), "nvidia.com/gpu");
        for strategy in [MigStrategy::None, MigStrategy::Single, MigStrategy::Mixed] {
            for profile in [
                None,
                Some("1g.10gb"),
                Some("1g.10gb+me"),
                Some("1c.2g.20gb"),
            ] {
                let device = super::super::DeviceInfo {
                    mig: profile.map(|p| MigInfo {
                        parent: "GPU-0".into(),
                        profile: p.into(),
                        gpu_instance: 1,
                        compute_instance: 0,
                    }),
                    ..Default::default()
                };
                let naming = naming(strategy);
                for resource in [
                    "nvidia.com/gpu",
                    "nvidia.com/mig-1g.10gb",
                    "nvidia.com/mig-1g.10gb.me",
                    "nvidia.com/mig-1g.10gb+me",
                    "nvidia.com/mig-1c.2g.20gb",
                ] {
                    assert_eq!(
                        naming.serves(resource, &device),
                        naming.of_device(&device) == resource,
                        "{strategy:?} {profile:?} {resource}"
                    );
                }
            }
        }
    }

    fn layout(id: &str, enabled: bool, profiles: &[&str]) -> GpuLayout {
        GpuLayout {
            id: id.into(),
            mig_enabled: enabled,
            migs: profiles
                .iter()
                .map(|p| {
                    let slices = p[..1].parse().unwrap_or(1);
                    (
                        p.to_string(),
                        MigAttributes {
                            multiprocessors: 16 * slices,
                            gpu_slices: slices,
                            compute_slices: slices,
                            memory_mb: 10_000 * u64::from(slices),
                        },
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn single_refuses_what_nvidia_refuses_and_mixed_only_warns() {
        let uniform = [
            layout("GPU-a", true, &["1g.10gb", "1g.10gb"]),
            layout("GPU-b", true, &["1g.10gb"]),
        ];
        assert_eq!(check_layout(MigStrategy::Single, &uniform), Ok(vec![]));
        let two_kinds = [
            layout("GPU-a", true, &["1g.10gb"]),
            layout("GPU-b", true, &["2g.20gb"]),
        ];
        assert!(matches!(
            check_layout(MigStrategy::Single, &two_kinds),
            Err(LayoutError::NotUniform { ref other_gpu, .. }) if other_gpu == "GPU-b"
        ));
        assert_eq!(check_layout(MigStrategy::Mixed, &two_kinds), Ok(vec![]));
        let modes = [
            layout("GPU-a", true, &["1g.10gb"]),
            layout("GPU-b", false, &[]),
        ];
        assert!(matches!(
            check_layout(MigStrategy::Single, &modes),
            Err(LayoutError::MixedModes { .. })
        ));
        let empty = [layout("GPU-a", true, &[])];
        assert_eq!(
            check_layout(MigStrategy::Single, &empty),
            Err(LayoutError::NoMigDevices("GPU-a".into()))
        );
        assert_eq!(
            check_layout(MigStrategy::Mixed, &empty).map(|w| w.len()),
            Ok(1)
        );
    }

    #[test]
    fn a_mig_strategy_on_a_node_without_mig_says_so_once_and_what_is_served() {
        let plain = [layout("GPU-a", false, &[]), layout("GPU-b", false, &[])];
        for strategy in [MigStrategy::Mixed, MigStrategy::Single] {
            let warnings = check_layout(strategy, &plain).unwrap_or_default();
            assert_eq!(
                warnings,
                [format!(
                    "migStrategy {strategy}: no GPU on this node has MIG mode on; all 2 GPUs are served whole, as with migStrategy none"
                )]
            );
        }
        assert_eq!(check_layout(MigStrategy::None, &plain), Ok(vec![]));
    }

    #[test]
    fn capability_nodes_come_from_the_minors_file() -> Result<(), Box<dyn std::error::Error>> {
        let root = tempfile::tempdir()?;
        let dir = root.path().join("driver/nvidia-caps");
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join("mig-minors"),
            "config 1\nmonitor 2\ngpu3/gi5/access 399\ngpu3/gi5/ci0/access 400\ngarbage\n",
        )?;
        let minors = read_mig_minors(root.path());
        let mig = MigInfo {
            parent: "GPU-3".into(),
            profile: "1g.10gb".into(),
            gpu_instance: 5,
            compute_instance: 0,
        };
        let (nodes, missing) = device_nodes(&minors, Some(3), &mig);
        assert_eq!(
            nodes,
            [
                PathBuf::from("/dev/nvidia3"),
                PathBuf::from("/dev/nvidia-caps/nvidia-cap399"),
                PathBuf::from("/dev/nvidia-caps/nvidia-cap400"),
            ]
        );
        assert!(missing.is_empty());
        let other = MigInfo {
            gpu_instance: 6,
            ..mig
        };
        assert_eq!(device_nodes(&minors, Some(3), &other).1.len(), 2);
        Ok(())
    }
}
