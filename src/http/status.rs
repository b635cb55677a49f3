//! What the node agent says about itself: each device with its health, conditions and message, the link with
//! the kubelet, and the policy in force. Served as JSON on `/status` and shown by `gpu-device-plugin status`;
//! the types are shared by both ends, and the table an operator reads is rendered here, pure.

use serde::{Deserialize, Serialize};

use crate::health::Effect;
use crate::health::policy::Recover;
use crate::monitor::{ConditionSnapshot, DeviceSnapshot};

/// The whole report.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// Every device, in the order the kubelet gets them.
    pub devices: Vec<DeviceStatus>,
    /// Where the plugin stands with the kubelet (its first resource, `nvidia.com/gpu` where it serves it).
    pub kubelet: KubeletStatus,
    /// The other resources this process serves (MIG profiles under `migStrategy: mixed`), one registration
    /// each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub other_resources: Vec<KubeletStatus>,
    /// The health policy in force.
    pub policy: PolicySummary,
    /// Devices present on the node but not served, each with why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unserved: Vec<crate::devices::Unserved>,
    /// The DRA side, when GPUs are served through DRA: the kubelet's word on its registration and the claims
    /// prepared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dra: Option<crate::dra::registration::DraStatus>,
}

/// How a device served through DRA is published, and the claim it is prepared for.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DraDevice {
    /// The driver it is published under.
    pub driver: String,
    /// Its name in the ResourceSlice.
    pub device: String,
    /// The claim (`namespace/name`) it is prepared for, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
}

/// One device.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceStatus {
    /// Device ID as the kubelet knows it (the GPU UUID).
    pub id: String,
    /// NVML's index of the GPU (for a MIG device, of its GPU), as `nvidia-smi` numbers it: with GPU 0 not
    /// served, GPU 1 is still 1. The position in the device list where the source has no index.
    pub index: usize,
    /// The extended resource the device is served under.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub resource: String,
    /// For a MIG device: its profile and GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigStatus>,
    /// `Healthy` or `Unhealthy`.
    pub health: String,
    /// NUMA node, where known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<i64>,
    /// The health message (KEP-4680 shape), when the device has conditions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Active conditions, in the order first seen.
    pub conditions: Vec<ConditionStatus>,
    /// The containers holding the device, from the kubelet's pod-resources API (empty when none, or when
    /// the kubelet cannot say).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<crate::kubelet::pods::Holder>,
    /// Set for a device served through DRA rather than the device plugin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dra: Option<DraDevice>,
    /// What the driver says about the device (product, memory, PCI address, versions, MIG placement): what a
    /// DRA ResourceSlice publishes of it, for an operator to check against `nvidia-smi`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub facts: Option<crate::devices::facts::DeviceFacts>,
}

/// What a MIG device is part of.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigStatus {
    /// The GPU's UUID.
    pub parent: String,
    /// The MIG profile, e.g. `1g.10gb`.
    pub profile: String,
}

/// One active condition of a device.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConditionStatus {
    /// Name in the DRA health schema (`xid`, `ecc-dbe`, ...).
    pub kind: String,
    /// Its value where it has one (the XID, the recovery action).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<u64>,
    /// `Unhealthy` or `None`, under the policy in force.
    pub effect: String,
    /// `auto` or `never`.
    pub recover: String,
    /// Extra words: who fenced the device and why, why it is unmonitored, the burst's size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Times observed.
    pub count: u64,
    /// First observation, RFC 3339.
    pub first_seen: String,
    /// Latest observation, RFC 3339.
    pub last_seen: String,
}

impl DeviceStatus {
    /// `device` as the report shows it, served under `resource` and held by `pods`.
    pub fn of(
        device: &DeviceSnapshot,
        resource: String,
        pods: Vec<crate::kubelet::pods::Holder>,
    ) -> Self {
        DeviceStatus {
            id: device.info.id.clone(),
            index: device.index,
            resource,
            mig: device.info.mig.as_ref().map(|m| MigStatus {
                parent: m.parent.clone(),
                profile: m.profile.clone(),
            }),
            health: device.health.as_api_str().into(),
            numa_node: device.info.numa_node,
            message: device.message.clone(),
            conditions: device.conditions.iter().map(ConditionStatus::of).collect(),
            pods,
            dra: None,
            facts: device.info.facts.as_deref().cloned(),
        }
    }
}

impl ConditionStatus {
    /// `condition` in the report's words.
    pub fn of(condition: &ConditionSnapshot) -> Self {
        let time = |t: std::time::SystemTime| humantime::format_rfc3339_seconds(t).to_string();
        let c = &condition.condition;
        ConditionStatus {
            kind: c.kind.name().into(),
            value: c.kind.value(),
            effect: match condition.effect {
                Effect::Unhealthy => "Unhealthy".into(),
                Effect::None => "None".into(),
            },
            recover: match condition.recover {
                Recover::Auto => "auto".into(),
                Recover::Never => "never".into(),
            },
            detail: c.detail.clone(),
            count: c.count,
            first_seen: time(c.first_seen),
            last_seen: time(c.last_seen),
        }
    }
}

pub use crate::kubelet::KubeletStatus;

/// The health policy in force, in the config file's terms.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicySummary {
    /// `catalog` or `nvidia`.
    pub xid_policy: String,
    /// `DP_DISABLE_HEALTHCHECKS` as given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_disable_healthchecks: Option<String>,
    /// `DP_ENABLE_HEALTHCHECKS` as given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_enable_healthchecks: Option<String>,
    /// Quiet period before recovery, e.g. `10m`.
    pub quiet_period: String,
    /// Retry interval of a failed recovery probe.
    pub probe_interval: String,
    /// How often the driver's recovery action is read.
    pub recovery_action_interval: String,
}

impl PolicySummary {
    /// `policy` as the report shows it: the health engine knows nothing of the report's shape.
    pub fn of(policy: &crate::health::Policy) -> PolicySummary {
        let duration = |d: std::time::Duration| humantime::format_duration(d).to_string();
        let (disable, enable) = policy.dp_given();
        PolicySummary {
            xid_policy: match policy.xid_policy {
                crate::health::policy::XidPolicy::Catalog => "catalog".into(),
                crate::health::policy::XidPolicy::Nvidia => "nvidia".into(),
            },
            dp_disable_healthchecks: disable.map(String::from),
            dp_enable_healthchecks: enable.map(String::from),
            quiet_period: duration(policy.quiet_period),
            probe_interval: duration(policy.probe_interval),
            recovery_action_interval: duration(policy.recovery_action_interval),
        }
    }
}

impl Report {
    /// The table an operator reads at a glance: one line per device (index, ID, health, what is wrong in
    /// short), the kubelet link, then each Unhealthy or noted device's full message.
    /// Every string in it came from the running plugin, and many from outside it (a fence's reason from a
    /// Node annotation, a detector's file): each is printed escaped, so that none can drive the terminal
    /// or forge a line.
    pub fn table(&self) -> String {
        let mut out = grid(&self.rows());
        out.push_str(&self.summary());
        out.push_str(&self.messages());
        out
    }

    /// One row per device, then one per device present but not served, each cell printable.
    fn rows(&self) -> Vec<[String; 5]> {
        let printable = |text: &str| crate::util::text::shown(text, crate::util::text::LINE_MAX);
        let rows: Vec<[String; 5]> = self
            .devices
            .iter()
            .map(|d| {
                let conditions: Vec<String> = d
                    .conditions
                    .iter()
                    .map(|c| match c.value {
                        Some(v) => format!("{}-{v}", c.kind),
                        None => c.kind.clone(),
                    })
                    .collect();
                let mut pods: Vec<String> = d
                    .pods
                    .iter()
                    .map(|h| format!("{}/{}", h.namespace, h.pod))
                    .collect();
                pods.dedup();
                if let Some(claim) = d.dra.as_ref().and_then(|dra| dra.claim.as_ref()) {
                    pods.push(format!("claim {claim}"));
                }
                [
                    d.index.to_string(),
                    d.id.clone(),
                    d.health.clone(),
                    if pods.is_empty() {
                        "-".into()
                    } else {
                        pods.join(",")
                    },
                    if conditions.is_empty() {
                        "-".into()
                    } else {
                        conditions.join(",")
                    },
                ]
                .map(|cell| printable(&cell))
            })
            .collect();
        let unserved_rows = self.unserved.iter().map(|u| {
            [
                u.index.map_or_else(|| "-".into(), |i| i.to_string()),
                u.id.clone().unwrap_or_else(|| "-".into()),
                NOT_SERVED.into(),
                "-".into(),
                "-".into(),
            ]
            .map(|cell| printable(&cell))
        });
        rows.into_iter().chain(unserved_rows).collect()
    }

    /// The line under the table: the counts, the kubelet's registrations and DRA's.
    fn summary(&self) -> String {
        let printable = |text: &str| crate::util::text::shown(text, crate::util::text::LINE_MAX);
        let k = &self.kubelet;
        let others: String = self
            .other_resources
            .iter()
            .map(|o| {
                format!(
                    "; {}: {}",
                    printable(&o.resource),
                    if o.registered {
                        "registered"
                    } else {
                        "NOT registered"
                    }
                )
            })
            .collect();
        let unhealthy = self
            .devices
            .iter()
            .filter(|d| d.health != "Healthy")
            .count();
        let not_served = if self.unserved.is_empty() {
            String::new()
        } else {
            format!(", {} not served", self.unserved.len())
        };
        // Every GPU through DRA: there is no device plugin registration to speak of.
        let kubelet = if k.resource.is_empty() && self.dra.is_some() {
            String::new()
        } else {
            format!(
                "; kubelet: {} ({} as {}, {} stream{} open, {} registration{}){}",
                if k.registered {
                    "registered"
                } else {
                    "NOT registered"
                },
                printable(&k.resource),
                printable(&k.endpoint),
                k.streams_open,
                if k.streams_open == 1 { "" } else { "s" },
                k.registrations,
                if k.registrations == 1 { "" } else { "s" },
                others,
            )
        };
        let dra = match &self.dra {
            None => String::new(),
            Some(dra) => format!(
                "; DRA: {} as {} ({} device{} prepared){}",
                if dra.registered {
                    "registered"
                } else {
                    "NOT registered"
                },
                printable(&dra.driver),
                dra.prepared.len(),
                if dra.prepared.len() == 1 { "" } else { "s" },
                dra.error
                    .as_ref()
                    .map(|e| format!(", the kubelet said: {}", printable(e)))
                    .unwrap_or_default(),
            ),
        };
        format!(
            "\n{} devices, {} Unhealthy{not_served}{kubelet}{dra}\n",
            self.devices.len(),
            unhealthy,
        )
    }

    /// Each Unhealthy or noted device's full message, and why each device not served is not.
    fn messages(&self) -> String {
        let printable = |text: &str| crate::util::text::shown(text, crate::util::text::LINE_MAX);
        let mut out = String::new();
        for d in &self.devices {
            if let Some(message) = &d.message {
                out.push_str(&format!(
                    "\n{} ({}):\n  {}\n",
                    printable(&d.id),
                    d.index,
                    printable(message)
                ));
            }
        }
        for u in &self.unserved {
            let what = match (&u.id, u.index) {
                (Some(id), Some(index)) => format!("{} ({index})", printable(id)),
                (Some(id), None) => printable(id),
                (None, Some(index)) => format!("GPU {index}"),
                (None, None) => "a GPU".into(),
            };
            out.push_str(&format!(
                "\n{what}: {NOT_SERVED}:\n  {}\n",
                printable(&u.why)
            ));
        }
        out
    }
}

/// `rows` under the header, in columns as wide as their widest cell.
fn grid(rows: &[[String; 5]]) -> String {
    let header = ["INDEX", "DEVICE", "HEALTH", "PODS", "CONDITIONS"];
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            rows.iter()
                .map(|r| r[i].chars().count())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: &[&str]| {
        let mut out = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<width$}  ", width = widths[i]));
            }
        }
        out.push('\n');
        out
    };
    let mut out = line(&header);
    for row in rows {
        let cells: Vec<&str> = row.iter().map(String::as_str).collect();
        out.push_str(&line(&cells));
    }
    out
}

/// What the table's HEALTH column says of a device present but not served.
const NOT_SERVED: &str = "not served";

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> Report {
        Report {
            devices: vec![
                DeviceStatus {
                    id: "GPU-a".into(),
                    index: 0,
                    health: "Healthy".into(),
                    facts: Some(crate::devices::facts::DeviceFacts {
                        minor: Some(0),
                        cuda_compute_capability: Some((9, 0)),
                        pci_bus_id: Some("0000:17:00.0".into()),
                        mig: Some(crate::devices::facts::MigPlacement {
                            gi_profile_id: 19,
                            placement_start: 3,
                            placement_size: 1,
                            capacities: Some(crate::devices::facts::MigCapacities {
                                multiprocessors: 16,
                                ..Default::default()
                            }),
                        }),
                        ..Default::default()
                    }),
                    ..DeviceStatus::default()
                },
                DeviceStatus {
                    id: "GPU-bb".into(),
                    index: 1,
                    health: "Unhealthy".into(),
                    message: Some("Unhealthy: XID 79: the GPU has fallen off the bus".into()),
                    conditions: vec![ConditionStatus {
                        kind: "xid".into(),
                        value: Some(79),
                        effect: "Unhealthy".into(),
                        recover: "auto".into(),
                        count: 1,
                        ..ConditionStatus::default()
                    }],
                    pods: ["trainer", "profiler"]
                        .map(|container| crate::kubelet::pods::Holder {
                            namespace: "ml".into(),
                            pod: "train-0".into(),
                            container: container.into(),
                        })
                        .to_vec(),
                    ..DeviceStatus::default()
                },
            ],
            kubelet: KubeletStatus {
                resource: "nvidia.com/gpu".into(),
                endpoint: "gpu-device-plugin-1.sock".into(),
                registered: true,
                streams_open: 1,
                registrations: 1,
                ..KubeletStatus::default()
            },
            other_resources: Vec::new(),
            policy: PolicySummary::default(),
            unserved: Vec::new(),
            dra: None,
        }
    }

    #[test]
    fn the_table_shows_a_dra_devices_claim_and_the_dra_registration_without_a_device_plugin_line() {
        let mut report = report();
        report.kubelet = KubeletStatus::default();
        report.devices[0].dra = Some(DraDevice {
            driver: "gpu.nvidia.com".into(),
            device: "gpu-0".into(),
            claim: Some("ml/train-gpu".into()),
        });
        report.dra = Some(crate::dra::registration::DraStatus {
            driver: "gpu.nvidia.com".into(),
            registered: true,
            prepared: [("gpu-0".to_string(), "ml/train-gpu".to_string())].into(),
            ..Default::default()
        });
        let table = report.table();
        assert!(table.contains("claim ml/train-gpu"), "{table}");
        assert!(
            table.contains("DRA: registered as gpu.nvidia.com (1 device prepared)"),
            "{table}"
        );
        assert!(
            !table.contains("kubelet:"),
            "no device plugin registration to report: {table}"
        );

        report.dra = Some(crate::dra::registration::DraStatus {
            driver: "gpu.nvidia.com".into(),
            error: Some("no supported version\nforged".into()),
            ..Default::default()
        });
        let table = report.table();
        assert!(table.contains("DRA: NOT registered"), "{table}");
        assert!(
            !table.contains("\nforged"),
            "the kubelet's words are printed escaped: {table}"
        );
    }

    #[test]
    fn the_table_names_every_other_resource_and_whether_it_is_registered() {
        let mut report = report();
        report.other_resources = vec![
            KubeletStatus {
                resource: "nvidia.com/mig-1g.10gb".into(),
                registered: true,
                ..KubeletStatus::default()
            },
            KubeletStatus {
                resource: "nvidia.com/mig-3g.40gb".into(),
                ..KubeletStatus::default()
            },
        ];
        let table = report.table();
        assert!(
            table.contains(
                "1 registration); nvidia.com/mig-1g.10gb: registered; nvidia.com/mig-3g.40gb: NOT registered\n"
            ),
            "{table}"
        );
    }

    #[test]
    fn the_table_lines_up_devices_and_ends_with_the_messages() {
        let table = report().table();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines[0], "INDEX  DEVICE  HEALTH     PODS        CONDITIONS");
        assert_eq!(lines[1], "0      GPU-a   Healthy    -           -");
        assert_eq!(lines[2], "1      GPU-bb  Unhealthy  ml/train-0  xid-79");
        assert!(
            table.contains(
                "2 devices, 1 Unhealthy; kubelet: registered (nvidia.com/gpu as \
                 gpu-device-plugin-1.sock, 1 stream open, 1 registration)"
            ),
            "{table}"
        );
        assert!(
            table.ends_with("GPU-bb (1):\n  Unhealthy: XID 79: the GPU has fallen off the bus\n"),
            "{table}"
        );
    }

    #[test]
    fn a_gpu_present_but_not_served_is_a_row_of_its_own_with_why() {
        let mut report = report();
        report.devices[0].index = 1;
        report.devices[1].index = 2;
        report.unserved = vec![crate::devices::Unserved {
            index: Some(0),
            id: Some("GPU-z".into()),
            why: "MIG mode is on and it has no MIG devices".into(),
        }];
        let table = report.table();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines[1], "1      GPU-a   Healthy     -           -");
        assert_eq!(lines[3], "0      GPU-z   not served  -           -");
        assert!(
            table.contains("2 devices, 1 Unhealthy, 1 not served;"),
            "{table}"
        );
        assert!(
            table.ends_with("GPU-z (0): not served:\n  MIG mode is on and it has no MIG devices\n"),
            "{table}"
        );
    }

    #[test]
    fn outside_text_in_the_table_is_escaped_and_forges_no_line() {
        let plain = report().table();
        let mut report = report();
        report.devices[1].message =
            Some("Unhealthy: fenced by x: ok\nGPU-a (0):\n  Healthy\u{1b}[2J".into());
        report.devices[1].pods[0].pod = "train-0\u{1b}]0;owned\u{7}".into();
        let table = report.table();
        assert!(
            !table.contains('\u{1b}') && !table.contains('\u{7}'),
            "{table:?}"
        );
        assert!(
            table.ends_with("  Unhealthy: fenced by x: ok\\nGPU-a (0):\\n  Healthy\\u{1b}[2J\n"),
            "{table}"
        );
        assert_eq!(table.lines().count(), plain.lines().count());
    }

    #[test]
    fn the_report_round_trips_through_json() -> Result<(), serde_json::Error> {
        let report = report();
        let text = serde_json::to_string(&report)?;
        assert!(text.contains("\"streamsOpen\":1"), "{text}");
        assert!(
            text.contains("\"pciBusId\":\"0000:17:00.0\"") && text.contains("\"giProfileId\":19"),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<Report>(&text)?, report);
        Ok(())
    }
}
