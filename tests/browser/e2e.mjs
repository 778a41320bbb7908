// Drives cellgate's web client in Debian's headless Chromium (never a downloaded browser).
// Run by tests/it/web_client.rs against a real `cellgate serve`:
//   CELLGATE_URL=http://127.0.0.1:PORT CELLGATE_TOKEN=T SCREENSHOT_DIR=target/… node e2e.mjs
// CELLGATE_PAGE (default CELLGATE_URL + "/") is the address typed into the browser;
// CELLGATE_E2E=short stops after a printed result and a chart (used for a gateway under a
// base URL, where only the paths differ); CELLGATE_E2E=kernels instead picks the Deno
// kernel for a new conversation and checks the language shown and the code's highlighting.
// The main run also drops the session's WebSocket mid-cell and checks it resumes.
// Prints one line per step; exits non-zero (with the page's console and a screenshot) on the
// first failure.

import { chromium } from "playwright-core";
import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";

const url = process.env.CELLGATE_URL;
const token = process.env.CELLGATE_TOKEN;
const shots = process.env.SCREENSHOT_DIR ?? "target/web-client-screenshots";
const pageUrl = process.env.CELLGATE_PAGE ?? url + "/";
const short = process.env.CELLGATE_E2E === "short";
const kernels = process.env.CELLGATE_E2E === "kernels";
const executablePath = process.env.CHROMIUM ?? "/usr/bin/chromium";
if (!url || !token) throw new Error("CELLGATE_URL and CELLGATE_TOKEN are required");
mkdirSync(shots, { recursive: true });

const STEP_TIMEOUT = 120_000;
const browser = await chromium.launch({
  executablePath,
  headless: true,
  // Root in a container: Chromium's own sandbox needs user namespaces it may not get.
  args: ["--no-sandbox", "--disable-dev-shm-usage"],
});
const context = await browser.newContext({ acceptDownloads: true, viewport: { width: 1280, height: 900 } });
const page = await context.newPage();
page.setDefaultTimeout(STEP_TIMEOUT);
// Every WebSocket the page opens, so a step can drop the session's socket as a network would.
await context.addInitScript(() => {
  const Native = window.WebSocket;
  window.__sockets = [];
  window.WebSocket = class extends Native {
    constructor(...args) {
      super(...args);
      window.__sockets.push(this);
    }
  };
});
const consoleLines = [];
page.on("console", (m) => consoleLines.push(`[${m.type()}] ${m.text()}`));
page.on("pageerror", (e) => consoleLines.push(`[pageerror] ${e.message}`));

let step = "start";
let shot = 0;
async function screenshot(name) {
  shot += 1;
  await page.screenshot({ path: join(shots, `${String(shot).padStart(2, "0")}-${name}.png`), fullPage: true });
}
function check(condition, message) {
  if (!condition) throw new Error(message);
}
const cells = page.locator("article.cell");
const lastCell = () => cells.last();

// Types code, runs it, and returns the new cell once it exists.
async function run(code) {
  const before = await cells.count();
  // As a user would: Run is enabled once the session's socket is open (right after a
  // reload it may still be connecting, and code sent then is refused as "Not connected").
  await page.locator("#run:not([disabled])").waitFor();
  await page.fill("#code", code);
  await page.press("#code", "Control+Enter");
  await page.waitForFunction((n) => document.querySelectorAll("article.cell").length > n, before);
  return lastCell();
}
// Waits until the cell shows a loaded PNG (a chart) and returns its <img>.
async function shownImage(cell) {
  const img = cell.locator(".rich[data-mime='image/png'] img");
  await img.waitFor();
  await page.waitForFunction((el) => el.complete && el.naturalWidth > 100, await img.elementHandle());
  return img;
}
async function finished(cell) {
  await cell.locator(".status:not([data-status='running'])").waitFor();
  return cell.locator(".status").getAttribute("data-status");
}

try {
  step = "login";
  await page.goto(pageUrl);
  await page.fill("#token", token);
  await page.click("#login-form button[type=submit]");
  await page.locator("#kernel-state[data-state='idle']").waitFor();
  check(!page.url().includes(token), "the token must never be in the page's address");
  const stored = await page.evaluate(() => sessionStorage.getItem("cellgate.token"));
  check(stored === token, "the token is kept in sessionStorage");
  await screenshot("connected");
  console.log("ok login");
  if (kernels) {
    step = "kernels: the picker";
    const picker = page.locator("#kernel");
    await picker.waitFor();
    const offered = await picker.locator("option").evaluateAll((options) =>
      options.map((o) => [o.value, o.dataset.language]),
    );
    check(
      JSON.stringify(offered.filter(([name]) => ["deno", "python3"].includes(name))) ===
        JSON.stringify([["deno", "typescript"], ["python3", "python"]]),
      `the picker offers the gateway's kernelspecs: ${JSON.stringify(offered)}`,
    );
    check((await picker.inputValue()) === "python3", "the default kernelspec is picked at first");
    await page.locator("#session-language[data-language='python']", { hasText: "Python" }).waitFor();

    step = "kernels: Python highlighted";
    let cell = await run("def greet():\n    return 'hi'  # says hi\ngreet()");
    check((await finished(cell)) === "ok", "the Python cell ends ok");
    await cell.locator(".rich pre.text", { hasText: "'hi'" }).waitFor();
    const code = cell.locator("pre.code");
    check((await code.getAttribute("data-language")) === "python", "the cell's code is marked Python");
    check((await code.locator(".tok-keyword").allTextContents()).join(" ") === "def return", "Python keywords highlighted");
    check((await code.locator(".tok-string").allTextContents()).join(" ") === "'hi'", "Python strings highlighted");
    check((await code.locator(".tok-comment").allTextContents()).join(" ") === "# says hi", "Python comments highlighted");
    check((await code.textContent()) === "def greet():\n    return 'hi'  # says hi\ngreet()", "the code shown is the code run");
    console.log("ok Python highlighted");

    step = "kernels: a Deno conversation";
    const before = await page.evaluate(() => sessionStorage.getItem("cellgate.session"));
    await picker.selectOption("deno");
    check((await page.evaluate(() => localStorage.getItem("cellgate.kernel"))) === "deno", "the choice is remembered");
    await page.click("#new-session");
    await page.locator("#session-language[data-language='typescript']", { hasText: "TypeScript" }).waitFor();
    await page.locator("#kernel-state[data-state='idle']").waitFor();
    const after = await page.evaluate(() => sessionStorage.getItem("cellgate.session"));
    check(after && after !== before, "a new session");
    check((await cells.count()) === 0, "the new conversation starts empty");
    check((await page.locator("#session-info").textContent()).startsWith("deno"), "the header names the kernel");
    const old = await fetch(`${url}/v1/sessions/${before}`, { headers: { Authorization: `Bearer ${token}` } });
    check(old.status === 404, `the previous session is ended (${old.status})`);
    // Awaiting the display makes Deno send it before the cell's idle (a bare expression's
    // value can come after it, and an execution ends at its idle).
    cell = await run('const greeting: string = "hi";\nawait Deno.jupyter.display(Deno.jupyter.html`<b>${greeting}</b>`);');
    check((await finished(cell)) === "ok", "the TypeScript cell ends ok");
    await cell.frameLocator("iframe.artifact-html").locator("b", { hasText: "hi" }).waitFor();
    const ts = cell.locator("pre.code");
    check((await ts.getAttribute("data-language")) === "typescript", "the cell's code is marked TypeScript");
    check((await ts.locator(".tok-keyword").allTextContents()).join(" ") === "const string await", "TypeScript keywords highlighted");
    check((await ts.locator(".tok-string").allTextContents()).join(" ") === '"hi" `<b>${greeting}</b>`', "TypeScript strings highlighted");
    await screenshot("deno");
    console.log("ok deno conversation");

    step = "kernels: reload";
    await page.reload();
    await page.locator("#kernel-state[data-state='idle']").waitFor();
    await page.locator("#session-language[data-language='typescript']").waitFor();
    check((await page.locator("#kernel").inputValue()) === "deno", "the picker keeps the choice");
    check((await page.evaluate(() => sessionStorage.getItem("cellgate.session"))) === after, "the same session");
    console.log("ok reload keeps the kernel");
    await browser.close();
    console.log("all steps passed");
    process.exit(0);
  }
  if (short) {
    step = "short: print";
    const printed = await run("print(6 * 7)");
    await printed.locator("pre.stream.stdout", { hasText: "42" }).waitFor();
    check((await finished(printed)) === "ok", "the print cell ends ok");
    step = "short: chart";
    const chart = await run(
      "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()",
    );
    await finished(chart);
    await shownImage(chart);
    await screenshot("short-chart");
    console.log(`ok short run at ${page.url()}`);
    await browser.close();
    console.log("all steps passed");
    process.exit(0);
  }

  step = "progressive output";
  // The cell waits on input() between two prints: the first line must be on screen while
  // the cell is still running, before the second exists.
  let cell = await run("print('before the question', flush=True)\nname = input('Your name? ')\nprint('hello', name)");
  await cell.locator("pre.stream.stdout", { hasText: "before the question" }).waitFor();
  await cell.locator(".input-request input").waitFor();
  check((await cell.locator(".status").getAttribute("data-status")) === "running", "still running at the prompt");
  check(!(await cell.locator("pre.stream", { hasText: "hello" }).count()), "later output not there yet");
  await screenshot("input-prompt");
  await cell.locator(".input-request input").fill("Ada");
  await cell.locator(".input-request input").press("Enter");
  await cell.locator("pre.stream.stdout", { hasText: "hello Ada" }).waitFor();
  check((await finished(cell)) === "ok", "the input cell ends ok");
  console.log("ok progressive output and input()");

  step = "matplotlib";
  cell = await run(
    "import matplotlib.pyplot as plt\n" +
      "fig, ax = plt.subplots(figsize=(4, 3))\nax.plot([1, 2, 3], [1, 4, 9])\nplt.show()",
  );
  await finished(cell);
  await shownImage(cell);
  await screenshot("matplotlib");
  console.log("ok matplotlib chart");

  step = "dataframe";
  cell = await run("import pandas as pd\npd.DataFrame({'city': ['Oslo', 'Lima'], 'temp': [3.5, 19.25]})");
  check((await finished(cell)) === "ok", "the DataFrame cell ends ok");
  const frame = cell.locator("iframe.artifact-html");
  await frame.waitFor();
  check((await frame.getAttribute("sandbox")) === "allow-scripts", "HTML runs in a sandboxed iframe without same-origin");
  const table = cell.frameLocator("iframe.artifact-html").locator("table");
  await table.locator("td", { hasText: "19.25" }).waitFor();
  check((await table.locator("tbody tr").count()) === 2, "the table has the DataFrame's two rows");
  // The frame fits its table: taller than the table, not the fixed 320 px it starts with.
  const tableBottom = await table.evaluate((t) => t.getBoundingClientRect().bottom);
  await page.waitForFunction(
    ([i, bottom]) => {
      const frames = document.querySelectorAll("iframe.artifact-html");
      const height = frames[frames.length - 1]?.getBoundingClientRect().height ?? 0;
      return height >= bottom && height <= bottom + 60;
    },
    [0, tableBottom],
    { timeout: 10_000 },
  );
  await screenshot("dataframe");
  console.log("ok DataFrame table");

  step = "plotly";
  cell = await run(
    "from IPython.display import display\n" +
      "display({'application/vnd.plotly.v1+json': {'data': [{'type': 'bar', 'x': ['a', 'b'], 'y': [3, 5]}], 'layout': {'title': {'text': 'bars'}}}, 'text/plain': 'plotly'}, raw=True)",
  );
  await finished(cell);
  await cell.locator(".plotly-chart .main-svg").first().waitFor();
  console.log("ok Plotly chart");

  step = "vega-lite";
  cell = await run(
    "from IPython.display import display\n" +
      "spec = {'$schema': 'https://vega.github.io/schema/vega-lite/v5.json', 'data': {'values': [{'a': 'x', 'b': 2}, {'a': 'y', 'b': 7}]}, 'mark': 'bar', 'encoding': {'x': {'field': 'a', 'type': 'nominal'}, 'y': {'field': 'b', 'type': 'quantitative'}}}\n" +
      "display({'application/vnd.vegalite.v5+json': spec, 'text/plain': 'vega-lite'}, raw=True)",
  );
  await finished(cell);
  await cell.locator(".vega-chart svg .mark-rect path").first().waitFor();
  await screenshot("charts");
  console.log("ok Vega-Lite chart");

  // The libraries themselves, as generated code uses them: the kernel's display extension
  // sends each figure's spec and a PNG; the page shows the interactive one, drawn by the
  // bundled libraries (a histogram needs Plotly's cartesian bundle, not the basic one).
  step = "plotly express";
  cell = await run(
    "import plotly.express as px\n" +
      "fig = px.histogram(x=[1, 2, 2, 3, 3, 3, 4, 4, 5], nbins=5, title='spread')\nfig.show()",
  );
  check((await finished(cell)) === "ok", "the plotly.express cell ends ok");
  await cell.locator(".plotly-chart .main-svg .bars path").first().waitFor();
  check((await cell.locator(".rich").first().getAttribute("data-mime")) === "application/vnd.plotly.v1+json", "the interactive figure, not its PNG");
  check(!(await cell.locator(".rich img").count()), "no static image beside the interactive figure");
  console.log("ok plotly.express histogram");

  step = "altair";
  cell = await run(
    "import altair as alt, pandas as pd\n" +
      "alt.Chart(pd.DataFrame({'a': ['x', 'y'], 'b': [2, 7]})).mark_bar().encode(x='a', y='b')",
  );
  check((await finished(cell)) === "ok", "the Altair cell ends ok");
  await cell.locator(".vega-chart svg .mark-rect path").first().waitFor();
  check((await cell.locator(".rich").first().getAttribute("data-mime")) === "application/vnd.vegalite.v6+json", "Altair's Vega-Lite 6 spec is shown");
  await screenshot("library-charts");
  console.log("ok Altair chart");

  step = "error";
  cell = await run("def f():\n    return 1 / 0\nf()");
  check((await finished(cell)) === "error", "a raising cell ends with status error");
  const traceback = await cell.locator("pre.error").textContent();
  check(traceback.includes("ZeroDivisionError") && traceback.includes("f()"), `traceback shown: ${traceback}`);
  check(!traceback.includes("\u001b["), "no ANSI codes in the traceback");
  await screenshot("error");
  console.log("ok error with traceback");

  step = "interrupt";
  cell = await run("import time\nprint('sleeping', flush=True)\ntime.sleep(600)");
  await cell.locator("pre.stream", { hasText: "sleeping" }).waitFor();
  await page.click("#interrupt");
  const status = await finished(cell);
  check(status === "error", `an interrupted cell ends with error, got ${status}`);
  await cell.locator("pre.error", { hasText: "KeyboardInterrupt" }).waitFor();
  await screenshot("interrupt");
  console.log("ok interrupt");

  step = "a dropped socket resumes";
  // The cell prints, then waits for `go`; the socket drops, `go` is uploaded while the page
  // is disconnected, and what the cell printed and its result meanwhile arrive, once, after
  // the page reconnects with `last_event_id`.
  cell = await run(
    "import os, time\nprint('line 1', flush=True)\n" +
      "while not os.path.exists('go'): time.sleep(0.02)\nprint('line 2', flush=True)",
  );
  await cell.locator("pre.stream.stdout", { hasText: "line 1" }).waitFor();
  const socketsBefore = await page.evaluate(() => window.__sockets.length);
  await page.evaluate(
    () =>
      new Promise((resolve) => {
        const socket = window.__sockets.at(-1);
        socket.addEventListener("close", resolve);
        // Not 1000: the page reconnects after anything but a normal close.
        socket.close(4000, "the test drops it");
      }),
  );
  const id = await page.evaluate(() => sessionStorage.getItem("cellgate.session"));
  const go = await fetch(`${url}/v1/sessions/${id}/files/go`, { method: "PUT", headers: { Authorization: `Bearer ${token}` }, body: "" });
  check(go.status === 201, `uploaded go: ${go.status}`);
  check((await finished(cell)) === "ok", "the cell's result arrives after the reconnect");
  const printed = (await cell.locator("pre.stream.stdout").allTextContents()).join("");
  check(printed === "line 1\nline 2\n", `every line once: ${JSON.stringify(printed)}`);
  const resumed = await page.evaluate((n) => window.__sockets.slice(n).map((s) => s.url), socketsBefore);
  check(resumed.length === 1 && /[?&]last_event_id=\d+/.test(resumed[0]), `reconnected with last_event_id: ${resumed}`);
  await screenshot("resumed");
  console.log("ok a dropped socket resumes");

  step = "upload";
  await page.setInputFiles("#upload", {
    name: "sales.csv",
    mimeType: "text/csv",
    buffer: Buffer.from("region,amount\nnorth,120\nsouth,80\nnorth,30\n"),
  });
  await page.locator("#file-list a[data-path='sales.csv']").waitFor();
  console.log("ok upload");

  step = "analyse";
  cell = await run(
    "import pandas as pd, os\ndf = pd.read_csv('sales.csv')\ntotals = df.groupby('region')['amount'].sum()\nprint(totals.to_dict())\n" +
      "os.makedirs('outputs', exist_ok=True)\ntotals.to_csv('outputs/totals.csv')",
  );
  check((await finished(cell)) === "ok", "the analysis cell ends ok");
  await cell.locator("pre.stream", { hasText: "{'north': 150, 'south': 80}" }).waitFor();
  console.log("ok analyse");

  step = "download";
  const link = cell.locator("a.download[data-path='outputs/totals.csv']");
  await link.waitFor();
  const [download] = await Promise.all([page.waitForEvent("download"), link.click()]);
  const saved = join(shots, "totals.csv");
  await download.saveAs(saved);
  const { readFileSync } = await import("node:fs");
  const content = readFileSync(saved, "utf8");
  check(content.includes("north,150") && content.includes("south,80"), `downloaded file: ${content}`);
  await screenshot("files");
  console.log("ok download");

  step = "reload keeps the session and token";
  const sessionBefore = await page.evaluate(() => sessionStorage.getItem("cellgate.session"));
  await page.reload();
  await page.locator("#kernel-state[data-state='idle']").waitFor();
  cell = await run("print(len(df))");
  await cell.locator("pre.stream", { hasText: "3" }).waitFor();
  check((await page.evaluate(() => sessionStorage.getItem("cellgate.session"))) === sessionBefore, "same session");
  console.log("ok reload");

  step = "sign out ends the session";
  const ended = await page.evaluate(() => sessionStorage.getItem("cellgate.session"));
  check(ended, "a session id before signing out");
  await page.click("#logout");
  await page.locator("#login").waitFor();
  let gone = false;
  for (let i = 0; i < 100 && !gone; i++) {
    const answer = await fetch(`${url}/v1/sessions/${ended}`, { headers: { Authorization: `Bearer ${token}` } });
    gone = answer.status === 404;
    if (!gone) await new Promise((r) => setTimeout(r, 100));
  }
  check(gone, `the session ${ended} is deleted after Sign out`);
  check((await page.evaluate(() => sessionStorage.getItem("cellgate.token"))) === null, "the token is forgotten");
  console.log("ok sign out");

  step = "bad token";
  const other = await context.newPage();
  await other.goto(url + "/");
  await other.fill("#token", "not-the-token");
  await other.click("#login-form button[type=submit]");
  await other.locator("#login-error", { hasText: "Token refused" }).waitFor();
  await other.close();
  console.log("ok bad token refused");
} catch (err) {
  console.error(`FAILED at step "${step}": ${err.message}`);
  console.error("page console:\n" + consoleLines.join("\n"));
  await screenshot("failure").catch(() => {});
  writeFileSync(join(shots, "failure.html"), await page.content().catch(() => ""));
  await browser.close();
  process.exit(1);
}
await browser.close();
console.log("all steps passed");
