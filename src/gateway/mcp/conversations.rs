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
//! - **A cap per tenant, and one for the gateway.** A session rmcp opens is counted
//!   against its tenant's cap ([`crate::tenants::Tenants::max_mcp_sessions`]) and the
//!   gateway's, under one lock, before its id reaches the client; past either it is closed
//!   again and the open refused, so concurrent opens cannot overshoot. The gateway's cap
//!   stays below what the cache of openers holds, so no opener is ever evicted for room.
//! - **One record.** Whenever the gateway forgets an opener (the opener's `DELETE`, rmcp
//!   answering that the session is gone, or idle expiry a minute after rmcp's own 2 h), it
//!   also closes the session in rmcp, gives the slot back and deletes the cellgate session
//!   the tools made for the conversation, as its opener (marked ended, so a racing tool call
//!   cannot make a kernel nobody deletes): a client that reconnects leaves no idle
//!   kernel behind, and no session lives on in rmcp that the gateway no longer counts.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use moka::notification::RemovalCause;
use parking_lot::Mutex;

use crate::gateway::auth::Principal;
use crate::ids::SessionId;

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

/// A conversation's default cellgate session.
#[derive(Debug, Default)]
pub struct DefaultSession {
    /// `None` until a tool makes one.
    pub id: Option<SessionId>,
    /// The conversation's sessions of other kernelspecs (`run_code` in another language),
    /// by kernelspec name.
    pub others: std::collections::BTreeMap<String, SessionId>,
    /// The policy `new_session` asked for: the conversation's later sessions get it too.
    pub policy: Option<String>,
    /// The conversation has ended: no tool may make a session for it any more (one made
    /// after its end would never be deleted).
    pub ended: bool,
}

/// Each conversation's default session, behind a lock of its own.
pub type Defaults = moka::sync::Cache<Conversation, Arc<tokio::sync::Mutex<DefaultSession>>>;

/// What the end of a conversation does outside this module.
#[derive(Clone)]
pub struct Hooks {
    /// Closes MCP session `id` in rmcp (a no-op for one rmcp no longer has).
    pub close_mcp_session: Arc<dyn Fn(String) + Send + Sync>,
    /// Deletes cellgate session `id` as `principal`.
    pub delete_session: Arc<dyn Fn(Principal, SessionId) + Send + Sync>,
}

/// Why an MCP session cannot be opened.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConversationError {
    #[error("tenant {tenant:?} has {open} open MCP sessions, its limit: end one (DELETE /mcp with its Mcp-Session-Id) or let one expire")]
    TooMany { tenant: String, open: usize },
    #[error("the gateway holds {open} open MCP sessions, as many as it keeps: try again later")]
    Full { open: usize },
}

/// The opener of one MCP session.
#[derive(Clone)]
struct Opener {
    caller: Caller,
    /// What the conversation's default session is deleted as when it ends.
    principal: Principal,
}

/// Open MCP sessions, in all and per tenant.
#[derive(Default)]
struct Counts {
    total: usize,
    per_tenant: HashMap<String, usize>,
}

impl Counts {
    fn release(&mut self, caller: &Caller) {
        self.total = self.total.saturating_sub(1);
        if let Some(tenant) = caller.tenant() {
            if let Some(count) = self.per_tenant.get_mut(tenant) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    self.per_tenant.remove(tenant);
                }
            }
        }
    }
}

/// The MCP sessions this gateway vouches for, their openers and the counts.
#[derive(Clone)]
pub struct Conversations {
    openers: moka::sync::Cache<String, Opener>,
    counts: Arc<Mutex<Counts>>,
    /// The most open at once, for the whole gateway.
    capacity: usize,
    hooks: Hooks,
}

/// Room the cache of openers keeps beyond [`Conversations`]' capacity: moka evicts by an
/// estimate, and an opener must never be evicted to make room.
const CACHE_SLACK: u64 = 1024;

impl Conversations {
    /// `idle`: how long an unused MCP session is remembered (a little longer than rmcp keeps
    /// it, so rmcp ends it first); `capacity`: the most open at once.
    pub fn new(idle: Duration, capacity: usize, defaults: Defaults, hooks: Hooks) -> Conversations {
        let counts: Arc<Mutex<Counts>> = Arc::default();
        let listener_counts = counts.clone();
        let listener_hooks = hooks.clone();
        let openers = moka::sync::Cache::builder()
            .max_capacity(capacity as u64 + CACHE_SLACK)
            .time_to_idle(idle)
            .eviction_listener(move |id: Arc<String>, opener: Opener, cause| {
                listener_counts.lock().release(&opener.caller);
                // A replaced entry is the same session still open (and counted again).
                if cause == RemovalCause::Replaced {
                    return;
                }
                (listener_hooks.close_mcp_session)(id.as_ref().clone());
                let conversation = (opener.caller, id.as_ref().clone());
                let Some(slot) = defaults.remove(&conversation) else {
                    return;
                };
                let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                    // Every cache call is made on the gateway's runtime; should one not be,
                    // the session is left to the idle cull.
                    tracing::warn!(mcp_session = %id, "an MCP conversation ended off the runtime: its session is left to the idle cull");
                    return;
                };
                let delete = listener_hooks.delete_session.clone();
                let principal = opener.principal;
                runtime.spawn(async move {
                    // The lock: a tool call making the session finishes first, and none
                    // makes one after this.
                    let mut state = slot.lock().await;
                    state.ended = true;
                    let others = std::mem::take(&mut state.others).into_values();
                    for session in state.id.take().into_iter().chain(others) {
                        delete(principal.clone(), session);
                    }
                });
            })
            .build();
        Conversations {
            openers,
            counts,
            capacity,
            hooks,
        }
    }

    /// Whether `caller` opened MCP session `id` (false for an id never issued or ended).
    pub fn is_openers(&self, id: &str, caller: &Caller) -> bool {
        self.openers.get(id).is_some_and(|o| &o.caller == caller)
    }

    /// Counts the session rmcp just opened for `principal` (`limit`: its tenant's cap; the
    /// admin has none) and remembers its opener; past a cap, closes it and says why.
    pub fn open(
        &self,
        id: &str,
        principal: &Principal,
        limit: usize,
    ) -> Result<(), ConversationError> {
        let caller = Caller::of(principal);
        // Expired sessions give their slots back first.
        self.openers.run_pending_tasks();
        let refused = {
            let mut counts = self.counts.lock();
            let tenant_open = caller.tenant().map_or(0, |tenant| {
                counts.per_tenant.get(tenant).copied().unwrap_or(0)
            });
            if counts.total >= self.capacity {
                Some(ConversationError::Full { open: counts.total })
            } else if let Some(tenant) = caller.tenant().filter(|_| tenant_open >= limit) {
                Some(ConversationError::TooMany {
                    tenant: tenant.to_owned(),
                    open: tenant_open,
                })
            } else {
                counts.total += 1;
                if let Some(tenant) = caller.tenant() {
                    *counts.per_tenant.entry(tenant.to_owned()).or_default() += 1;
                }
                None
            }
        };
        if let Some(error) = refused {
            (self.hooks.close_mcp_session)(id.to_owned());
            return Err(error);
        }
        self.openers.insert(
            id.to_owned(),
            Opener {
                caller,
                principal: principal.clone(),
            },
        );
        Ok(())
    }

    /// The session ended (its opener's `DELETE`) or is gone from rmcp.
    pub fn ended(&self, id: &str) {
        self.openers.invalidate(id);
        self.openers.run_pending_tasks();
    }

    /// Open sessions of `tenant`, and in all.
    #[cfg(test)]
    fn open_of(&self, tenant: &str) -> (usize, usize) {
        self.openers.run_pending_tasks();
        let counts = self.counts.lock();
        (
            counts.per_tenant.get(tenant).copied().unwrap_or(0),
            counts.total,
        )
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

    /// What the hooks were called with.
    #[derive(Default)]
    struct Seen {
        closed: Mutex<Vec<String>>,
        deleted: Mutex<Vec<String>>,
    }

    fn conversations(idle: Duration, capacity: usize) -> (Conversations, Defaults, Arc<Seen>) {
        let seen = Arc::new(Seen::default());
        let defaults: Defaults = moka::sync::Cache::new(100);
        let (closed, deleted) = (seen.clone(), seen.clone());
        let hooks = Hooks {
            close_mcp_session: Arc::new(move |id| closed.closed.lock().push(id)),
            delete_session: Arc::new(move |_, session: SessionId| {
                deleted.deleted.lock().push(session.to_string())
            }),
        };
        (
            Conversations::new(idle, capacity, defaults.clone(), hooks),
            defaults,
            seen,
        )
    }

    const HOUR: Duration = Duration::from_secs(3600);
    /// Two cellgate sessions' ids.
    const KERNEL_1: &str = "00000000-0000-4000-8000-000000000001";
    const KERNEL_2: &str = "00000000-0000-4000-8000-000000000002";
    const KERNEL_3: &str = "00000000-0000-4000-8000-000000000003";

    fn with_default(defaults: &Defaults, principal: &Principal, id: &str, session: &str) {
        defaults.insert(
            (Caller::of(principal), id.to_owned()),
            Arc::new(tokio::sync::Mutex::new(DefaultSession {
                id: Some(SessionId::parse(session).unwrap()),
                others: Default::default(),
                policy: None,
                ended: false,
            })),
        );
    }

    async fn eventually(what: impl Fn() -> bool) -> bool {
        for _ in 0..200 {
            if what() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    #[test]
    fn separators_in_claims_do_not_make_two_callers_one() {
        let a = Caller::of(&tenant("t", "u:x"));
        let b = Caller::of(&tenant("t:u", "x"));
        assert_ne!(a, b);
        let (conversations, _, _) = conversations(HOUR, 100);
        conversations
            .open("s1", &tenant("t", "u:x"), 10)
            .expect("open");
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
        let (conversations, _, seen) = conversations(HOUR, 100);
        let alice = tenant("acme", "alice");
        conversations.open("s1", &alice, 2).expect("first");
        conversations.open("s2", &alice, 2).expect("second");
        assert_eq!(
            conversations.open("s3", &alice, 2),
            Err(ConversationError::TooMany {
                tenant: "acme".to_owned(),
                open: 2
            })
        );
        assert_eq!(
            *seen.closed.lock(),
            ["s3"],
            "a refused session is closed in rmcp"
        );
        assert!(!conversations.is_openers("s3", &Caller::of(&alice)));
        // Another tenant, and the admin, are not counted against acme.
        assert!(conversations
            .open("g1", &tenant("globex", "bob"), 2)
            .is_ok());
        assert!(conversations.open("a1", &Principal::Admin, 0).is_ok());
        assert_eq!(conversations.open_of("acme"), (2, 4));
        conversations.ended("s1");
        assert_eq!(conversations.open_of("acme"), (1, 3));
        assert!(
            !conversations.is_openers("s1", &Caller::of(&alice)),
            "ended is nobody's"
        );
        assert!(conversations.open("s4", &alice, 2).is_ok());
    }

    #[test]
    fn the_gateway_cap_holds_for_everyone() {
        let (conversations, _, seen) = conversations(HOUR, 2);
        conversations.open("a1", &Principal::Admin, 0).expect("one");
        conversations
            .open("t1", &tenant("acme", "alice"), 10)
            .expect("two");
        assert_eq!(
            conversations.open("a2", &Principal::Admin, 0),
            Err(ConversationError::Full { open: 2 })
        );
        assert_eq!(*seen.closed.lock(), ["a2"]);
    }

    #[tokio::test]
    async fn an_ended_conversation_ends_its_default_session_and_no_other() {
        let (conversations, defaults, seen) = conversations(HOUR, 100);
        let alice = tenant("acme", "alice");
        conversations.open("s1", &alice, 5).expect("open");
        conversations.open("s2", &alice, 5).expect("open");
        with_default(&defaults, &alice, "s1", KERNEL_1);
        with_default(&defaults, &alice, "s2", KERNEL_2);
        let s1 = defaults
            .get(&(Caller::of(&alice), "s1".to_owned()))
            .expect("s1's");
        // Its session of another language (run_code) ends with it too.
        s1.lock()
            .await
            .others
            .insert("deno".to_owned(), SessionId::parse(KERNEL_3).unwrap());
        conversations.ended("s1");
        assert!(eventually(|| seen.deleted.lock().len() >= 2).await);
        assert_eq!(
            *seen.deleted.lock(),
            [KERNEL_1, KERNEL_3],
            "only the ended one's"
        );
        assert_eq!(*seen.closed.lock(), ["s1"]);
        assert!(
            s1.lock().await.ended,
            "no tool may make it a session any more"
        );
        assert!(defaults
            .get(&(Caller::of(&alice), "s2".to_owned()))
            .is_some());
    }

    #[tokio::test]
    async fn an_idle_conversation_expires_whole() {
        let (conversations, defaults, seen) = conversations(Duration::from_millis(50), 100);
        let alice = tenant("acme", "alice");
        conversations.open("s1", &alice, 1).expect("open");
        with_default(&defaults, &alice, "s1", KERNEL_1);
        assert_eq!(conversations.open_of("acme"), (1, 1));
        tokio::time::sleep(Duration::from_millis(120)).await;
        assert_eq!(conversations.open_of("acme"), (0, 0), "its slot is back");
        assert!(!conversations.is_openers("s1", &Caller::of(&alice)));
        assert!(eventually(|| !seen.deleted.lock().is_empty()).await);
        assert_eq!(*seen.deleted.lock(), [KERNEL_1]);
        assert_eq!(*seen.closed.lock(), ["s1"], "and rmcp forgets it too");
        assert!(conversations.open("s2", &alice, 1).is_ok());
    }
}
