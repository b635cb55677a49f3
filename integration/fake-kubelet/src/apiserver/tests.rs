//! The fake API server's resource.k8s.io/v1 side, through the client the plugin uses (kube-rs).

use std::time::Duration;

use futures_util::StreamExt as _;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, PostParams, WatchEvent, WatchParams,
};
use kube::runtime::watcher;
use serde_json::{Value, json};

use super::{AllocationResult, FakeApiServer};

const WAIT: Duration = Duration::from_secs(10);

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: "resource.k8s.io".into(),
        version: "v1".into(),
        api_version: "resource.k8s.io/v1".into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

fn client(api: &FakeApiServer) -> Result<kube::Client, Box<dyn std::error::Error>> {
    let config = kube::Config::new(api.url().parse()?);
    Ok(kube::Client::try_from(config)?)
}

fn slices(api: &FakeApiServer) -> Result<Api<DynamicObject>, Box<dyn std::error::Error>> {
    Ok(Api::all_with(
        client(api)?,
        &resource("ResourceSlice", "resourceslices"),
    ))
}

fn device(name: &str) -> Value {
    json!({"name": name, "attributes": {
        "type": {"string": "gpu"},
        "gpu.example.com/driverVersion": {"version": "580.65.6"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
        "index": {"int": 0},
        "healthy": {"bool": true},
    }, "capacity": {"memory": {"value": "80Gi"}}})
}

fn slice(name: &str, node: &str, devices: Vec<Value>) -> DynamicObject {
    DynamicObject::new(name, &resource("ResourceSlice", "resourceslices")).data(json!({
        "spec": {
            "driver": "gpu.example.com",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        }
    }))
}

fn api_error(result: Result<DynamicObject, kube::Error>) -> (u16, String) {
    match result {
        Err(kube::Error::Api(status)) => (status.code, status.message),
        other => (0, format!("{other:?}")),
    }
}

#[tokio::test]
async fn a_slice_made_with_generate_name_gets_its_name_uid_and_resource_version() -> TestResult {
    let server = FakeApiServer::start().await?;
    let api = slices(&server)?;
    let mut wanted = slice("", "node-a", vec![device("gpu-0")]);
    wanted.metadata.generate_name = Some("node-a-gpu.example.com-".into());
    wanted.metadata.owner_references = Some(vec![
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: "node-a".into(),
            uid: "uid-node-node-a".into(),
            controller: Some(true),
            ..Default::default()
        },
    ]);
    let made = api.create(&PostParams::default(), &wanted).await?;
    let name = made.metadata.name.clone().unwrap_or_default();
    let suffix = name.strip_prefix("node-a-gpu.example.com-").unwrap_or("");
    assert_eq!(suffix.len(), 5, "{name}");
    assert!(made.metadata.uid.is_some() && made.metadata.resource_version.is_some());
    let read = api.get(&name).await?;
    assert_eq!(
        read.metadata.owner_references,
        wanted.metadata.owner_references
    );
    assert_eq!(read.data["spec"]["devices"][0]["name"], "gpu-0");
    assert_eq!(server.slices().len(), 1);
    Ok(())
}

#[tokio::test]
async fn slices_the_api_server_would_refuse_are_invalid_naming_the_field() -> TestResult {
    let server = FakeApiServer::start().await?;
    let api = slices(&server)?;
    let many = |n: usize, taints: bool| {
        (0..n)
            .map(|i| {
                let mut d = json!({"name": format!("gpu-{i}")});
                if taints {
                    d["taints"] = json!([{"key": "gpu.example.com/xid", "effect": "NoSchedule"}]);
                }
                d
            })
            .collect::<Vec<_>>()
    };
    let attributes = |n: usize| {
        let mut d = json!({"name": "gpu-0", "attributes": {}});
        for i in 0..n {
            d["attributes"][format!("a{i}")] = json!({"int": i});
        }
        d
    };
    type Mutation = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(&str, Mutation)> = vec![
        (
            "spec.driver: Required value",
            Box::new(|s| s["spec"]["driver"] = Value::Null),
        ),
        (
            "spec.pool.name: Required value",
            Box::new(|s| s["spec"]["pool"]["name"] = json!("")),
        ),
        (
            "spec.pool.generation: Required value",
            Box::new(|s| s["spec"]["pool"]["generation"] = Value::Null),
        ),
        (
            "spec.pool.resourceSliceCount",
            Box::new(|s| s["spec"]["pool"]["resourceSliceCount"] = json!(0)),
        ),
        (
            "multiple fields are set",
            Box::new(|s| s["spec"]["allNodes"] = json!(true)),
        ),
        (
            "exactly one of `nodeName`",
            Box::new(|s| s["spec"]["nodeName"] = Value::Null),
        ),
        (
            "spec.devices: Too many: 129",
            Box::new(move |s| s["spec"]["devices"] = json!(many(129, false))),
        ),
        (
            "spec.devices: Too many: 65",
            Box::new(move |s| s["spec"]["devices"] = json!(many(65, true))),
        ),
        (
            "spec.devices[0].name",
            Box::new(|s| s["spec"]["devices"][0]["name"] = json!("GPU_0")),
        ),
        (
            "spec.devices[1].name: Duplicate value",
            Box::new(|s| s["spec"]["devices"] = json!([{"name": "a"}, {"name": "a"}])),
        ),
        (
            "spec.devices[0]: Too many: 33",
            Box::new(move |s| s["spec"]["devices"] = json!([attributes(33)])),
        ),
        (
            "spec.devices[0].attributes[gpu.example.com/not-a-c-identifier]",
            Box::new(|s| {
                s["spec"]["devices"][0]["attributes"]["gpu.example.com/not-a-c-identifier"] =
                    json!({"int": 1});
            }),
        ),
        (
            "spec.devices[0].attributes[a_name_that_is_longer_than_32_chars]",
            Box::new(|s| {
                s["spec"]["devices"][0]["attributes"]["a_name_that_is_longer_than_32_chars"] =
                    json!({"int": 1});
            }),
        ),
        (
            "spec.devices[0].attributes[type]: Invalid value",
            Box::new(|s| {
                s["spec"]["devices"][0]["attributes"]["type"] = json!({"string": "gpu", "int": 1});
            }),
        ),
        (
            "spec.devices[0].attributes[type]: Required value",
            Box::new(|s| {
                s["spec"]["devices"][0]["attributes"]["type"] = json!({});
            }),
        ),
        (
            "spec.devices[0].attributes[type].string: Too long",
            Box::new(|s| {
                s["spec"]["devices"][0]["attributes"]["type"] = json!({"string": "x".repeat(65)});
            }),
        ),
        (
            "spec.devices[0].attributes[gpu.example.com/driverVersion].version",
            Box::new(|s| {
                s["spec"]["devices"][0]["attributes"]["gpu.example.com/driverVersion"] =
                    json!({"version": "580.65.06"});
            }),
        ),
        (
            "spec.devices[0].taints: Too many: 17",
            Box::new(|s| {
                s["spec"]["devices"][0]["taints"] = json!(
                    (0..17)
                        .map(|i| json!({"key": format!("k{i}"), "effect": "None"}))
                        .collect::<Vec<_>>()
                );
            }),
        ),
        (
            "spec.devices[0].taints[0].effect: Unsupported value: \"Evict\"",
            Box::new(|s| {
                s["spec"]["devices"][0]["taints"] = json!([{"key": "k", "effect": "Evict"}]);
            }),
        ),
    ];
    for (i, (field, mutate)) in cases.iter().enumerate() {
        let mut object =
            serde_json::to_value(slice(&format!("bad-{i}"), "node-a", vec![device("gpu-0")]))?;
        mutate(&mut object);
        let object: DynamicObject = serde_json::from_value(object)?;
        let (code, message) = api_error(api.create(&PostParams::default(), &object).await);
        assert_eq!(code, 422, "{field}: {message}");
        assert!(message.contains(field), "wanted {field:?} in {message:?}");
    }
    assert!(server.slices().is_empty());
    // The limits themselves are fine.
    let mut edge = slice("edge", "node-a", many(64, true));
    edge.data["spec"]["devices"][0]["taints"] = json!(
        (0..16)
            .map(|i| json!({"key": format!("k{i}"), "effect": "None"}))
            .collect::<Vec<_>>()
    );
    api.create(&PostParams::default(), &edge).await?;
    api.create(
        &PostParams::default(),
        &slice("full", "node-a", many(128, false)),
    )
    .await?;
    api.create(
        &PostParams::default(),
        &slice("attrs", "node-a", vec![attributes(32)]),
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn an_update_from_a_stale_resource_version_is_a_conflict() -> TestResult {
    let server = FakeApiServer::start().await?;
    let api = slices(&server)?;
    let made = api
        .create(
            &PostParams::default(),
            &slice("s", "node-a", vec![device("gpu-0")]),
        )
        .await?;
    let mut newer = made.clone();
    newer.data["spec"]["pool"]["generation"] = json!(2);
    let updated = api.replace("s", &PostParams::default(), &newer).await?;
    assert_ne!(
        updated.metadata.resource_version,
        made.metadata.resource_version
    );
    assert_eq!(updated.metadata.generation, Some(2), "the spec changed");
    let (code, message) = api_error(api.replace("s", &PostParams::default(), &made).await);
    assert_eq!(code, 409, "{message}");
    assert!(
        message.contains("the object has been modified"),
        "{message}"
    );
    Ok(())
}

#[tokio::test]
async fn the_watcher_sees_its_nodes_slices_come_change_and_go() -> TestResult {
    let server = FakeApiServer::start().await?;
    let api = slices(&server)?;
    api.create(&PostParams::default(), &slice("before", "node-a", vec![]))
        .await?;
    for (round, config) in [
        watcher::Config::default(),
        watcher::Config::default().streaming_lists(),
    ]
    .into_iter()
    .enumerate()
    {
        let mut events =
            std::pin::pin!(watcher(api.clone(), config.fields("spec.nodeName=node-a")));
        let mut next = async || match tokio::time::timeout(WAIT, events.next()).await {
            Ok(Some(Ok(event))) => Ok(event),
            other => Err(format!("no event: {other:?}")),
        };
        let mut initial = Vec::new();
        loop {
            match next().await? {
                watcher::Event::InitApply(o) => initial.extend(o.metadata.name),
                watcher::Event::InitDone => break,
                _ => {}
            }
        }
        assert_eq!(initial, vec!["before".to_string()]);
        api.create(
            &PostParams::default(),
            &slice(&format!("other-node-{round}"), "node-b", vec![]),
        )
        .await?;
        let made = api
            .create(&PostParams::default(), &slice("mine", "node-a", vec![]))
            .await?;
        let mut changed = made.clone();
        changed.data["spec"]["pool"]["generation"] = json!(2);
        api.replace("mine", &PostParams::default(), &changed)
            .await?;
        api.delete("mine", &DeleteParams::default()).await?;
        let mut seen = Vec::new();
        while seen.len() < 3 {
            match next().await? {
                watcher::Event::Apply(o) => {
                    seen.push(("apply", o.data["spec"]["pool"]["generation"].clone()))
                }
                watcher::Event::Delete(o) => {
                    seen.push(("delete", o.data["spec"]["pool"]["generation"].clone()))
                }
                _ => {}
            }
        }
        assert_eq!(
            seen,
            vec![
                ("apply", json!(1)),
                ("apply", json!(2)),
                ("delete", json!(2))
            ]
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_watch_resumes_from_a_resource_version_until_the_history_is_compacted() -> TestResult {
    let server = FakeApiServer::start().await?;
    let api = slices(&server)?;
    api.create(&PostParams::default(), &slice("old", "node-a", vec![]))
        .await?;
    let listed = api.list(&ListParams::default()).await?;
    let version = listed.metadata.resource_version.unwrap_or_default();
    api.create(&PostParams::default(), &slice("new", "node-a", vec![]))
        .await?;
    let first =
        async |version: &str| -> Result<WatchEvent<DynamicObject>, Box<dyn std::error::Error>> {
            let events = api.watch(&WatchParams::default(), version).await?;
            let mut events = std::pin::pin!(events);
            match tokio::time::timeout(WAIT, events.next()).await {
                Ok(Some(event)) => Ok(event?),
                other => Err(format!("no event: {other:?}").into()),
            }
        };
    match first(&version).await? {
        WatchEvent::Added(o) => assert_eq!(o.metadata.name.as_deref(), Some("new")),
        other => panic!("{other:?}"),
    }
    server.compact_slice_history();
    match first(&version).await? {
        WatchEvent::Error(status) => assert_eq!(status.code, 410, "{status:?}"),
        other => panic!("{other:?}"),
    }
    Ok(())
}

#[tokio::test]
async fn without_the_device_taints_gate_taints_are_dropped_silently() -> TestResult {
    let server = FakeApiServer::start().await?;
    let api = slices(&server)?;
    server.drop_device_taints(true);
    let mut tainted = slice("s", "node-a", vec![device("gpu-0")]);
    tainted.data["spec"]["devices"][0]["taints"] =
        json!([{"key": "gpu.example.com/xid", "value": "79", "effect": "NoSchedule"}]);
    let made = api.create(&PostParams::default(), &tainted).await?;
    assert!(made.data["spec"]["devices"][0].get("taints").is_none());
    assert!(
        server.slices()[0]["spec"]["devices"][0]
            .get("taints")
            .is_none()
    );
    server.drop_device_taints(false);
    let mut again = api.get("s").await?;
    again.data["spec"]["devices"][0]["taints"] =
        tainted.data["spec"]["devices"][0]["taints"].clone();
    let kept = api.replace("s", &PostParams::default(), &again).await?;
    assert_eq!(kept.data["spec"]["devices"][0]["taints"][0]["value"], "79");
    Ok(())
}

#[tokio::test]
async fn wiping_a_node_deletes_its_slices_only_and_watches_see_them_go() -> TestResult {
    let server = FakeApiServer::start().await?;
    let api = slices(&server)?;
    for (name, node) in [("a-1", "node-a"), ("a-2", "node-a"), ("b-1", "node-b")] {
        api.create(&PostParams::default(), &slice(name, node, vec![]))
            .await?;
    }
    let listed = api
        .list(&ListParams::default().fields("spec.nodeName=node-a"))
        .await?;
    assert_eq!(listed.items.len(), 2);
    let version = listed.metadata.resource_version.unwrap_or_default();
    let events = api
        .watch(
            &WatchParams::default().fields("spec.nodeName=node-a"),
            &version,
        )
        .await?;
    let mut events = std::pin::pin!(events);
    assert_eq!(server.wipe_slices("node-a"), 2);
    for _ in 0..2 {
        let event = tokio::time::timeout(WAIT, events.next()).await;
        assert!(
            matches!(event, Ok(Some(Ok(WatchEvent::Deleted(_))))),
            "{event:?}"
        );
    }
    let left = server
        .wait_for_slices("node-b's slice alone", WAIT, |s| s.len() == 1)
        .await?;
    assert_eq!(left[0]["metadata"]["name"], "b-1");
    Ok(())
}

#[tokio::test]
async fn slices_are_selected_by_driver_and_labels_and_an_unknown_field_is_refused() -> TestResult {
    let server = FakeApiServer::start().await?;
    let api = slices(&server)?;
    let mut labelled = slice("labelled", "node-a", vec![]);
    labelled.metadata.labels = Some([("tier".to_string(), "gold".to_string())].into());
    api.create(&PostParams::default(), &labelled).await?;
    let mut other = slice("other-driver", "node-a", vec![]);
    other.data["spec"]["driver"] = json!("nic.example.com");
    api.create(&PostParams::default(), &other).await?;
    let names = |list: kube::core::ObjectList<DynamicObject>| {
        list.items
            .into_iter()
            .filter_map(|o| o.metadata.name)
            .collect::<Vec<_>>()
    };
    let by_driver = api
        .list(&ListParams::default().fields("spec.driver=nic.example.com,spec.nodeName=node-a"))
        .await?;
    assert_eq!(names(by_driver), vec!["other-driver".to_string()]);
    let by_label = api.list(&ListParams::default().labels("tier=gold")).await?;
    assert_eq!(names(by_label), vec!["labelled".to_string()]);
    let by_absence = api.list(&ListParams::default().labels("!tier")).await?;
    assert_eq!(names(by_absence), vec!["other-driver".to_string()]);
    let refused = api
        .list(&ListParams::default().fields("spec.pool.generation=1"))
        .await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(s)) if s.code == 400),
        "{refused:?}"
    );
    Ok(())
}

#[tokio::test]
async fn claims_are_served_allocated_and_missing_ones_are_404() -> TestResult {
    let server = FakeApiServer::start().await?;
    let claims: Api<DynamicObject> = Api::namespaced_with(
        client(&server)?,
        "default",
        &resource("ResourceClaim", "resourceclaims"),
    );
    let uid = server.add_claim(
        "default",
        "gpus",
        vec![
            AllocationResult::new("gpu", "gpu.example.com", "node-a", "gpu-0"),
            AllocationResult::new("gpu", "gpu.example.com", "node-a", "gpu-1"),
            AllocationResult::new("nic/fast", "nic.example.com", "node-a", "nic-0"),
        ],
    );
    let claim = claims.get("gpus").await?;
    assert_eq!(claim.metadata.uid.as_deref(), Some(uid.as_str()));
    let results = &claim.data["status"]["allocation"]["devices"]["results"];
    assert_eq!(
        results[1],
        json!({"request": "gpu", "driver": "gpu.example.com", "pool": "node-a", "device": "gpu-1"})
    );
    let requests = &claim.data["spec"]["devices"]["requests"];
    assert_eq!(requests[0]["name"], "gpu");
    assert_eq!(requests[0]["exactly"]["count"], 2);
    assert_eq!(requests[1]["firstAvailable"][0]["name"], "fast");
    assert!(server.deallocate_claim("default", "gpus"));
    assert!(
        claims.get("gpus").await?.data["status"]
            .get("allocation")
            .is_none()
    );
    assert!(server.delete_claim("default", "gpus"));
    let (code, message) = api_error(claims.get("gpus").await);
    assert_eq!(code, 404, "{message}");
    Ok(())
}

#[tokio::test]
async fn device_classes_are_kept_as_sent() -> TestResult {
    let server = FakeApiServer::start().await?;
    let classes: Api<DynamicObject> =
        Api::all_with(client(&server)?, &resource("DeviceClass", "deviceclasses"));
    let class = DynamicObject::new("gpu.example.com", &resource("DeviceClass", "deviceclasses")).data(
        json!({"spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.example.com'"}}]}}),
    );
    classes.create(&PostParams::default(), &class).await?;
    let read = classes.get("gpu.example.com").await?;
    assert_eq!(read.data["spec"], class.data["spec"]);
    assert_eq!(classes.list(&ListParams::default()).await?.items.len(), 1);
    let (code, _) = api_error(classes.create(&PostParams::default(), &class).await);
    assert_eq!(code, 409);
    assert_eq!(server.device_classes().len(), 1);
    Ok(())
}

#[tokio::test]
async fn the_kubelets_wipe_is_recorded_as_its_delete_collection() -> TestResult {
    let server = FakeApiServer::start().await?;
    let api = slices(&server)?;
    api.create(&PostParams::default(), &slice("s", "node-a", vec![]))
        .await?;
    assert_eq!(
        server.link().wipe_slices("node-a", Some("gpu.example.com")),
        1
    );
    let last = server.requests().pop();
    assert_eq!(
        last.map(|r| (r.method, r.path, r.query)),
        Some((
            "DELETE".into(),
            "/apis/resource.k8s.io/v1/resourceslices".into(),
            "fieldSelector=spec.nodeName%3Dnode-a%2Cspec.driver%3Dgpu.example.com".into()
        ))
    );
    Ok(())
}

#[tokio::test]
async fn resource_requests_are_refused_while_forbidden_or_failing_as_any_other() -> TestResult {
    let server = FakeApiServer::start().await?;
    let api = slices(&server)?;
    server.forbid(true);
    let (code, _) = api_error(
        api.create(&PostParams::default(), &slice("s", "node-a", vec![]))
            .await,
    );
    assert_eq!(code, 403);
    let listed = api.list(&ListParams::default()).await;
    assert!(
        matches!(&listed, Err(kube::Error::Api(s)) if s.code == 403),
        "{listed:?}"
    );
    server.forbid(false);
    // kube-rs tries a 503 again by itself: the server answered 503, then the missing slice's 404.
    server.fail_next(1);
    let (code, _) = api_error(api.get("s").await);
    assert_eq!(code, 404);
    let statuses: Vec<u16> = server
        .requests()
        .iter()
        .filter(|r| r.path.ends_with("/resourceslices/s"))
        .map(|r| r.status)
        .collect();
    assert_eq!(statuses, vec![503, 404]);
    api.create(&PostParams::default(), &slice("s", "node-a", vec![]))
        .await?;
    assert_eq!(server.slices().len(), 1);
    Ok(())
}

#[tokio::test]
async fn claims_are_listed_across_namespaces_in_pages_as_the_api_server_gives_them() -> TestResult {
    let api = FakeApiServer::start().await?;
    for (namespace, name) in [("a", "one"), ("b", "two"), ("b", "three")] {
        api.add_claim(
            namespace,
            name,
            vec![AllocationResult::new(
                "gpu",
                "gpu.example.com",
                "node-a",
                "gpu-0",
            )],
        );
    }
    let claims: Api<DynamicObject> =
        Api::all_with(client(&api)?, &resource("ResourceClaim", "resourceclaims"));
    let first = claims.list(&ListParams::default().limit(2)).await?;
    assert_eq!(first.items.len(), 2);
    let token = first.metadata.continue_.clone().ok_or("a continue token")?;
    assert_eq!(first.metadata.remaining_item_count, Some(1));
    let rest = claims
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await?;
    assert_eq!(rest.items.len(), 1);
    assert!(rest.metadata.continue_.is_none_or(|c| c.is_empty()));
    let mut names: Vec<String> = first
        .items
        .iter()
        .chain(&rest.items)
        .filter_map(|c| c.metadata.name.clone())
        .collect();
    names.sort();
    assert_eq!(names, ["one", "three", "two"]);
    // A token that is not one the server gave is refused.
    let bad = claims
        .list(&ListParams::default().continue_token("not-a-token"))
        .await;
    assert!(matches!(bad, Err(kube::Error::Api(s)) if s.code == 400));
    Ok(())
}

#[tokio::test]
async fn a_slow_claims_list_answers_each_page_after_its_delay_and_nothing_else_waits() -> TestResult
{
    let server = FakeApiServer::start().await?;
    for name in ["one", "two", "three"] {
        server.add_claim(
            "a",
            name,
            vec![AllocationResult::new(
                "gpu",
                "gpu.example.com",
                "node-a",
                "gpu-0",
            )],
        );
    }
    let per_page = Duration::from_millis(300);
    server.slow_claim_lists(per_page);
    let claims: Api<DynamicObject> = Api::all_with(
        client(&server)?,
        &resource("ResourceClaim", "resourceclaims"),
    );
    let began = std::time::Instant::now();
    let first = claims.list(&ListParams::default().limit(2)).await?;
    let token = first.metadata.continue_.clone().ok_or("a continue token")?;
    let rest = claims
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await?;
    assert_eq!(first.items.len() + rest.items.len(), 3);
    // Two pages, each after its delay.
    assert!(began.elapsed() >= 2 * per_page, "{:?}", began.elapsed());
    // One claim, read on its own, is not part of the list: at once.
    let one: Api<DynamicObject> = Api::namespaced_with(
        client(&server)?,
        "a",
        &resource("ResourceClaim", "resourceclaims"),
    );
    let began = std::time::Instant::now();
    one.get("one").await?;
    assert!(began.elapsed() < per_page, "{:?}", began.elapsed());
    let pages = server
        .requests()
        .iter()
        .filter(|r| r.path == "/apis/resource.k8s.io/v1/resourceclaims")
        .count();
    assert_eq!(pages, 2);
    Ok(())
}
