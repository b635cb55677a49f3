//! Health engine policies, each with an injected clock.

use std::time::{Duration, SystemTime};

use super::checkpoint::Durability;
use super::policy::{HealthConfig, Policy};
use super::*;

const GPU: &str = "GPU-a";

fn t(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + secs)
}

fn engine(yaml: &str) -> HealthEngine {
    let config: HealthConfig = serde_norway::from_str(yaml).unwrap_or_default();
    HealthEngine::new(Policy::new(&config, None, None).unwrap_or_default())
}

fn answered(action: Option<u32>) -> Observation {
    Observation::Probe(ProbeResult::Answered {
        recovery_action: action,
    })
}

/// Quiet period 10 min, probe interval 30 s (the defaults).
fn default_engine() -> HealthEngine {
    engine("{}")
}

#[test]
fn recovery_action_reported_by_the_driver_makes_the_gpu_unhealthy_until_it_returns_to_none() {
    let mut e = default_engine();
    let announced = e.observe(GPU, &Observation::Xid(154), t(0));
    assert!(
        announced.probe_now,
        "XID 154 asks for the recovery action to be read"
    );
    assert_eq!(
        announced.new,
        Health::Healthy,
        "XID 154 alone decides nothing"
    );
    let reset = e.observe(GPU, &answered(Some(1)), t(1));
    assert_eq!(reset.new, Health::Unhealthy);
    assert!(
        reset
            .message
            .is_some_and(|m| m.contains("GPU reset required"))
    );
    // Back to None: Healthy at once, no quiet period; the XID it followed is cleared with it.
    e.observe(GPU, &Observation::Xid(154), t(2));
    let back = e.observe(GPU, &answered(Some(0)), t(3));
    assert_eq!((back.old, back.new), (Health::Unhealthy, Health::Healthy));
    assert!(back.conditions.is_empty(), "{:?}", back.conditions);
}

#[test]
fn a_recovery_action_that_went_and_came_back_between_reads_still_clears() {
    let mut e = default_engine();
    e.observe(GPU, &Observation::Xid(79), t(0));
    // The driver went to 1 and back to 0 before the plugin read it: two XID 154s, one read of 0.
    e.observe(GPU, &Observation::Xid(154), t(1));
    e.observe(GPU, &Observation::Xid(154), t(2));
    assert_eq!(
        e.observe(GPU, &answered(Some(0)), t(3)).new,
        Health::Healthy
    );
    // Without an XID 154, a read of 0 is no news: the quiet period still applies.
    e.observe(GPU, &Observation::Xid(79), t(4));
    assert_eq!(
        e.observe(GPU, &answered(Some(0)), t(5)).new,
        Health::Unhealthy
    );
}

#[test]
fn the_driver_is_the_authority_over_the_quiet_period() {
    let mut e = default_engine();
    e.observe(GPU, &Observation::Xid(79), t(0));
    e.observe(GPU, &answered(Some(2)), t(1));
    // Long after the quiet period, the driver still asks for a reboot: still Unhealthy.
    assert_eq!(
        e.observe(GPU, &answered(Some(2)), t(3600)).new,
        Health::Unhealthy
    );
    assert_eq!(
        e.observe(GPU, &answered(Some(0)), t(3601)).new,
        Health::Healthy
    );
}

#[test]
fn a_reset_class_xid_recovers_after_the_quiet_period_and_a_successful_probe() {
    let mut e = default_engine();
    assert_eq!(
        e.observe(GPU, &Observation::Xid(109), t(0)).new,
        Health::Unhealthy
    );
    assert_eq!(
        e.next_deadline(),
        Some(t(600)),
        "first probe when the quiet period ends"
    );
    assert!(e.due_probes(t(599)).is_empty());
    // A probe before the quiet period is over changes nothing (driver without the field).
    assert_eq!(
        e.observe(GPU, &answered(None), t(300)).new,
        Health::Unhealthy
    );
    assert_eq!(e.due_probes(t(600)), vec![GPU.to_string()]);
    let recovered = e.observe(GPU, &answered(None), t(601));
    assert_eq!(
        (recovered.old, recovered.new),
        (Health::Unhealthy, Health::Healthy)
    );
    assert_eq!(recovered.message, None);
    assert_eq!(e.next_deadline(), None, "nothing left to probe");
}

#[test]
fn a_gpu_off_the_bus_is_served_at_its_first_answer_after_the_quiet_period() {
    let mut e = default_engine();
    e.observe(GPU, &Observation::Xid(79), t(0));
    for at in [600, 630] {
        let probed = e.observe(GPU, &Observation::Probe(ProbeResult::Lost), t(at));
        assert_eq!(probed.new, Health::Unhealthy);
        assert_eq!(e.next_deadline(), Some(t(at + 30)));
    }
    assert_eq!(e.observe(GPU, &answered(None), t(660)).new, Health::Healthy);
}

#[test]
fn a_new_fault_during_the_quiet_period_starts_it_again() {
    let mut e = default_engine();
    e.observe(GPU, &Observation::Xid(109), t(0));
    e.observe(GPU, &Observation::DoubleBitEcc, t(500));
    assert_eq!(
        e.observe(GPU, &answered(None), t(700)).new,
        Health::Unhealthy
    );
    assert_eq!(
        e.observe(GPU, &answered(None), t(1100)).new,
        Health::Healthy
    );
}

#[test]
fn harmless_events_do_not_delay_recovery() {
    let mut e = default_engine();
    e.observe(GPU, &Observation::Xid(109), t(0));
    e.observe(GPU, &Observation::Xid(13), t(590));
    assert_eq!(e.observe(GPU, &answered(None), t(601)).new, Health::Healthy);
}

#[test]
fn a_lost_gpu_recovers_only_once_it_answers_again() {
    let mut e = default_engine();
    e.observe(GPU, &Observation::GpuLost, t(0));
    // Probes keep failing while the GPU is off the bus.
    for at in [600, 630] {
        assert_eq!(
            e.observe(GPU, &Observation::Probe(ProbeResult::Lost), t(at))
                .new,
            Health::Unhealthy
        );
    }
    // Answering within the quiet period after a new loss the GPU raised is not enough.
    e.observe(GPU, &Observation::GpuLost, t(650));
    assert_eq!(
        e.observe(GPU, &answered(None), t(700)).new,
        Health::Unhealthy
    );
    assert_eq!(
        e.observe(GPU, &answered(None), t(1250)).new,
        Health::Healthy
    );
}

#[test]
fn a_lost_gpu_reset_during_its_probes_is_served_at_the_next_probe_not_a_quiet_period_later() {
    let mut e = default_engine();
    e.observe(GPU, &Observation::GpuLost, t(0));
    assert!(e.due_probes(t(599)).is_empty(), "quiet period");
    // From the end of the quiet period, a probe that finds the GPU still lost is retried every probe
    // interval: it is no new event, and does not start the quiet period again.
    let mut at = 600;
    while at <= 720 {
        assert_eq!(e.due_probes(t(at)), vec![GPU.to_string()], "at {at} s");
        let probed = e.observe(GPU, &Observation::Probe(ProbeResult::Lost), t(at));
        assert_eq!(probed.new, Health::Unhealthy);
        assert_eq!(
            e.next_deadline(),
            Some(t(at + 30)),
            "after the probe at {at} s"
        );
        at += 30;
    }
    // Reset 12 minutes after the loss, just after that probe: the next one, at 12.5 minutes, finds it
    // answering, and it is served.
    assert!(e.due_probes(t(749)).is_empty());
    assert_eq!(e.due_probes(t(750)), vec![GPU.to_string()]);
    assert_eq!(e.observe(GPU, &answered(None), t(750)).new, Health::Healthy);
    assert_eq!(e.next_deadline(), None, "nothing left to probe");
}

#[test]
fn a_failed_probe_is_retried_after_the_probe_interval() {
    let mut e = default_engine();
    e.observe(GPU, &Observation::Xid(109), t(0));
    assert_eq!(e.due_probes(t(600)).len(), 1);
    assert!(e.due_probes(t(610)).is_empty(), "already asked");
    e.observe(
        GPU,
        &Observation::Probe(ProbeResult::Failed("timeout".into())),
        t(611),
    );
    assert_eq!(
        e.due_probes(t(630)).len(),
        1,
        "asked again one probe interval later"
    );
}

#[test]
fn recover_never_holds_against_probes_and_the_driver() {
    let mut e = engine("conditions:\n  xid-79: {recover: never}\n");
    e.observe(GPU, &Observation::Xid(79), t(0));
    e.observe(GPU, &Observation::Xid(109), t(0));
    assert_eq!(
        e.next_deadline(),
        Some(t(600)),
        "the XID 109 may still recover"
    );
    e.observe(GPU, &answered(Some(1)), t(1));
    let after = e.observe(GPU, &answered(Some(0)), t(2));
    assert_eq!(after.new, Health::Unhealthy);
    assert_eq!(
        after.conditions,
        vec!["xid-79".to_string()],
        "109 cleared, 79 held"
    );
    assert_eq!(
        e.observe(GPU, &answered(None), t(100_000)).new,
        Health::Unhealthy
    );
}

#[test]
fn a_single_bit_ecc_burst_is_recorded_but_keeps_the_gpu_healthy() {
    let mut e = engine("sbeBurst: {count: 3, window: 1m}\n");
    for s in [0, 10, 20] {
        assert!(
            e.observe(GPU, &Observation::SingleBitEcc, t(s))
                .conditions
                .is_empty()
        );
    }
    let burst = e.observe(GPU, &Observation::SingleBitEcc, t(30));
    assert_eq!(burst.conditions, vec!["ecc-sbe-burst".to_string()]);
    assert_eq!(burst.new, Health::Healthy);
    // Spread out, the same number is no burst.
    let mut e = engine("sbeBurst: {count: 3, window: 1m}\n");
    for s in [0, 61, 122, 183] {
        assert!(
            e.observe(GPU, &Observation::SingleBitEcc, t(s))
                .conditions
                .is_empty()
        );
    }
}

#[test]
fn restoring_after_a_plugin_restart_keeps_an_unhealthy_gpu_unhealthy_with_its_message() {
    let mut before = default_engine();
    before.observe(GPU, &Observation::Xid(79), t(0));
    let message = before.message(GPU);
    let conditions = before
        .device(GPU)
        .map(|d| d.conditions().to_vec())
        .unwrap_or_default();
    let mut after = default_engine();
    let restored = after.restore(GPU, conditions, before.last_unhealthy(GPU), false, t(60));
    assert_eq!(restored.new, Health::Unhealthy);
    assert_eq!(restored.message, message);
    assert_eq!(
        after.next_deadline(),
        Some(t(600)),
        "recovery keeps its schedule"
    );
}

#[test]
fn a_new_boot_drops_what_a_reboot_resolves_but_not_recover_never() {
    let mut before = engine("conditions:\n  ecc-dbe: {recover: never}\n");
    before.observe(GPU, &Observation::Xid(79), t(0));
    before.observe(GPU, &Observation::DoubleBitEcc, t(1));
    let conditions = before
        .device(GPU)
        .map(|d| d.conditions().to_vec())
        .unwrap_or_default();
    let mut after = engine("conditions:\n  ecc-dbe: {recover: never}\n");
    let restored = after.restore(
        GPU,
        conditions.clone(),
        before.last_unhealthy(GPU),
        true,
        t(60),
    );
    assert_eq!(restored.conditions, vec!["ecc-dbe".to_string()]);
    let mut plain = default_engine();
    assert_eq!(
        plain.restore(GPU, conditions, None, true, t(60)).new,
        Health::Healthy
    );
}

#[test]
fn the_message_for_xid_79_says_what_happened_what_to_do_and_when() {
    let mut e = default_engine();
    e.observe(GPU, &Observation::Xid(79), t(0));
    let m = e
        .observe(GPU, &Observation::Xid(79), t(90))
        .message
        .unwrap_or_default();
    assert!(
        m.starts_with("Unhealthy: XID 79: the GPU has fallen off the bus"),
        "{m}"
    );
    assert!(m.contains("drain and reboot the node"), "{m}");
    assert!(
        m.contains("seen 2 times, first 2027-01-15T08:00:00Z, last 2027-01-15T08:01:30Z"),
        "{m}"
    );
}

#[test]
fn the_messages_for_dbe_and_a_lost_gpu_say_what_to_do() {
    let mut e = default_engine();
    let dbe = e
        .observe(GPU, &Observation::DoubleBitEcc, t(0))
        .message
        .unwrap_or_default();
    assert!(
        dbe.contains(
            "double-bit (uncorrectable) ECC error (ecc-dbe), seen once at 2027-01-15T08:00:00Z"
        ),
        "{dbe}"
    );
    assert!(dbe.contains("reset it"), "{dbe}");
    let lost = e
        .observe("GPU-b", &Observation::GpuLost, t(0))
        .message
        .unwrap_or_default();
    assert!(
        lost.contains("stopped answering (GPU is lost) (gpu-lost)")
            && lost.contains("reboot the node"),
        "{lost}"
    );
}

#[test]
fn recorded_conditions_are_in_the_message_but_say_they_do_not_affect_health() {
    let mut e = default_engine();
    let m = e.observe(GPU, &Observation::Xid(13), t(0));
    assert_eq!(m.new, Health::Healthy);
    let text = m.message.unwrap_or_default();
    assert!(
        text.starts_with("Healthy: Also recorded, not affecting health: XID 13"),
        "{text}"
    );
}

#[test]
fn an_xid_made_critical_by_the_operator_says_the_configuration_took_the_gpu_out() {
    let policy = Policy::new(&HealthConfig::default(), None, Some("31")).unwrap_or_default();
    let mut e = HealthEngine::new(policy);
    let outcome = e.observe(GPU, &Observation::Xid(31), t(0));
    assert_eq!(outcome.new, Health::Unhealthy);
    let m = outcome.message.unwrap_or_default();
    assert!(m.starts_with("Unhealthy: XID 31"), "{m}");
    assert!(
        m.contains("Unhealthy by this node's configuration (DP_ENABLE_HEALTHCHECKS)"),
        "{m}"
    );
    assert!(!m.contains("the GPU is fine"), "{m}");
}

#[test]
fn an_xid_ignored_by_the_operator_says_what_the_catalog_would_advise() {
    let mut e = engine("ignoredXids: [79]\n");
    let outcome = e.observe(GPU, &Observation::Xid(79), t(0));
    assert_eq!(outcome.new, Health::Healthy);
    let m = outcome.message.unwrap_or_default();
    assert!(
        m.contains(
            "kept in service by this node's configuration (health.ignoredXids); by default: drain and \
             reboot the node"
        ),
        "{m}"
    );
}

#[test]
fn a_long_history_is_cut_at_1024_characters_with_an_ellipsis() {
    let mut e = engine(
        "criticalXids: [1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007, 1008, 1009, 1010]\n",
    );
    let mut last = None;
    for xid in 1000..1011 {
        last = e.observe(GPU, &Observation::Xid(xid), t(xid)).message;
    }
    let m = last.unwrap_or_default();
    assert_eq!(m.chars().count(), 1024);
    assert!(m.ends_with("..."));
    assert!(m.starts_with("Unhealthy: XID 1000"));
}

#[test]
fn an_unmonitored_gpu_stays_healthy_and_says_why() {
    let mut e = default_engine();
    let m = e.observe(
        GPU,
        &Observation::Unmonitored("NVML refused the event registration".into()),
        t(0),
    );
    assert_eq!(m.new, Health::Healthy);
    assert!(
        m.message
            .is_some_and(|m| m.contains("NVML refused the event registration"))
    );
}

#[test]
fn a_gpu_watched_again_loses_its_unmonitored_condition_and_keeps_the_others() {
    let mut e = default_engine();
    e.observe(GPU, &Observation::Xid(79), t(0));
    e.observe(
        GPU,
        &Observation::Unmonitored("the event wait fails".into()),
        t(1),
    );
    let m = e.observe(GPU, &Observation::Monitored, t(2));
    assert!(m.conditions_changed);
    assert_eq!(m.conditions, ["xid-79"]);
    assert_eq!(m.new, Health::Unhealthy);
    let again = e.observe(GPU, &Observation::Monitored, t(3));
    assert!(!again.conditions_changed, "nothing to end the second time");
}

#[test]
fn the_nvidia_policy_and_dp_variables_change_xid_effects_in_the_engine() {
    let config: HealthConfig = serde_norway::from_str("xidPolicy: nvidia").unwrap_or_default();
    let policy = Policy::new(&config, None, Some("13")).unwrap_or_default();
    let mut e = HealthEngine::new(policy);
    assert_eq!(
        e.observe("a", &Observation::Xid(13), t(0)).new,
        Health::Unhealthy,
        "forced on"
    );
    assert_eq!(
        e.observe("b", &Observation::Xid(94), t(0)).new,
        Health::Unhealthy
    );
    assert_eq!(
        e.observe("c", &Observation::Xid(109), t(0)).new,
        Health::Healthy
    );
}

#[test]
fn only_a_condition_a_reboot_keeps_makes_the_checkpoint_wait_for_the_disk() {
    let mut e = engine("conditions:\n  xid-109: {recover: never}\n");
    assert_eq!(Durability::needed_by(&e), Durability::Process);
    e.observe(GPU, &Observation::Xid(79), t(0));
    e.observe(GPU, &Observation::DoubleBitEcc, t(0));
    assert_eq!(
        Durability::needed_by(&e),
        Durability::Process,
        "a new boot drops XID 79 and ECC errors, so a node crash may lose them too"
    );
    e.observe("GPU-other", &Observation::Xid(109), t(1));
    assert_eq!(
        Durability::needed_by(&e),
        Durability::Synced,
        "the next boot must still see a recover: never condition"
    );
}

fn fence() -> Observation {
    Observation::Fence {
        reason: "burn-in failed".into(),
        by: "alice".into(),
    }
}

#[test]
fn a_fence_holds_against_probes_quiet_periods_reboots_and_disabled_health_checks() {
    let mut e = engine("quietPeriod: 1s\nprobeInterval: 1s\n");
    let fenced = e.observe(GPU, &fence(), t(0));
    assert_eq!(fenced.new, Health::Unhealthy);
    assert!(
        fenced
            .message
            .is_some_and(|m| m.contains("fenced by alice: burn-in failed"))
    );
    let later = e.observe(GPU, &answered(Some(0)), t(3600));
    assert_eq!(
        later.new,
        Health::Unhealthy,
        "a probe does not clear a fence"
    );
    assert_eq!(e.next_deadline(), None, "nothing waits for a probe");
    assert_eq!(e.policy().recover(&ConditionKind::Fenced), Recover::Never);
    let restored = e.restore(
        GPU,
        e.device(GPU)
            .map(|d| d.conditions().to_vec())
            .unwrap_or_default(),
        None,
        true,
        t(7200),
    );
    assert_eq!(restored.new, Health::Unhealthy, "a reboot keeps it");

    let config: HealthConfig = serde_norway::from_str("{}").unwrap_or_default();
    let disabled = Policy::new(&config, Some("all"), None).unwrap_or_default();
    assert_eq!(disabled.effect(&ConditionKind::Fenced), Effect::Unhealthy);
}

#[test]
fn a_release_clears_the_conditions_it_names_and_nothing_else() {
    let mut e = default_engine();
    e.observe(GPU, &Observation::Xid(79), t(0));
    e.observe(GPU, &fence(), t(1));
    let fenced_only = ConditionSelector::fenced();
    let out = e.observe(GPU, &Observation::Release { which: fenced_only }, t(2));
    assert_eq!(out.conditions, ["xid-79"]);
    assert_eq!(out.new, Health::Unhealthy, "XID 79 still holds");
    let which = ConditionSelector::parse("xid-79").unwrap_or_else(|e| panic!("{e}"));
    let out = e.observe(GPU, &Observation::Release { which }, t(3));
    assert!(out.conditions.is_empty());
    assert_eq!(out.new, Health::Healthy);
}

#[test]
fn every_condition_is_shown_as_release_takes_it_and_the_old_spelling_is_still_read() {
    for kind in [
        ConditionKind::Xid(79),
        ConditionKind::RecoveryAction(2),
        ConditionKind::EccDbe,
        ConditionKind::GpuLost,
        ConditionKind::Fenced,
    ] {
        let shown = kind.to_string();
        let read = ConditionSelector::parse(&shown).unwrap_or_else(|e| panic!("{shown}: {e}"));
        assert!(read.matches(&kind), "{shown} does not name {kind:?}");
    }
    assert_eq!(ConditionKind::Xid(79).to_string(), "xid-79");
    let old = ConditionSelector::parse("xid=79").unwrap_or_else(|e| panic!("{e}"));
    assert!(old.matches(&ConditionKind::Xid(79)) && !old.matches(&ConditionKind::Xid(13)));
}

#[test]
fn condition_names_for_a_release_are_read_as_the_config_file_names_them() {
    let xid = |n| ConditionKind::Xid(n);
    let any_xid = ConditionSelector::parse("xid").unwrap_or_else(|e| panic!("{e}"));
    assert!(any_xid.matches(&xid(13)) && any_xid.matches(&xid(79)));
    let xid79 = ConditionSelector::parse("xid-79").unwrap_or_else(|e| panic!("{e}"));
    assert!(xid79.matches(&xid(79)) && !xid79.matches(&xid(13)));
    assert_eq!(xid79.to_string(), "xid-79");
    let action = ConditionSelector::parse("recovery-action").unwrap_or_else(|e| panic!("{e}"));
    assert!(action.matches(&ConditionKind::RecoveryAction(2)));
    assert!(ConditionSelector::fenced().matches(&ConditionKind::Fenced));
    let bad = ConditionSelector::parse("xid-seventy")
        .err()
        .unwrap_or_default();
    assert!(bad.contains("not a number"), "{bad}");
    let bad = ConditionSelector::parse("thermal")
        .err()
        .unwrap_or_default();
    assert!(
        bad.contains("\"thermal\"") && bad.contains("ecc-dbe"),
        "{bad}"
    );
}

/// A config that records XIDs 1000-2999 without effect.
fn ignoring_1000_to_2999() -> String {
    let xids: Vec<String> = (1000..3000).map(|x| x.to_string()).collect();
    format!("ignoredXids: [{}]\n", xids.join(", "))
}

/// The XIDs `device` keeps as conditions.
fn kept_xids(e: &HealthEngine, device: &str) -> Vec<u64> {
    e.device(device)
        .map(|d| {
            d.conditions()
                .iter()
                .filter_map(|c| match c.kind {
                    ConditionKind::Xid(x) => Some(x),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn two_thousand_harmless_xids_after_a_fatal_one_keep_sixteen_conditions_and_the_gpu_unhealthy() {
    // XIDs 1000-2999 recorded without effect (as a node's config may say), XID 79 before them.
    let mut e = engine(&ignoring_1000_to_2999());
    e.observe(GPU, &Observation::Xid(79), t(0));
    for (i, xid) in (1000..3000).enumerate() {
        e.observe(GPU, &Observation::Xid(xid), t(1 + i as u64 / 100));
    }
    let kept = kept_xids(&e, GPU);
    assert_eq!(kept.len(), MAX_XID_CONDITIONS, "{kept:?}");
    assert!(kept.contains(&79), "the fatal XID is kept: {kept:?}");
    assert!(kept.contains(&2999), "the newest is kept: {kept:?}");
    assert_eq!(e.health(GPU), Health::Unhealthy);
    let other = e.device(GPU).map(|d| d.other_xids()).unwrap_or_default();
    assert_eq!((other.events, other.last.is_some()), (2000 - 15, true));
    let message = e.message(GPU).unwrap_or_default();
    assert!(message.starts_with("Unhealthy: XID 79"), "{message}");
    assert!(message.chars().count() <= message::MAX_MESSAGE_CHARS);
}

#[test]
fn a_recover_never_xid_outlives_a_flood_of_recoverable_ones_and_their_recovery() {
    let mut e = engine("conditions:\n  xid-109: {recover: never}\n");
    e.observe(GPU, &Observation::Xid(109), t(0));
    // Other XIDs are Unhealthy until they recover: as strong for health, weaker for recovery.
    for xid in 1000..3000 {
        e.observe(GPU, &Observation::Xid(xid), t(1));
    }
    let kept = kept_xids(&e, GPU);
    assert_eq!(kept.len(), MAX_XID_CONDITIONS);
    assert!(kept.contains(&109), "{kept:?}");
    // A quiet period later the GPU answers: the recoverable XIDs clear, the recover-never one holds.
    e.observe(GPU, &answered(None), t(1 + 600));
    assert_eq!(kept_xids(&e, GPU), vec![109]);
    assert_eq!(e.health(GPU), Health::Unhealthy);
}

#[test]
fn a_checkpoint_with_more_xids_than_the_bound_is_cut_to_it_on_restore() {
    let mut before = engine(&ignoring_1000_to_2999());
    before.observe(GPU, &Observation::Xid(79), t(0));
    let mut conditions = before
        .device(GPU)
        .map(|d| d.conditions().to_vec())
        .unwrap_or_default();
    for xid in 1000..1100 {
        let mut c = conditions[0].clone();
        c.kind = ConditionKind::Xid(xid);
        conditions.push(c);
    }
    let mut after = engine(&ignoring_1000_to_2999());
    let restored = after.restore(GPU, conditions, before.last_unhealthy(GPU), false, t(60));
    assert_eq!(restored.new, Health::Unhealthy);
    let kept = kept_xids(&after, GPU);
    assert_eq!(kept.len(), MAX_XID_CONDITIONS);
    assert!(kept.contains(&79));
}
