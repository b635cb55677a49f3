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
use crate::health::monitor::{OperatorRequest, StatusQueries};

/// The largest report read.
const MAX_REPORT_BYTES: u64 = 64 * 1024;

/// The longest reason or detector name kept.
const MAX_TEXT_BYTES: usize = 512;

/// Marks a fence as this directory's in the `fenced` condition's detail, with the file's name after it.
const FROM_FILE: &str = " via the fence directory, file ";

/// One report.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
struct Report {
    device: String,
    reason: String,
    #[serde(default)]
    by: Option<String>,
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
    let Some(devices) = queries.devices().await else {
        return;
    };
    // Fences this directory set, by device: the file each came from, and its detail.
    let mut fenced: BTreeMap<String, (String, String)> = BTreeMap::new();
    for device in &devices {
        for condition in &device.conditions {
            if condition.kind != "fenced" {
                continue;
            }
            let Some(detail) = &condition.detail else {
                continue;
            };
            // "by <detector><FROM_FILE><file>: <reason>": neither the detector's name nor the file's holds a
            // colon, so the first ": " ends the part that says where the fence came from.
            let source = detail.split_once(": ").map_or(detail.as_str(), |(s, _)| s);
            if let Some((_, file)) = source.split_once(FROM_FILE) {
                fenced.insert(device.id.clone(), (file.to_string(), detail.clone()));
            }
        }
    }
    for (file, report) in &reports {
        let by = format!(
            "{}{FROM_FILE}{file}",
            report.by.as_deref().unwrap_or("a detector")
        );
        let detail = format!("by {by}: {}", report.reason);
        let done = fenced.values().any(|(_, d)| *d == detail);
        if done {
            continue;
        }
        let request = OperatorRequest::Fence {
            reason: report.reason.clone(),
            by,
        };
        if let Err(e) = queries.operate(&report.device, request).await {
            let key = (format!("{file}: {e}"), None);
            if warned.insert(key) {
                tracing::warn!(file = %dir.join(file).display(), error = %e, "fence report not applied");
            }
        }
    }
    let files: HashSet<&str> = reports.keys().map(String::as_str).collect();
    for (device, (file, _)) in &fenced {
        if files.contains(file.as_str()) {
            continue;
        }
        let request = OperatorRequest::Release {
            which: ConditionSelector::fenced(),
            reason: format!("report {file} removed from the fence directory"),
            by: format!("the fence directory {}", dir.display()),
        };
        if let Err(e) = queries.operate(device, request).await {
            tracing::warn!(device = %device, error = %e, "cannot release a fence whose report was removed");
        }
    }
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
    let mut report: Report = serde_json::from_slice(&text).map_err(|e| {
        format!("not a report ({{\"device\": ..., \"reason\": ..., \"by\": ...}}): {e}")
    })?;
    report.device = report.device.trim().to_string();
    report.reason = crate::text::cut_bytes(report.reason.trim(), MAX_TEXT_BYTES);
    report.by = report
        .by
        .map(|b| crate::text::cut_bytes(&b.trim().replace(':', "-"), MAX_TEXT_BYTES))
        .filter(|b| !b.is_empty());
    if report.device.is_empty() {
        return Err("\"device\" is empty".into());
    }
    if report.reason.is_empty() {
        return Err("\"reason\" is empty".into());
    }
    Ok(report)
}
