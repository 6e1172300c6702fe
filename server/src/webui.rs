//! The web page at `/`: a chat that draws the decode live (`webui/`: plain HTML, CSS and
//! JavaScript written by hand, no build step, no npm, embedded in the binary and fetching
//! nothing from another host). `--no-webui` turns it off.
//!
//! The page and its files need no API key (they hold nothing secret: the page asks for the
//! key and sends it with each API call). They are sent with a Content-Security-Policy that
//! lets them load scripts and styles from this server only and connect nowhere else, so that
//! nothing a prompt or an answer holds could run even if it reached the page as markup (the
//! page writes all text as text).

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

const INDEX: &str = include_str!("webui/index.html");
const APP_JS: &str = include_str!("webui/app.js");
const APP_CSS: &str = include_str!("webui/app.css");
const ICON: &str = include_str!("webui/icon.svg");

/// The policy: this server's scripts, styles and icon, API calls to it, nothing else; and no
/// string may ever become markup or script (Trusted Types with no policy: `innerHTML` and
/// the like throw).
pub(super) const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'; require-trusted-types-for 'script'; trusted-types 'none'";

/// Whether a path is the page's (answered without the API key).
pub(super) fn is_page(path: &str) -> bool {
    path == "/" || path == "/index.html" || path.starts_with("/webui/")
}

fn file(content_type: &'static str, body: &'static str) -> Response {
    let mut res = body.into_response();
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    res
}

/// The page's routes.
pub(super) fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    let index = || async { file("text/html; charset=utf-8", INDEX) };
    Router::new()
        .route("/", get(index))
        .route("/index.html", get(index))
        .route(
            "/webui/app.js",
            get(|| async { file("text/javascript; charset=utf-8", APP_JS) }),
        )
        .route(
            "/webui/app.css",
            get(|| async { file("text/css; charset=utf-8", APP_CSS) }),
        )
        .route(
            "/webui/icon.svg",
            get(|| async { file("image/svg+xml", ICON) }),
        )
}

/// The page's weight in bytes (all its files).
#[cfg(test)]
fn weight() -> usize {
    INDEX.len() + APP_JS.len() + APP_CSS.len() + ICON.len()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_page_is_small_and_self_contained() {
        assert!(super::weight() < 300 * 1024, "{} bytes", super::weight());
        for (name, text) in [
            ("index.html", super::INDEX),
            ("app.js", super::APP_JS),
            ("app.css", super::APP_CSS),
        ] {
            // Nothing from another host, and no markup built from strings.
            for banned in [
                "http://",
                "https://",
                "innerHTML",
                "outerHTML",
                "insertAdjacentHTML",
                "eval(",
                "document.write",
            ] {
                assert!(!text.contains(banned), "{name} contains {banned}");
            }
        }
    }
}
