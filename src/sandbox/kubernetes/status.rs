//! What a pod's status says, in the gateway's terms: still starting (and why it waits),
//! running at an address, or ended (and why). Kubernetes' own reasons and messages are kept,
//! since they are what an operator searches for (`ImagePullBackOff`, `Unschedulable`,
//! `Evicted`, `OOMKilled`).

use k8s_openapi::api::core::v1::Pod;

/// Where a pod is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodState {
    /// Not running yet; `why` is the latest reason Kubernetes gives, when it gives one.
    Waiting { why: Option<String> },
    /// Running, at this address.
    Running { ip: String },
    /// Over: it failed, was evicted, or its container ended.
    Ended { why: String },
}

/// The state `pod`'s status says it is in (a pod being deleted has ended).
pub fn state(pod: &Pod) -> PodState {
    if pod.metadata.deletion_timestamp.is_some() {
        return PodState::Ended {
            why: "the pod is being deleted".to_owned(),
        };
    }
    let Some(status) = &pod.status else {
        return PodState::Waiting { why: None };
    };
    let phase = status.phase.as_deref().unwrap_or("Pending");
    let container = status.container_statuses.as_ref().and_then(|c| c.first());
    let terminated = container
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.as_ref());
    if let Some(terminated) = terminated {
        let reason = terminated.reason.as_deref().unwrap_or("Terminated");
        let mut why = format!(
            "the kernel's container ended ({reason}, exit code {})",
            terminated.exit_code
        );
        if let Some(message) = terminated.message.as_deref().filter(|m| !m.is_empty()) {
            why.push_str(&format!(": {}", one_line(message)));
        }
        return PodState::Ended { why };
    }
    if matches!(phase, "Failed" | "Succeeded") {
        let reason = status.reason.as_deref().unwrap_or(phase);
        let why = match status.message.as_deref().filter(|m| !m.is_empty()) {
            Some(message) => format!("the pod {}: {reason}: {}", verb(reason), one_line(message)),
            None => format!("the pod {}: {reason}", verb(reason)),
        };
        return PodState::Ended { why };
    }
    let running = container
        .and_then(|c| c.state.as_ref())
        .is_some_and(|s| s.running.is_some());
    if phase == "Running" && running {
        if let Some(ip) = status.pod_ip.as_deref().filter(|ip| !ip.is_empty()) {
            return PodState::Running { ip: ip.to_owned() };
        }
    }
    PodState::Waiting {
        why: waiting_reason(pod),
    }
}

fn verb(reason: &str) -> &'static str {
    if reason == "Evicted" {
        "was evicted"
    } else {
        "ended"
    }
}

/// Why a pending pod waits: its container's waiting reason, else an unmet condition's.
fn waiting_reason(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    let waiting = status
        .container_statuses
        .as_ref()
        .and_then(|c| c.first())
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.waiting.as_ref());
    if let Some(waiting) = waiting {
        let reason = waiting
            .reason
            .clone()
            .unwrap_or_else(|| "Waiting".to_owned());
        return Some(match waiting.message.as_deref().filter(|m| !m.is_empty()) {
            Some(message) => format!("{reason}: {}", one_line(message)),
            None => reason,
        });
    }
    let unmet = status
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.status == "False" && c.reason.is_some())?;
    let reason = unmet.reason.clone().unwrap_or_default();
    Some(match unmet.message.as_deref().filter(|m| !m.is_empty()) {
        Some(message) => format!("{reason}: {}", one_line(message)),
        None => reason,
    })
}

/// A message as one line of reasonable length (a container's termination message may be
/// a log tail).
fn one_line(text: &str) -> String {
    let line: String = text
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .chars()
        .take(400)
        .collect();
    line
}

/// Whether a waiting reason means the pod will not start by itself (so the gateway need not
/// wait for its deadline).
pub fn hopeless(why: &str) -> bool {
    [
        "ErrImageNeverPull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    ]
    .iter()
    .any(|reason| why.starts_with(reason))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(status: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p"}, "status": status})).unwrap()
    }

    #[test]
    fn states_follow_the_status() {
        assert_eq!(
            state(&pod(json!({"phase": "Pending"}))),
            PodState::Waiting { why: None }
        );
        let pulling = pod(json!({"phase": "Pending", "containerStatuses": [{
            "name": "kernel", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image \"x\""}}}]}));
        assert_eq!(
            state(&pulling),
            PodState::Waiting {
                why: Some("ImagePullBackOff: Back-off pulling image \"x\"".to_owned())
            }
        );
        let unschedulable = pod(
            json!({"phase": "Pending", "conditions": [{"type": "PodScheduled",
            "status": "False", "reason": "Unschedulable", "message": "0/3 nodes are available: 3 Insufficient memory."}]}),
        );
        let PodState::Waiting { why: Some(why) } = state(&unschedulable) else {
            panic!()
        };
        assert!(why.starts_with("Unschedulable: 0/3 nodes"), "{why}");
        let running = pod(
            json!({"phase": "Running", "podIP": "10.1.2.3", "containerStatuses": [{
            "name": "kernel", "image": "x", "imageID": "", "ready": true, "restartCount": 0,
            "state": {"running": {}}}]}),
        );
        assert_eq!(
            state(&running),
            PodState::Running {
                ip: "10.1.2.3".to_owned()
            }
        );
        let evicted = pod(json!({"phase": "Failed", "reason": "Evicted",
            "message": "The node was low on resource: memory."}));
        let PodState::Ended { why } = state(&evicted) else {
            panic!()
        };
        assert_eq!(
            why,
            "the pod was evicted: Evicted: The node was low on resource: memory."
        );
        let oom = pod(json!({"phase": "Failed", "containerStatuses": [{
            "name": "kernel", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}));
        let PodState::Ended { why } = state(&oom) else {
            panic!()
        };
        assert!(why.contains("OOMKilled, exit code 137"), "{why}");
        assert!(hopeless("ErrImageNeverPull: x"));
        assert!(!hopeless("ImagePullBackOff: x"));
    }
}
