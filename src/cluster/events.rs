//! Kubernetes Events: a Warning on the Node and on each pod holding a device when it becomes Unhealthy, a
//! Normal one when it recovers, held to a budget ([`EventBudget`]).

use super::*;

/// How many Events may go out: `burst` at once, then one every `refill`. The default is 20, then one
/// every 3 s: at most 20 + 20 a minute, whatever the node throws.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventBudget {
    /// Events that may go out back to back.
    pub burst: u32,
    /// Time to earn one more.
    pub refill: Duration,
}

impl Default for EventBudget {
    fn default() -> Self {
        EventBudget {
            burst: 20,
            refill: Duration::from_secs(3),
        }
    }
}

impl Cluster {
    /// Sends queued Events within the budget, each retried a few times with backoff.
    pub(super) async fn send_events(
        self,
        mut queue: mpsc::Receiver<Note>,
        budget: EventBudget,
        metrics: Arc<Metrics>,
    ) {
        let recorder = Recorder::new(
            self.client.clone(),
            Reporter {
                controller: CONTROLLER.into(),
                // `kubectl describe` shows "From: <controller>, <instance>", as "kubelet, <node>" for the
                // kubelet's own Events.
                instance: Some(self.node.clone()),
            },
        );
        let mut bucket = TokenBucket::new(budget, Instant::now());
        let mut dropped_since_warned = 0u64;
        let mut warned_at: Option<Instant> = None;
        while let Some(note) = queue.recv().await {
            if !bucket.take(Instant::now()) {
                metrics.event_dropped();
                dropped_since_warned += 1;
                if warned_at.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) {
                    tracing::warn!(dropped = dropped_since_warned, burst = budget.burst, every = %humantime::format_duration(budget.refill), "Kubernetes Events over budget dropped (the log and metrics still have every transition)");
                    warned_at = Some(Instant::now());
                    dropped_since_warned = 0;
                }
                continue;
            }
            let reference = self.reference(&note.target).await;
            let event = Event {
                type_: note.type_,
                reason: note.reason.into(),
                note: Some(crate::util::text::cut_bytes(&note.text, NOTE_LIMIT)),
                action: action(note.reason, &note.text),
                secondary: None,
            };
            let published = (|| recorder.publish(&event, &reference))
                .retry(retry_delays().with_max_times(EVENT_RETRIES))
                .sleep(tokio::time::sleep)
                .notify(|e, _| tracing::debug!(error = %e, "Event not recorded; retrying"))
                .await;
            metrics.api_call("event", published.is_ok());
            if let Err(e) = published {
                tracing::warn!(error = %explain(&e, "create and patch on events.k8s.io events"), reason = note.reason, "cannot record a Kubernetes Event; given up");
            }
        }
    }

    /// The object an Event is about. A pod's UID is looked up, since `kubectl describe pod` shows only
    /// Events that carry it; a Node's Events carry the node name as UID, as the kubelet's do.
    async fn reference(&self, target: &Target) -> ObjectReference {
        match target {
            Target::Node => ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(self.node.clone()),
                uid: Some(self.node.clone()),
                ..Default::default()
            },
            Target::Pod { namespace, name } => {
                // Only the metadata: decoding a whole Pod takes a lot of code for one field.
                let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
                let uid = match pods.get_metadata(name).await {
                    Ok(pod) => pod.metadata.uid,
                    Err(e) => {
                        tracing::debug!(error = %explain(&e, "get on pods"), pod = %name, "pod UID unknown; its Event will show in `kubectl get events`, not in `kubectl describe pod`");
                        None
                    }
                };
                ObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    namespace: Some(namespace.clone()),
                    name: Some(name.clone()),
                    uid,
                    ..Default::default()
                }
            }
        }
    }
}

/// One device's change of health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    /// Device ID.
    pub id: String,
    /// NVML's index of its GPU (the list position where the source has none), as `nvidia-smi` shows it.
    pub index: usize,
    /// The health it changed to.
    pub to: Health,
    /// Its message now (Unhealthy), or the one it had (recovered).
    pub message: Option<String>,
}

/// The devices whose health differs between two inventories (a device new in `after` counts as having been
/// Healthy).
pub fn transitions(before: &Inventory, after: &Inventory) -> Vec<Transition> {
    after
        .devices()
        .iter()
        .enumerate()
        .filter_map(|(position, d)| {
            let was = before.get(&d.info.id);
            let was_health = was.map_or(Health::Healthy, |w| w.health);
            (was_health != d.health).then(|| Transition {
                id: d.info.id.clone(),
                index: d.info.gpu_index().unwrap_or(position),
                to: d.health,
                message: match d.health {
                    Health::Unhealthy => d.reason.clone(),
                    Health::Healthy => was.and_then(|w| w.reason.clone()),
                },
            })
        })
        .collect()
}

/// Who an Event is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The node.
    Node,
    /// A pod.
    Pod {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
}

/// An Event to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    /// Who it is about.
    pub target: Target,
    /// Warning or Normal.
    pub type_: EventType,
    /// `GPUUnhealthy` or `GPURecovered`.
    pub reason: &'static str,
    /// The message.
    pub text: String,
}

/// A pod using a device through a DRA ResourceClaim (one the claim is reserved for).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimUser {
    /// The pod's namespace (the claim's).
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The claim's name.
    pub claim: String,
}

/// The Events for one transition: one on the node, one on each pod holding the device, through the device
/// plugin (`holders`) or a DRA claim (`claims`); a pod with several containers or claims on it gets one,
/// naming them.
pub fn notes_for(change: &Transition, holders: &[Holder], claims: &[ClaimUser]) -> Vec<Note> {
    let (type_, reason) = match change.to {
        Health::Unhealthy => (EventType::Warning, UNHEALTHY_REASON),
        Health::Healthy => (EventType::Normal, RECOVERED_REASON),
    };
    let text = |held_by: Option<&str>| {
        let held = held_by
            .map(|c| format!(", used by {c}"))
            .unwrap_or_default();
        match change.to {
            Health::Unhealthy => format!(
                "device {} (index {}){held}: {}",
                change.id,
                change.index,
                change.message.as_deref().unwrap_or("Unhealthy")
            ),
            Health::Healthy => format!(
                "device {} (index {}){held}: Healthy again, back in service{}",
                change.id,
                change.index,
                change
                    .message
                    .as_deref()
                    .map(|m| format!(" (was {m})"))
                    .unwrap_or_default()
            ),
        }
    };
    let mut notes = vec![Note {
        target: Target::Node,
        type_,
        reason,
        text: text(None),
    }];
    /// What in one pod uses the device.
    #[derive(Default)]
    struct Uses<'a> {
        containers: Vec<&'a str>,
        claims: Vec<&'a str>,
    }
    let mut by_pod: BTreeMap<(&str, &str), Uses> = BTreeMap::new();
    for h in holders {
        by_pod
            .entry((&h.namespace, &h.pod))
            .or_default()
            .containers
            .push(&h.container);
    }
    for c in claims {
        let claims = &mut by_pod.entry((&c.namespace, &c.pod)).or_default().claims;
        if !claims.contains(&c.claim.as_str()) {
            claims.push(&c.claim);
        }
    }
    let named = |what: &str, names: &[&str]| match names {
        [] => None,
        [one] => Some(format!("{what} {one}")),
        many => Some(format!("{what}s {}", many.join(", "))),
    };
    for ((namespace, name), uses) in by_pod {
        let containers = [
            named("container", &uses.containers),
            named("claim", &uses.claims),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(" and ");
        notes.push(Note {
            target: Target::Pod {
                namespace: namespace.into(),
                name: name.into(),
            },
            type_,
            reason,
            text: text(Some(&containers)),
        });
    }
    notes
}

/// The recorder folds repeats of an Event into one with a count, keyed on (object, type, reason, action);
/// the note is not part of its key. The action carries a digest of the note, so that only an Event with the
/// same text is folded in: two GPUs failing on one node are two Events, each with its own message.
fn action(reason: &str, text: &str) -> String {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut hasher);
    let verb = if reason == UNHEALTHY_REASON {
        "TakeOutOfService"
    } else {
        "ReturnToService"
    };
    format!("{verb}-{:08x}", hasher.finish() as u32)
}

/// A token bucket on an injected clock.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    budget: EventBudget,
    tokens: u32,
    since: Instant,
}

impl TokenBucket {
    /// A full bucket at `now`.
    pub fn new(budget: EventBudget, now: Instant) -> Self {
        TokenBucket {
            budget,
            tokens: budget.burst,
            since: now,
        }
    }

    /// Takes one token if there is one at `now`.
    pub fn take(&mut self, now: Instant) -> bool {
        if !self.budget.refill.is_zero() {
            let earned = now.saturating_duration_since(self.since).as_nanos()
                / self.budget.refill.as_nanos();
            let earned = u32::try_from(earned).unwrap_or(u32::MAX);
            if self.tokens.saturating_add(earned) >= self.budget.burst {
                self.tokens = self.budget.burst;
                self.since = now;
            } else if earned > 0 {
                self.tokens += earned;
                self.since += self.budget.refill * earned;
            }
        }
        if self.tokens == 0 {
            return false;
        }
        self.tokens -= 1;
        true
    }

    /// How long after `now` a token is there to take: zero if one is now.
    pub fn ready_in(&self, now: Instant) -> Duration {
        if self.tokens > 0 {
            Duration::ZERO
        } else if self.budget.refill.is_zero() {
            Duration::MAX
        } else {
            (self.since + self.budget.refill).saturating_duration_since(now)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::tests::inventory;

    #[test]
    fn a_fault_and_a_recovery_are_transitions_a_new_message_alone_is_not() {
        let before = inventory(3);
        let mut after = before.clone();
        after.set_health(
            "GPU-1",
            Health::Unhealthy,
            Some("Unhealthy: XID 79: GPU has fallen off the bus.".into()),
        );
        let changes = transitions(&before, &after);
        assert_eq!(
            changes,
            [Transition {
                id: "GPU-1".into(),
                index: 1,
                to: Health::Unhealthy,
                message: Some("Unhealthy: XID 79: GPU has fallen off the bus.".into()),
            }]
        );
        let mut again = after.clone();
        again.set_health(
            "GPU-1",
            Health::Unhealthy,
            Some("Unhealthy: XID 48.".into()),
        );
        assert!(transitions(&after, &again).is_empty());
        let mut recovered = again.clone();
        recovered.set_health("GPU-1", Health::Healthy, None);
        let back = transitions(&again, &recovered);
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].to, Health::Healthy);
        assert_eq!(back[0].message.as_deref(), Some("Unhealthy: XID 48."));
    }

    #[test]
    fn each_pod_holding_the_device_gets_one_event_naming_its_containers() {
        let change = Transition {
            id: "GPU-3".into(),
            index: 3,
            to: Health::Unhealthy,
            message: Some("Unhealthy: XID 79: GPU has fallen off the bus.".into()),
        };
        let holder = |ns: &str, pod: &str, c: &str| Holder {
            namespace: ns.into(),
            pod: pod.into(),
            container: c.into(),
        };
        let notes = notes_for(
            &change,
            &[
                holder("ml", "train-0", "trainer"),
                holder("ml", "train-0", "profiler"),
                holder("web", "infer", "server"),
            ],
            &[],
        );
        let texts: Vec<(&Target, &str)> =
            notes.iter().map(|n| (&n.target, n.text.as_str())).collect();
        assert_eq!(
            texts,
            [
                (
                    &Target::Node,
                    "device GPU-3 (index 3): Unhealthy: XID 79: GPU has fallen off the bus."
                ),
                (
                    &Target::Pod {
                        namespace: "ml".into(),
                        name: "train-0".into()
                    },
                    "device GPU-3 (index 3), used by containers trainer, profiler: Unhealthy: XID 79: GPU has fallen off the bus."
                ),
                (
                    &Target::Pod {
                        namespace: "web".into(),
                        name: "infer".into()
                    },
                    "device GPU-3 (index 3), used by container server: Unhealthy: XID 79: GPU has fallen off the bus."
                ),
            ]
        );
        assert!(
            notes
                .iter()
                .all(|n| n.type_ == EventType::Warning && n.reason == UNHEALTHY_REASON)
        );
        let back = notes_for(
            &Transition {
                to: Health::Healthy,
                ..change
            },
            &[],
            &[],
        );
        assert_eq!(back.len(), 1);
        assert_eq!(
            (back[0].type_, back[0].reason),
            (EventType::Normal, RECOVERED_REASON)
        );
        assert_eq!(
            back[0].text,
            "device GPU-3 (index 3): Healthy again, back in service (was Unhealthy: XID 79: GPU has fallen off the bus.)"
        );
    }

    #[test]
    fn each_pod_using_the_device_through_a_claim_gets_one_event_naming_its_claims() {
        let change = Transition {
            id: "GPU-1".into(),
            index: 1,
            to: Health::Unhealthy,
            message: Some("Unhealthy: XID 79: GPU has fallen off the bus.".into()),
        };
        let user = |pod: &str, claim: &str| ClaimUser {
            namespace: "ml".into(),
            pod: pod.into(),
            claim: claim.into(),
        };
        // A claim shared by two pods, one of which also holds the GPU through the device plugin (a split
        // node never does this, but the text must still say both).
        let notes = notes_for(
            &change,
            &[Holder {
                namespace: "ml".into(),
                pod: "train-0".into(),
                container: "trainer".into(),
            }],
            &[
                user("train-0", "shared-gpu"),
                user("train-1", "shared-gpu"),
                user("train-1", "shared-gpu"),
                user("train-1", "spare-gpu"),
            ],
        );
        let texts: Vec<&str> = notes.iter().skip(1).map(|n| n.text.as_str()).collect();
        assert_eq!(
            texts,
            [
                "device GPU-1 (index 1), used by container trainer and claim shared-gpu: Unhealthy: XID 79: GPU has fallen off the bus.",
                "device GPU-1 (index 1), used by claims shared-gpu, spare-gpu: Unhealthy: XID 79: GPU has fallen off the bus.",
            ]
        );
        assert_eq!(
            notes[2].target,
            Target::Pod {
                namespace: "ml".into(),
                name: "train-1".into()
            }
        );
    }

    #[test]
    fn events_with_different_text_are_never_folded_together() {
        assert_ne!(
            action(UNHEALTHY_REASON, "device a: x"),
            action(UNHEALTHY_REASON, "device b: x")
        );
        assert_eq!(
            action(UNHEALTHY_REASON, "device a: x"),
            action(UNHEALTHY_REASON, "device a: x")
        );
        assert!(action(UNHEALTHY_REASON, &"x".repeat(5000)).len() <= 128);
    }

    #[test]
    fn the_bucket_allows_a_burst_then_one_per_refill() {
        let budget = EventBudget {
            burst: 3,
            refill: Duration::from_secs(3),
        };
        let start = Instant::now();
        let mut bucket = TokenBucket::new(budget, start);
        let allowed = (0..10).filter(|_| bucket.take(start)).count();
        assert_eq!(allowed, 3);
        assert!(!bucket.take(start + Duration::from_millis(2999)));
        assert!(bucket.take(start + Duration::from_secs(3)));
        assert!(!bucket.take(start + Duration::from_secs(3)));
        // A minute of quiet fills it to the burst, no more.
        let later = start + Duration::from_secs(63);
        assert_eq!((0..10).filter(|_| bucket.take(later)).count(), 3);
    }

    #[test]
    fn the_bucket_says_when_the_next_token_comes() {
        let budget = EventBudget {
            burst: 2,
            refill: Duration::from_millis(50),
        };
        let start = Instant::now();
        let mut bucket = TokenBucket::new(budget, start);
        assert_eq!(bucket.ready_in(start), Duration::ZERO);
        assert!(bucket.take(start) && bucket.take(start));
        assert_eq!(bucket.ready_in(start), Duration::from_millis(50));
        assert_eq!(
            bucket.ready_in(start + Duration::from_millis(30)),
            Duration::from_millis(20)
        );
        assert_eq!(
            bucket.ready_in(start + Duration::from_millis(60)),
            Duration::ZERO
        );
        assert!(bucket.take(start + Duration::from_millis(60)));
        // The next one is earned 50 ms after the last, not after the take.
        assert_eq!(
            bucket.ready_in(start + Duration::from_millis(60)),
            Duration::from_millis(40)
        );
    }

    #[test]
    fn notes_are_cut_at_a_character_boundary() {
        let cut = crate::util::text::cut_bytes(&"é".repeat(1000), NOTE_LIMIT);
        assert!(cut.len() <= NOTE_LIMIT && cut.ends_with("..."));
    }
}
