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
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n",
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
    // HTTP trims header values: a key with spaces could never match.
    for key in ["sekrit ", " sekrit", "sek rit", "sek\trit"] {
        let o = run(&["serve", "-m", "/nonexistent.gguf", "--api-key", key]);
        assert_fails_with(&o, &["--api-key must be visible ASCII"]);
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
    // The key is checked before the body is read: a stranger's announced 10 MB is not waited
    // for (a body within the limit is read and dropped, so the client sees its 401).
    let mut s = connect(&server);
    s.write_all(
        format!("POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 10000000\r\n\r\n")
            .as_bytes(),
    )
    .unwrap();
    let (status, _, b) = read_response(&mut s);
    assert_eq!(status, 401, "{b}");
    // /health stays open (for load balancers); unknown routes need the key too.
    assert_eq!(health(&server), 200);
    let (status, _, b) = request(&server, "GET", "/v2/nothing", &[], "");
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
        .write_all(format!("POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nContent-Le").as_bytes())
        .unwrap();
    let sent = Instant::now();
    // A body shorter than its Content-Length: 408 with the error object, then closed.
    let mut short_body = connect(&server);
    short_body
        .write_all(
            format!(
                "POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n{{\"mess"
            )
            .as_bytes(),
        )
        .unwrap();
    // Connected, nothing sent.
    let mut silent = connect(&server);
    // A keep-alive connection after one answered request.
    let mut keep_alive = connect(&server);
    keep_alive
        .write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = keep_alive.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));

    closed_within(&mut half_headers, limit).expect("half-sent headers were never closed");
    assert!(
        sent.elapsed() >= Duration::from_millis(900),
        "closed before the header timeout: {:?}",
        sent.elapsed()
    );
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
        "Host: localhost\r\n",
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
    let model = fast_model(tmp.path());
    let server = Server::start(
        &model,
        &[
            "--max-body-bytes",
            "8000000",
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
    // A flood of silent connections does not lock a real request out either (each newcomer
    // inherits the place of the connection it evicted).
    let flood: Vec<TcpStream> = (0..60).map(|_| connect(&server)).collect();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(health(&server), 200);
    drop(flood);
    // Requests whose body stalls after complete headers make room as well, oldest first.
    let mut stalled: Vec<TcpStream> = (0..3)
        .map(|_| {
            let mut s = connect(&server);
            s.write_all(
                format!("POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 50\r\n\r\n{{")
                    .as_bytes(),
            )
            .unwrap();
            std::thread::sleep(Duration::from_millis(50));
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..20 {
        assert_eq!(health(&server), 200);
    }
    closed_within(&mut stalled[0], Duration::from_secs(10))
        .expect("the oldest stalled body kept its place");
    drop(stalled);
    // Requests being answered are never evicted: with every place answering one (a long text
    // being tokenized, seconds each), others get 503, but /health is still answered. A body
    // still arriving is evictable, so the checks start once the bodies are surely in (they
    // take milliseconds; the tokenizing, seconds).
    let long_tokenize = format!(
        r#"{{"content":"{}","with_pieces":true}}"#,
        "hello world ".repeat(300_000)
    );
    let answering: Vec<TcpStream> = (0..3)
        .map(|_| {
            let mut s = connect(&server);
            let msg = format!(
                "POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{long_tokenize}",
                long_tokenize.len()
            );
            s.write_all(msg.as_bytes()).unwrap();
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    for _ in 0..10 {
        let (status, head, body) = request(&server, "GET", "/v1/models", &[], "");
        assert_eq!(status, 503, "{head}\n{body}");
        assert!(
            error_message(&body).contains("too many open connections"),
            "{body}"
        );
        assert_eq!(health(&server), 200, "/health over the cap");
    }
    drop(answering);
    let t = Instant::now();
    while request(&server, "GET", "/v1/models", &[], "").0 != 200 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the server never recovered"
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
    // The page's route too (axum's own 405).
    let (status, head, body) = request(&server, "TRACE", "/", &[], "");
    assert_eq!(status, 405, "{body}");
    assert!(head.contains("allow: get"), "{head}");
    assert!(
        error_message(&body).contains("method TRACE is not allowed"),
        "{body}"
    );
    // A body that is not JSON, whatever it starts with.
    let (status, _, body) = request(&server, "POST", CHAT, &[], &"[".repeat(900));
    assert_eq!(status, 400, "{body}");
    assert!(error_message(&body).starts_with("malformed JSON"), "{body}");
    // hyper's own answers to what it cannot parse.
    for (raw, code, needle) in [
        (
            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: abc\r\n\r\n"
                .to_string(),
            400,
            "malformed HTTP request",
        ),
        (
            format!(
                "GET /health HTTP/1.1\r\nHost: localhost\r\nX-Pad: {}\r\n\r\n",
                "a".repeat(70_000)
            ),
            431,
            "headers are too large",
        ),
    ] {
        let mut s = connect(&server);
        s.write_all(raw.as_bytes()).unwrap();
        let (status, head, body) = read_response(&mut s);
        assert_eq!(status, code, "{head}");
        assert!(head.contains("content-type: application/json"), "{head}");
        assert!(head.contains("x-content-type-options: nosniff"), "{head}");
        assert!(error_message(&body).contains(needle), "{body}");
    }
    // JSON answers are never sniffed as something else.
    let (status, head, _) = request(&server, "GET", "/v1/models", &[], "");
    assert_eq!(status, 200);
    assert!(head.contains("x-content-type-options: nosniff"), "{head}");
}

#[test]
fn host_names_that_only_look_local_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let server = Server::start(&model, &[]);
    for host in [
        "localhost:80@evil.example",
        "evil.example\\.localhost",
        "localhost:99999",
        "evil.example/.localhost",
    ] {
        let mut s = connect(&server);
        let raw = format!("GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        s.write_all(raw.as_bytes()).unwrap();
        let (status, _, body) = read_response(&mut s);
        assert_eq!(status, 403, "{host}: {body}");
        assert!(
            error_message(&body).contains("is not this server"),
            "{body}"
        );
    }
    let o = run(&[
        "serve",
        "-m",
        model.to_str().unwrap(),
        "--port",
        "0",
        "--cors-origin",
        "http://x:99999",
    ]);
    assert_fails_with(&o, &["--cors-origin 'http://x:99999' is not an origin"]);
}

const LONG: &str = r#"{"messages":[{"role":"user","content":"hello"}],"max_tokens":4000,"stream":true,"slot_size":4,"serial_blocks":1000}"#;

fn post_chat(s: &mut TcpStream, body: &str) {
    let msg = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(msg.as_bytes()).unwrap();
}

/// Starts a streamed generation long enough to be in progress when the test signals, and
/// returns its socket once the first text has arrived.
fn start_long_stream(server: &Server) -> TcpStream {
    let mut s = connect(server);
    post_chat(&mut s, LONG);
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
fn sigterm_cancels_the_generation_and_the_queue_and_closes_what_waits_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    // One request decodes at a time, so that the second waits in the queue.
    let mut server = Server::start(
        &model,
        &[
            "--parallel",
            "1",
            "-c",
            "8192",
            "--max-gen-length",
            "4000",
            "--header-timeout",
            "600",
            "--idle-timeout",
            "600",
            "--body-timeout",
            "600",
            "--shutdown-timeout",
            "60",
        ],
    );
    let mut half_headers = connect(&server);
    half_headers
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
        .unwrap();
    let mut half_body = connect(&server);
    half_body
        .write_all(
            format!("POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 50\r\n\r\n{{")
                .as_bytes(),
        )
        .unwrap();
    let mut idle = connect(&server);
    let mut stream = start_long_stream(&server);
    // Queued behind the generation in progress.
    let mut queued = connect(&server);
    post_chat(&mut queued, &chat_body(8, false));
    std::thread::sleep(Duration::from_millis(300));

    let t = Instant::now();
    server.signal("-TERM");
    let status = server
        .wait_exit(Duration::from_secs(30))
        .expect("the server did not exit after SIGTERM");
    // Nothing waited for the 60 s of --shutdown-timeout.
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert_eq!(status.code(), Some(0), "{status:?}");
    let log = server
        .wait_log("stopped", Duration::from_secs(5))
        .unwrap_or_else(|l| l);
    assert!(
        log.contains("SIGTERM: shutting down (cancelling the generation in progress"),
        "{log}"
    );
    assert!(
        log.contains("generation in progress was cancelled"),
        "{log}"
    );
    // The stream was told why it ended; the queued request got a 503.
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        rest.contains("shutting down") && rest.contains("[DONE]"),
        "{rest}"
    );
    let (status, _, body) = read_response(&mut queued);
    assert_eq!(status, 503, "{body}");
    assert!(error_message(&body).contains("shutting down"), "{body}");
    for s in [&mut half_headers, &mut half_body, &mut idle] {
        closed_within(s, Duration::from_secs(1)).expect("a connection outlived the server");
    }
}

/// A socket whose receive buffer is tiny, so that a client that does not read blocks the
/// server's writes quickly.
fn connect_small_window(server: &Server) -> TcpStream {
    use socket2::{Domain, Socket, Type};
    let addr: std::net::SocketAddr = server.addr().parse().unwrap();
    let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    s.set_recv_buffer_size(4096).unwrap();
    s.connect(&addr.into()).unwrap();
    s.into()
}

/// A fixture model with a small vocabulary, fast enough to fill socket buffers in a moment.
fn fast_model(dir: &std::path::Path) -> std::path::PathBuf {
    let out = dir.join("pub-a.gguf");
    convert_quiet(&fixture_model("pub-a"), &out, "q8_0");
    out
}

/// Bytes waiting in the send queue of the server's established socket on `port`
/// (`/proc/net/tcp`'s `tx_queue`; Linux).
fn server_send_queue(port: u16) -> Option<u64> {
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let local_port = u16::from_str_radix(f.get(1)?.rsplit(':').next()?, 16).ok()?;
        let established = *f.get(3)? == "01";
        let tx = u64::from_str_radix(f.get(4)?.split(':').next()?, 16).ok()?;
        (local_port == port && established).then_some(tx)
    })
}

/// Streams a long answer to a client that does not read it, and returns once the server's
/// socket can take no more (its send queue full and still), so its writes are blocked.
fn stalled_reader(server: &Server) -> TcpStream {
    let port: u16 = server.addr().rsplit(':').next().unwrap().parse().unwrap();
    let mut s = connect_small_window(server);
    post_chat(&mut s, LONG);
    let (mut last, mut since) = (0, Instant::now());
    let t = Instant::now();
    while last < 8192 || since.elapsed() < Duration::from_millis(1500) {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the server's writes never blocked"
        );
        let queued = server_send_queue(port).unwrap_or(0);
        if queued != last {
            (last, since) = (queued, Instant::now());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    s
}

#[test]
fn a_client_that_stops_reading_is_disconnected() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fast_model(tmp.path());
    let server = Server::start(
        &model,
        &[
            "-c",
            "8192",
            "--max-gen-length",
            "4000",
            "--idle-timeout",
            "1",
            "--max-connections",
            "1",
        ],
    );
    // It holds the only place with a request in flight (not evictable) until its writes have
    // been blocked for the idle timeout; then it is closed and its generation cancelled. How
    // soon its buffers fill depends on the machine's speed, so the wait is long; it ends at
    // the cancellation.
    let mut s = connect_small_window(&server);
    post_chat(&mut s, LONG);
    server
        .wait_log("cancelled", Duration::from_secs(90))
        .expect("the generation was not cancelled");
    // Its place is free again: a request other than `GET /health` (which is answered even over
    // the cap) is served, not refused with 503.
    let t = Instant::now();
    while request(&server, "GET", "/v1/models", &[], "").0 != 200 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the stalled reader kept its place"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut buf = vec![0u8; 1 << 20];
    let t = Instant::now();
    while s.read(&mut buf).map(|n| n > 0).unwrap_or(false) {
        assert!(t.elapsed() < Duration::from_secs(20), "the stream went on");
    }
}

#[test]
fn a_second_signal_exits_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fast_model(tmp.path());
    let mut server = Server::start(
        &model,
        &[
            "-c",
            "8192",
            "--max-gen-length",
            "4000",
            "--idle-timeout",
            "120",
            "--shutdown-timeout",
            "120",
        ],
    );
    // An answer the client does not read keeps the drain waiting.
    let _stalled = stalled_reader(&server);
    server.signal("-TERM");
    server
        .wait_log("shutting down", Duration::from_secs(10))
        .expect("no shutdown message");
    if let Some(status) = server.wait_exit(Duration::from_secs(1)) {
        let log = server
            .wait_log("stopped", Duration::from_secs(1))
            .unwrap_or_else(|l| l);
        panic!("exited before the drain ({status:?}):\n{log}");
    }
    server.signal("-INT");
    let status = server
        .wait_exit(Duration::from_secs(5))
        .expect("the second signal did not exit");
    assert_eq!(status.code(), Some(130), "{status:?}");
    server
        .wait_log("second SIGINT: exiting now", Duration::from_secs(5))
        .expect("no exit message");
}

/// A request head of exactly 64 KiB is read; one byte more gets 431 (hyper alone let about
/// 114 KB through).
#[test]
fn the_header_limit_is_64_kib_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&fast_model(tmp.path()), &[]);
    let head = |total: usize| {
        let base = "GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nX-Pad: ";
        let pad = "a".repeat(total - base.len() - 4);
        let mut s = connect(&server);
        s.write_all(format!("{base}{pad}\r\n\r\n").as_bytes())
            .unwrap();
        read_response(&mut s).0
    };
    assert_eq!(head(1000), 200);
    assert_eq!(head(65_536), 200);
    assert_eq!(head(65_537), 431);
    assert_eq!(head(114_000), 431);
}

/// One JSON value per request: anything after it is a 400.
#[test]
fn json_followed_by_more_data_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&fast_model(tmp.path()), &[]);
    let one = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#;
    let (status, _, _) = request(&server, "POST", CHAT, &[], one);
    assert_eq!(status, 200);
    for tail in [r#"{"a":1}"#, "xx", " 5"] {
        let (status, _, body) = request(&server, "POST", CHAT, &[], &format!("{one}{tail}"));
        assert_eq!(status, 400, "{body}");
        assert!(error_message(&body).contains("trailing data"), "{body}");
    }
    let (status, _, body) = request(&server, "POST", "/tokenize", &[], r#"{"content":"a"}{}"#);
    assert_eq!(status, 400, "{body}");
}

/// At the deadline with only a /tokenize answer in flight (a long text still being tokenized),
/// the server closes it and stops without claiming that a generation did not stop.
#[test]
fn a_tokenize_answer_at_the_deadline_is_not_called_a_generation() {
    let tmp = tempfile::tempdir().unwrap();
    let mut server = Server::start(
        &fast_model(tmp.path()),
        &["--shutdown-timeout", "1", "--max-body-bytes", "4000000"],
    );
    let mut s = connect(&server);
    let body = format!(
        r#"{{"content":"{}","with_pieces":true}}"#,
        "hello world ".repeat(200_000)
    );
    let msg = format!(
        "POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(msg.as_bytes()).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    server.signal("-TERM");
    let t = Instant::now();
    let status = server
        .wait_exit(Duration::from_secs(20))
        .expect("the server did not stop");
    assert!(status.success(), "{status:?}");
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    let log = server.log_lines().join("\n");
    assert!(!log.contains("did not stop"), "{log}");
    assert!(log.contains("refusion serve: stopped"), "{log}");
    drop(s);
}

/// The same signal twice exits at once with 130, as two different ones do.
#[test]
fn the_same_signal_twice_exits_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fast_model(tmp.path());
    for sig in ["-TERM", "-INT"] {
        let mut server = Server::start(
            &model,
            &[
                "-c",
                "8192",
                "--max-gen-length",
                "4000",
                "--idle-timeout",
                "120",
                "--shutdown-timeout",
                "120",
            ],
        );
        let _stalled = stalled_reader(&server);
        server.signal(sig);
        server
            .wait_log("shutting down", Duration::from_secs(10))
            .expect("no shutdown message");
        server.signal(sig);
        let status = server
            .wait_exit(Duration::from_secs(5))
            .expect("the second signal did not exit");
        assert_eq!(status.code(), Some(130), "{sig}: {status:?}");
    }
}

/// A Prometheus value from `/metrics`.
fn metric(server: &Server, name: &str) -> u64 {
    let (status, _, body) = request(server, "GET", "/metrics", &[], "");
    assert_eq!(status, 200, "{body}");
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("refusion_{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {body}"))
}

/// Waits until `f` holds (polled), up to `limit`.
fn eventually(limit: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn queued_places_free_when_clients_leave_and_mistakes_never_take_one() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fast_model(tmp.path());
    let server = Server::start(
        &model,
        &[
            "-c",
            "8192",
            "--max-gen-length",
            "4000",
            "-np",
            "1",
            "--queue",
            "2",
        ],
    );
    // The one place in the scheduler is busy for a long while (a token per forward).
    let mut running = connect(&server);
    post_chat(
        &mut running,
        &LONG.replace(
            r#""slot_size":4,"serial_blocks":1000"#,
            r#""slot_size":1,"serial_blocks":4000"#,
        ),
    );
    eventually(
        Duration::from_secs(20),
        "the long request never ran",
        || metric(&server, "requests_running") == 1,
    );
    // Two requests wait in the queue, which is then full.
    let mut waiting: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut s = connect(&server);
            post_chat(&mut s, &chat_body(8, false));
            s
        })
        .collect();
    eventually(Duration::from_secs(20), "two requests never queued", || {
        metric(&server, "requests_waiting") == 2
    });
    let (status, _, body) = request(&server, "POST", CHAT, &[], &chat_body(8, false));
    assert_eq!(status, 503, "the queue was not full: {body}");
    // A mistake is answered at once without taking a place: checked in its handler, so a
    // 400 naming it, never the full queue's 503.
    let bad = chat_body(8, false).replacen('{', r#"{"strategy":"sideways","#, 1);
    let (status, _, body) = request(&server, "POST", CHAT, &[], &bad);
    assert_eq!(status, 400, "a bad request waited for a place: {body}");
    assert!(body.contains("unknown strategy 'sideways'"), "{body}");
    // Their clients leave: the places are free at once (the running request still runs),
    // and the two are counted cancelled.
    let before = metric(&server, "requests_cancelled_total");
    for s in waiting.drain(..) {
        s.shutdown(std::net::Shutdown::Both).unwrap();
    }
    eventually(
        Duration::from_secs(20),
        "dead requests kept their places",
        || metric(&server, "requests_waiting") == 0,
    );
    assert_eq!(metric(&server, "requests_cancelled_total"), before + 2);
    assert_eq!(metric(&server, "requests_running"), 1);
    // A new client is queued, not refused.
    let mut next = connect(&server);
    post_chat(&mut next, &chat_body(8, false));
    eventually(
        Duration::from_secs(20),
        "the new request was not queued",
        || metric(&server, "requests_waiting") == 1,
    );
}

/// Starts `refusion serve ARGS` and waits for it to exit (up to `limit`).
fn serve_exit(args: &[&str], limit: Duration) -> (Option<i32>, String) {
    let mut child = std::process::Command::new(bin())
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > limit {
            let _ = child.kill();
            let o = child.wait_with_output().unwrap();
            panic!("serve kept running:\n{}", stderr(&o));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = child.wait_with_output().unwrap();
    (o.status.code(), stderr(&o))
}

#[test]
fn a_server_whose_kv_file_fails_exits_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fast_model(tmp.path());
    let m = model.to_str().unwrap();
    let kv = tmp.path().join("kv.bin");
    let k = kv.to_str().unwrap();
    // Another run holds the file.
    let first = Server::start(&model, &["--kv-file", k]);
    assert_eq!(health(&first), 200);
    let (code, err) = serve_exit(
        &["serve", "-m", m, "--port", "0", "--kv-file", k],
        Duration::from_secs(60),
    );
    assert_ne!(code, Some(0), "{err}");
    assert!(err.contains("in use by another refusion"), "{err}");
    assert!(!err.contains("listening on"), "it announced itself: {err}");
    assert!(!err.contains("panicked"), "{err}");
    drop(first);
    // A folder where nothing can be created (sysfs refuses even root), when there is one.
    if std::fs::File::create("/sys/refusion-probe").is_err() {
        let (code, err) = serve_exit(
            &["serve", "-m", m, "--port", "0", "--kv-file", "/sys/kv.bin"],
            Duration::from_secs(60),
        );
        assert_ne!(code, Some(0), "{err}");
        assert!(err.contains("/sys/kv.bin"), "{err}");
        assert!(!err.contains("listening on"), "{err}");
    }
}
