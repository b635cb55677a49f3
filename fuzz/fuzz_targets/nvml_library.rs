//! The check of NVML's library before it is loaded: any bytes as a whole file (its ELF header, program
//! headers, segments and dynamic section against its length), and the same header read from a file's first
//! 64 bytes with the file's length taken from the input's first eight bytes (its dynamic section read as
//! zeros past the input: a hole). It must answer, never panic, and pass only images whose program headers
//! and segments lie within the length it was given.
#![no_main]

use gpu_device_plugin::sources::nvml::library::{
    check_dynamic, check_image, check_segments, dynamic_segment, parse_header,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _whole = check_image(data);
    // A file longer or shorter than what was read of it: the header alone, then the program headers read
    // from wherever the header says, as the check reads a file.
    let (len, image) = match data.split_first_chunk::<8>() {
        Some((len, image)) => (u64::from_le_bytes(*len), image),
        None => return,
    };
    let start = &image[..image.len().min(64)];
    if let Ok(header) = parse_header(start, len) {
        assert!(header.program_headers.saturating_add(header.table_bytes() as u64) <= len);
        let from = usize::try_from(header.program_headers).unwrap_or(usize::MAX);
        let table = image.get(from..).unwrap_or_default();
        let table = &table[..table.len().min(header.table_bytes())];
        if check_segments(&header, table, len).is_ok() {
            // The dynamic section, where the input holds its bytes (past them is a hole of zeros).
            if let Ok((offset, size)) = dynamic_segment(&header, table) {
                let from = usize::try_from(offset).unwrap_or(usize::MAX);
                let bytes = image.get(from..).unwrap_or_default();
                let mut dynamic = bytes[..bytes.len().min(size)].to_vec();
                dynamic.resize(size, 0);
                let _dynamic = check_dynamic(&header, table, &dynamic);
            }
        }
    }
});
