// The TypeScript client against a live gateway (started by tests/it/sdk.rs, which sets
// CELLGATE_URL and CELLGATE_TOKEN and builds dist/ first): real kernels in the default sandbox.
import assert from "node:assert/strict";
import { test } from "node:test";

import { CellgateError, Client, Session } from "../dist/index.js";

const URL = process.env.CELLGATE_URL;
const TOKEN = process.env.CELLGATE_TOKEN;
if (!URL || !TOKEN) throw new Error("CELLGATE_URL and CELLGATE_TOKEN must name a running gateway");

async function withSession(body) {
  const session = await Session.create(URL, TOKEN);
  try {
    await body(session);
  } finally {
    await session.close();
  }
}

test("runCode streams and resolves to a typed execution", () =>
  withSession(async (session) => {
    const out = [];
    const err = [];
    const execution = await session.runCode("import sys\nprint('hello')\nprint('oops', file=sys.stderr)\n6 * 7", {
      onStdout: (t) => out.push(t),
      onStderr: (t) => err.push(t),
    });
    assert.equal(execution.status, "ok");
    assert.equal(execution.stdout, "hello\n");
    assert.equal(out.join(""), "hello\n");
    assert.equal(err.join(""), "oops\n");
    assert.equal(execution.result, "42");
    assert.equal(execution.error, null);
    assert.ok(execution.state_generation >= 1);
  }));

test("state lasts across calls; restart loses it and says so", () =>
  withSession(async (session) => {
    const first = await session.runCode("x = 41");
    assert.equal((await session.runCode("x + 1")).result, "42");
    const info = await session.restart();
    assert.notEqual(info.state_generation, first.state_generation);
    const after = await session.runCode("x");
    assert.equal(after.status, "error");
    assert.equal(after.error.ename, "NameError");
  }));

test("errors, timeouts and input", () =>
  withSession(async (session) => {
    const failed = await session.runCode("1 / 0");
    assert.equal(failed.error.ename, "ZeroDivisionError");
    assert.ok(failed.error.traceback.some((line) => line.includes("1 / 0")));
    const slow = await session.runCode("import time\ntime.sleep(30)", { timeoutS: 1 });
    assert.equal(slow.status, "timeout");
    const prompts = [];
    const answered = await session.runCode("name = input('who? ')\nprint('hi', name)", {
      onInput: async (prompt, password) => {
        prompts.push([prompt, password]);
        return "Ada";
      },
    });
    assert.deepEqual(prompts, [["who? ", false]]);
    assert.equal(answered.stdout, "hi Ada\n");
    const unanswered = await session.runCode("input('nobody ')");
    assert.equal(unanswered.error.ename, "KeyboardInterrupt");
  }));

test("a chart is an artifact to fetch; HTML reads as text", () =>
  withSession(async (session) => {
    const seen = [];
    const execution = await session.runCode(
      "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()\n" +
        "from IPython.display import HTML, display\ndisplay(HTML('<b>t</b>'))",
      { onArtifact: (a) => seen.push(a) },
    );
    const png = execution.artifacts.find((a) => a.mime === "image/png");
    assert.ok(png && png.width > 0 && png.summary.startsWith("PNG image"), JSON.stringify(execution.artifacts));
    const bytes = await png.fetch();
    assert.equal(bytes.length, png.bytes);
    assert.deepEqual([...bytes.slice(0, 4)], [0x89, 0x50, 0x4e, 0x47]);
    const html = execution.artifacts.find((a) => a.mime === "text/html");
    assert.equal(await html.text(), "<b>t</b>");
    assert.deepEqual(seen.map((a) => a.id).sort(), execution.artifacts.map((a) => a.id).sort());
    assert.equal((await session.artifacts()).length, 2);
    // The signed link is absolute and needs no credential; link() makes another.
    assert.ok(png.signed_url.startsWith(`${URL}/v1/artifacts/${png.id}/signed?`), png.signed_url);
    const anonymous = await fetch(png.signed_url);
    assert.equal(anonymous.status, 200);
    assert.deepEqual(new Uint8Array(await anonymous.arrayBuffer()), bytes);
    assert.equal((await fetch(URL + png.url)).status, 401);
    const link = await png.link(60);
    assert.ok(link.expires && link.url !== png.signed_url, JSON.stringify(link));
    assert.equal((await fetch(link.url)).status, 200);
  }));

test("files go up and come down", () =>
  withSession(async (session) => {
    assert.deepEqual(await session.upload("data/in.csv", "a,b\n1,2\n"), { path: "data/in.csv", bytes: 8 });
    await session.upload("blob.bin", new Uint8Array([0, 1, 2, 255]));
    const execution = await session.runCode(
      "import pandas as pd\npd.read_csv('data/in.csv').sum().to_csv('out.csv')\nlen(open('blob.bin','rb').read())",
    );
    assert.equal(execution.result, "4");
    assert.deepEqual([...(await session.download("blob.bin"))], [0, 1, 2, 255]);
    const top = (await session.files()).map((f) => f.path);
    assert.ok(top.includes("data") && top.includes("out.csv") && !top.includes("data/in.csv"), top.join());
    const all = (await session.files({ recursive: true })).map((f) => f.path);
    assert.ok(all.includes("data/in.csv"), all.join());
    assert.match((await session.files())[0].mtime, /^\d{4}-\d\d-\d\dT/);
  }));

test("interrupt stops a running cell; the notebook exports", () =>
  withSession(async (session) => {
    // Interrupted every 2 s until the run returns: on a slow machine the first interrupt may
    // come before the cell runs, and a kernel between cells ignores it. Should no interrupt
    // work, the cell's own timeout ends it, as `timeout` and not KeyboardInterrupt.
    // Every interrupt is awaited: one that failed is reported, never left unhandled.
    const interrupts = [];
    const stopper = setInterval(() => {
      interrupts.push(session.interrupt());
    }, 2000);
    let stopped;
    try {
      stopped = await session.runCode("import time\nwhile True:\n    time.sleep(0.1)", { timeoutS: 120 });
    } finally {
      clearInterval(stopper);
    }
    const failed = (await Promise.allSettled(interrupts)).filter((r) => r.status === "rejected");
    assert.deepEqual(failed.map((r) => String(r.reason)), [], "every interrupt succeeded");
    assert.equal(stopped.error?.ename, "KeyboardInterrupt", JSON.stringify(stopped));
    const notebook = await session.exportNotebook();
    assert.equal(notebook.nbformat, 4);
  }));

test("errors are CellgateErrors with the server's code", async () => {
  await assert.rejects(Session.create(URL, "wrong"), (e) => e instanceof CellgateError && e.status === 401 && e.code === "invalid_token");
  await assert.rejects(Session.create(URL, TOKEN, { policy: "no-such-policy" }), (e) => e.code === "unknown_policy");
  const client = new Client(URL, TOKEN);
  await assert.rejects(client.attach("nope"), (e) => e.status === 404 && e.code === "no_such_session");
});

test("attach by id keeps the state; one-shot runCode leaves no session", async () => {
  const client = new Client(URL, TOKEN);
  const session = await client.session({ files: { "seed.txt": "seeded", "raw.bin": new Uint8Array([7]) } });
  await session.runCode("turn = 1");
  const again = await client.attach(session.id);
  assert.equal((await again.runCode("turn + 1")).result, "2");
  assert.equal((await again.runCode("open('seed.txt').read()")).result, "'seeded'");
  await again.close();
  const before = (await client.sessions()).length;
  assert.equal((await client.runCode("2 ** 10")).result, "1024");
  assert.equal((await client.sessions()).length, before);
});
