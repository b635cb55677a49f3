//! The fake driver's state: GPUs (created once, alive for the process), event sets, and the fault script
//! follower that turns appended commands into events.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use gpu_device_plugin::devices::script::{self, Command, Follower, Line};

use crate::config::{self, DeviceSpec};
use crate::{code, event_type, nvmlDevice_t, nvmlEventSet_t, nvmlReturn_t};

/// One fake GPU.
pub struct Device {
    pub index: usize,
    pub spec: DeviceSpec,
    lost: AtomicBool,
    recovery_action: AtomicU32,
}

pub type DeviceRef = &'static Device;

impl Device {
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    pub fn recovery_action(&self) -> u32 {
        self.recovery_action.load(Ordering::SeqCst)
    }

    pub fn handle(&'static self) -> nvmlDevice_t {
        std::ptr::from_ref(self).cast_mut().cast()
    }
}

static DEVICES: OnceLock<Result<&'static [Device], String>> = OnceLock::new();

fn load_devices() -> &'static Result<&'static [Device], String> {
    DEVICES.get_or_init(|| {
        let specs = config::load()?;
        let devices: Vec<Device> = specs
            .into_iter()
            .enumerate()
            .map(|(index, spec)| Device {
                index,
                spec,
                lost: AtomicBool::new(false),
                recovery_action: AtomicU32::new(0),
            })
            .collect();
        // Handles are addresses of these records, valid for the life of the process, as NVML's are.
        Ok(Vec::leak(devices))
    })
}

/// `FAKE_NVML_REGISTER_DELAY_MS`: how long each `nvmlDeviceRegisterEvents` takes; unset or unparsable: no
/// delay.
pub fn register_delay() -> Option<Duration> {
    static DELAY: OnceLock<Option<Duration>> = OnceLock::new();
    *DELAY.get_or_init(|| {
        let ms: u64 = std::env::var("FAKE_NVML_REGISTER_DELAY_MS")
            .ok()?
            .trim()
            .parse()
            .ok()?;
        (ms > 0).then(|| Duration::from_millis(ms))
    })
}

struct Library {
    initialized: u32,
    follower: Option<Follower>,
}

static LIBRARY: Mutex<Library> = Mutex::new(Library {
    initialized: 0,
    follower: None,
});

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub fn init() -> nvmlReturn_t {
    let devices = match load_devices() {
        Ok(devices) => *devices,
        Err(e) => {
            eprintln!("fake-nvml: {e}");
            return code::UNKNOWN;
        }
    };
    let mut library = lock(&LIBRARY);
    library.initialized += 1;
    if library.follower.is_none()
        && let Some(path) = std::env::var_os("FAKE_NVML_EVENTS")
    {
        let path = std::path::PathBuf::from(path);
        match script::follow(&path, move |line| on_line(devices, line)) {
            Ok(follower) => library.follower = Some(follower),
            Err(e) => eprintln!(
                "fake-nvml: cannot follow FAKE_NVML_EVENTS {}: {e}",
                path.display()
            ),
        }
    }
    code::SUCCESS
}

pub fn shutdown() -> nvmlReturn_t {
    let mut library = lock(&LIBRARY);
    if library.initialized == 0 {
        return code::UNINITIALIZED;
    }
    library.initialized -= 1;
    if library.initialized == 0 {
        library.follower = None;
    }
    code::SUCCESS
}

pub fn check_init() -> Result<(), nvmlReturn_t> {
    if lock(&LIBRARY).initialized == 0 {
        Err(code::UNINITIALIZED)
    } else {
        Ok(())
    }
}

pub fn devices() -> Result<&'static [Device], nvmlReturn_t> {
    check_init()?;
    match load_devices() {
        Ok(devices) => Ok(devices),
        Err(_) => Err(code::UNINITIALIZED),
    }
}

/// The device behind a handle, checked to be one of ours.
pub fn device(handle: nvmlDevice_t) -> Result<DeviceRef, nvmlReturn_t> {
    devices()?
        .iter()
        .find(|d| d.handle() == handle)
        .ok_or(code::INVALID_ARGUMENT)
}

// ---- events --------------------------------------------------------------------------------------------

/// An event waiting in a set.
#[derive(Debug, Clone, Copy)]
pub enum Pending {
    Event {
        device: usize,
        event_type: u64,
        event_data: u64,
    },
    Lost,
}

/// Events queued per set before the oldest are dropped, so a client that stops waiting cannot make the
/// fake grow without bound.
const QUEUE_LIMIT: usize = 1 << 16;

#[derive(Default)]
pub struct EventSet {
    registrations: Mutex<Vec<(usize, u64)>>,
    queue: Mutex<VecDeque<Pending>>,
    ready: Condvar,
}

static SETS: Mutex<Vec<Arc<EventSet>>> = Mutex::new(Vec::new());

/// A live event set, looked up by handle so a freed or foreign handle is refused, not dereferenced.
pub struct SetRef(Arc<EventSet>);

impl SetRef {
    pub fn from_handle(handle: nvmlEventSet_t) -> Option<SetRef> {
        lock(&SETS)
            .iter()
            .find(|s| Arc::as_ptr(s).cast_mut().cast() == handle)
            .cloned()
            .map(SetRef)
    }

    pub fn register(&self, device: usize, types: u64) {
        lock(&self.0.registrations).push((device, types));
    }

    pub fn wait(&self, timeout: Duration) -> Option<Pending> {
        let queue = lock(&self.0.queue);
        let (mut queue, _) = self
            .0
            .ready
            .wait_timeout_while(queue, timeout, |q| q.is_empty())
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        queue.pop_front()
    }
}

pub fn create_set() -> nvmlEventSet_t {
    let set = Arc::new(EventSet::default());
    let handle = Arc::as_ptr(&set).cast_mut().cast();
    lock(&SETS).push(set);
    handle
}

pub fn free_set(handle: nvmlEventSet_t) -> nvmlReturn_t {
    let mut sets = lock(&SETS);
    let before = sets.len();
    sets.retain(|s| Arc::as_ptr(s).cast_mut().cast() != handle);
    if sets.len() == before {
        code::INVALID_ARGUMENT
    } else {
        code::SUCCESS
    }
}

/// Queues `pending` on every set that registered `device` for any of `types` (any type at all when
/// `types` is 0, as for a lost GPU).
fn deliver(device: usize, types: u64, pending: Pending) {
    for set in lock(&SETS).iter() {
        let wanted = lock(&set.registrations)
            .iter()
            .any(|&(d, mask)| d == device && (types == 0 || mask & types != 0));
        if wanted {
            let mut queue = lock(&set.queue);
            if queue.len() >= QUEUE_LIMIT {
                queue.pop_front();
            }
            queue.push_back(pending);
            set.ready.notify_all();
        }
    }
}

fn on_line(devices: &'static [Device], line: Line<'_>) {
    let (text, appended) = match line {
        Line::Existing(text) => (text, false),
        Line::Appended(text) => (text, true),
    };
    let command = match script::parse_line(text) {
        Ok(Some(command)) => command,
        Ok(None) => return,
        Err(e) => {
            eprintln!("fake-nvml: skipped: {e}");
            return;
        }
    };
    let Some(device) = devices.iter().find(|d| d.spec.uuid == command.uuid()) else {
        eprintln!("fake-nvml: skipped {text:?}: no GPU with that UUID");
        return;
    };
    let index = device.index;
    let event = |event_type, event_data| Pending::Event {
        device: index,
        event_type,
        event_data,
    };
    // Lines already in the file set state (a lost GPU stays lost); only appended lines raise events.
    match command {
        Command::Lost { .. } => {
            device.lost.store(true, Ordering::SeqCst);
            if appended {
                deliver(index, 0, Pending::Lost);
            }
        }
        Command::Restore { .. } => device.lost.store(false, Ordering::SeqCst),
        Command::Action { action, .. } => {
            device.recovery_action.store(action, Ordering::SeqCst);
            if appended {
                deliver(
                    index,
                    event_type::XID_CRITICAL,
                    event(event_type::XID_CRITICAL, 154),
                );
            }
        }
        _ if !appended || device.is_lost() => {}
        Command::Xid { xid, .. } => deliver(
            index,
            event_type::XID_CRITICAL,
            event(event_type::XID_CRITICAL, xid),
        ),
        Command::Dbe { .. } => deliver(
            index,
            event_type::DOUBLE_BIT_ECC,
            event(event_type::DOUBLE_BIT_ECC, 0),
        ),
        Command::Sbe { .. } => deliver(
            index,
            event_type::SINGLE_BIT_ECC,
            event(event_type::SINGLE_BIT_ECC, 0),
        ),
    }
}
