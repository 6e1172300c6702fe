//! llama.cpp's flags that constrain the answer: `--grammar`/`--grammar-file` (GBNF) and
//! `-j/--json-schema`/`-jf/--json-schema-file`, read and checked before the model loads.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use refusion_engine::chat::tokenizer::Tokenizer;
use refusion_engine::constrain::{gbnf, Format};
use refusion_engine::decode::DecodeParams;

#[derive(Args, Clone, Debug, Default)]
pub struct GrammarArgs {
    /// Constrain the answer to this GBNF grammar (llama.cpp's; `root` is the start). The
    /// answer is then decoded at its frontier, each token masked by the grammar.
    #[arg(long, value_name = "GBNF", conflicts_with_all = ["grammar_file", "json_schema", "json_schema_file"])]
    grammar: Option<String>,
    /// --grammar, read from a file.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["json_schema", "json_schema_file"])]
    grammar_file: Option<PathBuf>,
    /// Constrain the answer to JSON valid against this JSON Schema (`{}`: any JSON object).
    #[arg(
        short = 'j',
        long,
        value_name = "SCHEMA",
        conflicts_with = "json_schema_file"
    )]
    json_schema: Option<String>,
    /// --json-schema, read from a file.
    #[arg(long, visible_alias = "jf", value_name = "FILE")]
    json_schema_file: Option<PathBuf>,
}

/// Grammar and schema files are small; a larger one is a mistake.
const MAX_FILE: u64 = 1 << 20;

fn read(path: &PathBuf, what: &str) -> Result<String> {
    let meta = std::fs::metadata(path).with_context(|| format!("{what} '{}'", path.display()))?;
    if meta.len() > MAX_FILE {
        bail!("{what} '{}' is larger than 1 MiB", path.display());
    }
    std::fs::read_to_string(path).with_context(|| format!("{what} '{}'", path.display()))
}

impl GrammarArgs {
    /// The format asked for, read and checked (syntax, JSON) without the model.
    pub fn format(&self) -> Result<Option<Format>> {
        let gbnf = match (&self.grammar, &self.grammar_file) {
            (Some(g), _) => Some(g.clone()),
            (None, Some(p)) => Some(read(p, "--grammar-file")?),
            _ => None,
        };
        if let Some(g) = gbnf {
            gbnf::to_lark(&g).map_err(|e| anyhow::anyhow!("--grammar: {e}"))?;
            return Ok(Some(Format::Gbnf(g)));
        }
        let schema = match (&self.json_schema, &self.json_schema_file) {
            (Some(s), _) => s.clone(),
            (None, Some(p)) => read(p, "--json-schema-file")?,
            _ => return Ok(None),
        };
        let v: serde_json::Value = serde_json::from_str(&schema)
            .map_err(|e| anyhow::anyhow!("--json-schema is not JSON: {e}"))?;
        Ok(Some(match v.as_object() {
            Some(o) if o.is_empty() => Format::Json,
            _ => Format::JsonSchema(v),
        }))
    }

    /// `params` constrained to `format` compiled over the model's vocabulary.
    pub fn apply(
        format: Option<&Format>,
        params: DecodeParams,
        tok: &Tokenizer,
    ) -> Result<DecodeParams> {
        let Some(f) = format else {
            return Ok(params);
        };
        let guide = tok.guides()?.compile(f)?;
        let params = params.with_guide(Arc::new(guide));
        params.validate()?;
        Ok(params)
    }
}
