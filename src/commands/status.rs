//! `gpu-device-plugin status`: a running agent's devices, as a table or JSON.

use std::process::ExitCode;

use super::{command_runtime, fail, subcommand_argv, usage_exit};
use crate::http;

/// `gpu-device-plugin status`: a running agent's devices, as a table or JSON.
#[derive(Debug, clap::Parser)]
#[command(
    name = "gpu-device-plugin status",
    about = "Show a running gpu-device-plugin's devices, their health and messages"
)]
struct StatusArgs {
    /// The agent's --http-addr
    #[arg(long, default_value = http::DEFAULT_ADDR, value_name = "HOST:PORT")]
    addr: String,
    /// Print the report as JSON (for scripts)
    #[arg(long)]
    json: bool,
    /// Keep following: print the report again whenever it changes (every 2 s at most)
    #[arg(long)]
    watch: bool,
}

/// Runs the command.
pub fn run() -> ExitCode {
    use clap::Parser as _;
    let args = match StatusArgs::try_parse_from(subcommand_argv()) {
        Ok(args) => args,
        Err(e) => return usage_exit(&e),
    };
    let runtime = match command_runtime() {
        Ok(runtime) => runtime,
        Err(exit) => return exit,
    };
    runtime.block_on(async {
        let mut last = None;
        loop {
            let report = match http::fetch_report(&args.addr).await {
                Ok(report) => report,
                Err(e) => return fail(&e.to_string()),
            };
            if last.as_ref() != Some(&report) {
                let text = if args.json {
                    serde_json::to_string_pretty(&report).unwrap_or_default() + "\n"
                } else {
                    report.table()
                };
                if last.is_some() {
                    println!("---");
                }
                print!("{text}");
                last = Some(report);
            }
            if !args.watch {
                return ExitCode::SUCCESS;
            }
            tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        }
    })
}
