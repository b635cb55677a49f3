//! The device configuration a claim's allocation carries for this driver (`status.allocation.devices.config`,
//! from the claim and its DeviceClass), in the kinds NVIDIA's DRA driver reads (`resource.nvidia.com/v1beta1`
//! `GpuConfig`, `MigDeviceConfig`), so that claims written for it keep their meaning here.
//!
//! This plugin changes no GPU setting: a configuration that asks for nothing to be done (no `sharing`, or
//! time-slicing at the GPU's default interval) is accepted; one that asks for something it does not do (a
//! time-slice interval, MPS, a kind it does not serve) refuses the claim with what to change, rather than
//! handing out a GPU that silently lacks what the claim asked for. A configuration is decoded strictly, as
//! NVIDIA's driver decodes it: an unknown field or kind is an error, not ignored.

use serde::Deserialize;
use serde::de::IgnoredAny;

/// What to do about an entry this plugin cannot read.
const FIX_ENTRY: &str = "correct or remove it in the claim (or its DeviceClass)";

/// The API group and version of NVIDIA's device configuration kinds.
pub const API_VERSION: &str = "resource.nvidia.com/v1beta1";

/// One entry of `status.allocation.devices.config`, as read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AllocatedConfig {
    /// `FromClass` or `FromClaim`.
    #[serde(default)]
    pub source: String,
    /// The requests it applies to (`<request>` or `<request>/<subrequest>`); empty: every request.
    #[serde(default)]
    pub requests: Vec<String>,
    /// The driver's own parameters; the only form there is today.
    #[serde(default)]
    pub opaque: Option<Opaque>,
}

/// Opaque parameters, for one driver.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct Opaque {
    /// The driver they are for.
    #[serde(default)]
    pub driver: String,
    /// What that driver reads.
    #[serde(default)]
    pub parameters: Parameters,
}

/// How deep a driver's parameters are kept, at most. This driver's kinds are 4 levels deep; another
/// driver's parameters may be nested as deep as the API server lets them (a few hundred levels fit in a
/// claim), and are never this driver's to read: past this depth they are skipped, not parsed (serde_json's
/// skip walks the bytes without recursion), so no nesting in them can make the claim unreadable.
pub const MAX_PARAMETERS_DEPTH: usize = 16;

/// A driver's parameters as read: whole, or nested deeper than [`MAX_PARAMETERS_DEPTH`] (then not kept).
/// Which driver they are for may come after them in the object, so every entry's are read this far; only
/// this driver's are decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parameters {
    /// The parameters.
    Read(serde_json::Value),
    /// Nested deeper than [`MAX_PARAMETERS_DEPTH`]: skipped.
    TooDeep,
}

impl Default for Parameters {
    fn default() -> Self {
        Parameters::Read(serde_json::Value::Null)
    }
}

impl From<serde_json::Value> for Parameters {
    fn from(value: serde_json::Value) -> Self {
        Parameters::Read(value)
    }
}

impl<'de> Deserialize<'de> for Parameters {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::DeserializeSeed as _;
        Ok(Bounded {
            left: MAX_PARAMETERS_DEPTH,
        }
        .deserialize(deserializer)?
        .map_or(Parameters::TooDeep, Parameters::Read))
    }
}

/// Reads a JSON value at most `left` arrays and objects deep; `None` when it goes deeper (the rest of it
/// skipped, without recursion).
struct Bounded {
    left: usize,
}

impl<'de> serde::de::DeserializeSeed<'de> for Bounded {
    type Value = Option<serde_json::Value>;

    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Bounded {
    type Value = Option<serde_json::Value>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Some(v.into()))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Some(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Some(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(Some(v.into()))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Some(v.into()))
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Some(v.into()))
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Some(serde_json::Value::Null))
    }

    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(Some(serde_json::Value::Null))
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        serde::de::DeserializeSeed::deserialize(self, d)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        if self.left > 0 {
            while let Some(item) = seq.next_element_seed(Bounded {
                left: self.left - 1,
            })? {
                match item {
                    Some(item) => items.push(item),
                    None => {
                        while seq.next_element::<IgnoredAny>()?.is_some() {}
                        return Ok(None);
                    }
                }
            }
            return Ok(Some(serde_json::Value::Array(items)));
        }
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(None)
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = serde_json::Map::new();
        if self.left > 0 {
            while let Some(key) = map.next_key::<String>()? {
                match map.next_value_seed(Bounded {
                    left: self.left - 1,
                })? {
                    Some(value) => {
                        fields.insert(key, value);
                    }
                    None => {
                        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                        return Ok(None);
                    }
                }
            }
            return Ok(Some(serde_json::Value::Object(fields)));
        }
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(None)
    }
}

/// Which kind of device a configuration is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceType {
    /// A whole GPU.
    Gpu,
    /// A MIG device.
    Mig,
}

/// What a configuration asks for, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Asked {
    /// `GpuConfig` or `MigDeviceConfig`: nothing, or what is named.
    Sharing {
        /// The device type the kind is for.
        for_type: DeviceType,
        kind: &'static str,
        /// `None`: nothing to do.
        refused: Option<String>,
    },
    /// A kind NVIDIA's driver knows for devices this plugin does not serve (VFIO, ComputeDomain).
    NotServed { kind: String },
    /// Not a driver's opaque parameters: a form of configuration this plugin does not know.
    NotOpaque,
}

/// One configuration of this driver, in the order it takes effect (a later one wins).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    requests: Vec<String>,
    asked: Asked,
}

/// The configurations of one claim for this driver, decoded and in order of precedence.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimConfig {
    entries: Vec<Entry>,
}

impl ClaimConfig {
    /// Reads `config` for `driver`: the DeviceClass's entries take effect before the claim's, each in the
    /// order given. An entry this plugin cannot read at all is an error naming it (even one that would be
    /// overridden: the claim would mean something else on another driver).
    pub fn read(config: &[AllocatedConfig], driver: &str) -> Result<ClaimConfig, String> {
        let mut from_class = Vec::new();
        let mut from_claim = Vec::new();
        for (i, c) in config.iter().enumerate() {
            let which = || format!("device configuration {} ({})", i + 1, c.source);
            let asked = match &c.opaque {
                Some(opaque) if opaque.driver != driver => continue,
                Some(opaque) => decode(&opaque.parameters)
                    .map_err(|e| format!("{}: {e}; {FIX_ENTRY}", which()))?,
                // Not one driver's: it applies to every device of the requests it names.
                None => Asked::NotOpaque,
            };
            let entry = Entry {
                requests: c.requests.clone(),
                asked,
            };
            match c.source.as_str() {
                "FromClass" => from_class.push(entry),
                "FromClaim" => from_claim.push(entry),
                other => {
                    return Err(format!(
                        "{}: source {other:?} is neither FromClass nor FromClaim; {FIX_ENTRY}",
                        which()
                    ));
                }
            }
        }
        from_class.extend(from_claim);
        Ok(ClaimConfig {
            entries: from_class,
        })
    }

    /// Checks the configuration that takes effect on the device allocated for `request`, of type `of`:
    /// the last entry naming the request (or its main request), or, among those naming none, the last one of
    /// the device's type. `Err` says what the claim asks that this plugin does not do, and what to change.
    pub fn check(&self, request: &str, of: DeviceType) -> Result<(), String> {
        let main = request.split_once('/').map_or(request, |(main, _)| main);
        let applies = |e: &&Entry| {
            if e.requests.is_empty() {
                match &e.asked {
                    Asked::Sharing { for_type, .. } => *for_type == of,
                    // A kind for devices not served here: no device here is of its type.
                    Asked::NotServed { .. } => false,
                    Asked::NotOpaque => true,
                }
            } else {
                e.requests.iter().any(|r| r == request || r == main)
            }
        };
        let Some(entry) = self.entries.iter().rev().find(applies) else {
            return Ok(());
        };
        let change =
            "change the claim (or its DeviceClass), or serve this GPU with NVIDIA's DRA driver";
        match &entry.asked {
            Asked::Sharing { for_type, kind, .. } if *for_type != of => Err(format!(
                "request {request:?} has a {kind}, which is for {}, but was given {}; {change}",
                describe(*for_type),
                describe(of)
            )),
            Asked::Sharing { refused: None, .. } => Ok(()),
            Asked::Sharing {
                kind,
                refused: Some(why),
                ..
            } => Err(format!(
                "request {request:?} has a {kind} that {why}; {change}"
            )),
            Asked::NotServed { kind } => Err(format!(
                "request {request:?} has {kind}, which this plugin does not apply; {change}"
            )),
            Asked::NotOpaque => Err(format!(
                "request {request:?} has a device configuration that is not opaque parameters, the only \
                 form this plugin reads; {change}"
            )),
        }
    }
}

fn describe(of: DeviceType) -> &'static str {
    match of {
        DeviceType::Gpu => "a whole GPU",
        DeviceType::Mig => "a MIG device",
    }
}

/// The kind's name and version, read before the rest.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct TypeMeta {
    #[serde(default)]
    api_version: String,
    #[serde(default)]
    kind: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct GpuConfig {
    #[serde(rename = "apiVersion")]
    _api_version: IgnoredAny,
    #[serde(rename = "kind")]
    _kind: IgnoredAny,
    #[serde(default)]
    sharing: Option<GpuSharing>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct GpuSharing {
    strategy: String,
    #[serde(default)]
    time_slicing_config: Option<TimeSlicing>,
    #[serde(default)]
    mps_config: Option<IgnoredAny>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TimeSlicing {
    #[serde(default)]
    interval: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct MigDeviceConfig {
    #[serde(rename = "apiVersion")]
    _api_version: IgnoredAny,
    #[serde(rename = "kind")]
    _kind: IgnoredAny,
    #[serde(default)]
    sharing: Option<MigSharing>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct MigSharing {
    strategy: String,
    #[serde(default)]
    mps_config: Option<IgnoredAny>,
}

/// The kinds NVIDIA's driver reads for devices this plugin does not serve.
const NOT_SERVED: [&str; 3] = [
    "VfioDeviceConfig",
    "ComputeDomainChannelConfig",
    "ComputeDomainDaemonConfig",
];

fn decode(parameters: &Parameters) -> Result<Asked, String> {
    let Parameters::Read(parameters) = parameters else {
        return Err(format!(
            "parameters are nested more than {MAX_PARAMETERS_DEPTH} levels deep (this driver's kinds are 4)"
        ));
    };
    let meta = TypeMeta::deserialize(parameters)
        .map_err(|e| format!("parameters are not a configuration object: {e}"))?;
    if meta.api_version != API_VERSION {
        return Err(format!(
            "apiVersion {:?} is not one this plugin reads (it reads {API_VERSION})",
            meta.api_version
        ));
    }
    let strict = |e: serde_json::Error| format!("{} cannot be read: {e}", meta.kind);
    match meta.kind.as_str() {
        "GpuConfig" => {
            let config = GpuConfig::deserialize(parameters).map_err(strict)?;
            Ok(Asked::Sharing {
                for_type: DeviceType::Gpu,
                kind: "GpuConfig",
                refused: config.sharing.and_then(|s| {
                    refusal(&s.strategy, s.time_slicing_config, s.mps_config.is_some())
                }),
            })
        }
        "MigDeviceConfig" => {
            let config = MigDeviceConfig::deserialize(parameters).map_err(strict)?;
            Ok(Asked::Sharing {
                for_type: DeviceType::Mig,
                kind: "MigDeviceConfig",
                refused: config
                    .sharing
                    .and_then(|s| refusal(&s.strategy, None, s.mps_config.is_some())),
            })
        }
        kind if NOT_SERVED.contains(&kind) => Ok(Asked::NotServed {
            kind: format!("a {kind}"),
        }),
        other => Err(format!(
            "kind {other:?} is not one this plugin reads (GpuConfig, MigDeviceConfig)"
        )),
    }
}

/// Why a sharing setting cannot be served; `None` when it asks for nothing this plugin would have to do.
fn refusal(strategy: &str, slicing: Option<TimeSlicing>, mps_config: bool) -> Option<String> {
    match strategy {
        "TimeSlicing" if mps_config => {
            Some("sets mpsConfig with the TimeSlicing strategy".into())
        }
        "TimeSlicing" => match slicing.and_then(|t| t.interval).as_deref() {
            // The GPU's own time-slice: what every process sharing it gets without a setting.
            None | Some("Default") => None,
            Some(interval @ ("Short" | "Medium" | "Long")) => Some(format!(
                "asks for the {interval} time-slice interval (this plugin changes no GPU setting; \
                 leave the interval out or set it to Default)"
            )),
            Some(other) => Some(format!("names an unknown time-slice interval {other:?}")),
        },
        "MPS" => Some(
            "asks for MPS, which this plugin does not serve through DRA (pods share a GPU by naming \
             one ResourceClaim, time-sliced)"
                .into(),
        ),
        other => Some(format!("names an unknown sharing strategy {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const DRIVER: &str = "gpu.nvidia.com";

    fn entry(source: &str, requests: &[&str], parameters: serde_json::Value) -> AllocatedConfig {
        AllocatedConfig {
            source: source.into(),
            requests: requests.iter().map(|r| r.to_string()).collect(),
            opaque: Some(Opaque {
                driver: DRIVER.into(),
                parameters: parameters.into(),
            }),
        }
    }

    fn gpu(sharing: serde_json::Value) -> serde_json::Value {
        json!({"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": sharing})
    }

    fn check(config: &[AllocatedConfig], request: &str, of: DeviceType) -> Result<(), String> {
        ClaimConfig::read(config, DRIVER)?.check(request, of)
    }

    #[test]
    fn a_configuration_that_asks_for_nothing_is_accepted() {
        for parameters in [
            json!({"apiVersion": API_VERSION, "kind": "GpuConfig"}),
            gpu(json!({"strategy": "TimeSlicing"})),
            gpu(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Default"}})),
        ] {
            let config = [entry("FromClaim", &[], parameters.clone())];
            assert_eq!(
                check(&config, "gpu", DeviceType::Gpu),
                Ok(()),
                "{parameters}"
            );
        }
        let mig = json!({"apiVersion": API_VERSION, "kind": "MigDeviceConfig",
                         "sharing": {"strategy": "TimeSlicing"}});
        assert_eq!(
            check(&[entry("FromClaim", &[], mig)], "mig", DeviceType::Mig),
            Ok(())
        );
        assert_eq!(
            check(&[], "gpu", DeviceType::Gpu),
            Ok(()),
            "no configuration"
        );
    }

    #[test]
    fn what_this_plugin_does_not_do_refuses_the_claim_saying_what_to_change() {
        let cases = [
            (
                gpu(json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}})),
                "asks for MPS",
            ),
            (
                gpu(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})),
                "Long time-slice interval",
            ),
            (
                gpu(
                    json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Forever"}}),
                ),
                "unknown time-slice interval \"Forever\"",
            ),
            (
                gpu(json!({"strategy": "TimeSlicing", "mpsConfig": {}})),
                "mpsConfig with the TimeSlicing strategy",
            ),
            (
                gpu(json!({"strategy": "Exclusive"})),
                "unknown sharing strategy",
            ),
        ];
        for (parameters, says) in cases {
            let why = check(
                &[entry("FromClaim", &["gpu"], parameters)],
                "gpu",
                DeviceType::Gpu,
            )
            .expect_err("refused");
            assert!(why.contains(says), "{why}");
            assert!(why.contains("request \"gpu\" has a GpuConfig"), "{why}");
            assert!(why.contains("change the claim"), "says what to do: {why}");
        }
    }

    #[test]
    fn what_cannot_be_read_is_an_error_naming_the_entry_whatever_overrides_it() {
        let cases = [
            (
                gpu(json!({"strategy": "TimeSlicing", "colour": "red"})),
                "unknown field `colour`",
            ),
            (
                json!({"apiVersion": API_VERSION, "kind": "GpuConfig", "extra": 1}),
                "unknown field `extra`",
            ),
            (
                json!({"apiVersion": "resource.nvidia.com/v9", "kind": "GpuConfig"}),
                "apiVersion \"resource.nvidia.com/v9\"",
            ),
            (
                json!({"apiVersion": API_VERSION, "kind": "TpuConfig"}),
                "kind \"TpuConfig\"",
            ),
            (json!("just a string"), "not a configuration object"),
            // MIG devices have no time-slice setting in NVIDIA's kinds either.
            (
                json!({"apiVersion": API_VERSION, "kind": "MigDeviceConfig",
                       "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {}}}),
                "unknown field `timeSlicingConfig`",
            ),
        ];
        for (parameters, says) in cases {
            let config = [
                entry("FromClass", &[], parameters),
                entry("FromClaim", &[], gpu(json!(null))),
            ];
            let why = ClaimConfig::read(&config, DRIVER).expect_err("unreadable");
            assert!(
                why.starts_with("device configuration 1 (FromClass): "),
                "{why}"
            );
            assert!(why.contains(says), "{why}");
            assert!(why.ends_with(FIX_ENTRY), "says what to do: {why}");
        }
        let odd = AllocatedConfig {
            source: "FromSomewhere".into(),
            ..entry("", &[], gpu(json!(null)))
        };
        let why = ClaimConfig::read(&[odd], DRIVER).expect_err("unknown source");
        assert!(why.contains("neither FromClass nor FromClaim"), "{why}");
    }

    #[test]
    fn the_claims_own_configuration_wins_over_its_class_and_a_later_one_over_an_earlier() {
        let mps = gpu(json!({"strategy": "MPS"}));
        let plain = gpu(json!(null));
        // The class asks for MPS, the claim for nothing: the claim's wins, whatever the order given.
        let config = [
            entry("FromClaim", &[], plain.clone()),
            entry("FromClass", &[], mps.clone()),
        ];
        assert_eq!(check(&config, "gpu", DeviceType::Gpu), Ok(()));
        // Within the claim, the later entry wins.
        let config = [
            entry("FromClaim", &[], plain.clone()),
            entry("FromClaim", &[], mps.clone()),
        ];
        assert!(check(&config, "gpu", DeviceType::Gpu).is_err());
        // Entries naming other requests do not apply.
        let config = [
            entry("FromClaim", &["gpu"], mps.clone()),
            entry("FromClaim", &["other"], plain.clone()),
        ];
        assert!(check(&config, "gpu", DeviceType::Gpu).is_err());
        assert_eq!(check(&config, "other", DeviceType::Gpu), Ok(()));
        // A subrequest is named by its main request.
        let config = [entry("FromClaim", &["gpu"], mps)];
        assert!(check(&config, "gpu/big", DeviceType::Gpu).is_err());
        assert_eq!(check(&config, "gpus/big", DeviceType::Gpu), Ok(()));
    }

    #[test]
    fn a_configuration_for_another_type_of_device_applies_only_where_it_is_named() {
        let mig_mps = json!({"apiVersion": API_VERSION, "kind": "MigDeviceConfig",
                             "sharing": {"strategy": "MPS"}});
        // For every request: a whole GPU is not a MIG device, so it is not for it.
        let config = [entry("FromClaim", &[], mig_mps.clone())];
        assert_eq!(check(&config, "gpu", DeviceType::Gpu), Ok(()));
        assert!(check(&config, "mig", DeviceType::Mig).is_err());
        // Named for the request: a mistake the claim's author must hear of.
        let config = [entry(
            "FromClaim",
            &["gpu"],
            json!({"apiVersion": API_VERSION, "kind": "MigDeviceConfig"}),
        )];
        let why = check(&config, "gpu", DeviceType::Gpu).expect_err("wrong type");
        assert!(
            why.contains("is for a MIG device, but was given a whole GPU"),
            "{why}"
        );
        // Kinds for devices this plugin does not serve: only where named.
        let vfio = json!({"apiVersion": API_VERSION, "kind": "VfioDeviceConfig"});
        assert_eq!(
            check(
                &[entry("FromClaim", &[], vfio.clone())],
                "gpu",
                DeviceType::Gpu
            ),
            Ok(())
        );
        let why = check(
            &[entry("FromClaim", &["gpu"], vfio)],
            "gpu",
            DeviceType::Gpu,
        )
        .expect_err("not served");
        assert!(
            why.contains("a VfioDeviceConfig, which this plugin does not apply"),
            "{why}"
        );
    }

    #[test]
    fn other_drivers_configurations_are_theirs_and_one_that_is_not_opaque_is_refused() {
        let mut theirs = entry("FromClaim", &[], json!({"anything": "at all"}));
        if let Some(o) = theirs.opaque.as_mut() {
            o.driver = "nic.example.com".into();
        }
        assert_eq!(check(&[theirs], "gpu", DeviceType::Gpu), Ok(()));
        let plain = AllocatedConfig {
            source: "FromClaim".into(),
            requests: vec!["nic".into()],
            opaque: None,
        };
        assert_eq!(
            check(std::slice::from_ref(&plain), "gpu", DeviceType::Gpu),
            Ok(()),
            "names another request"
        );
        let everywhere = AllocatedConfig {
            requests: Vec::new(),
            ..plain
        };
        let why = check(&[everywhere], "gpu", DeviceType::Gpu).expect_err("cannot be read here");
        assert!(why.contains("not opaque"), "{why}");
    }
}
