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

/// Runs `command`, a config check, for at most `limit`: when it exits 0, what it wrote to stdout (what the
/// new config says that the running plugin must weigh: see [`new_roads`]); else the one line it wrote to
/// stderr (without the program's `gpu-device-plugin: error: ` prefix). Past `limit` the process is killed
/// and reaped before the answer, so nothing of the check runs on.
pub async fn check_in_child(
    mut command: tokio::process::Command,
    limit: Duration,
) -> Result<String, String> {
    command
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = command
        .spawn()
        .map_err(|e| format!("cannot start a process to read it: {e}"))?;
    let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
    let run = async {
        let (said, answer) = tokio::join!(first_bytes(stdout), first_bytes(stderr));
        (child.wait().await, said, answer)
    };
    let outcome = tokio::time::timeout(limit, run).await;
    match outcome {
        Ok((Ok(status), said, _)) if status.success() => {
            Ok(String::from_utf8_lossy(&said).into_owned())
        }
        Ok((Ok(status), _, answer)) => {
            let text = String::from_utf8_lossy(&answer);
            let line = text
                .lines()
                .find(|l| !l.trim().is_empty())
                .map(|l| l.strip_prefix("gpu-device-plugin: error: ").unwrap_or(l))
                .map(|l| crate::util::text::shown(l, crate::util::text::LINE_MAX));
            Err(line.unwrap_or_else(|| format!("the check ended with {status} and said nothing")))
        }
        Ok((Err(e), _, _)) => Err(format!("cannot wait for the check: {e}")),
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

/// Reads `pipe` to its end (the process's exit closes it), keeping the first [`MAX_ANSWER_BYTES`] only.
async fn first_bytes(pipe: Option<impl tokio::io::AsyncRead + Unpin>) -> Vec<u8> {
    use tokio::io::AsyncReadExt as _;
    let mut kept = Vec::new();
    if let Some(pipe) = pipe {
        let mut limited = pipe.take(MAX_ANSWER_BYTES as u64);
        let _read = limited.read_to_end(&mut kept).await;
        let _rest = tokio::io::copy(&mut limited.into_inner(), &mut tokio::io::sink()).await;
    }
    kept
}

/// What the check says of the new config's `dra` (printed by the check, read by the running plugin).
const DRA_LINE: &str = "dra=";

/// The check's line for the new config's `dra` selection.
pub fn roads_line(dra: Option<&crate::devices::selection::DraSelection>) -> String {
    format!("{DRA_LINE}{}", crate::devices::selection::setting(dra))
}

/// The new config's `dra` selection, from the check's answer: `Err` when the answer does not say it.
pub fn new_roads(said: &str) -> Result<Option<crate::devices::selection::DraSelection>, String> {
    let value = said
        .lines()
        .find_map(|line| line.strip_prefix(DRA_LINE))
        .ok_or("the check did not say which GPUs the new config serves through DRA")?;
    crate::devices::selection::DraSelection::parse(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::selection::DraSelection;

    #[test]
    fn the_new_roads_read_back_as_the_check_printed_them() {
        for value in ["off", "all", "1,GPU-2"] {
            let selection = DraSelection::parse(value).unwrap_or_else(|e| panic!("{e}"));
            let said = format!("{}\n", roads_line(selection.as_ref()));
            assert_eq!(new_roads(&said), Ok(selection));
        }
        assert!(new_roads("").is_err());
    }

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
            check_in_child(shell("echo dra=0,1"), Duration::from_secs(600)).await,
            Ok("dra=0,1\n".into())
        );
    }
}
