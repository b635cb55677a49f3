use super::*;
use crate::devices::mig::MigInfo;
use crate::devices::{DeviceInfo, Health};
use crate::health::policy::Recover;
use crate::health::{Condition, Effect};
use crate::monitor::{ConditionSnapshot, DeviceSnapshot};

/// A device, fenced with `detail` if given.
fn device(id: &str, fenced: Option<&str>) -> DeviceSnapshot {
    let at = std::time::SystemTime::UNIX_EPOCH;
    DeviceSnapshot {
        info: DeviceInfo {
            id: id.into(),
            ..DeviceInfo::default()
        },
        index: 0,
        health: Health::Healthy,
        message: None,
        conditions: fenced
            .map(|detail| ConditionSnapshot {
                condition: Condition {
                    kind: ConditionKind::Fenced,
                    detail: Some(detail.into()),
                    count: 1,
                    first_seen: at,
                    last_seen: at,
                },
                effect: Effect::Unhealthy,
                recover: Recover::Auto,
            })
            .into_iter()
            .collect(),
    }
}

fn mig(id: &str, parent: &str, fenced: Option<&str>) -> DeviceSnapshot {
    let mut device = device(id, fenced);
    device.info.mig = Some(MigInfo {
        parent: parent.into(),
        profile: "1g.10gb".into(),
        gpu_instance: 1,
        compute_instance: 0,
    });
    device
}

fn want(device: &str, reason: &str) -> Wanted {
    Wanted {
        device: device.into(),
        reason: reason.into(),
        who: "dcgm".into(),
    }
}

/// The detail a fence from `file` for `reason` has.
fn detail(file: &str, reason: &str) -> String {
    format!("by dcgm{FROM_FILE}{file}: {reason}")
}

fn wanted(entries: &[(&str, Wanted)]) -> BTreeMap<String, Wanted> {
    entries
        .iter()
        .map(|(k, w)| (k.to_string(), w.clone()))
        .collect()
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

#[test]
fn a_report_naming_a_device_not_on_the_node_is_answered_without_asking_the_monitor() {
    let devices = [device("GPU-0", None)];
    let plan = plan(
        &devices,
        FROM_FILE,
        &wanted(&[("elsewhere.json", want("GPU-\u{1b}[2Jx", "thermal"))]),
        &BTreeSet::new(),
    );
    assert!(plan.fence.is_empty() && plan.release.is_empty());
    assert_eq!(plan.failed.len(), 1);
    let said = plan.failed[0].1.to_string();
    assert!(
        said.contains("no device GPU-\\u{1b}[2Jx") && said.contains("GPU-0"),
        "{said}"
    );
}

#[test]
fn a_held_file_keeps_its_fence_and_a_file_gone_releases_its_own() {
    let devices = [
        device("GPU-0", Some(&detail("held.json", "burn-in"))),
        device("GPU-1", Some(&detail("gone.json", "burn-in"))),
        device(
            "GPU-2",
            Some("by alice (uid 0) via the control socket, pid 1: maintenance"),
        ),
    ];
    let held = BTreeSet::from(["held.json".to_string()]);
    let plan = plan(&devices, FROM_FILE, &BTreeMap::new(), &held);
    assert!(plan.fence.is_empty());
    assert_eq!(plan.release, pairs(&[("GPU-1", "gone.json")]));
}

#[test]
fn a_gpu_two_files_fence_stays_fenced_when_one_of_them_is_removed() {
    // a.json set the fence; b.json wants the same GPU. a.json removed: b.json takes the fence over, and
    // nothing is released.
    let devices = [device("GPU-0", Some(&detail("a.json", "ecc")))];
    let taken = plan(
        &devices,
        FROM_FILE,
        &wanted(&[("b.json", want("GPU-0", "nvlink"))]),
        &BTreeSet::new(),
    );
    assert_eq!(taken.fence, pairs(&[("GPU-0", "b.json")]));
    assert!(taken.release.is_empty());
    // Both there: the fence in place stays as it is, whichever comes first by name.
    let devices = [device("GPU-0", Some(&detail("b.json", "nvlink")))];
    let both = plan(
        &devices,
        FROM_FILE,
        &wanted(&[
            ("a.json", want("GPU-0", "ecc")),
            ("b.json", want("GPU-0", "nvlink")),
        ]),
        &BTreeSet::new(),
    );
    assert_eq!(both, Plan::default());
}

#[test]
fn a_report_moved_to_another_gpu_fences_that_one_and_releases_the_first() {
    let devices = [
        device("GPU-0", Some(&detail("r.json", "ecc"))),
        device("GPU-1", None),
    ];
    let plan = plan(
        &devices,
        FROM_FILE,
        &wanted(&[("r.json", want("GPU-1", "ecc"))]),
        &BTreeSet::new(),
    );
    assert_eq!(plan.fence, pairs(&[("GPU-1", "r.json")]));
    assert_eq!(plan.release, pairs(&[("GPU-0", "r.json")]));
}

#[test]
fn a_gpus_uuid_fences_its_mig_devices_once_and_a_changed_reason_fences_again() {
    let devices = [mig("MIG-a", "GPU-0", None), mig("MIG-b", "GPU-0", None)];
    let report = wanted(&[("r.json", want("GPU-0", "ecc"))]);
    let plan1 = plan(&devices, FROM_FILE, &report, &BTreeSet::new());
    assert_eq!(plan1.fence, pairs(&[("GPU-0", "r.json")]));
    let fenced = detail("r.json", "ecc");
    let devices = [
        mig("MIG-a", "GPU-0", Some(&fenced)),
        mig("MIG-b", "GPU-0", Some(&fenced)),
    ];
    assert_eq!(
        plan(&devices, FROM_FILE, &report, &BTreeSet::new()),
        Plan::default()
    );
    let changed = wanted(&[("r.json", want("GPU-0", "ecc and nvlink"))]);
    let plan3 = plan(&devices, FROM_FILE, &changed, &BTreeSet::new());
    assert_eq!(plan3.fence, pairs(&[("GPU-0", "r.json")]));
    assert!(plan3.release.is_empty());
}

#[test]
fn a_reports_reason_and_detector_are_made_printable() {
    let report = parse_report(
        br#"{"device": " GPU-1 ", "reason": "thermal\n2026-11-26T00:00:00Z INFO forged", "by": "det\u001b[2J"}"#,
    );
    let report = report.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.device, "GPU-1");
    assert_eq!(report.reason, "thermal\\n2026-11-26T00:00:00Z INFO forged");
    assert_eq!(report.by.as_deref(), Some("det\\u{1b}[2J"));
    let unknown = parse_report(br#"{"device": "GPU-1", "reason": "x", "evil\nfield": 1}"#);
    let said = unknown.err().unwrap_or_default();
    assert!(
        !said.contains('\n') && said.contains("evil\\nfield"),
        "{said}"
    );
}
