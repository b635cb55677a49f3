//! The node condition `GPUUnhealthy`: `True` while any GPU is Unhealthy, with each one's message; kept
//! current with backoff, and left `Unknown` when the plugin stops for good.

use super::*;

/// What a stopping plugin did with the node condition.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Left {
    /// Set to `Unknown`.
    Unknown,
    /// Left alone: another instance wrote it after this one.
    Newer,
    /// This instance never wrote it.
    NothingWritten,
}

/// One node condition this instance sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Written {
    status: String,
    message: String,
    heartbeat: String,
}

/// Unanswered writes kept: enough for the retries of one stop's last seconds.
const MAX_UNANSWERED: usize = 8;

/// The node conditions this instance wrote, or may have: the last write the API server answered, and the
/// writes sent since without an answer (the API server may have applied any of them: the answer can be lost,
/// or the plugin stopped, after the write was taken in). At stop, the node still showing one of these means
/// no other instance has written since.
#[derive(Debug, Clone, Default)]
pub(super) struct Ours {
    answered: Option<Written>,
    unanswered: std::collections::VecDeque<Written>,
}

impl Ours {
    /// `written` is about to be sent.
    fn sending(&mut self, written: Written) {
        if self.unanswered.len() == MAX_UNANSWERED {
            self.unanswered.pop_front();
        }
        self.unanswered.push_back(written);
    }

    /// The API server answered `written`: older writes can no longer be what the node shows.
    fn answered(&mut self, written: Written) {
        self.unanswered.clear();
        self.answered = Some(written);
    }

    /// Ours among what was written, if `current` is one of them.
    fn find(&self, current: &Written) -> Option<&Written> {
        self.unanswered
            .iter()
            .rev()
            .chain(self.answered.as_ref())
            .find(|w| *w == current)
    }

    fn is_empty(&self) -> bool {
        self.answered.is_none() && self.unanswered.is_empty()
    }
}

impl Cluster {
    /// Writes the wanted node condition, retrying with backoff until it is written; a newer wanted state
    /// replaces one still being retried.
    pub(super) async fn keep_condition(
        self,
        mut wanted: watch::Receiver<WantedCondition>,
        metrics: Arc<Metrics>,
        ours: Arc<std::sync::Mutex<Ours>>,
    ) {
        // What the node says now: (status, lastTransitionTime) of our condition, once read.
        let mut on_node: Option<Option<(String, String)>> = None;
        let mut failing = false;
        loop {
            let target = wanted.borrow_and_update().clone();
            let mut delays = retry_delays().without_max_times().build();
            // Whether a newer state arrived while this one was being retried (then it is written at once).
            let mut newer = false;
            loop {
                let result = self.write_condition(&target, &mut on_node, &ours).await;
                metrics.api_call("node_condition", result.is_ok());
                match result {
                    Ok(wrote) => {
                        ours.lock()
                            .unwrap_or_else(|poisoned| poisoned.into_inner())
                            .answered(wrote);
                        if failing {
                            tracing::info!(node = %self.node, "node condition written again");
                        }
                        failing = false;
                        break;
                    }
                    Err(e) => {
                        if !failing {
                            tracing::warn!(node = %self.node, error = %explain(&e, "get on nodes and patch on nodes/status"), "cannot write the node condition; retrying with backoff");
                        } else {
                            tracing::debug!(error = %e, "node condition still not written");
                        }
                        failing = true;
                        let delay = delays.next().unwrap_or(MAX_RETRY);
                        tokio::select! {
                            () = tokio::time::sleep(delay) => {}
                            changed = wanted.changed() => {
                                if changed.is_err() { return; }
                                newer = true;
                                break;
                            }
                        }
                    }
                }
            }
            if !newer && !wanted.has_changed().unwrap_or(false) && wanted.changed().await.is_err() {
                return;
            }
        }
    }

    /// Reads the node's conditions (once) and patches ours. The requests are made by hand with a view of
    /// only the fields used: the typed Node would bring the code to decode every field of a Node into the
    /// binary, and its pages into every node's memory.
    async fn write_condition(
        &self,
        target: &WantedCondition,
        on_node: &mut Option<Option<(String, String)>>,
        ours: &std::sync::Mutex<Ours>,
    ) -> Result<Written, kube::Error> {
        let path = format!("/api/v1/nodes/{}", self.node);
        let known = match on_node {
            Some(known) => known.clone(),
            None => {
                let request = hyper::Request::get(&path)
                    .body(Vec::new())
                    .map_err(kube::Error::HttpError)?;
                let node: NodeView = self.client.request(request).await?;
                let found = node
                    .status
                    .conditions
                    .into_iter()
                    .find(|c| c.type_ == CONDITION_TYPE)
                    .map(|c| (c.status, c.last_transition_time.unwrap_or_default()));
                *on_node = Some(found.clone());
                found
            }
        };
        let now = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
        let status = target.status();
        let transition = match known {
            Some((was, at)) if was == status => at,
            _ => now.clone(),
        };
        let patch = serde_json::json!({
            "status": {
                "conditions": [{
                    "type": CONDITION_TYPE,
                    "status": status,
                    "reason": target.reason(),
                    "message": target.message,
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": transition,
                }]
            }
        });
        let request = hyper::Request::patch(format!("{path}/status"))
            .header("content-type", "application/strategic-merge-patch+json")
            .body(patch.to_string().into_bytes())
            .map_err(kube::Error::HttpError)?;
        let written = Written {
            status: status.to_string(),
            message: target.message.clone(),
            heartbeat: now,
        };
        ours.lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .sending(written.clone());
        self.client.request_text(request).await?;
        *on_node = Some(Some((status.to_string(), transition)));
        Ok(written)
    }

    /// At stop: the condition `Unknown` if it is still as this instance wrote it (or may have: a write whose
    /// answer had not come). The patch carries the Node's `resourceVersion` as read, so that a write by
    /// another instance between the read and the patch makes the API server refuse it (409) rather than be
    /// overwritten.
    pub(super) async fn leave_stopped(&self, ours: Ours) -> Result<Left, kube::Error> {
        if ours.is_empty() {
            return Ok(Left::NothingWritten);
        }
        let path = format!("/api/v1/nodes/{}", self.node);
        let request = hyper::Request::get(&path)
            .body(Vec::new())
            .map_err(kube::Error::HttpError)?;
        let node: NodeView = self.client.request(request).await?;
        let current = node
            .status
            .conditions
            .into_iter()
            .find(|c| c.type_ == CONDITION_TYPE)
            .map(|c| Written {
                status: c.status,
                message: c.message.unwrap_or_default(),
                heartbeat: c.last_heartbeat_time.unwrap_or_default(),
            });
        let Some(ours) = current.as_ref().and_then(|c| ours.find(c)) else {
            return Ok(Left::Newer);
        };
        let now = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
        let message = crate::util::text::cut_bytes(
            &format!(
                "gpu-device-plugin stopped on this node at {now}: GPU health is not watched by it; its last report ({}): {}",
                ours.status, ours.message
            ),
            CONDITION_MESSAGE_LIMIT,
        );
        let mut patch = serde_json::json!({
            "status": {
                "conditions": [{
                    "type": CONDITION_TYPE,
                    "status": "Unknown",
                    "reason": STOPPED_REASON,
                    "message": message,
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }]
            }
        });
        if let Some(version) = node.metadata.resource_version {
            patch["metadata"] = serde_json::json!({ "resourceVersion": version });
        }
        let request = hyper::Request::patch(format!("{path}/status"))
            .header("content-type", "application/strategic-merge-patch+json")
            .body(patch.to_string().into_bytes())
            .map_err(kube::Error::HttpError)?;
        match self.client.request_text(request).await {
            Ok(_) => Ok(Left::Unknown),
            // Written by another instance between the read and the patch: theirs stands.
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(Left::Newer),
            Err(e) => Err(e),
        }
    }
}

/// The part of a Node the condition needs.
#[derive(Debug, Default, Deserialize)]
struct NodeView {
    #[serde(default)]
    metadata: MetadataView,
    #[serde(default)]
    status: NodeStatusView,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct MetadataView {
    #[serde(default)]
    resource_version: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct NodeStatusView {
    #[serde(default)]
    conditions: Vec<ConditionView>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ConditionView {
    #[serde(rename = "type")]
    type_: String,
    status: String,
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    last_heartbeat_time: Option<String>,
    #[serde(default)]
    last_transition_time: Option<String>,
}

/// What the node condition should say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WantedCondition {
    /// Unhealthy GPUs, of all.
    pub unhealthy: usize,
    /// All GPUs.
    pub total: usize,
    /// The message.
    pub message: String,
}

impl WantedCondition {
    /// `True` while any GPU is Unhealthy.
    pub fn status(&self) -> &'static str {
        if self.unhealthy > 0 { "True" } else { "False" }
    }

    /// The condition's reason.
    pub fn reason(&self) -> &'static str {
        if self.unhealthy > 0 {
            UNHEALTHY_REASON
        } else {
            HEALTHY_REASON
        }
    }
}

/// The node condition for an inventory: every Unhealthy GPU with its message.
pub fn condition_of(inventory: &Inventory) -> WantedCondition {
    let unhealthy: Vec<String> = inventory
        .devices()
        .iter()
        .enumerate()
        .filter(|(_, d)| d.health == Health::Unhealthy)
        .map(|(position, d)| {
            let index = d.info.gpu_index().unwrap_or(position);
            device_line(&d.info.id, index, d.reason.as_deref())
        })
        .collect();
    let total = inventory.len();
    let message = if unhealthy.is_empty() {
        format!("all {total} GPUs Healthy")
    } else {
        format!(
            "{} of {total} GPUs Unhealthy. {}",
            unhealthy.len(),
            unhealthy.join(" | ")
        )
    };
    WantedCondition {
        unhealthy: unhealthy.len(),
        total,
        message: crate::util::text::cut_bytes(&message, CONDITION_MESSAGE_LIMIT),
    }
}

fn device_line(id: &str, index: usize, message: Option<&str>) -> String {
    format!(
        "device {id} (index {index}): {}",
        message.unwrap_or("Unhealthy")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::tests::inventory;

    #[test]
    fn the_condition_lists_every_unhealthy_gpu_and_is_false_when_none_is() {
        let mut inv = inventory(8);
        let healthy = condition_of(&inv);
        assert_eq!(
            (healthy.status(), healthy.reason()),
            ("False", HEALTHY_REASON)
        );
        assert_eq!(healthy.message, "all 8 GPUs Healthy");
        inv.set_health(
            "GPU-2",
            Health::Unhealthy,
            Some("Unhealthy: XID 79: off the bus.".into()),
        );
        inv.set_health(
            "GPU-5",
            Health::Unhealthy,
            Some("Unhealthy: ECC double-bit error.".into()),
        );
        let sick = condition_of(&inv);
        assert_eq!((sick.status(), sick.reason()), ("True", UNHEALTHY_REASON));
        assert_eq!(
            sick.message,
            "2 of 8 GPUs Unhealthy. device GPU-2 (index 2): Unhealthy: XID 79: off the bus. | \
             device GPU-5 (index 5): Unhealthy: ECC double-bit error."
        );
    }

    #[test]
    fn the_condition_message_is_bounded_on_a_node_of_long_messages() {
        let mut inv = inventory(64);
        for i in 0..64 {
            inv.set_health(
                &format!("GPU-{i}"),
                Health::Unhealthy,
                Some("é".repeat(1000)),
            );
        }
        let wanted = condition_of(&inv);
        assert!(wanted.message.len() <= CONDITION_MESSAGE_LIMIT);
        assert!(
            wanted.message.starts_with("64 of 64 GPUs Unhealthy.")
                && wanted.message.ends_with("...")
        );
    }
}
