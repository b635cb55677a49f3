//! Which GPUs are served through DRA, and so not through the device plugin: one road per GPU, never both
//! (two accounting systems on one GPU hand it out twice).
//!
//! The unit is a whole GPU: a GPU served through DRA takes its MIG devices with it. Entries are NVML indices
//! (`0`) or GPU UUIDs (`GPU-…`); a MIG device cannot be named on its own, and an entry that names no GPU of
//! the node stops the plugin at start, so that a typo never leaves a GPU on the wrong road.

use super::{DeviceInfo, Inventory, Unserved};

/// The GPUs served through DRA.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DraSelection {
    /// Every GPU of the node.
    All,
    /// These GPUs (indices or UUIDs); the others through the device plugin.
    Gpus(Vec<String>),
}

impl DraSelection {
    /// Parses the setting: `all`, or a comma-separated list of GPU indices and UUIDs. `None` for off
    /// (`""`, `off`, `none`, `false`).
    pub fn parse(value: &str) -> Result<Option<DraSelection>, String> {
        let value = value.trim();
        match value {
            "" | "off" | "none" | "false" => return Ok(None),
            "all" | "true" => return Ok(Some(DraSelection::All)),
            _ => {}
        }
        let mut gpus = Vec::new();
        for entry in value.split(',').map(str::trim) {
            if entry.is_empty() {
                return Err("an empty entry in the list".into());
            }
            if entry.contains(':') || entry.starts_with("MIG-") {
                return Err(format!(
                    "{entry} is a MIG device: name its GPU; a GPU and its MIG devices are served by one road"
                ));
            }
            let index = entry.bytes().all(|b| b.is_ascii_digit());
            if !index && !entry.starts_with("GPU-") {
                return Err(format!(
                    "{entry} is neither a GPU index (0, 1, …) nor a GPU UUID (GPU-…); use all, or a list of those"
                ));
            }
            if !gpus.iter().any(|g| g == entry) {
                gpus.push(entry.to_string());
            }
        }
        Ok(Some(DraSelection::Gpus(gpus)))
    }

    /// Whether `info` (a GPU, or a MIG device of one) is served through DRA.
    pub fn serves(&self, info: &DeviceInfo) -> bool {
        match self {
            DraSelection::All => true,
            DraSelection::Gpus(gpus) => gpus.iter().any(|g| names(info, g)),
        }
    }

    /// Checks the selection against the node's devices: an entry that names none of them, nor a GPU present
    /// but serving nothing (`unserved`: in MIG mode without MIG devices, say), is refused.
    pub fn check(&self, inventory: &Inventory, unserved: &[Unserved]) -> Result<(), String> {
        let DraSelection::Gpus(gpus) = self else {
            return Ok(());
        };
        let present_unserved = |gpu: &str| {
            unserved.iter().any(|u| {
                u.id.as_deref() == Some(gpu) || u.index.is_some_and(|i| i.to_string() == gpu)
            })
        };
        for gpu in gpus {
            if !inventory.devices().iter().any(|d| names(&d.info, gpu)) && !present_unserved(gpu) {
                // Each GPU once, a GPU in MIG mode by its MIG devices' parent.
                let mut present: Vec<String> = Vec::new();
                for d in inventory.devices() {
                    let uuid = d.info.mig.as_ref().map_or(&d.info.id, |m| &m.parent);
                    let gpu = match d.info.gpu_index() {
                        Some(index) => format!("{index} ({uuid})"),
                        None => uuid.clone(),
                    };
                    if !present.contains(&gpu) {
                        present.push(gpu);
                    }
                }
                return Err(format!(
                    "--dra names GPU {gpu}, which this node does not have (its GPUs: {})",
                    if present.is_empty() {
                        "none".into()
                    } else {
                        present.join(", ")
                    }
                ));
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for DraSelection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DraSelection::All => f.write_str("all GPUs"),
            DraSelection::Gpus(gpus) if gpus.len() == 1 => write!(f, "GPU {}", gpus[0]),
            DraSelection::Gpus(gpus) => write!(f, "GPUs {}", gpus.join(", ")),
        }
    }
}

/// `dra` as its setting spells it.
pub fn setting(selection: Option<&DraSelection>) -> String {
    match selection {
        None => "off".into(),
        Some(DraSelection::All) => "all".into(),
        Some(DraSelection::Gpus(gpus)) => gpus.join(","),
    }
}

/// Whether `entry` names the GPU `info` is or is part of.
fn names(info: &DeviceInfo, entry: &str) -> bool {
    let gpu_uuid = info
        .mig
        .as_ref()
        .map_or(info.id.as_str(), |m| m.parent.as_str());
    gpu_uuid == entry || info.gpu_index().is_some_and(|i| i.to_string() == entry)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::mig::MigInfo;

    fn gpu(index: usize) -> DeviceInfo {
        DeviceInfo {
            id: format!("GPU-{index}"),
            index: Some(index.to_string()),
            ..DeviceInfo::default()
        }
    }

    fn mig(parent: usize, n: usize) -> DeviceInfo {
        DeviceInfo {
            id: format!("MIG-{parent}-{n}"),
            index: Some(format!("{parent}:{n}")),
            mig: Some(MigInfo {
                parent: format!("GPU-{parent}"),
                profile: "1g.10gb".into(),
                gpu_instance: 1,
                compute_instance: 0,
            }),
            ..DeviceInfo::default()
        }
    }

    #[test]
    fn off_all_and_lists_parse_and_a_mig_device_or_a_typo_is_refused_with_the_reason() {
        assert_eq!(DraSelection::parse(""), Ok(None));
        assert_eq!(DraSelection::parse("off"), Ok(None));
        assert_eq!(DraSelection::parse("all"), Ok(Some(DraSelection::All)));
        assert_eq!(
            DraSelection::parse("1, GPU-abc,1"),
            Ok(Some(DraSelection::Gpus(vec!["1".into(), "GPU-abc".into()])))
        );
        let mig = DraSelection::parse("0:1").expect_err("MIG");
        assert!(
            mig.contains("MIG device") && mig.contains("one road"),
            "{mig}"
        );
        assert!(DraSelection::parse("MIG-abc").is_err());
        assert!(
            DraSelection::parse("gpu0")
                .expect_err("typo")
                .contains("neither")
        );
        assert!(DraSelection::parse("0,,1").is_err());
    }

    #[test]
    fn a_gpu_takes_its_mig_devices_to_its_road() {
        let selection = DraSelection::Gpus(vec!["1".into()]);
        assert!(selection.serves(&gpu(1)));
        assert!(selection.serves(&mig(1, 0)));
        assert!(!selection.serves(&gpu(0)));
        assert!(!selection.serves(&mig(0, 0)));
        let by_uuid = DraSelection::Gpus(vec!["GPU-0".into()]);
        assert!(by_uuid.serves(&mig(0, 3)) && !by_uuid.serves(&gpu(1)));
    }

    #[test]
    fn a_gpu_the_node_does_not_have_is_refused_naming_the_ones_it_has() {
        let inventory = Inventory::new([gpu(0), gpu(1)]);
        assert_eq!(
            DraSelection::Gpus(vec!["1".into()]).check(&inventory, &[]),
            Ok(())
        );
        let why = DraSelection::Gpus(vec!["7".into()])
            .check(&inventory, &[])
            .expect_err("no GPU 7");
        assert!(
            why.contains("GPU 7") && why.contains("0 (GPU-0), 1 (GPU-1)"),
            "{why}"
        );
        // A GPU in MIG mode is named once, by its MIG devices' parent.
        let with_mig = Inventory::new([gpu(0), mig(1, 0), mig(1, 1)]);
        let why = DraSelection::Gpus(vec!["7".into()])
            .check(&with_mig, &[])
            .expect_err("no GPU 7");
        assert!(why.ends_with("(its GPUs: 0 (GPU-0), 1 (GPU-1))"), "{why}");
        // Present but serving nothing (MIG mode without MIG devices): on the node, so not a typo.
        let unserved = [Unserved {
            index: Some(7),
            id: Some("GPU-7".into()),
            why: "MIG mode is on and no MIG device of it can be served".into(),
        }];
        for entry in ["7", "GPU-7"] {
            assert_eq!(
                DraSelection::Gpus(vec![entry.into()]).check(&inventory, &unserved),
                Ok(())
            );
        }
    }
}
