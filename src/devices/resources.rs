//! Which resources the process registers and which devices each one lists: whole GPUs under the GPU
//! resource, MIG devices as the MIG strategy says, and, with sharing, each shared device as replicas under its
//! resource or the name it is shared under. Decided once at start from the devices found (as the devices
//! themselves are); a device that appears later is served under its resource unshared.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use crate::devices::mig::ResourceNaming;
use crate::devices::naming::{IdStrategy, Naming};
use crate::devices::sharing::{
    DeviceSelection, MAX_LISTED_REPLICAS, ShareKind, SharedResource, Sharing,
};
use crate::devices::{DeviceInfo, DeviceState, Inventory};

/// One resource the process registers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// Its extended resource name.
    pub name: String,
    /// How its devices are named to the kubelet.
    pub naming: Naming,
    /// Some of its devices are shared through MPS (its containers holding replicas get the daemon's
    /// directories).
    pub mps: bool,
}

/// Every resource of the process, and which one serves each device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourcePlan {
    resources: Vec<Served>,
    /// Inventory ID → position in `resources`.
    of_device: HashMap<String, usize>,
    natural: ResourceNaming,
}

/// A sharing entry that cannot be applied to the devices found.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    /// More devices listed under one resource than the kubelet could ever take in one message: refused
    /// before the list is built, so that a huge replica count cannot exhaust memory first.
    #[error(
        "sharing {resource}: {devices} devices to list (replicas included), more than the {most} that could \
         ever fit in the 4194304 bytes the kubelet accepts in one message; lower replicas"
    )]
    TooManyListed {
        /// The resource listed.
        resource: String,
        /// Devices it would list.
        devices: usize,
        /// The most any list could hold.
        most: usize,
    },
    /// A rename onto a name another resource of the node already has.
    #[error(
        "sharing {resource}: cannot serve its replicas as {rename}: another resource on this node has that name"
    )]
    RenameTaken {
        /// The shared resource.
        resource: String,
        /// The name asked for.
        rename: String,
    },
    /// MPS asked to share MIG devices.
    #[error(
        "sharing {resource} through MPS: MPS cannot share MIG devices (use time-slicing, or migStrategy none)"
    )]
    MpsOnMig {
        /// The shared resource.
        resource: String,
    },
}

impl ResourcePlan {
    /// The plan for the devices of `inventory`: each served under its resource (`natural`), shared devices
    /// as `replicas` each under the name they are shared under. Also returns a warning for each sharing entry
    /// no device of the node matches (nothing is shared for it, as NVIDIA's plugin does).
    pub fn build(
        natural: &ResourceNaming,
        ids: IdStrategy,
        sharing: Option<&Sharing>,
        inventory: &Inventory,
    ) -> Result<(ResourcePlan, Vec<String>), PlanError> {
        let devices = inventory.devices();
        let mut shares = Shares::unshared(natural, devices);
        // The entry that shares all of the GPU resource: a node without devices registers it as that says.
        let mut empty_target = None;
        if let Some(sharing) = sharing {
            for entry in &sharing.resources {
                let target = entry.rename.clone().unwrap_or_else(|| entry.name.clone());
                if entry.name == natural.base && entry.devices == DeviceSelection::All {
                    empty_target = Some((target.clone(), entry.replicas));
                }
                shares.apply(sharing, entry, target)?;
            }
        }
        shares.check_listed()?;
        let fail_requests = sharing.is_some_and(|s| s.fail_requests_greater_than_one);
        let mps = sharing.is_some_and(|s| s.kind == ShareKind::Mps);
        let (mut resources, of_device) = shares.group(ids, fail_requests, mps);
        name_replicated(&mut resources, &of_device, inventory, &shares.assigned);
        if resources.is_empty() {
            resources.push(unlisted_gpu_resource(
                natural,
                empty_target,
                ids,
                fail_requests,
                mps,
            ));
        }
        let plan = ResourcePlan {
            resources,
            of_device,
            natural: natural.clone(),
        };
        Ok((plan, shares.warnings))
    }

    /// The resources, whole GPUs' first.
    pub fn resources(&self) -> &[Served] {
        &self.resources
    }

    /// Whether `device` is served under the resource at `position` of [`ResourcePlan::resources`]. Runs for
    /// every device on every health change: no allocation.
    pub fn serves(&self, position: usize, device: &DeviceInfo) -> bool {
        match self.of_device.get(&device.id) {
            Some(k) => *k == position,
            None => self
                .resources
                .get(position)
                .is_some_and(|r| self.natural.serves(&r.name, device)),
        }
    }

    /// The resource the device with inventory ID `id` (and MIG profile `profile`) is served under.
    pub fn resource_of(&self, id: &str, profile: Option<&str>) -> Cow<'_, str> {
        match self.of_device.get(id).and_then(|k| self.resources.get(*k)) {
            Some(served) => Cow::Borrowed(&served.name),
            None => Cow::Owned(self.natural.of(profile)),
        }
    }
}

/// Per device of the inventory (by position), the resource it is served under and how many replicas it
/// lists, as the sharing entries are applied one after the other, with the warnings they raise.
struct Shares<'a> {
    devices: &'a [DeviceState],
    /// The resource each device is served under unshared: what sharing entries name.
    own: Vec<String>,
    assigned: Vec<(String, usize)>,
    warnings: Vec<String>,
}

impl<'a> Shares<'a> {
    /// Every device under its own resource, once.
    fn unshared(natural: &ResourceNaming, devices: &'a [DeviceState]) -> Self {
        let own: Vec<String> = devices.iter().map(|d| natural.of_device(&d.info)).collect();
        let assigned = own.iter().map(|name| (name.clone(), 1)).collect();
        Shares {
            devices,
            own,
            assigned,
            warnings: Vec::new(),
        }
    }

    /// Applies one sharing entry: the devices it selects of its resource list `entry.replicas` replicas each
    /// under `target`. An entry whose resource has no device here is a warning; a rename onto a name
    /// another resource has, and MPS on MIG devices, are refused.
    fn apply(
        &mut self,
        sharing: &Sharing,
        entry: &SharedResource,
        target: String,
    ) -> Result<(), PlanError> {
        let members: Vec<usize> = (0..self.devices.len())
            .filter(|&p| self.own[p] == entry.name)
            .collect();
        if members.is_empty() {
            self.warnings.push(format!(
                "sharing {}: no device on this node is served under it; nothing of it is shared",
                entry.name
            ));
            return Ok(());
        }
        if target != entry.name {
            let taken = self.own.contains(&target)
                || sharing.resources.iter().any(|other| {
                    other.name != entry.name
                        && other.rename.as_deref().unwrap_or(&other.name) == target
                });
            if taken {
                return Err(PlanError::RenameTaken {
                    resource: entry.name.clone(),
                    rename: target,
                });
            }
        }
        let chosen = match &entry.devices {
            DeviceSelection::All => members,
            DeviceSelection::Count(count) => self.first(entry, *count, members),
            DeviceSelection::List(references) => match self.listed(entry, references, &members) {
                Some(chosen) => chosen,
                None => return Ok(()),
            },
        };
        if sharing.kind == ShareKind::Mps
            && chosen.iter().any(|&p| self.devices[p].info.mig.is_some())
        {
            return Err(PlanError::MpsOnMig {
                resource: entry.name.clone(),
            });
        }
        for p in chosen {
            self.assigned[p] = (target.clone(), entry.replicas);
        }
        Ok(())
    }

    /// The first `count` of `members`. A count meant for a larger node (one ConfigMap serves many kinds of
    /// nodes, and NVIDIA's plugin ignores `devices`): every device here is shared, said once.
    fn first(&mut self, entry: &SharedResource, count: usize, members: Vec<usize>) -> Vec<usize> {
        if count > members.len() {
            self.warnings.push(format!(
                "sharing {}: {count} devices to share, but this node has {}; sharing all {}",
                entry.name,
                members.len(),
                members.len()
            ));
        }
        members[..count.min(members.len())].to_vec()
    }

    /// The `members` that `references` name by index or UUID, each once, in the order named; `None` when
    /// none does. One ConfigMap serves many kinds of nodes (and NVIDIA's plugin ignores `devices`
    /// altogether): references to devices of other nodes are one warning, and what matches here is shared.
    fn listed(
        &mut self,
        entry: &SharedResource,
        references: &[String],
        members: &[usize],
    ) -> Option<Vec<usize>> {
        let mut chosen = Vec::with_capacity(references.len());
        let mut unmatched = Vec::new();
        for reference in references {
            let found = members.iter().copied().find(|&p| {
                let info = &self.devices[p].info;
                info.id == *reference || info.index.as_deref() == Some(reference.as_str())
            });
            match found {
                Some(p) if !chosen.contains(&p) => chosen.push(p),
                Some(_) => {}
                None => unmatched.push(reference.as_str()),
            }
        }
        if !unmatched.is_empty() {
            let what = if chosen.is_empty() {
                "nothing of it is shared on this node".to_string()
            } else {
                format!("sharing the {} that match", chosen.len())
            };
            self.warnings.push(format!(
                "sharing {}: devices {} match no device of that resource on this node (GPU or MIG indices as \
                 NVML numbers them, or UUIDs); {what}",
                entry.name,
                unmatched.join(", "),
            ));
        }
        if chosen.is_empty() {
            return None;
        }
        Some(chosen)
    }

    /// Refuses a resource that would list more devices, replicas included, than any message the kubelet
    /// accepts could hold: before any list is built, so that a huge replica count cannot exhaust memory
    /// first.
    fn check_listed(&self) -> Result<(), PlanError> {
        let mut listed: HashMap<&str, usize> = HashMap::new();
        for (name, replicas) in &self.assigned {
            let total = listed.entry(name.as_str()).or_default();
            *total = total.saturating_add(*replicas);
            if *total > MAX_LISTED_REPLICAS {
                return Err(PlanError::TooManyListed {
                    resource: name.clone(),
                    devices: self
                        .assigned
                        .iter()
                        .filter(|(n, _)| n == name)
                        .fold(0usize, |sum, (_, r)| sum.saturating_add(*r)),
                    most: MAX_LISTED_REPLICAS,
                });
            }
        }
        Ok(())
    }

    /// The resources, whole GPUs' first, each in the order its first device is found, and which one serves
    /// each device (by inventory ID). A resource with replicated devices lists `replicas` of them, with the
    /// sharing's request rule and MPS.
    fn group(
        &self,
        ids: IdStrategy,
        fail_requests: bool,
        mps: bool,
    ) -> (Vec<Served>, HashMap<String, usize>) {
        let devices = self.devices;
        let mut resources: Vec<Served> = Vec::new();
        let mut of_device = HashMap::with_capacity(devices.len());
        let mut order: Vec<usize> = (0..devices.len()).collect();
        order.sort_by_key(|&p| devices[p].info.mig.is_some());
        for p in order {
            let (name, replicas) = &self.assigned[p];
            let k = match resources.iter().position(|r| r.name == *name) {
                Some(k) => k,
                None => {
                    resources.push(Served {
                        name: name.clone(),
                        naming: Naming {
                            ids,
                            ..Naming::default()
                        },
                        mps: false,
                    });
                    resources.len() - 1
                }
            };
            if *replicas > 1 {
                let naming = &mut resources[k].naming;
                naming.replicas = *replicas;
                naming.fail_requests_greater_than_one = fail_requests;
                resources[k].mps = mps;
            }
            of_device.insert(devices[p].info.id.clone(), k);
        }
        (resources, of_device)
    }
}

/// What a node without devices (yet) registers: the GPU resource, with an empty list, under the name and
/// with the replicas of the entry that shares all of it (`shared_as`), if there is one.
fn unlisted_gpu_resource(
    natural: &ResourceNaming,
    shared_as: Option<(String, usize)>,
    ids: IdStrategy,
    fail_requests: bool,
    mps: bool,
) -> Served {
    let (name, replicas) = shared_as.unwrap_or_else(|| (natural.base.clone(), 1));
    Served {
        name,
        naming: Naming {
            ids,
            replicas,
            fail_requests_greater_than_one: fail_requests && replicas > 1,
            ..Naming::default()
        },
        mps: mps && replicas > 1,
    }
}

/// A resource where only some devices are shared names those, so that the rest are listed whole.
fn name_replicated(
    resources: &mut [Served],
    of_device: &HashMap<String, usize>,
    inventory: &Inventory,
    assigned: &[(String, usize)],
) {
    for (k, served) in resources.iter_mut().enumerate() {
        if served.naming.replicas <= 1 {
            continue;
        }
        let members = || {
            of_device
                .iter()
                .filter(move |(_, r)| **r == k)
                .map(|(id, _)| id)
        };
        let replicated: BTreeSet<String> = members()
            .filter(|id| inventory.position(id).is_some_and(|p| assigned[p].1 > 1))
            .cloned()
            .collect();
        if replicated.len() < members().count() {
            served.naming.replicated = Some(Arc::new(replicated));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::mig::{MigInfo, MigStrategy};
    use crate::devices::sharing::SharedResource;

    fn gpu(i: usize) -> DeviceInfo {
        DeviceInfo {
            id: format!("GPU-{i}"),
            index: Some(i.to_string()),
            ..DeviceInfo::default()
        }
    }

    fn mig(gpu: usize, n: usize, profile: &str) -> DeviceInfo {
        DeviceInfo {
            id: format!("MIG-{gpu}-{n}"),
            index: Some(format!("{gpu}:{n}")),
            mig: Some(MigInfo {
                parent: format!("GPU-{gpu}"),
                profile: profile.into(),
                gpu_instance: 0,
                compute_instance: 0,
            }),
            ..DeviceInfo::default()
        }
    }

    fn mixed() -> ResourceNaming {
        ResourceNaming {
            strategy: MigStrategy::Mixed,
            base: "nvidia.com/gpu".into(),
        }
    }

    fn share(kind: ShareKind, resources: Vec<SharedResource>) -> Sharing {
        Sharing {
            kind,
            fail_requests_greater_than_one: true,
            resources,
        }
    }

    fn entry(
        name: &str,
        rename: Option<&str>,
        replicas: usize,
        devices: DeviceSelection,
    ) -> SharedResource {
        SharedResource {
            name: name.into(),
            rename: rename.map(String::from),
            replicas,
            devices,
        }
    }

    fn listed(plan: &ResourcePlan, inventory: &Inventory) -> Vec<(String, Vec<String>)> {
        plan.resources()
            .iter()
            .enumerate()
            .map(|(k, served)| {
                let mine = inventory.subset(|info| plan.serves(k, info), None);
                let ids = served.naming.listed(&mine).map(|(id, _)| id).collect();
                (served.name.clone(), ids)
            })
            .collect()
    }

    #[test]
    fn several_resources_are_shared_each_with_its_own_replicas_and_name() -> Result<(), PlanError> {
        let inventory = Inventory::new([
            gpu(0),
            mig(1, 0, "1g.10gb"),
            mig(1, 1, "1g.10gb"),
            mig(1, 2, "2g.20gb"),
        ]);
        let sharing = share(
            ShareKind::TimeSlicing,
            vec![
                entry("nvidia.com/gpu", None, 2, DeviceSelection::All),
                entry(
                    "nvidia.com/mig-1g.10gb",
                    Some("nvidia.com/mig-1g.10gb.shared"),
                    3,
                    DeviceSelection::All,
                ),
            ],
        );
        let (plan, warnings) =
            ResourcePlan::build(&mixed(), IdStrategy::Uuid, Some(&sharing), &inventory)?;
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(
            listed(&plan, &inventory),
            [
                (
                    "nvidia.com/gpu".to_string(),
                    vec!["GPU-0::0".to_string(), "GPU-0::1".into()]
                ),
                (
                    "nvidia.com/mig-1g.10gb.shared".into(),
                    [
                        "MIG-1-0::0",
                        "MIG-1-0::1",
                        "MIG-1-0::2",
                        "MIG-1-1::0",
                        "MIG-1-1::1",
                        "MIG-1-1::2"
                    ]
                    .map(String::from)
                    .to_vec()
                ),
                ("nvidia.com/mig-2g.20gb".into(), vec!["MIG-1-2".into()]),
            ]
        );
        assert!(plan.resources()[0].naming.fail_requests_greater_than_one);
        assert!(!plan.resources()[2].naming.fail_requests_greater_than_one);
        assert_eq!(
            plan.resource_of("MIG-1-1", Some("1g.10gb")),
            "nvidia.com/mig-1g.10gb.shared"
        );
        Ok(())
    }

    #[test]
    fn a_subset_is_shared_by_count_index_or_uuid_and_the_rest_stays_whole() -> Result<(), PlanError>
    {
        let inventory = Inventory::new((0..4).map(gpu));
        let none = ResourceNaming {
            strategy: MigStrategy::None,
            base: "nvidia.com/gpu".into(),
        };
        let cases = [
            (
                DeviceSelection::Count(2),
                [
                    "GPU-0::0", "GPU-0::1", "GPU-1::0", "GPU-1::1", "GPU-2", "GPU-3",
                ],
            ),
            (
                DeviceSelection::List(vec!["3".into(), "GPU-1".into()]),
                [
                    "GPU-0", "GPU-1::0", "GPU-1::1", "GPU-2", "GPU-3::0", "GPU-3::1",
                ],
            ),
        ];
        for (devices, expected) in cases {
            let sharing = share(
                ShareKind::TimeSlicing,
                vec![entry("nvidia.com/gpu", None, 2, devices)],
            );
            let (plan, _) =
                ResourcePlan::build(&none, IdStrategy::Uuid, Some(&sharing), &inventory)?;
            let got = listed(&plan, &inventory);
            assert_eq!(got.len(), 1);
            assert_eq!(got[0].1, expected);
        }
        // Renamed: the shared ones move to their own resource, the rest keep the GPU resource.
        let sharing = share(
            ShareKind::Mps,
            vec![entry(
                "nvidia.com/gpu",
                Some("nvidia.com/gpu.shared"),
                2,
                DeviceSelection::Count(1),
            )],
        );
        let (plan, _) = ResourcePlan::build(&none, IdStrategy::Index, Some(&sharing), &inventory)?;
        assert_eq!(
            listed(&plan, &inventory),
            [
                (
                    "nvidia.com/gpu.shared".to_string(),
                    vec!["0::0".to_string(), "0::1".into()]
                ),
                (
                    "nvidia.com/gpu".into(),
                    vec!["1".into(), "2".into(), "3".into()]
                ),
            ]
        );
        assert!(plan.resources()[0].mps && !plan.resources()[1].mps);
        Ok(())
    }

    #[test]
    fn entries_that_cannot_apply_are_refused_by_name_and_unmatched_ones_warned() {
        let inventory = Inventory::new([gpu(0), mig(1, 0, "1g.10gb")]);
        let refused = [(
            entry(
                "nvidia.com/gpu",
                Some("nvidia.com/mig-1g.10gb"),
                2,
                DeviceSelection::All,
            ),
            "cannot serve its replicas as nvidia.com/mig-1g.10gb",
        )];
        for (e, why) in refused {
            let sharing = share(ShareKind::TimeSlicing, vec![e]);
            let err = ResourcePlan::build(&mixed(), IdStrategy::Uuid, Some(&sharing), &inventory)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(err.contains(why), "{err:?} does not say {why:?}");
        }
        let single = ResourceNaming {
            strategy: MigStrategy::Single,
            base: "nvidia.com/gpu".into(),
        };
        let mps = share(
            ShareKind::Mps,
            vec![entry("nvidia.com/gpu", None, 2, DeviceSelection::All)],
        );
        let migs = Inventory::new([mig(0, 0, "1g.10gb")]);
        assert!(matches!(
            ResourcePlan::build(&single, IdStrategy::Uuid, Some(&mps), &migs),
            Err(PlanError::MpsOnMig { .. })
        ));
        let absent = share(
            ShareKind::TimeSlicing,
            vec![entry(
                "nvidia.com/mig-3g.40gb",
                None,
                2,
                DeviceSelection::All,
            )],
        );
        let built = ResourcePlan::build(&mixed(), IdStrategy::Uuid, Some(&absent), &inventory);
        let warned = built.map(|(_, w)| w.join("\n")).unwrap_or_default();
        assert!(warned.contains("nvidia.com/mig-3g.40gb"), "{warned:?}");
    }

    #[test]
    fn devices_of_other_nodes_are_warned_once_and_what_matches_is_shared() -> Result<(), PlanError>
    {
        let none = ResourceNaming {
            strategy: MigStrategy::None,
            base: "nvidia.com/gpu".into(),
        };
        let inventory = Inventory::new([gpu(0), gpu(1)]);
        let sharing = share(
            ShareKind::TimeSlicing,
            vec![entry(
                "nvidia.com/gpu",
                None,
                2,
                DeviceSelection::List(vec!["1".into(), "5".into(), "GPU-other".into()]),
            )],
        );
        let (plan, warnings) =
            ResourcePlan::build(&none, IdStrategy::Index, Some(&sharing), &inventory)?;
        assert_eq!(
            listed(&plan, &inventory),
            [(
                "nvidia.com/gpu".to_string(),
                vec!["0".to_string(), "1::0".into(), "1::1".into()]
            )]
        );
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("devices 5, GPU-other match no device")
                && warnings[0].contains("sharing the 1 that match"),
            "{warnings:?}"
        );
        // Nothing matches: nothing shared, still one warning, and the GPUs served whole.
        let sharing = share(
            ShareKind::TimeSlicing,
            vec![entry(
                "nvidia.com/gpu",
                None,
                2,
                DeviceSelection::List(vec!["7".into()]),
            )],
        );
        let (plan, warnings) =
            ResourcePlan::build(&none, IdStrategy::Index, Some(&sharing), &inventory)?;
        assert_eq!(
            listed(&plan, &inventory),
            [(
                "nvidia.com/gpu".to_string(),
                vec!["0".to_string(), "1".into()]
            )]
        );
        assert!(
            warnings.len() == 1 && warnings[0].contains("nothing of it is shared"),
            "{warnings:?}"
        );
        // A count meant for a larger node: every device here shared, said once.
        let sharing = share(
            ShareKind::TimeSlicing,
            vec![entry("nvidia.com/gpu", None, 2, DeviceSelection::Count(3))],
        );
        let (plan, warnings) =
            ResourcePlan::build(&none, IdStrategy::Index, Some(&sharing), &inventory)?;
        assert_eq!(
            listed(&plan, &inventory),
            [(
                "nvidia.com/gpu".to_string(),
                vec![
                    "0::0".to_string(),
                    "0::1".into(),
                    "1::0".into(),
                    "1::1".into()
                ]
            )]
        );
        assert!(
            warnings.len() == 1
                && warnings[0].contains("3 devices to share, but this node has 2; sharing all 2"),
            "{warnings:?}"
        );
        Ok(())
    }

    #[test]
    fn more_replicas_than_any_kubelet_list_holds_are_refused_before_the_list_is_built() {
        let none = ResourceNaming {
            strategy: MigStrategy::None,
            base: "nvidia.com/gpu".into(),
        };
        let inventory = Inventory::new((0..8).map(gpu));
        let sharing = share(
            ShareKind::TimeSlicing,
            vec![entry(
                "nvidia.com/gpu",
                None,
                MAX_LISTED_REPLICAS,
                DeviceSelection::All,
            )],
        );
        let err = ResourcePlan::build(&none, IdStrategy::Uuid, Some(&sharing), &inventory)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("sharing nvidia.com/gpu:")
                && err.contains(&format!("{} devices to list", 8 * MAX_LISTED_REPLICAS))
                && err.contains("4194304 bytes the kubelet accepts"),
            "{err}"
        );
    }

    #[test]
    fn a_node_without_devices_registers_the_gpu_resource_under_its_shared_name()
    -> Result<(), PlanError> {
        let none = ResourceNaming {
            strategy: MigStrategy::None,
            base: "nvidia.com/gpu".into(),
        };
        let sharing = share(
            ShareKind::TimeSlicing,
            vec![entry(
                "nvidia.com/gpu",
                Some("nvidia.com/gpu.shared"),
                4,
                DeviceSelection::All,
            )],
        );
        let (plan, _) =
            ResourcePlan::build(&none, IdStrategy::Uuid, Some(&sharing), &Inventory::new([]))?;
        assert_eq!(plan.resources().len(), 1);
        assert_eq!(plan.resources()[0].name, "nvidia.com/gpu.shared");
        assert_eq!(plan.resources()[0].naming.replicas, 4);
        Ok(())
    }
}
