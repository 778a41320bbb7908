//! Token authentication, as Kernel Gateway does it and a little stricter: `?token=T`,
//! `Authorization: token T` or `Authorization: Bearer T`; the query wins when both are given;
//! an empty credential counts as none; comparison in constant time. CORS preflights are
//! answered before this layer runs.

use axum::extract::{Request, State};
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use super::api_error::ApiError;
use super::state::AppState;

/// Who a request comes from; `require_token` puts it in the request's extensions, so handlers
/// take `Extension<Principal>`.
///
/// Tenancy rule for every surface: a tenant sees only what it owns, and anything else answers
/// 404 exactly as a missing id would (never 403, which would confirm that the id exists).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Principal {
    /// The static token, or no token configured (loopback only): sees everything.
    Admin,
    /// A JWT bearer: one tenant, capped at the most permissive policy it may use.
    Tenant {
        tenant: String,
        subject: String,
        policy: String,
    },
}

impl Principal {
    /// The tenant that owns what this principal creates (`None` for the admin).
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Principal::Admin => None,
            Principal::Tenant { tenant, .. } => Some(tenant),
        }
    }

    /// Whether this principal may see something owned by `owner` (`None`: made by the admin).
    pub fn may_see(&self, owner: Option<&str>) -> bool {
        match self {
            Principal::Admin => true,
            Principal::Tenant { tenant, .. } => owner == Some(tenant.as_str()),
        }
    }
}

/// The credential a request presents, if any.
pub fn credential(request: &Request) -> Option<String> {
    let from_query = request.uri().query().and_then(|query| {
        query.split('&').find_map(|pair| {
            let (key, value) = pair.split_once('=')?;
            (key == "token").then(|| percent_decode(value))
        })
    });
    if let Some(token) = from_query.filter(|t| !t.is_empty()) {
        return Some(token);
    }
    let value = request
        .headers()
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    let scheme_ok = scheme.eq_ignore_ascii_case("token") || scheme.eq_ignore_ascii_case("bearer");
    (scheme_ok && !token.is_empty()).then(|| token.to_owned())
}

fn percent_decode(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `presented` is the configured token, in time independent of where they differ.
pub fn token_matches(expected: &str, presented: &str) -> bool {
    expected.as_bytes().ct_eq(presented.as_bytes()).into()
}

/// Rejects requests without the right token with 401 (OPTIONS passes: preflights carry no
/// credentials).
pub async fn require_token(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let Some(expected) = state.config.token.as_deref() else {
        request.extensions_mut().insert(Principal::Admin);
        return next.run(request).await;
    };
    if request.method() == Method::OPTIONS {
        return next.run(request).await;
    }
    match credential(&request) {
        Some(presented) if token_matches(expected, &presented) => {
            request.extensions_mut().insert(Principal::Admin);
            next.run(request).await
        }
        _ => ApiError::unauthorized().into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;

    fn req(uri: &str, auth: Option<&str>) -> Request {
        let mut builder = Request::builder().uri(uri);
        if let Some(a) = auth {
            builder = builder.header(header::AUTHORIZATION, a);
        }
        builder.body(Body::empty()).unwrap()
    }

    #[test]
    fn credentials_from_query_and_headers() {
        assert_eq!(
            credential(&req("/api?token=abc", None)).as_deref(),
            Some("abc")
        );
        assert_eq!(
            credential(&req("/api?a=1&token=a%2Bb", None)).as_deref(),
            Some("a+b")
        );
        assert_eq!(
            credential(&req("/api", Some("token xyz"))).as_deref(),
            Some("xyz")
        );
        assert_eq!(
            credential(&req("/api", Some("Bearer xyz"))).as_deref(),
            Some("xyz")
        );
        assert_eq!(credential(&req("/api", Some("Basic xyz"))), None);
        assert_eq!(credential(&req("/api", Some("token "))), None);
        assert_eq!(
            credential(&req("/api?token=", Some("token h"))).as_deref(),
            Some("h")
        );
        assert_eq!(
            credential(&req("/api?token=q", Some("token h"))).as_deref(),
            Some("q")
        );
        assert_eq!(credential(&req("/api?token=%", None)).as_deref(), Some("%"));
    }

    #[test]
    fn token_comparison() {
        assert!(token_matches("secret", "secret"));
        assert!(!token_matches("secret", "secreT"));
        assert!(!token_matches("secret", "secret2"));
        assert!(!token_matches("secret", ""));
    }
}
