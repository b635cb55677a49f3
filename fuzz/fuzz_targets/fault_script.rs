//! The simulated GPUs' fault script (`--simulate-events`), line by line as the plugin follows it.
#![no_main]

use gpu_device_plugin::sources::script::parse_line;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    for line in text.lines() {
        if let Ok(Some(command)) = parse_line(line) {
            let _named = command.uuid();
        }
    }
});
