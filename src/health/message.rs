//! The per-device health message, in the shape of the KEP-4680 device health message: what happened, what it
//! means, what to do, how often and when; at most 1024 characters.

use std::time::SystemTime;

use super::{Condition, ConditionKind, Effect, Policy, xid_info};
use crate::devices::Health;

/// KEP-4680's limit on a health message, in characters.
pub const MAX_MESSAGE_CHARS: usize = 1024;

/// The message for a device with `conditions` (Unhealthy ones first) and `other_xids` beyond them, or `None`
/// when it has no condition.
pub fn compose(
    health: Health,
    conditions: &[Condition],
    other_xids: super::OtherXids,
    policy: &Policy,
) -> Option<String> {
    if conditions.is_empty() {
        return None;
    }
    let (mut unhealthy, mut recorded) = (Vec::new(), Vec::new());
    for c in conditions {
        let effect = policy.effect(&c.kind);
        let text = describe(c, effect, policy.overridden_by(&c.kind));
        match effect {
            Effect::Unhealthy => unhealthy.push(text),
            Effect::None => recorded.push(text),
        }
    }
    if other_xids.events > 0 {
        // Right after the first condition, where the 1024-character cut does not reach it: past 16 XIDs the
        // list of those kept alone is longer than that.
        let note = format!(
            "Also {} event(s) of other XIDs (the latest dropped: {}), counted only: a GPU keeps {} distinct XIDs, the strongest and newest.",
            other_xids.events,
            other_xids
                .last
                .map_or_else(|| "unknown".to_string(), |x| x.to_string()),
            super::MAX_XID_CONDITIONS
        );
        let list = if unhealthy.is_empty() {
            &mut recorded
        } else {
            &mut unhealthy
        };
        list.insert(list.len().min(1), note);
    }
    let mut text = format!("{health}: ");
    text.push_str(&unhealthy.join(" "));
    if !recorded.is_empty() {
        if !unhealthy.is_empty() {
            text.push(' ');
        }
        text.push_str("Also recorded, not affecting health: ");
        text.push_str(&recorded.join(" "));
    }
    Some(truncate(&text))
}

/// Cuts `text` to the KEP's limit: longer messages keep 1021 characters and end in "...".
pub fn truncate(text: &str) -> String {
    if text.chars().count() <= MAX_MESSAGE_CHARS {
        return text.to_string();
    }
    let mut cut: String = text.chars().take(MAX_MESSAGE_CHARS - 3).collect();
    cut.push_str("...");
    cut
}

/// One condition as a sentence or two. Where a setting of this node, not the built-in table, decided the
/// effect, the advice says so: "restart the application; the GPU is fine" must not stand on a GPU the
/// operator's configuration took out of service.
fn describe(c: &Condition, effect: Effect, overridden_by: Option<&str>) -> String {
    let (what, advice) = meaning(&c.kind, c.detail.as_deref());
    let todo = match (overridden_by, effect) {
        (None, _) => advice,
        (Some(setting), Effect::Unhealthy) => format!(
            "Unhealthy by this node's configuration ({setting}); by default this would not take the GPU out \
             of service"
        ),
        (Some(setting), Effect::None) => {
            format!(
                "kept in service by this node's configuration ({setting}); by default: {advice}"
            )
        }
    };
    let times = match c.count {
        1 => format!("seen once at {}", rfc3339(c.first_seen)),
        n => format!(
            "seen {n} times, first {}, last {}",
            rfc3339(c.first_seen),
            rfc3339(c.last_seen)
        ),
    };
    format!("{what} ({}), {times}; {todo}.", c.kind)
}

/// What a condition means and what to do about it.
fn meaning(kind: &ConditionKind, detail: Option<&str>) -> (String, String) {
    match kind {
        ConditionKind::Xid(xid) => match xid_info(*xid) {
            Some(info) => (
                format!("XID {xid}: {}", info.meaning),
                info.action.advice().to_string(),
            ),
            None => (
                format!("XID {xid}: not in the built-in XID table"),
                "treated as needing a GPU reset; look it up in NVIDIA's XID catalog".into(),
            ),
        },
        ConditionKind::GpuLost => (
            "the GPU stopped answering (GPU is lost)".into(),
            "drain and reboot the node; if it recurs, check the GPU's power, cooling and seating"
                .into(),
        ),
        ConditionKind::EccDbe => (
            "double-bit (uncorrectable) ECC error".into(),
            "drain the GPU and reset it; replace it if errors recur".into(),
        ),
        ConditionKind::EccSbeBurst => (
            format!(
                "burst of corrected single-bit ECC errors ({})",
                detail.unwrap_or("over the threshold")
            ),
            "watch the trend; the GPU memory may be degrading".into(),
        ),
        ConditionKind::RecoveryAction(action) => {
            let (name, todo) = match action {
                1 => (
                    "GPU reset required",
                    "stop the GPU's workloads and reset it",
                ),
                2 => ("node reboot required", "drain and reboot the node"),
                3 => (
                    "drain peer-to-peer traffic",
                    "stop peer-to-peer traffic, then the driver re-evaluates",
                ),
                4 => (
                    "drain and reset",
                    "drain the GPU's workloads, then reset it",
                ),
                _ => ("unknown action", "check the driver's documentation"),
            };
            (
                format!("the driver reports recovery action {action} ({name})"),
                todo.into(),
            )
        }
        ConditionKind::Fenced => (
            format!(
                "fenced {}",
                detail.unwrap_or("by an operator")
            ),
            "kept out of service until an operator releases it (gpu-device-plugin release, the node \
             annotation or the fence directory, as it was set)"
                .into(),
        ),
        ConditionKind::Unmonitored => (
            format!(
                "health events are not watched: {}",
                detail.unwrap_or("unknown reason")
            ),
            "faults on this GPU go unnoticed; check the driver and the plugin's logs".into(),
        ),
    }
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}
