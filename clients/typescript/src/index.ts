// The client of cellgate's API v1: a sandboxed Jupyter kernel per session, output streamed
// as it comes (Server-Sent Events over fetch), typed results, artifacts by reference.
// Works in browsers and in Node 18+ (global fetch); no framework, no dependency.
//
//   import { Session } from "@cellgate/client";
//   const session = await Session.create("http://127.0.0.1:8888", token);
//   const execution = await session.runCode("6 * 7");
//   console.log(execution.status, execution.result); // ok 42
//   await session.close();

/** A session as the gateway describes it. */
export interface SessionInfo {
  id: string;
  kernel_name: string;
  policy: string;
  sandbox: string;
  state: string;
  state_generation: number;
  created: string;
  last_activity: string;
  executions: number;
  tenant?: string;
  reason?: string;
}

/** A rich output, or a file the code wrote under `outputs/`, stored once on the gateway. */
export interface ArtifactRef {
  id: string;
  url: string;
  mime: string;
  bytes: number;
  summary: string;
  width?: number;
  height?: number;
  display_id?: string;
  version: number;
  previous?: string;
  path?: string;
  /**
   * The same bytes with no credential, for a page's `<img src>`: signed for this artifact,
   * working until `signed_url_expires` and until the session is deleted (absent when the gateway
   * signs no links). Relative to the gateway's origin in a reference; absolute in an
   * {@link Artifact}.
   */
  signed_url?: string;
  /** When `signed_url` stops working (RFC 3339, UTC). */
  signed_url_expires?: string;
}

/** A signed artifact link: an absolute URL that needs no credential. */
export interface ArtifactLink {
  url: string;
  /** RFC 3339, UTC; the link also stops working when the session is deleted. */
  expires: string;
}

/** An artifact with the means to fetch its bytes. */
export interface Artifact extends ArtifactRef {
  /** Its bytes. */
  fetch(): Promise<Uint8Array>;
  /** Its bytes as text (HTML, JSON, Markdown, SVG…). */
  text(): Promise<string>;
  /** A signed link that works for `ttlSeconds` (the gateway's default if omitted). */
  link(ttlSeconds?: number): Promise<ArtifactLink>;
}

export interface ExecError {
  ename: string;
  evalue: string;
  traceback: string[];
}

/** Something the session's policy refused: a connection (`egress`) or a package. */
export interface Denial {
  kind: "egress" | "package";
  target: string;
  policy: string;
  reason: string;
}

export type Status =
  | "ok"
  | "error"
  | "timeout"
  | "oom"
  | "denied"
  | "output_truncated"
  | "sandbox_lost";

/** The typed result of running code. `state_generation` changes when the kernel's variables
 * were lost (restart, crash, out of memory). */
export interface Execution {
  execution_id: string;
  status: Status;
  execution_count: number | null;
  stdout: string;
  stderr: string;
  stdout_truncated: boolean;
  stderr_truncated: boolean;
  output_truncated: boolean;
  result: string | null;
  error: ExecError | null;
  artifacts: Artifact[];
  omitted: Record<string, unknown>[];
  denials: Denial[];
  duration_ms: number;
  state_generation: number;
  resources: { cpu_time_ms?: number; memory_peak_bytes?: number; memory_bytes?: number };
}

export interface FileEntry {
  path: string;
  kind: "file" | "dir" | "symlink" | "other";
  size: number;
  /** RFC 3339. */
  mtime: string;
}

/** One event of an execution, as `docs/api-v1.md` lists them. */
export type ExecutionEvent = { type: string; execution_id?: string; [field: string]: unknown };

export interface RunOptions {
  /** Interrupt the cell after this many seconds and report `timeout`. */
  timeoutS?: number;
  onStdout?: (text: string) => void;
  onStderr?: (text: string) => void;
  onArtifact?: (artifact: Artifact) => void;
  /** Answers the code's `input()`; without it, a cell asking for input is interrupted. */
  onInput?: (prompt: string, password: boolean) => string | Promise<string>;
  onEvent?: (event: ExecutionEvent) => void;
  /** Aborting stops reading the stream (the cell keeps running: see `interrupt`). */
  signal?: AbortSignal;
}

export interface NewSessionOptions {
  policy?: string;
  kernelName?: string;
  env?: Record<string, string>;
  /** Files to put in the workspace first: text, or bytes. */
  files?: Record<string, string | Uint8Array>;
}

/** The gateway answered an error: its status, its stable machine `code`
 * (`no_such_session`, `invalid_json`, `rate_limited`…), its message, and `retryAfter`
 * (seconds) where waiting helps. */
export class CellgateError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
    readonly retryAfter?: number,
  ) {
    super(`${status} ${code}: ${message}`);
    this.name = "CellgateError";
  }

  static async from(response: Response): Promise<CellgateError> {
    let code = "error";
    let message = response.statusText;
    const text = await response.text();
    try {
      const body = JSON.parse(text);
      code = String(body.code ?? code);
      message = String(body.message ?? message);
    } catch {
      if (text) message = text;
    }
    const retry = Number(response.headers.get("retry-after"));
    return new CellgateError(response.status, code, message, Number.isFinite(retry) && retry > 0 ? retry : undefined);
  }
}

type FetchLike = typeof fetch;

/** A cellgate gateway. `token` is its static token or a tenant's JWT. */
export class Client {
  readonly url: string;
  private readonly headers: Record<string, string>;
  private readonly fetchImpl: FetchLike;

  constructor(url: string, token?: string, options: { fetch?: FetchLike } = {}) {
    this.url = url.replace(/\/+$/, "");
    // `Bearer` carries both the static token and a tenant's JWT.
    this.headers = token ? { Authorization: `Bearer ${token}` } : {};
    this.fetchImpl = options.fetch ?? globalThis.fetch.bind(globalThis);
  }

  /** One request; throws a CellgateError for an error answer. */
  async request(method: string, path: string, init: RequestInit = {}): Promise<Response> {
    const response = await this.fetchImpl(this.url + path, {
      ...init,
      method,
      headers: { ...this.headers, ...(init.headers as Record<string, string> | undefined) },
    });
    if (!response.ok && response.status !== 304) throw await CellgateError.from(response);
    return response;
  }

  async json<T>(method: string, path: string, body?: unknown): Promise<T> {
    const init: RequestInit = {};
    if (body !== undefined) {
      init.body = JSON.stringify(body);
      init.headers = { "Content-Type": "application/json" };
    }
    const response = await this.request(method, path, init);
    return (await response.json()) as T;
  }

  /** A new session: a kernel in its own sandbox, ready when this resolves. */
  async session(options: NewSessionOptions = {}): Promise<Session> {
    const info = await this.json<SessionInfo>("POST", "/v1/sessions", sessionBody(options));
    return new Session(this, info);
  }

  /** The existing session `id` (a chat app keeps it across turns). */
  async attach(id: string): Promise<Session> {
    return new Session(this, await this.json<SessionInfo>("GET", `/v1/sessions/${enc(id)}`));
  }

  /** The caller's sessions. */
  sessions(): Promise<SessionInfo[]> {
    return this.json<SessionInfo[]>("GET", "/v1/sessions");
  }

  /** Runs `code` once in a fresh session, deleted afterwards. */
  async runCode(code: string, options: RunOptions & { policy?: string } = {}): Promise<Execution> {
    const session = await this.session({ policy: options.policy });
    try {
      return await session.runCode(code, options);
    } finally {
      await session.close();
    }
  }

  /** An artifact's bytes. */
  async fetchArtifact(id: string): Promise<Uint8Array> {
    const response = await this.request("GET", `/v1/artifacts/${enc(id)}`);
    return new Uint8Array(await response.arrayBuffer());
  }

  /**
   * A signed link to an artifact, for a page's `<img src>` with no credential: it works for
   * `ttlSeconds` (the gateway's default if omitted, at most its maximum) and while the
   * session is deleted.
   */
  async artifactLink(id: string, ttlSeconds?: number): Promise<ArtifactLink> {
    const body = ttlSeconds === undefined ? {} : { ttl_s: Math.floor(ttlSeconds) };
    const link = await this.json<ArtifactLink>("POST", `/v1/artifacts/${enc(id)}/links`, body);
    return { ...link, url: this.absoluteUrl(link.url) };
  }

  /** A URL the gateway gave relative to its origin, made absolute. */
  absoluteUrl(path: string): string {
    return new URL(path, this.url + "/").toString();
  }

  /** @internal */
  artifact(ref: ArtifactRef): Artifact {
    const client = this;
    return {
      ...ref,
      ...(ref.signed_url ? { signed_url: client.absoluteUrl(ref.signed_url) } : {}),
      fetch: () => client.fetchArtifact(ref.id),
      text: async () => new TextDecoder().decode(await client.fetchArtifact(ref.id)),
      link: (ttlSeconds?: number) => client.artifactLink(ref.id, ttlSeconds),
    };
  }
}

/** One sandboxed kernel whose variables and files last across calls. */
export class Session {
  readonly id: string;

  constructor(
    readonly client: Client,
    /** The session when it was created or attached. */
    readonly infoAtStart: SessionInfo,
  ) {
    this.id = infoAtStart.id;
  }

  /** `new Client(url, token).session(options)`. */
  static async create(url: string, token?: string, options: NewSessionOptions = {}): Promise<Session> {
    return new Client(url, token).session(options);
  }

  private get path(): string {
    return `/v1/sessions/${enc(this.id)}`;
  }

  /** The session now. */
  info(): Promise<SessionInfo> {
    return this.client.json<SessionInfo>("GET", this.path);
  }

  /** Runs `code`, streaming its output to the callbacks, and resolves to its Execution
   * (whatever its status). */
  async runCode(code: string, options: RunOptions = {}): Promise<Execution> {
    const body: Record<string, unknown> = { code };
    if (options.timeoutS !== undefined) body.timeout_s = options.timeoutS;
    const response = await this.client.request("POST", `${this.path}/execute`, {
      body: JSON.stringify(body),
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      signal: options.signal,
    });
    if (!response.body) throw new CellgateError(0, "no_stream", "the answer has no body");
    for await (const event of sseEvents(response.body)) {
      options.onEvent?.(event);
      switch (event.type) {
        case "stream": {
          const text = String(event.text ?? "");
          (event.name === "stderr" ? options.onStderr : options.onStdout)?.(text);
          break;
        }
        case "display":
        case "update_display":
        case "result":
          for (const ref of (event.artifacts as ArtifactRef[] | undefined) ?? []) {
            options.onArtifact?.(this.client.artifact(ref));
          }
          break;
        case "input_request":
          if (options.onInput) {
            const value = await options.onInput(String(event.prompt ?? ""), Boolean(event.password));
            await this.sendInput(value, event.execution_id);
          } else {
            await this.interrupt();
          }
          break;
        case "done": {
          const result = event.result as Omit<Execution, "artifacts"> & { artifacts: ArtifactRef[] };
          return { ...result, artifacts: result.artifacts.map((a) => this.client.artifact(a)) };
        }
      }
    }
    throw new CellgateError(0, "stream_ended", "the event stream ended before the execution's result");
  }

  /** Answers the `input()` a running cell waits for. */
  async sendInput(value: string, executionId?: string): Promise<void> {
    const body: Record<string, string> = { value };
    if (executionId) body.execution_id = executionId;
    await this.client.request("POST", `${this.path}/input`, {
      body: JSON.stringify(body),
      headers: { "Content-Type": "application/json" },
    });
  }

  /** Interrupts the running cell (its result says KeyboardInterrupt). */
  async interrupt(): Promise<void> {
    await this.client.request("POST", `${this.path}/interrupt`);
  }

  /** Restarts the kernel: variables and workspace files are lost; state_generation changes. */
  restart(): Promise<SessionInfo> {
    return this.client.json<SessionInfo>("POST", `${this.path}/restart`);
  }

  /** Writes `content` to `path` in the workspace. */
  async upload(path: string, content: string | Uint8Array | Blob): Promise<{ path: string; bytes: number }> {
    const response = await this.client.request("PUT", `${this.path}/files/${encPath(path)}`, {
      body: content as BodyInit,
    });
    return (await response.json()) as { path: string; bytes: number };
  }

  /** A workspace file's bytes. */
  async download(path: string): Promise<Uint8Array> {
    const response = await this.client.request("GET", `${this.path}/files/${encPath(path)}`);
    return new Uint8Array(await response.arrayBuffer());
  }

  /** The workspace's files: the top (or `dir`), everything below with `recursive`, dot
   * names with `hidden`. */
  files(options: { dir?: string; recursive?: boolean; hidden?: boolean } = {}): Promise<FileEntry[]> {
    const query = new URLSearchParams();
    if (options.dir) query.set("dir", options.dir);
    if (options.recursive) query.set("recursive", "true");
    if (options.hidden) query.set("hidden", "true");
    const text = query.toString();
    const suffix = text ? `?${text}` : "";
    return this.client.json<FileEntry[]>("GET", `${this.path}/files${suffix}`);
  }

  /** Every artifact the session made, oldest first. */
  async artifacts(): Promise<Artifact[]> {
    const refs = await this.client.json<ArtifactRef[]>("GET", `${this.path}/artifacts`);
    return refs.map((ref) => this.client.artifact(ref));
  }

  /** The session's history as an nbformat 4 notebook. */
  exportNotebook(): Promise<Record<string, unknown>> {
    return this.client.json<Record<string, unknown>>("GET", `${this.path}/notebook`);
  }

  /** Shuts the kernel down (a session already gone is fine). */
  async close(): Promise<void> {
    try {
      await this.client.request("DELETE", this.path);
    } catch (error) {
      if (!(error instanceof CellgateError && error.status === 404)) throw error;
    }
  }
}

/** The events of a Server-Sent Events body (`data:` lines joined; an empty line ends one). */
export async function* sseEvents(body: ReadableStream<Uint8Array>): AsyncGenerator<ExecutionEvent> {
  const decoder = new TextDecoder();
  const reader = body.getReader();
  let buffer = "";
  let data: string[] = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let newline: number;
      while ((newline = buffer.search(/\r?\n/)) >= 0) {
        const line = buffer.slice(0, newline);
        buffer = buffer.slice(buffer[newline] === "\r" ? newline + 2 : newline + 1);
        if (line === "") {
          if (data.length) yield JSON.parse(data.join("\n")) as ExecutionEvent;
          data = [];
        } else if (line.startsWith("data:")) {
          data.push(line.slice(5).replace(/^ /, ""));
        }
      }
    }
  } finally {
    // Left early (a callback threw, the caller aborted, or `done` came): stop the stream.
    await reader.cancel().catch(() => {});
  }
}

function sessionBody(options: NewSessionOptions): Record<string, unknown> {
  const body: Record<string, unknown> = {};
  if (options.policy !== undefined) body.policy = options.policy;
  if (options.kernelName !== undefined) body.kernel_name = options.kernelName;
  if (options.env) body.env = options.env;
  if (options.files) {
    body.files = Object.entries(options.files).map(([path, content]) =>
      typeof content === "string"
        ? { path, content }
        : { path, content: base64(content), encoding: "base64" },
    );
  }
  return body;
}

function base64(bytes: Uint8Array): string {
  let binary = "";
  for (const byte of bytes) binary += String.fromCharCode(byte);
  return btoa(binary);
}

function enc(segment: string): string {
  return encodeURIComponent(segment);
}

function encPath(path: string): string {
  return path.replace(/^\/+/, "").split("/").map(encodeURIComponent).join("/");
}
