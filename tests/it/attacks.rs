//! Attacks driven through the gateway, as a user's notebook code would attack.
//!
//! Each test starts a real gateway (namespaces sandbox unless `CELLGATE_TEST_SANDBOX` says
//! otherwise, which these tests refuse), a *bystander* kernel in another session, and an
//! *attacker* kernel. The attacker's cell runs hostile code sent over the WebSocket; the test
//! asserts the attempt fails and is reported (an exception in the cell's output, or a typed
//! outcome), and that the bystander keeps answering `1+1` meanwhile.
//!
//! Latency of the bystander: the median of [`SAMPLES`] `1+1` round trips right before the
//! attack, with both kernels started and idle (baseline), and the median of the round trips
//! taken while the attack runs. Quick attacks repeat inside one cell for
//! [`SUSTAIN_SECONDS`] (see [`sustained`]) and the cell is run again until the bystander has
//! [`SAMPLES`] samples during it; attacks that end sooner and cannot be repeated are measured
//! over "during and right after", and the printed line says so. The ratio of the two medians
//! is printed for every attack but is no verdict: on a 2-core machine that also compiles
//! (CI), ratios of 2 to 4 come from the load alone. An attack fails the bystander check only
//! when it starves the bystander (see [`starved`]): a `1+1` unanswered for 30 s, or a median
//! over both [`STARVED_RATIO`] times the baseline and [`STARVED_FLOOR`]. That a CPU attack
//! stays within its CPU limit is checked in CPU time, from the attacker's cgroup
//! ([`sandbox_cpu`]), which a busy machine can only lower.
//!
//! Weaknesses these tests found, each fixed since (9d787dd) and kept fixed by its test:
//! - `ipc_directory_tricks`: the kernel owned its run directory, so it could plant symlinks
//!   under the ipc socket names of the next generation and have the gateway connect to host
//!   unix sockets. Now every generation gets a fresh, randomly named directory, and the
//!   gateway connects only through `O_PATH|O_NOFOLLOW` handles of the sockets the kernel bound.
//! - `memory_bombs`: a kernel OOM-killed before its `busy` status got out used to answer the
//!   running cell "this cell never ran"; the oldest waiting execute now counts as running.
//!
//! The files under `attacks/` hold the attacks of issue 13, one concern each.

use std::future::Future;
use std::io::ErrorKind;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use serde_json::{json, Value};

use crate::support::*;

// Attack files of issue 13, one per concern; their tests run as `attacks::<file>::…`, so the
// nextest override (one at a time) and the gVisor pass apply to them too.
mod artifact_quotas;
mod connections;
mod deno;
mod egress_fronting;
mod host_view;
mod output_floods;
mod replay_and_origin;
mod workspace_memory;

/// Samples per median.
const SAMPLES: usize = 20;
/// The bystander is starved when its median `1+1` round trip during an attack is over both
/// this multiple of its quiet baseline and [`STARVED_FLOOR`].
///
/// A `1+1` takes milliseconds here on a quiet machine, and some tens of milliseconds on a
/// 2-core machine that compiles meanwhile (ratios up to 3.6 came from such load alone, with
/// no attack at fault); a bystander really starved (a kernel that takes the CPUs or the
/// gateway's attention, memory thrashing, a flood stalling the router) waits seconds. Both
/// bounds must be passed: the ratio alone fails a busy machine whose quiet baseline was
/// fast, the floor alone a slow machine whose every round trip is slow.
const STARVED_RATIO: f64 = 10.0;
/// See [`STARVED_RATIO`]: no busy 2-core machine takes a second for a median `1+1`.
const STARVED_FLOOR: Duration = Duration::from_secs(1);

/// Whether a median round trip of `during` against a quiet `baseline` is starvation.
fn starved(baseline: Duration, during: Duration) -> bool {
    during > STARVED_FLOOR && during.as_secs_f64() > STARVED_RATIO * baseline.as_secs_f64()
}

/// Policies of these tests' attackers (`default` is the built-in defaults: 1 GiB, pids 256,
/// 1 CPU, 300 s, 10 MiB of output, 1 GiB workspace). The bystander has its own `bystander`
/// policy, the defaults in the default backend, whatever the attackers' backend.
const POLICIES: &[(&str, &str)] = &[
    ("default", ""),
    ("oom", "[limits]\nmemory = \"512MiB\"\n"),
    (
        "timeout",
        "[limits]\nexecution_timeout = \"2s\"\ninterrupt_grace = \"2s\"\n",
    ),
    ("flood", "[limits]\noutput_per_execution = \"64KiB\"\n"),
    ("disk", "[limits]\nworkspace = \"64MiB\"\n"),
];

fn require_sandbox() {
    if sandbox_backend() == "process" {
        panic!("the attack suite needs a real sandbox; it cannot run with CELLGATE_TEST_SANDBOX=process");
    }
}

/// One gateway with a bystander session (its own kernel) whose `1+1` latency is watched.
struct Arena {
    _policies: tempfile::TempDir,
    gateway: Gateway,
    bystander_id: String,
    bystander: Client,
}

async fn arena() -> Result<Arena> {
    arena_with(&[]).await
}

async fn arena_with(args: &[&str]) -> Result<Arena> {
    arena_built(args, None).await
}

/// An arena whose gateway takes `args`, and `token` instead of the suite's shared one.
async fn arena_built(args: &[&str], token: Option<&str>) -> Result<Arena> {
    require_sandbox();
    let policies = tempfile::tempdir()?;
    let backend = attacker_backend();
    for (name, text) in POLICIES {
        let text = format!("[sandbox]\nbackend = \"{backend}\"\n{text}");
        std::fs::write(policies.path().join(format!("{name}.toml")), text)?;
    }
    std::fs::write(policies.path().join("bystander.toml"), "")?;
    // The attackers' namespaces kernels are forked from the kernel zygote, as the product's
    // default is (issue 28: forked kernels must stand the same attacks as cold ones).
    let mut builder = Gateway::builder()
        .policies_dir(policies.path().to_owned())
        .args(&["--kernel-zygote", "true"])
        .args(args);
    if let Some(token) = token {
        builder = builder.token(Some(token));
    }
    if backend == "microvm" {
        // CI's machines have no usable KVM: the attackers' VMs run under emulation.
        builder = builder.arg("--microvm-allow-emulation");
    }
    let gateway = builder.start().await?;
    let response = gateway
        .request(reqwest::Method::POST, "/api/kernels")
        .json(&json!({"name": "python3", "env": {"KERNEL_POLICY": "bystander"}}))
        .send()
        .await?;
    ensure!(
        response.status().as_u16() == 201,
        "start the bystander: {}",
        response.text().await?
    );
    let bystander_id = response.json::<Value>().await?["id"]
        .as_str()
        .context("id")?
        .to_owned();
    let mut bystander = gateway.connect(&bystander_id, "bystander", true).await?;
    for _ in 0..3 {
        one_plus_one(&mut bystander).await?;
    }
    Ok(Arena {
        _policies: policies,
        gateway,
        bystander_id,
        bystander,
    })
}

impl Arena {
    /// Starts a kernel under `policy` and connects to it.
    async fn attacker(&self, policy: &str) -> Result<(String, Client)> {
        self.attacker_with(json!({"KERNEL_POLICY": policy})).await
    }

    /// Starts a kernel with the given client environment and connects to it.
    async fn attacker_with(&self, env: Value) -> Result<(String, Client)> {
        let policy = env["KERNEL_POLICY"]
            .as_str()
            .unwrap_or("default")
            .to_owned();
        let response = self
            .gateway
            .request(reqwest::Method::POST, "/api/kernels")
            .json(&json!({"name": "python3", "env": env}))
            .send()
            .await?;
        ensure!(
            response.status().as_u16() == 201,
            "start an attacker under {policy}: {}",
            response.text().await?
        );
        let id = response.json::<Value>().await?["id"]
            .as_str()
            .context("id")?
            .to_owned();
        let mut client = self.gateway.connect(&id, "attacker", false).await?;
        let msgs = client.run("1").await?;
        ensure!(reply(&msgs).content["status"] == "ok", "{msgs:?}");
        Ok((id, client))
    }

    /// The gateway is alive and serves its API.
    async fn assert_gateway_serves(&self) -> Result<()> {
        ensure!(
            alive(self.gateway.pid()),
            "the gateway died:\n{}",
            self.gateway.log()
        );
        let (status, _) = self.gateway.get_json("/api/kernels").await?;
        ensure!(status == 200, "GET /api/kernels: {status}");
        Ok(())
    }

    async fn model(&self, kernel: &str) -> Result<Value> {
        let (status, model) = self
            .gateway
            .get_json(&format!("/api/kernels/{kernel}"))
            .await?;
        ensure!(status == 200, "GET kernel {kernel}: {status} {model}");
        Ok(model)
    }
}

async fn one_plus_one(client: &mut Client) -> Result<Duration> {
    let started = Instant::now();
    let msgs = tokio::time::timeout(Duration::from_secs(30), client.run("1+1"))
        .await
        .map_err(|_| anyhow!("1+1 took more than 30 s"))??;
    let elapsed = started.elapsed();
    let results = of_type(&msgs, "execute_result");
    ensure!(
        results.len() == 1 && results[0].content["data"]["text/plain"] == "2",
        "1+1 did not answer 2: {msgs:?}"
    );
    Ok(elapsed)
}

fn median(samples: &mut [Duration]) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// Shared between an attack and the bystander's sampler.
#[derive(Clone, Default)]
struct Probe {
    during: Arc<AtomicUsize>,
    done: Arc<AtomicBool>,
}

impl Probe {
    /// Whether a repeatable attack has run long enough for the measurement.
    fn enough(&self) -> bool {
        self.during.load(Ordering::SeqCst) >= SAMPLES
    }
}

/// Runs `attack` while the bystander answers `1+1` in a loop; prints the ratio of medians and
/// fails if the bystander stopped answering or was [`starved`]. Returns the attack's result.
async fn under_attack<T>(
    name: &str,
    bystander: &mut Client,
    probe: &Probe,
    attack: impl Future<Output = Result<T>>,
) -> Result<T> {
    // The baseline: both kernels started and idle, right before the attack.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut before = vec![];
    for _ in 0..SAMPLES {
        before.push(
            one_plus_one(bystander)
                .await
                .with_context(|| format!("{name}: baseline"))?,
        );
    }
    let baseline = median(&mut before);
    let attack = async {
        let result = attack.await;
        probe.done.store(true, Ordering::SeqCst);
        result
    };
    let sampler = async {
        let (mut during, mut after) = (vec![], vec![]);
        let result = async {
            while !probe.done.load(Ordering::SeqCst) || during.len() + after.len() < SAMPLES {
                let sample = one_plus_one(bystander).await?;
                if probe.done.load(Ordering::SeqCst) {
                    after.push(sample);
                } else {
                    during.push(sample);
                    probe.during.fetch_add(1, Ordering::SeqCst);
                }
            }
            Ok::<(), anyhow::Error>(())
        }
        .await;
        if result.is_err() {
            // Let a repeating attack stop.
            probe.during.store(usize::MAX / 2, Ordering::SeqCst);
        }
        result.map(|()| (during, after))
    };
    let (attack_result, sampled) = tokio::join!(attack, sampler);
    let (mut during, after) =
        sampled.with_context(|| format!("{name}: the second session stopped answering 1+1"))?;
    let (label, window) = if during.len() >= SAMPLES {
        ("during", median(&mut during))
    } else {
        let mut all: Vec<Duration> = during.iter().chain(after.iter()).copied().collect();
        ("during+right after", median(&mut all))
    };
    let ratio = window.as_secs_f64() / baseline.as_secs_f64();
    let slowest = during.iter().chain(after.iter()).max().copied();
    println!(
        "ATTACK {name}: bystander 1+1 median {baseline:?} before, {window:?} {label} ({} samples during, {} after, slowest {slowest:?}), ratio {ratio:.2}",
        during.len(),
        after.len()
    );
    let result = attack_result.with_context(|| format!("attack {name}"))?;
    ensure!(
        !starved(baseline, window),
        "{name}: the bystander was starved: its median 1+1 round trip went from {baseline:?} to {window:?} ({label}), over {STARVED_FLOOR:?} and ratio {ratio:.2} > {STARVED_RATIO}"
    );
    Ok(result)
}

/// The JSON object printed on the last stdout line of a cell that must succeed.
fn json_out(msgs: &[Msg]) -> Result<Value> {
    let errors = of_type(msgs, "error");
    ensure!(
        errors.is_empty(),
        "the probe cell itself failed: {:?}",
        errors.iter().map(|e| &e.content).collect::<Vec<_>>()
    );
    let out = stdout(msgs);
    let line = out
        .lines()
        .last()
        .with_context(|| format!("no output: {msgs:?}"))?;
    serde_json::from_str(line).with_context(|| format!("not JSON: {out}"))
}

/// The cell raised one of `enames`, reported both as an `error` message and in the reply.
fn expect_error(msgs: &[Msg], enames: &[&str]) -> Result<String> {
    let errors = of_type(msgs, "error");
    ensure!(
        errors.len() == 1,
        "expected one error ({enames:?}), got stdout {:?} and {:?}",
        stdout(msgs),
        errors.iter().map(|e| &e.content).collect::<Vec<_>>()
    );
    let ename = errors[0].content["ename"].as_str().unwrap_or_default();
    ensure!(
        enames.contains(&ename),
        "expected one of {enames:?}, got {ename}: {}",
        errors[0].content["evalue"]
    );
    ensure!(
        reply(msgs).content["status"] == "error",
        "{:?}",
        reply(msgs).content
    );
    Ok(ename.to_owned())
}

/// Python helper: `attempt(f)` is `"ok:<repr>"` or the exception's class name and errno.
const PRELUDE: &str = r#"
import json, os, sys, socket, errno as _errno
def attempt(f):
    try:
        r = f()
        return 'ok:' + repr(r)[:80]
    except OSError as e:
        return type(e).__name__ + ':' + str(_errno.errorcode.get(e.errno, e.errno))
    except Exception as e:
        return type(e).__name__
"#;

/// Every value of a JSON object of `attempt` results is an error (not `ok:`).
fn all_refused(results: &Value) -> Result<()> {
    let map = results.as_object().context("an object")?;
    ensure!(!map.is_empty());
    let succeeded: Vec<_> = map
        .iter()
        .filter(|(_, v)| v.as_str().is_none_or(|s| s.starts_with("ok")))
        .collect();
    ensure!(
        succeeded.is_empty(),
        "these succeeded: {succeeded:?} (all: {results})"
    );
    Ok(())
}

/// The gateway's runtime root (`$TMPDIR/cellgate-*`) holding `kernel`'s directory.
/// A kernel's first generation's directory under its root: each generation has its own,
/// `run/g1-<random>/`.
fn first_generation_dir(kernel_root: &Path) -> Result<PathBuf> {
    std::fs::read_dir(kernel_root.join("run"))?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("g1-"))
        })
        .ok_or_else(|| anyhow!("no first generation directory under {kernel_root:?}"))
}

fn runtime_root_of(kernel: &str) -> Result<PathBuf> {
    for entry in std::fs::read_dir(std::env::temp_dir())? {
        let path = entry?.path();
        let is_ours = path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("cellgate-"));
        if is_ours && path.join(kernel).is_dir() {
            return Ok(path);
        }
    }
    bail!(
        "no cellgate-* runtime root under {:?} holds {kernel}",
        std::env::temp_dir()
    )
}

/// The CPU time used so far by the cgroup of `kernel`'s sandbox, and that cgroup's CPU limit
/// in CPUs, read on the host through the kernel's host processes (the kernel itself, or
/// gVisor's Sentry): cgroup v1 `cpuacct.usage` and `cpu.cfs_quota_us`/`cpu.cfs_period_us`,
/// v2 `cpu.stat` and `cpu.max`. An error when no process of the kernel is in a cgroup with a
/// CPU limit.
fn sandbox_cpu(kernel: &str) -> Result<(Duration, f64)> {
    let read = |path: PathBuf| std::fs::read_to_string(path).ok();
    let mut seen = vec![];
    for pid in pids_with(kernel) {
        let Some(table) = read(PathBuf::from(format!("/proc/{pid}/cgroup"))) else {
            continue;
        };
        // `id:controllers:path`; v1 hierarchies are mounted at their controllers' names.
        let dir_of = |controller: &str| {
            table.lines().find_map(|line| {
                let mut parts = line.splitn(3, ':');
                let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
                let wanted = if controller.is_empty() {
                    controllers.is_empty()
                } else {
                    controllers.split(',').any(|c| c == controller)
                };
                wanted.then(|| {
                    Path::new("/sys/fs/cgroup")
                        .join(controllers)
                        .join(path.trim_start_matches('/'))
                })
            })
        };
        let v1 = (|| {
            let cpu = dir_of("cpu")?;
            let quota: i64 = read(cpu.join("cpu.cfs_quota_us"))?.trim().parse().ok()?;
            let period: f64 = read(cpu.join("cpu.cfs_period_us"))?.trim().parse().ok()?;
            let usage: u64 = read(dir_of("cpuacct")?.join("cpuacct.usage"))?
                .trim()
                .parse()
                .ok()?;
            Some((Duration::from_nanos(usage), quota, period))
        })();
        let v2 = || {
            let dir = dir_of("")?;
            let max = read(dir.join("cpu.max"))?;
            let mut fields = max.split_whitespace();
            let quota: i64 = fields.next()?.parse().unwrap_or(-1);
            let period: f64 = fields.next()?.parse().ok()?;
            let usage: u64 = read(dir.join("cpu.stat"))?
                .lines()
                .find_map(|l| l.strip_prefix("usage_usec "))?
                .trim()
                .parse()
                .ok()?;
            Some((Duration::from_micros(usage), quota, period))
        };
        match v1.or_else(v2) {
            Some((usage, quota, period)) if quota > 0 => {
                return Ok((usage, quota as f64 / period));
            }
            other => seen.push((pid, table.clone(), other.map(|(u, q, _)| (u, q)))),
        }
    }
    bail!("no process of kernel {kernel} is in a cgroup with a CPU limit: {seen:?}")
}

fn py_str(path: &Path) -> String {
    serde_json::to_string(&path.display().to_string()).unwrap()
}

/// How long a quick attack repeats inside one cell.
const SUSTAIN_SECONDS: f64 = 1.0;

/// Wraps a quick attack so that it repeats inside the kernel for [`SUSTAIN_SECONDS`]: the
/// client sees the last round's stdout and exception; a cell whose rounds end differently
/// fails with an AssertionError (attacks here are deterministic).
fn sustained(cell: &str) -> String {
    let source = serde_json::to_string(cell).unwrap();
    format!(
        r#"
import contextlib as _cl, io as _io, time as _time, sys as _sys
_code = compile({source}, '<attack>', 'exec')
_outs, _errs, _rounds = set(), set(), 0
_end = _time.time() + {SUSTAIN_SECONDS}
while True:
    _rounds += 1
    _buf, _exc = _io.StringIO(), None
    try:
        with _cl.redirect_stdout(_buf):
            exec(_code, globals())
    except Exception as _e:
        _exc = _e
    _outs.add(_buf.getvalue())
    _errs.add(type(_exc).__name__)
    if _time.time() >= _end:
        break
print(f'sustained {{_rounds}} rounds', file=_sys.stderr)
if len(_outs) != 1 or len(_errs) != 1:
    raise AssertionError(f'rounds differ: {{_outs}} {{_errs}}')
_sys.stdout.write(_outs.pop())
if _exc is not None:
    raise _exc
"#
    )
}

/// Runs `cell` [`sustained`] on `client`, checking each outcome, until the probe has enough
/// samples. Returns the number of cells run.
async fn repeat_until_measured(
    client: &mut Client,
    probe: &Probe,
    cell: &str,
    check: impl Fn(&[Msg]) -> Result<()>,
) -> Result<usize> {
    let cell = sustained(cell);
    let mut rounds = 0;
    loop {
        let msgs = client.run(&cell).await?;
        check(&msgs).with_context(|| format!("round {rounds}"))?;
        rounds += 1;
        if probe.enough() {
            return Ok(rounds);
        }
    }
}

#[tokio::test]
async fn read_etc_shadow() -> Result<()> {
    let mut arena = arena().await?;
    let (_id, mut attacker) = arena.attacker("default").await?;
    let probe = Probe::default();
    let rounds = under_attack(
        "read /etc/shadow",
        &mut arena.bystander,
        &probe,
        repeat_until_measured(
            &mut attacker,
            &probe,
            "print(open('/etc/shadow').read())",
            |msgs| {
                expect_error(msgs, &["FileNotFoundError", "PermissionError"])?;
                ensure!(stdout(msgs).is_empty(), "{:?}", stdout(msgs));
                Ok(())
            },
        ),
    )
    .await?;
    println!("read /etc/shadow refused {rounds} times");
    arena.assert_gateway_serves().await
}

/// The token is on the gateway's command line (`--token`). The kernel looks for it in every
/// `/proc/*/cmdline` and `/proc/*/environ` it can see and in every regular file under the
/// roots of its filesystem (except /proc, /sys, /dev). The cell holds the token only
/// hex-encoded, so its own history cannot match.
///
/// The search is complete on every backend, however slow the machine: it has no time budget.
/// What makes that affordable under emulation (~50x slower, where reading every file of the
/// read-only environment took minutes) is a proof instead of a read for most of that
/// environment: this gateway's token is drawn at random right before the gateway starts, so a
/// file whose status last changed before then (its ctime, which no process can set back
/// without setting the clock) cannot hold it. The search reads in full every file in the
/// places a secret could reach (the environment and command line of every visible process,
/// /run, /tmp, /root, /home, /etc, /var, the workspace, every other root) and, in the
/// read-only environment (/usr, /opt/cellgate: the kernel's Python and its venv), every file
/// changed since the token was made (the gateway's rewritten venv files, a relocated view);
/// the rest of the read-only environment is walked and stat'ed, never skipped unseen. It also
/// checks that the sandbox's clock is not behind the host's, which the proof needs.
#[tokio::test]
async fn the_gateway_token_is_nowhere_the_kernel_can_read() -> Result<()> {
    // Files changed within this margin before the token was made are read as well: it covers
    // a guest clock set from the host's a little behind (a microVM's at restore) and
    // timestamp granularity.
    const MARGIN_S: f64 = 120.0;
    let token_born = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs_f64();
    let token = format!("token-search-{}", uuid::Uuid::new_v4().simple());
    let mut arena = arena_built(&[], Some(&token)).await?;
    // A canary in the kernel's environment proves the search finds what is there: in the
    // environ of a child the kernel starts (a kernel restored from a microVM snapshot is
    // its zygote, whose own /proc/self/environ is the one it was started with, before it
    // took the session's; its children get the session's).
    let canary = format!("canary-{}", uuid::Uuid::new_v4().simple());
    let (_id, mut attacker) = arena
        .attacker_with(json!({"KERNEL_POLICY": "default", "KERNEL_CANARY": canary}))
        .await?;
    let cell = format!(
        "{PRELUDE}{}",
        r#"
import subprocess, time, stat
child = subprocess.Popen(['sleep', '600'])
needle = bytes.fromhex('NEEDLE')
canary = bytes.fromhex('CANARY')
born = TOKEN_BORN - MARGIN
started = time.time()
r = {'child': child.pid, 'hits': [], 'canary': [], 'scanned': 0, 'unreadable': 0, 'procs': [],
     'roots': [], 'visible_roots': sorted(os.listdir('/')),
     'links': sorted(d for d in os.listdir('/') if os.path.islink('/' + d)),
     'clock_ahead_s': started - TOKEN_BORN, 'older': 0, 'newer_read': 0}
overlap = max(len(needle), len(canary)) - 1
def check(path):
    # Whole files, in blocks that overlap by a needle's length.
    try:
        f = open(path, 'rb')
    except OSError:
        r['unreadable'] += 1
        return
    found, seen, tail = False, False, b''
    with f:
        while True:
            try:
                block = f.read(1 << 22)
            except OSError:
                r['unreadable'] += 1
                return
            if not block:
                break
            data = tail + block
            found = found or needle in data
            seen = seen or canary in data
            tail = data[-overlap:]
    r['scanned'] += 1
    if found:
        r['hits'].append(path)
    if seen:
        r['canary'].append(path)
for pid in os.listdir('/proc'):
    if pid.isdigit():
        r['procs'].append(int(pid))
        for name in ('cmdline', 'environ'):
            check(f'/proc/{pid}/{name}')
check('/proc/self/cmdline')
check('/proc/self/environ')
r['env_hit'] = any(needle.decode() in k + '=' + v for k, v in os.environ.items())
READ_ONLY = ('/usr', '/opt/cellgate')
def walk(top, read_only):
    stack = [top]
    while stack:
        d = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            r['unreadable'] += 1
            continue
        for e in entries:
            if not read_only and e.path in READ_ONLY:
                continue  # walked last, as the read-only environment
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                r['unreadable'] += 1
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append(e.path)
            elif stat.S_ISREG(st.st_mode):
                if not read_only:
                    check(e.path)
                elif st.st_ctime >= born:
                    r['newer_read'] += 1
                    check(e.path)
                else:
                    r['older'] += 1
# The places a secret could reach first, then every other root, then the read-only
# environment. /bin, /lib … are links into /usr (os.scandir never follows them).
first = ['run', 'tmp', 'root', 'home', 'etc', 'var']
roots = sorted(os.listdir('/'), key=lambda n: (n not in first, first.index(n) if n in first else 0, n))
for root in roots:
    if root in ('proc', 'sys', 'dev') or os.path.islink('/' + root) or not os.path.isdir('/' + root):
        continue
    r['roots'].append(root)
    if '/' + root not in READ_ONLY:
        walk('/' + root, False)
# Writable memory file systems under /dev, which is otherwise left out.
for extra in ('/dev/shm', '/dev/mqueue'):
    if os.path.isdir(extra) and not os.path.islink(extra):
        r['roots'].append(extra)
        walk(extra, False)
r['read_only'] = []
for top in READ_ONLY:
    if os.path.isdir(top):
        r['read_only'].append(top)
        walk(top, True)
r['link_targets'] = {l: os.path.realpath('/' + l) for l in r['links']}
r['seconds'] = round(time.time() - started, 1)
child.kill()
child.wait()
print(json.dumps(r))
"#
        .replace("NEEDLE", &hex::encode(&token))
        .replace("CANARY", &hex::encode(&canary))
        .replace("TOKEN_BORN", &format!("{token_born:.3}"))
        .replace("MARGIN", &format!("{MARGIN_S:.1}"))
    );
    // The ctime proof needs the sandbox's clock not behind the host's by more than the
    // margin: a file changed after the token was made must not look older than it.
    let now_s = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0)
    };
    let host_before = now_s();
    let msgs = attacker
        .run("import time; print(repr(time.time()))")
        .await?;
    let host_after = now_s();
    let sandbox_time: f64 = stdout(&msgs).trim().parse().context("the sandbox's time")?;
    println!(
        "sandbox clock: {sandbox_time:.3}, host {host_before:.3}..{host_after:.3} ({:+.3} s)",
        sandbox_time - host_after
    );
    assert!(
        sandbox_time - host_after > -MARGIN_S,
        "the sandbox's clock is {:.1} s behind the host's: files it changed could look older than the token, so the search would skip them",
        host_after - sandbox_time
    );
    let probe = Probe::default();
    let result = under_attack(
        "search for the token",
        &mut arena.bystander,
        &probe,
        async {
            let msg_id = attacker.execute(&cell).await?;
            // No budget inside: this bound is only there so a hung kernel fails the test
            // instead of the run; a complete search takes seconds natively and about a
            // minute in an emulated VM on a busy 2-core machine.
            let msgs = attacker.collect(&msg_id, Duration::from_secs(1200)).await?;
            json_out(&msgs)
        },
    )
    .await?;
    println!(
        "token search: {} files and /proc entries read in {} s ({} unreadable; in the read-only environment {} changed since the token was made and read, {} older and stat'ed), roots searched: {} of {}, sandbox clock {:.1} s past the token's birth, pids seen: {}",
        result["scanned"],
        result["seconds"],
        result["unreadable"],
        result["newer_read"],
        result["older"],
        result["roots"],
        result["visible_roots"],
        result["clock_ahead_s"].as_f64().unwrap_or(f64::NAN),
        result["procs"]
    );
    let visible = result["visible_roots"].as_array().context("roots")?;
    let searched = result["roots"].as_array().context("roots")?;
    let links = result["links"].as_array().context("links")?;
    for root in visible {
        let name = root.as_str().unwrap_or_default();
        // Links into /usr (/bin, /lib …) are covered with /usr.
        if !["proc", "sys", "dev"].contains(&name) && !links.contains(root) {
            assert!(
                searched.contains(root),
                "/{name} was not searched: {result}"
            );
        }
    }
    let read_only = result["read_only"].as_array().context("read_only")?;
    assert!(
        read_only.contains(&json!("/usr")),
        "the read-only environment was not searched: {result}"
    );
    // A top-level link counts as covered only when it leads into what was searched.
    let covered: Vec<String> = searched
        .iter()
        .chain(read_only.iter())
        .filter_map(|r| r.as_str())
        .map(|r| {
            if r.starts_with('/') {
                r.to_owned()
            } else {
                format!("/{r}")
            }
        })
        .collect();
    for (link, target) in result["link_targets"].as_object().context("link targets")? {
        let target = target.as_str().unwrap_or_default();
        assert!(
            covered
                .iter()
                .any(|c| target == c || target.starts_with(&format!("{c}/"))),
            "/{link} leads to {target}, which was not searched: {result}"
        );
    }
    let canary_hits = result["canary"].as_array().context("canary")?;
    let child_environ = format!("/proc/{}/environ", result["child"]);
    assert!(
        canary_hits.contains(&json!(child_environ)),
        "the search did not find the canary in the environment of the kernel's child: {result}"
    );
    assert_eq!(result["hits"], json!([]), "the token is readable: {result}");
    assert_eq!(result["env_hit"], false);

    let seen = result["scanned"].as_u64().unwrap_or(0) + result["older"].as_u64().unwrap_or(0);
    assert!(
        seen > 500 && result["scanned"].as_u64().unwrap_or(0) > 20,
        "the search saw too little to mean anything: {result}"
    );
    assert!(!result["procs"].as_array().unwrap().is_empty());
    arena.assert_gateway_serves().await
}

/// Kernel A tries to read kernel B's (the bystander's) connection file, workspace and
/// kernel directory at their host paths, found from the test side under the runtime root.
#[tokio::test]
async fn another_sessions_connection_file_and_workspace() -> Result<()> {
    let mut arena = arena().await?;
    let msgs = arena
        .bystander
        .run("open('secret.txt', 'w').write('bystander-secret'); import os; print(os.getcwd())")
        .await?;
    let b_cwd = stdout(&msgs).trim().to_owned();
    let (a_id, mut attacker) = arena.attacker("default").await?;
    let root = runtime_root_of(&arena.bystander_id)?;
    let b_root = root.join(&arena.bystander_id);
    let b_gen = first_generation_dir(&b_root)?;
    let b_conn = b_gen.join("connection.json");
    let b_sock = b_gen.join("k-1");
    let b_work = b_root.join("work");
    assert!(b_conn.is_file(), "B's connection file exists on the host");
    // Every namespaces sandbox shows its workspace at the same fixed path.
    assert_eq!(b_cwd, "/home/user", "B's workspace path");
    let cell = format!(
        "{PRELUDE}
root, b_root, b_conn, b_work, b_sock = {}, {}, {}, {}, {}
r = {{
    'b_conn': attempt(lambda: open(b_conn, 'rb').read()),
    'b_secret': attempt(lambda: open(b_work + '/secret.txt').read()),
    'b_work_list': attempt(lambda: os.listdir(b_work)),
    'b_root_list': attempt(lambda: os.listdir(b_root)),
    'b_log': attempt(lambda: open(b_root + '/kernel.log', 'rb').read()),
    'b_run_list': attempt(lambda: os.listdir(b_root + '/run')),
    'b_shell_socket': attempt(lambda: socket.socket(socket.AF_UNIX).connect(b_sock)),
    'own_log': attempt(lambda: open(os.path.join(root, {:?}, 'kernel.log'), 'rb').read()),
}}
root_list = attempt(lambda: os.listdir(root))
print(json.dumps({{'r': r, 'root_list': root_list}}))
",
        py_str(&root),
        py_str(&b_root),
        py_str(&b_conn),
        py_str(&b_work),
        py_str(&b_sock),
        a_id,
    );
    let b_id = arena.bystander_id.clone();
    let probe = Probe::default();
    let rounds = under_attack(
        "read another session's files",
        &mut arena.bystander,
        &probe,
        repeat_until_measured(&mut attacker, &probe, &cell, |msgs| {
            let out = json_out(msgs)?;
            all_refused(&out["r"])?;
            let listing = out["root_list"].as_str().unwrap_or_default();
            ensure!(
                !listing.contains(&b_id),
                "the runtime root listing shows B: {listing}"
            );
            ensure!(!stdout(msgs).contains("bystander-secret"));
            Ok(())
        }),
    )
    .await?;
    let last = json_out(&attacker.run(&cell).await?)?;
    println!("another session's files, refused {rounds} times: {last}");
    arena.assert_gateway_serves().await
}

/// Host processes are invisible: the kernel sees a handful of pids, none the gateway's,
/// none running `cellgate serve`; signalling or ptracing the gateway's pid finds nothing.
#[tokio::test]
async fn host_processes_are_invisible_and_the_gateway_cannot_be_killed() -> Result<()> {
    let mut arena = arena().await?;
    let (_id, mut attacker) = arena.attacker("default").await?;
    let gateway_pid = arena.gateway.pid();
    let test_pid = std::process::id();
    let cell = format!(
        "{PRELUDE}
import ctypes, signal
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
procs = {{}}
for p in os.listdir('/proc'):
    if p.isdigit():
        seen = attempt(lambda: open(f'/proc/{{p}}/cmdline', 'rb').read().replace(b'\\0', b' ').decode())
        # Kernel threads (no command line; a VM's come and go) and a process that ended
        # between the listing and the read are no finding, and would make rounds differ.
        if seen != \"ok:''\" and not seen.startswith(('FileNotFoundError', 'ProcessLookupError')):
            procs[p] = seen
ctypes.set_errno(0)
rc = libc.syscall(ctypes.c_long(101), ctypes.c_long(16), ctypes.c_long({gateway_pid}), ctypes.c_long(0), ctypes.c_long(0))
r = {{
    'procs': procs,
    'ptrace_attach': [rc, _errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno())],
    'gateway_proc': attempt(lambda: os.listdir('/proc/{gateway_pid}')),
    'test_proc': attempt(lambda: os.listdir('/proc/{test_pid}')),
    'kill0': attempt(lambda: os.kill({gateway_pid}, 0)),
}}
print(json.dumps(r))
os.kill({gateway_pid}, signal.SIGKILL)
"
    );
    let probe = Probe::default();
    let last = under_attack(
        "signal the gateway's pid",
        &mut arena.bystander,
        &probe,
        async {
            let cell = sustained(&cell);
            loop {
                let msgs = attacker.run(&cell).await?;
                expect_error(&msgs, &["ProcessLookupError"])?;
                let out = json_out_lenient(&msgs)?;
                let procs = out["procs"].as_object().context("procs")?;
                if attacker_backend() == "microvm" {
                    // The kernel sees its own VM: the agent (/init) and itself (the guest
                    // kernel's threads, with no command line, are left out above);
                    // nothing of the host.
                    let foreign: Vec<_> = procs
                        .values()
                        .filter_map(|c| c.as_str())
                        .filter(|c| {
                            !(*c == "ok:''"
                                || c.starts_with("ok:'/init")
                                || c.starts_with("ok:'/opt/cellgate/venv/bin/python"))
                        })
                        .collect();
                    ensure!(
                        foreign.is_empty(),
                        "processes not the guest's own: {foreign:?}"
                    );
                } else {
                    ensure!(
                        procs.len() < 20,
                        "the kernel sees {} processes: {procs:?}",
                        procs.len()
                    );
                }
                ensure!(
                    !procs.contains_key(&gateway_pid.to_string()),
                    "the gateway's pid is visible: {procs:?}"
                );
                ensure!(
                    !procs
                        .values()
                        .any(|c| c.as_str().unwrap_or_default().contains("serve")),
                    "a `cellgate serve` is visible: {procs:?}"
                );
                ensure!(
                    out["ptrace_attach"] == json!([-1, "ESRCH"])
                        || out["ptrace_attach"] == json!([-1, "EPERM"]),
                    "ptrace attach: {}",
                    out["ptrace_attach"]
                );
                ensure!(out["gateway_proc"] == "FileNotFoundError:ENOENT", "{out}");
                ensure!(out["test_proc"] == "FileNotFoundError:ENOENT", "{out}");
                ensure!(out["kill0"] == "ProcessLookupError:ESRCH", "{out}");
                ensure!(alive(gateway_pid), "the gateway died");
                if probe.enough() {
                    return Ok::<Value, anyhow::Error>(out);
                }
            }
        },
    )
    .await?;
    println!("visible processes and kill attempts: {last}");
    arena.assert_gateway_serves().await
}

/// Like [`json_out`] for a cell that prints its JSON and then raises.
fn json_out_lenient(msgs: &[Msg]) -> Result<Value> {
    let out = stdout(msgs);
    let line = out
        .lines()
        .last()
        .with_context(|| format!("no output: {msgs:?}"))?;
    serde_json::from_str(line).with_context(|| format!("not JSON: {out}"))
}

/// Writes outside the workspace and `/tmp` fail; what the kernel writes in its workspace and
/// `/tmp` never reaches the host's paths of the same name.
#[tokio::test]
async fn writes_outside_the_workspace() -> Result<()> {
    let mut arena = arena().await?;
    let (a_id, mut attacker) = arena.attacker("default").await?;
    let root = runtime_root_of(&a_id)?;
    let marker = format!("cellgate-attack-{}", uuid::Uuid::new_v4().simple());
    let targets = [
        "/".to_owned(),
        "/etc".to_owned(),
        "/usr".to_owned(),
        "/usr/local/bin".to_owned(),
        repo().display().to_string(),
        kernels_dir().join("python3/.venv").display().to_string(),
        kernels_dir()
            .join("python3/.venv/bin")
            .display()
            .to_string(),
    ];
    let cell = format!(
        "{PRELUDE}
import sys
marker = {marker:?}
def write(d):
    with open(os.path.join(d, marker), 'w') as f:
        f.write('x')
r = {{d: attempt(lambda d=d: write(d)) for d in {targets:?} + [sys.prefix, os.path.dirname(sys.executable)]}}
r['proc_sys'] = attempt(lambda: open('/proc/sys/kernel/hostname', 'w').write('x'))
r['sysrq'] = attempt(lambda: open('/proc/sysrq-trigger', 'w').write('h'))
r['mkdir_root'] = attempt(lambda: os.mkdir('/' + marker))

# The sandbox's private /tmp (which holds the scaffolding of the runtime root's path) and the
# workspace are writable: the test checks the host's paths stay untouched.
ok = {{'workspace': attempt(lambda: write(os.getcwd())), 'tmp': attempt(lambda: write('/tmp')),
      'runtime_root': attempt(lambda: write({root})), 'kernel_root': attempt(lambda: write({kroot})),
      'kernel_log': attempt(lambda: open(os.path.join({kroot}, 'kernel.log'), 'a').write(marker))}}
print(json.dumps({{'refused': r, 'allowed': ok, 'cwd': os.getcwd()}}))
",
        root = py_str(&root),
        kroot = py_str(&root.join(&a_id)),
    );
    let probe = Probe::default();
    let rounds = under_attack(
        "write outside the workspace",
        &mut arena.bystander,
        &probe,
        repeat_until_measured(&mut attacker, &probe, &cell, |msgs| {
            let out = json_out(msgs)?;
            // A target under the host's temp dir (a checkout in /tmp, as CI may have) lies in
            // the sandbox's private /tmp, where writing is allowed; that the host path stays
            // untouched is checked below for every target.
            let mut refused = out["refused"].clone();
            if let Some(map) = refused.as_object_mut() {
                let tmp = std::env::temp_dir().display().to_string();
                map.retain(|path, _| !(path == &tmp || path.starts_with(&format!("{tmp}/"))));
            }
            all_refused(&refused)?;
            ensure!(out["allowed"]["workspace"] == "ok:None", "{out}");
            ensure!(out["allowed"]["tmp"] == "ok:None", "{out}");
            // Absent in a namespaces sandbox (its directories are at fixed paths); in gVisor's
            // private /tmp, the scaffolding of their paths.
            for dir in ["runtime_root", "kernel_root"] {
                let seen = &out["allowed"][dir];
                ensure!(
                    *seen == "ok:None" || *seen == "FileNotFoundError:ENOENT",
                    "{dir}: {out}"
                );
            }
            ensure!(out["allowed"]["kernel_log"].as_str().is_some(), "{out}");
            Ok(())
        }),
    )
    .await?;
    let log = std::fs::read(root.join(&a_id).join("kernel.log")).unwrap_or_default();
    assert!(
        !String::from_utf8_lossy(&log).contains(&marker),
        "the kernel wrote into its host log file directly"
    );
    for dir in targets.iter().map(PathBuf::from).chain([
        std::env::temp_dir(),
        root.clone(),
        root.join(&a_id),
        root.join(&a_id).join("work"),
    ]) {
        assert!(
            !dir.join(&marker).exists(),
            "{} appeared on the host",
            dir.join(&marker).display()
        );
    }
    println!("writes outside the workspace refused {rounds} times");
    arena.assert_gateway_serves().await
}

/// The kernel's network namespace has only `lo`: neither the gateway's port nor a listener
/// the test opens on 127.0.0.1 is reachable, nor unix sockets the test binds (in its
/// tempdir, under /tmp, and in the abstract namespace).
#[tokio::test]
async fn network_and_host_sockets_are_unreachable() -> Result<()> {
    use std::os::linux::net::SocketAddrExt;
    let mut arena = arena().await?;
    let (_id, mut attacker) = arena.attacker("default").await?;
    let tcp = std::net::TcpListener::bind("127.0.0.1:0")?;
    tcp.set_nonblocking(true)?;
    let tcp_port = tcp.local_addr()?.port();
    let dir = tempfile::tempdir()?;
    let private_path = dir.path().join("host.sock");
    let private = UnixListener::bind(&private_path)?;
    let tmp_path = std::env::temp_dir().join(format!(
        "cellgate-attack-{}.sock",
        uuid::Uuid::new_v4().simple()
    ));
    let tmp = UnixListener::bind(&tmp_path)?;
    let abstract_name = format!("cellgate-attack-{}", uuid::Uuid::new_v4().simple());
    let abstract_addr = std::os::unix::net::SocketAddr::from_abstract_name(&abstract_name)?;
    let abstract_listener = UnixListener::bind_addr(&abstract_addr)?;
    for listener in [&private, &tmp, &abstract_listener] {
        listener.set_nonblocking(true)?;
    }
    let cell = format!(
        "{PRELUDE}
def tcp(port):
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect(('127.0.0.1', port))
    finally:
        s.close()
def unix(path):
    s = socket.socket(socket.AF_UNIX); s.settimeout(3)
    try:
        s.connect(path)
    finally:
        s.close()
r = {{
    'gateway_port': attempt(lambda: tcp({gw})),
    'test_listener': attempt(lambda: tcp({tcp_port})),
    'unix_tempdir': attempt(lambda: unix({private})),
    'unix_tmp': attempt(lambda: unix({tmp})),
    'unix_abstract': attempt(lambda: unix('\\0' + {abstract_name:?})),
}}
ifs = socket.if_nameindex()
dev = [l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]]
print(json.dumps({{'refused': r, 'ifs': ifs, 'dev': dev}}))
",
        gw = arena.gateway.port,
        private = py_str(&private_path),
        tmp = py_str(&tmp_path),
    );
    let probe = Probe::default();
    let rounds = under_attack(
        "connect to host sockets",
        &mut arena.bystander,
        &probe,
        repeat_until_measured(&mut attacker, &probe, &cell, |msgs| {
            let out = json_out(msgs)?;
            all_refused(&out["refused"])?;
            ensure!(
                out["ifs"] == json!([[1, "lo"]]),
                "interfaces: {}",
                out["ifs"]
            );
            ensure!(out["dev"] == json!(["lo"]), "/proc/net/dev: {}", out["dev"]);
            Ok(())
        }),
    )
    .await?;
    let last = json_out(&attacker.run(&cell).await?)?;
    println!("network, refused {rounds} times: {last}");
    assert_eq!(
        tcp.accept().err().map(|e| e.kind()),
        Some(ErrorKind::WouldBlock),
        "the test's TCP listener accepted a connection"
    );
    for (name, listener) in [
        ("tempdir", &private),
        ("/tmp", &tmp),
        ("abstract", &abstract_listener),
    ] {
        assert_eq!(
            listener.accept().err().map(|e| e.kind()),
            Some(ErrorKind::WouldBlock),
            "the {name} unix listener accepted a connection"
        );
    }
    let _ = std::fs::remove_file(&tmp_path);
    arena.assert_gateway_serves().await
}

/// Privileged or attack-surface syscalls through ctypes fail with EPERM or ENOSYS.
#[tokio::test]
async fn privileged_syscalls_are_refused() -> Result<()> {
    let mut arena = arena().await?;
    let (_id, mut attacker) = arena.attacker("default").await?;
    let cell = format!(
        "{PRELUDE}{}",
        r#"
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sc(nr, *args):
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return [rc, _errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno())]
buf = ctypes.create_string_buffer(256)
nsfd = os.open('/proc/self/ns/net', os.O_RDONLY)
src = ctypes.create_string_buffer(b'none')
dst = ctypes.create_string_buffer(b'/tmp')
fs = ctypes.create_string_buffer(b'tmpfs')
desc = ctypes.create_string_buffer(b'x')
def raw():
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); s.close()
    return [0, 'ok']
def raw_errno():
    try:
        return raw()
    except OSError as e:
        return [-1, _errno.errorcode.get(e.errno, e.errno)]
r = {
    'mount': sc(165, ctypes.addressof(src), ctypes.addressof(dst), ctypes.addressof(fs), 0, 0),
    'unshare_user': sc(272, 0x10000000),
    'unshare_net': sc(272, 0x40000000),
    'unshare_mount': sc(272, 0x00020000),
    'setns': sc(308, nsfd, 0),
    'init_module': sc(175, ctypes.addressof(buf), 256, ctypes.addressof(desc)),
    'finit_module': sc(313, 0, ctypes.addressof(desc), 0),
    'keyctl': sc(250, 0, 0, 0, 0, 0),
    'add_key': sc(248, ctypes.addressof(desc), ctypes.addressof(desc), 0, 0, -2),
    'bpf': sc(321, 0, ctypes.addressof(buf), 48),
    'io_uring_setup': sc(425, 1, ctypes.addressof(buf)),
    'perf_event_open': sc(298, ctypes.addressof(buf), 0, -1, -1, 0),
    'raw_socket': raw_errno(),
}
try:
    socket.socket(17, socket.SOCK_RAW, 0).close(); r['packet_socket'] = [0, 'ok']
except OSError as e:
    r['packet_socket'] = [-1, _errno.errorcode.get(e.errno, e.errno)]
os.close(nsfd)
if r['io_uring_setup'][0] >= 0:
    # gVisor implements io_uring in the Sentry: a real fd, closed so rounds compare equal.
    os.close(r['io_uring_setup'][0])
    r['io_uring_setup'] = [0, 'ok']
print(json.dumps(r))
"#
    );
    let probe = Probe::default();
    let rounds = under_attack(
        "privileged syscalls",
        &mut arena.bystander,
        &probe,
        repeat_until_measured(&mut attacker, &probe, &cell, |msgs| {
            let out = json_out(msgs)?;
            // namespaces: the seccomp filter refuses each with EPERM/ENOSYS. gVisor: the
            // Sentry answers them itself (the host kernel never sees them); it refuses the
            // rest with its own errno and implements unshare(CLONE_NEWNS) and io_uring
            // inside its user-space kernel, which gives no way out. microvm: the guest's own
            // kernel answers (nothing reaches the host's), with its errnos: EAFNOSUPPORT for
            // packet sockets (not built in), EACCES for perf events.
            let gvisor = attacker_backend() == "gvisor";
            let any_refusal = gvisor || attacker_backend() == "microvm";
            let bad: Vec<_> = out
                .as_object()
                .context("object")?
                .iter()
                .filter(|(name, v)| {
                    let refused = if any_refusal {
                        v[0] == -1
                    } else {
                        v[0] == -1 && (v[1] == "EPERM" || v[1] == "ENOSYS")
                    };
                    let sentry_only =
                        gvisor && ["unshare_mount", "io_uring_setup"].contains(&name.as_str());
                    !(refused || sentry_only)
                })
                .collect();
            ensure!(bad.is_empty(), "not refused: {bad:?}\nall: {out}");
            Ok(())
        }),
    )
    .await?;
    let last = json_out(&attacker.run(&cell).await?)?;
    println!("privileged syscalls refused {rounds} times: {last}");
    arena.assert_gateway_serves().await
}

/// The kernel plants, in its own run directory, entries under the names the gateway will use
/// for the next generations, all pointing at things the test owns: generation 2's ipc socket
/// paths as symlinks to a unix socket the test listens on, generation 3's connection file as
/// a symlink to a decoy file, generation 4's as a fifo, plus a directory symlink to a decoy
/// directory and a symlink to /etc/shadow. Then the kernel is restarted three times and
/// deleted. Checked from the test side: the decoys are untouched and the decoy directory
/// survives the deletion (the gateway followed no symlink), the test's unix socket saw no
/// connection, no restart hung on the fifo, /etc/shadow is unchanged, and hard links to
/// files outside the run directory failed.
#[tokio::test]
async fn ipc_directory_tricks() -> Result<()> {
    let mut arena = arena_with(&["--start-timeout", "10"]).await?;
    let (a_id, mut attacker) = arena.attacker("default").await?;
    let root = runtime_root_of(&a_id)?;
    let run = root.join(&a_id).join("run");
    let decoys = tempfile::tempdir()?;
    let decoy_file = decoys.path().join("decoy.txt");
    std::fs::write(&decoy_file, "decoy\n")?;
    let decoy_dir = decoys.path().join("dir");
    std::fs::create_dir(&decoy_dir)?;
    std::fs::write(decoy_dir.join("keep.txt"), "keep\n")?;
    let sock_path = std::env::temp_dir().join(format!(
        "cellgate-attack-{}.sock",
        uuid::Uuid::new_v4().simple()
    ));
    let listener = UnixListener::bind(&sock_path)?;
    listener.set_nonblocking(true)?;
    let host_shadow = std::fs::read("/etc/shadow").ok();
    let cell = format!(
        "{PRELUDE}
# The directory the kernel can write that holds its ipc sockets: at a fixed path in a
# namespaces sandbox, at the host's path in gVisor.
run = '/run/cellgate' if os.path.isdir('/run/cellgate') else {run}
decoy_file, decoy_dir, sock = {decoy_file}, {decoy_dir}, {sock}
r = {{}}
for port in range(1, 6):
    r[f'g2-{{port}}'] = attempt(lambda port=port: os.symlink(sock, f'{{run}}/g2-{{port}}'))
r['conn_g3_symlink'] = attempt(lambda: os.symlink(decoy_file, run + '/connection-g3.json'))
r['conn_g4_fifo'] = attempt(lambda: os.mkfifo(run + '/connection-g4.json'))
r['symlink_shadow'] = attempt(lambda: os.symlink('/etc/shadow', run + '/shadow'))
r['symlink_dir'] = attempt(lambda: os.symlink(decoy_dir, run + '/dir'))
links = {{}}
for src in ['/etc/passwd', sys.executable, os.path.realpath(sys.executable), '/usr/bin/env', decoy_file, '/etc/shadow']:
    links[src] = attempt(lambda src=src: os.link(src, run + '/hl-' + os.path.basename(src)))
seen = {{'decoy': attempt(lambda: open(decoy_file).read()), 'shadow': attempt(lambda: open(run + '/shadow').read())}}
print(json.dumps({{'planted': r, 'hard_links': links, 'seen': seen, 'listing': sorted(os.listdir(run))}}))
",
        run = py_str(&run),
        decoy_file = py_str(&decoy_file),
        decoy_dir = py_str(&decoy_dir),
        sock = py_str(&sock_path),
    );
    let probe = Probe::default();
    let gateway = &arena.gateway;
    let (planted, restarts, killed) = under_attack(
        "ipc directory tricks",
        &mut arena.bystander,
        &probe,
        async {
            let planted = json_out(&attacker.run(&cell).await?)?;
            let mut restarts = vec![];
            for _ in 0..3 {
                let started = Instant::now();
                let response = tokio::time::timeout(
                    Duration::from_secs(60),
                    gateway
                        .request(
                            reqwest::Method::POST,
                            &format!("/api/kernels/{a_id}/restart"),
                        )
                        .send(),
                )
                .await;
                let (status, body) = match response {
                    Ok(response) => {
                        let response = response?;
                        (response.status().as_u16(), response.text().await?)
                    }
                    Err(_) => (0, "no answer within 60 s".to_owned()),
                };
                let (_, model) = gateway.get_json(&format!("/api/kernels/{a_id}")).await?;
                let works = if status == 200 {
                    one_plus_one(&mut attacker).await.is_ok()
                } else {
                    false
                };
                restarts.push(json!({
                    "status": status, "body": body, "after": format!("{:?}", started.elapsed()),
                    "state": model["execution_state"], "reason": model["reason"],
                    "generation": model["cellgate"]["state_generation"], "1+1": works,
                }));
            }
            let killed = gateway.delete_kernel(&a_id).await?;
            Ok((planted, restarts, killed))
        },
    )
    .await?;
    println!(
        "ipc tricks: planted {planted}\nrestarts: {}\ndelete: {killed}",
        serde_json::to_string_pretty(&restarts)?
    );
    all_refused(&planted["hard_links"])?;
    all_refused(&planted["seen"])?;
    // What the kernel could plant is printed above, not asserted: a fix may well forbid it.
    assert_eq!(std::fs::read_to_string(&decoy_file)?, "decoy\n");
    assert_eq!(
        std::fs::read_to_string(decoy_dir.join("keep.txt"))?,
        "keep\n"
    );
    assert_eq!(
        std::fs::read("/etc/shadow").ok(),
        host_shadow,
        "/etc/shadow changed"
    );
    // SAFE behaviour: the gateway never connects to what a kernel-planted symlink names.
    // Fails as of this writing: see the module's notes on weaknesses.
    let connected: Vec<String> = std::iter::from_fn(|| listener.accept().ok())
        .map(|(mut stream, _)| {
            use std::io::Read;
            let _ = stream.set_nonblocking(false);
            let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
            let mut buf = [0u8; 64];
            let n = stream.read(&mut buf).unwrap_or(0);
            format!("{:02x?}", &buf[..n])
        })
        .collect();
    assert!(
        connected.is_empty(),
        "the gateway (outside the sandbox) followed a symlink the kernel planted in its run \
         directory and connected to the test's unix socket {} {} time(s); first bytes it sent: {connected:?}",
        sock_path.display(),
        connected.len()
    );
    let log = arena.gateway.log();
    assert!(!log.contains("decoy\n") && !log.contains("root:"), "{log}");
    let hung: Vec<_> = restarts.iter().filter(|r| r["status"] == 0).collect();
    assert!(hung.is_empty(), "restarts hung: {hung:?}");
    assert_eq!(killed, 204, "the kernel can still be deleted");
    assert!(!run.exists(), "the kernel's directory is removed");
    // gVisor's `runsc delete` (its command line names the kernel's directory) may still be
    // finishing the cleanup just after DELETE answered (a minute: only a leak takes that long).
    assert!(
        eventually(Duration::from_secs(60), || pids_with(&a_id).is_empty()).await,
        "no process of the kernel is left: {:?}",
        pids_with(&a_id)
    );
    let _ = std::fs::remove_file(&sock_path);
    arena.assert_gateway_serves().await
}

/// Every process forks until the pids limit (256 by default) stops it: the kernel's own fork
/// fails with BlockingIOError (EAGAIN) in the cell, and the kernel answers afterwards.
#[tokio::test]
async fn fork_bomb() -> Result<()> {
    let mut arena = arena().await?;
    let (id, mut attacker) = arena.attacker("default").await?;
    let cell = r#"
import os, time
def bomb():
    while True:
        if os.fork() == 0:
            try:
                while True:
                    os.fork()
            except BaseException:
                pass
            finally:
                time.sleep(3)
                os._exit(0)
bomb()
"#;
    let probe = Probe::default();
    // How long the bomb lasts is the machine's doing: its processes refill the freed pids
    // until the cell's own fork meets the limit, and on a loaded machine the cell's process
    // gets a 256th of the cgroup's CPU (seen: ~200 s beside two builds, when the suite's
    // common bound left its reply under a minute). The bound only catches a cell that
    // never ends; nextest's for this test is longer (.config/nextest.toml).
    let msgs = under_attack("fork bomb", &mut arena.bystander, &probe, async {
        let id = attacker.execute(cell).await?;
        attacker.collect(&id, Duration::from_secs(900)).await
    })
    .await?;
    // namespaces: the fork fails in the cell and the kernel lives on; gVisor's Sentry cannot
    // survive the exhausted limit, so the sandbox ends and the kernel is restarted.
    // Under gVisor the memory limit may end the sandbox first (every guest process costs the
    // Sentry memory): then the outcome is `oom`.
    let ename = expect_error(
        &msgs,
        &["BlockingIOError", "ProcessLimitError", "OutOfMemoryError"],
    )?;
    ensure!(
        ename != "OutOfMemoryError" || attacker_backend() == "gvisor",
        "{msgs:?}"
    );
    println!(
        "fork bomb: the cell failed with {ename}: {}",
        of_type(&msgs, "error")[0].content["evalue"]
    );
    // The client learns which limit it was: outcome `pids` on the reply, and a stderr line.
    let reply = reply(&msgs);
    let (outcome, words) = if ename == "OutOfMemoryError" {
        ("oom", "out-of-memory")
    } else {
        ("pids", "process limit")
    };
    ensure!(
        reply.metadata["cellgate"]["outcome"] == outcome,
        "reply metadata names the limit ({outcome}): {}",
        reply.metadata
    );
    let stderr: String = of_type(&msgs, "stream")
        .iter()
        .filter(|m| m.content["name"] == "stderr")
        .filter_map(|m| m.content["text"].as_str())
        .collect();
    let error = of_type(&msgs, "error")[0].content["evalue"].to_string();
    ensure!(
        stderr.contains(words) || error.contains(words),
        "a stderr line or the error names the limit: {stderr:?} / {error}"
    );
    // While the pids are taken, ipykernel cannot start the thread a cell needs ("can't start
    // new thread"). The bomb's processes exit after 3 s, but the kernel's direct children stay
    // zombies, holding pids, until the kernel reaps them, which needs a cell to run. Either the
    // kernel answers again within 20 s, or it is wedged and a restart through the API brings
    // it back; the test prints which.
    let started = Instant::now();
    let mut answered = None;
    while started.elapsed() < Duration::from_secs(20) {
        if one_plus_one(&mut attacker).await.is_ok() {
            answered = Some(started.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    match answered {
        Some(after) => {
            println!("fork bomb: the kernel answered 1+1 again {after:?} after the cell");
            let msgs = attacker
                .run("import os, time, subprocess\nn = 0\ntry:\n    while True:\n        os.waitpid(-1, 0); n += 1\nexcept ChildProcessError:\n    pass\nfor _ in range(100):\n    try:\n        rc = subprocess.run(['true']).returncode; break\n    except OSError:\n        time.sleep(0.1)\nprint(rc)")
                .await?;
            assert_eq!(stdout(&msgs), "0\n", "{msgs:?}");
        }
        None => {
            let model = arena.model(&id).await?;
            println!("fork bomb: the kernel did not answer 1+1 within 20 s (model {model}); restarting it");
            let status = arena
                .gateway
                .request(reqwest::Method::POST, &format!("/api/kernels/{id}/restart"))
                .send()
                .await?
                .status();
            assert_eq!(status.as_u16(), 200);
            one_plus_one(&mut attacker).await?;
        }
    }
    let model = arena.model(&id).await?;
    println!("fork bomb: model afterwards {model}");
    arena.assert_gateway_serves().await
}

/// Runs `code` and reads until its reply and idle, or a `dead` status for the kernel.
async fn run_or_death(client: &mut Client, code: &str) -> Result<(Vec<Msg>, bool)> {
    let id = client.execute(code).await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut msgs, mut idle, mut replied) = (vec![], false, false);
    while !(idle && replied) {
        let msg = client
            .recv(deadline.saturating_duration_since(Instant::now()))
            .await?;
        if msg.msg_type() == "status" && msg.content["execution_state"] == "dead" {
            msgs.push(msg);
            return Ok((msgs, true));
        }
        idle |= msg.is_idle_for(&id);
        replied |= msg.channel == "shell" && msg.parent_id() == id;
        msgs.push(msg);
    }
    Ok((msgs, false))
}

/// Under a 512 MiB policy: a child allocating 2 GiB is killed and the kernel survives; the
/// kernel itself allocating 2 GiB either gets a MemoryError or is killed by the OOM killer
/// with a reason on its model, then a restart brings it back.
#[tokio::test]
async fn memory_bombs() -> Result<()> {
    let mut arena = arena().await?;
    let (id, mut attacker) = arena.attacker("oom").await?;
    let child = "import subprocess, sys\nr = subprocess.run([sys.executable, '-c', 'b = bytearray(2**31)'])\nprint('rc', r.returncode)";
    let probe = Probe::default();
    let msgs = under_attack(
        "memory bomb in a child",
        &mut arena.bystander,
        &probe,
        async { attacker.run(child).await },
    )
    .await?;
    if child_oom_ends_the_sandbox(&attacker_backend()) {
        // gVisor: the OOM killer ends the whole sandbox; the cell is told, the kernel
        // restarts.
        expect_error(&msgs, &["OutOfMemoryError"])?;
        ensure!(
            reply(&msgs).metadata["cellgate"]["outcome"] == "oom",
            "{msgs:?}"
        );
    } else {
        assert_eq!(stdout(&msgs), "rc -9\n", "{msgs:?}");
    }
    one_plus_one(&mut attacker).await?;

    let probe = Probe::default();
    let (msgs, died) = under_attack(
        "memory bomb in the kernel",
        &mut arena.bystander,
        &probe,
        run_or_death(&mut attacker, "b = bytearray(2**31)"),
    )
    .await?;
    if died {
        let model = arena.model(&id).await?;
        println!("memory bomb in the kernel: the kernel died: {model}");
        assert_eq!(model["execution_state"], "dead", "{model}");
        let reason = model["reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains("out-of-memory"),
            "the reason names the OOM killer: {reason}"
        );
        let status = arena
            .gateway
            .request(reqwest::Method::POST, &format!("/api/kernels/{id}/restart"))
            .send()
            .await?
            .status();
        assert_eq!(status.as_u16(), 200);
    } else {
        let ename = expect_error(&msgs, &["MemoryError", "OutOfMemoryError"])?;
        let error = &of_type(&msgs, "error")[0].content;
        let model = arena.model(&id).await?;
        println!("memory bomb in the kernel: the cell failed with {error}; model {model}");
        if ename == "OutOfMemoryError" {
            // The gateway restarted the kernel on its own.
            let evalue = error["evalue"].as_str().unwrap_or_default();
            assert!(evalue.contains("out-of-memory"), "{evalue}");
            assert!(
                !evalue.starts_with("this cell never ran"),
                "the cell that ran out of memory is told it never ran: {evalue}"
            );
            assert_eq!(reply(&msgs).metadata["cellgate"]["outcome"], "oom");
            // One restart per OOM end: the child's too under gVisor.
            let expected = if child_oom_ends_the_sandbox(&attacker_backend()) {
                3
            } else {
                2
            };
            assert_eq!(model["cellgate"]["state_generation"], expected, "{model}");
        }
    }
    one_plus_one(&mut attacker).await?;
    arena.assert_gateway_serves().await
}

/// Under a 64 MiB workspace: writing until the disk is full ends with ENOSPC near the limit,
/// and the host's directory behind the workspace stays empty.
#[tokio::test]
async fn fill_the_workspace() -> Result<()> {
    let mut arena = arena().await?;
    let (id, mut attacker) = arena.attacker("disk").await?;
    let host_work = runtime_root_of(&id)?.join(&id).join("work");
    let cell = r#"
import os
chunk = b'x' * (1 << 20)
written = 0
with open('fill.bin', 'wb', buffering=0) as f:
    try:
        # Bounded, so a broken limit fails this test instead of filling the host's disk
        # (it did once, under gVisor: 45 GB before the limit existed there).
        while written < (256 << 20):
            written += f.write(chunk)
    finally:
        print(written)
"#;
    let probe = Probe::default();
    let msgs = under_attack("fill the workspace", &mut arena.bystander, &probe, async {
        attacker.run(cell).await
    })
    .await?;
    expect_error(&msgs, &["OSError"])?;
    let error = &of_type(&msgs, "error")[0].content;
    assert!(
        error["evalue"]
            .as_str()
            .unwrap_or_default()
            .contains("No space left"),
        "{error}"
    );
    let written: u64 = stdout(&msgs).trim().parse()?;
    println!("fill the workspace: {written} bytes written before ENOSPC");
    assert!(written <= 64 << 20, "{written} bytes in a 64 MiB workspace");
    assert!(written >= 32 << 20, "only {written} bytes");
    let mut host_bytes = 0;
    for entry in std::fs::read_dir(&host_work)? {
        host_bytes += entry?.metadata()?.len();
    }
    assert_eq!(
        host_bytes,
        0,
        "the host's {} got the bytes",
        host_work.display()
    );
    let msgs = attacker
        .run("import os; os.remove('fill.bin'); open('ok.txt', 'w').write('ok')")
        .await?;
    assert_eq!(reply(&msgs).content["status"], "ok", "{msgs:?}");
    arena.assert_gateway_serves().await
}

/// Under a 2 s execution timeout: the kernel and four forked children spin; the cell ends as
/// a CellTimeoutError with outcome `timeout` and the kernel answers afterwards. Meanwhile the
/// sandbox's CPU time stays within its policy's CPU limit (1 CPU).
#[tokio::test]
async fn cpu_spin_past_the_timeout() -> Result<()> {
    let mut arena = arena().await?;
    let (id, mut attacker) = arena.attacker("timeout").await?;
    let cell = r#"
import os, time
for _ in range(4):
    if os.fork() == 0:
        try:
            end = time.time() + 5
            while time.time() < end:
                pass
        finally:
            os._exit(0)
while True:
    pass
"#;
    let probe = Probe::default();
    let started = Instant::now();
    let (msgs, used, wall, limit) = under_attack("CPU spin", &mut arena.bystander, &probe, async {
        let (before, limit) = sandbox_cpu(&id)?;
        let window = Instant::now();
        let msgs = attacker.run(cell).await?;
        let wall = window.elapsed();
        let (after, _) = sandbox_cpu(&id)?;
        Ok((msgs, after.saturating_sub(before), wall, limit))
    })
    .await?;
    println!(
        "CPU spin: cell ended after {:?}; the sandbox used {used:?} of CPU in {wall:?} under a {limit} CPU limit",
        started.elapsed()
    );
    // The policy's limit (the built-in 1 CPU) is the sandbox's cgroup's, and holds five
    // spinning processes, measured in CPU time: a slow or busy machine gives the attacker
    // less, never more. The slack is two CFS periods' quota (the window's edges) and a tenth.
    ensure!(
        (limit - 1.0).abs() < 1e-6,
        "the sandbox's cgroup allows {limit} CPUs, not the policy's 1"
    );
    let allowed = limit * (wall.as_secs_f64() * 1.1 + 0.2);
    ensure!(
        used.as_secs_f64() <= allowed,
        "the attacker used {used:?} of CPU in {wall:?} under a {limit} CPU limit (at most {allowed:.2} s)"
    );
    expect_error(&msgs, &["CellTimeoutError"])?;
    assert_eq!(reply(&msgs).metadata["cellgate"]["outcome"], "timeout");
    one_plus_one(&mut attacker).await?;
    arena.assert_gateway_serves().await
}

/// Under a 64 KiB output limit: 20 MB of prints reach the client as at most 64 KiB, one
/// marker and the outcome `output_truncated`.
#[tokio::test]
async fn output_flood() -> Result<()> {
    let mut arena = arena().await?;
    let (_id, mut attacker) = arena.attacker("flood").await?;
    let probe = Probe::default();
    let msgs = under_attack(
        "output flood",
        &mut arena.bystander,
        &probe,
        async {
            attacker
                .run("import sys\nfor i in range(200000):\n    sys.stdout.write('x' * 99 + '\\n')\nprint('done')")
                .await
        },
    )
    .await?;
    let out = stdout(&msgs);
    println!(
        "output flood: {} bytes reached the client in {} messages",
        out.len(),
        msgs.len()
    );
    assert!(out.len() <= 64 << 10, "{} bytes got through", out.len());
    assert!(!out.contains("done"));
    let markers: Vec<_> = msgs
        .iter()
        .filter(|m| m.msg_type() == "stream" && m.content["name"] == "stderr")
        .collect();
    assert_eq!(markers.len(), 1, "one marker");
    assert_eq!(
        reply(&msgs).metadata["cellgate"]["outcome"],
        "output_truncated"
    );
    one_plus_one(&mut attacker).await?;
    arena.assert_gateway_serves().await
}

/// `kill(-1, SIGKILL)` from the kernel reaches only the sandbox's own processes (here a
/// child it started), never the gateway, the bystander or the test; `kill(1, SIGKILL)` does
/// nothing to the sandbox's init.
#[tokio::test]
async fn kill_everything_from_inside() -> Result<()> {
    let mut arena = arena().await?;
    let (id, mut attacker) = arena.attacker("default").await?;
    let bystander_pids = pids_with(&arena.bystander_id);
    assert_eq!(
        bystander_pids.len(),
        host_processes_per_kernel(&sandbox_backend()),
        "{bystander_pids:?}"
    );
    let cell = r#"
import os, signal, subprocess, time, json
child = subprocess.Popen(['sleep', '60'])
time.sleep(0.2)
os.kill(-1, signal.SIGKILL)
time.sleep(0.5)
rc = child.poll()
if os.getpid() == 1:
    # gVisor without tini: the kernel is the container's init, and kill(1) would be suicide.
    init = 'self'
else:
    try:
        os.kill(1, signal.SIGKILL)
        init = 'sent'
    except OSError as e:
        init = type(e).__name__
time.sleep(0.2)
print(json.dumps({'child_rc': rc, 'init': init, 'init_alive': os.path.exists('/proc/1')}))
"#;
    let probe = Probe::default();
    let (msgs, died) = under_attack(
        "kill(-1, SIGKILL)",
        &mut arena.bystander,
        &probe,
        run_or_death(&mut attacker, cell),
    )
    .await?;
    let model = arena.model(&id).await?;
    println!(
        "kill(-1): died {died}, output {:?}, model {model}",
        stdout(&msgs)
    );
    assert!(!died, "the kernel died: {model}");
    let out = json_out(&msgs)?;
    assert_eq!(
        out["child_rc"], -9,
        "the sandbox's own child was killed: {out}"
    );
    assert_eq!(out["init_alive"], true, "{out}");
    assert!(alive(std::process::id()));
    assert!(
        bystander_pids.iter().all(|p| alive(*p)),
        "the bystander was killed"
    );
    one_plus_one(&mut attacker).await?;
    one_plus_one(&mut arena.bystander).await?;
    arena.assert_gateway_serves().await
}

/// The base interpreter's site-packages (whatever the host installed globally) is an empty
/// directory inside the sandbox; the kernel's own venv still imports its packages.
#[tokio::test]
async fn host_python_packages_are_hidden() -> Result<()> {
    let arena = arena().await?;
    let (_id, mut attacker) = arena.attacker("default").await?;
    let cell = r#"
import glob, json, os, sys, numpy
base = [d for pattern in ('/lib/python3*/site-packages', '/lib/python3*/dist-packages', '/local/lib/python3*/dist-packages')
        for d in glob.glob(sys.base_prefix + pattern)]
print(json.dumps({'base': {d: os.listdir(d) for d in base}, 'venv': sys.prefix != sys.base_prefix, 'numpy': numpy.__file__.startswith(sys.prefix)}))
"#;
    let out = json_out(&attacker.run(cell).await?)?;
    println!("base site-packages inside: {out}");
    let base = out["base"].as_object().context("base")?;
    ensure!(
        !base.is_empty(),
        "the base prefix has a site-packages: {out}"
    );
    ensure!(
        base.values()
            .all(|v| v.as_array().is_some_and(Vec::is_empty)),
        "the host's global packages are visible: {out}"
    );
    ensure!(out["venv"] == true && out["numpy"] == true, "{out}");
    arena.assert_gateway_serves().await
}
