//! The kubelet's APIs, generated from `proto/` at build time: the device plugin API v1beta1 (`proto/api.proto`),
//! the pod-resources API v1 and the DRA APIs ([`dra`]).
#![allow(missing_docs, clippy::all, clippy::pedantic)]

tonic::include_proto!("v1beta1");

/// The only API version the kubelet accepts in `RegisterRequest.version`.
pub const VERSION: &str = "v1beta1";

/// File name of the kubelet's registration socket inside the device plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";

/// The kubelet pod-resources API v1 (which pods and containers hold which devices), generated from
/// `proto/podresources.proto`.
pub mod pod_resources {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]

    tonic::include_proto!("v1");

    /// Where the kubelet serves it.
    pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
}

/// The kubelet's DRA APIs, generated from `proto/dra/`: plugin registration, the DRA plugin service (v1 and
/// v1beta1, each under the package path the kubelet calls) and the health stream (v1alpha1 and v1).
pub mod dra {
    /// Plugin registration (`pluginregistration.Registration`), served on the registry socket.
    pub mod registration {
        #![allow(missing_docs, clippy::all, clippy::pedantic)]
        include!(concat!(env!("OUT_DIR"), "/dra/pluginregistration.rs"));
    }

    /// `k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`.
    pub mod v1 {
        #![allow(missing_docs, clippy::all, clippy::pedantic)]
        include!(concat!(
            env!("OUT_DIR"),
            "/dra/k8s.io.kubelet.pkg.apis.dra.v1.rs"
        ));
    }

    /// `k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin`.
    pub mod v1beta1 {
        #![allow(missing_docs, clippy::all, clippy::pedantic)]
        include!(concat!(
            env!("OUT_DIR"),
            "/dra/k8s.io.kubelet.pkg.apis.dra.v1beta1.rs"
        ));
    }

    /// `v1alpha1.DRAResourceHealth`.
    pub mod health_v1alpha1 {
        #![allow(missing_docs, clippy::all, clippy::pedantic)]
        include!(concat!(env!("OUT_DIR"), "/dra/v1alpha1.rs"));
    }

    /// `v1.DRAResourceHealth`.
    pub mod health_v1 {
        #![allow(missing_docs, clippy::all, clippy::pedantic)]
        include!(concat!(env!("OUT_DIR"), "/dra/health-v1/v1.rs"));
    }
}

#[cfg(test)]
mod tests {
    use super::dra;

    /// The kubelet calls these exact gRPC services: the version string a DRA plugin advertises at
    /// registration (`v1.DRAPlugin`) is not the path, and a service under any other package is never reached.
    #[test]
    fn the_dra_services_are_served_under_the_paths_the_kubelet_calls() {
        assert_eq!(
            [
                dra::registration::registration_server::SERVICE_NAME,
                dra::v1::dra_plugin_server::SERVICE_NAME,
                dra::v1beta1::dra_plugin_server::SERVICE_NAME,
                dra::health_v1alpha1::dra_resource_health_server::SERVICE_NAME,
                dra::health_v1::dra_resource_health_server::SERVICE_NAME,
            ],
            [
                "pluginregistration.Registration",
                "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
                "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
                "v1alpha1.DRAResourceHealth",
                "v1.DRAResourceHealth",
            ]
        );
    }

    /// Field numbers as the kubelet encodes them: a v1 device's `share_id` is field 5, and v1beta1 has none.
    #[test]
    fn a_prepared_device_encodes_with_the_kubelets_field_numbers() {
        use prost::Message as _;
        let empty = dra::v1::Device::default;
        // Each field alone: its first byte is the tag, field << 3 | 2 (length-delimited).
        let alone = [
            (
                dra::v1::Device {
                    request_names: vec!["gpu".into()],
                    ..empty()
                },
                1,
            ),
            (
                dra::v1::Device {
                    pool_name: "node-a".into(),
                    ..empty()
                },
                2,
            ),
            (
                dra::v1::Device {
                    device_name: "gpu-0".into(),
                    ..empty()
                },
                3,
            ),
            (
                dra::v1::Device {
                    cdi_device_ids: vec!["nvidia.com/gpu=GPU-0".into()],
                    ..empty()
                },
                4,
            ),
            (
                dra::v1::Device {
                    share_id: Some("s".into()),
                    ..empty()
                },
                5,
            ),
        ];
        for (device, field) in alone {
            assert_eq!(device.encode_to_vec().first(), Some(&(field << 3 | 2)));
        }
        let shared = dra::v1::Device {
            device_name: "gpu-0".into(),
            share_id: Some("s".into()),
            ..empty()
        };
        let old = dra::v1beta1::Device::decode(shared.encode_to_vec().as_slice());
        assert_eq!(
            old.map(|d| d.device_name).ok().as_deref(),
            Some("gpu-0"),
            "v1beta1 skips the field it does not know"
        );
    }
}
