// The API reference page (/v1/docs) in Debian's headless Chromium (never a downloaded
// browser). Run by tests/it/contract.rs against a real `cellgate serve`:
//   CELLGATE_URL=http://127.0.0.1:PORT CELLGATE_TOKEN=T SCREENSHOT_DIR=target/… node docs.mjs
// The page renders every operation of the OpenAPI document from the gateway's own assets
// (any request elsewhere fails the test), "Authorize" takes the token, and "try it out"
// lists the sessions and creates one through the real API. Prints one line per step;
// exits non-zero with the page's console and a screenshot on the first failure.

import { chromium } from "playwright-core";
import { mkdirSync } from "node:fs";
import { join } from "node:path";

const url = process.env.CELLGATE_URL;
const token = process.env.CELLGATE_TOKEN;
const shots = process.env.SCREENSHOT_DIR ?? "target/web-client-screenshots/docs";
const executablePath = process.env.CHROMIUM ?? "/usr/bin/chromium";
if (!url || !token) throw new Error("CELLGATE_URL and CELLGATE_TOKEN are required");
mkdirSync(shots, { recursive: true });

const browser = await chromium.launch({
  executablePath,
  headless: true,
  args: ["--no-sandbox", "--disable-dev-shm-usage"],
});
const page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
page.setDefaultTimeout(60_000);
const consoleLines = [];
page.on("console", (m) => consoleLines.push(`[${m.type()}] ${m.text()}`));
page.on("pageerror", (e) => consoleLines.push(`[pageerror] ${e.message}`));
const origin = new URL(url).origin;
const elsewhere = [];
page.on("request", (r) => {
  const target = r.url();
  if (!target.startsWith(origin) && !target.startsWith("data:") && !target.startsWith("blob:")) {
    elsewhere.push(target);
  }
});

let step = "start";
function check(condition, message) {
  if (!condition) throw new Error(message);
}

try {
  step = "the page renders every operation";
  await page.goto(`${url}/v1/docs`);
  await page.locator(".opblock").first().waitFor();
  const operations = await page.locator(".opblock").count();
  check(operations >= 17, `${operations} operations rendered`);
  const text = await page.locator("#swagger-ui").innerText();
  for (const id of ["create_session", "execute", "upload_file", "fetch_artifact", "replay_notebook"]) {
    check(text.includes(id), `operation ${id} is not shown`);
  }
  check(text.includes("ErrorBody"), "the ErrorBody schema is not shown");
  console.log(`ok: ${step} (${operations})`);

  step = "Authorize takes the gateway's token";
  await page.getByRole("button", { name: /Authorize/ }).first().click();
  const dialog = page.locator(".modal-ux");
  await dialog.waitFor();
  const tokenBlock = dialog.locator(".auth-container").filter({ hasText: "token (apiKey)" });
  await tokenBlock.locator("input").fill(`token ${token}`);
  await tokenBlock.locator("button.authorize").click();
  await tokenBlock.getByText("Authorized").waitFor();
  await dialog.locator("button.btn-done").first().click();
  console.log(`ok: ${step}`);

  step = "try it out: create a session";
  const create = page.locator("#operations-sessions-create_session");
  await create.locator(".opblock-summary").click();
  await create.getByRole("button", { name: "Try it out" }).click();
  await create.locator("textarea.body-param__text").fill("{}");
  await create.getByRole("button", { name: "Execute" }).click();
  const created = create.locator(".live-responses-table .response .response-col_status").first();
  await created.waitFor();
  const createdStatus = (await created.innerText()).trim();
  check(createdStatus.startsWith("201"), `POST /v1/sessions answered ${createdStatus}`);
  console.log(`ok: ${step}`);

  step = "try it out: the session is listed";
  const list = page.locator("#operations-sessions-list_sessions");
  await list.locator(".opblock-summary").click();
  await list.getByRole("button", { name: "Try it out" }).click();
  await list.getByRole("button", { name: "Execute" }).click();
  const listed = list.locator(".live-responses-table .response .response-col_status").first();
  await listed.waitFor();
  check((await listed.innerText()).trim().startsWith("200"), "GET /v1/sessions failed");
  const body = await list.locator(".live-responses-table .microlight").first().innerText();
  check(body.includes("state_generation"), `the listing shows no session: ${body.slice(0, 200)}`);
  console.log(`ok: ${step}`);

  step = "nothing was loaded from elsewhere";
  check(elsewhere.length === 0, `requests left the gateway: ${elsewhere.join(", ")}`);
  const errors = consoleLines.filter((l) => l.startsWith("[error]") || l.startsWith("[pageerror]"));
  check(errors.length === 0, `console errors: ${errors.join("\n")}`);
  console.log(`ok: ${step}`);
  await page.screenshot({ path: join(shots, "docs.png"), fullPage: false });
  console.log("all steps passed");
} catch (error) {
  console.log(`FAILED at "${step}": ${error.message}`);
  console.log(consoleLines.join("\n"));
  await page.screenshot({ path: join(shots, "docs-failed.png"), fullPage: true }).catch(() => {});
  await browser.close();
  process.exit(1);
}
await browser.close();
