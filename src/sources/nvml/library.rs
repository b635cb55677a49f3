//! NVML's library checked before the dynamic loader maps it. The loader maps each loadable segment the
//! program headers name; a segment that runs past the end of a truncated file is a SIGBUS when touched,
//! inside `dlopen`, with no chance to log. And the loader opens a FIFO named as the library and waits on it
//! for ever. So the file the loader would open is looked at first: a regular file, an ELF shared object
//! whose program headers and the segments they name fit in the file. A bad one is refused with the reason
//! in one line, before it is loaded.

use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};

/// The most program headers read: a real shared object has about ten; the read stays small whatever the
/// header claims.
pub const MAX_PROGRAM_HEADERS: usize = 1024;

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

/// Checks a whole image in memory (what the fuzz target and the tests give): the header, then the program
/// headers, against the image's own length.
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
    check_segments(&header, table, len)
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
        return Ok(());
    };
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
    // A missing file is the loader's to report, as it always did.
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
    check_segments(&header, &table, len).map_err(bad)
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

    #[test]
    fn a_whole_shared_object_passes_and_a_truncated_one_names_the_segment_past_its_end() {
        let whole = image(&[(1, 0, 4096), (2, 4000, 96)], 4096);
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
