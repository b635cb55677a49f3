//! NVML's library checked before the dynamic loader maps it. The loader maps each loadable segment the
//! program headers name; a segment that runs past the end of a truncated file is a SIGBUS when touched,
//! inside `dlopen`, with no chance to log. And the loader opens a FIFO named as the library and waits on it
//! for ever. So the file the loader would open is looked at first: a regular file, an ELF shared object
//! whose program headers and the segments they name fit in the file, with a dynamic section whose string and
//! symbol tables lie in what the file maps. A bad one is refused with the reason in one line, before it is
//! loaded.
//!
//! No reading of the file can foresee every damage that crashes the loader (a half-written copy whose first
//! pages are whole, a table pointing at zeros), so the library is then loaded once in a child process: this
//! binary run as [`TRIAL_LOAD`], which maps it and looks up NVML's symbols as the real load does, without
//! initialising NVML. A child killed by a signal, or one that does not finish, is a damaged library, refused
//! in one line; only a library that loaded there is loaded by the plugin itself.

use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};

/// The most program headers read: a real shared object has about ten; the read stays small whatever the
/// header claims.
pub const MAX_PROGRAM_HEADERS: usize = 1024;

/// The most bytes of a dynamic section read: a real one is a few hundred bytes.
pub const MAX_DYNAMIC_BYTES: u64 = 64 * 1024;

/// The hidden subcommand that loads the library given after it, looks up NVML's symbols and exits: the trial
/// load [`check`] runs in a child process.
pub const TRIAL_LOAD: &str = "__trial-load-nvml";

/// What the trial-load child prints once the library loaded: an executable that is not this binary (a test
/// harness, the bench) ignores the subcommand and prints something else, and is not taken as a failed load.
const TRIAL_LOADED: &str = "gpu-device-plugin: NVML library loaded";

/// How long the trial load may take. Mapping NVML's library takes milliseconds; a load that takes this long
/// is stuck (a hung mount) and the plugin's own load would be too.
pub const TRIAL_LOAD_LIMIT: std::time::Duration = std::time::Duration::from_secs(20);

/// Where the dynamic loader looks for a library given by name (after `LD_LIBRARY_PATH`), as far as this
/// check follows it: the usual library directories. A library only `ld.so.cache` names elsewhere is loaded
/// unchecked.
const SEARCH_DIRS: [&str; 8] = [
    "/lib64",
    "/usr/lib64",
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/lib",
    "/usr/lib",
];

/// Why a library file cannot be loaded safely.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LibraryProblem {
    /// Not a regular file: a FIFO would block the loader for ever, a directory cannot be loaded.
    #[error("{} is {kind}, not a regular file", shown(.path))]
    NotAFile {
        /// The file.
        path: PathBuf,
        /// What it is instead.
        kind: &'static str,
    },
    /// The file could not be opened or read.
    #[error("cannot read {}: {cause}", shown(.path))]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// The OS error.
        cause: String,
    },
    /// Loading it in a child process killed the child: the loader or the library's start-up code crashed.
    #[error(
        "{} crashed the dynamic loader when loaded in a trial process ({signal}): a damaged or half-written copy? Reinstall or remount the driver's library",
        shown(.path)
    )]
    CrashedLoading {
        /// The file (or the name, where the loader finds it by its cache).
        path: PathBuf,
        /// The signal that ended the trial, by name.
        signal: String,
    },
    /// Loading it in a child process did not finish in time.
    #[error(
        "{} did not finish loading in a trial process within {} s: a hung mount or a damaged copy?",
        shown(.path),
        TRIAL_LOAD_LIMIT.as_secs()
    )]
    HungLoading {
        /// The file (or the name).
        path: PathBuf,
    },
    /// The file is not an ELF shared object whose parts fit in it.
    #[error("{} is not a whole shared library: {problem} (a truncated or damaged copy?)", shown(.path))]
    BadElf {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: ElfProblem,
    },
}

/// A path as a line shows it.
fn shown(path: &Path) -> String {
    crate::util::text::shown(&path.to_string_lossy(), crate::util::text::SHOWN_MAX)
}

/// What is wrong with an ELF image.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ElfProblem {
    /// Shorter than an ELF header, or without ELF's magic bytes.
    #[error("no ELF header")]
    NoHeader,
    /// A class (32/64-bit) or byte order ELF does not define.
    #[error("an ELF header of unknown class or byte order")]
    UnknownFormat,
    /// Not a shared object (an executable, an object file).
    #[error("an ELF file of type {0}, not a shared object")]
    NotShared(u16),
    /// The program headers' size is not their class's, or there are none, or too many.
    #[error("{count} program headers of {size} bytes each")]
    BadProgramHeaders {
        /// How many the header says.
        count: u16,
        /// How big each, the header says.
        size: u16,
    },
    /// The program headers run past the end of the file.
    #[error("its program headers end at byte {end}, past its {len} bytes")]
    HeadersPastEnd {
        /// Where they end.
        end: u64,
        /// The file's length.
        len: u64,
    },
    /// No dynamic section, or one too big or not within the file.
    #[error("no usable dynamic section ({0})")]
    BadDynamicSection(&'static str),
    /// The dynamic section does not name a table the loader reads (empty: the file's bytes there are zeros).
    #[error("its dynamic section names no {0} table")]
    MissingTable(&'static str),
    /// A table the dynamic section names lies outside what the file maps.
    #[error(
        "its {table} table at address {address:#x} lies outside the segments it maps from the file"
    )]
    TableOutside {
        /// Which table (`string`, `symbol`, `hash`).
        table: &'static str,
        /// Its address as the dynamic section gives it.
        address: u64,
    },
    /// A segment the loader maps runs past the end of the file.
    #[error("segment {index} ends at byte {end}, past its {len} bytes")]
    SegmentPastEnd {
        /// Which program header.
        index: usize,
        /// Where its bytes end in the file.
        end: u64,
        /// The file's length.
        len: u64,
    },
}

/// The header fields the check needs, in the file's class and byte order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElfHeader {
    wide: bool,
    big_endian: bool,
    /// Where the program headers start.
    pub program_headers: u64,
    /// How many there are.
    pub count: usize,
    /// How big each one is.
    pub entry_size: usize,
}

impl ElfHeader {
    /// The bytes the program headers take, from [`Self::program_headers`].
    pub fn table_bytes(&self) -> usize {
        self.count * self.entry_size
    }
}

/// Reads an unsigned field of `width` bytes at `at` in `bytes`, in the byte order asked for.
fn field(bytes: &[u8], at: usize, width: usize, big_endian: bool) -> Option<u64> {
    let raw = bytes.get(at..at.checked_add(width)?)?;
    let mut value = 0u64;
    if big_endian {
        for &b in raw {
            value = (value << 8) | u64::from(b);
        }
    } else {
        for &b in raw.iter().rev() {
            value = (value << 8) | u64::from(b);
        }
    }
    Some(value)
}

/// The ELF header at the start of `bytes` (at least its first 64 bytes, or the whole file if shorter), checked
/// against a file of `len` bytes: a shared object whose program headers fit in the file.
pub fn parse_header(bytes: &[u8], len: u64) -> Result<ElfHeader, ElfProblem> {
    if bytes.len() < 52 || !bytes.starts_with(b"\x7fELF") {
        return Err(ElfProblem::NoHeader);
    }
    let wide = match bytes[4] {
        1 => false,
        2 => true,
        _ => return Err(ElfProblem::UnknownFormat),
    };
    let big_endian = match bytes[5] {
        1 => false,
        2 => true,
        _ => return Err(ElfProblem::UnknownFormat),
    };
    let read =
        |at: usize, width: usize| field(bytes, at, width, big_endian).ok_or(ElfProblem::NoHeader);
    let kind = read(16, 2)? as u16;
    // ET_DYN: what dlopen maps (a shared object, or a position-independent executable).
    if kind != 3 {
        return Err(ElfProblem::NotShared(kind));
    }
    let (program_headers, entry_size, count, expected_size) = if wide {
        (read(32, 8)?, read(54, 2)?, read(56, 2)?, 56)
    } else {
        (read(28, 4)?, read(42, 2)?, read(44, 2)?, 32)
    };
    if entry_size != expected_size || count == 0 || count as usize > MAX_PROGRAM_HEADERS {
        return Err(ElfProblem::BadProgramHeaders {
            count: count as u16,
            size: entry_size as u16,
        });
    }
    let end = program_headers.saturating_add(count * entry_size);
    if end > len {
        return Err(ElfProblem::HeadersPastEnd { end, len });
    }
    Ok(ElfHeader {
        wide,
        big_endian,
        program_headers,
        count: count as usize,
        entry_size: entry_size as usize,
    })
}

/// Checks the program headers `table` (the [`ElfHeader::table_bytes`] bytes at
/// [`ElfHeader::program_headers`]) against a file of `len` bytes: every segment the loader maps
/// (`PT_LOAD`) or reads (`PT_DYNAMIC`, `PT_INTERP`, `PT_NOTE`, ...) holds bytes within the file.
pub fn check_segments(header: &ElfHeader, table: &[u8], len: u64) -> Result<(), ElfProblem> {
    let short = ElfProblem::HeadersPastEnd {
        end: header
            .program_headers
            .saturating_add(header.table_bytes() as u64),
        len,
    };
    for index in 0..header.count {
        let entry = table
            .get(index * header.entry_size..(index + 1) * header.entry_size)
            .ok_or(short.clone())?;
        let read = |at: usize, width: usize| {
            field(entry, at, width, header.big_endian).ok_or(short.clone())
        };
        let (kind, offset, size) = if header.wide {
            (read(0, 4)?, read(8, 8)?, read(32, 8)?)
        } else {
            (read(0, 4)?, read(4, 4)?, read(16, 4)?)
        };
        // PT_NULL has no bytes; a segment of no bytes in the file is all memory (bss).
        if kind == 0 || size == 0 {
            continue;
        }
        let end = offset.saturating_add(size);
        if end > len {
            return Err(ElfProblem::SegmentPastEnd { index, end, len });
        }
    }
    Ok(())
}

/// One program header's type, file offset, address and size in the file.
fn program_header(header: &ElfHeader, table: &[u8], index: usize) -> Option<(u64, u64, u64, u64)> {
    let entry = table.get(index * header.entry_size..(index + 1) * header.entry_size)?;
    let read = |at: usize, width: usize| field(entry, at, width, header.big_endian);
    Some(if header.wide {
        (read(0, 4)?, read(8, 8)?, read(16, 8)?, read(32, 8)?)
    } else {
        (read(0, 4)?, read(4, 4)?, read(8, 4)?, read(16, 4)?)
    })
}

/// Where the dynamic section (`PT_DYNAMIC`) lies in the file: its offset and size, at most
/// [`MAX_DYNAMIC_BYTES`]. Call after [`check_segments`], which has checked it lies within the file.
pub fn dynamic_segment(header: &ElfHeader, table: &[u8]) -> Result<(u64, usize), ElfProblem> {
    let found = (0..header.count)
        .filter_map(|i| program_header(header, table, i))
        .find(|(kind, ..)| *kind == 2);
    let Some((_, offset, _, size)) = found else {
        return Err(ElfProblem::BadDynamicSection("none"));
    };
    let entry = if header.wide { 16 } else { 8 };
    if size < entry || size > MAX_DYNAMIC_BYTES {
        return Err(ElfProblem::BadDynamicSection("of an impossible size"));
    }
    let size = usize::try_from(size).map_err(|_| ElfProblem::BadDynamicSection("too big"))?;
    Ok((offset, size))
}

/// Checks the dynamic section's bytes `dynamic` (read from where [`dynamic_segment`] says): it names a string
/// table and a symbol table (and any hash table) that lie within the file bytes a loadable segment maps. A
/// dynamic section left as zeros (a copy written only in part) names none; one pointing elsewhere makes the
/// loader read past what it mapped.
pub fn check_dynamic(header: &ElfHeader, table: &[u8], dynamic: &[u8]) -> Result<(), ElfProblem> {
    let width = if header.wide { 8 } else { 4 };
    let (mut strtab, mut strsz, mut symtab, mut hashes) = (None, None, None, Vec::new());
    for entry in dynamic.chunks_exact(2 * width) {
        let read = |at: usize| field(entry, at, width, header.big_endian).unwrap_or(0);
        match (read(0), read(width)) {
            (0, _) => break,
            (5, address) => strtab = Some(address),
            (6, address) => symtab = Some(address),
            (10, size) => strsz = Some(size),
            // DT_HASH, DT_GNU_HASH.
            (4 | 0x6fff_fef5, address) => hashes.push(address),
            _ => {}
        }
    }
    let loads: Vec<(u64, u64)> = (0..header.count)
        .filter_map(|i| program_header(header, table, i))
        .filter(|(kind, ..)| *kind == 1)
        .map(|(_, _, address, size)| (address, size))
        .collect();
    let within = |table: &'static str, address: u64, size: u64| {
        let end = address.saturating_add(size.max(1));
        if loads
            .iter()
            .any(|&(start, len)| start <= address && end <= start.saturating_add(len))
        {
            Ok(())
        } else {
            Err(ElfProblem::TableOutside { table, address })
        }
    };
    let strtab = strtab.ok_or(ElfProblem::MissingTable("string"))?;
    within("string", strtab, strsz.unwrap_or(1))?;
    let symtab = symtab.ok_or(ElfProblem::MissingTable("symbol"))?;
    within("symbol", symtab, if header.wide { 24 } else { 16 })?;
    for address in hashes {
        within("hash", address, 16)?;
    }
    Ok(())
}

/// Checks a whole image in memory (what the fuzz target and the tests give): the header, the program
/// headers and the dynamic section, against the image's own length.
pub fn check_image(image: &[u8]) -> Result<(), ElfProblem> {
    let len = image.len() as u64;
    let header = parse_header(image, len)?;
    let start = usize::try_from(header.program_headers).map_err(|_| ElfProblem::NoHeader)?;
    let table = image
        .get(start..start.saturating_add(header.table_bytes()))
        .ok_or(ElfProblem::HeadersPastEnd {
            end: header
                .program_headers
                .saturating_add(header.table_bytes() as u64),
            len,
        })?;
    check_segments(&header, table, len)?;
    let (offset, size) = dynamic_segment(&header, table)?;
    let dynamic = usize::try_from(offset)
        .ok()
        .and_then(|start| image.get(start..start.checked_add(size)?))
        .ok_or(ElfProblem::BadDynamicSection("not within the file"))?;
    check_dynamic(&header, table, dynamic)
}

/// The file the dynamic loader would open for `library`: the path itself when it names a directory (has a
/// '/'), else the first of `LD_LIBRARY_PATH`'s directories and the usual library directories that holds
/// something of that name. `None` when nothing is found there (the loader then says it found nothing, or
/// finds it through its cache).
pub fn file_for(library: &Path) -> Option<PathBuf> {
    if library.as_os_str().as_encoded_bytes().contains(&b'/') {
        return Some(library.to_path_buf());
    }
    let from_env = std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default();
    let env_dirs: Vec<PathBuf> = std::env::split_paths(&from_env)
        .filter(|d| !d.as_os_str().is_empty())
        .collect();
    env_dirs
        .into_iter()
        .chain(SEARCH_DIRS.iter().map(PathBuf::from))
        .map(|dir| dir.join(library))
        // Anything of that name, links followed: a FIFO there is what the loader would open.
        .find(|path| std::fs::metadata(path).is_ok())
}

/// Checks the file the loader would open for `library` (see [`file_for`]): a regular file and a whole ELF
/// shared object. It is opened without blocking, so a FIFO put in its place after the look is not waited on.
pub fn check(library: &Path) -> Result<(), LibraryProblem> {
    let Some(path) = file_for(library) else {
        // Found (or not) by the loader's cache: no file to read, but a trial load all the same.
        if trial_load(library, library)? {
            tracing::info!(library = %shown(library), "loading NVML (a trial load succeeded)");
        }
        return Ok(());
    };
    check_file(&path)?;
    if trial_load(library, &path)? {
        // The last line before the load, should anything still go wrong inside it. (A library the trial
        // could not load, such as a missing one, gets the loader's own error from the load, in one line.)
        tracing::info!(library = %shown(&path), "loading NVML (its file checked and a trial load succeeded)");
    }
    Ok(())
}

/// The checks of [`check`] on the file itself.
fn check_file(path: &Path) -> Result<(), LibraryProblem> {
    let path = path.to_path_buf();
    let unreadable = |e: std::io::Error| LibraryProblem::Unreadable {
        path: path.clone(),
        cause: e.to_string(),
    };
    let not_a_file = |file_type: std::fs::FileType| {
        use std::os::unix::fs::FileTypeExt as _;
        let kind = if file_type.is_dir() {
            "a directory"
        } else if file_type.is_fifo() {
            "a FIFO"
        } else if file_type.is_socket() {
            "a socket"
        } else if file_type.is_char_device() || file_type.is_block_device() {
            "a device"
        } else {
            "not a file"
        };
        LibraryProblem::NotAFile {
            path: path.clone(),
            kind,
        }
    };
    // A missing file is the loader's to report, as it always did (and the trial load says nothing of it).
    let Ok(metadata) = std::fs::metadata(&path) else {
        return Ok(());
    };
    if !metadata.is_file() {
        return Err(not_a_file(metadata.file_type()));
    }
    let file = {
        use std::os::unix::fs::OpenOptionsExt as _;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .map_err(unreadable)?
    };
    let metadata = file.metadata().map_err(unreadable)?;
    if !metadata.is_file() {
        return Err(not_a_file(metadata.file_type()));
    }
    let len = metadata.len();
    let bad = |problem: ElfProblem| LibraryProblem::BadElf {
        path: path.clone(),
        problem,
    };
    let mut start = vec![0u8; usize::try_from(len.min(64)).unwrap_or(64)];
    file.read_exact_at(&mut start, 0).map_err(unreadable)?;
    let header = parse_header(&start, len).map_err(bad)?;
    let mut table = vec![0u8; header.table_bytes()];
    file.read_exact_at(&mut table, header.program_headers)
        .map_err(unreadable)?;
    check_segments(&header, &table, len).map_err(bad)?;
    let (offset, size) = dynamic_segment(&header, &table).map_err(bad)?;
    let mut dynamic = vec![0u8; size];
    file.read_exact_at(&mut dynamic, offset)
        .map_err(unreadable)?;
    check_dynamic(&header, &table, &dynamic).map_err(bad)
}

/// Loads `library` in a child process (this binary as [`TRIAL_LOAD`]) and waits for it at most
/// [`TRIAL_LOAD_LIMIT`]: a child killed by a signal or still loading then is a damaged library, named as
/// `path`. Otherwise whether the child loaded it: one that could not be started, or that is not this binary,
/// or that reports an error the loader gave, proves nothing, and the plugin's own load follows and reports
/// what it finds.
fn trial_load(library: &Path, path: &Path) -> Result<bool, LibraryProblem> {
    use std::os::unix::process::ExitStatusExt as _;
    use std::process::{Command, Stdio};
    // The running binary even if its file was replaced since (an upgrade in place).
    let started = Command::new("/proc/self/exe")
        .arg(TRIAL_LOAD)
        .arg(library)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn();
    let child = match started {
        Ok(child) => child,
        Err(e) => {
            tracing::debug!(error = %e, "no trial load of NVML: cannot start a child");
            return Ok(false);
        }
    };
    let pid = rustix::process::Pid::from_raw(child.id() as i32);
    let (tx, rx) = std::sync::mpsc::channel();
    let waiting = std::thread::Builder::new()
        .name("nvml-trial".into())
        .spawn(move || {
            let _gone = tx.send(child.wait_with_output());
        });
    let kill = || {
        if let Some(pid) = pid {
            let _gone = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    };
    if waiting.is_err() {
        kill();
        return Ok(false);
    }
    match rx.recv_timeout(TRIAL_LOAD_LIMIT) {
        Ok(Ok(output)) => match output.status.signal() {
            Some(signal) => Err(LibraryProblem::CrashedLoading {
                path: path.to_path_buf(),
                signal: signal_name(signal),
            }),
            None => Ok(output.stdout.starts_with(TRIAL_LOADED.as_bytes())),
        },
        Ok(Err(_)) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Ok(false),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            // The waiting thread reaps it.
            kill();
            Err(LibraryProblem::HungLoading {
                path: path.to_path_buf(),
            })
        }
    }
}

/// A signal's name, as an operator reads it in a line.
fn signal_name(signal: i32) -> String {
    match signal {
        libc::SIGSEGV => "killed by SIGSEGV".into(),
        libc::SIGBUS => "killed by SIGBUS".into(),
        libc::SIGILL => "killed by SIGILL".into(),
        libc::SIGABRT => "killed by SIGABRT".into(),
        libc::SIGFPE => "killed by SIGFPE".into(),
        libc::SIGKILL => "killed by SIGKILL".into(),
        other => format!("killed by signal {other}"),
    }
}

/// The trial-load child ([`TRIAL_LOAD`]): maps the library named by the next argument and looks up NVML's
/// symbols as the plugin's load does, without calling into it; says so and exits 0. A damaged library ends
/// it by a signal, which is what the parent looks for; without a core dump, which would only fill the node.
pub fn trial_load_command() -> std::process::ExitCode {
    let _no_core = nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_CORE, 0, 0);
    let Some(library) = std::env::args_os().nth(2) else {
        return std::process::ExitCode::from(2);
    };
    match load_symbols(&library) {
        Ok(()) => {
            println!("{TRIAL_LOADED}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            println!("{e}");
            std::process::ExitCode::from(3)
        }
    }
}

/// Maps `library` and resolves NVML's symbols, as nvml-wrapper's load does; the library stays mapped until
/// the process exits (unloading it runs code of its own, which is not what is tried).
#[allow(unsafe_code)]
fn load_symbols(library: &std::ffi::OsStr) -> Result<(), String> {
    // SAFETY: this runs only in the trial child, which exists to be killed if the library is damaged;
    // nothing in the library is called beyond what the loader itself runs, and nothing is shared with the
    // plugin's process.
    let loaded = unsafe { nvml_wrapper_sys::bindings::NvmlLib::new(library) };
    match loaded {
        Ok(lib) => {
            std::mem::forget(lib);
            Ok(())
        }
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A little 64-bit shared object: its header, `segments` program headers (type, offset, size in the
    /// file), and `len` bytes in all.
    fn image(segments: &[(u32, u64, u64)], len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len.max(64 + 56 * segments.len())];
        out[..4].copy_from_slice(b"\x7fELF");
        out[4] = 2;
        out[5] = 1;
        out[16..18].copy_from_slice(&3u16.to_le_bytes());
        out[32..40].copy_from_slice(&64u64.to_le_bytes());
        out[54..56].copy_from_slice(&56u16.to_le_bytes());
        out[56..58].copy_from_slice(&(segments.len() as u16).to_le_bytes());
        for (i, (kind, offset, size)) in segments.iter().enumerate() {
            let at = 64 + 56 * i;
            out[at..at + 4].copy_from_slice(&kind.to_le_bytes());
            out[at + 8..at + 16].copy_from_slice(&offset.to_le_bytes());
            out[at + 32..at + 40].copy_from_slice(&size.to_le_bytes());
        }
        out.truncate(len.max(64 + 56 * segments.len()));
        out
    }

    /// Writes dynamic entries (tag, value) at `at`, ended by DT_NULL.
    fn dynamic(image: &mut [u8], at: usize, entries: &[(u64, u64)]) {
        for (i, (tag, value)) in entries.iter().chain([(0, 0)].iter()).enumerate() {
            let at = at + 16 * i;
            image[at..at + 8].copy_from_slice(&tag.to_le_bytes());
            image[at + 8..at + 16].copy_from_slice(&value.to_le_bytes());
        }
    }

    /// A whole little shared object: one loadable segment of 4096 bytes at address 0, a dynamic section at
    /// 4000 naming a string table, its size and a symbol table within it.
    fn whole() -> Vec<u8> {
        let mut out = image(&[(1, 0, 4096), (2, 4000, 96)], 4096);
        dynamic(&mut out, 4000, &[(5, 0x100), (10, 16), (6, 0x200)]);
        out
    }

    #[test]
    fn a_dynamic_section_of_zeros_or_with_tables_out_of_range_is_refused() {
        assert_eq!(check_image(&whole()), Ok(()));
        // A copy written only in part: the dynamic section is zeros.
        let mut zeros = whole();
        zeros[4000..].fill(0);
        assert_eq!(check_image(&zeros), Err(ElfProblem::MissingTable("string")));
        let mut far = whole();
        dynamic(
            &mut far,
            4000,
            &[(5, 0x7fff_0000_0100), (10, 16), (6, 0x200)],
        );
        assert_eq!(
            check_image(&far),
            Err(ElfProblem::TableOutside {
                table: "string",
                address: 0x7fff_0000_0100
            })
        );
        let mut long = whole();
        dynamic(&mut long, 4000, &[(5, 0x100), (10, 1 << 40), (6, 0x200)]);
        assert!(matches!(
            check_image(&long),
            Err(ElfProblem::TableOutside {
                table: "string",
                ..
            })
        ));
        let mut symbols = whole();
        dynamic(&mut symbols, 4000, &[(5, 0x100), (6, u64::MAX - 4)]);
        assert!(matches!(
            check_image(&symbols),
            Err(ElfProblem::TableOutside {
                table: "symbol",
                ..
            })
        ));
        let none = image(&[(1, 0, 4096)], 4096);
        assert_eq!(
            check_image(&none),
            Err(ElfProblem::BadDynamicSection("none"))
        );
    }

    #[test]
    fn a_whole_shared_object_passes_and_a_truncated_one_names_the_segment_past_its_end() {
        let whole = whole();
        assert_eq!(check_image(&whole), Ok(()));
        let mut truncated = whole.clone();
        truncated.truncate(3000);
        assert_eq!(
            check_image(&truncated),
            Err(ElfProblem::SegmentPastEnd {
                index: 0,
                end: 4096,
                len: 3000
            })
        );
        // Cut inside the program headers themselves.
        truncated.truncate(100);
        assert!(matches!(
            check_image(&truncated),
            Err(ElfProblem::HeadersPastEnd { .. })
        ));
    }

    #[test]
    fn garbage_an_executable_and_absurd_headers_are_refused() {
        assert_eq!(check_image(b""), Err(ElfProblem::NoHeader));
        assert_eq!(check_image(&[0xAB; 4096]), Err(ElfProblem::NoHeader));
        let mut executable = image(&[(1, 0, 200)], 200);
        executable[16] = 2;
        assert_eq!(check_image(&executable), Err(ElfProblem::NotShared(2)));
        let mut huge = image(&[(1, 0, 200)], 200);
        huge[56..58].copy_from_slice(&u16::MAX.to_le_bytes());
        assert!(matches!(
            check_image(&huge),
            Err(ElfProblem::BadProgramHeaders { .. })
        ));
        let far = image(&[(1, u64::MAX - 2, 10)], 200);
        assert!(matches!(
            check_image(&far),
            Err(ElfProblem::SegmentPastEnd { .. })
        ));
    }

    #[test]
    fn a_fifo_a_directory_and_garbage_named_as_the_library_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let fifo = dir.path().join("libnvidia-ml.so.1");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(made.success());
        let refused = check(&fifo)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            refused.contains("is a FIFO, not a regular file"),
            "{refused}"
        );
        let refused = check(dir.path())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(refused.contains("is a directory"), "{refused}");
        let garbage = dir.path().join("garbage.so");
        std::fs::write(&garbage, [0x5a; 10_000]).unwrap_or_else(|e| panic!("{e}"));
        let refused = check(&garbage)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(refused.contains("no ELF header"), "{refused}");
        // A missing file is the loader's to report.
        assert_eq!(check(&dir.path().join("missing.so")), Ok(()));
    }

    #[test]
    fn a_library_given_by_path_is_checked_there() {
        assert_eq!(
            file_for(Path::new("/x/libnvidia-ml.so.1")),
            Some(PathBuf::from("/x/libnvidia-ml.so.1"))
        );
        assert_eq!(file_for(Path::new("libno-such-library-here.so.1")), None);
    }
}
