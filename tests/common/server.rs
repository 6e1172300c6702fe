//! A `refusion serve` process on a tiny model over loopback, for the server tests.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::bin;

pub struct Server {
    pub child: Child,
    /// `http://127.0.0.1:PORT`
    pub base: String,
    /// Its stderr up to the line saying where it listens (the plan, notes, warnings).
    pub startup: Vec<String>,
    log: mpsc::Receiver<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `refusion serve -m MODEL --port 0 -t 2 [-c 2048] EXTRA...` and waits until it
    /// listens.
    pub fn start(model: &Path, extra: &[&str]) -> Server {
        let mut args = vec![
            "serve",
            "-m",
            model.to_str().unwrap(),
            "--port",
            "0",
            "-t",
            "2",
        ];
        if !extra.contains(&"-c") {
            args.extend_from_slice(&["-c", "2048"]);
        }
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
        let mut startup = Vec::new();
        let base = loop {
            let line = rx
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("server did not start:\n{}", startup.join("\n")));
            if let Some(rest) = line.split("listening on ").nth(1) {
                break rest.split_whitespace().next().unwrap().to_string();
            }
            startup.push(line);
        };
        Server {
            child,
            base,
            startup,
            log: rx,
        }
    }

    /// Runs tests/interop/openai_client.py in MODE against the server; it must print OK.
    pub fn client(&self, mode: &str) {
        self.python_client("openai", mode)
    }

    /// Runs `tests/interop/{package}_client.py BASE MODE` (the official `openai` or `ollama`
    /// client library against this server); it must print OK.
    pub fn python_client(&self, package: &str, mode: &str) {
        let python = std::env::var("REFUSION_PYTHON").unwrap_or_else(|_| "python3".into());
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/interop")
            .join(format!("{package}_client.py"));
        let o = Command::new(python)
            .arg(script)
            .arg(&self.base)
            .arg(mode)
            .output()
            .expect("python3 not found");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !err.contains("No module named"),
            "this test needs the {package} package: pip install {package}\n{err}"
        );
        assert!(
            o.status.success(),
            "{mode} failed:\n{}\n{err}",
            String::from_utf8_lossy(&o.stdout)
        );
        assert!(String::from_utf8_lossy(&o.stdout).contains("OK"));
    }

    /// The stderr lines logged since the last call.
    pub fn log_lines(&self) -> Vec<String> {
        self.log.try_iter().collect()
    }

    /// Waits up to `limit` for a stderr line containing `needle`; returns the lines read
    /// (including it), or all of them in the error.
    pub fn wait_log(&self, needle: &str, limit: Duration) -> Result<String, String> {
        let t = Instant::now();
        let mut seen = Vec::new();
        while let Some(left) = limit.checked_sub(t.elapsed()) {
            match self.log.recv_timeout(left) {
                Ok(line) => {
                    let hit = line.contains(needle);
                    seen.push(line);
                    if hit {
                        return Ok(seen.join("\n"));
                    }
                }
                Err(_) => break,
            }
        }
        Err(seen.join("\n"))
    }

    /// A POST of `body` (JSON text, or a `serde_json::Value`) to `path`: the status and the
    /// raw body (chunked or not).
    pub fn post(&self, path: &str, body: impl std::fmt::Display) -> (u16, String) {
        try_post(&self.addr(), path, body.to_string().as_bytes())
            .unwrap_or_else(|| panic!("POST {path}: no answer"))
    }

    /// A POST that must answer 200: its JSON.
    pub fn post_json(&self, path: &str, body: &serde_json::Value) -> serde_json::Value {
        let (status, text) = self.post(path, body);
        assert_eq!(status, 200, "{path}: {text}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"))
    }

    /// `host:port`, for raw sockets.
    pub fn addr(&self) -> String {
        self.base.trim_start_matches("http://").to_string()
    }

    /// Sends a signal (`"-TERM"`, `"-INT"`) to the server.
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} failed");
    }

    /// Waits up to `limit` for the process to exit.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let t = Instant::now();
        while t.elapsed() < limit {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

/// One POST over a raw loopback connection (`Connection: close`, any bytes as the body): the
/// status and the raw body, or `None` when no answer came (within two minutes).
pub fn try_post(addr: &str, path: &str, body: &[u8]) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(120))).ok()?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).ok()?;
    s.write_all(body).ok()?;
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf).to_string();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_string()))
}
