//! A change of `dra` checked against what is in use: a GPU moves between the device plugin and DRA only
//! while nothing holds it on the road it leaves. A GPU still prepared for a claim, or still allocated to a
//! pod's container, would otherwise be handed out a second time by the road it joins (one road per GPU,
//! never both; see [`crate::devices::selection`]).

use std::collections::BTreeMap;

use crate::devices::selection::{DraSelection, setting};
use crate::devices::{DeviceInfo, Inventory, Unserved};
use crate::kubelet::pods::Holders;

/// What holds the node's devices now, on each road.
#[derive(Debug, Clone, Copy)]
pub struct InUse<'a> {
    /// Each prepared DRA device's claim (`namespace/name`), by the device's DRA name.
    pub claims: &'a BTreeMap<String, String>,
    /// The containers holding each device-plugin device, by device ID, as the kubelet's pod-resources API
    /// says; or why the kubelet cannot say.
    pub pods: Result<&'a Holders, &'a str>,
}

/// Whether the road of every device may change from `old` to `new` now: `Err` says which GPU would be on
/// both roads, what holds it, and what to drain. A selection that names a GPU the node does not have is
/// refused too, as it would stop the restarted plugin.
pub fn check_switch(
    inventory: &Inventory,
    unserved: &[Unserved],
    old: Option<&DraSelection>,
    new: Option<&DraSelection>,
    in_use: InUse<'_>,
) -> Result<(), String> {
    if let Some(new) = new {
        new.check(inventory, unserved)?;
    }
    let through_dra = |selection: Option<&DraSelection>, info: &DeviceInfo| {
        selection.is_some_and(|s| s.serves(info))
    };
    let mut held = Vec::new();
    for device in inventory.devices() {
        let info = &device.info;
        match (through_dra(old, info), through_dra(new, info)) {
            (true, false) => {
                let name = crate::dra::names::device_name(info);
                if let Some(claim) = in_use.claims.get(&name) {
                    held.push(format!(
                        "{} is prepared for claim {claim} through DRA (delete the pods that use the claim, or \
                         wait for them to end)",
                        gpu(info)
                    ));
                }
            }
            (false, true) => match in_use.pods {
                Ok(holders) => {
                    if let Some(pods) = holders.get(&info.id).filter(|p| !p.is_empty()) {
                        let pods: Vec<String> = pods.iter().map(ToString::to_string).collect();
                        held.push(format!(
                            "{} is allocated through the device plugin to {} (delete those pods, or wait for \
                             them to end)",
                            gpu(info),
                            pods.join(", ")
                        ));
                    }
                }
                Err(why) => held.push(format!(
                    "{} would move to DRA, and which pods hold it cannot be told: {why}",
                    gpu(info)
                )),
            },
            _ => {}
        }
    }
    if held.is_empty() {
        return Ok(());
    }
    Err(format!(
        "the change of dra from {} to {} would hand out a GPU held on the road it leaves: {}; then send \
         SIGHUP again",
        setting(old),
        setting(new),
        held.join("; ")
    ))
}

/// A device as an operator finds it: NVML's index and its ID.
fn gpu(info: &DeviceInfo) -> String {
    match info.gpu_index() {
        Some(index) if info.mig.is_some() => format!("MIG device {} of GPU {index}", info.id),
        Some(index) => format!("GPU {index} ({})", info.id),
        None => info.id.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet::pods::Holder;

    fn node(gpus: usize) -> Inventory {
        Inventory::new((0..gpus).map(|i| DeviceInfo {
            id: format!("GPU-{i}"),
            numa_node: None,
            device_nodes: vec![format!("/dev/nvidia{i}").into()],
            index: Some(i.to_string()),
            mig: None,
            facts: None,
        }))
    }

    fn parsed(value: &str) -> Option<DraSelection> {
        DraSelection::parse(value).unwrap()
    }

    fn holder(pod: &str) -> Holder {
        Holder {
            namespace: "default".into(),
            pod: pod.into(),
            container: "main".into(),
        }
    }

    #[test]
    fn a_gpu_prepared_for_a_claim_cannot_move_to_the_device_plugin() {
        let inventory = node(2);
        let claims = BTreeMap::from([("gpu-0".to_string(), "default/a".to_string())]);
        let pods = Holders::new();
        let in_use = InUse {
            claims: &claims,
            pods: Ok(&pods),
        };
        let refused = check_switch(&inventory, &[], parsed("all").as_ref(), None, in_use)
            .expect_err("gpu-0 is prepared for a claim");
        assert!(refused.contains("GPU 0 (GPU-0)"), "{refused}");
        assert!(refused.contains("claim default/a"), "{refused}");
        assert!(refused.contains("from all to off"), "{refused}");
        assert!(!refused.contains("GPU 1"), "{refused}");
        // Moving only the GPU nobody holds is fine.
        check_switch(
            &inventory,
            &[],
            parsed("all").as_ref(),
            parsed("0").as_ref(),
            in_use,
        )
        .unwrap();
    }

    #[test]
    fn a_gpu_allocated_to_a_pod_cannot_move_to_dra() {
        let inventory = node(2);
        let claims = BTreeMap::new();
        let pods = Holders::from([("GPU-1".to_string(), vec![holder("trainer")])]);
        let in_use = InUse {
            claims: &claims,
            pods: Ok(&pods),
        };
        let refused = check_switch(&inventory, &[], None, parsed("1").as_ref(), in_use)
            .expect_err("GPU 1 is allocated to a pod");
        assert!(refused.contains("GPU 1 (GPU-1)"), "{refused}");
        assert!(refused.contains("default/trainer (main)"), "{refused}");
        check_switch(&inventory, &[], None, parsed("0").as_ref(), in_use).unwrap();
    }

    #[test]
    fn without_the_kubelets_answer_no_gpu_moves_to_dra() {
        let inventory = node(1);
        let claims = BTreeMap::new();
        let in_use = InUse {
            claims: &claims,
            pods: Err("the pod-resources API is off"),
        };
        let refused = check_switch(&inventory, &[], None, parsed("all").as_ref(), in_use)
            .expect_err("nobody can say the GPU is free");
        assert!(refused.contains("pod-resources API is off"), "{refused}");
        // Nothing moves: nothing to ask.
        check_switch(
            &inventory,
            &[],
            parsed("all").as_ref(),
            parsed("all").as_ref(),
            in_use,
        )
        .unwrap();
    }

    #[test]
    fn a_selection_naming_a_gpu_the_node_lacks_is_refused_before_the_restart() {
        let claims = BTreeMap::new();
        let pods = Holders::new();
        let in_use = InUse {
            claims: &claims,
            pods: Ok(&pods),
        };
        let refused = check_switch(&node(2), &[], None, parsed("7").as_ref(), in_use)
            .expect_err("there is no GPU 7");
        assert!(refused.contains('7'), "{refused}");
    }

    #[test]
    fn the_setting_reads_back_as_it_was_given() {
        for value in ["off", "all", "0,GPU-1"] {
            assert_eq!(setting(parsed(value).as_ref()), value);
        }
    }
}
