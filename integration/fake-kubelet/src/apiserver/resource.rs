//! `resource.k8s.io/v1` in the fake API server: ResourceClaims (made by tests, read by a DRA driver),
//! ResourceSlices (written by the driver, validated as the API server validates them, listed and watched) and
//! DeviceClasses (kept as sent).
//!
//! Resource versions come from the server's one counter, as etcd's revision does: a list's
//! `metadata.resourceVersion` is the counter when it was made, and a watch from it replays every slice change
//! after it, which is what kube-rs's `watcher` relies on between its list and its watch.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use hyper::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

use super::{failure, merge, not_found};

/// Slice changes kept for watches that resume from an older resource version; a watch from before the oldest
/// is answered `410 Gone`, as after an etcd compaction.
const HISTORY: usize = 10_000;

/// What a watch's stream carries: one event per line.
pub(super) type Events = mpsc::UnboundedReceiver<Value>;

/// `resource.k8s.io/v1` objects and the watches on slices.
#[derive(Debug)]
pub(super) struct ResourceState {
    /// ResourceClaims by namespace and name.
    pub(super) claims: BTreeMap<(String, String), Value>,
    /// ResourceSlices by name (cluster-scoped).
    slices: BTreeMap<String, Value>,
    /// DeviceClasses by name.
    classes: BTreeMap<String, Value>,
    /// Slice changes, oldest first, for watches that resume.
    history: VecDeque<Change>,
    /// The resource version of the newest change dropped from `history`: a watch must start at or after it.
    compacted: u64,
    /// Open watches on slices.
    watches: Vec<(Filter, mpsc::UnboundedSender<Value>)>,
    /// Models an API server with the `DRADeviceTaints` gate off: `taints` are dropped from devices on write.
    pub(super) drop_device_taints: bool,
    /// Slice changes not yet sent to the open watches, while watches lag (`Some`); `None` when they do not.
    lagging: Option<Vec<Change>>,
    /// Every slice, after each change: what [`super::FakeApiServer::wait_for_slices`] waits on.
    pub(super) snapshot: watch::Sender<Vec<Value>>,
}

impl Default for ResourceState {
    fn default() -> Self {
        ResourceState {
            claims: BTreeMap::new(),
            slices: BTreeMap::new(),
            classes: BTreeMap::new(),
            history: VecDeque::new(),
            compacted: 0,
            watches: Vec::new(),
            drop_device_taints: false,
            lagging: None,
            snapshot: watch::Sender::new(Vec::new()),
        }
    }
}

/// One change of a slice: created (`old` none), modified, or deleted (`new` none).
#[derive(Debug, Clone)]
struct Change {
    rv: u64,
    old: Option<Value>,
    new: Option<Value>,
}

/// Which slices a list, watch or collection delete is about: `fieldSelector` (`metadata.name`,
/// `spec.nodeName`, `spec.driver`) and equality-based `labelSelector`.
#[derive(Debug, Clone, Default)]
pub(super) struct Filter {
    fields: Vec<(String, String, bool)>,
    labels: Vec<Label>,
}

#[derive(Debug, Clone)]
enum Label {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    Absent(String),
}

impl Filter {
    fn parse(params: &BTreeMap<String, String>) -> Result<Filter, String> {
        let mut filter = Filter::default();
        for term in params
            .get("fieldSelector")
            .map(String::as_str)
            .unwrap_or("")
            .split(',')
            .filter(|t| !t.is_empty())
        {
            let (field, value, equal) = if let Some((f, v)) = term.split_once("!=") {
                (f, v, false)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, v, true)
            } else if let Some((f, v)) = term.split_once('=') {
                (f, v, true)
            } else {
                return Err(format!("invalid field selector term {term:?}"));
            };
            if !matches!(field, "metadata.name" | "spec.nodeName" | "spec.driver") {
                return Err(format!(
                    "field label not supported: {field} (this fake selects ResourceSlices by metadata.name, \
                     spec.nodeName and spec.driver)"
                ));
            }
            filter.fields.push((field.into(), value.into(), equal));
        }
        let labels = params
            .get("labelSelector")
            .map(String::as_str)
            .unwrap_or("");
        if labels.contains('(') {
            return Err(format!(
                "set-based label selectors are not served by this fake: {labels:?}"
            ));
        }
        for term in labels.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let label = if let Some((k, v)) = term.split_once("!=") {
                Label::NotEquals(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = term.split_once("==") {
                Label::Equals(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = term.split_once('=') {
                Label::Equals(k.trim().into(), v.trim().into())
            } else if let Some(k) = term.strip_prefix('!') {
                Label::Absent(k.trim().into())
            } else {
                Label::Exists(term.into())
            };
            filter.labels.push(label);
        }
        Ok(filter)
    }

    fn matches(&self, slice: &Value) -> bool {
        let fields = self.fields.iter().all(|(field, value, equal)| {
            let actual = match field.as_str() {
                "metadata.name" => &slice["metadata"]["name"],
                "spec.nodeName" => &slice["spec"]["nodeName"],
                _ => &slice["spec"]["driver"],
            };
            (actual.as_str().unwrap_or("") == value) == *equal
        });
        let labels = &slice["metadata"]["labels"];
        fields
            && self.labels.iter().all(|label| match label {
                Label::Equals(k, v) => labels[k].as_str() == Some(v),
                Label::NotEquals(k, v) => labels[k].as_str() != Some(v),
                Label::Exists(k) => labels.get(k).is_some(),
                Label::Absent(k) => labels.get(k).is_none(),
            })
    }
}

/// A reply: a whole JSON body, or a watch's stream of events that ends after `timeout` (`timeoutSeconds`).
pub(super) enum Reply {
    Whole(StatusCode, Value),
    Watch(Events, Option<Duration>),
}

impl From<(StatusCode, Value)> for Reply {
    fn from((status, value): (StatusCode, Value)) -> Self {
        Reply::Whole(status, value)
    }
}

/// Decodes a URL query (`a=b&c=d%3De`) into its parameters.
pub(super) fn query_params(query: &str) -> BTreeMap<String, String> {
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = bytes
                    .get(i + 1..i + 3)
                    .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

const GROUP: &str = "resource.k8s.io";
const API_VERSION: &str = "resource.k8s.io/v1";

/// Routes a request under `/apis/resource.k8s.io/v1/`; `parts` is the path after it. `version` is the
/// resource version this request's write takes.
pub(super) fn route(
    rs: &mut ResourceState,
    version: u64,
    method: &Method,
    parts: &[&str],
    query: &str,
    content_type: Option<&str>,
    body: &Value,
) -> Reply {
    let params = query_params(query);
    let dry_run = params.get("dryRun").is_some_and(|d| d == "All");
    match (method, parts) {
        (&Method::GET, ["resourceslices"]) => rs.list_or_watch(version, &params),
        (&Method::POST, ["resourceslices"]) => rs.create_slice(version, body, dry_run).into(),
        (&Method::DELETE, ["resourceslices"]) => match Filter::parse(&params) {
            Ok(filter) => rs.delete_collection(version, &filter, dry_run).into(),
            Err(e) => failure(StatusCode::BAD_REQUEST, "BadRequest", &e).into(),
        },
        (&Method::GET, ["resourceslices", name]) => match rs.slices.get(*name) {
            Some(slice) => Reply::Whole(StatusCode::OK, slice.clone()),
            None => not_found("resourceslices.resource.k8s.io", name).into(),
        },
        (&Method::PUT, ["resourceslices", name]) => {
            rs.update_slice(version, name, body.clone(), dry_run).into()
        }
        (&Method::PATCH, ["resourceslices", name]) => {
            rs.patch_slice(version, name, content_type, body, dry_run)
                .into()
        }
        (&Method::DELETE, ["resourceslices", name]) => {
            rs.delete_slice(version, name, body, dry_run).into()
        }
        (&Method::GET, ["resourceclaims"]) => rs.list_claims(version, &params),
        (&Method::GET, ["namespaces", ns, "resourceclaims", name]) => {
            match rs.claims.get(&((*ns).into(), (*name).into())) {
                Some(claim) => Reply::Whole(StatusCode::OK, claim.clone()),
                None => not_found("resourceclaims.resource.k8s.io", name).into(),
            }
        }
        (&Method::GET, ["deviceclasses"]) => Reply::Whole(
            StatusCode::OK,
            json!({
                "apiVersion": API_VERSION,
                "kind": "DeviceClassList",
                "metadata": {"resourceVersion": version.to_string()},
                "items": rs.classes.values().cloned().collect::<Vec<_>>(),
            }),
        ),
        (&Method::POST, ["deviceclasses"]) => rs.create_class(version, body, dry_run).into(),
        (&Method::GET, ["deviceclasses", name]) => match rs.classes.get(*name) {
            Some(class) => Reply::Whole(StatusCode::OK, class.clone()),
            None => not_found("deviceclasses.resource.k8s.io", name).into(),
        },
        (&Method::DELETE, ["deviceclasses", name]) => match rs.classes.remove(*name) {
            Some(class) => Reply::Whole(StatusCode::OK, class),
            None => not_found("deviceclasses.resource.k8s.io", name).into(),
        },
        _ => failure(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!(
                "the server could not find the requested resource ({method} /apis/{API_VERSION}/{})",
                parts.join("/")
            ),
        )
        .into(),
    }
}

/// A list's continue token: the last key given, in hex (opaque to the client, as the API server's are).
fn encode_token((namespace, name): &(String, String)) -> String {
    format!("{namespace}/{name}")
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn decode_token(token: &str) -> Option<(String, String)> {
    let bytes: Option<Vec<u8>> = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(token.get(i..i + 2)?, 16).ok())
        .collect();
    let text = String::from_utf8(bytes?).ok()?;
    let (namespace, name) = text.split_once('/')?;
    Some((namespace.into(), name.into()))
}

/// A resource version as the API server writes it.
fn rv(version: u64) -> Value {
    Value::String(version.to_string())
}

fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

/// A random UID in the shape of the API server's (a version 4 UUID).
pub(super) fn new_uid() -> String {
    let hex = |n: usize| {
        (0..n)
            .map(|_| char::from_digit(fastrand::u32(0..16), 16).unwrap_or('0'))
            .collect::<String>()
    };
    let variant = ['8', '9', 'a', 'b'][fastrand::usize(0..4)];
    format!(
        "{}-{}-4{}-{variant}{}-{}",
        hex(8),
        hex(4),
        hex(3),
        hex(3),
        hex(12)
    )
}

/// The suffix the API server appends to a `generateName`: five characters of its alphabet (no vowels, no
/// digits that look like letters).
fn name_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|_| char::from(ALPHABET[fastrand::usize(0..ALPHABET.len())]))
        .collect()
}

fn conflict(resource: &str, name: &str) -> (StatusCode, Value) {
    failure(
        StatusCode::CONFLICT,
        "Conflict",
        &format!(
            "Operation cannot be fulfilled on {resource} \"{name}\": the object has been modified; please apply \
             your changes to the latest version and try again"
        ),
    )
}

fn already_exists(resource: &str, name: &str) -> (StatusCode, Value) {
    failure(
        StatusCode::CONFLICT,
        "AlreadyExists",
        &format!("{resource} \"{name}\" already exists"),
    )
}

/// 422 Invalid in the API server's words: `<Kind>.<group> "<name>" is invalid: <errors>`, every error also
/// in `details.causes` with its field.
fn invalid_object(kind: &str, name: &str, errors: &[FieldError]) -> (StatusCode, Value) {
    let texts: Vec<String> = errors.iter().map(FieldError::to_string).collect();
    let joined = match texts.as_slice() {
        [one] => one.clone(),
        many => format!("[{}]", many.join(", ")),
    };
    let (code, mut status) = failure(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        &format!("{kind}.{GROUP} \"{name}\" is invalid: {joined}"),
    );
    status["details"] = json!({
        "name": name,
        "group": GROUP,
        "kind": kind,
        "causes": errors.iter().map(|e| json!({
            "reason": e.reason,
            "message": e.to_string(),
            "field": e.field,
        })).collect::<Vec<_>>(),
    });
    (code, status)
}

impl ResourceState {
    /// Every slice.
    /// Every namespace's claims, in pages as the API server gives them: `limit` claims at most (all without
    /// one), the next page from the `continue` token the previous one ended with, and the count of those
    /// left in `metadata.remainingItemCount`. A token that is not one of ours is 400, as a malformed one is
    /// there.
    fn list_claims(&self, version: u64, params: &BTreeMap<String, String>) -> Reply {
        let limit = params
            .get("limit")
            .and_then(|l| l.parse::<usize>().ok())
            .filter(|l| *l > 0)
            .unwrap_or(usize::MAX);
        let after = match params.get("continue").filter(|c| !c.is_empty()) {
            None => None,
            Some(token) => match decode_token(token) {
                Some(key) => Some(key),
                None => {
                    return failure(
                        StatusCode::BAD_REQUEST,
                        "BadRequest",
                        &format!("continue key is not valid: {token:?}"),
                    )
                    .into();
                }
            },
        };
        let rest: Vec<(&(String, String), &Value)> = match &after {
            Some(key) => self
                .claims
                .range::<(String, String), _>((
                    std::ops::Bound::Excluded(key),
                    std::ops::Bound::Unbounded,
                ))
                .collect(),
            None => self.claims.iter().collect(),
        };
        let page: Vec<Value> = rest.iter().take(limit).map(|(_, c)| (*c).clone()).collect();
        let mut metadata = json!({"resourceVersion": version.to_string()});
        if let Some((last, _)) = rest
            .get(page.len().wrapping_sub(1))
            .filter(|_| rest.len() > page.len())
        {
            metadata["continue"] = Value::String(encode_token(last));
            metadata["remainingItemCount"] = json!(rest.len() - page.len());
        }
        Reply::Whole(
            StatusCode::OK,
            json!({
                "apiVersion": API_VERSION,
                "kind": "ResourceClaimList",
                "metadata": metadata,
                "items": page,
            }),
        )
    }

    pub(super) fn slices(&self) -> Vec<Value> {
        self.slices.values().cloned().collect()
    }

    /// Forgets the change history: a watch resuming from any resource version before `version` gets 410 Gone.
    pub(super) fn compact(&mut self, version: u64) {
        self.history.clear();
        self.compacted = version;
    }

    /// Someone else's update of the stored slice `name`: `edit` applied to it, stored as a write would store
    /// it (a new resource version, watches told). Whether there was such a slice.
    pub(super) fn edit_slice(
        &mut self,
        version: u64,
        name: &str,
        edit: impl FnOnce(&mut Value),
    ) -> bool {
        let Some(mut slice) = self.slices.get(name).cloned() else {
            return false;
        };
        edit(&mut slice);
        self.store_update(version, name, slice, false)
            .0
            .is_success()
    }

    /// Number of open watches on slices.
    pub(super) fn watching(&self) -> usize {
        self.watches
            .iter()
            .filter(|(_, tx)| !tx.is_closed())
            .count()
    }

    fn list_or_watch(&mut self, version: u64, params: &BTreeMap<String, String>) -> Reply {
        let filter = match Filter::parse(params) {
            Ok(filter) => filter,
            Err(e) => return failure(StatusCode::BAD_REQUEST, "BadRequest", &e).into(),
        };
        if !params.get("watch").is_some_and(|w| w == "true" || w == "1") {
            let items: Vec<Value> = self
                .slices
                .values()
                .filter(|s| filter.matches(s))
                .cloned()
                .collect();
            return Reply::Whole(
                StatusCode::OK,
                json!({
                    "apiVersion": API_VERSION,
                    "kind": "ResourceSliceList",
                    "metadata": {"resourceVersion": version.to_string()},
                    "items": items,
                }),
            );
        }
        let timeout = params
            .get("timeoutSeconds")
            .and_then(|t| t.parse::<u64>().ok())
            .map(Duration::from_secs);
        let (tx, rx) = mpsc::unbounded_channel();
        let from = params
            .get("resourceVersion")
            .map(String::as_str)
            .unwrap_or("");
        let initial = params.get("sendInitialEvents").is_some_and(|s| s == "true");
        if from.is_empty() || from == "0" || initial {
            // The current state as ADDED events, then (streaming lists) the bookmark that ends them.
            for slice in self.slices.values().filter(|s| filter.matches(s)) {
                let _sent = tx.send(json!({"type": "ADDED", "object": slice}));
            }
            if initial {
                let _sent = tx.send(json!({"type": "BOOKMARK", "object": {
                    "apiVersion": API_VERSION,
                    "kind": "ResourceSlice",
                    "metadata": {
                        "resourceVersion": version.to_string(),
                        "annotations": {"k8s.io/initial-events-end": "true"},
                    },
                }}));
            }
        } else {
            let Ok(from) = from.parse::<u64>() else {
                return failure(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    &format!("invalid resource version {from:?}"),
                )
                .into();
            };
            if from < self.compacted {
                let (_, status) = failure(
                    StatusCode::GONE,
                    "Expired",
                    &format!("too old resource version: {from} ({})", self.compacted),
                );
                // The sender goes with this function: the stream ends after the error, as the API server's does.
                let _sent = tx.send(json!({"type": "ERROR", "object": status}));
                return Reply::Watch(rx, None);
            }
            for change in self.history.iter().filter(|c| c.rv > from) {
                if let Some(event) = event_for(&filter, change) {
                    let _sent = tx.send(event);
                }
            }
        }
        self.watches.push((filter, tx));
        Reply::Watch(rx, timeout)
    }

    /// While `lag` is true, slice changes reach the open watches only when it is set back to false (in
    /// order): an API server's watch cache behind its writes. Lists, reads and writes are not held.
    pub(super) fn lag_watches(&mut self, lag: bool) {
        match (lag, self.lagging.take()) {
            (true, held) => self.lagging = Some(held.unwrap_or_default()),
            (false, Some(held)) => held.iter().for_each(|change| self.send(change)),
            (false, None) => {}
        }
    }

    /// Sends `change` to the watches it concerns.
    fn send(&mut self, change: &Change) {
        self.watches
            .retain(|(filter, tx)| match event_for(filter, change) {
                Some(event) => tx.send(event).is_ok(),
                None => !tx.is_closed(),
            });
    }

    /// Records a change, sends it to the watches it concerns and refreshes the snapshot.
    fn changed(&mut self, change: Change) {
        match &mut self.lagging {
            Some(held) => held.push(change.clone()),
            None => self.send(&change),
        }
        self.history.push_back(change);
        while self.history.len() > HISTORY {
            if let Some(dropped) = self.history.pop_front() {
                self.compacted = dropped.rv;
            }
        }
        let slices = self.slices();
        self.snapshot.send_replace(slices);
    }

    fn create_slice(&mut self, version: u64, body: &Value, dry_run: bool) -> (StatusCode, Value) {
        let mut slice = body.clone();
        if let Some(problem) = check_kind(&slice, "ResourceSlice") {
            return problem;
        }
        let name = match slice["metadata"]["name"].as_str().filter(|n| !n.is_empty()) {
            Some(name) => name.to_string(),
            None => match slice["metadata"]["generateName"].as_str() {
                Some(prefix) if !prefix.is_empty() => {
                    let prefix: String = prefix.chars().take(58).collect();
                    format!("{prefix}{}", name_suffix())
                }
                _ => {
                    return invalid_object(
                        "ResourceSlice",
                        "",
                        &[FieldError::required(
                            "metadata.name",
                            "name or generateName is required",
                        )],
                    );
                }
            },
        };
        slice["metadata"]["name"] = Value::String(name.clone());
        if self.drop_device_taints {
            drop_taints(&mut slice);
        }
        let errors = validate_slice(&slice);
        if !errors.is_empty() {
            return invalid_object("ResourceSlice", &name, &errors);
        }
        if self.slices.contains_key(&name) {
            return already_exists("resourceslices.resource.k8s.io", &name);
        }
        slice["apiVersion"] = Value::String(API_VERSION.into());
        slice["kind"] = Value::String("ResourceSlice".into());
        let metadata = &mut slice["metadata"];
        metadata["uid"] = Value::String(new_uid());
        metadata["resourceVersion"] = rv(version);
        metadata["creationTimestamp"] = Value::String(now_rfc3339());
        metadata["generation"] = json!(1);
        if !dry_run {
            self.slices.insert(name, slice.clone());
            self.changed(Change {
                rv: version,
                old: None,
                new: Some(slice.clone()),
            });
        }
        (StatusCode::CREATED, slice)
    }

    fn update_slice(
        &mut self,
        version: u64,
        name: &str,
        mut slice: Value,
        dry_run: bool,
    ) -> (StatusCode, Value) {
        if let Some(problem) = check_kind(&slice, "ResourceSlice") {
            return problem;
        }
        let sent_name = slice["metadata"]["name"].as_str().unwrap_or("");
        if sent_name != name {
            return failure(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &format!(
                    "the name of the object ({sent_name}) does not match the name on the URL ({name})"
                ),
            );
        }
        let Some(stored) = self.slices.get(name) else {
            return not_found("resourceslices.resource.k8s.io", name);
        };
        if let Some(problem) = preconditions(
            stored,
            slice["metadata"]["resourceVersion"].as_str(),
            slice["metadata"]["uid"].as_str(),
            name,
        ) {
            return problem;
        }
        if self.drop_device_taints {
            drop_taints(&mut slice);
        }
        self.store_update(version, name, slice, dry_run)
    }

    fn patch_slice(
        &mut self,
        version: u64,
        name: &str,
        content_type: Option<&str>,
        patch: &Value,
        dry_run: bool,
    ) -> (StatusCode, Value) {
        // A ResourceSlice's lists are atomic, so a strategic merge patch of it is a JSON merge patch.
        if !matches!(
            content_type,
            Some("application/merge-patch+json" | "application/strategic-merge-patch+json")
        ) {
            return failure(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "UnsupportedMediaType",
                &format!(
                    "the body of the request was in an unknown format ({}): this fake serves merge patches only",
                    content_type.unwrap_or("none")
                ),
            );
        }
        let Some(stored) = self.slices.get(name) else {
            return not_found("resourceslices.resource.k8s.io", name);
        };
        if let Some(problem) = preconditions(
            stored,
            patch["metadata"]["resourceVersion"].as_str(),
            patch["metadata"]["uid"].as_str(),
            name,
        ) {
            return problem;
        }
        let mut slice = stored.clone();
        merge(&mut slice, patch);
        if self.drop_device_taints {
            drop_taints(&mut slice);
        }
        self.store_update(version, name, slice, dry_run)
    }

    /// Validates and stores a new version of slice `name` (which exists), keeping what the server owns.
    fn store_update(
        &mut self,
        version: u64,
        name: &str,
        mut slice: Value,
        dry_run: bool,
    ) -> (StatusCode, Value) {
        let errors = validate_slice(&slice);
        if !errors.is_empty() {
            return invalid_object("ResourceSlice", name, &errors);
        }
        let Some(old) = self.slices.get(name).cloned() else {
            return not_found("resourceslices.resource.k8s.io", name);
        };
        slice["apiVersion"] = Value::String(API_VERSION.into());
        slice["kind"] = Value::String("ResourceSlice".into());
        let generation = old["metadata"]["generation"].as_i64().unwrap_or(1);
        let generation = if slice["spec"] != old["spec"] {
            generation + 1
        } else {
            generation
        };
        let metadata = &mut slice["metadata"];
        for owned in ["uid", "creationTimestamp"] {
            metadata[owned] = old["metadata"][owned].clone();
        }
        metadata["resourceVersion"] = rv(version);
        metadata["generation"] = json!(generation);
        if !dry_run {
            self.slices.insert(name.into(), slice.clone());
            self.changed(Change {
                rv: version,
                old: Some(old),
                new: Some(slice.clone()),
            });
        }
        (StatusCode::OK, slice)
    }

    fn delete_slice(
        &mut self,
        version: u64,
        name: &str,
        options: &Value,
        dry_run: bool,
    ) -> (StatusCode, Value) {
        let Some(stored) = self.slices.get(name) else {
            return not_found("resourceslices.resource.k8s.io", name);
        };
        let wanted = &options["preconditions"];
        if let Some(problem) = preconditions(
            stored,
            wanted["resourceVersion"].as_str(),
            wanted["uid"].as_str(),
            name,
        ) {
            return problem;
        }
        if dry_run {
            return (StatusCode::OK, stored.clone());
        }
        match self.remove_slice(version, name) {
            Some(gone) => (StatusCode::OK, gone),
            None => not_found("resourceslices.resource.k8s.io", name),
        }
    }

    /// Removes slice `name`; the watches see it DELETED with `version`.
    fn remove_slice(&mut self, version: u64, name: &str) -> Option<Value> {
        let mut gone = self.slices.remove(name)?;
        gone["metadata"]["resourceVersion"] = rv(version);
        self.changed(Change {
            rv: version,
            old: Some(gone.clone()),
            new: None,
        });
        Some(gone)
    }

    fn delete_collection(
        &mut self,
        version: u64,
        filter: &Filter,
        dry_run: bool,
    ) -> (StatusCode, Value) {
        let names: Vec<String> = self
            .slices
            .iter()
            .filter(|(_, s)| filter.matches(s))
            .map(|(n, _)| n.clone())
            .collect();
        let items: Vec<Value> = if dry_run {
            names
                .iter()
                .filter_map(|n| self.slices.get(n).cloned())
                .collect()
        } else {
            names
                .iter()
                .filter_map(|n| self.remove_slice(version, n))
                .collect()
        };
        (
            StatusCode::OK,
            json!({
                "apiVersion": API_VERSION,
                "kind": "ResourceSliceList",
                "metadata": {"resourceVersion": version.to_string()},
                "items": items,
            }),
        )
    }

    /// Deletes the slices of `node` (of `driver` only, if given), as the kubelet does; returns how many.
    pub(super) fn wipe(&mut self, version: u64, node: &str, driver: Option<&str>) -> usize {
        let mut fields = vec![("spec.nodeName".to_string(), node.to_string(), true)];
        if let Some(driver) = driver {
            fields.push(("spec.driver".into(), driver.into(), true));
        }
        let filter = Filter {
            fields,
            labels: Vec::new(),
        };
        let (_, deleted) = self.delete_collection(version, &filter, false);
        deleted["items"].as_array().map_or(0, Vec::len)
    }

    fn create_class(&mut self, version: u64, body: &Value, dry_run: bool) -> (StatusCode, Value) {
        let mut class = body.clone();
        if let Some(problem) = check_kind(&class, "DeviceClass") {
            return problem;
        }
        let name = class["metadata"]["name"].as_str().unwrap_or("").to_string();
        if !is_dns_subdomain(&name) {
            return invalid_object(
                "DeviceClass",
                &name,
                &[FieldError::invalid(
                    "metadata.name",
                    &Value::String(name.clone()),
                    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, \
                     '-' or '.', and must start and end with an alphanumeric character",
                )],
            );
        }
        if self.classes.contains_key(&name) {
            return already_exists("deviceclasses.resource.k8s.io", &name);
        }
        class["apiVersion"] = Value::String(API_VERSION.into());
        class["kind"] = Value::String("DeviceClass".into());
        class["metadata"]["uid"] = Value::String(new_uid());
        class["metadata"]["resourceVersion"] = rv(version);
        class["metadata"]["creationTimestamp"] = Value::String(now_rfc3339());
        class["metadata"]["generation"] = json!(1);
        if !dry_run {
            self.classes.insert(name, class.clone());
        }
        (StatusCode::CREATED, class)
    }

    /// Every DeviceClass.
    pub(super) fn classes(&self) -> Vec<Value> {
        self.classes.values().cloned().collect()
    }
}

/// The event a watch with `filter` sees for `change`, if any: a slice that starts matching is ADDED, one
/// that stops matching is DELETED, as the API server's watch cache does.
fn event_for(filter: &Filter, change: &Change) -> Option<Value> {
    let was = change.old.as_ref().is_some_and(|o| filter.matches(o));
    let is = change.new.as_ref().is_some_and(|n| filter.matches(n));
    let (kind, object) = match (was, is, &change.new) {
        (true, true, Some(new)) => ("MODIFIED", new.clone()),
        (false, true, Some(new)) => ("ADDED", new.clone()),
        (true, false, Some(new)) => ("DELETED", new.clone()),
        (true, false, None) => ("DELETED", change.old.clone()?),
        _ => return None,
    };
    Some(json!({"type": kind, "object": object}))
}

/// A body whose `kind`/`apiVersion` name another type is refused, as the API server's decoder does.
fn check_kind(object: &Value, kind: &str) -> Option<(StatusCode, Value)> {
    if !object.is_object() {
        return Some(failure(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            &format!("the body is not a {kind} object"),
        ));
    }
    let sent_kind = object["kind"].as_str().unwrap_or(kind);
    let sent_version = object["apiVersion"].as_str().unwrap_or(API_VERSION);
    if sent_kind != kind || sent_version != API_VERSION {
        return Some(failure(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            &format!(
                "the API version in the data ({sent_version}) and kind ({sent_kind}) do not match \
                 {API_VERSION} {kind}"
            ),
        ));
    }
    None
}

/// The optimistic-concurrency preconditions of a write: a resource version or UID that is not the stored
/// one's is a conflict.
fn preconditions(
    stored: &Value,
    resource_version: Option<&str>,
    uid: Option<&str>,
    name: &str,
) -> Option<(StatusCode, Value)> {
    if let Some(uid) = uid.filter(|u| !u.is_empty())
        && stored["metadata"]["uid"].as_str() != Some(uid)
    {
        return Some(failure(
            StatusCode::CONFLICT,
            "Conflict",
            &format!(
                "Operation cannot be fulfilled on resourceslices.resource.k8s.io \"{name}\": Precondition \
                 failed: UID in precondition: {uid}, UID in object meta: {}",
                stored["metadata"]["uid"].as_str().unwrap_or("")
            ),
        ));
    }
    match resource_version.filter(|v| !v.is_empty()) {
        Some(wanted) if stored["metadata"]["resourceVersion"].as_str() != Some(wanted) => {
            Some(conflict("resourceslices.resource.k8s.io", name))
        }
        _ => None,
    }
}

/// What an API server with the `DRADeviceTaints` gate off does with a slice on write: drops every device's
/// `taints`, silently.
fn drop_taints(slice: &mut Value) {
    if let Some(devices) = slice["spec"]["devices"].as_array_mut() {
        for device in devices {
            if let Some(device) = device.as_object_mut() {
                device.remove("taints");
            }
        }
    }
}

/// One validation error, as the API server words it: `<field>: <reason>[: <detail>]`.
#[derive(Debug, Clone)]
pub(super) struct FieldError {
    field: String,
    /// `FieldValueRequired`, `FieldValueInvalid`, ...
    reason: &'static str,
    text: String,
}

impl FieldError {
    fn required(field: &str, detail: &str) -> Self {
        FieldError {
            field: field.into(),
            reason: "FieldValueRequired",
            text: if detail.is_empty() {
                "Required value".into()
            } else {
                format!("Required value: {detail}")
            },
        }
    }

    fn invalid(field: &str, value: &Value, detail: &str) -> Self {
        FieldError {
            field: field.into(),
            reason: "FieldValueInvalid",
            text: format!("Invalid value: {value}: {detail}"),
        }
    }

    fn too_many(field: &str, actual: usize, limit: usize) -> Self {
        FieldError {
            field: field.into(),
            reason: "FieldValueTooMany",
            text: format!("Too many: {actual}: must have at most {limit} items"),
        }
    }

    fn too_long(field: &str, limit: usize) -> Self {
        FieldError {
            field: field.into(),
            reason: "FieldValueTooLong",
            text: format!("Too long: may not be more than {limit} bytes"),
        }
    }

    fn not_supported(field: &str, value: &Value, supported: &[&str]) -> Self {
        let supported: Vec<String> = supported.iter().map(|s| format!("{s:?}")).collect();
        FieldError {
            field: field.into(),
            reason: "FieldValueNotSupported",
            text: format!(
                "Unsupported value: {value}: supported values: {}",
                supported.join(", ")
            ),
        }
    }

    fn duplicate(field: &str, value: &Value) -> Self {
        FieldError {
            field: field.into(),
            reason: "FieldValueDuplicate",
            text: format!("Duplicate value: {value}"),
        }
    }
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.text)
    }
}

/// Devices in one slice.
const MAX_DEVICES: usize = 128;
/// Devices in one slice when any of them has taints (or consumes counters).
const MAX_DEVICES_WITH_TAINTS: usize = 64;
/// Attributes and capacities together, per device.
const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
/// Taints per device.
const MAX_TAINTS: usize = 16;
/// Length of a string or version attribute value.
const MAX_VALUE_LENGTH: usize = 64;
/// Length of an attribute's or capacity's name (after its domain).
const MAX_IDENTIFIER_LENGTH: usize = 32;

/// What the API server's validation of a resource.k8s.io/v1 ResourceSlice refuses that a driver could get
/// wrong; empty when it is valid.
pub(super) fn validate_slice(slice: &Value) -> Vec<FieldError> {
    let mut errors = Vec::new();
    let name = &slice["metadata"]["name"];
    if !name.as_str().is_some_and(is_dns_subdomain) {
        errors.push(FieldError::invalid(
            "metadata.name",
            name,
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', \
             and must start and end with an alphanumeric character",
        ));
    }
    let spec = &slice["spec"];
    match spec["driver"].as_str() {
        None | Some("") => errors.push(FieldError::required("spec.driver", "")),
        Some(driver) if driver.len() > 63 => errors.push(FieldError::too_long("spec.driver", 63)),
        Some(driver) if !is_dns_subdomain(driver) => errors.push(FieldError::invalid(
            "spec.driver",
            &spec["driver"],
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', \
             and must start and end with an alphanumeric character",
        )),
        Some(_) => {}
    }
    let pool = &spec["pool"];
    match pool["name"].as_str() {
        None | Some("") => errors.push(FieldError::required("spec.pool.name", "")),
        Some(name) if name.len() > 253 => errors.push(FieldError::too_long("spec.pool.name", 253)),
        Some(name) if !name.split('/').all(is_dns_subdomain) => errors.push(FieldError::invalid(
            "spec.pool.name",
            &pool["name"],
            "each part of a pool name separated by '/' must be a lowercase RFC 1123 subdomain",
        )),
        Some(_) => {}
    }
    match &pool["generation"] {
        Value::Null => errors.push(FieldError::required("spec.pool.generation", "")),
        g if g.as_i64().is_none_or(|g| g < 0) => errors.push(FieldError::invalid(
            "spec.pool.generation",
            g,
            "must be greater than or equal to 0",
        )),
        _ => {}
    }
    match &pool["resourceSliceCount"] {
        Value::Null => errors.push(FieldError::required("spec.pool.resourceSliceCount", "")),
        c if c.as_i64().is_none_or(|c| c < 1) => errors.push(FieldError::invalid(
            "spec.pool.resourceSliceCount",
            c,
            "must be greater than zero",
        )),
        _ => {}
    }
    let selections = [
        spec["nodeName"].as_str().is_some_and(|n| !n.is_empty()),
        !spec["nodeSelector"].is_null(),
        spec["allNodes"].as_bool() == Some(true),
        spec["perDeviceNodeSelection"].as_bool() == Some(true),
    ];
    match selections.iter().filter(|s| **s).count() {
        0 => errors.push(FieldError::required(
            "spec",
            "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required",
        )),
        1 => {}
        _ => errors.push(FieldError::invalid(
            "spec",
            &json!("{`nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection`}"),
            "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required, \
             but multiple fields are set",
        )),
    }
    if let Some(node) = spec["nodeName"].as_str().filter(|n| !n.is_empty())
        && !is_dns_subdomain(node)
    {
        errors.push(FieldError::invalid(
            "spec.nodeName",
            &spec["nodeName"],
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', \
             and must start and end with an alphanumeric character",
        ));
    }
    match &spec["devices"] {
        Value::Null => {}
        Value::Array(devices) => validate_devices(devices, &mut errors),
        other => errors.push(FieldError::invalid("spec.devices", other, "must be a list")),
    }
    errors
}

fn validate_devices(devices: &[Value], errors: &mut Vec<FieldError>) {
    let restricted = devices
        .iter()
        .any(|d| !d["taints"].is_null() || !d["consumesCounters"].is_null());
    let limit = if restricted {
        MAX_DEVICES_WITH_TAINTS
    } else {
        MAX_DEVICES
    };
    if devices.len() > limit {
        errors.push(FieldError::too_many("spec.devices", devices.len(), limit));
    }
    let mut names = std::collections::BTreeSet::new();
    for (i, device) in devices.iter().enumerate() {
        let path = format!("spec.devices[{i}]");
        match device["name"].as_str() {
            None | Some("") => errors.push(FieldError::required(&format!("{path}.name"), "")),
            Some(name) if !is_dns_label(name) => errors.push(FieldError::invalid(
                &format!("{path}.name"),
                &device["name"],
                "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and \
                 must start and end with an alphanumeric character",
            )),
            Some(name) => {
                if !names.insert(name.to_string()) {
                    errors.push(FieldError::duplicate(
                        &format!("{path}.name"),
                        &device["name"],
                    ));
                }
            }
        }
        let attributes = device["attributes"].as_object();
        let capacity = device["capacity"].as_object();
        let count = attributes.map_or(0, |a| a.len()) + capacity.map_or(0, |c| c.len());
        if count > MAX_ATTRIBUTES_AND_CAPACITIES {
            errors.push(FieldError::too_many(
                &path,
                count,
                MAX_ATTRIBUTES_AND_CAPACITIES,
            ));
        }
        for (key, value) in attributes.into_iter().flatten() {
            let field = format!("{path}.attributes[{key}]");
            if let Some(problem) = check_qualified_name(key) {
                errors.push(FieldError::invalid(&field, &json!(key), &problem));
            }
            validate_attribute(&field, value, errors);
        }
        for (key, value) in capacity.into_iter().flatten() {
            let field = format!("{path}.capacity[{key}]");
            if let Some(problem) = check_qualified_name(key) {
                errors.push(FieldError::invalid(&field, &json!(key), &problem));
            }
            if value["value"].is_null() {
                errors.push(FieldError::required(&format!("{field}.value"), ""));
            }
        }
        match &device["taints"] {
            Value::Null => {}
            Value::Array(taints) => {
                if taints.len() > MAX_TAINTS {
                    errors.push(FieldError::too_many(
                        &format!("{path}.taints"),
                        taints.len(),
                        MAX_TAINTS,
                    ));
                }
                for (j, taint) in taints.iter().enumerate() {
                    validate_taint(&format!("{path}.taints[{j}]"), taint, errors);
                }
            }
            other => errors.push(FieldError::invalid(
                &format!("{path}.taints"),
                other,
                "must be a list",
            )),
        }
    }
}

/// An attribute holds exactly one of `int`, `bool`, `string`, `version`.
fn validate_attribute(field: &str, value: &Value, errors: &mut Vec<FieldError>) {
    let set: Vec<&str> = ["int", "bool", "string", "version"]
        .into_iter()
        .filter(|k| !value[*k].is_null())
        .collect();
    match set.as_slice() {
        [] => errors.push(FieldError::required(
            field,
            "exactly one value must be specified",
        )),
        ["int"] if !value["int"].is_i64() => errors.push(FieldError::invalid(
            &format!("{field}.int"),
            &value["int"],
            "must be an integer",
        )),
        ["bool"] if !value["bool"].is_boolean() => errors.push(FieldError::invalid(
            &format!("{field}.bool"),
            &value["bool"],
            "must be a boolean",
        )),
        ["string"] => match value["string"].as_str() {
            None => errors.push(FieldError::invalid(
                &format!("{field}.string"),
                &value["string"],
                "must be a string",
            )),
            Some(s) if s.len() > MAX_VALUE_LENGTH => errors.push(FieldError::too_long(
                &format!("{field}.string"),
                MAX_VALUE_LENGTH,
            )),
            Some(_) => {}
        },
        ["version"] => match value["version"].as_str() {
            Some(v) if v.len() > MAX_VALUE_LENGTH => errors.push(FieldError::too_long(
                &format!("{field}.version"),
                MAX_VALUE_LENGTH,
            )),
            Some(v) if is_semver(v) => {}
            _ => errors.push(FieldError::invalid(
                &format!("{field}.version"),
                &value["version"],
                "must be a string compatible with semver.org spec 2.0.0",
            )),
        },
        [_] => {}
        _ => errors.push(FieldError::invalid(
            field,
            &json!(set.join(", ")),
            "exactly one value must be specified",
        )),
    }
}

fn validate_taint(field: &str, taint: &Value, errors: &mut Vec<FieldError>) {
    match taint["key"].as_str() {
        None | Some("") => errors.push(FieldError::required(&format!("{field}.key"), "")),
        Some(key) => {
            if let Some(problem) = check_label_key(key) {
                errors.push(FieldError::invalid(
                    &format!("{field}.key"),
                    &taint["key"],
                    &problem,
                ));
            }
        }
    }
    if let Some(value) = taint["value"].as_str()
        && !is_label_value(value)
    {
        errors.push(FieldError::invalid(
            &format!("{field}.value"),
            &taint["value"],
            "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and \
             must start and end with an alphanumeric character (at most 63 characters)",
        ));
    }
    const EFFECTS: [&str; 3] = ["NoSchedule", "NoExecute", "None"];
    match taint["effect"].as_str() {
        None | Some("") => errors.push(FieldError::required(&format!("{field}.effect"), "")),
        Some(effect) if !EFFECTS.contains(&effect) => errors.push(FieldError::not_supported(
            &format!("{field}.effect"),
            &taint["effect"],
            &EFFECTS,
        )),
        Some(_) => {}
    }
}

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
pub(super) fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b.first() != Some(&b'-')
        && b.last() != Some(&b'-')
}

/// DNS labels joined by dots, at most 253 characters.
pub(super) fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// A C identifier: `[A-Za-z_][A-Za-z0-9_]*`.
fn is_c_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// What is wrong with an attribute or capacity name (`[<domain>/]<C identifier>`), if anything.
fn check_qualified_name(name: &str) -> Option<String> {
    let (domain, id) = match name.split_once('/') {
        Some((domain, id)) => (Some(domain), id),
        None => (None, name),
    };
    if let Some(domain) = domain
        && (domain.len() > 63 || !is_dns_subdomain(domain))
    {
        return Some(
            "the domain must be a lowercase RFC 1123 subdomain of at most 63 characters".into(),
        );
    }
    if id.len() > MAX_IDENTIFIER_LENGTH {
        return Some(format!(
            "the name must be at most {MAX_IDENTIFIER_LENGTH} characters"
        ));
    }
    if !is_c_identifier(id) {
        return Some(
            "a valid C identifier must start with alphabetic character or '_', followed by a string of \
             alphanumeric characters or '_'"
                .into(),
        );
    }
    None
}

/// What is wrong with a label key (`[<prefix>/]<name>`, as a taint's key), if anything.
fn check_label_key(key: &str) -> Option<String> {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix
        && !is_dns_subdomain(prefix)
    {
        return Some("prefix part must be a lowercase RFC 1123 subdomain".into());
    }
    if name.is_empty() || !is_label_value(name) {
        return Some(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with \
             an alphanumeric character (at most 63 characters)"
                .into(),
        );
    }
    None
}

/// Empty, or `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?` of at most 63 characters.
fn is_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    b.is_empty()
        || (b.len() <= 63
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
            && b.first().is_some_and(u8::is_ascii_alphanumeric)
            && b.last().is_some_and(u8::is_ascii_alphanumeric))
}

/// Semantic Versioning 2.0.0, strictly: `MAJOR.MINOR.PATCH[-pre][+build]`, no leading zeros in numbers.
pub(super) fn is_semver(v: &str) -> bool {
    let (rest, build) = match v.split_once('+') {
        Some((rest, build)) => (rest, Some(build)),
        None => (v, None),
    };
    let (core, pre) = match rest.split_once('-') {
        Some((core, pre)) => (core, Some(pre)),
        None => (rest, None),
    };
    let numeric = |s: &str| {
        !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit()) && (s == "0" || !s.starts_with('0'))
    };
    let identifier =
        |s: &str| !s.is_empty() && s.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-');
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3
        && parts.iter().all(|p| numeric(p))
        && pre.is_none_or(|pre| {
            pre.split('.').all(|id| {
                identifier(id) && (!id.bytes().all(|c| c.is_ascii_digit()) || numeric(id))
            })
        })
        && build.is_none_or(|b| b.split('.').all(identifier))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_checked_as_semver_two() {
        for good in [
            "1.2.3",
            "0.0.0",
            "12.0.1-rc.1",
            "1.0.0-alpha+001",
            "1.0.0+20130313144700",
        ] {
            assert!(is_semver(good), "{good}");
        }
        for bad in [
            "1.2",
            "v1.2.3",
            "01.2.3",
            "1.2.3-",
            "1.2.3-01",
            "1.2.3+",
            "580.65.06",
            "",
        ] {
            assert!(!is_semver(bad), "{bad}");
        }
    }

    #[test]
    fn query_parameters_are_percent_decoded() {
        let params = query_params(
            "fieldSelector=spec.nodeName%3Dnode-a%2Cspec.driver%3Dgpu.example.com&watch=true",
        );
        assert_eq!(
            params.get("fieldSelector").map(String::as_str),
            Some("spec.nodeName=node-a,spec.driver=gpu.example.com")
        );
        assert_eq!(params.get("watch").map(String::as_str), Some("true"));
    }
}
