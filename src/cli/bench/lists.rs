//! llama-bench's lists of models and thread counts: `-m a.gguf,b.gguf` (or `-m` repeated) and
//! `-t 1,2,4`. The thread pools are sized once per process, so each (model, threads) pair runs
//! as a child `refusion bench` with the other flags unchanged, one after the other, and their
//! rows make one table (one header; `-o json` one array).

use std::ffi::OsString;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// The flags that take lists here, and the rest of the command line.
#[derive(Debug)]
struct Lists {
    models: Vec<String>,
    threads: Vec<String>,
    rest: Vec<String>,
    format: String,
    /// `--rounds`: every pair once per round, in turn (1: each pair's own output, as is).
    rounds: usize,
}

/// Splits `bench`'s arguments (after the subcommand); `None` when there are no lists.
fn parse(args: &[String]) -> Result<Option<Lists>> {
    let (mut models, mut threads, mut rest) = (Vec::new(), Vec::new(), Vec::new());
    let mut format = "md".to_string();
    let mut rounds = 1;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with('-') => (f, Some(v.to_string())),
            _ => (arg.as_str(), None),
        };
        // A joined short flag (`-ojson`) is the format too.
        if let Some(v) = flag
            .strip_prefix("-o")
            .filter(|v| !v.is_empty() && !flag.starts_with("--"))
        {
            format = v.to_string();
            rest.extend(["-o".to_string(), v.to_string()]);
            continue;
        }
        let target = match flag {
            "-m" | "--model" => &mut models,
            "-t" | "--threads" => &mut threads,
            "--rounds" => {
                let v = inline.or_else(|| it.next().cloned()).unwrap_or_default();
                rounds = v
                    .parse::<usize>()
                    .ok()
                    .filter(|&r| r > 0)
                    .ok_or_else(|| anyhow::anyhow!("--rounds {v}: expected a number from 1"))?;
                continue;
            }
            "-o" | "--output" => {
                let v = inline.or_else(|| it.next().cloned()).unwrap_or_default();
                format = v.clone();
                rest.extend([flag.to_string(), v]);
                continue;
            }
            _ => {
                rest.push(arg.clone());
                continue;
            }
        };
        let Some(v) = inline.or_else(|| it.next().cloned()) else {
            bail!("{flag} needs a value");
        };
        target.extend(v.split(',').map(str::to_string));
    }
    if rest.iter().any(|a| a == "--json") {
        format = "jsonl".into();
    }
    if models.len() <= 1 && threads.len() <= 1 {
        return Ok(None);
    }
    if rounds > 1 {
        if let Some(f) = rest
            .iter()
            .find(|a| ["--membw", "--decode"].contains(&a.split('=').next().unwrap_or(a)))
        {
            bail!("--rounds cannot be used with {f} (each run of those is its own measure)");
        }
    }
    Ok(Some(Lists {
        models,
        threads,
        rest,
        format,
        rounds,
    }))
}

/// Runs `refusion bench` with lists, if the command line has them: `Some(exit code)`.
pub fn run_if_lists(argv: &[OsString]) -> Option<i32> {
    let args: Vec<String> = argv
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    if args.get(1).map(String::as_str) != Some("bench") {
        return None;
    }
    let lists = match parse(&args[2..]) {
        Ok(Some(l)) => l,
        Ok(None) => return None,
        Err(e) => {
            eprintln!("error: {e:#}");
            return Some(2);
        }
    };
    match run_all(&lists) {
        Ok(code) => Some(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            Some(1)
        }
    }
}

/// Every pair in order (models outer, threads inner), checked first: every model a file,
/// every thread count a number.
fn run_all(l: &Lists) -> Result<i32> {
    for m in &l.models {
        if !std::path::Path::new(m).is_file() {
            bail!("{m}: no such model file");
        }
    }
    for t in &l.threads {
        t.parse::<usize>()
            .map_err(|_| anyhow::anyhow!("-t {t}: expected a thread count"))?;
    }
    let exe = std::env::current_exe().context("cannot find this program to run each model")?;
    let models: Vec<Option<&String>> = if l.models.is_empty() {
        vec![None]
    } else {
        l.models.iter().map(Some).collect()
    };
    let threads: Vec<Option<&String>> = if l.threads.is_empty() {
        vec![None]
    } else {
        l.threads.iter().map(Some).collect()
    };
    if l.rounds > 1 {
        return run_rounds(l, &exe, &models, &threads);
    }
    let json = l.format == "json";
    let mut objects = Vec::new();
    let mut first = true;
    for m in &models {
        for t in &threads {
            let mut cmd = Command::new(&exe);
            cmd.arg("bench").args(&l.rest);
            if let Some(m) = m {
                cmd.args(["-m", m]);
            }
            if let Some(t) = t {
                cmd.args(["-t", t]);
            }
            if !first {
                cmd.arg("--no-header");
            }
            first = false;
            if json {
                // Each run's array, gathered into one.
                cmd.stdout(Stdio::piped());
                let out = cmd.output().context("cannot run bench")?;
                if !out.status.success() {
                    return Ok(out.status.code().unwrap_or(1));
                }
                let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)
                    .context("a bench run printed no JSON array")?;
                objects.extend(rows);
            } else {
                let status = cmd.status().context("cannot run bench")?;
                if !status.success() {
                    return Ok(status.code().unwrap_or(1));
                }
            }
        }
    }
    if json {
        println!("{}", serde_json::Value::Array(objects));
    }
    Ok(0)
}

/// With `--rounds`: every pair once per round, in turn, each as `-o json`; then one row per
/// pair and test, the median round with the rounds' range, in the format asked for.
fn run_rounds(
    l: &Lists,
    exe: &std::path::Path,
    models: &[Option<&String>],
    threads: &[Option<&String>],
) -> Result<i32> {
    // The children's own format flags are replaced by `-o json`.
    let mut rest = Vec::new();
    let mut it = l.rest.iter();
    while let Some(a) = it.next() {
        match a.split_once('=').map_or(a.as_str(), |(f, _)| f) {
            "-o" | "--output" if !a.contains('=') => {
                it.next();
            }
            "-o" | "--output" | "--json" => {}
            _ => rest.push(a.clone()),
        }
    }
    let pairs: Vec<(Option<&String>, Option<&String>)> = models
        .iter()
        .flat_map(|m| threads.iter().map(move |t| (*m, *t)))
        .collect();
    let mut got: Vec<Vec<Vec<serde_json::Value>>> = vec![Vec::new(); pairs.len()];
    for _ in 0..l.rounds {
        for (i, (m, t)) in pairs.iter().enumerate() {
            let mut cmd = Command::new(exe);
            cmd.arg("bench").args(&rest).args(["-o", "json"]);
            if let Some(m) = m {
                cmd.args(["-m", m]);
            }
            if let Some(t) = t {
                cmd.args(["-t", t]);
            }
            cmd.stdout(Stdio::piped());
            let out = cmd.output().context("cannot run bench")?;
            if !out.status.success() {
                return Ok(out.status.code().unwrap_or(1));
            }
            let rows: Vec<serde_json::Value> =
                serde_json::from_slice(&out.stdout).context("a bench run printed no JSON array")?;
            got[i].push(rows);
        }
    }
    let rows: Vec<serde_json::Value> = got.into_iter().flat_map(median_rows).collect();
    print_rows(&l.format, &rows);
    Ok(0)
}

/// One pair's rounds (each an array of rows, one per test) as one row per test: the median
/// round's, with `rounds` and the rounds' lowest and highest rates.
fn median_rows(rounds: Vec<Vec<serde_json::Value>>) -> Vec<serde_json::Value> {
    let tests = rounds.first().map_or(0, Vec::len);
    let rate = |v: &serde_json::Value| v["tokens_per_s"].as_f64().unwrap_or(0.0);
    (0..tests)
        .filter_map(|t| {
            let mut these: Vec<serde_json::Value> =
                rounds.iter().filter_map(|r| r.get(t).cloned()).collect();
            these.sort_by(|a, b| rate(a).total_cmp(&rate(b)));
            let (low, high) = (rate(these.first()?), rate(these.last()?));
            let n = these.len();
            let mut row = these.swap_remove(n / 2);
            row["rounds"] = n.into();
            row["tokens_per_s_low"] = low.into();
            row["tokens_per_s_high"] = high.into();
            Some(row)
        })
        .collect()
}

/// Rows (bench's JSON objects) as `format` prints them.
fn print_rows(format: &str, rows: &[serde_json::Value]) {
    match format {
        "json" => println!("{}", serde_json::Value::Array(rows.to_vec())),
        "jsonl" => rows.iter().for_each(|r| println!("{r}")),
        "csv" => {
            println!("{}", super::CSV_HEAD);
            rows.iter().for_each(|r| println!("{}", super::csv_row(r)));
        }
        _ => {
            println!("{}", super::TABLE_HEAD);
            println!("{}", super::TABLE_RULE);
            rows.iter()
                .for_each(|r| println!("{}", super::table_row(r)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn lists_are_split_and_the_rest_kept() {
        assert!(parse(&args("-m a.gguf -t 2 -p 1")).unwrap().is_none());
        let l = parse(&args("-m a.gguf,b.gguf -t 1,2 -p 1,16 -o csv"))
            .unwrap()
            .unwrap();
        assert_eq!(l.models, ["a.gguf", "b.gguf"]);
        assert_eq!(l.threads, ["1", "2"]);
        assert_eq!(l.rest, args("-p 1,16 -o csv"));
        assert_eq!(l.format, "csv");
        let l = parse(&args("-m a.gguf --model=b.gguf --json"))
            .unwrap()
            .unwrap();
        assert_eq!(l.models, ["a.gguf", "b.gguf"]);
        assert_eq!(l.format, "jsonl");
        let l = parse(&args("-m a.gguf,b.gguf --rounds 3 -p 1"))
            .unwrap()
            .unwrap();
        assert_eq!((l.rounds, l.rest.clone()), (3, args("-p 1")));
        assert!(parse(&args("-m a.gguf,b.gguf --rounds 0")).is_err());
        let e = parse(&args("-m a.gguf,b.gguf --rounds 2 --decode card")).unwrap_err();
        assert!(
            e.to_string()
                .contains("--rounds cannot be used with --decode"),
            "{e}"
        );
        let l = parse(&args("-m a.gguf,b.gguf -ojson")).unwrap().unwrap();
        assert_eq!(
            (l.format.as_str(), l.rest.clone()),
            ("json", args("-o json"))
        );
    }

    #[test]
    fn rounds_give_the_median_round_and_the_range() {
        let round = |ts: f64| vec![serde_json::json!({"test": "pp1 @ d256", "tokens_per_s": ts})];
        let rows = median_rows(vec![round(30.0), round(50.0), round(40.0)]);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0]["tokens_per_s"], 40.0);
        assert_eq!(rows[0]["tokens_per_s_low"], 30.0);
        assert_eq!(rows[0]["tokens_per_s_high"], 50.0);
        assert_eq!(rows[0]["rounds"], 3);
    }
}
