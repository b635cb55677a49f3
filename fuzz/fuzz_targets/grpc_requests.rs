//! The kubelet's calls as the gRPC server decodes them: any bytes as an `AllocateRequest`,
//! `PreferredAllocationRequest` or `PreStartContainerRequest` (the first byte picks which, and whether the
//! GPUs are shared as replicas), answered by the plugin's service over four GPUs, one of them Unhealthy, and
//! two MIG devices. A request may be refused with a status; none may panic or allocate without bound.
#![no_main]

use std::collections::BTreeSet;
use std::sync::{Arc, OnceLock};

use gpu_device_plugin::devices::allocation::AllocateOptions;
use gpu_device_plugin::api::device_plugin_server::DevicePlugin;
use gpu_device_plugin::api::{AllocateRequest, PreStartContainerRequest, PreferredAllocationRequest};
use gpu_device_plugin::devices::mig::MigInfo;
use gpu_device_plugin::devices::{DeviceInfo, Health, Inventory};
use gpu_device_plugin::kubelet::server::PluginService;
use gpu_device_plugin::devices::naming::Naming;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tokio_util::sync::CancellationToken;

struct Rig {
    runtime: tokio::runtime::Runtime,
    /// GPUs listed once each.
    plain: PluginService,
    /// Three replicas of two of the GPUs, refusing a request for more than one.
    shared: PluginService,
}

fn inventory() -> Inventory {
    let gpu = |i: usize| format!("GPU-fa4e0000-0000-4000-8000-{i:012x}");
    let mut devices: Vec<DeviceInfo> = (0..4)
        .map(|i| DeviceInfo {
            id: gpu(i),
            numa_node: Some((i / 2) as i64),
            device_nodes: vec![format!("/dev/nvidia{i}").into()],
            index: Some(i.to_string()),
            ..DeviceInfo::default()
        })
        .collect();
    devices.extend((0..2u32).map(|m| DeviceInfo {
        id: format!("MIG-fa4e0000-0003-4000-8000-{m:012x}"),
        index: Some(format!("3:{m}")),
        mig: Some(MigInfo {
            parent: gpu(3),
            profile: "3g.40gb".into(),
            gpu_instance: m + 1,
            compute_instance: 0,
        }),
        ..DeviceInfo::default()
    }));
    let mut inventory = Inventory::new(devices);
    inventory.set_health(
        &gpu(1),
        Health::Unhealthy,
        Some("Unhealthy: XID 79: GPU has fallen off the bus".into()),
    );
    inventory
}

fn rig() -> &'static Rig {
    static RIG: OnceLock<Rig> = OnceLock::new();
    RIG.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        let service = |naming: Naming| {
            // The sender may go: a receiver keeps the last value, and these requests only read it.
            let (_sender, inventory) = tokio::sync::watch::channel(Arc::new(inventory()));
            let options = AllocateOptions {
                naming,
                ..AllocateOptions::default()
            };
            PluginService::new(inventory, options, CancellationToken::new()).with_pre_start_check(true)
        };
        let replicated: BTreeSet<String> = (0..2)
            .map(|i| format!("GPU-fa4e0000-0000-4000-8000-{i:012x}"))
            .collect();
        Rig {
            plain: service(Naming::default()),
            shared: service(Naming {
                replicas: 3,
                replicated: Some(Arc::new(replicated)),
                fail_requests_greater_than_one: true,
                ..Naming::default()
            }),
            runtime,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, body)) = data.split_first() else {
        return;
    };
    let rig = rig();
    let service = if pick & 4 == 0 { &rig.plain } else { &rig.shared };
    rig.runtime.block_on(async {
        match pick % 4 {
            0 => {
                if let Ok(request) = AllocateRequest::decode(body) {
                    let _answer = service.allocate(tonic::Request::new(request)).await;
                }
            }
            1 => {
                if let Ok(request) = PreferredAllocationRequest::decode(body) {
                    let _answer = service
                        .get_preferred_allocation(tonic::Request::new(request))
                        .await;
                }
            }
            _ => {
                if let Ok(request) = PreStartContainerRequest::decode(body) {
                    let _answer = service
                        .pre_start_container(tonic::Request::new(request))
                        .await;
                }
            }
        }
    });
});
