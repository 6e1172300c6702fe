//! `refusion serve` through the official `openai` Python client and plain HTTP, on a tiny model
//! over loopback. Needs python3 with `openai` (`.ci/run` installs it; REFUSION_PYTHON picks the
//! interpreter).

mod common;

use std::time::Duration;

use common::server::Server;
use common::*;

#[test]
fn openai_client_api_errors_and_cancellation() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let server = Server::start(&model, &[]);
    server.client("api");
    std::thread::sleep(Duration::from_millis(200));
    let log = server.log_lines().join("\n");
    assert!(log.contains("cancelled"), "no cancellation logged:\n{log}");
}

/// ollama's API through the official `ollama` Python client (as Open WebUI and editor
/// plugins talk to it): the model list, chat and generate, streamed and not, errors.
#[test]
fn ollama_client_api() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let server = Server::start(&model, &[]);
    server.python_client("ollama", "api");
}

/// An agent's tool-call round trip and JSON mode through the official `openai` client.
#[test]
fn openai_client_tools_and_json_mode() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let server = Server::start(&model, &[]);
    server.client("tools");
}

/// The trained tiny model does what the demo shows, through the official clients: a tool call
/// and the answer from the tool's result (openai and ollama), a conversation's second question,
/// a JSON answer under a schema; each checked for what it says, not only its shape.
#[test]
fn demo_model_calls_tools_holds_a_conversation_and_answers_in_json() {
    let tmp = tempfile::tempdir().unwrap();
    let model = trained_tiny_gguf(tmp.path(), "q4_k_m");
    let server = Server::start(&model, &[]);
    server.client("demo");
    server.python_client("ollama", "demo");
}

/// llama-server's `/tokenize`, `/detokenize` and `/props`.
#[test]
fn llama_server_utilities() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let server = Server::start(&model, &[]);
    server.client("llama");
    // One log line per request (method, path, status, time), and the worker's per answer.
    std::thread::sleep(Duration::from_millis(200));
    let log = server.log_lines().join("\n");
    for line in [
        "POST /tokenize 200",
        "POST /detokenize 400",
        "GET /props 200",
        "POST /v1/completions 200",
    ] {
        assert!(log.contains(line), "no '{line}' in the log:\n{log}");
    }
    assert!(
        log.contains("generated ") && log.contains("-token prompt"),
        "{log}"
    );
    assert!(
        !log.contains("user agent"),
        "-v's detail without -v:\n{log}"
    );
    drop(server);
    // -v adds the client's user agent; --log-disable leaves only the start and stop lines.
    let server = Server::start(&model, &["-v"]);
    server.client("llama");
    std::thread::sleep(Duration::from_millis(200));
    let log = server.log_lines().join("\n");
    assert!(log.contains("user agent Python-urllib"), "{log}");
    drop(server);
    let server = Server::start(&model, &["--log-disable"]);
    server.client("llama");
    std::thread::sleep(Duration::from_millis(200));
    let log = server.log_lines().join("\n");
    assert!(!log.contains("POST /tokenize"), "{log}");
}

#[test]
fn load_busy_and_auth() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let server = Server::start(&model, &[]);
    server.client("load");
    drop(server);
    let server = Server::start(&model, &["--queue", "1", "--parallel", "1"]);
    server.client("busy");
    drop(server);
    let server = Server::start(&model, &["--api-key", "sekrit"]);
    server.client("auth");
    // Binding beyond loopback without a key is refused.
    let o = run(&[
        "serve",
        "-m",
        model.to_str().unwrap(),
        "--host",
        "0.0.0.0",
        "--port",
        "0",
    ]);
    assert_fails_with(&o, &["--api-key"]);
}
