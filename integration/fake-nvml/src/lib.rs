//! A fake `libnvidia-ml.so.1`: the NVML C functions a GPU device plugin uses, backed by a JSON device list and a
//! fault script, so that NVML clients (ours through nvml-wrapper, or others through their own bindings) run
//! unchanged on a machine without a GPU. See README.md for the contract.
//!
//! Struct layouts, constants and return codes are NVML's (`nvml.h`). Every exported function checks its
//! pointers and answers `NVML_ERROR_INVALID_ARGUMENT` for null, as NVML does; nothing here panics across the
//! C boundary.
#![allow(
    unsafe_code,
    non_snake_case,
    non_camel_case_types,
    clippy::missing_safety_doc
)]

mod config;
mod state;
mod stubs;

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong, c_void};
use std::time::Duration;

use state::{DeviceRef, Handle, Pending, SetRef};

/// `nvmlReturn_t`.
pub type nvmlReturn_t = c_uint;
/// `nvmlDevice_t`: an opaque pointer; here, the address of a device record that lives as long as the process.
pub type nvmlDevice_t = *mut c_void;
/// `nvmlEventSet_t`: an opaque pointer to an event set.
pub type nvmlEventSet_t = *mut c_void;

/// NVML return codes used here.
pub mod code {
    use super::nvmlReturn_t;
    pub const SUCCESS: nvmlReturn_t = 0;
    pub const UNINITIALIZED: nvmlReturn_t = 1;
    pub const INVALID_ARGUMENT: nvmlReturn_t = 2;
    pub const NOT_SUPPORTED: nvmlReturn_t = 3;
    pub const NOT_FOUND: nvmlReturn_t = 6;
    pub const INSUFFICIENT_SIZE: nvmlReturn_t = 7;
    pub const TIMEOUT: nvmlReturn_t = 10;
    pub const GPU_IS_LOST: nvmlReturn_t = 15;
    pub const UNKNOWN: nvmlReturn_t = 999;
}

/// NVML event type bits.
pub mod event_type {
    pub const SINGLE_BIT_ECC: u64 = 0x1;
    pub const DOUBLE_BIT_ECC: u64 = 0x2;
    pub const XID_CRITICAL: u64 = 0x8;
}

/// `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`.
pub const FIELD_RECOVERY_ACTION: c_uint = 230;
/// `NVML_VALUE_TYPE_UNSIGNED_INT`.
const VALUE_TYPE_UNSIGNED_INT: c_uint = 1;
/// Driver version reported: a 580 driver (CUDA 13.0), before 580.82, so clients use NVML 12 field numbering.
const DRIVER_VERSION: &CStr = c"580.65.06";
/// CUDA driver version reported (13.0).
const CUDA_VERSION: c_int = 13000;

/// `nvmlPciInfo_t` (v3).
#[repr(C)]
pub struct nvmlPciInfo_t {
    pub busIdLegacy: [c_char; 16],
    pub domain: c_uint,
    pub bus: c_uint,
    pub device: c_uint,
    pub pciDeviceId: c_uint,
    pub pciSubSystemId: c_uint,
    pub busId: [c_char; 32],
}

/// `nvmlMemory_t`.
#[repr(C)]
pub struct nvmlMemory_t {
    pub total: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
pub struct nvmlMemory_v2_t {
    pub version: c_uint,
    pub total: c_ulonglong,
    pub reserved: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

/// `nvmlEventData_t`.
#[repr(C)]
pub struct nvmlEventData_t {
    pub device: nvmlDevice_t,
    pub eventType: c_ulonglong,
    pub eventData: c_ulonglong,
    pub gpuInstanceId: c_uint,
    pub computeInstanceId: c_uint,
}

/// `nvmlValue_t`: 8 bytes, read by `valueType`.
#[repr(C)]
pub union nvmlValue_t {
    pub dVal: f64,
    pub uiVal: c_uint,
    pub ullVal: c_ulonglong,
}

/// `nvmlFieldValue_t`.
#[repr(C)]
pub struct nvmlFieldValue_t {
    pub fieldId: c_uint,
    pub scopeId: c_uint,
    pub timestamp: i64,
    pub latencyUsec: i64,
    pub valueType: c_uint,
    pub nvmlReturn: nvmlReturn_t,
    pub value: nvmlValue_t,
}

/// Writes `value` through `out`, or reports a null pointer.
unsafe fn put<T>(out: *mut T, value: T) -> nvmlReturn_t {
    if out.is_null() {
        return code::INVALID_ARGUMENT;
    }
    unsafe { out.write(value) };
    code::SUCCESS
}

/// Copies `text` with its NUL into a caller buffer of `len` bytes.
unsafe fn put_str(out: *mut c_char, len: c_uint, text: &str) -> nvmlReturn_t {
    if out.is_null() {
        return code::INVALID_ARGUMENT;
    }
    let bytes = text.as_bytes();
    if bytes.len() + 1 > len as usize {
        return code::INSUFFICIENT_SIZE;
    }
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), out, bytes.len());
        out.add(bytes.len()).write(0);
    }
    code::SUCCESS
}

fn fill(buffer: &mut [c_char], text: &str) {
    let room = buffer.len().saturating_sub(1);
    for (dst, src) in buffer.iter_mut().zip(text.bytes().take(room)) {
        *dst = src as c_char;
    }
}

/// Runs `f` on a live (not lost) device, or returns the error NVML would.
fn with_device(handle: nvmlDevice_t, f: impl FnOnce(&DeviceRef) -> nvmlReturn_t) -> nvmlReturn_t {
    match state::device(handle) {
        Err(rc) => rc,
        Ok(device) if device.is_lost() => code::GPU_IS_LOST,
        Ok(device) => f(&device),
    }
}

/// Runs `f` on a live GPU or MIG device (a MIG device is lost with its GPU), or returns the error NVML
/// would.
fn with_handle(handle: nvmlDevice_t, f: impl FnOnce(Handle) -> nvmlReturn_t) -> nvmlReturn_t {
    match state::handle(handle) {
        Err(rc) => rc,
        Ok(h) if h.gpu().is_lost() => code::GPU_IS_LOST,
        Ok(h) => f(h),
    }
}

// ---- library -------------------------------------------------------------------------------------------

/// `FAKE_NVML_INIT_HANG_FILE=<path>`: while that file exists, `nvmlInit` never returns (after writing
/// `<path>.entered`, so that a test knows the load is under way), as with a driver that never answers; for
/// testing that a plugin bounds its load and still answers SIGTERM.
fn init_hang_if_asked() {
    let Some(path) = std::env::var_os("FAKE_NVML_INIT_HANG_FILE") else {
        return;
    };
    if std::path::Path::new(&path).exists() {
        let mut entered = path.clone();
        entered.push(".entered");
        let _ = std::fs::write(entered, b"");
        loop {
            std::thread::park();
        }
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    init_hang_if_asked();
    state::init()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    init_hang_if_asked();
    state::init()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    state::shutdown()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    let text: &'static CStr = match result {
        code::SUCCESS => c"Success",
        code::UNINITIALIZED => c"Uninitialized",
        code::INVALID_ARGUMENT => c"Invalid Argument",
        code::NOT_SUPPORTED => c"Not Supported",
        code::NOT_FOUND => c"Not Found",
        code::INSUFFICIENT_SIZE => c"Insufficient Size",
        code::TIMEOUT => c"Timeout",
        code::GPU_IS_LOST => c"GPU is lost",
        _ => c"Unknown Error",
    };
    text.as_ptr()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    if let Err(rc) = state::check_init() {
        return rc;
    }
    unsafe { put_str(version, length, DRIVER_VERSION.to_str().unwrap_or("")) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) -> nvmlReturn_t {
    unsafe { put(version, CUDA_VERSION) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> nvmlReturn_t {
    unsafe { put(version, CUDA_VERSION) }
}

// ---- devices -------------------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    match state::devices() {
        Ok(devices) => unsafe { put(count, devices.len() as c_uint) },
        Err(rc) => rc,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    let devices = match state::devices() {
        Ok(devices) => devices,
        Err(rc) => return rc,
    };
    match devices.get(index as usize) {
        None => code::INVALID_ARGUMENT,
        Some(d) if d.is_lost() => code::GPU_IS_LOST,
        Some(d) => unsafe { put(device, d.handle()) },
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    if uuid.is_null() {
        return code::INVALID_ARGUMENT;
    }
    let wanted = unsafe { CStr::from_ptr(uuid) }.to_string_lossy();
    let devices = match state::devices() {
        Ok(devices) => devices,
        Err(rc) => return rc,
    };
    match devices.iter().find(|d| d.spec.uuid == wanted) {
        None => code::NOT_FOUND,
        Some(d) if d.is_lost() => code::GPU_IS_LOST,
        Some(d) => unsafe { put(device, d.handle()) },
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_handle(device, |h| match h {
        Handle::Gpu(d) => unsafe { put_str(uuid, length, &d.spec.uuid) },
        Handle::Mig(_, m) => unsafe { put_str(uuid, length, &m.spec.uuid) },
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_handle(device, |h| match h {
        _ if !h.gpu().spec.supports("nvmlDeviceGetName") => code::NOT_SUPPORTED,
        Handle::Gpu(d) => unsafe { put_str(name, length, &d.spec.name) },
        Handle::Mig(d, m) => unsafe {
            put_str(
                name,
                length,
                &format!("{} MIG {}", d.spec.name, m.spec.profile.name),
            )
        },
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    device: nvmlDevice_t,
    index: *mut c_uint,
) -> nvmlReturn_t {
    with_device(device, |d| unsafe { put(index, d.index as c_uint) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minor: *mut c_uint,
) -> nvmlReturn_t {
    with_device(device, |d| {
        if !d.spec.supports("nvmlDeviceGetMinorNumber") {
            return code::NOT_SUPPORTED;
        }
        unsafe { put(minor, d.spec.minor) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    with_device(device, |d| {
        if !d.spec.supports("nvmlDeviceGetPciInfo_v3") {
            return code::NOT_SUPPORTED;
        }
        let (domain, bus, dev) = config::parse_bus_id(&d.spec.pci_bus_id);
        let mut info = nvmlPciInfo_t {
            busIdLegacy: [0; 16],
            domain,
            bus,
            device: dev,
            pciDeviceId: 0x2330_10de,
            pciSubSystemId: 0x16c1_10de,
            busId: [0; 32],
        };
        fill(&mut info.busId, &d.spec.pci_bus_id);
        fill(
            &mut info.busIdLegacy,
            &format!("{domain:04x}:{bus:02x}:{dev:02x}.0"),
        );
        unsafe { put(pci, info) }
    })
}

fn memory_bytes(h: Handle) -> u64 {
    match h {
        Handle::Gpu(d) => d.spec.memory_mib * 1024 * 1024,
        Handle::Mig(_, m) => m.spec.profile.memory_mb * 1024 * 1024,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    with_handle(device, |h| {
        if !h.gpu().spec.supports("nvmlDeviceGetMemoryInfo") {
            return code::NOT_SUPPORTED;
        }
        let total = memory_bytes(h);
        unsafe {
            put(
                memory,
                nvmlMemory_t {
                    total,
                    free: total,
                    used: 0,
                },
            )
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    with_handle(device, |h| {
        if !h.gpu().spec.supports("nvmlDeviceGetMemoryInfo") {
            return code::NOT_SUPPORTED;
        }
        let total = memory_bytes(h);
        let version = if memory.is_null() {
            0
        } else {
            unsafe { (*memory).version }
        };
        unsafe {
            put(
                memory,
                nvmlMemory_v2_t {
                    version,
                    total,
                    reserved: 0,
                    free: total,
                    used: 0,
                },
            )
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    with_device(device, |d| {
        if !d.spec.supports("nvmlDeviceGetCudaComputeCapability") {
            return code::NOT_SUPPORTED;
        }
        if major.is_null() || minor.is_null() {
            return code::INVALID_ARGUMENT;
        }
        let (cc_major, cc_minor) = d.spec.cuda_compute_capability;
        unsafe {
            major.write(cc_major);
            minor.write(cc_minor);
        }
        code::SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetArchitecture(
    device: nvmlDevice_t,
    arch: *mut c_uint,
) -> nvmlReturn_t {
    with_device(device, |d| {
        if !d.spec.supports("nvmlDeviceGetArchitecture") {
            return code::NOT_SUPPORTED;
        }
        unsafe { put(arch, d.spec.architecture) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBrand(
    device: nvmlDevice_t,
    brand: *mut c_uint,
) -> nvmlReturn_t {
    with_device(device, |d| {
        if !d.spec.supports("nvmlDeviceGetBrand") {
            return code::NOT_SUPPORTED;
        }
        unsafe { put(brand, d.spec.brand) }
    })
}

/// `NVML_DEVICE_MIG_ENABLE`.
const MIG_ENABLE: c_uint = 1;
/// MIG devices a GPU of this kind can hold.
const MAX_MIG_DEVICES: c_uint = 7;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    // Every fake GPU is MIG capable; MIG mode is on where the device list gives it MIG devices.
    with_device(device, |d| {
        if current.is_null() || pending.is_null() {
            return code::INVALID_ARGUMENT;
        }
        let mode = if d.spec.mig.is_some() { MIG_ENABLE } else { 0 };
        unsafe {
            current.write(mode);
            pending.write(mode);
        }
        code::SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    is_mig: *mut c_uint,
) -> nvmlReturn_t {
    with_handle(device, |h| unsafe {
        put(is_mig, c_uint::from(matches!(h, Handle::Mig(..))))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with_device(device, |_| unsafe { put(count, MAX_MIG_DEVICES) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    mig: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with_device(device, |d| {
        if d.spec.mig.is_none() || index >= MAX_MIG_DEVICES {
            return code::INVALID_ARGUMENT;
        }
        match d.migs.get(index as usize) {
            Some(m) => unsafe { put(mig, m.handle()) },
            None => code::NOT_FOUND,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig: nvmlDevice_t,
    parent: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with_handle(mig, |h| match h {
        Handle::Mig(d, _) => unsafe { put(parent, d.handle()) },
        Handle::Gpu(_) => code::INVALID_ARGUMENT,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    with_handle(device, |h| match h {
        Handle::Mig(_, m) => unsafe { put(id, m.spec.gpu_instance) },
        Handle::Gpu(_) => code::NOT_SUPPORTED,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    with_handle(device, |h| match h {
        Handle::Mig(_, m) => unsafe { put(id, m.spec.compute_instance) },
        Handle::Gpu(_) => code::NOT_SUPPORTED,
    })
}

/// `nvmlDeviceAttributes_t`.
#[repr(C)]
pub struct nvmlDeviceAttributes_t {
    pub multiprocessorCount: c_uint,
    pub sharedCopyEngineCount: c_uint,
    pub sharedDecoderCount: c_uint,
    pub sharedEncoderCount: c_uint,
    pub sharedJpegCount: c_uint,
    pub sharedOfaCount: c_uint,
    pub gpuInstanceSliceCount: c_uint,
    pub computeInstanceSliceCount: c_uint,
    pub memorySizeMB: c_ulonglong,
}

/// Streaming multiprocessors per compute slice, and in the whole GPU.
const SMS_PER_SLICE: c_uint = 16;
const SMS: c_uint = 132;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: nvmlDevice_t,
    attributes: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    with_handle(device, |h| {
        let (sms, gi, ci, mb) = match h {
            Handle::Gpu(d) => (SMS, 7, 7, d.spec.memory_mib),
            Handle::Mig(_, m) => (
                m.spec.compute_slices * SMS_PER_SLICE,
                m.spec.profile.slices,
                m.spec.compute_slices,
                m.spec.profile.memory_mb,
            ),
        };
        unsafe {
            put(
                attributes,
                nvmlDeviceAttributes_t {
                    multiprocessorCount: sms,
                    sharedCopyEngineCount: gi,
                    sharedDecoderCount: gi,
                    sharedEncoderCount: 0,
                    sharedJpegCount: gi,
                    sharedOfaCount: 0,
                    gpuInstanceSliceCount: gi,
                    computeInstanceSliceCount: ci,
                    memorySizeMB: mb,
                },
            )
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes(
    device: nvmlDevice_t,
    attributes: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    unsafe { nvmlDeviceGetAttributes_v2(device, attributes) }
}

/// `nvmlGpuInstanceProfileInfo_t`.
#[repr(C)]
pub struct nvmlGpuInstanceProfileInfo_t {
    pub id: c_uint,
    pub isP2pSupported: c_uint,
    pub sliceCount: c_uint,
    pub instanceCount: c_uint,
    pub multiprocessorCount: c_uint,
    pub copyEngineCount: c_uint,
    pub decoderCount: c_uint,
    pub encoderCount: c_uint,
    pub jpegCount: c_uint,
    pub ofaCount: c_uint,
    pub memorySizeMB: c_ulonglong,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    with_device(device, |d| {
        if !d.spec.supports("nvmlDeviceGetGpuInstanceProfileInfo") {
            return code::NOT_SUPPORTED;
        }
        // Looked up by index (`NVML_GPU_INSTANCE_PROFILE_*`); the info carries the profile's ID.
        let Some(p) = config::PROFILES.iter().find(|p| p.index == profile) else {
            // Profiles this GPU does not have, as on the real one.
            return code::NOT_SUPPORTED;
        };
        unsafe {
            put(
                info,
                nvmlGpuInstanceProfileInfo_t {
                    id: p.id,
                    isP2pSupported: 0,
                    sliceCount: p.slices,
                    instanceCount: p.placements.len() as c_uint,
                    multiprocessorCount: p.multiprocessors,
                    copyEngineCount: p.copy_engines,
                    decoderCount: p.decoders,
                    encoderCount: 0,
                    jpegCount: p.jpeg_engines,
                    ofaCount: p.ofa_engines,
                    memorySizeMB: p.memory_mb,
                },
            )
        }
    })
}

/// `nvmlGpuInstance_t`: an opaque token, here (parent index + 1) << 8 | GPU instance ID, never dereferenced.
pub type nvmlGpuInstance_t = *mut c_void;

/// `nvmlGpuInstancePlacement_t`.
#[repr(C)]
pub struct nvmlGpuInstancePlacement_t {
    pub start: c_uint,
    pub size: c_uint,
}

/// `nvmlGpuInstanceInfo_t`.
#[repr(C)]
pub struct nvmlGpuInstanceInfo_t {
    pub device: nvmlDevice_t,
    pub id: c_uint,
    pub profileId: c_uint,
    pub placement: nvmlGpuInstancePlacement_t,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: nvmlDevice_t,
    id: c_uint,
    instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    with_device(device, |d| {
        if d.spec.mig.is_none() {
            return code::INVALID_ARGUMENT;
        }
        if !d.migs.iter().any(|m| m.spec.gpu_instance == id) || id > 0xff {
            return code::NOT_FOUND;
        }
        let token = ((d.index + 1) << 8) | id as usize;
        unsafe { put(instance, std::ptr::without_provenance_mut(token)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    instance: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    let token = instance as usize;
    let (gpu, id) = ((token >> 8).wrapping_sub(1), (token & 0xff) as c_uint);
    let devices = match state::devices() {
        Ok(devices) => devices,
        Err(rc) => return rc,
    };
    let Some(d) = devices.get(gpu) else {
        return code::INVALID_ARGUMENT;
    };
    let Some(m) = d.migs.iter().find(|m| m.spec.gpu_instance == id) else {
        return code::INVALID_ARGUMENT;
    };
    if d.is_lost() {
        return code::GPU_IS_LOST;
    }
    unsafe {
        put(
            info,
            nvmlGpuInstanceInfo_t {
                device: d.handle(),
                id,
                profileId: m.spec.profile.id,
                placement: nvmlGpuInstancePlacement_t {
                    start: m.spec.placement_start,
                    size: m.spec.profile.memory_slices,
                },
            },
        )
    }
}

/// `NVML_TOPOLOGY_INTERNAL`, `_NODE`, `_SYSTEM`.
const TOPOLOGY_INTERNAL: c_uint = 0;
const TOPOLOGY_NODE: c_uint = 40;
const TOPOLOGY_SYSTEM: c_uint = 50;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    level: *mut c_uint,
) -> nvmlReturn_t {
    with_device(device1, |a| {
        with_device(device2, |b| {
            let common = if a.index == b.index {
                TOPOLOGY_INTERNAL
            } else if a.index / 4 == b.index / 4 {
                TOPOLOGY_NODE
            } else {
                TOPOLOGY_SYSTEM
            };
            unsafe { put(level, common) }
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    _link: c_uint,
    _active: *mut c_uint,
) -> nvmlReturn_t {
    // These fake GPUs have no NVLink.
    with_device(device, |_| code::NOT_SUPPORTED)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetFieldValues(
    device: nvmlDevice_t,
    count: c_int,
    values: *mut nvmlFieldValue_t,
) -> nvmlReturn_t {
    with_device(device, |d| {
        if values.is_null() || count < 0 {
            return code::INVALID_ARGUMENT;
        }
        let values = unsafe { std::slice::from_raw_parts_mut(values, count as usize) };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as i64);
        for value in values {
            value.timestamp = now;
            value.latencyUsec = 0;
            if value.fieldId == FIELD_RECOVERY_ACTION {
                value.valueType = VALUE_TYPE_UNSIGNED_INT;
                value.nvmlReturn = code::SUCCESS;
                value.value = nvmlValue_t {
                    ullVal: u64::from(d.recovery_action()),
                };
            } else {
                value.nvmlReturn = code::NOT_SUPPORTED;
            }
        }
        code::SUCCESS
    })
}

// ---- events --------------------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    types: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_device(device, |d| unsafe { put(types, d.spec.supported_events) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    if let Err(rc) = state::check_init() {
        return rc;
    }
    unsafe { put(set, state::create_set()) }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    types: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    if let Some(delay) = state::register_delay() {
        // A slow driver, for tests of what a plugin does while it is still registering.
        std::thread::sleep(delay);
    }
    with_device(device, |d| {
        if types & !d.spec.supported_events != 0 {
            return code::NOT_SUPPORTED;
        }
        match SetRef::from_handle(set) {
            Some(set) => {
                set.register(d.index, types);
                code::SUCCESS
            }
            None => code::INVALID_ARGUMENT,
        }
    })
}

/// `FAKE_NVML_HANG_FILE=<path>`: while that file exists, a call to `nvmlEventSetWait` never returns, as
/// with a driver stuck in the kernel; for testing that a plugin notices its event thread is stuck.
fn hang_if_asked() {
    let Some(path) = std::env::var_os("FAKE_NVML_HANG_FILE") else {
        return;
    };
    if std::path::Path::new(&path).exists() {
        loop {
            std::thread::park();
        }
    }
}

/// Whether every event wait fails now (`FAKE_NVML_WAIT_FAILS_FILE` names a file that exists), as a driver
/// whose waits error at once on every call.
fn wait_fails() -> bool {
    std::env::var_os("FAKE_NVML_WAIT_FAILS_FILE").is_some_and(|p| std::path::Path::new(&p).exists())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> nvmlReturn_t {
    if let Err(rc) = state::check_init() {
        return rc;
    }
    if data.is_null() {
        return code::INVALID_ARGUMENT;
    }
    let Some(set) = SetRef::from_handle(set) else {
        return code::INVALID_ARGUMENT;
    };
    hang_if_asked();
    if wait_fails() {
        return code::UNKNOWN;
    }
    match set.wait(Duration::from_millis(u64::from(timeout_ms))) {
        None => code::TIMEOUT,
        Some(Pending::Lost) => code::GPU_IS_LOST,
        Some(Pending::Event {
            device,
            event_type,
            event_data,
            gpu_instance,
            compute_instance,
        }) => {
            let handle = state::devices()
                .ok()
                .and_then(|ds| ds.get(device).map(|d| d.handle()));
            let Some(handle) = handle else {
                return code::UNKNOWN;
            };
            unsafe {
                put(
                    data,
                    nvmlEventData_t {
                        device: handle,
                        eventType: event_type,
                        eventData: event_data,
                        // All ones when the event is not attributed to a MIG device's instances.
                        gpuInstanceId: gpu_instance,
                        computeInstanceId: compute_instance,
                    },
                )
            }
        }
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    if let Err(rc) = state::check_init() {
        return rc;
    }
    state::free_set(set)
}
