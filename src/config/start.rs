//! What the start takes from the settings beyond each module's own part: the device source to open, the
//! resources to serve, and the start's one line.

use super::{DraSettings, Settings};
use crate::devices::Inventory;
use crate::devices::mig::ResourceNaming;
use crate::devices::resources::{PlanError, ResourcePlan};
use crate::kubelet::PluginConfig;
use crate::sources::open::Choice;

impl Settings {
    /// The device source to open.
    pub fn source_choice(&self) -> Choice {
        Choice {
            simulate: self.simulate,
            simulate_events: self.simulate_events.clone(),
            nvml: self.nvml.clone(),
            fail_on_init_error: self.fail_on_init_error,
        }
    }

    /// The resources these settings serve `inventory` under, and the plan's warnings.
    pub fn resource_plan(
        &self,
        inventory: &Inventory,
    ) -> Result<(ResourcePlan, Vec<String>), PlanError> {
        let natural = ResourceNaming {
            strategy: self.nvml.mig_strategy,
            base: self.resource_name.clone(),
        };
        ResourcePlan::build(
            &natural,
            self.allocate.naming.ids,
            self.sharing.as_ref(),
            inventory,
        )
    }

    /// Logs one line at start with what is asked first when a node misbehaves: the version, the driver, how devices
    /// are handed to containers and the health policy in force.
    pub fn log_start(&self, driver: Option<String>) {
        let allocate = &self.allocate;
        let mut lists = Vec::new();
        if allocate.volume_mounts {
            lists.push("volume-mounts");
        } else if allocate.envvar {
            lists.push("envvar");
        }
        if allocate.cdi_annotations.is_some() {
            lists.push("cdi-annotations");
        }
        if allocate.cdi {
            lists.push("cdi-cri");
        }
        let driver = match (driver, self.simulate) {
            (Some(version), _) => version,
            (None, Some(_)) => "none (simulated GPUs)".into(),
            (None, None) => "unknown".into(),
        };
        let policy = crate::http::status::PolicySummary::of(&self.monitor.policy);
        tracing::info!(
            version = %env!("CARGO_PKG_VERSION"),
            driver = %driver,
            resource = %self.resource_name,
            mig_strategy = %self.nvml.mig_strategy,
            device_list_strategy = %lists.join(","),
            device_id_strategy = %match allocate.naming.ids {
                crate::devices::naming::IdStrategy::Uuid => "uuid",
                crate::devices::naming::IdStrategy::Index => "index",
            },
            device_specs = allocate.device_specs,
            xid_policy = %policy.xid_policy,
            dp_disable_healthchecks = policy.dp_disable_healthchecks.as_deref(),
            dp_enable_healthchecks = policy.dp_enable_healthchecks.as_deref(),
            quiet_period = %policy.quiet_period,
            dra = %self
                .dra
                .as_ref()
                .map_or("off".to_string(), |d| format!("{} as {}", d.gpus, d.driver)),
            "gpu-device-plugin starting"
        );
    }

    /// The DRA side's settings, its pool named `pool` (the node): the node's pool, the CDI kind Allocate uses, the state directory and boot id the
    /// health checkpoint uses.
    pub fn dra_config(&self, dra: &DraSettings, pool: &str) -> crate::dra::DraConfig {
        crate::dra::DraConfig {
            driver: dra.driver.clone(),
            registry_dir: dra.registry_dir.clone(),
            plugins_dir: dra.plugins_dir.clone(),
            pool: pool.to_string(),
            cdi_kind: self.allocate.cdi_kind.clone(),
            state_dir: self.state_dir.clone(),
            boot_id: crate::monitor::checkpoint::read_boot_id(&self.monitor.boot_id_path),
            heartbeat: crate::dra::health::HEARTBEAT,
            pod_uid: dra.pod_uid.clone(),
        }
    }

    /// The kubelet side's settings for `resource`.
    pub fn plugin_config(&self, resource: &str) -> PluginConfig {
        let mut plugin = PluginConfig::new(&self.kubelet_dir, resource);
        plugin.socket_name = self.socket_name.clone();
        plugin.allocate = self.allocate.clone();
        plugin.pre_start_check = self.pre_start_check;
        plugin
    }
}

/// `--socket-name` for another resource of the process: `<stem>-<resource without domain>.sock`.
pub fn socket_name_for(name: &str, resource: &str) -> String {
    let stem = name.strip_suffix(".sock").unwrap_or(name);
    let short = resource.rsplit('/').next().unwrap_or(resource);
    format!("{stem}-{short}.sock")
}
