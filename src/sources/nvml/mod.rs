//! The NVML GPU backend: discovers GPUs and turns NVML health events into observations for the health engine.
//!
//! Each GPU has an NVML event set of its own, registered for the critical XID, double-bit and single-bit ECC
//! events the GPU supports, and an OS thread of its own that blocks in `nvmlEventSetWait` on it (a blocking
//! call has no place on the async runtime; one more thread answers probes). One set per GPU because the
//! driver answers GPU_IS_LOST to every wait on a set holding a lost GPU, before or after the events queued
//! in it: a set shared by several GPUs would have to be freed and made again when one is lost or comes back,
//! and the other GPUs' faults queued in it would be lost with it. So a loss stops its own GPU's waits only;
//! its set is kept, not waited on, until the GPU answers again (asked every [`LOST_RECHECK_MS`]), and then
//! waited on again, so that the events queued in it before the loss still arrive. A set is made again only
//! where the driver holds it dead (GPU_IS_LOST while the GPU answers, or every wait failing just after the
//! GPU came back), and only after it is freed, so that no event reaches two sets. The cost: a thread per
//! GPU, each waking once per [`WAIT_TIMEOUT_MS`] when idle. Every thread beats its own [`Beat`] of the
//! source's [`Heartbeat`], so `/healthz` names a GPU whose thread is stuck or whose every wait fails. When
//! NVML cannot be loaded at all, [`UnmonitoredGpus`] can serve the GPUs the driver lists in procfs, marked
//! `unmonitored`, instead.
//!
//! With a MIG strategy, a GPU in MIG mode is served as its MIG devices. Events are still registered on the
//! GPU; an XID attributed to a GPU and compute instance reaches that MIG device only, and anything else on
//! the GPU (an unattributed XID, XID 79, a double-bit ECC error, the GPU lost, its recovery action) every MIG
//! device of it.

mod facts;
pub mod library;
mod raw;

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::{Device, EventSet, Nvml};
use tokio::sync::mpsc;

use crate::devices::DeviceInfo;
use crate::devices::mig::{self, GpuLayout, MigAttributes, MigInfo, MigStrategy, ProfileFacts};
use crate::devices::selection::DraSelection;
use crate::health::{Observation, ProbeResult};
use crate::sources::{Beat, DeviceEvent, DeviceSource, Heartbeat, SourceError};

/// The library name NVIDIA's driver installs.
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// How long one `nvmlEventSetWait` blocks. Events wake it at once; the timeout only bounds how long a GPU's
/// event thread takes to notice that the plugin is stopping, and how often it beats its heartbeat, at the
/// cost of one wake-up per period and GPU when idle.
const WAIT_TIMEOUT_MS: u32 = 2000;

/// Event waits failing in a row (about 0.6 s of tries) after which a GPU counts as `unmonitored`.
const BLIND_AFTER: u32 = 3;

/// How often a lost GPU is asked whether it answers again, so that its events are watched again (by its own
/// event thread, which has nothing else to do meanwhile).
const LOST_RECHECK_MS: u32 = 250;

/// How long start-up waits for the GPUs' event registration. NVML delivers only events that happen after
/// registration, so a GPU listed to the kubelet before it is registered could fail unseen; past this, the
/// plugin serves anyway (a driver this slow is reported) rather than keep every GPU from the node.
const REGISTRATION_WAIT: Duration = Duration::from_secs(10);

/// The events the plugin watches.
fn wanted_events() -> EventTypes {
    EventTypes::CRITICAL_XID_ERROR
        | EventTypes::DOUBLE_BIT_ECC_ERROR
        | EventTypes::SINGLE_BIT_ECC_ERROR
}

/// The directories under a driver root where `libnvidia-ml.so.1` is looked for, in NVIDIA's order.
const LIBRARY_DIRS: [&str; 6] = [
    "usr/lib64",
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "lib64",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
];

/// NVML's library under a driver root mounted at `root` in this container (the GPU operator's driver
/// container, or the host's root): the first of the library directories that holds it, as NVIDIA's plugin looks.
/// `None` for `/` (the dynamic loader finds it there) or when none holds it.
pub fn library_under(root: &Path) -> Option<PathBuf> {
    if root.as_os_str().is_empty() || root == Path::new("/") {
        return None;
    }
    LIBRARY_DIRS
        .iter()
        .map(|dir| root.join(dir).join(DEFAULT_LIBRARY))
        // A regular file (through its links): opening anything else (a FIFO) could block the start.
        .find(|path| path.is_file())
}

/// Where NVML and the kernel's views of the GPUs are found.
#[derive(Debug, Clone)]
pub struct NvmlOptions {
    /// Path or name of `libnvidia-ml.so.1`.
    pub library: PathBuf,
    /// Root of sysfs, for each GPU's NUMA node (`<root>/bus/pci/devices/<bus id>/numa_node`).
    pub sysfs_root: PathBuf,
    /// Root of procfs, for the driver's GPU list when NVML cannot be loaded and its MIG capability minors.
    pub proc_root: PathBuf,
    /// Whether GPUs in MIG mode are served whole or as their MIG devices, through the device plugin.
    pub mig_strategy: MigStrategy,
    /// The GPUs served through DRA, if any: a GPU of them in MIG mode is served as its MIG devices whatever
    /// `mig_strategy` says (DRA has no strategy: NVIDIA's DRA driver publishes a GPU in MIG mode as its MIG
    /// devices, and claims written for it ask for those), and the strategy's rules leave it out.
    pub dra: Option<DraSelection>,
}

impl Default for NvmlOptions {
    fn default() -> Self {
        NvmlOptions {
            library: PathBuf::from(DEFAULT_LIBRARY),
            sysfs_root: PathBuf::from("/sys"),
            proc_root: PathBuf::from("/proc"),
            mig_strategy: MigStrategy::None,
            dra: None,
        }
    }
}

/// NVML could not be used at all.
#[derive(Debug, thiserror::Error)]
pub enum NvmlInitError {
    /// The library could not be loaded.
    #[error(
        "cannot load NVML library {library}: {cause} (is the NVIDIA driver installed and its library mounted into the pod?)"
    )]
    Load {
        /// The library path or name.
        library: String,
        /// The loader's message.
        cause: String,
    },
    /// The library loaded, but initialisation failed.
    #[error("NVML initialisation failed ({library}): {cause}")]
    Init {
        /// The library path or name.
        library: String,
        /// NVML's error.
        cause: String,
    },
}

/// One physical GPU, whose events its event thread watches, and the devices the kubelet sees of it.
#[derive(Debug, Clone, Default)]
struct Watched {
    /// NVML index.
    index: u32,
    /// The GPU's UUID (also for a GPU served as its MIG devices): names its event thread to an operator.
    id: String,
    /// The served devices on it: the GPU itself, or its MIG devices.
    devices: Vec<String>,
    /// Its MIG devices by GPU and compute instance ID, to attribute an event.
    instances: HashMap<(u32, u32), String>,
}

impl Watched {
    /// Whether an event attributed to `instance` names a device served on this GPU (a GPU without MIG devices
    /// has no instances to name).
    fn serves_instance(&self, instance: (u32, u32)) -> bool {
        self.instances.is_empty() || self.instances.contains_key(&instance)
    }

    /// The devices an observation on this GPU reaches: an XID attributed to one of its MIG devices reaches
    /// that one (unless it is about the whole GPU); everything else reaches every device on the GPU.
    fn targets(&self, observation: &Observation, instance: Option<(u32, u32)>) -> &[String] {
        let whole_gpu = matches!(
            observation,
            Observation::Xid(79 | 154) | Observation::DoubleBitEcc | Observation::GpuLost
        );
        match instance {
            Some(instance) if !whole_gpu && !self.instances.is_empty() => {
                match self.instances.get(&instance) {
                    Some(id) => std::slice::from_ref(id),
                    None => &self.devices,
                }
            }
            _ => &self.devices,
        }
    }
}

/// GPUs from NVML.
pub struct NvmlGpus {
    nvml: Nvml,
    options: NvmlOptions,
    /// Each GPU, in discovery order.
    gpus: Vec<Watched>,
    /// GPUs that do not answer at discovery, named from the driver's list: reported lost as soon as the
    /// source starts.
    lost_at_start: Vec<String>,
    /// GPUs that do not answer at discovery and could not be named: not served.
    unidentified: usize,
    /// GPUs found but not served, with why, for the status report.
    unserved: Vec<crate::devices::Unserved>,
    /// Beaten by each GPU's event thread each time round its loop (at least every [`WAIT_TIMEOUT_MS`]).
    heartbeat: Heartbeat,
}

impl NvmlGpus {
    /// Loads and initialises NVML.
    pub fn open(options: NvmlOptions) -> Result<Self, NvmlInitError> {
        let library = crate::util::text::shown(
            &options.library.to_string_lossy(),
            crate::util::text::SHOWN_MAX,
        );
        // Looked at before the loader maps it: a truncated copy is a SIGBUS inside the load, a FIFO a
        // load that never ends.
        library::check(&options.library).map_err(|problem| NvmlInitError::Load {
            library: library.clone(),
            cause: problem.to_string(),
        })?;
        let nvml = Nvml::builder()
            .lib_path(OsStr::new(options.library.as_os_str()))
            .init()
            .map_err(|e| match e {
                NvmlError::LibloadingError(cause) => NvmlInitError::Load {
                    library: library.clone(),
                    cause: cause.to_string(),
                },
                other => NvmlInitError::Init {
                    library: library.clone(),
                    cause: other.to_string(),
                },
            })?;
        tracing::info!(library = %library, "NVML loaded");
        Ok(NvmlGpus {
            nvml,
            options,
            gpus: Vec::new(),
            lost_at_start: Vec::new(),
            unidentified: 0,
            unserved: Vec::new(),
            heartbeat: Heartbeat::default(),
        })
    }
}

impl NvmlGpus {
    /// GPUs present but silent at discovery (`unreadable`, by index): served lost under the UUID the
    /// driver's GPU list gives them, so that the kubelet keeps the device it knows and its recorded
    /// conditions still apply; one the list does not name is not served (counted as unidentified).
    fn serve_silent(&mut self, unreadable: &[u32], found: &mut Vec<DeviceInfo>) {
        if unreadable.is_empty() {
            return;
        }
        // Every GPU that answered, whichever road serves it (the layout holds the device plugin's only).
        let answered_ids: Vec<String> = self.gpus.iter().map(|gpu| gpu.id.clone()).collect();
        let answered: HashSet<&str> = answered_ids.iter().map(String::as_str).collect();
        let driver = driver_gpus(&self.options);
        for (index, named) in name_unreadable(&driver, &answered, unreadable) {
            let Some(mut info) = named else {
                self.unidentified += 1;
                self.unserved.push(crate::devices::Unserved {
                    index: usize::try_from(index).ok(),
                    id: None,
                    why: "does not answer NVML and the driver's GPU list does not name it; served once it answers at a restart".into(),
                });
                tracing::error!(
                    index,
                    "GPU does not answer NVML and the driver's GPU list does not tell which it is; not served until it answers at a restart (its checkpointed conditions are kept)"
                );
                continue;
            };
            // Present but silent: served under its own UUID, lost, so that the kubelet keeps the device
            // it knows and its recorded conditions still apply.
            tracing::error!(index, device = %info.id, "GPU does not answer NVML; named from the driver's information file and served lost");
            info.index = Some(index.to_string());
            self.lost_at_start.push(info.id.clone());
            self.gpus.push(Watched {
                index,
                id: info.id.clone(),
                devices: vec![info.id.clone()],
                ..Watched::default()
            });
            found.push(info);
        }
    }
}

impl DeviceSource for NvmlGpus {
    fn discover(&mut self) -> Result<Vec<DeviceInfo>, SourceError> {
        let count = self
            .nvml
            .device_count()
            .map_err(|e| SourceError::Discovery(format!("NVML cannot count GPUs: {e}")))?;
        let strategy = self.options.mig_strategy;
        let dra = self.options.dra.as_ref();
        let minors = match (strategy, dra) {
            (MigStrategy::None, None) => HashMap::new(),
            _ => mig::read_mig_minors(&self.options.proc_root),
        };
        let system = facts::system(&self.nvml);
        let mut found = Vec::new();
        let mut layout = Vec::new();
        let mut unreadable = Vec::new();
        self.gpus.clear();
        self.unserved.clear();
        for index in 0..count {
            let gpu = self
                .nvml
                .device_by_index(index)
                .and_then(|d| Ok((d.uuid()?, d)));
            let (uuid, device) = match gpu {
                Ok(found) => found,
                Err(e) => {
                    tracing::error!(index, error = %e, "GPU does not answer NVML at discovery");
                    unreadable.push(index);
                    continue;
                }
            };
            let info = describe(
                &self.nvml,
                &device,
                uuid.clone(),
                &self.options.sysfs_root,
                index,
                &system,
            );
            let through_dra = dra.is_some_and(|d| d.serves(&info));
            let mig_enabled = (through_dra || strategy != MigStrategy::None)
                && device.mig_mode().is_ok_and(|m| m.current == MIG_ENABLED);
            // The strategy's rules are the device plugin's: a GPU served through DRA is not in its layout.
            let layout_of = |gpu: GpuLayout| (!through_dra).then_some(gpu);
            if !mig_enabled {
                layout.extend(layout_of(GpuLayout {
                    id: uuid.clone(),
                    mig_enabled: false,
                    migs: Vec::new(),
                }));
                self.gpus.push(Watched {
                    index,
                    id: uuid.clone(),
                    devices: vec![uuid],
                    ..Watched::default()
                });
                found.push(info);
                continue;
            }
            let migs = mig_devices(&self.nvml, &device, index, &info, &minors);
            let mut watched = Watched {
                index,
                id: uuid.clone(),
                ..Watched::default()
            };
            let mut kinds = Vec::new();
            for (mig_info, attributes) in migs {
                if let Some(m) = &mig_info.mig {
                    watched
                        .instances
                        .insert((m.gpu_instance, m.compute_instance), mig_info.id.clone());
                    kinds.push((m.profile.clone(), attributes));
                }
                watched.devices.push(mig_info.id.clone());
                found.push(mig_info);
            }
            if watched.devices.is_empty() {
                if through_dra {
                    tracing::warn!(device = %uuid, "GPU served through DRA has MIG mode on but no MIG devices: it publishes nothing until its instances are created");
                }
                let served_as = if through_dra {
                    "served through DRA, a GPU in MIG mode is published as its MIG devices"
                        .to_string()
                } else {
                    format!("migStrategy {strategy} serves its MIG devices")
                };
                self.unserved.push(crate::devices::Unserved {
                    index: usize::try_from(index).ok(),
                    id: Some(uuid.clone()),
                    why: format!(
                        "MIG mode is on and no MIG device of it can be served ({served_as}, not the whole GPU): create MIG devices, or turn MIG mode off"
                    ),
                });
            }
            layout.extend(layout_of(GpuLayout {
                id: uuid,
                mig_enabled: true,
                migs: kinds,
            }));
            self.gpus.push(watched);
        }
        self.serve_silent(&unreadable, &mut found);
        let warnings = mig::check_layout(strategy, &layout)
            .map_err(|e| SourceError::Discovery(e.to_string()))?;
        for warning in warnings {
            tracing::warn!("{warning}");
        }
        Ok(found)
    }

    fn start(
        self: Box<Self>,
        events: mpsc::Sender<DeviceEvent>,
        probes: mpsc::Receiver<Vec<String>>,
    ) -> Result<(), SourceError> {
        for id in &self.lost_at_start {
            report_at_start(&events, id, Observation::GpuLost);
        }
        let NvmlGpus {
            nvml,
            gpus,
            heartbeat,
            ..
        } = *self;
        let nvml = Arc::new(nvml);
        let gpus = Arc::new(gpus);
        let thread_error =
            |e: std::io::Error| SourceError::Discovery(format!("cannot start an NVML thread: {e}"));
        let (probe_nvml, probe_gpus, probe_events) = (nvml.clone(), gpus.clone(), events.clone());
        // Probes get a thread of their own: the event threads spend their lives blocked in the event wait.
        std::thread::Builder::new()
            .name("nvml-probe".into())
            .spawn(move || answer_probes(&probe_nvml, &probe_gpus, &probe_events, probes))
            .map_err(thread_error)?;
        if gpus.is_empty() {
            tracing::warn!("no GPU can report health events; nothing to watch");
            return Ok(());
        }
        // One event thread per GPU, each on an event set of its own (see `watch_gpu` for why).
        let (registered_tx, registered) = std::sync::mpsc::sync_channel(gpus.len());
        for slot in 0..gpus.len() {
            let beat = heartbeat.waiter(gpus[slot].id.clone());
            let (nvml, gpus, events) = (nvml.clone(), gpus.clone(), events.clone());
            let registered = registered_tx.clone();
            std::thread::Builder::new()
                .name(format!("nvml-gpu-{}", gpus[slot].index))
                .spawn(move || {
                    watch_gpu(&nvml, &gpus[slot], &events, &registered, &beat);
                    beat.retire();
                })
                .map_err(thread_error)?;
        }
        drop(registered_tx);
        // Return, and so let the GPUs be listed, only once their events are being watched. Blocking here is
        // start-up, before anything is served. Nothing reads `events` until this returns, and each event
        // thread sends at most one observation per device of its GPU while registering (a GPU lost at start
        // has one more, sent above): the channel's room (1024) is enough for any node.
        let deadline = std::time::Instant::now() + REGISTRATION_WAIT;
        for waiting in (1..=gpus.len()).rev() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match registered.recv_timeout(left) {
                Ok(()) => {}
                // Every thread has told, or ended.
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    tracing::warn!(
                        waited_s = REGISTRATION_WAIT.as_secs(),
                        gpus = waiting,
                        "NVML event registration is still running; serving the GPUs now, but a fault before \
                         it completes will not be seen"
                    );
                    break;
                }
            }
        }
        tracing::info!(gpus = gpus.len(), "watching NVML health events");
        Ok(())
    }

    fn heartbeat(&self) -> Option<Heartbeat> {
        Some(self.heartbeat.clone())
    }

    fn unidentified(&self) -> usize {
        self.unidentified
    }

    fn unserved(&self) -> Vec<crate::devices::Unserved> {
        self.unserved.clone()
    }

    fn driver_version(&self) -> Option<String> {
        self.nvml.sys_driver_version().ok()
    }
}

/// `NVML_DEVICE_MIG_ENABLE`.
const MIG_ENABLED: u32 = 1;

/// `NVML_GPU_INSTANCE_PROFILE_COUNT`: GPU instance profiles are looked up by index below this.
const GPU_INSTANCE_PROFILES: u32 = 17;

/// The MIG devices of GPU `index` (MIG mode on), each with the attributes `single` compares. A MIG device
/// that does not answer is left out with an error logged: serving it would hand pods a device that cannot
/// be named or watched.
fn mig_devices(
    nvml: &Nvml,
    gpu: &Device<'_>,
    index: u32,
    gpu_info: &DeviceInfo,
    minors: &HashMap<String, u32>,
) -> Vec<(DeviceInfo, MigAttributes)> {
    let slots = gpu.mig_device_count().unwrap_or(0);
    let gpu_memory = gpu.memory_info().map(|m| m.total).unwrap_or(0);
    let gpu_minor = gpu.minor_number().ok();
    let mut found = Vec::new();
    for slot in 0..slots {
        let device = match gpu.mig_device_by_index(slot) {
            Ok(device) => device,
            Err(NvmlError::NotFound) => continue,
            Err(e) => {
                tracing::error!(gpu = %gpu_info.id, slot, error = %e, "MIG device does not answer NVML; not served");
                continue;
            }
        };
        let read = || -> Result<(String, nvml_wrapper::struct_wrappers::device::DeviceAttributes, u32, u32), NvmlError> {
            Ok((
                device.uuid()?,
                device.attributes()?,
                raw::gpu_instance_id(nvml, &device)?,
                raw::compute_instance_id(nvml, &device)?,
            ))
        };
        let (uuid, attributes, gpu_instance, compute_instance) = match read() {
            Ok(read) => read,
            Err(e) => {
                tracing::error!(gpu = %gpu_info.id, slot, error = %e, "MIG device cannot be read through NVML; not served");
                continue;
            }
        };
        // The GPU instance's profile and placement: its profile index names attributes such as media
        // extensions (`+me`); the profile's ID and the placement name the device in a ResourceSlice.
        let instance = raw::gpu_instance_info(nvml, gpu, gpu_instance).ok();
        let found_profile = instance.and_then(|gi| {
            (0..GPU_INSTANCE_PROFILES).find_map(|i| {
                let info = gpu.profile_info(i).ok()?;
                (info.id == gi.profile_id).then_some((i, info))
            })
        });
        let gi_profile = found_profile.as_ref().map(|(i, _)| *i);
        let device_facts = gpu_info.facts.as_deref().map(|gpu_facts| {
            Arc::new(facts::mig(
                gpu_facts,
                instance,
                found_profile.as_ref().map(|(_, info)| info),
                attributes.memory_size_mb,
            ))
        });
        let profile = mig::profile_name(&ProfileFacts {
            gi_profile,
            gpu_slices: attributes.gpu_instance_slice_count,
            compute_slices: attributes.compute_instance_slice_count,
            memory_mb: attributes.memory_size_mb,
            gpu_memory_bytes: gpu_memory,
        });
        let mig = MigInfo {
            parent: gpu_info.id.clone(),
            profile,
            gpu_instance,
            compute_instance,
        };
        let (device_nodes, missing) = mig::device_nodes(minors, gpu_minor, &mig);
        if !missing.is_empty() {
            tracing::warn!(device = %uuid, missing = %missing.join(", "), "MIG capability device nodes not found in the driver's \
                mig-minors (is the host's /proc mounted at --proc-root?); device specs will lack them");
        }
        tracing::info!(device = %uuid, gpu = %gpu_info.id, profile = %mig.profile, gpu_instance, compute_instance, "found MIG device");
        found.push((
            DeviceInfo {
                id: uuid,
                numa_node: gpu_info.numa_node,
                device_nodes,
                index: Some(format!("{index}:{slot}")),
                mig: Some(mig.clone()),
                facts: device_facts,
            },
            MigAttributes {
                multiprocessors: attributes.multiprocessor_count,
                gpu_slices: attributes.gpu_instance_slice_count,
                compute_slices: attributes.compute_instance_slice_count,
                memory_mb: attributes.memory_size_mb,
            },
        ));
    }
    found
}

/// A whole GPU as the plugin serves it, with its facts.
fn describe(
    nvml: &Nvml,
    device: &Device<'_>,
    uuid: String,
    sysfs_root: &Path,
    index: u32,
    system: &facts::SystemFacts,
) -> DeviceInfo {
    let bus_id = device.pci_info().ok().map(|pci| pci.bus_id);
    let numa_node = bus_id
        .as_deref()
        .and_then(|bus_id| numa_node(sysfs_root, bus_id));
    let facts = facts::gpu(nvml, device, bus_id.as_deref(), sysfs_root, system);
    // A value the driver does not give is left out of the line (`Option` fields record nothing when `None`).
    tracing::info!(
        device = %uuid,
        name = facts.product_name.as_deref(),
        index,
        minor = facts.minor,
        numa = numa_node,
        pci = facts.pci_bus_id.as_deref(),
        "found GPU"
    );
    DeviceInfo {
        id: uuid,
        numa_node,
        device_nodes: facts
            .minor
            .map(|m| vec![PathBuf::from(format!("/dev/nvidia{m}"))])
            .unwrap_or_default(),
        index: Some(index.to_string()),
        mig: None,
        facts: Some(Arc::new(facts)),
    }
}

/// The NUMA node of the PCI device `bus_id` (NVML's form, `00000000:17:00.0`), from sysfs; `None` where the
/// kernel does not know (-1) or the file is missing.
pub fn numa_node(sysfs_root: &Path, bus_id: &str) -> Option<i64> {
    let path = sysfs_root
        .join("bus/pci/devices")
        .join(sysfs_bus_id(bus_id))
        .join("numa_node");
    let node: i64 = std::fs::read_to_string(path).ok()?.trim().parse().ok()?;
    (node >= 0).then_some(node)
}

/// NVML writes an 8-digit PCI domain in upper case; sysfs names devices with a 4-digit one in lower case.
fn sysfs_bus_id(bus_id: &str) -> String {
    let lower = bus_id.trim().to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => lower,
    }
}

/// Reports from `start`, which runs on the async runtime's thread and must not block there: the channel is
/// empty at start, so a full one only means far more GPUs than it holds, and the rest stay as they are.
fn report_at_start(events: &mpsc::Sender<DeviceEvent>, id: &str, observation: Observation) -> bool {
    events
        .try_send(DeviceEvent::Observed {
            id: id.to_string(),
            observation,
            at: SystemTime::now(),
        })
        .is_ok()
}

/// Reports from the NVML threads, which may block until the monitor takes the event.
fn observe(events: &mpsc::Sender<DeviceEvent>, id: &str, observation: Observation) -> bool {
    events
        .blocking_send(DeviceEvent::Observed {
            id: id.to_string(),
            observation,
            at: SystemTime::now(),
        })
        .is_ok()
}

/// NVML field id of the driver's recovery action (`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`).
pub const RECOVERY_ACTION_FIELD: u32 = 230;

/// Answers probe requests until the plugin stops: does each GPU answer, and what recovery action does the
/// driver report for it. A MIG device is probed through its GPU, once for all of them in one request.
fn answer_probes(
    nvml: &Nvml,
    gpus: &[Watched],
    events: &mpsc::Sender<DeviceEvent>,
    mut probes: mpsc::Receiver<Vec<String>>,
) {
    while let Some(ids) = probes.blocking_recv() {
        let mut answers: HashMap<u32, ProbeResult> = HashMap::new();
        for id in ids {
            let Some(gpu) = gpus.iter().find(|g| g.devices.contains(&id)) else {
                continue;
            };
            let answer = answers
                .entry(gpu.index)
                .or_insert_with(|| probe(nvml, gpu.index))
                .clone();
            if !observe(events, &id, Observation::Probe(answer)) {
                return;
            }
        }
    }
}

/// Probes one GPU.
pub fn probe(nvml: &Nvml, index: u32) -> ProbeResult {
    let device = nvml
        .device_by_index(index)
        .and_then(|d| d.uuid().map(|_| d));
    match device {
        Ok(device) => ProbeResult::Answered {
            recovery_action: recovery_action(&device),
        },
        Err(NvmlError::GpuLost) => ProbeResult::Lost,
        Err(e) => ProbeResult::Failed(e.to_string()),
    }
}

/// The driver's recovery action for the GPU, or `None` where the driver does not report one.
fn recovery_action(device: &Device<'_>) -> Option<u32> {
    let values = device
        .field_values_for(&[FieldId(RECOVERY_ACTION_FIELD)])
        .ok()?;
    let sample = values.into_iter().next()?.ok()?;
    match sample.value.ok()? {
        SampleValue::U32(v) => Some(v),
        SampleValue::U64(v) => u32::try_from(v).ok(),
        SampleValue::I64(v) => u32::try_from(v).ok(),
        SampleValue::F64(_) => None,
    }
}

/// Watches GPU `gpu`'s events on an event set of its own until the plugin stops (the event channel closes):
/// registers it, says on `registered` that its registration is over (whatever came of it), then forwards
/// each event it gets, follows the GPU through a loss and its return, and beats `beat` each time round.
///
/// One set per GPU, each waited on by a thread of its own, because the driver answers GPU_IS_LOST to every
/// wait on a set that holds a lost GPU, before or after the events queued in it: in a set shared with other
/// GPUs those events would be stuck behind the loss, or lost with the set. Here a loss stops only its own
/// GPU's waits, and no set is ever made again while another holds the same GPU, so no event reaches two sets.
fn watch_gpu(
    nvml: &Nvml,
    gpu: &Watched,
    events: &mpsc::Sender<DeviceEvent>,
    registered: &std::sync::mpsc::SyncSender<()>,
    beat: &Beat,
) {
    let first = register(nvml, gpu, events);
    let _told = registered.try_send(());
    let mut watch = match first {
        Registered::Set(set) => {
            tracing::debug!(gpu = gpu.index, "watching NVML health events");
            Watch::Set(set)
        }
        // Lost at start (or since discovery): watched once it answers.
        Registered::Lost => Watch::Lost(None),
        Registered::Unwatchable => return,
    };
    let mut waiter = Waiter {
        nvml,
        gpu,
        events,
        beat,
        failures: 0,
        stale_losses: 0,
        resumed: false,
        unserved_instances: HashSet::new(),
    };
    while !events.is_closed() {
        beat.beat();
        watch = match watch {
            Watch::Lost(kept) => match waiter.answers_again(kept) {
                Some(next) => next,
                None => return,
            },
            Watch::Set(set) => match waiter.wait(set) {
                Some(next) => next,
                None => return,
            },
        };
    }
    tracing::debug!(gpu = gpu.index, "NVML event thread stopped");
}

/// Where one GPU's watch stands.
enum Watch<'n> {
    /// Waiting on the GPU's event set.
    Set(EventSet<'n>),
    /// The GPU does not answer; asked again every [`LOST_RECHECK_MS`]. Its set, if it had one, is kept (not
    /// waited on) for when it answers: the driver may still hold events raised before the loss in it.
    Lost(Option<EventSet<'n>>),
}

/// A GPU's event set is answered GPU_IS_LOST this many times in a row while the GPU itself answers (or, just
/// after the GPU came back, fails this many waits in a row in any way), and is then made again: the first
/// answers are notices of a loss already over, queued before the events behind them; past a few, the driver
/// holds the set dead, and only a new one can watch the GPU again.
const STALE_LOSSES: u32 = 3;

/// One GPU's event thread, between waits.
struct Waiter<'a, 'n> {
    nvml: &'n Nvml,
    gpu: &'a Watched,
    events: &'a mpsc::Sender<DeviceEvent>,
    beat: &'a Beat,
    /// Event waits failed in a row (not timed out, not GPU_IS_LOST for a lost GPU).
    failures: u32,
    /// GPU_IS_LOST answers in a row while the GPU answers, and failed waits in a row on a set kept through
    /// a loss (see [`STALE_LOSSES`]).
    stale_losses: u32,
    /// The set is the one kept through the GPU's loss, and no wait on it has worked since the GPU came back:
    /// the driver may hold it dead after a reset, so its failures count toward making it again.
    resumed: bool,
    /// MIG instances already warned about as not served.
    unserved_instances: HashSet<(u32, u32)>,
}

impl<'n> Waiter<'_, 'n> {
    /// One wait on the GPU's set and what comes of it; `None` once the plugin stops or the GPU cannot be
    /// watched any more.
    fn wait(&mut self, set: EventSet<'n>) -> Option<Watch<'n>> {
        let waited = raw::wait(self.nvml, &set, WAIT_TIMEOUT_MS);
        if matches!(waited, Ok(_) | Err(NvmlError::Timeout)) {
            self.stale_losses = 0;
            self.resumed = false;
            self.failures = 0;
        }
        // The heartbeat says whether the GPU was reported `unmonitored` because every wait failed.
        if self.beat.is_blind() && matches!(waited, Ok(_) | Err(NvmlError::Timeout)) {
            self.beat.set_blind(false);
            tracing::info!(
                gpu = self.gpu.index,
                "NVML event waits work again; the GPU's events are watched"
            );
            self.tell(&Observation::Monitored)?;
        }
        match waited {
            Ok(event) => {
                self.forward(&event)?;
                Some(Watch::Set(set))
            }
            Err(NvmlError::Timeout) => Some(Watch::Set(set)),
            Err(NvmlError::GpuLost) if is_lost(self.nvml, self.gpu.index) => {
                self.failures = 0;
                self.stale_losses = 0;
                self.resumed = false;
                for id in &self.gpu.devices {
                    tracing::error!(device = %id, "GPU is lost");
                }
                self.tell(&Observation::GpuLost)?;
                Some(Watch::Lost(Some(set)))
            }
            Err(e) => {
                let stale_loss = matches!(e, NvmlError::GpuLost);
                if !stale_loss && !self.resumed {
                    self.failed(&e)?;
                    return Some(Watch::Set(set));
                }
                self.stale_losses += 1;
                if self.stale_losses == 1 {
                    tracing::warn!(
                        gpu = self.gpu.index,
                        error = %e,
                        "NVML event wait fails on the GPU's event set, yet the GPU answers"
                    );
                }
                if self.stale_losses < STALE_LOSSES {
                    // A queued notice of a loss already over is answered at once, with the events behind it:
                    // wait again now. Any other failure is paced as usual.
                    if !stale_loss {
                        self.failed(&e)?;
                    }
                    return Some(Watch::Set(set));
                }
                // The driver holds the set dead: free it before making another, so that no event reaches
                // both. Paced, and counted as failing waits, in case every new set is answered the same.
                self.stale_losses = 0;
                self.resumed = false;
                drop(set);
                tracing::warn!(
                    gpu = self.gpu.index,
                    error = %e,
                    "the GPU's event set keeps failing while the GPU answers; it is made again"
                );
                self.failed(&e)?;
                self.registered(register(self.nvml, self.gpu, self.events))
            }
        }
    }

    /// A wait failed at once: says so once, reports the GPU `unmonitored` after [`BLIND_AFTER`] in a row, and
    /// paces the retries (a wait that fails at once would spin).
    fn failed(&mut self, e: &NvmlError) -> Option<()> {
        self.failures += 1;
        if self.failures == 1 {
            tracing::error!(gpu = self.gpu.index, error = %e, "NVML event wait failed");
        }
        if self.failures == BLIND_AFTER && !self.beat.is_blind() {
            // Nothing watches the GPU now: say so on each of its devices until a wait works again.
            self.beat.set_blind(true);
            tracing::error!(gpu = self.gpu.index, error = %e, failures = self.failures, "every NVML event wait fails; the GPU's health events are not watched");
            self.tell(&Observation::Unmonitored(format!(
                "the NVML event wait fails on every call: {e}"
            )))?;
        }
        std::thread::sleep(retry_pause(self.failures));
        Some(())
    }

    /// A lost GPU, asked again after [`LOST_RECHECK_MS`]: watched on its kept set (whose queued events then
    /// come first) or on a new one once it answers.
    fn answers_again(&mut self, kept: Option<EventSet<'n>>) -> Option<Watch<'n>> {
        std::thread::sleep(Duration::from_millis(u64::from(LOST_RECHECK_MS)));
        if !answers(self.nvml, self.gpu.index) {
            return Some(Watch::Lost(kept));
        }
        let next = match kept {
            Some(set) => {
                self.resumed = true;
                Watch::Set(set)
            }
            None => self.registered(register(self.nvml, self.gpu, self.events))?,
        };
        if matches!(next, Watch::Set(_)) {
            tracing::info!(
                gpu = self.gpu.index,
                "lost GPU answers again; its events are watched again"
            );
        }
        Some(next)
    }

    /// What a registration leaves to watch.
    fn registered(&self, registration: Registered<'n>) -> Option<Watch<'n>> {
        match registration {
            Registered::Set(set) => Some(Watch::Set(set)),
            // Lost again between answering and registering.
            Registered::Lost => Some(Watch::Lost(None)),
            Registered::Unwatchable => None,
        }
    }

    /// Hands an event's observations to the monitor, each to the devices it reaches; `None` once the plugin
    /// stops.
    fn forward(&mut self, event: &raw::Event) -> Option<()> {
        let gpu = self.gpu;
        let instance = (event.gpu_instance != u32::MAX)
            .then_some((event.gpu_instance, event.compute_instance));
        if let Some((gi, ci)) = instance
            && !gpu.serves_instance((gi, ci))
            && self.unserved_instances.insert((gi, ci))
        {
            tracing::warn!(
                gpu = gpu.index,
                gpu_instance = gi,
                compute_instance = ci,
                "NVML event for a MIG instance this plugin does not serve; its events count against every MIG \
                 device of its GPU"
            );
        }
        for observation in observations(event.event_type, event.data) {
            for id in gpu.targets(&observation, instance) {
                observe(self.events, id, observation.clone()).then_some(())?;
            }
        }
        Some(())
    }

    /// Tells every device on the GPU; `None` once the plugin stops.
    fn tell(&self, observation: &Observation) -> Option<()> {
        for id in &self.gpu.devices {
            observe(self.events, id, observation.clone()).then_some(())?;
        }
        Some(())
    }
}

/// How long to wait before the `failures`-th wait in a row that failed at once is tried again: 100 ms more
/// each time, at most 5 s.
fn retry_pause(failures: u32) -> Duration {
    Duration::from_millis(100 * u64::from(failures.min(50)))
}

/// Whether GPU `index` says it is lost (GPU_IS_LOST): only then does a wait's GPU_IS_LOST mean this GPU fell
/// off the bus; any other answer leaves the wait's error to say what is wrong.
fn is_lost(nvml: &Nvml, index: u32) -> bool {
    matches!(
        nvml.device_by_index(index).and_then(|d| d.uuid()),
        Err(NvmlError::GpuLost)
    )
}

/// Whether lost GPU `index` answers again: it can be opened and names itself. A GPU still coming back (any
/// error) stays lost and is asked again, rather than being registered and given up on as unwatchable.
fn answers(nvml: &Nvml, index: u32) -> bool {
    nvml.device_by_index(index).and_then(|d| d.uuid()).is_ok()
}

/// What [`register`] made of one GPU.
enum Registered<'n> {
    /// Its own event set, registered for every health event it supports.
    Set(EventSet<'n>),
    /// It does not answer (GPU_IS_LOST): watched once it does.
    Lost,
    /// It cannot be watched; its devices were reported `unmonitored`.
    Unwatchable,
}

/// Creates an event set for GPU `gpu` alone and registers it for the health events it supports. A GPU that
/// cannot be registered is reported `unmonitored` (every device on it).
fn register<'n>(
    nvml: &'n Nvml,
    gpu: &Watched,
    events: &mpsc::Sender<DeviceEvent>,
) -> Registered<'n> {
    let unmonitored = |why: String| {
        for id in &gpu.devices {
            observe(events, id, Observation::Unmonitored(why.clone()));
        }
        Registered::Unwatchable
    };
    let (device, mask) = match watchable_events(nvml, gpu.index) {
        Ok(found) => found,
        Err(Unwatchable::Lost) => return Registered::Lost,
        Err(Unwatchable::Other(why)) => return unmonitored(why),
    };
    if mask != wanted_events() {
        tracing::info!(gpu = gpu.index, watched = ?mask, "GPU supports only some health events");
    }
    let set = match nvml.create_event_set() {
        Ok(set) => set,
        Err(e) => {
            tracing::error!(gpu = gpu.index, error = %e, "NVML cannot create an event set; the GPU's events are not watched");
            return unmonitored(format!("NVML cannot create an event set: {e}"));
        }
    };
    match device.register_events(mask, set) {
        Ok(set) => Registered::Set(set),
        Err(e) if matches!(e.error, NvmlError::GpuLost) => Registered::Lost,
        Err(e) => unmonitored(format!("NVML refused the event registration: {}", e.error)),
    }
}

/// Why a GPU's events cannot be watched.
enum Unwatchable {
    /// It does not answer (GPU_IS_LOST): watched again when it does.
    Lost,
    /// Anything else, in words.
    Other(String),
}

/// GPU `index` and the health events it can report, or why it cannot be watched.
fn watchable_events(nvml: &Nvml, index: u32) -> Result<(Device<'_>, EventTypes), Unwatchable> {
    let device = nvml.device_by_index(index).map_err(|e| match e {
        NvmlError::GpuLost => Unwatchable::Lost,
        e => Unwatchable::Other(format!("NVML cannot open the GPU: {e}")),
    })?;
    let supported = device.supported_event_types().map_err(|e| match e {
        NvmlError::GpuLost => Unwatchable::Lost,
        e => Unwatchable::Other(format!("NVML cannot list its event types: {e}")),
    })?;
    let mask = supported & wanted_events();
    if mask.is_empty() {
        return Err(Unwatchable::Other(
            "it supports none of the XID and ECC events".into(),
        ));
    }
    Ok((device, mask))
}

/// The observations one NVML event carries (`event_type` bits, `data` the XID of an XID event).
fn observations(event_type: u64, data: u64) -> Vec<Observation> {
    let event_type = EventTypes::from_bits_truncate(event_type);
    let mut found = Vec::new();
    if event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
        // NVML reports 999 when it could not tell the XID; the policy treats an unknown XID as one needing
        // a reset.
        found.push(Observation::Xid(data));
    }
    if event_type.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
        found.push(Observation::DoubleBitEcc);
    }
    if event_type.contains(EventTypes::SINGLE_BIT_ECC_ERROR) {
        found.push(Observation::SingleBitEcc);
    }
    found
}

/// GPUs the driver lists in `<proc>/driver/nvidia/gpus/*/information`, served `unmonitored` when NVML cannot
/// be loaded and `--fail-on-init-error=false`: they stay allocatable, and the logs say their health is not
/// watched.
pub struct UnmonitoredGpus {
    devices: Vec<DeviceInfo>,
    why: String,
}

impl UnmonitoredGpus {
    /// Reads the driver's GPU list; `why` says why NVML is not used.
    pub fn from_procfs(options: &NvmlOptions, why: String) -> Self {
        UnmonitoredGpus {
            devices: driver_gpus(options),
            why,
        }
    }
}

/// The GPUs the driver lists in `<proc>/driver/nvidia/gpus/<bus id>/information`, in PCI bus order (the
/// order NVML numbers them in). A GPU whose file cannot be read or does not name a UUID is left out, with a
/// warning.
fn driver_gpus(options: &NvmlOptions) -> Vec<DeviceInfo> {
    let dir = options.proc_root.join("driver/nvidia/gpus");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut entries: Vec<_> = entries.flatten().map(|e| e.path()).collect();
    entries.sort();
    let driver_version = facts::procfs_driver_version(&options.proc_root);
    let mut devices = Vec::new();
    for entry in entries {
        let file = entry.join("information");
        let text = match std::fs::read_to_string(&file) {
            Ok(text) => text,
            Err(e) => {
                tracing::warn!(file = %file.display(), error = %e, "cannot read the driver's GPU information; that GPU is left out");
                continue;
            }
        };
        let Some(mut info) = parse_information(&text) else {
            tracing::warn!(file = %file.display(), "the driver's GPU information names no GPU UUID; that GPU is left out");
            continue;
        };
        let bus_id = entry
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        info.numa_node = numa_node(&options.sysfs_root, &bus_id);
        if let Some(found) = info.facts.as_mut() {
            let found = Arc::make_mut(found);
            // The directory is named for the GPU's address where the file does not say it.
            found.pci_bus_id = found
                .pci_bus_id
                .take()
                .or_else(|| crate::devices::facts::pci_bus_id(&bus_id));
            found.pcie_root = found
                .pci_bus_id
                .as_deref()
                .and_then(|id| facts::pcie_root(&options.sysfs_root, id));
            found.driver_version.clone_from(&driver_version);
        }
        devices.push(info);
    }
    devices
}

/// Names the GPUs NVML counts but cannot open (`unreadable`, NVML indices in order) from the driver's list:
/// the GPUs the driver lists that no answering GPU is, taken in bus order as NVML numbers them. Only when
/// the two counts agree is the pairing certain; otherwise none is named.
fn name_unreadable(
    driver: &[DeviceInfo],
    answered: &HashSet<&str>,
    unreadable: &[u32],
) -> Vec<(u32, Option<DeviceInfo>)> {
    let silent: Vec<&DeviceInfo> = driver
        .iter()
        .filter(|gpu| !answered.contains(gpu.id.as_str()))
        .collect();
    if silent.len() != unreadable.len() {
        return unreadable.iter().map(|&index| (index, None)).collect();
    }
    unreadable
        .iter()
        .zip(silent)
        .map(|(&index, gpu)| (index, Some(gpu.clone())))
        .collect()
}

/// The UUID, minor number, model and bus location from a driver `information` file (`GPU UUID:`, `Device
/// Minor:`, `Model:`, `Bus Location:` lines).
fn parse_information(text: &str) -> Option<DeviceInfo> {
    let field = |name: &str| {
        text.lines().find_map(|l| {
            l.strip_prefix(name)
                .map(|v| v.trim_start_matches(':').trim().to_string())
        })
    };
    // A GPU the driver has not initialised shows question marks where its UUID would be.
    let uuid = field("GPU UUID").filter(|u| !u.is_empty() && !u.contains('?'))?;
    let minor = field("Device Minor").and_then(|m| m.parse::<u32>().ok());
    let facts = crate::devices::facts::DeviceFacts {
        minor,
        product_name: field("Model").filter(|m| !m.is_empty()),
        pci_bus_id: field("Bus Location")
            .as_deref()
            .and_then(crate::devices::facts::pci_bus_id),
        ..Default::default()
    };
    Some(DeviceInfo {
        id: uuid,
        numa_node: None,
        device_nodes: minor
            .map(|m| vec![PathBuf::from(format!("/dev/nvidia{m}"))])
            .unwrap_or_default(),
        facts: Some(Arc::new(facts)),
        ..DeviceInfo::default()
    })
}

impl DeviceSource for UnmonitoredGpus {
    fn discover(&mut self) -> Result<Vec<DeviceInfo>, SourceError> {
        if self.devices.is_empty() {
            tracing::warn!("NVML is unavailable and the driver lists no GPUs; serving none");
        }
        Ok(self.devices.clone())
    }

    fn start(
        self: Box<Self>,
        events: mpsc::Sender<DeviceEvent>,
        probes: mpsc::Receiver<Vec<String>>,
    ) -> Result<(), SourceError> {
        // Without NVML nothing can be probed: closing the channel tells the monitor so (it drops requests to
        // a closed channel), and an unmonitored GPU has nothing that waits for a probe anyway.
        drop(probes);
        for device in &self.devices {
            if !report_at_start(
                &events,
                &device.id,
                Observation::Unmonitored(self.why.clone()),
            ) {
                break;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_is_found_under_a_driver_root_in_nvidias_order() -> std::io::Result<()> {
        let root = tempfile::tempdir()?;
        assert_eq!(library_under(root.path()), None);
        assert_eq!(library_under(Path::new("/")), None);
        for dir in ["lib/x86_64-linux-gnu", "usr/lib64"] {
            std::fs::create_dir_all(root.path().join(dir))?;
            std::fs::write(root.path().join(dir).join(DEFAULT_LIBRARY), b"")?;
        }
        assert_eq!(
            library_under(root.path()),
            Some(root.path().join("usr/lib64").join(DEFAULT_LIBRARY))
        );
        // Not a regular file: passed over, never opened.
        std::fs::remove_file(root.path().join("usr/lib64").join(DEFAULT_LIBRARY))?;
        std::fs::create_dir(root.path().join("usr/lib64").join(DEFAULT_LIBRARY))?;
        assert_eq!(
            library_under(root.path()),
            Some(
                root.path()
                    .join("lib/x86_64-linux-gnu")
                    .join(DEFAULT_LIBRARY)
            )
        );
        Ok(())
    }

    #[test]
    fn sysfs_bus_ids_have_a_short_lower_case_domain() {
        assert_eq!(sysfs_bus_id("00000000:17:00.0"), "0000:17:00.0");
        assert_eq!(sysfs_bus_id("0000:AB:00.0"), "0000:ab:00.0");
    }

    #[test]
    fn numa_node_comes_from_sysfs_and_minus_one_means_unknown()
    -> Result<(), Box<dyn std::error::Error>> {
        let root = tempfile::tempdir()?;
        let dev = root.path().join("bus/pci/devices/0000:17:00.0");
        std::fs::create_dir_all(&dev)?;
        std::fs::write(dev.join("numa_node"), "1\n")?;
        assert_eq!(numa_node(root.path(), "00000000:17:00.0"), Some(1));
        std::fs::write(dev.join("numa_node"), "-1\n")?;
        assert_eq!(numa_node(root.path(), "00000000:17:00.0"), None);
        assert_eq!(numa_node(root.path(), "00000000:99:00.0"), None);
        Ok(())
    }

    fn driver_gpu(id: &str) -> DeviceInfo {
        DeviceInfo {
            id: id.into(),
            ..DeviceInfo::default()
        }
    }

    #[test]
    fn silent_gpus_are_named_from_the_drivers_list_only_when_the_pairing_is_certain() {
        let driver = [
            driver_gpu("GPU-a"),
            driver_gpu("GPU-b"),
            driver_gpu("GPU-c"),
            driver_gpu("GPU-d"),
        ];
        let answered = HashSet::from(["GPU-a", "GPU-c"]);
        let named: Vec<_> = name_unreadable(&driver, &answered, &[1, 3])
            .into_iter()
            .map(|(index, info)| (index, info.map(|i| i.id)))
            .collect();
        assert_eq!(
            named,
            [
                (1, Some("GPU-b".to_string())),
                (3, Some("GPU-d".to_string()))
            ]
        );
        // The driver lists one GPU fewer than NVML cannot read: which is which is unknown.
        let named = name_unreadable(&driver[..3], &answered, &[1, 3]);
        assert!(named.iter().all(|(_, info)| info.is_none()), "{named:?}");
        // No driver list at all (procfs not mounted).
        assert!(name_unreadable(&[], &answered, &[2])[0].1.is_none());
    }

    #[test]
    fn driver_information_file_gives_uuid_and_device_node() {
        let text = "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 42\nGPU UUID: \t GPU-1234\nBus Location: \t 0000:AB:00.0\nDevice Minor: \t 3\n";
        let info = parse_information(text);
        assert_eq!(info.as_ref().map(|i| i.id.as_str()), Some("GPU-1234"));
        let facts = info.as_ref().and_then(|i| i.facts.as_deref());
        assert_eq!(
            facts.map(|f| (f.minor, f.product_name.as_deref(), f.pci_bus_id.as_deref())),
            Some((Some(3), Some("NVIDIA H100 80GB HBM3"), Some("0000:ab:00.0")))
        );
        assert_eq!(
            info.map(|i| i.device_nodes),
            Some(vec![PathBuf::from("/dev/nvidia3")])
        );
        let uninitialised =
            "GPU UUID: \t GPU-????????-????-????-????-????????????\nDevice Minor: \t 3\n";
        assert!(parse_information(uninitialised).is_none());
        assert!(parse_information("GPU UUID: \t \n").is_none());
    }

    #[test]
    fn gpus_the_driver_lists_carry_its_facts_and_sysfs_placement()
    -> Result<(), Box<dyn std::error::Error>> {
        let root = tempfile::tempdir()?;
        let options = NvmlOptions {
            proc_root: root.path().join("proc"),
            sysfs_root: root.path().join("sys"),
            ..NvmlOptions::default()
        };
        let gpus = options.proc_root.join("driver/nvidia/gpus");
        // The second GPU's file has no bus location: its directory names it.
        for (dir, text) in [
            (
                "0000:17:00.0",
                "Model: \t NVIDIA H100 80GB HBM3\nGPU UUID: \t GPU-a\nBus Location: \t 0000:17:00.0\nDevice Minor: \t 0\n",
            ),
            ("0000:2a:00.0", "GPU UUID: \t GPU-b\nDevice Minor: \t 1\n"),
        ] {
            std::fs::create_dir_all(gpus.join(dir))?;
            std::fs::write(gpus.join(dir).join("information"), text)?;
        }
        std::fs::write(
            options.proc_root.join("driver/nvidia/version"),
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 06:54:38 UTC 2025\n",
        )?;
        let links = options.sysfs_root.join("bus/pci/devices");
        std::fs::create_dir_all(&links)?;
        std::os::unix::fs::symlink(
            "../../../devices/pci0000:16/0000:16:01.0/0000:17:00.0",
            links.join("0000:17:00.0"),
        )?;
        let found = driver_gpus(&options);
        let facts: Vec<_> = found
            .iter()
            .map(|d| d.facts.as_deref().cloned().unwrap_or_default())
            .collect();
        assert_eq!(
            facts,
            [
                crate::devices::facts::DeviceFacts {
                    minor: Some(0),
                    product_name: Some("NVIDIA H100 80GB HBM3".into()),
                    pci_bus_id: Some("0000:17:00.0".into()),
                    pcie_root: Some("pci0000:16".into()),
                    driver_version: Some("580.65.06".into()),
                    ..Default::default()
                },
                crate::devices::facts::DeviceFacts {
                    minor: Some(1),
                    pci_bus_id: Some("0000:2a:00.0".into()),
                    driver_version: Some("580.65.06".into()),
                    ..Default::default()
                },
            ]
        );
        Ok(())
    }

    #[test]
    fn an_event_carries_the_observations_of_its_type_bits() {
        let xid = EventTypes::CRITICAL_XID_ERROR.bits();
        assert_eq!(observations(xid, 79), vec![Observation::Xid(79)]);
        assert_eq!(observations(xid, 999), vec![Observation::Xid(999)]);
        assert_eq!(
            observations(EventTypes::DOUBLE_BIT_ECC_ERROR.bits(), 0),
            vec![Observation::DoubleBitEcc]
        );
    }

    fn mig_gpu() -> Watched {
        Watched {
            index: 0,
            id: "GPU-a".into(),
            devices: vec!["MIG-a".into(), "MIG-b".into()],
            instances: HashMap::from([((1, 0), "MIG-a".into()), ((2, 0), "MIG-b".into())]),
        }
    }

    #[test]
    fn an_attributed_xid_reaches_its_mig_device_and_a_gpu_fault_reaches_all() {
        let gpu = mig_gpu();
        assert_eq!(gpu.targets(&Observation::Xid(48), Some((2, 0))), ["MIG-b"]);
        assert_eq!(gpu.targets(&Observation::Xid(48), None), ["MIG-a", "MIG-b"]);
        assert_eq!(
            gpu.targets(&Observation::Xid(79), Some((2, 0))),
            ["MIG-a", "MIG-b"],
            "XID 79 is the whole GPU's, wherever NVML attributes it"
        );
        assert_eq!(
            gpu.targets(&Observation::DoubleBitEcc, Some((1, 0))),
            ["MIG-a", "MIG-b"]
        );
        assert_eq!(
            gpu.targets(&Observation::Xid(48), Some((9, 0))),
            ["MIG-a", "MIG-b"],
            "an instance not served counts against the whole GPU"
        );
    }
}
