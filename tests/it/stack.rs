//! The kernels' Python environments, end to end: a real `cellgate serve` starts real
//! ipykernels in the test sandbox and API v1 drives them.
//!
//! - the python3 kernel imports every library of its stack (kernels/python3/requirements.in)
//!   and uses each a little, within the shipped default policy's memory (1 GiB);
//! - a Plotly and an Altair figure each arrive as two artifacts of one bundle: the
//!   interactive spec the web client renders and a PNG for clients that run no JavaScript
//!   (kernels/python3/cellgate_display.py);
//! - the lean kernelspec (kernels/python3-lean) runs the small set and nothing more.

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};

use crate::support::v1::V1Client;
use crate::support::Gateway;

/// A gateway whose default policy runs the test sandbox with the shipped default policy's
/// memory limit. The directory must outlive the gateway.
async fn start_gateway() -> Result<(Gateway, tempfile::TempDir)> {
    Gateway::with_default_policy("[limits]\nmemory = \"1GiB\"\n", &[]).await
}

/// Imports each module and does one small real thing with it; prints what worked as JSON.
const EVERY_LIBRARY: &str = r#"
import json, importlib, io
modules = ["numpy", "pandas", "scipy", "matplotlib", "seaborn", "sklearn", "statsmodels.api",
           "sympy", "plotly", "plotly.express", "altair", "vl_convert", "openpyxl", "xlrd",
           "xlsxwriter", "pyarrow", "pyarrow.parquet", "polars", "duckdb", "bs4", "lxml.etree",
           "networkx", "PIL.Image", "tabulate", "requests", "jinja2", "xarray", "docx",
           "pypdf", "yaml", "chardet", "pytz", "tqdm"]
versions = {}
for name in modules:
    module = importlib.import_module(name)
    versions[name] = getattr(module, "__version__", "?")

import numpy as np, pandas as pd
df = pd.DataFrame({"x": np.arange(20.0), "g": list("ab") * 10})
df["y"] = 2 * df["x"] + 1
used = {}
import sklearn.linear_model
used["sklearn"] = round(float(sklearn.linear_model.LinearRegression().fit(df[["x"]], df["y"]).coef_[0]), 3)
import statsmodels.formula.api as smf
used["statsmodels"] = round(float(smf.ols("y ~ x", data=df).fit().params["x"]), 3)
import scipy.stats
used["scipy"] = round(float(scipy.stats.pearsonr(df["x"], df["y"])[0]), 3)
import sympy
used["sympy"] = str(sympy.integrate(sympy.Symbol("t") ** 2))
import polars, duckdb
used["polars"] = polars.from_pandas(df).group_by("g").len().height
used["duckdb"] = duckdb.sql("select sum(y) from df").fetchall()[0][0]
buf = io.BytesIO(); df.to_parquet(buf); used["parquet"] = len(pd.read_parquet(io.BytesIO(buf.getvalue())))
buf = io.BytesIO(); df.to_excel(buf, engine="openpyxl"); used["xlsx"] = len(pd.read_excel(io.BytesIO(buf.getvalue())))
buf = io.BytesIO(); df.to_excel(buf, engine="xlsxwriter"); used["xlsxwriter"] = buf.getbuffer().nbytes > 0
from bs4 import BeautifulSoup
used["bs4"] = BeautifulSoup("<p><b>hi</b></p>", "lxml").b.text
import networkx as nx
used["networkx"] = nx.shortest_path_length(nx.path_graph(5), 0, 4)
used["markdown"] = df.head(2).to_markdown().count("\n")
used["style"] = "<table" in df.head(2).style.to_html()
import seaborn as sns, matplotlib
matplotlib.use("agg")
used["seaborn"] = type(sns.histplot(df["x"])).__name__
print(json.dumps({"versions": versions, "used": used}))
"#;

#[tokio::test]
async fn every_library_of_the_stack_imports_and_works_in_a_sandboxed_kernel() -> Result<()> {
    let (gateway, _policies) = start_gateway().await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let r = v1.execute(&id, EVERY_LIBRARY).await?;
    ensure!(r["status"] == "ok", "{r}");
    let out: Value = serde_json::from_str(r["stdout"].as_str().context("stdout")?.trim())
        .with_context(|| format!("{r}"))?;
    let used = &out["used"];
    assert_eq!(used["sklearn"], 2.0, "{out}");
    assert_eq!(used["statsmodels"], 2.0, "{out}");
    assert_eq!(used["scipy"], 1.0, "{out}");
    assert_eq!(used["sympy"], "t**3/3", "{out}");
    assert_eq!(used["polars"], 2, "{out}");
    assert_eq!(used["duckdb"], 400.0, "{out}");
    assert_eq!(used["parquet"], 20, "{out}");
    assert_eq!(used["xlsx"], 20, "{out}");
    assert_eq!(used["xlsxwriter"], true, "{out}");
    assert_eq!(used["bs4"], "hi", "{out}");
    assert_eq!(used["networkx"], 4, "{out}");
    assert_eq!(used["markdown"], 3, "{out}");
    assert_eq!(used["style"], true, "{out}");
    assert_eq!(used["seaborn"], "Axes", "{out}");
    Ok(())
}

/// The artifact of `mime` among `artifacts`, fetched: its record and bytes.
async fn fetched(
    v1: &V1Client<'_>,
    artifacts: &[Value],
    mime: &str,
) -> Result<(Value, bytes::Bytes)> {
    let Some(artifact) = artifacts.iter().find(|a| a["mime"] == mime) else {
        bail!("no {mime} artifact in {artifacts:?}");
    };
    let response = v1.artifact(artifact["id"].as_str().context("id")?).await?;
    ensure!(response.status() == 200, "{mime}: {}", response.status());
    Ok((artifact.clone(), response.bytes().await?))
}

/// Checks a static fallback: a real PNG of a chart's size, described as a PNG.
fn check_png(what: &str, artifact: &Value, bytes: &[u8]) -> Result<()> {
    ensure!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{what}: not a PNG: {artifact}"
    );
    let (width, height) = (artifact["width"].as_u64(), artifact["height"].as_u64());
    ensure!(
        width.is_some_and(|w| w >= 200) && height.is_some_and(|h| h >= 100),
        "{what}: {artifact}"
    );
    // Not a blank canvas: a drawn chart's PNG compresses far less than an empty one.
    ensure!(bytes.len() > 5_000, "{what}: {} bytes", bytes.len());
    Ok(())
}

#[tokio::test]
async fn plotly_and_altair_figures_arrive_as_specs_and_pngs() -> Result<()> {
    let (gateway, _policies) = start_gateway().await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;

    // Plotly, shown the way generated code does (fig.show()).
    let r = v1
        .execute(
            &id,
            "import plotly.express as px\n\
             fig = px.bar(x=['north', 'south', 'east'], y=[3, 7, 5], title='sales by region')\n\
             fig.show()",
        )
        .await?;
    ensure!(r["status"] == "ok", "{r}");
    let artifacts = r["artifacts"].as_array().context("artifacts")?.clone();
    let (spec, bytes) = fetched(&v1, &artifacts, "application/vnd.plotly.v1+json").await?;
    let figure: Value = serde_json::from_slice(&bytes)?;
    assert_eq!(figure["data"][0]["type"], "bar", "{figure}");
    assert_eq!(
        figure["layout"]["title"]["text"], "sales by region",
        "{figure}"
    );
    // The summary (for language models) carries the bundle's text line.
    assert_eq!(
        spec["summary"], "Plotly chart: Plotly figure: 'sales by region', 1 trace(s): bar",
        "{spec}"
    );
    let (png, bytes) = fetched(&v1, &artifacts, "image/png").await?;
    check_png("plotly", &png, &bytes)?;
    // Both are the same display: one bundle, the spec first (what a frontend prefers).
    let mimes: Vec<&str> = artifacts
        .iter()
        .filter_map(|a| a["mime"].as_str())
        .collect();
    assert_eq!(
        mimes,
        ["application/vnd.plotly.v1+json", "image/png"],
        "{artifacts:?}"
    );

    // Altair, as the cell's value.
    let r = v1
        .execute(
            &id,
            "import altair as alt, pandas as pd\n\
             df = pd.DataFrame({'month': ['Jan', 'Feb', 'Mar'], 'revenue': [10, 14, 9]})\n\
             alt.Chart(df, title='revenue').mark_line().encode(x='month', y='revenue')",
        )
        .await?;
    ensure!(r["status"] == "ok", "{r}");
    let artifacts = r["artifacts"].as_array().context("artifacts")?.clone();
    let (spec, bytes) = fetched(&v1, &artifacts, "application/vnd.vegalite.v6+json").await?;
    let chart: Value = serde_json::from_slice(&bytes)?;
    assert_eq!(chart["mark"]["type"], "line", "{chart}");
    assert_eq!(
        spec["summary"], "Vega-Lite chart: Altair chart: 'revenue', mark line",
        "{spec}"
    );
    let (png, bytes) = fetched(&v1, &artifacts, "image/png").await?;
    check_png("altair", &png, &bytes)?;

    // A chart the static renderer cannot draw (data behind a URL, which the image renderer
    // never fetches) still arrives as its spec, and its text says why there is no PNG.
    let r = v1
        .execute(
            &id,
            "alt.Chart('https://example.invalid/data.csv').mark_point().encode(x='a:Q')",
        )
        .await?;
    ensure!(r["status"] == "ok", "{r}");
    let artifacts = r["artifacts"].as_array().context("artifacts")?.clone();
    fetched(&v1, &artifacts, "application/vnd.vegalite.v6+json").await?;
    ensure!(
        !artifacts.iter().any(|a| a["mime"] == "image/png"),
        "{artifacts:?}"
    );
    let text = r["result"].as_str().unwrap_or_default();
    ensure!(text.contains("no static image"), "{r}");
    Ok(())
}

#[tokio::test]
async fn the_lean_kernelspec_runs_the_small_set_only() -> Result<()> {
    let (gateway, _policies) = start_gateway().await?;
    let v1 = V1Client::new(&gateway);
    let id = v1
        .create_session(json!({"kernel_name": "python3-lean"}))
        .await?;
    let r = v1
        .execute(
            &id,
            "import importlib.util as u, json\n\
             import numpy, pandas, scipy, matplotlib\n\
             print(json.dumps({m: u.find_spec(m) is not None for m in ['pandas', 'plotly', 'sklearn', 'polars']}))",
        )
        .await?;
    ensure!(r["status"] == "ok", "{r}");
    let found: Value = serde_json::from_str(r["stdout"].as_str().context("stdout")?.trim())?;
    assert_eq!(
        found,
        json!({"pandas": true, "plotly": false, "sklearn": false, "polars": false})
    );
    Ok(())
}
