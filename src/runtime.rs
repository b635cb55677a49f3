//! Work that must never take a turn on the thread carrying faults to the kubelet runs on a thread and runtime of
//! its own.

use std::future::Future;

/// Runs `future` to its end on a new thread named `name`, on a single-threaded tokio runtime of its own.
/// Fails (and runs nothing) if the runtime or the thread cannot be made.
pub fn spawn_on_own_thread<F>(name: &str, future: F) -> std::io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || runtime.block_on(future))?;
    Ok(())
}

/// The exit code after a panic (Rust's own for a panicking main thread).
pub const PANIC_EXIT_CODE: i32 = 101;

/// Makes a panic anywhere end the process with [`PANIC_EXIT_CODE`], whatever the build's panic strategy: a
/// task that died alone (the async runtime would catch it) could leave the plugin registered with nothing
/// watching the GPUs. The DaemonSet restarts the pod, and the checkpoint keeps what was known.
pub fn exit_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        tracing::error!("{info}; exiting so that the plugin is restarted");
        std::process::exit(PANIC_EXIT_CODE);
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Set in the child process of the test below, which then panics in a task.
    const CHILD: &str = "GPU_DEVICE_PLUGIN_TEST_PANIC_CHILD";

    #[test]
    fn a_panic_in_a_task_ends_the_process_with_exit_code_101()
    -> Result<(), Box<dyn std::error::Error>> {
        if std::env::var_os(CHILD).is_some() {
            exit_on_panic();
            let runtime = tokio::runtime::Builder::new_current_thread().build()?;
            runtime.block_on(async {
                // Without the hook the runtime would catch this and the process would go on.
                let task = tokio::spawn(async { panic!("a task fails") });
                let _caught = task.await;
            });
            // Reached only if the process did not end.
            return Ok(());
        }
        let out = std::process::Command::new(std::env::current_exe()?)
            .args([
                "--exact",
                "runtime::tests::a_panic_in_a_task_ends_the_process_with_exit_code_101",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .output()?;
        assert_eq!(
            out.status.code(),
            Some(PANIC_EXIT_CODE),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }
}
