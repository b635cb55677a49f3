//! Where devices and their health come from: the [`DeviceSource`] trait a GPU backend implements, and the
//! backends: NVML on a GPU node ([`nvml`]), simulated GPUs and their fault script elsewhere ([`simulated`],
//! [`script`]).
//!
//! A source discovers the devices, then reports what it sees on them as [`DeviceEvent`]s into the health
//! monitor's channel (`crate::monitor`), and answers the probes the engine asks for.

pub mod nvml;
pub mod open;
pub mod script;
pub mod simulated;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use tokio::sync::mpsc;

use crate::devices::{DeviceInfo, Unserved};
use crate::health::Observation;

/// A change reported by a device source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceEvent {
    /// The backend saw something on a device; the health engine decides what it means.
    Observed {
        /// Device ID.
        id: String,
        /// What was seen.
        observation: Observation,
        /// When it was seen.
        at: SystemTime,
    },
    /// A device appeared.
    Added(DeviceInfo),
    /// A device is gone.
    Removed(String),
}

/// Error from a device source.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The source could not enumerate its devices.
    #[error("cannot discover devices: {0}")]
    Discovery(String),
}

/// Where devices and their health come from: NVML on a GPU node, simulated GPUs elsewhere.
pub trait DeviceSource: Send + 'static {
    /// The devices present now, in a stable order.
    fn discover(&mut self) -> Result<Vec<DeviceInfo>, SourceError>;

    /// Starts reporting changes into `events`, and answering each probe request (device IDs) on `probes`
    /// with an [`Observation::Probe`] per device. The source stops when `events` is closed. It returns once
    /// it watches the devices' health (the devices are listed to the kubelet only then, so that no fault
    /// falls between the two), and within a bounded time: it must not block the caller for long.
    fn start(
        self: Box<Self>,
        events: mpsc::Sender<DeviceEvent>,
        probes: mpsc::Receiver<Vec<String>>,
    ) -> Result<(), SourceError>;

    /// The heartbeats of the threads that wait for the devices' events, for sources that have them: a thread
    /// stuck in the driver leaves faults unseen, and `/healthz` must say so.
    fn heartbeat(&self) -> Option<Heartbeat> {
        None
    }

    /// Devices present but not served because they cannot be named (a GPU that does not answer, and that
    /// nothing else identifies). While there are any, checkpoint entries of devices not listed are kept: one
    /// of them may be such a device, and its conditions must outlive its silence.
    fn unidentified(&self) -> usize {
        0
    }

    /// The GPU driver's version, where the source talks to a driver (for the start-up line: the first thing
    /// asked when a node misbehaves).
    fn driver_version(&self) -> Option<String> {
        None
    }

    /// Devices found at discovery but not served, each with why; asked once, after [`DeviceSource::discover`].
    fn unserved(&self) -> Vec<Unserved> {
        Vec::new()
    }
}

/// When each thread that waits for the devices' events (one per GPU for NVML) last came round its loop, and
/// whether it can watch at all. Shared between those threads, each beating its own [`Beat`], and whoever asks
/// whether they are alive. One stuck thread is enough to leave its GPU's faults unseen, so the longest
/// silence speaks for all.
#[derive(Debug, Clone, Default)]
pub struct Heartbeat(Arc<std::sync::Mutex<Vec<Arc<Pulse>>>>);

/// One waiting thread's heartbeat, beaten by that thread alone (no lock: an atomic store per beat).
#[derive(Debug)]
pub struct Beat(Arc<Pulse>);

/// The shared state of one [`Beat`].
#[derive(Debug)]
struct Pulse {
    /// What the thread watches, as an operator names it (a GPU's UUID).
    name: String,
    /// Milliseconds since the epoch at the last beat; [`RETIRED`] once the thread ended on purpose.
    at: AtomicU64,
    /// The thread runs but cannot watch: every event wait fails.
    blind: std::sync::atomic::AtomicBool,
}

/// Stored when the thread stopped watching on purpose (nothing to watch): no age, nothing stuck.
const RETIRED: u64 = u64::MAX;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX - 1))
}

impl Beat {
    /// The thread is alive now.
    pub fn beat(&self) {
        self.0.at.store(now_ms(), Ordering::Relaxed);
    }

    /// Whether the thread, though it runs, cannot watch anything (every event wait fails).
    pub fn set_blind(&self, blind: bool) {
        self.0.blind.store(blind, Ordering::Relaxed);
    }

    /// See [`Beat::set_blind`].
    pub fn is_blind(&self) -> bool {
        self.0.blind.load(Ordering::Relaxed)
    }

    /// The thread has ended on purpose; there is nothing left for it to be stuck in.
    pub fn retire(&self) {
        self.0.at.store(RETIRED, Ordering::Relaxed);
        self.0.blind.store(false, Ordering::Relaxed);
    }

    /// As if the thread had last beaten `ago`, for tests of a stuck thread.
    #[cfg(test)]
    pub(crate) fn silent_for(&self, ago: std::time::Duration) {
        let ago = u64::try_from(ago.as_millis()).unwrap_or(u64::MAX);
        self.0
            .at
            .store(now_ms().saturating_sub(ago), Ordering::Relaxed);
    }
}

impl Heartbeat {
    /// A beat for one more waiting thread, named for what it watches; alive from now. Added before the thread
    /// starts, so that a thread that never comes round its loop still counts.
    pub fn waiter(&self, name: impl Into<String>) -> Beat {
        let pulse = Arc::new(Pulse {
            name: name.into(),
            at: AtomicU64::new(now_ms()),
            blind: std::sync::atomic::AtomicBool::new(false),
        });
        self.pulses().push(pulse.clone());
        Beat(pulse)
    }

    fn pulses(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Pulse>>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The names of the threads still running and the time since each last beat.
    fn live(&self) -> Vec<(String, std::time::Duration)> {
        let now = now_ms();
        self.pulses()
            .iter()
            .filter_map(|p| match p.at.load(Ordering::Relaxed) {
                RETIRED => None,
                at => Some((
                    p.name.clone(),
                    std::time::Duration::from_millis(now.saturating_sub(at)),
                )),
            })
            .collect()
    }

    /// The longest time since a running thread last beat; `None` once none runs (all retired, or none
    /// started: nothing to watch).
    pub fn age(&self) -> Option<std::time::Duration> {
        self.live().into_iter().map(|(_, age)| age).max()
    }

    /// How many threads run, and the names of those silent for longer than `after`.
    pub fn stuck(&self, after: std::time::Duration) -> (usize, Vec<String>) {
        let live = self.live();
        let stuck = live
            .iter()
            .filter(|(_, age)| *age > after)
            .map(|(name, _)| name.clone())
            .collect();
        (live.len(), stuck)
    }

    /// Whether any running thread cannot watch (every one of its event waits fails).
    pub fn is_blind(&self) -> bool {
        !self.blind().1.is_empty()
    }

    /// How many threads run, and the names of those that cannot watch.
    pub fn blind(&self) -> (usize, Vec<String>) {
        let pulses = self.pulses();
        let live = pulses
            .iter()
            .filter(|p| p.at.load(Ordering::Relaxed) != RETIRED);
        let count = live.clone().count();
        let blind = live
            .filter(|p| p.blind.load(Ordering::Relaxed))
            .map(|p| p.name.clone())
            .collect();
        (count, blind)
    }

    /// Watches these heartbeats from a task of its own: logs an error once when a thread has been silent for
    /// longer than `stuck_after` (stuck, in the driver most likely, and its GPU's faults go unseen), and
    /// again when every thread beats once more. Looks every `stuck_after`: each look costs the idle plugin a
    /// few wake-ups (the timer wheel cascades a long timer), measured 0.2 per second at a look every 15 s.
    pub fn watch(self, stuck_after: std::time::Duration) {
        tokio::spawn(async move {
            let mut stuck = false;
            let mut every = tokio::time::interval(stuck_after);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(age) = self.age() else { return };
                if age > stuck_after && !stuck {
                    let (threads, names) = self.stuck(stuck_after);
                    tracing::error!(
                        silent_s = age.as_secs(),
                        stuck = %names.join(","),
                        threads,
                        "the NVML event thread is stuck (in the driver?) for these GPUs: their faults are \
                         not seen; /healthz reports it"
                    );
                    stuck = true;
                } else if age <= stuck_after && stuck {
                    tracing::info!("the NVML event thread is running again for every GPU");
                    stuck = false;
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn one_silent_thread_makes_the_heartbeat_stuck_and_a_retired_one_counts_for_nothing() {
        let minute = std::time::Duration::from_secs(60);
        let heartbeat = Heartbeat::default();
        assert_eq!(heartbeat.age(), None, "no thread: nothing to be stuck");
        let a = heartbeat.waiter("GPU-a");
        let b = heartbeat.waiter("GPU-b");
        assert!(heartbeat.age() < Some(minute));
        b.silent_for(2 * minute);
        assert!(heartbeat.age() > Some(minute), "{:?}", heartbeat.age());
        assert_eq!(heartbeat.stuck(minute), (2, vec!["GPU-b".to_string()]));
        b.beat();
        assert_eq!(heartbeat.stuck(minute), (2, vec![]));
        b.silent_for(2 * minute);
        b.retire();
        assert!(
            heartbeat.age() < Some(minute),
            "a retired thread is not stuck"
        );
        assert_eq!(heartbeat.stuck(minute), (1, vec![]));
        a.retire();
        assert_eq!(heartbeat.age(), None);
    }

    #[test]
    fn the_heartbeat_is_blind_while_any_running_thread_is() {
        let heartbeat = Heartbeat::default();
        let a = heartbeat.waiter("GPU-a");
        let b = heartbeat.waiter("GPU-b");
        assert!(!heartbeat.is_blind());
        b.set_blind(true);
        assert!(heartbeat.is_blind() && b.is_blind() && !a.is_blind());
        assert_eq!(heartbeat.blind(), (2, vec!["GPU-b".to_string()]));
        b.retire();
        assert!(
            !heartbeat.is_blind(),
            "a thread that ended watches nothing, blind or not"
        );
        assert_eq!(heartbeat.blind(), (1, vec![]));
    }
}
