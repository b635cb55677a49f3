//! The fake driver's state: GPUs (created once, alive for the process), event sets, and the fault script
//! feed that turns appended commands into events.
//!
//! No thread of the fake's own reads the fault script. As the real driver wakes the thread waiting in
//! `nvmlEventSetWait` straight from the kernel, the waiting thread here reads the script itself: it blocks in
//! `poll` on an inotify watch of the file, so an appended line costs the client one thread wake-up, as a
//! real event does. One waiter reads at a time; others wait for their own set's queue, and an event wakes only
//! the waiters of the sets it is queued in (the driver wakes no other), so one set per GPU costs a client no
//! more than one shared set: at most one more wake-up, when the event is read by another set's waiter. Every
//! other call that
//! reads a GPU's state first takes in whatever was appended meanwhile without blocking, so a GPU lost in the
//! script is lost to every caller at once, waiting or not.

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use gpu_device_plugin::sources::script::{self, Command, Line, Tail};
use inotify::{Inotify, WatchMask};

use crate::config::{self, DeviceSpec, MigSpec};
use crate::{code, event_type, nvmlDevice_t, nvmlEventSet_t, nvmlReturn_t};

/// One fake GPU.
pub struct Device {
    pub index: usize,
    pub spec: DeviceSpec,
    /// Its MIG devices, in the order NVML lists them (empty with MIG mode off).
    pub migs: Vec<MigDevice>,
    lost: AtomicBool,
    recovery_action: AtomicU32,
}

/// One MIG device; its handle is the address of this record, as a GPU's is.
pub struct MigDevice {
    pub spec: MigSpec,
}

impl MigDevice {
    pub fn handle(&'static self) -> nvmlDevice_t {
        std::ptr::from_ref(self).cast_mut().cast()
    }
}

/// What a device handle names.
#[derive(Clone, Copy)]
pub enum Handle {
    Gpu(DeviceRef),
    Mig(DeviceRef, &'static MigDevice),
}

impl Handle {
    /// The physical GPU: itself, or a MIG device's parent.
    pub fn gpu(self) -> DeviceRef {
        match self {
            Handle::Gpu(gpu) | Handle::Mig(gpu, _) => gpu,
        }
    }
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
                migs: spec
                    .mig
                    .iter()
                    .flatten()
                    .map(|m| MigDevice { spec: m.clone() })
                    .collect(),
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

/// `FAKE_NVML_LOST_FIRST=1`: a wait on a set holding a lost GPU answers `GPU_IS_LOST` at once, before the
/// events queued in the set (they stay queued), as the real driver may; unset or anything else: the queued
/// events come first.
pub fn lost_first() -> bool {
    static LOST_FIRST: OnceLock<bool> = OnceLock::new();
    *LOST_FIRST.get_or_init(|| std::env::var("FAKE_NVML_LOST_FIRST").is_ok_and(|v| v.trim() == "1"))
}

/// `nvmlInit` calls not yet matched by `nvmlShutdown`. Held only for a count and, at the first `nvmlInit`,
/// for opening the fault script: never across a wait, so `nvmlInit` and `nvmlShutdown` answer at once while
/// another thread waits in `nvmlEventSetWait`, as the real library's do (its documentation: "NVML is
/// thread-safe so it is safe to make simultaneous NVML calls from multiple threads").
static INITIALIZED: Mutex<u32> = Mutex::new(0);

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
    let mut initialized = lock(&INITIALIZED);
    *initialized += 1;
    let mut feed = lock(&FEED);
    if feed.is_none()
        && let Some(path) = std::env::var_os("FAKE_NVML_EVENTS")
    {
        let path = std::path::PathBuf::from(path);
        match Feed::open(&path, devices) {
            Ok(opened) => {
                *feed = Some(opened);
                // Waits that began while nothing was followed take the reader's turn now.
                let mut events = lock(&EVENTS);
                events.following = true;
                for set in &events.sets {
                    set.wake.notify_all();
                }
            }
            Err(e) => eprintln!(
                "fake-nvml: cannot follow FAKE_NVML_EVENTS {}: {e}",
                path.display()
            ),
        }
    }
    code::SUCCESS
}

/// Reference-counted, as NVML documents: only the call that matches the last `nvmlInit` shuts the library
/// down, and it stops following the fault script. A wait in progress then takes in nothing more of the
/// script and ends as NVML documents a wait to end (README, "Threads").
pub fn shutdown() -> nvmlReturn_t {
    let mut initialized = lock(&INITIALIZED);
    if *initialized == 0 {
        return code::UNINITIALIZED;
    }
    *initialized -= 1;
    if *initialized == 0 {
        *lock(&FEED) = None;
        lock(&EVENTS).following = false;
    }
    code::SUCCESS
}

pub fn check_init() -> Result<(), nvmlReturn_t> {
    if *lock(&INITIALIZED) == 0 {
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

/// The device behind a handle, checked to be one of ours, with the fault script taken in up to now.
pub fn device(handle: nvmlDevice_t) -> Result<DeviceRef, nvmlReturn_t> {
    let device = devices()?
        .iter()
        .find(|d| d.handle() == handle)
        .ok_or(code::INVALID_ARGUMENT)?;
    catch_up();
    Ok(device)
}

/// The GPU or MIG device behind a handle, checked to be one of ours, with the fault script taken in.
pub fn handle(handle: nvmlDevice_t) -> Result<Handle, nvmlReturn_t> {
    let devices = devices()?;
    let found = devices
        .iter()
        .find(|d| d.handle() == handle)
        .map(Handle::Gpu)
        .or_else(|| {
            devices.iter().find_map(|d| {
                d.migs
                    .iter()
                    .find(|m| m.handle() == handle)
                    .map(|m| Handle::Mig(d, m))
            })
        })
        .ok_or(code::INVALID_ARGUMENT)?;
    catch_up();
    Ok(found)
}

// ---- the fault script ------------------------------------------------------------------------------

/// The fault script being followed.
struct Feed {
    tail: Tail,
    inotify: Inotify,
    /// A second descriptor of the inotify instance, for the reader's `poll`: the reader waits on it with no
    /// lock held, so that `nvmlInit`, `nvmlShutdown` and queries never wait for a reader's wait to end.
    ready: Arc<OwnedFd>,
    /// Which opening of the script this is: a reader that polled an earlier one (shut down meanwhile) takes
    /// in nothing from the one that replaced it.
    generation: u64,
    devices: &'static [Device],
}

/// The script followed while the library is initialised. Every holder of this lock only reads what is
/// already in the file, never waits: the waiting is done on [`Feed::ready`] outside it.
static FEED: Mutex<Option<Feed>> = Mutex::new(None);

impl Feed {
    /// Watches the file, then takes in the lines already there as history.
    fn open(path: &std::path::Path, devices: &'static [Device]) -> std::io::Result<Feed> {
        static OPENED: AtomicU64 = AtomicU64::new(0);
        let mut tail = Tail::open(path)?;
        let inotify = Inotify::init()?;
        // Watch before the first read, so that nothing appended in between is missed.
        inotify.watches().add(path, WatchMask::MODIFY)?;
        let ready = Arc::new(inotify.as_fd().try_clone_to_owned()?);
        tail.read_lines(|l| on_line(devices, Line::Existing(l)))?;
        Ok(Feed {
            tail,
            inotify,
            ready,
            generation: OPENED.fetch_add(1, Ordering::Relaxed),
            devices,
        })
    }

    /// Takes in what was appended since the last read, without waiting; whether the file was written. The
    /// file is read only when inotify says it was written since: most calls cost one `read` of the watch and
    /// nothing more.
    fn read(&mut self) -> bool {
        if !self.written() {
            return false;
        }
        let devices = self.devices;
        if let Err(e) = self
            .tail
            .read_lines(|l| on_line(devices, Line::Appended(l)))
        {
            eprintln!("fake-nvml: cannot read FAKE_NVML_EVENTS: {e}");
        }
        true
    }

    /// Empties the watch's queue; whether it held anything. A write after this raises a new notification,
    /// so every write is either read next or announced again.
    fn written(&mut self) -> bool {
        let mut buffer = [0u8; 1024];
        let mut any = false;
        while let Ok(mut events) = self.inotify.read_events(&mut buffer) {
            any |= events.next().is_some();
        }
        any
    }
}

/// What the reader found in the script before waiting.
enum Script {
    /// Lines written before the wait, now taken in: the queues may hold something for the waiter.
    Taken,
    /// Nothing new: wait on this opening's inotify descriptor.
    Quiet(u64, Arc<OwnedFd>),
    /// No script followed (the library shut down since the turn was taken).
    Absent,
}

/// Takes in what was written before the wait, or says what to wait on.
fn look_at_script() -> Script {
    let mut feed = lock(&FEED);
    let Some(feed) = feed.as_mut() else {
        return Script::Absent;
    };
    if feed.read() {
        Script::Taken
    } else {
        Script::Quiet(feed.generation, Arc::clone(&feed.ready))
    }
}

/// Waits up to `wait` for the script to be written, with no lock held, then takes in what was appended,
/// unless the opening polled was shut down meanwhile.
fn wait_for_script(generation: u64, ready: &OwnedFd, wait: Duration) {
    let timeout = nix::poll::PollTimeout::try_from(wait.as_millis().max(1))
        .unwrap_or(nix::poll::PollTimeout::MAX);
    let mut fds = [nix::poll::PollFd::new(
        ready.as_fd(),
        nix::poll::PollFlags::POLLIN,
    )];
    if !nix::poll::poll(&mut fds, timeout).is_ok_and(|n| n > 0) {
        return;
    }
    if let Some(feed) = lock(&FEED).as_mut()
        && feed.generation == generation
    {
        feed.read();
    }
}

/// Takes in the script without blocking, unless another thread is already reading it.
fn catch_up() {
    if take_reader_turn() {
        if let Some(feed) = lock(&FEED).as_mut() {
            feed.read();
        }
        end_reader_turn();
    }
}

fn take_reader_turn() -> bool {
    let mut events = lock(&EVENTS);
    if events.reading {
        return false;
    }
    events.reading = true;
    true
}

fn end_reader_turn() {
    let mut events = lock(&EVENTS);
    events.reading = false;
    events.offer_turn();
}

// ---- events --------------------------------------------------------------------------------------------

/// An event waiting in a set.
#[derive(Debug, Clone, Copy)]
pub enum Pending {
    Event {
        device: usize,
        event_type: u64,
        event_data: u64,
        /// GPU and compute instance the event is attributed to; `u32::MAX` when it is not.
        gpu_instance: u32,
        compute_instance: u32,
    },
    Lost,
}

/// Events queued per set before the oldest are dropped, so a client that stops waiting cannot make the
/// fake grow without bound.
const QUEUE_LIMIT: usize = 1 << 16;

struct EventSet {
    handle: usize,
    registrations: Vec<(usize, u64)>,
    queue: VecDeque<Pending>,
    /// Signalled when an event is queued here, the set is freed, or its waiter is given the reader's turn.
    wake: Arc<Condvar>,
    /// Threads waiting on `wake`.
    waiters: usize,
}

/// Every event set, and whether a thread is reading the script. One lock for all, so no wake-up can be
/// missed between a check and a wait; one condition variable per set, so an event wakes only its own waiter.
struct Events {
    sets: Vec<EventSet>,
    next_handle: usize,
    reading: bool,
    /// Whether a fault script is followed: without one, waits wait on their sets for the timeout (or for an
    /// `nvmlInit` that starts following one), holding no reader's turn. It says what [`FEED`] holds, kept here
    /// because a wait decides under this lock, and taking [`FEED`] under it would invert the order in which
    /// a reader takes the two (the feed, then the sets it delivers to).
    following: bool,
}

static EVENTS: Mutex<Events> = Mutex::new(Events {
    sets: Vec::new(),
    next_handle: 1,
    reading: false,
    following: false,
});

impl Events {
    fn set(&mut self, handle: usize) -> Option<&mut EventSet> {
        self.sets.iter_mut().find(|s| s.handle == handle)
    }

    /// With nobody reading the script, wakes one waiting thread to take the reader's turn (one, not all: the
    /// others would only wake to find it taken).
    fn offer_turn(&self) {
        if self.reading {
            return;
        }
        if let Some(set) = self.sets.iter().find(|s| s.waiters > 0) {
            set.wake.notify_one();
        }
    }
}

/// A live event set, looked up by handle so a freed or foreign handle is refused, not dereferenced.
pub struct SetRef(usize);

impl SetRef {
    pub fn from_handle(handle: nvmlEventSet_t) -> Option<SetRef> {
        let handle = handle as usize;
        lock(&EVENTS).set(handle).map(|_| SetRef(handle))
    }

    pub fn register(&self, device: usize, types: u64) {
        if let Some(set) = lock(&EVENTS).set(self.0) {
            set.registrations.push((device, types));
        }
    }

    /// The next event, waiting up to `timeout`; `None` when none came (or the set was freed).
    pub fn wait(&self, timeout: Duration) -> Option<Pending> {
        let deadline = Instant::now() + timeout;
        let mut events = lock(&EVENTS);
        loop {
            let Some(set) = events.set(self.0) else {
                events.offer_turn();
                return None;
            };
            // As the driver does: while a GPU registered in the set is lost, every wait on the set answers
            // GPU_IS_LOST at once (the set has to be freed and made again without it). By default the
            // events queued before come first; with `FAKE_NVML_LOST_FIRST` the loss does, and they wait.
            let holds_lost = set.registrations.iter().any(|(device, _)| {
                load_devices()
                    .as_ref()
                    .ok()
                    .and_then(|devices| devices.get(*device))
                    .is_some_and(Device::is_lost)
            });
            let answer = if holds_lost && lost_first() {
                // Told now: the loss's own notice in the queue would tell it a second time.
                set.queue
                    .retain(|pending| !matches!(pending, Pending::Lost));
                Some(Pending::Lost)
            } else if let Some(pending) = set.queue.pop_front() {
                Some(pending)
            } else if holds_lost {
                Some(Pending::Lost)
            } else {
                None
            };
            if answer.is_some() {
                // This thread may have been offered the reader's turn: pass it on, since it leaves.
                events.offer_turn();
                return answer;
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                events.offer_turn();
                return None;
            }
            let wake = Arc::clone(&set.wake);
            if events.reading || !events.following {
                if let Some(set) = events.set(self.0) {
                    set.waiters += 1;
                }
                events = wake
                    .wait_timeout(events, remaining)
                    .map(|(guard, _)| guard)
                    .unwrap_or_else(|poisoned| poisoned.into_inner().0);
                if let Some(set) = events.set(self.0) {
                    set.waiters -= 1;
                }
                continue;
            }
            // This thread's turn to read the script, as the driver's waiter is woken by the kernel. No lock
            // is held while it waits: other threads' calls go on meanwhile, as with the real library.
            events.reading = true;
            drop(events);
            // Lines taken in, or shut down meanwhile: the next turn of the loop looks at the queue, or waits
            // on the set.
            if let Script::Quiet(generation, ready) = look_at_script() {
                wait_for_script(generation, &ready, remaining);
            }
            end_reader_turn();
            events = lock(&EVENTS);
        }
    }
}

pub fn create_set() -> nvmlEventSet_t {
    let mut events = lock(&EVENTS);
    let handle = events.next_handle;
    events.next_handle += 1;
    events.sets.push(EventSet {
        handle,
        registrations: Vec::new(),
        queue: VecDeque::new(),
        wake: Arc::new(Condvar::new()),
        waiters: 0,
    });
    // An opaque, non-null token: never dereferenced, only looked up.
    std::ptr::without_provenance_mut(handle)
}

pub fn free_set(handle: nvmlEventSet_t) -> nvmlReturn_t {
    let mut events = lock(&EVENTS);
    let Some(at) = events.sets.iter().position(|s| s.handle == handle as usize) else {
        return code::INVALID_ARGUMENT;
    };
    // Its waiters (a client's mistake) return with nothing.
    events.sets.remove(at).wake.notify_all();
    code::SUCCESS
}

/// Queues `pending` on every set that registered `device` for any of `types` (any type at all when
/// `types` is 0, as for a lost GPU).
fn deliver(device: usize, types: u64, pending: Pending) {
    let mut events = lock(&EVENTS);
    for set in &mut events.sets {
        let wanted = set
            .registrations
            .iter()
            .any(|&(d, mask)| d == device && (types == 0 || mask & types != 0));
        if wanted {
            if set.queue.len() >= QUEUE_LIMIT {
                set.queue.pop_front();
            }
            set.queue.push_back(pending);
            set.wake.notify_all();
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
    // A command may name a MIG device: its XIDs are attributed to its instances, on its parent GPU.
    let target = devices.iter().find_map(|d| {
        if d.spec.uuid == command.uuid() {
            return Some((d, None));
        }
        d.migs
            .iter()
            .find(|m| m.spec.uuid == command.uuid())
            .map(|m| (d, Some(m)))
    });
    let Some((device, mig)) = target else {
        eprintln!("fake-nvml: skipped {text:?}: no GPU or MIG device with that UUID");
        return;
    };
    let index = device.index;
    let (gpu_instance, compute_instance) = mig.map_or((u32::MAX, u32::MAX), |m| {
        (m.spec.gpu_instance, m.spec.compute_instance)
    });
    let event = |event_type, event_data| Pending::Event {
        device: index,
        event_type,
        event_data,
        gpu_instance,
        compute_instance,
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
                // The recovery action is the GPU's: XID 154 is never attributed to an instance.
                deliver(
                    index,
                    event_type::XID_CRITICAL,
                    Pending::Event {
                        device: index,
                        event_type: event_type::XID_CRITICAL,
                        event_data: 154,
                        gpu_instance: u32::MAX,
                        compute_instance: u32::MAX,
                    },
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
