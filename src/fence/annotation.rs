//! The Node annotation `gpu-device-plugin/fenced`: operators fence GPUs from the API server, with RBAC
//! deciding who may (patch on nodes). Its value lists the fenced devices with a reason each,
//! `<uuid>=<reason>,<uuid>=<reason>`: adding an entry fences the device, removing it releases it. The plugin
//! watches its own Node; entries it cannot use are reported in a Warning Event on the Node (and the log),
//! never a crash.

use std::collections::{BTreeMap, BTreeSet};

use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::events::EventType;
use kube::runtime::{WatchStreamExt as _, watcher};
use tokio::sync::mpsc;

use crate::cluster::{Note, Target};
use crate::fence::dir::{Wanted, apply};
use crate::monitor::MonitorHandle;

/// The annotation's key.
pub const ANNOTATION: &str = "gpu-device-plugin/fenced";

/// The reason of the Warning Event for entries that cannot be used.
pub const INVALID_REASON: &str = "FenceAnnotationInvalid";

/// Marks a fence as the annotation's in who set it, with the entry's device after it.
const FROM_ENTRY: &str = "the node annotation gpu-device-plugin/fenced, entry ";

/// The longest reason kept.
const MAX_REASON_BYTES: usize = 512;

/// The annotation's entries by device, and what is wrong with the others.
pub fn parse(value: &str) -> (BTreeMap<String, String>, Vec<String>) {
    let mut entries = BTreeMap::new();
    let mut problems = Vec::new();
    for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        // Anyone who may patch the Node writes this: made printable before it reaches a log or a message.
        let shown = crate::util::text::shown(entry, 120);
        let Some((device, reason)) = entry.split_once('=') else {
            problems.push(format!("{shown:?}: not <device>=<reason>"));
            continue;
        };
        let (device, reason) = (crate::util::text::shown(device.trim(), 120), reason.trim());
        if device.is_empty() || device.contains(':') {
            problems.push(format!("{shown:?}: no device UUID before '='"));
            continue;
        }
        if reason.is_empty() {
            problems.push(format!("{shown:?}: no reason after '='"));
            continue;
        }
        if entries
            .insert(
                device.clone(),
                crate::util::text::shown(reason, MAX_REASON_BYTES),
            )
            .is_some()
        {
            problems.push(format!("{device}: listed twice; the last entry counts"));
        }
    }
    (entries, problems)
}

/// [`follow`] as the Kubernetes API side runs it, beside its Events and node condition.
pub fn follower(queries: MonitorHandle) -> crate::cluster::NodeFollower {
    Box::new(move |client, node, notes| Box::pin(follow(client, node, queries, notes)))
}

/// Watches node `node` and keeps the fences its annotation asks for until the stream of changes ends;
/// entries it cannot use go to `notes` as a Warning Event on the Node, once for each value of the
/// annotation.
pub async fn follow(
    client: kube::Client,
    node: String,
    queries: MonitorHandle,
    notes: mpsc::Sender<Note>,
) {
    let nodes: Api<Node> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
    let mut changes = std::pin::pin!(watcher(nodes, config).default_backoff().applied_objects());
    let mut reported = None::<String>;
    let mut failing = false;
    tracing::info!(%node, annotation = ANNOTATION, "following the node's fence annotation");
    while let Some(change) = changes.next().await {
        let object = match change {
            Ok(object) => {
                if failing {
                    tracing::info!(%node, "watching the node's fence annotation again");
                    failing = false;
                }
                object
            }
            Err(e) => {
                if !failing {
                    let why = crate::cluster::explain_watch(&e, "list and watch on nodes");
                    tracing::warn!(%node, error = %why, "cannot watch the node's fence annotation; retrying with backoff");
                    failing = true;
                }
                continue;
            }
        };
        let value = object
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANNOTATION))
            .cloned()
            .unwrap_or_default();
        let (entries, mut problems) = parse(&value);
        let wanted: BTreeMap<String, Wanted> = entries
            .into_iter()
            .map(|(device, reason)| {
                let wanted = Wanted {
                    device: device.clone(),
                    reason,
                    who: String::new(),
                };
                (device, wanted)
            })
            .collect();
        let released_by = format!("the node annotation {ANNOTATION}");
        for (device, e) in apply(
            &queries,
            FROM_ENTRY,
            &wanted,
            &BTreeSet::new(),
            &released_by,
        )
        .await
        {
            problems.push(format!("{device}: {e}"));
        }
        if problems.is_empty() || reported.as_deref() == Some(value.as_str()) {
            continue;
        }
        reported = Some(value);
        let text = format!(
            "annotation {ANNOTATION}: entries not applied: {}",
            problems.join("; ")
        );
        tracing::warn!(%node, "{text}");
        let note = Note {
            target: Target::Node,
            type_: EventType::Warning,
            reason: INVALID_REASON,
            text,
        };
        if notes.send(note).await.is_err() {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_device_equals_reason_and_bad_ones_are_named() {
        let (entries, problems) = parse(
            "GPU-a=burn-in failed, GPU-b = NVLink errors ,, no-equals, =orphan, GPU-c=, GPU-a=again",
        );
        assert_eq!(entries.get("GPU-a").map(String::as_str), Some("again"));
        assert_eq!(
            entries.get("GPU-b").map(String::as_str),
            Some("NVLink errors")
        );
        assert_eq!(entries.len(), 2);
        assert_eq!(problems.len(), 4, "{problems:?}");
        assert!(problems[0].contains("no-equals") && problems[0].contains("<device>=<reason>"));
        assert!(problems[1].contains("no device UUID"));
        assert!(problems[2].contains("no reason"));
        assert!(problems[3].contains("listed twice"));
        assert_eq!(parse(""), (BTreeMap::new(), Vec::new()));
    }

    #[test]
    fn an_entry_cannot_forge_a_log_line_or_drive_a_terminal() {
        let (entries, problems) =
            parse("GPU-a=ok\nlevel=INFO msg=forged, GPU-b\u{1b}[2J=x, GPU-b\u{1b}[2J=y");
        assert_eq!(
            entries.get("GPU-a").map(String::as_str),
            Some("ok\\nlevel=INFO msg=forged")
        );
        assert!(entries.contains_key("GPU-b\\u{1b}[2J"));
        assert!(
            problems.iter().all(|p| !p.contains('\u{1b}')),
            "{problems:?}"
        );
    }
}
