//! NVIDIA's file, flags and variables as this plugin reads them.

use super::*;

/// A list entry that counts how often it is compared or hashed: the work a list costs.
#[derive(Clone)]
struct Counted(u32, std::rc::Rc<std::cell::Cell<u64>>);

impl PartialEq for Counted {
    fn eq(&self, other: &Self) -> bool {
        self.1.set(self.1.get() + 1);
        self.0 == other.0
    }
}

impl Eq for Counted {}

impl std::hash::Hash for Counted {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.1.set(self.1.get() + 1);
        self.0.hash(state);
    }
}

#[test]
fn a_long_device_list_costs_a_few_steps_per_entry_not_one_per_pair() {
    let work = std::rc::Rc::new(std::cell::Cell::new(0));
    let n = 100_000u32;
    let list: Vec<Counted> = (0..n)
        .chain([7, 7, 99_999])
        .map(|i| Counted(i, work.clone()))
        .collect();
    let kept: Vec<u32> = first_of_each(list).iter().map(|c| c.0).collect();
    assert_eq!(
        kept,
        (0..n).collect::<Vec<_>>(),
        "repeats left out, order kept"
    );
    // Comparing each entry with the ones before it would be about n²/2 = 5·10⁹ steps.
    assert!(
        work.get() <= 4 * u64::from(n),
        "{} steps for {n} entries",
        work.get()
    );
}

#[test]
fn a_device_list_keeps_each_entry_once_in_order() {
    let list = serde_json::json!([3, "GPU-a", "3", 1, "GPU-a"]);
    match device_selection(Some(&list)) {
        Ok(DeviceSelection::List(refs)) => assert_eq!(refs, ["3", "GPU-a", "1"]),
        other => panic!("{other:?}"),
    }
}

fn load_str(yaml: &str) -> Result<Loaded, ConfigError> {
    let document = document(yaml).map_err(|message| ConfigError::ParseFile {
        path: "test.yaml".into(),
        message,
    })?;
    assert!(is_nvidias(&document), "{yaml}");
    load(&document, yaml, std::path::Path::new("test.yaml"))
}

fn err_of(result: Result<impl std::fmt::Debug, ConfigError>) -> String {
    result.err().map(|e| e.to_string()).unwrap_or_default()
}

#[test]
fn a_mistyped_replicas_key_is_refused_with_the_key_meant() {
    let e = err_of(load_str(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replica: 4\n",
    ));
    assert!(
        e.contains("resources[0].replicas: no replicas specified (the entry has replica: did you mean replicas?)"),
        "{e}"
    );
    let e = err_of(load_str(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      count: 4\n",
    ));
    assert!(e.ends_with("no replicas specified"), "{e}");
}

#[test]
fn an_exact_duplicate_key_is_refused_naming_it() {
    for yaml in [
        "version: v1\nflags:\n  migStrategy: none\n  migStrategy: mixed\n",
        "version: v1\nversion: v1\n",
        "version: v1\nflags: {migStrategy: none, migStrategy: mixed}\n",
    ] {
        let e = document(yaml).err().unwrap_or_default();
        assert!(e.contains("is given twice in one mapping"), "{yaml:?}: {e}");
        let key = if yaml.contains("flags") {
            "migStrategy"
        } else {
            "version"
        };
        assert!(e.contains(&format!("the key {key} ")), "{e}");
    }
    // A merge (`<<`) may set a key the mapping sets again: that is what merges are for.
    assert!(document("base: &b {a: 1}\nx:\n  <<: *b\n  a: 2\n").is_ok());
}

#[test]
fn a_resource_shared_twice_in_a_long_list_is_refused() {
    // 15 000 entries (75 000 values, within the reader's limit), each name looked up in a set rather
    // than compared with every earlier one.
    let mut yaml = String::from("version: v1\nsharing:\n  timeSlicing:\n    resources:\n");
    for i in 0..15_000 {
        yaml.push_str(&format!(
            "    - name: example.com/r{i}\n      replicas: 2\n"
        ));
    }
    assert!(load_str(&yaml).is_ok());
    yaml.push_str("    - name: example.com/r7\n      replicas: 2\n");
    let e = err_of(load_str(&yaml));
    assert!(
        e.contains("resources[15000].name") && e.contains("shared twice"),
        "{e}"
    );
}

#[test]
fn a_full_file_of_nvidias_flags_maps_to_ours_and_names_what_it_ignores() -> Result<(), ConfigError>
{
    let loaded = load_str(
        "version: v1\n\
         flags:\n  migStrategy: none\n  failOnInitError: false\n  nvidiaDriverRoot: /\n  nvidiaDevRoot: /\n  \
         gdsEnabled: true\n  useNodeFeatureAPI: false\n  \
         plugin:\n    passDeviceSpecs: true\n    deviceListStrategy: [envvar, cdi-cri]\n    deviceIDStrategy: uuid\n    \
         cdiAnnotationPrefix: cdi.k8s.io/\n    nvidiaCTKPath: /usr/bin/nvidia-ctk\n    someFutureFlag: 1\n  \
         gfd:\n    oneshot: false\n\
         resources:\n  gpus:\n  - pattern: '*'\n    name: gpu\n\
         health:\n  quietPeriod: 5m\n",
    )?;
    assert_eq!(loaded.file.fail_on_init_error, Some(false));
    assert_eq!(loaded.file.device_specs, Some(true));
    assert_eq!(loaded.file.dev_root, Some(PathBuf::from("/")));
    assert!(loaded.file.health.is_some());
    let applied = apply(&loaded.nvidia)?;
    assert!(applied.envvar && applied.cdi);
    assert_eq!(
        applied.extra_envs,
        [("NVIDIA_GDS".to_string(), "enabled".to_string())]
    );
    let warned = loaded.warnings.join("\n");
    for key in [
        "flags.gfd",
        "flags.useNodeFeatureAPI",
        "resources",
        "flags.plugin.someFutureFlag",
        "flags.plugin.nvidiaCTKPath",
    ] {
        assert!(
            warned.contains(&format!("config key {key}")),
            "{key} not warned:\n{warned}"
        );
    }
    assert_eq!(loaded.warnings.len(), 5, "{warned}");
    Ok(())
}

#[test]
fn settings_not_done_yet_are_refused_by_name() {
    let cases = [
        ("flags:\n  migStrategy: many\n", "migStrategy"),
        (
            "flags:\n  plugin:\n    deviceListStrategy: cdi-annotations\n    cdiAnnotationPrefix: Bad_Prefix\n",
            "cdiAnnotationPrefix",
        ),
        (
            "flags:\n  plugin:\n    deviceIDStrategy: serial\n",
            "deviceIDStrategy",
        ),
        (
            "flags:\n  nvidiaDriverRoot: run/nvidia/driver\n",
            "nvidiaDriverRoot",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 1\n",
            "replicas must be >= 2",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n      devices: [0, first]\n",
            "resources[0].devices",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n      replicas: 2\n      devices: 0\n",
            "count of devices must be > 0",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n      devices: some\n",
            "only string allowed is all",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n    - name: gpu\n      replicas: 3\n",
            "resources[1].name",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n    - name: nvidia.com/mig-1g.10gb\n      replicas: 2\n",
            "no replicas specified",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/-bad\n      replicas: 2\n",
            "resources[0].name",
        ),
        (
            "flags:\n  migStrategy: mixed\n  mpsRoot: /run/nvidia/mps\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n",
            "MPS cannot share MIG devices",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources: []\n",
            "no resources",
        ),
        (
            "sharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n",
            "mpsRoot",
        ),
        ("imex:\n  channelIDs: [0, 1]\n", "channelIDs"),
        (
            "flags:\n  plugin:\n    sharedDevicesAllocationPolicy: tightly\n",
            "sharedDevicesAllocationPolicy",
        ),
        ("flags:\n  deviceDiscoveryStrategy: tegra\n", "no NVML"),
    ];
    for (yaml, named) in cases {
        let result = load_str(&format!("version: v1\n{yaml}"))
            .and_then(|loaded| apply(&loaded.nvidia).map(|_| ()));
        let err = result.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains(named), "{yaml}: {err:?} does not name {named}");
    }
}

#[test]
fn several_shared_resources_with_subsets_and_renames_are_read() -> Result<(), ConfigError> {
    let loaded = load_str(
        "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n    \
         - name: gpu\n      replicas: 4\n      devices: 2\n    \
         - name: nvidia.com/mig-1g.10gb\n      replicas: 3\n      rename: mig-small\n      \
         devices: [0, '1:2', GPU-8e3f, MIG-aa]\n",
    )?;
    let sharing = apply(&loaded.nvidia)?.sharing.ok_or(ConfigError::Invalid {
        setting: "test",
        value: String::new(),
        why: "no sharing".into(),
    })?;
    assert_eq!(sharing.kind, ShareKind::TimeSlicing);
    assert!(!sharing.fail_requests_greater_than_one);
    assert_eq!(
        sharing.resources,
        [
            SharedResource {
                name: "nvidia.com/gpu".into(),
                rename: Some("nvidia.com/gpu.shared".into()),
                replicas: 4,
                devices: DeviceSelection::Count(2),
            },
            SharedResource {
                name: "nvidia.com/mig-1g.10gb".into(),
                rename: Some("nvidia.com/mig-small".into()),
                replicas: 3,
                devices: DeviceSelection::List(vec![
                    "0".into(),
                    "1:2".into(),
                    "GPU-8e3f".into(),
                    "MIG-aa".into()
                ]),
            },
        ]
    );
    Ok(())
}

#[test]
fn a_bad_value_type_is_an_error_naming_the_key() {
    let err = load_str("version: v1\nflags:\n  failOnInitError: maybe\n")
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("failOnInitError"), "{err}");
}

#[test]
fn keys_differing_only_in_case_set_the_setting_as_in_nvidias_decoder() -> Result<(), ConfigError> {
    let loaded = load_str(
        "Version: v1\nFlags:\n  MigStrategy: single\n  useNodeFeatureAPI: true\n  Plugin:\n    \
         deviceIdStrategy: index\n    PassDeviceSpecs: true\nIMEX:\n  channelIds: [0]\n",
    )?;
    assert_eq!(loaded.nvidia.mig_strategy.as_deref(), Some("single"));
    assert_eq!(loaded.nvidia.device_id_strategy.as_deref(), Some("index"));
    assert_eq!(loaded.file.device_specs, Some(true));
    assert_eq!(loaded.nvidia.imex_channel_ids, Some(vec![0]));
    // The only warning: useNodeFeatureAPI is feature discovery's, not a typo.
    assert_eq!(loaded.warnings.len(), 1, "{:?}", loaded.warnings);
    assert!(loaded.warnings[0].contains("flags.useNodeFeatureAPI: GPU feature discovery"));
    let applied = apply(&loaded.nvidia)?;
    assert_eq!(applied.mig_strategy, MigStrategy::Single);
    assert_eq!(
        applied.naming.ids,
        crate::devices::naming::IdStrategy::Index
    );
    Ok(())
}

#[test]
fn two_spellings_of_one_key_use_the_last_in_byte_order_and_say_so() -> Result<(), ConfigError> {
    let loaded = load_str("flags:\n  migStrategy: mixed\n  MigStrategy: single\n")?;
    assert_eq!(loaded.nvidia.mig_strategy.as_deref(), Some("mixed"));
    let warned = loaded.warnings.join("\n");
    assert!(
        warned.contains("flags.MigStrategy and flags.migStrategy set the same setting")
            && warned.contains("the value of flags.migStrategy is used"),
        "{warned}"
    );
    Ok(())
}

#[test]
fn yaml_1_1_booleans_are_booleans_and_one_in_a_string_setting_is_refused() -> Result<(), ConfigError>
{
    let loaded = load_str(
        "flags:\n  failOnInitError: no\n  gdsEnabled: on\n  mofedEnabled: Off\n  plugin:\n    \
         passDeviceSpecs: yes\n",
    )?;
    assert_eq!(loaded.file.fail_on_init_error, Some(false));
    assert_eq!(loaded.file.device_specs, Some(true));
    assert_eq!(
        (loaded.nvidia.gds, loaded.nvidia.mofed),
        (Some(true), Some(false))
    );
    // NVIDIA's decoder puts a boolean in no string setting (under flags): refused, naming the key.
    let err = err_of(load_str("flags:\n  migStrategy: no\n"));
    assert!(
        err.contains("test.yaml")
            && err.contains("flags.migStrategy: expected a string, found the boolean false")
            && err.contains("quote"),
        "{err}"
    );
    // A quoted "true" is a string, which a boolean setting refuses, as NVIDIA's does.
    let err = err_of(load_str("flags:\n  failOnInitError: 'true'\n"));
    assert!(
        err.contains("flags.failOnInitError: expected true or false"),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_file_without_version_is_nvidias_when_it_has_nvidias_keys_and_ours_otherwise()
-> Result<(), String> {
    for nvidias in [
        "flags:\n  migStrategy: none\n",
        "sharing:\n  timeSlicing:\n    resources: []\n",
        "imex: {}\n",
        "Resources: {}\n",
        "version: v1\n",
    ] {
        assert!(is_nvidias(&document(nvidias)?), "{nvidias}");
    }
    for ours in [
        "resourceName: nvidia.com/gpu\n",
        "health:\n  quietPeriod: 5m\n",
        "",
    ] {
        assert!(!is_nvidias(&document(ours)?), "{ours}");
    }
    Ok(())
}

#[test]
fn a_version_other_than_v1_is_refused_naming_it_and_what_is_read() {
    let err = err_of(load_str("version: v2\nflags: {}\n"));
    assert!(
        err.contains("version \"v2\" is not supported")
            && err.contains("reads version v1 of NVIDIA's format")
            && !err.contains("unknown field"),
        "{err}"
    );
    // Empty is v1, as NVIDIA's plugin reads it.
    assert!(load_str("version: ''\nflags: {}\n").is_ok());
}

#[test]
fn a_typo_is_one_warning_with_the_key_meant_and_the_default_runs() -> Result<(), ConfigError> {
    let loaded = load_str(
        "flags:\n  migStrateg: mixed\n  plugin:\n    deviceListStrategie: cdi-cri\nsharring: {}\n\
         sharing:\n  timeSlicing:\n    renamebydefault: true\n    resources:\n    - name: gpu\n      \
         replicas: 2\n      replica: 3\n",
    )?;
    assert_eq!(loaded.nvidia.mig_strategy, None);
    assert_eq!(loaded.nvidia.device_list_strategy, None);
    let warned = loaded.warnings.join("\n");
    for (key, meant) in [
        ("flags.migStrateg", "flags.migStrategy"),
        (
            "flags.plugin.deviceListStrategie",
            "flags.plugin.deviceListStrategy",
        ),
        ("sharring", "sharing"),
        (
            "sharing.timeSlicing.renamebydefault",
            "sharing.timeSlicing.renameByDefault",
        ),
        (
            "sharing.timeSlicing.resources[].replica",
            "sharing.timeSlicing.resources[].replicas",
        ),
    ] {
        assert!(
            warned.contains(&format!("config key {key}:"))
                && warned.contains(&format!("(did you mean {meant}?)")),
            "{key}:\n{warned}"
        );
    }
    assert!(
        !warned.contains("ignored as NVIDIA's plugin ignores it"),
        "{warned}"
    );
    assert_eq!(loaded.warnings.len(), 5, "{warned}");
    // renameByDefault spelled in another case sets nothing: NVIDIA looks it up exactly.
    let sharing = loaded.nvidia.sharing.ok_or(ConfigError::Invalid {
        setting: "test",
        value: String::new(),
        why: "no sharing".into(),
    })?;
    assert_eq!(sharing.resources[0].rename, None);
    Ok(())
}

#[test]
fn packed_allocation_is_accepted_with_a_warning_saying_what_happens_here() -> Result<(), ConfigError>
{
    let loaded = load_str("flags:\n  plugin:\n    sharedDevicesAllocationPolicy: packed\n")?;
    let applied = apply(&loaded.nvidia)?;
    assert_eq!(applied.warnings.len(), 1);
    assert!(
        applied.warnings[0].contains("packed: accepted, but not applied")
            && applied.warnings[0].contains("spread over the GPUs"),
        "{:?}",
        applied.warnings
    );
    Ok(())
}

#[test]
fn replicas_above_1024_are_read_and_only_a_count_no_kubelet_list_holds_is_refused()
-> Result<(), ConfigError> {
    let file = |n: usize| {
        format!("sharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n      replicas: {n}\n")
    };
    let loaded = load_str(&file(5000))?;
    assert_eq!(
        loaded.nvidia.sharing.map(|s| s.resources[0].replicas),
        Some(5000)
    );
    assert!(load_str(&file(MAX_LISTED_REPLICAS)).is_ok());
    let err = err_of(load_str(&file(MAX_LISTED_REPLICAS + 1)));
    assert!(
        err.contains("resources[0].replicas")
            && err.contains("4194304 bytes the kubelet accepts")
            && err.contains(&format!("at most {MAX_LISTED_REPLICAS}")),
        "{err}"
    );
    Ok(())
}

#[test]
fn time_slicing_and_mps_together_share_through_mps_and_say_time_slicing_is_ignored()
-> Result<(), ConfigError> {
    let loaded = load_str(
        "sharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n      replicas: 4\n  mps:\n    \
         resources:\n    - name: gpu\n      replicas: 2\n",
    )?;
    let sharing = loaded.nvidia.sharing.clone();
    assert_eq!(sharing.as_ref().map(|s| s.kind), Some(ShareKind::Mps));
    assert_eq!(sharing.map(|s| s.resources[0].replicas), Some(2));
    let warned = loaded.warnings.join("\n");
    assert!(
        warned.contains("config key sharing.timeSlicing: ignored: sharing.mps is set too"),
        "{warned}"
    );
    // Errors in the ignored section still refuse the file, as NVIDIA's decoder reads both.
    let err = err_of(load_str(
        "sharing:\n  timeSlicing:\n    resources: []\n  mps:\n    resources:\n    - name: gpu\n      \
         replicas: 2\n",
    ));
    assert!(err.contains("no resources specified"), "{err}");
    Ok(())
}

#[test]
fn imex_channels_are_read_checked_and_carried_through() -> Result<(), ConfigError> {
    let applied = apply(&load_str("imex:\n  channelIDs: [0]\n  required: yes\n")?.nvidia)?;
    assert_eq!(
        (applied.imex_channel_ids, applied.imex_required),
        (vec![0], true)
    );
    // Required with no channels, and null channels: accepted, as NVIDIA's plugin accepts them.
    let applied = apply(&load_str("imex:\n  required: true\n")?.nvidia)?;
    assert_eq!(
        (applied.imex_channel_ids, applied.imex_required),
        (vec![], true)
    );
    let applied = apply(&load_str("imex:\n  channelIDs: null\n")?.nvidia)?;
    assert!(applied.imex_channel_ids.is_empty());
    let err = err_of(load_str("imex:\n  channelIDs: [1]\n").and_then(|l| apply(&l.nvidia)));
    assert!(
        err.contains("test.yaml")
            && err.contains("imex.channelIDs \"[1]\"")
            && err.contains("channel 0 only"),
        "{err}"
    );
    let err = err_of(load_str("imex:\n  channelIDs: [zero]\n"));
    assert!(
        err.contains("imex.channelIDs: expected a list of channel numbers"),
        "{err}"
    );
    Ok(())
}

#[test]
fn an_invalid_value_from_the_file_names_the_file_and_one_from_a_flag_the_flag()
-> Result<(), ConfigError> {
    let loaded = load_str("flags:\n  migStrategy: many\n")?;
    let err = err_of(apply(&loaded.nvidia));
    assert_eq!(
        err,
        "config file test.yaml: flags.migStrategy \"many\": must be none, single or mixed"
    );
    // The same value given as a flag over the file's: the flag is named.
    let flags = NvidiaSettings {
        mig_strategy: Some("many".into()),
        ..NvidiaSettings::default()
    };
    let err = err_of(apply(&flags.or(loaded.nvidia)));
    assert!(
        err.starts_with("invalid migStrategy (--mig-strategy"),
        "{err}"
    );
    // A valid flag over an invalid file value runs, as NVIDIA's plugin checks the merged settings.
    let loaded = load_str("flags:\n  migStrategy: many\n")?;
    let flags = NvidiaSettings {
        mig_strategy: Some("single".into()),
        ..NvidiaSettings::default()
    };
    assert_eq!(
        apply(&flags.or(loaded.nvidia))?.mig_strategy,
        MigStrategy::Single
    );
    Ok(())
}
