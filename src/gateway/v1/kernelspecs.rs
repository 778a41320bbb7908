//! `GET /v1/kernelspecs`: the kernels a caller may start, with the language each runs, so a
//! chat app can offer a choice and label code without speaking Jupyter's `/api/kernelspecs`
//! (whose models carry argv, resources and metadata a v1 client has no use for).
//!
//! Every kernelspec is listed: no policy restricts which kernelspec a caller starts (a
//! session's `kernel_name` is checked only for existing, `crate::kernel::manager`), so there
//! is nothing to filter; should policies ever name kernelspecs, this list must follow.

use axum::extract::State;
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use crate::gateway::state::AppState;

/// One kernelspec as API v1 lists it.
#[derive(Debug, Clone, Serialize, serde::Deserialize, ToSchema)]
pub struct Kernelspec {
    /// What `kernel_name` takes at `POST /v1/sessions`.
    pub name: String,
    pub display_name: String,
    /// The kernel's language (`python`, `typescript`, `bash`, `R`…), as its kernelspec says.
    pub language: String,
}

/// `GET /v1/kernelspecs`.
#[derive(Debug, Clone, Serialize, serde::Deserialize, ToSchema)]
pub struct Kernelspecs {
    /// The kernelspec a session gets when it names none.
    pub default: String,
    /// By name.
    pub kernelspecs: Vec<Kernelspec>,
}

/// The kernels a session may run, and which one it gets by default.
#[utoipa::path(get, path = "/v1/kernelspecs", tag = "sessions", operation_id = "list_kernelspecs",
    responses((status = 200, body = Kernelspecs)))]
pub async fn list(State(state): State<AppState>) -> Json<Kernelspecs> {
    let specs = state.kernels.specs();
    Json(Kernelspecs {
        default: specs.default_name().to_owned(),
        kernelspecs: specs
            .iter()
            .map(|spec| Kernelspec {
                name: spec.name.clone(),
                display_name: spec.display_name.clone(),
                language: spec.language.clone(),
            })
            .collect(),
    })
}
