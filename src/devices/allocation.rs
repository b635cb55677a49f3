//! Allocation decisions, pure: which devices a container gets (Allocate) and which we would like it to get
//! (GetPreferredAllocation). No IO: the caller passes a predicate for "does this device node exist", so every
//! rule is a fast unit test.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use crate::api::{CdiDevice, ContainerAllocateResponse, DeviceSpec, Mount};
use crate::devices::{Health, Inventory};

/// Environment variable the NVIDIA container toolkit reads to decide which GPUs a container sees.
pub const VISIBLE_DEVICES_ENV: &str = "NVIDIA_VISIBLE_DEVICES";

/// Device nodes every GPU container needs besides its own `/dev/nvidia<minor>`: the control device, unified
/// memory, and modesetting. Handed out only where they exist on the host.
const CONTROL_DEVICE_NODES: [&str; 4] = [
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
];

/// The MPS control daemon's directories for one resource, as NVIDIA's plugin passes them: its pipe directory
/// (`<root>/<resource>/pipe` on the host, `/mps/<resource>/pipe` in the container, named by
/// `CUDA_MPS_PIPE_DIRECTORY`) and its shared memory (`<root>/shm` on the host, the container's `/dev/shm`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsDirs {
    /// The pipe directory in the container.
    pub pipe: String,
    /// The pipe directory on the host.
    pub host_pipe: String,
    /// The shm directory on the host.
    pub host_shm: String,
}

impl MpsDirs {
    /// The directories for `resource` under the daemon's host root `root`.
    pub fn new(root: &Path, resource: &str) -> Self {
        MpsDirs {
            pipe: format!("/mps/{resource}/pipe"),
            host_pipe: root
                .join(resource)
                .join("pipe")
                .to_string_lossy()
                .into_owned(),
            host_shm: root.join("shm").to_string_lossy().into_owned(),
        }
    }
}

/// Where the `volume-mounts` device list strategy mounts one file per device, as NVIDIA's plugin does.
pub const VOLUME_MOUNTS_DIR: &str = "/var/run/nvidia-container-devices";

/// How Allocate describes the devices to the container runtime, beyond the environment variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocateOptions {
    /// Set `NVIDIA_VISIBLE_DEVICES` to the IDs (NVIDIA's `envvar` device list strategy; off when only CDI
    /// names are wanted).
    pub envvar: bool,
    /// How the kubelet names the devices (UUIDs or indices, replicas).
    pub naming: crate::devices::naming::Naming,
    /// NVIDIA's `volume-mounts` device list strategy: `NVIDIA_VISIBLE_DEVICES` names
    /// [`VOLUME_MOUNTS_DIR`] and each device is a mount of `/dev/null` at `VOLUME_MOUNTS_DIR/<id>`, which the
    /// NVIDIA container toolkit reads when it accepts device lists as volume mounts only (an unprivileged pod
    /// cannot then ask for GPUs by setting the variable itself).
    pub volume_mounts: bool,
    /// Environment variables every container response carries (`NVIDIA_GDS=enabled`, …).
    pub extra_envs: Vec<(String, String)>,
    /// With MPS sharing: the MPS control daemon's directories, for every container holding a replica.
    pub mps: Option<MpsDirs>,
    /// Put CDI device names (`<cdi_kind>=<id>`) in the response, for runtimes that resolve CDI.
    pub cdi: bool,
    /// NVIDIA's `cdi-annotations` device list strategy: the CDI names, comma-joined, in a container
    /// annotation keyed `<prefix>nvidia-device-plugin_<random UUID>`, for runtimes that read CDI devices from
    /// annotations; the prefix when on.
    pub cdi_annotations: Option<String>,
    /// CDI kind the names are qualified with, e.g. `nvidia.com/gpu`.
    pub cdi_kind: String,
    /// Put device specs for the device nodes in the response, for runtimes without the NVIDIA hook.
    pub device_specs: bool,
    /// Where the device nodes are **on the host** (NVIDIA's `--dev-root`): `/`, or the driver container's
    /// root under the GPU operator (`/run/nvidia/driver`). A spec's host path is this root plus `/dev/...`,
    /// because the container runtime resolves it on the host.
    pub dev_root: PathBuf,
    /// Where **this process** sees the host's root file system: `/` on the host, the host root's mount in a
    /// pod (e.g. `/host`). Used only to check which device nodes exist, at host root + dev root + node.
    pub host_root: PathBuf,
    /// IMEX channels every container gets (multi-node NVLink), their device nodes found at start: named as
    /// NVIDIA's plugin names them in each form the response takes (`NVIDIA_IMEX_CHANNELS`, a volume mount,
    /// a CDI name, a device spec).
    pub imex_channels: Vec<u32>,
}

/// Where IMEX channel `id`'s device node is, in a container and (under the dev root) on the host.
pub fn imex_channel_node(id: u32) -> PathBuf {
    PathBuf::from(format!("/dev/nvidia-caps-imex-channels/channel{id}"))
}

/// The environment variable that names the IMEX channels to the NVIDIA container toolkit.
pub const IMEX_CHANNELS_ENV: &str = "NVIDIA_IMEX_CHANNELS";

impl Default for AllocateOptions {
    fn default() -> Self {
        AllocateOptions {
            envvar: true,
            naming: crate::devices::naming::Naming::default(),
            volume_mounts: false,
            extra_envs: Vec::new(),
            mps: None,
            cdi: false,
            cdi_annotations: None,
            cdi_kind: "nvidia.com/gpu".into(),
            device_specs: false,
            dev_root: PathBuf::from("/"),
            host_root: PathBuf::from("/"),
            imex_channels: Vec::new(),
        }
    }
}

/// Longest part of a device ID from a request that errors and logs repeat, in bytes: an ID is a UUID (about
/// 40 bytes) or an index; a caller's megabyte-long one is not written out whole on every refusal.
pub const ECHOED_ID_MAX: usize = 80;

/// Device IDs shown in one log line at most; the rest are counted.
pub const ECHOED_IDS_MAX: usize = 16;

/// A device ID from a request as errors and logs repeat it: at most [`ECHOED_ID_MAX`] bytes, and its length
/// when cut.
pub fn echoed(id: &str) -> String {
    if id.len() <= ECHOED_ID_MAX {
        return id.to_string();
    }
    let end = crate::util::text::floor(id, ECHOED_ID_MAX);
    format!("{}... ({} bytes)", &id[..end], id.len())
}

/// The device IDs of a request for a log line: at most [`ECHOED_IDS_MAX`] of them, each [`echoed`].
pub fn echoed_ids<'a>(ids: impl IntoIterator<Item = &'a String>) -> String {
    let mut shown = Vec::new();
    let mut more = 0usize;
    for id in ids {
        if shown.len() < ECHOED_IDS_MAX {
            shown.push(echoed(id));
        } else {
            more += 1;
        }
    }
    let mut text = shown.join(",");
    if more > 0 {
        text.push_str(&format!(" and {more} more"));
    }
    text
}

/// Why an allocation request was refused. Mapped to gRPC codes at the server edge.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocationError {
    /// The request lists no containers.
    #[error("request has no container requests")]
    NoContainers,
    /// A container request lists no devices.
    #[error("container request {0} lists no device IDs")]
    NoDevices(usize),
    /// A device ID this plugin does not advertise.
    #[error("unknown device ID {0:?}: not advertised by this plugin")]
    UnknownDevice(String),
    /// The same device twice in one request.
    #[error("device ID {0:?} appears more than once in the request")]
    DuplicateDevice(String),
    /// A container asks for more than one replica of a shared resource set to refuse that (NVIDIA's
    /// `failRequestsGreaterThanOne`; the message is NVIDIA's).
    #[error("invalid request: maximum request size for shared resources is 1; found {0}")]
    SharedRequestTooLarge(usize),
    /// A device that is Unhealthy now.
    #[error("device {id}: {reason}")]
    UnhealthyDevice {
        /// Device ID.
        id: String,
        /// Its health message, which begins with the health (`Unhealthy: XID 79: ...`).
        reason: String,
    },
    /// A preferred-allocation size that cannot be met by anyone.
    #[error("allocation size {size} is invalid: {why}")]
    BadSize {
        /// Requested size.
        size: i32,
        /// Why it is invalid.
        why: &'static str,
    },
}

/// Checks one Allocate request against the inventory and builds one response per container, in order.
///
/// All argument errors are reported before any health error, so a malformed request is always
/// `INVALID_ARGUMENT` whatever the devices' health.
pub fn allocate(
    inventory: &Inventory,
    containers: &[Vec<String>],
    options: &AllocateOptions,
    node_exists: impl Fn(&Path) -> bool,
) -> Result<Vec<ContainerAllocateResponse>, AllocationError> {
    if containers.is_empty() {
        return Err(AllocationError::NoContainers);
    }
    // MPS is for containers holding replicas: a device that is not shared runs as it would without MPS.
    let holds_replica: Vec<bool> = containers
        .iter()
        .map(|ids| {
            ids.iter()
                .any(|id| crate::devices::naming::Naming::is_replica(id))
        })
        .collect();
    let translated;
    let containers = if options.naming.is_plain() {
        containers
    } else {
        translated = to_physical(inventory, &options.naming, containers)?;
        &translated[..]
    };
    // Replicas of one GPU may go to several containers of a pod; whole GPUs may not.
    let shared = options.naming.replicas > 1;
    let mut seen = HashSet::new();
    for (i, ids) in containers.iter().enumerate() {
        if ids.is_empty() {
            return Err(AllocationError::NoDevices(i));
        }
        for id in ids {
            if inventory.get(id).is_none() {
                return Err(AllocationError::UnknownDevice(echoed(id)));
            }
            if !shared && !seen.insert(id.as_str()) {
                return Err(AllocationError::DuplicateDevice(echoed(id)));
            }
        }
    }
    for id in containers.iter().flatten() {
        if let Some(device) = inventory.get(id)
            && device.health != Health::Healthy
        {
            return Err(AllocationError::UnhealthyDevice {
                id: id.clone(),
                reason: device
                    .reason
                    .clone()
                    .unwrap_or_else(|| "Unhealthy (no reason recorded)".into()),
            });
        }
    }
    Ok(containers
        .iter()
        .zip(holds_replica)
        .map(|(ids, shared)| {
            let mps = options.mps.as_ref().filter(|_| shared);
            container_response(inventory, ids, options, mps, &node_exists)
        })
        .collect())
}

/// Each container's kubelet IDs as the GPUs' inventory IDs, each GPU once per container: a kubelet ID that
/// names no GPU, one given twice in the request, or more than one replica where that is refused is an error.
fn to_physical(
    inventory: &Inventory,
    naming: &crate::devices::naming::Naming,
    containers: &[Vec<String>],
) -> Result<Vec<Vec<String>>, AllocationError> {
    let mut seen = HashSet::new();
    containers
        .iter()
        .map(|ids| {
            if naming.fail_requests_greater_than_one
                && ids.len() > 1
                && ids
                    .iter()
                    .any(|id| crate::devices::naming::Naming::is_replica(id))
            {
                return Err(AllocationError::SharedRequestTooLarge(ids.len()));
            }
            let mut gpus: Vec<String> = Vec::with_capacity(ids.len().min(inventory.len()));
            for id in ids {
                if !seen.insert(id.as_str()) {
                    return Err(AllocationError::DuplicateDevice(echoed(id)));
                }
                let gpu = naming
                    .resolve(inventory, id)
                    .ok_or_else(|| AllocationError::UnknownDevice(echoed(id)))?;
                if !gpus.iter().any(|g| g == gpu) {
                    gpus.push(gpu.to_string());
                }
            }
            Ok(gpus)
        })
        .collect()
}

fn container_response(
    inventory: &Inventory,
    ids: &[String],
    options: &AllocateOptions,
    mps: Option<&MpsDirs>,
    node_exists: &impl Fn(&Path) -> bool,
) -> ContainerAllocateResponse {
    let mut response = ContainerAllocateResponse::default();
    let imex: Vec<String> = options
        .imex_channels
        .iter()
        .map(ToString::to_string)
        .collect();
    if options.envvar {
        response
            .envs
            .insert(VISIBLE_DEVICES_ENV.to_string(), ids.join(","));
        if !imex.is_empty() {
            response
                .envs
                .insert(IMEX_CHANNELS_ENV.to_string(), imex.join(","));
        }
    }
    if options.volume_mounts {
        response.envs.insert(
            VISIBLE_DEVICES_ENV.to_string(),
            VOLUME_MOUNTS_DIR.to_string(),
        );
        let channels = imex.iter().map(|id| format!("imex/{id}"));
        response.mounts = ids
            .iter()
            .cloned()
            .chain(channels)
            .map(|id| Mount {
                container_path: format!("{VOLUME_MOUNTS_DIR}/{id}"),
                host_path: "/dev/null".into(),
                read_only: false,
            })
            .collect();
    }
    response.envs.extend(options.extra_envs.iter().cloned());
    if let Some(mps) = mps {
        response
            .envs
            .insert("CUDA_MPS_PIPE_DIRECTORY".into(), mps.pipe.clone());
        response.mounts.push(Mount {
            container_path: mps.pipe.clone(),
            host_path: mps.host_pipe.clone(),
            read_only: false,
        });
        response.mounts.push(Mount {
            container_path: "/dev/shm".into(),
            host_path: mps.host_shm.clone(),
            read_only: false,
        });
    }
    // IMEX channels in CDI are the vendor's `imex-channel` class: nvidia.com/imex-channel=0.
    let vendor = options
        .cdi_kind
        .split_once('/')
        .map_or(options.cdi_kind.as_str(), |(vendor, _)| vendor);
    let cdi_names = || {
        ids.iter()
            .map(|id| format!("{}={id}", options.cdi_kind))
            .chain(imex.iter().map(|id| format!("{vendor}/imex-channel={id}")))
    };
    if options.cdi {
        response.cdi_devices = cdi_names().map(|name| CdiDevice { name }).collect();
    }
    if let Some(prefix) = &options.cdi_annotations {
        let names: Vec<String> = cdi_names().collect();
        response.annotations.insert(
            format!("{prefix}nvidia-device-plugin_{}", random_uuid()),
            names.join(","),
        );
    }
    if options.device_specs {
        let own = ids
            .iter()
            .filter_map(|id| inventory.get(id))
            .flat_map(|d| d.info.device_nodes.iter().map(PathBuf::as_path));
        let control = CONTROL_DEVICE_NODES.iter().map(Path::new);
        for node in own.chain(control) {
            let host_path = under(&options.dev_root, node);
            if node_exists(&under(&options.host_root, &host_path)) {
                response.devices.push(DeviceSpec {
                    container_path: node.to_string_lossy().into_owned(),
                    host_path: host_path.to_string_lossy().into_owned(),
                    permissions: "rw".into(),
                });
            }
        }
        // Checked at start: a channel missing then was left out (or refused the start).
        for &id in &options.imex_channels {
            let node = imex_channel_node(id);
            response.devices.push(DeviceSpec {
                container_path: node.to_string_lossy().into_owned(),
                host_path: under(&options.dev_root, &node)
                    .to_string_lossy()
                    .into_owned(),
                permissions: "rw".into(),
            });
        }
    }
    response
}

/// A random (version 4) UUID, in the form NVIDIA's plugin keys its CDI annotations with; all zeros in the
/// unlikely case the OS has no randomness to give, which leaves the key valid.
fn random_uuid() -> String {
    let mut b = [0u8; 16];
    let _filled = getrandom::fill(&mut b);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// `path` under `root`: `/dev/nvidia0` under `/run/nvidia/driver` is `/run/nvidia/driver/dev/nvidia0`, and
/// under `/` it is itself.
pub fn under(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// Longest description a refused PreStartContainer carries, in bytes. The kubelet puts it in a pod event and
/// the container's waiting message; several devices' messages (each up to 1024 characters) must not make one
/// of those unwieldy.
pub const MAX_PRE_START_DESCRIPTION: usize = 4096;

/// Why a container may not start on its devices now. The text is what the operator reads in the pod's events
/// (`Error: device plugin PreStartContainer rpc failed with err: rpc error: code = FailedPrecondition desc =
/// <text>`), so what matters comes first: each device and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PreStartError {
    /// Devices this plugin no longer serves (a GPU gone since Allocate), then Unhealthy ones with their
    /// messages; at most [`MAX_PRE_START_DESCRIPTION`] bytes.
    #[error("{0}")]
    Refused(String),
}

/// The health gate before a container starts (PreStartContainer): every device the container holds must be
/// present and Healthy now. The kubelet asks before each start, restarts of a crash-looping container
/// included, so a container whose GPU recovered starts at the kubelet's next try.
pub fn pre_start(inventory: &Inventory, ids: &[String]) -> Result<(), PreStartError> {
    let mut seen = HashSet::new();
    let mut text = String::new();
    for id in ids {
        // Past the bound nothing more would be shown: a request naming huge numbers of devices costs no more.
        if text.len() > MAX_PRE_START_DESCRIPTION {
            break;
        }
        if !seen.insert(id.as_str()) {
            continue;
        }
        let problem = match inventory.get(id) {
            None => format!(
                "device {id} is not served by this plugin any more (gone from the node since it was \
                 allocated?)."
            ),
            Some(device) if device.health != Health::Healthy => format!(
                "device {id}: {}",
                device
                    .reason
                    .as_deref()
                    .unwrap_or("Unhealthy (no reason recorded)")
            ),
            Some(_) => continue,
        };
        if !text.is_empty() {
            text.push(' ');
        }
        text.push_str(&problem);
    }
    if text.is_empty() {
        return Ok(());
    }
    Err(PreStartError::Refused(crate::util::text::cut_bytes(
        &text,
        MAX_PRE_START_DESCRIPTION,
    )))
}

/// [`preferred`] in the kubelet's names. With index IDs, the same choice among the GPUs. With replicas, the
/// replicas are spread over the GPUs (the GPU holding the fewest chosen replicas first, then the list order),
/// healthy GPUs only, after every `must_include` replica.
pub fn preferred_named(
    inventory: &Inventory,
    naming: &crate::devices::naming::Naming,
    request: &PreferenceRequest<'_>,
) -> Result<Vec<String>, AllocationError> {
    if naming.is_plain() {
        return preferred(inventory, request);
    }
    let bad = |why| AllocationError::BadSize {
        size: request.size,
        why,
    };
    let size = usize::try_from(request.size).map_err(|_| bad("negative"))?;
    if size > inventory.len().saturating_mul(naming.replicas.max(1)) {
        return Err(bad("larger than the number of devices this plugin serves"));
    }
    if naming.replicas <= 1 {
        let gpus = |ids: &[String]| -> Vec<String> {
            ids.iter()
                .filter_map(|id| naming.resolve(inventory, id).map(String::from))
                .collect()
        };
        let (available, must_include) = (gpus(request.available), gpus(request.must_include));
        let chosen = preferred(
            inventory,
            &PreferenceRequest {
                available: &available,
                must_include: &must_include,
                size: request.size,
            },
        )?;
        return Ok(chosen
            .iter()
            .filter_map(|gpu| naming.kubelet_ids_of(inventory, gpu).into_iter().next())
            .collect());
    }
    let mut chosen: Vec<String> = Vec::with_capacity(size);
    // Every ID once: the kubelet's lists are its own, but their length is not ours to trust.
    let mut taken: HashSet<&str> = HashSet::new();
    let mut per_gpu: BTreeMap<&str, usize> = BTreeMap::new();
    for id in request.must_include {
        if taken.insert(id) {
            chosen.push(id.clone());
            if let Some(gpu) = naming.resolve(inventory, id) {
                *per_gpu.entry(gpu).or_default() += 1;
            }
        }
        if chosen.len() > size {
            return Err(bad("smaller than the number of must-include devices"));
        }
    }
    let mut candidates: Vec<(&str, usize, &String)> = request
        .available
        .iter()
        .filter(|id| taken.insert(id))
        .filter_map(|id| {
            let gpu = naming.resolve(inventory, id)?;
            let device = inventory.get(gpu)?;
            (device.health == Health::Healthy)
                .then(|| (gpu, inventory.position(gpu).unwrap_or(0), id))
        })
        .collect();
    while chosen.len() < size {
        let best = candidates
            .iter()
            .enumerate()
            .min_by_key(|(_, (gpu, position, id))| {
                (per_gpu.get(gpu).copied().unwrap_or(0), *position, *id)
            })
            .map(|(i, _)| i);
        let Some(best) = best else { break };
        let (gpu, _, id) = candidates.swap_remove(best);
        *per_gpu.entry(gpu).or_default() += 1;
        chosen.push(id.clone());
    }
    Ok(chosen)
}

/// [`pre_start`] in the kubelet's names: each GPU behind the IDs once; an ID that names none is kept as it
/// is, and refused by name.
pub fn pre_start_named(
    inventory: &Inventory,
    naming: &crate::devices::naming::Naming,
    ids: &[String],
) -> Result<(), PreStartError> {
    if naming.is_plain() {
        return pre_start(inventory, ids);
    }
    let mut seen = HashSet::new();
    let gpus: Vec<String> = ids
        .iter()
        .map(|id| naming.resolve(inventory, id).unwrap_or(id.as_str()))
        .filter(|gpu| seen.insert(*gpu))
        .map(String::from)
        .collect();
    pre_start(inventory, &gpus)
}

/// One container's preferred-allocation question, as the kubelet asks it.
#[derive(Debug, Clone, Default)]
pub struct PreferenceRequest<'a> {
    /// Devices the kubelet could give.
    pub available: &'a [String],
    /// Devices the kubelet will give in any case.
    pub must_include: &'a [String],
    /// How many devices the container gets.
    pub size: i32,
}

/// Chooses `size` devices: every `must_include` device, then healthy available devices, keeping the choice on
/// as few NUMA nodes as possible (the nodes of `must_include` first, then the node that fits best). Returns
/// fewer than `size` only when there are not enough healthy devices; the kubelet then decides by itself.
pub fn preferred(
    inventory: &Inventory,
    request: &PreferenceRequest<'_>,
) -> Result<Vec<String>, AllocationError> {
    let size = usize::try_from(request.size).map_err(|_| AllocationError::BadSize {
        size: request.size,
        why: "negative",
    })?;
    // The size comes from outside: no container can get more devices than exist (and a size near i32::MAX
    // must not become an allocation of that many).
    if size > inventory.len() {
        return Err(AllocationError::BadSize {
            size: request.size,
            why: "larger than the number of devices this plugin serves",
        });
    }
    let mut chosen: Vec<String> = Vec::with_capacity(size);
    for id in request.must_include {
        if !chosen.contains(id) {
            chosen.push(id.clone());
        }
    }
    if chosen.len() > size {
        return Err(AllocationError::BadSize {
            size: request.size,
            why: "smaller than the number of must-include devices",
        });
    }

    // Healthy candidates grouped by NUMA node, each group in the inventory's stable order.
    let mut groups: BTreeMap<Option<i64>, Vec<(usize, &str)>> = BTreeMap::new();
    let mut seen: HashSet<&str> = chosen.iter().map(String::as_str).collect();
    for id in request.available {
        if !seen.insert(id.as_str()) {
            continue;
        }
        let (Some(device), Some(pos)) = (inventory.get(id), inventory.position(id)) else {
            continue;
        };
        if device.health == Health::Healthy {
            groups
                .entry(device.info.numa_node)
                .or_default()
                .push((pos, id));
        }
    }
    for group in groups.values_mut() {
        group.sort_unstable();
    }

    // Stay with the nodes the kubelet already committed to.
    let committed: Vec<Option<i64>> = chosen
        .iter()
        .filter_map(|id| inventory.get(id))
        .map(|d| d.info.numa_node)
        .collect();
    for node in committed {
        take_from(&mut groups, node, size, &mut chosen);
    }

    while chosen.len() < size && !groups.is_empty() {
        let need = size - chosen.len();
        // The smallest node that fits the rest keeps larger nodes whole for larger requests; when none fits,
        // the largest node covers the most with one node.
        let fits = groups
            .iter()
            .filter(|(_, g)| g.len() >= need)
            .min_by_key(|(node, g)| (g.len(), **node))
            .map(|(node, _)| *node);
        let node = fits.or_else(|| {
            groups
                .iter()
                .max_by_key(|(node, g)| (g.len(), std::cmp::Reverse(**node)))
                .map(|(node, _)| *node)
        });
        match node {
            Some(node) => take_from(&mut groups, node, size, &mut chosen),
            None => break,
        }
    }
    Ok(chosen)
}

fn take_from(
    groups: &mut BTreeMap<Option<i64>, Vec<(usize, &str)>>,
    node: Option<i64>,
    size: usize,
    chosen: &mut Vec<String>,
) {
    let Some(group) = groups.remove(&node) else {
        return;
    };
    let need = size.saturating_sub(chosen.len());
    chosen.extend(group.iter().take(need).map(|(_, id)| (*id).to_string()));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::DeviceInfo;

    /// Eight GPUs `g0`..`g7`, `g0`-`g3` on NUMA node 0 and `g4`-`g7` on node 1.
    fn node() -> Inventory {
        Inventory::new((0..8).map(|i| DeviceInfo {
            id: format!("g{i}"),
            numa_node: Some(i / 4),
            device_nodes: vec![PathBuf::from(format!("/dev/nvidia{i}"))],
            ..DeviceInfo::default()
        }))
    }

    fn fail(inv: &mut Inventory, id: &str) {
        inv.set_health(
            id,
            Health::Unhealthy,
            Some("XID 79: GPU has fallen off the bus".into()),
        );
    }

    fn ids(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    fn all() -> Vec<String> {
        (0..8).map(|i| format!("g{i}")).collect()
    }

    fn alloc(
        inv: &Inventory,
        req: &[&[&str]],
    ) -> Result<Vec<ContainerAllocateResponse>, AllocationError> {
        let containers: Vec<Vec<String>> = req.iter().map(|c| ids(c)).collect();
        allocate(inv, &containers, &AllocateOptions::default(), |_| true)
    }

    #[test]
    fn allocate_sets_visible_devices_per_container_in_order() {
        let responses = alloc(&node(), &[&["g1", "g0"], &["g5"]]).unwrap_or_default();
        let envs: Vec<_> = responses
            .iter()
            .map(|r| r.envs.get(VISIBLE_DEVICES_ENV).cloned())
            .collect();
        assert_eq!(envs, vec![Some("g1,g0".into()), Some("g5".into())]);
        assert!(
            responses
                .iter()
                .all(|r| r.cdi_devices.is_empty() && r.devices.is_empty())
        );
    }

    #[test]
    fn mps_directories_go_to_containers_holding_replicas_only() -> Result<(), AllocationError> {
        let inv = node();
        let options = AllocateOptions {
            naming: crate::devices::naming::Naming {
                replicas: 2,
                replicated: Some(std::sync::Arc::new(["g1".to_string()].into())),
                fail_requests_greater_than_one: true,
                ..crate::devices::naming::Naming::default()
            },
            mps: Some(MpsDirs::new(Path::new("/run/nvidia/mps"), "nvidia.com/gpu")),
            ..AllocateOptions::default()
        };
        let containers = [
            vec!["g0".to_string(), "g2".into()],
            vec!["g1::1".to_string()],
        ];
        let responses = allocate(&inv, &containers, &options, |_| true)?;
        assert!(!responses[0].envs.contains_key("CUDA_MPS_PIPE_DIRECTORY"));
        assert_eq!(
            responses[1]
                .envs
                .get("CUDA_MPS_PIPE_DIRECTORY")
                .map(String::as_str),
            Some("/mps/nvidia.com/gpu/pipe")
        );
        // Two whole GPUs pass failRequestsGreaterThanOne; a replica with anything else does not.
        let two = [vec!["g1::0".to_string(), "g0".into()]];
        assert!(matches!(
            allocate(&inv, &two, &options, |_| true),
            Err(AllocationError::SharedRequestTooLarge(2))
        ));
        Ok(())
    }

    #[test]
    fn ids_from_a_request_are_echoed_bounded() {
        let huge = "G".repeat(1 << 20);
        let err = alloc(&node(), &[&[huge.as_str()]])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("unknown device ID") && err.contains("(1048576 bytes)"),
            "{}",
            &err[..err.len().min(200)]
        );
        assert!(err.len() < 200, "{} bytes", err.len());
        let many: Vec<String> = (0..1000).map(|i| format!("id-{i}")).collect();
        let line = echoed_ids(&many);
        assert!(
            line.starts_with("id-0,id-1,") && line.ends_with(" and 984 more"),
            "{line}"
        );
        assert_eq!(
            echoed("é".repeat(60).as_str()).len(),
            80 + " (120 bytes)".len() + 3
        );
    }

    #[test]
    fn allocate_refuses_an_unhealthy_device_and_says_why() {
        let mut inv = node();
        fail(&mut inv, "g2");
        let err = alloc(&inv, &[&["g1", "g2"]]).err();
        let Some(AllocationError::UnhealthyDevice { id, reason }) = err else {
            panic!("expected UnhealthyDevice, got {err:?}");
        };
        assert_eq!(id, "g2");
        assert!(reason.contains("XID 79"));
    }

    #[test]
    fn allocate_rejects_unknown_duplicate_and_empty_input() {
        let inv = node();
        assert_eq!(
            alloc(&inv, &[&["g1", "nope"]]).err(),
            Some(AllocationError::UnknownDevice("nope".into()))
        );
        assert_eq!(
            alloc(&inv, &[&["g1"], &["g1"]]).err(),
            Some(AllocationError::DuplicateDevice("g1".into()))
        );
        assert_eq!(alloc(&inv, &[]).err(), Some(AllocationError::NoContainers));
        assert_eq!(
            alloc(&inv, &[&["g1"], &[]]).err(),
            Some(AllocationError::NoDevices(1))
        );
    }

    #[test]
    fn argument_errors_win_over_health_errors() {
        let mut inv = node();
        fail(&mut inv, "g0");
        assert_eq!(
            alloc(&inv, &[&["g0", "nope"]]).err(),
            Some(AllocationError::UnknownDevice("nope".into()))
        );
    }

    fn specs(r: &ContainerAllocateResponse) -> Vec<(&str, &str, &str)> {
        r.devices
            .iter()
            .map(|d| {
                (
                    d.container_path.as_str(),
                    d.host_path.as_str(),
                    d.permissions.as_str(),
                )
            })
            .collect()
    }

    #[test]
    fn an_imex_channel_reaches_every_container_in_each_form_the_response_takes() {
        let options = AllocateOptions {
            envvar: true,
            volume_mounts: false,
            cdi: true,
            cdi_annotations: Some("cdi.k8s.io/".into()),
            device_specs: true,
            dev_root: PathBuf::from("/run/nvidia/driver"),
            imex_channels: vec![0],
            ..AllocateOptions::default()
        };
        let none = |_: &Path| false;
        let responses =
            allocate(&node(), &[ids(&["g1"]), ids(&["g2"])], &options, none).unwrap_or_default();
        assert_eq!(responses.len(), 2);
        for r in &responses {
            assert_eq!(r.envs.get(IMEX_CHANNELS_ENV).map(String::as_str), Some("0"));
            assert!(
                r.cdi_devices
                    .iter()
                    .any(|d| d.name == "nvidia.com/imex-channel=0"),
                "{:?}",
                r.cdi_devices
            );
            assert!(
                r.annotations
                    .values()
                    .any(|v| v.ends_with(",nvidia.com/imex-channel=0")),
                "{:?}",
                r.annotations
            );
            assert_eq!(
                specs(r),
                vec![(
                    "/dev/nvidia-caps-imex-channels/channel0",
                    "/run/nvidia/driver/dev/nvidia-caps-imex-channels/channel0",
                    "rw"
                )]
            );
        }
        let mounts = AllocateOptions {
            envvar: false,
            volume_mounts: true,
            imex_channels: vec![0],
            ..AllocateOptions::default()
        };
        let responses = allocate(&node(), &[ids(&["g1"])], &mounts, none).unwrap_or_default();
        let paths: Vec<&str> = responses[0]
            .mounts
            .iter()
            .map(|m| m.container_path.as_str())
            .collect();
        assert_eq!(
            paths,
            vec![
                "/var/run/nvidia-container-devices/g1",
                "/var/run/nvidia-container-devices/imex/0"
            ]
        );
        // Without channels, nothing of them.
        let plain = allocate(&node(), &[ids(&["g1"])], &AllocateOptions::default(), none)
            .unwrap_or_default();
        assert!(!plain[0].envs.contains_key(IMEX_CHANNELS_ENV));
    }

    #[test]
    fn allocate_adds_cdi_names_and_the_device_nodes_that_exist() {
        let options = AllocateOptions {
            cdi: true,
            device_specs: true,
            ..AllocateOptions::default()
        };
        let present = |p: &Path| p == Path::new("/dev/nvidia3") || p == Path::new("/dev/nvidiactl");
        let responses = allocate(&node(), &[ids(&["g3"])], &options, present).unwrap_or_default();
        let r = &responses[0];
        assert_eq!(
            r.cdi_devices,
            vec![CdiDevice {
                name: "nvidia.com/gpu=g3".into()
            }]
        );
        assert_eq!(
            specs(r),
            vec![
                ("/dev/nvidia3", "/dev/nvidia3", "rw"),
                ("/dev/nvidiactl", "/dev/nvidiactl", "rw")
            ]
        );
    }

    #[test]
    fn host_paths_are_under_the_dev_root_and_existence_is_checked_under_the_host_root_too() {
        // The GPU operator's driver container: device nodes at /run/nvidia/driver/dev on the host, and the
        // host's root mounted at /host in the plugin's pod.
        let options = AllocateOptions {
            device_specs: true,
            dev_root: PathBuf::from("/run/nvidia/driver"),
            host_root: PathBuf::from("/host"),
            ..AllocateOptions::default()
        };
        let checked = std::cell::RefCell::new(Vec::new());
        let present = |p: &Path| {
            checked.borrow_mut().push(p.to_path_buf());
            p == Path::new("/host/run/nvidia/driver/dev/nvidia3")
        };
        let responses = allocate(&node(), &[ids(&["g3"])], &options, present).unwrap_or_default();
        assert_eq!(
            specs(&responses[0]),
            vec![("/dev/nvidia3", "/run/nvidia/driver/dev/nvidia3", "rw")]
        );
        assert!(
            checked
                .borrow()
                .contains(&PathBuf::from("/host/run/nvidia/driver/dev/nvidiactl")),
            "{checked:?}"
        );
    }

    #[test]
    fn pre_start_passes_healthy_devices_and_names_every_unhealthy_or_unknown_one() {
        let mut inv = node();
        assert_eq!(pre_start(&inv, &ids(&["g0", "g1"])), Ok(()));
        fail(&mut inv, "g1");
        let Err(PreStartError::Refused(text)) = pre_start(&inv, &ids(&["g0", "g1", "gone", "g1"]))
        else {
            panic!("a container on an Unhealthy GPU must not start");
        };
        assert!(
            text.starts_with("device g1: XID 79: GPU has fallen off the bus"),
            "{text}"
        );
        assert!(
            text.contains("device gone is not served by this plugin any more"),
            "{text}"
        );
        assert_eq!(text.matches("device g1").count(), 1, "{text}");
        assert!(!text.contains("g0"), "{text}");
    }

    #[test]
    fn a_pre_start_naming_a_million_unknown_devices_is_refused_with_a_bounded_text() {
        let ids: Vec<String> = (0..1_000_000).map(|i| format!("GPU-gone-{i}")).collect();
        let Err(PreStartError::Refused(text)) = pre_start(&node(), &ids) else {
            panic!("refused");
        };
        assert!(text.len() <= MAX_PRE_START_DESCRIPTION);
        assert!(
            text.starts_with("device GPU-gone-0 is not served"),
            "{text}"
        );
    }

    #[test]
    fn a_pre_start_refusal_is_bounded_whatever_the_messages() {
        let mut inv = node();
        for i in 0..8 {
            inv.set_health(
                &format!("g{i}"),
                Health::Unhealthy,
                Some(format!("Unhealthy: {}", "é".repeat(1000))),
            );
        }
        let Err(PreStartError::Refused(text)) = pre_start(&inv, &all()) else {
            panic!("refused");
        };
        assert!(text.len() <= MAX_PRE_START_DESCRIPTION, "{}", text.len());
        assert!(text.starts_with("device g0: Unhealthy: é") && text.ends_with("..."));
    }

    fn prefer(inv: &Inventory, available: &[String], must: &[&str], size: i32) -> Vec<String> {
        let must = ids(must);
        let request = PreferenceRequest {
            available,
            must_include: &must,
            size,
        };
        preferred(inv, &request).unwrap_or_default()
    }

    #[test]
    fn preferred_keeps_a_request_on_one_numa_node() {
        let mut inv = node();
        fail(&mut inv, "g0");
        // Node 0 has three healthy GPUs left, node 1 four: a request for four fits only on node 1.
        assert_eq!(prefer(&inv, &all(), &[], 4), ids(&["g4", "g5", "g6", "g7"]));
        // A request for three fits on node 0 exactly, leaving node 1 whole.
        assert_eq!(prefer(&inv, &all(), &[], 3), ids(&["g1", "g2", "g3"]));
    }

    #[test]
    fn preferred_honours_must_include_and_stays_on_its_node() {
        assert_eq!(
            prefer(&node(), &all(), &["g6"], 3),
            ids(&["g6", "g4", "g5"])
        );
    }

    #[test]
    fn preferred_never_picks_an_unhealthy_device() {
        let mut inv = node();
        for id in ["g0", "g1", "g2", "g4", "g5", "g6"] {
            fail(&mut inv, id);
        }
        assert_eq!(prefer(&inv, &all(), &[], 2), ids(&["g3", "g7"]));
        // Not enough healthy devices: as many as there are, never an unhealthy one.
        assert_eq!(prefer(&inv, &all(), &[], 3), ids(&["g3", "g7"]));
    }

    #[test]
    fn preferred_spans_nodes_only_when_it_must() {
        let chosen = prefer(&node(), &all(), &[], 6);
        assert_eq!(chosen.len(), 6);
        assert_eq!(&chosen[..4], &ids(&["g0", "g1", "g2", "g3"])[..]);
    }

    #[test]
    fn preferred_only_chooses_from_available() {
        let available = ids(&["g1", "g5", "g6"]);
        assert_eq!(prefer(&node(), &available, &[], 2), ids(&["g5", "g6"]));
    }

    #[test]
    fn preferred_rejects_impossible_sizes() {
        let inv = node();
        let must = ids(&["g1", "g2"]);
        let request = PreferenceRequest {
            available: &all(),
            must_include: &must,
            size: 1,
        };
        assert!(matches!(
            preferred(&inv, &request),
            Err(AllocationError::BadSize { .. })
        ));
        for size in [-1, 9, i32::MAX] {
            let request = PreferenceRequest {
                available: &all(),
                must_include: &[],
                size,
            };
            assert!(
                matches!(
                    preferred(&inv, &request),
                    Err(AllocationError::BadSize { .. })
                ),
                "size {size}"
            );
        }
    }
}
