//! `DRAPlugin` (v1 and v1beta1): preparing a claim's devices for its pod, and unpreparing them.
//!
//! Preparing reads the claim from the API server, takes the devices allocated to it from this driver's pool,
//! and answers with their CDI device IDs (`<cdi kind>=<UUID>`, names the node's CDI spec already holds; the
//! first of them is the `resourceID` the pod status shows, so it is the GPU's UUID). Every answer is
//! recorded before the kubelet hears it; a repeated prepare answers from the record; a device held by
//! another claim is refused, as is a device that is Unhealthy now. Prepare and unprepare are serialized.
//! Unpreparing a claim the plugin never prepared succeeds: the kubelet asks for claims of pods that never
//! started and for claims it already unprepared.
//!
//! The record is a cache of what the API server says: before the first claim is prepared, and again
//! whenever the record cannot be read (damaged, replaced by something else, or of a newer format that a
//! newer instance of the plugin wrote), the ResourceClaims allocated devices of this node's pool for pods
//! are read from the API server, and their devices are refused to any other claim. A record that cannot be
//! read never empties what this instance holds, and one of a newer format is never written over.

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::StreamExt as _;
use tokio::sync::Mutex;
use tonic::{Request, Response, Status};

use crate::api::dra::{v1, v1beta1};
use crate::devices::{Health, InventoryWatch};

use super::claims::{Claim, ClaimReader};
use super::device_config::{ClaimConfig, DeviceType};
use super::listing::{Done, Listing};
use super::names;
use super::record::{Look, PreparedClaim, PreparedDevice, Record, RecordFile, RecordLock};
use crate::util::files::FileId;

/// Claims read from the API server at once, at most, by all calls together: a flood of prepares of claims
/// that do not exist is not a flood of requests to the API server, and the answers held at once are at most
/// this many claims of [`super::claims::MAX_CLAIM_BYTES`].
const MAX_READS: usize = 4;
/// The least time between two lists of the claims for a listed claim that blocks another.
const RELIST_AFTER: std::time::Duration = std::time::Duration::from_secs(1);
/// How long a prepare call waits at most for the list of the claims when the kubelet's call carries no
/// deadline (the kubelet gives a call 45 s): the answer, a refusal saying why, comes well before it.
pub const DEFAULT_ANSWER_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);
/// Prepare calls served at once, at most; others wait their turn (the kubelet makes one call per pod, and
/// gives each 45 s): what a flood of calls holds (their claims, their answers) is this many calls' worth.
pub const MAX_PREPARES: usize = 4;
/// Refusals said in the log: 20 back to back, then one a second, with a count of those left out (every one
/// is in the answer to the kubelet and in `/metrics`).
const REFUSALS_SAID: crate::cluster::EventBudget = crate::cluster::EventBudget {
    burst: 20,
    refill: std::time::Duration::from_secs(1),
};

/// A claim as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRef {
    /// Namespace.
    pub namespace: String,
    /// UID.
    pub uid: String,
    /// Name.
    pub name: String,
}

impl ClaimRef {
    fn describe(&self) -> String {
        format!("ResourceClaim {}/{}", self.namespace, self.name)
    }

    /// Why no API server could hold this claim (its namespace, name or UID breaks the API server's rules),
    /// if so: said with the sizes, never the text, whatever its size.
    fn invalid(&self) -> Option<String> {
        use crate::util::text::{is_dns_label, is_dns_subdomain};
        if !is_dns_label(&self.namespace) {
            return Some(format!(
                "its namespace ({} bytes) is not a DNS label of at most 63 lower-case letters, digits and '-'",
                self.namespace.len()
            ));
        }
        if !is_dns_subdomain(&self.name) {
            return Some(format!(
                "its name ({} bytes) is not a DNS subdomain of at most 253 bytes",
                self.name.len()
            ));
        }
        let uid_ok = !self.uid.is_empty()
            && self.uid.len() <= MAX_UID
            && self.uid.bytes().all(|b| b.is_ascii_graphic());
        (!uid_ok).then(|| {
            format!(
                "its UID ({} bytes) is not 1-{MAX_UID} printable ASCII characters",
                self.uid.len()
            )
        })
    }
}

/// The longest claim UID taken: the API server's are 36-character UUIDs.
const MAX_UID: usize = 128;
/// Claims in one call, at most: the kubelet sends the claims of one pod, and a pod names at most 32.
pub const MAX_CLAIMS_PER_CALL: usize = 128;

/// The claims of one call from the kubelet, or the refusal of a call no kubelet makes: more claims than a
/// pod can name, or a claim no API server could hold. Nothing of it is read from the API server, logged
/// or echoed: an answer carries every claim's UID back, so a call like that is refused whole.
pub fn checked(claims: Vec<ClaimRef>) -> Result<Vec<ClaimRef>, Status> {
    if claims.len() > MAX_CLAIMS_PER_CALL {
        return Err(Status::invalid_argument(format!(
            "{} claims in one call: the kubelet sends one pod's, at most {MAX_CLAIMS_PER_CALL}",
            claims.len()
        )));
    }
    for (n, claim) in claims.iter().enumerate() {
        if let Some(why) = claim.invalid() {
            return Err(Status::invalid_argument(format!(
                "claim {} of {} is not a ResourceClaim the API server could hold: {why}",
                n + 1,
                claims.len()
            )));
        }
    }
    Ok(claims)
}

/// What preparing serves.
#[derive(Debug, Clone)]
pub struct PrepareConfig {
    /// The driver name devices are allocated under.
    pub driver: String,
    /// This node's pool.
    pub pool: String,
    /// The CDI kind device IDs are qualified with (`nvidia.com/gpu`).
    pub cdi_kind: String,
}

/// What this instance holds: the record as it stands, and the claims the API server says hold devices of
/// the pool.
#[derive(Debug, Default)]
struct Holdings {
    record: Record,
    /// Claims allocated devices of this pool and reserved for pods, by UID, as the API server last listed
    /// them: their devices are refused to other claims, even when the record does not hold them (it could
    /// not be read, or an instance that is gone prepared them). A claim the kubelet prepares or unprepares
    /// here leaves it; one that blocks another claim is looked up again before the refusal.
    listed: std::collections::BTreeMap<String, PreparedClaim>,
    /// The list of the claims needed before a claim not in the record is prepared, by the least generation
    /// that serves ([`Listing`]): at the start, and each time the record is found unreadable, written by a
    /// newer instance, or lacking claims held here (then a list begun after that).
    due: Option<u64>,
    /// The generation of the list `listed` is from.
    listed_generation: u64,
    /// When the claims were last listed: a listed claim that blocks another is listed again at most every
    /// [`RELIST_AFTER`] (the kubelet retries the blocked claim; each retry is not a list of every claim in
    /// the cluster).
    listed_at: Option<tokio::time::Instant>,
    /// The record's file is of a newer format (this version): it is left as it is, never written over.
    newer: Option<u32>,
    /// The record's file was set aside, or lacks claims held here: written again from what is held at the
    /// next call.
    rewrite: bool,
    /// Claims this instance holds that the record's file was found without (another instance unprepared
    /// them, or the file was replaced): held until the API server settles it, kept if it lists them as
    /// allocated in the pool and reserved for a pod, let go if not.
    disputed: std::collections::BTreeSet<String>,
}

impl Holdings {
    /// The claim other than `uid` that holds `device` of `pool`: in the record, or listed.
    fn holder(&self, pool: &str, device: &str, uid: &str) -> Option<(String, &PreparedClaim)> {
        if let Some((holder, claim)) = self.record.holder(pool, device, uid) {
            return Some((holder.to_string(), claim));
        }
        self.listed
            .iter()
            .find(|(other, claim)| {
                *other != uid
                    && !self.record.claims.contains_key(*other)
                    && claim
                        .devices
                        .iter()
                        .any(|d| d.pool == pool && d.device == device)
            })
            .map(|(uid, claim)| (uid.clone(), claim))
    }

    /// Whether a device `claim` is allocated is held by a listed claim alone (one the record does not hold),
    /// which may have let its device go since it was listed.
    fn blocked_by_listed(&self, claim: &ClaimRef, object: &Claim, pool: &str) -> bool {
        object.allocated.iter().flatten().any(|result| {
            self.record
                .holder(pool, &result.device, &claim.uid)
                .is_none()
                && self.holder(pool, &result.device, &claim.uid).is_some()
        })
    }
}

/// The service behind both versions.
#[derive(Clone)]
pub struct Preparer {
    config: Arc<PrepareConfig>,
    devices: InventoryWatch,
    claims: Arc<dyn ClaimReader>,
    record: Arc<Mutex<Holdings>>,
    file: Arc<RecordFile>,
    /// The record file as this instance last read or wrote it: another instance (a rolling update's other
    /// pod) may have written it since.
    seen: Arc<std::sync::Mutex<Option<FileId>>>,
    /// The one list of the claims holding the pool's devices, shared by the calls that need it.
    listing: Listing,
    /// Permits for reading claims from the API server ([`MAX_READS`]).
    reads: Arc<tokio::sync::Semaphore>,
    /// Permits for prepare calls ([`MAX_PREPARES`]).
    prepares: Arc<tokio::sync::Semaphore>,
    /// Refusals said in the log, and how many were left out since the last one said.
    said: Arc<std::sync::Mutex<(crate::cluster::TokenBucket, u64)>>,
    status: Option<tokio::sync::watch::Sender<super::registration::DraStatus>>,
    metrics: Arc<crate::metrics::Metrics>,
}

impl Preparer {
    /// Prepares from `devices`, reading claims from `claims`, recording in `file` (starting from `record`,
    /// which the file is read again over before the first call, and the claims the API server lists as
    /// allocated in the pool).
    pub fn new(
        config: PrepareConfig,
        devices: InventoryWatch,
        claims: Arc<dyn ClaimReader>,
        record: Record,
        file: RecordFile,
    ) -> Self {
        let listing = Listing::new(claims.clone(), config.driver.clone(), config.pool.clone());
        Preparer {
            config: Arc::new(config),
            devices,
            claims,
            listing,
            record: Arc::new(Mutex::new(Holdings {
                record,
                listed: Default::default(),
                due: Some(1),
                listed_generation: 0,
                listed_at: None,
                newer: None,
                rewrite: false,
                disputed: Default::default(),
            })),
            // Looked at again before the first call: what is there may be of a newer format.
            seen: Arc::new(std::sync::Mutex::new(None)),
            reads: Arc::new(tokio::sync::Semaphore::new(MAX_READS)),
            prepares: Arc::new(tokio::sync::Semaphore::new(MAX_PREPARES)),
            said: Arc::new(std::sync::Mutex::new((
                crate::cluster::TokenBucket::new(REFUSALS_SAID, tokio::time::Instant::now()),
                0,
            ))),
            file: Arc::new(file),
            status: None,
            metrics: crate::metrics::Metrics::off(),
        }
    }

    /// Counts each claim prepared and unprepared, and each refused, in `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// Says which claim holds each device in `status`, now and after every change.
    pub fn with_status(
        mut self,
        status: tokio::sync::watch::Sender<super::registration::DraStatus>,
    ) -> Self {
        if let Ok(held) = self.record.try_lock() {
            show(&status, &held);
        }
        self.status = Some(status);
        self
    }

    /// Prepares every claim: by UID, its devices or why it cannot be prepared, answered within
    /// [`DEFAULT_ANSWER_WITHIN`].
    pub async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> HashMap<String, Result<Vec<PreparedDevice>, String>> {
        self.prepare_by(claims, tokio::time::Instant::now() + DEFAULT_ANSWER_WITHIN)
            .await
    }

    /// Prepares every claim, answering by `until` at the latest where it waits on the list of the claims
    /// (the kubelet's deadline, less a margin).
    pub async fn prepare_by(
        &self,
        claims: Vec<ClaimRef>,
        until: tokio::time::Instant,
    ) -> HashMap<String, Result<Vec<PreparedDevice>, String>> {
        // Never closed: the permit always comes, in turn.
        let _turn = self.prepares.acquire().await;
        let read = self.read_claims(&claims).await;
        // What the API server says is prepared on the node, before a claim the record does not hold is: at
        // the start, after the record could not be read or lacked claims held here, and when a listed claim
        // alone holds a device asked for (it may have let it go since). The list is waited for without the
        // record or its lock: it may take longer than the kubelet waits, and goes on without this call.
        let needed = match self.list_needed(&claims, &read).await {
            Ok(needed) => needed,
            Err(why) => return unrecorded(claims, &why, "prepared"),
        };
        let listed = match needed {
            Some(at_least) => Some(self.listing.wait(at_least, until, &self.metrics).await),
            None => None,
        };
        let mut held = self.record.lock().await;
        let _file = match self.hold_file(&mut held).await {
            Ok(lock) => lock,
            Err(why) => return unrecorded(claims, &why, "prepared"),
        };
        let mut unlisted = match listed {
            Some(Ok(Done {
                result: Err(why), ..
            })) => Some(why),
            Some(Ok(done)) if held.due.is_none_or(|due| done.generation >= due) => {
                self.apply(&mut held, &done);
                None
            }
            Some(Ok(_)) => Some(
                "the record changed while the claims were listed; a newer list is needed"
                    .to_string(),
            ),
            Some(Err(why)) => Some(why),
            None => None,
        };
        if unlisted.is_none() && held.due.is_some() && claims.iter().any(|c| fresh(&held, c)) {
            unlisted = Some("the record changed since this call looked at it".to_string());
        }
        let before = held.record.clone();
        let mut answers = HashMap::new();
        for (claim, read) in claims.into_iter().zip(read) {
            let answer = self.answer(&mut held, &claim, read, unlisted.as_deref());
            answers.insert(claim.uid, answer);
        }
        for (uid, answer) in &answers {
            let code = match answer {
                Ok(_) => tonic::Code::Ok,
                Err(why) => {
                    self.say_refusal(uid, why);
                    tonic::Code::FailedPrecondition
                }
            };
            self.metrics.call("PrepareClaim", code);
        }
        if held.record != before || held.rewrite {
            if let Err(e) = self.save(&mut held).await {
                // Nothing is handed out that the record does not hold: a restart must not forget a device's
                // holder.
                held.record = before;
                let why = format!("cannot record the prepared claims: {e}; the kubelet asks again");
                for answer in answers.values_mut() {
                    if answer.is_ok() {
                        *answer = Err(why.clone());
                    }
                }
            }
        }
        answers
    }

    /// Each claim the record does not hold, read from the API server before the lock, together (a slow API
    /// server delays this call, not every other), a few at a time (a pod with many claims must not become a
    /// burst of requests). `Ok(None)` for a claim the record holds.
    async fn read_claims(&self, claims: &[ClaimRef]) -> Vec<Result<Option<Option<Claim>>, String>> {
        let known: Vec<bool> = {
            let held = self.record.lock().await;
            claims
                .iter()
                .map(|c| held.record.claims.contains_key(&c.uid))
                .collect()
        };
        let reads: Vec<_> = claims
            .iter()
            .zip(known)
            .map(|(c, known)| {
                let (reader, namespace, name) =
                    (self.claims.clone(), c.namespace.clone(), c.name.clone());
                let permits = self.reads.clone();
                async move {
                    if known {
                        return Ok(None);
                    }
                    let _permit = permits.acquire_owned().await.map_err(|e| e.to_string())?;
                    reader.get(&namespace, &name).await.map(Some)
                }
            })
            .collect();
        futures_util::stream::iter(reads)
            .buffered(MAX_READS)
            .collect()
            .await
    }

    /// Whether the claims the API server lists must be known before these claims are answered: the list's
    /// generation to wait for, or `None`. `Err` when the record cannot be held.
    async fn list_needed(
        &self,
        claims: &[ClaimRef],
        read: &[Result<Option<Option<Claim>>, String>],
    ) -> Result<Option<u64>, String> {
        let mut held = self.record.lock().await;
        let _file = self.hold_file(&mut held).await?;
        let stale = held.listed_at.is_none_or(|at| at.elapsed() >= RELIST_AFTER);
        let suspect = stale
            && claims.iter().zip(read).any(|(c, read)| match read {
                Ok(Some(Some(object))) => {
                    fresh(&held, c) && held.blocked_by_listed(c, object, &self.config.pool)
                }
                _ => false,
            });
        let at_least = match held.due {
            Some(due) => Some(due),
            None if suspect => Some(held.listed_generation + 1),
            None => None,
        };
        Ok(at_least.filter(|_| claims.iter().any(|c| fresh(&held, c))))
    }

    /// One claim's answer: the devices the record holds for it, else those its allocation names here, else
    /// why not; a claim answered with devices is recorded in `held`.
    fn answer(
        &self,
        held: &mut Holdings,
        claim: &ClaimRef,
        read: Result<Option<Option<Claim>>, String>,
        unlisted: Option<&str>,
    ) -> Result<Vec<PreparedDevice>, String> {
        let answer = match held.record.claims.get(&claim.uid) {
            Some(prepared) => Ok(prepared.devices.clone()),
            None if unlisted.is_some() => Err(format!(
                "cannot learn from the API server which devices are prepared on this node, so {} is \
                 not prepared: {}; the kubelet asks again",
                claim.describe(),
                unlisted.unwrap_or_default()
            )),
            None => match read {
                Ok(Some(Some(object))) => self.devices_of(claim, &object, held),
                Ok(Some(None)) => Err(format!(
                    "{} is not in the API server (deleted?); the pod needs a claim that exists",
                    claim.describe()
                )),
                Ok(None) => Err(format!(
                    "{} was unprepared while this prepare read it; the kubelet asks again",
                    claim.describe()
                )),
                Err(e) => Err(format!(
                    "cannot read {} from the API server: {e}; the kubelet asks again",
                    claim.describe()
                )),
            },
        };
        if let Ok(devices) = &answer {
            held.listed.remove(&claim.uid);
            held.record.claims.insert(
                claim.uid.clone(),
                PreparedClaim {
                    namespace: claim.namespace.clone(),
                    name: claim.name.clone(),
                    devices: devices.clone(),
                },
            );
        }
        answer
    }

    /// Unprepares every claim: by UID, success or why not.
    pub async fn unprepare(&self, claims: Vec<ClaimRef>) -> HashMap<String, Result<(), String>> {
        let mut held = self.record.lock().await;
        let _file = match self.hold_file(&mut held).await {
            Ok(lock) => lock,
            Err(why) => return unrecorded(claims, &why, "unprepared"),
        };
        let before = held.record.clone();
        let listed_before = held.listed.clone();
        for claim in &claims {
            held.disputed.remove(&claim.uid);
            let listed = held.listed.remove(&claim.uid);
            if let Some(prepared) = held.record.claims.remove(&claim.uid).or(listed) {
                tracing::info!(claim = %claim.describe(), devices = prepared.devices.len(), "unprepared");
            }
        }
        let saved = if held.record != before || held.rewrite {
            self.save(&mut held).await
        } else {
            Ok(())
        };
        let answer = match saved {
            Ok(()) => Ok(()),
            Err(e) => {
                held.record = before;
                held.listed = listed_before;
                Err(format!(
                    "cannot record the unprepared claims: {e}; the kubelet asks again"
                ))
            }
        };
        let code = if answer.is_ok() {
            tonic::Code::Ok
        } else {
            tonic::Code::Unavailable
        };
        for _ in &claims {
            self.metrics.call("UnprepareClaim", code);
        }
        claims
            .into_iter()
            .map(|c| (c.uid, answer.clone()))
            .collect()
    }

    /// Takes the record file's lock, held for the rest of a call (until the returned lock is dropped), and
    /// brings `held` up to the file if another instance has written it since this one last read or wrote
    /// it. What is held here is never emptied by the file: one gone (deleted by hand) is put back by the
    /// next write; one that cannot be read is set aside (kept beside, to look at) and written again from
    /// what is held; one of a newer format is left as it is and not written while it is there. After
    /// either, the claims are listed from the API server again before a new claim is prepared: another
    /// instance may have prepared some that this one cannot read.
    async fn hold_file(&self, held: &mut Holdings) -> Result<RecordLock, String> {
        let (file, seen) = (self.file.clone(), self.seen());
        let boot = held.record.boot_id().map(str::to_string);
        let (lock, look) = tokio::task::spawn_blocking(move || -> Result<_, String> {
            let lock = file.lock()?;
            let now = file.file_id();
            let look = match (now != seen).then(|| file.look(boot)) {
                Some(Look::Unreadable(why)) => {
                    let aside = file.set_aside();
                    Some((
                        Look::Unreadable(format!("{why} (set aside: {aside})")),
                        None,
                    ))
                }
                look => look.map(|l| (l, now)),
            };
            Ok((lock, look))
        })
        .await
        .map_err(|e| e.to_string())??;
        let Some((look, stamp)) = look else {
            return Ok(lock);
        };
        self.set_seen(stamp);
        match look {
            Look::Absent => held.newer = None,
            Look::Found(mut record) => {
                // What is held here is never emptied by the file: a claim it lacks stays held until the
                // API server says whether it still holds its devices. Claims only the file has (another
                // instance prepared them) are taken: they only keep devices from other claims.
                let lacking: Vec<String> = held
                    .record
                    .claims
                    .keys()
                    .filter(|uid| !record.claims.contains_key(*uid))
                    .cloned()
                    .collect();
                if !lacking.is_empty() {
                    tracing::warn!(
                        file = %self.file.path().display(),
                        lacking = lacking.len(),
                        "the prepared-claim record was replaced without claims this instance prepared: they \
                         stay held, and the API server is asked whether they still hold their devices before \
                         another claim is prepared"
                    );
                    for uid in lacking {
                        if let Some(claim) = held.record.claims.get(&uid) {
                            record.claims.insert(uid.clone(), claim.clone());
                        }
                        held.disputed.insert(uid);
                    }
                    held.due = Some(self.listing.next());
                    held.rewrite = true;
                }
                held.record = record;
                held.newer = None;
                if let Some(status) = &self.status {
                    show(status, held);
                }
            }
            Look::Unreadable(why) => {
                tracing::warn!(
                    file = %self.file.path().display(),
                    error = %why,
                    prepared = held.record.claims.len(),
                    "the prepared-claim record cannot be read: this instance keeps the claims it holds, writes \
                     them again, and asks the API server which claims hold devices of the node before it \
                     prepares another"
                );
                held.newer = None;
                held.due = Some(self.listing.next());
                held.rewrite = true;
            }
            Look::Newer(version) => {
                if held.newer != Some(version) {
                    tracing::warn!(
                        file = %self.file.path().display(),
                        version,
                        "the prepared-claim record is of a newer format (a newer version of the plugin wrote \
                         it): left untouched; this instance keeps its claims in memory and asks the API server \
                         which claims hold devices of the node"
                    );
                }
                held.newer = Some(version);
                held.due = Some(self.listing.next());
            }
        }
        Ok(lock)
    }

    /// Takes the list `done` of the claims allocated devices of this pool for pods into `held`, newer than
    /// what it holds.
    fn apply(&self, held: &mut Holdings, done: &Done) {
        let config = &self.config;
        let Ok(claims) = &done.result else {
            return;
        };
        if done.generation <= held.listed_generation {
            return;
        }
        held.listed = claims
            .iter()
            .filter(|c| !c.pods.is_empty())
            .filter_map(|c| {
                let devices: Vec<PreparedDevice> = c
                    .allocated
                    .iter()
                    .flatten()
                    .filter(|r| r.driver == config.driver && r.pool == config.pool)
                    .map(|r| PreparedDevice {
                        requests: vec![r.request.clone()],
                        pool: r.pool.clone(),
                        device: r.device.clone(),
                        cdi_device_ids: Vec::new(),
                    })
                    .collect();
                (!devices.is_empty()).then(|| {
                    let claim = PreparedClaim {
                        namespace: c.namespace.clone(),
                        name: c.name.clone(),
                        devices,
                    };
                    (c.uid.clone(), claim)
                })
            })
            .collect();
        // Claims held here that the record's file lacked: the API server settles it.
        for uid in std::mem::take(&mut held.disputed) {
            if !held.listed.contains_key(&uid) {
                if let Some(gone) = held.record.claims.remove(&uid) {
                    tracing::info!(
                        claim = %format!("{}/{}", gone.namespace, gone.name),
                        "a claim the record's file lacked is not reserved in the API server any more: let go"
                    );
                    held.rewrite = true;
                }
            }
        }
        held.due = None;
        held.listed_generation = done.generation;
        held.listed_at = Some(tokio::time::Instant::now());
        if let Some(status) = &self.status {
            show(status, held);
        }
    }

    /// Says in the log why claim `uid` was not prepared, within [`REFUSALS_SAID`].
    fn say_refusal(&self, uid: &str, why: &str) {
        let mut said = self
            .said
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (bucket, left_out) = &mut *said;
        if bucket.take(tokio::time::Instant::now()) {
            tracing::warn!(claim = %crate::util::text::shown(uid, crate::util::text::SHOWN_MAX), reason = %crate::util::text::shown(why, crate::util::text::LINE_MAX), left_out_before = *left_out, "claim not prepared");
            *left_out = 0;
        } else {
            *left_out += 1;
        }
    }

    fn seen(&self) -> Option<FileId> {
        *self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set_seen(&self, stamp: Option<FileId>) {
        *self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = stamp;
    }

    /// Writes the record off the async thread (a synced write waits on the disk); not over a record of a
    /// newer format, which stays as it is (what is held here is then in memory and in the API server).
    async fn save(&self, held: &mut Holdings) -> Result<(), String> {
        if held.newer.is_some() {
            if let Some(status) = &self.status {
                show(status, held);
            }
            return Ok(());
        }
        let (file, copy) = (self.file.clone(), held.record.clone());
        let stamp = tokio::task::spawn_blocking(move || file.save(&copy).map(|()| file.file_id()))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        self.set_seen(stamp);
        held.rewrite = false;
        if let Some(status) = &self.status {
            show(status, held);
        }
        Ok(())
    }

    /// The devices of this driver allocated to `object`, checked against what the node serves now.
    fn devices_of(
        &self,
        claim: &ClaimRef,
        object: &Claim,
        held: &Holdings,
    ) -> Result<Vec<PreparedDevice>, String> {
        let name = claim.describe();
        if object.uid != claim.uid {
            return Err(format!(
                "{name} in the API server has UID {}, not {} as the kubelet asks: it was deleted and made \
                 again; the pod must be recreated to use the new one",
                object.uid, claim.uid
            ));
        }
        let Some(allocated) = &object.allocated else {
            return Err(format!(
                "{name} is not allocated yet; the scheduler allocates it first"
            ));
        };
        let config = &self.config;
        let settings = ClaimConfig::read(&object.config, &config.driver)
            .map_err(|e| format!("{name}: {e}"))?;
        let inventory = self.devices.borrow().clone();
        let mut devices: Vec<PreparedDevice> = Vec::new();
        for result in allocated.iter().filter(|r| r.driver == config.driver) {
            if result.pool != config.pool {
                return Err(format!(
                    "{name} was given device {} of pool {}, but this node publishes pool {}: it was allocated \
                     for another node",
                    result.device, result.pool, config.pool
                ));
            }
            let Some(device) = names::find(&inventory, &result.device) else {
                return Err(format!(
                    "{name} was given device {}, which this node does not publish (any more); delete the pod \
                     so that its claim is allocated again",
                    result.device
                ));
            };
            if device.health == Health::Unhealthy {
                return Err(format!(
                    "{name} was given device {} ({}), which is Unhealthy: {}; delete the pod so that its \
                     claim is allocated another device",
                    result.device,
                    device.info.id,
                    device.reason.as_deref().unwrap_or("no reason recorded")
                ));
            }
            let of = match device.info.mig {
                Some(_) => DeviceType::Mig,
                None => DeviceType::Gpu,
            };
            settings
                .check(&result.request, of)
                .map_err(|e| format!("{name}: {e}"))?;
            if let Some((uid, holder)) = held.holder(&config.pool, &result.device, &claim.uid) {
                return Err(format!(
                    "{name} was given device {}, which is prepared for ResourceClaim {}/{} (UID {uid}); a \
                     device serves one claim at a time",
                    result.device, holder.namespace, holder.name
                ));
            }
            let request = result.request.clone();
            match devices.iter_mut().find(|d| d.device == result.device) {
                Some(same) => same.requests.push(request),
                None => devices.push(PreparedDevice {
                    requests: vec![request],
                    pool: result.pool.clone(),
                    device: result.device.clone(),
                    cdi_device_ids: vec![format!("{}={}", config.cdi_kind, device.info.id)],
                }),
            }
        }
        tracing::info!(claim = %name, devices = devices.len(), "prepared");
        Ok(devices)
    }
}

/// Puts each device's claim into `status`: the record's, and those the API server lists.
fn show(status: &tokio::sync::watch::Sender<super::registration::DraStatus>, held: &Holdings) {
    let prepared = held
        .listed
        .values()
        .chain(held.record.claims.values())
        .flat_map(|c| {
            c.devices
                .iter()
                .map(move |d| (d.device.clone(), format!("{}/{}", c.namespace, c.name)))
        })
        .collect();
    status.send_modify(|s| s.prepared = prepared);
}

/// Whether `claim` is new to the record.
fn fresh(held: &Holdings, claim: &ClaimRef) -> bool {
    !held.record.claims.contains_key(&claim.uid)
}

/// Every claim of a call answered with why the record could not be taken (`done` says what was not done to
/// them, for the log): nothing is handed out or taken back that the record does not hold.
fn unrecorded<T>(
    claims: Vec<ClaimRef>,
    why: &str,
    done: &str,
) -> HashMap<String, Result<T, String>> {
    let why = format!("cannot take the prepared-claim record: {why}; the kubelet asks again");
    tracing::warn!(error = %why, claims = claims.len(), "claims not {done}");
    claims
        .into_iter()
        .map(|c| (c.uid, Err(why.clone())))
        .collect()
}

/// When a prepare call must be answered by: before the deadline the kubelet's call carries (gRPC's
/// `grpc-timeout`, the time left when it was sent), less a fifth of it and at most 2 s for the answer's way
/// back; [`DEFAULT_ANSWER_WITHIN`] when it carries none.
fn answer_by(metadata: &tonic::metadata::MetadataMap) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    let Some(timeout) = metadata
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(grpc_timeout)
    else {
        return now + DEFAULT_ANSWER_WITHIN;
    };
    let margin = (timeout / 5).min(std::time::Duration::from_secs(2));
    now + timeout
        .saturating_sub(margin)
        .min(DEFAULT_ANSWER_WITHIN * 2)
}

/// A `grpc-timeout` header's time: at most 8 digits and a unit (`H`, `M`, `S`, `m`, `u`, `n`).
fn grpc_timeout(text: &str) -> Option<std::time::Duration> {
    use std::time::Duration;
    let (digits, unit) = text.split_at_checked(text.len().checked_sub(1)?)?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// `DRAPlugin` of API version `$version` on [`Preparer`]: the versions' messages are the same but for fields
/// only the newer has (`$extra`, set to `$value`).
macro_rules! serve_version {
    ($version:ident $(, $extra:ident: $value:expr)?) => {
        impl From<$version::Claim> for ClaimRef {
            fn from(c: $version::Claim) -> Self {
                ClaimRef {
                    namespace: c.namespace,
                    uid: c.uid,
                    name: c.name,
                }
            }
        }

        #[tonic::async_trait]
        impl $version::dra_plugin_server::DraPlugin for Preparer {
            async fn node_prepare_resources(
                &self,
                request: Request<$version::NodePrepareResourcesRequest>,
            ) -> Result<Response<$version::NodePrepareResourcesResponse>, Status> {
                let until = answer_by(request.metadata());
                let request = request.into_inner();
                let claims = checked(request.claims.into_iter().map(ClaimRef::from).collect())?;
                let claims = self
                    .prepare_by(claims, until)
                    .await
                    .into_iter()
                    .map(|(uid, answer)| {
                        let (devices, error) = match answer {
                            Ok(devices) => (devices, String::new()),
                            Err(error) => (Vec::new(), crate::util::text::status_message(&error)),
                        };
                        let devices = devices
                            .into_iter()
                            .map(|d| $version::Device {
                                request_names: d.requests,
                                pool_name: d.pool,
                                device_name: d.device,
                                cdi_device_ids: d.cdi_device_ids,
                                $($extra: $value,)?
                            })
                            .collect();
                        (uid, $version::NodePrepareResourceResponse { devices, error })
                    })
                    .collect();
                Ok(Response::new($version::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$version::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$version::NodeUnprepareResourcesResponse>, Status> {
                let request = request.into_inner();
                let claims = checked(request.claims.into_iter().map(ClaimRef::from).collect())?;
                let claims = self
                    .unprepare(claims)
                    .await
                    .into_iter()
                    .map(|(uid, answer)| {
                        let error = answer.err().map(|e| crate::util::text::status_message(&e)).unwrap_or_default();
                        (uid, $version::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                Ok(Response::new($version::NodeUnprepareResourcesResponse { claims }))
            }
        }
    };
}

serve_version!(v1, share_id: None);
serve_version!(v1beta1);

#[cfg(test)]
mod tests;
