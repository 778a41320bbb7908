//! The REST contract and bad input: tokens, ids, bodies, frames.

use futures_util::SinkExt;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message as WsMessage;

use crate::support::*;

fn is_kg_timestamp(s: &str) -> bool {
    // YYYY-MM-DDTHH:MM:SS.ffffffZ
    s.len() == 27
        && s.ends_with('Z')
        && s.as_bytes()[10] == b'T'
        && s.as_bytes()[19] == b'.'
        && s[20..26].chars().all(|c| c.is_ascii_digit())
}

#[tokio::test]
async fn rest_contract() -> anyhow::Result<()> {
    let gateway = Gateway::start().await?;
    let (status, specs) = gateway.get_json("/api/kernelspecs").await?;
    assert_eq!(status, 200);
    assert_eq!(specs["default"], "python3");
    let spec = &specs["kernelspecs"]["python3"];
    assert_eq!(spec["name"], "python3");
    assert!(
        spec["spec"]["argv"]
            .as_array()
            .unwrap()
            .iter()
            .all(|a| !a.as_str().unwrap().starts_with('/')),
        "no host paths: {spec}"
    );
    assert_eq!(spec["spec"]["env"], json!({}));
    // The GatewayClient bug: ?user=bob/python3 means the single spec.
    let (status, single) = gateway
        .get_json("/api/kernelspecs?user=bob/python3")
        .await?;
    assert_eq!((status, &single["name"]), (200, &json!("python3")));
    let (status, body) = gateway.get_json("/api/kernelspecs/nope").await?;
    assert_eq!(
        (status, body["message"].as_str().unwrap()),
        (404, "Kernel spec nope not found")
    );

    let response = gateway
        .request(reqwest::Method::POST, "/api/kernels")
        .json(&json!({"name": "python3", "env": {"KERNEL_USERNAME": "bob", "KERNEL_WORKING_DIR": "/home/bob", "SECRET": "x"}}))
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 201);
    let location = response.headers()["location"].to_str()?.to_owned();
    let model: Value = response.json().await?;
    let id = model["id"].as_str().unwrap().to_owned();
    assert_eq!(location, format!("/api/kernels/{id}"));
    assert!(
        is_kg_timestamp(model["last_activity"].as_str().unwrap()),
        "{model}"
    );
    assert_eq!(model["connections"], 0);
    let keys: Vec<&String> = model.as_object().unwrap().keys().collect();
    // Kernel Gateway's fields, plus cellgate's own under one namespaced key.
    assert_eq!(
        keys,
        [
            "cellgate",
            "connections",
            "execution_state",
            "id",
            "last_activity",
            "name"
        ]
    );
    assert_eq!(model["cellgate"]["policy"], "default");
    assert_eq!(model["cellgate"]["state_generation"], 1);

    // The environment the kernel really got.
    let mut client = gateway.connect(&id, "env", false).await?;
    let msgs = client
        .run("import os; print(os.environ.get('KERNEL_USERNAME'), os.environ.get('KERNEL_WORKING_DIR'), os.environ.get('SECRET'), 'CELLGATE_AUTH_TOKEN' in os.environ)")
        .await?;
    assert_eq!(stdout(&msgs), "bob None None False\n");

    let (status, list) = gateway.get_json("/api/kernels").await?;
    assert_eq!(status, 200);
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(list[0]["execution_state"], "idle");
    assert_eq!(list[0]["connections"], 1);

    let status = gateway
        .request(
            reqwest::Method::POST,
            &format!("/api/kernels/{id}/interrupt"),
        )
        .send()
        .await?
        .status();
    assert_eq!(status.as_u16(), 204);

    // Unknown ids: a well-formed one is "Kernel does not exist", a malformed one the catch-all.
    let (status, body) = gateway
        .get_json("/api/kernels/00000000-0000-0000-0000-000000000000")
        .await?;
    assert_eq!(status, 404);
    assert!(body["message"]
        .as_str()
        .unwrap()
        .starts_with("Kernel does not exist"));
    let (status, body) = gateway.get_json("/api/kernels/abc").await?;
    assert_eq!(status, 404);
    assert_eq!(body["reason"], "Not Found", "{body}");
    assert_eq!(body["code"], "no_such_kernel", "{body}");
    assert!(body["message"].as_str().unwrap().contains("abc"), "{body}");
    let (status, body) = gateway.get_json("/no/such/route").await?;
    assert_eq!(status, 404);
    assert_eq!(body["code"], "no_such_route", "{body}");

    // Bad bodies are 400 with a reason, unknown kernel names 404.
    for body in [
        "{",
        "[]",
        r#"{"env": "x"}"#,
        r#"{"env": {"KERNEL_X": "$(id)"}}"#,
    ] {
        let response = gateway
            .request(reqwest::Method::POST, "/api/kernels")
            .header("Content-Type", "application/json")
            .body(body)
            .send()
            .await?;
        assert_eq!(response.status().as_u16(), 400, "{body}");
        let json: Value = response.json().await?;
        assert_eq!(json["reason"], "Bad Request");
    }
    let response = gateway
        .request(reqwest::Method::POST, "/api/kernels")
        .json(&json!({"name": "nope"}))
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 404);
    let text = response.text().await?;
    assert!(
        !text.contains("Traceback") && !text.contains('/'),
        "no internals leak: {text}"
    );
    assert_eq!(gateway.delete_kernel(&id).await?, 204);
    Ok(())
}

/// A refused request with a body ends its connection, and says so: the body was never read,
/// so the connection cannot carry another request, and a client that reused it (the same
/// request again, now with a token) would meet a closed socket. Many requests in a row,
/// refused then accepted on one client, all get answers.
#[tokio::test]
async fn a_refused_request_with_a_body_closes_its_connection_openly() -> anyhow::Result<()> {
    let gateway = Gateway::start().await?;
    let url = format!("{}/api/kernels", gateway.base);
    let client = reqwest::Client::new();
    let body = json!({"name": "python3", "env": {"PAD": "x".repeat(4096)}});
    let refused = client.post(&url).json(&body).send().await?;
    assert_eq!(refused.status().as_u16(), 401);
    assert_eq!(
        refused
            .headers()
            .get("connection")
            .map(|v| v.to_str().unwrap_or_default()),
        Some("close"),
        "{:?}",
        refused.headers()
    );
    let bodiless = client.get(&url).send().await?;
    assert_eq!(bodiless.status().as_u16(), 401);
    assert!(
        bodiless.headers().get("connection").is_none(),
        "a refusal with nothing unread keeps its connection: {:?}",
        bodiless.headers()
    );
    for round in 0..20 {
        let refused = client.post(&url).json(&body).send().await?;
        assert_eq!(refused.status().as_u16(), 401, "round {round}");
        let listed = client
            .get(&url)
            .header("Authorization", format!("token {TOKEN}"))
            .send()
            .await?;
        assert_eq!(listed.status().as_u16(), 200, "round {round}");
    }
    Ok(())
}

#[tokio::test]
async fn tokens_are_required_everywhere() -> anyhow::Result<()> {
    let gateway = Gateway::start().await?;
    let id = gateway.start_kernel().await?;
    let url = |p: &str| format!("{}{}", gateway.base, p);
    let plain = reqwest::Client::new();
    for (auth, expected) in [
        (None, 401),
        (Some("token wrong"), 401),
        (Some("token "), 401),
        (Some("Basic dGVzdA=="), 401),
        (Some(&*format!("token {TOKEN}")), 200),
        (Some(&*format!("Bearer {TOKEN}")), 200),
    ] {
        let mut request = plain.get(url("/api/kernels"));
        if let Some(auth) = auth {
            request = request.header("Authorization", auth);
        }
        let response = request.send().await?;
        assert_eq!(response.status().as_u16(), expected, "{auth:?}");
        if expected == 401 {
            // Kernel Gateway answers an empty message; a client is better told how to
            // authenticate, in the body and in the challenge.
            let challenge = response.headers().get("www-authenticate").cloned();
            let body: Value = response.json().await?;
            assert_eq!(body["reason"], "Unauthorized", "{body}");
            assert!(
                body["code"] == "invalid_token" || body["code"] == "missing_token",
                "{body}"
            );
            assert!(challenge.is_some_and(|c| c.to_str().unwrap().starts_with("Bearer")));
        }
    }
    assert_eq!(
        plain
            .get(url(&format!("/api/kernels?token={TOKEN}")))
            .send()
            .await?
            .status()
            .as_u16(),
        200
    );
    assert_eq!(
        plain
            .get(url("/api/kernels?token=nope"))
            .send()
            .await?
            .status()
            .as_u16(),
        401
    );
    assert_eq!(
        plain
            .post(url("/api/kernels"))
            .send()
            .await?
            .status()
            .as_u16(),
        401
    );
    assert_eq!(
        plain
            .delete(url(&format!("/api/kernels/{id}")))
            .send()
            .await?
            .status()
            .as_u16(),
        401
    );

    // WebSocket: no token → 401; token in the query works (browsers cannot set headers).
    let ws_url = gateway.ws_url(&id, "s");
    let err = tokio_tungstenite::connect_async(ws_url.clone())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("401"), "{err}");
    let (mut socket, _) =
        tokio_tungstenite::connect_async(format!("{ws_url}&token={TOKEN}")).await?;
    socket.close(None).await?;
    // A foreign Origin is refused, an unknown kernel is 404.
    let mut request = format!("{ws_url}&token={TOKEN}").into_client_request()?;
    request
        .headers_mut()
        .insert("Origin", "http://evil.example".parse()?);
    let err = tokio_tungstenite::connect_async(request).await.unwrap_err();
    assert!(err.to_string().contains("403"), "{err}");
    let missing = gateway.ws_url("00000000-0000-0000-0000-000000000000", "s");
    let err = tokio_tungstenite::connect_async(format!("{missing}&token={TOKEN}"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("404"), "{err}");
    Ok(())
}

#[tokio::test]
async fn without_a_token_serve_refuses_public_addresses() -> anyhow::Result<()> {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_cellgate"))
        .args([
            "serve",
            "--ip",
            "0.0.0.0",
            "--port",
            "0",
            "--sandbox",
            "process",
        ])
        .env_remove("CELLGATE_AUTH_TOKEN")
        .env_remove("KG_AUTH_TOKEN")
        .output()?;
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("without a token"), "{stderr}");
    Ok(())
}

/// Garbage on one socket closes that socket with a reason; the kernel and other sockets carry on.
#[tokio::test]
async fn malformed_frames_close_only_their_socket() -> anyhow::Result<()> {
    let gateway = Gateway::builder()
        .arg("--max-message-mib")
        .arg("1")
        .start()
        .await?;
    let id = gateway.start_kernel().await?;
    let mut bystander = gateway.connect(&id, "bystander", false).await?;
    let cases: Vec<(bool, WsMessage)> = vec![
        (false, WsMessage::Text("not json".into())),
        (
            false,
            WsMessage::Text(r#"{"header": {"msg_type": "execute_request"}}"#.into()),
        ),
        (
            false,
            WsMessage::Text(
                r#"{"header": {"msg_id": "a", "msg_type": "x"}, "channel": "nope"}"#.into(),
            ),
        ),
        (false, WsMessage::Binary(vec![0, 0, 0, 9, 1, 2].into())),
        (true, WsMessage::Binary(vec![255; 40].into())),
        (true, WsMessage::Binary(vec![0; 3].into())),
        (false, WsMessage::Text("x".repeat(2 << 20).into())),
    ];
    for (i, (v1, frame)) in cases.into_iter().enumerate() {
        let mut attacker = gateway.connect(&id, &format!("attacker-{i}"), v1).await?;
        let _ = attacker.socket.send(frame).await;
        // A close: a wait that runs out is no close (its error says "no message within").
        let outcome = attacker.recv(PATIENCE).await;
        let err = outcome.expect_err("the socket is closed").to_string();
        assert!(
            err.contains("1007")
                || err.contains("1009")
                || err.contains("Invalid")
                || err.contains("invalid")
                || err.contains("closed"),
            "case {i}: {err}"
        );
        let msgs = bystander.run(&format!("{i} + 1")).await?;
        assert_eq!(
            of_type(&msgs, "execute_result")[0].content["data"]["text/plain"],
            (i + 1).to_string()
        );
    }
    Ok(())
}

#[tokio::test]
async fn kernelspec_resources_are_served() -> anyhow::Result<()> {
    let gateway = Gateway::start().await?;
    let (_, specs) = gateway.get_json("/api/kernelspecs").await?;
    let resources = &specs["kernelspecs"]["python3"]["resources"];
    let logo = resources["logo-64x64"].as_str().expect("a 64x64 logo");
    assert_eq!(logo, "/kernelspecs/python3/logo-64x64.png");
    let response = gateway.request(reqwest::Method::GET, logo).send().await?;
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(response.headers()["content-type"], "image/png");
    let bytes = response.bytes().await?;
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert!(resources["logo-svg"]
        .as_str()
        .unwrap()
        .ends_with("logo-svg.svg"));
    // Nothing else in the spec's directory is reachable.
    for path in [
        "/kernelspecs/python3/kernel.json",
        "/kernelspecs/python3/..%2Fpython3%2Fkernel.json",
        "/kernelspecs/python3/requirements.txt",
    ] {
        let status = gateway
            .request(reqwest::Method::GET, path)
            .send()
            .await?
            .status()
            .as_u16();
        assert_eq!(status, 404, "{path}");
    }
    Ok(())
}

/// Browsers send preflights without credentials; Kernel Gateway refuses them (403), so browser
/// apps cannot talk to it. We answer them before auth.
#[tokio::test]
async fn cors_preflight_is_answered_before_auth() -> anyhow::Result<()> {
    let gateway = Gateway::builder()
        .args(&["--allow-origin", "https://app.example"])
        .start()
        .await?;
    let response = reqwest::Client::new()
        .request(
            reqwest::Method::OPTIONS,
            format!("{}/api/kernels", gateway.base),
        )
        .header("Origin", "https://app.example")
        .header("Access-Control-Request-Method", "POST")
        .header(
            "Access-Control-Request-Headers",
            "authorization, content-type",
        )
        .send()
        .await?;
    assert!(response.status().is_success(), "{}", response.status());
    assert_eq!(
        response.headers()["access-control-allow-origin"],
        "https://app.example"
    );
    let allowed = response.headers()["access-control-allow-headers"]
        .to_str()?
        .to_lowercase();
    assert!(allowed.contains("authorization"), "{allowed}");
    // The actual request still needs the token, and carries the CORS header.
    let response = reqwest::Client::new()
        .get(format!("{}/api/kernels", gateway.base))
        .header("Origin", "https://app.example")
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 401);
    let response = gateway
        .request(reqwest::Method::GET, "/api/kernels")
        .header("Origin", "https://app.example")
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(
        response.headers()["access-control-allow-origin"],
        "https://app.example"
    );
    // Another origin gets no CORS grant (the header, as in Kernel Gateway, names only the
    // configured origin, which the browser compares with its own).
    let response = gateway
        .request(reqwest::Method::GET, "/api/kernels")
        .header("Origin", "https://evil.example")
        .send()
        .await?;
    let granted = response
        .headers()
        .get("access-control-allow-origin")
        .map(|v| v.to_str().unwrap_or_default().to_owned());
    assert_ne!(granted.as_deref(), Some("https://evil.example"));
    assert_ne!(granted.as_deref(), Some("*"));
    Ok(())
}
