//! The fake library under several threads, as NVML documents its own: "NVML is thread-safe so it is safe to
//! make simultaneous NVML calls from multiple threads". One thread waits in `nvmlEventSetWait`; the other
//! initialises, shuts down and queries meanwhile, and each of its calls must answer while the wait is still in
//! progress, not when it ends.
//!
//! The library's state is the process's, so these tests take turns (one lock) and leave it shut down.
#![allow(unsafe_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::ffi::{CStr, c_char, c_uint};
use std::io::Write;
use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use fake_nvml::{
    code, event_type, nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t, nvmlMemory_t, nvmlReturn_t,
};

/// The fault script every test appends to (the fake follows `FAKE_NVML_EVENTS` from the first `nvmlInit`).
fn script() -> &'static PathBuf {
    static SCRIPT: OnceLock<PathBuf> = OnceLock::new();
    SCRIPT.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep();
        let path = dir.join("events");
        std::fs::write(&path, "").unwrap();
        // SAFETY: set once, before any thread of these tests reads the environment through the library.
        unsafe { std::env::set_var("FAKE_NVML_EVENTS", &path) };
        path
    })
}

/// The library to this test alone, shut down on entry and on exit.
struct Library(#[allow(dead_code)] MutexGuard<'static, ()>);

impl Library {
    fn take() -> Library {
        static TURN: Mutex<()> = Mutex::new(());
        script();
        let turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
        while fake_nvml::nvmlShutdown() == code::SUCCESS {}
        Library(turn)
    }
}

impl Drop for Library {
    fn drop(&mut self) {
        while fake_nvml::nvmlShutdown() == code::SUCCESS {}
    }
}

fn append(line: &str) {
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(script())
        .unwrap();
    writeln!(file, "{line}").unwrap();
}

fn gpu(index: c_uint) -> nvmlDevice_t {
    let mut device = std::ptr::null_mut();
    assert_eq!(
        unsafe { fake_nvml::nvmlDeviceGetHandleByIndex_v2(index, &mut device) },
        code::SUCCESS
    );
    device
}

fn uuid(device: nvmlDevice_t) -> String {
    let mut buffer = [0 as c_char; 96];
    assert_eq!(
        unsafe { fake_nvml::nvmlDeviceGetUUID(device, buffer.as_mut_ptr(), 96) },
        code::SUCCESS
    );
    unsafe { CStr::from_ptr(buffer.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// An event set with GPU 0 registered for XIDs.
fn xid_set() -> nvmlEventSet_t {
    let mut set = std::ptr::null_mut();
    assert_eq!(
        unsafe { fake_nvml::nvmlEventSetCreate(&mut set) },
        code::SUCCESS
    );
    assert_eq!(
        fake_nvml::nvmlDeviceRegisterEvents(gpu(0), event_type::XID_CRITICAL, set),
        code::SUCCESS
    );
    set
}

/// What a wait returned: its code, the XID when it returned an event, and how long it took.
type Waited = (nvmlReturn_t, Option<u64>, Duration);

/// A thread waiting on `set` for up to `timeout`, seen blocked in its wait before this returns.
struct Waiter {
    done: Receiver<Waited>,
}

impl Waiter {
    fn start(set: nvmlEventSet_t, timeout: Duration) -> Waiter {
        let set = set as usize;
        let (tid_tx, tid_rx) = mpsc::channel();
        let (done_tx, done) = mpsc::channel();
        std::thread::spawn(move || {
            // "/proc/thread-self" links to "<pid>/task/<tid>".
            let me = std::fs::read_link("/proc/thread-self").unwrap();
            tid_tx.send(me.file_name().unwrap().to_owned()).unwrap();
            let mut data = std::mem::MaybeUninit::<nvmlEventData_t>::zeroed();
            let started = Instant::now();
            let rc = unsafe {
                fake_nvml::nvmlEventSetWait_v2(
                    std::ptr::without_provenance_mut(set),
                    data.as_mut_ptr(),
                    timeout.as_millis() as c_uint,
                )
            };
            let xid = (rc == code::SUCCESS).then(|| unsafe { data.assume_init() }.eventData);
            let _ = done_tx.send((rc, xid, started.elapsed()));
        });
        let tid = tid_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        wait_blocked_in_poll(&tid);
        Waiter { done }
    }

    /// Panics unless the wait is still in progress.
    fn assert_waiting(&self, after: &str) {
        assert_eq!(
            self.done.try_recv().err(),
            Some(TryRecvError::Empty),
            "the wait ended before {after} answered: {after} waited for it"
        );
    }

    fn result(self) -> Waited {
        self.done
            .recv_timeout(Duration::from_secs(20))
            .expect("the wait never ended")
    }
}

/// Waits (up to 10 s) until thread `tid` of this process is blocked in `poll`, as a thread waiting in
/// `nvmlEventSetWait` for the fault script is.
fn wait_blocked_in_poll(tid: &std::ffi::OsStr) {
    // poll and ppoll on x86_64; ppoll on aarch64.
    let polls: &[&str] = if cfg!(target_arch = "aarch64") {
        &["73"]
    } else {
        &["7", "271"]
    };
    let path = PathBuf::from("/proc/self/task").join(tid).join("syscall");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let syscall = std::fs::read_to_string(&path).unwrap_or_default();
        if syscall
            .split_whitespace()
            .next()
            .is_some_and(|n| polls.contains(&n))
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the waiting thread never blocked in its wait (last: {syscall:?})"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Runs `call`, returning its answer and how long it took, and reports the time.
fn timed<T>(what: &str, call: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let answer = call();
    eprintln!("{what}: {:?} while another thread waits", started.elapsed());
    answer
}

#[test]
fn init_answers_while_another_thread_waits() {
    let _library = Library::take();
    assert_eq!(fake_nvml::nvmlInit_v2(), code::SUCCESS);
    let set = xid_set();
    let waiter = Waiter::start(set, Duration::from_secs(30));

    assert_eq!(
        timed("nvmlInit_v2", || fake_nvml::nvmlInit_v2()),
        code::SUCCESS
    );
    assert_eq!(
        timed("nvmlInitWithFlags", || fake_nvml::nvmlInitWithFlags(0)),
        code::SUCCESS
    );
    waiter.assert_waiting("nvmlInit");

    // The wait still takes the next fault.
    append(&format!("xid {} 79", uuid(gpu(0))));
    let (rc, xid, _) = waiter.result();
    assert_eq!((rc, xid), (code::SUCCESS, Some(79)));
    assert_eq!(fake_nvml::nvmlEventSetFree(set), code::SUCCESS);
}

#[test]
fn a_shutdown_that_is_not_the_last_answers_while_another_thread_waits_and_the_wait_goes_on() {
    let _library = Library::take();
    assert_eq!(fake_nvml::nvmlInit_v2(), code::SUCCESS);
    assert_eq!(fake_nvml::nvmlInit_v2(), code::SUCCESS);
    let set = xid_set();
    let waiter = Waiter::start(set, Duration::from_secs(30));

    assert_eq!(
        timed("nvmlShutdown", || fake_nvml::nvmlShutdown()),
        code::SUCCESS
    );
    waiter.assert_waiting("nvmlShutdown");

    // One nvmlInit is still unmatched: the library is up, the wait takes the next fault.
    append(&format!("xid {} 48", uuid(gpu(0))));
    let (rc, xid, _) = waiter.result();
    assert_eq!((rc, xid), (code::SUCCESS, Some(48)));
    assert_eq!(fake_nvml::nvmlEventSetFree(set), code::SUCCESS);
}

#[test]
fn queries_answer_while_another_thread_waits() {
    let _library = Library::take();
    assert_eq!(fake_nvml::nvmlInit_v2(), code::SUCCESS);
    let set = xid_set();
    let waiter = Waiter::start(set, Duration::from_secs(30));

    timed("queries of every GPU", || {
        let mut count = 0;
        assert_eq!(
            unsafe { fake_nvml::nvmlDeviceGetCount_v2(&mut count) },
            code::SUCCESS
        );
        assert_eq!(count, 4);
        for index in 0..count {
            let device = gpu(index);
            assert!(uuid(device).starts_with("GPU-"));
            let mut name = [0 as c_char; 96];
            assert_eq!(
                unsafe { fake_nvml::nvmlDeviceGetName(device, name.as_mut_ptr(), 96) },
                code::SUCCESS
            );
            let mut memory = nvmlMemory_t {
                total: 0,
                free: 0,
                used: 0,
            };
            assert_eq!(
                unsafe { fake_nvml::nvmlDeviceGetMemoryInfo(device, &mut memory) },
                code::SUCCESS
            );
            assert!(memory.total > 0);
        }
        let mut version = [0 as c_char; 80];
        assert_eq!(
            unsafe { fake_nvml::nvmlSystemGetDriverVersion(version.as_mut_ptr(), 80) },
            code::SUCCESS
        );
    });
    // A second event set made and registered meanwhile, as another thread of a plugin may.
    let other = timed("nvmlEventSetCreate + nvmlDeviceRegisterEvents", xid_set);
    waiter.assert_waiting("the queries");

    append(&format!("xid {} 79", uuid(gpu(0))));
    let (rc, xid, _) = waiter.result();
    assert_eq!((rc, xid), (code::SUCCESS, Some(79)));
    assert_eq!(fake_nvml::nvmlEventSetFree(other), code::SUCCESS);
    assert_eq!(fake_nvml::nvmlEventSetFree(set), code::SUCCESS);
}

#[test]
fn the_last_shutdown_answers_at_once_and_the_wait_in_progress_ends_at_its_timeout() {
    let _library = Library::take();
    assert_eq!(fake_nvml::nvmlInit_v2(), code::SUCCESS);
    let set = xid_set();
    let fault = format!("xid {} 79", uuid(gpu(0)));
    let timeout = Duration::from_secs(2);
    let waiter = Waiter::start(set, timeout);

    assert_eq!(
        timed("the last nvmlShutdown", || fake_nvml::nvmlShutdown()),
        code::SUCCESS
    );
    waiter.assert_waiting("the last nvmlShutdown");

    // Shut down, the library follows no more faults: the wait ends at its timeout, not with this one.
    append(&fault);
    let (rc, xid, waited) = waiter.result();
    assert_eq!((rc, xid), (code::TIMEOUT, None));
    assert!(
        waited >= timeout,
        "the wait ended after {waited:?}, before its timeout of {timeout:?}"
    );

    // The next wait is a call on a library that is not initialised.
    let mut data = std::mem::MaybeUninit::<nvmlEventData_t>::zeroed();
    assert_eq!(
        unsafe { fake_nvml::nvmlEventSetWait_v2(set, data.as_mut_ptr(), 0) },
        code::UNINITIALIZED
    );
    assert_eq!(fake_nvml::nvmlEventSetFree(set), code::UNINITIALIZED);
    // Initialised again, the set is still there to free; the fault appended while shut down is history.
    assert_eq!(fake_nvml::nvmlInit_v2(), code::SUCCESS);
    assert_eq!(
        unsafe { fake_nvml::nvmlEventSetWait_v2(set, data.as_mut_ptr(), 0) },
        code::TIMEOUT
    );
    assert_eq!(fake_nvml::nvmlEventSetFree(set), code::SUCCESS);
}

#[test]
fn a_wait_across_the_last_shutdown_and_a_new_init_takes_only_faults_written_after_that_init() {
    let _library = Library::take();
    assert_eq!(fake_nvml::nvmlInit_v2(), code::SUCCESS);
    let set = xid_set();
    let gpu0 = uuid(gpu(0));
    let waiter = Waiter::start(set, Duration::from_secs(30));

    assert_eq!(
        timed("the last nvmlShutdown", || fake_nvml::nvmlShutdown()),
        code::SUCCESS
    );
    // Written while shut down: history once the library is initialised again.
    append(&format!("xid {gpu0} 48"));
    assert_eq!(
        timed("nvmlInit_v2 after the last shutdown", || {
            fake_nvml::nvmlInit_v2()
        }),
        code::SUCCESS
    );
    waiter.assert_waiting("nvmlInit after the last nvmlShutdown");

    append(&format!("xid {gpu0} 79"));
    let (rc, xid, _) = waiter.result();
    assert_eq!((rc, xid), (code::SUCCESS, Some(79)));
    assert_eq!(fake_nvml::nvmlEventSetFree(set), code::SUCCESS);
}

#[test]
fn shutdown_is_counted_against_init_and_one_too_many_answers_uninitialized() {
    let _library = Library::take();
    assert_eq!(fake_nvml::nvmlInit_v2(), code::SUCCESS);
    assert_eq!(fake_nvml::nvmlInitWithFlags(0), code::SUCCESS);
    assert_eq!(fake_nvml::nvmlShutdown(), code::SUCCESS);
    // One init still unmatched: calls work.
    let mut count = 0;
    assert_eq!(
        unsafe { fake_nvml::nvmlDeviceGetCount_v2(&mut count) },
        code::SUCCESS
    );
    assert_eq!(fake_nvml::nvmlShutdown(), code::SUCCESS);
    assert_eq!(
        unsafe { fake_nvml::nvmlDeviceGetCount_v2(&mut count) },
        code::UNINITIALIZED
    );
    assert_eq!(fake_nvml::nvmlShutdown(), code::UNINITIALIZED);
}
