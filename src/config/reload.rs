//! The check of the config a SIGHUP asks for, in a process of its own: the running plugin's own binary
//! (`gpu-device-plugin reload-check` with the plugin's arguments and environment) reads and checks the
//! config at a lower priority, and is killed when it runs past its limit. A thread given up on would keep
//! the processor (a config that takes long to parse) or stay stuck in a read for good; a process is stopped.

use std::time::Duration;

/// The hidden subcommand the plugin runs itself as to check its config.
pub const SUBCOMMAND: &str = "reload-check";

/// The most bytes of the check's stderr read: its refusal is one line (see
/// [`crate::util::text::LINE_MAX`]).
const MAX_ANSWER_BYTES: usize = 16 * 1024;

/// Runs `command`, a config check, for at most `limit`: `Ok` when it exits 0, else the one line it wrote to
/// stderr (without the program's `gpu-device-plugin: error: ` prefix). Past `limit` the process is killed
/// and reaped before the answer, so nothing of the check runs on.
pub async fn check_in_child(
    mut command: tokio::process::Command,
    limit: Duration,
) -> Result<(), String> {
    use tokio::io::AsyncReadExt as _;
    command
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = command
        .spawn()
        .map_err(|e| format!("cannot start a process to read it: {e}"))?;
    let stderr = child.stderr.take();
    let run = async {
        let mut answer = Vec::new();
        if let Some(stderr) = stderr {
            // Read to the end (the process's exit closes it), keeping the first bytes only.
            let mut limited = stderr.take(MAX_ANSWER_BYTES as u64);
            let _read = limited.read_to_end(&mut answer).await;
            let _rest = tokio::io::copy(&mut limited.into_inner(), &mut tokio::io::sink()).await;
        }
        (child.wait().await, answer)
    };
    let outcome = tokio::time::timeout(limit, run).await;
    match outcome {
        Ok((Ok(status), _)) if status.success() => Ok(()),
        Ok((Ok(status), answer)) => {
            let text = String::from_utf8_lossy(&answer);
            let line = text
                .lines()
                .find(|l| !l.trim().is_empty())
                .map(|l| l.strip_prefix("gpu-device-plugin: error: ").unwrap_or(l))
                .map(|l| crate::util::text::shown(l, crate::util::text::LINE_MAX));
            Err(line.unwrap_or_else(|| format!("the check ended with {status} and said nothing")))
        }
        Ok((Err(e), _)) => Err(format!("cannot wait for the check: {e}")),
        Err(_) => {
            // The read and the wait were dropped with the timeout: the child is ours to stop now.
            let stopped = match child.kill().await {
                Ok(()) => "stopped",
                Err(_) => "it could not be stopped",
            };
            Err(format!(
                "reading it took more than {} s; the check was {stopped}",
                limit.as_secs_f64()
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shell(script: &str) -> tokio::process::Command {
        let mut command = tokio::process::Command::new("/bin/sh");
        command.arg("-c").arg(script);
        command
    }

    #[tokio::test]
    async fn a_check_past_its_limit_is_killed_not_left_running() {
        // A check that never ends, with its PID written where the test can see it.
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let pid_file = dir.path().join("pid");
        let script = format!("echo $$ > {}; exec sleep 1000", pid_file.display());
        let refused = check_in_child(shell(&script), Duration::from_secs(2)).await;
        let why = refused.err().unwrap_or_default();
        assert!(why.contains("the check was stopped"), "{why}");
        let pid = std::fs::read_to_string(&pid_file).unwrap_or_default();
        let pid = pid.trim();
        assert!(!pid.is_empty(), "the check ran");
        // Killed and reaped: no such process left, not even a zombie.
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "process {pid} still there"
        );
    }

    #[tokio::test]
    async fn a_refused_config_comes_back_as_the_checks_one_line() {
        let refused = check_in_child(
            shell("echo 'gpu-device-plugin: error: invalid --resource-name \"gpu\"' >&2; exit 1"),
            Duration::from_secs(600),
        )
        .await;
        assert_eq!(refused, Err("invalid --resource-name \"gpu\"".into()));
        assert_eq!(
            check_in_child(shell("exit 0"), Duration::from_secs(600)).await,
            Ok(())
        );
    }
}
