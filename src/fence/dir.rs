//! The fence directory (`--fence-dir`): a detector running beside the plugin (node-problem-detector, a
//! DCGM-based health check, a burn-in job) reports a GPU it finds faulty by dropping a file there, and
//! releases it by removing the file. Watched with inotify, as the kubelet's directory is.
//!
//! One JSON file per report, named `<anything>.json` (hidden files and other names are skipped, so a
//! detector can write `.name.tmp` and rename it into place):
//!
//! ```json
//! {"device": "GPU-8e4f…", "reason": "SXID 20034 on NVSwitch 3", "by": "nvswitch-watch"}
//! ```
//!
//! `device` is a GPU or MIG device UUID (a GPU's UUID fences all its MIG devices), `reason` is required,
//! `by` names the detector. The fence records the file it came from; removing the file releases that fence
//! (and only a fence that came from this directory). At start, fences recorded from a file that is gone are
//! released.
//!
//! Only a file that is gone releases its fence. A file that is there but cannot be used (empty or half
//! written, unparseable, not a regular file, unreadable) is reported at warn level and changes nothing: a
//! fence its name had stays, and it sets none. A directory that cannot be read (removed, replaced, out of
//! file descriptors) changes nothing either; it is read again every second until it can be, and a directory
//! made again in its place is watched. Symbolic links are not followed (a report is the file itself).
//!
//! What it may cost, at most: the directory is read on a thread of its own (a stuck file system stalls
//! the fence directory alone, and a reading that takes over [`READ_TIMEOUT`] is said at warn level); at most
//! ten readings a second however fast it changes ([`MIN_READ_INTERVAL`]), the last change never missed;
//! none while nothing changes (the plugin's own reading does not wake it); [`MAX_REPORTS`] reports read per
//! reading, the first by name (past it, the rest are not read: they set no fence, a fence one of them set
//! before stays while its file exists, and the number not read is said); one query to the health monitor
//! per reading, and one per fence set or released (a report naming a device not on this node is answered
//! from the list); warnings at most one line per file a minute and ten lines a minute in all, with what was
//! held back counted in one line.

mod read;
mod warnings;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use read::{MAX_REPORT_BYTES, MAX_REPORTS};

use crate::health::{ConditionKind, ConditionSelector};
use crate::monitor::DeviceSnapshot;
use crate::monitor::{MonitorHandle, OperatorError, OperatorRequest};
use read::{Reader, Reading};
use warnings::Warnings;

/// The longest reason or detector name kept.
const MAX_TEXT_BYTES: usize = 512;

/// Marks a fence as this directory's in the `fenced` condition's detail, with the file's name after it.
const FROM_FILE: &str = " via the fence directory, file ";

/// Changes closer together than this are read as one: a directory rewritten every millisecond is read at
/// most ten times a second, and a change that comes meanwhile is read at the end of it.
pub const MIN_READ_INTERVAL: Duration = Duration::from_millis(100);

/// How long a reading may take before it is said to be stuck (a hung mount). Its fences stay as they were
/// until the file system answers; then the directory is read again.
pub const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How often a directory that cannot be read or watched is read again.
pub const RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// One report.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    /// The device, or a GPU's UUID for all its MIG devices.
    pub device: String,
    /// Why (printable: see [`crate::util::text::printable`]).
    pub reason: String,
    /// The detector (printable).
    #[serde(default)]
    pub by: Option<String>,
}

/// The directory could not be watched.
#[derive(Debug, thiserror::Error)]
#[error("cannot watch the fence directory {}: {cause}", .dir.display())]
pub struct FenceDirError {
    dir: PathBuf,
    cause: String,
}

/// Watches `dir` and applies its reports until `shutdown`. The directory is read on a thread of its own;
/// this task, on the caller's runtime, only asks the health monitor.
pub fn spawn(
    dir: PathBuf,
    queries: MonitorHandle,
    shutdown: CancellationToken,
) -> Result<(), FenceDirError> {
    let error = |cause: String| FenceDirError {
        dir: dir.clone(),
        cause,
    };
    if !dir.is_dir() {
        return Err(error("not a directory".into()));
    }
    // One wake-up pending at most: any number of changes before the next reading are the same news.
    let (wake, woken) = mpsc::channel(1);
    let reader = Reader::spawn(dir.clone(), wake)
        .map_err(|e| error(format!("cannot start its thread: {e}")))?;
    tracing::info!(dir = %dir.display(), "watching the fence directory for detectors' reports");
    tokio::spawn(follow(dir, reader, woken, queries, shutdown));
    Ok(())
}

/// Why the follower stopped waiting.
enum Woken {
    /// A change in the directory.
    Change,
    /// A reading due without a change (the directory unreadable or unwatched), or a summary of warnings.
    Due,
    /// The plugin is stopping.
    Stop,
}

/// Reads the directory at each change, at most every [`MIN_READ_INTERVAL`], and makes the fences from it
/// what its files say.
async fn follow(
    dir: PathBuf,
    reader: Reader,
    mut woken: mpsc::Receiver<()>,
    queries: MonitorHandle,
    shutdown: CancellationToken,
) {
    let shown = dir.display().to_string();
    let mut follower = Follower {
        released_by: format!("the fence directory {shown}"),
        shown,
        reader,
        queries,
        warnings: Warnings::new(Instant::now()),
        said_unreadable: false,
    };
    let mut last_read: Option<Instant> = None;
    // A reading due without a change: at start, and while the directory cannot be read or watched.
    let mut due = Some(Instant::now());
    loop {
        let deadline = match (due, follower.warnings.summary_due()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let why = tokio::select! {
            () = shutdown.cancelled() => Woken::Stop,
            change = woken.recv() => if change.is_some() { Woken::Change } else { Woken::Stop },
            () = sleep_until(deadline) => Woken::Due,
        };
        if let Some(count) = follower.warnings.summary(Instant::now()) {
            tracing::warn!(dir = %follower.shown, held_back = count, "{count} more problems with the fence directory's reports were not logged in the last {}s (at most one line per file and {} lines in that time)", warnings::INTERVAL.as_secs(), warnings::BUDGET);
        }
        match why {
            Woken::Stop => return,
            Woken::Due if due.is_none_or(|at| Instant::now() < at) => continue,
            Woken::Change | Woken::Due => {}
        }
        if let Some(last) = last_read {
            let next = last + MIN_READ_INTERVAL;
            if Instant::now() < next {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep_until(next) => {}
                }
            }
        }
        // Every change until now is in this reading.
        while woken.try_recv().is_ok() {}
        last_read = Some(Instant::now());
        due = match follower.read(&shutdown).await {
            Some(due) => due,
            None => return,
        };
    }
}

/// The follower's state between two readings: the reading thread, the way to the monitor, and what it has
/// said.
struct Follower {
    shown: String,
    released_by: String,
    reader: Reader,
    queries: MonitorHandle,
    warnings: Warnings,
    said_unreadable: bool,
}

impl Follower {
    /// One reading of the directory, its fences applied: when the next reading is due without a change
    /// (`None` for none), or `None` when the plugin stops.
    async fn read(&mut self, shutdown: &CancellationToken) -> Option<Option<Instant>> {
        let shown = self.shown.clone();
        let devices = self.queries.devices().await?;
        let keep = in_place(&devices, FROM_FILE)
            .into_values()
            .map(|(key, _)| key);
        let mut reply = self.reader.read(keep.collect());
        let answered = tokio::select! {
            () = shutdown.cancelled() => return None,
            answered = tokio::time::timeout(READ_TIMEOUT, &mut reply) => answered,
        };
        let answer = match answered {
            Ok(Ok(answer)) => answer,
            // The reading thread is gone: it panicked, and the process is ending.
            Ok(Err(_)) => return None,
            Err(_) => {
                // At most a line a minute for a file system that hangs again and again.
                let said = self.warnings.allow("/hung", 0, Instant::now());
                if said {
                    tracing::warn!(dir = %shown, timeout_s = READ_TIMEOUT.as_secs(), "reading the fence directory takes too long (a hung file system?): its fences stay as they are until it answers");
                }
                tokio::select! {
                    () = shutdown.cancelled() => return None,
                    _late = &mut reply => {}
                }
                if said {
                    tracing::info!(dir = %shown, "the fence directory answers again; reading it anew");
                }
                return Some(Some(Instant::now()));
            }
        };
        let now = Instant::now();
        let listing = match answer.reading {
            Reading::Unreadable { why } => {
                tracing::debug!(dir = %shown, error = %why, "fence directory read: unreadable");
                if self.warnings.allow("/dir", read::hash(&why), now) {
                    self.said_unreadable = true;
                    tracing::warn!(dir = %shown, error = %why, "cannot read the fence directory: every fence from it stays as it is until it can be read");
                }
                self.warnings.keep_only(|source| source == "/dir", now);
                return Some(Some(Instant::now() + RETRY_INTERVAL));
            }
            Reading::Listed(listing) => listing,
        };
        let mut due = None;
        if let Err(why) = &answer.watched {
            due = Some(Instant::now() + RETRY_INTERVAL);
            if self.warnings.allow("/watch", read::hash(why), now) {
                tracing::warn!(dir = %shown, error = %why, retry_s = RETRY_INTERVAL.as_secs(), "cannot watch the fence directory for changes: reading it every second until it can be watched");
            }
        }
        // Said only after a warning was, so that a directory that comes and goes logs no more than the
        // warnings allow.
        if std::mem::take(&mut self.said_unreadable) {
            tracing::info!(dir = %shown, "the fence directory can be read again");
        }
        self.apply(listing, answer.watched.is_err(), &devices, now)
            .await;
        Some(due)
    }

    /// Makes the fences from the directory what `listing` says, each problem said within the warnings'
    /// budget.
    async fn apply(
        &mut self,
        listing: read::Listing,
        unwatched: bool,
        devices: &[DeviceSnapshot],
        now: Instant,
    ) {
        let shown = &self.shown;
        tracing::debug!(
            dir = %shown,
            reports = listing.reports.len(),
            held = listing.held.len(),
            unread = listing.unread,
            "fence directory read"
        );
        if listing.unread > 0 && self.warnings.allow("/unread", listing.unread as u64, now) {
            tracing::warn!(dir = %shown, unread = listing.unread, "more than {MAX_REPORTS} reports in the fence directory: the {} past the first {MAX_REPORTS} by name are not read (a fence from one of them stays while its file exists)", listing.unread);
        }
        for problem in &listing.problems {
            if self.warnings.allow(&problem.file, problem.version, now) {
                if problem.held {
                    tracing::warn!(dir = %shown, file = %problem.file, error = %problem.why, "fence report ignored: a fence from this file stays as it is until the file is removed or made right");
                } else {
                    tracing::warn!(dir = %shown, file = %problem.file, error = %problem.why, "fence report ignored");
                }
            }
        }
        let wanted: BTreeMap<String, Wanted> = listing
            .reports
            .into_iter()
            .map(|(file, report)| {
                let wanted = Wanted {
                    device: report.device,
                    reason: report.reason,
                    who: report.by.unwrap_or_else(|| "a detector".into()),
                };
                (file, wanted)
            })
            .collect();
        // The list from before the reading: only this task sets or releases the directory's fences, so
        // what it says of them still holds.
        let failed = apply_to(
            &self.queries,
            devices,
            FROM_FILE,
            &wanted,
            &listing.held,
            &self.released_by,
        )
        .await;
        for (file, e) in &failed {
            if self.warnings.allow(file, read::hash(e.to_string()), now) {
                tracing::warn!(dir = %shown, %file, error = %e, "fence report not applied");
            }
        }
        // What is wrong now is remembered; the rest once its interval is over, so that a problem that comes
        // back later is said again.
        let problems: BTreeSet<&str> = listing
            .problems
            .iter()
            .map(|p| p.file.as_str())
            .chain(failed.iter().map(|(file, _)| file.as_str()))
            .chain((listing.unread > 0).then_some("/unread"))
            .chain(unwatched.then_some("/watch"))
            .collect();
        self.warnings
            .keep_only(|source| problems.contains(source), now);
    }
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// One fence a source (the fence directory, the node annotation) wants, under its key there (a file name,
/// an entry).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    /// The device, or a GPU's UUID for all its MIG devices.
    pub device: String,
    /// Why.
    pub reason: String,
    /// Who, as the source names them.
    pub who: String,
}

/// Makes the fences of one source what it wants. A source's fences are told apart by `marker` in who set
/// them (`<who><marker><key>`, the part of the `fenced` condition's detail before its first ": "; neither
/// `who` nor the key may hold a colon): a wanted fence not in place is set, a fence of the source that is
/// neither wanted nor `held` is released, and fences set any other way are left alone. `held` names the
/// keys that are there but cannot be read now (a report being written): their fences stay as they are.
/// Returns the keys that could not be applied, with why. Asks the monitor once for the devices, then once
/// per change: a report naming a device not on this node is answered from that list.
pub async fn apply(
    queries: &MonitorHandle,
    marker: &str,
    wanted: &BTreeMap<String, Wanted>,
    held: &BTreeSet<String>,
    released_by: &str,
) -> Vec<(String, OperatorError)> {
    let Some(devices) = queries.devices().await else {
        return Vec::new();
    };
    apply_to(queries, &devices, marker, wanted, held, released_by).await
}

/// [`apply`] with the monitor's device list already fetched: asks the monitor only for the changes.
async fn apply_to(
    queries: &MonitorHandle,
    devices: &[DeviceSnapshot],
    marker: &str,
    wanted: &BTreeMap<String, Wanted>,
    held: &BTreeSet<String>,
    released_by: &str,
) -> Vec<(String, OperatorError)> {
    let Plan {
        fence,
        release,
        mut failed,
    } = plan(devices, marker, wanted, held);
    // Fences first: a device passed from one key to another never shows Healthy in between.
    for (target, key) in fence {
        let Some(want) = wanted.get(&key) else {
            continue;
        };
        let request = OperatorRequest::Fence {
            reason: want.reason.clone(),
            by: by(want, marker, &key),
        };
        if let Err(e) = queries.operate(&target, request).await {
            failed.push((key, e));
        }
    }
    for (device, key) in release {
        let request = OperatorRequest::Release {
            which: ConditionSelector::fenced(),
            reason: format!("{}{key} withdrawn", marker.trim_start()),
            by: released_by.to_string(),
        };
        if let Err(e) = queries.operate(&device, request).await {
            tracing::warn!(device = %device, error = %e, "cannot release a fence its source withdrew");
        }
    }
    failed
}

/// Who set a wanted fence, as the `fenced` condition records it.
fn by(want: &Wanted, marker: &str, key: &str) -> String {
    format!("{}{marker}{key}", want.who.replace(':', "-"))
}

/// This source's fences in place, by device: the key each came from, and its detail.
fn in_place(devices: &[DeviceSnapshot], marker: &str) -> BTreeMap<String, (String, String)> {
    let mut in_place = BTreeMap::new();
    for device in devices {
        let fence = device
            .conditions
            .iter()
            .find(|c| c.condition.kind == ConditionKind::Fenced)
            .and_then(|c| c.condition.detail.as_ref());
        let Some(detail) = fence else {
            continue;
        };
        let source = detail.split_once(": ").map_or(detail.as_str(), |(s, _)| s);
        if let Some((_, key)) = source.split_once(marker) {
            in_place.insert(device.info.id.clone(), (key.to_string(), detail.clone()));
        }
    }
    in_place
}

/// What [`apply`] asks of the monitor.
#[derive(Debug, Default, PartialEq)]
struct Plan {
    /// Fences to set: the target (a device, or a GPU for all its MIG devices) and the key wanting it.
    fence: Vec<(String, String)>,
    /// Fences to release: the device, and the key its fence came from.
    release: Vec<(String, String)>,
    /// Keys that cannot be applied.
    failed: Vec<(String, OperatorError)>,
}

/// Which fences to set and release so that the source's fences are what it wants. One fence per device: a
/// device several keys want keeps the fence in place if its key still wants it (or is held), else takes
/// the first key by name; it is released only when no key wants it.
fn plan(
    devices: &[DeviceSnapshot],
    marker: &str,
    wanted: &BTreeMap<String, Wanted>,
    held: &BTreeSet<String>,
) -> Plan {
    let mut plan = Plan::default();
    let in_place = in_place(devices, marker);
    // The devices each wanted key's target names, or why none.
    let mut targets: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (key, want) in wanted {
        let ids: Vec<&str> = devices
            .iter()
            .filter(|d| {
                d.info.id == want.device
                    || d.info.mig.as_ref().is_some_and(|m| m.parent == want.device)
            })
            .map(|d| d.info.id.as_str())
            .collect();
        if ids.is_empty() {
            let known: Vec<&str> = devices.iter().map(|d| d.info.id.as_str()).collect();
            plan.failed.push((
                key.clone(),
                OperatorError::UnknownDevice {
                    target: crate::util::text::shown(&want.device, 80),
                    known: crate::util::text::cut_bytes(&known.join(", "), 400),
                    command: None,
                },
            ));
            continue;
        }
        targets.insert(key, ids);
    }
    // Which key holds each device's fence: the one in place while it still wants it, else the first.
    let mut owner: BTreeMap<&str, &str> = BTreeMap::new();
    for (device, (key, _)) in &in_place {
        let wants = targets
            .get(key.as_str())
            .is_some_and(|ids| ids.contains(&device.as_str()));
        if wants || held.contains(key) {
            owner.insert(device, key);
        }
    }
    for (key, ids) in &targets {
        for id in ids {
            owner.entry(id).or_insert(key);
        }
    }
    for (key, ids) in &targets {
        let Some(want) = wanted.get(*key) else {
            continue;
        };
        let detail = format!("by {}: {}", by(want, marker, key), want.reason);
        let owned: Vec<&str> = ids
            .iter()
            .copied()
            .filter(|id| owner.get(id) == Some(key))
            .collect();
        let stale: Vec<&str> = owned
            .iter()
            .copied()
            .filter(|id| in_place.get(*id).is_none_or(|(_, d)| *d != detail))
            .collect();
        if stale.is_empty() {
            continue;
        }
        if owned.len() == ids.len() {
            plan.fence.push((want.device.clone(), key.to_string()));
        } else {
            plan.fence
                .extend(stale.iter().map(|id| (id.to_string(), key.to_string())));
        }
    }
    for (device, (key, _)) in &in_place {
        if !owner.contains_key(device.as_str()) {
            plan.release.push((device.clone(), key.clone()));
        }
    }
    plan
}

/// A report's content, checked: the device and reason present, texts trimmed, made printable and cut to
/// size.
pub fn parse_report(text: &[u8]) -> Result<Report, String> {
    // serde's message may quote the text (an unknown field's name).
    let mut report: Report = serde_json::from_slice(text).map_err(|e| {
        let e = crate::util::text::shown(&e.to_string(), MAX_TEXT_BYTES);
        format!("not a report ({{\"device\": ..., \"reason\": ..., \"by\": ...}}): {e}")
    })?;
    // Written by anyone who may write the directory, and shown in the log, the kubelet's message, Events:
    // printable, so that it can neither forge a line nor drive a terminal.
    let text = |t: &str| crate::util::text::shown(t.trim(), MAX_TEXT_BYTES);
    report.device = report.device.trim().to_string();
    report.reason = text(&report.reason);
    report.by = report.by.map(|b| text(&b)).filter(|b| !b.is_empty());
    if report.device.is_empty() {
        return Err("\"device\" is empty".into());
    }
    if report.reason.is_empty() {
        return Err("\"reason\" is empty".into());
    }
    Ok(report)
}

#[cfg(test)]
mod tests;
