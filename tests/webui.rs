//! The web page at `/`, in a real browser: headless Chromium driven by Selenium
//! (tests/webui/check_page.py) against `refusion serve` on the trained tiny ReFusion. It loads
//! with no console error and asks nothing of another host, answers the worked sum, draws the
//! decode's steps and replays them, fills a gap, keeps conversations, stops an answer (the
//! server cancels it), asks for the API key, and shows HTML from a prompt or an answer as text.
//! The HTTP side (CSP, CORS, preflight, the host check, `decode_events`) is checked without a
//! browser.
//!
//! Needs `chromium` and `chromium-driver` (Debian) and Selenium in `REFUSION_PYTHON`'s
//! environment (.ci/run installs them); `REFUSION_SKIP_BROWSER=1` skips the browser tests
//! where there is none.

mod common;

use std::io::{Read, Write};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::server::Server;
use common::*;

/// Runs check_page.py in MODE against the server; returns its output (it must end with OK).
fn check(server: &Server, mode: &str, arg: Option<&str>) -> String {
    let python = std::env::var("REFUSION_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/webui/check_page.py");
    let mut cmd = Command::new(python);
    cmd.arg(script).arg(&server.base).arg(mode);
    if let Some(a) = arg {
        cmd.arg(a);
    }
    let o = cmd.output().expect("python3 not found");
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(
        !err.contains("No module named 'selenium'"),
        "this test needs Selenium: pip install selenium==4.27.1\n{err}"
    );
    assert!(o.status.success(), "{mode} failed:\n{out}\n{err}");
    assert!(out.trim_end().ends_with("OK"), "{out}");
    out.into_owned()
}

/// Whether the browser tests run: Chromium and its driver must be there unless skipped.
fn browser() -> bool {
    if std::env::var("REFUSION_SKIP_BROWSER").is_ok_and(|v| v == "1") {
        eprintln!("REFUSION_SKIP_BROWSER=1: the browser tests are skipped");
        return false;
    }
    for (var, default) in [
        ("REFUSION_CHROMIUM", "/usr/bin/chromium"),
        ("REFUSION_CHROMEDRIVER", "/usr/bin/chromedriver"),
    ] {
        let path = std::env::var(var).unwrap_or_else(|_| default.into());
        assert!(
            Path::new(&path).exists(),
            "{path} is missing: apt-get install chromium chromium-driver (or set {var}, or REFUSION_SKIP_BROWSER=1)"
        );
    }
    true
}

/// A plain GET: the status line and the body.
fn get(addr: &str, path: &str) -> (String, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let status = text.lines().next().unwrap_or("").to_string();
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

#[test]
fn headers_cors_and_decode_events() {
    let tmp = tempfile::tempdir().unwrap();
    let m = trained_tiny_gguf(tmp.path(), "f32");
    let server = Server::start(&m, &["--cors-origin", "http://app.example.com"]);
    check(&server, "http", Some("http://app.example.com"));
    drop(server);
    // With a key, the page opens (it asks for the key), the API does not.
    let server = Server::start(&m, &["--api-key", "k3y"]);
    assert!(get(&server.addr(), "/").0.contains("200"));
    assert!(get(&server.addr(), "/webui/app.js").0.contains("200"));
    assert!(get(&server.addr(), "/v1/models").0.contains("401"));
    drop(server);
    // --no-webui: no page.
    let server = Server::start(&m, &["--no-webui"]);
    let (status, body) = get(&server.addr(), "/");
    assert!(
        status.contains("404") && body.contains("unknown endpoint"),
        "{status} {body}"
    );
    assert!(get(&server.addr(), "/webui/app.js").0.contains("404"));
    drop(server);
    // Origins are checked before the model loads.
    let m = m.to_str().unwrap();
    let o = run(&["serve", "-m", m, "--port", "0", "--cors-origin", "*"]);
    assert_fails_with(&o, &["--cors-origin '*'", "--api-key"]);
    let o = run(&[
        "serve",
        "-m",
        m,
        "--port",
        "0",
        "--cors-origin",
        "example.com",
    ]);
    assert_fails_with(&o, &["not an origin", "scheme://host"]);
}

#[test]
fn the_page_in_a_browser() {
    if !browser() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let m = trained_tiny_gguf(tmp.path(), "f32");
    let server = Server::start(&m, &[]);
    // REFUSION_SCREENSHOT=docs/img/serve-page.png keeps the screenshot docs/serve.md shows.
    let shot = std::env::var("REFUSION_SCREENSHOT")
        .unwrap_or_else(|_| tmp.path().join("page.png").display().to_string());
    let out = check(&server, "page", Some(&shot));
    eprintln!("{out}");
    assert!(std::fs::metadata(&shot).unwrap().len() > 10_000);
    // The stop button cancels: the server hears the client go and cancels the generation. A
    // random 0.6B-shaped file answers slowly enough to be stopped half-way.
    let slow = synthetic_gguf(tmp.path(), "0.6b", "q4_0");
    let server = Server::start(&slow, &[]);
    check(&server, "stop", None);
    server
        .wait_log("its generation was cancelled", Duration::from_secs(30))
        .unwrap_or_else(|log| panic!("the server did not cancel:\n{log}"));
}

#[test]
fn the_key_prompt_in_a_browser() {
    if !browser() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let m = trained_tiny_gguf(tmp.path(), "f32");
    let server = Server::start(&m, &["--api-key", "s3cret-key"]);
    check(&server, "key", Some("s3cret-key"));
}
