//! The NVML calls nvml-wrapper does not wrap, made through its raw library handle: a MIG device's GPU and
//! compute instance IDs, its GPU instance's profile and placement, and the event wait with the instance IDs
//! an event is attributed to (nvml-wrapper's `EventData` drops them); and a GPU's brand and architecture as
//! NVML's numbers, which nvml-wrapper refuses for values newer than itself (a Rubin GPU's architecture).
//!
//! The only unsafe code in the plugin. Each call passes NVML a handle nvml-wrapper got from NVML and
//! still owns (alive for the borrow), and pointers to locals of the right `nvml.h` type; symbols are looked
//! up through nvml-wrapper's checked accessor, so a driver without one is an error, not a crash.
#![allow(unsafe_code)]

use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper::{Device, EventSet, Nvml};
use nvml_wrapper_sys::bindings::{
    nvmlEventData_t, nvmlGpuInstance_t, nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t,
};

/// A MIG device's GPU instance ID.
pub fn gpu_instance_id(nvml: &Nvml, device: &Device<'_>) -> Result<u32, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceId.as_ref())?;
    let mut id = 0u32;
    // SAFETY: a live device handle and a pointer to a local c_uint.
    nvml_try(unsafe { sym(device.handle(), &mut id) })?;
    Ok(id)
}

/// A MIG device's compute instance ID.
pub fn compute_instance_id(nvml: &Nvml, device: &Device<'_>) -> Result<u32, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceGetComputeInstanceId.as_ref())?;
    let mut id = 0u32;
    // SAFETY: a live device handle and a pointer to a local c_uint.
    nvml_try(unsafe { sym(device.handle(), &mut id) })?;
    Ok(id)
}

/// What NVML says of one GPU instance (`nvmlGpuInstanceInfo_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuInstanceInfo {
    /// Its GPU instance profile's ID.
    pub profile_id: u32,
    /// First memory slice it occupies.
    pub placement_start: u32,
    /// Memory slices it occupies.
    pub placement_size: u32,
}

/// Profile and placement of GPU instance `gpu_instance` of `gpu` (a GPU, not a MIG device).
pub fn gpu_instance_info(
    nvml: &Nvml,
    gpu: &Device<'_>,
    gpu_instance: u32,
) -> Result<GpuInstanceInfo, NvmlError> {
    let by_id = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceById.as_ref())?;
    let get_info = nvml_sym(nvml.lib().nvmlGpuInstanceGetInfo.as_ref())?;
    let mut instance: nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: a live device handle and a pointer to a local handle.
    nvml_try(unsafe { by_id(gpu.handle(), gpu_instance, &mut instance) })?;
    let mut info = nvmlGpuInstanceInfo_t {
        device: std::ptr::null_mut(),
        id: 0,
        profileId: 0,
        placement: nvmlGpuInstancePlacement_t { start: 0, size: 0 },
    };
    // SAFETY: the instance handle NVML just returned and a pointer to a local info struct.
    nvml_try(unsafe { get_info(instance, &mut info) })?;
    Ok(GpuInstanceInfo {
        profile_id: info.profileId,
        placement_start: info.placement.start,
        placement_size: info.placement.size,
    })
}

/// A GPU's `NVML_DEVICE_ARCH_*` value.
pub fn architecture(nvml: &Nvml, device: &Device<'_>) -> Result<u32, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceGetArchitecture.as_ref())?;
    let mut architecture = 0u32;
    // SAFETY: a live device handle and a pointer to a local c_uint (`nvmlDeviceArchitecture_t`).
    nvml_try(unsafe { sym(device.handle(), &mut architecture) })?;
    Ok(architecture)
}

/// A GPU's `NVML_BRAND_*` value.
pub fn brand(nvml: &Nvml, device: &Device<'_>) -> Result<u32, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceGetBrand.as_ref())?;
    let mut brand = 0u32;
    // SAFETY: a live device handle and a pointer to a local c_uint (`nvmlBrandType_t`).
    nvml_try(unsafe { sym(device.handle(), &mut brand) })?;
    Ok(brand)
}

/// One event, with what nvml-wrapper's `EventData` leaves out. Not which GPU it came on: each set holds one
/// GPU, and asking NVML about the event's device handle fails once that GPU is lost, which would drop a
/// fault raised just before the loss.
#[derive(Debug, Clone, Copy)]
pub struct Event {
    /// `nvmlEventType*` bits.
    pub event_type: u64,
    /// The XID for an XID event.
    pub data: u64,
    /// GPU instance the event is attributed to; `u32::MAX` when it is not.
    pub gpu_instance: u32,
    /// Compute instance; `u32::MAX` when not attributed.
    pub compute_instance: u32,
}

/// Waits up to `timeout_ms` on `set` (`nvmlEventSetWait_v2`).
pub fn wait(nvml: &Nvml, set: &EventSet<'_>, timeout_ms: u32) -> Result<Event, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlEventSetWait_v2.as_ref())?;
    let mut data = nvmlEventData_t {
        device: std::ptr::null_mut(),
        eventType: 0,
        eventData: 0,
        gpuInstanceId: u32::MAX,
        computeInstanceId: u32::MAX,
    };
    // SAFETY: the set handle nvml-wrapper owns for as long as `set` is borrowed, and a pointer to a local
    // event data struct.
    nvml_try(unsafe { sym(set.handle(), &mut data, timeout_ms) })?;
    Ok(Event {
        event_type: data.eventType,
        data: data.eventData,
        gpu_instance: data.gpuInstanceId,
        compute_instance: data.computeInstanceId,
    })
}
