//! Egress proxy and package index, end to end: a real gateway, real kernels in the
//! namespaces sandbox, real pip inside them, the real proxy and bridge. Test servers listen
//! on loopback and are reached through host names the gateway config maps to them; the
//! upstream index (PEP 691 JSON) is a local one too: nothing leaves this machine.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::v1::V1Client;
use crate::support::*;

/// A tiny HTTP server on 127.0.0.1 that answers every request with `hello from <name>`.
async fn test_server(name: &'static str) -> Result<u16> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut seen = vec![];
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                let body = format!("hello from {name}");
                let response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
            });
        }
    });
    Ok(port)
}

/// Writes a pure-Python wheel `name-version` whose module prints nothing and has `VALUE`,
/// declaring `requires` as dependencies.
fn build_wheel(dir: &Path, name: &str, version: &str, requires: &[&str]) -> Result<PathBuf> {
    let script = r#"
import base64, hashlib, sys, zipfile, os
out, name, version = sys.argv[1], sys.argv[2], sys.argv[3]
requires = [r for r in sys.argv[4].split(",") if r]
dist = f"{name}-{version}.dist-info"
files = {
    f"{name}/__init__.py": f"VALUE = '{name} {version} works'\n",
    f"{dist}/METADATA": "Metadata-Version: 2.1\nName: %s\nVersion: %s\n%s\n" % (name, version, "".join(f"Requires-Dist: {r}\n" for r in requires)),
    f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: cellgate-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = []
for path, text in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    record.append(f"{path},sha256={digest},{len(text.encode())}")
record.append(f"{dist}/RECORD,,")
files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
path = os.path.join(out, f"{name}-{version}-py3-none-any.whl")
with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
    for p, text in files.items():
        z.writestr(p, text)
print(path)
"#;
    let output = std::process::Command::new(tools_python())
        .args(["-c", script])
        .arg(dir)
        .args([name, version, &requires.join(",")])
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "building a wheel failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(PathBuf::from(
        String::from_utf8(output.stdout)?.trim().to_owned(),
    ))
}

struct Setup {
    _dir: tempfile::TempDir,
    gateway: Gateway,
}

/// A gateway with the repo's default policy plus `extra` policies, and `config` as its
/// config file.
async fn gateway_with(extra: &[(&str, String)], config: String) -> Result<Setup> {
    let dir = tempfile::tempdir()?;
    let policies = dir.path().join("policies");
    std::fs::create_dir(&policies)?;
    std::fs::copy(
        repo().join("policies/default.toml"),
        policies.join("default.toml"),
    )?;
    for (name, text) in extra {
        std::fs::write(policies.join(format!("{name}.toml")), text)?;
    }
    let config_path = dir.path().join("cellgate.toml");
    let cache = dir.path().join("cache");
    std::fs::write(
        &config_path,
        format!("package_cache_dir = {cache:?}\n{config}"),
    )?;
    let gateway = Gateway::builder()
        .policies_dir(policies)
        .arg("--config")
        .arg(config_path.to_str().context("path")?)
        .start()
        .await?;
    Ok(Setup { _dir: dir, gateway })
}

async fn start_with_policy(gateway: &Gateway, policy: &str) -> Result<String> {
    let response = gateway
        .request(reqwest::Method::POST, "/api/kernels")
        .json(&json!({"name": "python3", "env": {"KERNEL_POLICY": policy}}))
        .send()
        .await?;
    anyhow::ensure!(
        response.status().as_u16() == 201,
        "start: {}",
        response.text().await?
    );
    let model: Value = response.json().await?;
    Ok(model["id"].as_str().context("id")?.to_owned())
}

/// stderr, plus any error's name and value (so failures explain themselves).
pub(crate) fn stderr(msgs: &[Msg]) -> String {
    msgs.iter()
        .filter_map(|m| match m.msg_type() {
            "stream" if m.content["name"] == "stderr" => {
                Some(m.content["text"].as_str().unwrap_or_default().to_owned())
            }
            "error" => Some(format!("{}: {}\n", m.content["ename"], m.content["evalue"])),
            _ => None,
        })
        .collect()
}

pub(crate) fn denials(msgs: &[Msg]) -> Vec<Value> {
    reply(msgs).metadata["cellgate"]["denials"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

async fn run_long(client: &mut Client, code: &str) -> Result<Vec<Msg>> {
    let id = client.execute(code).await?;
    client.collect(&id, Duration::from_secs(180)).await
}

#[tokio::test]
async fn wheelhouse_packages_install_import_and_denials_name_the_package() -> Result<()> {
    let wheels = tempfile::tempdir()?;
    build_wheel(wheels.path(), "cgtiny", "1.0", &[])?;
    build_wheel(wheels.path(), "cgtiny", "2.0", &[])?;
    build_wheel(wheels.path(), "cgdenied", "1.0", &[])?;
    build_wheel(wheels.path(), "cgparent", "1.0", &["cgchild"])?;
    build_wheel(wheels.path(), "cgchild", "1.0", &[])?;
    for version in ["1.0", "2.0", "3.0", "3.1"] {
        build_wheel(wheels.path(), "cgrange", version, &[])?;
    }
    let setup = gateway_with(
        &[
            (
                "pkgs",
                "description = \"test\"\n[packages]\nallow = [\"CGTiny==1.*\", \"cgparent\", \"cgrange >=2.0, !=3.*\"]\n"
                    .to_owned(),
            ),
            (
                "implicit",
                "description = \"test\"\n[packages]\nallow = [\"cgparent\"]\ndependencies = \"implicit\"\n"
                    .to_owned(),
            ),
        ],
        format!("wheelhouse = {:?}\n", wheels.path()),
    )
    .await?;
    let gateway = &setup.gateway;
    let kernel = start_with_policy(gateway, "pkgs").await?;
    let mut client = gateway.connect(&kernel, "pkgs", false).await?;

    // Allowed: installs (the pin picks 1.0 although 2.0 is in the wheelhouse) and imports in
    // the same kernel.
    let msgs = run_long(&mut client, "%pip install cgtiny").await?;
    let out = stdout(&msgs);
    assert!(
        out.contains("Successfully installed cgtiny-1.0"),
        "{out}\n{}",
        stderr(&msgs)
    );
    assert!(denials(&msgs).is_empty(), "{:?}", denials(&msgs));
    let msgs = client
        .run("import cgtiny; print(cgtiny.VALUE, cgtiny.__file__)")
        .await?;
    let out = stdout(&msgs);
    assert!(
        out.starts_with("cgtiny 1.0 works /"),
        "{out}{}",
        stderr(&msgs)
    );

    // PEP 440 specifiers: `>=2.0, !=3.*` serves 2.0 (the newest it allows), and neither
    // 1.0 (below) nor 3.0 (excluded) is there for pip.
    let msgs = run_long(&mut client, "%pip install cgrange").await?;
    let out = stdout(&msgs);
    assert!(
        out.contains("Successfully installed cgrange-2.0"),
        "{out}\n{}",
        stderr(&msgs)
    );
    for refused in ["1.0", "3.0"] {
        let msgs = run_long(&mut client, &format!("%pip install cgrange=={refused}")).await?;
        let out = stdout(&msgs) + &stderr(&msgs);
        assert!(
            out.contains("No matching distribution found for cgrange==")
                && !out.contains("Successfully installed"),
            "{refused}: {out}"
        );
    }

    // Denied: fails at once, the reason names the package and the policy, on iopub and in
    // the reply's metadata.
    let started = Instant::now();
    let msgs = run_long(&mut client, "%pip install cgdenied").await?;
    println!("denied %pip install took {:?}", started.elapsed());
    let err = stderr(&msgs);
    assert!(
        err.contains("cellgate: package 'cgdenied' is not allowed by policy 'pkgs'"),
        "{err}"
    );
    let found = denials(&msgs);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0]["kind"], "package");
    assert_eq!(found[0]["target"], "cgdenied");
    assert_eq!(found[0]["policy"], "pkgs");
    assert!(
        stdout(&msgs).contains("No matching distribution")
            || err.contains("No matching distribution")
    );
    let msgs = client
        .run("import importlib.util; print(importlib.util.find_spec('cgdenied'))")
        .await?;
    assert_eq!(stdout(&msgs), "None\n");

    // A dependency that is not listed: the denial names it, and says whose dependency it is.
    let msgs = run_long(&mut client, "%pip install cgparent").await?;
    let found = denials(&msgs);
    assert!(
        found.iter().any(|d| d["target"] == "cgchild"
            && d["reason"]
                .as_str()
                .is_some_and(|r| r.contains("dependency of 'cgparent'"))),
        "{found:?}\n{}",
        stderr(&msgs)
    );

    // pip pointed at another index goes through the proxy and is refused there.
    let msgs = run_long(
        &mut client,
        "!pip install --index-url https://other.example/simple cgtiny2",
    )
    .await?;
    let found = denials(&msgs);
    assert!(
        found
            .iter()
            .any(|d| d["kind"] == "egress" && d["target"] == "other.example:443"),
        "{found:?}\n{}{}",
        stdout(&msgs),
        stderr(&msgs)
    );
    // Asking the index directly (not through pip) is refused the same way.
    let msgs = client
        .run(concat!(
            "import urllib.request, urllib.error\n",
            "try:\n",
            "    urllib.request.urlopen('http://packages.cellgate.internal/simple/cgdenied/', timeout=30)\n",
            "except urllib.error.HTTPError as e:\n",
            "    print(e.code)\n",
        ))
        .await?;
    assert_eq!(stdout(&msgs), "404\n", "{}", stderr(&msgs));
    assert_eq!(denials(&msgs).len(), 1);
    client.close().await;

    // With implicit dependencies, what an allowed wheel declares comes along; nothing else.
    let kernel = start_with_policy(gateway, "implicit").await?;
    let mut client = gateway.connect(&kernel, "implicit", false).await?;
    let msgs = run_long(&mut client, "%pip install cgparent").await?;
    let out = stdout(&msgs);
    assert!(
        out.contains("Successfully installed") && out.contains("cgchild-1.0"),
        "{out}{}",
        stderr(&msgs)
    );
    assert!(denials(&msgs).is_empty(), "{:?}", denials(&msgs));
    let msgs = run_long(&mut client, "%pip install cgtiny").await?;
    assert_eq!(denials(&msgs)[0]["target"], "cgtiny");
    Ok(())
}

#[tokio::test]
async fn egress_reaches_named_hosts_only_and_never_internal_addresses() -> Result<()> {
    let port = test_server("allowed").await?;
    let policy = format!(
        "description = \"net\"\n[egress]\nallow = [\"allowed.test:{port}\", \"*.wild.test:*\"]\n"
    );
    let setup = gateway_with(
        &[("net", policy)],
        concat!(
            "[egress_hosts]\n",
            "\"allowed.test\" = \"127.0.0.1\"\n",
            "\"denied.test\" = \"127.0.0.1\"\n",
            "\"svc.wild.test\" = \"127.0.0.1\"\n",
        )
        .to_owned(),
    )
    .await?;
    let gateway = &setup.gateway;
    let kernel = start_with_policy(gateway, "net").await?;
    let mut client = gateway.connect(&kernel, "net", false).await?;

    // Absolute-form HTTP through the proxy (urllib reads HTTP_PROXY).
    let msgs = client
        .run(&format!(
            "import urllib.request\nprint(urllib.request.urlopen('http://allowed.test:{port}/x', timeout=30).read().decode())"
        ))
        .await?;
    assert_eq!(
        stdout(&msgs),
        "hello from allowed\n",
        "{}\n{}",
        stderr(&msgs),
        gateway.log()
    );
    assert!(denials(&msgs).is_empty());

    // CONNECT to the allowed host is answered, but a tunnel carries TLS naming that host
    // only (attacks::egress_fronting has the TLS cases): plain HTTP inside it goes nowhere,
    // and the refusal is reported.
    let msgs = client
        .run(&format!(
            concat!(
                "import http.client\n",
                "c = http.client.HTTPConnection('127.0.0.1', 3128, timeout=30)\n",
                "c.set_tunnel('allowed.test', {port})\n",
                "try:\n",
                "    c.request('GET', '/')\n",
                "    print(c.getresponse().read().decode())\n",
                "except OSError as e:\n",
                "    print('refused', type(e).__name__)\n",
            ),
            port = port
        ))
        .await?;
    assert!(
        stdout(&msgs).starts_with("refused"),
        "{}{}",
        stdout(&msgs),
        stderr(&msgs)
    );
    let found = denials(&msgs);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0]["target"], format!("allowed.test:{port}"));
    assert!(
        found[0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("TLS")),
        "{found:?}"
    );

    // A host the policy does not name: 403 and a denial in the result.
    let probe = |url: String| {
        format!(
            concat!(
                "import urllib.request, urllib.error\n",
                "try:\n",
                "    urllib.request.urlopen('{url}', timeout=30)\n",
                "    print('reached')\n",
                "except urllib.error.HTTPError as e:\n",
                "    print(e.code)\n",
            ),
            url = url
        )
    };
    let msgs = client
        .run(&probe(format!("http://denied.test:{port}/")))
        .await?;
    assert_eq!(stdout(&msgs), "403\n", "{}", stderr(&msgs));
    let found = denials(&msgs);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0]["kind"], "egress");
    assert_eq!(found[0]["target"], format!("denied.test:{port}"));
    assert_eq!(found[0]["policy"], "net");
    assert!(stderr(&msgs).contains(&format!(
        "cellgate: egress to denied.test:{port} is not allowed by policy 'net'"
    )));

    // CONNECT to a denied host: 403 on the tunnel.
    let msgs = client
        .run(&format!(
            concat!(
                "import http.client\n",
                "c = http.client.HTTPConnection('127.0.0.1', 3128, timeout=30)\n",
                "c.set_tunnel('denied.test', {port})\n",
                "try:\n",
                "    c.request('GET', '/')\n",
                "    print('reached')\n",
                "except OSError as e:\n",
                "    print('refused', e)\n",
            ),
            port = port
        ))
        .await?;
    assert!(
        stdout(&msgs).starts_with("refused") && stdout(&msgs).contains("403"),
        "{}",
        stdout(&msgs)
    );
    assert_eq!(denials(&msgs).len(), 1);

    // A wildcard rule never opens loopback, whatever the name resolves to; nor does any rule
    // open 127.0.0.1 or the gateway's own port unless the policy names them.
    let msgs = client
        .run(&probe(format!("http://svc.wild.test:{port}/")))
        .await?;
    assert_eq!(stdout(&msgs), "403\n");
    let reason = denials(&msgs)[0]["reason"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(reason.contains("loopback"), "{reason}");
    for target in [
        format!("127.0.0.1:{port}"),
        format!("127.0.0.1:{}", gateway.port),
    ] {
        let msgs = client
            .run(&format!(
                concat!(
                    "import http.client\n",
                    "c = http.client.HTTPConnection('127.0.0.1', 3128, timeout=30)\n",
                    "c.request('GET', 'http://{target}/api')\n",
                    "print(c.getresponse().status)\n",
                ),
                target = target
            ))
            .await?;
        assert_eq!(stdout(&msgs), "403\n", "{target}: {}", stderr(&msgs));
        assert_eq!(denials(&msgs)[0]["target"], target.as_str());
    }

    // Garbage to the proxy gets a 400 on that connection; the proxy keeps serving.
    let msgs = client
        .run(&format!(concat!(
            "import socket, urllib.request\n",
            "s = socket.create_connection(('127.0.0.1', 3128), timeout=30)\n",
            "s.sendall(b'\\x00\\xff\\xfe not http at all\\r\\n\\r\\n')\n",
            "print(s.recv(12).decode())\n",
            "s.close()\n",
            "print(urllib.request.urlopen('http://allowed.test:{port}/', timeout=30).read().decode())\n",
        ), port = port))
        .await?;
    assert_eq!(
        stdout(&msgs),
        "HTTP/1.1 400\nhello from allowed\n",
        "{}",
        stderr(&msgs)
    );

    // No way around the proxy: no route to the host's loopback, no resolver.
    let msgs = client
        .run(&format!(
            concat!(
                "import socket, os\n",
                "try:\n",
                "    socket.create_connection(('127.0.0.1', {port}), timeout=30)\n",
                "    print('connected')\n",
                "except OSError as e:\n",
                "    print('direct:', type(e).__name__)\n",
                "try:\n",
                "    socket.getaddrinfo('allowed.test', {port})\n",
                "    print('resolved')\n",
                "except OSError as e:\n",
                "    print('dns:', type(e).__name__)\n",
                "print('resolv.conf:', os.path.exists('/etc/resolv.conf'))\n",
            ),
            port = port
        ))
        .await?;
    assert_eq!(
        stdout(&msgs),
        "direct: ConnectionRefusedError\ndns: gaierror\nresolv.conf: False\n",
        "{}",
        stderr(&msgs)
    );
    client.close().await;
    Ok(())
}

#[tokio::test]
async fn a_proxy_flood_from_one_sandbox_does_not_starve_another() -> Result<()> {
    let port = test_server("allowed").await?;
    let policy = format!("description = \"net\"\n[egress]\nallow = [\"allowed.test:{port}\"]\n");
    let setup = gateway_with(
        &[("net", policy)],
        "egress_max_connections = 8\n[egress_hosts]\n\"allowed.test\" = \"127.0.0.1\"\n".to_owned(),
    )
    .await?;
    let gateway = &setup.gateway;
    let flooder = start_with_policy(gateway, "net").await?;
    let victim = start_with_policy(gateway, "net").await?;
    let mut a = gateway.connect(&flooder, "a", false).await?;
    let mut b = gateway.connect(&victim, "b", false).await?;

    // The flooder opens many proxy connections and holds them open, sending nothing.
    let msgs = a
        .run(concat!(
            "import socket\n",
            "held = []\n",
            "for _ in range(200):\n",
            "    try:\n",
            "        held.append(socket.create_connection(('127.0.0.1', 3128), timeout=5))\n",
            "    except OSError:\n",
            "        pass\n",
            "print(len(held) > 0)\n",
        ))
        .await?;
    assert_eq!(stdout(&msgs), "True\n", "{}", stderr(&msgs));
    // Its own next request is refused at once (over its cap)…
    let msgs = a
        .run(&format!(
            concat!(
                "import urllib.request, urllib.error\n",
                "try:\n",
                "    urllib.request.urlopen('http://allowed.test:{port}/', timeout=10)\n",
                "    print('reached')\n",
                "except urllib.error.HTTPError as e:\n",
                "    print(e.code)\n",
                "except OSError as e:\n",
                "    print('refused')\n",
            ),
            port = port
        ))
        .await?;
    let out = stdout(&msgs);
    assert!(
        out == "429\n" || out == "refused\n",
        "{out}{}",
        stderr(&msgs)
    );
    // …while the other session's traffic goes through.
    let msgs = b
        .run(&format!(
            "import urllib.request\nprint(urllib.request.urlopen('http://allowed.test:{port}/', timeout=30).read().decode())"
        ))
        .await?;
    assert_eq!(stdout(&msgs), "hello from allowed\n", "{}", stderr(&msgs));
    // Releasing the connections gives the flooder its proxy back, once the gateway has seen
    // them close: asked again until then (a minute at most).
    let msgs = run_long(
        &mut a,
        &format!(
            concat!(
                "for s in held: s.close()\n",
                "import time, urllib.request\n",
                "end = time.monotonic() + 60\n",
                "while True:\n",
                "    try:\n",
                "        print(urllib.request.urlopen('http://allowed.test:{port}/', timeout=30).read().decode())\n",
                "        break\n",
                "    except OSError:\n",
                "        if time.monotonic() > end:\n",
                "            raise\n",
                "        time.sleep(0.2)\n",
            ),
            port = port
        ),
    )
    .await?;
    assert_eq!(stdout(&msgs), "hello from allowed\n", "{}", stderr(&msgs));
    Ok(())
}

/// The upstream path (PEP 691 JSON listing, download, hash check, cache) with a local
/// index standing in for PyPI: an allowed project installs; one the index lists but the
/// policy does not is refused.
#[tokio::test]
async fn an_allowed_package_installs_from_the_upstream_index() -> Result<()> {
    let wheels = tempfile::tempdir()?;
    let allowed = build_wheel(wheels.path(), "cgupstream", "1.0", &[])?;
    let listed = build_wheel(wheels.path(), "cgunlisted", "1.0", &[])?;
    let upstream = Upstream::start(&[allowed, listed]).await?;
    let setup = gateway_with(
        &[(
            "upstream",
            "description = \"upstream\"\n[packages]\nallow = [\"cgupstream\"]\n".to_owned(),
        )],
        upstream.config(),
    )
    .await?;
    let gateway = &setup.gateway;
    let kernel = start_with_policy(gateway, "upstream").await?;
    let mut client = gateway.connect(&kernel, "upstream", false).await?;
    let msgs = run_long(&mut client, "%pip install cgupstream").await?;
    assert!(
        stdout(&msgs).contains("Successfully installed cgupstream"),
        "{}{}",
        stdout(&msgs),
        stderr(&msgs)
    );
    let msgs = client
        .run("import cgupstream; print(cgupstream.VALUE)")
        .await?;
    assert_eq!(stdout(&msgs), "cgupstream 1.0 works\n", "{}", stderr(&msgs));
    // Listed upstream is not allowed: the index has it, the policy does not.
    let msgs = run_long(&mut client, "%pip install cgunlisted").await?;
    let found = denials(&msgs);
    assert!(
        found.iter().any(|d| d["target"] == "cgunlisted"),
        "{found:?}"
    );
    assert_eq!(
        upstream.hits.lock().get("cgunlisted-1.0-py3-none-any.whl"),
        None,
        "a refused project's file was downloaded"
    );
    Ok(())
}

/// API v1: a cell whose package install the policy refused is `denied`, with the denial
/// (package, policy, reason) in the result's `denials`, whether it raised or only printed
/// pip's failure (`%pip`); a cell that caught a refused connection stays `ok` and lists it.
#[tokio::test]
async fn api_v1_results_carry_denials_and_the_denied_status() -> Result<()> {
    let wheels = tempfile::tempdir()?;
    build_wheel(wheels.path(), "cgdenied", "1.0", &[])?;
    let setup = gateway_with(
        &[(
            "pkgs",
            "description = \"test\"\n[packages]\nallow = [\"cgtiny\"]\n".to_owned(),
        )],
        format!("wheelhouse = {:?}\n", wheels.path()),
    )
    .await?;
    let v1 = V1Client::new(&setup.gateway);
    let id = v1.create_session(json!({"policy": "pkgs"})).await?;
    let result = v1
        .execute(
            &id,
            "import subprocess, sys\nsubprocess.check_call([sys.executable, '-m', 'pip', 'install', '-q', 'cgdenied'])",
        )
        .await?;
    assert_eq!(result["status"], "denied", "{result}");
    let denials = result["denials"].as_array().context("denials")?;
    assert!(
        denials.iter().any(|d| d["kind"] == "package"
            && d["target"].as_str().is_some_and(|t| t.contains("cgdenied"))
            && d["policy"] == "pkgs"),
        "{result}"
    );
    // `%pip` does not raise when pip fails: the cell is still `denied`, not `ok`.
    let result = v1.execute(&id, "%pip install -q cgdenied").await?;
    assert_eq!(result["status"], "denied", "{result}");
    assert!(
        result["denials"].as_array().is_some_and(|d| !d.is_empty()),
        "{result}"
    );
    // A refused connection the code caught is the code's business: `ok`, the denial listed.
    let result = v1
        .execute(
            &id,
            "import urllib.request
try:
    urllib.request.urlopen('http://blocked.example/', timeout=30)
except Exception as e:
    print('caught', type(e).__name__)",
        )
        .await?;
    assert_eq!(result["status"], "ok", "{result}");
    assert!(
        result["denials"]
            .as_array()
            .is_some_and(|d| d.iter().any(|d| d["kind"] == "egress")),
        "{result}"
    );
    Ok(())
}

/// Writes `name-version`, a valid wheel whose module carries `size` random bytes stored
/// uncompressed (quick to write, and nothing along the way can shrink it).
fn build_large_wheel(dir: &Path, name: &str, version: &str, size: usize) -> Result<PathBuf> {
    let script = r#"
import base64, hashlib, os, sys, zipfile
out, name, version, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
dist = f"{name}-{version}.dist-info"
small = {
    f"{name}/__init__.py": f"VALUE = '{name} {version} works'\n",
    f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
    f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: cellgate-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
def digest(h):
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
record = []
path = os.path.join(out, f"{name}-{version}-py3-none-any.whl")
with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
    h = hashlib.sha256()
    with z.open(f"{name}/blob.bin", "w", force_zip64=True) as f:
        left = size
        while left:
            chunk = os.urandom(min(left, 1 << 20))
            h.update(chunk)
            f.write(chunk)
            left -= len(chunk)
    record.append(f"{name}/blob.bin,sha256={digest(h)},{size}")
    for p, text in small.items():
        z.writestr(p, text)
        record.append(f"{p},sha256={digest(hashlib.sha256(text.encode()))},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
print(path)
"#;
    let output = std::process::Command::new(tools_python())
        .args(["-c", script])
        .arg(dir)
        .args([name, version, &size.to_string()])
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "building a wheel failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(PathBuf::from(
        String::from_utf8(output.stdout)?.trim().to_owned(),
    ))
}

fn sha256_hex(path: &Path) -> Result<String> {
    use sha2::Digest;
    let mut hasher = sha2::Sha256::new();
    std::io::copy(&mut std::fs::File::open(path)?, &mut hasher)?;
    Ok(hex::encode(hasher.finalize()))
}

/// A PEP 691 upstream index on 127.0.0.1 serving wheels from disk with their sha256 and
/// `Content-Length`. It counts requests per file (any method) and the file bodies a client
/// dropped before their end; while `corrupt` is set it sends every file with one byte
/// changed; while `gate` is shut it sends a file's first MiB and then a KiB every 2 s
/// (slower than the gateway writes to its clients, faster than its stall timeout); it lists the
/// PEP 700 `size` of the files in `sizes` (which may lie); while `unannounced` is set it
/// sends files without a `Content-Length`.
struct Upstream {
    port: u16,
    hits: Arc<Mutex<HashMap<String, usize>>>,
    dropped: Arc<Mutex<HashMap<String, usize>>>,
    corrupt: Arc<AtomicBool>,
    unannounced: Arc<AtomicBool>,
    sizes: Arc<Mutex<HashMap<String, u64>>>,
    gate: tokio::sync::watch::Sender<bool>,
}

#[derive(Clone)]
struct UpstreamState {
    files: Arc<Vec<(String, PathBuf, String)>>,
    hits: Arc<Mutex<HashMap<String, usize>>>,
    dropped: Arc<Mutex<HashMap<String, usize>>>,
    corrupt: Arc<AtomicBool>,
    unannounced: Arc<AtomicBool>,
    sizes: Arc<Mutex<HashMap<String, u64>>>,
    gate: tokio::sync::watch::Receiver<bool>,
}

/// Counts a file body dropped before its end (its client hung up) in `dropped`.
struct BodyEnd {
    name: String,
    dropped: Arc<Mutex<HashMap<String, usize>>>,
    done: bool,
}

impl BodyEnd {
    fn finished(&mut self) {
        self.done = true;
    }
}

impl Drop for BodyEnd {
    fn drop(&mut self) {
        if !self.done {
            *self.dropped.lock().entry(self.name.clone()).or_default() += 1;
        }
    }
}

impl Upstream {
    async fn start(wheels: &[PathBuf]) -> Result<Upstream> {
        use axum::extract::{Path as UrlPath, State};
        use axum::http::{header, StatusCode};
        use axum::response::IntoResponse;
        let mut files = vec![];
        for path in wheels {
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .context("wheel name")?
                .to_owned();
            files.push((name, path.clone(), sha256_hex(path)?));
        }
        let (gate, gate_rx) = tokio::sync::watch::channel(true);
        let state = UpstreamState {
            files: Arc::new(files),
            hits: Arc::default(),
            dropped: Arc::default(),
            corrupt: Arc::default(),
            unannounced: Arc::default(),
            sizes: Arc::default(),
            gate: gate_rx,
        };
        let upstream = Upstream {
            port: 0,
            hits: state.hits.clone(),
            dropped: state.dropped.clone(),
            corrupt: state.corrupt.clone(),
            unannounced: state.unannounced.clone(),
            sizes: state.sizes.clone(),
            gate,
        };
        async fn project(
            State(state): State<UpstreamState>,
            UrlPath(project): UrlPath<String>,
        ) -> impl IntoResponse {
            let files: Vec<Value> = state
                .files
                .iter()
                .filter(|(name, _, _)| name.starts_with(&format!("{project}-")))
                .map(|(name, _, sha)| {
                    let mut entry = json!({"filename": name, "url": format!("/files/{name}"), "hashes": {"sha256": sha}});
                    if let Some(size) = state.sizes.lock().get(name) {
                        entry["size"] = json!(size);
                    }
                    entry
                })
                .collect();
            (
                [(header::CONTENT_TYPE, "application/vnd.pypi.simple.v1+json")],
                json!({"meta": {"api-version": "1.0"}, "name": project, "files": files})
                    .to_string(),
            )
        }
        async fn file(
            State(state): State<UpstreamState>,
            UrlPath(name): UrlPath<String>,
        ) -> axum::response::Response {
            let Some((_, path, _)) = state.files.iter().find(|(n, _, _)| *n == name) else {
                return StatusCode::NOT_FOUND.into_response();
            };
            *state.hits.lock().entry(name.clone()).or_default() += 1;
            let Ok(file) = tokio::fs::File::open(path).await else {
                return StatusCode::INTERNAL_SERVER_ERROR.into_response();
            };
            let Ok(meta) = file.metadata().await else {
                return StatusCode::INTERNAL_SERVER_ERROR.into_response();
            };
            let corrupt = state.corrupt.load(Ordering::SeqCst);
            let end = BodyEnd {
                name: name.clone(),
                dropped: state.dropped.clone(),
                done: false,
            };
            let chunks = futures_util::stream::unfold(
                (file, 0u64, state.gate.clone(), end),
                move |(mut file, sent, mut gate, mut end)| async move {
                    let mut len = 1 << 20;
                    if sent >= 1 << 20 && !*gate.borrow() {
                        // Shut: a trickle (a KiB every 2 s) until it opens, so that the
                        // gateway's stall timeout does not end a download a test holds.
                        match tokio::time::timeout(
                            Duration::from_secs(2),
                            gate.wait_for(|open| *open),
                        )
                        .await
                        {
                            Ok(Ok(_)) => {}
                            // The test is over and the gate gone; no one wants the rest.
                            Ok(Err(_)) => return None,
                            Err(_) => len = 1 << 10,
                        }
                    }
                    let mut buf = vec![0u8; len];
                    let n = file.read(&mut buf).await.ok()?;
                    if n == 0 {
                        end.finished();
                        return None;
                    }
                    buf.truncate(n);
                    if corrupt && sent == 0 {
                        buf[n / 2] ^= 0xff;
                    }
                    Some((
                        Ok::<_, std::io::Error>(bytes::Bytes::from(buf)),
                        (file, sent + n as u64, gate, end),
                    ))
                },
            );
            let mut response = (
                [(header::CONTENT_TYPE, "application/octet-stream".to_owned())],
                axum::body::Body::from_stream(chunks),
            )
                .into_response();
            if !state.unannounced.load(Ordering::SeqCst) {
                response
                    .headers_mut()
                    .insert(header::CONTENT_LENGTH, meta.len().into());
            }
            response
        }
        let app = axum::Router::new()
            .route("/simple/{project}/", axum::routing::get(project))
            .route("/files/{name}", axum::routing::get(file))
            .with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Upstream { port, ..upstream })
    }

    fn hits(&self, name: &str) -> usize {
        self.hits.lock().get(name).copied().unwrap_or(0)
    }

    /// File bodies dropped before their end, all files.
    fn dropped(&self) -> usize {
        self.dropped.lock().values().sum()
    }

    fn config(&self) -> String {
        format!(
            "package_index = \"http://127.0.0.1:{}/simple\"\n",
            self.port
        )
    }
}

/// The gateway's peak resident memory so far (VmHWM), in bytes.
fn peak_rss(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .context("VmHWM")?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kib << 10)
}

/// Messages of execution `msg_id` until its stdout contains `needle` (an error if the
/// execution ends first), added to `msgs`.
async fn until_stdout(
    client: &mut Client,
    msg_id: &str,
    needle: &str,
    msgs: &mut Vec<Msg>,
) -> Result<()> {
    while !stdout(msgs).contains(needle) {
        let msg = client.recv(Duration::from_secs(180)).await?;
        anyhow::ensure!(
            !msg.is_idle_for(msg_id),
            "execution ended before {needle:?}:\n{}{}",
            stdout(msgs),
            stderr(msgs)
        );
        msgs.push(msg);
    }
    Ok(())
}

/// The rest of execution `msg_id` (until its idle status and its reply), added to `msgs`.
async fn finish(client: &mut Client, msg_id: &str, msgs: &mut Vec<Msg>) -> Result<()> {
    let (mut idle, mut replied) = (false, false);
    while !(idle && replied) {
        let msg = client.recv(Duration::from_secs(300)).await?;
        idle |= msg.is_idle_for(msg_id);
        replied |= msg.channel == "shell" && msg.parent_id() == msg_id;
        msgs.push(msg);
    }
    Ok(())
}

/// A large wheel streams from the upstream index to pip: one upstream download however many
/// sessions install it at once, a `Content-Length` all the way (pip names the size and
/// draws a progress bar, which reaches an API v1 client as one clean line), and the
/// gateway's memory does not grow with the wheel.
#[tokio::test]
async fn a_large_wheel_streams_once_to_concurrent_installs_in_bounded_memory() -> Result<()> {
    let wheels = tempfile::tempdir()?;
    let wheel = build_large_wheel(wheels.path(), "cgbig", "1.0", 160 << 20)?;
    let name = wheel
        .file_name()
        .and_then(|n| n.to_str())
        .context("name")?
        .to_owned();
    let size = std::fs::metadata(&wheel)?.len();
    let sha = sha256_hex(&wheel)?;
    let upstream = Upstream::start(std::slice::from_ref(&wheel)).await?;
    let setup = gateway_with(
        &[(
            "big",
            "description = \"big\"\n[packages]\nallow = [\"cgbig\"]\n".to_owned(),
        )],
        upstream.config(),
    )
    .await?;
    let gateway = &setup.gateway;
    // One install through Jupyter's protocol, one through API v1 (streamed as SSE).
    let kernel = start_with_policy(gateway, "big").await?;
    let mut client = gateway.connect(&kernel, "a", false).await?;
    let v1 = V1Client::new(gateway);
    let session = v1.create_session(json!({"policy": "big"})).await?;
    let rss_before = peak_rss(gateway.pid())?;

    // Upstream sends the first MiB and holds the rest until both pips are reading.
    upstream.gate.send_replace(false);
    let id = client.execute("%pip install cgbig").await?;
    let mut events = v1
        .sse(
            &format!("/v1/sessions/{session}/execute"),
            json!({"code": "%pip install cgbig"}),
        )
        .await?;
    // pip names the size only from a Content-Length, once the gateway answered: both
    // sessions are then reading the download that upstream is holding.
    let shown = format!("({:.1} MB)", size as f64 / 1e6);
    let mut msgs = vec![];
    until_stdout(&mut client, &id, &shown, &mut msgs).await?;
    let mut streamed = String::new();
    while !streamed.contains(&shown) {
        let (kind, event) = events.next().await?;
        anyhow::ensure!(kind != "done", "API v1 install ended early: {event}");
        if kind == "stream" {
            streamed.push_str(event["text"].as_str().unwrap_or_default());
        }
    }
    upstream.gate.send_replace(true);
    finish(&mut client, &id, &mut msgs).await?;
    let result = loop {
        let (kind, event) = events.next().await?;
        if kind == "stream" {
            streamed.push_str(event["text"].as_str().unwrap_or_default());
        }
        if kind == "done" {
            break event["result"].clone();
        }
    };
    assert!(
        stdout(&msgs).contains("Successfully installed cgbig-1.0"),
        "{}{}",
        stdout(&msgs),
        stderr(&msgs)
    );
    let out = result["stdout"].as_str().context("stdout")?;
    assert!(out.contains("Successfully installed cgbig-1.0"), "{result}");
    assert_eq!(
        upstream.hits(&name),
        1,
        "two installs, one upstream download"
    );
    assert!(
        setup._dir.path().join("cache").join(&sha).exists(),
        "the verified file is in the cache"
    );

    // API v1: pip's progress bar (drawn under a pty, redrawn in place many times while
    // upstream held the file) is one line with the sizes, done, without escape sequences
    // or the frames it overwrote; the live events carry no escape sequences either.
    println!("API v1 stdout of the install:\n{out}");
    let total = format!("{:.1}", size as f64 / 1e6);
    let bar: Vec<&str> = out
        .lines()
        .filter(|l| l.contains(&format!("/{total} MB")))
        .collect();
    assert_eq!(bar.len(), 1, "one progress line: {out:?}");
    assert!(
        bar[0].contains(&format!("{total}/{total} MB")),
        "the last frame: {out:?}"
    );
    assert!(
        !out.contains('\u{1b}') && !out.contains('\r') && !out.contains("bytes ?"),
        "{out:?}"
    );
    assert!(!streamed.contains('\u{1b}'), "{streamed:?}");

    let msgs = client.run("import cgbig; print(cgbig.VALUE)").await?;
    assert_eq!(stdout(&msgs), "cgbig 1.0 works\n", "{}", stderr(&msgs));
    // A cached file has its length too.
    let msgs = client
        .run(&format!(
            concat!(
                "import urllib.request\n",
                "r = urllib.request.urlopen(urllib.request.Request('http://packages.cellgate.internal/files/{sha}/{name}', method='HEAD'), timeout=30)\n",
                "print(r.status, r.headers['Content-Length'])\n",
            ),
            sha = sha,
            name = name
        ))
        .await?;
    assert_eq!(stdout(&msgs), format!("200 {size}\n"), "{}", stderr(&msgs));

    let rss_after = peak_rss(gateway.pid())?;
    let growth = rss_after.saturating_sub(rss_before);
    println!(
        "gateway peak RSS: {} MiB before, {} MiB after 2 installs of a {} MiB wheel (+{} MiB)",
        rss_before >> 20,
        rss_after >> 20,
        size >> 20,
        growth >> 20
    );
    assert!(
        growth < size / 4,
        "peak RSS grew by {} MiB for a {} MiB wheel",
        growth >> 20,
        size >> 20
    );
    Ok(())
}

/// An upstream whose bytes do not match the sha256 it lists: the install fails, nothing is
/// left in the cache (not even a partial file), and once upstream serves the right bytes
/// the same install works.
#[tokio::test]
async fn a_download_that_fails_its_hash_is_refused_and_leaves_nothing_cached() -> Result<()> {
    let wheels = tempfile::tempdir()?;
    let wheel = build_large_wheel(wheels.path(), "cgbad", "1.0", 4 << 20)?;
    let name = wheel
        .file_name()
        .and_then(|n| n.to_str())
        .context("name")?
        .to_owned();
    let sha = sha256_hex(&wheel)?;
    let upstream = Upstream::start(std::slice::from_ref(&wheel)).await?;
    let setup = gateway_with(
        &[(
            "bad",
            "description = \"bad\"\n[packages]\nallow = [\"cgbad\"]\n".to_owned(),
        )],
        upstream.config(),
    )
    .await?;
    let gateway = &setup.gateway;
    let cache = setup._dir.path().join("cache");
    let kernel = start_with_policy(gateway, "bad").await?;
    let mut client = gateway.connect(&kernel, "bad", false).await?;

    upstream.corrupt.store(true, Ordering::SeqCst);
    let msgs = run_long(&mut client, "%pip install cgbad").await?;
    let out = stdout(&msgs) + &stderr(&msgs);
    assert!(!out.contains("Successfully installed"), "{out}");
    assert_eq!(upstream.hits(&name), 1, "{out}");
    let msgs = client
        .run("import importlib.util; print(importlib.util.find_spec('cgbad'))")
        .await?;
    assert_eq!(stdout(&msgs), "None\n", "{}", stderr(&msgs));
    // pip's urllib3 does not hold a response to its Content-Length, so pip failed on its own
    // hash check; Python's http.client does: the body ends before its last byte.
    let msgs = client
        .run(&format!(
            concat!(
                "import urllib.request, http.client\n",
                "try:\n",
                "    data = urllib.request.urlopen('http://packages.cellgate.internal/files/{sha}/{name}', timeout=30).read()\n",
                "    print('whole', len(data))\n",
                "except http.client.IncompleteRead as e:\n",
                "    print('incomplete', len(e.partial) < {size})\n",
            ),
            sha = sha,
            name = name,
            size = std::fs::metadata(&wheel)?.len()
        ))
        .await?;
    assert_eq!(stdout(&msgs), "incomplete True\n", "{}", stderr(&msgs));
    assert_eq!(upstream.hits(&name), 2, "a failed download is not reused");
    let left: Vec<_> = std::fs::read_dir(&cache)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<std::io::Result<_>>()?;
    assert!(left.is_empty(), "left in the cache: {left:?}");
    assert!(
        gateway.log().contains("does not match"),
        "the gateway says why: {}",
        gateway.log()
    );

    upstream.corrupt.store(false, Ordering::SeqCst);
    let msgs = run_long(&mut client, "%pip install cgbad").await?;
    assert!(
        stdout(&msgs).contains("Successfully installed cgbad-1.0"),
        "{}{}",
        stdout(&msgs),
        stderr(&msgs)
    );
    assert_eq!(upstream.hits(&name), 3);
    let left: Vec<_> = std::fs::read_dir(&cache)?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<_>>()?;
    assert_eq!(left, [sha]);
    Ok(())
}

/// The names in the package cache directory (temporary files start with a dot).
fn cache_entries(cache: &Path) -> Result<Vec<String>> {
    Ok(std::fs::read_dir(cache)?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<_>>()?)
}

/// Waits until `done` holds, failing after a generous minute with `what` and the log.
async fn eventually(gateway: &Gateway, what: &str, mut done: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "never: {what}\n{}",
            gateway.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Python that prints the `/files/...` URL of `project`'s (only) file, as the gateway's
/// index lists it to this kernel.
fn listed_url(project: &str) -> String {
    format!(
        concat!(
            "import json, urllib.request\n",
            "def listed(p):\n",
            "    r = urllib.request.Request(f'http://packages.cellgate.internal/simple/{{p}}/', headers={{'Accept': 'application/vnd.pypi.simple.v1+json'}})\n",
            "    return 'http://packages.cellgate.internal' + json.load(urllib.request.urlopen(r, timeout=60))['files'][0]['url']\n",
            "url = listed('{project}')\n",
        ),
        project = project
    )
}

/// A hostile kernel cannot leave downloads behind or hold the slots: clients that hang up
/// mid-download stop their downloads (upstream sees its connections dropped, the temporary
/// files go, nothing is cached); a request that finds every slot taken gets a 503 with
/// `Retry-After` once it waited too long, and its queued download is dropped without ever
/// reaching upstream; afterwards the same files install.
#[tokio::test]
async fn downloads_whose_clients_hang_up_or_wait_too_long_leave_nothing_behind() -> Result<()> {
    let wheels = tempfile::tempdir()?;
    let mut names = vec![];
    let mut paths = vec![];
    for i in 0..5 {
        let wheel = build_large_wheel(wheels.path(), &format!("cgquit{i}"), "1.0", 3 << 20)?;
        names.push(
            wheel
                .file_name()
                .and_then(|n| n.to_str())
                .context("name")?
                .to_owned(),
        );
        paths.push(wheel);
    }
    let upstream = Upstream::start(&paths).await?;
    let allow: Vec<String> = (0..5).map(|i| format!("\"cgquit{i}\"")).collect();
    let setup = gateway_with(
        &[(
            "quit",
            format!(
                "description = \"quit\"\n[packages]\nallow = [{}]\n",
                allow.join(", ")
            ),
        )],
        upstream.config(),
    )
    .await?;
    let gateway = &setup.gateway;
    let cache = setup._dir.path().join("cache");
    let kernel = start_with_policy(gateway, "quit").await?;
    let mut client = gateway.connect(&kernel, "quit", false).await?;

    // Upstream sends each file's first MiB and holds the rest: four downloads take the four
    // slots, each with one client that has its first bytes.
    upstream.gate.send_replace(false);
    let msgs = client
        .run(&format!(
            concat!(
                "{listed}",
                "held = []\n",
                "for i in range(4):\n",
                "    r = urllib.request.urlopen(listed(f'cgquit{{i}}'), timeout=60)\n",
                "    print(len(r.read(1000)), r.headers['Content-Length'])\n",
                "    held.append(r)\n",
            ),
            listed = listed_url("cgquit0"),
        ))
        .await?;
    let size = std::fs::metadata(&paths[0])?.len();
    assert_eq!(
        stdout(&msgs),
        format!("1000 {size}\n").repeat(4),
        "{}",
        stderr(&msgs)
    );
    let temporaries = cache_entries(&cache)?;
    assert!(
        temporaries.len() == 4 && temporaries.iter().all(|n| n.starts_with('.')),
        "{temporaries:?}"
    );

    // The fifth waits for a slot, then is told to come back later.
    let started = Instant::now();
    let msgs = client
        .run(concat!(
            "import urllib.error\n",
            "try:\n",
            "    urllib.request.urlopen(listed('cgquit4'), timeout=120)\n",
            "    print('served')\n",
            "except urllib.error.HTTPError as e:\n",
            "    print(e.code, e.headers['Retry-After'])\n",
        ))
        .await?;
    println!(
        "the queued request was refused after {:?}",
        started.elapsed()
    );
    assert_eq!(stdout(&msgs), "503 10\n", "{}", stderr(&msgs));
    assert_eq!(
        upstream.hits(&names[4]),
        0,
        "the queued download never started"
    );

    // The four clients hang up: their downloads stop.
    let msgs = client
        .run("for r in held: r.close()\nheld.clear()\nprint('closed')")
        .await?;
    assert_eq!(stdout(&msgs), "closed\n", "{}", stderr(&msgs));
    eventually(gateway, "upstream sees the four downloads dropped", || {
        upstream.dropped() == 4
    })
    .await?;
    eventually(gateway, "the temporary files are removed", || {
        cache_entries(&cache).is_ok_and(|e| e.is_empty())
    })
    .await?;
    // Four running downloads stopped, and the queued one dropped when its client left.
    eventually(gateway, "five downloads dropped", || {
        gateway.log().matches("every client hung up").count() == 5
    })
    .await?;
    assert_eq!(
        upstream.hits(&names[4]),
        0,
        "the queued download never started"
    );

    // The same files install afresh.
    upstream.gate.send_replace(true);
    let msgs = run_long(&mut client, "%pip install cgquit0 cgquit4").await?;
    let out = stdout(&msgs);
    assert!(
        out.contains("Successfully installed")
            && out.contains("cgquit0-1.0")
            && out.contains("cgquit4-1.0"),
        "{out}{}",
        stderr(&msgs)
    );
    assert_eq!(upstream.hits(&names[0]), 2);
    assert_eq!(upstream.hits(&names[4]), 1);
    let mut left = cache_entries(&cache)?;
    left.sort();
    let mut want = vec![sha256_hex(&paths[0])?, sha256_hex(&paths[4])?];
    want.sort();
    assert_eq!(left, want);
    Ok(())
}

/// `HEAD` of a file answers from what the gateway knows (the listed size; then the cached
/// file's length) and never starts a download.
#[tokio::test]
async fn head_of_a_file_never_reaches_upstream() -> Result<()> {
    let wheels = tempfile::tempdir()?;
    let wheel = build_wheel(wheels.path(), "cghead", "1.0", &[])?;
    let name = wheel
        .file_name()
        .and_then(|n| n.to_str())
        .context("name")?
        .to_owned();
    let size = std::fs::metadata(&wheel)?.len();
    let upstream = Upstream::start(std::slice::from_ref(&wheel)).await?;
    upstream.sizes.lock().insert(name.clone(), size);
    let setup = gateway_with(
        &[(
            "head",
            "description = \"head\"\n[packages]\nallow = [\"cghead\"]\n".to_owned(),
        )],
        upstream.config(),
    )
    .await?;
    let gateway = &setup.gateway;
    let cache = setup._dir.path().join("cache");
    let kernel = start_with_policy(gateway, "head").await?;
    let mut client = gateway.connect(&kernel, "head", false).await?;
    let head = concat!(
        "r = urllib.request.urlopen(urllib.request.Request(url, method='HEAD'), timeout=30)\n",
        "print(r.status, r.headers['Content-Length'], len(r.read()))\n",
    );
    let msgs = client
        .run(&format!("{}{}", listed_url("cghead"), head))
        .await?;
    assert_eq!(
        stdout(&msgs),
        format!("200 {size} 0\n"),
        "{}",
        stderr(&msgs)
    );
    assert_eq!(upstream.hits(&name), 0, "a HEAD reached upstream");
    assert!(cache_entries(&cache)?.is_empty());

    let msgs = run_long(&mut client, "%pip install cghead").await?;
    assert!(
        stdout(&msgs).contains("Successfully installed cghead-1.0"),
        "{}{}",
        stdout(&msgs),
        stderr(&msgs)
    );
    assert_eq!(upstream.hits(&name), 1);
    // Cached: its length, still without upstream.
    let msgs = client.run(head).await?;
    assert_eq!(
        stdout(&msgs),
        format!("200 {size} 0\n"),
        "{}",
        stderr(&msgs)
    );
    assert_eq!(upstream.hits(&name), 1);
    Ok(())
}

/// An upstream that sends more than the index listed for a file (PEP 700 `size`), without
/// a `Content-Length` to give it away, is cut off: the install fails, nothing is cached,
/// and the gateway says why.
#[tokio::test]
async fn an_upstream_file_larger_than_its_listed_size_is_refused() -> Result<()> {
    let wheels = tempfile::tempdir()?;
    let wheel = build_large_wheel(wheels.path(), "cglong", "1.0", 3 << 20)?;
    let name = wheel
        .file_name()
        .and_then(|n| n.to_str())
        .context("name")?
        .to_owned();
    let size = std::fs::metadata(&wheel)?.len();
    let upstream = Upstream::start(std::slice::from_ref(&wheel)).await?;
    upstream.sizes.lock().insert(name.clone(), size - 4096);
    upstream.unannounced.store(true, Ordering::SeqCst);
    let setup = gateway_with(
        &[(
            "long",
            "description = \"long\"\n[packages]\nallow = [\"cglong\"]\n".to_owned(),
        )],
        upstream.config(),
    )
    .await?;
    let gateway = &setup.gateway;
    let cache = setup._dir.path().join("cache");
    let kernel = start_with_policy(gateway, "long").await?;
    let mut client = gateway.connect(&kernel, "long", false).await?;
    let msgs = run_long(&mut client, "%pip install cglong").await?;
    let out = stdout(&msgs) + &stderr(&msgs);
    assert!(!out.contains("Successfully installed"), "{out}");
    assert!(upstream.hits(&name) >= 1, "{out}");
    let msgs = client
        .run("import importlib.util; print(importlib.util.find_spec('cglong'))")
        .await?;
    assert_eq!(stdout(&msgs), "None\n", "{}", stderr(&msgs));
    assert!(
        cache_entries(&cache)?.is_empty(),
        "{:?}",
        cache_entries(&cache)
    );
    let why = format!("more than the {} bytes the index lists", size - 4096);
    assert!(gateway.log().contains(&why), "{why}: {}", gateway.log());
    Ok(())
}
