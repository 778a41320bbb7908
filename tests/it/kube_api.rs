//! The Kubernetes API double (`support::kube_api`) against the real kube client: that it
//! answers as the real API server does where the gateway depends on it (conflicts,
//! RBAC, watches, garbage collection, bad requests), and that its node really runs pods.

use std::time::Duration;

use futures_util::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, PostParams, WatchEvent, WatchParams};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::support::kube_api::{netns_exists, Image, KubeApi, Options, Rule};
use crate::support::PATIENCE;

const NS: &str = "default";

fn api_error(result: Result<impl std::fmt::Debug, kube::Error>) -> kube::core::Status {
    match result {
        Err(kube::Error::Api(status)) => *status,
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn secret(name: &str, labels: Value) -> Secret {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "stringData": {"token": format!("secret of {name}")},
    }))
    .expect("a Secret")
}

fn lease(name: &str, holder: &str) -> Lease {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15},
    }))
    .expect("a Lease")
}

/// A pod of one container, run once; `spec` adds to the pod's spec and to its container
/// (`spec.containers[0]`).
fn pod(name: &str, image: &str, command: &[&str], mut spec: Value) -> Pod {
    spec["restartPolicy"] = json!("Never");
    if !spec["containers"].is_array() {
        spec["containers"] = json!([{}]);
    }
    let container = &mut spec["containers"][0];
    container["name"] = json!("main");
    container["image"] = json!(image);
    container["command"] = json!(command);
    serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).expect("a Pod")
}

#[tokio::test]
async fn objects_are_created_read_and_listed_by_label() {
    let double = KubeApi::start(Options::default()).await;
    let secrets: Api<Secret> = Api::namespaced(double.client().await, NS);
    let pp = PostParams::default();
    let a = secrets
        .create(
            &pp,
            &secret("a", json!({"app": "cellgate", "tier": "kernel"})),
        )
        .await
        .expect("create a");
    secrets
        .create(&pp, &secret("b", json!({"app": "cellgate"})))
        .await
        .expect("create b");
    secrets
        .create(&pp, &secret("c", json!({"app": "other"})))
        .await
        .expect("create c");

    // The server's metadata, and stringData folded into data.
    let metadata = &a.metadata;
    assert!(metadata.uid.as_deref().is_some_and(|u| u.len() == 36));
    assert!(metadata
        .resource_version
        .as_deref()
        .is_some_and(|rv| rv.parse::<u64>().is_ok()));
    assert!(metadata.creation_timestamp.is_some());
    assert_eq!(metadata.namespace.as_deref(), Some(NS));
    let got = secrets.get("a").await.expect("get a");
    assert_eq!(got.data.as_ref().expect("data")["token"].0, b"secret of a");
    assert!(got.string_data.is_none());
    assert_eq!(got.type_.as_deref(), Some("Opaque"));

    let names = |list: kube::core::ObjectList<Secret>| -> Vec<String> {
        list.items
            .into_iter()
            .filter_map(|s| s.metadata.name)
            .collect()
    };
    for (selector, expected) in [
        ("app=cellgate", &["a", "b"][..]),
        ("app!=cellgate", &["c"][..]),
        ("app=cellgate,tier", &["a"][..]),
        ("app in (other, none)", &["c"][..]),
        ("!tier", &["b", "c"][..]),
    ] {
        let listed = secrets
            .list(&ListParams::default().labels(selector))
            .await
            .expect("list");
        assert_eq!(names(listed), expected, "{selector}");
    }
    let by_name = secrets
        .list(&ListParams::default().fields("metadata.name=b"))
        .await
        .expect("list by field");
    assert_eq!(names(by_name), ["b"]);
    let error = api_error(secrets.list(&ListParams::default().labels("app=(")).await);
    assert_eq!((error.code, error.reason.as_str()), (400, "BadRequest"));

    // generateName makes a name; a missing object is 404 NotFound.
    let generated: Secret =
        serde_json::from_value(json!({"metadata": {"generateName": "kernel-"}})).expect("a Secret");
    let made = secrets
        .create(&pp, &generated)
        .await
        .expect("create generated");
    let made_name = made.metadata.name.expect("a generated name");
    assert!(made_name.starts_with("kernel-") && made_name.len() == "kernel-".len() + 5);
    let error = api_error(secrets.get("nope").await);
    assert_eq!((error.code, error.reason.as_str()), (404, "NotFound"));
    assert_eq!(error.message, "secrets \"nope\" not found");

    // Pages: `limit` and `continue`.
    let first = secrets
        .list(&ListParams::default().limit(3))
        .await
        .expect("a first page");
    let token = first.metadata.continue_.clone().expect("a continue token");
    assert_eq!(first.items.len(), 3);
    let rest = secrets
        .list(&ListParams::default().limit(3).continue_token(&token))
        .await
        .expect("the next page");
    assert_eq!(rest.items.len(), 1);
    assert!(rest.metadata.continue_.is_none());

    // deletecollection: what the selector names, and nothing else.
    secrets
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels("app=cellgate"),
        )
        .await
        .expect("delete a collection");
    let left = secrets.list(&ListParams::default()).await.expect("list");
    assert_eq!(left.items.len(), 2);

    // Counted: every request, with its verb.
    let requests = double.requests();
    assert!(requests.iter().any(|r| r.verb == "list"
        && r.path == "/api/v1/namespaces/default/secrets"
        && r.status == 200));
    assert_eq!(requests.iter().filter(|r| r.verb == "create").count(), 4);
}

#[tokio::test]
async fn a_second_create_of_a_name_is_409_already_exists() {
    let double = KubeApi::start(Options::default()).await;
    let leases: Api<Lease> = Api::namespaced(double.client().await, NS);
    leases
        .create(&PostParams::default(), &lease("owner", "gateway-0"))
        .await
        .expect("first create");
    let error = api_error(
        leases
            .create(&PostParams::default(), &lease("owner", "gateway-1"))
            .await,
    );
    assert_eq!((error.code, error.reason.as_str()), (409, "AlreadyExists"));
    assert_eq!(
        error.message,
        "leases.coordination.k8s.io \"owner\" already exists"
    );
}

#[tokio::test]
async fn replacing_with_a_stale_resource_version_is_409_conflict() {
    let double = KubeApi::start(Options::default()).await;
    let leases: Api<Lease> = Api::namespaced(double.client().await, NS);
    let created = leases
        .create(&PostParams::default(), &lease("owner", "gateway-0"))
        .await
        .expect("create");

    // Two replicas read the same version; the first write wins.
    let mut first = created.clone();
    first.spec.as_mut().expect("spec").holder_identity = Some("gateway-1".to_owned());
    let written = leases
        .replace("owner", &PostParams::default(), &first)
        .await
        .expect("the first replace");
    assert_ne!(
        written.metadata.resource_version,
        created.metadata.resource_version
    );
    let mut second = created.clone();
    second.spec.as_mut().expect("spec").holder_identity = Some("gateway-2".to_owned());
    let error = api_error(
        leases
            .replace("owner", &PostParams::default(), &second)
            .await,
    );
    assert_eq!((error.code, error.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        error.message,
        "Operation cannot be fulfilled on leases.coordination.k8s.io \"owner\": the object has been modified; please apply your changes to the latest version and try again"
    );
    let stored = leases.get("owner").await.expect("get");
    assert_eq!(
        stored.spec.expect("spec").holder_identity.as_deref(),
        Some("gateway-1")
    );

    // A merge patch naming the stale version conflicts too; one naming none applies.
    let stale = json!({"metadata": {"resourceVersion": created.metadata.resource_version}, "spec": {"holderIdentity": "x"}});
    let error = api_error(
        leases
            .patch(
                "owner",
                &Default::default(),
                &kube::api::Patch::Merge(&stale),
            )
            .await,
    );
    assert_eq!(error.code, 409);
    let patched = leases
        .patch(
            "owner",
            &Default::default(),
            &kube::api::Patch::Merge(&json!({"spec": {"leaseTransitions": 2}})),
        )
        .await
        .expect("patch");
    assert_eq!(patched.spec.expect("spec").lease_transitions, Some(2));

    // A write that changes nothing writes nothing (no new resourceVersion).
    let current = leases.get("owner").await.expect("get");
    let again = leases
        .replace("owner", &PostParams::default(), &current)
        .await
        .expect("a no-op replace");
    assert_eq!(
        again.metadata.resource_version,
        current.metadata.resource_version
    );
}

#[tokio::test]
async fn rbac_answers_403_in_kubernetes_words_and_401_without_a_token() {
    let double = KubeApi::start(Options::default()).await;
    double.add_user(
        "limited-token",
        "system:serviceaccount:default:gateway",
        vec![Rule::new(
            "coordination.k8s.io",
            &["leases"],
            &["get", "list"],
            &[NS],
        )],
    );
    let limited = double
        .client_for(&double.kubeconfig_for("limited-token", NS))
        .await;
    let leases: Api<Lease> = Api::namespaced(limited.clone(), NS);
    assert!(leases.list(&ListParams::default()).await.is_ok());
    let error = api_error(
        leases
            .create(&PostParams::default(), &lease("x", "y"))
            .await,
    );
    assert_eq!((error.code, error.reason.as_str()), (403, "Forbidden"));
    assert_eq!(
        error.message,
        "leases.coordination.k8s.io is forbidden: User \"system:serviceaccount:default:gateway\" cannot create resource \"leases\" in API group \"coordination.k8s.io\" in the namespace \"default\""
    );
    let pods: Api<Pod> = Api::namespaced(limited.clone(), NS);
    let error = api_error(
        pods.create(
            &PostParams::default(),
            &pod("p", "img", &["true"], json!({})),
        )
        .await,
    );
    assert_eq!(
        error.message,
        "pods is forbidden: User \"system:serviceaccount:default:gateway\" cannot create resource \"pods\" in API group \"\" in the namespace \"default\""
    );
    let error = api_error(pods.get("p").await);
    assert_eq!(
        error.message,
        "pods \"p\" is forbidden: User \"system:serviceaccount:default:gateway\" cannot get resource \"pods\" in API group \"\" in the namespace \"default\""
    );
    let everywhere: Api<Lease> = Api::all(limited);
    let error = api_error(everywhere.list(&ListParams::default()).await);
    assert!(
        error.message.ends_with("at the cluster scope"),
        "{}",
        error.message
    );

    // No token, or an unknown one: 401.
    let config = kube::Config::new(double.url().parse().expect("the double's URL"));
    let anonymous: Api<Lease> =
        Api::namespaced(kube::Client::try_from(config).expect("a client"), NS);
    let error = api_error(anonymous.list(&ListParams::default()).await);
    assert_eq!((error.code, error.reason.as_str()), (401, "Unauthorized"));
    let stranger = double
        .client_for(&double.kubeconfig_for("unknown-token", NS))
        .await;
    let error = api_error(Api::<Lease>::namespaced(stranger, NS).get("x").await);
    assert_eq!(error.code, 401);
}

#[tokio::test]
async fn a_watch_sees_changes_in_order_and_410_for_a_compacted_version() {
    let options = Options {
        event_history: 10,
        ..Options::default()
    };
    let double = KubeApi::start(options).await;
    let leases: Api<Lease> = Api::namespaced(double.client().await, NS);
    let start = leases
        .list(&ListParams::default())
        .await
        .expect("list")
        .metadata
        .resource_version
        .expect("a list resourceVersion");
    let mut stream = leases
        .watch(&WatchParams::default().timeout(20), &start)
        .await
        .expect("watch")
        .boxed();
    let created = leases
        .create(&PostParams::default(), &lease("l", "a"))
        .await
        .expect("create");
    let mut changed = created.clone();
    changed.spec.as_mut().expect("spec").holder_identity = Some("b".to_owned());
    leases
        .replace("l", &PostParams::default(), &changed)
        .await
        .expect("replace");
    leases
        .delete("l", &DeleteParams::default())
        .await
        .expect("delete");
    let mut seen = vec![];
    while seen.len() < 3 {
        let event = tokio::time::timeout(PATIENCE, stream.try_next())
            .await
            .expect("an event within a minute")
            .expect("a good event")
            .expect("the stream goes on");
        seen.push(match event {
            WatchEvent::Added(l) => ("ADDED", l.spec.and_then(|s| s.holder_identity)),
            WatchEvent::Modified(l) => ("MODIFIED", l.spec.and_then(|s| s.holder_identity)),
            WatchEvent::Deleted(l) => ("DELETED", l.spec.and_then(|s| s.holder_identity)),
            other => panic!("unexpected {other:?}"),
        });
    }
    let b = Some("b".to_owned());
    assert_eq!(
        seen,
        [
            ("ADDED", Some("a".to_owned())),
            ("MODIFIED", b.clone()),
            ("DELETED", b)
        ]
    );
    assert!(double.watch_events_sent() >= 3);
    assert!(double
        .requests()
        .iter()
        .any(|r| r.watch && r.verb == "watch"));

    // Push `start` out of the history: a watch from it is 410 Expired.
    for i in 0..12 {
        leases
            .create(&PostParams::default(), &lease(&format!("churn-{i}"), "x"))
            .await
            .expect("create");
    }
    let mut stream = leases
        .watch(&WatchParams::default(), &start)
        .await
        .expect("watch")
        .boxed();
    match stream
        .try_next()
        .await
        .expect("an event")
        .expect("one event")
    {
        WatchEvent::Error(status) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
        }
        other => panic!("expected 410 Expired, got {other:?}"),
    }
}

#[tokio::test]
async fn deleting_a_pod_collects_the_secret_it_owns() {
    let double = KubeApi::start(Options::default()).await;
    let client = double.client().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let secrets: Api<Secret> = Api::namespaced(client, NS);
    // The gateway's order: the pod, then its secret owned by the pod's uid. (The image is
    // unknown: the pod never runs, which does not matter here.)
    let pod = pods
        .create(
            &PostParams::default(),
            &pod("kernel-1", "absent", &["true"], json!({})),
        )
        .await
        .expect("create the pod");
    let uid = pod.metadata.uid.clone().expect("a uid");
    let mut owned = secret("kernel-1-key", json!({}));
    owned.metadata.owner_references = Some(vec![serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod", "name": "kernel-1", "uid": uid,
    }))
    .expect("an owner reference")]);
    secrets
        .create(&PostParams::default(), &owned)
        .await
        .expect("create the secret");
    secrets
        .create(&PostParams::default(), &secret("unowned", json!({})))
        .await
        .expect("create another");
    pods.delete("kernel-1", &DeleteParams::default())
        .await
        .expect("delete the pod");
    double
        .wait_until("the pod and its secret to be gone", PATIENCE, || {
            let gone = double.object("pods", NS, "kernel-1").is_none()
                && double.object("secrets", NS, "kernel-1-key").is_none();
            gone.then_some(())
        })
        .await;
    assert!(double.object("secrets", NS, "unowned").is_some());
}

#[tokio::test]
async fn a_body_that_is_not_the_resource_is_400() {
    let double = KubeApi::start(Options::default()).await;
    let http = reqwest::Client::new();
    let post = |path: &str, body: &str| {
        http.post(format!("{}{path}", double.url()))
            .bearer_auth(double.admin_token())
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
    };
    for (path, body) in [
        ("/api/v1/namespaces/default/pods", "{not json"),
        (
            "/api/v1/namespaces/default/pods",
            r#"{"kind": "Secret", "apiVersion": "v1", "metadata": {"name": "x"}}"#,
        ),
        (
            "/api/v1/namespaces/default/pods",
            r#"{"metadata": {"name": "x"}, "spec": {"containers": "one"}}"#,
        ),
        (
            "/apis/coordination.k8s.io/v1/namespaces/default/leases",
            r#"{"apiVersion": "v1", "kind": "Lease"}"#,
        ),
    ] {
        let response = post(path, body).await.expect("a response");
        assert_eq!(response.status(), 400, "{body}");
        let status: Value = response.json().await.expect("a Status");
        assert_eq!(status["kind"], "Status");
        assert_eq!(status["reason"], "BadRequest");
    }
    // Valid JSON of the right kind, but an invalid object: 422 Invalid.
    let response = post(
        "/api/v1/namespaces/default/secrets",
        r#"{"metadata": {"name": "Not_A_Name"}}"#,
    )
    .await
    .expect("a response");
    assert_eq!(response.status(), 422);
}

const ECHO_SERVER: &str = r#"
import json, os, socket
print("container up: uid", os.getuid(), "pid", os.getpid(), flush=True)
def status(key):
    return [l.split()[1] for l in open("/proc/self/status") if l.startswith(key + ":")][0]
def writable(path):
    try:
        open(os.path.join(path, "probe"), "w").close()
        return True
    except OSError:
        return False
def outside():
    try:
        socket.create_connection(("192.0.2.1", 80), timeout=2).close()
        return "reached"
    except OSError as e:
        return e.strerror
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 7070))
s.listen()
while True:
    c, _ = s.accept()
    line = c.makefile().readline().strip()
    st = os.statvfs("/scratch")
    reply = {"line": line, "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
             "pid": os.getpid(), "cap_eff": status("CapEff"), "no_new_privs": status("NoNewPrivs"),
             "hostname": socket.gethostname(), "root_writable": writable("/"),
             "scratch_writable": writable("/scratch"), "scratch_bytes": st.f_blocks * st.f_frsize,
             "token": os.path.exists("/var/run/secrets/kubernetes.io/serviceaccount/token"),
             "env": os.environ.get("MY_POD_IP", ""),
             "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
             "outside": outside()}
    c.sendall((json.dumps(reply) + "\n").encode())
    c.close()
"#;

async fn ask(ip: std::net::Ipv4Addr, line: &str) -> Value {
    let mut stream = tokio::net::TcpStream::connect((ip, 7070))
        .await
        .expect("the pod's port 7070 answers");
    stream
        .write_all(format!("{line}\n").as_bytes())
        .await
        .expect("write");
    let mut reply = String::new();
    BufReader::new(stream)
        .read_line(&mut reply)
        .await
        .expect("read");
    serde_json::from_str(&reply).expect("a JSON reply")
}

#[tokio::test]
async fn a_pod_runs_as_its_user_with_pid_1_and_an_ip_the_host_reaches() {
    // The image: the host's system directories and the server, at a path whose parents do
    // not exist on the host (they are made in the pod's mount namespace only).
    let scratch = tempfile::tempdir().expect("a temporary directory");
    let server = scratch.path().join("echo.py");
    std::fs::write(&server, ECHO_SERVER).expect("write the server");
    let image = Image::new().bind("/usr/local/lib/cellgate-test/echo.py", &server);
    let double = KubeApi::start(Options::default().image("echo:1", image)).await;
    let pods: Api<Pod> = Api::namespaced(double.client().await, NS);
    let mut events = pods
        .watch(&WatchParams::default().fields("metadata.name=echo"), "0")
        .await
        .expect("watch")
        .boxed();
    let spec = json!({
        "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000},
        "containers": [{
            "name": "main",
            "securityContext": {
                "allowPrivilegeEscalation": false,
                "capabilities": {"drop": ["ALL"]},
                "readOnlyRootFilesystem": true,
            },
            "env": [{"name": "MY_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
            "readinessProbe": {"tcpSocket": {"port": 7070}, "periodSeconds": 1},
        }],
        "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "16Mi"}}],
    });
    pods.create(
        &PostParams::default(),
        &pod(
            "echo",
            "echo:1",
            &["python3", "/usr/local/lib/cellgate-test/echo.py"],
            spec,
        ),
    )
    .await
    .expect("create");
    let running = double
        .wait_for_pod(NS, "echo", PATIENCE, "Ready", |p| {
            p["status"]["conditions"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
        })
        .await;
    assert_eq!(running["status"]["phase"], "Running", "{running:#}");
    let ip: std::net::Ipv4Addr = running["status"]["podIP"]
        .as_str()
        .expect("a pod IP")
        .parse()
        .expect("an IPv4 address");
    assert!(ip.octets()[..2] == [10, 244]);
    assert_eq!(double.pod_ip(NS, "echo"), Some(ip));

    let reply = ask(ip, "hello").await;
    assert_eq!(reply["line"], "hello");
    assert_eq!(reply["uid"], 1000);
    assert_eq!(reply["gid"], 1000);
    assert_eq!(reply["groups"], json!([2000]));
    assert_eq!(
        reply["pid"], 1,
        "the entrypoint is pid 1 of its pid namespace"
    );
    assert_eq!(reply["cap_eff"], "0000000000000000");
    assert_eq!(reply["no_new_privs"], "1");
    assert_eq!(reply["hostname"], "echo");
    assert_eq!(reply["root_writable"], false);
    assert_eq!(reply["scratch_writable"], true);
    assert_eq!(reply["scratch_bytes"], 16 * 1024 * 1024);
    assert_eq!(
        reply["token"], true,
        "the service account token is mounted by default"
    );
    assert_eq!(reply["env"], ip.to_string());
    assert_eq!(reply["pids"], json!([1]), "its own pid namespace");
    assert_eq!(
        reply["outside"], "Network is unreachable",
        "no route beyond its host end"
    );
    assert!(!std::path::Path::new("/usr/local/lib/cellgate-test").exists());
    assert!(double
        .pod_log(NS, "echo")
        .contains("container up: uid 1000 pid 1"));

    // Delete: SIGTERM (ignored by a pid 1 without a handler), SIGKILL after the grace
    // period, then the object goes; the process and the network namespace with it.
    let pid = double.pod_pid(NS, "echo").expect("the pod's pid");
    let netns = double.pod_netns(NS, "echo").expect("the pod's netns");
    assert!(netns_exists(&netns));
    pods.delete("echo", &DeleteParams::default().grace_period(1))
        .await
        .expect("delete");
    let mut kinds = vec![];
    loop {
        let event = tokio::time::timeout(PATIENCE, events.try_next())
            .await
            .expect("an event within a minute")
            .expect("a good event")
            .expect("the watch goes on");
        match event {
            WatchEvent::Added(_) => kinds.push("ADDED"),
            WatchEvent::Modified(_) => kinds.push("MODIFIED"),
            WatchEvent::Deleted(p) => {
                let status = p.status.expect("a status");
                assert_eq!(status.phase.as_deref(), Some("Failed"));
                let terminated = status.container_statuses.expect("statuses")[0]
                    .state
                    .clone()
                    .expect("a state")
                    .terminated
                    .expect("terminated");
                assert_eq!(terminated.exit_code, 137, "SIGKILL after the grace period");
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(kinds[0], "ADDED");
    assert!(!crate::support::alive(pid), "the pod's process is gone");
    assert!(!netns_exists(&netns), "the pod's network namespace is gone");
}

#[tokio::test]
async fn a_pod_of_an_unknown_image_stays_pending_in_image_pull_back_off() {
    let double = KubeApi::start(Options::default()).await;
    let pods: Api<Pod> = Api::namespaced(double.client().await, NS);
    // (A client's status is not written: the pod starts Pending whatever it says.)
    let mut unpullable = pod("nope", "registry.invalid/nope:1", &["true"], json!({}));
    unpullable.status =
        Some(serde_json::from_value(json!({"phase": "Running"})).expect("a status"));
    let created = pods
        .create(&PostParams::default(), &unpullable)
        .await
        .expect("create");
    assert_eq!(
        created.status.and_then(|s| s.phase).as_deref(),
        Some("Pending")
    );
    let stored = double
        .wait_for_pod(NS, "nope", PATIENCE, "ImagePullBackOff", |p| {
            p["status"]["containerStatuses"][0]["state"]["waiting"]["reason"] == "ImagePullBackOff"
        })
        .await;
    assert_eq!(stored["status"]["phase"], "Pending");
    assert_eq!(
        stored["status"]["containerStatuses"][0]["state"]["waiting"]["message"],
        "Back-off pulling image \"registry.invalid/nope:1\""
    );

    // A node that has no room: Pending, Unschedulable, in the scheduler's words.
    double.set_schedulable(false);
    pods.create(
        &PostParams::default(),
        &pod("later", "registry.invalid/nope:1", &["true"], json!({})),
    )
    .await
    .expect("create");
    let stored = double
        .wait_for_pod(NS, "later", PATIENCE, "Unschedulable", |p| {
            p["status"]["conditions"]
                .as_array()
                .is_some_and(|c| c.iter().any(|c| c["reason"] == "Unschedulable"))
        })
        .await;
    let condition = &stored["status"]["conditions"][0];
    assert_eq!(condition["type"], "PodScheduled");
    assert_eq!(condition["status"], "False");
    assert_eq!(
        condition["message"],
        "0/1 nodes are available: 1 Insufficient memory."
    );
    assert!(stored["spec"]["nodeName"].is_null());
}

#[tokio::test]
async fn a_pod_starts_only_once_its_secret_exists() {
    let double = KubeApi::start(Options::default().image("python:3", Image::new())).await;
    let client = double.client().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let secrets: Api<Secret> = Api::namespaced(client, NS);
    let spec = json!({
        "automountServiceAccountToken": false,
        "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000},
        "containers": [{
            "name": "main",
            "volumeMounts": [{"name": "key", "mountPath": "/var/run/cellgate"}],
        }],
        "volumes": [{"name": "key", "secret": {"secretName": "kernel-key", "defaultMode": 0o400}}],
    });
    let read_key = "import os, time; print('key:', open('/var/run/cellgate/token').read(), oct(os.stat('/var/run/cellgate/token').st_mode & 0o777), flush=True); time.sleep(600)";
    let created = pods
        .create(
            &PostParams::default(),
            &pod(
                "kernel",
                "python:3",
                &["/usr/bin/python3", "-c", read_key],
                spec,
            ),
        )
        .await
        .expect("create");
    let waiting = double
        .wait_for_pod(NS, "kernel", PATIENCE, "ContainerCreating", |p| {
            p["status"]["containerStatuses"][0]["state"]["waiting"]["reason"] == "ContainerCreating"
        })
        .await;
    assert!(
        waiting["status"]["podIP"].is_null(),
        "no sandbox before the volumes"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        double.object("pods", NS, "kernel").expect("the pod")["status"]["phase"],
        "Pending"
    );
    assert!(double.pod_log(NS, "kernel").is_empty());

    let mut key = secret("kernel-key", json!({}));
    key.metadata.owner_references = Some(vec![serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod", "name": "kernel", "uid": created.metadata.uid,
    }))
    .expect("an owner reference")]);
    secrets
        .create(&PostParams::default(), &key)
        .await
        .expect("create the secret");
    double
        .wait_for_pod(NS, "kernel", PATIENCE, "Running", |p| {
            p["status"]["phase"] == "Running"
        })
        .await;
    double
        .wait_until("the key in the pod's log", PATIENCE, || {
            double.pod_log(NS, "kernel").contains("key:").then_some(())
        })
        .await;
    let log = double.pod_log(NS, "kernel");
    assert!(log.contains("key: secret of kernel-key 0o440"), "{log}");
    pods.delete("kernel", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete");
}

#[tokio::test]
async fn an_evicted_pod_fails_with_reason_evicted_and_stays() {
    let double = KubeApi::start(Options::default().image("python:3", Image::new())).await;
    let pods: Api<Pod> = Api::namespaced(double.client().await, NS);
    pods.create(
        &PostParams::default(),
        &pod(
            "victim",
            "python:3",
            &["/usr/bin/python3", "-c", "import time; time.sleep(600)"],
            json!({"automountServiceAccountToken": false}),
        ),
    )
    .await
    .expect("create");
    double
        .wait_for_pod(NS, "victim", PATIENCE, "Running", |p| {
            p["status"]["phase"] == "Running"
        })
        .await;
    let pid = double.pod_pid(NS, "victim").expect("a pid");
    double.evict(NS, "victim", "The node was low on resource: memory.");
    let pod = double
        .wait_for_pod(NS, "victim", PATIENCE, "Failed", |p| {
            p["status"]["phase"] == "Failed"
        })
        .await;
    assert_eq!(pod["status"]["reason"], "Evicted");
    assert_eq!(
        pod["status"]["message"],
        "The node was low on resource: memory."
    );
    // The status comes first, then the kill (as in the kubelet), then the container's end.
    let stored = double
        .wait_for_pod(NS, "victim", PATIENCE, "terminated", |p| {
            p["status"]["containerStatuses"][0]["state"]["terminated"].is_object()
        })
        .await;
    let terminated = &stored["status"]["containerStatuses"][0]["state"]["terminated"];
    assert_eq!(terminated["exitCode"], 137);
    assert!(!crate::support::alive(pid));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        double.object("pods", NS, "victim").is_some(),
        "the object stays"
    );
    pods.delete("victim", &DeleteParams::default())
        .await
        .expect("delete");
    double
        .wait_until("the evicted pod to go", PATIENCE, || {
            double.object("pods", NS, "victim").is_none().then_some(())
        })
        .await;
}

#[tokio::test]
async fn a_container_that_exits_leaves_its_pod_succeeded_or_failed() {
    let double = KubeApi::start(Options::default().image("python:3", Image::new())).await;
    let pods: Api<Pod> = Api::namespaced(double.client().await, NS);
    for (name, code) in [("ok", 0), ("bad", 3)] {
        let exit = format!("import sys; print('bye'); sys.exit({code})");
        pods.create(
            &PostParams::default(),
            &pod(
                name,
                "python:3",
                &["/usr/bin/python3", "-c", &exit],
                json!({"automountServiceAccountToken": false}),
            ),
        )
        .await
        .expect("create");
    }
    for (name, phase, code, reason) in [
        ("ok", "Succeeded", 0, "Completed"),
        ("bad", "Failed", 3, "Error"),
    ] {
        let stored = double
            .wait_for_pod(NS, name, PATIENCE, phase, |p| p["status"]["phase"] == phase)
            .await;
        let terminated = &stored["status"]["containerStatuses"][0]["state"]["terminated"];
        assert_eq!(
            (
                terminated["exitCode"].as_i64(),
                terminated["reason"].as_str()
            ),
            (Some(code), Some(reason))
        );
        assert_eq!(double.pod_log(NS, name), "bye\n");
        double
            .wait_until("the network torn down", PATIENCE, || {
                double.pod_netns(NS, name).is_none().then_some(())
            })
            .await;
    }
    // Across namespaces (the admin may), both are listed.
    let all: Api<Pod> = Api::all(double.client().await);
    assert_eq!(
        all.list(&ListParams::default())
            .await
            .expect("list")
            .items
            .len(),
        2
    );
    // A command that is not in the image: the runtime's StartError, exit code 128.
    pods.create(
        &PostParams::default(),
        &pod(
            "missing",
            "python:3",
            &["no-such-program"],
            json!({"automountServiceAccountToken": false}),
        ),
    )
    .await
    .expect("create");
    let stored = double
        .wait_for_pod(NS, "missing", PATIENCE, "Failed", |p| {
            p["status"]["phase"] == "Failed"
        })
        .await;
    let terminated = &stored["status"]["containerStatuses"][0]["state"]["terminated"];
    assert_eq!(
        (
            terminated["exitCode"].as_i64(),
            terminated["reason"].as_str()
        ),
        (Some(128), Some("StartError"))
    );
    assert!(terminated["message"]
        .as_str()
        .is_some_and(|m| m.contains("executable file not found in $PATH")));
}

#[tokio::test]
async fn pod_security_restricted_refuses_a_pod_it_forbids() {
    let double = KubeApi::start(Options::default().pod_security(NS, "restricted")).await;
    let pods: Api<Pod> = Api::namespaced(double.client().await, NS);
    let error = api_error(
        pods.create(
            &PostParams::default(),
            &pod("loose", "img", &["true"], json!({})),
        )
        .await,
    );
    assert_eq!((error.code, error.reason.as_str()), (403, "Forbidden"));
    assert_eq!(
        error.message,
        "pods \"loose\" is forbidden: violates PodSecurity \"restricted:latest\": allowPrivilegeEscalation != false (container \"main\" must set securityContext.allowPrivilegeEscalation=false), unrestricted capabilities (container \"main\" must set securityContext.capabilities.drop=[\"ALL\"]), runAsNonRoot != true (pod or container \"main\" must set securityContext.runAsNonRoot=true), seccompProfile (pod or container \"main\" must set securityContext.seccompProfile.type to \"RuntimeDefault\" or \"Localhost\")"
    );
    let restricted = json!({
        "securityContext": {"runAsNonRoot": true, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{"securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}}],
    });
    pods.create(
        &PostParams::default(),
        &pod("tight", "img", &["true"], restricted),
    )
    .await
    .expect("a restricted pod is admitted");
}
