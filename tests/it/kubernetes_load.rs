//! What the `kubernetes` backend costs the API server, measured with the test double's
//! request log (`support::kube_api`): the requests of a kernel start, an execution, a
//! delete, a take-over after a replica is killed (SIGKILL) or stopped (SIGTERM), and of
//! replicas left idle, by verb and resource, watches apart, and the watch events sent.
//! SCALING.md's figures come from here (run with `--no-capture` to see the tables).
//!
//! The bounds asserted are regression checks, not timings: each is the measured count with
//! a margin, so a change that multiplies API calls (a read per request, a write per
//! renewal per kernel) fails, and background requests that fall into an operation's window
//! (replicas renew and sweep every 5 s whatever else happens) do not.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use serde_json::json;

use crate::kubernetes::{cluster, free_port, gateway, pod_of, setup, until};
use crate::support::kube_api::{KubeApi, RequestRecord};
use crate::support::v1::V1Client;
use crate::support::{Gateway, PATIENCE};

const NAMESPACE: &str = "cellgate";
/// How long idle replicas are watched (then scaled to a minute); `CELLGATE_TEST_IDLE_SECONDS`
/// measures longer (the once-a-minute work, the readiness check and the sweep's
/// housekeeping, then shows as it is rather than as a sample).
const IDLE: Duration = Duration::from_secs(20);
/// The renewal and sweep period of `sandbox::kubernetes::replicas` (RENEW_EVERY).
const PERIOD_SECONDS: f64 = 5.0;

fn idle_window() -> Duration {
    std::env::var("CELLGATE_TEST_IDLE_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(IDLE, Duration::from_secs)
}

/// The resource a request is about, from its path; a Lease by what it records (a replica's
/// own, or a kernel's owner) when the path names one.
fn resource_of(path: &str) -> String {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let rest = match segments.as_slice() {
        ["api", _version, rest @ ..] => rest,
        ["apis", _group, _version, rest @ ..] => rest,
        _ => return path.to_owned(),
    };
    let (plural, name) = match rest {
        ["namespaces", _, plural] | [plural] => (*plural, None),
        ["namespaces", _, plural, name, ..] => (*plural, Some(*name)),
        _ => return path.to_owned(),
    };
    match (plural, name) {
        ("leases", Some(name)) if name.starts_with("cellgate-replica-") => {
            "leases(replica)".to_owned()
        }
        ("leases", Some(name)) if name.starts_with("cellgate-kernel-") => {
            "leases(kernel)".to_owned()
        }
        (plural, _) => plural.to_owned(),
    }
}

/// `verb resource`, with the status when it is not a success (a 409 lost race, a 404).
fn key_of(record: &RequestRecord) -> String {
    let mut key = format!("{} {}", record.verb, resource_of(&record.path));
    if !(200..300).contains(&record.status) {
        let _ = write!(key, " [{}]", record.status);
    }
    key
}

/// The API load of one window.
#[derive(Debug, Clone, Default)]
struct Load {
    /// Requests by `verb resource` (watches as `watch pods`).
    by_key: BTreeMap<String, usize>,
    watch_events: u64,
    elapsed: Duration,
}

impl Load {
    /// Requests of `verb resource`, whatever their status.
    fn count(&self, key: &str) -> usize {
        self.by_key
            .iter()
            .filter(|(k, _)| *k == key || k.starts_with(&format!("{key} [")))
            .map(|(_, n)| n)
            .sum()
    }

    /// Every request but watches.
    fn requests(&self) -> usize {
        self.by_key
            .iter()
            .filter(|(k, _)| !k.starts_with("watch "))
            .map(|(_, n)| n)
            .sum()
    }

    fn watches(&self) -> usize {
        self.by_key
            .iter()
            .filter(|(k, _)| k.starts_with("watch "))
            .map(|(_, n)| n)
            .sum()
    }

    /// Requests of `verb` on any lease (any status).
    fn lease_requests(&self, verb: &str, which: &str) -> usize {
        self.by_key
            .iter()
            .filter(|(k, _)| k.starts_with(&format!("{verb} {which}")))
            .map(|(_, n)| n)
            .sum()
    }

    /// The replicas' own background in this window: their Lease renewals (a read and a
    /// write each) and, estimated, their sweeps (two lists each, as often as renewals:
    /// both run every 5 s). A list of Leases is the same request whoever asks (a sweep, a
    /// census for a forwarded request or a listing, a cap count): the rest are the
    /// operation's.
    fn background(&self) -> (usize, usize) {
        let renewals = self.lease_requests("get", "leases(replica)");
        let replica_writes = self.lease_requests("update", "leases(replica)")
            + self.lease_requests("create", "leases(replica)");
        (renewals + replica_writes, 2 * renewals)
    }

    /// Requests that are the operation's own: all but the background (renewals exactly,
    /// sweeps' lists estimated).
    fn own(&self) -> usize {
        let (renewals, sweep_lists) = self.background();
        let lists = self.count("list leases");
        self.requests() - renewals - lists + lists.saturating_sub(sweep_lists)
    }

    /// Requests that can only be the operation's: all but the replicas' own Leases, the
    /// lists of Leases (whoever made them), and the once-a-minute work: the readiness
    /// check's list of pods (nothing else lists pods) and the housekeeping's deletes of gone
    /// replicas' Leases. Those come by the clock, into whichever window runs then: a slow
    /// machine, whose windows are longer and later, catches them more often.
    fn unambiguous(&self) -> usize {
        let (renewals, _) = self.background();
        self.requests()
            - renewals
            - self.count("list leases")
            - self.readiness()
            - self.count("delete leases(replica)")
    }

    /// The readiness check's lists of pods (once a minute per gateway: nothing else lists
    /// pods).
    fn readiness(&self) -> usize {
        self.count("list pods")
    }

    /// The most once-a-minute rounds (readiness check, housekeeping) one gateway's window can
    /// hold: each runs a minute after the last one ended.
    fn minutes(&self) -> usize {
        self.elapsed.as_secs() as usize / 60 + 1
    }

    fn detail(&self) -> String {
        let mut out = String::new();
        for (key, n) in &self.by_key {
            if !out.is_empty() {
                out.push_str(", ");
            }
            let _ = write!(out, "{key} {n}");
        }
        if out.is_empty() {
            out.push('-');
        }
        out
    }
}

/// Counts the API requests from now on (the log is only appended to: a window is a slice
/// of it, so windows may nest).
struct Meter {
    from: usize,
    events: u64,
    at: Instant,
}

impl Meter {
    fn start(api: &KubeApi) -> Meter {
        Meter {
            from: api.requests().len(),
            events: api.watch_events_sent(),
            at: Instant::now(),
        }
    }

    fn stop(&self, api: &KubeApi) -> Load {
        let mut load = Load {
            elapsed: self.at.elapsed(),
            watch_events: api.watch_events_sent() - self.events,
            ..Load::default()
        };
        for record in api.requests().iter().skip(self.from) {
            *load.by_key.entry(key_of(record)).or_default() += 1;
        }
        load
    }
}

/// The printed table: one row per operation.
struct Table {
    title: String,
    rows: Vec<(String, Load)>,
}

impl Table {
    fn new(title: &str) -> Table {
        Table {
            title: title.to_owned(),
            rows: vec![],
        }
    }

    fn add(&mut self, what: &str, load: &Load) {
        self.rows.push((what.to_owned(), load.clone()));
    }

    fn print(&self) {
        let mut out = format!(
            "\nAPI load, {} (requests: all but watches; own: without the replicas' renewals \
             and, estimated, their sweeps' lists)\n",
            self.title
        );
        let _ = writeln!(
            out,
            "| operation | window | requests | own | watches | watch events | by verb and resource |"
        );
        let _ = writeln!(out, "| --- | --- | --- | --- | --- | --- | --- |");
        for (what, load) in &self.rows {
            let _ = writeln!(
                out,
                "| {what} | {:.1} s | {} | {} | {} | {} | {} |",
                load.elapsed.as_secs_f64(),
                load.requests(),
                load.own(),
                load.watches(),
                load.watch_events,
                load.detail()
            );
        }
        println!("{out}");
    }
}

/// After a start: the kernel's exit watch is opened just after the start returns. Waited for
/// (up to [`PATIENCE`]), not assumed: a watch late on a busy machine would fall into the next
/// window, whose bounds have no room for it.
async fn exit_watch_opened(api: &KubeApi, meter: &Meter, watches: usize) {
    let _ = until(PATIENCE, || async {
        (meter.stop(api).count("watch pods") >= watches).then_some(())
    })
    .await;
}

/// After a delete: the pod, its Secret and (with replicas) its Lease are gone, and the
/// requests that follow (the exit watch's end) are in.
async fn deleted(api: &KubeApi, id: &str, pod: &str) -> Result<()> {
    let gone = until(PATIENCE, || async {
        (api.object("pods", NAMESPACE, pod).is_none()
            && api.object("secrets", NAMESPACE, pod).is_none()
            && api
                .object("leases", NAMESPACE, &format!("cellgate-kernel-{id}"))
                .is_none())
        .then_some(())
    })
    .await;
    ensure!(gone.is_some(), "the kernel's objects were not all deleted");
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(())
}

/// Lets a gateway's start-up requests (its first readiness check, its Lease, its first
/// sweep) pass before anything is measured.
async fn settled(api: &KubeApi) {
    let _ = until(PATIENCE, || async {
        api.requests()
            .iter()
            .any(|r| r.verb == "list" && r.path.ends_with("/pods"))
            .then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
}

async fn pod_name(api: &KubeApi, id: &str) -> Result<String> {
    let pod = pod_of(api, id).await?;
    Ok(pod["metadata"]["name"]
        .as_str()
        .context("pod name")?
        .to_owned())
}

/// Restarts a kernel (a new pod: the kernel's process is the pod's) and waits until the old
/// pod and its Secret are gone and the new pod's exit watch is open.
async fn restarted(
    api: &KubeApi,
    gateway: &Gateway,
    meter: &Meter,
    id: &str,
    old: &str,
) -> Result<()> {
    let response = gateway
        .request(reqwest::Method::POST, &format!("/api/kernels/{id}/restart"))
        .send()
        .await?;
    let status = response.status();
    ensure!(
        status == 200,
        "restart: {status} {}\n{}",
        response.text().await.unwrap_or_default(),
        gateway.log()
    );
    let moved = until(PATIENCE, || async {
        let pods: Vec<_> = api
            .objects("pods", NAMESPACE)
            .into_iter()
            .filter(|p| p["metadata"]["labels"]["cellgate.io/kernel"] == id)
            .collect();
        (pods.len() == 1
            && pods[0]["metadata"]["name"] != old
            && api.object("secrets", NAMESPACE, old).is_none())
        .then_some(())
    })
    .await;
    ensure!(moved.is_some(), "the restart left the old pod or made none");
    exit_watch_opened(api, meter, 2).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(())
}

/// An object's size as the double stores it (JSON), in bytes: what a list returns per item,
/// less the managedFields a real API server adds.
fn size_of(api: &KubeApi, kind: &str, name: &str) -> usize {
    api.object(kind, NAMESPACE, name)
        .map_or(0, |o| serde_json::to_vec(&o).map_or(0, |v| v.len()))
}

/// A process's open descriptors and resident memory (KiB).
fn footprint(pid: u32) -> (usize, u64) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
    let rss = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0);
    (fds, rss)
}

fn per_minute(count: usize, replicas: usize, load: &Load) -> f64 {
    count as f64 / replicas as f64 * 60.0 / load.elapsed.as_secs_f64()
}

/// The most requests of periodic work (every [`PERIOD_SECONDS`], per replica) a window can
/// hold: its periods, plus one started before it, plus one more for timing slack.
fn periods(load: &Load) -> usize {
    (load.elapsed.as_secs_f64() / PERIOD_SECONDS).floor() as usize + 2
}

/// Asserts that the operation's requests stay within `own` beyond the background that
/// `replicas` replicas may add in its window (2 renewal requests and 2 sweep lists per
/// period each, and the once-a-minute readiness list and housekeeping census), as many as
/// the window's length allows: a slow machine's longer window holds more of them.
fn assert_within(what: &str, load: &Load, replicas: usize, own: usize) -> Result<()> {
    let background = replicas * periods(load) * 4 + replicas * 2 * load.minutes();
    ensure!(
        load.requests() <= own + background,
        "{what}: {} requests (at most {own} of its own and {background} of background \
         expected): {}",
        load.requests(),
        load.detail()
    );
    ensure!(
        load.own() <= own + 2 * replicas * load.minutes(),
        "{what}: {} requests of its own, at most {own} expected: {}",
        load.own(),
        load.detail()
    );
    Ok(())
}

#[tokio::test]
async fn api_load_of_one_gateway() -> Result<()> {
    let api = cluster().await;
    let dir = tempfile::tempdir()?;
    let (policies, config) = setup(dir.path(), 9)?;
    let gw = gateway(&api, &policies, &config, None, &[]).await?;
    let v1 = V1Client::new(&gw);
    settled(&api).await;
    let mut table = Table::new("one gateway (no --replica-url)");
    let before = footprint(gw.pid());

    // The first kernel of a policy: its NetworkPolicy is made sure of (read, created).
    let meter = Meter::start(&api);
    let _first = v1
        .create_session(json!({}))
        .await
        .with_context(|| gw.log())?;
    exit_watch_opened(&api, &meter, 2).await;
    let start_first = meter.stop(&api);
    table.add("start, first kernel of the policy", &start_first);
    let one = footprint(gw.pid());

    let meter = Meter::start(&api);
    let id = v1.create_session(json!({})).await?;
    exit_watch_opened(&api, &meter, 2).await;
    let start = meter.stop(&api);
    table.add("start, a later kernel", &start);
    let two = footprint(gw.pid());

    let meter = Meter::start(&api);
    let r = v1.execute(&id, "1 + 1").await?;
    ensure!(r["result"] == "2", "{r}");
    let execute = meter.stop(&api);
    table.add("execute `1 + 1`", &execute);

    let pod = pod_name(&api, &id).await?;
    let meter = Meter::start(&api);
    restarted(&api, &gw, &meter, &id, &pod).await?;
    let restart = meter.stop(&api);
    table.add("restart (a new pod)", &restart);

    let pod = pod_name(&api, &id).await?;
    let sizes = [
        ("pod", size_of(&api, "pods", &pod)),
        ("secret", size_of(&api, "secrets", &pod)),
    ];
    let meter = Meter::start(&api);
    let (status, body) = v1
        .call(reqwest::Method::DELETE, &format!("/v1/sessions/{id}"), None)
        .await?;
    ensure!(status == 204, "{status} {body}");
    deleted(&api, &id, &pod).await?;
    let delete = meter.stop(&api);
    table.add("delete", &delete);

    // Idle, with one kernel (`first`) alive: its pod's watch stays open.
    let meter = Meter::start(&api);
    tokio::time::sleep(idle_window()).await;
    let idle = meter.stop(&api);
    table.add("idle, one kernel, whole window", &idle);
    table.print();
    println!(
        "idle: {:.1} requests per minute, {:.1} watch events per minute",
        per_minute(idle.requests(), 1, &idle),
        idle.watch_events as f64 * 60.0 / idle.elapsed.as_secs_f64()
    );
    println!("objects as the double stores them (JSON bytes): {sizes:?}");
    let fds_per_kernel = two.0.saturating_sub(one.0);
    println!(
        "gateway descriptors: {} before any kernel, {} with one, {} with two ({fds_per_kernel} \
         per kernel); resident memory (this build) {} / {} / {} KiB",
        before.0, one.0, two.0, before.1, one.1, two.1
    );

    // A start: the NetworkPolicy once per policy and process (a read, a create when it is
    // missing), the pod and its Secret, and two watches of the pod: until it runs, then
    // for its end. Events: the pod's ADDED and each status change until Running, then a
    // few more as the exit watch resumes from the version it was handed.
    ensure!(
        start_first.requests() <= 6 && start_first.count("create pods") == 1,
        "{}",
        start_first.detail()
    );
    ensure!(start_first.count("get networkpolicies") == 1);
    ensure!(start.requests() <= 3, "{}", start.detail());
    ensure!(
        start.count("get networkpolicies") == 0,
        "{}",
        start.detail()
    );
    for load in [&start_first, &start] {
        ensure!(load.watches() <= 3, "{}", load.detail());
        ensure!(load.watch_events <= 20, "{} events", load.watch_events);
    }
    // An execution never reaches the API: it goes to the kernel over the agent's link (the
    // readiness check may fall into its window, by the clock).
    ensure!(
        execute.requests() - execute.readiness() + execute.watches() == 0
            && execute.readiness() <= execute.minutes(),
        "{}",
        execute.detail()
    );
    // A restart is a new pod: a start and a delete.
    ensure!(
        restart.requests() <= 6 && restart.count("create pods") == 1,
        "{}",
        restart.detail()
    );
    ensure!(restart.watches() <= 3, "{}", restart.detail());
    // Per kernel: the agent's connection, its channels' sockets, the pod's watch.
    ensure!(
        fds_per_kernel <= 40,
        "{fds_per_kernel} descriptors per kernel"
    );
    // A delete: the pod and its Secret (the Secret would go with the pod anyway).
    ensure!(
        delete.requests() <= 3 && delete.watches() <= 1,
        "{}",
        delete.detail()
    );
    // Idle: nothing but the readiness check (a list of pods a minute).
    ensure!(idle.requests() <= idle.minutes(), "{}", idle.detail());
    ensure!(idle.watches() <= 1, "{}", idle.detail());
    Ok(())
}

/// SIGTERM, as the kubelet stops a pod.
fn terminate(gateway: &Gateway) -> Result<()> {
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(gateway.pid() as i32).context("pid")?,
        rustix::process::Signal::TERM,
    )?;
    Ok(())
}

/// Waits until `gateway` says it took `id` over, and its pod watch is open.
async fn taken_over(api: &KubeApi, gateway: &Gateway, meter: &Meter, id: &str) -> Result<()> {
    let done = until(PATIENCE, || async {
        gateway
            .log()
            .lines()
            // The session, not only the kernel: a request before it is told to retry (503).
            .any(|l| l.contains("session taken over") && l.contains(id))
            .then_some(())
    })
    .await;
    ensure!(done.is_some(), "not taken over: {}", gateway.log());
    exit_watch_opened(api, meter, 2).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(())
}

#[tokio::test]
async fn api_load_of_two_replicas() -> Result<()> {
    let api = cluster().await;
    let dir = tempfile::tempdir()?;
    let (policies, config) = setup(dir.path(), 9)?;
    let (port_a, port_b, port_c) = (free_port()?, free_port()?, free_port()?);
    let mut a = gateway(&api, &policies, &config, Some((port_a, "gw-a")), &[]).await?;
    let mut b = gateway(&api, &policies, &config, Some((port_b, "gw-b")), &[]).await?;
    let (via_a, via_b) = (V1Client::new(&a), V1Client::new(&b));
    settled(&api).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut table = Table::new("two replicas (--replica-url)");

    // Idle, no kernel: the replicas' own Leases and sweeps.
    let meter = Meter::start(&api);
    tokio::time::sleep(idle_window()).await;
    let idle_empty = meter.stop(&api);
    table.add("idle, 2 replicas, no kernel, whole window", &idle_empty);

    let meter = Meter::start(&api);
    let id = via_a
        .create_session(json!({}))
        .await
        .with_context(|| a.log())?;
    exit_watch_opened(&api, &meter, 2).await;
    let start_first = meter.stop(&api);
    table.add("start on A, first kernel of the policy", &start_first);

    let meter = Meter::start(&api);
    let other = via_a.create_session(json!({})).await?;
    exit_watch_opened(&api, &meter, 2).await;
    let start = meter.stop(&api);
    table.add("start on A, a later kernel", &start);

    let meter = Meter::start(&api);
    let r = via_a.execute(&id, "x = 41\nx + 1").await?;
    ensure!(r["result"] == "42", "{r}");
    let execute_local = meter.stop(&api);
    table.add("execute on the owner (A)", &execute_local);

    let meter = Meter::start(&api);
    let r = via_b.execute(&id, "x").await?;
    ensure!(r["result"] == "41", "{r}");
    let execute_forwarded = meter.stop(&api);
    table.add("execute through B, forwarded to A", &execute_forwarded);

    let meter = Meter::start(&api);
    let (status, listed) = via_b.get("/v1/sessions").await?;
    ensure!(status == 200, "{status} {listed}");
    let listing = meter.stop(&api);
    table.add("list sessions through B (gathered from A)", &listing);

    let pod = pod_name(&api, &other).await?;
    let meter = Meter::start(&api);
    restarted(&api, &a, &meter, &other, &pod).await?;
    let restart = meter.stop(&api);
    table.add("restart on the owner (A; a new pod)", &restart);

    let pod = pod_name(&api, &other).await?;
    let sizes = [
        (
            "kernel lease",
            size_of(&api, "leases", &format!("cellgate-kernel-{other}")),
        ),
        (
            "replica lease",
            size_of(&api, "leases", "cellgate-replica-gw-a"),
        ),
    ];
    let lease = api
        .object("leases", NAMESPACE, &format!("cellgate-kernel-{other}"))
        .context("the kernel's lease")?;
    ensure!(
        lease["metadata"]["annotations"]["cellgate.io/pod"] == pod.as_str(),
        "the lease names the old pod: {lease}"
    );
    let meter = Meter::start(&api);
    let (status, body) = via_a
        .call(
            reqwest::Method::DELETE,
            &format!("/v1/sessions/{other}"),
            None,
        )
        .await?;
    ensure!(status == 204, "{status} {body}");
    deleted(&api, &other, &pod).await?;
    let delete = meter.stop(&api);
    table.add("delete on the owner (A)", &delete);

    let meter = Meter::start(&api);
    tokio::time::sleep(idle_window()).await;
    let idle_kernel = meter.stop(&api);
    table.add("idle, 2 replicas, one kernel, whole window", &idle_kernel);

    // A is killed: until its Lease lapses (15 s by B's clock) a request for its kernel is
    // forwarded to an address that does not answer (502, retry later); then B's sweep takes
    // the kernel over. Nothing asks B meanwhile, so the take-over is the sweep's.
    let takeover_meter = Meter::start(&api);
    a.child.kill()?;
    a.child.wait()?;
    let meter = Meter::start(&api);
    let (status, body) = via_b
        .post(&format!("/v1/sessions/{id}/execute"), json!({"code": "x"}))
        .await?;
    ensure!(
        status == 502 && body["code"] == "replica_unreachable",
        "{status} {body}"
    );
    let dead_owner = meter.stop(&api);
    table.add(
        "execute through B, owner killed, Lease not lapsed (502)",
        &dead_owner,
    );
    taken_over(&api, &b, &takeover_meter, &id).await?;
    let killed = takeover_meter.stop(&api);
    table.add("take-over after SIGKILL (kill → B serves it)", &killed);
    let r = via_b.execute(&id, "x").await?;
    ensure!(r["result"] == "41", "{r}");

    // B is stopped (SIGTERM) with C up: B releases its Lease and C's next sweep takes the
    // kernel over at once.
    let c = gateway(&api, &policies, &config, Some((port_c, "gw-c")), &[]).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let meter = Meter::start(&api);
    terminate(&b)?;
    let status = b.child.wait()?;
    ensure!(status.success(), "{status}: {}", b.log());
    taken_over(&api, &c, &meter, &id).await?;
    let stopped = meter.stop(&api);
    table.add("take-over after SIGTERM (signal → C serves it)", &stopped);
    let r = V1Client::new(&c).execute(&id, "x").await?;
    ensure!(r["result"] == "41", "{r}");

    table.print();
    println!("objects as the double stores them (JSON bytes): {sizes:?}");
    for (what, load) in [("no kernel", &idle_empty), ("one kernel", &idle_kernel)] {
        let (renewals, sweep_lists) = load.background();
        println!(
            "idle, {what}: per replica per minute {:.1} requests ({:.1} renewal requests, \
             ~{:.1} sweep lists); {:.1} watch events per minute in all",
            per_minute(load.requests(), 2, load),
            per_minute(renewals, 2, load),
            per_minute(sweep_lists, 2, load),
            load.watch_events as f64 * 60.0 / load.elapsed.as_secs_f64()
        );
    }

    // Idle: per replica, a renewal (read and write) and a sweep (two lists) every 5 s: 48 a
    // minute, plus the readiness list and the housekeeping census once a minute. Each loop
    // waits its full period after its last round ended (no catch-up after a stall), so a
    // window holds at most a round per period and one more, however busy the machine:
    // that count is the bound (about 66 a minute per replica over 20 s).
    for load in [&idle_empty, &idle_kernel] {
        let per_replica = per_minute(load.requests(), 2, load);
        let rounds = (load.elapsed.as_secs_f64() / PERIOD_SECONDS).floor() as usize + 1;
        let most = 2 * (4 * rounds + 2 * load.minutes());
        ensure!(
            load.requests() <= most,
            "{per_replica:.1}/min per replica, {} requests in {:?} (at most {most}): {}",
            load.requests(),
            load.elapsed,
            load.detail()
        );
        ensure!(load.watches() <= 1, "{}", load.detail());
        // Kernel Leases are never renewed.
        ensure!(
            load.lease_requests("update", "leases(kernel)") == 0,
            "{}",
            load.detail()
        );
    }
    // A start with replicas: the policy cap's list of kernel Leases and the kernel's Lease
    // on top of one gateway's start.
    assert_within("first start", &start_first, 2, 7)?;
    assert_within("start", &start, 2, 4)?;
    for load in [&start_first, &start] {
        ensure!(load.count("create leases") == 1, "{}", load.detail());
        ensure!(load.count("create pods") == 1, "{}", load.detail());
        ensure!(load.watches() <= 3, "{}", load.detail());
        ensure!(load.watch_events <= 20, "{} events", load.watch_events);
    }
    // On the owner an execution costs nothing; forwarded, the kernel's Lease is read and
    // the replicas' Leases listed (who owns it, and whether the owner lives).
    assert_within("local execute", &execute_local, 2, 0)?;
    ensure!(execute_local.count("get leases(kernel)") == 0);
    assert_within("forwarded execute", &execute_forwarded, 2, 2)?;
    ensure!(
        execute_forwarded.count("get leases(kernel)") == 1,
        "{}",
        execute_forwarded.detail()
    );
    assert_within("listing", &listing, 2, 1)?;
    // A restart: a start (its Lease rewritten for the new pod) and a delete of the old pod.
    assert_within("restart", &restart, 2, 10)?;
    ensure!(restart.watches() <= 3, "{}", restart.detail());
    // The pod, its Secret and the kernel's Lease: read, then deleted if it still names the
    // pod (the double's garbage collector, quicker than a real one, deleted both with the
    // pod already).
    assert_within("delete", &delete, 2, 4)?;
    ensure!(
        delete.count("get leases(kernel)") + delete.count("delete leases(kernel)") <= 2,
        "{}",
        delete.detail()
    );
    assert_within("request to a dead owner", &dead_owner, 2, 2)?;
    // Take-overs: the kernel's Lease read and written, its Secret read (key, connection),
    // the pod watched, the NetworkPolicy made sure of by the new owner; the rest is the
    // sweeps' and renewals' of the lapse.
    // (The SIGKILL window also holds the 502 request's two.)
    assert_within("take-over after SIGKILL", &killed, 2, 8)?;
    assert_within("take-over after SIGTERM", &stopped, 3, 6)?;
    for load in [&killed, &stopped] {
        ensure!(load.unambiguous() <= 7, "{}", load.detail());
        ensure!(
            load.lease_requests("update", "leases(kernel)") <= 2,
            "{}",
            load.detail()
        );
        ensure!(load.watches() <= 3, "{}", load.detail());
        ensure!(load.watch_events <= 20, "{} events", load.watch_events);
    }
    Ok(())
}
