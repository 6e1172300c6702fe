//! llama-bench's lists of models and thread counts: `-m a.gguf,b.gguf` (or `-m` repeated) and
//! `-t 1,2,4`. The thread pools are sized once per process, so each (model, threads) pair runs
//! as a child `refusion bench` with the other flags unchanged, one after the other, and their
//! rows make one table (one header; `-o json` one array).

use std::ffi::OsString;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// The flags that take lists here, and the rest of the command line.
struct Lists {
    models: Vec<String>,
    threads: Vec<String>,
    rest: Vec<String>,
    format: String,
}

/// Splits `bench`'s arguments (after the subcommand); `None` when there are no lists.
fn parse(args: &[String]) -> Result<Option<Lists>> {
    let (mut models, mut threads, mut rest) = (Vec::new(), Vec::new(), Vec::new());
    let mut format = "md".to_string();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with('-') => (f, Some(v.to_string())),
            _ => (arg.as_str(), None),
        };
        let target = match flag {
            "-m" | "--model" => &mut models,
            "-t" | "--threads" => &mut threads,
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
    Ok(Some(Lists {
        models,
        threads,
        rest,
        format,
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
    }
}
