//! `refusion bench --decode`: llama-bench's `tg` for slot decoding. The real decoder answers a
//! fixed set of prompts once per setting; each row reports committed tokens per second, the
//! reference's TPF, the tokens fed per forward and the forward sizes, and, when the file carries
//! answers (`refusion.eval.*`, written by `convert` from a folder's `heldout.json`), accuracy.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use refusion_convert::info::human_bytes;
use refusion_gguf::{DecodingDefaults, GgufHeader, Value};

use super::{score, BenchArgs, ModelLine};
use refusion_engine::decode::{check, generate, DecodeParams, Kind};
use refusion_engine::kv::KvCache;
use refusion_engine::load::runtime::{load, Loaded};
use refusion_engine::model::Forward;

/// A named decoding setting: the model card's, a paper benchmark's (refusion-facts §7.2), or
/// plain left-to-right decoding on the same file.
pub struct Setting {
    pub name: String,
    params: DecodeParams,
}

/// (name, slot size, serial blocks, slot threshold, token threshold) of the paper's eval.sh.
const PAPER: [(&str, u32, u32, f32, f32); 7] = [
    ("gsm8k", 32, 4, 0.9, 0.4),
    ("humaneval", 32, 4, 0.9, 0.4),
    ("mbpp", 32, 4, 0.9, 0.3),
    ("math", 32, 8, 0.8, 0.6),
    ("mmlu-pro", 16, 4, 0.9, 0.4),
    ("arc-c", 8, 64, 0.8, 0.1),
    ("gpqa", 8, 32, 0.8, 0.2),
];

/// The names `--decode` takes.
pub fn setting_names() -> Vec<&'static str> {
    let mut names = vec!["card", "ar"];
    names.extend(PAPER.iter().map(|p| p.0));
    names
}

impl Setting {
    /// `name` over the file's decoding defaults (`card` is the file's own, the model card's
    /// unless the file says otherwise).
    pub fn parse(name: &str, header: &GgufHeader, eos: u32, mask: u32) -> Result<Setting> {
        let d = DecodingDefaults::from_metadata(header).map_err(anyhow::Error::msg)?;
        let mut p = DecodeParams::new(d, eos, mask);
        match name {
            "card" => {}
            "ar" => p.strategy = Kind::Autoregressive,
            _ => {
                let Some(&(_, k, blocks, ts, tt)) = PAPER.iter().find(|s| s.0 == name) else {
                    bail!(
                        "--decode: unknown setting '{name}' (expected {})",
                        setting_names().join(", ")
                    );
                };
                (p.slot_size, p.serial_blocks) = (k, blocks);
                (p.slot_threshold, p.token_threshold) = (ts, tt);
            }
        }
        p.validate()?;
        Ok(Setting {
            name: name.to_string(),
            params: p,
        })
    }

    /// What the row's test column says: `card k4 b32 .6/.3`.
    pub fn label(&self) -> String {
        let p = &self.params;
        if !p.strategy.method().uses_slots() {
            return format!("decode {} (left to right)", self.name);
        }
        format!(
            "decode {} k{} b{} {}/{}",
            self.name, p.slot_size, p.serial_blocks, p.slot_threshold, p.token_threshold
        )
    }
}

/// One prompt: its ids and, for a held-out question, its kind and reference answer.
pub struct Prompt {
    ids: Vec<u32>,
    answer: Option<(String, String)>,
}

/// `n` prompts: the file's held-out questions through its chat template (spread over the list,
/// so every kind is in), or fixed token-id prompts of 32 ids for files without questions.
pub fn prompts(loaded: &Loaded, n: usize) -> Result<(Vec<Prompt>, &'static str)> {
    let h = &loaded.file.header;
    let strings = |key: &str| -> Option<Vec<String>> {
        h.get(key)?
            .as_array()?
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect()
    };
    let held = (
        strings("refusion.eval.kind"),
        strings("refusion.eval.question"),
        strings("refusion.eval.answer"),
    );
    if let (Some(kinds), Some(questions), Some(answers)) = held {
        if questions.is_empty()
            || kinds.len() != questions.len()
            || answers.len() != questions.len()
        {
            bail!("the file's refusion.eval.* arrays are empty or of different lengths");
        }
        let has_template = h
            .get("tokenizer.chat_template")
            .and_then(Value::as_str)
            .is_some();
        let count = n.min(questions.len());
        let mut out = Vec::with_capacity(count);
        for i in 0..count {
            let q = i * questions.len() / count;
            let ids = crate::cli::generate::prompt_tokens(
                &loaded.tokenizer,
                h,
                &questions[q],
                None,
                has_template,
            )?;
            out.push(Prompt {
                ids,
                answer: Some((kinds[q].clone(), answers[q].clone())),
            });
        }
        return Ok((out, "held-out questions"));
    }
    let vocab = loaded.model.config().vocab as u32;
    let specials: Vec<u32> = [loaded.tokenizer.eos_id, loaded.tokenizer.mask_id]
        .into_iter()
        .flatten()
        .collect();
    let out = (0..n as u32)
        .map(|p| {
            let ids = (0..32u32)
                .map(|i| ((p * 32 + i) * 7_919 + 13) % vocab)
                .map(|t| {
                    if specials.contains(&t) {
                        (t + 1) % vocab
                    } else {
                        t
                    }
                })
                .collect();
            Prompt { ids, answer: None }
        })
        .collect();
    Ok((out, "token-id prompts"))
}

/// What one setting did over the prompts.
pub struct DecodeRow {
    pub label: String,
    pub prompts: usize,
    /// Answer tokens (the front ends' count) over all prompts.
    pub committed: usize,
    pub seconds: f64,
    /// The spread of per-prompt committed tokens/s.
    pub sd: f64,
    /// The reference's TPF, averaged over prompts.
    pub tpf: f64,
    pub forwards: usize,
    pub fed: usize,
    /// Every forward's size (tokens fed), all prompts together.
    pub sizes: Vec<u32>,
    /// Right answers, when the prompts have answers.
    pub right: Option<usize>,
}

impl DecodeRow {
    pub fn tokens_per_s(&self) -> f64 {
        self.committed as f64 / self.seconds.max(1e-12)
    }
    pub fn fed_per_forward(&self) -> f64 {
        self.fed as f64 / self.forwards.max(1) as f64
    }
    /// The median and largest forward.
    pub fn size_summary(&self) -> (u32, u32) {
        let mut s = self.sizes.clone();
        s.sort_unstable();
        (
            s.get(s.len() / 2).copied().unwrap_or(0),
            s.last().copied().unwrap_or(0),
        )
    }
    pub fn accuracy(&self) -> Option<f64> {
        self.right.map(|r| r as f64 / self.prompts.max(1) as f64)
    }
}

/// Checks every prompt against the context under `setting` before any is decoded.
pub fn check_fits(loaded: &Loaded, setting: &Setting, prompts: &[Prompt]) -> Result<()> {
    let vocab = loaded.model.config().vocab;
    for (i, p) in prompts.iter().enumerate() {
        check(&p.ids, &setting.params, vocab, loaded.context)
            .with_context(|| format!("--decode {}: prompt {i}", setting.name))?;
    }
    Ok(())
}

/// Decodes every prompt under `setting` (after one untimed warm-up decode of the first).
pub fn run_setting(
    loaded: &Loaded,
    cache: &mut KvCache,
    setting: &Setting,
    prompts: &[Prompt],
) -> Result<DecodeRow> {
    let model = &loaded.model;
    let mut row = DecodeRow {
        label: setting.label(),
        prompts: prompts.len(),
        committed: 0,
        seconds: 0.0,
        sd: 0.0,
        tpf: 0.0,
        forwards: 0,
        fed: 0,
        sizes: Vec::new(),
        right: prompts.first().and_then(|p| p.answer.as_ref()).map(|_| 0),
    };
    if let Some(first) = prompts.first() {
        cache.crop(0);
        cache.clear_rows();
        generate(model, cache, &first.ids, &setting.params, &mut |_| {})?;
    }
    let mut rates = Vec::with_capacity(prompts.len());
    for p in prompts {
        cache.crop(0);
        cache.clear_rows();
        let t = Instant::now();
        let r = generate(model, cache, &p.ids, &setting.params, &mut |_| {})?;
        let dt = t.elapsed().as_secs_f64();
        let n = r.completion_tokens();
        rates.push(n as f64 / dt.max(1e-12));
        row.committed += n;
        row.seconds += dt;
        row.tpf += r.tpf / prompts.len() as f64;
        row.forwards += r.forward_calls;
        row.fed += r.forward_tokens;
        row.sizes.extend_from_slice(&r.forward_sizes);
        if let (Some((kind, answer)), Some(right)) = (&p.answer, row.right.as_mut()) {
            let text = loaded.tokenizer.decode(r.answer(), true)?;
            *right += usize::from(score::is_right(kind, &text, answer));
        }
    }
    let mean = rates.iter().sum::<f64>() / rates.len().max(1) as f64;
    let var = rates.iter().map(|r| (r - mean).powi(2)).sum::<f64>()
        / rates.len().saturating_sub(1).max(1) as f64;
    row.sd = var.sqrt();
    Ok(row)
}

/// `--decode`: every setting checked against the file and the context, then decoded.
pub fn run(a: BenchArgs) -> Result<()> {
    if a.prompts == 0 {
        bail!("--prompts must be at least 1");
    }
    let names = a.decode.clone().unwrap_or_default();
    let known = setting_names();
    if let Some(bad) = names.iter().find(|n| !known.contains(&n.as_str())) {
        bail!(
            "--decode: unknown setting '{bad}' (expected {})",
            known.join(", ")
        );
    }
    let format = if a.json { "jsonl" } else { a.output.as_str() };
    let table = format == "md";
    crate::cli::set_threads(a.model.threads)?;
    let threads = rayon::current_num_threads();
    let loaded = load(&a.model.load_options(table)?)?;
    let tok = &loaded.tokenizer;
    let (Some(eos), Some(mask)) = (tok.eos_id, tok.mask_id) else {
        bail!("--decode needs a ReFusion file (an EOS and a mask token)");
    };
    let settings = names
        .iter()
        .map(|n| Setting::parse(n, &loaded.file.header, eos, mask))
        .collect::<Result<Vec<_>>>()?;
    let (prompts, source) = prompts(&loaded, a.prompts)?;
    for s in &settings {
        check_fits(&loaded, s, &prompts)?;
    }
    let line = ModelLine::of(&loaded, threads);
    if table && !a.no_header {
        eprintln!(
            "{} {source}, each decoded once per setting after a warm-up",
            prompts.len()
        );
        println!("| model                          |       size |     params | backend       | threads |                          test |             t/s |    TPF | fed/fwd | fwd p50/max |   acc |");
        println!("| ------------------------------ | ---------: | ---------: | ------------- | ------: | ----------------------------: | --------------: | -----: | ------: | ----------: | ----: |");
    }
    let mut cache = loaded.new_cache(loaded.context)?;
    let mut rows = Vec::new();
    for s in &settings {
        let row = run_setting(&loaded, &mut cache, s, &prompts)?;
        match format {
            "md" => println!("{}", line.decode_row(&row)),
            "jsonl" => println!("{}", line.decode_json(&row)),
            _ => {}
        }
        rows.push(row);
    }
    match format {
        "json" => {
            let all: Vec<_> = rows.iter().map(|r| line.decode_json(r)).collect();
            println!("{}", serde_json::Value::Array(all));
        }
        "csv" => {
            if !a.no_header {
                println!("model,size,params,backend,threads,kernels,test,prompts,committed,seconds,tokens_per_s,stddev,tpf,forwards,fed_per_forward,forward_p50,forward_max,accuracy");
            }
            for r in &rows {
                println!("{}", line.decode_csv(r));
            }
        }
        _ => {}
    }
    Ok(())
}

impl ModelLine {
    // The decode rows' columns (the forward rows' are in mod.rs).
    fn decode_row(&self, r: &DecodeRow) -> String {
        let (p50, max) = r.size_summary();
        format!(
            "| {:<30} | {:>10} | {:>10} | {:<13} | {:>7} | {:>29} | {:>15} | {:>6.2} | {:>7.1} | {:>11} | {:>5} |",
            self.model,
            human_bytes(self.size),
            super::params_text(self.params),
            self.backend,
            self.threads,
            r.label,
            format!("{:.2} ± {:.2}", r.tokens_per_s(), r.sd),
            r.tpf,
            r.fed_per_forward(),
            format!("{p50}/{max}"),
            r.accuracy()
                .map(|a| format!("{:.1}%", a * 100.0))
                .unwrap_or_else(|| "-".into()),
        )
    }

    fn decode_json(&self, r: &DecodeRow) -> serde_json::Value {
        let (p50, max) = r.size_summary();
        serde_json::json!({
            "model": self.model,
            "size": self.size,
            "params": self.params,
            "backend": self.backend,
            "threads": self.threads,
            "kernels": self.kernels,
            "caches": self.caches,
            "test": r.label,
            "prompts": r.prompts,
            "committed": r.committed,
            "seconds": r.seconds,
            "tokens_per_s": r.tokens_per_s(),
            "stddev": r.sd,
            "tpf": r.tpf,
            "forwards": r.forwards,
            "fed_per_forward": r.fed_per_forward(),
            "forward_p50": p50,
            "forward_max": max,
            "forward_sizes": r.sizes,
            "accuracy": r.accuracy(),
        })
    }

    fn decode_csv(&self, r: &DecodeRow) -> String {
        let (p50, max) = r.size_summary();
        format!(
            "\"{}\",{},{},{},{},{},\"{}\",{},{},{:.4},{:.4},{:.4},{:.4},{},{:.4},{},{},{}",
            self.model,
            self.size,
            self.params,
            self.backend,
            self.threads,
            self.kernels,
            r.label,
            r.prompts,
            r.committed,
            r.seconds,
            r.tokens_per_s(),
            r.sd,
            r.tpf,
            r.forwards,
            r.fed_per_forward(),
            p50,
            max,
            r.accuracy().map(|a| format!("{a:.4}")).unwrap_or_default(),
        )
    }
}
