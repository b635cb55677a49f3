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
}

/// A GPU instance profile of the H100 80GB, as NVML describes it.
#[derive(Debug)]
pub struct Profile {
    /// Its name in the fake's device list.
    pub name: &'static str,
    /// `NVML_GPU_INSTANCE_PROFILE_*`: the index NVML lists it under, and its ID.
    pub id: u32,
    pub slices: u32,
    pub memory_mb: u64,
}

/// Profiles of an 80 GB GPU; memory sizes a little under the nominal ones, as a driver reports them.
pub const PROFILES: &[Profile] = &[
    Profile {
        name: "1g.10gb",
        id: 0,
        slices: 1,
        memory_mb: 9984,
    },
    Profile {
        name: "2g.20gb",
        id: 1,
        slices: 2,
        memory_mb: 20096,
    },
    Profile {
        name: "3g.40gb",
        id: 2,
        slices: 3,
        memory_mb: 40448,
    },
    Profile {
        name: "4g.40gb",
        id: 3,
        slices: 4,
        memory_mb: 40448,
    },
    Profile {
        name: "7g.80gb",
        id: 4,
        slices: 7,
        memory_mb: 81152,
    },
    Profile {
        name: "1g.10gb+me",
        id: 7,
        slices: 1,
        memory_mb: 9984,
    },
    Profile {
        name: "1g.20gb",
        id: 9,
        slices: 1,
        memory_mb: 20096,
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
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MigEntry {
    profile: String,
    uuid: Option<String>,
    compute_slices: Option<u32>,
    gpu_instance: Option<u32>,
    compute_instance: Option<u32>,
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
    }
}

/// UUID of MIG device `mig` of GPU `gpu`, when the list gives none.
pub fn default_mig_uuid(gpu: usize, mig: usize) -> String {
    format!("MIG-fa4e0000-{gpu:04x}-4000-8000-{mig:012x}")
}

fn mig_spec(gpu: usize, index: usize, entry: MigEntry) -> Result<MigSpec, String> {
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
    Ok(MigSpec {
        uuid: entry.uuid.unwrap_or_else(|| default_mig_uuid(gpu, index)),
        profile,
        compute_slices,
        // GPU instance IDs as the driver numbers them are placement-dependent; any distinct values do.
        gpu_instance: entry.gpu_instance.unwrap_or(index as u32 + 1),
        compute_instance: entry.compute_instance.unwrap_or(0),
    })
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
            if let Some(migs) = entry.mig {
                let migs = migs
                    .into_iter()
                    .enumerate()
                    .map(|(j, m)| mig_spec(i, j, m))
                    .collect::<Result<Vec<_>, _>>()?;
                let slices: u32 = migs.iter().map(|m| m.profile.slices).sum();
                if slices > 7 {
                    return Err(format!(
                        "GPU {}: its MIG devices take {slices} of 7 slices",
                        spec.uuid
                    ));
                }
                spec.mig = Some(migs);
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
