//! The kubernetes backend end to end, against the Kubernetes API test double
//! (`support::kube_api`), whose node "runs" each pod as a real process in namespaces of its
//! own: the kernel image is the repository's kernel environment and the guest agent
//! (`target/release/cellgate-agent`, built by `./dev setup`). The gateway finds the double
//! through `KUBECONFIG`, exactly as it would find a cluster.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::microvm::{test_server, workspace_files_cross_the_vm_boundary};
use crate::support::kube_api::{Image, KubeApi, Options, Rule};
use crate::support::v1::V1Client;
use crate::support::{kernels_dir, repo, Gateway, PATIENCE, TOKEN};

const NAMESPACE: &str = "cellgate";
const IMAGE: &str = "registry.test/cellgate-kernel:dev";

/// The agent the kernel image holds: the one `./dev setup` builds for the microVM guest.
fn agent_binary() -> PathBuf {
    let agent = repo().join("target/release/cellgate-agent");
    assert!(
        agent.is_file(),
        "{} is missing: run `./dev setup` (it builds the guest agent the kernel image holds)",
        agent.display()
    );
    agent
}

/// The kernel image, as the double's node has it: the kernel venv where the image puts it
/// (built for /opt/cellgate/venv over Debian's Python, like the real image) and the agent.
fn kernel_image() -> Image {
    Image::new()
        .bind("/opt/cellgate/venv", kernels_dir().join("python3/.venv"))
        .bind("/opt/cellgate/bin/cellgate-agent", agent_binary())
}

/// The token gateways present: a user with exactly the rules of the gateway's Role in
/// `deploy/kubernetes/role.yaml`, so a request the Role does not allow fails the tests (403).
const GATEWAY_TOKEN: &str = "gateway-service-account-token";

/// The rules of `deploy/kubernetes/role.yaml`, in the double's terms.
fn gateway_role() -> Vec<Rule> {
    let text = std::fs::read_to_string(repo().join("deploy/kubernetes/role.yaml"))
        .expect("deploy/kubernetes/role.yaml");
    let role: k8s_openapi::api::rbac::v1::Role =
        serde_saphyr::from_str(&text).expect("role.yaml is a Role");
    let mut rules = Vec::new();
    for rule in role.rules.unwrap_or_default() {
        for group in rule.api_groups.unwrap_or_default() {
            let resources: Vec<&str> = rule
                .resources
                .iter()
                .flatten()
                .map(String::as_str)
                .collect();
            let verbs: Vec<&str> = rule.verbs.iter().map(String::as_str).collect();
            rules.push(Rule::new(&group, &resources, &verbs, &[NAMESPACE]));
        }
    }
    assert!(!rules.is_empty(), "role.yaml grants nothing");
    rules
}

pub(crate) async fn cluster() -> KubeApi {
    let mut options = Options::default()
        .namespace(NAMESPACE)
        .image(IMAGE, kernel_image());
    options.runtime_classes = vec!["gvisor".to_owned()];
    let api = KubeApi::start(options).await;
    api.add_user(
        GATEWAY_TOKEN,
        &format!("system:serviceaccount:{NAMESPACE}:cellgate"),
        gateway_role(),
    );
    api
}

/// Policies and a config for gateways on the double: `default` runs pods (egress to
/// `allowed.test:<port>` only), `unpullable` names an image the node does not have.
pub(crate) fn setup(dir: &Path, port: u16) -> Result<(PathBuf, PathBuf)> {
    let policies = dir.join("policies");
    std::fs::create_dir_all(&policies)?;
    let pods = format!(
        "[sandbox]\nbackend = \"kubernetes\"\n[kubernetes]\nimage = \"{IMAGE}\"\n\
         runtime_class = \"gvisor\"\npending_timeout = \"60s\"\n\
         [limits]\nmemory = \"512MiB\"\nworkspace = \"16MiB\"\n\
         [egress]\nallow = [\"allowed.test:{port}\"]\n"
    );
    std::fs::write(policies.join("default.toml"), pods)?;
    std::fs::write(
        policies.join("tight.toml"),
        format!(
            "[sandbox]\nbackend = \"kubernetes\"\n[kubernetes]\nimage = \"{IMAGE}\"\n\
             pending_timeout = \"6s\"\n"
        ),
    )?;
    std::fs::write(
        policies.join("unpullable.toml"),
        "[sandbox]\nbackend = \"kubernetes\"\n[kubernetes]\nimage = \"registry.test/nope:1\"\n\
         pending_timeout = \"6s\"\n",
    )?;
    let config = dir.join("cellgate.toml");
    std::fs::write(
        &config,
        format!(
            "package_cache_dir = {:?}\n[egress_hosts]\n\"allowed.test\" = \"127.0.0.1\"\n\
             \"denied.test\" = \"127.0.0.1\"\n",
            dir.join("cache")
        ),
    )?;
    Ok((policies, config))
}

/// A gateway whose kernels are the double's pods; `replica`: `(port, id)` to serve as one
/// of several replicas.
pub(crate) async fn gateway(
    api: &KubeApi,
    policies: &Path,
    config: &Path,
    replica: Option<(u16, &str)>,
    extra: &[&str],
) -> Result<Gateway> {
    let mut command = Command::new(env!("CARGO_BIN_EXE_cellgate"));
    let port = replica.map_or(0, |(port, _)| port);
    command
        .arg("serve")
        .args(["--ip", "127.0.0.1", "--port", &port.to_string()])
        .arg("--kernels-dir")
        .arg(kernels_dir())
        .arg("--policies-dir")
        .arg(policies)
        .arg("--config")
        .arg(config)
        .args(["--token", TOKEN, "--pool-size", "0"])
        // Replicas share this host here: each would need a state directory of its own.
        .args(["--state-dir", "none"])
        .args(extra)
        .env("KUBECONFIG", api.kubeconfig_for(GATEWAY_TOKEN, NAMESPACE))
        // kube-client would send the double's requests to a proxy the shell names.
        .env_remove("HTTPS_PROXY")
        .env_remove("https_proxy")
        .env("RUST_LOG", "info,zeromq=error")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some((port, id)) = replica {
        command
            .args(["--replica-url", &format!("http://127.0.0.1:{port}")])
            .args(["--replica-id", id]);
    }
    for (name, _) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        if (name.starts_with("CELLGATE_") || name.starts_with("KG_"))
            && !name.starts_with("CELLGATE_TEST_")
        {
            command.env_remove(name);
        }
    }
    Gateway::attach(command.spawn()?, Some(TOKEN.to_owned())).await
}

/// The stream output of `code` run through Server-Sent Events, as it arrived.
async fn streamed(v1: &V1Client<'_>, id: &str, code: &str) -> Result<String> {
    let mut sse = v1
        .sse(&format!("/v1/sessions/{id}/execute"), json!({"code": code}))
        .await?;
    let mut text = String::new();
    loop {
        let (event, data) = sse.next().await?;
        match event.as_str() {
            "stream" => text.push_str(data["text"].as_str().unwrap_or_default()),
            "done" => return Ok(text),
            _ => {}
        }
    }
}

/// Code that asks the gateway's proxy for a host no policy allows.
fn fetch_denied(port: u16) -> String {
    format!(
        "import urllib.request\nurllib.request.urlopen('http://denied.test:{port}/', timeout=30)"
    )
}

/// `check`'s first `Some`, asked every 100 ms until `timeout`.
pub(crate) async fn until<T, F, Fut>(timeout: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(found) = check().await {
            return Some(found);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The one kernel pod of `kernel` in the double, once there is one.
pub(crate) async fn pod_of(api: &KubeApi, kernel: &str) -> Result<Value> {
    let found = until(PATIENCE, || async {
        api.objects("pods", NAMESPACE)
            .into_iter()
            .find(|p| p["metadata"]["labels"]["cellgate.io/kernel"] == kernel)
    })
    .await;
    found.with_context(|| format!("no pod for kernel {kernel}"))
}

#[tokio::test]
async fn a_kernel_pod_runs_code_streams_files_and_its_policy() -> Result<()> {
    let api = cluster().await;
    let port = test_server("allowed").await?;
    let dir = tempfile::tempdir()?;
    let (policies, config) = setup(dir.path(), port)?;
    let gateway = gateway(&api, &policies, &config, None, &[]).await?;
    let v1 = V1Client::new(&gateway);
    let id = v1
        .create_session(json!({}))
        .await
        .with_context(|| gateway.log())?;

    let r = v1.execute(&id, "x = 1 + 1\nx").await?;
    assert_eq!(
        (&r["status"], &r["result"]),
        (&json!("ok"), &json!("2")),
        "{r}"
    );

    // The kernel runs in the pod: uid 1000, the pod's hostname, only the pod's interfaces.
    let r = v1
        .execute(
            &id,
            "import os, socket\nprint(os.getuid(), os.getcwd(), socket.gethostname())",
        )
        .await?;
    let pod = pod_of(&api, &id).await?;
    let pod_name = pod["metadata"]["name"].as_str().context("pod name")?;
    assert_eq!(r["stdout"], format!("1000 /home/user {pod_name}\n"), "{r}");

    // Output streams as it is printed (SSE through the pod's agent link).
    let code = "import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.3)";
    assert_eq!(streamed(&v1, &id, code).await?, "0\n1\n2\n");

    // Egress: the policy's host through the gateway's proxy (over the agent link), any
    // other refused and reported as a denial.
    let r = v1
        .execute(
            &id,
            &format!(
                "import urllib.request\n\
                 print(urllib.request.urlopen('http://allowed.test:{port}/', timeout=30).read().decode())"
            ),
        )
        .await?;
    assert_eq!(r["stdout"], "hello from allowed\n", "{r}");
    let r = v1.execute(&id, &fetch_denied(port)).await?;
    assert_eq!(r["status"], "denied", "{r}");

    // A restart is a new pod (the old one deleted); the kernel's id, lease and policy stay.
    let (status, body) = v1
        .post(&format!("/v1/sessions/{id}/restart"), json!({}))
        .await?;
    assert!(status < 300, "{status} {body}");
    let restarted = until(PATIENCE, || async {
        let pods = api.objects("pods", NAMESPACE);
        let mine: Vec<&Value> = pods
            .iter()
            .filter(|p| p["metadata"]["labels"]["cellgate.io/kernel"] == id.as_str())
            .collect();
        (mine.len() == 1 && mine[0]["metadata"]["name"] != pod_name).then(|| {
            mine[0]["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
    })
    .await
    .context("the restart made no new pod, or left the old one")?;
    let r = v1.execute(&id, "'x' in dir()").await?;
    assert_eq!(r["result"], "False", "{r}");
    let pod = pod_of(&api, &id).await?;
    let pod_name = restarted.as_str();
    assert_eq!(pod["metadata"]["name"], pod_name);

    // Files both ways through the agent, into the pod's workspace volume.
    workspace_files_cross_the_vm_boundary(&v1, &id).await?;

    // What the cluster was asked for: a locked-down pod, its key in a Secret it owns, the
    // policy's NetworkPolicy.
    let spec = &pod["spec"];
    assert_eq!(spec["runtimeClassName"], "gvisor");
    assert_eq!(spec["automountServiceAccountToken"], false);
    assert_eq!(
        spec["containers"][0]["securityContext"]["readOnlyRootFilesystem"],
        true
    );
    assert_eq!(pod["metadata"]["labels"]["cellgate.io/policy"], "default");
    let secret = api
        .object("secrets", NAMESPACE, pod_name)
        .context("the pod's secret")?;
    assert_eq!(
        secret["metadata"]["ownerReferences"][0]["uid"],
        pod["metadata"]["uid"]
    );
    let netpol = api
        .object("networkpolicies", NAMESPACE, "cellgate-kernels-default")
        .context("the policy's network policy")?;
    assert_eq!(netpol["spec"]["egress"], json!([]), "{netpol}");

    // Deleting the session deletes pod and secret.
    let (status, _) = v1
        .call(reqwest::Method::DELETE, &format!("/v1/sessions/{id}"), None)
        .await?;
    assert_eq!(status, 204);
    let gone = until(PATIENCE, || async {
        (api.object("pods", NAMESPACE, pod_name).is_none()
            && api.object("secrets", NAMESPACE, pod_name).is_none())
        .then_some(())
    })
    .await;
    assert!(
        gone.is_some(),
        "pod or secret left: {:?}",
        api.objects("pods", NAMESPACE)
    );
    Ok(())
}

#[tokio::test]
async fn a_pod_that_cannot_start_fails_with_kubernetes_reason_and_is_deleted() -> Result<()> {
    let api = cluster().await;
    let dir = tempfile::tempdir()?;
    let (policies, config) = setup(dir.path(), 9)?;
    let gateway = gateway(&api, &policies, &config, None, &[]).await?;
    let v1 = V1Client::new(&gateway);
    let (status, body) = v1
        .post("/v1/sessions", json!({"policy": "unpullable"}))
        .await?;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["code"], "pod_pending", "{body}");
    let message = body["message"].as_str().unwrap_or_default();
    assert!(message.contains("ImagePullBackOff"), "{body}");
    let left = until(PATIENCE, || async {
        api.objects("pods", NAMESPACE).is_empty().then_some(())
    })
    .await;
    assert!(left.is_some(), "{:?}", api.objects("pods", NAMESPACE));

    // No node with room: the scheduler's reason.
    api.set_schedulable(false);
    let (status, body) = v1.post("/v1/sessions", json!({"policy": "tight"})).await?;
    assert_eq!(
        (status, &body["code"]),
        (503, &json!("pod_pending")),
        "{body}"
    );
    let message = body["message"].as_str().unwrap_or_default();
    assert!(message.contains("Unschedulable"), "{body}");
    Ok(())
}

/// Another language's kernel runs in the image its policy names for it (`[kubernetes]
/// kernel_images`, issue 30): a Deno kernel in a pod of the Deno image, whose environment is
/// at the fixed path as python3's is in the default image. A policy that names no image for
/// it refuses the kernelspec, saying how to give it one.
#[tokio::test]
async fn another_languages_kernel_runs_in_the_image_its_policy_names() -> Result<()> {
    const DENO_IMAGE: &str = "registry.test/cellgate-kernel-deno:dev";
    let deno_image = Image::new()
        .bind("/opt/cellgate/venv", kernels_dir().join("deno/.venv"))
        .bind("/opt/cellgate/bin/cellgate-agent", agent_binary());
    let api = KubeApi::start(
        Options::default()
            .namespace(NAMESPACE)
            .image(IMAGE, kernel_image())
            .image(DENO_IMAGE, deno_image),
    )
    .await;
    api.add_user(
        GATEWAY_TOKEN,
        &format!("system:serviceaccount:{NAMESPACE}:cellgate"),
        gateway_role(),
    );
    let dir = tempfile::tempdir()?;
    let (policies, config) = setup(dir.path(), 9)?;
    std::fs::write(
        policies.join("languages.toml"),
        format!(
            "[sandbox]\nbackend = \"kubernetes\"\n[kubernetes]\nimage = \"{IMAGE}\"\n\
             kernel_images = {{ deno = \"{DENO_IMAGE}\" }}\npending_timeout = \"60s\"\n"
        ),
    )?;
    let gateway = gateway(&api, &policies, &config, None, &[]).await?;
    let v1 = V1Client::new(&gateway);

    let (status, body) = v1
        .post(
            "/v1/sessions",
            json!({"kernel_name": "deno", "policy": "tight"}),
        )
        .await?;
    assert_eq!(
        (status, &body["code"]),
        (400, &json!("kernel_unsupported")),
        "{body}"
    );
    let message = body["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("cannot run in a kubernetes sandbox") && message.contains("kernel_images"),
        "{body}"
    );

    let id = v1
        .create_session(json!({"kernel_name": "deno", "policy": "languages"}))
        .await
        .with_context(|| gateway.log())?;
    let pod = pod_of(&api, &id).await?;
    assert_eq!(pod["spec"]["containers"][0]["image"], DENO_IMAGE, "{pod}");
    let r = v1
        .execute(&id, "const x: number = 6 * 7;\nx")
        .await
        .with_context(|| gateway.log())?;
    assert_eq!(
        (&r["status"], &r["result"]),
        (&json!("ok"), &json!("42")),
        "{r}"
    );
    // The same policy's Python kernel still runs in the default image.
    let py = v1
        .create_session(json!({"policy": "languages"}))
        .await
        .with_context(|| gateway.log())?;
    assert_eq!(
        pod_of(&api, &py).await?["spec"]["containers"][0]["image"],
        IMAGE
    );
    let r = v1.execute(&py, "6 * 7").await?;
    assert_eq!(r["result"], "42", "{r}");
    Ok(())
}

#[tokio::test]
async fn an_evicted_pod_is_a_lost_sandbox_with_the_reason() -> Result<()> {
    let api = cluster().await;
    let dir = tempfile::tempdir()?;
    let (policies, config) = setup(dir.path(), 9)?;
    let gateway = gateway(&api, &policies, &config, None, &[]).await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let pod = pod_of(&api, &id).await?;
    let name = pod["metadata"]["name"].as_str().context("name")?.to_owned();
    api.evict(NAMESPACE, &name, "The node was low on resource: memory.");
    let dead = until(PATIENCE, || async {
        let (_, model) = v1.get(&format!("/v1/sessions/{id}")).await.ok()?;
        (model["state"] == "dead").then_some(model)
    })
    .await
    .context("the session never died")?;
    let reason = dead["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("evicted") && reason.contains("low on resource"),
        "{dead}"
    );
    Ok(())
}

/// A free port on 127.0.0.1 for a replica, whose URL must be known before it starts.
pub(crate) fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

#[tokio::test]
async fn replicas_share_kernels_and_sessions_survive_losing_one() -> Result<()> {
    let api = cluster().await;
    let port = test_server("allowed").await?;
    let dir = tempfile::tempdir()?;
    let (policies, config) = setup(dir.path(), port)?;
    let (port_a, port_b) = (free_port()?, free_port()?);
    let mut a = gateway(&api, &policies, &config, Some((port_a, "gw-a")), &[]).await?;
    let b = gateway(&api, &policies, &config, Some((port_b, "gw-b")), &[]).await?;
    let (via_a, via_b) = (V1Client::new(&a), V1Client::new(&b));

    // A kernel made through A, used through B: forwarded to its owner.
    let id = via_a
        .create_session(json!({}))
        .await
        .with_context(|| a.log())?;
    let r = via_b
        .execute(&id, "x = 41\nx + 1")
        .await
        .with_context(|| b.log())?;
    assert_eq!(r["result"], "42", "{r}");
    let lease = api
        .object("leases", NAMESPACE, &format!("cellgate-kernel-{id}"))
        .context("the kernel's lease")?;
    assert_eq!(lease["spec"]["holderIdentity"], "gw-a", "{lease}");
    // Listings gather both replicas' kernels.
    let other = via_b.create_session(json!({})).await?;
    let (_, listed) = via_a.get("/v1/sessions").await?;
    let ids: Vec<&str> = listed
        .as_array()
        .context("a list")?
        .iter()
        .filter_map(|s| s["id"].as_str())
        .collect();
    assert!(
        ids.contains(&id.as_str()) && ids.contains(&other.as_str()),
        "{listed}"
    );
    // An artifact made on the owner (A), fetched through B: asked of the peers.
    let r = via_b
        .execute(&id, "from IPython.display import HTML\nHTML('<b>on A</b>')")
        .await?;
    let artifact = r["artifacts"]
        .as_array()
        .and_then(|a| a.iter().find(|a| a["mime"] == "text/html"))
        .and_then(|a| a["id"].as_str())
        .with_context(|| format!("no html artifact: {r}"))?
        .to_owned();
    let fetched = via_b.artifact(&artifact).await?;
    assert_eq!(fetched.status(), 200);
    assert!(fetched.text().await?.contains("<b>on A</b>"));
    // Its signed link, with no credential, through B too (the replicas share the token the
    // links' key derives from).
    let link = r["artifacts"]
        .as_array()
        .and_then(|a| a.iter().find(|a| a["id"] == artifact.as_str()))
        .and_then(|a| a["signed_url"].as_str())
        .with_context(|| format!("no signed link: {r}"))?;
    let path = link
        .split_once("/v1/")
        .map(|(_, rest)| rest)
        .context("a v1 link")?;
    let anonymous = reqwest::get(format!("{}/v1/{path}", b.base)).await?;
    assert_eq!(anonymous.status(), 200);
    assert!(anonymous.text().await?.contains("<b>on A</b>"));
    // A link asked of B (its body passed on to A), and it works through B.
    let (status, minted) = via_b
        .post(
            &format!("/v1/artifacts/{artifact}/links"),
            json!({"ttl_s": 600}),
        )
        .await?;
    assert_eq!(status, 200, "{minted}");
    let minted = minted["url"].as_str().context("url")?;
    let path = minted
        .split_once("/v1/")
        .map(|(_, rest)| rest)
        .context("a v1 link")?;
    let anonymous = reqwest::get(format!("{}/v1/{path}", b.base)).await?;
    assert_eq!(anonymous.status(), 200);
    // A forged link is refused by B itself: 404, and A never hears of it.
    let forged = format!(
        "{}/v1/artifacts/{artifact}/signed?expires={}&owner={}&signature={}",
        b.base,
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs()
            + 600,
        "A".repeat(22),
        "A".repeat(43)
    );
    let refused = reqwest::get(&forged).await?;
    assert_eq!(refused.status(), 404);
    assert!(
        !a.log().contains("artifact link refused"),
        "a forged link reached the holder: {}",
        a.log()
    );
    // Server-Sent Events through the other replica, as they are sent.
    assert_eq!(
        streamed(&via_b, &id, "print('streamed', x)").await?,
        "streamed 41\n"
    );
    // Jupyter's WebSocket through the other replica.
    let mut client = b.connect(&id, "s-replica", false).await?;
    let replies = client.run("print(x * 2)").await?;
    assert!(
        replies
            .iter()
            .any(|m| m.msg_type() == "stream" && m.content["text"] == "82\n"),
        "{replies:?}"
    );
    drop(client);

    // A dies without a word; B takes its kernel over once A's lease lapses: same kernel,
    // same variables, now B's.
    a.child.kill()?;
    a.child.wait()?;
    let r = until(2 * PATIENCE, || async {
        let r = via_b.execute(&id, "x").await.ok()?;
        (r["status"] == "ok").then_some(r)
    })
    .await
    .with_context(|| format!("the kernel was not taken over: {}", b.log()))?;
    assert_eq!(r["result"], "41", "{r}");
    let lease = api
        .object("leases", NAMESPACE, &format!("cellgate-kernel-{id}"))
        .context("the kernel's lease")?;
    assert_eq!(lease["spec"]["holderIdentity"], "gw-b", "{lease}");
    // Files and the policy still hold in the taken-over kernel.
    assert_eq!(via_b.put_file(&id, "after.txt", b"ok".to_vec()).await?, 201);
    let r = via_b.execute(&id, &fetch_denied(port)).await?;
    assert_eq!(r["status"], "denied", "{r}");
    if api.objects("pods", NAMESPACE).len() != 2 {
        bail!("pods: {:?}", api.objects("pods", NAMESPACE));
    }
    // The taken-over kernel restarts into a new pod, still B's, its Lease naming that pod.
    let before = pod_of(&api, &id).await?;
    let (status, body) = via_b
        .post(&format!("/v1/sessions/{id}/restart"), json!({}))
        .await?;
    assert!(status < 300, "{status} {body}");
    let r = via_b.execute(&id, "1 + 1").await?;
    assert_eq!(r["result"], "2", "{r}");
    let after = until(PATIENCE, || async {
        let pods = api.objects("pods", NAMESPACE);
        let mine: Vec<Value> = pods
            .into_iter()
            .filter(|p| p["metadata"]["labels"]["cellgate.io/kernel"] == id.as_str())
            .collect();
        (mine.len() == 1 && mine[0]["metadata"]["uid"] != before["metadata"]["uid"])
            .then(|| mine[0].clone())
    })
    .await
    .context("no single new pod after the restart")?;
    let lease = until(PATIENCE, || async {
        api.object("leases", NAMESPACE, &format!("cellgate-kernel-{id}"))
    })
    .await
    .context("the restarted kernel has no lease")?;
    assert_eq!(lease["spec"]["holderIdentity"], "gw-b", "{lease}");
    assert_eq!(
        lease["metadata"]["annotations"]["cellgate.io/pod"], after["metadata"]["name"],
        "{lease}"
    );
    Ok(())
}

#[tokio::test]
async fn a_replica_shutting_down_hands_its_kernels_over() -> Result<()> {
    let api = cluster().await;
    let dir = tempfile::tempdir()?;
    let (policies, config) = setup(dir.path(), 9)?;
    let (port_a, port_b) = (free_port()?, free_port()?);
    let mut a = gateway(&api, &policies, &config, Some((port_a, "gw-a")), &[]).await?;
    let b = gateway(&api, &policies, &config, Some((port_b, "gw-b")), &[]).await?;
    let via_b = V1Client::new(&b);
    let id = V1Client::new(&a).create_session(json!({})).await?;
    let pod = pod_of(&api, &id).await?;
    let r = via_b.execute(&id, "y = 'kept'").await?;
    assert_eq!(r["status"], "ok", "{r}");

    // SIGTERM: A lets its pod run on and releases its lease at once (no lapse to wait
    // for), and B takes the kernel over with its variables.
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(a.pid() as i32).context("pid")?,
        rustix::process::Signal::TERM,
    )?;
    let status = a.child.wait()?;
    assert!(status.success(), "{status}: {}", a.log());
    let released = api
        .object("leases", NAMESPACE, "cellgate-replica-gw-a")
        .context("A's lease")?;
    assert_eq!(released["spec"]["holderIdentity"], "", "{released}");
    let r = until(PATIENCE, || async {
        let r = via_b.execute(&id, "y").await.ok()?;
        (r["status"] == "ok").then_some(r)
    })
    .await
    .with_context(|| format!("not taken over: {}", b.log()))?;
    assert_eq!(r["result"], "'kept'", "{r}");
    // The same pod: handed over, not restarted.
    let now = pod_of(&api, &id).await?;
    assert_eq!(now["metadata"]["uid"], pod["metadata"]["uid"]);
    Ok(())
}

#[tokio::test]
async fn a_tenants_kernel_cap_counts_its_pods_on_every_replica() -> Result<()> {
    let api = cluster().await;
    let dir = tempfile::tempdir()?;
    let (policies, config) = setup(dir.path(), 9)?;
    let secret = crate::tenants::secret_file(dir.path());
    let secret = secret.to_str().context("path")?;
    let caps = ["--jwt-secret-file", secret, "--tenant-max-kernels", "1"];
    let (port_a, port_b) = (free_port()?, free_port()?);
    let a = gateway(&api, &policies, &config, Some((port_a, "gw-a")), &caps).await?;
    let b = gateway(&api, &policies, &config, Some((port_b, "gw-b")), &caps).await?;
    let jwt = crate::tenants::hs256(&crate::tenants::claims("acme", "default"));
    let id = V1Client::bearer(&a, &jwt).create_session(json!({})).await?;
    // The tenant's one kernel is A's; B counts it (by its Lease) and refuses a second.
    let (status, body) = V1Client::bearer(&b, &jwt)
        .post("/v1/sessions", json!({}))
        .await?;
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["code"], "tenant_kernel_limit", "{body}");
    // Another tenant is not affected, and the first one's kernel is listed by both.
    let other = crate::tenants::hs256(&crate::tenants::claims("globex", "default"));
    V1Client::bearer(&b, &other)
        .create_session(json!({}))
        .await?;
    let (_, mine) = V1Client::bearer(&b, &jwt).get("/v1/sessions").await?;
    let ids: Vec<&str> = mine
        .as_array()
        .context("a list")?
        .iter()
        .filter_map(|s| s["id"].as_str())
        .collect();
    assert_eq!(ids, [id.as_str()], "{mine}");
    Ok(())
}
