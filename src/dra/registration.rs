//! Registration with the kubelet's plugin watcher: a socket in `plugins_registry` the kubelet finds, asks
//! what we are (`GetInfo`) and tells whether it took us (`NotifyRegistrationStatus`).

use std::path::PathBuf;

use tokio::sync::watch;
use tonic::{Request, Response, Status};

use crate::api::dra::registration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
    registration_server::Registration,
};

/// What the kubelet is asked to take, best first: it uses the first entry it knows, so v1 leads; the health
/// entries are not part of that choice (a 1.36 kubelet opens the health stream whatever is listed).
pub const SUPPORTED_VERSIONS: [&str; 4] = [
    "v1.DRAPlugin",
    "v1beta1.DRAPlugin",
    "v1.DRAResourceHealth",
    "v1alpha1.DRAResourceHealth",
];

/// The plugin type the kubelet's watcher routes to its DRA manager.
pub const PLUGIN_TYPE: &str = "DRAPlugin";

/// What the DRA side says of itself on the status surfaces: the kubelet's word on the registration, and the
/// claims prepared.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DraStatus {
    /// The driver name.
    pub driver: String,
    /// How many times the kubelet asked who we are.
    pub asked: u64,
    /// Whether the kubelet's last word was a registration accepted.
    pub registered: bool,
    /// The kubelet's reason, when it refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Each prepared device's claim (`namespace/name`), by device name.
    #[serde(default)]
    pub prepared: std::collections::BTreeMap<String, String>,
}

/// The registration service.
#[derive(Debug, Clone)]
pub struct RegistrationService {
    driver: String,
    endpoint: PathBuf,
    status: watch::Sender<DraStatus>,
}

impl RegistrationService {
    /// Answers as `driver`, serving the DRA API on `endpoint`; what the kubelet says goes to `status`.
    pub fn new(driver: String, endpoint: PathBuf, status: watch::Sender<DraStatus>) -> Self {
        RegistrationService {
            driver,
            endpoint,
            status,
        }
    }

    /// What the kubelet said, as it says it.
    pub fn status(&self) -> watch::Receiver<DraStatus> {
        self.status.subscribe()
    }
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(
        &self,
        _request: Request<InfoRequest>,
    ) -> Result<Response<PluginInfo>, Status> {
        self.status.send_modify(|s| s.asked += 1);
        Ok(Response::new(PluginInfo {
            r#type: PLUGIN_TYPE.to_string(),
            name: self.driver.clone(),
            endpoint: self.endpoint.to_string_lossy().into_owned(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|v| v.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        let error = (!status.error.is_empty()).then(|| {
            crate::util::text::printable(&crate::util::text::cut_bytes(&status.error, 1024))
        });
        if status.plugin_registered {
            tracing::info!(driver = %self.driver, "registered with the kubelet as a DRA driver");
        } else {
            tracing::warn!(
                driver = %self.driver,
                error = error.as_deref().unwrap_or("no reason given"),
                "the kubelet refused the DRA driver's registration; it will ask again"
            );
        }
        self.status.send_modify(|s| {
            s.registered = status.plugin_registered;
            s.error = error;
        });
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn get_info_names_the_driver_its_endpoint_and_v1_first() {
        let service = RegistrationService::new(
            "gpu.nvidia.com".into(),
            PathBuf::from("/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock"),
            watch::Sender::new(DraStatus::default()),
        );
        let info = service
            .get_info(Request::new(InfoRequest {}))
            .await
            .expect("answer")
            .into_inner();
        assert_eq!(info.r#type, "DRAPlugin");
        assert_eq!(info.name, "gpu.nvidia.com");
        assert_eq!(
            info.endpoint,
            "/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock"
        );
        assert_eq!(info.supported_versions[0], "v1.DRAPlugin");
        assert_eq!(service.status().borrow().asked, 1);
    }

    #[tokio::test]
    async fn a_refusal_is_kept_with_its_reason_made_printable() {
        let service = RegistrationService::new(
            "d".into(),
            PathBuf::from("/p/dra.sock"),
            watch::Sender::new(DraStatus::default()),
        );
        let refuse = RegistrationStatus {
            plugin_registered: false,
            error: "no supported version\nforged line".into(),
        };
        service
            .notify_registration_status(Request::new(refuse))
            .await
            .expect("answer");
        let status = service.status().borrow().clone();
        assert!(!status.registered);
        assert_eq!(
            status.error.as_deref(),
            Some("no supported version\\nforged line")
        );
    }
}
