//! Sharing a device between containers (time-slicing, MPS) as the model sees it: which devices of which
//! resources are listed as replicas, and under which name. Read from NVIDIA's config file by
//! `crate::config::nvidia`, applied by [`super::resources`].

/// The fewest bytes one listed device takes in a ListAndWatch message: the shortest replica ID (`0::0`) and
/// the health word `Unhealthy`, each with its field tag and length, inside the entry's own tag and length.
pub const MIN_LISTED_DEVICE_BYTES: usize = 19;

/// The most replicas of one device the kubelet could ever take in one list: its message limit (4 MiB,
/// `kubelet::server::KUBELET_MAX_MESSAGE_BYTES`) over the smallest listed device. Below this, whether a list
/// fits is checked at start against the real device IDs (`kubelet::server::check_list_size`), with the
/// reason; above it the file is refused at once, before any list is built in memory.
pub const MAX_LISTED_REPLICAS: usize = 4 * 1024 * 1024 / MIN_LISTED_DEVICE_BYTES;

/// How replicas share a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShareKind {
    /// `sharing.timeSlicing`.
    TimeSlicing,
    /// `sharing.mps`: the containers talk to NVIDIA's MPS control daemon for the resource.
    Mps,
}

/// Sharing as NVIDIA's file states it (`sharing.timeSlicing` or `sharing.mps`), checked: which devices of
/// which resources are listed as replicas, and under which name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sharing {
    /// Time-slicing or MPS.
    pub kind: ShareKind,
    /// Refuse a container asking for more than one replica.
    pub fail_requests_greater_than_one: bool,
    /// The shared resources, each named once.
    pub resources: Vec<SharedResource>,
}

/// One entry of `sharing.*.resources`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedResource {
    /// The resource whose devices are shared (`nvidia.com/gpu`, `nvidia.com/mig-1g.10gb`; a name without a
    /// domain is in `nvidia.com`, as NVIDIA reads it).
    pub name: String,
    /// The resource the replicas are served under instead (`rename`, or `<name>.shared` with
    /// `renameByDefault`); `None`: under `name`.
    pub rename: Option<String>,
    /// Devices listed per shared device, from 2 to [`MAX_LISTED_REPLICAS`].
    pub replicas: usize,
    /// Which of the resource's devices are shared.
    pub devices: DeviceSelection,
}

/// `devices` of a shared resource. NVIDIA's plugin v0.20 ignores it (it shares every device); this one
/// applies it, and entries that match no device of the node are a warning, not a refusal, because one
/// ConfigMap serves many kinds of nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSelection {
    /// `all` (or left out).
    All,
    /// The first N devices of the resource, in NVML index order.
    Count(usize),
    /// These devices, each by index (`0`, `<gpu>:<mig>` for a MIG device) or UUID (`GPU-…`, `MIG-…`).
    List(Vec<String>),
}
