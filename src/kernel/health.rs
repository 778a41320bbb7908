//! The sandbox backends' health, as readiness sees it: the checks of `cellgate doctor` for
//! every backend a policy uses, run in the background every [`CHECK_EVERY`], never on a
//! request: with a probe sandbox at the start and after a failure, the host's facts alone in
//! between; for microVMs always the host's facts alone (their probe is a VM boot).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Serialize;

use super::KernelManager;
use crate::sandbox::Backend;

/// How often the backends are checked again.
pub const CHECK_EVERY: Duration = Duration::from_secs(60);

/// One backend's last check.
#[derive(Debug, Clone, Serialize)]
pub struct BackendCheck {
    pub ok: bool,
    /// What failed (the doctor's words), when something did.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
}

/// The backends' last checks; `None` until the first has run.
#[derive(Default)]
pub struct Checks {
    last: Mutex<Option<BTreeMap<&'static str, BackendCheck>>>,
}

impl Checks {
    /// Checks the backends the policies use now, then every [`CHECK_EVERY`], for as long
    /// as the manager lives.
    pub fn spawn(kernels: &Arc<KernelManager>) -> Arc<Checks> {
        let checks = Arc::new(Checks::default());
        let (weak_checks, weak_kernels) = (Arc::downgrade(&checks), Arc::downgrade(kernels));
        tokio::spawn(async move {
            let mut failed_before = std::collections::HashSet::new();
            let mut first = true;
            loop {
                let Some(kernels) = weak_kernels.upgrade() else {
                    return;
                };
                let mut used: Vec<Backend> = Vec::new();
                for policy in kernels.policies().iter() {
                    let backend = kernels.backend_of(policy);
                    if !used.contains(&backend) {
                        used.push(backend);
                    }
                }
                // The manager is not held across the checks (a probe takes seconds): its
                // drop at shutdown must not wait for one.
                let diagnoser = kernels.diagnoser();
                drop(kernels);
                let mut results = BTreeMap::new();
                for backend in used {
                    let probe =
                        (first || failed_before.contains(&backend)) && backend.cheap_probe();
                    let diagnosis = diagnoser.diagnose(backend, probe).await;
                    if diagnosis.available {
                        failed_before.remove(&backend);
                    } else {
                        failed_before.insert(backend);
                    }
                    let problems: Vec<String> = diagnosis
                        .problems
                        .iter()
                        .map(|p| p.problem.clone())
                        .collect();
                    if !diagnosis.available {
                        tracing::warn!(backend = backend.as_str(), problems = ?problems, "readiness: backend check failed");
                    }
                    results.insert(
                        backend.as_str(),
                        BackendCheck {
                            ok: diagnosis.available,
                            problems,
                        },
                    );
                }
                let Some(checks) = weak_checks.upgrade() else {
                    return;
                };
                *checks.last.lock() = Some(results);
                drop(checks);
                first = false;
                tokio::time::sleep(CHECK_EVERY).await;
            }
        });
        checks
    }

    /// The last checks, by backend; `None` until the first has run.
    pub fn last(&self) -> Option<BTreeMap<&'static str, BackendCheck>> {
        self.last.lock().clone()
    }
}
