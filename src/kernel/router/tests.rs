use super::*;
use bytes::Bytes;

fn msg(channel: Channel, msg_type: &str, id: &str, parent: Option<&str>, content: &str) -> Message {
    let parent = match parent {
        Some(p) => format!(r#"{{"msg_id":"{p}","msg_type":"x"}}"#),
        None => "{}".to_owned(),
    };
    Message::from_parts(
        channel,
        Bytes::from(format!(r#"{{"msg_id":"{id}","msg_type":"{msg_type}"}}"#)),
        Bytes::from(parent),
        Bytes::from_static(b"{}"),
        Bytes::from(content.to_owned()),
        vec![],
    )
    .unwrap()
}

fn request(id: &str) -> Message {
    msg(Channel::Shell, "execute_request", id, None, "{}")
}

fn drain(rx: &mut Inbox) -> Vec<String> {
    let mut out = vec![];
    while let Some(m) = rx.try_recv() {
        out.push(m.msg_id().to_owned());
    }
    out
}

#[test]
fn replies_go_to_the_requester_and_iopub_to_all() {
    let router = Router::new("k");
    let (a_tx, mut a) = client_queue();
    let (b_tx, mut b) = client_queue();
    let (a_id, _) = router.attach("sa", a_tx);
    let (_b_id, _) = router.attach("sb", b_tx);
    router.register_request(a_id, "sa", &request("r1"));
    router.deliver(msg(Channel::Iopub, "stream", "o1", Some("r1"), "{}"));
    router.deliver(msg(
        Channel::Shell,
        "execute_reply",
        "rep1",
        Some("r1"),
        "{}",
    ));
    assert_eq!(drain(&mut a), ["o1", "rep1"]);
    assert_eq!(drain(&mut b), ["o1"]);
    // A second reply to the same request has nowhere to go.
    router.deliver(msg(
        Channel::Shell,
        "execute_reply",
        "rep2",
        Some("r1"),
        "{}",
    ));
    assert!(drain(&mut a).is_empty());
}

#[test]
fn a_newer_socket_with_the_same_session_gets_the_reply() {
    // The Kernel Gateway race: the old socket closes after sending a request and a new one
    // with the same session_id attaches before the reply arrives.
    let router = Router::new("k");
    let (old_tx, _old) = client_queue();
    let (old_id, _) = router.attach("s", old_tx);
    router.register_request(old_id, "s", &request("r1"));
    let (new_tx, mut new) = client_queue();
    router.attach("s", new_tx);
    router.detach(old_id);
    router.deliver(msg(
        Channel::Shell,
        "execute_reply",
        "rep",
        Some("r1"),
        "{}",
    ));
    assert_eq!(drain(&mut new), ["rep"]);
}

#[test]
fn offline_output_is_replayed_once_to_the_same_session_only() {
    let router = Router::new("k");
    let (tx, _rx) = client_queue();
    let (id, _) = router.attach("s", tx);
    router.register_request(id, "s", &request("r1"));
    router.detach(id);
    router.deliver(msg(Channel::Iopub, "stream", "o1", Some("r1"), "{}"));
    router.deliver(msg(
        Channel::Shell,
        "execute_reply",
        "rep",
        Some("r1"),
        "{}",
    ));
    router.deliver(msg(
        Channel::Iopub,
        "status",
        "o2",
        Some("r1"),
        r#"{"execution_state":"idle"}"#,
    ));
    let (other_tx, mut other) = client_queue();
    let (_, replayed) = router.attach("different", other_tx);
    assert_eq!(replayed, 0);
    assert!(drain(&mut other).is_empty());
    let (tx, mut rx) = client_queue();
    let (_, replayed) = router.attach("s", tx);
    assert_eq!(replayed, 3);
    assert_eq!(drain(&mut rx), ["o1", "rep", "o2"]);
    // Live output continues after the replay, without duplicates.
    router.deliver(msg(Channel::Iopub, "stream", "o3", None, "{}"));
    assert_eq!(drain(&mut rx), ["o3"]);
    assert_eq!(drain(&mut other), ["o3"]);
}

#[test]
fn input_requests_follow_the_execute() {
    let router = Router::new("k");
    let (a_tx, mut a) = client_queue();
    let (b_tx, mut b) = client_queue();
    let (a_id, _) = router.attach("sa", a_tx);
    router.attach("sb", b_tx);
    router.register_request(a_id, "sa", &request("r1"));
    router.deliver(msg(
        Channel::Stdin,
        "input_request",
        "in1",
        Some("r1"),
        "{}",
    ));
    assert_eq!(drain(&mut a), ["in1"]);
    assert!(drain(&mut b).is_empty());
}

#[test]
fn internal_requests_are_hidden_and_answered() {
    let router = Router::new("k");
    let (tx, mut rx) = client_queue();
    router.attach("s", tx);
    let mut reply = router.register_internal("nudge");
    assert_eq!(router.activity().execution_state.as_str(), "starting");
    router.deliver(msg(
        Channel::Iopub,
        "status",
        "st1",
        Some("nudge"),
        r#"{"execution_state":"busy"}"#,
    ));
    router.deliver(msg(
        Channel::Shell,
        "kernel_info_reply",
        "ki",
        Some("nudge"),
        "{}",
    ));
    router.deliver(msg(
        Channel::Iopub,
        "status",
        "st2",
        Some("nudge"),
        r#"{"execution_state":"idle"}"#,
    ));
    assert!(drain(&mut rx).is_empty());
    assert_eq!(reply.try_recv().unwrap().msg_id(), "ki");
    // The first status moved the kernel out of `starting`, and not to busy.
    assert_eq!(router.activity().execution_state.as_str(), "idle");
    router.deliver(msg(
        Channel::Iopub,
        "status",
        "st3",
        Some("client"),
        r#"{"execution_state":"idle"}"#,
    ));
    assert_eq!(router.activity().execution_state.as_str(), "idle");
    assert_eq!(drain(&mut rx), ["st3"]);
}

#[test]
fn offline_buffer_is_bounded_and_says_what_it_dropped() {
    let router = Router::new("k");
    let (tx, _rx) = client_queue();
    let (id, _) = router.attach("s", tx);
    router.detach(id);
    let big = format!(r#"{{"text":"{}"}}"#, "x".repeat(1 << 20));
    for i in 0..80 {
        router.deliver(msg(Channel::Iopub, "stream", &format!("o{i}"), None, &big));
    }
    let (tx, mut rx) = client_queue();
    let (_, replayed) = router.attach("s", tx);
    assert!(replayed < 80 && replayed > 50, "{replayed}");
    let all = drain(&mut rx);
    assert_eq!(all.len(), replayed + 1, "one notice follows the replay");
}

#[test]
fn a_client_that_does_not_read_is_dropped_and_its_session_buffers() {
    let router = Router::new("k");
    let (slow_tx, slow) = client_queue();
    let (fast_tx, mut fast) = client_queue();
    router.attach("slow", slow_tx);
    router.attach("fast", fast_tx);
    let big = format!(r#"{{"text":"{}"}}"#, "x".repeat(1 << 20));
    for i in 0..300 {
        router.deliver(msg(Channel::Iopub, "stream", &format!("o{i}"), None, &big));
        // The fast client keeps up.
        assert_eq!(drain(&mut fast).len(), 1);
    }
    assert!(slow.evicted());
    assert_eq!(router.connections(), 1);
}

#[test]
fn undelivered_messages_of_a_dead_socket_open_its_buffer_in_order() {
    let router = Router::new("k");
    let (tx, mut rx) = client_queue();
    let (id, _) = router.attach("s", tx);
    router.register_request(id, "s", &request("r1"));
    router.deliver(msg(Channel::Iopub, "stream", "o1", Some("r1"), "{}"));
    router.deliver(msg(Channel::Iopub, "stream", "o2", Some("r1"), "{}"));
    // The writer took o1 and failed to write it; o2 is still queued.
    let unsent = rx.try_recv().unwrap();
    router.detach_with(id, rx, vec![unsent]);
    router.deliver(msg(
        Channel::Shell,
        "execute_reply",
        "rep",
        Some("r1"),
        "{}",
    ));
    let (tx, mut rx) = client_queue();
    let (_, replayed) = router.attach("s", tx);
    assert_eq!(replayed, 3);
    assert_eq!(drain(&mut rx), ["o1", "o2", "rep"]);
}

#[test]
fn replies_of_a_dead_socket_go_to_its_sibling() {
    let router = Router::new("k");
    let (a_tx, a) = client_queue();
    let (b_tx, mut b) = client_queue();
    let (a_id, _) = router.attach("s", a_tx);
    router.attach("s", b_tx);
    router.register_request(a_id, "s", &request("r1"));
    router.deliver(msg(Channel::Iopub, "stream", "o1", Some("r1"), "{}"));
    router.deliver(msg(
        Channel::Shell,
        "execute_reply",
        "rep",
        Some("r1"),
        "{}",
    ));
    router.detach_with(a_id, a, vec![]);
    // b had its own copy of the iopub message and now gets a's reply too.
    assert_eq!(drain(&mut b), ["o1", "rep"]);
}

#[test]
fn a_dead_kernel_answers_the_oldest_execute_as_the_running_one() {
    let router = Router::new("k");
    let (tx, mut rx) = client_queue();
    let (id, _) = router.attach("s", tx);
    router.register_request(id, "s", &request("first"));
    router.register_request(id, "s", &request("second"));
    // No busy status arrived before the process died.
    router.fail_pending_executions("OutOfMemoryError", "out of memory", Outcome::Oom);
    let mut texts = vec![];
    while let Some(m) = rx.try_recv() {
        if m.msg_type() == "error" {
            let c = m.content_json().unwrap();
            texts.push((
                m.parent_msg_id().unwrap().to_owned(),
                c["evalue"].as_str().unwrap().to_owned(),
            ));
        }
    }
    assert_eq!(texts.len(), 2);
    assert_eq!(texts[0], ("first".to_owned(), "out of memory".to_owned()));
    assert!(texts[1].1.starts_with("this cell never ran"));
}

/// A kernel message whose parent is an execute_request (so the router tracks the execution).
fn of_execute(msg_type: &str, id: &str, parent: &str, content: &str) -> Message {
    let channel = if msg_type.ends_with("_reply") {
        Channel::Shell
    } else {
        Channel::Iopub
    };
    Message::from_parts(
        channel,
        Bytes::from(format!(r#"{{"msg_id":"{id}","msg_type":"{msg_type}"}}"#)),
        Bytes::from(format!(
            r#"{{"msg_id":"{parent}","msg_type":"execute_request"}}"#
        )),
        Bytes::from_static(b"{}"),
        Bytes::from(content.to_owned()),
        vec![],
    )
    .unwrap()
}

#[test]
fn history_records_what_clients_executed_and_saw() {
    let router = Router::new("k").with_output_limit(Some(300));
    let (tx, _rx) = client_queue();
    let (id, _) = router.attach("s", tx);
    // The gateway's own requests and silent executions leave no history, but the readiness
    // probe's kernel_info_reply gives the language.
    let _probe = router.register_internal("probe");
    router.deliver(msg(
        Channel::Shell,
        "kernel_info_reply",
        "ki",
        Some("probe"),
        r#"{"language_info":{"name":"python","version":"3.12"}}"#,
    ));
    let _set_env = router.register_internal("internal");
    router.deliver(of_execute(
        "stream",
        "i1",
        "internal",
        r#"{"name":"stdout","text":"hidden"}"#,
    ));
    let silent = r#"{"code":"secret","silent":true}"#;
    router.register_request(
        id,
        "s",
        &msg(Channel::Shell, "execute_request", "q", None, silent),
    );
    let code = r#"{"code":"print('x' * 1000)","silent":false}"#;
    router.register_request(
        id,
        "s",
        &msg(Channel::Shell, "execute_request", "r1", None, code),
    );
    router.deliver(of_execute(
        "status",
        "b",
        "r1",
        r#"{"execution_state":"busy"}"#,
    ));
    for n in 0..5 {
        let text = format!(r#"{{"name":"stdout","text":"{}"}}"#, "x".repeat(100));
        router.deliver(of_execute("stream", &format!("o{n}"), "r1", &text));
    }
    router.deliver(of_execute(
        "execute_reply",
        "rep",
        "r1",
        r#"{"status":"ok","execution_count":1}"#,
    ));
    router.deliver(of_execute(
        "status",
        "i",
        "r1",
        r#"{"execution_state":"idle"}"#,
    ));
    let snapshot = router.history().snapshot();
    assert_eq!(snapshot.language_info.unwrap()["name"], "python");
    assert_eq!(snapshot.cells.len(), 1);
    let cell = &snapshot.cells[0];
    assert_eq!(cell.source, "print('x' * 1000)");
    assert_eq!(cell.execution_count, Some(1));
    // Only what clients were shown: the output up to the limit, then the gateway's marker.
    let outputs = cell.outputs.to_json();
    assert_eq!(outputs.len(), 2, "{outputs:?}");
    assert!(outputs[0]["text"].as_str().unwrap().len() < 500);
    assert_eq!(outputs[1]["name"], "stderr");
    assert!(outputs[1]["text"].as_str().unwrap().contains("limit"));
}

/// A denial as the proxy reports it, from its wire form.
fn denial_of(value: serde_json::Value) -> crate::kernel::Denial {
    serde_json::from_value(value).unwrap()
}

#[test]
fn denials_reach_the_running_execution_only() {
    let router = Router::new("k");
    let (a_tx, mut a) = client_queue();
    let (a_id, _) = router.attach("sa", a_tx);
    // No execution at all: nothing is attached.
    router.record_denial(denial_of(
        serde_json::json!({"kind": "egress", "target": "", "policy": "", "reason": "early"}),
    ));
    router.register_request(a_id, "sa", &request("r1"));
    // Sent but its `busy` not seen yet: the oldest waiting execute is the running one.
    let before_busy = serde_json::json!({"kind": "egress", "target": "h:1", "policy": "p", "reason": "egress to h:1 is not allowed by policy 'p'"});
    router.record_denial(denial_of(before_busy.clone()));
    let busy = Message::from_parts(
        Channel::Iopub,
        Bytes::from_static(br#"{"msg_id":"s1","msg_type":"status"}"#),
        Bytes::from_static(br#"{"msg_id":"r1","msg_type":"execute_request"}"#),
        Bytes::from_static(b"{}"),
        Bytes::from_static(br#"{"execution_state":"busy"}"#),
        vec![],
    )
    .unwrap();
    router.deliver(busy);
    let denial = serde_json::json!({"kind": "package", "target": "x", "policy": "p", "reason": "package 'x' is not allowed by policy 'p'"});
    router.record_denial(denial_of(denial.clone()));
    let mut reply = msg(Channel::Shell, "execute_reply", "rep1", Some("r1"), "{}");
    reply.metadata = Bytes::from_static(br#"{"cellgate":{"outcome":"timeout"},"other":1}"#);
    router.deliver(reply);
    router.deliver(of_execute(
        "status",
        "i1",
        "r1",
        r#"{"execution_state":"idle"}"#,
    ));
    let mut got = vec![];
    while let Some(m) = a.try_recv() {
        got.push(m);
    }
    let lines: Vec<_> = got.iter().filter(|m| m.msg_type() == "stream").collect();
    assert_eq!(lines.len(), 2);
    let line = lines[1];
    let content: serde_json::Value = serde_json::from_slice(&line.content).unwrap();
    assert_eq!(content["name"], "stderr");
    assert_eq!(
        content["text"],
        "cellgate: package 'x' is not allowed by policy 'p'\n"
    );
    assert_eq!(line.parent_msg_id(), Some("r1"));
    let reply = &got[got.len() - 2];
    assert_eq!(reply.msg_type(), "execute_reply");
    let metadata: serde_json::Value = serde_json::from_slice(&reply.metadata).unwrap();
    assert_eq!(
        metadata["cellgate"]["denials"],
        serde_json::json!([before_busy, denial])
    );
    assert_eq!(
        metadata["cellgate"]["outcome"], "timeout",
        "merged, not replaced"
    );
    assert_eq!(metadata["other"], 1);
}

#[test]
fn history_records_the_gateways_answer_for_a_cell_whose_kernel_died() {
    let router = Router::new("k");
    let (tx, _rx) = client_queue();
    let (id, _) = router.attach("s", tx);
    // fail_locked answers in the kernel's stead with the request's own header.
    let mut request = msg(
        Channel::Shell,
        "execute_request",
        "r1",
        None,
        r#"{"code":"crash()","silent":false}"#,
    );
    request.header.session = "s".to_owned();
    router.register_request(id, "s", &request);
    router.deliver(of_execute(
        "status",
        "b",
        "r1",
        r#"{"execution_state":"busy"}"#,
    ));
    router.fail_pending_executions(
        "KernelDiedError",
        "the kernel process ended",
        Outcome::SandboxLost,
    );
    let cell = &router.history().snapshot().cells[0];
    let outputs = cell.outputs.to_json();
    assert_eq!(outputs.len(), 1);
    assert_eq!(outputs[0]["ename"], "KernelDiedError");
}

fn kinds(rx: &mut Inbox) -> Vec<String> {
    let mut out = vec![];
    while let Some(m) = rx.try_recv() {
        let state = m
            .content_json()
            .and_then(|c| c["execution_state"].as_str().map(str::to_owned));
        out.push(match state {
            Some(state) => state,
            None => m.msg_type().to_owned(),
        });
    }
    out
}

#[test]
fn a_reply_that_overtakes_its_outputs_waits_for_idle_and_reports_them() {
    // The shell socket's reply arrives while the execution's last (oversized) output is
    // still on its way through iopub.
    let router = Router::new("k").with_output_limit(Some(300));
    let (tx, mut rx) = client_queue();
    let (id, _) = router.attach("s", tx);
    router.register_request(id, "s", &request("r1"));
    router.deliver(of_execute(
        "status",
        "b1",
        "r1",
        r#"{"execution_state":"busy"}"#,
    ));
    router.deliver(of_execute(
        "execute_reply",
        "rep1",
        "r1",
        r#"{"status":"ok","execution_count":1}"#,
    ));
    assert_eq!(kinds(&mut rx), ["busy"], "the reply waits");
    let text = format!(r#"{{"name":"stdout","text":"{}"}}"#, "x".repeat(1000));
    router.deliver(of_execute("stream", "o1", "r1", &text));
    router.deliver(of_execute(
        "status",
        "i1",
        "r1",
        r#"{"execution_state":"idle"}"#,
    ));
    let got: Vec<Arc<Message>> = std::iter::from_fn(|| rx.try_recv()).collect();
    let order: Vec<&str> = got.iter().map(|m| m.msg_type()).collect();
    assert_eq!(
        order,
        ["stream", "execute_reply", "status"],
        "marker, reply, idle"
    );
    let metadata: serde_json::Value = serde_json::from_slice(&got[1].metadata).unwrap();
    assert_eq!(metadata["cellgate"]["outcome"], "output_truncated");
}

#[test]
fn a_held_reply_is_never_lost() {
    let router = Router::new("k");
    let (tx, mut rx) = client_queue();
    let (id, _) = router.attach("s", tx);
    let reply = |n: &str| {
        of_execute(
            "execute_reply",
            &format!("rep{n}"),
            &format!("r{n}"),
            r#"{"status":"ok","execution_count":1}"#,
        )
    };
    let busy = |n: &str| {
        of_execute(
            "status",
            &format!("b{n}"),
            &format!("r{n}"),
            r#"{"execution_state":"busy"}"#,
        )
    };
    // A kernel that never says idle: the next execution's busy lets the reply go.
    router.register_request(id, "s", &request("r1"));
    router.register_request(id, "s", &request("r2"));
    router.deliver(busy("1"));
    router.deliver(reply("1"));
    assert_eq!(kinds(&mut rx), ["busy"]);
    router.deliver(busy("2"));
    assert_eq!(kinds(&mut rx), ["execute_reply", "busy"]);
    // The process dies after replying, before idle: its real reply, not a failure.
    router.deliver(reply("2"));
    router.fail_pending_executions("DeadKernelError", "the kernel died", Outcome::SandboxLost);
    let got: Vec<Arc<Message>> = std::iter::from_fn(|| rx.try_recv()).collect();
    assert_eq!(
        got.len(),
        1,
        "{:?}",
        got.iter().map(|m| m.msg_type()).collect::<Vec<_>>()
    );
    assert_eq!(got[0].msg_id(), "rep2");
    // And when only the running execution is forgotten.
    router.register_request(id, "s", &request("r3"));
    router.deliver(busy("3"));
    router.deliver(reply("3"));
    router.clear_running();
    assert_eq!(kinds(&mut rx), ["busy", "execute_reply"]);
    // A reply for an execution that is not running (its idle came first) goes at once.
    router.register_request(id, "s", &request("r4"));
    router.deliver(reply("4"));
    assert_eq!(kinds(&mut rx), ["execute_reply"]);
}
