//! Request bodies, read whole before any handler runs: bounded in size and in time.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;

use super::api::ApiError;
use super::conn::BodyWatch;

/// What a request body may be (`--max-body-bytes`, `--body-timeout`).
#[derive(Clone, Copy, Default)]
pub struct BodyLimits {
    pub max_bytes: usize,
    pub timeout: Duration,
}

/// Past the limit, up to this much more is read and dropped before answering 413: a client
/// still sending when the connection closes gets a reset instead of the answer (the "lingering
/// close" of nginx and others). Beyond it the connection is simply closed after the answer.
const DISCARD_BYTES: usize = 64 << 20;

/// Why a body could not be had.
enum BodyError {
    TooLarge,
    Read(axum::Error),
}

/// Middleware: the body, at most `max_bytes` (413 beyond) and within `timeout` of the headers
/// (408 after, and the connection is closed), so a client that announces a body and never sends
/// it holds nothing for long.
pub async fn read_body(State(limits): State<BodyLimits>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let read = collect(body, limits.max_bytes);
    let read = tokio::time::timeout(limits.timeout, read).await;
    // The connection now has nothing more to receive for this request.
    if let Some(watch) = parts.extensions.get::<BodyWatch>() {
        watch.received();
    }
    let bytes = match read {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(BodyError::TooLarge)) => return too_large(limits.max_bytes).into_response(),
        Ok(Err(BodyError::Read(e))) => {
            return ApiError::bad_request(format!("cannot read the request body: {e}"))
                .into_response()
        }
        Err(_) => {
            let mut r = ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "the request body did not arrive within {} s (--body-timeout)",
                    limits.timeout.as_secs_f64()
                ),
            )
            .into_response();
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            return r;
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// Reads and drops the body of a request we refuse, so the client reads the refusal instead of
/// a reset (a close with its upload unread): at most `max_bytes`, none of it kept, for at most
/// 5 s. A body announced larger than `max_bytes` is not waited for.
pub async fn discard_body(req: Request, limits: BodyLimits) {
    let (parts, mut body) = req.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_none_or(|n| n <= limits.max_bytes as u64) {
        let drain = async {
            let mut seen = 0usize;
            while let Some(Ok(frame)) = body.frame().await {
                seen = seen.saturating_add(frame.data_ref().map_or(0, |d| d.len()));
                if seen > limits.max_bytes {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(limits.timeout.min(Duration::from_secs(5)), drain).await;
    }
    if let Some(watch) = parts.extensions.get::<BodyWatch>() {
        watch.received();
    }
}

/// Reads the whole body, or, once it passes `max`, reads on and drops up to [`DISCARD_BYTES`]
/// more so the client can finish sending and read the 413.
async fn collect(mut body: Body, max: usize) -> Result<Bytes, BodyError> {
    let mut kept: Vec<u8> = Vec::new();
    let mut seen = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(BodyError::Read)?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        seen = seen.saturating_add(data.len());
        if seen <= max {
            kept.extend_from_slice(data);
        } else {
            kept = Vec::new();
            if seen > max.saturating_add(DISCARD_BYTES) {
                break;
            }
        }
    }
    if seen > max {
        Err(BodyError::TooLarge)
    } else {
        Ok(Bytes::from(kept))
    }
}

fn too_large(max: usize) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        format!("the request body is too large: more than {max} bytes (--max-body-bytes)"),
    )
}
