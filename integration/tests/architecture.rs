//! The house rules of `src/`, checked: each top-level room uses only the rooms below it (so no circle between
//! rooms can come back), and the health engine stays pure (no tokio, no file system, no output).
//!
//! Read from the sources themselves: every `crate::<room>` path outside comments and test code counts.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The rooms of `src/`, lowest first: a room may use only the rooms before it. The data flows up this list:
/// sources → device model → health engine → monitor → outputs, with operator inputs and configuration on top.
const ROOMS: &[&str] = &[
    "util", // text, threads and runtimes, the open-file limit, bounded sockets, Unix-socket channels
    "api",  // the kubelet's wire types, generated from proto/
    "devices", // the device model: inventory, MIG, naming, resources, sharing, allocation
    "health", // the pure engine: policy, XID catalog, messages, the checkpoint's record
    "sources", // where devices and events come from: NVML, simulated GPUs, the fault script
    "metrics", // the Prometheus metrics, recorded by the rooms above
    "monitor", // the task around the engine: inventory, checkpoint file, operator requests
    "kubelet", // the device plugin server, registration, the socket watch, pod-resources
    "cluster", // the Kubernetes API: Events, the node condition
    "dra",  // serving GPUs through DRA: registration, prepare and its record, the health stream
    "http", // /healthz, /readyz, /status, /metrics and the status report
    "fence", // operator inputs: the control socket, the fence directory, the Node annotation
    "config", // flags, environment, our config file and NVIDIA's
    "roads", // which GPU on which road, each resource's registration, a change of roads checked
    "reload", // a SIGHUP's reload: the roads' change checked, the GPUs watched across the restart
    "commands", // the binary's commands: status, fence, release, check-config, the reload's own
];

/// What the health engine may use, of the rooms below it.
const HEALTH_USES: &[&str] = &["util", "devices"];

/// Paths the health engine must never name: it is pure (events and time in, conditions out).
const HEALTH_NEVER: &[&str] = &[
    "tokio",
    "std::fs",
    "std::net",
    "std::thread",
    "std::process",
    "std::io",
    "tempfile",
    "File::",
];

/// A use of one room by another, where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Use {
    room: String,
    line: usize,
}

/// The production code of a source file: test code (from the first `#[cfg(test)]`) and comments removed,
/// each kept line with its number.
fn production_lines(text: &str) -> Vec<(usize, &str)> {
    let mut kept = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]") {
            break;
        }
        if trimmed.starts_with("//") {
            continue;
        }
        // A trailing comment is not code either.
        let code = line.split_once("//").map_or(line, |(code, _)| code);
        kept.push((i + 1, code));
    }
    kept
}

/// Every room `text` names through `crate::`, with `use crate::{a, b::c}` groups taken apart.
fn rooms_used(text: &str) -> Vec<Use> {
    let mut uses = Vec::new();
    for (line, code) in production_lines(text) {
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let inner = group.split('}').next().unwrap_or_default();
                for part in inner.split(',') {
                    let room: String = part
                        .trim()
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if !room.is_empty() {
                        uses.push(Use { room, line });
                    }
                }
            } else {
                let room: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !room.is_empty() {
                    uses.push(Use { room, line });
                }
            }
        }
    }
    uses
}

/// What is wrong with one file of `room`, in words naming the file and line.
fn violations(room: &str, file: &str, text: &str) -> Vec<String> {
    let mut wrong = Vec::new();
    let Some(rank) = ROOMS.iter().position(|r| *r == room) else {
        return vec![format!(
            "{file}: room {room} is not in ROOMS: give it its place in the order"
        )];
    };
    let below = &ROOMS[..rank];
    for used in rooms_used(text) {
        if used.room == room {
            continue;
        }
        let allowed = if room == "health" {
            HEALTH_USES.contains(&used.room.as_str())
        } else {
            below.contains(&used.room.as_str())
        };
        if !allowed {
            let may = if room == "health" { HEALTH_USES } else { below };
            wrong.push(format!(
                "{file}:{}: {room} uses crate::{}, but may use only: {}",
                used.line,
                used.room,
                may.join(", ")
            ));
        }
    }
    if room == "health" {
        for (line, code) in production_lines(text) {
            for never in HEALTH_NEVER {
                if code.contains(never) {
                    wrong.push(format!(
                        "{file}:{line}: the health engine is pure, but names {never}"
                    ));
                }
            }
        }
    }
    wrong
}

/// Every `.rs` file under `dir`, test-only files (`tests.rs`, `tests/`) left out.
fn sources(dir: &Path, into: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if path.is_dir() {
            if name != "tests" {
                sources(&path, into)?;
            }
        } else if name.ends_with(".rs") && name != "tests.rs" {
            into.push(path);
        }
    }
    Ok(())
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn every_room_uses_only_the_rooms_below_it_and_health_stays_pure() -> std::io::Result<()> {
    let src = src();
    let mut files = Vec::new();
    sources(&src, &mut files)?;
    let mut wrong = Vec::new();
    let mut checked = 0;
    for path in files {
        let relative = path.strip_prefix(&src).unwrap_or(&path);
        let first = relative
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .unwrap_or_default();
        let room = first.trim_end_matches(".rs");
        if matches!(room, "lib" | "main") {
            continue;
        }
        let text = std::fs::read_to_string(&path)?;
        wrong.extend(violations(room, &relative.display().to_string(), &text));
        checked += 1;
    }
    assert!(
        checked > 20,
        "only {checked} files found under {}",
        src.display()
    );
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
    Ok(())
}

#[test]
fn the_rooms_are_the_modules_lib_rs_declares() -> std::io::Result<()> {
    let lib = std::fs::read_to_string(src().join("lib.rs"))?;
    let declared: BTreeSet<&str> = lib
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod "))
        .map(|m| m.trim_end_matches(';'))
        .collect();
    let listed: BTreeSet<&str> = ROOMS.iter().copied().collect();
    assert_eq!(declared, listed, "lib.rs and ROOMS disagree");
    Ok(())
}

#[test]
fn a_use_of_a_room_above_is_caught_and_comments_and_tests_are_not_uses() {
    let text = "\
//! Uses of [`crate::http`] in docs are not uses.
use crate::devices::Inventory;
use crate::{util::text, monitor::MonitorHandle};
fn f() { crate::kubelet::run(); } // crate::cluster in a comment
#[cfg(test)]
mod tests { use crate::config::Settings; }
";
    let wrong = violations("sources", "sources/x.rs", text);
    assert_eq!(
        wrong,
        [
            "sources/x.rs:3: sources uses crate::monitor, but may use only: util, api, devices, health",
            "sources/x.rs:4: sources uses crate::kubelet, but may use only: util, api, devices, health",
        ]
    );
    let impure = violations(
        "health",
        "health/x.rs",
        "use tokio::sync::mpsc;\nuse crate::metrics::Metrics;\n",
    );
    assert_eq!(
        impure,
        [
            "health/x.rs:2: health uses crate::metrics, but may use only: util, devices",
            "health/x.rs:1: the health engine is pure, but names tokio",
        ]
    );
}
