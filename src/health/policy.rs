//! The health policy: which conditions make a GPU Unhealthy and which may recover by themselves, from the
//! built-in XID table, the `health:` section of the config file, and NVIDIA's `DP_*` environment variables.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use serde::Deserialize;

use super::{ConditionKind, Effect, xid_info};

/// Which XID table decides XID effects before any override.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum XidPolicy {
    /// NVIDIA's XID catalog: restart-the-application and ignore XIDs leave the GPU Healthy.
    #[default]
    Catalog,
    /// NVIDIA's device plugin: XIDs 13, 31, 43, 45, 68 and 109 are ignored, every other XID is Unhealthy.
    Nvidia,
}

/// XIDs NVIDIA's device plugin ignores by default.
pub const NVIDIA_IGNORED_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// Whether a condition may clear by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recover {
    /// Clears when the driver's recovery action returns to None, or after the quiet period and a successful
    /// probe of the GPU.
    #[default]
    Auto,
    /// Stays until the node reboots (reboot-resolved conditions) or the checkpoint is removed.
    Never,
}

/// Effect as written in the config file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ConfigEffect {
    /// Recorded; the GPU stays Healthy.
    None,
    /// The GPU is Unhealthy while the condition holds.
    Unhealthy,
}

impl From<ConfigEffect> for Effect {
    fn from(e: ConfigEffect) -> Self {
        match e {
            ConfigEffect::None => Effect::None,
            ConfigEffect::Unhealthy => Effect::Unhealthy,
        }
    }
}

/// A per-condition override.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Effect, if overridden.
    pub effect: Option<ConfigEffect>,
    /// Recovery, if overridden.
    pub recover: Option<Recover>,
}

/// The longest duration a health setting may have: longer is surely a mistake, and clock arithmetic on it
/// could overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

fn too_long(key: &str) -> PolicyError {
    PolicyError {
        key: key.into(),
        why: format!(
            "must be at most {}",
            humantime::format_duration(MAX_DURATION)
        ),
    }
}

/// A single-bit ECC burst: more than `count` corrected errors within `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SbeBurst {
    /// Errors tolerated within the window.
    pub count: u32,
    /// The window.
    #[serde(with = "humantime_serde")]
    pub window: Duration,
}

/// The `health:` section of the config file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HealthConfig {
    /// Base XID table.
    pub xid_policy: Option<XidPolicy>,
    /// XIDs that leave the GPU Healthy whatever the table says.
    pub ignored_xids: Option<Vec<u64>>,
    /// XIDs that make the GPU Unhealthy whatever the table says.
    pub critical_xids: Option<Vec<u64>>,
    /// Per-condition overrides, keyed `gpu-lost`, `ecc-dbe`, `ecc-sbe-burst`, `recovery-action`,
    /// `unmonitored`, `xid` (every XID) or `xid-<N>` (one XID).
    pub conditions: Option<HashMap<String, Rule>>,
    /// Time without a new Unhealthy event before a GPU may recover.
    #[serde(default, with = "humantime_serde")]
    pub quiet_period: Option<Duration>,
    /// How often a GPU waiting to recover is probed again after a failed probe.
    #[serde(default, with = "humantime_serde")]
    pub probe_interval: Option<Duration>,
    /// How often the driver's recovery action is read on GPUs whose driver reports it.
    #[serde(default, with = "humantime_serde")]
    pub recovery_action_interval: Option<Duration>,
    /// Single-bit ECC burst threshold.
    pub sbe_burst: Option<SbeBurst>,
}

/// A bad policy setting; names the key or variable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {key}: {why}")]
pub struct PolicyError {
    /// Config key or environment variable.
    pub key: String,
    /// What is wrong.
    pub why: String,
}

/// The resolved policy the engine applies.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// Base XID table.
    pub xid_policy: XidPolicy,
    ignored_xids: HashSet<u64>,
    critical_xids: HashSet<u64>,
    /// `DP_DISABLE_HEALTHCHECKS=all`: nothing makes a GPU Unhealthy.
    disable_all: bool,
    /// `DP_DISABLE_HEALTHCHECKS=xids`: no XID makes a GPU Unhealthy (unless forced on).
    disable_xids: bool,
    /// `DP_DISABLE_HEALTHCHECKS=<list>`.
    env_ignored: HashSet<u64>,
    /// `DP_ENABLE_HEALTHCHECKS=<list>`: forced Unhealthy, over every ignore.
    env_enabled: HashSet<u64>,
    /// `DP_ENABLE_HEALTHCHECKS=all|xids`: every XID counts, over every XID ignore.
    env_enable_all_xids: bool,
    /// The two `DP_*` variables as given, for the status report.
    dp_given: (Option<String>, Option<String>),
    rules: HashMap<String, Rule>,
    /// Quiet period before recovery.
    pub quiet_period: Duration,
    /// Retry interval for probes.
    pub probe_interval: Duration,
    /// Poll interval for the driver's recovery action.
    pub recovery_action_interval: Duration,
    /// SBE burst threshold.
    pub sbe_burst: SbeBurst,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            xid_policy: XidPolicy::Catalog,
            ignored_xids: HashSet::new(),
            critical_xids: HashSet::new(),
            disable_all: false,
            disable_xids: false,
            env_ignored: HashSet::new(),
            env_enabled: HashSet::new(),
            env_enable_all_xids: false,
            dp_given: (None, None),
            rules: HashMap::new(),
            quiet_period: Duration::from_secs(600),
            probe_interval: Duration::from_secs(30),
            recovery_action_interval: Duration::from_secs(300),
            sbe_burst: SbeBurst {
                count: 10,
                window: Duration::from_secs(60),
            },
        }
    }
}

const CONDITION_KEYS: [&str; 6] = [
    "gpu-lost",
    "ecc-dbe",
    "ecc-sbe-burst",
    "recovery-action",
    "unmonitored",
    "xid",
];

impl Policy {
    /// Builds the policy from the config section and the values of `DP_DISABLE_HEALTHCHECKS` and
    /// `DP_ENABLE_HEALTHCHECKS` (unset: `None`).
    pub fn new(
        config: &HealthConfig,
        dp_disable: Option<&str>,
        dp_enable: Option<&str>,
    ) -> Result<Policy, PolicyError> {
        let defaults = Policy::default();
        let ignored: HashSet<u64> = config.ignored_xids.iter().flatten().copied().collect();
        let critical: HashSet<u64> = config.critical_xids.iter().flatten().copied().collect();
        if let Some(xid) = ignored.intersection(&critical).next() {
            return Err(PolicyError {
                key: "health.ignoredXids".into(),
                why: format!("XID {xid} is also in health.criticalXids"),
            });
        }
        let rules = config.conditions.clone().unwrap_or_default();
        for key in rules.keys() {
            let known = CONDITION_KEYS.contains(&key.as_str())
                || key
                    .strip_prefix("xid-")
                    .is_some_and(|n| n.parse::<u64>().is_ok());
            if !known {
                return Err(PolicyError {
                    key: format!("health.conditions.{key}"),
                    why: format!(
                        "unknown condition (one of {}, or xid-<N>)",
                        CONDITION_KEYS.join(", ")
                    ),
                });
            }
        }
        let positive = |key: &str, d: Option<Duration>, default: Duration| match d {
            Some(d) if d.is_zero() && key != "health.quietPeriod" => Err(PolicyError {
                key: key.into(),
                why: "must be more than 0".into(),
            }),
            Some(d) if d > MAX_DURATION => Err(too_long(key)),
            Some(d) => Ok(d),
            None => Ok(default),
        };
        let sbe_burst = config.sbe_burst.unwrap_or(defaults.sbe_burst);
        if sbe_burst.window.is_zero() {
            return Err(PolicyError {
                key: "health.sbeBurst.window".into(),
                why: "must be more than 0".into(),
            });
        }
        if sbe_burst.window > MAX_DURATION {
            return Err(too_long("health.sbeBurst.window"));
        }
        let mut policy = Policy {
            xid_policy: config.xid_policy.unwrap_or_default(),
            ignored_xids: ignored,
            critical_xids: critical,
            rules,
            quiet_period: positive(
                "health.quietPeriod",
                config.quiet_period,
                defaults.quiet_period,
            )?,
            probe_interval: positive(
                "health.probeInterval",
                config.probe_interval,
                defaults.probe_interval,
            )?,
            recovery_action_interval: positive(
                "health.recoveryActionInterval",
                config.recovery_action_interval,
                defaults.recovery_action_interval,
            )?,
            sbe_burst,
            ..defaults
        };
        policy.dp_given = (dp_disable.map(String::from), dp_enable.map(String::from));
        if let Some(value) = dp_disable {
            for token in tokens("DP_DISABLE_HEALTHCHECKS", value)? {
                match token {
                    Token::All => policy.disable_all = true,
                    Token::Xids => policy.disable_xids = true,
                    Token::Xid(xid) => {
                        policy.env_ignored.insert(xid);
                    }
                }
            }
        }
        if let Some(value) = dp_enable {
            for token in tokens("DP_ENABLE_HEALTHCHECKS", value)? {
                match token {
                    Token::All | Token::Xids => policy.env_enable_all_xids = true,
                    Token::Xid(xid) => {
                        policy.env_enabled.insert(xid);
                    }
                }
            }
        }
        Ok(policy)
    }

    /// `DP_DISABLE_HEALTHCHECKS` and `DP_ENABLE_HEALTHCHECKS` as they were given, for those who show the
    /// policy.
    pub fn dp_given(&self) -> (Option<&str>, Option<&str>) {
        (self.dp_given.0.as_deref(), self.dp_given.1.as_deref())
    }

    /// The effect of a condition under this policy.
    pub fn effect(&self, kind: &ConditionKind) -> Effect {
        // An operator's decision: no setting overrides it.
        if *kind == ConditionKind::Fenced {
            return Effect::Unhealthy;
        }
        if self.disable_all {
            return Effect::None;
        }
        match kind {
            ConditionKind::Xid(xid) => self.xid_effect(*xid),
            other => self
                .rule(other)
                .effect
                .map(Effect::from)
                .unwrap_or_else(|| default_effect(other)),
        }
    }

    fn xid_effect(&self, xid: u64) -> Effect {
        if self.env_enabled.contains(&xid) || self.env_enable_all_xids {
            return Effect::Unhealthy;
        }
        if self.disable_xids || self.env_ignored.contains(&xid) {
            return Effect::None;
        }
        if let Some(effect) = self.rule(&ConditionKind::Xid(xid)).effect {
            return effect.into();
        }
        if self.critical_xids.contains(&xid) {
            return Effect::Unhealthy;
        }
        if self.ignored_xids.contains(&xid) {
            return Effect::None;
        }
        match self.xid_policy {
            XidPolicy::Nvidia if NVIDIA_IGNORED_XIDS.contains(&xid) => Effect::None,
            XidPolicy::Nvidia => Effect::Unhealthy,
            XidPolicy::Catalog => match xid_info(xid) {
                Some(info) => info.action.effect(),
                None => Effect::Unhealthy,
            },
        }
    }

    /// The setting that gave a condition an effect other than its built-in one (NVIDIA's XID catalog for
    /// XIDs), if one did: the message then says that the node's configuration, not the fault, decided.
    pub fn overridden_by(&self, kind: &ConditionKind) -> Option<&'static str> {
        let built_in = match kind {
            ConditionKind::Xid(xid) => {
                xid_info(*xid).map_or(Effect::Unhealthy, |i| i.action.effect())
            }
            other => default_effect(other),
        };
        if self.effect(kind) == built_in {
            return None;
        }
        if self.disable_all {
            return Some("DP_DISABLE_HEALTHCHECKS=all");
        }
        let ConditionKind::Xid(xid) = kind else {
            return Some("health.conditions");
        };
        let xid = *xid;
        Some(
            if self.env_enabled.contains(&xid) || self.env_enable_all_xids {
                "DP_ENABLE_HEALTHCHECKS"
            } else if self.disable_xids || self.env_ignored.contains(&xid) {
                "DP_DISABLE_HEALTHCHECKS"
            } else if self.rule(kind).effect.is_some() {
                "health.conditions"
            } else if self.critical_xids.contains(&xid) {
                "health.criticalXids"
            } else if self.ignored_xids.contains(&xid) {
                "health.ignoredXids"
            } else {
                "health.xidPolicy: nvidia"
            },
        )
    }

    /// Whether a condition may clear by itself.
    pub fn recover(&self, kind: &ConditionKind) -> Recover {
        if *kind == ConditionKind::Fenced {
            return Recover::Never;
        }
        self.rule(kind).recover.unwrap_or_default()
    }

    /// The override for a condition: `xid-<N>` first, then `xid`, for XIDs.
    fn rule(&self, kind: &ConditionKind) -> Rule {
        let specific = match kind {
            ConditionKind::Xid(xid) => self.rules.get(&format!("xid-{xid}")),
            other => self.rules.get(other.name()),
        };
        let general = match kind {
            ConditionKind::Xid(_) => self.rules.get("xid"),
            _ => None,
        };
        Rule {
            effect: specific
                .and_then(|r| r.effect)
                .or(general.and_then(|r| r.effect)),
            recover: specific
                .and_then(|r| r.recover)
                .or(general.and_then(|r| r.recover)),
        }
    }
}

fn default_effect(kind: &ConditionKind) -> Effect {
    match kind {
        ConditionKind::GpuLost
        | ConditionKind::EccDbe
        | ConditionKind::RecoveryAction(_)
        | ConditionKind::Fenced => Effect::Unhealthy,
        ConditionKind::Unmonitored | ConditionKind::EccSbeBurst | ConditionKind::Xid(_) => {
            Effect::None
        }
    }
}

enum Token {
    All,
    Xids,
    Xid(u64),
}

/// Parses NVIDIA's list format: comma-separated, `all`, `xids` or XID numbers; blank means nothing.
fn tokens(variable: &str, value: &str) -> Result<Vec<Token>, PolicyError> {
    value
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| match t.to_ascii_lowercase().as_str() {
            "all" => Ok(Token::All),
            "xids" => Ok(Token::Xids),
            n => n.parse().map(Token::Xid).map_err(|_| PolicyError {
                key: variable.into(),
                why: format!("{t:?} is not all, xids or an XID number (value {value:?})"),
            }),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(
        yaml: &str,
        disable: Option<&str>,
        enable: Option<&str>,
    ) -> Result<Policy, PolicyError> {
        let config: HealthConfig = serde_norway::from_str(yaml).map_err(|e| PolicyError {
            key: "yaml".into(),
            why: e.to_string(),
        })?;
        Policy::new(&config, disable, enable)
    }

    fn unhealthy(p: &Policy, xid: u64) -> bool {
        p.effect(&ConditionKind::Xid(xid)) == Effect::Unhealthy
    }

    #[test]
    fn the_catalog_policy_is_the_default() -> Result<(), PolicyError> {
        let p = policy("{}", None, None)?;
        assert!(
            !unhealthy(&p, 13) && !unhealthy(&p, 94) && unhealthy(&p, 109) && unhealthy(&p, 79)
        );
        Ok(())
    }

    #[test]
    fn the_nvidia_policy_reproduces_nvidias_list() -> Result<(), PolicyError> {
        let p = policy("xidPolicy: nvidia", None, None)?;
        assert!(
            !unhealthy(&p, 13) && unhealthy(&p, 94) && !unhealthy(&p, 109) && unhealthy(&p, 63)
        );
        Ok(())
    }

    #[test]
    fn dp_disable_and_enable_work_as_in_nvidias_plugin() -> Result<(), PolicyError> {
        let p = policy("{}", Some("79, 48"), None)?;
        assert!(!unhealthy(&p, 79) && !unhealthy(&p, 48) && unhealthy(&p, 109));
        let p = policy("{}", Some("xids"), Some("79"))?;
        assert!(unhealthy(&p, 79) && !unhealthy(&p, 109));
        assert_eq!(
            p.effect(&ConditionKind::EccDbe),
            Effect::Unhealthy,
            "xids leaves ECC alone"
        );
        let p = policy("{}", Some("all"), None)?;
        assert_eq!(p.effect(&ConditionKind::GpuLost), Effect::None);
        assert!(!unhealthy(&p, 79));
        let p = policy("{}", None, Some("13"))?;
        assert!(unhealthy(&p, 13));
        Ok(())
    }

    #[test]
    fn config_lists_and_per_condition_rules_apply() -> Result<(), PolicyError> {
        let p = policy(
            "ignoredXids: [79]\ncriticalXids: [13]\nconditions:\n  ecc-dbe: {effect: none}\n  xid-109: {recover: never}\n",
            None,
            None,
        )?;
        assert!(!unhealthy(&p, 79) && unhealthy(&p, 13));
        assert_eq!(p.effect(&ConditionKind::EccDbe), Effect::None);
        assert_eq!(p.recover(&ConditionKind::Xid(109)), Recover::Never);
        assert_eq!(p.recover(&ConditionKind::Xid(79)), Recover::Auto);
        Ok(())
    }

    #[test]
    fn the_setting_that_overrode_the_catalog_is_named() -> Result<(), PolicyError> {
        let p = policy("{}", None, None)?;
        assert_eq!(p.overridden_by(&ConditionKind::Xid(79)), None);
        let p = policy("{}", None, Some("31"))?;
        assert_eq!(
            p.overridden_by(&ConditionKind::Xid(31)),
            Some("DP_ENABLE_HEALTHCHECKS")
        );
        assert_eq!(p.overridden_by(&ConditionKind::Xid(13)), None);
        let p = policy("xidPolicy: nvidia\ncriticalXids: [13]", None, None)?;
        assert_eq!(
            p.overridden_by(&ConditionKind::Xid(94)),
            Some("health.xidPolicy: nvidia")
        );
        assert_eq!(
            p.overridden_by(&ConditionKind::Xid(13)),
            Some("health.criticalXids")
        );
        let p = policy("ignoredXids: [79]", None, None)?;
        assert_eq!(
            p.overridden_by(&ConditionKind::Xid(79)),
            Some("health.ignoredXids")
        );
        let p = policy(
            "conditions:\n  ecc-sbe-burst: {effect: unhealthy}",
            None,
            None,
        )?;
        assert_eq!(
            p.overridden_by(&ConditionKind::EccSbeBurst),
            Some("health.conditions")
        );
        Ok(())
    }

    #[test]
    fn bad_settings_name_the_key() {
        let err = |yaml: &str, d: Option<&str>| {
            policy(yaml, d, None)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        assert!(
            err("conditions:\n  ecc-tbe: {effect: none}\n", None)
                .contains("health.conditions.ecc-tbe")
        );
        assert!(err("ignoredXids: [1]\ncriticalXids: [1]\n", None).contains("health.ignoredXids"));
        assert!(err("probeInterval: 0s\n", None).contains("health.probeInterval"));
        assert!(err("{}", Some("13,oops")).contains("DP_DISABLE_HEALTHCHECKS"));
    }
}
