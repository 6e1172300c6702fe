//! Models by repo id from the Hugging Face Hub, into the standard Hugging Face cache
//! (`$HF_HOME/hub/models--org--name/{blobs,snapshots,refs}`), the layout Python's
//! `huggingface_hub` reads and writes: files either downloaded are reused by the other.
//!
//! The protocol is the `hf-hub` crate's: file metadata (`X-Repo-Commit`, `X-Linked-Etag`,
//! `Content-Range`), resumable blob downloads (`Range`) under a lock, the cache layout and the
//! progress bar. Written here, because the crate does not do it: which files a conversion needs
//! (from the repo's listing), `HF_TOKEN` and `HF_HUB_OFFLINE`, the cache used when the Hub
//! cannot be reached, and errors a user can act on, read from the Hub's status and
//! `X-Error-Code` (the crate reports only a status code).

use std::path::{Path, PathBuf};

use super::Notes;
use hf_hub::api::sync::{Api, ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};

/// A repository and the revision (branch, tag or commit) to take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoRef {
    pub id: String,
    pub revision: String,
}

impl RepoRef {
    pub fn new(id: &str, revision: Option<&str>) -> RepoRef {
        RepoRef {
            id: id.to_string(),
            revision: revision.unwrap_or("main").to_string(),
        }
    }

    /// The repository's own name (`ReFusion` of `GSAI-ML/ReFusion`).
    pub fn name(&self) -> &str {
        self.id.rsplit('/').next().unwrap_or(&self.id)
    }

    fn hf(&self) -> Repo {
        Repo::with_revision(self.id.clone(), RepoType::Model, self.revision.clone())
    }
}

/// Whether `s` reads as a Hub repo id (`org/name`): one slash, the Hub's characters, not a
/// path that exists here (a folder of that name wins).
pub fn is_repo_id(s: &str) -> bool {
    let mut parts = s.split('/');
    let (Some(org), Some(name), None) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let ok = |p: &str| {
        !p.is_empty()
            && p != "."
            && p != ".."
            && !p.starts_with('-')
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    ok(org) && ok(name) && !Path::new(s).exists()
}

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("{repo}: no such model repository on {endpoint} (if it is private, set HF_TOKEN)")]
    RepoNotFound { repo: String, endpoint: String },
    #[error("{repo}: no revision '{revision}' (a branch, tag or commit of the repository)")]
    RevisionNotFound { repo: String, revision: String },
    #[error("{repo}: no file {file} at revision '{revision}'")]
    FileNotFound {
        repo: String,
        revision: String,
        file: String,
    },
    #[error(
        "{repo} is gated or private: {why}; accept its terms on the Hub and set HF_TOKEN to a token that may read it"
    )]
    Unauthorized { repo: String, why: String },
    #[error(
        "cannot reach {endpoint}: {reason} (no network? HF_HUB_OFFLINE=1 uses only files already in the cache)"
    )]
    Unreachable { endpoint: String, reason: String },
    #[error("{repo} (revision '{revision}') is not in the cache at {cache} and HF_HUB_OFFLINE is set: {missing}")]
    NotCached {
        repo: String,
        revision: String,
        cache: String,
        missing: String,
    },
    #[error("{repo} has no GGUF files{hint}")]
    NoGguf { repo: String, hint: String },
    #[error("{repo} has no GGUF file for {quant}; it has: {available}")]
    NoSuchQuant {
        repo: String,
        quant: String,
        available: String,
    },
    #[error("{repo} has several GGUF files; choose one with {repo}:QUANT (one of: {available})")]
    WhichGguf { repo: String, available: String },
    #[error("{repo}: {file} is split into parts; refusion reads single-file GGUFs (merge it with llama-gguf-split --merge)")]
    SplitGguf { repo: String, file: String },
    #[error("{repo} is not a Qwen3/ReFusion checkpoint: {why}")]
    NotACheckpoint { repo: String, why: String },
    #[error("Hugging Face Hub: {0}")]
    Other(String),
}

/// Top-level files a conversion reads, beyond the weights (absent ones are skipped).
const CHECKPOINT_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];
const SHARD_INDEX: &str = "model.safetensors.index.json";

pub struct Hub {
    api: Api,
    cache: Cache,
    endpoint: String,
    offline: bool,
    notes: Notes,
}

/// `HF_HUB_OFFLINE` as `huggingface_hub` reads it (1, true, yes, on).
fn env_flag(name: &str) -> bool {
    std::env::var(name)
        .map(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
        .unwrap_or(false)
}

impl Hub {
    /// From the environment as `huggingface_hub` reads it: `HF_HOME` (the cache),
    /// `HF_ENDPOINT` (a mirror), `HF_TOKEN` (else the token file `huggingface-cli login`
    /// wrote), `HF_HUB_OFFLINE`.
    pub fn from_env(progress: bool) -> Result<Hub, HubError> {
        let cache = Cache::from_env();
        let endpoint = std::env::var("HF_ENDPOINT")
            .ok()
            .filter(|e| !e.is_empty())
            .map(|e| e.trim_end_matches('/').to_string())
            .unwrap_or_else(|| "https://huggingface.co".to_string());
        let token = ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"]
            .iter()
            .find_map(|k| std::env::var(k).ok().filter(|t| !t.trim().is_empty()))
            .or_else(|| cache.token());
        let api = ApiBuilder::from_cache(cache.clone())
            .with_endpoint(endpoint.clone())
            .with_token(token)
            .with_progress(progress)
            .with_retries(3)
            .with_user_agent("refusion", env!("CARGO_PKG_VERSION"))
            .build()
            .map_err(|e| HubError::Other(e.to_string()))?;
        Ok(Hub {
            api,
            cache,
            endpoint,
            offline: env_flag("HF_HUB_OFFLINE"),
            notes: Notes::silent(),
        })
    }

    /// Where the Hub's notes go (a cached snapshot used because the Hub cannot be reached).
    pub fn with_notes(mut self, notes: Notes) -> Hub {
        self.notes = notes;
        self
    }

    /// Only what is cached: nothing is asked of the Hub (as `HF_HUB_OFFLINE=1`).
    pub fn cached_only(mut self) -> Hub {
        self.offline = true;
        self
    }

    /// The cache folder (`$HF_HOME/hub`).
    pub fn cache_dir(&self) -> &Path {
        self.cache.path()
    }

    /// The repository's files at the revision and the commit it resolves to, from the Hub's
    /// listing (`GET /api/models/{id}/revision/{rev}`).
    fn listing(&self, repo: &RepoRef) -> Result<(String, Vec<String>), HubError> {
        let url = format!(
            "{}/api/models/{}/revision/{}",
            self.endpoint, repo.id, repo.revision
        );
        let response = self
            .api
            .repo(repo.hf())
            .info_request()
            .config()
            .http_status_as_error(false)
            .build()
            .call()
            .map_err(|e| self.transport(e))?;
        let status = response.status().as_u16();
        let code = response
            .headers()
            .get("x-error-code")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        if status != 200 {
            return Err(self.status_error(repo, status, &code, None));
        }
        let mut body = response.into_body();
        let info: serde_json::Value = body
            .read_json()
            .map_err(|e| HubError::Other(format!("unreadable answer from {url}: {e}")))?;
        let sha = info["sha"]
            .as_str()
            .ok_or_else(|| HubError::Other(format!("{url}: the answer has no commit (sha)")))?
            .to_string();
        let files = info["siblings"]
            .as_array()
            .map(|s| {
                s.iter()
                    .filter_map(|f| f["rfilename"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        Ok((sha, files))
    }

    fn transport(&self, e: impl std::fmt::Display) -> HubError {
        HubError::Unreachable {
            endpoint: self.endpoint.clone(),
            reason: e.to_string(),
        }
    }

    /// What a status (and the Hub's `X-Error-Code`) means for this repository.
    fn status_error(
        &self,
        repo: &RepoRef,
        status: u16,
        code: &str,
        file: Option<&str>,
    ) -> HubError {
        match (status, code) {
            (_, "RevisionNotFound") => HubError::RevisionNotFound {
                repo: repo.id.clone(),
                revision: repo.revision.clone(),
            },
            (_, "EntryNotFound") | (404, _) if file.is_some() => HubError::FileNotFound {
                repo: repo.id.clone(),
                revision: repo.revision.clone(),
                file: file.unwrap_or_default().to_string(),
            },
            (_, "GatedRepo") => HubError::Unauthorized {
                repo: repo.id.clone(),
                why: "access is restricted (gated)".into(),
            },
            (_, "RepoNotFound") | (404, _) => HubError::RepoNotFound {
                repo: repo.id.clone(),
                endpoint: self.endpoint.clone(),
            },
            (401 | 403, _) => HubError::Unauthorized {
                repo: repo.id.clone(),
                why: format!("the Hub answered {status}"),
            },
            _ => HubError::Other(format!("{}: the Hub answered {status} {code}", repo.id)),
        }
    }

    /// One file into the cache (reused when there; resumed when a download was cut off).
    fn get(&self, repo: &RepoRef, file: &str) -> Result<PathBuf, HubError> {
        self.api.repo(repo.hf()).get(file).map_err(|e| match e {
            ApiError::RequestError(e) => match *e {
                ureq::Error::StatusCode(s) => self.status_error(repo, s, "", Some(file)),
                other => self.transport(other),
            },
            other => HubError::Other(format!("{}/{file}: {other}", repo.id)),
        })
    }

    /// The repository's files at the revision: from the Hub, or, offline or when the Hub cannot
    /// be reached, from the cache's snapshot (with a note).
    fn files(&self, repo: &RepoRef) -> Result<(Vec<String>, bool), HubError> {
        if !self.offline {
            match self.listing(repo) {
                Ok((_, files)) => return Ok((files, true)),
                Err(e @ HubError::Unreachable { .. }) => match self.cached_files(repo) {
                    Some(files) => {
                        self.notes.say(&format!(
                            "note: {e}; using the cached snapshot of {}",
                            repo.id
                        ));
                        return Ok((files, false));
                    }
                    None => return Err(e),
                },
                Err(e) => return Err(e),
            }
        }
        self.cached_files(repo)
            .map(|f| (f, false))
            .ok_or_else(|| self.not_cached(repo, "nothing cached for this revision"))
    }

    fn not_cached(&self, repo: &RepoRef, missing: &str) -> HubError {
        HubError::NotCached {
            repo: repo.id.clone(),
            revision: repo.revision.clone(),
            cache: self.cache.path().display().to_string(),
            missing: missing.to_string(),
        }
    }

    /// The cached snapshot folder of the revision (through `refs/`, or the commit itself).
    fn snapshot_dir(&self, repo: &RepoRef) -> Option<PathBuf> {
        let folder = self
            .cache
            .path()
            .join(format!("models--{}", repo.id.replace('/', "--")));
        let commit = std::fs::read_to_string(folder.join("refs").join(&repo.revision))
            .map(|c| c.trim().to_string())
            .unwrap_or_else(|_| repo.revision.clone());
        let dir = folder.join("snapshots").join(commit);
        dir.is_dir().then_some(dir)
    }

    fn cached_files(&self, repo: &RepoRef) -> Option<Vec<String>> {
        let dir = self.snapshot_dir(repo)?;
        let mut out = Vec::new();
        let mut stack = vec![dir.clone()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).ok()?.flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.exists() {
                    if let Ok(rel) = p.strip_prefix(&dir) {
                        out.push(rel.to_string_lossy().into_owned());
                    }
                }
            }
        }
        Some(out)
    }

    /// Takes `file` from the Hub (online) or from the cached snapshot (offline).
    fn fetch(&self, repo: &RepoRef, file: &str, online: bool) -> Result<PathBuf, HubError> {
        if online {
            return self.get(repo, file);
        }
        self.snapshot_dir(repo)
            .map(|d| d.join(file))
            .filter(|p| p.exists())
            .ok_or_else(|| self.not_cached(repo, &format!("{file} is missing")))
    }

    /// A checkpoint for `refusion convert`: config, tokenizer files and safetensors (the shards
    /// the index names), nothing else. Returns the snapshot folder holding them.
    pub fn checkpoint(&self, repo: &RepoRef) -> Result<PathBuf, HubError> {
        let (files, online) = self.files(repo)?;
        let has = |f: &str| files.iter().any(|x| x == f);
        let not_checkpoint = |why: &str| HubError::NotACheckpoint {
            repo: repo.id.clone(),
            why: why.to_string(),
        };
        if !has("config.json") {
            let hint = if files.iter().any(|f| f.ends_with(".gguf")) {
                " (it holds GGUF files: run them with -hf)"
            } else {
                ""
            };
            return Err(not_checkpoint(&format!("it has no config.json{hint}")));
        }
        let mut wanted: Vec<String> = CHECKPOINT_FILES
            .iter()
            .filter(|f| has(f))
            .map(|f| f.to_string())
            .collect();
        let config = self.fetch(repo, "config.json", online)?;
        if has(SHARD_INDEX) {
            let index = self.fetch(repo, SHARD_INDEX, online)?;
            wanted.push(SHARD_INDEX.to_string());
            for shard in shard_names(&index)? {
                if !has(&shard) {
                    return Err(not_checkpoint(&format!(
                        "{SHARD_INDEX} names {shard}, which the repository does not have"
                    )));
                }
                wanted.push(shard);
            }
        } else if has("model.safetensors") {
            wanted.push("model.safetensors".to_string());
        } else {
            return Err(not_checkpoint(
                "it has no model.safetensors nor model.safetensors.index.json",
            ));
        }
        for f in &wanted {
            self.fetch(repo, f, online)?;
        }
        config
            .parent()
            .map(Path::to_path_buf)
            .ok_or_else(|| HubError::Other("the cache has no snapshot folder".into()))
    }

    /// One GGUF file of a GGUF repository (llama.cpp's `-hf REPO[:QUANT]`): by its quant name
    /// (case-insensitive), else Q4_K_M when there is one, else the only one.
    pub fn gguf(&self, repo: &RepoRef, quant: Option<&str>) -> Result<PathBuf, HubError> {
        let (files, online) = self.files(repo)?;
        let file = pick_gguf(&repo.id, &files, quant)?;
        self.fetch(repo, &file, online)
    }
}

/// The shard file names an index's `weight_map` names, in first-seen order.
fn shard_names(index: &Path) -> Result<Vec<String>, HubError> {
    let text = std::fs::read_to_string(index)
        .map_err(|e| HubError::Other(format!("{}: {e}", index.display())))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| HubError::Other(format!("{SHARD_INDEX}: {e}")))?;
    let map = v["weight_map"]
        .as_object()
        .ok_or_else(|| HubError::Other(format!("{SHARD_INDEX} has no weight_map")))?;
    let mut out: Vec<String> = Vec::new();
    for f in map.values().filter_map(|f| f.as_str()) {
        // The converter refuses names outside the folder; here they would leave the snapshot.
        if f.contains('/') || f.contains('\\') || f.starts_with('.') {
            return Err(HubError::Other(format!(
                "{SHARD_INDEX} names {f:?}, outside the checkpoint folder"
            )));
        }
        if !out.iter().any(|o| o == f) {
            out.push(f.to_string());
        }
    }
    Ok(out)
}

/// A split GGUF part (`name-00001-of-00003.gguf`).
fn is_split_part(f: &str) -> bool {
    let stem = f.trim_end_matches(".gguf");
    let b = stem.as_bytes();
    b.len() > 15
        && stem[b.len() - 15..].starts_with('-')
        && stem[b.len() - 9..].starts_with("-of-")
        && stem[b.len() - 14..b.len() - 9]
            .bytes()
            .all(|c| c.is_ascii_digit())
        && stem[b.len() - 5..].bytes().all(|c| c.is_ascii_digit())
}

/// Which GGUF of a repository's files `quant` names (see [`Hub::gguf`]).
pub fn pick_gguf(repo: &str, files: &[String], quant: Option<&str>) -> Result<String, HubError> {
    let ggufs: Vec<&String> = files
        .iter()
        .filter(|f| f.to_ascii_lowercase().ends_with(".gguf"))
        .collect();
    if ggufs.is_empty() {
        let hint = if files.iter().any(|f| f == "config.json") {
            format!(" (a checkpoint: convert it first, refusion convert {repo} -o FILE.gguf)")
        } else {
            String::new()
        };
        return Err(HubError::NoGguf {
            repo: repo.to_string(),
            hint,
        });
    }
    let list = || {
        ggufs
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    // A quant name matches as a whole word of the file name: Q4_K matches `x-Q4_K.gguf`, not
    // `x-Q4_K_M.gguf`.
    let matches = |f: &str, q: &str| {
        let name = f.rsplit('/').next().unwrap_or(f).to_ascii_uppercase();
        let q = q.to_ascii_uppercase();
        name.match_indices(&q).any(|(i, _)| {
            let before = name[..i].chars().next_back();
            let after = name[i + q.len()..].chars().next();
            !before.is_some_and(|c| c.is_ascii_alphanumeric())
                && !after.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        })
    };
    let chosen: Vec<&String> = match quant {
        Some(q) => ggufs.iter().copied().filter(|f| matches(f, q)).collect(),
        None => {
            let q4 = ggufs
                .iter()
                .copied()
                .filter(|f| matches(f, "Q4_K_M"))
                .collect::<Vec<_>>();
            if q4.is_empty() {
                ggufs.clone()
            } else {
                q4
            }
        }
    };
    match chosen.as_slice() {
        [] => Err(HubError::NoSuchQuant {
            repo: repo.to_string(),
            quant: quant.unwrap_or("Q4_K_M").to_string(),
            available: list(),
        }),
        [one] if is_split_part(one) => Err(HubError::SplitGguf {
            repo: repo.to_string(),
            file: one.to_string(),
        }),
        [one] => Ok(one.to_string()),
        many if many.iter().all(|f| is_split_part(f)) => Err(HubError::SplitGguf {
            repo: repo.to_string(),
            file: many[0].to_string(),
        }),
        _ => Err(HubError::WhichGguf {
            repo: repo.to_string(),
            available: list(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn repo_ids_are_org_and_name() {
        assert!(is_repo_id("GSAI-ML/ReFusion"));
        assert!(is_repo_id("Qwen/Qwen3-8B-GGUF"));
        assert!(!is_repo_id("ReFusion"));
        assert!(!is_repo_id("./ReFusion"));
        assert!(!is_repo_id("/abs/path"));
        assert!(!is_repo_id("a/b/c"));
        assert!(!is_repo_id("a/.."));
        assert!(!is_repo_id("org/na me"));
        assert!(!is_repo_id("src/load")); // exists here (the package folder)
    }

    #[test]
    fn a_gguf_is_picked_by_its_quant_name() {
        let f = files(&[
            "README.md",
            "m-Q4_K.gguf",
            "m-Q4_K_M.gguf",
            "m-q8_0.gguf",
            "m-f16.gguf",
        ]);
        assert_eq!(pick_gguf("r", &f, Some("q8_0")).unwrap(), "m-q8_0.gguf");
        assert_eq!(pick_gguf("r", &f, Some("Q4_K")).unwrap(), "m-Q4_K.gguf");
        assert_eq!(pick_gguf("r", &f, Some("q4_k_m")).unwrap(), "m-Q4_K_M.gguf");
        assert_eq!(pick_gguf("r", &f, None).unwrap(), "m-Q4_K_M.gguf");
        let e = pick_gguf("r", &f, Some("Q5_K_M")).unwrap_err().to_string();
        assert!(
            e.contains("no GGUF file for Q5_K_M") && e.contains("m-q8_0.gguf"),
            "{e}"
        );
        let two = files(&["a-Q8_0.gguf", "a-F16.gguf"]);
        assert!(matches!(
            pick_gguf("r", &two, None),
            Err(HubError::WhichGguf { .. })
        ));
        assert_eq!(
            pick_gguf("r", &files(&["only.gguf"]), None).unwrap(),
            "only.gguf"
        );
        let none = pick_gguf("r", &files(&["config.json", "model.safetensors"]), None);
        assert!(none.unwrap_err().to_string().contains("convert it first"));
        let split = files(&[
            "m-Q4_K_M-00001-of-00002.gguf",
            "m-Q4_K_M-00002-of-00002.gguf",
        ]);
        assert!(matches!(
            pick_gguf("r", &split, None),
            Err(HubError::SplitGguf { .. })
        ));
    }
}
