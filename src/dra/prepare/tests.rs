use std::path::PathBuf;
use std::sync::Mutex as StdMutex;

use tokio::sync::watch;

use super::*;
use crate::devices::Inventory;
use crate::dra::claims::Allocated;

/// Claims as a test sets them; a read of one not set is "not found", and `fail` makes every read fail. A list
/// answers as the API server does: every claim allocated in the pool and reserved for a pod.
#[derive(Default)]
struct Claims {
    claims: StdMutex<HashMap<String, Claim>>,
    fail: StdMutex<Option<String>>,
    lists: std::sync::atomic::AtomicUsize,
    /// Lists wait for this to be notified, when set: a slow API server.
    gate: StdMutex<Option<Arc<tokio::sync::Notify>>>,
}

impl Claims {
    fn allocate(&self, name: &str, uid: &str, devices: &[(&str, &str, &str)]) {
        let allocated = devices
            .iter()
            .map(|(request, pool, device)| Allocated {
                request: request.to_string(),
                driver: "gpu.nvidia.com".into(),
                pool: pool.to_string(),
                device: device.to_string(),
            })
            .collect();
        let claim = Claim {
            namespace: "ns".into(),
            name: name.into(),
            uid: uid.into(),
            allocated: Some(allocated),
            config: Vec::new(),
            pods: Vec::new(),
        };
        self.claims.lock().expect("lock").insert(name.into(), claim);
    }

    /// Reserves claim `name` for a pod, as the scheduler does when it binds the pod.
    fn reserve(&self, name: &str) {
        if let Some(claim) = self.claims.lock().expect("lock").get_mut(name) {
            claim.pods.push(format!("{name}-pod"));
        }
    }
}

#[tonic::async_trait]
impl ClaimReader for Claims {
    async fn get(&self, _namespace: &str, name: &str) -> Result<Option<Claim>, String> {
        if let Some(why) = self.fail.lock().expect("lock").clone() {
            return Err(why);
        }
        Ok(self.claims.lock().expect("lock").get(name).cloned())
    }

    async fn allocated_in(
        &self,
        driver: &str,
        pool: &str,
    ) -> Result<crate::dra::claims::Listed, String> {
        if let Some(why) = self.fail.lock().expect("lock").clone() {
            return Err(why);
        }
        self.lists
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let gate = self.gate.lock().expect("lock").clone();
        if let Some(gate) = gate {
            gate.notified().await;
        }
        let claims = self.claims.lock().expect("lock");
        Ok(crate::dra::claims::Listed {
            claims: claims
                .values()
                .filter(|c| crate::dra::claims::holds_in(c, driver, pool))
                .cloned()
                .collect(),
            pages: 1,
        })
    }
}

struct Setup {
    _dir: tempfile::TempDir,
    state: PathBuf,
    devices: watch::Sender<Arc<Inventory>>,
    claims: Arc<Claims>,
}

fn inventory() -> Inventory {
    crate::dra::fixtures::gpus(2)
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().expect("dir");
    Setup {
        state: dir.path().to_path_buf(),
        _dir: dir,
        devices: watch::Sender::new(Arc::new(inventory())),
        claims: Arc::new(Claims::default()),
    }
}

impl Setup {
    fn preparer(&self) -> Preparer {
        let file = RecordFile::in_dir(&self.state);
        Preparer::new(
            PrepareConfig {
                driver: "gpu.nvidia.com".into(),
                pool: "node-a".into(),
                cdi_kind: "nvidia.com/gpu".into(),
            },
            self.devices.subscribe(),
            self.claims.clone(),
            file.load(None),
            file,
        )
    }
}

fn claim(name: &str, uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: "ns".into(),
        uid: uid.into(),
        name: name.into(),
    }
}

#[tokio::test]
async fn a_claim_is_prepared_with_its_gpus_uuid_as_cdi_id_and_answered_again_from_the_record() {
    let s = setup();
    s.claims
        .allocate("train", "u-1", &[("gpu", "node-a", "gpu-1")]);
    let preparer = s.preparer();
    let answer = preparer.prepare(vec![claim("train", "u-1")]).await;
    let devices = answer["u-1"].clone().expect("prepared");
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].device, "gpu-1");
    assert_eq!(devices[0].requests, vec!["gpu".to_string()]);
    assert_eq!(
        devices[0].cdi_device_ids,
        vec!["nvidia.com/gpu=GPU-1".to_string()]
    );

    // The API server is gone now: a repeated prepare (the kubelet retries) answers from the record, and so
    // does a new instance (a restart, or the other pod of a rolling update).
    *s.claims.fail.lock().expect("lock") = Some("connection refused".into());
    assert_eq!(
        preparer.prepare(vec![claim("train", "u-1")]).await["u-1"],
        Ok(devices.clone())
    );
    assert_eq!(
        s.preparer().prepare(vec![claim("train", "u-1")]).await["u-1"],
        Ok(devices)
    );
}

#[tokio::test]
async fn a_device_prepared_for_one_claim_is_refused_to_another_until_unprepared() {
    let s = setup();
    s.claims
        .allocate("first", "u-1", &[("gpu", "node-a", "gpu-0")]);
    s.claims
        .allocate("second", "u-2", &[("gpu", "node-a", "gpu-0")]);
    let preparer = s.preparer();
    assert!(preparer.prepare(vec![claim("first", "u-1")]).await["u-1"].is_ok());
    let refused = preparer.prepare(vec![claim("second", "u-2")]).await["u-2"].clone();
    let why = refused.expect_err("held by the first claim");
    assert!(
        why.contains("ResourceClaim ns/first") && why.contains("gpu-0"),
        "{why}"
    );

    // After a restart too: the holder is in the record.
    let restarted = s.preparer();
    assert!(restarted.prepare(vec![claim("second", "u-2")]).await["u-2"].is_err());
    assert_eq!(
        restarted.unprepare(vec![claim("first", "u-1")]).await["u-1"],
        Ok(())
    );
    assert!(restarted.prepare(vec![claim("second", "u-2")]).await["u-2"].is_ok());
}

#[tokio::test]
async fn unpreparing_a_claim_never_prepared_succeeds() {
    let s = setup();
    let answer = s.preparer().unprepare(vec![claim("ghost", "u-9")]).await;
    assert_eq!(answer["u-9"], Ok(()));
}

#[tokio::test]
async fn each_claim_that_cannot_be_prepared_says_why_and_what_to_do() {
    let s = setup();
    s.claims
        .allocate("renewed", "u-new", &[("gpu", "node-a", "gpu-0")]);
    s.claims
        .allocate("elsewhere", "u-2", &[("gpu", "node-b", "gpu-0")]);
    s.claims
        .allocate("gone-gpu", "u-3", &[("gpu", "node-a", "gpu-7")]);
    s.claims.claims.lock().expect("lock").insert(
        "pending".into(),
        Claim {
            uid: "u-4".into(),
            allocated: None,
            ..Claim::default()
        },
    );
    let mut sick = inventory();
    sick.set_health(
        "GPU-1",
        Health::Unhealthy,
        Some("XID 79: the GPU fell off the bus".into()),
    );
    s.devices.send_replace(Arc::new(sick));
    s.claims
        .allocate("sick", "u-5", &[("gpu", "node-a", "gpu-1")]);

    let answer = s
        .preparer()
        .prepare(vec![
            claim("renewed", "u-old"),
            claim("elsewhere", "u-2"),
            claim("gone-gpu", "u-3"),
            claim("pending", "u-4"),
            claim("sick", "u-5"),
            claim("missing", "u-6"),
        ])
        .await;
    let why = |uid: &str| answer[uid].clone().expect_err("refused");
    assert!(
        why("u-old").contains("deleted and made again"),
        "{}",
        why("u-old")
    );
    assert!(
        why("u-2").contains("allocated for another node"),
        "{}",
        why("u-2")
    );
    assert!(why("u-3").contains("does not publish"), "{}", why("u-3"));
    assert!(why("u-4").contains("not allocated yet"), "{}", why("u-4"));
    assert!(why("u-5").contains("Unhealthy: XID 79"), "{}", why("u-5"));
    assert!(
        why("u-6").contains("not in the API server"),
        "{}",
        why("u-6")
    );
    assert_eq!(answer.len(), 6, "every claim has its answer");
}

#[tokio::test]
async fn a_claim_whose_device_configuration_asks_for_what_this_plugin_does_not_do_is_refused_and_nothing_held()
 {
    use crate::dra::device_config::{API_VERSION, AllocatedConfig, Opaque};
    let s = setup();
    let configure = |name: &str, uid: &str, sharing: serde_json::Value| {
        s.claims.allocate(name, uid, &[("gpu", "node-a", "gpu-0")]);
        let mut claims = s.claims.claims.lock().expect("lock");
        let claim = claims.get_mut(name).expect("just made");
        claim.config = vec![AllocatedConfig {
            source: "FromClaim".into(),
            requests: Vec::new(),
            opaque: Some(Opaque {
                driver: "gpu.nvidia.com".into(),
                parameters: serde_json::json!({
                    "apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": sharing
                })
                .into(),
            }),
        }];
    };
    configure("mps", "u-1", serde_json::json!({"strategy": "MPS"}));
    configure(
        "shared",
        "u-2",
        serde_json::json!({"strategy": "TimeSlicing"}),
    );
    let preparer = s.preparer();
    let refused = preparer.prepare(vec![claim("mps", "u-1")]).await["u-1"].clone();
    let why = refused.expect_err("MPS is not served");
    assert!(
        why.starts_with("ResourceClaim ns/mps: request \"gpu\" has a GpuConfig that asks for MPS"),
        "{why}"
    );
    // Nothing was held for it: the GPU goes to the next claim, whose configuration asks for nothing.
    let devices = preparer.prepare(vec![claim("shared", "u-2")]).await["u-2"].clone();
    assert_eq!(devices.expect("prepared")[0].device, "gpu-0");
}

#[tokio::test]
async fn an_api_server_that_fails_fails_the_claim_and_records_nothing() {
    let s = setup();
    s.claims
        .allocate("train", "u-1", &[("gpu", "node-a", "gpu-0")]);
    *s.claims.fail.lock().expect("lock") = Some("503 Service Unavailable".into());
    let preparer = s.preparer();
    let why = preparer.prepare(vec![claim("train", "u-1")]).await["u-1"]
        .clone()
        .expect_err("failed");
    assert!(why.contains("503") && why.contains("asks again"), "{why}");
    *s.claims.fail.lock().expect("lock") = None;
    assert!(preparer.prepare(vec![claim("train", "u-1")]).await["u-1"].is_ok());
}

#[tokio::test]
async fn a_record_that_cannot_be_written_hands_nothing_out() {
    let s = setup();
    s.claims
        .allocate("train", "u-1", &[("gpu", "node-a", "gpu-0")]);
    let blocked = s.state.join("not-a-dir");
    std::fs::write(&blocked, "").expect("file");
    let preparer = Preparer::new(
        PrepareConfig {
            driver: "gpu.nvidia.com".into(),
            pool: "node-a".into(),
            cdi_kind: "nvidia.com/gpu".into(),
        },
        s.devices.subscribe(),
        s.claims.clone(),
        Record::new(None),
        RecordFile::in_dir(&blocked),
    );
    let why = preparer.prepare(vec![claim("train", "u-1")]).await["u-1"]
        .clone()
        .expect_err("not recorded, not handed out");
    // Said (the record's lock beside it cannot be made either), and to be asked again.
    assert!(
        why.contains("prepared-claim record") && why.contains("the kubelet asks again"),
        "{why}"
    );
    // Nothing was kept either: the same device is free for another claim once the record works.
    assert!(preparer.record.lock().await.record.claims.is_empty());
}

#[tokio::test]
async fn two_requests_on_one_device_list_the_device_once_with_both() {
    let s = setup();
    s.claims.allocate(
        "pair",
        "u-1",
        &[
            ("a", "node-a", "gpu-0"),
            ("b", "node-a", "gpu-0"),
            ("c", "node-a", "gpu-1"),
        ],
    );
    let devices = s.preparer().prepare(vec![claim("pair", "u-1")]).await["u-1"]
        .clone()
        .expect("prepared");
    assert_eq!(devices.len(), 2);
    assert_eq!(devices[0].requests, vec!["a".to_string(), "b".to_string()]);
}

#[tokio::test]
async fn both_api_versions_answer_every_claim_by_uid_with_its_devices_or_its_error() {
    let s = setup();
    s.claims
        .allocate("train", "u-1", &[("gpu", "node-a", "gpu-0")]);
    let preparer = s.preparer();
    let claims = vec![
        v1beta1::Claim {
            namespace: "ns".into(),
            uid: "u-1".into(),
            name: "train".into(),
        },
        v1beta1::Claim {
            namespace: "ns".into(),
            uid: "u-2".into(),
            name: "missing".into(),
        },
    ];
    let answer = v1beta1::dra_plugin_server::DraPlugin::node_prepare_resources(
        &preparer,
        Request::new(v1beta1::NodePrepareResourcesRequest {
            claims: claims.clone(),
        }),
    )
    .await
    .expect("answered")
    .into_inner();
    let prepared = &answer.claims["u-1"];
    assert_eq!(prepared.error, "");
    assert_eq!(prepared.devices[0].device_name, "gpu-0");
    assert_eq!(prepared.devices[0].pool_name, "node-a");
    assert_eq!(
        prepared.devices[0].cdi_device_ids,
        vec!["nvidia.com/gpu=GPU-0".to_string()]
    );
    assert!(answer.claims["u-2"].error.contains("not in the API server"));

    // v1 answers the same from the record, and unprepares by UID.
    let v1_claims: Vec<v1::Claim> = claims
        .iter()
        .map(|c| v1::Claim {
            namespace: c.namespace.clone(),
            uid: c.uid.clone(),
            name: c.name.clone(),
        })
        .collect();
    let again = v1::dra_plugin_server::DraPlugin::node_prepare_resources(
        &preparer,
        Request::new(v1::NodePrepareResourcesRequest {
            claims: v1_claims.clone(),
        }),
    )
    .await
    .expect("answered")
    .into_inner();
    assert_eq!(again.claims["u-1"].devices[0].device_name, "gpu-0");
    assert_eq!(again.claims["u-1"].devices[0].share_id, None);
    let gone = v1::dra_plugin_server::DraPlugin::node_unprepare_resources(
        &preparer,
        Request::new(v1::NodeUnprepareResourcesRequest { claims: v1_claims }),
    )
    .await
    .expect("answered")
    .into_inner();
    assert_eq!(gone.claims.len(), 2);
    assert!(gone.claims.values().all(|c| c.error.is_empty()));
}

#[tokio::test]
async fn a_call_no_kubelet_makes_is_refused_whole_with_sizes_and_nothing_of_it_echoed() {
    let s = setup();
    s.claims
        .allocate("train", "u-1", &[("gpu", "node-a", "gpu-0")]);
    let preparer = s.preparer();
    let huge = "a".repeat(1 << 20);
    let one = |namespace: &str, name: &str, uid: &str| v1::Claim {
        namespace: namespace.into(),
        uid: uid.into(),
        name: name.into(),
    };
    let refusals = [
        (vec![one("ns", &huge, "u-1")], "name (1048576 bytes)"),
        (
            vec![one(&huge, "train", "u-1")],
            "namespace (1048576 bytes)",
        ),
        (vec![one("ns", "train", &huge)], "UID (1048576 bytes)"),
        (vec![one("ns", "train", "u-1\n forged")], "UID (11 bytes)"),
        (vec![one("NS", "train", "u-1")], "namespace (2 bytes)"),
        (
            vec![one("ns", "train", "u-1"), one("ns", "Train_Gpu", "u-2")],
            "claim 2 of 2",
        ),
        (
            (0..=MAX_CLAIMS_PER_CALL)
                .map(|i| one("ns", "train", &format!("u-{i}")))
                .collect(),
            "129 claims in one call",
        ),
    ];
    for (claims, said) in refusals {
        for unprepare in [false, true] {
            let status = if unprepare {
                v1::dra_plugin_server::DraPlugin::node_unprepare_resources(
                    &preparer,
                    Request::new(v1::NodeUnprepareResourcesRequest {
                        claims: claims.clone(),
                    }),
                )
                .await
                .map(|_| ())
            } else {
                v1::dra_plugin_server::DraPlugin::node_prepare_resources(
                    &preparer,
                    Request::new(v1::NodePrepareResourcesRequest {
                        claims: claims.clone(),
                    }),
                )
                .await
                .map(|_| ())
            }
            .expect_err("refused");
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{said}");
            assert!(
                status.message().contains(said) && status.message().len() < 200,
                "{}",
                status.message()
            );
        }
    }
    // Nothing was prepared by the refused calls, though one held a good claim.
    assert!(preparer.record.lock().await.record.claims.is_empty());
}

#[tokio::test]
async fn two_instances_on_one_state_directory_prepare_and_unprepare_from_one_record() {
    // The two pods of a rolling update, both started before either prepared anything.
    let s = setup();
    s.claims
        .allocate("train", "u-1", &[("gpu", "node-a", "gpu-0")]);
    s.claims
        .allocate("serve", "u-2", &[("gpu", "node-a", "gpu-0")]);
    let (old, new) = (s.preparer(), s.preparer());
    assert!(old.prepare(vec![claim("train", "u-1")]).await["u-1"].is_ok());
    // The new one sees the old one's claim: the device is refused to another claim, and the claim itself
    // is answered as prepared.
    let refused = new.prepare(vec![claim("serve", "u-2")]).await["u-2"].clone();
    assert!(
        refused
            .as_ref()
            .is_err_and(|why| why.contains("train") && why.contains("gpu-0")),
        "{refused:?}"
    );
    let again = new.prepare(vec![claim("train", "u-1")]).await["u-1"].clone();
    assert_eq!(again.map(|d| d[0].device.clone()), Ok("gpu-0".to_string()));
    // Unprepared through the new one, the old one sees the device free.
    assert!(new.unprepare(vec![claim("train", "u-1")]).await["u-1"].is_ok());
    let second = old.prepare(vec![claim("serve", "u-2")]).await["u-2"].clone();
    assert!(second.is_ok(), "{second:?}");
    // And the record on disk holds what both did.
    let on_disk = RecordFile::in_dir(&s.state).load(None);
    assert_eq!(on_disk.claims.keys().collect::<Vec<_>>(), vec!["u-2"]);
}

#[tokio::test]
async fn a_record_held_by_another_instance_past_the_wait_fails_the_call_and_hands_nothing_out() {
    let s = setup();
    s.claims
        .allocate("train", "u-1", &[("gpu", "node-a", "gpu-0")]);
    let preparer = s.preparer();
    // The other pod of a rolling update, stopped with the lock held.
    let held = RecordFile::in_dir(&s.state).lock().expect("lock");
    let why = preparer.prepare(vec![claim("train", "u-1")]).await["u-1"]
        .clone()
        .expect_err("not prepared while the record is held");
    assert!(
        why.contains("another instance") && why.contains("the kubelet asks again"),
        "{why}"
    );
    assert!(preparer.record.lock().await.record.claims.is_empty());
    // Given back, the same call goes through.
    drop(held);
    assert!(preparer.prepare(vec![claim("train", "u-1")]).await["u-1"].is_ok());
}

/// Makes the record at `state` unreadable as `how` says: garbage, a FIFO, a link, or a newer format.
fn spoil_record(state: &std::path::Path, how: &str) {
    let path = RecordFile::in_dir(state).path().to_path_buf();
    let _gone = std::fs::remove_file(&path);
    match how {
        "garbage" => std::fs::write(&path, "\u{0}\u{1}not json").expect("garbage"),
        "fifo" => rustix::fs::mknodat(
            rustix::fs::CWD,
            &path,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .expect("fifo"),
        "link" => {
            let target = state.join("elsewhere.json");
            std::fs::write(&target, r#"{"version":1,"claims":{}}"#).expect("target");
            std::os::unix::fs::symlink(&target, &path).expect("link");
        }
        _ => std::fs::write(&path, NEWER_RECORD).expect("newer"),
    }
}

/// A record as a later version of the plugin might write it.
const NEWER_RECORD: &str = r#"{"version":2,"claims":{"u-9":{"devicesByRequest":{}}},"leases":[]}"#;

#[tokio::test]
async fn a_record_made_unreadable_while_running_never_frees_the_gpu_a_claim_holds() {
    for how in ["garbage", "fifo", "link", "newer"] {
        let s = setup();
        s.claims
            .allocate("first", "u-1", &[("gpu", "node-a", "gpu-0")]);
        s.claims
            .allocate("second", "u-2", &[("gpu", "node-a", "gpu-0")]);
        let preparer = s.preparer();
        assert!(
            preparer.prepare(vec![claim("first", "u-1")]).await["u-1"].is_ok(),
            "{how}"
        );
        spoil_record(&s.state, how);
        let refused = preparer.prepare(vec![claim("second", "u-2")]).await["u-2"].clone();
        assert!(
            refused
                .as_ref()
                .is_err_and(|why| why.contains("ResourceClaim ns/first") && why.contains("gpu-0")),
            "{how}: {refused:?}"
        );
        // The claim itself is still answered with its GPU, and freed by its unprepare.
        let again = preparer.prepare(vec![claim("first", "u-1")]).await["u-1"].clone();
        assert_eq!(
            again.map(|d| d[0].device.clone()),
            Ok("gpu-0".to_string()),
            "{how}"
        );
        assert!(preparer.unprepare(vec![claim("first", "u-1")]).await["u-1"].is_ok());
        let second = preparer.prepare(vec![claim("second", "u-2")]).await["u-2"].clone();
        assert!(second.is_ok(), "{how}: {second:?}");
    }
}

#[tokio::test]
async fn a_record_of_a_newer_format_is_left_untouched_while_claims_are_served() {
    let s = setup();
    s.claims
        .allocate("first", "u-1", &[("gpu", "node-a", "gpu-0")]);
    s.claims
        .allocate("second", "u-2", &[("gpu", "node-a", "gpu-1")]);
    spoil_record(&s.state, "newer");
    let path = RecordFile::in_dir(&s.state).path().to_path_buf();
    // Started on it (a rollback while the newer pod still runs), and serving beside it.
    let preparer = s.preparer();
    assert!(preparer.prepare(vec![claim("first", "u-1")]).await["u-1"].is_ok());
    assert!(preparer.prepare(vec![claim("second", "u-2")]).await["u-2"].is_ok());
    assert!(preparer.unprepare(vec![claim("second", "u-2")]).await["u-2"].is_ok());
    assert_eq!(
        std::fs::read_to_string(&path).ok().as_deref(),
        Some(NEWER_RECORD),
        "written over"
    );
    let names: Vec<String> = std::fs::read_dir(&s.state)
        .expect("list")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("unreadable"))
        .collect();
    assert!(names.is_empty(), "set aside: {names:?}");
}

#[tokio::test(start_paused = true)]
async fn at_the_start_claims_the_api_server_has_on_the_pool_hold_their_gpus_whatever_the_record() {
    let s = setup();
    // Prepared by an instance whose record is gone (deleted, or set aside as unreadable).
    s.claims
        .allocate("first", "u-1", &[("gpu", "node-a", "gpu-0")]);
    s.claims.reserve("first");
    s.claims
        .allocate("second", "u-2", &[("gpu", "node-a", "gpu-0")]);
    spoil_record(&s.state, "garbage");
    let preparer = s.preparer();
    let refused = preparer.prepare(vec![claim("second", "u-2")]).await["u-2"].clone();
    assert!(
        refused
            .as_ref()
            .is_err_and(|why| why.contains("ResourceClaim ns/first") && why.contains("gpu-0")),
        "{refused:?}"
    );
    // The kubelet retries at once: refused again without another list of every claim.
    let lists = s.claims.lists.load(std::sync::atomic::Ordering::Relaxed);
    assert!(preparer.prepare(vec![claim("second", "u-2")]).await["u-2"].is_err());
    assert_eq!(
        s.claims.lists.load(std::sync::atomic::Ordering::Relaxed),
        lists
    );
    // The claim let its GPU go since (its pod ended, the claim deallocated): listed again (at most once a
    // second, as the kubelet retries), not a refusal for ever.
    s.claims.claims.lock().expect("lock").remove("first");
    tokio::time::advance(RELIST_AFTER).await;
    let second = preparer.prepare(vec![claim("second", "u-2")]).await["u-2"].clone();
    assert!(second.is_ok(), "{second:?}");
    // Listed once at the start and once for the look again; a prepare answered from the record lists
    // nothing.
    let lists = s.claims.lists.load(std::sync::atomic::Ordering::Relaxed);
    assert!(preparer.prepare(vec![claim("second", "u-2")]).await["u-2"].is_ok());
    assert_eq!(
        s.claims.lists.load(std::sync::atomic::Ordering::Relaxed),
        lists
    );
    assert_eq!(lists, 2);
}

#[tokio::test]
async fn no_claim_is_prepared_before_the_api_server_says_what_the_node_holds() {
    let s = setup();
    s.claims
        .allocate("train", "u-1", &[("gpu", "node-a", "gpu-0")]);
    *s.claims.fail.lock().expect("lock") = Some("403 Forbidden: list on resourceclaims".into());
    let why = s.preparer().prepare(vec![claim("train", "u-1")]).await["u-1"]
        .clone()
        .expect_err("not prepared");
    assert!(
        why.contains("which devices are prepared on this node")
            && why.contains("403")
            && why.contains("the kubelet asks again"),
        "{why}"
    );
}

/// A reader whose claim reads wait until released, counting how many are waiting at once.
#[derive(Default)]
struct HeldReads {
    inside: std::sync::atomic::AtomicUsize,
    release: tokio::sync::Notify,
}

#[tonic::async_trait]
impl ClaimReader for HeldReads {
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<Claim>, String> {
        use std::sync::atomic::Ordering;
        self.inside.fetch_add(1, Ordering::SeqCst);
        self.release.notified().await;
        self.inside.fetch_sub(1, Ordering::SeqCst);
        Ok(Some(Claim {
            namespace: namespace.into(),
            name: name.into(),
            uid: format!("u-{name}"),
            allocated: None,
            ..Claim::default()
        }))
    }

    async fn allocated_in(
        &self,
        _driver: &str,
        _pool: &str,
    ) -> Result<crate::dra::claims::Listed, String> {
        Ok(crate::dra::claims::Listed::default())
    }
}

#[tokio::test]
async fn a_flood_of_prepare_calls_is_served_a_few_at_a_time_and_every_call_answered() {
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().expect("dir");
    let reads = Arc::new(HeldReads::default());
    let devices = watch::Sender::new(Arc::new(inventory()));
    let preparer = Preparer::new(
        PrepareConfig {
            driver: "gpu.nvidia.com".into(),
            pool: "node-a".into(),
            cdi_kind: "nvidia.com/gpu".into(),
        },
        devices.subscribe(),
        reads.clone(),
        Record::new(None),
        RecordFile::in_dir(dir.path()),
    );
    // Calls of two claims each: the reads alone would let 4 calls in; the calls are held to 4 too, so at
    // most 4 calls' claims are being read or held at once.
    let calls: Vec<_> = (0..12)
        .map(|i| {
            let preparer = preparer.clone();
            tokio::spawn(async move {
                preparer
                    .prepare(vec![
                        claim(&format!("a{i}"), &format!("u-a{i}")),
                        claim(&format!("b{i}"), &format!("u-b{i}")),
                    ])
                    .await
            })
        })
        .collect();
    let wait = async {
        while reads.inside.load(Ordering::SeqCst) < MAX_READS {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(5), wait)
        .await
        .expect("reads under way");
    assert_eq!(
        preparer.prepares.available_permits(),
        0,
        "calls held to {MAX_PREPARES}"
    );
    assert_eq!(reads.inside.load(Ordering::SeqCst), MAX_READS);
    // Let every read through, in turn: each call gets its answer.
    let release = async {
        loop {
            reads.release.notify_waiters();
            tokio::task::yield_now().await;
        }
    };
    let answered = async {
        let mut answers = Vec::new();
        for call in calls {
            answers.push(call.await.expect("call"));
        }
        answers
    };
    let answers = tokio::select! {
        answers = answered => answers,
        () = release => unreachable!(),
    };
    assert_eq!(answers.len(), 12);
    for answer in answers {
        assert_eq!(answer.len(), 2);
        assert!(answer.values().all(|a| {
            a.as_ref()
                .is_err_and(|why| why.contains("not allocated yet"))
        }));
    }
    assert_eq!(preparer.prepares.available_permits(), MAX_PREPARES);
}

/// Replaces the record at `state` with `text` in one rename, as another writer would.
fn replace_record(state: &std::path::Path, text: &str) {
    let path = RecordFile::in_dir(state).path().to_path_buf();
    let temp = state.join(".replacement");
    std::fs::write(&temp, text).expect("write");
    std::fs::rename(&temp, &path).expect("rename");
}

#[tokio::test]
async fn a_readable_record_that_lacks_a_prepared_claim_never_frees_its_gpu_while_the_api_server_lists_it()
 {
    let replacements = [
        (
            "from another boot",
            r#"{"version":1,"bootId":"boot-0","claims":{}}"#,
        ),
        ("without a boot ID", r#"{"version":1,"claims":{}}"#),
        (
            "empty, of this boot",
            r#"{"version":1,"bootId":"boot-1","claims":{}}"#,
        ),
    ];
    for (which, text) in replacements {
        let s = setup();
        s.claims
            .allocate("first", "u-1", &[("gpu", "node-a", "gpu-0")]);
        s.claims.reserve("first");
        s.claims
            .allocate("second", "u-2", &[("gpu", "node-a", "gpu-0")]);
        let file = RecordFile::in_dir(&s.state);
        let preparer = Preparer::new(
            PrepareConfig {
                driver: "gpu.nvidia.com".into(),
                pool: "node-a".into(),
                cdi_kind: "nvidia.com/gpu".into(),
            },
            s.devices.subscribe(),
            s.claims.clone(),
            file.load(Some("boot-1".into())),
            file.clone(),
        );
        assert!(
            preparer.prepare(vec![claim("first", "u-1")]).await["u-1"].is_ok(),
            "{which}"
        );
        // The scheduler (wrongly, or a hostile writer) reserves B for a pod too.
        s.claims.reserve("second");
        replace_record(&s.state, text);
        let refused = preparer.prepare(vec![claim("second", "u-2")]).await["u-2"].clone();
        assert!(
            refused
                .as_ref()
                .is_err_and(|why| why.contains("ResourceClaim ns/first") && why.contains("gpu-0")),
            "{which}: claim B got claim A's GPU: {refused:?}"
        );
        // The record is written again holding A, never B; A is still answered with its GPU.
        let on_disk = file.load(Some("boot-1".into()));
        assert_eq!(
            on_disk.claims.keys().collect::<Vec<_>>(),
            vec!["u-1"],
            "{which}"
        );
        let again = preparer.prepare(vec![claim("first", "u-1")]).await["u-1"].clone();
        assert_eq!(
            again.map(|d| d[0].device.clone()),
            Ok("gpu-0".to_string()),
            "{which}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_list_slower_than_the_kubelets_deadline_refuses_in_time_goes_on_and_serves_the_retry() {
    use std::sync::atomic::Ordering;
    use std::time::Duration;
    let s = setup();
    s.claims
        .allocate("train", "u-1", &[("gpu", "node-a", "gpu-0")]);
    s.claims.reserve("train");
    let slow = Arc::new(tokio::sync::Notify::new());
    *s.claims.gate.lock().expect("lock") = Some(slow.clone());
    let preparer = s.preparer();
    // The kubelet gives each call 5 s; the plugin answers within 4 s, a refusal saying why.
    let call = |preparer: Preparer| async move {
        let until = tokio::time::Instant::now() + Duration::from_secs(4);
        tokio::time::timeout(
            Duration::from_secs(5),
            preparer.prepare_by(vec![claim("train", "u-1")], until),
        )
        .await
        .expect("answered before the kubelet's deadline")["u-1"]
            .clone()
    };
    for _ in 0..3 {
        let why = call(preparer.clone()).await.expect_err("not prepared yet");
        assert!(
            why.contains("is not done yet") && why.contains("the kubelet asks again"),
            "{why}"
        );
    }
    // One list for the three calls, going on without them.
    assert_eq!(s.claims.lists.load(Ordering::SeqCst), 1);
    slow.notify_one();
    // The kubelet's retry finds it done.
    let devices = call(preparer.clone()).await.expect("prepared");
    assert_eq!(devices[0].device, "gpu-0");
    assert_eq!(s.claims.lists.load(Ordering::SeqCst), 1);
}

#[test]
fn the_kubelets_deadline_is_read_from_the_grpc_timeout_header() {
    use std::time::Duration;
    assert_eq!(grpc_timeout("45S"), Some(Duration::from_secs(45)));
    assert_eq!(grpc_timeout("5000m"), Some(Duration::from_secs(5)));
    assert_eq!(grpc_timeout("2M"), Some(Duration::from_secs(120)));
    for bad in ["", "S", "123456789S", "5s", "-1S", "5"] {
        assert_eq!(grpc_timeout(bad), None, "{bad}");
    }
}
