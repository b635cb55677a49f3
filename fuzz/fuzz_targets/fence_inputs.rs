//! What operators and detectors send to fence a GPU: the Node annotation's value, a report file in the
//! fence directory, and a request on the control socket with its condition name (the first byte picks
//! which).
#![no_main]

use gpu_device_plugin::fence::control::ControlRequest;
use gpu_device_plugin::fence::annotation;
use gpu_device_plugin::fence::dir::parse_report;
use gpu_device_plugin::health::ConditionSelector;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&pick, body)) = data.split_first() else {
        return;
    };
    match pick % 3 {
        0 => {
            let (entries, problems) = annotation::parse(&String::from_utf8_lossy(body));
            for (device, reason) in &entries {
                assert!(!device.is_empty() && !reason.is_empty() && !device.contains(':'));
            }
            let _said = problems.join("; ");
        }
        1 => {
            if let Ok(report) = parse_report(body) {
                assert!(!report.device.is_empty() && !report.reason.is_empty());
            }
        }
        _ => {
            if let Ok(request) = serde_json::from_slice::<ControlRequest>(body)
                && let Some(condition) = &request.condition
                && let Ok(which) = ConditionSelector::parse(condition)
            {
                let _named = which.to_string();
            }
        }
    }
});
