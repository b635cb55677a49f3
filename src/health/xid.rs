//! The built-in XID table: what each XID in NVIDIA's XID catalog means and what it needs.

use super::Effect;

/// What the GPU needs, per NVIDIA's XID catalog ("resolution bucket, immediate action").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XidAction {
    /// Restart the application; the GPU is fine.
    RestartApp,
    /// Nothing to do.
    Ignore,
    /// Stop the GPU's processes and reset the GPU.
    ResetGpu,
    /// Reboot the node.
    RebootNode,
    /// Double-bit ECC error: reset, and drain first if row remapping failed too.
    EccWorkflow,
    /// NVLink error: decode it; most need a reset.
    NvlinkWorkflow,
    /// The driver's recovery action changed; the action itself says what to do.
    FollowRecoveryAction,
}

impl XidAction {
    /// Whether a GPU with this XID should be kept away from new pods.
    pub fn effect(self) -> Effect {
        match self {
            XidAction::RestartApp | XidAction::Ignore => Effect::None,
            // XID 154 only announces a change: the recovery action it points to decides health.
            XidAction::FollowRecoveryAction => Effect::None,
            XidAction::ResetGpu
            | XidAction::RebootNode
            | XidAction::EccWorkflow
            | XidAction::NvlinkWorkflow => Effect::Unhealthy,
        }
    }

    /// What an operator should do, in words.
    pub fn advice(self) -> &'static str {
        match self {
            XidAction::RestartApp => "restart the application; the GPU is fine",
            XidAction::Ignore => "no action needed",
            XidAction::ResetGpu => "stop the GPU's workloads and reset the GPU",
            XidAction::RebootNode => "drain and reboot the node",
            XidAction::EccWorkflow => {
                "drain the GPU and reset it; check for failed row remapping (XID 64)"
            }
            XidAction::NvlinkWorkflow => "check the NVLink error details; most need a GPU reset",
            XidAction::FollowRecoveryAction => "follow the recovery action the driver reports",
        }
    }
}

/// One entry of the built-in XID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XidInfo {
    /// What happened, in words.
    pub meaning: &'static str,
    /// What the catalog says to do.
    pub action: XidAction,
}

/// The XIDs the catalog lists for current GPUs, with what each means and needs.
pub fn xid_info(xid: u64) -> Option<XidInfo> {
    use XidAction::*;
    let (meaning, action) = match xid {
        8 => ("the GPU stopped processing (idle timeout)", RestartApp),
        13 => (
            "graphics engine exception, usually an application fault",
            RestartApp,
        ),
        31 => (
            "GPU memory page fault, usually an application fault",
            RestartApp,
        ),
        32 => ("invalid or corrupted push buffer stream", RestartApp),
        43 => ("the GPU stopped processing a channel", Ignore),
        45 => ("channel clean-up after earlier errors", Ignore),
        48 => ("double-bit ECC error", EccWorkflow),
        62 => ("internal micro-controller halt", ResetGpu),
        63 => ("a memory row was remapped or a page retired", Ignore),
        64 => ("memory row remapping failed", ResetGpu),
        68 => ("video decoder exception", RestartApp),
        69 => ("graphics engine class error", RestartApp),
        74 => ("NVLink error", NvlinkWorkflow),
        79 => ("the GPU has fallen off the bus", RebootNode),
        92 => ("high single-bit ECC error rate (early warning)", Ignore),
        94 => ("contained memory error", RestartApp),
        95 => ("uncontained memory error", ResetGpu),
        109 => ("context switch timeout", ResetGpu),
        119 => ("GSP firmware RPC timeout", ResetGpu),
        120 => ("GSP firmware error", ResetGpu),
        121 => ("chip-to-chip link error", Ignore),
        136 => ("link training failed", ResetGpu),
        140 => ("unrecovered ECC error", ResetGpu),
        143 => ("GPU initialisation error", ResetGpu),
        144..=150 => ("NVLink5 error", NvlinkWorkflow),
        154 => ("the driver's recovery action changed", FollowRecoveryAction),
        155 => ("NVLink software-defined error", ResetGpu),
        _ => return None,
    };
    Some(XidInfo { meaning, action })
}
