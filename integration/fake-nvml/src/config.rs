//! The fake's GPUs: from the JSON file named by `FAKE_NVML_CONFIG`, or four deterministic GPUs.

use serde::Deserialize;

use crate::event_type;

/// One fake GPU.
#[derive(Debug, Clone)]
pub struct DeviceSpec {
    pub uuid: String,
    pub name: String,
    pub pci_bus_id: String,
    pub minor: u32,
    pub memory_mib: u64,
    /// NVML event type bits this GPU supports.
    pub supported_events: u64,
    /// MIG mode on, with these MIG devices (`None`: MIG mode off).
    pub mig: Option<Vec<MigSpec>>,
    /// `NVML_DEVICE_ARCH_*`.
    pub architecture: u32,
    /// `NVML_BRAND_*`.
    pub brand: u32,
    /// CUDA compute capability, major and minor.
    pub cuda_compute_capability: (i32, i32),
    /// NVML functions that answer `NVML_ERROR_NOT_SUPPORTED` for this GPU (and its MIG devices), as for a
    /// query the GPU lacks; each one of [`MAY_BE_UNSUPPORTED`].
    pub not_supported: Vec<String>,
}

impl DeviceSpec {
    /// Whether `function` answers `NVML_ERROR_NOT_SUPPORTED` for this GPU.
    pub fn supports(&self, function: &str) -> bool {
        !self.not_supported.iter().any(|f| f == function)
    }
}

/// The functions a device list may mark `not_supported`: the queries of a GPU's facts.
pub const MAY_BE_UNSUPPORTED: &[&str] = &[
    "nvmlDeviceGetName",
    "nvmlDeviceGetBrand",
    "nvmlDeviceGetArchitecture",
    "nvmlDeviceGetCudaComputeCapability",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMinorNumber",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetGpuInstanceProfileInfo",
];

/// `NVML_DEVICE_ARCH_*` by the name go-nvml gives it (lower case).
const ARCHITECTURES: &[(&str, u32)] = &[
    ("kepler", 2),
    ("maxwell", 3),
    ("pascal", 4),
    ("volta", 5),
    ("turing", 6),
    ("ampere", 7),
    ("ada", 8),
    ("hopper", 9),
    ("blackwell", 10),
    ("rubin", 13),
    ("unknown", u32::MAX),
];

/// `NVML_BRAND_*` by its `nvml.h` name without the prefix (lower case).
const BRANDS: &[(&str, u32)] = &[
    ("unknown", 0),
    ("quadro", 1),
    ("tesla", 2),
    ("nvs", 3),
    ("grid", 4),
    ("geforce", 5),
    ("titan", 6),
    ("nvidia_vapps", 7),
    ("nvidia_vpc", 8),
    ("nvidia_vcs", 9),
    ("nvidia_vws", 10),
    ("nvidia_cloud_gaming", 11),
    ("quadro_rtx", 12),
    ("nvidia_rtx", 13),
    ("nvidia", 14),
    ("geforce_rtx", 15),
    ("titan_rtx", 16),
];

/// `name`'s value in `table`, or what is wrong.
fn lookup(table: &[(&str, u32)], what: &str, name: &str) -> Result<u32, String> {
    table
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| *v)
        .ok_or_else(|| {
            let known: Vec<&str> = table.iter().map(|(n, _)| *n).collect();
            format!("unknown {what} {name:?} (known: {})", known.join(", "))
        })
}

/// One MIG device (a GPU instance with one compute instance) of a fake GPU.
#[derive(Debug, Clone)]
pub struct MigSpec {
    pub uuid: String,
    pub profile: &'static Profile,
    /// Compute slices of its compute instance; the profile's GPU slices unless a smaller one is asked for.
    pub compute_slices: u32,
    pub gpu_instance: u32,
    pub compute_instance: u32,
    /// First memory slice its GPU instance occupies (it occupies the profile's `memory_slices` from there).
    pub placement_start: u32,
}

/// A GPU instance profile of the H100 80GB, as NVML describes it (`nvidia-smi mig -lgip`, `-lgipp`).
#[derive(Debug)]
pub struct Profile {
    /// Its name in the fake's device list.
    pub name: &'static str,
    /// `NVML_GPU_INSTANCE_PROFILE_*`: the index NVML lists it under.
    pub index: u32,
    /// Its ID (`nvmlGpuInstanceProfileInfo_t.id`, `nvmlGpuInstanceInfo_t.profileId`): not its index.
    pub id: u32,
    /// GPU (compute) slices.
    pub slices: u32,
    /// Memory slices, of the GPU's [`MEMORY_SLICES`].
    pub memory_slices: u32,
    /// The memory slices a GPU instance of it may start at.
    pub placements: &'static [u32],
    pub memory_mb: u64,
    pub multiprocessors: u32,
    pub copy_engines: u32,
    pub decoders: u32,
    pub jpeg_engines: u32,
    pub ofa_engines: u32,
}

/// Memory slices of an H100 80GB.
pub const MEMORY_SLICES: u32 = 8;

/// Profiles of an 80 GB GPU; memory sizes a little under the nominal ones, as a driver reports them.
pub const PROFILES: &[Profile] = &[
    Profile {
        name: "1g.10gb",
        index: 0,
        id: 19,
        slices: 1,
        memory_slices: 1,
        placements: &[0, 1, 2, 3, 4, 5, 6],
        memory_mb: 9984,
        multiprocessors: 16,
        copy_engines: 1,
        decoders: 1,
        jpeg_engines: 1,
        ofa_engines: 0,
    },
    Profile {
        name: "2g.20gb",
        index: 1,
        id: 14,
        slices: 2,
        memory_slices: 2,
        placements: &[0, 2, 4],
        memory_mb: 20096,
        multiprocessors: 32,
        copy_engines: 2,
        decoders: 2,
        jpeg_engines: 2,
        ofa_engines: 0,
    },
    Profile {
        name: "3g.40gb",
        index: 2,
        id: 9,
        slices: 3,
        memory_slices: 4,
        placements: &[0, 4],
        memory_mb: 40448,
        multiprocessors: 60,
        copy_engines: 3,
        decoders: 3,
        jpeg_engines: 3,
        ofa_engines: 0,
    },
    Profile {
        name: "4g.40gb",
        index: 3,
        id: 5,
        slices: 4,
        memory_slices: 4,
        placements: &[0],
        memory_mb: 40448,
        multiprocessors: 64,
        copy_engines: 4,
        decoders: 4,
        jpeg_engines: 4,
        ofa_engines: 0,
    },
    Profile {
        name: "7g.80gb",
        index: 4,
        id: 0,
        slices: 7,
        memory_slices: 8,
        placements: &[0],
        memory_mb: 81152,
        multiprocessors: 132,
        copy_engines: 8,
        decoders: 7,
        jpeg_engines: 7,
        ofa_engines: 1,
    },
    Profile {
        name: "1g.10gb+me",
        index: 7,
        id: 20,
        slices: 1,
        memory_slices: 1,
        placements: &[0, 1, 2, 3, 4, 5, 6],
        memory_mb: 9984,
        multiprocessors: 16,
        copy_engines: 1,
        decoders: 7,
        jpeg_engines: 7,
        ofa_engines: 1,
    },
    Profile {
        name: "1g.20gb",
        index: 9,
        id: 15,
        slices: 1,
        memory_slices: 2,
        placements: &[0, 2, 4, 6],
        memory_mb: 20096,
        multiprocessors: 26,
        copy_engines: 1,
        decoders: 1,
        jpeg_engines: 1,
        ofa_engines: 0,
    },
];

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    devices: Vec<Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    uuid: String,
    name: Option<String>,
    pci_bus_id: Option<String>,
    minor: Option<u32>,
    memory_mib: Option<u64>,
    supported_events: Option<Vec<String>>,
    mig: Option<Vec<MigEntry>>,
    architecture: Option<String>,
    brand: Option<String>,
    cuda_compute_capability: Option<String>,
    not_supported: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MigEntry {
    profile: String,
    uuid: Option<String>,
    compute_slices: Option<u32>,
    gpu_instance: Option<u32>,
    compute_instance: Option<u32>,
    placement_start: Option<u32>,
}

/// Devices when `FAKE_NVML_CONFIG` is not set.
pub const DEFAULT_DEVICE_COUNT: usize = 4;

/// UUID of default GPU `index`.
pub fn default_uuid(index: usize) -> String {
    format!("GPU-fa4e0000-0000-4000-8000-{index:012x}")
}

fn default_bus_id(index: usize) -> String {
    format!("{:08X}:{:02X}:00.0", index / 256, index % 256)
}

fn defaults(index: usize, uuid: String) -> DeviceSpec {
    DeviceSpec {
        uuid,
        name: "NVIDIA H100 80GB HBM3".into(),
        pci_bus_id: default_bus_id(index),
        minor: index as u32,
        memory_mib: 81559,
        supported_events: event_type::XID_CRITICAL
            | event_type::DOUBLE_BIT_ECC
            | event_type::SINGLE_BIT_ECC,
        mig: None,
        architecture: 9,
        brand: 14,
        cuda_compute_capability: (9, 0),
        not_supported: Vec::new(),
    }
}

/// UUID of MIG device `mig` of GPU `gpu`, when the list gives none.
pub fn default_mig_uuid(gpu: usize, mig: usize) -> String {
    format!("MIG-fa4e0000-{gpu:04x}-4000-8000-{mig:012x}")
}

/// One MIG device as the list gives it, its placement still to be chosen where the list gives none.
fn mig_spec(gpu: usize, index: usize, entry: MigEntry) -> Result<(MigSpec, Option<u32>), String> {
    let profile = PROFILES
        .iter()
        .find(|p| p.name == entry.profile)
        .ok_or_else(|| {
            let known: Vec<&str> = PROFILES.iter().map(|p| p.name).collect();
            format!(
                "unknown MIG profile {:?} (known: {})",
                entry.profile,
                known.join(", ")
            )
        })?;
    let compute_slices = entry.compute_slices.unwrap_or(profile.slices);
    if compute_slices == 0 || compute_slices > profile.slices {
        return Err(format!(
            "compute_slices {compute_slices} does not fit profile {}",
            profile.name
        ));
    }
    if let Some(start) = entry.placement_start
        && !profile.placements.contains(&start)
    {
        return Err(format!(
            "placement_start {start} is not a placement of profile {} (it may start at {:?})",
            profile.name, profile.placements
        ));
    }
    let spec = MigSpec {
        uuid: entry.uuid.unwrap_or_else(|| default_mig_uuid(gpu, index)),
        profile,
        compute_slices,
        // GPU instance IDs as the driver numbers them are placement-dependent; any distinct values do.
        gpu_instance: entry.gpu_instance.unwrap_or(index as u32 + 1),
        compute_instance: entry.compute_instance.unwrap_or(0),
        placement_start: 0,
    };
    Ok((spec, entry.placement_start))
}

/// Gives every MIG device a placement: the one the list gives, or else the lowest of its profile's that
/// still fits, in list order, trying the others where a later device would not fit (as an operator would
/// lay the GPU out); `false` when the devices cannot share the GPU's memory slices.
fn place(migs: &mut [(MigSpec, Option<u32>)], used: u32) -> bool {
    let Some(((spec, asked), rest)) = migs.split_first_mut() else {
        return true;
    };
    let candidates: Vec<u32> = match asked {
        Some(start) => vec![*start],
        None => spec.profile.placements.to_vec(),
    };
    for start in candidates {
        let mask = ((1u32 << spec.profile.memory_slices) - 1) << start;
        if start + spec.profile.memory_slices <= MEMORY_SLICES
            && used & mask == 0
            && place(rest, used | mask)
        {
            spec.placement_start = start;
            return true;
        }
    }
    false
}

/// Reads the device list; the error says what is wrong with the file.
pub fn load() -> Result<Vec<DeviceSpec>, String> {
    let Some(path) = std::env::var_os("FAKE_NVML_CONFIG") else {
        return Ok((0..DEFAULT_DEVICE_COUNT)
            .map(|i| defaults(i, default_uuid(i)))
            .collect());
    };
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "cannot read FAKE_NVML_CONFIG {}: {e}",
            path.to_string_lossy()
        )
    })?;
    let file: File = serde_json::from_str(&text)
        .map_err(|e| format!("FAKE_NVML_CONFIG {}: {e}", path.to_string_lossy()))?;
    file.devices
        .into_iter()
        .enumerate()
        .map(|(i, entry)| {
            let mut spec = defaults(i, entry.uuid);
            if let Some(name) = entry.name {
                spec.name = name;
            }
            if let Some(bus) = entry.pci_bus_id {
                spec.pci_bus_id = bus;
            }
            if let Some(minor) = entry.minor {
                spec.minor = minor;
            }
            if let Some(mib) = entry.memory_mib {
                spec.memory_mib = mib;
            }
            if let Some(events) = entry.supported_events {
                spec.supported_events = events_mask(&events)?;
            }
            if let Some(name) = entry.architecture {
                spec.architecture = lookup(ARCHITECTURES, "architecture", &name)?;
            }
            if let Some(name) = entry.brand {
                spec.brand = lookup(BRANDS, "brand", &name)?;
            }
            if let Some(cc) = entry.cuda_compute_capability {
                spec.cuda_compute_capability = cc
                    .split_once('.')
                    .and_then(|(major, minor)| Some((major.parse().ok()?, minor.parse().ok()?)))
                    .ok_or_else(|| {
                        format!("cuda_compute_capability {cc:?} is not <major>.<minor>")
                    })?;
            }
            if let Some(functions) = entry.not_supported {
                if let Some(other) = functions
                    .iter()
                    .find(|f| !MAY_BE_UNSUPPORTED.contains(&f.as_str()))
                {
                    return Err(format!(
                        "not_supported: {other:?} is not one of {}",
                        MAY_BE_UNSUPPORTED.join(", ")
                    ));
                }
                spec.not_supported = functions;
            }
            if let Some(migs) = entry.mig {
                let mut migs = migs
                    .into_iter()
                    .enumerate()
                    .map(|(j, m)| mig_spec(i, j, m))
                    .collect::<Result<Vec<_>, _>>()?;
                let slices: u32 = migs.iter().map(|(m, _)| m.profile.slices).sum();
                if slices > 7 {
                    return Err(format!(
                        "GPU {}: its MIG devices take {slices} of 7 slices",
                        spec.uuid
                    ));
                }
                if !place(&mut migs, 0) {
                    return Err(format!(
                        "GPU {}: its MIG devices do not fit its {MEMORY_SLICES} memory slices together",
                        spec.uuid
                    ));
                }
                spec.mig = Some(migs.into_iter().map(|(m, _)| m).collect());
            }
            Ok(spec)
        })
        .collect()
}

fn events_mask(names: &[String]) -> Result<u64, String> {
    names.iter().try_fold(0, |mask, name| {
        let bit = match name.as_str() {
            "xid" => event_type::XID_CRITICAL,
            "dbe" => event_type::DOUBLE_BIT_ECC,
            "sbe" => event_type::SINGLE_BIT_ECC,
            other => {
                return Err(format!(
                    "unknown supported_events entry {other:?} (xid, dbe, sbe)"
                ));
            }
        };
        Ok(mask | bit)
    })
}

/// Domain, bus and device numbers of a bus id such as `00000000:17:00.0`; zeros where it does not parse.
pub fn parse_bus_id(bus_id: &str) -> (u32, u32, u32) {
    let mut parts = bus_id.split([':', '.']);
    let mut next = || {
        parts
            .next()
            .and_then(|p| u32::from_str_radix(p, 16).ok())
            .unwrap_or(0)
    };
    (next(), next(), next())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(profile: &str, placement_start: Option<u32>) -> MigEntry {
        MigEntry {
            profile: profile.into(),
            uuid: None,
            compute_slices: None,
            gpu_instance: None,
            compute_instance: None,
            placement_start,
        }
    }

    fn placed(entries: Vec<MigEntry>) -> Result<Option<Vec<u32>>, String> {
        let mut migs = entries
            .into_iter()
            .enumerate()
            .map(|(j, e)| mig_spec(0, j, e))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(place(&mut migs, 0).then(|| migs.iter().map(|(m, _)| m.placement_start).collect()))
    }

    #[test]
    fn mig_devices_take_the_lowest_placements_that_leave_room_for_the_rest() -> Result<(), String> {
        let two = |p: &str| {
            vec![
                entry("1g.10gb", None),
                entry("1g.10gb", None),
                entry(p, None),
            ]
        };
        assert_eq!(placed(two("2g.20gb"))?, Some(vec![0, 1, 2]));
        // The 3g.40gb must go to slice 4 for the two 2g.20gb to fit below it.
        let layout = vec![
            entry("3g.40gb", None),
            entry("2g.20gb", None),
            entry("2g.20gb", None),
        ];
        assert_eq!(placed(layout)?, Some(vec![4, 0, 2]));
        assert_eq!(
            placed(vec![entry("3g.40gb", Some(4)), entry("1g.10gb", None)])?,
            Some(vec![4, 0])
        );
        assert_eq!(
            placed(vec![entry("4g.40gb", None), entry("3g.40gb", Some(0))])?,
            None,
            "both at slice 0"
        );
        assert!(placed(vec![entry("2g.20gb", Some(1))]).is_err());
        Ok(())
    }
}
