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
//! (and only a fence that came from this directory). A file that cannot be read or parsed is reported once
//! at warn level and fences nothing. At start, fences recorded from a file that is gone are released.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use notify::{RecursiveMode, Watcher as _};
use serde::Deserialize;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::health::ConditionSelector;
use crate::health::monitor::{OperatorError, OperatorRequest, StatusQueries};

/// The largest report read.
const MAX_REPORT_BYTES: u64 = 64 * 1024;

/// The longest reason or detector name kept.
const MAX_TEXT_BYTES: usize = 512;

/// Marks a fence as this directory's in the `fenced` condition's detail, with the file's name after it.
const FROM_FILE: &str = " via the fence directory, file ";

/// One report.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    /// The device, or a GPU's UUID for all its MIG devices.
    pub device: String,
    /// Why.
    pub reason: String,
    /// The detector.
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

/// Watches `dir` and applies its reports until `shutdown`.
pub fn spawn(
    dir: PathBuf,
    queries: StatusQueries,
    shutdown: CancellationToken,
) -> Result<(), FenceDirError> {
    let error = |cause: String| FenceDirError {
        dir: dir.clone(),
        cause,
    };
    if !dir.is_dir() {
        return Err(error("not a directory".into()));
    }
    let wake = Arc::new(Notify::new());
    let notify = wake.clone();
    // Any change may be a report added, changed or removed: look at the directory again.
    let mut watcher = notify::recommended_watcher(move |_event: notify::Result<notify::Event>| {
        notify.notify_one();
    })
    .map_err(|e| error(e.to_string()))?;
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .map_err(|e| error(e.to_string()))?;
    tracing::info!(dir = %dir.display(), "watching the fence directory for detectors' reports");
    tokio::spawn(async move {
        let _watching = watcher;
        let mut warned = HashSet::new();
        loop {
            reconcile(&dir, &queries, &mut warned).await;
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = wake.notified() => {}
            }
        }
    });
    Ok(())
}

/// Makes the fences from this directory what its files say.
async fn reconcile(
    dir: &Path,
    queries: &StatusQueries,
    warned: &mut HashSet<(String, Option<SystemTime>)>,
) {
    let reports = read_reports(dir, warned);
    let wanted: BTreeMap<String, Wanted> = reports
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
    let released_by = format!("the fence directory {}", dir.display());
    for (file, e) in apply(queries, FROM_FILE, &wanted, &released_by).await {
        if warned.insert((format!("{file}: {e}"), None)) {
            tracing::warn!(file = %dir.join(&file).display(), error = %e, "fence report not applied");
        }
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
/// `who` nor the key may hold a colon): a wanted fence not in place is set, a fence of the source no longer
/// wanted is released, and fences set any other way are left alone. Returns the keys that could not be
/// applied, with why.
pub async fn apply(
    queries: &StatusQueries,
    marker: &str,
    wanted: &BTreeMap<String, Wanted>,
    released_by: &str,
) -> Vec<(String, OperatorError)> {
    let mut failed = Vec::new();
    let Some(devices) = queries.devices().await else {
        return failed;
    };
    // This source's fences in place, by device: the key each came from, and its detail.
    let mut in_place: BTreeMap<String, (String, String)> = BTreeMap::new();
    for device in &devices {
        let fence = device
            .conditions
            .iter()
            .find(|c| c.kind == "fenced")
            .and_then(|c| c.detail.as_ref());
        let Some(detail) = fence else {
            continue;
        };
        let source = detail.split_once(": ").map_or(detail.as_str(), |(s, _)| s);
        if let Some((_, key)) = source.split_once(marker) {
            in_place.insert(device.id.clone(), (key.to_string(), detail.clone()));
        }
    }
    for (key, fence) in wanted {
        let by = format!("{}{marker}{key}", fence.who.replace(':', "-"));
        let detail = format!("by {by}: {}", fence.reason);
        if in_place.values().any(|(_, d)| *d == detail) {
            continue;
        }
        let request = OperatorRequest::Fence {
            reason: fence.reason.clone(),
            by,
        };
        if let Err(e) = queries.operate(&fence.device, request).await {
            failed.push((key.clone(), e));
        }
    }
    for (device, (key, _)) in &in_place {
        if wanted.contains_key(key) {
            continue;
        }
        let request = OperatorRequest::Release {
            which: ConditionSelector::fenced(),
            reason: format!("{}{key} withdrawn", marker.trim_start()),
            by: released_by.to_string(),
        };
        if let Err(e) = queries.operate(device, request).await {
            tracing::warn!(device = %device, error = %e, "cannot release a fence its source withdrew");
        }
    }
    failed
}

/// The directory's reports by file name; a file that cannot be used is said once (per file and
/// modification time) at warn level.
fn read_reports(
    dir: &Path,
    warned: &mut HashSet<(String, Option<SystemTime>)>,
) -> BTreeMap<String, Report> {
    let mut reports = BTreeMap::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => {
            if warned.insert((format!("{}: {e}", dir.display()), None)) {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot read the fence directory");
            }
            return reports;
        }
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !name.ends_with(".json") {
            continue;
        }
        let path = entry.path();
        let modified = entry.metadata().ok().and_then(|m| m.modified().ok());
        if name.contains(':') {
            if warned.insert((name.clone(), modified)) {
                tracing::warn!(file = %path.display(), "fence report ignored: its name holds a colon");
            }
            continue;
        }
        match read_report(&path) {
            Ok(report) => {
                reports.insert(name, report);
            }
            Err(why) => {
                if warned.insert((name.clone(), modified)) {
                    tracing::warn!(file = %path.display(), error = %why, "fence report ignored");
                }
            }
        }
    }
    reports
}

fn read_report(path: &Path) -> Result<Report, String> {
    use std::io::Read as _;
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    if !file.metadata().map_err(|e| e.to_string())?.is_file() {
        return Err("not a regular file".into());
    }
    let mut text = Vec::new();
    file.take(MAX_REPORT_BYTES + 1)
        .read_to_end(&mut text)
        .map_err(|e| e.to_string())?;
    if text.len() as u64 > MAX_REPORT_BYTES {
        return Err(format!("larger than {MAX_REPORT_BYTES} bytes"));
    }
    parse_report(&text)
}

/// A report's content, checked: the device and reason present, texts trimmed and cut to size.
pub fn parse_report(text: &[u8]) -> Result<Report, String> {
    let mut report: Report = serde_json::from_slice(text).map_err(|e| {
        format!("not a report ({{\"device\": ..., \"reason\": ..., \"by\": ...}}): {e}")
    })?;
    report.device = report.device.trim().to_string();
    report.reason = crate::text::cut_bytes(report.reason.trim(), MAX_TEXT_BYTES);
    report.by = report
        .by
        .map(|b| crate::text::cut_bytes(b.trim(), MAX_TEXT_BYTES))
        .filter(|b| !b.is_empty());
    if report.device.is_empty() {
        return Err("\"device\" is empty".into());
    }
    if report.reason.is_empty() {
        return Err("\"reason\" is empty".into());
    }
    Ok(report)
}
