//! Models by repo id, against a stand-in Hub on loopback (tests/common/hub.rs): `convert
//! REPO` and `-hf REPO[:QUANT]` download only what they need into the standard Hugging Face
//! cache, reuse it (ours and Python's `huggingface_hub`'s), resume a cut-off download, and
//! answer each failure in one line with no output file.
//! Python's `huggingface_hub` comes from REFUSION_PYTHON (`.ci/run` installs it).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::hub::{FakeHub, FakeRepo};
use common::*;

const PUB: &str = "test-org/pub-a";
const GGUF_REPO: &str = "test-org/tiny-GGUF";
const GATED: &str = "test-org/gated";
const BROKEN: &str = "test-org/broken";

struct Setup {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    hub: FakeHub,
    /// Our own conversion of the fixture folder, to compare with.
    direct: Vec<u8>,
    q8: PathBuf,
}

fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let pub_a = fixture_model("pub-a");
    let direct_path = dir.join("direct.gguf");
    convert_quiet(&pub_a, &direct_path, "f32");
    let tiny = trained_tiny();
    let (q8, q4) = (dir.join("tiny-Q8_0.gguf"), dir.join("tiny-Q4_K_M.gguf"));
    convert_quiet(&tiny, &q8, "q8_0");
    convert_quiet(&tiny, &q4, "q4_k_m");
    let mut repos = BTreeMap::new();
    repos.insert(
        PUB.to_string(),
        FakeRepo::new(1)
            .folder(&pub_a)
            .file("README.md", b"# a model card".to_vec())
            .file("unneeded.bin", vec![7u8; 300_000]),
    );
    repos.insert(
        GGUF_REPO.to_string(),
        FakeRepo::new(2)
            .file("README.md", b"# GGUF".to_vec())
            .file("refusion-tiny-Q8_0.gguf", std::fs::read(&q8).unwrap())
            .file("refusion-tiny-Q4_K_M.gguf", std::fs::read(&q4).unwrap()),
    );
    let mut gated = FakeRepo::new(3).folder(&pub_a);
    gated.token = Some("hf_secret".into());
    repos.insert(GATED.to_string(), gated);
    let mut broken = FakeRepo::new(4).file("config.json", b"{}".to_vec());
    broken.broken = vec!["model.safetensors".into()];
    repos.insert(BROKEN.to_string(), broken);
    Setup {
        direct: std::fs::read(&direct_path).unwrap(),
        _tmp: tmp,
        dir,
        hub: FakeHub::start(repos),
        q8,
    }
}

fn refusion(s: &Setup, home: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(bin());
    c.args(args)
        .current_dir(&s.dir)
        .env("HF_HOME", home)
        .env("HF_ENDPOINT", &s.hub.url)
        .env_remove("HF_TOKEN")
        .env_remove("HUGGING_FACE_HUB_TOKEN")
        .env_remove("HF_HUB_OFFLINE");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn convert(s: &Setup, home: &Path, out: &str, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let mut args = vec!["convert", PUB, "-o", out, "--outtype", "f32", "-q"];
    args.extend_from_slice(extra);
    refusion(s, home, &args, env)
}

/// Runs Python's huggingface_hub against the stand-in Hub; prints what the snippet returns.
fn hf_python(s: &Setup, home: &Path, code: &str) -> String {
    let o = Command::new(python())
        .args(["-c", code])
        .env("HF_HOME", home)
        .env("HF_ENDPOINT", &s.hub.url)
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        .env("HF_HUB_DISABLE_XET", "1")
        .env_remove("HF_HUB_OFFLINE")
        .output()
        .expect("python3 with huggingface_hub");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

#[test]
fn convert_by_repo_id_into_the_hugging_face_cache_and_reuse_it() {
    let s = setup();
    let home = s.dir.join("hf");
    let o = convert(&s, &home, "a.gguf", &[], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        std::fs::read(s.dir.join("a.gguf")).unwrap(),
        s.direct,
        "the same file as converting the folder"
    );
    // Only what a conversion reads was downloaded: no model card, no other files.
    let got: Vec<String> = s.hub.downloads().iter().map(|l| l.path.clone()).collect();
    assert!(
        got.iter().any(|p| p.ends_with("/model.safetensors")),
        "{got:?}"
    );
    assert!(got.iter().any(|p| p.ends_with("/config.json")), "{got:?}");
    assert!(
        !got.iter()
            .any(|p| p.ends_with("README.md") || p.ends_with("unneeded.bin")),
        "{got:?}"
    );
    // The standard layout: blobs, snapshots/<commit>/<file> as links into them, refs/main.
    let repo = home.join("hub/models--test-org--pub-a");
    let commit = std::fs::read_to_string(repo.join("refs/main")).unwrap();
    let link = repo
        .join("snapshots")
        .join(commit.trim())
        .join("model.safetensors");
    assert!(link.symlink_metadata().unwrap().file_type().is_symlink());
    assert!(std::fs::canonicalize(&link)
        .unwrap()
        .starts_with(repo.join("blobs").canonicalize().unwrap()));

    // A second conversion downloads nothing.
    s.hub.clear_log();
    let o = convert(&s, &home, "b.gguf", &[], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(s.hub.downloads().is_empty(), "{:?}", s.hub.downloads());
    assert_eq!(std::fs::read(s.dir.join("b.gguf")).unwrap(), s.direct);

    // Offline, from the cache alone: no request at all.
    s.hub.clear_log();
    let o = convert(&s, &home, "c.gguf", &[], &[("HF_HUB_OFFLINE", "1")]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(s.hub.log().is_empty(), "{:?}", s.hub.log());

    // Python's huggingface_hub finds our downloads in the cache, offline.
    let path = hf_python(
        &s,
        &home,
        &format!(
            "from huggingface_hub import hf_hub_download as d; print(d('{PUB}', 'model.safetensors', local_files_only=True))"
        ),
    );
    assert_eq!(
        std::fs::read(path).unwrap(),
        std::fs::read(fixture_model("pub-a").join("model.safetensors")).unwrap()
    );
}

#[test]
fn a_cache_written_by_python_huggingface_hub_is_reused() {
    let s = setup();
    let home = s.dir.join("hf-python");
    let snapshot = hf_python(
        &s,
        &home,
        &format!("from huggingface_hub import snapshot_download as d; print(d('{PUB}'))"),
    );
    assert!(Path::new(&snapshot).join("config.json").exists());
    s.hub.clear_log();
    let o = convert(&s, &home, "p.gguf", &[], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(s.hub.downloads().is_empty(), "{:?}", s.hub.downloads());
    assert_eq!(std::fs::read(s.dir.join("p.gguf")).unwrap(), s.direct);
}

#[test]
fn an_interrupted_download_resumes_where_it_stopped() {
    let s = setup();
    let home = s.dir.join("hf-resume");
    s.hub.set_slow(true);
    let mut child = Command::new(bin())
        .args(["convert", PUB, "-o", "r.gguf", "--outtype", "f32", "-q"])
        .current_dir(&s.dir)
        .env("HF_HOME", &home)
        .env("HF_ENDPOINT", &s.hub.url)
        .env_remove("HF_HUB_OFFLINE")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Cut it off once part of the weights has arrived.
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.hub.served("model.safetensors") < 100_000 {
        assert!(Instant::now() < deadline, "{:?}", s.hub.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    let _ = child.wait();
    assert!(!s.dir.join("r.gguf").exists());
    let got = s.hub.served("model.safetensors");
    let total = std::fs::metadata(fixture_model("pub-a").join("model.safetensors"))
        .unwrap()
        .len() as usize;
    assert!(
        got < total,
        "the download was not cut off ({got} of {total})"
    );

    s.hub.set_slow(false);
    s.hub.clear_log();
    let o = convert(&s, &home, "r.gguf", &[], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read(s.dir.join("r.gguf")).unwrap(), s.direct);
    // The rest was asked for from where the part file ended, not from the start.
    let resumed: Vec<_> = s
        .hub
        .downloads()
        .into_iter()
        .filter(|l| l.path.ends_with("model.safetensors"))
        .collect();
    assert_eq!(resumed.len(), 1, "{resumed:?}");
    let from: usize = resumed[0]
        .range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    assert!(
        from > 0 && from + resumed[0].body == total,
        "{resumed:?}, {total}"
    );
}

#[test]
fn hub_failures_are_one_line_with_no_output_file() {
    let s = setup();
    let home = s.dir.join("hf-errors");
    let check = |o: &Output, needles: &[&str]| {
        assert_fails_with(o, needles);
        assert!(!s.dir.join("x.gguf").exists());
        assert!(temporaries(&s.dir.join("x.gguf")).is_empty());
    };
    let o = refusion(
        &s,
        &home,
        &["convert", "test-org/nope", "-o", "x.gguf"],
        &[],
    );
    check(
        &o,
        &["test-org/nope", "no such model repository", "HF_TOKEN"],
    );
    let o = convert(&s, &home, "x.gguf", &["--revision", "v9"], &[]);
    check(&o, &["no revision 'v9'"]);
    let gated = ["convert", GATED, "-o", "x.gguf", "--outtype", "f32", "-q"];
    let o = refusion(&s, &home, &gated, &[]);
    check(&o, &["test-org/gated is gated or private", "HF_TOKEN"]);
    let o = refusion(&s, &home, &gated, &[("HF_TOKEN", "hf_secret")]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::remove_file(s.dir.join("x.gguf")).unwrap();
    let o = refusion(&s, &home, &["convert", BROKEN, "-o", "x.gguf"], &[]);
    check(&o, &["test-org/broken", "no file model.safetensors"]);
    // No network: a port nobody listens on.
    let o = refusion(
        &s,
        &home,
        &["convert", "test-org/other", "-o", "x.gguf"],
        &[("HF_ENDPOINT", "http://127.0.0.1:9")],
    );
    check(&o, &["cannot reach http://127.0.0.1:9", "HF_HUB_OFFLINE"]);
    let o = refusion(
        &s,
        &home,
        &["convert", PUB, "-o", "x.gguf"],
        &[("HF_HUB_OFFLINE", "1")],
    );
    check(&o, &["not in the cache", "HF_HUB_OFFLINE"]);
    let o = refusion(
        &s,
        &home,
        &["convert", PUB, "-o", "no-such-dir/x.gguf"],
        &[],
    );
    assert_fails_with(&o, &["output folder 'no-such-dir' does not exist"]);
    assert!(
        s.hub
            .log()
            .iter()
            .all(|l| !l.path.contains("pub-a/resolve")),
        "checked before downloading"
    );
    // Flags are checked before anything is downloaded.
    s.hub.clear_log();
    let o = refusion(
        &s,
        &home,
        &["generate", "-hf", GGUF_REPO, "-p", "hi", "--temp", "-1"],
        &[],
    );
    assert_fails_with(&o, &["--temp must be >= 0"]);
    assert!(s.hub.log().is_empty(), "{:?}", s.hub.log());
    let o = refusion(
        &s,
        &home,
        &[
            "generate",
            "-hf",
            &format!("{GGUF_REPO}:Q5_K_M"),
            "-p",
            "hi",
        ],
        &[],
    );
    assert_fails_with(
        &o,
        &["no GGUF file for Q5_K_M", "refusion-tiny-Q4_K_M.gguf"],
    );
    let o = refusion(&s, &home, &["generate", "-hf", PUB, "-p", "hi"], &[]);
    assert_fails_with(&o, &["has no GGUF files", "convert it first"]);
}

#[test]
fn hf_flag_downloads_only_the_chosen_gguf_and_runs_it() {
    let s = setup();
    let home = s.dir.join("hf-gguf");
    let args = |m: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "generate",
            "--prompt-ids",
            "5,6,7",
            "-n",
            "8",
            "--slot-size",
            "4",
            "--serial-blocks",
            "1",
            "--json",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(m.iter().map(|s| s.to_string()));
        v
    };
    let spec = format!("{GGUF_REPO}:q8_0");
    let a = args(&["-hf", &spec]);
    let o = refusion(
        &s,
        &home,
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let got: Vec<String> = s.hub.downloads().iter().map(|l| l.path.clone()).collect();
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].ends_with("refusion-tiny-Q8_0.gguf"), "{got:?}");
    let local = args(&["-m", s.q8.to_str().unwrap()]);
    let l = refusion(
        &s,
        &home,
        &local.iter().map(String::as_str).collect::<Vec<_>>(),
        &[],
    );
    assert!(l.status.success(), "{}", stderr(&l));
    let tokens = |o: &Output| {
        serde_json::from_str::<serde_json::Value>(&stdout(o)).unwrap()["tokens"].clone()
    };
    assert_eq!(tokens(&o), tokens(&l));
    // Without a quant name: Q4_K_M, and only that file.
    s.hub.clear_log();
    let o = refusion(
        &s,
        &home,
        &[
            "generate",
            "-hf",
            GGUF_REPO,
            "--prompt-ids",
            "5,6",
            "-n",
            "4",
            "--slot-size",
            "4",
            "--serial-blocks",
            "1",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let got: Vec<String> = s.hub.downloads().iter().map(|l| l.path.clone()).collect();
    assert!(
        got.len() == 1 && got[0].ends_with("refusion-tiny-Q4_K_M.gguf"),
        "{got:?}"
    );
    // bench and the long form take it too.
    s.hub.clear_log();
    let o = refusion(
        &s,
        &home,
        &["bench", "--hf-repo", &spec, "-p", "4", "-n", "0", "-r", "1"],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        s.hub.downloads().is_empty(),
        "cached: {:?}",
        s.hub.downloads()
    );
}

/// ollama's verbs over the Hugging Face cache (issue 33, item 1): `pull`, `list`/`ls`, `show`,
/// `run` (pulling when missing; with a prompt it generates, `--` passes flags on), the model as
/// a positional argument, `rm` (only what is in the cache), and `ps` against a running server.
#[test]
fn ollama_verbs_over_the_hugging_face_cache() {
    let s = setup();
    let home = s.dir.join("hf-verbs");
    let spec = format!("{GGUF_REPO}:Q8_0");
    let ok = |args: &[&str]| {
        let o = refusion(&s, &home, args, &[]);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        stdout(&o)
    };
    // Nothing cached: list is empty, show does not download.
    assert!(!ok(&["list"]).contains(GGUF_REPO));
    let o = refusion(&s, &home, &["show", &spec], &[]);
    assert_fails_with(&o, &[GGUF_REPO]);
    assert!(s.hub.downloads().is_empty());
    // pull: the one file, into the cache; list and ls show it.
    let path = ok(&["pull", &spec]);
    assert!(path.trim_end().ends_with("refusion-tiny-Q8_0.gguf") && path.contains("hf-verbs"));
    assert_eq!(s.hub.downloads().len(), 1);
    for verb in ["list", "ls"] {
        let table = ok(&[verb]);
        assert!(table.starts_with("NAME"), "{table}");
        assert!(
            table.contains(&spec) && table.contains("refusion-tiny-Q8_0.gguf"),
            "{table}"
        );
    }
    let line = ok(&["list", "--json"]);
    let v: serde_json::Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
    assert_eq!(v["name"], spec.as_str());
    assert_eq!(v["quant"], "Q8_0");
    // show: from the cache, as text and JSON.
    let shown = ok(&["show", &spec]);
    for needle in ["qwen3", "Q8_0", "slot size", "context length", "Template"] {
        assert!(shown.contains(needle), "{needle}: {shown}");
    }
    let v: serde_json::Value = serde_json::from_str(&ok(&["show", &spec, "--json"])).unwrap();
    assert_eq!(v["model"]["architecture"], "qwen3");
    assert!(v["template"].as_str().unwrap().contains("<|im_start|>"));
    // run: with a prompt it answers; flags after `--` reach generate; no second download.
    let answer = ok(&["run", &spec, "What", "is", "47", "+", "38?"]);
    assert!(answer.contains("85"), "{answer}");
    let short = ok(&["run", &spec, "What is 47 + 38?", "--", "-n", "4"]);
    assert!(short.len() < answer.len(), "{short}");
    // The model as a positional argument, as ollama users write it.
    let o = ok(&["generate", &spec, "-p", "What is 47 + 38?"]);
    assert!(o.contains("85"), "{o}");
    // ollama's short names: the cached repository's name alone, `:latest` as no tag.
    for short in ["tiny-GGUF:Q8_0", "TINY-gguf:q8_0"] {
        let o = ok(&["generate", short, "-p", "What is 47 + 38?", "-n", "4"]);
        assert!(!o.is_empty(), "{short}");
    }
    let o = refusion(&s, &home, &["show", "no-such-model"], &[]);
    assert_fails_with(&o, &["'no-such-model'", "no cached repository"]);
    let o = ok(&["generate", s.q8.to_str().unwrap(), "-p", "What is 47 + 38?"]);
    assert!(o.contains("85"), "{o}");
    assert_eq!(s.hub.downloads().len(), 1);
    // run pulls a model that is not there yet.
    let q4 = format!("{GGUF_REPO}:Q4_K_M");
    assert!(ok(&["run", &q4, "What is 47 + 38?"]).contains("85"));
    assert_eq!(s.hub.downloads().len(), 2);
    // No tag and `:latest` are the default file (Q4_K_M), now cached.
    for short in ["tiny-GGUF", "tiny-GGUF:latest", "test-org/tiny-GGUF:latest"] {
        let o = ok(&["generate", short, "-p", "What is 47 + 38?", "-n", "4"]);
        assert!(!o.is_empty(), "{short}");
    }
    assert_eq!(s.hub.downloads().len(), 2);
    // ps asks a running server.
    let server = common::server::Server::start(&s.q8, &["-a", "tiny-served"]);
    let port = server.addr().rsplit(':').next().unwrap().to_string();
    let table = ok(&["ps", "--port", &port]);
    assert!(
        table.contains("tiny-served") && table.contains("CPU"),
        "{table}"
    );
    drop(server);
    let o = refusion(&s, &home, &["ps", "--port", &port], &[]);
    assert_fails_with(&o, &["no refusion serve answers"]);
    // rm: only names in the cache, never a user's file; each checked before any is deleted.
    let o = refusion(&s, &home, &["rm", s.q8.to_str().unwrap()], &[]);
    assert_fails_with(&o, &["delete it yourself"]);
    assert!(s.q8.exists());
    let o = refusion(&s, &home, &["rm", &spec, "test-org/none"], &[]);
    assert_fails_with(&o, &["test-org/none", "not in the cache"]);
    let o = refusion(&s, &home, &["rm", GGUF_REPO], &[]);
    assert_fails_with(&o, &["names 2 files", "add the quant"]);
    assert!(ok(&["rm", &spec]).contains("deleted"));
    let table = ok(&["list"]);
    assert!(!table.contains(&spec) && table.contains(&q4), "{table}");
    assert!(ok(&["rm", &q4]).contains("deleted"));
    let repo_dir = home.join("hub/models--test-org--tiny-GGUF");
    assert!(
        !repo_dir.exists(),
        "the emptied repository's folder is left"
    );
}
