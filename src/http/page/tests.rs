use super::*;
use crate::http::status::{DraDevice, KubeletStatus};

fn condition(kind: &str, value: Option<u64>, detail: Option<&str>) -> ConditionStatus {
    ConditionStatus {
        kind: kind.into(),
        value,
        effect: "Unhealthy".into(),
        recover: "auto".into(),
        detail: detail.map(String::from),
        count: 1,
        first_seen: "2026-11-28T09:00:00Z".into(),
        last_seen: "2026-11-28T09:01:00Z".into(),
    }
}

fn report() -> Report {
    Report {
        devices: vec![
            DeviceStatus {
                id: "GPU-a".into(),
                index: 0,
                resource: "nvidia.com/gpu".into(),
                health: "Healthy".into(),
                ..DeviceStatus::default()
            },
            DeviceStatus {
                id: "GPU-b".into(),
                index: 1,
                resource: "nvidia.com/gpu".into(),
                health: "Unhealthy".into(),
                message: Some("Unhealthy: XID 79: the GPU has fallen off the bus".into()),
                conditions: vec![
                    condition("xid", Some(79), None),
                    condition(
                        "fenced",
                        None,
                        Some("by alice (uid 0) via the control socket, pid 7: burn-in failed"),
                    ),
                ],
                pods: vec![crate::kubelet::pods::Holder {
                    namespace: "ml".into(),
                    pod: "train-0".into(),
                    container: "trainer".into(),
                }],
                ..DeviceStatus::default()
            },
        ],
        kubelet: KubeletStatus {
            resource: "nvidia.com/gpu".into(),
            registered: true,
            streams_open: 1,
            registrations: 1,
            ..KubeletStatus::default()
        },
        ..Report::default()
    }
}

/// The table of the device whose caption names `index`.
fn table_of(page: &str, index: usize) -> &str {
    let start = page
        .find(&format!("<caption>GPU {index} "))
        .unwrap_or_else(|| panic!("no table of GPU {index}: {page}"));
    let end = page[start..]
        .find("</table>\n")
        .map_or(page.len(), |e| start + e);
    &page[start..end]
}

#[test]
fn a_browser_asks_for_html_and_curl_prometheus_and_the_status_command_get_json() {
    let chromium =
        "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8";
    assert!(wants_html(Some(chromium)));
    assert!(wants_html(Some("TEXT/HTML")));
    assert!(!wants_html(Some("*/*")), "curl");
    assert!(!wants_html(None), "the status command sends no Accept");
    assert!(!wants_html(Some(
        "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    )));
    assert!(!wants_html(Some("application/json, text/html;q=0")));
}

#[test]
fn each_gpu_has_a_table_with_its_index_uuid_resource_health_message_conditions_pods_and_fences() {
    let page = html(&report());
    assert!(page.starts_with("<!DOCTYPE html>"), "{page}");
    assert!(
        page.contains("<title>GPU health: 2 devices, 1 Unhealthy</title>"),
        "{page}"
    );
    let bad = table_of(&page, 1);
    for shown in [
        "<tr><th>NVML index</th><td>1</td></tr>",
        "<span class=\"mono\">GPU-b</span>",
        "<tr><th>Resource</th><td>nvidia.com/gpu</td></tr>",
        "<span class=\"health unhealthy\">Unhealthy</span>",
        "Unhealthy: XID 79: the GPU has fallen off the bus",
        "<td class=\"mono\">xid-79</td>",
        "2026-11-28T09:00:00Z",
        "ml/train-0 (trainer)",
        "<tr><td>alice (uid 0) via the control socket, pid 7</td><td>burn-in failed</td><td>2026-11-28T09:00:00Z</td></tr>",
    ] {
        assert!(bad.contains(shown), "missing {shown:?} in {bad}");
    }
    let good = table_of(&page, 0);
    assert!(
        good.contains("<span class=\"health healthy\">Healthy</span>"),
        "{good}"
    );
    assert!(
        good.contains("<tr><th>Fences</th><td><span class=\"none\">none</span></td></tr>"),
        "{good}"
    );
}

#[test]
fn the_page_has_no_script_and_loads_nothing_from_outside() {
    let page = html(&report());
    for forbidden in [
        "<script", "src=", "href=", "<link", "@import", "url(", "<img", "<iframe",
    ] {
        assert!(!page.contains(forbidden), "{forbidden} in {page}");
    }
}

#[test]
fn outside_text_is_escaped_and_cannot_add_markup() {
    let mut report = report();
    report.devices[1].conditions[1].detail =
        Some("by <b>mallory</b>: <script>alert(1)</script>\u{1b}[2J".into());
    report.devices[1].pods[0].pod = "x\"><img src=y>".into();
    let page = html(&report);
    assert!(
        !page.contains("<script>") && !page.contains("<img") && !page.contains("<b>"),
        "{page}"
    );
    assert!(
        page.contains("<td>&lt;b&gt;mallory&lt;/b&gt;</td><td>&lt;script&gt;alert(1)&lt;/script&gt;\\u{1b}[2J</td>"),
        "{page}"
    );
    assert!(
        page.contains("ml/x&quot;&gt;&lt;img src=y&gt; (trainer)"),
        "{page}"
    );
}

#[test]
fn a_huge_message_is_cut_not_copied_whole() {
    let mut report = report();
    report.devices[1].message = Some("x".repeat(10 << 20));
    let page = html(&report);
    assert!(page.len() < 64 * 1024, "{} bytes", page.len());
    assert!(page.contains("more bytes)"));
}

#[test]
fn a_dra_gpu_shows_its_driver_device_and_claim_and_the_dra_registration() {
    let mut report = report();
    report.kubelet = KubeletStatus::default();
    report.devices[0].resource = String::new();
    report.devices[0].dra = Some(DraDevice {
        driver: "gpu.nvidia.com".into(),
        device: "gpu-0".into(),
        claim: Some("ml/train-gpu".into()),
    });
    report.dra = Some(crate::dra::registration::DraStatus {
        driver: "gpu.nvidia.com".into(),
        registered: false,
        ..Default::default()
    });
    let page = html(&report);
    let table = table_of(&page, 0);
    assert!(table.contains("DRA: gpu.nvidia.com / gpu-0"), "{table}");
    assert!(table.contains("claim ml/train-gpu"), "{table}");
    assert!(
        page.contains("DRA: <strong>NOT registered</strong> as gpu.nvidia.com"),
        "{page}"
    );
    assert!(
        !page.contains("Kubelet:"),
        "no device plugin registration to speak of: {page}"
    );
}
