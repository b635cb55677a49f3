//! A ResourceClaim as the API server returns it to the DRA side's prepare: the claim read for its UID,
//! allocated devices and who it is reserved for, and its device configuration read and checked for every
//! request it names, on both kinds of device.
#![no_main]

use gpu_device_plugin::dra::claims::Claim;
use gpu_device_plugin::dra::device_config::{ClaimConfig, DeviceType};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(object) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let Ok(claim) = Claim::from_object(object) else {
        return;
    };
    let Ok(config) = ClaimConfig::read(&claim.config, "gpu.nvidia.com") else {
        return;
    };
    for result in claim.allocated.iter().flatten() {
        for of in [DeviceType::Gpu, DeviceType::Mig] {
            if let Err(why) = config.check(&result.request, of) {
                assert!(why.contains("change the claim"), "says what to do: {why}");
            }
        }
    }
});
