//! `/status` as a page for a browser: the same [`Report`] the JSON and the `status` table render, as one HTML
//! table per GPU (NVML index, UUID, resource, health in colour, the message, the conditions with their times,
//! the pods holding it, the fences with who and why). Pure: a report in, a page out.
//!
//! The page is plain on purpose: no script, no outside asset (fonts, images, style sheets), one inline style
//! sheet; the response's Content-Security-Policy ([`CONTENT_SECURITY_POLICY`]) forbids anything else, so a
//! string that slipped past the escaping still could not run. Every string in the report came from the running
//! plugin and many from outside it (a fence's reason from a Node annotation, a pod's name): each is shown
//! through [`crate::util::text::shown`] (control characters escaped, capped) and then HTML-escaped.

use std::fmt::Write as _;

use crate::http::status::{ConditionStatus, DeviceStatus, Report};
use crate::util::text;

/// What the page may load: its own inline style sheet, nothing else (no script, no image, no frame, no form).
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// Whether a request's `Accept` header asks for HTML (a browser's does; curl's `*/*`, Prometheus's and the
/// `status` command's do not, and keep the JSON).
pub fn wants_html(accept: Option<&str>) -> bool {
    accept.is_some_and(|accept| {
        accept.split(',').any(|range| {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or_default().trim();
            // `text/html;q=0` is a refusal of HTML, as RFC 9110 12.4.2 reads it.
            let refused = parts.any(|p| {
                p.trim()
                    .strip_prefix("q=")
                    .and_then(|q| q.trim().parse::<f32>().ok())
                    .is_some_and(|q| q <= 0.0)
            });
            media.eq_ignore_ascii_case("text/html") && !refused
        })
    })
}

/// The inline style sheet: health in colour (green, red; grey for a GPU not served), a table per GPU.
const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:1.5em;color:#1b1b1b;background:#fff}\
h1{font-size:1.4em;margin:0 0 .3em}h2{font-size:1.1em;margin:1.4em 0 .4em}\
p.summary{margin:.2em 0 1em}\
table{border-collapse:collapse;margin:0 0 1.2em;min-width:40em}\
caption{text-align:left;font-weight:600;padding:.3em 0}\
th,td{border:1px solid #c8c8c8;padding:.3em .6em;text-align:left;vertical-align:top}\
th{background:#f2f2f2;font-weight:600;white-space:nowrap}\
td.mono,.mono{font-family:ui-monospace,monospace}\
table.conditions,table.fences{margin:0;min-width:0}\
.health{font-weight:700;padding:.1em .5em;border-radius:.3em;color:#fff}\
.health.healthy{background:#1e7b34}.health.unhealthy{background:#c0262d}.health.not-served{background:#6b6b6b}\
table.device{width:100%;max-width:80em}table.device>tbody>tr>th{width:9em}table.device.unhealthy{border-left:.4em solid #c0262d}table.device.healthy{border-left:.4em solid #1e7b34}\
.none{color:#6b6b6b}";

/// The report as an HTML page.
pub fn html(report: &Report) -> String {
    let unhealthy = report
        .devices
        .iter()
        .filter(|d| d.health != "Healthy")
        .count();
    let mut page = String::with_capacity(4096 + 2048 * report.devices.len());
    let title = format!(
        "GPU health: {} device{}, {unhealthy} Unhealthy",
        report.devices.len(),
        if report.devices.len() == 1 { "" } else { "s" }
    );
    let _ = write!(
        page,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width\">\n<title>{title}</title>\n\
         <style>{STYLE}</style>\n</head>\n<body>\n<h1>{title}</h1>\n<p class=\"summary\">{}</p>\n",
        link_summary(report)
    );
    for device in &report.devices {
        device_table(&mut page, device);
    }
    if !report.unserved.is_empty() {
        page.push_str("<h2>Present but not served</h2>\n");
        page.push_str("<table class=\"unserved\">\n<tr><th>NVML index</th><th>UUID</th><th>Health</th><th>Why</th></tr>\n");
        for u in &report.unserved {
            let _ = writeln!(
                page,
                "<tr><td>{}</td><td class=\"mono\">{}</td><td><span class=\"health not-served\">not served</span></td><td>{}</td></tr>",
                u.index.map_or_else(|| "-".into(), |i| i.to_string()),
                shown(u.id.as_deref().unwrap_or("-")),
                shown(&u.why),
            );
        }
        page.push_str("</table>\n");
    }
    let p = &report.policy;
    let _ = write!(
        page,
        "<h2>Health policy</h2>\n<p>XIDs by the {} policy; recovery after {} quiet, probes every {}, recovery \
         action read every {}.</p>\n</body>\n</html>\n",
        shown(&p.xid_policy),
        shown(&p.quiet_period),
        shown(&p.probe_interval),
        shown(&p.recovery_action_interval),
    );
    page
}

/// The kubelet's and the DRA side's word on the plugin, in one line.
fn link_summary(report: &Report) -> String {
    let mut parts = Vec::new();
    let k = &report.kubelet;
    if !(k.resource.is_empty() && report.dra.is_some()) {
        let mut line = format!(
            "Kubelet: {} ({}, {} stream{} open, {} registration{})",
            if k.registered {
                "registered"
            } else {
                "<strong>NOT registered</strong>"
            },
            shown(&k.resource),
            k.streams_open,
            if k.streams_open == 1 { "" } else { "s" },
            k.registrations,
            if k.registrations == 1 { "" } else { "s" },
        );
        for other in &report.other_resources {
            let _ = write!(
                line,
                "; {}: {}",
                shown(&other.resource),
                if other.registered {
                    "registered"
                } else {
                    "<strong>NOT registered</strong>"
                }
            );
        }
        parts.push(line);
    }
    if let Some(dra) = &report.dra {
        parts.push(format!(
            "DRA: {} as {} ({} device{} prepared){}",
            if dra.registered {
                "registered"
            } else {
                "<strong>NOT registered</strong>"
            },
            shown(&dra.driver),
            dra.prepared.len(),
            if dra.prepared.len() == 1 { "" } else { "s" },
            dra.error
                .as_ref()
                .map(|e| format!(", the kubelet said: {}", shown(e)))
                .unwrap_or_default(),
        ));
    }
    parts.join(". ")
}

/// One GPU's table.
fn device_table(page: &mut String, d: &DeviceStatus) {
    let class = health_class(&d.health);
    let _ = writeln!(
        page,
        "<table class=\"device {class}\" id=\"gpu-{}\">\n<caption>GPU {} <span class=\"health {class}\">{}</span></caption>",
        anchor(&d.id),
        d.index,
        shown(&d.health),
    );
    row(page, "NVML index", &d.index.to_string());
    row(
        page,
        "UUID",
        &format!("<span class=\"mono\">{}</span>", shown(&d.id)),
    );
    let resource = match &d.dra {
        Some(dra) => format!("DRA: {} / {}", shown(&dra.driver), shown(&dra.device)),
        None if d.resource.is_empty() => none(),
        None => shown(&d.resource),
    };
    row(page, "Resource", &resource);
    if let Some(mig) = &d.mig {
        row(
            page,
            "MIG",
            &format!(
                "{} on <span class=\"mono\">{}</span>",
                shown(&mig.profile),
                shown(&mig.parent)
            ),
        );
    }
    row(
        page,
        "Health",
        &format!("<span class=\"health {class}\">{}</span>", shown(&d.health)),
    );
    row(
        page,
        "Message",
        &d.message.as_deref().map_or_else(none, shown),
    );
    row(page, "Conditions", &conditions(&d.conditions));
    let mut holders: Vec<String> = d
        .pods
        .iter()
        .map(|h| {
            format!(
                "{}/{} ({})",
                shown(&h.namespace),
                shown(&h.pod),
                shown(&h.container)
            )
        })
        .collect();
    if let Some(claim) = d.dra.as_ref().and_then(|dra| dra.claim.as_ref()) {
        holders.push(format!("claim {}", shown(claim)));
    }
    row(
        page,
        "Pods holding it",
        &if holders.is_empty() {
            none()
        } else {
            holders.join("<br>")
        },
    );
    row(page, "Fences", &fences(&d.conditions));
    page.push_str("</table>\n");
}

/// The conditions as a small table: which, its effect, how it recovers, how often and when it was seen.
fn conditions(conditions: &[ConditionStatus]) -> String {
    if conditions.is_empty() {
        return none();
    }
    let mut out = String::from(
        "<table class=\"conditions\"><tr><th>Condition</th><th>Effect</th><th>Recovers</th><th>Seen</th>\
         <th>First seen</th><th>Last seen</th><th>Detail</th></tr>",
    );
    for c in conditions {
        let name = match c.value {
            Some(v) => format!("{}-{v}", c.kind),
            None => c.kind.clone(),
        };
        let _ = write!(
            out,
            "<tr><td class=\"mono\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            shown(&name),
            shown(&c.effect),
            shown(&c.recover),
            if c.count == 1 {
                "once".to_string()
            } else {
                format!("{} times", c.count)
            },
            shown(&c.first_seen),
            shown(&c.last_seen),
            c.detail.as_deref().map_or_else(none, shown),
        );
    }
    out.push_str("</table>");
    out
}

/// The `fenced` conditions, with who set each and why (the detail is `by <who>: <why>`) and since when.
fn fences(conditions: &[ConditionStatus]) -> String {
    let fences: Vec<&ConditionStatus> = conditions.iter().filter(|c| c.kind == "fenced").collect();
    if fences.is_empty() {
        return none();
    }
    let mut out =
        String::from("<table class=\"fences\"><tr><th>By</th><th>Why</th><th>Since</th></tr>");
    for fence in fences {
        let detail = fence.detail.as_deref().unwrap_or_default();
        let (who, why) = match detail.split_once(": ") {
            Some((who, why)) => (who.strip_prefix("by ").unwrap_or(who), why),
            None => ("", detail),
        };
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
            if who.is_empty() { none() } else { shown(who) },
            shown(why),
            shown(&fence.first_seen),
        );
    }
    out.push_str("</table>");
    out
}

fn row(page: &mut String, name: &str, value: &str) {
    let _ = writeln!(page, "<tr><th>{name}</th><td>{value}</td></tr>");
}

fn none() -> String {
    "<span class=\"none\">none</span>".into()
}

/// The CSS class of a health: `healthy`, `unhealthy`, or `not-served` for anything else.
fn health_class(health: &str) -> &'static str {
    match health {
        "Healthy" => "healthy",
        "Unhealthy" => "unhealthy",
        _ => "not-served",
    }
}

/// A device ID as an element id: letters, digits and `-` kept, anything else `_`.
fn anchor(id: &str) -> String {
    id.chars()
        .take(text::SHOWN_MAX)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Outside text as the page shows it: control characters escaped and capped as on every other surface, then
/// HTML-escaped.
fn shown(s: &str) -> String {
    escape(&text::shown(s, text::LINE_MAX))
}

/// `s` with HTML's five special characters escaped, safe in element content and quoted attributes.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests;
