//! Sustained output floods under the default policy (issue 13, item 8).
//!
//! ipykernel buffers a stream faster than its IOPub thread sends it: a print loop of ten
//! seconds grew the kernel past its 1 GiB limit in about a second, and the cell ended `oom`
//! with its variables gone, although the gateway forwards nothing past the cell's output limit
//! anyway. The kernel launcher now stops a cell's output at the source a little past that
//! limit. Each flood here runs for seconds (not a fixed amount), through stdout, stderr, the
//! process's file descriptor 1 and rich displays (also from a thread); each must end
//! `output_truncated` with the
//! head of its output shown, and the kernel, its variables and a modest peak memory must
//! survive it.

use anyhow::{ensure, Context, Result};

use super::{arena, one_plus_one, under_attack, Probe};
use crate::support::*;

/// How long each flood writes.
const FLOOD_SECONDS: u32 = 6;
/// The default policy's `output_per_execution`.
const LIMIT: usize = 10 << 20;
/// Peak RSS the kernel may reach over all the floods; the default memory limit is 1 GiB and
/// before the fix the first flood alone passed it.
const MAX_PEAK_RSS_MIB: u64 = 400;

/// The floods: a name, the cell, and the output type that must carry the head.
fn floods() -> Vec<(&'static str, String, &'static str)> {
    let seconds = FLOOD_SECONDS;
    let timed = |body: &str| {
        format!("import os, sys, time\nt = time.time()\nwhile time.time() - t < {seconds}:\n    {body}\n")
    };
    vec![
        (
            "stdout",
            timed(r#"sys.stdout.write("x" * 4000 + "\n")"#),
            "stdout",
        ),
        (
            "stderr",
            timed(r#"sys.stderr.write("e" * 4000 + "\n")"#),
            "stderr",
        ),
        (
            "fd 1",
            timed(r#"os.write(1, b"f" * 4000 + b"\n")"#),
            "stdout",
        ),
        (
            "displays",
            format!(
                "from IPython.display import display, HTML\n{}",
                timed(r#"display(HTML("<b>" + "d" * 40000 + "</b>"))"#)
            ),
            "display_data",
        ),
        // ipykernel keeps display hooks per thread: a thread's displays must count too.
        (
            "thread displays",
            format!(
                "import threading, time\nfrom IPython.display import display, HTML\ndef flood():\n    t = time.time()\n    while time.time() - t < {seconds}:\n        display(HTML('<b>' + 't' * 40000 + '</b>'))\nworker = threading.Thread(target=flood)\nworker.start()\nworker.join()\n"
            ),
            "display_data",
        ),
    ]
}

/// Bytes of a cell's output of one kind (stream text or display_data's text/html).
fn output_of(msgs: &[Msg], kind: &str) -> (usize, String) {
    let texts: Vec<&str> = msgs
        .iter()
        .filter_map(|m| match (m.msg_type(), kind) {
            ("stream", "stdout" | "stderr") if m.content["name"] == kind => {
                m.content["text"].as_str()
            }
            ("display_data", "display_data") => m.content["data"]["text/html"].as_str(),
            _ => None,
        })
        .collect();
    let total = texts.iter().map(|t| t.len()).sum();
    (
        total,
        texts
            .first()
            .map(|t| t[..t.len().min(40)].to_owned())
            .unwrap_or_default(),
    )
}

/// Each flood writes for [`FLOOD_SECONDS`] and ends `output_truncated` with its head shown
/// and no more than the limit forwarded; the kernel keeps a variable set before the floods,
/// its peak memory stays far from the limit, and a bystander session keeps answering.
#[tokio::test]
async fn sustained_floods_end_truncated_and_the_kernel_lives() -> Result<()> {
    let mut arena = arena().await?;
    let (id, mut attacker) = arena.attacker("default").await?;
    let msgs = attacker.run("kept = 6 * 7").await?;
    ensure!(reply(&msgs).content["status"] == "ok", "{msgs:?}");

    for (name, cell, kind) in floods() {
        let probe = Probe::default();
        let label = format!("sustained {name} flood");
        let msgs = under_attack(&label, &mut arena.bystander, &probe, async {
            attacker.run(&cell).await
        })
        .await?;
        let reply = reply(&msgs);
        let (bytes, head) = output_of(&msgs, kind);
        println!(
            "{label}: {bytes} bytes of {kind} forwarded in {} messages, outcome {}",
            msgs.len(),
            reply.metadata["cellgate"]["outcome"]
        );
        ensure!(
            reply.metadata["cellgate"]["outcome"] == "output_truncated",
            "{label}: outcome {} (status {}), not output_truncated",
            reply.metadata["cellgate"]["outcome"],
            reply.content["status"]
        );
        ensure!(
            reply.content["status"] == "ok",
            "{label}: the cell did not finish normally: {}",
            reply.content
        );
        ensure!(bytes > 0, "{label}: the head of the output is missing");
        ensure!(bytes <= LIMIT, "{label}: {bytes} bytes got through");
        let expected = match name {
            "stdout" => "xxxx",
            "stderr" => "eeee",
            "fd 1" => "ffff",
            "thread displays" => "<b>tt",
            _ => "<b>dd",
        };
        ensure!(head.starts_with(expected), "{label}: the head is {head:?}");
        let markers = msgs
            .iter()
            .filter(|m| {
                m.msg_type() == "stream"
                    && m.content["text"]
                        .as_str()
                        .is_some_and(|t| t.contains("output passed the limit"))
            })
            .count();
        ensure!(markers == 1, "{label}: {markers} truncation markers");

        // The same kernel process, with its variables.
        let msgs = attacker.run("print(kept)").await?;
        ensure!(
            stdout(&msgs).trim() == "42",
            "{label}: the kernel lost its variables: {msgs:?}"
        );
    }

    let model = arena.model(&id).await?;
    ensure!(
        model["cellgate"]["state_generation"] == 1,
        "the kernel was restarted: {model}"
    );
    let msgs = attacker
        .run("import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)")
        .await?;
    let peak: u64 = stdout(&msgs)
        .trim()
        .parse()
        .with_context(|| format!("peak RSS: {msgs:?}"))?;
    println!("sustained floods: the kernel's peak RSS was {peak} MiB");
    ensure!(
        peak <= MAX_PEAK_RSS_MIB,
        "the kernel's peak RSS reached {peak} MiB"
    );
    one_plus_one(&mut attacker).await?;
    arena.assert_gateway_serves().await
}
