//! Work that must never take a turn on the thread carrying faults to the kubelet runs on a thread and runtime of
//! its own.

use std::future::Future;

/// How much lower than the fault path's the side threads' scheduling priority is (added to the nice value,
/// at most 19). With both runnable on a busy node the fault path gets about nine tenths of a processor to a
/// side thread's tenth; an idle processor still runs a side thread at once, so a probe or a status request
/// is slowed only while the fault path needs the processor.
pub const SIDE_NICE_STEP: i32 = 10;

/// Lowers the calling thread's scheduling priority by [`SIDE_NICE_STEP`]: for a thread that serves a side
/// surface, so that its work (a flood of requests, a directory of reports rewritten thousands of times a
/// second, a large config file parsed) takes the processors after the fault path's threads. Threads it
/// starts inherit the priority. A failure (a seccomp profile that refuses `setpriority`) leaves the priority
/// as it was and says so at debug level: the bulkheads still hold, only the share of processor time differs.
pub fn lower_priority() {
    let tid = rustix::thread::gettid();
    let lowered = rustix::process::getpriority_process(Some(tid)).and_then(|nice| {
        rustix::process::setpriority_process(Some(tid), (nice + SIDE_NICE_STEP).min(19))
    });
    if let Err(e) = lowered {
        tracing::debug!(error = %e, "cannot lower a side thread's scheduling priority");
    }
}

/// The scheduling priority of a thread of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    /// A side surface's: [`lower_priority`].
    Side,
    /// The fault path's own (the process's priority): a thread that carries faults to the kubelet.
    FaultPath,
}

/// Runs `future` to its end on a new thread named `name`, on a single-threaded tokio runtime of its own,
/// at `priority`. Fails (and runs nothing) if the runtime or the thread cannot be made.
pub fn spawn_on_own_thread<F>(name: &str, priority: Priority, future: F) -> std::io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            if priority == Priority::Side {
                lower_priority();
            }
            runtime.block_on(future);
        })?;
    Ok(())
}

/// A thread and single-threaded runtime of their own for the side surfaces (HTTP, the control socket, the
/// fence directory): the bulkhead between them and the fault path. A slow client, a stuck file or a flood
/// of requests there costs that thread alone; the runtime carrying faults to the kubelet never runs their
/// tasks. They reach the health monitor only through its bounded channels.
pub struct SideRuntime {
    handle: tokio::runtime::Handle,
    thread: std::thread::JoinHandle<()>,
}

/// How long the side runtime's tasks get to finish (a socket removed, a connection closed) once `until`
/// is cancelled, before the rest are dropped.
const SIDE_GRACE: std::time::Duration = std::time::Duration::from_millis(200);

impl SideRuntime {
    /// Starts the runtime on a new thread named `name`; it runs its tasks until `until` is cancelled.
    pub fn start(
        name: &str,
        until: tokio_util::sync::CancellationToken,
    ) -> std::io::Result<SideRuntime> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                lower_priority();
                runtime.block_on(async {
                    until.cancelled().await;
                    // Tasks that end on the cancellation take their last turn (a control socket removes
                    // its file); a connection still open is dropped after the grace period.
                    let metrics = tokio::runtime::Handle::current().metrics();
                    let _ended = tokio::time::timeout(SIDE_GRACE, async {
                        while metrics.num_alive_tasks() > 0 {
                            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
                        }
                    })
                    .await;
                });
                runtime.shutdown_timeout(std::time::Duration::ZERO);
            })?;
        Ok(SideRuntime { handle, thread })
    }

    /// Enters the runtime: what is spawned or bound while the guard lives (`tokio::spawn`, a listener's
    /// bind) belongs to the side thread.
    pub fn enter(&self) -> tokio::runtime::EnterGuard<'_> {
        self.handle.enter()
    }

    /// Waits, off the async runtime, for the side thread to end (once `until` was cancelled).
    pub async fn join(self) {
        let thread = self.thread;
        let _ended = tokio::task::spawn_blocking(move || thread.join()).await;
    }
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

    #[test]
    fn side_tasks_run_on_their_own_thread_at_a_lower_priority_and_end_with_it()
    -> Result<(), Box<dyn std::error::Error>> {
        let main = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        main.block_on(async {
            let until = tokio_util::sync::CancellationToken::new();
            let side = SideRuntime::start("side-test", until.clone())?;
            let (tx, rx) = tokio::sync::oneshot::channel();
            let stopped = until.clone();
            let (done_tx, done_rx) = tokio::sync::oneshot::channel();
            {
                let _inside = side.enter();
                tokio::spawn(async move {
                    let nice = rustix::process::getpriority_process(Some(rustix::thread::gettid()));
                    let _sent = tx.send((std::thread::current().name().map(String::from), nice));
                    stopped.cancelled().await;
                    // The last turn after cancellation still runs.
                    let _sent = done_tx.send(());
                });
            }
            let (name, side_nice) =
                tokio::time::timeout(std::time::Duration::from_secs(10), rx).await??;
            assert_eq!(name.as_deref(), Some("side-test"));
            // Below the fault path's priority: a flood there takes the processors after the fault path.
            let main_nice = rustix::process::getpriority_process(Some(rustix::thread::gettid()))?;
            assert_eq!(side_nice?, (main_nice + SIDE_NICE_STEP).min(19));
            until.cancel();
            side.join().await;
            assert!(done_rx.await.is_ok(), "the task's last turn never ran");
            Ok::<_, Box<dyn std::error::Error>>(())
        })
    }

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
        // This test's name as the harness knows it: its module path without the crate's name.
        let module = module_path!().split_once("::").map_or("", |(_, m)| m);
        let name = format!("{module}::a_panic_in_a_task_ends_the_process_with_exit_code_101");
        let out = std::process::Command::new(std::env::current_exe()?)
            .args(["--exact", name.as_str(), "--nocapture"])
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
