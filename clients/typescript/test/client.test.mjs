// The TypeScript client against a live gateway (started by tests/it/sdk.rs, which sets
// CELLGATE_URL and CELLGATE_TOKEN and builds dist/ first): real kernels in the default sandbox.
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { connect, createServer as createTcpServer } from "node:net";
import { test } from "node:test";

import { CellgateConnectionError, CellgateError, Client, QuotaExceededError, Session, StreamInterrupted } from "../dist/index.js";

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
    const slow = await session.runCode("import time\ntime.sleep(30)", { timeoutSeconds: 1 });
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
      stopped = await session.runCode("import time\nwhile True:\n    time.sleep(0.1)", { timeoutSeconds: 120 });
    } finally {
      clearInterval(stopper);
    }
    const failed = (await Promise.allSettled(interrupts)).filter((r) => r.status === "rejected");
    assert.deepEqual(failed.map((r) => String(r.reason)), [], "every interrupt succeeded");
    assert.equal(stopped.error?.ename, "KeyboardInterrupt", JSON.stringify(stopped));
    const notebook = await session.exportNotebook();
    assert.equal(notebook.nbformat, 4);
  }));

test("kernelspecs name their language; a session runs the kernel it names", async () => {
  const client = new Client(URL, TOKEN);
  const specs = await client.kernelspecs();
  assert.equal(specs.default, "python3");
  const language = (name) => specs.kernelspecs.find((k) => k.name === name)?.language;
  assert.equal(language("python3"), "python");
  assert.equal(language("deno"), "typescript");
  assert.ok(specs.kernelspecs.every((k) => k.display_name), JSON.stringify(specs));
  const deno = await client.session({ kernelName: "deno" });
  try {
    assert.deepEqual([deno.kernelName, deno.language], ["deno", "typescript"]);
    assert.equal((await deno.info()).language, "typescript");
    const listed = (await client.sessions()).find((s) => s.id === deno.id);
    assert.equal(listed?.language, "typescript");
    // TypeScript that Python refuses: the session runs the kernel it named (the status is
    // the kernel's reply; Deno's outputs are not asserted, see tests/it/api_v1.rs).
    assert.equal((await deno.runCode("const answer: number = 6 * 7;")).status, "ok");
  } finally {
    await deno.close();
  }
  const python = await client.session();
  try {
    assert.deepEqual([python.kernelName, python.language], ["python3", "python"]);
    assert.equal((await python.runCode("const answer: number = 6 * 7;")).status, "error");
  } finally {
    await python.close();
  }
  await assert.rejects(client.session({ kernelName: "cobol" }), (e) => e instanceof CellgateError && e.status === 404);
});

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

test("commands: exit codes, stderr, cwd, env and timeouts", () =>
  withSession(async (session) => {
    const ok = await session.runCommand("echo hello; echo oops >&2");
    assert.equal(ok.status, "ok", JSON.stringify(ok));
    assert.equal(ok.exit_code, 0);
    assert.equal(ok.signal, null);
    assert.equal(ok.stdout, "hello\n");
    assert.equal(ok.stderr, "oops\n");
    assert.equal(ok.error, null);
    assert.ok(ok.command_id && ok.duration_ms >= 0 && ok.state_generation >= 1, JSON.stringify(ok));
    const failed = await session.runCommand("echo no >&2; exit 3");
    assert.equal(failed.status, "error");
    assert.equal(failed.exit_code, 3);
    assert.equal(failed.stderr, "no\n");
    await session.makeDir("sub/dir");
    const there = await session.runCommand("pwd; echo made > here.txt", { cwd: "sub/dir" });
    assert.match(there.stdout, /\/sub\/dir\n$/);
    assert.deepEqual(new TextDecoder().decode(await session.download("sub/dir/here.txt")), "made\n");
    const env = await session.runCommand('echo "$GREETING, $WHO"', { env: { GREETING: "hi", WHO: "Ada" } });
    assert.equal(env.stdout, "hi, Ada\n");
    const slow = await session.runCommand("sleep 30", { timeoutSeconds: 1 });
    assert.equal(slow.status, "timeout", JSON.stringify(slow));
    assert.equal(slow.signal, "SIGKILL");
    assert.equal(slow.exit_code, null);
    assert.ok(slow.duration_ms < 20000, JSON.stringify(slow));
    await assert.rejects(session.runCommand("ls", { cwd: "../etc" }), (e) => e instanceof CellgateError && e.status === 400);
  }));

test("commands stream their output to the callbacks while they run", () =>
  withSession(async (session) => {
    // The command prints, then waits for a file the test uploads only once that first chunk
    // has arrived: the callback provably ran before the command ended.
    const out = [];
    const err = [];
    let released;
    const result = await session.runCommand(
      "echo first; echo warn >&2; while [ ! -e go ]; do sleep 0.1; done; echo second",
      {
        timeoutSeconds: 60,
        onStdout: (text) => {
          out.push(text);
          if (!released && out.join("").includes("first")) released = session.upload("go", "");
        },
        onStderr: (text) => err.push(text),
      },
    );
    assert.ok(released, "the first chunk came while the command ran");
    await released;
    assert.equal(result.status, "ok", JSON.stringify(result));
    assert.equal(out.join(""), "first\nsecond\n");
    assert.equal(err.join(""), "warn\n");
    assert.equal(result.stdout, "first\nsecond\n");
  }));

test("workspace files: mkdir, stat, exists, move, remove", () =>
  withSession(async (session) => {
    const made = await session.makeDir("a/b");
    assert.equal(made.path, "a/b");
    assert.equal(made.kind, "dir");
    assert.match(made.mtime, /^\d{4}-\d\d-\d\dT/);
    assert.equal((await session.makeDir("a/b")).kind, "dir", "an existing directory is fine");
    await session.upload("a/b/one.txt", "12345");
    const one = await session.stat("a/b/one.txt");
    assert.deepEqual([one.path, one.kind, one.size], ["a/b/one.txt", "file", 5]);
    assert.equal(await session.exists("a/b/one.txt"), true);
    assert.equal(await session.exists("a"), true);
    assert.equal(await session.exists("a/nothing.txt"), false);
    await assert.rejects(session.stat("a/nothing.txt"), (e) => e.status === 404 && e.code === "no_such_file");

    const moved = await session.move("a/b/one.txt", "c/two.txt");
    assert.deepEqual([moved.path, moved.kind, moved.size], ["c/two.txt", "file", 5]);
    assert.equal(await session.exists("a/b/one.txt"), false);
    await session.upload("three.txt", "333");
    await assert.rejects(session.move("three.txt", "c/two.txt"), (e) => e.status === 409 && e.code === "exists");
    assert.equal((await session.move("three.txt", "c/two.txt", { overwrite: true })).size, 3);
    assert.equal(new TextDecoder().decode(await session.download("c/two.txt")), "333");

    await assert.rejects(session.remove("c"), (e) => e.status === 409 && e.code === "not_empty");
    assert.equal(await session.remove("c/two.txt"), 1);
    assert.equal(await session.remove("c"), 1);
    await session.upload("a/b/x.txt", "x");
    assert.equal(await session.remove("a", { recursive: true }), 3);
    assert.equal(await session.exists("a"), false);
    await assert.rejects(session.remove("a"), (e) => e.status === 404 && e.code === "no_such_file");
  }));

test("exists on a deleted session throws instead of saying false", async () => {
  const session = await Session.create(URL, TOKEN);
  await session.close();
  await assert.rejects(session.exists("x"), (e) => e.status === 404 && e.code === "no_such_session");
});

test("sessions take environment variables the policy allows", async () => {
  const client = new Client(URL, TOKEN);
  const session = await client.session({ env: { CLIENT_TEST_X: "from the client" } });
  try {
    const seen = await session.runCode("import os\nos.environ['CLIENT_TEST_X']");
    assert.equal(seen.result, "'from the client'");
    assert.equal((await session.runCommand('printf %s "$CLIENT_TEST_X"')).stdout, "from the client");
  } finally {
    await session.close();
  }
  const oneShot = await client.runCode("import os\nos.environ.get('CLIENT_TEST_Y')", { env: { CLIENT_TEST_Y: "once" } });
  assert.equal(oneShot.result, "'once'");
  await assert.rejects(
    client.session({ env: { NOT_ALLOWED_HERE: "x" } }),
    (e) => e instanceof CellgateError && e.status === 400 && e.code === "env_not_allowed",
  );
});

test("a client with no URL or token reads CELLGATE_URL and CELLGATE_TOKEN", async () => {
  const client = new Client();
  assert.equal(client.url, URL.replace(/\/+$/, ""));
  assert.ok(Array.isArray(await client.sessions()));
  const session = await Session.create();
  try {
    assert.equal((await session.runCode("1 + 1")).result, "2");
  } finally {
    await session.close();
  }
  // An explicit empty token sends none.
  await assert.rejects(new Client(undefined, "").sessions(), (e) => e.status === 401 && e.code === "missing_token");
  const saved = process.env.CELLGATE_URL;
  delete process.env.CELLGATE_URL;
  try {
    assert.throws(() => new Client(), /CELLGATE_URL/);
  } finally {
    process.env.CELLGATE_URL = saved;
  }
});

/** A port on 127.0.0.1 nothing listens on. */
async function closedPort() {
  const server = createServer();
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address();
  await new Promise((resolve) => server.close(resolve));
  return port;
}

test("an unreachable gateway is a CellgateConnectionError naming the URL", async () => {
  const url = `http://127.0.0.1:${await closedPort()}`;
  await assert.rejects(new Client(url, TOKEN).sessions(), (e) => {
    assert.ok(e instanceof CellgateConnectionError && e instanceof CellgateError, String(e));
    assert.equal(e.name, "CellgateConnectionError");
    assert.equal(e.code, "connection_failed");
    assert.equal(e.url, `${url}/v1/sessions`);
    assert.ok(e.message.startsWith(`cannot reach ${url}/v1/sessions: `), e.message);
    assert.ok(e.message.includes("ECONNREFUSED"), e.message);
    assert.equal(e.requestMayHaveRun, false, "nothing left: nothing ran");
    assert.ok(e.cause, "fetch's own error is the cause");
    return true;
  });
});

/** A local server answering each request with `handle(request, response, body)`; `requests`
 * lists what it received as [method, url, body, headers]. */
async function fakeGateway(handle) {
  const served = { requests: [] };
  const server = createServer((request, response) => {
    const chunks = [];
    request.on("data", (chunk) => chunks.push(chunk));
    request.on("end", () => {
      const body = Buffer.concat(chunks).toString();
      served.requests.push([request.method, request.url, body, request.headers]);
      handle(request, response, body);
    });
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  served.url = `http://127.0.0.1:${server.address().port}`;
  served.close = () => {
    server.closeAllConnections();
    return new Promise((resolve) => server.close(resolve));
  };
  return served;
}

const SESSION = { id: "s1", kernel_name: "python3", policy: "default", state: "idle", state_generation: 1 };

function sse(...events) {
  return events.map((event) => `event: ${event.type}\ndata: ${JSON.stringify(event)}\n\n`).join("");
}

const COMMAND = {
  command_id: "c1", status: "ok", exit_code: 0, signal: null, stdout: "hi\n", stderr: "",
  stdout_truncated: false, stderr_truncated: false, output_truncated: false, error: null,
  denials: [], duration_ms: 5, state_generation: 1,
};

test("exists is one HEAD: 200 is true, 404 no_such_file false, any other error throws", async () => {
  const answers = {
    "/v1/sessions/s1/files/there.txt": [200, {}],
    "/v1/sessions/s1/files/dir/missing.txt": [404, { "X-Cellgate-Error-Code": "no_such_file" }],
    "/v1/sessions/gone/files/x": [404, { "X-Cellgate-Error-Code": "no_such_session" }],
    "/v1/sessions/s1/files/busy": [503, { "X-Cellgate-Error-Code": "kernel_busy" }],
    "/v1/sessions/s1/files/nocode": [404, {}],
  };
  const fake = await fakeGateway((request, response) => {
    const [status, headers] = answers[request.url] ?? [500, { "X-Cellgate-Error-Code": "unexpected" }];
    // A HEAD answer has no body: the header is all there is to say what is missing.
    response.writeHead(status, headers);
    response.end();
  });
  try {
    const client = new Client(fake.url, "t");
    const session = new Session(client, SESSION);
    assert.equal(await session.exists("there.txt"), true);
    assert.equal(await session.exists("dir/missing.txt"), false);
    await assert.rejects(new Session(client, { ...SESSION, id: "gone" }).exists("x"), (e) =>
      e instanceof CellgateError && e.status === 404 && e.code === "no_such_session",
    );
    await assert.rejects(session.exists("busy"), (e) => e.status === 503 && e.code === "kernel_busy");
    await assert.rejects(session.exists("nocode"), (e) => e.status === 404 && e.code === "error", "a 404 that names nothing is not false");
    assert.deepEqual(
      fake.requests.map(([method, url]) => [method, url]),
      Object.keys(answers).map((url) => ["HEAD", url]),
      "one HEAD per call, nothing else",
    );
  } finally {
    await fake.close();
  }
});

test("runCommand always reads the event stream, with or without callbacks", async () => {
  const fake = await fakeGateway((request, response) => {
    response.writeHead(200, { "Content-Type": "text/event-stream" });
    response.end(
      sse(
        { type: "started", command_id: "c1", cmd: "echo hi" },
        { type: "stream", command_id: "c1", name: "stdout", text: "hi\n" },
        { type: "done", command_id: "c1", result: COMMAND },
      ),
    );
  });
  try {
    const session = new Session(new Client(fake.url, "t"), SESSION);
    assert.deepEqual(await session.runCommand("echo hi", { timeoutSeconds: 600 }), COMMAND);
    const out = [];
    assert.deepEqual(await session.runCommand("echo hi", { onStdout: (t) => out.push(t) }), COMMAND);
    assert.deepEqual(out, ["hi\n"]);
    for (const [method, url, body, headers] of fake.requests) {
      assert.deepEqual([method, url], ["POST", "/v1/sessions/s1/commands"]);
      assert.equal(headers.accept, "text/event-stream", "the streamed form, never one long JSON wait");
    }
    assert.deepEqual(JSON.parse(fake.requests[0][2]), { cmd: "echo hi", timeout_s: 600 });
  } finally {
    await fake.close();
  }
});

test("an event stream that ends without its done event throws saying so", async () => {
  const fake = await fakeGateway((request, response) => {
    response.writeHead(200, { "Content-Type": "text/event-stream" });
    response.end(sse({ type: "stream", command_id: "c1", execution_id: "e1", name: "stdout", text: "partial\n" }));
  });
  try {
    const session = new Session(new Client(fake.url, "t"), SESSION);
    const out = [];
    await assert.rejects(session.runCommand("echo partial", { onStdout: (t) => out.push(t) }), (e) => {
      assert.ok(e instanceof CellgateError && e.code === "stream_ended", String(e));
      assert.match(e.message, /without the command's result \(no `done` event\)/);
      return true;
    });
    assert.deepEqual(out, ["partial\n"]);
    await assert.rejects(session.runCode("print('partial')"), (e) => e.code === "stream_ended" && /execution's result/.test(e.message));
  } finally {
    await fake.close();
  }
});

test("a connection that breaks after the request was sent says the request may have run", async () => {
  const fake = await fakeGateway((request, response) => {
    if (request.url === "/v1/sessions") {
      // Took the request, then hung up without answering.
      request.socket.destroy();
    } else if (request.url === "/v1/sessions/s1") {
      // Began the answer, then hung up in the middle of its body.
      response.writeHead(200, { "Content-Type": "application/json", "Content-Length": "1000" });
      response.write('{"id": "s1", ');
      setTimeout(() => response.socket.destroy(), 50);
    } else {
      // Streamed one chunk of the command's output, then hung up.
      response.writeHead(200, { "Content-Type": "text/event-stream" });
      response.write(sse({ type: "stream", command_id: "c1", name: "stdout", text: "first\n" }));
      setTimeout(() => response.socket.destroy(), 50);
    }
  });
  try {
    const client = new Client(fake.url, "t");
    await assert.rejects(client.session(), (e) => {
      assert.ok(e instanceof CellgateConnectionError && e instanceof CellgateError, String(e));
      assert.equal(e.requestMayHaveRun, true);
      assert.equal(e.code, "connection_failed");
      assert.equal(e.url, `${fake.url}/v1/sessions`);
      assert.ok(!e.message.includes("cannot reach"), e.message);
      assert.match(e.message, /may have run/);
      assert.match(e.message, /other side closed/, "fetch's reason is kept");
      return true;
    });
    await assert.rejects(client.attach("s1"), (e) => {
      assert.ok(e instanceof CellgateConnectionError, `reading the body throws ours, not undici's: ${e}`);
      assert.equal(e.requestMayHaveRun, true);
      assert.match(e.message, /broke while its answer was read; the request may have run/);
      assert.match(e.message, /terminated/);
      return true;
    });
    const out = [];
    const session = new Session(client, SESSION);
    await assert.rejects(session.runCommand("echo first; sleep 600", { onStdout: (t) => out.push(t) }), (e) => {
      assert.ok(e instanceof CellgateConnectionError, String(e));
      assert.equal(e.requestMayHaveRun, true);
      assert.equal(e.url, `${fake.url}/v1/sessions/s1/commands`);
      return true;
    });
    assert.deepEqual(out, ["first\n"]);
    assert.equal(fake.requests.length, 3, "none of them was sent again");
  } finally {
    await fake.close();
  }
});

test("runCode takes timeoutSeconds, and timeoutS as its deprecated alias", async () => {
  const execution = {
    execution_id: "e1", status: "ok", execution_count: 1, stdout: "", stderr: "", stdout_truncated: false,
    stderr_truncated: false, output_truncated: false, result: "2", error: null, artifacts: [], omitted: [],
    denials: [], duration_ms: 1, state_generation: 1, resources: {},
  };
  const fake = await fakeGateway((request, response) => {
    response.writeHead(200, { "Content-Type": "text/event-stream" });
    response.end(sse({ type: "done", execution_id: "e1", result: execution }));
  });
  try {
    const session = new Session(new Client(fake.url, "t"), SESSION);
    assert.equal((await session.runCode("1 + 1", { timeoutSeconds: 5 })).result, "2");
    await session.runCode("1 + 1", { timeoutS: 7 });
    await session.runCode("1 + 1", { timeoutSeconds: 9, timeoutS: 1 });
    await session.runCode("1 + 1");
    assert.deepEqual(
      fake.requests.map(([, , body]) => JSON.parse(body)),
      [
        { code: "1 + 1", timeout_s: 5 },
        { code: "1 + 1", timeout_s: 7 },
        { code: "1 + 1", timeout_s: 9 },
        { code: "1 + 1" },
      ],
    );
  } finally {
    await fake.close();
  }
});

/** A local server that gives the answers in `script` (status, headers) one after another,
 * then 200 `[]`; `requests` counts what it received. */
async function scriptedServer(script) {
  const served = { requests: 0, bodies: [] };
  const server = createServer((request, response) => {
    const chunks = [];
    request.on("data", (chunk) => chunks.push(chunk));
    request.on("end", () => {
      served.bodies.push(Buffer.concat(chunks).toString());
      const [status, headers, answer] = script[served.requests++] ?? [200, {}];
      const body =
        answer !== undefined
          ? JSON.stringify(answer)
          : status === 200
            ? "[]"
            : JSON.stringify({ reason: "x", message: "try later", code: status === 429 ? "rate_limited" : "unavailable" });
      response.writeHead(status, { "Content-Type": "application/json", ...headers });
      response.end(body);
    });
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  served.url = `http://127.0.0.1:${server.address().port}`;
  served.close = () => new Promise((resolve) => server.close(resolve));
  return served;
}

test("a quota refusal is a typed error naming the quota and when it resets", async () => {
  const cpu = {
    reason: "Too Many Requests",
    code: "quota_exceeded",
    message: "tenant acme has used its quota cpu_seconds_per_day of 60 s",
    quota: {
      name: "cpu_seconds_per_day",
      limit: 60,
      used: 61.5,
      resets_at: "2026-03-05T00:00:00.000000Z",
      resets: "at 2026-03-05T00:00:00.000000Z (UTC midnight)",
    },
  };
  const sessions = {
    reason: "Too Many Requests",
    code: "quota_exceeded",
    message: "tenant acme runs 2 sessions, its quota concurrent_sessions of 2",
    quota: { name: "concurrent_sessions", limit: 2, used: 2, resets: "when one of the tenant's sessions ends" },
  };
  const server = await scriptedServer([
    [429, { "Retry-After": "40000", "X-Cellgate-Error-Code": "quota_exceeded" }, cpu],
    [429, { "X-Cellgate-Error-Code": "quota_exceeded" }, sessions],
  ]);
  try {
    const client = new Client(server.url, "t");
    await assert.rejects(client.sessions(), (e) => {
      assert.ok(e instanceof QuotaExceededError && e instanceof CellgateError, String(e));
      assert.deepEqual([e.status, e.code, e.quota, e.limit, e.used], [429, "quota_exceeded", "cpu_seconds_per_day", 60, 61.5]);
      assert.equal(e.resetsAt?.toISOString(), "2026-03-05T00:00:00.000Z");
      assert.equal(e.retryAfter, 40000);
      assert.match(e.resets, /UTC midnight/);
      return true;
    });
    await assert.rejects(client.sessions(), (e) => {
      assert.ok(e instanceof QuotaExceededError, String(e));
      assert.deepEqual([e.quota, e.limit, e.resetsAt, e.retryAfter], ["concurrent_sessions", 2, undefined, undefined]);
      return true;
    });
    // Neither was sent again: one waits past maxRetryWaitSeconds, the other has no time.
    assert.equal(server.requests, 2);
  } finally {
    await server.close();
  }
});

test("429 and 503 with Retry-After are retried after the wait, within bounds", async () => {
  const retried = await scriptedServer([
    [429, { "Retry-After": "0" }],
    [503, { "Retry-After": "1" }],
  ]);
  try {
    const started = Date.now();
    assert.deepEqual(await new Client(retried.url, "t").sessions(), []);
    assert.equal(retried.requests, 3);
    assert.ok(Date.now() - started >= 900, "it waited the second answer's second");
  } finally {
    await retried.close();
  }

  const tooLong = await scriptedServer([[429, { "Retry-After": "120" }]]);
  try {
    const started = Date.now();
    await assert.rejects(new Client(tooLong.url, "t", { maxRetryWaitSeconds: 30 }).sessions(), (e) =>
      e instanceof CellgateError && e.status === 429 && e.code === "rate_limited" && e.retryAfter === 120,
    );
    assert.equal(tooLong.requests, 1);
    assert.ok(Date.now() - started < 5000, "thrown at once, not after waiting");
  } finally {
    await tooLong.close();
  }

  const noHeader = await scriptedServer([[503, {}]]);
  try {
    await assert.rejects(new Client(noHeader.url, "t").sessions(), (e) => e.status === 503 && e.retryAfter === undefined);
    assert.equal(noHeader.requests, 1, "a 503 without Retry-After is not repeated");
  } finally {
    await noHeader.close();
  }

  const limited = await scriptedServer([
    [429, { "Retry-After": "0" }],
    [429, { "Retry-After": "0" }],
    [429, { "Retry-After": "0" }],
  ]);
  try {
    await assert.rejects(new Client(limited.url, "t", { maxRetries: 1 }).sessions(), (e) => e.status === 429 && e.retryAfter === 0);
    assert.equal(limited.requests, 2, "one retry, as maxRetries says");
  } finally {
    await limited.close();
  }

  // Bytes can be sent again; a stream cannot, so its refusal is thrown.
  const bytes = await scriptedServer([[429, { "Retry-After": "0" }]]);
  try {
    await new Client(bytes.url, "t").request("PUT", "/v1/sessions/s/files/a", { body: new Uint8Array([65, 66]) });
    assert.deepEqual(bytes.bodies, ["AB", "AB"]);
  } finally {
    await bytes.close();
  }
  const streamed = await scriptedServer([[429, { "Retry-After": "0" }]]);
  try {
    const stream = new ReadableStream({
      start(controller) {
        controller.enqueue(new TextEncoder().encode("once"));
        controller.close();
      },
    });
    await assert.rejects(
      new Client(streamed.url, "t").request("PUT", "/v1/sessions/s/files/b", { body: stream, duplex: "half" }),
      (e) => e.status === 429 && e.retryAfter === 0,
    );
    assert.deepEqual(streamed.bodies, ["once"], "a stream body is never sent twice");
  } finally {
    await streamed.close();
  }
});

const EXECUTION = "e1";
const RESULT = {
  execution_id: EXECUTION, status: "ok", execution_count: 1, stdout: "a\nb\n", stderr: "",
  result: null, error: null, artifacts: [], denials: [], omitted: [], duration_ms: 1,
  state_generation: 1, resources: {},
};
const numbered = (id, type, fields = {}) => ({ id, type, execution_id: EXECUTION, ...fields });

test("a broken execution stream is resumed from its last event, each event once", async () => {
  const fake = await fakeGateway((request, response) => {
    response.writeHead(200, { "Content-Type": "text/event-stream" });
    if (request.method === "POST") {
      response.write(sse(numbered(1, "started", { code: "…" }), numbered(2, "stream", { name: "stdout", text: "a\n" })));
      setTimeout(() => response.socket.destroy(), 50);
    } else {
      // The resumed stream starts with an event already seen: it is dropped.
      response.end(sse(
        numbered(2, "stream", { name: "stdout", text: "a\n" }),
        numbered(3, "stream", { name: "stdout", text: "b\n" }),
        numbered(4, "done", { result: RESULT }),
      ));
    }
  });
  try {
    const session = new Session(new Client(fake.url, "t"), SESSION);
    const out = [];
    const ids = [];
    const execution = await session.runCode("…", { onStdout: (t) => out.push(t), onEvent: (e) => ids.push(e.id) });
    assert.equal(execution.status, "ok");
    assert.deepEqual(out, ["a\n", "b\n"]);
    assert.deepEqual(ids, [1, 2, 3, 4]);
    const [method, url, , headers] = fake.requests.at(-1);
    assert.equal(method, "GET");
    assert.equal(url, `/v1/sessions/s1/executions/${EXECUTION}`);
    assert.equal(headers["last-event-id"], "2");
    assert.equal(headers.accept, "text/event-stream");
  } finally {
    await fake.close();
  }
});

test("resuming stops after maxResumes with StreamInterrupted naming the execution", async () => {
  const fake = await fakeGateway((request, response) => {
    response.writeHead(200, { "Content-Type": "text/event-stream" });
    // Every answer breaks again, with nothing new after the first.
    response.write(sse(numbered(1, "started", { code: "…" }), numbered(2, "stream", { name: "stdout", text: "a\n" })));
    setTimeout(() => response.socket.destroy(), 50);
  });
  try {
    const session = new Session(new Client(fake.url, "t", { maxResumes: 2 }), SESSION);
    const out = [];
    await assert.rejects(session.runCode("…", { onStdout: (t) => out.push(t) }), (e) => {
      assert.ok(e instanceof StreamInterrupted && e instanceof CellgateConnectionError, String(e));
      assert.equal(e.executionId, EXECUTION);
      assert.equal(e.lastEventId, 2);
      assert.equal(e.requestMayHaveRun, true);
      assert.match(e.message, /Session\.execution/);
      return true;
    });
    assert.deepEqual(out, ["a\n"]);
    assert.deepEqual(fake.requests.map(([method]) => method), ["POST", "GET", "GET"]);
  } finally {
    await fake.close();
  }
});

/** A TCP proxy on 127.0.0.1 in front of the gateway that, once, ends the connection whose
 * answer carries `marker` right after passing it on (a FIN mid-answer). */
async function cuttingProxy(target, marker) {
  const { hostname, port } = new globalThis.URL(target);
  const proxy = { cuts: 0, requests: [] };
  const sockets = new Set();
  const server = createTcpServer((client) => {
    const upstream = connect(Number(port), hostname);
    sockets.add(client).add(upstream);
    let seen = "";
    client.on("data", (chunk) => {
      for (const line of chunk.toString("latin1").split("\r\n")) {
        if (/^(GET|POST|PUT|DELETE) /.test(line)) proxy.requests.push(line);
      }
      upstream.write(chunk);
    });
    upstream.on("data", (chunk) => {
      client.write(chunk);
      seen = (seen + chunk.toString("latin1")).slice(-4096);
      if (proxy.cuts === 0 && seen.includes(marker)) {
        proxy.cuts++;
        client.end();
        upstream.destroy();
      }
    });
    const close = () => {
      client.destroy();
      upstream.destroy();
    };
    client.on("close", close).on("error", close);
    upstream.on("close", close).on("error", close);
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  proxy.url = `http://127.0.0.1:${server.address().port}`;
  proxy.close = () => {
    for (const socket of sockets) socket.destroy();
    return new Promise((resolve) => server.close(resolve));
  };
  return proxy;
}

const CUT_CELL =
  "import os, time\n" +
  "for i in range(1, 4):\n    print(f'line {i}', flush=True)\n" +
  "t0 = time.monotonic()\n" +
  "while not os.path.exists('go'):\n" +
  "    if time.monotonic() - t0 > 60: raise RuntimeError('never went on')\n" +
  "    time.sleep(0.02)\n" +
  "for i in range(4, 7):\n    print(f'line {i}', flush=True)\n";
const CUT_LINES = [1, 2, 3, 4, 5, 6].map((i) => `line ${i}\n`).join("");

test("a stream dropped mid-cell is resumed by the client itself", async () => {
  // The cut comes as line 3 passes the proxy, while the cell waits for `go`, which the test
  // uploads only once it has line 3 (from the first stream or the resumed one).
  const proxy = await cuttingProxy(URL, "line 3");
  const session = await Session.create(proxy.url, TOKEN);
  try {
    const out = [];
    const events = [];
    let uploaded;
    const execution = await session.runCode(CUT_CELL, {
      onStdout: (text) => {
        out.push(text);
        if (text.includes("line 3")) uploaded = session.upload("go", "");
      },
      onEvent: (event) => events.push(event),
    });
    await uploaded;
    assert.equal(proxy.cuts, 1);
    assert.ok(proxy.requests.some((r) => r.startsWith("GET ") && r.includes("/executions/")), String(proxy.requests));
    assert.equal(execution.status, "ok");
    assert.equal(execution.stdout, CUT_LINES);
    assert.equal(out.join(""), CUT_LINES);
    const ids = events.map((e) => e.id);
    assert.deepEqual(ids, [...new Set(ids)].sort((a, b) => a - b));
    // What reached the callbacks is what the gateway recorded: every event, once.
    const record = await session.execution(execution.execution_id);
    assert.equal(record.state, "done");
    assert.deepEqual(record.events, events);
    assert.equal(record.result?.stdout, CUT_LINES);
    const listed = await session.executions();
    assert.equal(listed.at(-1)?.execution_id, execution.execution_id);
    assert.equal(listed.at(-1)?.status, "ok");
  } finally {
    await session.close();
    await proxy.close();
  }
});

test("an unknown execution is a 404 no_such_execution", () =>
  withSession(async (session) => {
    await assert.rejects(session.execution("0123456789abcdef0123456789abcdef"), (e) => e.status === 404 && e.code === "no_such_execution");
  }));
