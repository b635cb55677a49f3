//! The roads a GPU is served by: the device plugin (one registration per resource) or DRA, one road per GPU,
//! never both. The inventory split between them, each resource's registration, the pod-resources client
//! that says which containers hold the device plugin's devices, and a change of roads checked against what is
//! in use ([`switch`]).

pub mod switch;

use std::sync::Arc;

use crate::config::{self, Settings};
use crate::devices;
use crate::devices::allocation::MpsDirs;
use crate::devices::resources::ResourcePlan;
use crate::kubelet::pods::PodResources;
use crate::kubelet::{self, PluginConfig};
use crate::metrics::Metrics;
use crate::monitor;

/// Each resource's registration settings, with the view of the inventory it lists.
pub type Plugins = Vec<(PluginConfig, devices::InventoryWatch)>;

/// The devices each road serves: the device plugin's view, and DRA's when it is on. A GPU is in one of them.
pub struct Roads {
    /// The device plugin's view.
    pub device_plugin: devices::InventoryWatch,
    /// DRA's view, when it is on.
    pub dra: Option<devices::InventoryWatch>,
}

impl Roads {
    /// Splits the inventory by `--dra`; a selection naming a GPU the node does not have stops the start.
    pub fn split(
        settings: &Settings,
        inventory: &devices::InventoryWatch,
        unserved: &[devices::Unserved],
    ) -> anyhow::Result<Roads> {
        let Some(dra) = &settings.dra else {
            return Ok(Roads {
                device_plugin: inventory.clone(),
                dra: None,
            });
        };
        dra.gpus
            .check(&inventory.borrow(), unserved)
            .map_err(|why| anyhow::anyhow!("{why}"))?;
        let (mine, theirs) = (dra.gpus.clone(), dra.gpus.clone());
        // Every GPU through DRA: the monitor's own inventory, so that a fault wakes the DRA side as it is
        // published, not once a task on the monitor's thread has copied it out.
        let dra_devices = match dra.gpus {
            devices::selection::DraSelection::All => inventory.clone(),
            _ => devices::subset_watch(inventory.clone(), move |i| theirs.serves(i)),
        };
        Ok(Roads {
            device_plugin: devices::subset_watch(inventory.clone(), move |i| !mine.serves(i)),
            dra: Some(dra_devices),
        })
    }
}

/// One registration per resource: whole GPUs, under migStrategy mixed each MIG profile, and each name shared
/// devices are served under; each with its socket, its view of the inventory, and its device list checked
/// against the kubelet's message limit.
pub fn plugins_for(
    settings: &Settings,
    inventory: &devices::InventoryWatch,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<(Arc<ResourcePlan>, Plugins)> {
    let (plan, warnings) = settings.resource_plan(&inventory.borrow())?;
    let plan = Arc::new(plan);
    // Every GPU served through DRA: the device plugin does not register (a resource with no device would
    // still be one the scheduler counts on this node).
    if settings.dra.is_some() && inventory.borrow().is_empty() {
        return Ok((plan, Vec::new()));
    }
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    let several = plan.resources().len() > 1;
    let mut plugins = Vec::new();
    for (position, served) in plan.resources().iter().enumerate() {
        let mut plugin = settings.plugin_config(&served.name);
        plugin.allocate.naming = served.naming.clone();
        plugin.allocate.mps = match (&settings.mps_root, served.mps) {
            (Some(root), true) => Some(MpsDirs::new(root, &served.name)),
            _ => None,
        };
        if position > 0 {
            plugin.socket_name = settings
                .socket_name
                .as_ref()
                .map(|n| config::socket_name_for(n, &served.name));
        }
        let socket = kubelet::socket_path_for(&plugin)?;
        plugin.socket_name = socket.file_name().map(|n| n.to_string_lossy().into_owned());
        plugin.metrics = metrics.clone();
        let inventory = if several {
            let plan = plan.clone();
            devices::subset_watch(inventory.clone(), move |info| plan.serves(position, info))
        } else {
            inventory.clone()
        };
        let size = kubelet::server::check_list_size(
            &served.name,
            &inventory.borrow(),
            &plugin.allocate.naming,
        )?;
        tracing::debug!(resource = %served.name, bytes = size, "largest device list");
        plugins.push((plugin, inventory));
    }
    Ok((plan, plugins))
}

/// The kubelet's pod-resources client for every resource served, unless turned off.
pub fn pod_resources(
    settings: &Settings,
    plugins: &Plugins,
    monitored: &monitor::Monitored,
) -> Option<Arc<PodResources>> {
    let socket = settings.pod_resources_socket.as_ref()?;
    let (first, others) = plugins.split_first()?;
    let mut pods = PodResources::new(socket, first.0.resource_name.clone())
        .with_naming(first.0.allocate.naming.clone(), monitored.inventory.clone());
    for (plugin, _) in others {
        pods = pods.with_resource(
            plugin.resource_name.clone(),
            plugin.allocate.naming.clone(),
            monitored.inventory.clone(),
        );
    }
    Some(Arc::new(pods))
}
