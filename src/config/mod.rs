//! Settings from the command line, the environment and the config file, checked once at start.
//!
//! Precedence: a flag, then its environment variable, then the `--config` file, then the default. Every
//! problem is one [`ConfigError`] naming the setting and the bad value.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::{Parser, ValueEnum};
use serde::Deserialize;

use crate::devices::allocation::AllocateOptions;
use crate::health::{HealthConfig, Policy};
use crate::monitor::MonitorConfig;
use crate::sources::nvml::NvmlOptions;

mod args;
mod checks;
mod describe;
mod file;
pub mod nvidia;
pub mod reload;
mod settings;
mod start;
#[cfg(test)]
mod tests;

pub use args::{Args, usage_error_line};
pub use checks::{DEFAULT_CONTAINER_DRIVER_ROOT, check_extended_resource_name, prepare_state_dir};
pub use file::{FileConfig, MAX_CONFIG_BYTES, MAX_FLOW_DEPTH};
pub use settings::{DraSettings, Settings};
pub use start::socket_name_for;

// What the phases share with each other, by name.
#[allow(unused_imports)]
use {args::*, checks::*, file::*, settings::*};

/// Default kubelet device plugin directory.
pub const DEFAULT_KUBELET_DIR: &str = "/var/lib/kubelet/device-plugins";
/// Default resource name, the one NVIDIA's plugin serves.
pub const DEFAULT_RESOURCE_NAME: &str = "nvidia.com/gpu";
/// Default directory for the plugin's own state.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/gpu-device-plugin";

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log pipelines.
    Json,
}

use crate::util::text::{LINE_MAX, SHOWN_MAX, shown};

/// A setting that cannot be used. Its text shows every value from outside through [`shown`]: a 1 MB value
/// or a key holding an escape is one short line.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {}: {}", shown_path(.path), shown(&.source.to_string(), SHOWN_MAX))]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The config file is not valid YAML for our settings.
    #[error("config file {}: {}", shown_path(.path), shown(.message, LINE_MAX))]
    ParseFile {
        /// The file.
        path: PathBuf,
        /// What the parser said, including the key and line.
        message: String,
    },
    /// A setting has a value that cannot work.
    #[error("invalid {setting} \"{}\": {}", shown(.value, SHOWN_MAX), shown(.why, LINE_MAX))]
    Invalid {
        /// Flag name of the setting.
        setting: &'static str,
        /// The value given.
        value: String,
        /// Why it is invalid.
        why: String,
    },
}
