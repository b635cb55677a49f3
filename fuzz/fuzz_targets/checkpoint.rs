//! The health checkpoint as a restart finds it on disk: loaded, put back into the health engine, and
//! written out again. A file it cannot use is refused; none may panic.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::SystemTime;

use gpu_device_plugin::health::checkpoint::Checkpoint;
use gpu_device_plugin::monitor::checkpoint::{FILE_NAME, Store};
use gpu_device_plugin::health::{HealthEngine, Policy};
use libfuzzer_sys::fuzz_target;

fn state_dir() -> &'static PathBuf {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    let (_dir, path) = DIR.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().to_path_buf();
        (dir, path)
    });
    path
}

fuzz_target!(|data: &[u8]| {
    let dir = state_dir();
    std::fs::write(dir.join(FILE_NAME), data).expect("write the checkpoint");
    let Ok(Some(saved)) = Store::in_dir(dir).load() else {
        return;
    };
    let rebooted = data.len() % 2 == 1;
    let mut engine = HealthEngine::new(Policy::default());
    for (id, record) in &saved.devices {
        let outcome = engine.restore(
            id,
            record.conditions(),
            record.last_unhealthy(),
            rebooted,
            SystemTime::now(),
        );
        let _shown = outcome.message;
    }
    let again = Checkpoint::of(&engine, saved.boot_id.clone());
    serde_json::to_string(&again).expect("a checkpoint always serialises");
});
