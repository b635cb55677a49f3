//! The process's limits: the open-file limit, and how the side surfaces share it with the fault path; and
//! resident memory handed back after a burst of connections.
//!
//! Every socket, device file and inotify watch is a descriptor. The kubelet's restart (a new connection to
//! `kubelet.sock`, a new socket of ours), a checkpoint save (a temporary file and the directory) and NVML's
//! device files all need one at the moment a fault or a restart comes; if clients of the HTTP port have
//! taken them all, that moment fails. So the soft limit is raised to the hard one at start (container
//! runtimes commonly hand out 1024 soft over a hard limit of a million), and each side surface that holds
//! connections (the HTTP port, the control socket) may hold at most an eighth of the limit
//! ([`connection_cap`]): the two together a quarter, which leaves at least three quarters to the fault path
//! whatever the limit is.

use nix::sys::resource::{Resource, getrlimit, setrlimit};

/// The share of the open-file limit that one side surface may hold in connections: one eighth.
pub const SIDE_SURFACE_SHARE: u64 = 8;

/// Why the limit was not raised.
#[derive(Debug, thiserror::Error)]
pub enum LimitsError {
    /// `getrlimit` or `setrlimit` failed.
    #[error("cannot {action} the open-file limit (RLIMIT_NOFILE): {source}")]
    Rlimit {
        /// What was tried: read or raise.
        action: &'static str,
        /// The OS error.
        source: nix::Error,
    },
}

/// The open-file limit before and after [`raise_open_files`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFiles {
    /// The soft limit the process started with.
    pub was: u64,
    /// The soft limit now.
    pub now: u64,
    /// The hard limit, which only a privileged process could raise.
    pub hard: u64,
}

/// Raises the soft open-file limit to the hard one (an unprivileged process may always do this).
pub fn raise_open_files() -> Result<OpenFiles, LimitsError> {
    let (was, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(|source| LimitsError::Rlimit {
        action: "read",
        source,
    })?;
    if was < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).map_err(|source| LimitsError::Rlimit {
            action: "raise",
            source,
        })?;
    }
    Ok(OpenFiles {
        was,
        now: was.max(hard),
        hard,
    })
}

/// [`raise_open_files`] at start-up, said at debug level (a failure at warn: the plugin works on, with
/// smaller connection caps).
pub fn raise_open_files_at_start() {
    match raise_open_files() {
        Ok(files) => tracing::debug!(
            soft_was = files.was,
            soft_now = files.now,
            hard = files.hard,
            "open-file limit"
        ),
        Err(e) => tracing::warn!(error = %e, "the open-file limit stays as it was"),
    }
}

/// The soft open-file limit now, or 1024 (the usual default) if it cannot be read.
pub fn open_files_now() -> u64 {
    getrlimit(Resource::RLIMIT_NOFILE).map_or(1024, |(soft, _)| soft)
}

/// How many connections a side surface that would hold up to `wanted` may hold under an open-file limit of
/// `limit`: at most `limit / 8`, and at least one so that the surface still serves.
pub fn connection_cap(wanted: usize, limit: u64) -> usize {
    let share = usize::try_from(limit / SIDE_SURFACE_SHARE).unwrap_or(usize::MAX);
    wanted.min(share).max(1)
}

/// Hands the heap's free memory back to the kernel. glibc keeps memory freed in the middle of its heap
/// resident (it only gives back the top of the heap, and only past a threshold): after a flood of 5 000
/// connections, each held for a moment, 3 MiB of freed buffers stayed resident until this was called, and
/// came back to within 0.1 MiB of the start with it. Called after a burst on a side surface (see
/// [`crate::util::bounded::Gate`]); it walks the allocator's free lists, well under a millisecond for this
/// process's few MiB of heap.
#[allow(unsafe_code)]
pub fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointer and touches only the allocator's own free memory, under the
    // allocator's locks; glibc documents it as safe to call from any thread at any time (MT-Safe).
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn side_surfaces_together_leave_three_quarters_of_any_limit_to_the_fault_path() {
        // The usual limits: a raised one, the default 1024, and a small hard limit.
        assert_eq!(connection_cap(128, 1_048_576), 128);
        assert_eq!(connection_cap(128, 1024) + connection_cap(8, 1024), 136);
        assert_eq!(connection_cap(128, 256), 32);
        for limit in [64, 256, 1024, 4096, 1 << 20] {
            let held = connection_cap(128, limit) + connection_cap(8, limit);
            assert!(held as u64 <= limit / 4, "{limit}: {held}");
        }
        // A surface always serves something.
        assert_eq!(connection_cap(8, 4), 1);
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() -> Result<(), LimitsError> {
        let files = raise_open_files()?;
        assert_eq!((files.now, open_files_now()), (files.hard, files.hard));
        Ok(())
    }
}
