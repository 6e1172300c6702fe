//! Which web pages may call the server from a browser (CORS), and which host names it answers
//! to. Pages served from a loopback origin (`http://localhost:3000`, `http://127.0.0.1:5173`)
//! and the server's own page are allowed, as ollama allows them; other origins only when named
//! with `--cors-origin` (`*`, any origin, only together with `--api-key`). A request from any
//! other origin is refused with 403 before it is read, preflights are answered here (before
//! the API key is asked for: browsers send none with them).
//!
//! A server bound to loopback answers only to loopback host names and IP addresses: a page on
//! `http://evil.example` whose name is made to resolve to 127.0.0.1 (DNS rebinding) reaches
//! the port as its own origin, and only the `Host` header it sends gives it away.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::api::ApiError;
use super::body::{discard_body, BodyLimits};
use crate::error::{Error, Result};

/// The origins allowed beyond loopback, and whether host names are checked.
#[derive(Clone, Default)]
pub struct Cors {
    /// How a refused request's body is read and dropped.
    body: Option<BodyLimits>,
    origins: Vec<String>,
    any: bool,
    /// Bound to loopback: only loopback host names are answered.
    loopback_only: bool,
}

impl Cors {
    /// `--cors-origin` values (each `scheme://host[:port]`, or `*`), checked.
    pub fn new(origins: &[String], host: IpAddr, api_key: Option<&str>) -> Result<Cors> {
        let mut cors = Cors {
            loopback_only: host.is_loopback(),
            ..Cors::default()
        };
        for o in origins {
            if o == "*" {
                if api_key.is_none() {
                    return Err(Error::msg(
                        "--cors-origin '*' lets any web page call the server: it needs --api-key",
                    ));
                }
                cors.any = true;
            } else if let Some(origin) = parse_origin(o) {
                cors.origins.push(origin);
            } else {
                return Err(Error::msg(format!(
                    "--cors-origin '{o}' is not an origin: give scheme://host[:port] (http://example.com:3000), or '*'"
                )));
            }
        }
        Ok(cors)
    }

    /// Refused requests' bodies are read (bounded) and dropped, so that the client reads its
    /// 403 instead of a reset.
    pub(super) fn with_body_limits(mut self, limits: BodyLimits) -> Cors {
        self.body = Some(limits);
        self
    }

    /// A 403 for the request, its body drained first.
    async fn refuse(&self, req: Request, message: String) -> Response {
        if let Some(limits) = self.body {
            discard_body(req, limits).await;
        }
        ApiError::new(StatusCode::FORBIDDEN, "forbidden", message).into_response()
    }

    fn allows(&self, origin: &str, host: Option<&str>) -> bool {
        self.any
            || is_loopback_origin(origin)
            || self.origins.iter().any(|o| o.eq_ignore_ascii_case(origin))
            // The server's own page (its origin is the address the browser used).
            || host.is_some_and(|h| {
                origin.eq_ignore_ascii_case(&format!("http://{h}"))
                    || origin.eq_ignore_ascii_case(&format!("https://{h}"))
            })
    }
}

/// `scheme://host[:port]` lowercased without a trailing slash, or `None`.
fn parse_origin(s: &str) -> Option<String> {
    let s = s.trim_end_matches('/');
    let (scheme, rest) = s.split_once("://")?;
    let ok = matches!(scheme, "http" | "https")
        && !rest.is_empty()
        && !rest.contains(['/', '?', '#', '@', ' '])
        && host_name(rest).is_some_and(|h| !h.is_empty());
    ok.then(|| s.to_ascii_lowercase())
}

/// The host of `host[:port]` (`[::1]:8080` → `::1`).
fn host_name(authority: &str) -> Option<&str> {
    if let Some(rest) = authority.strip_prefix('[') {
        let (ip, after) = rest.split_once(']')?;
        return (after.is_empty() || after.starts_with(':')).then_some(ip);
    }
    Some(authority.split(':').next().unwrap_or(authority))
}

/// `localhost`, `*.localhost` or a loopback address.
fn is_loopback_host(host: &str) -> bool {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    host == "localhost"
        || host.ends_with(".localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn is_loopback_origin(origin: &str) -> bool {
    let Some((scheme, rest)) = origin.split_once("://") else {
        return false;
    };
    matches!(scheme, "http" | "https") && host_name(rest).is_some_and(is_loopback_host)
}

/// A host name a loopback-bound server answers to: loopback names, any IP address (an address
/// cannot be rebound), and names only this machine or network resolves (a name without a dot,
/// such as the machine's own, `.local`, `.internal`): a rebinding page needs a public domain.
fn answers_to(host: &str) -> bool {
    let Some(name) = host_name(host) else {
        return false;
    };
    let lower = name.trim_end_matches('.').to_ascii_lowercase();
    is_loopback_host(name)
        || lower.parse::<IpAddr>().is_ok()
        || !lower.contains('.')
        || lower.ends_with(".local")
        || lower.ends_with(".internal")
}

/// Middleware, outermost: the host check, the origin check, preflights, and the
/// `Access-Control-Allow-Origin` header on allowed cross-origin answers.
pub(super) async fn cors(State(cors): State<Arc<Cors>>, req: Request, next: Next) -> Response {
    let headers = req.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    if let Some(h) = host
        .as_deref()
        .filter(|h| cors.loopback_only && !answers_to(h))
    {
        let message = format!(
            "host '{h}' is not this server: a server on loopback answers to localhost, IP addresses and local names only"
        );
        return cors.refuse(req, message).await;
    }
    let Some(origin) = headers.get(header::ORIGIN).cloned() else {
        return next.run(req).await;
    };
    let text = origin.to_str().unwrap_or("").to_string();
    if !cors.allows(&text, host.as_deref()) {
        let message = format!(
            "origin '{text}' may not call this server: start refusion serve with --cors-origin {text}"
        );
        return cors.refuse(req, message).await;
    }
    let preflight = req.method() == Method::OPTIONS
        && headers.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let mut res = if preflight {
        preflight_answer(req.headers())
    } else {
        next.run(req).await
    };
    let h = res.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.append(header::VARY, HeaderValue::from_static("Origin"));
    res
}

/// 204 with the methods and headers the API takes.
fn preflight_answer(headers: &HeaderMap) -> Response {
    let mut res = StatusCode::NO_CONTENT.into_response();
    let h = res.headers_mut();
    h.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, HEAD, POST, OPTIONS"),
    );
    let asked = headers
        .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
        .cloned()
        .unwrap_or(HeaderValue::from_static("authorization, content-type"));
    h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked);
    h.insert(
        header::ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from_static("600"),
    );
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_and_hosts() {
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let c = Cors::new(&["https://app.example.com/".into()], lo, None).unwrap();
        assert!(c.allows("http://localhost:3000", None));
        assert!(c.allows("http://127.0.0.1:5173", None));
        assert!(c.allows("http://[::1]:8080", None));
        assert!(c.allows("https://app.example.com", None));
        assert!(!c.allows("https://app.example.com.evil.net", None));
        assert!(!c.allows("http://evil.example", None));
        assert!(!c.allows("null", None));
        assert!(c.allows("http://10.0.0.5:8080", Some("10.0.0.5:8080")));
        assert!(!c.allows("http://localhost.evil.net", None));
        assert!(Cors::new(&["*".into()], lo, None).is_err());
        assert!(Cors::new(&["*".into()], lo, Some("k"))
            .unwrap()
            .allows("http://x.y", None));
        for bad in ["example.com", "ftp://x", "http://", "http://a/b"] {
            assert!(Cors::new(&[bad.into()], lo, None).is_err(), "{bad}");
        }
        assert!(answers_to("localhost:8080") && answers_to("127.0.0.1:1") && answers_to("[::1]:2"));
        assert!(answers_to("192.168.1.2:80") && answers_to("box.local") && answers_to("mybox:80"));
        assert!(!answers_to("evil.example:8080") && !answers_to("localhost.evil.net"));
    }
}
