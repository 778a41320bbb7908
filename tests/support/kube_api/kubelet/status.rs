//! The pod `status` the kubelet and scheduler write, piece by piece, in the real shapes:
//! conditions in the real order with transition times, and the container's status with
//! its waiting, running or terminated state, reason and message.

use serde_json::{json, Value};

use super::super::cluster::now;

/// The order the real kubelet lists conditions in.
const CONDITION_ORDER: [&str; 6] = [
    "DisruptionTarget",
    "PodReadyToStartContainers",
    "Initialized",
    "Ready",
    "ContainersReady",
    "PodScheduled",
];

/// Sets a condition; its lastTransitionTime moves only when its status changes.
pub fn set_condition(
    status: &mut Value,
    kind: &str,
    ok: bool,
    reason: Option<&str>,
    message: Option<&str>,
) {
    let value = if ok { "True" } else { "False" };
    let mut conditions: Vec<Value> = status["conditions"].as_array().cloned().unwrap_or_default();
    let transition = conditions
        .iter()
        .find(|c| c["type"] == kind)
        .filter(|c| c["status"] == value)
        .map(|c| c["lastTransitionTime"].clone())
        .unwrap_or_else(|| json!(now()));
    conditions.retain(|c| c["type"] != kind);
    let mut condition = json!({
        "type": kind,
        "status": value,
        "lastProbeTime": null,
        "lastTransitionTime": transition,
    });
    if let Some(reason) = reason {
        condition["reason"] = json!(reason);
    }
    if let Some(message) = message {
        condition["message"] = json!(message);
    }
    conditions.push(condition);
    let rank = |c: &Value| {
        CONDITION_ORDER
            .iter()
            .position(|k| c["type"] == *k)
            .unwrap_or(CONDITION_ORDER.len())
    };
    conditions.sort_by_key(rank);
    status["conditions"] = json!(conditions);
}

/// Ready and ContainersReady, together, as the kubelet sets them.
pub fn set_readiness(status: &mut Value, ready: bool, container: &str, reason_if_not: &str) {
    let message = format!("containers with unready status: [{container}]");
    let (reason, message) = if ready {
        (None, None)
    } else {
        (Some(reason_if_not), Some(message.as_str()))
    };
    set_condition(status, "Ready", ready, reason, message);
    set_condition(status, "ContainersReady", ready, reason, message);
}

pub fn waiting(reason: &str, message: Option<&str>) -> Value {
    let mut state = json!({"waiting": {"reason": reason}});
    if let Some(message) = message {
        state["waiting"]["message"] = json!(message);
    }
    state
}

pub fn running(started_at: &str) -> Value {
    json!({"running": {"startedAt": started_at}})
}

pub fn terminated(
    exit_code: i32,
    reason: &str,
    message: Option<&str>,
    started_at: Option<&str>,
    container_id: Option<&str>,
) -> Value {
    let mut state = json!({
        "terminated": {
            "exitCode": exit_code,
            "reason": reason,
            "finishedAt": now(),
        }
    });
    if let Some(message) = message {
        state["terminated"]["message"] = json!(message);
    }
    if let Some(started_at) = started_at {
        state["terminated"]["startedAt"] = json!(started_at);
    }
    if let Some(id) = container_id {
        state["terminated"]["containerID"] = json!(id);
    }
    state
}

/// The single container's status.
pub fn set_container(
    status: &mut Value,
    container: &Value,
    state: Value,
    ready: bool,
    container_id: Option<&str>,
) {
    let started = state.get("running").is_some();
    let image = container["image"].as_str().unwrap_or("");
    let mut entry = json!({
        "name": container["name"],
        "state": state,
        "lastState": {},
        "ready": ready,
        "restartCount": 0,
        "image": image,
        "imageID": "",
        "started": started,
    });
    if let Some(id) = container_id {
        entry["containerID"] = json!(id);
        entry["imageID"] = json!(format!("cellgate-kube-api-double/{image}"));
    }
    status["containerStatuses"] = json!([entry]);
}

/// The container's current state and startedAt, if it ran.
pub fn started_at(status: &Value) -> Option<String> {
    let state = &status["containerStatuses"][0]["state"];
    state["running"]["startedAt"]
        .as_str()
        .or_else(|| state["terminated"]["startedAt"].as_str())
        .map(str::to_owned)
}
