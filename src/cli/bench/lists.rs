//! llama-bench's lists of models, thread counts and KV cache types: `-m a.gguf,b.gguf` (or `-m`
//! repeated), `-t 1,2,4`, `-ctk f16,q8_0`, `-ctv f16,q8_0`. The thread pools are sized once per
//! process, so each combination (models outermost, then threads, key types, value types) runs
//! as a child `refusion bench` with the other flags unchanged, one after the other, and their
//! rows make one table (one header; `-o json` one array).

use std::ffi::OsString;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// The flags that take lists, each with the spellings it is given by, in the order their
/// combinations run (the first outermost).
const AXES: [(&str, &[&str]); 4] = [
    ("-m", &["-m", "--model"]),
    ("-t", &["-t", "--threads"]),
    ("--cache-type-k", &["-ctk", "--cache-type-k"]),
    ("--cache-type-v", &["-ctv", "--cache-type-v"]),
];

/// The flags that take lists here, and the rest of the command line.
#[derive(Debug)]
struct Lists {
    /// The values given for each of [`AXES`] (empty: not given).
    lists: [Vec<String>; 4],
    rest: Vec<String>,
    format: String,
    /// `--rounds`: every pair once per round, in turn (1: each pair's own output, as is).
    rounds: usize,
}

/// Splits `bench`'s arguments (after the subcommand); `None` when there are no lists.
fn parse(args: &[String]) -> Result<Option<Lists>> {
    let mut lists: [Vec<String>; 4] = Default::default();
    let mut rest = Vec::new();
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
        if let Some(axis) = AXES.iter().position(|(_, names)| names.contains(&flag)) {
            let Some(v) = inline.or_else(|| it.next().cloned()) else {
                bail!("{flag} needs a value");
            };
            lists[axis].extend(v.split(',').map(str::to_string));
            continue;
        }
        match flag {
            "--rounds" => {
                let v = inline.or_else(|| it.next().cloned()).unwrap_or_default();
                rounds = v
                    .parse::<usize>()
                    .ok()
                    .filter(|&r| r > 0)
                    .ok_or_else(|| anyhow::anyhow!("--rounds {v}: expected a number from 1"))?;
            }
            "-o" | "--output" => {
                let v = inline.or_else(|| it.next().cloned()).unwrap_or_default();
                format = v.clone();
                rest.extend([flag.to_string(), v]);
            }
            _ => rest.push(arg.clone()),
        }
    }
    if rest.iter().any(|a| a == "--json") {
        format = "jsonl".into();
    }
    if lists.iter().all(|l| l.len() <= 1) {
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
        lists,
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

/// Every combination of the lists' values, as the flags each child gets (`-m a.gguf -t 2 ...`):
/// the first list outermost; a flag not given is left out.
fn combinations(lists: &[Vec<String>; 4]) -> Vec<Vec<String>> {
    let mut all = vec![Vec::new()];
    for ((flag, _), values) in AXES.iter().zip(lists) {
        if values.is_empty() {
            continue;
        }
        all = all
            .into_iter()
            .flat_map(|args| {
                values.iter().map(move |v| {
                    let mut a = args.clone();
                    a.extend([flag.to_string(), v.clone()]);
                    a
                })
            })
            .collect();
    }
    all
}

/// Every combination in order, checked first: every model a file, every thread count a
/// number, every cache type a name.
fn run_all(l: &Lists) -> Result<i32> {
    let [models, threads, ctk, ctv] = &l.lists;
    for m in models {
        if !std::path::Path::new(m).is_file() {
            bail!("{m}: no such model file");
        }
    }
    for t in threads {
        t.parse::<usize>()
            .map_err(|_| anyhow::anyhow!("-t {t}: expected a thread count"))?;
    }
    for (flag, t) in ctk
        .iter()
        .map(|t| ("-ctk", t))
        .chain(ctv.iter().map(|t| ("-ctv", t)))
    {
        t.parse::<refusion_engine::kv::CacheType>()
            .map_err(|e| anyhow::anyhow!("{flag} {t}: {e}"))?;
    }
    let exe = std::env::current_exe().context("cannot find this program to run each model")?;
    let combos = combinations(&l.lists);
    if l.rounds > 1 {
        return run_rounds(l, &exe, &combos);
    }
    let json = l.format == "json";
    let mut objects = Vec::new();
    for (i, combo) in combos.iter().enumerate() {
        let mut cmd = Command::new(&exe);
        cmd.arg("bench").args(&l.rest).args(combo);
        if i > 0 {
            cmd.arg("--no-header");
        }
        if json {
            // Each run's array, gathered into one.
            match json_rows(cmd)? {
                Ok(rows) => objects.extend(rows),
                Err(code) => return Ok(code),
            }
        } else {
            let status = cmd.status().context("cannot run bench")?;
            if !status.success() {
                return Ok(status.code().unwrap_or(1));
            }
        }
    }
    if json {
        println!("{}", serde_json::Value::Array(objects));
    }
    Ok(0)
}

/// With `--rounds`: every combination once per round, in turn, each as `-o json`; then one
/// row per combination and test, the median round with the rounds' range, in the format
/// asked for.
fn run_rounds(l: &Lists, exe: &std::path::Path, combos: &[Vec<String>]) -> Result<i32> {
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
    let mut got: Vec<Vec<Vec<serde_json::Value>>> = vec![Vec::new(); combos.len()];
    for _ in 0..l.rounds {
        for (i, combo) in combos.iter().enumerate() {
            let mut cmd = Command::new(exe);
            cmd.arg("bench")
                .args(&rest)
                .args(["-o", "json"])
                .args(combo);
            match json_rows(cmd)? {
                Ok(rows) => got[i].push(rows),
                Err(code) => return Ok(code),
            }
        }
    }
    let rows: Vec<serde_json::Value> = got.into_iter().flat_map(median_rows).collect();
    print_rows(&l.format, &rows);
    Ok(0)
}

/// The rows a child `bench -o json` prints, or its exit code when it fails.
fn json_rows(mut cmd: Command) -> Result<std::result::Result<Vec<serde_json::Value>, i32>> {
    cmd.stdout(Stdio::piped());
    let out = cmd.output().context("cannot run bench")?;
    if !out.status.success() {
        return Ok(Err(out.status.code().unwrap_or(1)));
    }
    let rows = serde_json::from_slice(&out.stdout).context("a bench run printed no JSON array")?;
    Ok(Ok(rows))
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
        assert_eq!(l.lists[0], ["a.gguf", "b.gguf"]);
        assert_eq!(l.lists[1], ["1", "2"]);
        assert_eq!(l.rest, args("-p 1,16 -o csv"));
        assert_eq!(l.format, "csv");
        let l = parse(&args("-m a.gguf --model=b.gguf --json"))
            .unwrap()
            .unwrap();
        assert_eq!(l.lists[0], ["a.gguf", "b.gguf"]);
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
    fn cache_type_lists_combine_with_the_others() {
        assert!(parse(&args("-m a.gguf -ctk q8_0 -ctv f16"))
            .unwrap()
            .is_none());
        let l = parse(&args("-m a.gguf -ctk f16,q8_0 --cache-type-v=q4_0 -p 1"))
            .unwrap()
            .unwrap();
        assert_eq!(l.rest, args("-p 1"));
        assert_eq!(
            combinations(&l.lists),
            [
                args("-m a.gguf --cache-type-k f16 --cache-type-v q4_0"),
                args("-m a.gguf --cache-type-k q8_0 --cache-type-v q4_0"),
            ]
        );
        let l = parse(&args("-t 1,2 -ctk f16,q8_0")).unwrap().unwrap();
        assert_eq!(
            combinations(&l.lists),
            [
                args("-t 1 --cache-type-k f16"),
                args("-t 1 --cache-type-k q8_0"),
                args("-t 2 --cache-type-k f16"),
                args("-t 2 --cache-type-k q8_0"),
            ]
        );
        let e = run_all(&parse(&args("-ctk f16,q9")).unwrap().unwrap()).unwrap_err();
        assert!(
            e.to_string().contains("-ctk q9: unknown cache type 'q9'"),
            "{e}"
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
