//! Filling the workspace under the default policy (issue 13, item 7).
//!
//! The workspace is a RAM disk (a tmpfs) whose pages are charged to the sandbox's memory
//! cgroup. With the cgroup sized at the policy's `memory` alone, filling the 1 GiB workspace
//! of the default policy killed the 1 GiB kernel for memory: the cell ended `oom` and the
//! session's variables were gone, where a full disk should answer ENOSPC. The cgroup now holds
//! memory plus workspace.

use anyhow::{ensure, Context, Result};

use super::{arena, expect_error, one_plus_one, under_attack, Probe};
use crate::support::*;

/// The default policy's `workspace`.
const WORKSPACE: u64 = 1 << 30;

/// Writing until the default 1 GiB workspace is full ends in `OSError: [Errno 28]` near
/// 1 GiB; the kernel keeps its variables and can still allocate memory with the disk full;
/// deleting the file frees the space.
#[tokio::test]
async fn a_full_workspace_is_enospc_not_oom() -> Result<()> {
    let mut arena = arena().await?;
    let (id, mut attacker) = arena.attacker("default").await?;
    let msgs = attacker.run("kept = 6 * 7").await?;
    ensure!(reply(&msgs).content["status"] == "ok", "{msgs:?}");
    let cell = r#"
chunk = b'w' * (4 << 20)
written = 0
with open('fill.bin', 'wb', buffering=0) as f:
    try:
        # Bounded, so a broken limit fails this test instead of filling the host.
        while written < (1536 << 20):
            written += f.write(chunk)
    finally:
        print(written)
"#;
    let probe = Probe::default();
    let msgs = under_attack(
        "fill the default workspace",
        &mut arena.bystander,
        &probe,
        async { attacker.run(cell).await },
    )
    .await?;
    let outcome = &reply(&msgs).metadata["cellgate"]["outcome"];
    ensure!(
        outcome.is_null(),
        "the cell ended with outcome {outcome}, not an ordinary error: {msgs:?}"
    );
    expect_error(&msgs, &["OSError"])?;
    let error = &of_type(&msgs, "error")[0].content;
    ensure!(
        error["evalue"]
            .as_str()
            .is_some_and(|e| e.contains("[Errno 28] No space left")),
        "not ENOSPC: {error}"
    );
    let written: u64 = stdout(&msgs)
        .trim()
        .parse()
        .with_context(|| format!("bytes written: {msgs:?}"))?;
    println!("fill the default workspace: {written} bytes written before ENOSPC");
    ensure!(written <= WORKSPACE, "{written} bytes in a 1 GiB workspace");
    ensure!(
        written >= WORKSPACE - (64 << 20),
        "only {written} bytes fit in a 1 GiB workspace"
    );

    // The same process, its variables, and memory to spare with the disk full.
    let msgs = attacker
        .run("b = bytearray(256 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint(kept, len(b) >> 20)")
        .await?;
    ensure!(
        stdout(&msgs).trim() == "42 256",
        "the kernel lost its variables or could not allocate: {msgs:?}"
    );
    let model = arena.model(&id).await?;
    ensure!(
        model["cellgate"]["state_generation"] == 1,
        "the kernel was restarted: {model}"
    );
    let msgs = attacker
        .run("import os; del b; os.remove('fill.bin'); open('ok.txt', 'w').write('ok')")
        .await?;
    ensure!(reply(&msgs).content["status"] == "ok", "{msgs:?}");
    one_plus_one(&mut attacker).await?;
    arena.assert_gateway_serves().await
}
