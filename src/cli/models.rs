//! ollama's model verbs over the Hugging Face cache (where `-hf` and `convert REPO` keep their
//! downloads): `pull`, `list`/`ls`, `show`, `rm`, `ps` (asks a running `serve`), and `run` (a
//! file or a Hub repo, pulled when missing: with a prompt it generates, without one it chats).
//! A model is named as everywhere else: a GGUF path, or `ORG/NAME[:QUANT]`.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;

use refusion_engine::load::hub::{is_repo_id, Hub, RepoRef};

#[derive(Args, Debug)]
pub struct PullArgs {
    /// A GGUF repository on the Hugging Face Hub: ORG/NAME[:QUANT] (default quant Q4_K_M, else
    /// the only GGUF).
    #[arg(value_name = "ORG/NAME[:QUANT]")]
    model: String,
}

#[derive(Args, Debug)]
pub struct ListArgs {
    /// One JSON object per model instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct ShowArgs {
    /// A GGUF file, or ORG/NAME[:QUANT] in the Hugging Face cache.
    #[arg(value_name = "MODEL")]
    model: String,
    /// Everything as one JSON object (the whole chat template too).
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct RmArgs {
    /// Models in the Hugging Face cache: ORG/NAME[:QUANT] (see `refusion list`).
    #[arg(value_name = "ORG/NAME[:QUANT]", required = true)]
    models: Vec<String>,
}

#[derive(Args, Debug)]
pub struct PsArgs {
    /// The running server's address.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Its API key, if it was started with one.
    #[arg(long)]
    api_key: Option<String>,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// A GGUF file, or ORG/NAME[:QUANT] on the Hugging Face Hub (pulled when missing).
    #[arg(value_name = "MODEL")]
    model: String,
    /// The prompt (its words joined); without one, a chat starts.
    #[arg(value_name = "PROMPT")]
    prompt: Vec<String>,
    /// Flags for `generate` (with a prompt) or `chat` (without), after `--`.
    #[arg(last = true, value_name = "FLAGS")]
    flags: Vec<String>,
}

/// A model as a user names it.
#[derive(Debug)]
enum Spec {
    File(PathBuf),
    Repo {
        id: String,
        quant: Option<String>,
    },
    /// ollama's short name (`refusion-tiny`, `ReFusion:Q8_0`): a repository the cache holds.
    Short {
        name: String,
        quant: Option<String>,
    },
}

impl Spec {
    /// A path when it names an existing file or ends in `.gguf`; else `ORG/NAME[:QUANT]`.
    fn parse(s: &str) -> Result<Spec> {
        let path = Path::new(s);
        if path.exists() || s.to_ascii_lowercase().ends_with(".gguf") {
            return Ok(Spec::File(path.to_path_buf()));
        }
        let (id, quant) = match s.split_once(':') {
            // ollama's `:latest` is the default file, as no tag is.
            Some((id, q)) => (
                id,
                Some(q).filter(|q| !q.is_empty() && !q.eq_ignore_ascii_case("latest")),
            ),
            None => (s, None),
        };
        let quant = quant.map(str::to_string);
        if is_repo_id(id) {
            return Ok(Spec::Repo {
                id: id.to_string(),
                quant,
            });
        }
        let short = !id.is_empty()
            && id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        if !short {
            bail!("'{s}' is neither a GGUF file nor a Hub repository ORG/NAME[:QUANT]");
        }
        Ok(Spec::Short {
            name: id.to_string(),
            quant,
        })
    }

    /// A short name as the one repository in `cached` whose name it is (case aside).
    fn expand(self, cached: &[Cached]) -> Result<Spec> {
        let Spec::Short { name, quant } = self else {
            return Ok(self);
        };
        let mut repos: Vec<&str> = cached
            .iter()
            .map(|m| m.repo.as_str())
            .filter(|r| {
                r.rsplit('/')
                    .next()
                    .is_some_and(|n| n.eq_ignore_ascii_case(&name))
            })
            .collect();
        repos.dedup();
        match repos.as_slice() {
            [one] => Ok(Spec::Repo {
                id: one.to_string(),
                quant,
            }),
            [] => bail!(
                "'{name}' is not a GGUF file, and no cached repository is named so (refusion list shows them; refusion pull ORG/NAME adds one)"
            ),
            many => bail!(
                "'{name}' names several cached repositories: {}; give ORG/NAME",
                many.join(", ")
            ),
        }
    }
}

/// The GGUF file a model names: the file itself, or the repo's from the Hugging Face cache,
/// downloaded first when `fetch` (else only what is cached).
pub fn resolve(spec: &str, fetch: bool, progress: bool) -> Result<PathBuf> {
    let mut parsed = Spec::parse(spec)?;
    if matches!(parsed, Spec::Short { .. }) {
        let hub = Hub::from_env(false)?;
        parsed = parsed.expand(&cached_models(hub.cache_dir()))?;
    }
    match parsed {
        Spec::File(p) => {
            if !p.is_file() {
                bail!("{}: no such model file", p.display());
            }
            Ok(p)
        }
        Spec::Repo { id, quant } => {
            let hub = Hub::from_env(progress)?.with_notes(crate::cli::notes());
            let hub = if fetch { hub } else { hub.cached_only() };
            Ok(hub.gguf(&RepoRef::new(&id, None), quant.as_deref())?)
        }
        Spec::Short { .. } => unreachable!("expanded above"),
    }
}

pub fn pull(a: PullArgs) -> Result<()> {
    if matches!(Spec::parse(&a.model)?, Spec::File(_)) {
        bail!("pull takes a Hub repository ORG/NAME[:QUANT], not a file");
    }
    let path = resolve(&a.model, true, true)?;
    println!("{}", path.display());
    Ok(())
}

/// One GGUF file in the cache.
struct Cached {
    repo: String,
    /// Its path inside the snapshot.
    file: String,
    /// The snapshot's link (or copy).
    path: PathBuf,
    size: u64,
    modified: SystemTime,
}

impl Cached {
    fn name(&self) -> String {
        match quant_of(&self.file) {
            Some(q) => format!("{}:{q}", self.repo),
            None => self.repo.clone(),
        }
    }
}

/// The quant name in a file name (`Qwen3-8B-Q4_K_M.gguf` → `Q4_K_M`), the longest that fits.
fn quant_of(file: &str) -> Option<String> {
    const NAMES: [&str; 24] = [
        "IQ4_XS", "IQ4_NL", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M",
        "Q2_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16", "F16", "F32", "Q4_K",
        "Q5_K", "Q3_K", "IQ2_XS", "IQ3_XS",
    ];
    let upper = file.rsplit('/').next().unwrap_or(file).to_ascii_uppercase();
    NAMES
        .iter()
        .filter(|n| upper.contains(*n))
        .max_by_key(|n| n.len())
        .map(|n| n.to_string())
}

/// Every GGUF file of every model repository in the cache (the newest snapshot's, once).
fn cached_models(cache: &Path) -> Vec<Cached> {
    let mut out: Vec<Cached> = Vec::new();
    let Ok(repos) = std::fs::read_dir(cache) else {
        return out;
    };
    for repo_dir in repos.flatten() {
        let name = repo_dir.file_name().to_string_lossy().into_owned();
        let Some(id) = name.strip_prefix("models--") else {
            continue;
        };
        let repo = id.replacen("--", "/", 1);
        for (file, path) in snapshot_files(&repo_dir.path().join("snapshots")) {
            let Ok(meta) = std::fs::metadata(&path) else {
                continue; // a dangling link
            };
            let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            match out.iter_mut().find(|c| c.repo == repo && c.file == file) {
                Some(c) if c.modified >= modified => {}
                Some(c) => (c.path, c.size, c.modified) = (path, meta.len(), modified),
                None => out.push(Cached {
                    repo: repo.clone(),
                    file,
                    path,
                    size: meta.len(),
                    modified,
                }),
            }
        }
    }
    out.sort_by_key(|c| std::cmp::Reverse(c.modified));
    out
}

/// `(path in the snapshot, its path)` of every `.gguf` under `snapshots/*/`.
fn snapshot_files(snapshots: &Path) -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    let Ok(dirs) = std::fs::read_dir(snapshots) else {
        return out;
    };
    for snap in dirs.flatten().map(|d| d.path()) {
        let mut stack = vec![snap.clone()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                let p = e.path();
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    stack.push(p);
                } else if p.to_string_lossy().to_ascii_lowercase().ends_with(".gguf") {
                    if let Ok(rel) = p.strip_prefix(&snap) {
                        out.push((rel.to_string_lossy().into_owned(), p));
                    }
                }
            }
        }
    }
    out
}

/// Bytes as ollama shows them (decimal: `4.7 GB`).
fn size_text(n: u64) -> String {
    let n = n as f64;
    match n {
        n if n >= 1e9 => format!("{:.1} GB", n / 1e9),
        n if n >= 1e6 => format!("{:.0} MB", n / 1e6),
        n => format!("{:.0} KB", n / 1e3),
    }
}

/// `3 minutes ago`, `2 days ago`.
fn ago(t: SystemTime) -> String {
    let s = SystemTime::now()
        .duration_since(t)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (n, unit) = match s {
        0..=59 => return "just now".into(),
        60..=3599 => (s / 60, "minute"),
        3600..=86_399 => (s / 3600, "hour"),
        86_400..=2_591_999 => (s / 86_400, "day"),
        _ => (s / 2_592_000, "month"),
    };
    format!("{n} {unit}{} ago", if n == 1 { "" } else { "s" })
}

pub fn list(a: ListArgs) -> Result<()> {
    let hub = Hub::from_env(false)?.with_notes(crate::cli::notes());
    let models = cached_models(hub.cache_dir());
    if a.json {
        for m in &models {
            let modified = humantime::format_rfc3339_seconds(m.modified).to_string();
            println!(
                "{}",
                json!({"name": m.name(), "repo": m.repo, "file": m.file, "quant": quant_of(&m.file),
                       "size": m.size, "modified_at": modified, "path": m.path})
            );
        }
        return Ok(());
    }
    let width = models
        .iter()
        .map(|m| m.name().len())
        .max()
        .unwrap_or(0)
        .max(4);
    let fwidth = models
        .iter()
        .map(|m| m.file.len())
        .max()
        .unwrap_or(0)
        .max(4);
    println!(
        "{:width$}  {:fwidth$}  {:>8}  MODIFIED",
        "NAME", "FILE", "SIZE"
    );
    for m in &models {
        println!(
            "{:width$}  {:fwidth$}  {:>8}  {}",
            m.name(),
            m.file,
            size_text(m.size),
            ago(m.modified)
        );
    }
    if models.is_empty() {
        eprintln!(
            "no GGUF models in {} (refusion pull ORG/NAME[:QUANT] adds one)",
            hub.cache_dir().display()
        );
    }
    Ok(())
}

pub fn rm(a: RmArgs) -> Result<()> {
    let hub = Hub::from_env(false)?.with_notes(crate::cli::notes());
    let cache = hub.cache_dir().to_path_buf();
    let models = cached_models(&cache);
    // Every name is checked before anything is deleted.
    let mut chosen = Vec::new();
    for spec in &a.models {
        let Spec::Repo { id, quant } = Spec::parse(spec)?.expand(&models)? else {
            bail!(
                "rm deletes models pulled into the Hugging Face cache ({}); '{spec}' is a file of yours: delete it yourself",
                cache.display()
            );
        };
        let of_repo: Vec<&Cached> = models.iter().filter(|m| m.repo == id).collect();
        let hits: Vec<&Cached> = of_repo
            .iter()
            .copied()
            .filter(|m| {
                quant
                    .as_deref()
                    .is_none_or(|q| quant_of(&m.file).is_some_and(|f| f.eq_ignore_ascii_case(q)))
            })
            .collect();
        match hits.as_slice() {
            [] => bail!("'{spec}' is not in the cache (refusion list shows what is)"),
            [one] => chosen.push(*one),
            many => bail!(
                "'{spec}' names {} files: {}; add the quant (ORG/NAME:QUANT)",
                many.len(),
                many.iter().map(|m| m.name()).collect::<Vec<_>>().join(", ")
            ),
        }
    }
    for m in chosen {
        remove_cached(&cache, m)?;
        println!("deleted '{}'", m.name());
    }
    Ok(())
}

/// Removes one cached file: its links in every snapshot and its blob (when nothing else links
/// to it), and the repository's folder once it holds no file.
fn remove_cached(cache: &Path, m: &Cached) -> Result<()> {
    let repo_dir = cache.join(format!("models--{}", m.repo.replace('/', "--")));
    let blobs = repo_dir.join("blobs");
    let snapshots = repo_dir.join("snapshots");
    let mut targets = Vec::new();
    for (file, path) in snapshot_files(&snapshots) {
        if file != m.file {
            continue;
        }
        if let Ok(target) = std::fs::canonicalize(&path) {
            targets.push(target);
        }
        std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
    }
    let still_linked: Vec<PathBuf> = all_files(&snapshots)
        .iter()
        .filter_map(|p| std::fs::canonicalize(p).ok())
        .collect();
    let blobs = std::fs::canonicalize(&blobs).unwrap_or(blobs);
    for t in targets {
        // Only a blob of this repository, and only when no other link needs it.
        if t.starts_with(&blobs) && !still_linked.contains(&t) {
            std::fs::remove_file(&t).with_context(|| format!("removing {}", t.display()))?;
        }
    }
    if all_files(&snapshots).is_empty() {
        std::fs::remove_dir_all(&repo_dir)
            .with_context(|| format!("removing {}", repo_dir.display()))?;
    }
    Ok(())
}

fn all_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            } else {
                out.push(e.path());
            }
        }
    }
    out
}

pub fn show(a: ShowArgs) -> Result<()> {
    let path = resolve(&a.model, false, false)?;
    let file = refusion_gguf::GgufFile::open(&path)?;
    let (model, decoding) = facts(&file);
    let template = file
        .header
        .get("tokenizer.chat_template")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    if a.json {
        let object = |rows: &[(&str, serde_json::Value)]| {
            let map: serde_json::Map<String, serde_json::Value> = rows
                .iter()
                .map(|(k, v)| (k.replace(' ', "_"), v.clone()))
                .collect();
            serde_json::Value::Object(map)
        };
        let decoding = decoding.as_deref().map(object);
        println!(
            "{}",
            json!({"path": path, "model": object(&model), "decoding": decoding, "template": template})
        );
        return Ok(());
    }
    print_section("Model", &model);
    match &decoding {
        Some(d) => print_section("ReFusion decoding (the file's defaults)", d),
        None => println!("  ReFusion decoding\n    (no refusion.* keys: the built-in defaults)\n"),
    }
    println!("  Template");
    let lines: Vec<&str> = template.lines().collect();
    for l in lines.iter().take(8) {
        println!("    {l}");
    }
    if lines.len() > 8 {
        println!("    ... ({} lines in all; --json shows them)", lines.len());
    }
    Ok(())
}

type Rows = Vec<(&'static str, serde_json::Value)>;

/// What `show` tells, in order: the model, and its decoding defaults when the file has them.
fn facts(file: &refusion_gguf::GgufFile) -> (Rows, Option<Rows>) {
    let card = refusion_server::ModelCard::of(file);
    let h = &file.header;
    let text = |k: &str| json!(h.get(k).and_then(|v| v.as_str()).unwrap_or(""));
    let arch = h
        .get("general.architecture")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    let num = |k: String| json!(h.get(&k).and_then(|v| v.as_u64()));
    let params: u64 = h.tensors.iter().map(|t| t.n_elements()).sum();
    let model = vec![
        ("name", text("general.name")),
        ("architecture", json!(arch)),
        ("parameters", json!(params)),
        ("parameter size", json!(card.parameter_size)),
        ("quantization", json!(card.quantization)),
        ("size", json!(card.size)),
        ("context length", num(format!("{arch}.context_length"))),
        ("embedding length", num(format!("{arch}.embedding_length"))),
        ("layers", num(format!("{arch}.block_count"))),
        (
            "vocabulary",
            json!(h
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.as_array())
                .map(<[_]>::len)),
        ),
        ("mask token id", num("tokenizer.ggml.mask_token_id".into())),
    ];
    let decoding = refusion_gguf::DecodingDefaults::from_metadata(h)
        .ok()
        .map(|d| {
            vec![
                ("gen length", json!(d.gen_length)),
                ("slot size", json!(d.slot_size)),
                ("serial blocks", json!(d.serial_blocks)),
                (
                    "slot threshold",
                    json!(refusion_engine::decode::shortest_f64(d.slot_threshold)),
                ),
                (
                    "token threshold",
                    json!(refusion_engine::decode::shortest_f64(d.token_threshold)),
                ),
            ]
        });
    (model, decoding)
}

fn print_section(title: &str, rows: &[(&str, serde_json::Value)]) {
    println!("  {title}");
    for (k, v) in rows {
        let shown = match v {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Null => continue,
            v if *k == "size" => size_text(v.as_u64().unwrap_or(0)),
            v => v.to_string(),
        };
        println!("    {k:<20}{shown}");
    }
    println!();
}

pub fn ps(a: PsArgs) -> Result<()> {
    let host = if a.host.contains(':') && !a.host.starts_with('[') {
        format!("[{}]", a.host)
    } else {
        a.host.clone()
    };
    let base = format!("http://{host}:{}", a.port);
    let get = |path: &str| -> Result<serde_json::Value> {
        let mut req = ureq::get(&format!("{base}{path}"));
        if let Some(k) = &a.api_key {
            req = req.header("Authorization", &format!("Bearer {k}"));
        }
        let mut res = req.call().map_err(|e| match e {
            ureq::Error::StatusCode(401) => {
                anyhow::anyhow!("{base} wants an API key: pass --api-key")
            }
            e => anyhow::anyhow!(
                "no refusion serve answers at {base} ({e}); --host/--port name another"
            ),
        })?;
        Ok(res.body_mut().read_json()?)
    };
    let models = get("/api/ps")?;
    let health = get("/health").unwrap_or_default();
    println!("NAME                  SIZE      PROCESSOR    RUNNING    WAITING    UNTIL");
    for m in models["models"].as_array().into_iter().flatten() {
        let size = m["size"].as_u64().unwrap_or(0);
        let vram = m["size_vram"].as_u64().unwrap_or(0);
        let processor = if vram == 0 || size == 0 {
            "100% CPU".to_string()
        } else {
            format!("{:.0}% GPU", 100.0 * vram as f64 / size as f64)
        };
        println!(
            "{:<20}  {:>8}  {:<11}  {:>7}    {:>7}    while serve runs",
            m["name"].as_str().unwrap_or("?"),
            size_text(size),
            processor,
            health["slots_processing"].as_u64().unwrap_or(0),
            health["requests_waiting"].as_u64().unwrap_or(0),
        );
    }
    Ok(())
}

/// `run MODEL [PROMPT]`: the model pulled when missing, then `generate -p PROMPT` or `chat`.
pub fn run(a: RunArgs) -> Result<()> {
    let path = resolve(&a.model, true, true)?;
    let path = path.to_string_lossy().into_owned();
    let mut argv: Vec<String> = vec!["refusion".into()];
    if a.prompt.is_empty() {
        argv.extend(["chat".into(), "-m".into(), path]);
    } else {
        argv.extend(["generate".into(), "-m".into(), path]);
        argv.extend(["-p".into(), a.prompt.join(" ")]);
    }
    argv.extend(a.flags);
    super::run_argv(argv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quants_and_names() {
        assert_eq!(quant_of("Qwen3-8B-Q4_K_M.gguf").as_deref(), Some("Q4_K_M"));
        assert_eq!(quant_of("x-q8_0.gguf").as_deref(), Some("Q8_0"));
        assert_eq!(quant_of("sub/model-bf16.gguf").as_deref(), Some("BF16"));
        assert_eq!(quant_of("model.gguf"), None);
        assert!(
            matches!(Spec::parse("org/name:Q8_0"), Ok(Spec::Repo { quant: Some(q), .. }) if q == "Q8_0")
        );
        assert!(matches!(Spec::parse("x.gguf"), Ok(Spec::File(_))));
        assert!(Spec::parse("no/such/thing").is_err());
        assert!(Spec::parse("a b").is_err());
        assert!(matches!(
            Spec::parse("org/name:latest"),
            Ok(Spec::Repo { quant: None, .. })
        ));
        let cached = |repo: &str, file: &str| Cached {
            repo: repo.into(),
            file: file.into(),
            path: PathBuf::from(file),
            size: 1,
            modified: SystemTime::UNIX_EPOCH,
        };
        let models = [
            cached("GSAI-ML/ReFusion", "refusion-Q4_K_M.gguf"),
            cached("GSAI-ML/ReFusion", "refusion-Q8_0.gguf"),
            cached("a/tiny", "t.gguf"),
            cached("b/tiny", "t.gguf"),
        ];
        let short = Spec::parse("refusion:Q8_0")
            .unwrap()
            .expand(&models)
            .unwrap();
        assert!(
            matches!(short, Spec::Repo { id, quant: Some(q) } if id == "GSAI-ML/ReFusion" && q == "Q8_0")
        );
        assert!(matches!(
            Spec::parse("ReFusion:latest").unwrap().expand(&models),
            Ok(Spec::Repo { quant: None, .. })
        ));
        let e = Spec::parse("tiny").unwrap().expand(&models).unwrap_err();
        assert!(e.to_string().contains("a/tiny, b/tiny"), "{e}");
        assert!(Spec::parse("nonsense").unwrap().expand(&models).is_err());
        assert_eq!(size_text(4_700_000_000), "4.7 GB");
    }
}
