//! The commands the plugin runs itself as on a reload: `reload-check` (the new config read and checked in a
//! process of its own) and `handover-watch` (the GPUs watched across the restart in place).

use std::process::ExitCode;

use tokio_util::sync::CancellationToken;

use super::{command_runtime, fail, init_logging, one_line, settings_or_exit};
use crate::config;
use crate::reload::handover;
use crate::sources;

/// `gpu-device-plugin reload-check [FLAGS]` (hidden; the plugin runs it on SIGHUP): loads the settings
/// these flags and this environment give, at a lower priority, and exits non-zero with the one line a
/// start would give when they do not load.
pub fn check() -> ExitCode {
    crate::util::runtime::lower_priority();
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    argv.remove(1);
    match settings_or_exit(&argv) {
        Ok(settings) => {
            // What the running plugin weighs before it restarts (see `reload::Gate`).
            println!(
                "{}",
                config::reload::roads_line(settings.dra.as_ref().map(|d| &d.gpus))
            );
            ExitCode::SUCCESS
        }
        Err(exit) => exit,
    }
}

/// `gpu-device-plugin handover-watch [FLAGS]` (hidden; a reloading plugin runs it): opens the device source
/// these flags give, says `ready` on stdout once it watches, and hands what it sees to the restarted plugin
/// (see [`handover`]).
pub fn watch() -> ExitCode {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    argv.remove(1);
    let settings = match settings_or_exit(&argv) {
        Ok(settings) => settings,
        Err(exit) => return exit,
    };
    init_logging(settings.log_format);
    let runtime = match command_runtime() {
        Ok(runtime) => runtime,
        Err(exit) => return exit,
    };
    let socket = handover::socket_path(&settings.state_dir);
    let watched = runtime.block_on(async {
        let never = CancellationToken::new();
        let source = sources::open::open(&settings.source_choice(), &never)
            .await?
            .ok_or_else(|| anyhow::anyhow!("stopped while NVML was loading"))?;
        let mut ready = std::io::stdout();
        handover::watch(source, &socket, &mut ready, handover::WATCH_LIMIT)
            .await
            .map_err(anyhow::Error::from)
    });
    runtime.shutdown_timeout(std::time::Duration::from_millis(100));
    match watched {
        Ok(events) => {
            tracing::info!(events, "handed the events seen during the restart over");
            ExitCode::SUCCESS
        }
        Err(e) => fail(&format!("the restart's watcher: {}", one_line(&e))),
    }
}
