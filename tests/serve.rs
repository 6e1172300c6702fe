//! `refusion serve` through the official `openai` Python client and plain HTTP, on a tiny model
//! over loopback. Needs python3 with `openai` (`.ci/run` installs it; REFUSION_PYTHON picks the
//! interpreter).

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::*;

struct Server {
    child: Child,
    base: String,
    log: mpsc::Receiver<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn start(model: &Path, extra: &[&str]) -> Server {
        let mut args = vec![
            "serve",
            "-m",
            model.to_str().unwrap(),
            "--port",
            "0",
            "-c",
            "2048",
            "-t",
            "2",
        ];
        args.extend_from_slice(extra);
        let mut child = Command::new(bin())
            .args(&args)
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let base = loop {
            let line = rx
                .recv_timeout(Duration::from_secs(60))
                .expect("server did not start");
            if let Some(rest) = line.split("listening on ").nth(1) {
                break rest.split_whitespace().next().unwrap().to_string();
            }
        };
        Server {
            child,
            base,
            log: rx,
        }
    }

    fn client(&self, mode: &str) {
        let python = std::env::var("REFUSION_PYTHON").unwrap_or_else(|_| "python3".into());
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/interop/openai_client.py");
        let o = Command::new(python)
            .arg(script)
            .arg(&self.base)
            .arg(mode)
            .output()
            .expect("python3 not found");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !err.contains("No module named"),
            "this test needs the openai package: pip install openai\n{err}"
        );
        assert!(
            o.status.success(),
            "{mode} failed:\n{}\n{err}",
            String::from_utf8_lossy(&o.stdout)
        );
        assert!(String::from_utf8_lossy(&o.stdout).contains("OK"));
    }

    fn log_lines(&self) -> Vec<String> {
        self.log.try_iter().collect()
    }
}

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

#[test]
fn load_busy_and_auth() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let server = Server::start(&model, &[]);
    server.client("load");
    drop(server);
    let server = Server::start(&model, &["--queue", "1"]);
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
