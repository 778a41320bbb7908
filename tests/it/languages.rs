//! The kernels beside Python, end to end: a real `cellgate serve` starts Deno's kernel
//! (kernels/deno, behind cellgate-tcp-kernel), IRkernel (kernels/ir) and bash_kernel
//! (kernels/bash) in the test sandbox, and API v1 drives each through what a chat user does:
//! a computation, a display that becomes an artifact (an HTML table from Deno, a ggplot PNG
//! from R, HTML from bash's `displayHTML`), an error typed as such, a busy loop stopped by
//! the cell timeout with the kernel's state kept, an egress request the policy denies (with
//! the denial in the result), a run-time package install refused with the policy named (R),
//! and the session exported as a notebook that replays the same in a fresh sandbox with the
//! notebook's own kernelspec.

use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};

use crate::support::v1::V1Client;
use crate::support::Gateway;

async fn start_gateway() -> Result<(Gateway, tempfile::TempDir)> {
    Gateway::with_default_policy("", &[]).await
}

/// Runs `code` with a cell timeout; the result JSON.
async fn run(v1: &V1Client<'_>, session: &str, code: &str, timeout_s: f64) -> Result<Value> {
    v1.execute_with(session, json!({"code": code, "timeout_s": timeout_s}))
        .await
}

async fn run_ok(v1: &V1Client<'_>, session: &str, code: &str) -> Result<Value> {
    let r = run(v1, session, code, 60.0).await?;
    ensure!(r["status"] == "ok", "{code}: {r}");
    Ok(r)
}

/// The one artifact of `mime` in a result, fetched: its reference and bytes.
pub(crate) async fn artifact_of(
    v1: &V1Client<'_>,
    r: &Value,
    mime: &str,
) -> Result<(Value, Vec<u8>)> {
    let found = r["artifacts"]
        .as_array()
        .context("artifacts")?
        .iter()
        .find(|a| a["mime"] == mime)
        .with_context(|| format!("no {mime} artifact in {r}"))?
        .clone();
    let response = v1.artifact(found["id"].as_str().context("id")?).await?;
    ensure!(
        response.status() == 200,
        "fetch artifact: {}",
        response.status()
    );
    Ok((found, response.bytes().await?.to_vec()))
}

/// A cell in a busy loop is stopped by its timeout (an interrupt, not a restart): the result
/// says `timeout`, and the next cell still sees the session's state.
async fn busy_loop_times_out_and_state_stays(
    v1: &V1Client<'_>,
    session: &str,
    busy: &str,
    check: &str,
    expect: impl Fn(&Value) -> bool,
) -> Result<()> {
    let before = run_ok(v1, session, check).await?;
    let r = run(v1, session, busy, 3.0).await?;
    ensure!(r["status"] == "timeout", "busy loop: {r}");
    let after = run_ok(v1, session, check).await?;
    ensure!(expect(&after), "state after the interrupt: {after}");
    ensure!(
        after["state_generation"] == before["state_generation"],
        "the kernel was restarted, not interrupted: {before} then {after}"
    );
    Ok(())
}

/// An egress request the default policy denies: status `denied` and the denial named. A
/// gVisor sandbox has no way out at all (no egress bridge: the request fails, and there is
/// no proxy to record a denial).
fn assert_denied(r: &Value, host: &str) -> Result<()> {
    if crate::support::sandbox_backend() == "gvisor" {
        ensure!(r["status"] == "error", "egress from gVisor: {r}");
        ensure!(r["denials"] == json!([]), "{r}");
        return Ok(());
    }
    assert_denied_by(r, host, "default")
}

/// An egress request that `policy` denied through cellgate's proxy: status `denied`, and
/// the denial names the host and the policy.
pub(crate) fn assert_denied_by(r: &Value, host: &str, policy: &str) -> Result<()> {
    ensure!(r["status"] == "denied", "egress: {r}");
    let denial = &r["denials"][0];
    ensure!(denial["kind"] == "egress", "{r}");
    ensure!(
        denial["target"]
            .as_str()
            .is_some_and(|t| t.starts_with(host)),
        "{r}"
    );
    ensure!(denial["policy"] == policy, "{r}");
    Ok(())
}

/// Exports the session as a notebook, checks its kernelspec and language, replays it in a
/// fresh sandbox and expects every cell the same.
async fn export_and_replay(
    v1: &V1Client<'_>,
    session: &str,
    kernel: &str,
    language: &str,
) -> Result<()> {
    let (status, notebook) = v1.get(&format!("/v1/sessions/{session}/notebook")).await?;
    ensure!(status == 200, "export: {status} {notebook}");
    ensure!(
        notebook["metadata"]["kernelspec"]["name"] == kernel,
        "{}",
        notebook["metadata"]
    );
    ensure!(
        notebook["metadata"]["kernelspec"]["language"]
            .as_str()
            .is_some_and(|l| l.eq_ignore_ascii_case(language)),
        "{}",
        notebook["metadata"]
    );
    let (status, answer) = v1
        .post("/v1/notebooks/replay", json!({"notebook": notebook}))
        .await?;
    ensure!(status == 200, "replay: {status} {answer}");
    let statuses: Vec<&str> = answer["report"]
        .as_array()
        .context("report")?
        .iter()
        .map(|c| c["status"].as_str().unwrap_or("?"))
        .collect();
    ensure!(!statuses.is_empty(), "{answer}");
    ensure!(
        statuses.iter().all(|s| *s == "same"),
        "replayed cells: {statuses:?}\n{answer}"
    );
    ensure!(
        answer["notebook"]["metadata"]["kernelspec"]["name"] == kernel,
        "the replay ran on another kernelspec: {}",
        answer["notebook"]["metadata"]
    );
    Ok(())
}

#[tokio::test]
async fn deno_kernel_runs_typescript_in_the_sandbox() -> Result<()> {
    let (gateway, _policies) = start_gateway().await?;
    let v1 = V1Client::new(&gateway);
    let session = v1.create_session(json!({"kernel_name": "deno"})).await?;

    let r = run_ok(&v1, &session, "const answer: number = 6 * 7; answer").await?;
    ensure!(r["result"] == "42", "{r}");

    let r = run_ok(
        &v1,
        &session,
        "Deno.jupyter.html`<table><tr><td>cellgate-deno</td></tr></table>`",
    )
    .await?;
    let (_, html) = artifact_of(&v1, &r, "text/html").await?;
    ensure!(String::from_utf8_lossy(&html).contains("<td>cellgate-deno</td>"));

    let r = run(&v1, &session, "throw new TypeError('boom')", 60.0).await?;
    ensure!(r["status"] == "error", "{r}");
    ensure!(
        r["error"]["ename"] == "TypeError" && r["error"]["evalue"] == "boom",
        "{r}"
    );

    busy_loop_times_out_and_state_stays(&v1, &session, "while (true) {}", "answer + 1", |r| {
        r["result"] == "43"
    })
    .await?;

    let r = run(
        &v1,
        &session,
        "await fetch('https://example.com/').then(r => r.status)",
        60.0,
    )
    .await?;
    assert_denied(&r, "example.com")?;

    // The kernel's view: the fixed paths, the sandbox's own user, none of the host's.
    let r = run_ok(
        &v1,
        &session,
        "console.log(JSON.stringify([Deno.cwd(), Deno.execPath(), Deno.env.get('HOME')]))",
    )
    .await?;
    let seen: Vec<String> = serde_json::from_str(r["stdout"].as_str().context("stdout")?)
        .with_context(|| format!("{r}"))?;
    ensure!(
        seen == ["/home/user", "/opt/cellgate/venv/bin/deno", "/home/user"],
        "{seen:?}"
    );

    let fresh = v1.create_session(json!({"kernel_name": "deno"})).await?;
    run_ok(&v1, &fresh, "const xs = [3, 1, 2].sort(); xs").await?;
    run_ok(&v1, &fresh, "console.log(xs.join('-'))").await?;
    export_and_replay(&v1, &fresh, "deno", "typescript").await
}

#[tokio::test]
async fn r_kernel_plots_and_refuses_installs() -> Result<()> {
    let (gateway, _policies) = start_gateway().await?;
    let v1 = V1Client::new(&gateway);
    let session = v1.create_session(json!({"kernel_name": "ir"})).await?;

    // A value with no HTML form arrives as text, in stdout.
    let r = run_ok(&v1, &session, "answer <- 6 * 7; answer").await?;
    ensure!(r["stdout"] == "[1] 42\n", "{r}");

    let r = run_ok(
        &v1,
        &session,
        "library(ggplot2); ggplot(data.frame(x = 1:10, y = (1:10)^2), aes(x, y)) + geom_line()",
    )
    .await?;
    let (png, bytes) = artifact_of(&v1, &r, "image/png").await?;
    ensure!(bytes.starts_with(b"\x89PNG"), "not a PNG");
    ensure!(png["width"].as_u64().is_some_and(|w| w > 100), "{png}");

    // A data frame (dplyr's summary) is a table: HTML, and no Markdown or LaTeX copies.
    let r = run_ok(
        &v1,
        &session,
        "suppressMessages(library(dplyr)); mtcars %>% group_by(cyl) %>% summarise(n = n())",
    )
    .await?;
    let (_, html) = artifact_of(&v1, &r, "text/html").await?;
    ensure!(String::from_utf8_lossy(&html).contains("<table"), "{r}");
    ensure!(
        r["artifacts"].as_array().map(Vec::len) == Some(1),
        "one artifact per table: {r}"
    );

    let r = run(&v1, &session, "stop('boom')", 60.0).await?;
    ensure!(r["status"] == "error", "{r}");
    ensure!(
        r["error"]["evalue"]
            .as_str()
            .is_some_and(|e| e.contains("boom")),
        "{r}"
    );

    let r = run(&v1, &session, "install.packages('jsonlite')", 60.0).await?;
    ensure!(r["status"] == "error", "{r}");
    ensure!(
        r["error"]["evalue"]
            .as_str()
            .is_some_and(|e| e.contains("not allowed by policy 'default'")),
        "the refusal names the policy: {r}"
    );

    busy_loop_times_out_and_state_stays(&v1, &session, "while (TRUE) {}", "answer + 1", |r| {
        r["stdout"] == "[1] 43\n"
    })
    .await?;

    let r = run(&v1, &session, "readLines(url('http://example.com/'))", 60.0).await?;
    assert_denied(&r, "example.com")?;

    let fresh = v1.create_session(json!({"kernel_name": "ir"})).await?;
    run_ok(&v1, &fresh, "xs <- sort(c(3, 1, 2))").await?;
    run_ok(&v1, &fresh, "cat(paste(xs, collapse = '-'), '\\n')").await?;
    export_and_replay(&v1, &fresh, "ir", "R").await
}

#[tokio::test]
async fn bash_kernel_runs_commands_with_exit_statuses() -> Result<()> {
    let (gateway, _policies) = start_gateway().await?;
    let v1 = V1Client::new(&gateway);
    let session = v1.create_session(json!({"kernel_name": "bash"})).await?;

    let r = run_ok(
        &v1,
        &session,
        "ANSWER=$((6 * 7)); echo $ANSWER; pwd; id -un",
    )
    .await?;
    ensure!(r["stdout"] == "42\n/home/user\nkernel\n", "{r}");

    let r = run_ok(&v1, &session, "echo '<b>cellgate-bash</b>' | displayHTML").await?;
    let (_, html) = artifact_of(&v1, &r, "text/html").await?;
    ensure!(String::from_utf8_lossy(&html).contains("<b>cellgate-bash</b>"));

    // A command's non-zero exit is the cell's error, with the status.
    let r = run(&v1, &session, "ls /no/such/dir", 60.0).await?;
    ensure!(r["status"] == "error", "{r}");
    ensure!(
        r["error"]["ename"] == "ExitStatus" && r["error"]["evalue"] == "2",
        "{r}"
    );

    busy_loop_times_out_and_state_stays(&v1, &session, "sleep 600", "echo $ANSWER", |r| {
        r["stdout"] == "42\n"
    })
    .await?;

    let r = run(
        &v1,
        &session,
        "curl -fsS --max-time 20 -o /dev/null http://example.com/",
        60.0,
    )
    .await?;
    assert_denied(&r, "example.com")?;

    let fresh = v1.create_session(json!({"kernel_name": "bash"})).await?;
    run_ok(
        &v1,
        &fresh,
        "XS=$(printf '3\\n1\\n2\\n' | sort | paste -sd-)",
    )
    .await?;
    run_ok(&v1, &fresh, "echo $XS").await?;
    export_and_replay(&v1, &fresh, "bash", "bash").await
}

/// API v1's commands in other languages' sessions: the bash kernel runs them (its process
/// is Python and takes the runner line itself), with exit codes, both streams and the
/// timeout, and leaves its shell's state alone; a kernel with no runner (Deno) refuses them
/// with `commands_unsupported`, saying which language.
#[tokio::test]
async fn a_bash_session_takes_commands_and_a_deno_one_says_it_cannot() -> Result<()> {
    let (gateway, _policies) = start_gateway().await?;
    let v1 = V1Client::new(&gateway);
    let session = v1.create_session(json!({"kernel_name": "bash"})).await?;
    run_ok(&v1, &session, "KEPT=41").await?;

    let command = |body: Value| {
        let v1 = &v1;
        let session = &session;
        async move {
            v1.post(&format!("/v1/sessions/{session}/commands"), body)
                .await
        }
    };
    let (status, r) = command(json!({"cmd": "echo out; echo err >&2; pwd; exit 4"})).await?;
    ensure!(status == 200, "{status} {r}");
    ensure!(
        (
            r["status"].as_str(),
            r["exit_code"].as_i64(),
            r["stdout"].as_str(),
            r["stderr"].as_str()
        ) == (
            Some("error"),
            Some(4),
            Some("out\n/home/user\n"),
            Some("err\n")
        ),
        "{r}"
    );
    let (status, r) = command(json!({"cmd": "sleep 300", "timeout_s": 1})).await?;
    ensure!(status == 200 && r["status"] == "timeout", "{status} {r}");
    // The kernel's own shell is untouched, and a cell after the commands is a cell.
    let r = run_ok(&v1, &session, "echo $((KEPT + 1))").await?;
    ensure!(r["stdout"] == "42\n", "{r}");

    let deno = v1.create_session(json!({"kernel_name": "deno"})).await?;
    let (status, r) = v1
        .post(
            &format!("/v1/sessions/{deno}/commands"),
            json!({"cmd": "echo hi"}),
        )
        .await?;
    ensure!(
        status == 409 && r["code"] == "commands_unsupported",
        "{status} {r}"
    );
    Ok(())
}

/// Every kernel also starts and computes in gVisor, whatever backend the suite's other tests
/// use (the full suite runs in namespaces sandboxes; this is its gVisor pass for them).
#[tokio::test]
async fn every_kernel_computes_in_gvisor() -> Result<()> {
    let policies = tempfile::tempdir()?;
    std::fs::write(
        policies.path().join("default.toml"),
        "[sandbox]\nbackend = \"gvisor\"\n",
    )?;
    let gateway = Gateway::builder()
        .policies_dir(policies.path().to_owned())
        .start()
        .await?;
    let v1 = V1Client::new(&gateway);
    for (kernel, code, field, expected) in [
        ("deno", "6 * 7", "result", "42"),
        ("ir", "6 * 7", "stdout", "[1] 42\n"),
        ("bash", "echo $((6 * 7))", "stdout", "42\n"),
    ] {
        let session = v1.create_session(json!({"kernel_name": kernel})).await?;
        let (_, model) = v1.get(&format!("/v1/sessions/{session}")).await?;
        ensure!(model["sandbox"] == "gvisor", "{kernel}: {model}");
        let r = run_ok(&v1, &session, code).await?;
        ensure!(r[field] == expected, "{kernel}: {r}");
    }
    Ok(())
}
