//! Who may use the server: the API key (compared in constant time, checked before a body is
//! read; `/health` is open), and binding beyond loopback only with a key.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::api::ApiError;
use super::body::discard_body;
use crate::error::{Result, ServeError};
use crate::AppState;

/// Middleware: every route but `/health` and the web page's files needs the key when one is
/// set, checked before the body is read.
pub(super) async fn require_key(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path();
    let open = path == "/health" || (state.webui && super::webui::is_page(path));
    if !open {
        if let Err(e) = check_key(state.api_key.as_deref(), req.headers()) {
            // The body is read and dropped (bounded), not kept: the client gets its 401
            // instead of a reset from a close with its upload unread.
            discard_body(req, state.body).await;
            return e.into_response();
        }
    }
    next.run(req).await
}

/// `Authorization: Bearer KEY` against the server's key (if it has one): 401 when missing or
/// wrong.
pub(super) fn check_key(key: Option<&str>, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = key else {
        return Ok(());
    };
    let unauthorized = |why: &str| {
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            format!("{why}: send the header 'Authorization: Bearer <API key>'"),
        ))
    };
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return unauthorized("missing API key");
    };
    // The scheme is case-insensitive (RFC 9110); a missing header is never an empty key.
    let given = value.as_bytes();
    let token = match given.get(..7) {
        Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => &given[7..],
        _ => return unauthorized("wrong API key"),
    };
    if !key.is_empty() && constant_time_eq(token, key.as_bytes()) {
        Ok(())
    } else {
        unauthorized("wrong API key")
    }
}

/// Compares without an early exit, so the time taken does not tell how much of a guess matched.
/// (The length may show; the content does not.)
pub(super) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// Refuses an empty API key (it would match nothing sent, or look like protection while being
/// none) and an address beyond loopback without a key. Called before the model loads.
pub fn check_access(host: IpAddr, api_key: Option<&str>) -> Result<()> {
    if api_key.is_some_and(|k| k.is_empty()) {
        return Err(ServeError::Config(
            "--api-key must not be empty: pass a secret, or leave the flag out on loopback".into(),
        ));
    }
    // HTTP trims spaces around header values and carries only visible ASCII in a bearer token:
    // such a key could never be matched.
    if api_key.is_some_and(|k| !k.bytes().all(|b| b.is_ascii_graphic())) {
        return Err(ServeError::Config(
            "--api-key must be visible ASCII characters only (no spaces or control characters)"
                .into(),
        ));
    }
    if !host.is_loopback() && api_key.is_none() {
        return Err(ServeError::Config(format!(
            "binding to {host} exposes the server beyond this machine: pass --api-key (or bind 127.0.0.1)"
        )));
    }
    Ok(())
}
