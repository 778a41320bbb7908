//! `cellgate export` and `cellgate replay`: the notebook subcommands.
//!
//! `export` fetches `GET /api/kernels/{id}/notebook` from a running gateway. `replay` either
//! posts the notebook to a running gateway (`--url`) or, by default, starts its own kernel
//! registry in this process with the same sandbox and policies `serve` would use, so no
//! server is needed. Exit codes of `replay`: 0 every cell matched, 1 a cell differed or
//! errored, 2 the notebook or the command line was unusable or the replay could not run.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use cellgate::kernel::{KernelManager, KernelOptions, KernelSpecs, ManagerOptions};
use cellgate::notebook::{
    parse_notebook, replay, write_notebook, CellReport, CellStatus, Progress, ReplayOptions,
};
use cellgate::sandbox::Backend;
use serde_json::Value;

#[derive(clap::Args)]
pub struct ExportArgs {
    /// The gateway, e.g. http://127.0.0.1:8888.
    #[arg(long, env = "CELLGATE_URL")]
    url: String,
    /// The gateway's token.
    #[arg(long, env = "CELLGATE_AUTH_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The kernel whose history to export.
    kernel_id: String,
    /// Where to write the .ipynb (default: standard output).
    #[arg(short, long)]
    output: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct ReplayArgs {
    /// The notebook to replay (.ipynb, nbformat 4.0 to 4.5).
    notebook: PathBuf,
    /// The policy the replay kernel runs under (default: the kernelspec's, else `default`).
    #[arg(long)]
    policy: Option<String>,
    /// Where to write the executed notebook.
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Keep going after errors (cells tagged raises-exception always may raise).
    #[arg(long)]
    allow_errors: bool,
    /// Per-cell timeout in seconds when the cell's metadata.execution.timeout says nothing.
    #[arg(long)]
    timeout: Option<f64>,
    /// Print the report as JSON on standard output.
    #[arg(long)]
    json: bool,
    /// Replay on this running gateway instead of in-process.
    #[arg(long, env = "CELLGATE_URL")]
    url: Option<String>,
    /// The gateway's token (with --url).
    #[arg(long, env = "CELLGATE_AUTH_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Directory of kernelspecs (in-process replay).
    #[arg(long, env = "CELLGATE_KERNELS_DIR", default_value = "kernels")]
    kernels_dir: PathBuf,
    /// Directory of policy files (in-process replay).
    #[arg(long, env = "CELLGATE_POLICIES_DIR", default_value = "policies")]
    policies_dir: PathBuf,
    /// Run every kernel in this sandbox backend, whatever its policy names (in-process
    /// replay) [default: the policy's backend].
    #[arg(long, env = "CELLGATE_SANDBOX")]
    sandbox: Option<Backend>,
    #[command(flatten)]
    microvm: cellgate::config::MicrovmArgs,
}

fn with_token(request: reqwest::RequestBuilder, token: Option<&str>) -> reqwest::RequestBuilder {
    match token {
        Some(token) if !token.is_empty() => {
            request.header("Authorization", format!("token {token}"))
        }
        _ => request,
    }
}

/// The `message` of a gateway error body, else the body.
fn error_message(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_owned))
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| body.trim().to_owned())
}

pub async fn export(args: ExportArgs) -> anyhow::Result<()> {
    let url = format!(
        "{}/api/kernels/{}/notebook",
        args.url.trim_end_matches('/'),
        args.kernel_id
    );
    let response = with_token(reqwest::Client::new().get(&url), args.token.as_deref())
        .send()
        .await
        .with_context(|| format!("cannot reach {url}"))?;
    let status = response.status();
    let body = response.text().await?;
    if !status.is_success() {
        bail!("{url}: {status}: {}", error_message(&body));
    }
    match args.output {
        Some(path) => std::fs::write(&path, body)
            .with_context(|| format!("cannot write {}", path.display()))?,
        None => print!("{body}"),
    }
    Ok(())
}

/// What a replay came to, however it ran.
struct Finished {
    /// The executed notebook, written like Python's nbformat.
    notebook: String,
    report: Vec<CellReport>,
    matched: bool,
}

/// Runs `cellgate replay`; returns the process exit code.
pub async fn replay_command(args: ReplayArgs) -> i32 {
    let text = match std::fs::read_to_string(&args.notebook) {
        Ok(text) => text,
        Err(err) => {
            eprintln!(
                "cellgate replay: cannot read {}: {err}",
                args.notebook.display()
            );
            return 2;
        }
    };
    let finished = match &args.url {
        Some(url) => remote(&args, url, text).await,
        None => local(&args, &text).await,
    };
    let finished = match finished {
        Ok(finished) => finished,
        Err(err) => {
            eprintln!("cellgate replay: {}: {err:#}", args.notebook.display());
            return 2;
        }
    };
    if let Some(path) = &args.output {
        if let Err(err) = std::fs::write(path, &finished.notebook) {
            eprintln!("cellgate replay: cannot write {}: {err}", path.display());
            return 2;
        }
    }
    if args.json {
        let report = serde_json::json!({"report": finished.report, "matched": finished.matched});
        println!("{report}");
    } else {
        print_report(&finished.report);
    }
    if finished.matched {
        0
    } else {
        1
    }
}

fn print_report(report: &[CellReport]) {
    let mut counts = std::collections::BTreeMap::new();
    for cell in report {
        let status = match cell.status {
            CellStatus::Same => "same",
            CellStatus::Different => "different",
            CellStatus::Error => "error",
            CellStatus::Skipped => "skipped",
        };
        *counts.entry(status).or_insert(0) += 1;
        let detail = match cell.status {
            CellStatus::Different | CellStatus::Error => cell
                .diff
                .as_deref()
                .or(cell.error.as_deref())
                .map(|d| format!(": {d}"))
                .unwrap_or_default(),
            _ => String::new(),
        };
        println!("cell {} ({}): {status}{detail}", cell.index, cell.id);
    }
    let summary: Vec<String> = counts.iter().map(|(k, v)| format!("{v} {k}")).collect();
    println!("{} code cells: {}", report.len(), summary.join(", "));
}

async fn remote(args: &ReplayArgs, url: &str, text: String) -> anyhow::Result<Finished> {
    let endpoint = format!("{}/api/notebooks/replay", url.trim_end_matches('/'));
    let mut query: Vec<(&str, String)> = vec![("allow_errors", args.allow_errors.to_string())];
    if let Some(policy) = &args.policy {
        query.push(("policy", policy.clone()));
    }
    if let Some(timeout) = args.timeout {
        query.push(("timeout_s", timeout.to_string()));
    }
    let request = reqwest::Client::new()
        .post(&endpoint)
        .query(&query)
        .header("Content-Type", "application/json")
        .body(text);
    let response = with_token(request, args.token.as_deref())
        .send()
        .await
        .with_context(|| format!("cannot reach {endpoint}"))?;
    let status = response.status();
    let body = response.text().await?;
    if !status.is_success() {
        bail!("{status}: {}", error_message(&body));
    }
    let mut answer: Value = serde_json::from_str(&body).context("the gateway's answer")?;
    let report = serde_json::from_value(answer["report"].take()).context("the gateway's report")?;
    let notebook = parse_notebook(&answer["notebook"].take().to_string())
        .context("the executed notebook in the gateway's answer")?;
    Ok(Finished {
        notebook: write_notebook(notebook.notebook)?,
        report,
        matched: answer["matched"].as_bool().unwrap_or(false),
    })
}

async fn local(args: &ReplayArgs, text: &str) -> anyhow::Result<Finished> {
    let parsed = parse_notebook(text)?;
    let timeout = match args.timeout {
        Some(t) if t > 0.0 && t.is_finite() => Some(Duration::from_secs_f64(t)),
        Some(_) => bail!("--timeout: expected a positive number of seconds"),
        None => None,
    };
    let specs = KernelSpecs::load(&args.kernels_dir, None)
        .with_context(|| format!("loading kernelspecs from {}", args.kernels_dir.display()))?;
    let policies = cellgate::policy::Policies::load(&args.policies_dir)
        .with_context(|| format!("loading policies from {}", args.policies_dir.display()))?;
    let sandbox =
        cellgate::sandbox::Backends::new(args.sandbox, args.microvm.config(Default::default()));
    let runtime_root = std::env::temp_dir().join(format!(
        "cellgate-replay-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    ));
    let manager: Arc<KernelManager> = KernelManager::new(
        specs,
        sandbox,
        ManagerOptions {
            runtime_root,
            max_kernels: Some(1),
            env_allowlist: Vec::new(),
            cull_idle_timeout: None,
            cull_interval: Duration::from_secs(3600),
            cull_connected: false,
            kernel: KernelOptions::default(),
            policies,
            pool_size: 0,
            pool_kernels: Vec::new(),
        },
    )?;
    let options = ReplayOptions {
        policy: args.policy.clone(),
        allow_errors: args.allow_errors,
        timeout,
        // In-process: the local user runs it, as the admin.
        owner: None,
    };
    let (progress_tx, mut progress_rx) = tokio::sync::mpsc::unbounded_channel::<Progress>();
    let quiet = args.json;
    let printer = tokio::spawn(async move {
        while let Some(progress) = progress_rx.recv().await {
            if !quiet {
                eprintln!(
                    "[{}/{}] cell {} ran",
                    progress.done, progress.total, progress.cell.index
                );
            }
        }
    });
    let outcome = replay(&manager, parsed, &options, Some(&progress_tx)).await;
    drop(progress_tx);
    let _ = printer.await;
    manager.shutdown_all().await;
    let outcome = outcome?;
    Ok(Finished {
        notebook: outcome.notebook,
        report: outcome.report,
        matched: outcome.matched,
    })
}
