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
}

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
    }
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
