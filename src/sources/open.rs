//! The device source a start opens: simulated GPUs when asked, else NVML, loaded on a thread of its own
//! within a limit while a stop is answered; without NVML, the driver's GPUs unmonitored or a refusal to
//! start, as `--fail-on-init-error` says.

use std::path::PathBuf;

use tokio_util::sync::CancellationToken;

use super::DeviceSource;
use super::nvml::{NvmlGpus, NvmlInitError, NvmlOptions, UnmonitoredGpus};
use super::simulated::SimulatedGpus;

/// Which source, as the settings say.
#[derive(Debug, Clone)]
pub struct Choice {
    /// Simulated GPUs, this many, instead of NVML.
    pub simulate: Option<usize>,
    /// The fault script simulated GPUs follow.
    pub simulate_events: Option<PathBuf>,
    /// How NVML is loaded and what it serves.
    pub nvml: NvmlOptions,
    /// Whether a start without NVML is refused (else the driver's GPUs are served unmonitored).
    pub fail_on_init_error: bool,
}

/// NVML would not load and the settings refuse to start without it.
#[derive(Debug, thiserror::Error)]
#[error("{0}; set --fail-on-init-error=false to serve the driver's GPUs unmonitored")]
pub struct OpenError(#[from] NvmlInitError);

/// How long loading and initialising NVML may take. The driver answers in seconds on a node of eight GPUs;
/// a load that does not end (a library on a hung mount, a driver that never answers `nvmlInit`) is then
/// taken as NVML not loading, as `--fail-on-init-error` says.
const NVML_LOAD_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Loads NVML on a thread of its own, for at most [`NVML_LOAD_LIMIT`], while SIGTERM is answered: `None`
/// when the plugin is told to stop meanwhile.
async fn open_nvml(
    choice: &Choice,
    shutdown: &CancellationToken,
) -> Option<Result<NvmlGpus, NvmlInitError>> {
    let library = crate::util::text::shown(
        &choice.nvml.library.to_string_lossy(),
        crate::util::text::SHOWN_MAX,
    );
    let failed = |cause: String| NvmlInitError::Load {
        library: library.clone(),
        cause,
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let options = choice.nvml.clone();
    let started = std::thread::Builder::new()
        .name("nvml-load".into())
        .spawn(move || {
            let _gave_up = tx.send(NvmlGpus::open(options));
        });
    if let Err(e) = started {
        return Some(Err(failed(format!(
            "cannot start a thread to load it: {e}"
        ))));
    }
    tokio::select! {
        loaded = tokio::time::timeout(NVML_LOAD_LIMIT, rx) => Some(match loaded {
            Ok(Ok(opened)) => opened,
            Ok(Err(_)) => Err(failed("its loading thread ended without an answer".into())),
            Err(_) => Err(failed(format!(
                "loading and initialising it took more than {} s",
                NVML_LOAD_LIMIT.as_secs()
            ))),
        }),
        () = shutdown.cancelled() => None,
    }
}

/// Where the GPUs come from: simulated GPUs when asked, else NVML; without NVML, the driver's GPUs unmonitored
/// or a refusal to start, as `--fail-on-init-error` says. `None` when the plugin is told to stop while NVML
/// loads.
pub async fn open(
    choice: &Choice,
    shutdown: &CancellationToken,
) -> Result<Option<Box<dyn DeviceSource>>, OpenError> {
    if let Some(count) = choice.simulate {
        // The control handle is for tests; from the command line faults come from the fault script.
        let (gpus, _control) = SimulatedGpus::new(count);
        return Ok(Some(match &choice.simulate_events {
            Some(script) => Box::new(gpus.with_fault_script(script)),
            None => Box::new(gpus),
        }));
    }
    let Some(opened) = open_nvml(choice, shutdown).await else {
        return Ok(None);
    };
    Ok(Some(match opened {
        Ok(gpus) => Box::new(gpus),
        Err(e) if choice.fail_on_init_error => return Err(OpenError(e)),
        Err(e) => {
            tracing::warn!(error = %e, "NVML unavailable; serving the driver's GPUs unmonitored");
            Box::new(UnmonitoredGpus::from_procfs(&choice.nvml, e.to_string()))
        }
    }))
}
