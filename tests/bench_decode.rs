//! `refusion bench --decode`: the decoder end to end over the file's held-out questions (or
//! token-id prompts), one row per setting.

mod common;

use common::*;
use serde_json::Value;

fn bench_json(model: &str, prompts: &str, extra: &[&str]) -> Vec<Value> {
    let mut args = vec!["bench", "-m", model, "-o", "json", "--prompts", prompts];
    args.extend(extra);
    let o = run(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_str::<Value>(&stdout(&o))
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

#[test]
fn decode_rows_report_speed_tpf_forwards_and_accuracy_on_the_held_out_questions() {
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("tiny.gguf");
    convert_quiet(&trained_tiny(), &f, "q8_0");
    let rows = bench_json(f.to_str().unwrap(), "4", &["--decode", "card,ar"]);
    assert_eq!(rows.len(), 2);
    let (card, ar) = (&rows[0], &rows[1]);
    assert!(
        card["test"]
            .as_str()
            .unwrap()
            .starts_with("decode card k4 b32"),
        "{card}"
    );
    assert_eq!(card["prompts"], 4);
    // Slot decoding commits several tokens per forward; left to right exactly one.
    assert!(card["tpf"].as_f64().unwrap() > 2.0, "{card}");
    assert_eq!(ar["tpf"].as_f64().unwrap(), 1.0, "{ar}");
    for r in &rows {
        let sizes: u64 = r["forward_sizes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_u64().unwrap())
            .sum();
        let forwards = r["forwards"].as_f64().unwrap();
        assert_eq!(
            r["forward_sizes"].as_array().unwrap().len() as f64,
            forwards
        );
        let fed = r["fed_per_forward"].as_f64().unwrap();
        assert!((fed * forwards - sizes as f64).abs() < 1e-6, "{r}");
        assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0);
        // The trained model answers its held-out arithmetic (4 of the 200, one of each kind).
        assert!(r["accuracy"].as_f64().unwrap() >= 0.5, "{r}");
    }
}

#[test]
fn decode_without_questions_uses_token_prompts_and_reports_no_accuracy() {
    let tmp = tempfile::tempdir().unwrap();
    // A random fixture of 512 ids: GSM8K's setting feeds whole 128-position blocks, each with
    // its logits, which over the real vocabulary took a minute of CI's time.
    let model = pub_a_f32(tmp.path());
    let rows = bench_json(model.to_str().unwrap(), "1", &["--decode", "gsm8k"]);
    assert_eq!(rows.len(), 1);
    assert!(rows[0]["accuracy"].is_null(), "{}", rows[0]);
    assert!(rows[0]["test"].as_str().unwrap().contains("k32 b4"));
    let o = run(&[
        "bench",
        "-m",
        model.to_str().unwrap(),
        "--decode",
        "--prompts",
        "1",
        "-o",
        "csv",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).lines().count(), 2, "{}", stdout(&o));
}

#[test]
fn decode_refuses_unknown_settings_and_forward_tests_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let m = model.to_str().unwrap();
    let o = run(&["bench", "-m", m, "--decode", "card,gsm9k"]);
    assert_fails_with(&o, &["unknown setting 'gsm9k'", "gsm8k"]);
    assert!(!stderr(&o).contains("loaded"), "{}", stderr(&o));
    let o = run(&["bench", "-m", m, "--decode", "-p", "16"]);
    assert_fails_with(&o, &["--decode", "--n-prompt"]);
    // Forward-test knobs mean nothing to a decode: refused, not ignored.
    let o = run(&["bench", "-m", m, "--decode", "-r", "3"]);
    assert_fails_with(&o, &["--decode", "--repetitions"]);
    let o = run(&["bench", "-m", m, "--decode", "--prompts", "0"]);
    assert_fails_with(&o, &["--prompts"]);
}

/// `--rounds` gives each forward test's median round with its range; it means nothing to a
/// decode or to `--membw` (refused by name, also with lists), and `--membw` takes no model.
#[test]
fn rounds_give_a_range_and_are_refused_where_they_mean_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let m = model.to_str().unwrap();
    let o = run(&[
        "bench", "-m", m, "-p", "4", "-d", "8", "-r", "1", "--rounds", "3", "-o", "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows: Vec<Value> = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!(r["rounds"], 3);
    let (lo, mid, hi) = (
        r["tokens_per_s_low"].as_f64().unwrap(),
        r["tokens_per_s"].as_f64().unwrap(),
        r["tokens_per_s_high"].as_f64().unwrap(),
    );
    assert!(lo <= mid && mid <= hi && lo > 0.0, "{r}");
    // The caches that size the kernels' blocking are named with the kernels.
    assert!(r["caches"].as_str().is_some_and(|c| !c.is_empty()), "{r}");
    let o = run(&["bench", "-m", m, "--decode", "--rounds", "2"]);
    assert_fails_with(&o, &["--decode", "--rounds"]);
    let o = run(&[
        "bench",
        "-m",
        &format!("{m},{m}"),
        "--decode",
        "--rounds",
        "2",
    ]);
    assert_fails_with(&o, &["--rounds cannot be used with --decode"]);
    let o = run(&["bench", "--membw", "-m", m]);
    assert_fails_with(&o, &["--membw"]);
    let o = run(&["bench", "--membw", "--rounds", "2"]);
    assert_fails_with(&o, &["--membw", "--rounds"]);
}

/// llama-bench's `-ctk`/`-ctv` lists: one child per combination, keys and values each their
/// own type, named in the JSON and the table's `type_k`/`type_v` columns.
#[test]
fn cache_type_lists_give_one_row_per_pair() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_refusion_gguf(tmp.path());
    let m = model.to_str().unwrap();
    let o = run(&[
        "bench", "-m", m, "-p", "4", "-d", "8", "-r", "1", "-ctk", "f16,f32", "-ctv", "bf16", "-o",
        "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows: Vec<Value> = serde_json::from_str(&stdout(&o)).unwrap();
    let pairs: Vec<(&str, &str)> = rows
        .iter()
        .map(|r| (r["type_k"].as_str().unwrap(), r["type_v"].as_str().unwrap()))
        .collect();
    assert_eq!(pairs, [("f16", "bf16"), ("f32", "bf16")]);
    let o = run(&[
        "bench", "-m", m, "-p", "4", "-d", "8", "-r", "1", "-ctk", "f16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = stdout(&o);
    assert!(table.contains("| type_k | type_v |"), "{table}");
    assert!(table.contains("|    f16 |    f32 |"), "{table}");
    let o = run(&["bench", "-m", m, "-p", "4", "-ctk", "f16,q9"]);
    assert_fails_with(&o, &["-ctk q9", "unknown cache type 'q9'"]);
}
