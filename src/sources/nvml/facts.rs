//! Each device's facts for a ResourceSlice ([`DeviceFacts`]) as NVML, sysfs and the driver's procfs files give
//! them. Every fact is read on its own: one the driver cannot give (a query the GPU does not support, a
//! symbol an older library lacks, a link sysfs does not have) is `None`, never an error that loses the
//! device.

use std::path::{Component, Path};

use nvml_wrapper::struct_wrappers::device::ProfileInfo;
use nvml_wrapper::{Device, Nvml};

use super::raw;
use crate::devices::facts::{self, DeviceFacts, MigCapacities, MigPlacement};

/// The facts that are the node's, not a GPU's: read once per discovery.
#[derive(Debug, Clone, Default)]
pub(super) struct SystemFacts {
    driver_version: Option<String>,
    cuda_driver_version: Option<String>,
}

/// The driver's and the CUDA driver's versions.
pub(super) fn system(nvml: &Nvml) -> SystemFacts {
    SystemFacts {
        driver_version: nvml.sys_driver_version().ok(),
        cuda_driver_version: nvml
            .sys_cuda_driver_version()
            .ok()
            .and_then(facts::cuda_driver_version),
    }
}

/// A whole GPU's facts; `nvml_bus_id` is its PCI address as NVML gives it, when it could be read.
pub(super) fn gpu(
    nvml: &Nvml,
    device: &Device<'_>,
    nvml_bus_id: Option<&str>,
    sysfs_root: &Path,
    system: &SystemFacts,
) -> DeviceFacts {
    let pci_bus_id = nvml_bus_id.and_then(facts::pci_bus_id);
    DeviceFacts {
        minor: device.minor_number().ok(),
        product_name: device.name().ok(),
        brand: raw::brand(nvml, device)
            .ok()
            .and_then(facts::brand_name)
            .map(str::to_string),
        architecture: raw::architecture(nvml, device)
            .ok()
            .and_then(facts::architecture_name)
            .map(str::to_string),
        cuda_compute_capability: device
            .cuda_compute_capability()
            .ok()
            .and_then(|cc| Some((u32::try_from(cc.major).ok()?, u32::try_from(cc.minor).ok()?))),
        memory_bytes: device.memory_info().ok().map(|m| m.total),
        pcie_root: pci_bus_id
            .as_deref()
            .and_then(|id| pcie_root(sysfs_root, id)),
        pci_bus_id,
        driver_version: system.driver_version.clone(),
        cuda_driver_version: system.cuda_driver_version.clone(),
        mig: None,
    }
}

/// A MIG device's facts: its GPU's (`gpu`), with its own memory and placement. `instance` is its GPU
/// instance's info and `profile` that instance's profile, where NVML gave them; `memory_mb` is the MIG
/// device's memory from its attributes, used where the profile is unknown.
pub(super) fn mig(
    gpu: &DeviceFacts,
    instance: Option<raw::GpuInstanceInfo>,
    profile: Option<&ProfileInfo>,
    memory_mb: u64,
) -> DeviceFacts {
    const MIB: u64 = 1024 * 1024;
    // NVIDIA publishes the profile's memory (memorySizeMB, in MiB whatever its name says).
    let memory_mb = profile.map_or(memory_mb, |p| p.memory_size_mb);
    DeviceFacts {
        memory_bytes: memory_mb.checked_mul(MIB),
        mig: instance.map(|gi| MigPlacement {
            gi_profile_id: gi.profile_id,
            placement_start: gi.placement_start,
            placement_size: gi.placement_size,
            capacities: profile.map(|p| MigCapacities {
                multiprocessors: p.multiprocessor_count,
                copy_engines: p.copy_engine_count,
                decoders: p.decoder_count,
                encoders: p.encoder_count,
                jpeg_engines: p.jpeg_count,
                ofa_engines: p.ofa_count,
            }),
        }),
        ..gpu.clone()
    }
}

/// The PCIe root complex (`pci0000:00`) of the PCI device `bus_id` (`0000:17:00.0`), from where sysfs links
/// the device (`<root>/bus/pci/devices/<bus id>` → `../../../devices/pci0000:00/…/<bus id>`), as
/// `resource.kubernetes.io/pcieRoot` takes it; `None` where the link is missing or not of that shape.
pub fn pcie_root(sysfs_root: &Path, bus_id: &str) -> Option<String> {
    let target = std::fs::read_link(sysfs_root.join("bus/pci/devices").join(bus_id)).ok()?;
    root_in_link(&target, bus_id)
}

/// The root complex named in a sysfs device link's target: the component after `devices`, which must name a
/// root (`pci` and hex digits and colons), in a path that ends with the device itself.
fn root_in_link(target: &Path, bus_id: &str) -> Option<String> {
    let parts: Vec<&str> = target
        .components()
        .filter_map(|c| match c {
            Component::Normal(part) => part.to_str(),
            _ => None,
        })
        .collect();
    if parts.last() != Some(&bus_id) {
        return None;
    }
    let is_root = |part: &str| {
        part.strip_prefix("pci").is_some_and(|rest| {
            rest.contains(':') && rest.chars().all(|c| c == ':' || c.is_ascii_hexdigit())
        })
    };
    parts
        .windows(2)
        .find(|pair| pair[0] == "devices" && is_root(pair[1]))
        .map(|pair| pair[1].to_string())
}

/// The driver's version from `<proc>/driver/nvidia/version` (`NVRM version: NVIDIA UNIX x86_64 Kernel Module
/// 580.65.06  …`): the first word of the NVRM line that is numbers and dots. For a node where NVML cannot
/// be loaded.
pub(super) fn procfs_driver_version(proc_root: &Path) -> Option<String> {
    let text = std::fs::read_to_string(proc_root.join("driver/nvidia/version")).ok()?;
    let line = text.lines().find(|l| l.starts_with("NVRM version:"))?;
    line.split_whitespace()
        .find(|word| {
            word.contains('.')
                && word
                    .split('.')
                    .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pcie_root_is_the_root_complex_the_sysfs_link_goes_through()
    -> Result<(), Box<dyn std::error::Error>> {
        let sysfs = tempfile::tempdir()?;
        let device = sysfs
            .path()
            .join("devices/pci0000:16/0000:16:02.0/0000:17:00.0");
        std::fs::create_dir_all(&device)?;
        let links = sysfs.path().join("bus/pci/devices");
        std::fs::create_dir_all(&links)?;
        std::os::unix::fs::symlink(
            "../../../devices/pci0000:16/0000:16:02.0/0000:17:00.0",
            links.join("0000:17:00.0"),
        )?;
        assert_eq!(
            pcie_root(sysfs.path(), "0000:17:00.0").as_deref(),
            Some("pci0000:16")
        );
        // Not linked (sysfs not mounted, another GPU): unknown.
        assert_eq!(pcie_root(sysfs.path(), "0000:18:00.0"), None);
        Ok(())
    }

    #[test]
    fn a_link_of_another_shape_names_no_root() {
        let root = |target: &str| root_in_link(Path::new(target), "0000:17:00.0");
        assert_eq!(
            root("/sys/devices/pci0000:00/0000:00:01.0/0000:17:00.0").as_deref(),
            Some("pci0000:00")
        );
        assert_eq!(
            root("../../../devices/platform/0000:17:00.0"),
            None,
            "not under a PCI root"
        );
        assert_eq!(
            root("../../../devices/pci0000:00/0000:18:00.0"),
            None,
            "another device"
        );
        assert_eq!(root("../../../devices/pcixyz/0000:17:00.0"), None);
    }

    #[test]
    fn the_driver_version_comes_from_the_nvrm_line() -> Result<(), Box<dyn std::error::Error>> {
        let proc_root = tempfile::tempdir()?;
        assert_eq!(procfs_driver_version(proc_root.path()), None);
        let dir = proc_root.path().join("driver/nvidia");
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join("version"),
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  \
             (dvs-builder@U16-I3-B03-4-3)  Tue Jul 15 18:36:13 UTC 2025\nGCC version:  gcc version 13.3.0\n",
        )?;
        assert_eq!(
            procfs_driver_version(proc_root.path()).as_deref(),
            Some("580.65.06")
        );
        std::fs::write(dir.join("version"), "NVRM version: garbled\n")?;
        assert_eq!(procfs_driver_version(proc_root.path()), None);
        Ok(())
    }
}
