//! NVIDIA's `DP_DISABLE_HEALTHCHECKS` and `DP_ENABLE_HEALTHCHECKS` (the input split at its first NUL byte),
//! read into the health policy.
#![no_main]

use gpu_device_plugin::health::{HealthConfig, Policy};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (disable, enable) = text.split_once('\0').unwrap_or((&text, ""));
    let enable = (!enable.is_empty()).then_some(enable);
    if let Ok(policy) = Policy::new(&HealthConfig::default(), Some(disable), enable) {
        let _summary = gpu_device_plugin::http::status::PolicySummary::of(&policy);
    }
});
