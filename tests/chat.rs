//! `refusion chat` (driven through stdin) and `generate --prompt-cache`: later turns and
//! prompts reuse the cached KV, give the same tokens as a cold run, and refuse foreign files.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use common::*;
use serde_json::Value;

fn chat(model: &Path, input: &str) -> (String, String) {
    let mut child = Command::new(bin())
        .args([
            "chat",
            "-m",
            model.to_str().unwrap(),
            "-n",
            "16",
            "--slot-size",
            "4",
            "--serial-blocks",
            "2",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// (reused, prompt) from each "[... R of P prompt tokens from the cache]" line.
fn reuse(stderr: &str) -> Vec<(usize, usize)> {
    stderr
        .lines()
        .filter_map(|l| {
            let rest = l.split(", ").last()?;
            let mut w = rest.split_whitespace();
            let r = w.next()?.parse().ok()?;
            w.next()?;
            let p = w.next()?.parse().ok()?;
            Some((r, p))
        })
        .collect()
}

#[test]
fn two_turns_reuse_the_cache_and_sessions_save_and_load() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let saved = tmp.path().join("conv.kv");
    let script = format!(
        "Hello there\nAnd a second question\n/save {0}\n/reset\nFresh start\n/load {0}\nThird turn\n/exit\n",
        saved.display()
    );
    let (out, err) = chat(&model, &script);
    let r = reuse(&err);
    assert_eq!(r.len(), 4, "{err}");
    assert_eq!(r[0].0, 0, "the first turn starts cold");
    assert!(
        r[1].0 > r[0].1,
        "the second turn reuses the first turn's prompt and answer: {r:?}"
    );
    assert_eq!(r[2].0, 0, "after /reset nothing is cached");
    assert!(
        r[3].0 > r[1].1,
        "after /load the saved conversation is reused: {r:?}"
    );
    assert!(
        err.contains("(conversation reset)") && err.contains("loaded 4 messages"),
        "{err}"
    );
    assert_eq!(
        out.lines().filter(|l| !l.trim().is_empty()).count(),
        4,
        "four answers:\n{out}"
    );

    // A saved file from another model is refused with a message, and the chat goes on.
    let other = tmp.path().join("other.gguf");
    let o = run(&[
        "convert",
        fixture_model("pub-a").to_str().unwrap(),
        "-o",
        other.to_str().unwrap(),
        "--outtype",
        "f32",
        "-q",
    ]);
    assert!(o.status.success());
    let mut child = Command::new(bin())
        .args([
            "chat",
            "-m",
            other.to_str().unwrap(),
            "-n",
            "8",
            "--slot-size",
            "4",
            "--serial-blocks",
            "1",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("/load {}\nHi\n", saved.display()).as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success());
    assert!(err.contains("another model"), "{err}");
    assert!(!err.contains("panicked"));
}

/// The prompt and length most of these runs ask for.
const STORY: [&str; 4] = ["-p", "Tell me a story about a lighthouse.", "-n", "16"];

/// `generate REQUEST` with two serial blocks of slots of 4 and `--prompt-cache CACHE`: its
/// `--json` report, with its stderr as `"stderr"`.
fn generate_json(model: &Path, cache: &Path, request: &[&str]) -> Value {
    let mut args = vec!["generate", "-m", model.to_str().unwrap()];
    args.extend_from_slice(request);
    args.extend([
        "--slot-size",
        "4",
        "--serial-blocks",
        "2",
        "--json",
        "--prompt-cache",
        cache.to_str().unwrap(),
    ]);
    let o = run(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut j: Value = serde_json::from_slice(&o.stdout).unwrap();
    j["stderr"] = Value::String(stderr(&o));
    j
}

#[test]
fn prompt_cache_reuse_matches_a_cold_run_and_refuses_bad_files() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let cache = tmp.path().join("prompt.kv");
    let cold = generate_json(&model, &cache, &STORY);
    assert!(cache.exists());
    assert_eq!(cold["cached_prompt_tokens"], 0);
    let warm = generate_json(&model, &cache, &STORY);
    assert!(warm["cached_prompt_tokens"].as_u64().unwrap() > 0);
    assert_eq!(
        warm["tokens"], cold["tokens"],
        "reusing the cache changes nothing"
    );

    // Corrupt and truncated files are detected, not trusted.
    let bytes = std::fs::read(&cache).unwrap();
    let mut bad = bytes.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0xff;
    std::fs::write(&cache, &bad).unwrap();
    let j = generate_json(&model, &cache, &STORY);
    assert!(
        j["stderr"].as_str().unwrap().contains("checksum"),
        "{}",
        j["stderr"]
    );
    assert_eq!(j["tokens"], cold["tokens"]);
    assert_eq!(j["cached_prompt_tokens"], 0);
    std::fs::write(&cache, &bytes[..bytes.len() / 3]).unwrap();
    let j = generate_json(&model, &cache, &STORY);
    assert!(
        j["stderr"].as_str().unwrap().contains("truncated"),
        "{}",
        j["stderr"]
    );
    assert_eq!(j["tokens"], cold["tokens"]);

    // A cache made with another cache type is refused.
    let mut f16 = STORY.to_vec();
    f16.extend(["--cache-type", "f16"]);
    let j = generate_json(&model, &cache, &f16);
    let err = j["stderr"].as_str().unwrap();
    assert!(
        err.contains("KV cache of f32, this run's is f16 (give -ctk f32 -ctv f32)"),
        "{err}"
    );
}

#[test]
fn ctrl_c_stops_the_current_answer_and_the_chat_goes_on() {
    use std::io::Read;
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let mut child = Command::new(bin())
        .args([
            "chat",
            "-m",
            model.to_str().unwrap(),
            "-n",
            "2048",
            "--slot-size",
            "4",
            "--serial-blocks",
            "512",
            "-c",
            "4096",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"Write a very long story\n").unwrap();
    stdin.flush().unwrap();
    // Wait for the answer to start streaming, then press Ctrl-C.
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first).unwrap();
    let pid = child.id().to_string();
    assert!(Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap()
        .success());
    stdin.write_all(b"/exit\n").unwrap();
    drop(stdin);
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("(stopped)"), "{err}");
}

/// ollama's `/bye` and `/?`, "unknown command" for any other `/word`, and a failed `/load`
/// that leaves the conversation and its cache as they were (the next turn still sees the first
/// one, from the cache: nothing is read again).
#[test]
fn commands_and_a_failed_load_keep_the_conversation() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let saved = tmp.path().join("conv.kv");
    let corrupt = tmp.path().join("corrupt.kv");
    std::fs::write(&corrupt, b"not a saved conversation").unwrap();
    let script = format!(
        "Hello there\n/load {}\n/load {}\n/foo bar\n/?\nSecond turn\n/save {}\n/bye\nNever read\n",
        tmp.path().join("missing.kv").display(),
        corrupt.display(),
        saved.display()
    );
    let (_, err) = chat(&model, &script);
    assert!(err.contains("unknown command /foo (/? for help)"), "{err}");
    assert!(err.contains("commands: /reset"), "/? shows the help: {err}");
    assert_eq!(
        err.matches("the conversation goes on as it was").count(),
        2,
        "{err}"
    );
    // Two answers (the line after /bye is never read), the second turn's prompt holding the
    // first turn (more prompt tokens than the first), most of it from the cache.
    let r = reuse(&err);
    assert_eq!(r.len(), 2, "{err}");
    assert!(r[1].1 > r[0].1 + 4, "the first turn was kept: {r:?}");
    assert!(
        r[1].0 >= r[0].1,
        "the failed loads dropped the cache (the first turn's prompt was read again): {r:?}"
    );
    // The saved conversation holds both turns: 4 messages.
    let (_, err) = chat(&model, &format!("/load {}\n/bye\n", saved.display()));
    assert!(err.contains("(loaded 4 messages"), "{err}");
}

/// A chat on a pseudo-terminal (util-linux's `script`), typed key by key.
struct Pty {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    out: std::sync::Arc<std::sync::Mutex<String>>,
    seen: usize,
}

impl Pty {
    fn chat(model: &Path, home: &Path) -> Pty {
        use std::io::Read;
        let line = format!(
            "'{}' chat -m '{}' -n 16 --slot-size 4 --serial-blocks 2",
            bin().display(),
            model.display()
        );
        let mut child = Command::new("script")
            .args(["-qefc", &line, "/dev/null"])
            .env("HOME", home)
            .env_remove("XDG_STATE_HOME")
            .env("TERM", "xterm")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("util-linux's script");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = child.stdout.take().unwrap();
        let out = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let sink = out.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Pty {
            child,
            stdin,
            out,
            seen: 0,
        }
    }

    /// Waits until `needle` appears after what was already waited for.
    fn wait_for(&mut self, needle: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let out = self.out.lock().unwrap().clone();
            if let Some(i) = out[self.seen.min(out.len())..].find(needle) {
                self.seen += i + needle.len();
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no {needle:?} in the terminal: {out}"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    fn keys(&mut self, keys: &str) {
        self.stdin.write_all(keys.as_bytes()).unwrap();
        self.stdin.flush().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// On a terminal, lines are edited (Ctrl-A moves to the start), the up arrow recalls the last
/// line, Ctrl-C at the prompt keeps the chat, Ctrl-D leaves, and the history survives the
/// process (the next chat recalls the last line of the previous one).
#[test]
fn line_editing_and_history_on_a_terminal() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let mut t = Pty::chat(&model, tmp.path());
    t.wait_for("> ");
    t.keys("Hello there\r");
    t.wait_for("prompt tokens from the cache]");
    t.wait_for("> ");
    t.keys("\x1b[A"); // up: "Hello there" again
    t.keys("\r");
    t.wait_for("prompt tokens from the cache]");
    t.wait_for("> ");
    t.keys("bar\x01/foo \r"); // typed "bar", then Ctrl-A and "/foo " before it
    t.wait_for("unknown command /foo (/? for help)");
    t.wait_for("> ");
    t.keys("\x03"); // Ctrl-C at the prompt
    t.wait_for("(Ctrl-D or /bye to exit)");
    t.keys("\x04"); // Ctrl-D
    let status = t.child.wait().unwrap();
    assert!(status.success(), "{}", t.out.lock().unwrap());
    let history =
        std::fs::read_to_string(tmp.path().join(".local/state/refusion/chat_history")).unwrap();
    assert!(history.contains("Hello there"), "{history}");
    assert!(history.contains("/foo bar"), "{history}");

    // A new chat recalls the previous one's last line.
    let mut t = Pty::chat(&model, tmp.path());
    t.wait_for("> ");
    t.keys("\x1b[A\r");
    t.wait_for("unknown command /foo (/? for help)");
    t.keys("/bye\r");
    assert!(t.child.wait().unwrap().success());
}

/// ollama's multi-line input: `"""` opens a message that goes on over lines until one ends
/// with `"""`; a one-line `"""text"""` is a message too. Each is one turn.
#[test]
fn triple_quotes_make_one_message_of_several_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let (_, err) = chat(
        &model,
        "\"\"\"A first line\n/not a command\nlast line\"\"\"\n\"\"\"one line\"\"\"\n/exit\n",
    );
    let turns = reuse(&err);
    assert_eq!(turns.len(), 2, "{err}");
    assert!(!err.contains("unknown command"), "{err}");
    // The three lines are one prompt: longer than the one-line message's.
    assert!(turns[0].1 > 12, "{turns:?}");
}

/// Lines typed while an answer is being decoded wait in the terminal and are answered in turn
/// (issue 33, item 5): three lines typed at once give three answers, none lost.
#[test]
fn lines_typed_during_an_answer_are_queued() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let mut t = Pty::chat(&model, tmp.path());
    t.wait_for("> ");
    t.keys("First line\rSecond line\rThird line\r");
    for _ in 0..3 {
        t.wait_for("prompt tokens from the cache]");
    }
    t.wait_for("> ");
    t.keys("\x04");
    assert!(t.child.wait().unwrap().success());
    let out = t.out.lock().unwrap().clone();
    for line in ["Second line", "Third line"] {
        assert!(out.contains(line), "{line} was lost: {out}");
    }
}

/// A saved prompt longer than the next request's cache (its prompt, answer and a block) is
/// still loaded and its common prefix reused: `generate` sizes its cache to the request, and
/// makes room for the saved entries (it started fresh instead).
#[test]
fn a_longer_saved_prompt_still_gives_its_common_prefix() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let cache = tmp.path().join("prompt.kv");
    let ids = |n: u32| {
        (1..=n)
            .map(|i| (i * 7).to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let gen = |prompt: &str, n: &str| {
        let j = generate_json(&model, &cache, &["--prompt-ids", prompt, "-n", n]);
        let err = j["stderr"].as_str().unwrap().to_string();
        (j, err)
    };
    let (cold, _) = gen(&ids(120), "16");
    assert_eq!(cold["cached_prompt_tokens"], 0);
    let (warm, err) = gen(&ids(20), "8");
    // All but the last prompt token: one is always left to feed.
    assert_eq!(warm["cached_prompt_tokens"], 19, "{err}");
    assert!(!err.contains("starting fresh"), "{err}");
}

/// A terminal closed while chat waits at the prompt: reads and writes then fail with EIO. The
/// chat ends cleanly (EX_IOERR, 74, or 130 for the hangup), never with a panic's 101. Python's
/// `pty` plays the terminal.
#[cfg(unix)]
#[test]
fn a_terminal_closed_at_the_prompt_ends_the_chat_without_a_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let script = tmp.path().join("closed_terminal.py");
    std::fs::write(
        &script,
        r#"import os, pty, select, signal, sys, time
pid, fd = pty.fork()
if pid == 0:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    os.execv(sys.argv[1], sys.argv[1:])
seen = b""
deadline = time.time() + 60
while b"> " not in seen and time.time() < deadline:
    if select.select([fd], [], [], 1)[0]:
        try:
            seen += os.read(fd, 4096)
        except OSError:
            break
assert b"> " in seen, seen
os.close(fd)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"#,
    )
    .unwrap();
    let o = Command::new(python())
        .arg(&script)
        .arg(bin())
        .args(["chat", "-m", model.to_str().unwrap(), "-t", "1"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    // 74 when a read or write meets EIO first; 130 when the hangup signal does (ctrlc takes
    // SIGHUP as it takes Ctrl-C at the prompt). Never a panic's 101.
    let code = stdout(&o).trim().to_string();
    assert!(code == "74" || code == "130", "exit {code}: {}", stderr(&o));
}

/// ollama's chat commands: `/set parameter` (its names and ReFusion's, checked), `/set system`,
/// `/show`, `/clear`.
#[test]
fn ollamas_set_show_and_clear() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let (_, err) = chat(
        &model,
        "/set parameter num_predict 8\n/show parameters\n/set parameter slot_threshold 2\n\
         /set parameter bogus 1\n/set system Be brief.\n/show system\n/show template\n\
         Hello\n/clear\n/bye\n",
    );
    assert!(err.contains("(set num_predict to 8)"), "{err}");
    assert!(err.contains("num_predict 8 "), "{err}");
    assert!(
        err.contains("slot threshold"),
        "an invalid value was not refused:\n{err}"
    );
    assert!(err.contains("unknown parameter 'bogus'"), "{err}");
    assert!(
        err.contains("(system message set)") && err.contains("Be brief."),
        "{err}"
    );
    assert!(
        err.contains("<|im_start|>"),
        "no chat template shown:\n{err}"
    );
    assert!(err.contains("(conversation reset)"), "{err}");
}
