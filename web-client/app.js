// cellgate's web client: a chat-style page over API v1 (docs/api-v1.md).
//
// One session per browser tab: created on sign-in (or resumed after a reload), driven over
// its WebSocket; every event of every execution is rendered as it arrives, once: a socket
// that dropped reconnects with `?last_event_id=` and the gateway sends what it missed (a
// `gap` it no longer holds is said, and the results of cells it ended are fetched). The kernel of a
// new conversation is picked from `GET /v1/kernelspecs` (the choice kept in localStorage);
// the header names the session's language, and code is highlighted in it (highlight.js). Rich outputs are
// artifacts fetched with the token in the Authorization header (never in a page or
// subresource URL) and rendered by type: images as blob images, HTML in a sandboxed srcdoc
// iframe (opaque origin: it cannot read this page, its storage or the token), Plotly and
// Vega-Lite from their JSON. The token lives in sessionStorage only; a `#token=` given in the
// address is taken and removed from it at once.

import { highlight } from "./highlight.js";

const $ = (selector) => document.querySelector(selector);
const TOKEN_KEY = "cellgate.token";
const SESSION_KEY = "cellgate.session";
// Not a secret, and a preference rather than a tab's state: kept across tabs and visits.
const KERNEL_KEY = "cellgate.kernel";

const state = {
  token: null,
  session: null,
  socket: null,
  cells: new Map(), // execution_id -> {root, outputs, clearOnNext}
  displays: new Map(), // display_id -> [element]
  running: 0,
  // The id of the newest event handled (null: none yet on this session's socket).
  lastEventId: null,
};

// --- HTTP ---------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(method, path, { body, headers = {}, raw = false } = {}) {
  const response = await fetch(path, {
    method,
    headers: { Authorization: `Bearer ${state.token}`, ...headers },
    body,
  });
  if (response.status === 401) {
    const reason = await response.json().catch(() => ({}));
    signOut(`Token refused${reason.message ? `: ${reason.message}` : ""}`);
    throw new ApiError(401, "unauthorized");
  }
  if (!response.ok) {
    const reason = await response.json().catch(() => ({}));
    throw new ApiError(response.status, reason.message || response.statusText);
  }
  if (raw) return response;
  return response.status === 204 ? null : response.json();
}

function apiPath(path) {
  // Relative to the page, so a gateway under a base URL works unchanged.
  return new URL(path, document.baseURI).pathname;
}

async function download(url, filename) {
  const blob = await (await api("GET", url, { raw: true })).blob();
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = filename;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 60_000);
}

// --- sign-in and session ------------------------------------------------------------------

function takeTokenFromAddress() {
  const hash = new URLSearchParams(location.hash.slice(1));
  const token = hash.get("token");
  if (token) {
    sessionStorage.setItem(TOKEN_KEY, token);
    history.replaceState(null, "", location.pathname + location.search);
  }
}

function signOut(message = "") {
  sessionStorage.removeItem(TOKEN_KEY);
  sessionStorage.removeItem(SESSION_KEY);
  state.token = null;
  state.socket?.close();
  $("#app").hidden = true;
  $("#logout").hidden = true;
  $("#kernel-picker").hidden = true;
  $("#session-language").hidden = true;
  $("#login").hidden = false;
  $("#login-error").textContent = message;
  setControls(false);
  setKernelState("disconnected");
}

// Sign out ends the tab's session: its kernel is shut down and its artifacts' signed links
// revoked, instead of idling until the gateway culls it. Best effort: a gateway that cannot
// be reached still lets the user sign out.
async function endSession() {
  const id = state.session?.id ?? sessionStorage.getItem(SESSION_KEY);
  if (!id || !state.token) return;
  // Forgotten before it closes: its last events (the session's end) are no news to show.
  const socket = state.socket;
  state.socket = null;
  socket?.close(1000);
  await fetch(apiPath(`v1/sessions/${id}`), {
    method: "DELETE",
    headers: { Authorization: `Bearer ${state.token}` },
  }).catch(() => {});
  state.session = null;
}

// An HTML output's frame says how tall its content is: the frame takes that height (within
// bounds). Only the frame the message came from is sized.
addEventListener("message", (event) => {
  const height = Number(event.data?.cellgateFrameHeight);
  if (!Number.isFinite(height) || height <= 0) return;
  for (const frame of document.querySelectorAll("iframe.artifact-html")) {
    if (frame.contentWindow === event.source) {
      frame.style.height = `${Math.min(Math.max(height + 2, 40), 640)}px`;
    }
  }
});

async function signIn(token) {
  state.token = token;
  sessionStorage.setItem(TOKEN_KEY, token);
  $("#login").hidden = true;
  $("#app").hidden = false;
  $("#logout").hidden = false;
  setKernelState("starting");
  let session = null;
  const known = sessionStorage.getItem(SESSION_KEY);
  if (known) {
    session = await api("GET", apiPath(`v1/sessions/${known}`)).catch(() => null);
  }
  await loadKernels();
  if (!session || session.state === "terminated" || session.state === "dead") {
    await startSession($("#kernel").value);
  } else {
    adopt(session);
  }
}

// The kernels a conversation may run, in the picker: the remembered choice if the gateway
// still has it, else its default. A gateway without the list leaves the picker hidden and
// sessions get its default kernel.
async function loadKernels() {
  const picker = $("#kernel");
  const listed = await api("GET", apiPath("v1/kernelspecs")).catch((err) => {
    if (err.status === 401) throw err;
    return null;
  });
  $("#kernel-picker").hidden = !listed;
  if (!listed) return;
  picker.replaceChildren(
    ...listed.kernelspecs.map((spec) => {
      const option = document.createElement("option");
      option.value = spec.name;
      option.textContent = spec.display_name;
      option.dataset.language = spec.language;
      return option;
    }),
  );
  const wanted = localStorage.getItem(KERNEL_KEY);
  const names = listed.kernelspecs.map((spec) => spec.name);
  picker.value = names.includes(wanted) ? wanted : listed.default;
}

async function startSession(kernelName) {
  notice(`Starting a sandboxed ${kernelName || "default"} kernel…`);
  const body = kernelName ? { kernel_name: kernelName } : {};
  const session = await api("POST", apiPath("v1/sessions"), {
    body: JSON.stringify(body),
    headers: { "Content-Type": "application/json" },
  });
  adopt(session);
}

function adopt(session) {
  state.session = session;
  sessionStorage.setItem(SESSION_KEY, session.id);
  showSession(session);
  connect();
  refreshFiles();
}

// A new conversation in the picked kernel: the current session ends (its kernel shut down,
// as Sign out does) and the transcript starts empty.
async function newConversation() {
  const kernelName = $("#kernel").value;
  $("#new-session").disabled = true;
  setControls(false);
  try {
    await endSession();
    sessionStorage.removeItem(SESSION_KEY);
    state.cells.clear();
    state.lastEventId = null;
    state.displays.clear();
    state.running = 0;
    $("#transcript").replaceChildren();
    setKernelState("starting");
    await startSession(kernelName);
  } catch (err) {
    if (err.status !== 401) notice(`Could not start a session: ${err.message}`);
  } finally {
    $("#new-session").disabled = false;
  }
}

const LANGUAGE_NAMES = { python: "Python", typescript: "TypeScript", javascript: "JavaScript", r: "R", bash: "Bash" };

function languageName(language) {
  return LANGUAGE_NAMES[String(language).toLowerCase()] ?? language;
}

function showSession(session) {
  const who = session.tenant ? ` · tenant ${session.tenant}` : "";
  $("#session-info").textContent =
    `${session.kernel_name} · policy ${session.policy} · ${session.sandbox}${who}`;
  const language = session.language ?? "";
  const badge = $("#session-language");
  badge.textContent = language ? languageName(language) : "";
  badge.dataset.language = language.toLowerCase();
  badge.hidden = !language;
  $("#code").placeholder = `${language ? `${languageName(language)} code` : "Code"} — Ctrl+Enter runs it`;
  setKernelState(session.state);
}

function connect() {
  const url = new URL(apiPath(`v1/sessions/${state.session.id}/ws`), location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  // Browsers cannot set headers on a WebSocket; the query is the only way to authenticate it.
  url.searchParams.set("token", state.token);
  // A reconnect resumes: the events after the last one handled come first.
  if (state.lastEventId !== null) url.searchParams.set("last_event_id", String(state.lastEventId));
  const socket = new WebSocket(url);
  state.socket = socket;
  socket.onopen = () => setControls(true);
  socket.onmessage = (message) => {
    if (state.socket !== socket) return;
    let event;
    try {
      event = JSON.parse(message.data);
    } catch {
      return;
    }
    if (typeof event.id === "number") {
      // Already handled (before a reconnect): each event is rendered once.
      if (state.lastEventId !== null && event.id <= state.lastEventId) return;
      state.lastEventId = event.id;
    } else if (event.type === "session" && typeof event.last_event_id === "number") {
      // Behind the page's own (ids began again, in a session another replica took over):
      // go by the gateway's.
      if (state.lastEventId === null || event.last_event_id < state.lastEventId) state.lastEventId = event.last_event_id;
    }
    handle(event);
  };
  socket.onclose = (close) => {
    if (state.socket !== socket) return;
    setControls(false);
    if (state.token && close.code !== 1000) {
      setKernelState("disconnected");
      notice(`Connection closed (${close.code}${close.reason ? `: ${close.reason}` : ""}); reconnecting…`);
      setTimeout(() => state.token && state.socket === socket && connect(), 1500);
    }
  };
}

function send(message) {
  if (state.socket?.readyState === WebSocket.OPEN) {
    state.socket.send(JSON.stringify(message));
    return true;
  }
  notice("Not connected.");
  return false;
}

function setControls(enabled) {
  for (const id of ["#run", "#interrupt", "#restart", "#export"]) $(id).disabled = !enabled;
}

function setKernelState(kernelState) {
  const badge = $("#kernel-state");
  badge.textContent = kernelState;
  badge.dataset.state = kernelState;
}

// --- events -------------------------------------------------------------------------------

function handle(event) {
  switch (event.type) {
    case "session":
      state.session = event.session;
      showSession(event.session);
      break;
    case "kernel":
      setKernelState(event.state === "ready" ? "idle" : event.state);
      if (event.state === "restarting" || event.state === "dead") {
        notice(`Kernel ${event.state}${event.reason ? `: ${event.reason}` : ""} — variables are lost.`);
      }
      if (event.state === "terminated") {
        sessionStorage.removeItem(SESSION_KEY);
        notice("The session has ended. Reload the page to start a new one.");
      }
      break;
    case "started":
      setKernelState("busy");
      startCell(event.execution_id, event.code);
      break;
    case "stream":
      appendStream(cellFor(event), event.name, event.text);
      break;
    case "display":
    case "result":
      addOutput(cellFor(event), renderBundle(event), event.display_id);
      break;
    case "update_display":
      updateDisplay(event);
      break;
    case "clear_output": {
      const cell = cellFor(event);
      if (event.wait) cell.clearOnNext = true;
      else clearCell(cell);
      break;
    }
    case "error":
      addOutput(cellFor(event), renderError(event));
      break;
    case "input_request":
      addOutput(cellFor(event), renderInput(event));
      break;
    case "done":
      finishCell(cellFor(event), event.result);
      break;
    case "gap":
      notice(`This page missed events ${event.first_id}–${event.last_id} (no longer held); results of cells that ended meanwhile are fetched.`);
      refetchUnfinished();
      break;
    case "lagged":
      // A gateway that numbers events tells the same as a `gap` first; this is an older one.
      if (event.missed && state.lastEventId === null) notice(`This page fell behind and missed ${event.missed} events.`);
      break;
    case "client_error":
      notice(`The gateway did not accept a request: ${event.message}`);
      break;
  }
}

function startCell(executionId, code) {
  if (state.cells.has(executionId)) return state.cells.get(executionId);
  const root = document.createElement("article");
  root.className = "cell running";
  root.dataset.executionId = executionId;
  const source = document.createElement("pre");
  source.className = "code";
  const language = state.session?.language ?? "";
  source.dataset.language = language.toLowerCase();
  source.append(...highlight(code ?? "", language));
  const outputs = document.createElement("div");
  outputs.className = "outputs";
  const meta = document.createElement("div");
  meta.className = "meta";
  meta.innerHTML = `<span class="badge status" data-status="running">running</span><span class="duration"></span>`;
  root.append(source, outputs, meta);
  $("#transcript").append(root);
  const cell = { root, outputs, clearOnNext: false };
  state.cells.set(executionId, cell);
  state.running += 1;
  scrollDown();
  return cell;
}

function cellFor(event) {
  return state.cells.get(event.execution_id) ?? startCell(event.execution_id, "");
}

function clearCell(cell) {
  cell.outputs.replaceChildren();
  cell.clearOnNext = false;
}

function addOutput(cell, element, displayId) {
  if (cell.clearOnNext) clearCell(cell);
  element.classList.add("output");
  cell.outputs.append(element);
  if (displayId) {
    const list = state.displays.get(displayId) ?? [];
    list.push(element);
    state.displays.set(displayId, list);
  }
  scrollDown();
}

function appendStream(cell, name, text) {
  if (cell.clearOnNext) clearCell(cell);
  const last = cell.outputs.lastElementChild;
  if (last?.matches(`pre.stream.${name}`)) {
    last.textContent += text;
  } else {
    const pre = document.createElement("pre");
    pre.className = `stream ${name} output`;
    pre.textContent = text;
    cell.outputs.append(pre);
  }
  scrollDown();
}

function updateDisplay(event) {
  for (const element of state.displays.get(event.display_id) ?? []) {
    const fresh = renderBundle(event);
    fresh.classList.add("output");
    element.replaceWith(fresh);
    const list = state.displays.get(event.display_id);
    list[list.indexOf(element)] = fresh;
  }
}

/** Cells still running here whose `done` may be among missed events: their results, if they
 * have ended, from `GET …/executions/{id}`. */
async function refetchUnfinished() {
  for (const [executionId, cell] of state.cells) {
    if (cell.finished) continue;
    try {
      const record = await api("GET", apiPath(`v1/sessions/${state.session.id}/executions/${executionId}`));
      if (record.state === "done" && record.result) finishCell(cell, record.result);
    } catch (err) {
      if (err.status !== 401) notice(`Could not fetch the result of a cell: ${err.message}`);
    }
  }
}

function finishCell(cell, result) {
  // Once: a result fetched after a gap and its `done` may both arrive.
  if (cell.finished) return;
  cell.finished = true;
  cell.root.classList.remove("running");
  for (const input of cell.outputs.querySelectorAll(".input-request input")) input.disabled = true;
  const badge = cell.root.querySelector(".status");
  badge.textContent = result.status;
  badge.dataset.status = result.status;
  const details = [`${result.duration_ms} ms`];
  if (result.execution_count != null) details.unshift(`[${result.execution_count}]`);
  cell.root.querySelector(".duration").textContent = details.join(" · ");
  for (const denial of result.denials ?? []) {
    addOutput(cell, textBlock(`denied by policy ${denial.policy}: ${denial.kind} ${denial.target} — ${denial.reason}`, "error"));
  }
  for (const omitted of result.omitted ?? []) {
    addOutput(cell, textBlock(`output not kept (${omitted.mime}, ${omitted.bytes} bytes): ${omitted.reason}`, "text"));
  }
  // Files the cell wrote under outputs/ arrive only in the result.
  for (const artifact of result.artifacts ?? []) {
    if (artifact.path) addOutput(cell, fileLink(artifact.path, artifact.url, artifact.bytes));
  }
  state.running = Math.max(0, state.running - 1);
  if (state.running === 0) setKernelState("idle");
  refreshFiles();
}

// --- rendering ----------------------------------------------------------------------------

// Richest first; the first artifact of the bundle whose type is here is the one shown.
const PREFERENCE = [
  "application/vnd.plotly.v1+json",
  "application/vnd.vegalite.v6+json",
  "application/vnd.vegalite.v6.json",
  "application/vnd.vegalite.v5+json",
  "application/vnd.vegalite.v4+json",
  "application/vnd.vega.v6+json",
  "application/vnd.vega.v5+json",
  "text/html",
  "image/svg+xml",
  "image/png",
  "image/jpeg",
  "image/gif",
  "image/webp",
  "text/markdown",
  "text/latex",
  "application/json",
  "application/geo+json",
  "application/pdf",
];

function textBlock(text, kind) {
  const pre = document.createElement("pre");
  pre.className = kind;
  pre.textContent = text;
  return pre;
}

function renderBundle(event) {
  const artifacts = event.artifacts ?? [];
  const chosen = PREFERENCE.map((mime) => artifacts.find((a) => a.mime === mime)).find(Boolean);
  const holder = document.createElement("div");
  holder.className = "rich";
  if (event.type === "result" && event.execution_count != null) {
    holder.dataset.executionCount = event.execution_count;
  }
  if (!chosen) {
    holder.append(textBlock(event.text ?? "", "text"));
    return holder;
  }
  holder.dataset.mime = chosen.mime;
  holder.title = chosen.summary ?? "";
  renderArtifact(holder, chosen, event.text).catch((err) => {
    holder.replaceChildren(textBlock(`${event.text ?? ""}\n(could not show ${chosen.mime}: ${err.message})`, "text"));
  });
  return holder;
}

async function renderArtifact(holder, artifact, fallbackText) {
  const response = await api("GET", artifact.url, { raw: true });
  const mime = artifact.mime;
  if (mime.startsWith("image/")) {
    const img = document.createElement("img");
    img.alt = artifact.summary ?? mime;
    if (artifact.width) img.width = artifact.width;
    img.src = URL.createObjectURL(await response.blob());
    holder.append(img);
  } else if (mime === "text/html") {
    const frame = document.createElement("iframe");
    frame.className = "artifact-html";
    // Scripts may run, but in an opaque origin: no access to this page, its storage or token.
    frame.setAttribute("sandbox", "allow-scripts");
    // The frame reports its content's height (frame-height.js, from the gateway: the page's
    // policy, which the frame inherits, allows only its scripts), so it fits its table.
    const reporter = new URL("assets/frame-height.js", document.baseURI).href;
    frame.srcdoc = `${await response.text()}<script src="${reporter}"></script>`;
    holder.append(frame);
  } else if (mime === "application/vnd.plotly.v1+json") {
    const figure = await response.json();
    const div = document.createElement("div");
    div.className = "chart plotly-chart";
    holder.append(div);
    if (!window.Plotly) throw new Error("Plotly is not bundled in this build (run ./dev setup)");
    await window.Plotly.newPlot(div, figure.data ?? [], figure.layout ?? {}, { responsive: true });
  } else if (mime.startsWith("application/vnd.vega")) {
    const spec = await response.json();
    const div = document.createElement("div");
    div.className = "chart vega-chart";
    holder.append(div);
    if (!window.vegaEmbed) throw new Error("Vega-Lite is not bundled in this build (run ./dev setup)");
    await window.vegaEmbed(div, spec, { actions: false, renderer: "svg" });
  } else if (mime === "application/pdf") {
    holder.append(fileLink("output.pdf", artifact.url, artifact.bytes));
  } else if (mime === "application/json" || mime === "application/geo+json") {
    holder.append(textBlock(JSON.stringify(await response.json(), null, 2), "text"));
  } else {
    holder.append(textBlock((await response.text()) || fallbackText || "", "text"));
  }
}

function renderError(event) {
  const traceback = (event.traceback ?? []).join("\n");
  return textBlock(traceback || `${event.ename}: ${event.evalue}`, "error");
}

function renderInput(event) {
  const form = document.createElement("form");
  form.className = "input-request";
  const label = document.createElement("label");
  label.textContent = event.prompt || "input:";
  const input = document.createElement("input");
  input.type = event.password ? "password" : "text";
  input.autocomplete = "off";
  form.append(label, input);
  form.addEventListener("submit", (submit) => {
    submit.preventDefault();
    if (input.disabled) return;
    if (send({ type: "input_reply", value: input.value, execution_id: event.execution_id })) {
      input.disabled = true;
      if (event.password) input.value = "••••";
    }
  });
  setTimeout(() => input.focus(), 0);
  return form;
}

function fileLink(path, url, bytes) {
  const link = document.createElement("a");
  link.className = "download";
  link.textContent = `⬇ ${path}${bytes != null ? ` (${formatBytes(bytes)})` : ""}`;
  link.href = "#";
  link.dataset.path = path;
  link.addEventListener("click", (click) => {
    click.preventDefault();
    download(url, path.split("/").pop()).catch((err) => notice(`Download failed: ${err.message}`));
  });
  return link;
}

function formatBytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1 << 20) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / (1 << 20)).toFixed(1)} MiB`;
}

function notice(text) {
  const p = document.createElement("p");
  p.className = "notice";
  p.textContent = text;
  $("#transcript").append(p);
  scrollDown();
}

function scrollDown() {
  const transcript = $("#transcript");
  transcript.scrollTop = transcript.scrollHeight;
}

// --- files --------------------------------------------------------------------------------

async function refreshFiles() {
  if (!state.session) return;
  try {
    // Every file below the top, but not hidden ones (caches the kernel's libraries write
    // would drown the user's own): the listing leaves those out unless asked.
    const entries = await api("GET", apiPath(`v1/sessions/${state.session.id}/files?recursive=true`));
    const files = entries.filter((entry) => entry.kind === "file");
    const list = $("#file-list");
    list.replaceChildren(
      ...files.map((file) => {
        const item = document.createElement("li");
        item.append(
          fileLink(file.path, apiPath(`v1/sessions/${state.session.id}/files/${encodePath(file.path)}`), file.size),
        );
        return item;
      }),
    );
  } catch (err) {
    if (err.status !== 401) $("#file-list").replaceChildren();
  }
}

function encodePath(path) {
  return path.split("/").map(encodeURIComponent).join("/");
}

async function upload(files) {
  for (const file of files) {
    try {
      await api("PUT", apiPath(`v1/sessions/${state.session.id}/files/${encodePath(file.name)}`), { body: file });
      notice(`Uploaded ${file.name} (${formatBytes(file.size)}).`);
    } catch (err) {
      notice(`Upload of ${file.name} failed: ${err.message}`);
    }
  }
  refreshFiles();
}

// --- wiring -------------------------------------------------------------------------------

function run() {
  const code = $("#code").value;
  if (!code.trim()) return;
  if (send({ type: "execute", code })) $("#code").value = "";
}

$("#login-form").addEventListener("submit", (submit) => {
  submit.preventDefault();
  const token = $("#token").value.trim();
  $("#token").value = "";
  signIn(token).catch((err) => err.status !== 401 && signOut(`Could not start a session: ${err.message}`));
});
$("#composer").addEventListener("submit", (submit) => {
  submit.preventDefault();
  run();
});
$("#code").addEventListener("keydown", (key) => {
  if (key.key === "Enter" && (key.ctrlKey || key.metaKey)) {
    key.preventDefault();
    run();
  }
});
$("#interrupt").addEventListener("click", () => send({ type: "interrupt" }));
$("#restart").addEventListener("click", () => send({ type: "restart" }));
$("#logout").addEventListener("click", () => endSession().finally(() => signOut()));
$("#kernel").addEventListener("change", () => localStorage.setItem(KERNEL_KEY, $("#kernel").value));
$("#new-session").addEventListener("click", () => newConversation());
$("#upload").addEventListener("change", (change) => {
  upload([...change.target.files]);
  change.target.value = "";
});
$("#export").addEventListener("click", () =>
  download(apiPath(`v1/sessions/${state.session.id}/notebook`), `cellgate-${state.session.id}.ipynb`).catch((err) =>
    notice(`Export failed: ${err.message}`),
  ),
);

takeTokenFromAddress();
const saved = sessionStorage.getItem(TOKEN_KEY);
if (saved) {
  signIn(saved).catch((err) => err.status !== 401 && signOut(`Could not start a session: ${err.message}`));
} else {
  signOut();
}
