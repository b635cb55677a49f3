//! What the driver says about a device that a DRA ResourceSlice publishes: its minor number, product, brand,
//! architecture, memory, PCI address, driver versions and, for a MIG device, where it sits on its GPU. Read
//! once at discovery by each source (`crate::sources`), fixed while the device is present.
//!
//! # What NVIDIA's DRA driver publishes (so that its DeviceClasses and users' CEL selectors match ours)
//!
//! Read from `kubernetes-sigs/dra-driver-nvidia-gpu` (formerly `NVIDIA/k8s-dra-driver-gpu`) at commit
//! `95932046`: `cmd/gpu-kubelet-plugin/deviceinfo.go` (`GpuInfo.Attributes`, `GetDevice`),
//! `cmd/gpu-kubelet-plugin/mig.go` (`CommonAttributesMig`, `CommonCapacitiesMig`, `ToCanonicalName`),
//! `cmd/gpu-kubelet-plugin/nvlib.go` (`getGpuInfo`, `getMigDevices`: where each value comes from),
//! `cmd/gpu-kubelet-plugin/partitions.go` (`fullGpuCapacity`); the spellings from the vendored go-nvlib
//! `pkg/nvlib/device/device.go` and the standard attributes from the vendored
//! `k8s.io/dynamic-resource-allocation/deviceattribute/pci_linux.go`.
//!
//! Driver `gpu.nvidia.com`; unqualified attribute names below are in that domain.
//!
//! Device names: a GPU is `gpu-<minor>`; a MIG device is
//! `gpu-<parent minor>-mig-<profile>-<GI profile ID>-<placement start>`, where `<profile>` is the profile name
//! with its dots removed, lower-cased, every character outside `[a-z0-9-]` made `-` and `-` trimmed from both
//! ends (`1g.10gb` → `1g10gb`, `1g.10gb+me` → `1g10gb-me`), and the GI profile ID is NVML's ID of the GPU
//! instance profile (19 for an H100's `1g.10gb`; not the `NVML_GPU_INSTANCE_PROFILE_*` index):
//! `gpu-0-mig-1g10gb-19-3`.
//!
//! | attribute | type | value | here |
//! |---|---|---|---|
//! | `type` | string | `gpu`; `mig` for a MIG device | `DeviceInfo::mig` |
//! | `uuid` | string | `GPU-…`, `MIG-…` | `DeviceInfo::id` |
//! | `parentUUID` (MIG) | string | the GPU's UUID | `MigInfo::parent` |
//! | `profile` (MIG) | string | `1g.10gb`, `1c.2g.20gb`, `1g.10gb+me` | `MigInfo::profile` |
//! | `productName` | string | NVML's name, `NVIDIA H100 80GB HBM3` (a MIG device: its GPU's) | [`DeviceFacts::product_name`] |
//! | `brand` | string | see [`brand_name`] (`Nvidia` for an H100) | [`DeviceFacts::brand`] |
//! | `architecture` | string | see [`architecture_name`] (`Hopper`, `Ada Lovelace`) | [`DeviceFacts::architecture`] |
//! | `cudaComputeCapability` | version | `<major>.<minor>` as semver: `9.0.0` | [`DeviceFacts::cuda_compute_capability`] |
//! | `driverVersion` | version | NVML's string as semver: `580.65.06` → `580.65.6` | [`DeviceFacts::driver_version`] |
//! | `cudaDriverVersion` | version | `<v / 1000>.<v % 1000 / 10>` of NVML's integer, as semver: `13.0.0` | [`DeviceFacts::cuda_driver_version`] |
//! | `resource.kubernetes.io/pciBusID` | string | `dddd:bb:dd.f`, lower case, 4-digit domain | [`DeviceFacts::pci_bus_id`] |
//! | `resource.kubernetes.io/pcieRoot` | string | `pci<domain>:<bus>` of the root complex, `pci0000:00` | [`DeviceFacts::pcie_root`] |
//! | `resource.kubernetes.io/numaNode` | int | left out when unknown or negative | `DeviceInfo::numa_node` |
//! | `addressingMode` | string | `ATS`, `HMM`, `None`; coherent-memory systems only (not read here) | — |
//!
//! "As semver" is Masterminds/semver's lenient parse printed back: missing parts are zero and leading zeros
//! go. A MIG device carries its GPU's `productName`, `brand`, `architecture`, the three versions, `pciBusID`,
//! `pcieRoot` and `numaNode`. Capacities (integer quantities): a GPU has `memory` (total bytes; left out when
//! NVML does not support the memory query). A MIG device has, from its GPU instance profile's info,
//! `multiprocessors`, `copyEngines`, `decoders`, `encoders`, `jpegEngines`, `ofaEngines` and `memory`
//! (`memorySizeMB` × 2^20 bytes), plus `memorySlice<i>` = 1 for each memory slice `i` in its placement
//! (start up to start + size). NVIDIA's driver refuses a GPU whose name, brand, architecture, versions or bus
//! ID cannot be read; here each unknown fact is `None`, the device is still served, and the slice leaves the
//! attribute out.

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// The facts a ResourceSlice publishes about one device, as its source read them; `None` where the source
/// does not know (simulated and procfs sources know less than NVML, and NVML may not support a query).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceFacts {
    /// Minor number of the GPU's device node `/dev/nvidia<minor>`; for a MIG device, its GPU's. NVIDIA's DRA
    /// driver names devices by it (`gpu-<minor>`), so it must be the driver's, not a position in a list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<u32>,
    /// NVML's product name, e.g. `NVIDIA H100 80GB HBM3`; for a MIG device, its GPU's (as NVIDIA publishes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product_name: Option<String>,
    /// The brand as NVIDIA's DRA driver spells it ([`brand_name`]), e.g. `Nvidia`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub brand: Option<String>,
    /// The architecture as NVIDIA's DRA driver spells it ([`architecture_name`]), e.g. `Hopper`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<String>,
    /// CUDA compute capability, major and minor (9.0 for Hopper).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_compute_capability: Option<(u32, u32)>,
    /// The GPU's total memory in bytes; for a MIG device, its own (its GPU instance profile's, as NVIDIA
    /// publishes the `memory` capacity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// PCI address as `resource.kubernetes.io/pciBusID` takes it ([`pci_bus_id`]): `0000:17:00.0`. A MIG
    /// device's is its GPU's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
    /// The PCIe root complex as `resource.kubernetes.io/pcieRoot` takes it: `pci0000:00`. Lets a claim put a
    /// GPU and a NIC under the same root. A MIG device's is its GPU's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_root: Option<String>,
    /// The kernel driver's version as NVML gives it, e.g. `580.65.06` (published as semver, `580.65.6`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,
    /// The newest CUDA version the driver supports, `<major>.<minor>` ([`cuda_driver_version`]), e.g. `13.0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_driver_version: Option<String>,
    /// Set for a MIG device whose GPU instance could be read: where it sits on its GPU, and its engines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigPlacement>,
}

/// Where a MIG device sits on its GPU: what NVIDIA's DRA driver names it by and publishes as its memory
/// slices, with the GPU instance profile's engine counts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigPlacement {
    /// NVML's ID of the GPU instance profile (`nvmlGpuInstanceInfo_t.profileId`, the ID `nvidia-smi mig
    /// -lgip` lists: 19 for an H100's `1g.10gb`), part of the device's name.
    pub gi_profile_id: u32,
    /// First memory slice the GPU instance occupies; part of the device's name.
    pub placement_start: u32,
    /// Memory slices it occupies.
    pub placement_size: u32,
    /// Its GPU instance profile's engine counts, published as capacities; `None` where the profile's info
    /// could not be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacities: Option<MigCapacities>,
}

impl MigPlacement {
    /// The memory slices it occupies, each published as a `memorySlice<i>` capacity of 1.
    pub fn memory_slices(&self) -> Range<u32> {
        self.placement_start..self.placement_start.saturating_add(self.placement_size)
    }
}

/// A GPU instance profile's engine counts (`nvmlGpuInstanceProfileInfo_t`), as NVIDIA's DRA driver
/// publishes them: `multiprocessors`, `copyEngines`, `decoders`, `encoders`, `jpegEngines`, `ofaEngines`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigCapacities {
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Copy engines.
    pub copy_engines: u32,
    /// Video decoders (NVDEC).
    pub decoders: u32,
    /// Video encoders (NVENC).
    pub encoders: u32,
    /// JPEG decoders (NVJPG).
    pub jpeg_engines: u32,
    /// Optical flow accelerators.
    pub ofa_engines: u32,
}

/// NVIDIA's DRA driver's spelling of an `NVML_BRAND_*` value (go-nvlib's `GetBrandAsString`); `None` for a
/// value it does not know (it refuses the GPU then; here the attribute is left out).
pub fn brand_name(brand: u32) -> Option<&'static str> {
    Some(match brand {
        0 => "Unknown",
        1 => "Quadro",
        2 => "Tesla",
        3 => "NVS",
        4 => "Grid",
        5 => "GeForce",
        6 => "Titan",
        7 => "NvidiaVApps",
        8 => "NvidiaVPC",
        9 => "NvidiaVCS",
        10 => "NvidiaVWS",
        11 => "NvidiaCloudGaming",
        12 => "QuadroRTX",
        13 => "NvidiaRTX",
        14 => "Nvidia",
        15 => "GeForceRTX",
        16 => "TitanRTX",
        _ => return None,
    })
}

/// NVIDIA's DRA driver's spelling of an `NVML_DEVICE_ARCH_*` value (go-nvlib's `GetArchitectureAsString`);
/// `None` for a value it does not know.
pub fn architecture_name(architecture: u32) -> Option<&'static str> {
    Some(match architecture {
        2 => "Kepler",
        3 => "Maxwell",
        4 => "Pascal",
        5 => "Volta",
        6 => "Turing",
        7 => "Ampere",
        8 => "Ada Lovelace",
        9 => "Hopper",
        10 => "Blackwell",
        13 => "Rubin",
        u32::MAX => "Unknown",
        _ => return None,
    })
}

/// The CUDA driver version as NVIDIA's DRA driver writes NVML's integer (`13000` → `13.0`, `12040` →
/// `12.4`); `None` for a negative one.
pub fn cuda_driver_version(version: i32) -> Option<String> {
    (version >= 0).then(|| format!("{}.{}", version / 1000, version % 1000 / 10))
}

/// A PCI address in the form `resource.kubernetes.io/pciBusID` takes (`dddd:bb:dd.f`, lower case), from
/// NVML's (`00000000:17:00.0`: an 8-digit domain, upper case): lower-cased, and an 8-digit domain starting
/// with four zeros cut to its last four digits, as NVIDIA's driver does. `None` where the result is not
/// such an address (the attribute's validation would refuse it).
pub fn pci_bus_id(nvml_bus_id: &str) -> Option<String> {
    let lower = nvml_bus_id.trim().to_ascii_lowercase();
    let id = match lower.split_once(':') {
        Some((domain, rest)) if domain.len() == 8 && domain.starts_with("0000") => {
            format!("{}:{rest}", &domain[4..])
        }
        _ => lower,
    };
    is_bdf(&id).then_some(id)
}

/// Whether `id` is `dddd:bb:dd.f` in lower-case hex.
fn is_bdf(id: &str) -> bool {
    let bytes = id.as_bytes();
    let hex = |range: Range<usize>| {
        bytes[range]
            .iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
    };
    bytes.len() == 12
        && bytes[4] == b':'
        && bytes[7] == b':'
        && bytes[10] == b'.'
        && hex(0..4)
        && hex(5..7)
        && hex(8..10)
        && hex(11..12)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvml_bus_ids_become_the_standard_attributes_form() {
        assert_eq!(
            pci_bus_id("00000000:17:00.0").as_deref(),
            Some("0000:17:00.0")
        );
        assert_eq!(
            pci_bus_id("00000001:AB:1F.7").as_deref(),
            Some("0001:ab:1f.7")
        );
        assert_eq!(pci_bus_id("0000:ab:00.0").as_deref(), Some("0000:ab:00.0"));
        // A domain that does not fit four digits, and what is no address at all, are not published.
        assert_eq!(pci_bus_id("00010000:17:00.0"), None);
        assert_eq!(pci_bus_id(""), None);
        assert_eq!(pci_bus_id("0000:17:00"), None);
        assert_eq!(pci_bus_id("0000:g7:00.0"), None);
        assert_eq!(pci_bus_id("0000:17:00.0\u{e9}"), None);
    }

    #[test]
    fn brands_and_architectures_are_spelled_as_nvidias_driver_spells_them() {
        assert_eq!(brand_name(14), Some("Nvidia"));
        assert_eq!(brand_name(2), Some("Tesla"));
        assert_eq!(brand_name(16), Some("TitanRTX"));
        assert_eq!(brand_name(17), None);
        assert_eq!(architecture_name(9), Some("Hopper"));
        assert_eq!(architecture_name(8), Some("Ada Lovelace"));
        assert_eq!(architecture_name(13), Some("Rubin"));
        assert_eq!(architecture_name(u32::MAX), Some("Unknown"));
        assert_eq!(architecture_name(11), None);
    }

    #[test]
    fn the_cuda_driver_version_is_major_dot_minor() {
        assert_eq!(cuda_driver_version(13000).as_deref(), Some("13.0"));
        assert_eq!(cuda_driver_version(12040).as_deref(), Some("12.4"));
        assert_eq!(cuda_driver_version(12090).as_deref(), Some("12.9"));
        assert_eq!(cuda_driver_version(-1), None);
    }

    #[test]
    fn a_mig_device_occupies_the_memory_slices_of_its_placement() {
        let placement = MigPlacement {
            gi_profile_id: 9,
            placement_start: 4,
            placement_size: 4,
            capacities: None,
        };
        assert_eq!(placement.memory_slices().collect::<Vec<_>>(), [4, 5, 6, 7]);
        let odd = MigPlacement {
            placement_start: u32::MAX,
            placement_size: 2,
            ..placement
        };
        assert_eq!(
            odd.memory_slices().count(),
            0,
            "no overflow on driver input"
        );
    }
}
