//! Who each MCP session belongs to, how many a tenant may hold, and the end of a
//! conversation's kernel.
//!
//! rmcp accepts any request that names a live `Mcp-Session-Id`, whoever sends it. This
//! module is what makes an MCP session its opener's:
//!
//! - **The opener is a pair, never a joined string.** A [`Caller`] is the admin or one
//!   (tenant, subject) pair. JWT claims may contain any separator, so a key such as
//!   `tenant:{tenant}:{subject}` would make tenant `t` with subject `u:x` the same caller as
//!   tenant `t:u` with subject `x`.
//! - **Unknown means nobody's.** A request naming a session this gateway has no opener for
//!   (never issued, ended, or forgotten) is handed on exactly as one naming another caller's
//!   session: with an id that names no session, so rmcp answers "no such session" and the
//!   client starts a new one. Nothing is let through for want of an entry.
//! - **A cap per tenant.** Opening a session takes one of the tenant's slots
//!   ([`crate::tenants::Tenants::max_mcp_sessions`]) before rmcp sees the request, so
//!   concurrent opens cannot overshoot; ending or expiring gives it back.
//! - **A conversation's kernel ends with it.** When an MCP session ends (its client's
//!   `DELETE`, or idle expiry a little after rmcp's own), the cellgate session the tools made
//!   for it is deleted, as its opener: a client that reconnects leaves no idle kernel behind.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use moka::notification::RemovalCause;
use parking_lot::Mutex;

use crate::gateway::auth::Principal;

/// Who calls: the admin, or one subject of one tenant.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Caller {
    Admin,
    Tenant { tenant: String, subject: String },
}

impl Caller {
    pub fn of(principal: &Principal) -> Caller {
        match principal {
            Principal::Admin => Caller::Admin,
            Principal::Tenant {
                tenant, subject, ..
            } => Caller::Tenant {
                tenant: tenant.clone(),
                subject: subject.clone(),
            },
        }
    }

    fn tenant(&self) -> Option<&str> {
        match self {
            Caller::Admin => None,
            Caller::Tenant { tenant, .. } => Some(tenant),
        }
    }
}

/// One conversation: a caller and its MCP session id (empty for a client that keeps none).
pub type Conversation = (Caller, String);

/// Each conversation's default cellgate session, behind a lock of its own.
pub type Defaults = moka::sync::Cache<Conversation, Arc<tokio::sync::Mutex<Option<String>>>>;

/// What is done with a conversation's default session when the conversation ends: called
/// with the opener's principal and the session id.
pub type EndSession = Arc<dyn Fn(Principal, String) + Send + Sync>;

/// Why an MCP session cannot be opened.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConversationError {
    #[error("tenant {tenant:?} has {open} open MCP sessions, its limit: end one (DELETE /mcp with its Mcp-Session-Id) or let one expire")]
    TooMany { tenant: String, open: usize },
}

/// The opener of one MCP session.
#[derive(Clone)]
struct Opener {
    caller: Caller,
    /// What the conversation's default session is deleted as when it ends.
    principal: Principal,
}

/// The MCP sessions this gateway issued, their openers and each tenant's count.
#[derive(Clone)]
pub struct Conversations {
    openers: moka::sync::Cache<String, Opener>,
    /// Open MCP sessions (and opens under way) per tenant.
    open: Arc<Mutex<HashMap<String, usize>>>,
}

/// A tenant's slot, taken for an MCP session being opened: given back when dropped unless
/// [`Conversations::opened`] hands it to the new session.
pub struct Slot {
    open: Arc<Mutex<HashMap<String, usize>>>,
    tenant: Option<String>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(tenant) = self.tenant.take() {
            release(&self.open, &tenant);
        }
    }
}

fn release(open: &Mutex<HashMap<String, usize>>, tenant: &str) {
    let mut open = open.lock();
    if let Some(count) = open.get_mut(tenant) {
        *count = count.saturating_sub(1);
        if *count == 0 {
            open.remove(tenant);
        }
    }
}

impl Conversations {
    /// `idle`: how long an unused MCP session is remembered (a little longer than rmcp keeps
    /// it, so rmcp always ends it first); `capacity`: the most remembered at once.
    pub fn new(
        idle: Duration,
        capacity: u64,
        defaults: Defaults,
        end_session: EndSession,
    ) -> Conversations {
        let open: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let counts = open.clone();
        let openers = moka::sync::Cache::builder()
            .max_capacity(capacity)
            .time_to_idle(idle)
            .eviction_listener(move |id: Arc<String>, opener: Opener, cause| {
                if let Some(tenant) = opener.caller.tenant() {
                    release(&counts, tenant);
                }
                // A replaced entry is the same session still open.
                if cause == RemovalCause::Replaced {
                    return;
                }
                let conversation = (opener.caller, id.as_ref().clone());
                if let Some(slot) = defaults.remove(&conversation) {
                    // The lock: a tool call that is making the session finishes first.
                    let end = end_session.clone();
                    let principal = opener.principal;
                    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                        runtime.spawn(async move {
                            if let Some(session) = slot.lock().await.take() {
                                end(principal, session);
                            }
                        });
                    }
                }
            })
            .build();
        Conversations { openers, open }
    }

    /// Whether `caller` opened MCP session `id` (false for an id never issued or ended).
    pub fn is_openers(&self, id: &str, caller: &Caller) -> bool {
        self.openers.get(id).is_some_and(|o| &o.caller == caller)
    }

    /// Takes one of the tenant's slots for a session about to be opened (the admin has no
    /// cap), or says why not.
    pub fn reserve(&self, caller: &Caller, limit: usize) -> Result<Slot, ConversationError> {
        let Some(tenant) = caller.tenant() else {
            return Ok(Slot {
                open: self.open.clone(),
                tenant: None,
            });
        };
        // Expired sessions give their slots back first.
        self.openers.run_pending_tasks();
        let mut open = self.open.lock();
        let count = open.entry(tenant.to_owned()).or_default();
        if *count >= limit {
            return Err(ConversationError::TooMany {
                tenant: tenant.to_owned(),
                open: *count,
            });
        }
        *count += 1;
        Ok(Slot {
            open: self.open.clone(),
            tenant: Some(tenant.to_owned()),
        })
    }

    /// Records the session rmcp issued for `principal`, which keeps `slot`.
    pub fn opened(&self, id: &str, principal: &Principal, mut slot: Slot) {
        // The entry owns the slot now: its removal gives it back.
        slot.tenant = None;
        self.openers.insert(
            id.to_owned(),
            Opener {
                caller: Caller::of(principal),
                principal: principal.clone(),
            },
        );
    }

    /// The session's opener ended it.
    pub fn ended(&self, id: &str) {
        self.openers.invalidate(id);
        self.openers.run_pending_tasks();
    }

    /// Open sessions (and opens under way) of `tenant`.
    #[cfg(test)]
    fn open_of(&self, tenant: &str) -> usize {
        self.openers.run_pending_tasks();
        self.open.lock().get(tenant).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(tenant: &str, subject: &str) -> Principal {
        Principal::Tenant {
            tenant: tenant.to_owned(),
            subject: subject.to_owned(),
            policy: "default".to_owned(),
        }
    }

    fn conversations(ended: Arc<Mutex<Vec<String>>>) -> (Conversations, Defaults) {
        let defaults: Defaults = moka::sync::Cache::new(100);
        let end: EndSession = Arc::new(move |_, session| ended.lock().push(session));
        (
            Conversations::new(Duration::from_secs(3600), 100, defaults.clone(), end),
            defaults,
        )
    }

    #[test]
    fn separators_in_claims_do_not_make_two_callers_one() {
        let a = Caller::of(&tenant("t", "u:x"));
        let b = Caller::of(&tenant("t:u", "x"));
        assert_ne!(a, b);
        let (conversations, _) = conversations(Arc::default());
        let slot = conversations.reserve(&a, 10).unwrap();
        conversations.opened("s1", &tenant("t", "u:x"), slot);
        assert!(conversations.is_openers("s1", &a));
        assert!(!conversations.is_openers("s1", &b));
        assert!(!conversations.is_openers("s1", &Caller::Admin));
        assert!(
            !conversations.is_openers("never-issued", &a),
            "unknown is nobody's"
        );
    }

    #[test]
    fn a_tenant_is_capped_and_ending_gives_slots_back() {
        let (conversations, _) = conversations(Arc::default());
        let alice = tenant("acme", "alice");
        let caller = Caller::of(&alice);
        let first = conversations.reserve(&caller, 2).unwrap();
        let second = conversations.reserve(&caller, 2).unwrap();
        assert_eq!(
            conversations.reserve(&caller, 2).err(),
            Some(ConversationError::TooMany {
                tenant: "acme".to_owned(),
                open: 2
            }),
            "opens under way count"
        );
        // Another tenant, and the admin, are not counted against acme.
        assert!(conversations
            .reserve(&Caller::of(&tenant("globex", "bob")), 2)
            .is_ok());
        assert!(conversations.reserve(&Caller::Admin, 0).is_ok());
        // A reservation that issued nothing gives its slot back.
        drop(second);
        assert_eq!(conversations.open_of("acme"), 1);
        conversations.opened("s1", &alice, first);
        assert_eq!(
            conversations.open_of("acme"),
            1,
            "the session keeps its slot"
        );
        let third = conversations.reserve(&caller, 2).unwrap();
        conversations.opened("s2", &alice, third);
        assert!(conversations.reserve(&caller, 2).is_err());
        conversations.ended("s1");
        assert_eq!(conversations.open_of("acme"), 1);
        assert!(
            !conversations.is_openers("s1", &caller),
            "ended is nobody's"
        );
        assert!(conversations.reserve(&caller, 2).is_ok());
    }

    #[tokio::test]
    async fn an_ended_conversation_ends_its_default_session() {
        let ended = Arc::new(Mutex::new(Vec::new()));
        let (conversations, defaults) = conversations(ended.clone());
        let alice = tenant("acme", "alice");
        let caller = Caller::of(&alice);
        let slot = conversations.reserve(&caller, 5).unwrap();
        conversations.opened("s1", &alice, slot);
        let slot = conversations.reserve(&caller, 5).unwrap();
        conversations.opened("s2", &alice, slot);
        for (id, session) in [("s1", "kernel-1"), ("s2", "kernel-2")] {
            defaults.insert(
                (caller.clone(), id.to_owned()),
                Arc::new(tokio::sync::Mutex::new(Some(session.to_owned()))),
            );
        }
        conversations.ended("s1");
        for _ in 0..100 {
            if !ended.lock().is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(*ended.lock(), ["kernel-1"], "only the ended conversation's");
        assert!(defaults.get(&(caller.clone(), "s2".to_owned())).is_some());
    }
}
