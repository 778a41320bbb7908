//! A Deno attacker (issue 30): the TypeScript kernel runs with every Deno permission
//! (`deno jupyter` grants them all), so nothing but the sandbox stands between its code and
//! the host. From one cell it tries the host's files, another session's connection file,
//! workspace and sockets, the host's network (a TCP port and a unix socket the test holds
//! open), writes to the read-only environment, and subprocesses that mount or make user
//! namespaces; it counts the processes it can see. Every attempt must fail, and the bystander
//! (a Python session) keeps being served. Runs in the attack suite's gVisor pass too.

use std::os::unix::net::UnixListener;

use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};

use super::{arena, first_generation_dir, runtime_root_of};
use crate::support::v1::V1Client;
use crate::support::*;

/// A TypeScript string literal of `text` (JSON's quoting is valid TypeScript).
fn ts_str(text: &str) -> String {
    Value::from(text).to_string()
}

#[tokio::test]
async fn a_deno_attacker_reaches_nothing_outside_its_sandbox() -> Result<()> {
    let mut arena = arena().await?;
    let msgs = arena
        .bystander
        .run("open('secret.txt', 'w').write('bystander-secret')")
        .await?;
    ensure!(reply(&msgs).content["status"] == "ok", "{msgs:?}");
    let root = runtime_root_of(&arena.bystander_id)?;
    let b_root = root.join(&arena.bystander_id);
    let b_gen = first_generation_dir(&b_root)?;
    ensure!(b_gen.join("connection.json").is_file());

    let host_tcp = std::net::TcpListener::bind("127.0.0.1:0")?;
    let host_port = host_tcp.local_addr()?.port();
    let dir = tempfile::tempdir()?;
    let host_sock = dir.path().join("host.sock");
    let _host_unix = UnixListener::bind(&host_sock)?;
    // A file of this checkout, at its host path: the kernel must not see the checkout.
    let checkout_file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");

    let v1 = V1Client::new(&arena.gateway);
    let attacker = v1
        .create_session(json!({"kernel_name": "deno", "policy": "default"}))
        .await?;
    let cell = format!(
        r#"
const attempt = async (f: () => unknown) => {{
  try {{ return "ok:" + String(await f()).slice(0, 120); }}
  catch (e) {{ return "err:" + (e as Error).name; }}
}};
const run = async (cmd: string, args: string[]) =>
  (await new Deno.Command(cmd, {{ args, stdout: "null", stderr: "null" }}).output()).code;
const r: Record<string, string> = {{
  shadow: await attempt(() => Deno.readTextFile("/etc/shadow")),
  root_home: await attempt(() => [...Deno.readDirSync("/root")].map((e) => e.name).join(",")),
  checkout: await attempt(() => Deno.readTextFile({checkout})),
  b_conn: await attempt(() => Deno.readTextFile({b_conn})),
  b_secret: await attempt(() => Deno.readTextFile({b_secret})),
  b_socket: await attempt(async () => {{ const c = await Deno.connect({{ transport: "unix", path: {b_sock} }}); c.close(); return "connected"; }}),
  host_tcp: await attempt(async () => {{ const c = await Deno.connect({{ hostname: "127.0.0.1", port: {host_port} }}); c.close(); return "connected"; }}),
  host_unix: await attempt(async () => {{ const c = await Deno.connect({{ transport: "unix", path: {host_sock} }}); c.close(); return "connected"; }}),
  write_usr: await attempt(() => Deno.writeTextFile("/usr/cellgate-attack", "x")),
  write_env: await attempt(() => Deno.writeTextFile("/opt/cellgate/venv/bin/deno", "x")),
}};
const exits: Record<string, number> = {{
  mount: await run("mount", ["-t", "tmpfs", "x", "/tmp"]),
  userns: await run("unshare", ["-r", "true"]),
}};
const procs = [...Deno.readDirSync("/proc")].filter((e) => /^\d+$/.test(e.name)).length;
console.log(JSON.stringify({{ r, exits, procs }}));
"#,
        checkout = ts_str(&checkout_file.display().to_string()),
        b_conn = ts_str(&b_gen.join("connection.json").display().to_string()),
        b_secret = ts_str(&b_root.join("work/secret.txt").display().to_string()),
        b_sock = ts_str(&b_gen.join("k-1").display().to_string()),
        host_sock = ts_str(&host_sock.display().to_string()),
    );
    let result = v1
        .execute_with(&attacker, json!({"code": cell, "timeout_s": 120}))
        .await?;
    ensure!(result["status"] == "ok", "{result}");
    let out: Value = serde_json::from_str(result["stdout"].as_str().context("stdout")?)
        .with_context(|| format!("{result}"))?;
    println!("the Deno attacker saw: {out}");
    for (name, seen) in out["r"].as_object().context("r")? {
        ensure!(
            seen.as_str().is_some_and(|s| s.starts_with("err:")),
            "the Deno attacker's {name} succeeded: {seen}"
        );
    }
    for (name, code) in out["exits"].as_object().context("exits")? {
        // gVisor implements user namespaces inside its user-space kernel (the Sentry): one
        // made there maps to nothing on the host, as `privileged_syscalls_are_refused` says
        // of its mount namespaces. The namespaces backend's seccomp filter refuses it.
        let sentry_only = attacker_backend() == "gvisor" && name == "userns";
        ensure!(
            code != 0 || sentry_only,
            "the Deno attacker's {name} exited 0"
        );
    }
    // The sandbox's own few processes (its init, the relay, Deno, a subprocess or two);
    // the host has hundreds.
    let procs = out["procs"].as_u64().context("procs")?;
    ensure!(procs < 16, "the Deno attacker sees {procs} processes");
    // The host's listeners saw no connection.
    host_tcp.set_nonblocking(true)?;
    ensure!(
        host_tcp.accept().is_err(),
        "the host's TCP port was reached"
    );

    let msgs = arena.bystander.run("open('secret.txt').read()").await?;
    ensure!(
        reply(&msgs).content["status"] == "ok",
        "the bystander: {msgs:?}"
    );
    arena.assert_gateway_serves().await
}
