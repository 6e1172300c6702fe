//! `refusion serve` against hostile and careless clients, over raw loopback sockets: the API key,
//! stalled requests (timeouts short here), the connection cap, error bodies, and shutdown that
//! always ends.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::server::Server;
use common::*;
use serde_json::Value as Json;

const CHAT: &str = "/v1/chat/completions";

fn connect(server: &Server) -> TcpStream {
    let s = TcpStream::connect(server.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

/// A whole response read until the server closes: (status, lowercase head, body).
fn read_response(s: &mut TcpStream) -> (u16, String, String) {
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_string())
}

/// One request with `Connection: close`.
fn request(
    server: &Server,
    method: &str,
    path: &str,
    headers: &[&str],
    body: &str,
) -> (u16, String, String) {
    let mut s = connect(server);
    let mut msg = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for h in headers {
        msg.push_str(h);
        msg.push_str("\r\n");
    }
    msg.push_str("\r\n");
    msg.push_str(body);
    s.write_all(msg.as_bytes()).unwrap();
    read_response(&mut s)
}

/// The OpenAI-style error object of a body, with its message.
fn error_message(body: &str) -> String {
    let v: Json = serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"));
    let e = &v["error"];
    assert!(e["type"].is_string(), "no error type: {body}");
    assert!(
        e.get("param").is_some() && e.get("code").is_some(),
        "{body}"
    );
    e["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no message: {body}"))
        .to_string()
}

/// Waits until the server has closed `s` (read gives EOF or a reset); how long that took.
fn closed_within(s: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let t = Instant::now();
    s.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Some(t.elapsed()),
            Ok(_) => continue,
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                return None
            }
            Err(_) => return Some(t.elapsed()),
        }
    }
}

fn health(server: &Server) -> u16 {
    request(server, "GET", "/health", &[], "").0
}

fn chat_body(max_tokens: u32, stream: bool) -> String {
    format!(
        r#"{{"messages":[{{"role":"user","content":"hello"}}],"max_tokens":{max_tokens},"stream":{stream},"slot_size":4,"serial_blocks":1}}"#
    )
}

#[test]
fn an_empty_api_key_is_refused_before_loading() {
    // The model path does not exist: the key is checked first.
    for host in ["127.0.0.1", "0.0.0.0"] {
        let o = run(&[
            "serve",
            "-m",
            "/nonexistent.gguf",
            "--host",
            host,
            "--api-key",
            "",
        ]);
        assert_fails_with(&o, &["--api-key must not be empty"]);
    }
}

#[test]
fn the_api_key_is_required_and_compared_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let server = Server::start(&model, &["--api-key", "sekrit"]);
    let body = chat_body(4, false);
    for headers in [
        &[][..],
        &["Authorization: Bearer "][..],
        &["Authorization: Bearer sekri"][..],
        &["Authorization: Bearer sekrit2"][..],
        &["Authorization: sekrit"][..],
        &["Authorization: Basic c2Vrcml0"][..],
    ] {
        let (status, _, b) = request(&server, "POST", CHAT, headers, &body);
        assert_eq!(status, 401, "{headers:?}: {b}");
        assert!(error_message(&b).contains("API key"), "{b}");
    }
    let (status, _, b) = request(&server, "GET", "/v1/models", &[], "");
    assert_eq!(status, 401, "{b}");
    // The key is checked before the body is read: a stranger's 10 MB is never waited for.
    let mut s = connect(&server);
    s.write_all(
        format!("POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n").as_bytes(),
    )
    .unwrap();
    let (status, _, b) = read_response(&mut s);
    assert_eq!(status, 401, "{b}");
    // The scheme is case-insensitive.
    for auth in [
        "Authorization: Bearer sekrit",
        "authorization: bearer sekrit",
    ] {
        let (status, _, b) = request(&server, "POST", CHAT, &[auth], &body);
        assert_eq!(status, 200, "{auth}: {b}");
    }
}

#[test]
fn stalled_requests_and_idle_connections_time_out() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let server = Server::start(
        &model,
        &[
            "--header-timeout",
            "1",
            "--body-timeout",
            "1",
            "--idle-timeout",
            "1.5",
        ],
    );
    let limit = Duration::from_secs(10);

    // Headers never finished: closed, no answer.
    let mut half_headers = connect(&server);
    half_headers
        .write_all(format!("POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Le").as_bytes())
        .unwrap();
    // A body shorter than its Content-Length: 408 with the error object, then closed.
    let mut short_body = connect(&server);
    short_body
        .write_all(
            format!("POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{\"mess")
                .as_bytes(),
        )
        .unwrap();
    // Connected, nothing sent.
    let mut silent = connect(&server);
    // A keep-alive connection after one answered request.
    let mut keep_alive = connect(&server);
    keep_alive
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = keep_alive.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));

    let t = closed_within(&mut half_headers, limit).expect("half-sent headers were never closed");
    assert!(t >= Duration::from_millis(500), "closed too early: {t:?}");
    let (status, head, body) = read_response(&mut short_body);
    assert_eq!(status, 408, "{head}\n{body}");
    assert!(head.contains("connection: close"), "{head}");
    assert!(error_message(&body).contains("did not arrive"), "{body}");
    closed_within(&mut silent, limit).expect("a silent connection was never closed");
    closed_within(&mut keep_alive, limit).expect("an idle keep-alive connection was never closed");
    assert_eq!(health(&server), 200);
}

#[test]
fn a_slow_but_steady_client_is_not_cut_off_by_the_idle_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let server = Server::start(&model, &["--header-timeout", "5", "--idle-timeout", "0.5"]);
    // Headers trickling in for longer than the idle timeout are under the header timeout.
    let mut s = connect(&server);
    for part in [
        "GET /hea",
        "lth HTTP/1.1\r\n",
        "Host: x\r\n",
        "Connection: close\r\n",
        "\r\n",
    ] {
        s.write_all(part.as_bytes()).unwrap();
        std::thread::sleep(Duration::from_millis(300));
    }
    let (status, _, body) = read_response(&mut s);
    assert_eq!(status, 200, "{body}");
}

#[test]
fn silent_connections_make_room_and_requests_in_flight_fill_the_cap() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let server = Server::start(
        &model,
        &[
            "--max-connections",
            "3",
            "--header-timeout",
            "60",
            "--idle-timeout",
            "60",
            "--body-timeout",
            "60",
        ],
    );
    // Silent and half-sent connections at the cap are closed, oldest first, to let others in.
    let mut silent: Vec<TcpStream> = (0..3)
        .map(|i| {
            let mut s = connect(&server);
            if i > 0 {
                s.write_all(b"GET /health HTTP/1.1\r\nHo").unwrap();
            }
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..20 {
        assert_eq!(health(&server), 200);
    }
    // One place was needed at a time: the oldest silent connection gave it up.
    closed_within(&mut silent[0], Duration::from_secs(10))
        .expect("the oldest silent connection kept its place");
    // Requests in flight (bodies still coming) are never evicted: beyond them, 503.
    let mut busy: Vec<TcpStream> = (0..3)
        .map(|_| {
            let mut s = connect(&server);
            s.write_all(
                format!("POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{{")
                    .as_bytes(),
            )
            .unwrap();
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..50 {
        let (status, head, body) = request(&server, "GET", "/health", &[], "");
        assert_eq!(status, 503, "{head}\n{body}");
        assert!(
            error_message(&body).contains("too many open connections"),
            "{body}"
        );
    }
    busy.pop();
    let t = Instant::now();
    while health(&server) != 200 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "health never recovered"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn every_error_answer_is_an_error_object() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let server = Server::start(&model, &["--max-body-bytes", "1000"]);
    for (method, path, allow) in [
        ("GET", CHAT, "post"),
        ("PUT", "/v1/completions", "post"),
        ("POST", "/health", "get"),
        ("DELETE", "/v1/models", "get"),
    ] {
        let (status, head, body) = request(&server, method, path, &[], "");
        assert_eq!(status, 405, "{method} {path}: {body}");
        assert!(head.contains(&format!("allow: {allow}")), "{head}");
        assert!(error_message(&body).contains("not allowed"), "{body}");
    }
    let (status, _, body) = request(&server, "GET", "/v2/nothing", &[], "");
    assert_eq!(status, 404);
    error_message(&body);
    let big = format!(
        r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(2000)
    );
    let (status, _, body) = request(&server, "POST", CHAT, &[], &big);
    assert_eq!(status, 413, "{body}");
    assert!(error_message(&body).contains("--max-body-bytes"), "{body}");
    let (status, _, body) = request(&server, "POST", CHAT, &[], "{not json");
    assert_eq!(status, 400);
    error_message(&body);
}

/// Starts a streamed generation long enough to be in progress when the test signals, and
/// returns its socket once the first text has arrived.
fn start_long_stream(server: &Server) -> TcpStream {
    let mut s = connect(server);
    let body = r#"{"messages":[{"role":"user","content":"hello"}],"max_tokens":4000,"stream":true,"slot_size":4,"serial_blocks":1000}"#;
    s.write_all(
        format!(
            "POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended before its first event");
        seen.extend_from_slice(&buf[..n]);
    }
    s
}

#[test]
fn sigterm_cancels_the_generation_closes_stalled_connections_and_exits() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let mut server = Server::start(
        &model,
        &[
            "-c",
            "8192",
            "--max-gen-length",
            "4000",
            "--header-timeout",
            "600",
            "--idle-timeout",
            "600",
        ],
    );
    let mut half_sent = connect(&server);
    half_sent
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let mut idle = connect(&server);
    let mut stream = start_long_stream(&server);
    let t = Instant::now();
    server.signal("-TERM");
    let status = server
        .wait_exit(Duration::from_secs(20))
        .expect("the server did not exit after SIGTERM");
    assert_eq!(status.code(), Some(0), "{status:?}");
    let log = server
        .wait_log("stopped", Duration::from_secs(5))
        .unwrap_or_else(|l| l);
    assert!(log.contains("SIGTERM: shutting down"), "{log}");
    assert!(
        log.contains("generation in progress was cancelled"),
        "{log}"
    );
    assert!(log.contains("stopped"), "{log}");
    // The stream was told why it ended, and every connection is closed.
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        rest.contains("shutting down") && rest.contains("[DONE]"),
        "{rest}"
    );
    for s in [&mut half_sent, &mut idle] {
        closed_within(s, Duration::from_secs(1)).expect("a connection outlived the server");
    }
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
}

#[test]
fn a_second_signal_exits_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let mut server = Server::start(
        &model,
        &["--shutdown-timeout", "120", "--body-timeout", "120"],
    );
    // A request whose body never comes is in flight: the drain would wait for it.
    let mut stalled = connect(&server);
    stalled
        .write_all(
            format!("POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{{").as_bytes(),
        )
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    server.signal("-TERM");
    server
        .wait_log("shutting down", Duration::from_secs(10))
        .expect("no shutdown message");
    assert!(
        server.wait_exit(Duration::from_millis(500)).is_none(),
        "exited before the drain"
    );
    server.signal("-INT");
    let status = server
        .wait_exit(Duration::from_secs(5))
        .expect("the second signal did not exit");
    assert_eq!(status.code(), Some(130), "{status:?}");
}
