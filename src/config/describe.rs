//! What `check-config` prints of the settings: one `name: value` line each.

use super::*;

impl Settings {
    /// The effective settings as `check-config` prints them: one `name: value` line each, in the order
    /// an operator reviews a rollout (what the kubelet sees, how Allocate answers, health, surfaces).
    pub fn describe(&self) -> String {
        let on = |b: bool| if b { "on" } else { "off" };
        let path = |p: &Path| p.display().to_string();
        let a = &self.allocate;
        let allocate = self.allocate_answers();
        let sharing = self.sharing_line();
        let policy_line = self.policy_line();
        let gpus = self.gpus_line();
        let imex = if a.imex_channels.is_empty() {
            "none".to_string()
        } else {
            a.imex_channels
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let extra: Vec<String> = a
            .extra_envs
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let lines = [
            ("kubelet directory", path(&self.kubelet_dir)),
            ("resource", self.resource_name.clone()),
            ("GPUs", gpus),
            (
                "MIG strategy",
                format!("{:?}", self.nvml.mig_strategy).to_lowercase(),
            ),
            ("device IDs", format!("{:?}", a.naming.ids).to_lowercase()),
            ("sharing", sharing),
            ("Allocate answers with", allocate.join(", ")),
            (
                "Allocate adds",
                if extra.is_empty() {
                    "nothing".into()
                } else {
                    extra.join(" ")
                },
            ),
            ("IMEX channels", imex),
            ("health policy", policy_line),
            ("pre-start health check", on(self.pre_start_check).into()),
            ("state directory", path(&self.state_dir)),
            (
                "HTTP endpoints",
                self.http_addr.map_or("off".into(), |a| a.to_string()),
            ),
            (
                "fence directory",
                self.fence_dir.as_deref().map_or("none".into(), path),
            ),
            ("Kubernetes API", on(self.cluster.enabled).into()),
            (
                "DRA",
                self.dra.as_ref().map_or("off".into(), |d| {
                    format!(
                        "{} as driver {} (registration in {}, sockets in {})",
                        d.gpus,
                        d.driver,
                        path(&d.registry_dir),
                        path(&d.plugins_dir)
                    )
                }),
            ),
        ];
        // Values hold paths, names and lists from outside: each line printed as itself and one line.
        lines
            .iter()
            .map(|(name, value)| format!("{name}: {}\n", shown(value, LINE_MAX)))
            .collect()
    }

    /// How Allocate answers, each way that is on.
    fn allocate_answers(&self) -> Vec<String> {
        let a = &self.allocate;
        let path = |p: &Path| p.display().to_string();
        let mut allocate = Vec::new();
        if a.envvar {
            allocate.push("NVIDIA_VISIBLE_DEVICES (envvar)".to_string());
        }
        if a.volume_mounts {
            allocate.push("volume mounts".into());
        }
        if a.cdi {
            allocate.push(format!("CDI names (kind {})", a.cdi_kind));
        }
        if let Some(prefix) = &a.cdi_annotations {
            allocate.push(format!("CDI annotations (prefix {prefix})"));
        }
        if a.device_specs {
            allocate.push(format!(
                "device specs (dev root {}, checked under {})",
                path(&a.dev_root),
                path(&a.host_root)
            ));
        }
        allocate
    }

    /// Time-slicing or MPS, each shared resource with its replicas.
    fn sharing_line(&self) -> String {
        match &self.sharing {
            None => "none".to_string(),
            Some(sharing) => {
                let kind = match sharing.kind {
                    nvidia::ShareKind::TimeSlicing => "time-slicing",
                    nvidia::ShareKind::Mps => "MPS",
                };
                let each: Vec<String> = sharing
                    .resources
                    .iter()
                    .map(|r| {
                        let devices = match &r.devices {
                            nvidia::DeviceSelection::All => "all devices".to_string(),
                            nvidia::DeviceSelection::Count(n) => format!("the first {n} devices"),
                            nvidia::DeviceSelection::List(l) => format!("devices {}", l.join(", ")),
                        };
                        let under = r
                            .rename
                            .as_ref()
                            .map(|n| format!(" as {n}"))
                            .unwrap_or_default();
                        format!("{} × {} replicas{under} ({devices})", r.name, r.replicas)
                    })
                    .collect();
                format!(
                    "{kind}: {}{}",
                    each.join("; "),
                    if sharing.fail_requests_greater_than_one {
                        ", more than one replica per container refused"
                    } else {
                        ""
                    }
                )
            }
        }
    }

    /// The health policy in force.
    fn policy_line(&self) -> String {
        let policy = crate::http::status::PolicySummary::of(&self.monitor.policy);
        let mut policy_line = format!(
            "XIDs by the {} policy, recovery after {} quiet, probes every {}, recovery action read every {}",
            policy.xid_policy,
            policy.quiet_period,
            policy.probe_interval,
            policy.recovery_action_interval
        );
        if let Some(list) = &policy.dp_disable_healthchecks {
            policy_line.push_str(&format!(", DP_DISABLE_HEALTHCHECKS={list}"));
        }
        if let Some(list) = &policy.dp_enable_healthchecks {
            policy_line.push_str(&format!(", DP_ENABLE_HEALTHCHECKS={list}"));
        }
        policy_line
    }

    /// Where the GPUs come from.
    fn gpus_line(&self) -> String {
        let path = |p: &Path| p.display().to_string();
        match self.simulate {
            Some(n) => format!("{n} simulated"),
            None => format!(
                "NVML ({}), {}",
                path(&self.nvml.library),
                if self.fail_on_init_error {
                    "exit when it cannot be loaded"
                } else {
                    "served unmonitored when it cannot be loaded"
                }
            ),
        }
    }
}
