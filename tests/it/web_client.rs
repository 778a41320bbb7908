//! The web client in headless Chromium: a real `cellgate serve`, Debian's `/usr/bin/chromium`
//! driven by playwright-core (`tests/browser/e2e.mjs`): sign in, output arriving while the
//! cell still runs, `input()`, a matplotlib chart, a DataFrame table, Plotly and Vega-Lite
//! charts, an error with its traceback, an interrupt, a dropped session socket that resumes
//! with `last_event_id` (what the cell printed meanwhile and its result arrive once),
//! upload → analyse → download, a reload
//! that keeps the session, Sign out ending the session; a conversation in the kernel the
//! user picks (Deno), its language shown and its code highlighted; and the page and API
//! under a base URL. Screenshots go to
//! `target/web-client-screenshots/`.

use std::path::Path;

use anyhow::{Context, Result};

use crate::support::v1::V1Client;
use crate::support::{repo, Gateway, TOKEN};

/// Chromium and playwright-core come from `./dev setup`; without them this test fails and
/// says so, never skips.
pub(crate) fn browser_tools() -> std::path::PathBuf {
    let chromium =
        std::env::var("CELLGATE_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(
        Path::new(&chromium).exists(),
        "{chromium} is missing: `./dev setup` installs Debian's chromium (the web client's tests never download a browser)"
    );
    let browser_dir = repo().join("tests/browser");
    assert!(
        browser_dir.join("node_modules/playwright-core").exists(),
        "tests/browser/node_modules is missing: `./dev setup` runs npm ci there"
    );
    assert!(
        repo()
            .join("web-client/node_modules/plotly.js-cartesian-dist-min")
            .exists(),
        "web-client/node_modules is missing: `./dev setup` runs npm ci there (the binary embeds the chart libraries)"
    );
    browser_dir
}

/// Runs `tests/browser/e2e.mjs` against `gateway` with `env` added, screenshots under
/// `target/web-client-screenshots/<shots>`; fails with its output and the gateway's log
/// unless every step passed. Returns what it printed.
async fn run_browser(
    browser_dir: &Path,
    gateway: &Gateway,
    env: &[(&str, &str)],
    shots: &str,
) -> Result<String> {
    let output = tokio::process::Command::new("node")
        .arg("e2e.mjs")
        .current_dir(browser_dir)
        .env("CELLGATE_URL", &gateway.base)
        .env("CELLGATE_TOKEN", TOKEN)
        .env(
            "SCREENSHOT_DIR",
            repo().join("target/web-client-screenshots").join(shots),
        )
        .envs(env.iter().copied())
        .output()
        .await
        .context("run node (Debian package nodejs; ./dev setup installs it)")?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("all steps passed"),
        "the browser test failed (screenshots in target/web-client-screenshots/{shots}):\n{stdout}\n{stderr}\ngateway log:\n{}",
        gateway.log()
    );
    Ok(stdout)
}

#[tokio::test]
async fn the_web_client_runs_code_and_shows_every_kind_of_output() -> Result<()> {
    let browser_dir = browser_tools();
    let gateway = Gateway::start().await?;
    let stdout = run_browser(&browser_dir, &gateway, &[], "").await?;
    println!("{stdout}");
    Ok(())
}

/// A conversation in the kernel the user picks: the picker lists the gateway's kernelspecs
/// with the default chosen, Python code is highlighted as Python; choosing Deno and "New
/// conversation" ends the session for one whose header says TypeScript, runs TypeScript (an
/// HTML display), highlights it as TypeScript, and a reload keeps both choices.
#[tokio::test]
async fn the_web_client_starts_a_conversation_in_the_chosen_kernel() -> Result<()> {
    let browser_dir = browser_tools();
    let gateway = Gateway::start().await?;
    let stdout = run_browser(
        &browser_dir,
        &gateway,
        &[("CELLGATE_E2E", "kernels")],
        "kernels",
    )
    .await?;
    assert!(stdout.contains("ok deno conversation"), "{stdout}");
    Ok(())
}

#[tokio::test]
async fn the_page_and_its_assets_are_served_with_a_strict_policy() -> Result<()> {
    let gateway = Gateway::start().await?;
    let plain = reqwest::Client::new();
    for (path, kind) in [
        ("/", "text/html"),
        ("/assets/app.js", "text/javascript"),
        ("/assets/highlight.js", "text/javascript"),
        ("/assets/frame-height.js", "text/javascript"),
        ("/assets/style.css", "text/css"),
        ("/assets/plotly.min.js", "text/javascript"),
        ("/assets/vega-embed.min.js", "text/javascript"),
    ] {
        // No token: the page holds no data and asks for one itself.
        let response = plain.get(format!("{}{path}", gateway.base)).send().await?;
        assert_eq!(response.status().as_u16(), 200, "{path}");
        let headers = response.headers().clone();
        let content_type = headers["content-type"].to_str()?;
        assert!(content_type.starts_with(kind), "{path}: {content_type}");
        assert_eq!(headers["x-content-type-options"], "nosniff");
        let csp = headers["content-security-policy"].to_str()?;
        assert!(csp.contains("frame-ancestors 'none'") && csp.contains("default-src 'self'"));
        let body = response.text().await?;
        assert!(body.len() > 100, "{path} is served");
    }
    // The chart libraries are the real ones, not the build's stand-in.
    let plotly = plain
        .get(format!("{}/assets/plotly.min.js", gateway.base))
        .send()
        .await?
        .text()
        .await?;
    assert!(
        plotly.len() > 500_000,
        "Plotly is bundled ({} bytes)",
        plotly.len()
    );
    // The API next to the page still needs the token.
    let response = plain
        .get(format!("{}/api/kernels", gateway.base))
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 401);
    Ok(())
}

/// Under `--base-url /gw/` the page typed as `/gw` (no slash) must still find its assets and
/// the API: it is redirected to `/gw/` with its query, every URL the API hands out carries
/// the prefix, and nothing answers outside it. Then a real browser runs code from `/gw`.
#[tokio::test]
async fn the_page_and_api_work_under_a_base_url() -> Result<()> {
    let browser_dir = browser_tools();
    let gateway = Gateway::builder()
        .args(&["--base-url", "/gw/"])
        .start()
        .await?;
    let root = format!("http://127.0.0.1:{}", gateway.port);
    assert_eq!(
        gateway.base,
        format!("{root}/gw"),
        "the printed address names the base URL"
    );
    let plain = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?;

    for (path, expected) in [("/gw", "/gw/"), ("/gw?lang=en", "/gw/?lang=en")] {
        let response = plain.get(format!("{root}{path}")).send().await?;
        assert_eq!(response.status().as_u16(), 308, "{path}");
        assert_eq!(response.headers()["location"], expected, "{path}");
    }
    for path in ["/gw/", "/gw/assets/app.js", "/gw/healthz"] {
        let response = plain.get(format!("{root}{path}")).send().await?;
        assert_eq!(response.status().as_u16(), 200, "{path}");
    }
    for path in [
        "/",
        "/assets/app.js",
        "/api/kernels",
        "/v1/sessions",
        "/gwx/",
    ] {
        let response = plain
            .get(format!("{root}{path}"))
            .header("authorization", format!("token {TOKEN}"))
            .send()
            .await?;
        assert_eq!(
            response.status().as_u16(),
            404,
            "{path} is outside the base URL"
        );
    }
    let response = plain.get(format!("{root}/gw/api/kernels")).send().await?;
    assert_eq!(
        response.status().as_u16(),
        401,
        "the API under the prefix needs the token"
    );

    // Addresses the API hands out carry the prefix.
    let v1 = V1Client::new(&gateway);
    let created = v1
        .new_session(serde_json::json!({}))
        .await
        .with_context(|| gateway.log())?;
    let id = created.id;
    assert_eq!(
        created.location.as_deref(),
        Some(format!("/gw/v1/sessions/{id}").as_str())
    );
    let result = v1
        .execute(&id, "from IPython.display import HTML\nHTML('<b>hi</b>')")
        .await?;
    assert_eq!(result["status"], "ok", "{result}");
    let url = result["artifacts"][0]["url"]
        .as_str()
        .context("artifact url")?;
    assert!(url.starts_with("/gw/v1/artifacts/"), "{url}");
    let response = plain
        .get(format!("{root}{url}"))
        .header("authorization", format!("token {TOKEN}"))
        .send()
        .await?;
    assert_eq!(
        response.status().as_u16(),
        200,
        "the artifact URL is served"
    );
    assert!(response.text().await?.contains("<b>hi</b>"));

    // The browser types the address without the slash.
    let stdout = run_browser(
        &browser_dir,
        &gateway,
        &[("CELLGATE_PAGE", &gateway.base), ("CELLGATE_E2E", "short")],
        "base-url",
    )
    .await?;
    assert!(
        stdout.contains(&format!("ok short run at {}/", gateway.base)),
        "{stdout}"
    );
    Ok(())
}
