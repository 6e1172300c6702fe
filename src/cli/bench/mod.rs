//! `refusion bench`: forward throughput in llama-bench's table, and with `--decode` the slot
//! decoder's end to end (decode.rs).

mod decode;
pub mod lists;
mod membw;
mod score;

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use refusion_convert::info::human_bytes;
use refusion_gguf::FileType;

use super::model_args::ModelArgs;
use refusion_engine::load::plan::Workload;
use refusion_engine::load::runtime::{load_for, resident_bytes};
use refusion_engine::model::{Batch, Forward, LogitsFor};

#[derive(Args)]
#[command(mut_arg("model", |a| a.required_unless_present_any(["hf_repo", "model_arg", "membw"])))]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// llama-bench's -pg PP,TG (prompt then generation in one test): refused by name.
    #[arg(long = "pg", hide = true, allow_hyphen_values = true)]
    pg: Option<String>,
    /// New tokens per forward, comma-separated.
    #[arg(
        short = 'p',
        long = "n-prompt",
        default_value = "1,16,32,64,512",
        value_delimiter = ','
    )]
    n_tokens: Vec<usize>,
    /// Entries already in the cache before each forward (llama-bench's depth).
    #[arg(long, short = 'd', default_value_t = 256)]
    prefix: usize,
    /// Timed repetitions per size (after one warm-up).
    #[arg(short = 'r', long, default_value_t = 5)]
    repetitions: usize,
    /// Rounds: every test runs once per round, in turn (-r repetitions each), and each row
    /// gives the median round and the rounds' range: a machine whose speed drifts between
    /// minutes moves every test alike. With lists of models or thread counts (-m a,b / -t 1,2)
    /// every pair runs once per round, in turn.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Generated tokens per test, comma-separated (llama-bench's `-n`): one-token forwards
    /// in sequence, each appended to the cache, as autoregressive decoding runs.
    #[arg(short = 'n', long = "n-gen", value_delimiter = ',')]
    n_gen: Vec<usize>,
    /// Output format, as llama-bench's `-o`: md (the table), json (one array), jsonl (one
    /// object per line), csv.
    #[arg(short = 'o', long = "output", default_value = "md", value_parser = ["md", "json", "jsonl", "csv"])]
    output: String,
    /// One JSON object per line (the same as `-o jsonl`).
    #[arg(long)]
    json: bool,
    /// Decode end to end instead of timing forwards: one row per setting (card: the file's
    /// defaults; gsm8k, humaneval, mbpp, math, mmlu-pro, arc-c, gpqa: the paper's; ar: left to
    /// right), over the file's held-out questions or fixed token-id prompts.
    #[arg(
        long,
        value_delimiter = ',',
        num_args = 0..,
        default_missing_value = "card",
        value_name = "SETTINGS",
        conflicts_with_all = ["n_tokens", "n_gen", "prefix", "repetitions", "rounds"]
    )]
    decode: Option<Vec<String>>,
    /// Measure what the cores can read from memory per second instead (no model): every way
    /// of reading, interleaved over -r rounds; the best is the anchor a one-token forward is
    /// set against (benches/README.md).
    #[arg(long, conflicts_with_all = ["decode", "n_tokens", "n_gen", "prefix", "rounds", "model", "model_arg"])]
    membw: bool,
    /// Prompts per --decode setting.
    #[arg(long, default_value_t = 24, requires = "decode")]
    prompts: usize,
    /// No table or CSV header (the later runs of a list of models or thread counts).
    #[arg(long, hide = true)]
    no_header: bool,
}

/// The forward table's header, as llama-bench's.
pub(super) const TABLE_HEAD: &str = "| model                          |       size |     params | backend       | threads | type_k | type_v |            test |                  t/s |";
pub(super) const TABLE_RULE: &str = "| ------------------------------ | ---------: | ---------: | ------------- | ------: | -----: | -----: | --------------: | -------------------: |";

/// One test's result.
#[derive(Clone)]
struct Row {
    test: String,
    n: usize,
    tokens_per_s: f64,
    sd: f64,
    ms_per_forward: f64,
    /// With `--rounds`: how many, and the lowest and highest round's rate.
    rounds: usize,
    low: f64,
    high: f64,
}

pub fn run(a: BenchArgs) -> Result<()> {
    if let Some(pg) = &a.pg {
        anyhow::bail!(
            "-pg {pg} is not supported: measure the prompt with -p and the generation with -n (one row each)"
        );
    }
    if a.decode.is_some() {
        return decode::run(a);
    }
    if a.membw {
        return run_membw(&a);
    }
    let a = a.checked()?;
    let format = if a.json { "jsonl" } else { a.output.as_str() };
    let table = format == "md";
    super::set_threads(a.model.threads)?;
    let threads = rayon::current_num_threads();
    let opts = a.model.load_options(table)?;
    // With -c, refused before loading; without it, once the model's context is known (its
    // trained context may be below the default): either way before the table starts.
    if let Some(c) = opts.context.filter(|&c| c > 0) {
        a.check_context(c, &format!("-c {c}; raise -c"))?;
    }
    // The plan is of what the tests run: the whole context's cache, the widest forward (a
    // test's, or the depth's fill in chunks of the micro-batch), and the logits of its last
    // token only (as llama-bench asks).
    let widest = a
        .n_tokens
        .iter()
        .copied()
        .chain([1, a.prefix.min(a.model.ubatch)])
        .max()
        .unwrap_or(1);
    let loaded = load_for(&opts, |m| -> Result<_> {
        Ok(Some(Workload {
            kv_entries: m.context,
            forward_tokens: widest,
            logit_rows: 1,
        }))
    })?;
    a.check_context(loaded.context, "the model's context; raise with -c")?;
    let mut cache = loaded.new_cache(loaded.context)?;
    let rss = resident_bytes();
    let vocab = loaded.model.config().vocab as u32;
    let cache = &mut cache;
    fill_prefix(&loaded, cache, a.prefix, vocab)?;
    let line = ModelLine::of(&loaded, threads);
    if table && !a.no_header {
        if let Some(rss) = rss {
            eprintln!(
                "resident memory after load: {} (file {})",
                human_bytes(rss),
                human_bytes(loaded.file.file_len())
            );
        }
        println!("{TABLE_HEAD}");
        println!("{TABLE_RULE}");
    }
    let tests: Vec<(bool, usize)> = a
        .n_tokens
        .iter()
        .map(|&n| (false, n))
        .chain(a.n_gen.iter().map(|&n| (true, n)))
        .collect();
    // With --rounds, every test runs once per round, in turn, so a machine whose speed
    // drifts moves them all alike; a row is printed once its last round is done.
    let mut per_round: Vec<Vec<Row>> = vec![Vec::new(); tests.len()];
    let mut rows = Vec::new();
    for round in 0..a.rounds {
        for (i, &(gen, n)) in tests.iter().enumerate() {
            let times = if gen {
                time_generation(&loaded.model, cache, a.prefix, n, vocab, a.repetitions)?
            } else {
                time_prompt(&loaded.model, cache, a.prefix, n, vocab, a.repetitions)?
            };
            if table && round == 0 && i == 0 {
                if let Some(rss) = resident_bytes() {
                    eprintln!(
                        "resident memory after the first forwards: {}",
                        human_bytes(rss)
                    );
                }
            }
            let kind = if gen { "tg" } else { "pp" };
            per_round[i].push(summarize(
                format!("{kind}{n} @ d{}", a.prefix),
                n,
                gen,
                times,
            ));
            if round + 1 < a.rounds {
                continue;
            }
            let row = line.json(&over_rounds(std::mem::take(&mut per_round[i])), a.prefix);
            match format {
                "md" => println!("{}", table_row(&row)),
                "jsonl" => println!("{row}"),
                _ => {}
            }
            rows.push(row);
        }
    }
    match format {
        "json" => println!("{}", serde_json::Value::Array(rows)),
        "csv" => {
            if !a.no_header {
                println!("{CSV_HEAD}");
            }
            for r in &rows {
                println!("{}", csv_row(r));
            }
        }
        _ => {}
    }
    Ok(())
}

/// The CSV header of forward tests.
pub(super) const CSV_HEAD: &str = "model,size,params,backend,threads,kernels,test,n_tokens,prefix,tokens_per_s,stddev,ms_per_forward,rounds,tokens_per_s_low,tokens_per_s_high,type_k,type_v";

/// A forward test (its JSON object, [`ModelLine::json`]) as a row of llama-bench's table: the
/// median round and the range with `--rounds`, else the rate and its spread.
pub(super) fn table_row(v: &serde_json::Value) -> String {
    let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
    let params = params_text(v["params"].as_u64().unwrap_or(0));
    let rate = if v["rounds"].as_u64().unwrap_or(1) > 1 {
        format!(
            "{:.2} ({:.2}-{:.2})",
            f("tokens_per_s"),
            f("tokens_per_s_low"),
            f("tokens_per_s_high")
        )
    } else {
        format!("{:.2} ± {:.2}", f("tokens_per_s"), f("stddev"))
    };
    format!(
        "| {:<30} | {:>10} | {:>10} | {:<13} | {:>7} | {:>6} | {:>6} | {:>15} | {:>20} |",
        text(v, "model"),
        human_bytes(v["size"].as_u64().unwrap_or(0)),
        params,
        text(v, "backend"),
        text(v, "threads"),
        text(v, "type_k"),
        text(v, "type_v"),
        text(v, "test"),
        rate,
    )
}

/// A forward test (its JSON object) as a CSV row under [`CSV_HEAD`].
pub(super) fn csv_row(v: &serde_json::Value) -> String {
    let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
    format!(
        "\"{}\",{},{},{},{},{},{},{},{},{:.4},{:.4},{:.4},{},{:.4},{:.4},{},{}",
        text(v, "model"),
        text(v, "size"),
        text(v, "params"),
        text(v, "backend"),
        text(v, "threads"),
        text(v, "kernels"),
        text(v, "test"),
        text(v, "n_tokens"),
        text(v, "prefix"),
        f("tokens_per_s"),
        f("stddev"),
        f("ms_per_forward"),
        text(v, "rounds"),
        f("tokens_per_s_low"),
        f("tokens_per_s_high"),
        text(v, "type_k"),
        text(v, "type_v"),
    )
}

/// A parameter count as llama-bench writes it (`595.78 M`, `8.19 B`).
fn params_text(params: u64) -> String {
    if params >= 1_000_000_000 {
        format!("{:.2} B", params as f64 / 1e9)
    } else {
        format!("{:.2} M", params as f64 / 1e6)
    }
}

/// A JSON field as text (strings without their quotes).
fn text(v: &serde_json::Value, k: &str) -> String {
    match &v[k] {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// `--membw`: the table of the ways of reading, the best one marked.
fn run_membw(a: &BenchArgs) -> Result<()> {
    if a.repetitions == 0 {
        bail!("-r must be at least 1");
    }
    super::set_threads(a.model.threads)?;
    let threads = refusion_engine::model::pool::WorkerPool::global().threads();
    let ways = membw::measure(a.repetitions)?;
    let best = ways.iter().map(|w| w.gbps).fold(0.0, f64::max);
    let format = if a.json { "jsonl" } else { a.output.as_str() };
    let json = |w: &membw::Stream| {
        serde_json::json!({
            "test": format!("membw {}", w.name),
            "gbps": w.gbps,
            "gbps_low": w.low,
            "gbps_high": w.high,
            "best": w.gbps == best,
            "rounds": a.repetitions,
            "threads": threads,
        })
    };
    match format {
        "md" => {
            println!("| read            | threads | rounds |   GB/s (median) |          range |");
            println!("| --------------- | ------: | -----: | --------------: | -------------: |");
            for w in &ways {
                let mark = if w.gbps == best { " (best)" } else { "" };
                println!(
                    "| {:<15} | {threads:>7} | {:>6} | {:>15} | {:>14} |",
                    format!("{}{mark}", w.name),
                    a.repetitions,
                    format!("{:.2}", w.gbps),
                    format!("{:.2}-{:.2}", w.low, w.high)
                );
            }
        }
        "json" => {
            let all: Vec<_> = ways.iter().map(json).collect();
            println!("{}", serde_json::Value::Array(all));
        }
        "jsonl" => ways.iter().for_each(|w| println!("{}", json(w))),
        _ => {
            if !a.no_header {
                println!("test,threads,rounds,gbps,gbps_low,gbps_high,best");
            }
            for w in &ways {
                println!(
                    "membw {},{threads},{},{:.3},{:.3},{:.3},{}",
                    w.name,
                    a.repetitions,
                    w.gbps,
                    w.low,
                    w.high,
                    w.gbps == best
                );
            }
        }
    }
    Ok(())
}

impl BenchArgs {
    /// The tests to run (0 skips a kind of test, as in llama-bench: `-p 0 -n 128` is
    /// generation only), refused when there are none.
    fn checked(mut self) -> Result<BenchArgs> {
        if self.repetitions == 0 {
            bail!("-r must be at least 1");
        }
        if self.rounds == 0 {
            bail!("--rounds must be at least 1");
        }
        self.n_tokens.retain(|&n| n > 0);
        self.n_gen.retain(|&n| n > 0);
        if self.n_tokens.is_empty() && self.n_gen.is_empty() {
            bail!("nothing to measure: -p and -n are both 0");
        }
        Ok(self)
    }

    /// Never more than the context: a test that does not fit is refused before any is run
    /// (`whence` says where the context comes from).
    fn check_context(&self, context: usize, whence: &str) -> Result<()> {
        let (flag, largest) = self
            .n_tokens
            .iter()
            .map(|&n| ("-p", n))
            .chain(self.n_gen.iter().map(|&n| ("-n", n)))
            .max_by_key(|&(_, n)| n)
            .unwrap_or(("-p", 1));
        if self.prefix + largest > context {
            bail!(
                "-d {} plus {flag} {largest} is {} tokens, more than the context of {context} ({whence})",
                self.prefix,
                self.prefix + largest,
            );
        }
        Ok(())
    }
}

/// The shared prefix every test runs over (`-d`), committed once.
fn fill_prefix(
    loaded: &refusion_engine::load::runtime::Loaded,
    cache: &mut refusion_engine::kv::KvCache,
    prefix: usize,
    vocab: u32,
) -> Result<()> {
    if prefix == 0 {
        return Ok(());
    }
    let toks: Vec<u32> = (0..prefix as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let pos: Vec<u32> = (0..prefix as u32).collect();
    let mut b = Batch::row(&toks, &pos, 0);
    b.logits_for = LogitsFor::None;
    loaded.model.forward(&b, cache)?;
    cache.commit_row(0)?;
    Ok(())
}

/// What each row says of the model and the machine, as llama-bench's columns.
struct ModelLine {
    model: String,
    size: u64,
    params: u64,
    backend: String,
    threads: usize,
    kernels: &'static str,
    /// One core's data caches, which size the kernels' blocking (`L1d 32 KiB, L2 1 MiB, ...`).
    caches: String,
    /// The KV cache's types (llama-bench's `type_k`, `type_v`).
    types: refusion_engine::kv::KvTypes,
}

impl ModelLine {
    fn of(loaded: &refusion_engine::load::runtime::Loaded, threads: usize) -> ModelLine {
        let h = &loaded.file.header;
        let file_type = h
            .get("general.file_type")
            .and_then(|v| v.as_u64())
            .and_then(|c| FileType::from_code(c as u32))
            .map(|f| f.display_name())
            .unwrap_or_else(|| "?".into());
        let name = h
            .get("general.name")
            .and_then(|v| v.as_str())
            .unwrap_or("qwen3");
        // llama-bench's backend column, with the offload: "CUDA ngl 36+o" is every layer and
        // the output layer on the GPU.
        let backend = match loaded.model.offload() {
            Some(o) => format!("CUDA ngl {}{}", o.layers, if o.output { "+o" } else { "" }),
            None => "CPU".to_string(),
        };
        ModelLine {
            model: format!("{name} {file_type}"),
            size: h.tensors.iter().map(|t| t.n_bytes).sum(),
            params: h.tensors.iter().map(|t| t.n_elements()).sum(),
            backend,
            threads,
            kernels: refusion_engine::model::kquants::path_name(),
            caches: refusion_engine::model::kquants::caches::caches().describe(),
            types: loaded.cache_types(),
        }
    }

    /// A forward test as JSON, with the model columns CSV has (llama-bench's JSON has them).
    fn json(&self, r: &Row, prefix: usize) -> serde_json::Value {
        serde_json::json!({
            "model": self.model,
            "size": self.size,
            "params": self.params,
            "test": r.test,
            "n_tokens": r.n,
            "prefix": prefix,
            "tokens_per_s": r.tokens_per_s,
            "stddev": r.sd,
            "ms_per_forward": r.ms_per_forward,
            "rounds": r.rounds,
            "tokens_per_s_low": r.low,
            "tokens_per_s_high": r.high,
            "threads": self.threads,
            "type_k": self.types.k.name(),
            "type_v": self.types.v.name(),
            "backend": self.backend,
            "kernels": self.kernels,
            "caches": self.caches,
            "prefetch_tiles": refusion_engine::model::kquants::prefetch_tiles(),
        })
    }
}

/// `n` new tokens in one forward over `prefix` cached entries, `reps` timed runs after a
/// warm-up; logits for the last token only, as llama-bench's prompt processing.
fn time_prompt(
    model: &dyn Forward,
    cache: &mut refusion_engine::kv::KvCache,
    prefix: usize,
    n: usize,
    vocab: u32,
    reps: usize,
) -> Result<Vec<f64>> {
    let toks: Vec<u32> = (0..n as u32).map(|i| (i * 104_729 + 7) % vocab).collect();
    let pos: Vec<u32> = (prefix as u32..(prefix + n) as u32).collect();
    let mut b = Batch::row(&toks, &pos, 0);
    b.logits_for = LogitsFor::Indices(vec![n - 1]);
    let mut times = Vec::with_capacity(reps);
    for rep in 0..=reps {
        let t = Instant::now();
        model.forward(&b, cache)?;
        let dt = t.elapsed().as_secs_f64();
        cache.clear_rows();
        if rep > 0 {
            times.push(dt);
        }
    }
    Ok(times)
}

/// `n` one-token forwards in sequence, each committed to the cache (autoregressive decoding's
/// shape), timed as a whole per run; the cache is cropped back to `prefix` after each.
fn time_generation(
    model: &dyn Forward,
    cache: &mut refusion_engine::kv::KvCache,
    prefix: usize,
    n: usize,
    vocab: u32,
    reps: usize,
) -> Result<Vec<f64>> {
    let mut times = Vec::with_capacity(reps);
    for rep in 0..=reps {
        let t = Instant::now();
        for i in 0..n {
            let tok = [(i as u32 * 7_919 + 11) % vocab];
            let pos = [(prefix + i) as u32];
            model.forward(&Batch::row(&tok, &pos, 0), cache)?;
            cache.commit_row(0)?;
        }
        let dt = t.elapsed().as_secs_f64();
        cache.crop(prefix);
        if rep > 0 {
            times.push(dt);
        }
    }
    Ok(times)
}

/// The median rate, and the spread of the timed repetitions (after the warm-up): their
/// times' standard deviation relative to their mean, on the median rate. (The spread of the
/// runs' own rates blew up on one fast outlier: 2718 ± 4707.)
fn summarize(test: String, n: usize, gen: bool, mut times: Vec<f64>) -> Row {
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let rate = n as f64 / median;
    let sd = rate * relative_spread(&times);
    let forwards = if gen { n } else { 1 };
    Row {
        test,
        n,
        tokens_per_s: rate,
        sd,
        ms_per_forward: median * 1e3 / forwards as f64,
        rounds: 1,
        low: rate,
        high: rate,
    }
}

/// One row from a test's rounds: the median round (by rate) with every round's range.
fn over_rounds(mut rounds: Vec<Row>) -> Row {
    rounds.sort_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s));
    let n = rounds.len();
    let (low, high) = (rounds[0].tokens_per_s, rounds[n - 1].tokens_per_s);
    let mut row = rounds.swap_remove(n / 2);
    row.rounds = n;
    row.low = low;
    row.high = high;
    row
}

/// Standard deviation over mean (0 for one value).
fn relative_spread(times: &[f64]) -> f64 {
    if times.len() < 2 {
        return 0.0;
    }
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    let var = times.iter().map(|t| (t - mean).powi(2)).sum::<f64>() / (times.len() - 1) as f64;
    if mean > 0.0 {
        var.sqrt() / mean
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::{over_rounds, summarize};

    #[test]
    fn rounds_keep_the_median_round_and_the_range() {
        let rounds: Vec<_> = [0.020, 0.010, 0.040]
            .iter()
            .map(|&t| summarize("pp1".into(), 1, false, vec![t]))
            .collect();
        let r = over_rounds(rounds);
        assert_eq!(
            (r.rounds, r.tokens_per_s, r.low, r.high),
            (3, 50.0, 25.0, 100.0)
        );
    }

    #[test]
    fn one_fast_outlier_does_not_make_the_spread_larger_than_the_rate() {
        let r = summarize(
            "pp16".into(),
            16,
            false,
            vec![0.010, 0.011, 0.0001, 0.010, 0.012],
        );
        assert!((r.tokens_per_s - 1600.0).abs() < 1e-6, "{}", r.tokens_per_s);
        assert!(r.sd < r.tokens_per_s, "{} ± {}", r.tokens_per_s, r.sd);
        let steady = summarize("pp16".into(), 16, false, vec![0.010; 5]);
        assert_eq!(steady.sd, 0.0);
    }
}
