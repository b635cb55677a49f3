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
