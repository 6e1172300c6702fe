//! A stand-in for the Hugging Face Hub on loopback (`HF_ENDPOINT`): repo listings
//! (`/api/models/{repo}/revision/{rev}`), `resolve` with the headers real clients read
//! (`X-Repo-Commit`, `ETag`, `X-Linked-Etag`, `X-Linked-Size`, `Content-Length`, `Range` and
//! `Content-Range`), and the Hub's 401/404 answers with `X-Error-Code`. It logs every request
//! and the body bytes it served, and can serve slowly (to cut a download off midway).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Clone)]
pub struct FakeRepo {
    pub commit: String,
    pub files: BTreeMap<String, Arc<Vec<u8>>>,
    /// Served only with `Authorization: Bearer <token>`.
    pub token: Option<String>,
    /// Listed, but `resolve` answers 404 for these.
    pub broken: Vec<String>,
}

impl FakeRepo {
    pub fn new(commit_seed: u64) -> FakeRepo {
        FakeRepo {
            commit: hex(commit_seed, 40),
            files: BTreeMap::new(),
            token: None,
            broken: Vec::new(),
        }
    }

    pub fn file(mut self, name: &str, bytes: Vec<u8>) -> FakeRepo {
        self.files.insert(name.to_string(), Arc::new(bytes));
        self
    }

    /// Every file of a folder (top level).
    pub fn folder(mut self, dir: &Path) -> FakeRepo {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            if e.path().is_file() {
                let name = e.file_name().to_string_lossy().into_owned();
                self.files
                    .insert(name, Arc::new(std::fs::read(e.path()).unwrap()));
            }
        }
        self
    }
}

#[derive(Debug, Clone)]
pub struct Logged {
    pub method: String,
    pub path: String,
    pub range: Option<String>,
    pub status: u16,
    /// Body bytes sent (0 for HEAD and errors).
    pub body: usize,
    /// Which request this was (the log may be cleared while a killed client's answer is
    /// still going out, so entries are found by id, not by index).
    id: u64,
}

static NEXT_REQUEST: AtomicU64 = AtomicU64::new(0);

pub struct FakeHub {
    pub url: String,
    repos: Arc<Mutex<BTreeMap<String, FakeRepo>>>,
    log: Arc<Mutex<Vec<Logged>>>,
    slow: Arc<AtomicBool>,
}

/// A hex digest stand-in: deterministic, `len` hex digits.
fn hex(seed: u64, len: usize) -> String {
    let mut s = String::new();
    let mut x = seed ^ 0x9e37_79b9_7f4a_7c15;
    while s.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(&format!("{x:016x}"));
    }
    s.truncate(len);
    s
}

fn content_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// LFS files (weights) get a sha256-like etag and `X-Linked-*` headers, as on the Hub.
fn is_lfs(name: &str) -> bool {
    name.ends_with(".safetensors") || name.ends_with(".gguf") || name.ends_with(".bin")
}

impl FakeHub {
    pub fn start(repos: BTreeMap<String, FakeRepo>) -> FakeHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let hub = FakeHub {
            url,
            repos: Arc::new(Mutex::new(repos)),
            log: Arc::new(Mutex::new(Vec::new())),
            slow: Arc::new(AtomicBool::new(false)),
        };
        let (repos, log, slow) = (hub.repos.clone(), hub.log.clone(), hub.slow.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (repos, log, slow) = (repos.clone(), log.clone(), slow.clone());
                std::thread::spawn(move || {
                    let _ = serve(stream, &repos, &log, &slow);
                });
            }
        });
        hub
    }

    pub fn set_slow(&self, slow: bool) {
        self.slow.store(slow, Ordering::SeqCst);
    }

    pub fn log(&self) -> Vec<Logged> {
        self.log.lock().unwrap().clone()
    }

    pub fn clear_log(&self) {
        self.log.lock().unwrap().clear();
    }

    /// Body bytes served for files whose path ends with `suffix`.
    pub fn served(&self, suffix: &str) -> usize {
        self.log()
            .iter()
            .filter(|l| l.path.ends_with(suffix) && l.path.contains("/resolve/"))
            .map(|l| l.body)
            .sum()
    }

    /// Requests for file contents (GET on `resolve` that sent a body beyond one byte).
    pub fn downloads(&self) -> Vec<Logged> {
        self.log()
            .into_iter()
            .filter(|l| l.method == "GET" && l.path.contains("/resolve/") && l.body > 1)
            .collect()
    }
}

struct Request {
    method: String,
    path: String,
    range: Option<String>,
    auth: Option<String>,
}

fn read_request(stream: &TcpStream) -> Option<Request> {
    let mut r = BufReader::new(stream);
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let target = parts.next()?;
    let path = target.split('?').next()?.to_string();
    let (mut range, mut auth) = (None, None);
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).ok()? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            let v = v.trim().to_string();
            match k.trim().to_ascii_lowercase().as_str() {
                "range" => range = Some(v),
                "authorization" => auth = Some(v),
                _ => {}
            }
        }
    }
    Some(Request {
        method,
        path,
        range,
        auth,
    })
}

fn respond(
    mut s: &TcpStream,
    status: u16,
    headers: &[(String, String)],
    body: &[u8],
    send_body: bool,
    slow: bool,
    on_sent: &dyn Fn(usize),
) -> std::io::Result<()> {
    let reason = match status {
        200 => "OK",
        206 => "Partial Content",
        401 => "Unauthorized",
        404 => "Not Found",
        416 => "Range Not Satisfiable",
        _ => "Error",
    };
    let mut head = format!("HTTP/1.1 {status} {reason}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    s.write_all(head.as_bytes())?;
    if !send_body {
        return Ok(());
    }
    let mut sent = 0;
    for chunk in body.chunks(if slow { 32 * 1024 } else { 1 << 20 }) {
        s.write_all(chunk)?;
        sent += chunk.len();
        on_sent(sent);
        if slow {
            s.flush()?;
            std::thread::sleep(Duration::from_millis(150));
        }
    }
    Ok(())
}

fn error(code: &str, message: &str) -> (Vec<(String, String)>, Vec<u8>) {
    (
        vec![
            ("X-Error-Code".into(), code.into()),
            ("Content-Type".into(), "application/json".into()),
        ],
        format!("{{\"error\":\"{message}\"}}").into_bytes(),
    )
}

/// `bytes=a-b` / `bytes=a-` against a length: the (start, end exclusive) to send.
fn parse_range(range: &str, len: usize) -> Option<(usize, usize)> {
    let spec = range.strip_prefix("bytes=")?;
    let (a, b) = spec.split_once('-')?;
    let start: usize = a.parse().ok()?;
    let end = if b.is_empty() {
        len
    } else {
        b.parse::<usize>().ok()? + 1
    };
    (start <= end && end <= len && start < len.max(1)).then_some((start, end.min(len)))
}

fn serve(
    stream: TcpStream,
    repos: &Mutex<BTreeMap<String, FakeRepo>>,
    log: &Mutex<Vec<Logged>>,
    slow: &AtomicBool,
) -> std::io::Result<()> {
    let Some(req) = read_request(&stream) else {
        return Ok(());
    };
    let head = req.method == "HEAD";
    let segs: Vec<&str> = req.path.trim_start_matches('/').split('/').collect();
    let repos = repos.lock().unwrap().clone();
    let authorized = |r: &FakeRepo| match &r.token {
        None => true,
        Some(t) => req.auth.as_deref() == Some(format!("Bearer {t}").as_str()),
    };
    let mut status = 200;
    let mut headers: Vec<(String, String)> = Vec::new();
    let mut body: Vec<u8> = Vec::new();
    let mut slow_body = false;
    match segs.as_slice() {
        ["api", "models", org, name, "revision", rev] => {
            let id = format!("{org}/{name}");
            match repos.get(&id) {
                None => {
                    (status, (headers, body)) = (401, error("RepoNotFound", "Repository not found"))
                }
                Some(r) if !authorized(r) => {
                    (status, (headers, body)) = (401, error("GatedRepo", "Access restricted"))
                }
                Some(r) if *rev != "main" && *rev != r.commit => {
                    (status, (headers, body)) = (404, error("RevisionNotFound", "Invalid rev id"))
                }
                Some(r) => {
                    let siblings: Vec<String> = r
                        .files
                        .keys()
                        .chain(r.broken.iter())
                        .map(|f| format!("{{\"rfilename\":\"{f}\"}}"))
                        .collect();
                    headers.push(("Content-Type".into(), "application/json".into()));
                    body = format!(
                        "{{\"id\":\"{id}\",\"modelId\":\"{id}\",\"sha\":\"{}\",\"private\":false,\"siblings\":[{}]}}",
                        r.commit,
                        siblings.join(",")
                    )
                    .into_bytes();
                }
            }
        }
        [org, name, "resolve", rev, file @ ..] => {
            let id = format!("{org}/{name}");
            let file = file.join("/");
            match repos.get(&id) {
                None => {
                    (status, (headers, body)) = (401, error("RepoNotFound", "Repository not found"))
                }
                Some(r) if !authorized(r) => {
                    (status, (headers, body)) = (401, error("GatedRepo", "Access restricted"))
                }
                Some(r) if *rev != "main" && *rev != r.commit => {
                    (status, (headers, body)) = (404, error("RevisionNotFound", "Invalid rev id"))
                }
                Some(r) => match r.files.get(&file) {
                    None => {
                        (status, (headers, body)) = (404, error("EntryNotFound", "Entry not found"))
                    }
                    Some(bytes) => {
                        let len = bytes.len();
                        let h = content_hash(bytes);
                        headers.push(("X-Repo-Commit".into(), r.commit.clone()));
                        if is_lfs(&file) {
                            let etag = format!("\"{}\"", hex(h, 64));
                            headers.push(("ETag".into(), format!("\"{}\"", hex(h ^ 1, 40))));
                            headers.push(("X-Linked-Etag".into(), etag));
                            headers.push(("X-Linked-Size".into(), len.to_string()));
                        } else {
                            headers.push(("ETag".into(), format!("\"{}\"", hex(h, 40))));
                        }
                        headers.push(("Accept-Ranges".into(), "bytes".into()));
                        match req.range.as_deref() {
                            Some(range) => match parse_range(range, len) {
                                Some((a, b)) => {
                                    status = 206;
                                    headers.push((
                                        "Content-Range".into(),
                                        format!("bytes {a}-{}/{len}", b.max(a + 1) - 1),
                                    ));
                                    body = bytes[a..b].to_vec();
                                }
                                None => {
                                    status = 416;
                                    headers
                                        .push(("Content-Range".into(), format!("bytes */{len}")));
                                }
                            },
                            None => body = bytes.to_vec(),
                        }
                        slow_body = slow.load(Ordering::SeqCst) && is_lfs(&file);
                    }
                },
            }
        }
        _ => (status, (headers, body)) = (404, error("NotFound", "no such endpoint")),
    }
    let id = NEXT_REQUEST.fetch_add(1, Ordering::SeqCst);
    log.lock().unwrap().push(Logged {
        method: req.method.clone(),
        path: req.path.clone(),
        range: req.range.clone(),
        status,
        body: 0,
        id,
    });
    // A client killed midway leaves what went out counted.
    respond(&stream, status, &headers, &body, !head, slow_body, &|n| {
        if let Some(l) = log.lock().unwrap().iter_mut().rev().find(|l| l.id == id) {
            l.body = n;
        }
    })
}
