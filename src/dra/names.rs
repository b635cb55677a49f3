//! The names devices are published under: NVIDIA's DRA driver's, so that its DeviceClasses and users' CEL
//! selectors match them unchanged. A whole GPU is `gpu-<minor>` (its `/dev/nvidia<minor>`, which stays with
//! the card when NVML's index order changes); a MIG device carries its GPU's name and its place on it.
//!
//! A device name is a DNS label: lower case letters, digits and `-`, at most 63 characters.

use crate::devices::{DeviceInfo, DeviceState, Inventory};

/// The longest DNS label.
const MAX_NAME: usize = 63;

/// The name `info` is published under.
pub fn device_name(info: &DeviceInfo) -> String {
    let gpu = match gpu_minor(info) {
        Some(minor) => format!("gpu-{minor}"),
        // No minor known (a source without device nodes): NVML's index, or the UUID as a last resort.
        None => match info.gpu_index() {
            Some(index) => format!("gpu-{index}"),
            None => format!("gpu-{}", label(&info.id)),
        },
    };
    let placement = info.facts.as_ref().and_then(|f| f.mig.as_ref());
    let name = match (&info.mig, placement) {
        (None, _) => gpu,
        // NVIDIA's: the profile, the GPU instance profile's ID and where the instance starts on the GPU.
        (Some(mig), Some(placement)) => format!(
            "{gpu}-mig-{}-{}-{}",
            profile_label(&mig.profile),
            placement.gi_profile_id,
            placement.placement_start
        ),
        // A source that does not know the placement: the instance IDs, unique on the GPU too.
        (Some(mig), None) => format!(
            "{gpu}-mig-{}-{}-{}",
            profile_label(&mig.profile),
            mig.gpu_instance,
            mig.compute_instance
        ),
    };
    let mut name = label(&name);
    name.truncate(MAX_NAME);
    name.trim_end_matches('-').to_string()
}

/// The device of `inventory` published as `name`.
pub fn find<'a>(inventory: &'a Inventory, name: &str) -> Option<&'a DeviceState> {
    inventory
        .devices()
        .iter()
        .find(|d| device_name(&d.info) == name)
}

/// The minor of the GPU `info` is or is part of: as the source read it, else from its `/dev/nvidia<N>`.
fn gpu_minor(info: &DeviceInfo) -> Option<u32> {
    info.facts.as_ref().and_then(|f| f.minor).or_else(|| {
        info.device_nodes.iter().find_map(|node| {
            node.file_name()?
                .to_str()?
                .strip_prefix("nvidia")?
                .parse()
                .ok()
        })
    })
}

/// A MIG profile as NVIDIA's device names carry it: dots removed, lower case, anything else outside
/// `[a-z0-9-]` made `-`, trimmed (`1g.10gb+me` → `1g10gb-me`).
fn profile_label(profile: &str) -> String {
    let label: String = profile
        .chars()
        .filter(|c| *c != '.')
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    label.trim_matches('-').to_string()
}

/// `text` as DNS-label characters: lower case, every other character dropped (`1g.10gb+me` → `1g10gbme`).
fn label(text: &str) -> String {
    text.chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::facts::{DeviceFacts, MigPlacement};
    use crate::devices::mig::MigInfo;
    use std::path::PathBuf;

    fn gpu(id: &str, index: &str, node: Option<&str>) -> DeviceInfo {
        DeviceInfo {
            id: id.to_string(),
            index: Some(index.to_string()),
            device_nodes: node.map(PathBuf::from).into_iter().collect(),
            ..DeviceInfo::default()
        }
    }

    #[test]
    fn a_gpu_is_named_by_its_device_minor_not_its_index() {
        assert_eq!(
            device_name(&gpu("GPU-a", "0", Some("/dev/nvidia3"))),
            "gpu-3"
        );
        assert_eq!(device_name(&gpu("GPU-a", "2", None)), "gpu-2");
    }

    #[test]
    fn a_mig_device_is_named_as_nvidia_names_it_by_profile_and_placement() {
        let mut info = gpu("MIG-x", "1:0", Some("/dev/nvidia1"));
        info.device_nodes
            .push(PathBuf::from("/dev/nvidia-caps/nvidia-cap21"));
        info.mig = Some(MigInfo {
            parent: "GPU-a".into(),
            profile: "1g.10gb+me".into(),
            gpu_instance: 9,
            compute_instance: 0,
        });
        // Without the placement (a source that cannot read it): the instance IDs.
        assert_eq!(device_name(&info), "gpu-1-mig-1g10gb-me-9-0");
        info.facts = Some(std::sync::Arc::new(DeviceFacts {
            minor: Some(4),
            mig: Some(MigPlacement {
                gi_profile_id: 19,
                placement_start: 3,
                placement_size: 1,
                capacities: None,
            }),
            ..DeviceFacts::default()
        }));
        assert_eq!(device_name(&info), "gpu-4-mig-1g10gb-me-19-3");
    }

    #[test]
    fn a_name_is_never_longer_than_a_dns_label() {
        let info = DeviceInfo {
            id: "GPU-".to_string() + &"ab".repeat(60),
            ..DeviceInfo::default()
        };
        let name = device_name(&info);
        assert!(name.len() <= MAX_NAME && !name.ends_with('-'), "{name}");
        assert!(name.starts_with("gpu-gpu-abab"), "{name}");
    }
}
