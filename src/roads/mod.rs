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
    /// Splits the inventory by `--dra`; a selection naming a GPU the node does not have stops the start. A GPU
    /// the DRA record of this boot holds for a claim stays off the device plugin whatever the settings say
    /// (see [`held_through_dra`]).
    pub fn split(
        settings: &Settings,
        inventory: &devices::InventoryWatch,
        unserved: &[devices::Unserved],
    ) -> anyhow::Result<Roads> {
        let dra = settings.dra.as_ref();
        if let Some(dra) = dra {
            dra.gpus
                .check(&inventory.borrow(), unserved)
                .map_err(|why| anyhow::anyhow!("{why}"))?;
        }
        let held = held_through_dra(settings, &inventory.borrow());
        let mine = dra.map(|d| d.gpus.clone());
        let device_plugin = if mine.is_none() && held.is_empty() {
            inventory.clone()
        } else {
            devices::subset_watch(inventory.clone(), move |i| {
                !mine.as_ref().is_some_and(|m| m.serves(i)) && !held.contains(gpu_of(i))
            })
        };
        let dra_devices = dra.map(|dra| {
            let theirs = dra.gpus.clone();
            // Every GPU through DRA: the monitor's own inventory, so that a fault wakes the DRA side as it is
            // published, not once a task on the monitor's thread has copied it out.
            match dra.gpus {
                devices::selection::DraSelection::All => inventory.clone(),
                _ => devices::subset_watch(inventory.clone(), move |i| theirs.serves(i)),
            }
        });
        Ok(Roads {
            device_plugin,
            dra: dra_devices,
        })
    }
}

/// The GPU (its UUID) a device is or is part of.
fn gpu_of(info: &devices::DeviceInfo) -> &str {
    info.mig
        .as_ref()
        .map_or(info.id.as_str(), |m| m.parent.as_str())
}

/// The GPUs (by UUID) that the DRA record of this boot holds for a prepared claim while these settings serve
/// them through the device plugin: a change of `dra` across a restart (a rollout with a new config) that a
/// SIGHUP would have refused. They stay off the device plugin, each said with its claim, until the claim is
/// unprepared (DRA on for that GPU again) or the record is removed once no pod uses the claim; handing one
/// out would give it to a second pod.
fn held_through_dra(
    settings: &Settings,
    inventory: &devices::Inventory,
) -> std::collections::BTreeSet<String> {
    let mut held = std::collections::BTreeSet::new();
    // Every GPU through DRA: the device plugin serves none, and the DRA side reads the record itself.
    if settings
        .dra
        .as_ref()
        .is_some_and(|d| d.gpus == devices::selection::DraSelection::All)
    {
        return held;
    }
    let file = crate::dra::record::RecordFile::in_dir(&settings.state_dir);
    let boot = monitor::checkpoint::read_boot_id(&settings.monitor.boot_id_path);
    let crate::dra::record::Look::Found(record) = file.look(boot) else {
        return held;
    };
    let through_dra =
        |info: &devices::DeviceInfo| settings.dra.as_ref().is_some_and(|d| d.gpus.serves(info));
    for device in inventory.devices() {
        let info = &device.info;
        if through_dra(info) {
            continue;
        }
        let name = crate::dra::names::device_name(info);
        let claim = record
            .claims
            .values()
            .find(|c| c.devices.iter().any(|d| d.device == name));
        if let Some(claim) = claim
            && held.insert(gpu_of(info).to_string())
        {
            tracing::error!(
                device = %info.id,
                claim = %format!("{}/{}", claim.namespace, claim.name),
                record = %file.path().display(),
                "kept off the device plugin: the DRA record holds this GPU for a prepared claim, and these \
                 settings serve it through the device plugin (dra changed across a restart). Serve it \
                 through DRA again until the claim's pods end, or remove the record once no pod uses the claim"
            );
        }
    }
    held
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
