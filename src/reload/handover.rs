//! No fault lost to a restart in place. A SIGHUP's reload runs this program again in the same process, and
//! between the old image's last event wait and the new image's first, faults reach no event set: the driver
//! delivers an event only to sets registered when it happens.
//!
//! So before the old image lets go, it starts a watcher: this binary again, as [`SUBCOMMAND`] with the same
//! arguments, which opens the same device source, registers its event sets, says it is ready, and keeps what
//! it sees. The new image registers its own sets, then connects to the watcher's socket: everything the
//! watcher saw until then comes over as lines and goes through the health engine with its time, and the
//! watcher ends. A fault raised anywhere in the restart is seen by the old image, the watcher or the new
//! image; one raised while two of them watch may be counted twice (only a single-bit ECC burst counts
//! repeats).

use std::io::{BufRead as _, Read as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use tokio::sync::mpsc;

use crate::devices::{DeviceInfo, Unserved};
use crate::health::Observation;
use crate::sources::{DeviceEvent, DeviceSource, Heartbeat, SourceError};

/// The hidden subcommand the watcher runs as.
pub const SUBCOMMAND: &str = "handover-watch";

/// The variable the restarted image finds the watcher's process ID in (the watcher is its child: it must
/// reap it).
pub const PID_VAR: &str = "GPU_DEVICE_PLUGIN_HANDOVER_PID";

/// How long the watcher waits for the restarted image to take its events: a restart takes tens of
/// milliseconds, and a slow NVML load up to the load limit. Past this it says what it saw and ends.
pub const WATCH_LIMIT: Duration = Duration::from_secs(120);

/// How long the restarted image waits for the watcher's answer.
const TAKE_LIMIT: Duration = Duration::from_secs(5);

/// After the restarted image comes, how long the watcher still takes in events its threads had read before
/// (an event read by a thread just before the connection may reach the channel just after it).
const GRACE: Duration = Duration::from_millis(20);

/// The most events the watcher keeps. Past it, an event equal to one kept (same device, same observation)
/// is counted, not kept: it changes no health but a single-bit ECC burst's count.
const MAX_KEPT: usize = 65_536;

/// The longest line taken from the watcher (a device ID and an observation's text).
const MAX_LINE: usize = 16 * 1024;

/// The watcher's socket in the state directory.
pub fn socket_path(state_dir: &Path) -> PathBuf {
    state_dir.join("handover.sock")
}

/// What went wrong on either side of a handover.
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    /// The device source would not open or start.
    #[error("cannot watch the devices: {0}")]
    Source(#[from] SourceError),
    /// The socket could not be made or used.
    #[error("handover socket {}: {source}", .path.display())]
    Socket {
        /// The socket.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// Nobody came for the events in time.
    #[error(
        "no restarted plugin took the {0} events seen during the restart within {WATCH_LIMIT:?}; \
         they are only in this log"
    )]
    NotTaken(usize),
}

/// One event on the wire: the device, when it was seen (ms since the epoch) and what.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Line {
    id: String,
    at_ms: u64,
    #[serde(flatten)]
    seen: Seen,
}

/// The observations a source reports by itself (probes answer the engine's own questions; fences and
/// releases come from operators, who can repeat them).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "seen", rename_all = "lowercase")]
enum Seen {
    Xid { xid: u64 },
    Dbe,
    Sbe,
    Lost,
    Unmonitored { why: String },
    Monitored,
}

impl Line {
    fn of(event: &DeviceEvent) -> Option<Line> {
        let DeviceEvent::Observed {
            id,
            observation,
            at,
        } = event
        else {
            return None;
        };
        let seen = match observation {
            Observation::Xid(xid) => Seen::Xid { xid: *xid },
            Observation::DoubleBitEcc => Seen::Dbe,
            Observation::SingleBitEcc => Seen::Sbe,
            Observation::GpuLost => Seen::Lost,
            Observation::Unmonitored(why) => Seen::Unmonitored { why: why.clone() },
            Observation::Monitored => Seen::Monitored,
            Observation::Probe(_) | Observation::Fence { .. } | Observation::Release { .. } => {
                return None;
            }
        };
        let at_ms = at
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Some(Line {
            id: id.clone(),
            at_ms,
            seen,
        })
    }

    fn event(self) -> DeviceEvent {
        let observation = match self.seen {
            Seen::Xid { xid } => Observation::Xid(xid),
            Seen::Dbe => Observation::DoubleBitEcc,
            Seen::Sbe => Observation::SingleBitEcc,
            Seen::Lost => Observation::GpuLost,
            Seen::Unmonitored { why } => Observation::Unmonitored(why),
            Seen::Monitored => Observation::Monitored,
        };
        DeviceEvent::Observed {
            id: self.id,
            observation,
            at: UNIX_EPOCH + Duration::from_millis(self.at_ms),
        }
    }
}

/// The watcher's side: opens `source`, registers it, says `ready`, keeps what it sees, and hands it to the
/// first connection on `socket` (the restarted image). Returns how many events it handed over.
pub async fn watch(
    mut source: Box<dyn DeviceSource>,
    socket: &Path,
    ready: &mut (dyn std::io::Write + Send),
    limit: Duration,
) -> Result<usize, HandoverError> {
    let socket_error = |source| HandoverError::Socket {
        path: socket.to_path_buf(),
        source,
    };
    source.discover()?;
    let (events, mut seen) = mpsc::channel(1024);
    // Never sent on: the watcher asks no probes, but the source stops when its probe channel closes.
    let (_probes, probe_rx) = mpsc::channel(1);
    source.start(events, probe_rx)?;
    remove_stale(socket).map_err(socket_error)?;
    let listener = tokio::net::UnixListener::bind(socket).map_err(socket_error)?;
    ready
        .write_all(b"ready\n")
        .and_then(|()| ready.flush())
        .map_err(socket_error)?;
    let mut kept = Kept::default();
    let deadline = tokio::time::sleep(limit);
    tokio::pin!(deadline);
    let stream = loop {
        tokio::select! {
            event = seen.recv() => match event {
                Some(event) => kept.push(&event),
                None => std::future::pending().await,
            },
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => break stream,
                Err(e) => tracing::warn!(error = %e, "the handover socket refused a connection"),
            },
            () = &mut deadline => {
                let _gone = std::fs::remove_file(socket);
                for line in &kept.lines {
                    tracing::warn!(device = %line.id, at_ms = line.at_ms, seen = ?line.seen, "seen during the restart, not handed over");
                }
                return Err(HandoverError::NotTaken(kept.lines.len()));
            }
        }
    };
    let _gone = std::fs::remove_file(socket);
    let grace = tokio::time::sleep(GRACE);
    tokio::pin!(grace);
    loop {
        tokio::select! {
            Some(event) = seen.recv() => kept.push(&event),
            () = &mut grace => break,
        }
    }
    let mut text = Vec::new();
    for line in &kept.lines {
        if let Ok(json) = serde_json::to_vec(line) {
            text.extend_from_slice(&json);
            text.push(b'\n');
        }
    }
    let mut stream = stream;
    let written = tokio::time::timeout(TAKE_LIMIT, async {
        use tokio::io::AsyncWriteExt as _;
        stream.write_all(&text).await?;
        stream.shutdown().await
    })
    .await;
    match written {
        Ok(result) => result.map_err(socket_error)?,
        Err(_) => {
            return Err(socket_error(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the restarted plugin did not read the events in time",
            )));
        }
    }
    if kept.repeats > 0 {
        tracing::info!(
            repeats = kept.repeats,
            "repeated events past the handover's room were counted once"
        );
    }
    Ok(kept.lines.len())
}

/// Removes what an earlier watcher left at `socket`; anything but a socket there is an error, not removed.
fn remove_stale(socket: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::FileTypeExt as _;
    match std::fs::symlink_metadata(socket) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(socket),
        Ok(_) => Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            "something other than a socket is there; remove it",
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// What the watcher keeps, bounded by [`MAX_KEPT`].
#[derive(Default)]
struct Kept {
    lines: Vec<Line>,
    repeats: usize,
}

impl Kept {
    fn push(&mut self, event: &DeviceEvent) {
        let Some(line) = Line::of(event) else {
            return;
        };
        if self.lines.len() >= MAX_KEPT
            && self
                .lines
                .iter()
                .any(|l| l.id == line.id && l.seen == line.seen)
        {
            self.repeats += 1;
            return;
        }
        self.lines.push(line);
    }
}

/// The restarted image's device source: `inner`, started as usual, then whatever the watcher saw during the
/// restart, sent into the monitor's channel before anything else reads it.
pub struct HandedOver {
    inner: Box<dyn DeviceSource>,
    socket: PathBuf,
    watcher: Option<rustix::process::Pid>,
}

impl HandedOver {
    /// `inner`, taking over from the watcher on `socket`, process `watcher` (reaped once it ends).
    pub fn new(inner: Box<dyn DeviceSource>, socket: PathBuf, watcher: Option<i32>) -> HandedOver {
        HandedOver {
            inner,
            socket,
            watcher: watcher.and_then(rustix::process::Pid::from_raw),
        }
    }

    /// The watcher's process ID from [`PID_VAR`], when this image was started by a reload.
    pub fn watcher_from_env() -> Option<i32> {
        std::env::var(PID_VAR).ok()?.parse().ok()
    }
}

impl DeviceSource for HandedOver {
    fn discover(&mut self) -> Result<Vec<DeviceInfo>, SourceError> {
        self.inner.discover()
    }

    fn start(
        self: Box<Self>,
        events: mpsc::Sender<DeviceEvent>,
        probes: mpsc::Receiver<Vec<String>>,
    ) -> Result<(), SourceError> {
        let HandedOver {
            inner,
            socket,
            watcher,
        } = *self;
        // Our own event sets first: from here on nothing is missed, and what came before is the watcher's.
        inner.start(events.clone(), probes)?;
        let taken = take(&socket);
        if let Some(pid) = watcher {
            // The watcher ends once it has answered (or at its limit): reaped on a thread of its own.
            let _reaper = std::thread::Builder::new()
                .name("handover-reap".into())
                .spawn(move || {
                    let _status =
                        rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty());
                });
        }
        let lines = match taken {
            Ok(lines) => lines,
            Err(e) => {
                tracing::warn!(socket = %socket.display(), error = %e, "cannot take the events seen during the restart; a fault raised in it may be unseen");
                return Ok(());
            }
        };
        tracing::info!(
            events = lines.len(),
            "took the events seen while restarting"
        );
        // Nothing reads the channel until this returns: what does not fit goes in from a thread.
        let mut rest = Vec::new();
        for line in lines {
            match events.try_send(line.event()) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(event)) => rest.push(event),
                Err(mpsc::error::TrySendError::Closed(_)) => return Ok(()),
            }
        }
        if !rest.is_empty() {
            std::thread::Builder::new()
                .name("handover-send".into())
                .spawn(move || {
                    for event in rest {
                        if events.blocking_send(event).is_err() {
                            return;
                        }
                    }
                })
                .map_err(|e| {
                    SourceError::Discovery(format!(
                        "cannot start a thread for the events seen while restarting: {e}"
                    ))
                })?;
        }
        Ok(())
    }

    fn heartbeat(&self) -> Option<Heartbeat> {
        self.inner.heartbeat()
    }

    fn unidentified(&self) -> usize {
        self.inner.unidentified()
    }

    fn driver_version(&self) -> Option<String> {
        self.inner.driver_version()
    }

    fn unserved(&self) -> Vec<Unserved> {
        self.inner.unserved()
    }
}

/// The watcher's lines, read within [`TAKE_LIMIT`]; a line that does not parse is skipped with a warning.
fn take(socket: &Path) -> std::io::Result<Vec<Line>> {
    let stream = std::os::unix::net::UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(TAKE_LIMIT))?;
    let started = std::time::Instant::now();
    let mut reader = std::io::BufReader::new(stream);
    let mut lines = Vec::new();
    let mut buffer = Vec::new();
    loop {
        buffer.clear();
        let read = (&mut reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut buffer)?;
        if read == 0 {
            return Ok(lines);
        }
        if started.elapsed() > TAKE_LIMIT {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the watcher's answer took more than {TAKE_LIMIT:?}"),
            ));
        }
        if buffer.len() > MAX_LINE {
            // A line past the limit: skip to its end.
            let mut rest = Vec::new();
            reader.read_until(b'\n', &mut rest)?;
            tracing::warn!("a line from the handover watcher over {MAX_LINE} bytes was skipped");
            continue;
        }
        match serde_json::from_slice::<Line>(&buffer) {
            Ok(line) => lines.push(line),
            Err(e) => {
                tracing::warn!(error = %e, "a line from the handover watcher does not parse; skipped")
            }
        }
    }
}

/// The old image's side: starts `command` (this binary as [`SUBCOMMAND`]) and waits up to `limit` for it to
/// say it watches. Returns its process ID; a watcher that fails or does not answer in time is stopped, and
/// the reload is refused with why.
pub async fn start_watcher(
    mut command: std::process::Command,
    limit: Duration,
) -> Result<u32, String> {
    command
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped());
    let mut child = command.spawn().map_err(|e| {
        format!("cannot start the process that watches the GPUs during the restart: {e}")
    })?;
    let pid = child.id();
    let stdout = child.stdout.take();
    // Stopped and reaped unless it watches: past the limit, on a failure, and when the wait is given up (a
    // SIGTERM while the reload waits ends the plugin; the watcher must not outlive it for its own limit).
    let mut watcher = Stopped(Some(child));
    let Some(mut stdout) = stdout else {
        return Err("the watcher's output cannot be read".into());
    };
    // Byte by byte up to the line's end: nothing after it is read (the watcher says nothing more there).
    let said = tokio::task::spawn_blocking(move || {
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        while line.len() < 64 {
            match stdout.read(&mut byte) {
                Ok(0) | Err(_) => break,
                Ok(_) if byte[0] == b'\n' => break,
                Ok(_) => line.push(byte[0]),
            }
        }
        line == b"ready"
    });
    let why = match tokio::time::timeout(limit, said).await {
        Ok(Ok(true)) => {
            // It watches: left running for the restarted image, which takes its events and reaps it.
            let _running = watcher.0.take();
            return Ok(pid);
        }
        Ok(_) => "it ended before watching the GPUs (its log says why)".to_string(),
        Err(_) => format!("it did not watch the GPUs within {limit:?}"),
    };
    Err(format!(
        "cannot keep watching the GPUs during the restart: {why}"
    ))
}

/// A watcher process that is killed and reaped when this is dropped, unless taken out first.
struct Stopped(Option<std::process::Child>);

impl Drop for Stopped {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _killed = child.kill();
            // At once after SIGKILL: the wait only reaps it.
            let _reaped = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sources::simulated::{SimulatedGpus, simulated_uuid};
    use std::time::SystemTime;

    /// A command that writes its PID to `pid` and never says it watches.
    fn silent_watcher(pid: &Path) -> std::process::Command {
        let mut command = std::process::Command::new("/bin/sh");
        command
            .arg("-c")
            .arg(format!("echo $$ > {}; exec sleep 1000", pid.display()));
        command
    }

    fn gone(pid_file: &Path) -> bool {
        let pid = std::fs::read_to_string(pid_file).unwrap_or_default();
        let pid = pid.trim();
        !pid.is_empty() && !Path::new(&format!("/proc/{pid}")).exists()
    }

    #[tokio::test]
    async fn a_watcher_that_never_watches_is_stopped_at_the_limit_or_when_the_reload_is_given_up() {
        let dir = tempfile::tempdir().unwrap();
        // Past its limit: refused, and the process killed and reaped.
        let pid = dir.path().join("limit");
        let refused = start_watcher(silent_watcher(&pid), Duration::from_millis(500)).await;
        assert!(
            refused
                .unwrap_err()
                .contains("did not watch the GPUs within")
        );
        assert!(gone(&pid), "the watcher was left running");
        // The wait given up (a SIGTERM ends the plugin meanwhile): killed and reaped as well.
        let pid = dir.path().join("given-up");
        let mut waiting = Box::pin(start_watcher(silent_watcher(&pid), WATCH_LIMIT));
        let started = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                tokio::select! {
                    _ = &mut waiting => panic!("the silent watcher was taken"),
                    () = tokio::time::sleep(Duration::from_millis(5)) => {}
                }
                if std::fs::read_to_string(&pid).is_ok_and(|p| !p.trim().is_empty()) {
                    return;
                }
            }
        })
        .await;
        assert!(started.is_ok(), "the watcher never started");
        drop(waiting);
        assert!(gone(&pid), "the watcher outlived its reload");
    }

    #[test]
    fn every_observation_a_source_reports_crosses_the_wire_unchanged() {
        let at = UNIX_EPOCH + Duration::from_millis(1_764_000_000_123);
        for observation in [
            Observation::Xid(79),
            Observation::DoubleBitEcc,
            Observation::SingleBitEcc,
            Observation::GpuLost,
            Observation::Unmonitored("event registration failed".into()),
            Observation::Monitored,
        ] {
            let event = DeviceEvent::Observed {
                id: "GPU-1".into(),
                observation,
                at,
            };
            let line = Line::of(&event).expect("a source's observation");
            let json = serde_json::to_vec(&line).expect("serialised");
            let back: Line = serde_json::from_slice(&json).expect("parsed");
            assert_eq!(back.event(), event);
        }
    }

    #[test]
    fn past_its_room_the_watcher_counts_repeats_and_keeps_new_faults() {
        let mut kept = Kept::default();
        let event = |id: &str, xid| DeviceEvent::Observed {
            id: id.into(),
            observation: Observation::Xid(xid),
            at: SystemTime::now(),
        };
        for _ in 0..MAX_KEPT {
            kept.push(&event("GPU-0", 13));
        }
        kept.push(&event("GPU-0", 13));
        kept.push(&event("GPU-1", 79));
        assert_eq!(kept.repeats, 1);
        assert_eq!(kept.lines.len(), MAX_KEPT + 1);
        assert_eq!(kept.lines.last().map(|l| l.id.as_str()), Some("GPU-1"));
    }

    #[tokio::test]
    async fn a_fault_seen_only_by_the_watcher_reaches_the_restarted_source() {
        let dir = tempfile::tempdir().unwrap();
        let socket = socket_path(dir.path());
        let (watched, control) = SimulatedGpus::new(2);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        struct Ready(std::sync::mpsc::Sender<()>);
        impl std::io::Write for Ready {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                let _told = self.0.send(());
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let watcher_socket = socket.clone();
        let watcher = tokio::spawn(async move {
            watch(
                Box::new(watched),
                &watcher_socket,
                &mut Ready(ready_tx),
                WATCH_LIMIT,
            )
            .await
        });
        tokio::task::spawn_blocking(move || ready_rx.recv())
            .await
            .unwrap()
            .unwrap();
        // The old image has gone and the new one is not up yet: only the watcher sees this fault.
        let gpu = simulated_uuid(1);
        control.observe(&gpu, Observation::Xid(79)).await;

        let (restarted, _control) = SimulatedGpus::new(2);
        let source = Box::new(HandedOver::new(Box::new(restarted), socket.clone(), None));
        let (events, mut received) = mpsc::channel(16);
        let (_probes, probe_rx) = mpsc::channel(1);
        let started = tokio::task::spawn_blocking(move || source.start(events, probe_rx));
        let handed = watcher.await.unwrap().unwrap();
        started.await.unwrap().unwrap();
        assert_eq!(handed, 1);
        let event = tokio::time::timeout(Duration::from_secs(10), received.recv())
            .await
            .unwrap()
            .unwrap();
        match event {
            DeviceEvent::Observed {
                id, observation, ..
            } => {
                assert_eq!(id, gpu);
                assert_eq!(observation, Observation::Xid(79));
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(!socket.exists(), "the watcher removes its socket");
    }
}
