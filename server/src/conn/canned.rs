//! hyper's own error answers, given the API's error body.
//!
//! When a request cannot be parsed (a bad request line or header, a `Content-Length` that is
//! not a number, headers beyond the cap), hyper answers by itself, before any service runs,
//! with an empty body (`400`, `431`, ...), and offers no hook to change it. Every other error
//! this server sends carries the OpenAI-style error object, which clients parse. So the
//! socket wrapper recognises hyper's answer on its way out, and only it: a complete head with
//! a status of 400 or more and `content-length: 0`, written while no request is with the
//! service (every answer of ours to a request the service saw has a body), and sends it with
//! the error object instead.

use axum::http::StatusCode;

use crate::api::ApiError;

/// The bytes to send in place of `head` when it is hyper's own error answer.
pub fn with_error_body(head: &[u8]) -> Option<Vec<u8>> {
    const EMPTY: &[u8] = b"\r\ncontent-length: 0\r\n";
    let status = head.strip_prefix(b"HTTP/1.1 ")?.get(..3)?;
    let status = StatusCode::from_bytes(status).ok()?;
    if status.as_u16() < 400 || !head.ends_with(b"\r\n\r\n") {
        return None;
    }
    let at = head.windows(EMPTY.len()).position(|w| w == EMPTY)?;
    let body = error_for(status).body().to_string();
    let mut out = Vec::with_capacity(head.len() + body.len() + 96);
    out.extend_from_slice(&head[..at]);
    out.extend_from_slice(
        format!(
            "\r\ncontent-type: application/json\r\nx-content-type-options: nosniff\r\ncontent-length: {}\r\n",
            body.len()
        )
        .as_bytes(),
    );
    out.extend_from_slice(&head[at + EMPTY.len()..]);
    out.extend_from_slice(body.as_bytes());
    Some(out)
}

/// What each of hyper's answers means, in the API's words.
fn error_for(status: StatusCode) -> ApiError {
    let message = match status.as_u16() {
        400 => "malformed HTTP request: a bad request line, header or Content-Length".to_string(),
        431 => format!(
            "the request's headers are too large (the limit is {} KiB)",
            super::tracker::MAX_HEAD_BYTES >> 10
        ),
        414 => "the request's URI is too long".to_string(),
        505 => "HTTP version not supported: use HTTP/1.1".to_string(),
        _ => status
            .canonical_reason()
            .unwrap_or("the request could not be read")
            .to_string(),
    };
    let kind = if status.is_client_error() {
        "invalid_request_error"
    } else {
        "server_error"
    };
    ApiError::new(status, kind, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hypers_empty_error_answers_get_the_error_object() {
        let head = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\ndate: Fri, 04 Dec 2026 14:16:16 GMT\r\n\r\n";
        let out = String::from_utf8(with_error_body(head).unwrap()).unwrap();
        let (h, body) = out.split_once("\r\n\r\n").unwrap();
        assert!(h.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"));
        assert!(h.contains("\r\nconnection: close\r\n"), "{h}");
        assert!(h.contains("\r\ncontent-type: application/json\r\n"), "{h}");
        assert!(h.contains(&format!("\r\ncontent-length: {}\r\n", body.len())));
        assert!(!h.contains("content-length: 0"), "{h}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(v["error"]["message"].as_str().unwrap().contains("64 KiB"));
    }

    #[test]
    fn other_writes_pass_untouched() {
        for head in [
            &b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"[..],
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 12\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n",
            b"data: {\"x\":1}\n\n",
            b"HTTP/1.1 4",
        ] {
            assert!(with_error_body(head).is_none(), "{head:?}");
        }
    }
}
