//! Which web pages may call the server from a browser (CORS), and which host names it answers
//! to. Pages served from a loopback origin (`http://localhost:3000`, `http://127.0.0.1:5173`)
//! and the server's own page are allowed, as ollama allows them; other origins only when named
//! with `--cors-origin` (`*`, any origin, only together with `--api-key`). A request from any
//! other origin is refused with 403 (its body drained, not used); preflights are answered here,
//! before the API key is asked for (browsers send none with them).
//!
//! A server bound to loopback answers only to host names that cannot be made to point at it
//! from outside: loopback names, IP addresses, this machine's own name, and the hosts of the
//! `--cors-origin` origins (a reverse proxy's public name). A page on `http://evil.example`
//! whose name is made to resolve to 127.0.0.1 (DNS rebinding) reaches the port as its own
//! origin, and only the `Host` header it sends gives it away.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::api::ApiError;
use super::body::{discard_body, BodyLimits};
use crate::error::{Result, ServeError};

/// The origins allowed beyond loopback, and the host names a loopback server answers to.
#[derive(Clone)]
pub struct Cors {
    origins: Vec<String>,
    any: bool,
    /// Bound to loopback: only the host names below (and loopback ones) are answered.
    loopback_only: bool,
    /// This machine's name and the `--cors-origin` hosts, lowercased.
    hosts: Vec<String>,
    /// How a refused request's body is read and dropped.
    body: BodyLimits,
}

impl Cors {
    /// `--cors-origin` values (each `scheme://host[:port]`, or `*`), checked.
    pub fn new(origins: &[String], host: IpAddr, api_key: Option<&str>) -> Result<Cors> {
        let mut cors = Cors {
            origins: Vec::new(),
            any: false,
            loopback_only: host.is_loopback(),
            hosts: machine_name().into_iter().collect(),
            body: BodyLimits::default(),
        };
        for o in origins {
            if o == "*" {
                if api_key.is_none() {
                    return Err(ServeError::Config(
                        "--cors-origin '*' lets any web page call the server: it needs --api-key"
                            .into(),
                    ));
                }
                cors.any = true;
            } else if let Some(origin) = normalize_origin(o) {
                if let Some(h) = origin.split_once("://").and_then(|(_, a)| host_name(a)) {
                    cors.hosts.push(h.to_string());
                }
                cors.origins.push(origin);
            } else {
                return Err(ServeError::Config(format!(
                    "--cors-origin '{o}' is not an origin: give scheme://host[:port] (http://example.com:3000), or '*'"
                )));
            }
        }
        Ok(cors)
    }

    /// Refused requests' bodies are read (bounded) and dropped, so that the client reads its
    /// 403 instead of a reset.
    pub(super) fn with_body_limits(mut self, limits: BodyLimits) -> Cors {
        self.body = limits;
        self
    }

    /// A 403 for the request, its body drained first.
    async fn refuse(&self, req: Request, message: String) -> Response {
        discard_body(req, self.body).await;
        ApiError::new(StatusCode::FORBIDDEN, "forbidden", message).into_response()
    }

    /// Whether a loopback server answers to this `Host` (`name[:port]`).
    fn answers_to(&self, host: &str) -> bool {
        let Some(name) = host_name(host) else {
            return false;
        };
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        is_loopback_host(&name) || name.parse::<IpAddr>().is_ok() || self.hosts.contains(&name)
    }

    fn allows(&self, origin: &str, host: Option<&str>) -> bool {
        let Some(origin) = normalize_origin(origin) else {
            return false;
        };
        self.any
            || is_loopback_origin(&origin)
            || self.origins.contains(&origin)
            // The server's own page (its origin is the address the browser used, which the
            // host check has let through).
            || host.is_some_and(|h| {
                let h = h.to_ascii_lowercase();
                [format!("http://{h}"), format!("https://{h}")]
                    .iter()
                    .any(|own| normalize_origin(own).as_deref() == Some(origin.as_str()))
            })
    }
}

/// This machine's name (`hostname`) and its mDNS name, lowercased.
fn machine_name() -> Vec<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    if name.is_empty() {
        return Vec::new();
    }
    vec![format!("{name}.local"), name]
}

/// `scheme://host[:port]` as a browser sends it: lowercased, no trailing slash, no default
/// port; `None` for anything else (paths, credentials, wildcards, `null`).
fn normalize_origin(s: &str) -> Option<String> {
    let s = s.trim_end_matches('/').to_ascii_lowercase();
    let (scheme, rest) = s.split_once("://")?;
    let default_port = match scheme {
        "http" => ":80",
        "https" => ":443",
        _ => return None,
    };
    let bad = rest.is_empty()
        || rest.contains(['/', '?', '#', '@', ' ', '*'])
        || host_name(rest).is_none_or(|h| h.is_empty());
    if bad {
        return None;
    }
    let rest = rest.strip_suffix(default_port).unwrap_or(rest);
    Some(format!("{scheme}://{rest}"))
}

/// The host of `host[:port]` (`[::1]:8080` → `::1`), or `None` when `authority` is not one:
/// the host a name of letters, digits, `-`, `_` and `.`, or an IP address (IPv6 in brackets),
/// and the port, if any, a number up to 65535. So `localhost:80@evil.example` (a port that is
/// not one) or `evil.example\.localhost` (a name with a backslash) names no host at all.
fn host_name(authority: &str) -> Option<&str> {
    let (host, port) = match authority.strip_prefix('[') {
        Some(rest) => {
            let (ip, after) = rest.split_once(']')?;
            ip.parse::<std::net::Ipv6Addr>().ok()?;
            let port = match after {
                "" => None,
                a => Some(a.strip_prefix(':')?),
            };
            (ip, port)
        }
        None => {
            let (host, port) = match authority.split_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            };
            let name = host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
            if host.is_empty() || !name {
                return None;
            }
            (host, port)
        }
    };
    let port_ok = port.is_none_or(|p| {
        !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && p.parse::<u16>().is_ok()
    });
    port_ok.then_some(host)
}

/// `localhost`, `*.localhost`, `localhost.localdomain` or a loopback address.
fn is_loopback_host(host: &str) -> bool {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    host == "localhost"
        || host == "localhost.localdomain"
        || host.ends_with(".localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn is_loopback_origin(origin: &str) -> bool {
    origin
        .split_once("://")
        .and_then(|(_, rest)| host_name(rest))
        .is_some_and(is_loopback_host)
}

/// The host the request names: `Host`, else the request line's authority; `Err` when `Host`
/// is there but unreadable.
fn request_host(req: &Request) -> std::result::Result<Option<String>, ()> {
    match req.headers().get(header::HOST) {
        Some(v) => v.to_str().map(|s| Some(s.to_string())).map_err(|_| ()),
        None => Ok(req.uri().authority().map(|a| a.to_string())),
    }
}

/// Middleware, outermost: the host check, the origin check, preflights, and the
/// `Access-Control-Allow-Origin` header on allowed cross-origin answers.
pub(super) async fn cors(State(cors): State<Arc<Cors>>, req: Request, next: Next) -> Response {
    let host = match request_host(&req) {
        Ok(h) => h,
        Err(()) => {
            return cors
                .refuse(req, "the Host header is unreadable".into())
                .await
        }
    };
    if let Some(h) = host
        .as_deref()
        .filter(|h| cors.loopback_only && !cors.answers_to(h))
    {
        let message = format!(
            "host '{h}' is not this server: a server on loopback answers to localhost, IP addresses, this machine's name and the hosts of --cors-origin"
        );
        return cors.refuse(req, message).await;
    }
    let Some(origin) = req.headers().get(header::ORIGIN).cloned() else {
        let mut res = next.run(req).await;
        vary(res.headers_mut());
        return res;
    };
    let text = origin.to_str().unwrap_or("").to_string();
    if !cors.allows(&text, host.as_deref()) {
        let hint = match normalize_origin(&text) {
            Some(o) => format!("start refusion serve with --cors-origin {o}"),
            None => "it is not an http(s) origin".to_string(),
        };
        let message = format!("origin '{text}' may not call this server: {hint}");
        return cors.refuse(req, message).await;
    }
    let preflight = req.method() == Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let mut res = if preflight {
        preflight_answer(req.headers())
    } else {
        next.run(req).await
    };
    let h = res.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    vary(h);
    res
}

/// Answers depend on the `Origin` (caches must not mix them).
fn vary(h: &mut HeaderMap) {
    h.append(header::VARY, HeaderValue::from_static("Origin"));
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
    // Chromium asks before a public page may reach a private address (loopback).
    if headers.contains_key("access-control-request-private-network") {
        h.insert(
            "access-control-allow-private-network",
            HeaderValue::from_static("true"),
        );
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_and_hosts() {
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let c = Cors::new(&["HTTPS://App.example.com:443/".into()], lo, None).unwrap();
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
        for bad in [
            "example.com",
            "ftp://x",
            "http://",
            "http://a/b",
            "http://*.x",
            "http://x:99999",
            "http://x:",
            "http://x:8a",
            "http://x\\.y",
        ] {
            assert!(Cors::new(&[bad.into()], lo, None).is_err(), "{bad}");
        }
        for ok in ["localhost:8080", "127.0.0.1:1", "[::1]:2", "192.168.1.2:80"] {
            assert!(c.answers_to(ok), "{ok}");
        }
        // The --cors-origin host (a reverse proxy's public name) too.
        assert!(c.answers_to("app.example.com"));
        for bad in [
            "evil.example:8080",
            "localhost.evil.net",
            "mybox-not-mine",
            "x.local",
            // Authorities that only look like a loopback name.
            "localhost:80@evil.example",
            "evil.example\\.localhost",
            "localhost:99999",
            "localhost:",
            "127.0.0.1:80:80",
            "[::1]x",
            "[evil.example]:80",
            "evil.example/.localhost",
            "",
        ] {
            assert!(!c.answers_to(bad), "{bad}");
        }
    }
}
