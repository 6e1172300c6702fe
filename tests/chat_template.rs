//! Chat templates rendered by minijinja byte-identically to transformers' Jinja2 rendering.
//! Needs python3 with jinja2 (`.ci/run` installs it; REFUSION_PYTHON picks the interpreter).

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use common::*;
use refusion_engine::chat::{ChatTemplate, Message};
use serde_json::json;

fn conversations() -> Vec<(Vec<Message>, bool)> {
    let m = Message::new;
    vec![
        (vec![m("user", "Hello!")], true),
        (
            vec![
                m("system", "You are terse."),
                m("user", "Write a haiku about the sea."),
            ],
            true,
        ),
        (
            vec![
                m("user", "Hi"),
                m("assistant", "Hello! How can I help?"),
                m("user", "Sum 2+2."),
            ],
            true,
        ),
        (
            vec![
                m("user", "Q1"),
                m("assistant", "<think>\nlet me think\n</think>\n\nA1"),
                m("user", "Q2"),
                m("assistant", "<think>\nagain\n</think>\n\nA2"),
            ],
            false,
        ),
        (
            vec![
                m("user", "ünïcode — 中文 🙂\n\n  indented\ttabs"),
                m("assistant", "ok"),
            ],
            true,
        ),
        (
            vec![m("system", "s"), m("user", "u"), m("system", "late system")],
            true,
        ),
        (
            vec![
                m("user", "<tool_response>\nx\n</tool_response>"),
                m("user", "real question"),
            ],
            true,
        ),
    ]
}

fn jinja2_render(template: &str, cases: &[(Vec<Message>, bool)]) -> Vec<String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/interop/render_template.py");
    let req = json!({
        "template": template,
        "cases": cases.iter().map(|(msgs, gen)| json!({"messages": msgs, "add_generation_prompt": gen})).collect::<Vec<_>>(),
    });
    let mut child = Command::new(python())
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 not found (needed with jinja2 for this test)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(req.to_string().as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !err.contains("No module named"),
        "this test needs jinja2: pip install jinja2\n{err}"
    );
    assert!(o.status.success(), "jinja2 rendering failed:\n{err}");
    serde_json::from_slice(&o.stdout).unwrap()
}

fn template_of(tokenizer_config: &Path) -> String {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tokenizer_config).unwrap()).unwrap();
    v["chat_template"].as_str().unwrap().to_string()
}

#[test]
fn templates_render_like_transformers() {
    let cases = conversations();
    for cfg in [
        fixtures().join("tokenizers/qwen3-tokenizer_config.json"),
        fixtures().join("tokenizers/refusion/tokenizer_config.json"),
        fixture_model("pub-a").join("tokenizer_config.json"),
    ] {
        let source = template_of(&cfg);
        let want = jinja2_render(&source, &cases);
        let t = ChatTemplate::new(&source).unwrap();
        for ((msgs, gen), want) in cases.iter().zip(&want) {
            let got = t.render(msgs, *gen).unwrap();
            assert_eq!(&got, want, "{}: {msgs:?}", cfg.display());
        }
    }
}

#[test]
fn refusion_prompt_has_no_think_block() {
    let t = ChatTemplate::new(&template_of(
        &fixtures().join("tokenizers/refusion/tokenizer_config.json"),
    ))
    .unwrap();
    let s = t.render(&[Message::new("user", "Hi")], true).unwrap();
    assert_eq!(s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}
