// The client of cellgate's API v1: a sandboxed Jupyter kernel per session, output streamed
// as it comes (Server-Sent Events over fetch), typed results, artifacts by reference.
// Works in browsers and in Node 18+ (global fetch); no framework, no dependency.
//
//   import { Session } from "@cellgate/client";
//   const session = await Session.create("http://127.0.0.1:8888", token); // or CELLGATE_URL/TOKEN
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
  /** The kernel's language (`python`, `typescript`, `bash`, `R`…); absent from a gateway
   * too old to say. */
  language?: string;
}

/** A kernel a session may run: `name` is what `kernelName` takes. */
export interface Kernelspec {
  name: string;
  display_name: string;
  language: string;
}

/** The kernels a session may run, by name, and the one a session gets when it names none. */
export interface Kernelspecs {
  default: string;
  kernelspecs: Kernelspec[];
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
  /** True on the first result after the session was restored from hibernation (saved to
   * disk while idle): its variables are intact and `state_generation` is unchanged. */
  restored?: boolean;
}

export interface FileEntry {
  path: string;
  kind: "file" | "dir" | "symlink" | "other";
  size: number;
  /** RFC 3339. */
  mtime: string;
}

/** How a shell command ended: `ok` (exit code 0), `error` (another exit code, a signal, or it
 * could not start: `error` says why), `timeout` (killed after its timeout), and as for
 * executions `oom`, `denied`, `sandbox_lost`. */
export type CommandStatus = "ok" | "error" | "timeout" | "oom" | "denied" | "sandbox_lost";

/** The typed result of a shell command run in the session's sandbox. */
export interface CommandResult {
  command_id: string;
  status: CommandStatus;
  /** Its exit code, when it exited. */
  exit_code: number | null;
  /** The signal that ended it (`SIGKILL` after a timeout or an interrupt). */
  signal: string | null;
  /** Capped (see `stdout_truncated`); the callbacks saw the complete streams. */
  stdout: string;
  stderr: string;
  stdout_truncated: boolean;
  stderr_truncated: boolean;
  /** The policy's per-execution output limit cut the output off. */
  output_truncated: boolean;
  /** Why it could not run, or what ended the kernel's side of it. */
  error: string | null;
  denials: Denial[];
  duration_ms: number;
  state_generation: number;
}

export interface CommandOptions {
  /** A directory below the workspace to run in (default: the workspace). */
  cwd?: string;
  /** Variables added to the kernel's environment for this command. */
  env?: Record<string, string>;
  /** Kill the command (its whole process group) after this many seconds (the gateway's
   * default: 60) and report `timeout`. */
  timeoutSeconds?: number;
  /** The output, chunk by chunk as it comes. The answer is always an event stream (with
   * keep-alives), callbacks or not, so a command may run longer than any HTTP timeout. */
  onStdout?: (text: string) => void;
  onStderr?: (text: string) => void;
  /** Aborting stops waiting for the answer. */
  signal?: AbortSignal;
}

/** One event of an execution, as `docs/api-v1.md` lists them; `id` is its number in the
 * session (absent from gateways older than resumable delivery). */
export type ExecutionEvent = { type: string; id?: number; execution_id?: string; [field: string]: unknown };

/** An execution as `Session.executions()` lists it (`status`: the result's, `null` while
 * running). */
export interface ExecutionSummary {
  execution_id: string;
  state: "running" | "done";
  code: string;
  started: string;
  status: Status | null;
}

/** An execution as the gateway keeps it (`Session.execution(id)`): its events so far (each
 * with its `id`) and, once `state` is `done`, its result. */
export interface ExecutionRecord {
  execution_id: string;
  state: "running" | "done";
  code: string;
  started: string;
  events: ExecutionEvent[];
  result: Execution | null;
}

export interface RunOptions {
  /** Interrupt the cell after this many seconds and report `timeout`. */
  timeoutSeconds?: number;
  /** @deprecated The old name of `timeoutSeconds` (still honoured; `timeoutSeconds` wins
   * when both are given). */
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

/** The header in which the gateway sends an error answer's machine code. */
const ERROR_CODE_HEADER = "x-cellgate-error-code";

/** The gateway answered an error: its status, its stable machine `code`
 * (`no_such_session`, `invalid_json`, `rate_limited`…), its message, and `retryAfter`
 * (seconds, from the `Retry-After` header of a 429 or 503) where waiting helps. */
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
    // The header carries the code on every error answer, even a HEAD's, which has no body.
    const header = response.headers.get(ERROR_CODE_HEADER)?.trim();
    let code = header || "error";
    let message = response.statusText;
    let quota: unknown;
    const text = await response.text();
    try {
      const body = JSON.parse(text);
      if (!header && body.code) code = String(body.code);
      message = String(body.message ?? message);
      quota = body.quota;
    } catch {
      if (text) message = text;
    }
    if (response.status === 429 && code === "quota_exceeded") {
      return new QuotaExceededError(response.status, code, message, retryAfter(response), quota);
    }
    return new CellgateError(response.status, code, message, retryAfter(response));
  }
}

/**
 * 429 `quota_exceeded`: the tenant is over one of its quotas. `quota` names it
 * (`cpu_seconds_per_day`, `concurrent_sessions`); `limit` and `used` are in its unit (CPU
 * seconds; sessions); `resets` says when it frees, for a person; `resetsAt` is when it
 * resets at a time: the next UTC midnight for `cpu_seconds_per_day` (`retryAfter` counts
 * down to it), undefined for `concurrent_sessions`, which frees when one of the tenant's
 * sessions ends. A CellgateError with status 429, so code that handles those handles this;
 * the client repeats the request by itself only when `Retry-After` is within
 * `maxRetryWaitSeconds`.
 */
export class QuotaExceededError extends CellgateError {
  readonly quota?: string;
  readonly limit?: number;
  readonly used?: number;
  readonly resets?: string;
  readonly resetsAt?: Date;

  constructor(status: number, code: string, message: string, retryAfter: number | undefined, detail: unknown) {
    super(status, code, message, retryAfter);
    this.name = "QuotaExceededError";
    const quota = (detail !== null && typeof detail === "object" ? detail : {}) as Record<string, unknown>;
    if (typeof quota.name === "string") this.quota = quota.name;
    if (typeof quota.limit === "number") this.limit = quota.limit;
    if (typeof quota.used === "number") this.used = quota.used;
    if (typeof quota.resets === "string") this.resets = quota.resets;
    if (typeof quota.resets_at === "string") {
      const at = new Date(quota.resets_at);
      if (!Number.isNaN(at.getTime())) this.resetsAt = at;
    }
  }
}

/**
 * No (complete) answer from the gateway: `url` is what was asked for, `cause` what fetch, or
 * reading the answer's body, threw. `status` is 0 and `code` `connection_failed`.
 *
 * `requestMayHaveRun` says whether the gateway may have acted on the request:
 * - `false`: the connection failed before the request left (connection refused, unknown host,
 *   connect timeout, TLS): nothing ran. The message starts "cannot reach URL".
 * - `true`: the request was sent, or may have been, and the connection broke before the
 *   answer came or while its body was read (the message says so): the code, command or
 *   upload may have run, so check before repeating it. Where fetch says too little to tell
 *   (browsers say only "Failed to fetch"), it is `true`.
 */
export class CellgateConnectionError extends CellgateError {
  readonly requestMayHaveRun: boolean;

  /** `stage`: `"request"` when fetch itself threw (`requestMayHaveRun` then comes from
   * `cause`), `"answer"` when reading the body of an answer did. */
  constructor(
    readonly url: string,
    cause: unknown,
    stage: "request" | "answer" = "request",
  ) {
    const requestMayHaveRun = stage === "answer" || !failedBeforeSending(cause);
    const detail = describe(cause);
    const message =
      stage === "answer"
        ? `the connection to ${url} broke while its answer was read; the request may have run: ${detail}`
        : requestMayHaveRun
          ? `no answer from ${url}: the connection failed or broke after the request was sent, so it may have run: ${detail}`
          : `cannot reach ${url}: ${detail}`;
    super(0, "connection_failed", message);
    this.name = "CellgateConnectionError";
    this.message = message; // without CellgateError's "status code:" prefix: there was no answer
    this.cause = cause;
    this.requestMayHaveRun = requestMayHaveRun;
  }
}

/**
 * An execution's event stream broke and could not be resumed after `maxResumes` attempts in
 * a row. The code may have run, and may still be running: `executionId` fetches its result
 * later (`Session.execution`); `lastEventId` is the last event received.
 */
export class StreamInterrupted extends CellgateConnectionError {
  constructor(
    url: string,
    cause: unknown,
    readonly executionId: string,
    readonly lastEventId: number,
    attempts: number,
  ) {
    super(url, cause, "answer");
    this.name = "StreamInterrupted";
    this.message =
      `the event stream of execution ${executionId} broke without the execution's result (no ` +
      `\`done\` event) and ${attempts} attempts to resume it after event ${lastEventId} failed; ` +
      `the code may have run or still be running: Session.execution("${executionId}") fetches its result`;
  }
}

/** Milliseconds before resume attempt `attempt` (1, 2, …): a dropped connection is often
 * over at once, a restarting proxy takes longer. */
function resumeWait(attempt: number): number {
  return Math.min(250 * 2 ** (attempt - 1), 4000);
}

type FetchLike = typeof fetch;

export interface ClientOptions {
  /** The fetch to use (default: the global one). */
  fetch?: FetchLike;
  /** How many times to repeat a request the gateway refused with 429 or 503 and a
   * `Retry-After` header (it sends one only when nothing was done), after waiting as it
   * says. Default 3; 0 never repeats. */
  maxRetries?: number;
  /** The longest `Retry-After` to wait for, in seconds (default 30): a longer one is thrown
   * at once, as a CellgateError with `retryAfter`. */
  maxRetryWaitSeconds?: number;
  /** How many times in a row an execution's event stream that broke is resumed from the
   * last event received before `StreamInterrupted` is thrown. Default 5; 0 never resumes. */
  maxResumes?: number;
}

/** A cellgate gateway. `token` is its static token or a tenant's JWT. Under Node, a `url`
 * or `token` not given (undefined) is read from `CELLGATE_URL` / `CELLGATE_TOKEN`; `""` as
 * the token sends none. */
export class Client {
  readonly url: string;
  readonly maxRetries: number;
  readonly maxRetryWaitSeconds: number;
  readonly maxResumes: number;
  private readonly headers: Record<string, string>;
  private readonly fetchImpl: FetchLike;

  constructor(url?: string, token?: string, options: ClientOptions = {}) {
    const base = url ?? environment("CELLGATE_URL");
    if (!base) {
      throw new Error(
        "no cellgate URL: pass one (new Client(url, token)) or set CELLGATE_URL (e.g. http://127.0.0.1:8888)",
      );
    }
    this.url = base.replace(/\/+$/, "");
    const credential = token ?? environment("CELLGATE_TOKEN");
    // `Bearer` carries both the static token and a tenant's JWT.
    this.headers = credential ? { Authorization: `Bearer ${credential}` } : {};
    this.fetchImpl = options.fetch ?? globalThis.fetch.bind(globalThis);
    this.maxRetries = Math.max(0, Math.floor(options.maxRetries ?? 3));
    this.maxRetryWaitSeconds = Math.max(0, options.maxRetryWaitSeconds ?? 30);
    this.maxResumes = Math.max(0, Math.floor(options.maxResumes ?? 5));
  }

  /** One request; throws a CellgateError for an error answer, a CellgateConnectionError when
   * the gateway cannot be reached or the connection breaks (reading the answer's body too
   * throws one then, not fetch's own error). A 429 or 503 with `Retry-After` is repeated
   * after the wait (up to `maxRetries` times, for waits up to `maxRetryWaitSeconds`), unless
   * the body is a stream, which cannot be sent twice. */
  async request(method: string, path: string, init: RequestInit = {}): Promise<Response> {
    const url = this.url + path;
    const replayable = !isStream(init.body);
    for (let attempt = 0; ; attempt++) {
      let response: Response;
      try {
        response = await this.fetchImpl(url, {
          ...init,
          method,
          headers: { ...this.headers, ...(init.headers as Record<string, string> | undefined) },
        });
      } catch (error) {
        if (init.signal?.aborted || isAbort(error)) throw error;
        throw new CellgateConnectionError(url, error);
      }
      response = guardBody(response, url, init.signal ?? undefined);
      if (response.ok || response.status === 304) return response;
      const wait = retryAfter(response);
      const retryable =
        (response.status === 429 || response.status === 503) &&
        wait !== undefined &&
        wait <= this.maxRetryWaitSeconds &&
        attempt < this.maxRetries &&
        replayable;
      if (!retryable) throw await CellgateError.from(response);
      await response.body?.cancel().catch(() => {});
      await sleep(wait * 1000, init.signal ?? undefined);
    }
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

  /** The kernels a session may run (each one's `name`, `display_name`, `language`) and the
   * `default`. */
  kernelspecs(): Promise<Kernelspecs> {
    return this.json<Kernelspecs>("GET", "/v1/kernelspecs");
  }

  /** Runs `code` once in a fresh session (`policy`, `kernelName`, `env`, `files` as for
   * `session()`), deleted afterwards. */
  async runCode(code: string, options: RunOptions & NewSessionOptions = {}): Promise<Execution> {
    const { policy, kernelName, env, files } = options;
    const session = await this.session({ policy, kernelName, env, files });
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

  /** `new Client(url, token).session(options)` (no url or token: `CELLGATE_URL`,
   * `CELLGATE_TOKEN`). */
  static async create(url?: string, token?: string, options: NewSessionOptions = {}): Promise<Session> {
    return new Client(url, token).session(options);
  }

  private get path(): string {
    return `/v1/sessions/${enc(this.id)}`;
  }

  /** The kernelspec this session runs (it never changes). */
  get kernelName(): string {
    return this.infoAtStart.kernel_name;
  }

  /** The language of its kernel: `python`, `typescript`, `bash`, `R`… (`""` from a gateway
   * too old to say). */
  get language(): string {
    return this.infoAtStart.language ?? "";
  }

  /** The session now. */
  info(): Promise<SessionInfo> {
    return this.client.json<SessionInfo>("GET", this.path);
  }

  /** Runs `code`, streaming its output to the callbacks, and resolves to its Execution
   * (whatever its status). If the connection drops mid-stream, the stream is resumed from
   * the last event received (`GET …/executions/{id}` with `Last-Event-ID`), so each event
   * reaches the callbacks once; after the client's `maxResumes` failed attempts in a row,
   * `StreamInterrupted` says which execution to fetch later. */
  async runCode(code: string, options: RunOptions = {}): Promise<Execution> {
    const body: Record<string, unknown> = { code };
    const timeout = options.timeoutSeconds ?? options.timeoutS;
    if (timeout !== undefined) body.timeout_s = timeout;
    let response = await this.client.request("POST", `${this.path}/execute`, {
      body: JSON.stringify(body),
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      signal: options.signal,
    });
    let executionId: string | undefined;
    let lastEventId = 0;
    let failures = 0;
    for (;;) {
      let cause: unknown;
      try {
        if (!response.body) throw new CellgateError(0, "no_stream", "the answer has no body");
        for await (const event of sseEvents(response.body)) {
          if (typeof event.id === "number") {
            // A repeat of what a resumed stream already gave.
            if (event.id <= lastEventId) continue;
            lastEventId = event.id;
            failures = 0;
          }
          executionId ??= event.execution_id;
          const result = await this.handle(event, options);
          if (result) return result;
        }
      } catch (error) {
        if (!(error instanceof CellgateConnectionError)) throw error;
        cause = error;
      }
      // Without an execution and event ids (an older gateway) there is nothing to resume.
      if (executionId === undefined || lastEventId === 0) {
        if (cause) throw cause;
        throw new CellgateError(
          0,
          "stream_ended",
          "the event stream ended without the execution's result (no `done` event); the code may have run",
        );
      }
      // Resume where it broke: every failed attempt in a row counts, until one brings an
      // event it had not.
      for (;;) {
        if (failures >= this.client.maxResumes) {
          throw new StreamInterrupted(this.client.url + this.path, cause, executionId, lastEventId, failures);
        }
        failures++;
        await sleep(resumeWait(failures), options.signal);
        try {
          response = await this.client.request("GET", `${this.path}/executions/${enc(executionId)}`, {
            headers: { Accept: "text/event-stream", "Last-Event-ID": String(lastEventId) },
            signal: options.signal,
          });
          break;
        } catch (error) {
          if (!(error instanceof CellgateConnectionError)) throw error;
          cause = error;
        }
      }
    }
  }

  /** The session's newest executions (`limit`: the gateway's default is 100), oldest first,
   * the running one last: for an id that was lost. */
  executions(limit?: number): Promise<ExecutionSummary[]> {
    const query = limit === undefined ? "" : `?limit=${Math.floor(limit)}`;
    return this.client.json<ExecutionSummary[]>("GET", `${this.path}/executions${query}`);
  }

  /** An execution of this session, running or done: its events so far and, once done, its
   * result (for a result whose stream was lost, or that a page never saw). A 404
   * `no_such_execution` for one the session does not have (or no longer keeps). */
  async execution(executionId: string): Promise<ExecutionRecord> {
    const record = await this.client.json<
      Omit<ExecutionRecord, "result"> & { result: (Omit<Execution, "artifacts"> & { artifacts: ArtifactRef[] }) | null }
    >("GET", `${this.path}/executions/${enc(executionId)}`);
    return { ...record, result: record.result ? this.executionResult(record.result) : null };
  }

  private executionResult(result: Omit<Execution, "artifacts"> & { artifacts: ArtifactRef[] }): Execution {
    return { ...result, artifacts: result.artifacts.map((a) => this.client.artifact(a)) };
  }

  /** Passes one event to the callbacks; the Execution once it is `done`. */
  private async handle(event: ExecutionEvent, options: RunOptions): Promise<Execution | undefined> {
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
      case "done":
        return this.executionResult(event.result as Omit<Execution, "artifacts"> & { artifacts: ArtifactRef[] });
    }
    return undefined;
  }

  /** Runs the shell command `cmd` (`bash -c`) in the session's sandbox, as the kernel's user
   * with its limits and egress, after any running cell; resolves to its CommandResult
   * whatever its status. The answer is always an event stream, whose keep-alives let a long
   * command (or a long wait behind a cell) outlast HTTP timeouts; `onStdout`/`onStderr` get
   * its output as it comes. */
  async runCommand(cmd: string, options: CommandOptions = {}): Promise<CommandResult> {
    const body: Record<string, unknown> = { cmd };
    if (options.cwd !== undefined) body.cwd = options.cwd;
    if (options.env !== undefined) body.env = options.env;
    if (options.timeoutSeconds !== undefined) body.timeout_s = options.timeoutSeconds;
    const response = await this.client.request("POST", `${this.path}/commands`, {
      body: JSON.stringify(body),
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      signal: options.signal,
    });
    if (!response.body) throw new CellgateError(0, "no_stream", "the answer has no body");
    for await (const event of sseEvents(response.body)) {
      if (event.type === "stream") {
        const text = String(event.text ?? "");
        (event.name === "stderr" ? options.onStderr : options.onStdout)?.(text);
      } else if (event.type === "done") {
        return event.result as CommandResult;
      }
    }
    throw new CellgateError(
      0,
      "stream_ended",
      "the event stream ended without the command's result (no `done` event); the command may have run",
    );
  }

  /** Whether anything (file, directory, link…) is at `path` in the workspace: one `HEAD`
   * request, whose 404 names what is missing in its `X-Cellgate-Error-Code` header. Nothing
   * there (`no_such_file`) is `false`; any other error throws, so a session that is gone
   * is a 404 `no_such_session`, not `false`. */
  async exists(path: string): Promise<boolean> {
    try {
      await this.client.request("HEAD", `${this.path}/files/${encPath(path)}`);
      return true;
    } catch (error) {
      if (error instanceof CellgateError && error.status === 404 && error.code === "no_such_file") return false;
      throw error;
    }
  }

  /** What is at `path` (a link is described, not followed); 404 `no_such_file` if nothing. */
  stat(path: string): Promise<FileEntry> {
    return this.fileOperation(path, { op: "stat" });
  }

  /** Creates the directory `path` and any missing parent (one that exists is fine). */
  makeDir(path: string): Promise<FileEntry> {
    return this.fileOperation(path, { op: "mkdir" });
  }

  /** Moves (renames) `from` to `to`, creating missing parents, and resolves to the entry at
   * `to`. Something already at `to` is a 409 `exists`, unless `overwrite`. */
  move(from: string, to: string, options: { overwrite?: boolean } = {}): Promise<FileEntry> {
    return this.fileOperation(from, { op: "move", to, overwrite: Boolean(options.overwrite) });
  }

  /** Removes a file, a link, or a directory: an empty one, or with `recursive` everything
   * in it (else 409 `not_empty`). Resolves to how many entries went. */
  async remove(path: string, options: { recursive?: boolean } = {}): Promise<number> {
    const query = options.recursive ? "?recursive=true" : "";
    const answer = await this.client.json<{ path: string; removed: number }>(
      "DELETE",
      `${this.path}/files/${encPath(path)}${query}`,
    );
    return answer.removed;
  }

  private fileOperation(path: string, operation: Record<string, unknown>): Promise<FileEntry> {
    return this.client.json<FileEntry>("POST", `${this.path}/files/${encPath(path)}`, operation);
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

/** The `Retry-After` of an answer in seconds (delta-seconds or an HTTP date), if any. */
function retryAfter(response: Response): number | undefined {
  const value = response.headers.get("retry-after")?.trim();
  if (!value) return undefined;
  if (/^\d+$/.test(value)) return Number(value);
  const date = Date.parse(value);
  return Number.isNaN(date) ? undefined : Math.max(0, (date - Date.now()) / 1000);
}

/** A body that can be read only once (a stream, or an async iterable under Node). */
function isStream(body: unknown): boolean {
  if (body === null || typeof body !== "object") return false;
  if (typeof ReadableStream !== "undefined" && body instanceof ReadableStream) return true;
  return Symbol.asyncIterator in body;
}

/** `response` with a body whose read errors (the connection broke: undici's "terminated")
 * are CellgateConnectionErrors that say the request may have run. An abort stays an abort. */
function guardBody(response: Response, url: string, signal?: AbortSignal): Response {
  if (!response.body || NULL_BODY_STATUSES.has(response.status)) return response;
  const reader = response.body.getReader();
  const body = new ReadableStream<Uint8Array>({
    async pull(controller) {
      try {
        const { value, done } = await reader.read();
        if (done) controller.close();
        else controller.enqueue(value);
      } catch (error) {
        const aborted = signal?.aborted || isAbort(error);
        controller.error(aborted ? error : new CellgateConnectionError(url, error, "answer"));
      }
    },
    cancel(reason) {
      return reader.cancel(reason);
    },
  });
  const guarded = new Response(body, {
    status: response.status,
    statusText: response.statusText,
    headers: response.headers,
  });
  Object.defineProperty(guarded, "url", { value: response.url });
  return guarded;
}

const NULL_BODY_STATUSES = new Set([101, 103, 204, 205, 304]);

/** Whether fetch's `error` says the request never left: the connection or name lookup failed
 * (Node puts the system error, with its `code` and `syscall`, in the `cause` chain). Anything
 * else (the socket closed after sending, a reset, a bare "Failed to fetch") may have run. */
function failedBeforeSending(error: unknown): boolean {
  let current: unknown = error;
  for (let depth = 0; current !== undefined && current !== null && depth < 4; depth++) {
    const { code, syscall } = current as { code?: unknown; syscall?: unknown };
    if (syscall === "connect" || syscall === "getaddrinfo" || syscall === "getaddrinfo_all") return true;
    if (typeof code === "string" && (BEFORE_SENDING_CODES.has(code) || TLS_CODE.test(code))) return true;
    current = (current as { cause?: unknown }).cause;
  }
  return false;
}

const BEFORE_SENDING_CODES = new Set([
  "ECONNREFUSED",
  "ENOTFOUND",
  "EAI_AGAIN",
  "EAI_FAIL",
  "EAI_NONAME",
  "EHOSTUNREACH",
  "EHOSTDOWN",
  "ENETUNREACH",
  "ENETDOWN",
  "EADDRNOTAVAIL",
  "UND_ERR_CONNECT_TIMEOUT",
  "ERR_INVALID_URL",
]);
/** Certificate and handshake failures: the TLS session, and so the request, never started. */
const TLS_CODE = /^(ERR_TLS_|ERR_SSL_|CERT_|UNABLE_TO_|DEPTH_ZERO_SELF_SIGNED_CERT|SELF_SIGNED_CERT_IN_CHAIN)/;

function isAbort(error: unknown): boolean {
  const name = (error as { name?: unknown } | null)?.name;
  return name === "AbortError" || name === "TimeoutError";
}

/** What fetch's error says, with its cause (Node: "fetch failed" caused by ECONNREFUSED…). */
function describe(error: unknown): string {
  const parts: string[] = [];
  let current: unknown = error;
  for (let depth = 0; current !== undefined && current !== null && depth < 4; depth++) {
    const { message, code } = current as { message?: unknown; code?: unknown };
    const said = typeof message === "string" ? message : "";
    const text = typeof code === "string" && !said.includes(code) ? `${code} ${said}`.trim() : said;
    parts.push(text || String(current));
    current = (current as { cause?: unknown }).cause;
  }
  return parts.join(": ");
}

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/** A variable of the process's environment under Node (undefined in a browser). */
function environment(name: string): string | undefined {
  const runtime = globalThis as { process?: { env?: Record<string, string | undefined> } };
  return typeof runtime.process !== "undefined" ? runtime.process.env?.[name] || undefined : undefined;
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
