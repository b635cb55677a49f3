//! A ResourceClaim as the API server returns it to the DRA side's prepare (read from the answer's bytes,
//! within its size bound, and as a page of a list of claims): the claim read for its UID,
//! allocated devices and who it is reserved for, and its device configuration read and checked for every
//! request it names, on both kinds of device.
#![no_main]

use gpu_device_plugin::dra::claims::Claim;
use gpu_device_plugin::dra::device_config::{ClaimConfig, DeviceType};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // A page of a list of claims, as the start's look at what holds the node's devices reads it.
    if let Ok((claims, token)) = Claim::page_from_json(data) {
        assert!(token.is_none_or(|t| !t.is_empty()));
        drop(claims);
    }
    // One claim, read from the answer's bytes with its size bound.
    let Ok(claim) = Claim::from_json(data) else {
        return;
    };
    if let Ok(object) = serde_json::from_slice::<serde_json::Value>(data) {
        assert_eq!(
            Claim::from_object(object).ok(),
            Some(claim.clone()),
            "the same claim either way"
        );
    }
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
