//! The binary's commands beside the plugin itself: `status`, `fence` and `release`, `check-config`, and the
//! hidden ones the plugin runs itself as (`reload-check` on SIGHUP, `handover-watch` across a restart, the
//! NVML library's trial load before it is loaded for real); and
//! how every command ends: one line on stderr and a failure, or the help printed.

mod check_config;
mod control;
mod reload;
mod status;

use std::io::IsTerminal as _;
use std::process::ExitCode;

use crate::config::{self, LogFormat, Settings};

/// Runs the command the first argument names: `None` when it names none (the plugin itself runs).
pub fn dispatch() -> Option<ExitCode> {
    let command = std::env::args_os().nth(1)?;
    Some(match command.to_str()? {
        "status" => status::run(),
        "fence" => control::run(true),
        "release" => control::run(false),
        "check-config" => check_config::run(),
        config::reload::SUBCOMMAND => reload::check(),
        crate::reload::handover::SUBCOMMAND => reload::watch(),
        crate::sources::nvml::library::TRIAL_LOAD => {
            crate::sources::nvml::library::trial_load_command()
        }
        _ => return None,
    })
}

/// The settings `argv` and the environment give, or how the process ends: a refusal in one line, or
/// `--help` / `--version` printed.
pub fn settings_or_exit(argv: &[std::ffi::OsString]) -> Result<Settings, ExitCode> {
    match Settings::from_args(argv) {
        Ok(Ok(settings)) => Ok(settings),
        Ok(Err(e)) => Err(fail(&e.to_string())),
        Err(e) if e.use_stderr() => Err(fail(&config::usage_error_line(&e, argv))),
        Err(e) => {
            // --help and --version.
            let _printed = e.print();
            Err(ExitCode::SUCCESS)
        }
    }
}

/// An error and its causes in one line, each cause left out where the text before already says it (most
/// errors here name their cause in their own message).
pub fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !line.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
    }
    line
}

/// A refusal: one line on stderr, whatever outside text the message holds (see
/// [`crate::util::text::shown`]).
pub fn fail(message: &str) -> ExitCode {
    use crate::util::text::{LINE_MAX, shown};
    eprintln!("gpu-device-plugin: error: {}", shown(message, LINE_MAX));
    ExitCode::FAILURE
}

/// The log on stderr, as text or JSON, filtered by `RUST_LOG` (default `info`).
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        // Fields quote outside text (names, reasons, errors from other processes): each shown escaped.
        LogFormat::Text => builder
            .with_writer(std::io::stderr)
            .fmt_fields(crate::util::text::log_fields())
            .init(),
        // JSON escapes control characters; the writer escapes the bidirectional overrides JSON leaves.
        LogFormat::Json => builder
            .with_writer(|| crate::util::text::JsonLogWriter(std::io::stderr()))
            .json()
            .flatten_event(true)
            .init(),
    }
}

/// How a command ends on a command-line error: one line and a failure, or the help or version printed.
fn usage_exit(error: &clap::Error) -> ExitCode {
    if error.use_stderr() {
        let argv: Vec<_> = std::env::args_os().skip(1).collect();
        return fail(&config::usage_error_line(error, &argv));
    }
    let _printed = error.print();
    ExitCode::SUCCESS
}

/// The one-thread runtime a command (`status`, `fence`, `release`) runs on.
fn command_runtime() -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| fail(&format!("cannot start the async runtime: {e}")))
}

/// A subcommand's arguments for its parser, whose usage then reads `gpu-device-plugin <subcommand> ...`.
fn subcommand_argv() -> Vec<std::ffi::OsString> {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    if let Some(first) = argv.first_mut() {
        let mut named = std::ffi::OsString::from("gpu-device-plugin ");
        named.push(&*first);
        *first = named;
    }
    argv
}
