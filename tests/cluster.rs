//! The kubernetes backend on a real cluster (kind, k3s or any other), for what the API test
//! double cannot show: the RuntimeClass's sandbox, the CNI's enforcement of the kernels'
//! NetworkPolicy, real scheduling, image pulls and evictions.
//!
//! These tests need a cluster with cellgate deployed from `deploy/kubernetes` (DEPLOY.md,
//! "Kubernetes", "Testing on a real cluster": kind or k3s), so they are ignored unless
//! asked for:
//!
//! ```text
//! KUBECONFIG=~/.kube/config \
//! CELLGATE_TEST_CLUSTER_URL=http://127.0.0.1:8888 CELLGATE_TEST_CLUSTER_TOKEN=… \
//!   cargo nextest run --test cluster --run-ignored only
//! ```
//!
//! The URL must reach the Service, not one gateway pod (a port-forward dies with the pod it
//! picked, and the second test kills replicas): k3s's built-in load balancer, or kind with
//! a NodePort and `extraPortMappings`. Each test says loudly what it misses instead of
//! passing without a cluster.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams};
use serde_json::{json, Value};

const IGNORED: &str = "needs a real cluster: see tests/cluster.rs";

struct Cluster {
    url: String,
    token: String,
    http: reqwest::Client,
    pods: Api<Pod>,
}

impl Cluster {
    async fn from_env() -> Result<Cluster> {
        let need = |name: &str| {
            std::env::var(name).with_context(|| {
                format!("{name} is not set: these tests run against a deployed cellgate (tests/cluster.rs)")
            })
        };
        let url = need("CELLGATE_TEST_CLUSTER_URL")?;
        let token = need("CELLGATE_TEST_CLUSTER_TOKEN")?;
        need("KUBECONFIG")?;
        let namespace =
            std::env::var("CELLGATE_TEST_CLUSTER_NAMESPACE").unwrap_or_else(|_| "cellgate".into());
        let client = kube::Client::try_default().await?;
        Ok(Cluster {
            url: url.trim_end_matches('/').to_owned(),
            token,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(300))
                .build()?,
            pods: Api::namespaced(client, &namespace),
        })
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(u16, Value)> {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(&self.token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await?;
        let status = response.status().as_u16();
        let text = response.text().await?;
        Ok((
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        ))
    }

    async fn execute(&self, session: &str, code: &str) -> Result<Value> {
        let (status, result) = self
            .call(
                reqwest::Method::POST,
                &format!("/v1/sessions/{session}/execute"),
                Some(json!({"code": code})),
            )
            .await?;
        if status != 200 {
            bail!("execute: {status} {result}");
        }
        Ok(result)
    }

    async fn session(&self) -> Result<String> {
        let (status, created) = self
            .call(reqwest::Method::POST, "/v1/sessions", Some(json!({})))
            .await?;
        if status != 201 {
            bail!("create a session: {status} {created}");
        }
        Ok(created["id"].as_str().context("id")?.to_owned())
    }
}

#[tokio::test]
#[ignore = "needs a real cluster: see tests/cluster.rs"]
async fn a_kernel_pod_runs_sandboxed_and_reaches_nothing() -> Result<()> {
    let cluster = Cluster::from_env().await.context(IGNORED)?;
    let id = cluster.session().await?;
    let r = cluster.execute(&id, "1 + 1").await?;
    assert_eq!(r["result"], "2", "{r}");
    // The NetworkPolicy, as the CNI enforces it: nothing but the gateway's proxy.
    let r = cluster
        .execute(
            &id,
            "import socket\ns = socket.socket()\ns.settimeout(5)\n\
             try:\n    s.connect(('1.1.1.1', 53)); print('reached')\n\
             except OSError as e:\n    print('blocked', type(e).__name__)",
        )
        .await?;
    assert!(
        r["stdout"]
            .as_str()
            .unwrap_or_default()
            .starts_with("blocked"),
        "{r}"
    );
    let r = cluster
        .execute(
            &id,
            "import urllib.request\nurllib.request.urlopen('http://example.com/', timeout=20)",
        )
        .await?;
    assert_eq!(r["status"], "denied", "{r}");
    // gVisor's kernel says so in dmesg; another RuntimeClass is reported, not failed.
    let r = cluster
        .execute(&id, "import subprocess\nprint(subprocess.run(['dmesg'], capture_output=True, text=True).stdout[:200])")
        .await?;
    println!("the kernel's dmesg: {}", r["stdout"]);
    cluster
        .call(reqwest::Method::DELETE, &format!("/v1/sessions/{id}"), None)
        .await?;
    Ok(())
}

#[tokio::test]
#[ignore = "needs a real cluster: see tests/cluster.rs"]
async fn a_session_survives_the_loss_of_its_gateway_replica() -> Result<()> {
    let cluster = Cluster::from_env().await.context(IGNORED)?;
    let id = cluster.session().await?;
    cluster.execute(&id, "kept = 'yes'").await?;
    let gateways = cluster
        .pods
        .list(&ListParams::default().labels("app.kubernetes.io/component=gateway"))
        .await?;
    if gateways.items.len() < 2 {
        bail!(
            "this test needs two gateway replicas (kubectl scale deployment/cellgate --replicas 2)"
        );
    }
    // Kill every replica but one, without a grace period: whichever owned the kernel is
    // gone (unless it is the survivor), and the survivor must take it over.
    for pod in gateways.items.iter().skip(1) {
        let name = pod.metadata.name.clone().unwrap_or_default();
        cluster
            .pods
            .delete(
                &name,
                &DeleteParams {
                    grace_period_seconds: Some(0),
                    ..DeleteParams::default()
                },
            )
            .await?;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        match cluster.execute(&id, "kept").await {
            Ok(r) if r["status"] == "ok" => {
                assert_eq!(r["result"], "'yes'", "{r}");
                break;
            }
            _ if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_secs(2)).await
            }
            other => bail!("the session did not survive: {other:?}"),
        }
    }
    cluster
        .call(reqwest::Method::DELETE, &format!("/v1/sessions/{id}"), None)
        .await?;
    Ok(())
}
