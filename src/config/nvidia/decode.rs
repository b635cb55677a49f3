//! NVIDIA's config file decoded as NVIDIA's plugin decodes it: each section read into its settings, keys
//! looked up as NVIDIA's decoder does, every refusal naming the key.

use super::*;

/// Reads NVIDIA's file: `document` is its text as [`document`] gives it, `text` the text itself (for our
/// `health:` section, read by our own decoder). Errors name the file and the key.
pub fn load(document: &Value, text: &str, path: &Path) -> Result<Loaded, ConfigError> {
    decode(document, text, path).map_err(|message| ConfigError::ParseFile {
        path: path.to_owned(),
        message,
    })
}

/// [`load`], section by section; an error names the key.
pub(super) fn decode(document: &Value, text: &str, path: &Path) -> Result<Loaded, String> {
    let mut warnings = Vec::new();
    let Some(top) = document.as_object() else {
        return Err(format!(
            "NVIDIA's format is a mapping at the top, found {}",
            yaml11::describe(document)
        ));
    };
    let top = Level::read(top, "", TOP_KEYS, Match::AnyCase, &[OURS], &mut warnings);
    check_version(top.get("version"))?;
    let flags = object(top.get("flags"), "flags")?;
    let flags = Level::read_opt(flags, "flags.", FLAG_KEYS, Match::AnyCase, &mut warnings);
    let plugin = object(flags.get("plugin"), "flags.plugin")?;
    let plugin = Level::read_opt(
        plugin,
        "flags.plugin.",
        PLUGIN_KEYS,
        Match::AnyCase,
        &mut warnings,
    );
    let mut nvidia = NvidiaSettings {
        config_file: Some(path.to_owned()),
        ..NvidiaSettings::default()
    };
    read_flags(&flags, &plugin, &mut nvidia)?;
    let file = FileConfig {
        fail_on_init_error: get_bool(&flags, "failOnInitError")?,
        dev_root: get_string(&flags, "nvidiaDevRoot")?.map(PathBuf::from),
        device_specs: get_bool(&plugin, "passDeviceSpecs")?,
        health: health(&top, text)?,
        ..FileConfig::default()
    };
    warn_of_ignored(&top, &flags, &plugin, &mut warnings)?;
    nvidia.container_driver_root = get_string(&plugin, "containerDriverRoot")?;
    for (key, value) in [
        (MIG_STRATEGY, nvidia.mig_strategy.is_some()),
        (DEVICE_ID_STRATEGY, nvidia.device_id_strategy.is_some()),
        (DEVICE_LIST_STRATEGY, nvidia.device_list_strategy.is_some()),
        (DISCOVERY, nvidia.device_discovery_strategy.is_some()),
        (POLICY, nvidia.shared_devices_allocation_policy.is_some()),
        (ANNOTATION_PREFIX, nvidia.cdi_annotation_prefix.is_some()),
        (DRIVER_ROOT, nvidia.driver_root.is_some()),
        (MPS_ROOT, nvidia.mps_root.is_some()),
    ] {
        if value {
            nvidia.from_file.insert(key);
        }
    }
    nvidia.sharing = read_sharing(top.get("sharing"), &mut warnings)?;
    read_imex(top.get("imex"), &mut nvidia, &mut warnings)?;
    Ok(Loaded {
        file,
        nvidia,
        warnings,
    })
}

/// `level`'s `key` as a string, if given.
pub(super) fn get_string(level: &Level<'_>, key: &'static str) -> Result<Option<String>, String> {
    string(level.get(key), &level.path(key))
}

/// `level`'s `key` as a boolean, if given.
pub(super) fn get_bool(level: &Level<'_>, key: &'static str) -> Result<Option<bool>, String> {
    boolean(level.get(key), &level.path(key))
}

/// The file's `version`: none, or v1 (what NVIDIA's plugin reads).
pub(super) fn check_version(version: Option<&Value>) -> Result<(), String> {
    let version = match version {
        None | Some(Value::Null) => String::new(),
        // A number or boolean lands in Go's string field as its text (sigs.k8s.io/yaml does that at the
        // top level only).
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bool(b)) => b.to_string(),
        Some(Value::Number(n)) => n.to_string(),
        Some(other) => {
            return Err(format!(
                "version: expected a string, found {}",
                yaml11::describe(other)
            ));
        }
    };
    if !version.is_empty() && version != "v1" {
        return Err(format!(
            "version {version:?} is not supported: this plugin reads version v1 of NVIDIA's format (the only one \
             NVIDIA's plugin reads; a file without version is v1), and its own format, which has no version key"
        ));
    }
    Ok(())
}

/// `flags` and `flags.plugin` into `nvidia`.
pub(super) fn read_flags(
    flags: &Level<'_>,
    plugin: &Level<'_>,
    nvidia: &mut NvidiaSettings,
) -> Result<(), String> {
    nvidia.mig_strategy = get_string(flags, "migStrategy")?;
    nvidia.driver_root = get_string(flags, "nvidiaDriverRoot")?;
    nvidia.mps_root = get_string(flags, "mpsRoot")?;
    nvidia.gdrcopy = get_bool(flags, "gdrcopyEnabled")?;
    nvidia.gds = get_bool(flags, "gdsEnabled")?;
    nvidia.mofed = get_bool(flags, "mofedEnabled")?;
    nvidia.device_discovery_strategy = get_string(flags, "deviceDiscoveryStrategy")?;
    nvidia.device_id_strategy = get_string(plugin, "deviceIDStrategy")?;
    nvidia.cdi_annotation_prefix = get_string(plugin, "cdiAnnotationPrefix")?;
    nvidia.shared_devices_allocation_policy = get_string(plugin, "sharedDevicesAllocationPolicy")?;
    nvidia.device_list_strategy = match plugin.get("deviceListStrategy") {
        None | Some(Value::Null) => None,
        Some(Value::String(one)) => Some(vec![one.clone()]),
        Some(Value::Array(many)) => Some(
            many.iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(format!(
                        "{DEVICE_LIST_STRATEGY}: expected a string or a list of strings, found {} in the list",
                        yaml11::describe(other)
                    )),
                })
                .collect::<Result<_, _>>()?,
        ),
        Some(other) => {
            return Err(format!(
                "{DEVICE_LIST_STRATEGY}: expected a string or a list of strings, found {}",
                yaml11::describe(other)
            ));
        }
    };
    Ok(())
}

/// Keys NVIDIA's file may hold that mean nothing to a device plugin: each one a warning.
pub(super) fn warn_of_ignored(
    top: &Level<'_>,
    flags: &Level<'_>,
    plugin: &Level<'_>,
    warnings: &mut Vec<String>,
) -> Result<(), String> {
    let mut ignored = |key: &str, why: &str| warnings.push(format!("config key {key}: {why}"));
    if flags.get("gfd").is_some() {
        ignored(
            "flags.gfd",
            "GPU feature discovery's settings; no effect on a device plugin (NVIDIA's plugin drops them too)",
        );
    }
    if get_bool(flags, "useNodeFeatureAPI")?.is_some() {
        ignored(
            "flags.useNodeFeatureAPI",
            "GPU feature discovery's setting; no effect on a device plugin (NVIDIA's plugin does not read it either)",
        );
    }
    if top.get("resources").is_some_and(|v| !v.is_null()) {
        ignored(
            "resources",
            "NVIDIA's plugin v0.20 ignores it (resources keep their default names); so does this one",
        );
    }
    if let Some(ctk) = get_string(plugin, "nvidiaCTKPath")? {
        ignored(
            &format!("flags.plugin.nvidiaCTKPath ({ctk})"),
            "used by NVIDIA's plugin to write CDI specs, which this plugin does not write; no effect",
        );
    }
    Ok(())
}

/// `sharing`: time-slicing or MPS, MPS winning where both are given (as in NVIDIA's plugin).
pub(super) fn read_sharing(
    sharing: Option<&Value>,
    warnings: &mut Vec<String>,
) -> Result<Option<Sharing>, String> {
    let sharing = object(sharing, "sharing")?;
    let sharing = Level::read_opt(sharing, "sharing.", SHARING_KEYS, Match::AnyCase, warnings);
    // timeSlicing is a struct in NVIDIA's Config (null still runs its decoder, which then finds no
    // resources); mps a pointer (null is no MPS).
    let time_slicing = sharing
        .get("timeSlicing")
        .map(|spec| replicated(ShareKind::TimeSlicing, spec, warnings))
        .transpose()?;
    let mps = match sharing.get("mps") {
        None | Some(Value::Null) => None,
        Some(spec) => Some(replicated(ShareKind::Mps, spec, warnings)?),
    };
    Ok(match (time_slicing, mps) {
        (Some(_), Some(mps)) => {
            warnings.push(
                "config key sharing.timeSlicing: ignored: sharing.mps is set too, and NVIDIA's plugin then \
                 shares through MPS only; so does this one"
                    .into(),
            );
            Some(mps)
        }
        (time_slicing, mps) => mps.or(time_slicing),
    })
}

/// `imex`: the channels and whether they are required, into `nvidia`.
pub(super) fn read_imex(
    imex: Option<&Value>,
    nvidia: &mut NvidiaSettings,
    warnings: &mut Vec<String>,
) -> Result<(), String> {
    let imex = object(imex, "imex")?;
    let imex = Level::read_opt(imex, "imex.", IMEX_KEYS, Match::AnyCase, warnings);
    nvidia.imex_required = get_bool(&imex, "required")?;
    nvidia.imex_channel_ids = match imex.get("channelIDs") {
        None | Some(Value::Null) => None,
        Some(Value::Array(ids)) => Some(
            ids.iter()
                .map(|id| {
                    integer(id).ok_or_else(|| {
                        format!(
                            "{CHANNEL_IDS}: expected a list of channel numbers, found {} in it",
                            yaml11::describe(id)
                        )
                    })
                })
                .collect::<Result<_, _>>()?,
        ),
        Some(other) => {
            return Err(format!(
                "{CHANNEL_IDS}: expected a list of channel numbers, found {}",
                yaml11::describe(other)
            ));
        }
    };
    if nvidia.imex_channel_ids.is_some() {
        nvidia.from_file.insert(CHANNEL_IDS);
    }
    Ok(())
}

/// Our `health:` section, read by our own (YAML 1.2, strict) decoder so that it means what it means in our
/// format; errors name its line.
pub(super) fn health(top: &Level<'_>, text: &str) -> Result<Option<HealthConfig>, String> {
    if top.ours.is_empty() {
        return Ok(None);
    }
    /// The rest of the file is NVIDIA's: not denied here.
    #[derive(Deserialize)]
    struct Ours {
        health: Option<HealthConfig>,
    }
    serde_norway::from_str::<Ours>(text)
        .map(|ours| ours.health)
        .map_err(|e| e.to_string().replace('\n', " "))
}

/// How the keys of one level are matched to settings.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Match {
    /// As Go's `encoding/json`: the key spelled exactly, else one equal but for case.
    AnyCase,
    /// As NVIDIA's own decoders under `sharing.*` do: exactly as spelled.
    Exact,
}

/// One mapping of NVIDIA's file, its keys matched to the settings of that level.
pub(super) struct Level<'v> {
    prefix: &'static str,
    found: Vec<(&'static str, &'v Value)>,
    /// Keys of ours (exact) present at this level.
    ours: Vec<&'static str>,
}

impl<'v> Level<'v> {
    fn read_opt(
        map: Option<&'v Map<String, Value>>,
        prefix: &'static str,
        known: &'static [&'static str],
        matching: Match,
        warnings: &mut Vec<String>,
    ) -> Level<'v> {
        match map {
            Some(map) => Level::read(map, prefix, known, matching, &[], warnings),
            None => Level {
                prefix,
                found: Vec::new(),
                ours: Vec::new(),
            },
        }
    }

    /// Matches `map`'s keys to `known` settings, warning about every key that sets nothing (with the
    /// setting it probably meant) and about two keys that set the same setting.
    fn read(
        map: &'v Map<String, Value>,
        prefix: &'static str,
        known: &'static [&'static str],
        matching: Match,
        ours: &[&'static str],
        warnings: &mut Vec<String>,
    ) -> Level<'v> {
        let mut level = Level {
            prefix,
            found: Vec::new(),
            ours: Vec::new(),
        };
        // Go decodes the keys in sorted (byte) order, each overwriting what an earlier one set.
        let mut keys: Vec<(&String, &Value)> = map.iter().collect();
        keys.sort_by(|a, b| a.0.cmp(b.0));
        let mut setters: Vec<(&'static str, Vec<&str>)> = Vec::new();
        for (key, value) in keys {
            if let Some(&mine) = ours.iter().find(|o| **o == key.as_str()) {
                level.ours.push(mine);
                continue;
            }
            let exact = known.iter().find(|k| **k == key.as_str());
            let folded = known.iter().find(|k| k.eq_ignore_ascii_case(key));
            let field = match (exact, folded, matching) {
                (Some(k), _, _) | (None, Some(k), Match::AnyCase) => *k,
                (None, Some(k), Match::Exact) => {
                    warnings.push(format!(
                        "config key {prefix}{key}: ignored: NVIDIA's plugin reads the keys under {} exactly as \
                         spelled, so this one sets nothing there either (did you mean {prefix}{k}?)",
                        prefix.trim_end_matches('.')
                    ));
                    continue;
                }
                (None, None, _) => {
                    let hint = suggestion(key, known.iter().chain(ours.iter()).copied())
                        .map(|k| format!(" (did you mean {prefix}{k}?)"))
                        .unwrap_or_default();
                    let what = if prefix.is_empty() {
                        "not a key of NVIDIA's v1 format".to_string()
                    } else {
                        format!(
                            "not a key of {} in NVIDIA's v1 format",
                            prefix.trim_end_matches('.')
                        )
                    };
                    warnings.push(format!(
                        "config key {prefix}{key}: {what}; ignored, as NVIDIA's plugin ignores it (what it would \
                         set keeps its default){hint}"
                    ));
                    continue;
                }
            };
            level.found.retain(|(f, _)| *f != field);
            level.found.push((field, value));
            match setters.iter_mut().find(|(f, _)| *f == field) {
                Some((_, keys)) => keys.push(key),
                None => setters.push((field, vec![key])),
            }
        }
        for (_, keys) in setters.iter().filter(|(_, keys)| keys.len() > 1) {
            let used = keys.last().copied().unwrap_or_default();
            let all: Vec<String> = keys.iter().map(|k| format!("{prefix}{k}")).collect();
            warnings.push(format!(
                "config keys {} set the same setting; the value of {prefix}{used} is used, as NVIDIA's plugin uses \
                 it (the last in byte order)",
                all.join(" and ")
            ));
        }
        level
    }

    fn get(&self, field: &str) -> Option<&'v Value> {
        self.found
            .iter()
            .find(|(f, _)| *f == field)
            .map(|(_, v)| *v)
    }

    fn path(&self, field: &str) -> String {
        format!("{}{field}", self.prefix)
    }
}

/// The known key closest to a mistyped one, when it is close enough to be what was meant.
pub(super) fn suggestion<'k>(key: &str, known: impl Iterator<Item = &'k str>) -> Option<&'k str> {
    let key = key.to_ascii_lowercase();
    known
        .map(|k| (strsim::levenshtein(&key, &k.to_ascii_lowercase()), k))
        .filter(|(distance, k)| *distance <= 3.max(k.len() / 4) && *distance < k.len())
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, k)| k)
}

/// A mapping value: `None` for absent or null (Go leaves the struct as it is).
pub(super) fn object<'v>(
    value: Option<&'v Value>,
    key: &str,
) -> Result<Option<&'v Map<String, Value>>, String> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(map)) => Ok(Some(map)),
        Some(other) => Err(format!(
            "{key}: expected a mapping, found {}",
            yaml11::describe(other)
        )),
    }
}

/// A string setting: Go's `*string`, which takes a JSON string only (no number, no boolean).
pub(super) fn string(value: Option<&Value>, key: &str) -> Result<Option<String>, String> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Bool(b)) => Err(format!(
            "{key}: expected a string, found the boolean {b} (NVIDIA's plugin reads YAML 1.1, where an unquoted \
             yes/no/on/off/y/n is a boolean, and refuses it here too; quote the value)"
        )),
        Some(other) => Err(format!(
            "{key}: expected a string, found {} (NVIDIA's plugin refuses it too; quote the value)",
            yaml11::describe(other)
        )),
    }
}

/// A boolean setting: Go's `*bool`, which takes a JSON boolean only (`"true"` in quotes is a string).
pub(super) fn boolean(value: Option<&Value>, key: &str) -> Result<Option<bool>, String> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(format!(
            "{key}: expected true or false, found {} (NVIDIA's plugin refuses it too)",
            yaml11::describe(other)
        )),
    }
}

/// A JSON number Go's `encoding/json` puts in an `int`: a whole number (`2.0` is 2, as `json.Marshal` writes
/// it `2`).
pub(super) fn integer(value: &Value) -> Option<i64> {
    let Value::Number(n) = value else { return None };
    n.as_i64().or_else(|| {
        n.as_f64()
            .filter(|f| f.fract() == 0.0 && f.abs() < 9.0e18)
            .map(|f| f as i64)
    })
}

/// `sharing.timeSlicing` or `sharing.mps`, checked as NVIDIA's decoder checks it: at least one resource,
/// each with a name and at least 2 replicas, `devices` as `all`, a count above 0 or a list of indices and
/// UUIDs; keys looked up exactly as spelled.
pub(super) fn replicated(
    kind: ShareKind,
    spec: &Value,
    warnings: &mut Vec<String>,
) -> Result<Sharing, String> {
    let section = match kind {
        ShareKind::TimeSlicing => "sharing.timeSlicing",
        ShareKind::Mps => "sharing.mps",
    };
    let prefix = match kind {
        ShareKind::TimeSlicing => "sharing.timeSlicing.",
        ShareKind::Mps => "sharing.mps.",
    };
    let invalid = |key: String, why: &str| format!("{section}{key}: {why}");
    let spec = match spec {
        Value::Object(map) => Some(map),
        Value::Null => None,
        other => {
            return Err(invalid(
                String::new(),
                &format!("expected a mapping, found {}", yaml11::describe(other)),
            ));
        }
    };
    let spec = Level::read_opt(spec, prefix, SPEC_KEYS, Match::Exact, warnings);
    let rename_by_default = match spec.get("renameByDefault") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(invalid(
                ".renameByDefault".into(),
                &format!("expected true or false, found {}", yaml11::describe(other)),
            ));
        }
    };
    let fail_requests = boolean(
        spec.get("failRequestsGreaterThanOne"),
        &format!("{prefix}failRequestsGreaterThanOne"),
    )?;
    let entries = match spec.get("resources") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(entries)) => entries.iter().collect(),
        Some(other) => {
            return Err(invalid(
                ".resources".into(),
                &format!("expected a list, found {}", yaml11::describe(other)),
            ));
        }
    };
    if entries.is_empty() {
        return Err(invalid(".resources".into(), "no resources specified"));
    }
    let mut resources: Vec<SharedResource> = Vec::with_capacity(entries.len());
    let mut names = std::collections::HashSet::with_capacity(entries.len());
    for (i, entry) in entries.into_iter().enumerate() {
        let resource = shared_resource(kind, entry, rename_by_default, &mut names, warnings)
            .map_err(|(key, why)| invalid(format!(".resources[{i}]{key}"), &why))?;
        resources.push(resource);
    }
    Ok(Sharing {
        kind,
        // MPS refuses more than one replica per container unless told otherwise; time-slicing allows it.
        fail_requests_greater_than_one: fail_requests.unwrap_or(kind == ShareKind::Mps),
        resources,
    })
}

/// One entry of a sharing section's `resources`, its name new to `names`; an error is the key under the entry
/// and why.
pub(super) fn shared_resource(
    kind: ShareKind,
    entry: &Value,
    rename_by_default: bool,
    names: &mut std::collections::HashSet<String>,
    warnings: &mut Vec<String>,
) -> Result<SharedResource, (String, String)> {
    let entry = match entry {
        Value::Object(map) => Some(map),
        Value::Null => None,
        other => {
            return Err((
                String::new(),
                format!("expected a mapping, found {}", yaml11::describe(other)),
            ));
        }
    };
    let entry_prefix: &'static str = match kind {
        ShareKind::TimeSlicing => "sharing.timeSlicing.resources[].",
        ShareKind::Mps => "sharing.mps.resources[].",
    };
    let raw = entry;
    let entry = Level::read_opt(entry, entry_prefix, RESOURCE_KEYS, Match::Exact, warnings);
    let name = match entry.get("name") {
        None => None,
        Some(Value::Null) => Some(String::new()),
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => {
            return Err((
                ".name".to_string(),
                format!("expected a string, found {}", yaml11::describe(other)),
            ));
        }
    };
    let name = name.filter(|n| !n.is_empty()).ok_or_else(|| {
        (
            ".name".to_string(),
            "no resource name specified".to_string(),
        )
    })?;
    let name = full_resource_name(&name).map_err(|why| (".name".to_string(), why))?;
    // A set, not a search of the entries so far: the list may hold tens of thousands of entries.
    if !names.insert(name.clone()) {
        return Err((
            ".name".to_string(),
            format!("{name} is shared twice; give each resource one entry"),
        ));
    }
    let rename = match entry.get("rename") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.is_empty() => None,
        Some(Value::String(s)) => {
            Some(full_resource_name(s).map_err(|why| (".rename".to_string(), why))?)
        }
        Some(other) => {
            return Err((
                ".rename".to_string(),
                format!("expected a string, found {}", yaml11::describe(other)),
            ));
        }
    };
    let rename = match rename {
        Some(rename) => Some(rename),
        None if rename_by_default => Some(format!("{name}.shared")),
        None => None,
    }
    .filter(|rename| *rename != name);
    let replicas = replica_count(&entry, raw).map_err(|why| (".replicas".to_string(), why))?;
    let devices =
        device_selection(entry.get("devices")).map_err(|why| (".devices".to_string(), why))?;
    Ok(SharedResource {
        name,
        rename,
        replicas,
        devices,
    })
}

/// An entry's `replicas`: at least 2, and few enough for the kubelet's message.
pub(super) fn replica_count(
    entry: &Level<'_>,
    raw: Option<&serde_json::Map<String, Value>>,
) -> Result<usize, String> {
    let replicas = match entry.get("replicas") {
        None => {
            // A key meant as `replicas` (`replica`, `Replicas`) is only warned about, and the refusal
            // comes first: it says which key was meant.
            let meant = raw
                .into_iter()
                .flat_map(|map| map.keys())
                .find(|k| suggestion(k, ["replicas"].into_iter()).is_some());
            let why = match meant {
                Some(key) => format!(
                    "no replicas specified (the entry has {}: did you mean replicas?)",
                    crate::util::text::shown(key, crate::util::text::SHOWN_MAX)
                ),
                None => "no replicas specified".to_string(),
            };
            return Err(why);
        }
        // Go leaves the int at 0.
        Some(Value::Null) => 0,
        Some(value) => integer(value)
            .ok_or_else(|| format!("expected a whole number, found {}", yaml11::describe(value)))?,
    };
    match usize::try_from(replicas) {
        Ok(n) if n < 2 => Err("number of replicas must be >= 2".into()),
        Err(_) => Err("number of replicas must be >= 2".into()),
        Ok(n) if n > MAX_LISTED_REPLICAS => Err(format!(
            "{n} replicas of a single device already make a device list larger than the 4194304 \
             bytes the kubelet accepts in one message (each listed replica takes at least \
             {MIN_LISTED_DEVICE_BYTES} bytes); at most {MAX_LISTED_REPLICAS}"
        )),
        Ok(n) => Ok(n),
    }
}

/// A resource name of a sharing entry in full: one without a domain is in `nvidia.com`, as NVIDIA reads it.
pub(super) fn full_resource_name(name: &str) -> Result<String, String> {
    let full = if name.contains('/') {
        name.to_string()
    } else {
        format!("nvidia.com/{name}")
    };
    crate::config::check_extended_resource_name(&full).map_err(|e| match e {
        ConfigError::Invalid { why, .. } => format!("{full:?}: {why}"),
        other => other.to_string(),
    })?;
    Ok(full)
}

/// `items` without repeats, each where it first appears, in one pass: a list from the config file may hold
/// about 100 000 entries within the file's size limit, and comparing each with every earlier one took
/// 15 s.
pub(super) fn first_of_each<T: Eq + std::hash::Hash + Clone>(items: Vec<T>) -> Vec<T> {
    let mut seen = std::collections::HashSet::with_capacity(items.len());
    items
        .into_iter()
        .filter(|item| seen.insert(item.clone()))
        .collect()
}

/// `devices` as NVIDIA's plugin reads it: `all`, a count above 0, or a list whose entries are GPU indices
/// (numbers or strings), MIG indices `<gpu>:<mig>`, or GPU and MIG UUIDs.
pub(super) fn device_selection(devices: Option<&Value>) -> Result<DeviceSelection, String> {
    let entry = |value: &Value| -> Result<String, String> {
        let text = match value {
            Value::Number(n) => n
                .as_u64()
                .map(|n| n.to_string())
                .ok_or_else(|| format!("{n} is not a device index"))?,
            Value::String(s) => s.clone(),
            other => {
                return Err(format!(
                    "{} is not a device index or UUID",
                    yaml11::describe(other)
                ));
            }
        };
        let is_index = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        let is_mig_index = || {
            text.split_once(':')
                .is_some_and(|(g, m)| is_index(g) && is_index(m))
        };
        let is_uuid = ["GPU-", "MIG-"]
            .iter()
            .any(|p| text.strip_prefix(p).is_some_and(|rest| !rest.is_empty()));
        if is_index(&text) || is_mig_index() || is_uuid {
            Ok(text)
        } else {
            Err(format!(
                "{text:?} is not a GPU index, a MIG index (<gpu>:<mig>) or a GPU/MIG UUID"
            ))
        }
    };
    match devices {
        None | Some(Value::Null) => Ok(DeviceSelection::All),
        Some(Value::String(all)) if all == "all" => Ok(DeviceSelection::All),
        Some(Value::String(other)) => Err(format!(
            "{other:?}: the only string allowed is all (or give a count or a list)"
        )),
        Some(Value::Number(n)) => match integer(&Value::Number(n.clone())) {
            Some(count) if count > 0 => Ok(DeviceSelection::Count(
                usize::try_from(count).unwrap_or(usize::MAX),
            )),
            _ => Err(format!("{n}: a count of devices must be > 0")),
        },
        Some(Value::Array(list)) if !list.is_empty() => {
            let refs = list.iter().map(entry).collect::<Result<Vec<_>, _>>()?;
            Ok(DeviceSelection::List(first_of_each(refs)))
        }
        Some(Value::Array(_)) => {
            Err("an empty list shares nothing; leave devices out for all".into())
        }
        Some(other) => Err(format!(
            "{}: must be all, a count or a list",
            yaml11::describe(other)
        )),
    }
}
