//! `refusion generate --batch FILE.jsonl`: every line through the scheduler, one result per line
//! in input order, each the answer `generate` gives alone; bad files refused before loading.

mod common;

use common::*;
use serde_json::Value;

#[test]
fn a_batch_gives_each_line_its_answer_in_input_order() {
    let tmp = tempfile::tempdir().unwrap();
    let model = trained_tiny_gguf(tmp.path(), "q8_0");
    let m = model.to_str().unwrap();
    let questions = [
        "What is 47 + 38?",
        "What is 12 + 9?",
        "Reverse the list [3, 1, 2].",
        "What is 66 + 27?",
        "What is 47 + 38?",
    ];
    let mut lines: Vec<String> = questions
        .iter()
        .enumerate()
        .map(|(i, q)| {
            format!(r#"{{"prompt": "{q}", "id": "q{i}", "max_tokens": 64, "expected": 1}}"#)
        })
        .collect();
    lines.push(
        r#"{"messages": [{"role": "user", "content": "What is 12 + 9?"}], "max_tokens": 64}"#
            .into(),
    );
    lines.push(r#"{"prompt": [5, 6, 7], "max_tokens": 16, "serial_blocks": 1}"#.into());
    lines.push(r#"{"prompt": "What is 1 + 1?", "slot_threshold": 7}"#.into());
    let batch = tmp.path().join("b.jsonl");
    std::fs::write(&batch, lines.join("\n") + "\n\n").unwrap();
    let out = tmp.path().join("results.jsonl");
    let o = run(&[
        "generate",
        "-m",
        m,
        "--batch",
        batch.to_str().unwrap(),
        "-np",
        "3",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("batch: 8 requests"), "{}", stderr(&o));
    let results: Vec<Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(results.len(), 8);
    for (i, r) in results.iter().enumerate() {
        assert_eq!(r["index"], i, "{r}");
    }
    assert_eq!(results[0]["id"], "q0");
    assert!(
        results[0]["text"].as_str().unwrap().contains("85"),
        "{}",
        results[0]
    );
    assert!(
        results[7]["error"]
            .as_str()
            .unwrap()
            .contains("slot threshold"),
        "{}",
        results[7]
    );
    // Each line's tokens are what `generate` gives for it alone.
    for (i, args) in [
        (0, vec!["-p", questions[0], "-n", "64"]),
        (2, vec!["-p", questions[2], "-n", "64"]),
        (
            6,
            vec!["--prompt-ids", "5,6,7", "-n", "16", "--serial-blocks", "1"],
        ),
    ] {
        let mut a = vec!["generate", "-m", m, "--json"];
        a.extend(args);
        let alone = run(&a);
        assert!(alone.status.success(), "{}", stderr(&alone));
        let alone: Value = serde_json::from_str(&stdout(&alone)).unwrap();
        let answer: Vec<Value> = alone["tokens"].as_array().unwrap()
            [..alone["answer_tokens"].as_u64().unwrap() as usize]
            .to_vec();
        assert_eq!(
            results[i]["tokens"].as_array().unwrap(),
            &answer,
            "line {i}"
        );
        assert_eq!(results[i]["text"], alone["text"], "line {i}");
    }
    assert_eq!(
        results[0]["tokens"], results[4]["tokens"],
        "the same question twice"
    );
    // To standard output as well, the same lines.
    let o = run(&[
        "generate",
        "-m",
        m,
        "--batch",
        batch.to_str().unwrap(),
        "--log-disable",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), std::fs::read_to_string(&out).unwrap());
}

#[test]
fn a_bad_batch_file_is_refused_before_the_model_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let b = tmp.path().join("bad.jsonl");
    let out = tmp.path().join("out.jsonl");
    // The model does not even exist: the file is checked first.
    let model = tmp.path().join("missing.gguf");
    for (body, needle) in [
        (
            "{\"prompt\": \"hi\"}\n{not json\n",
            "bad.jsonl:2: malformed JSON",
        ),
        ("{\"id\": 1}\n", "bad.jsonl:1: needs a prompt or messages"),
        (
            "{\"prompt\": \"a\", \"messages\": []}\n",
            "has both a prompt and messages",
        ),
        (
            "{\"prompt\": \"a\", \"max_tokens\": \"many\"}\n",
            "bad.jsonl:1: max_tokens must be an integer",
        ),
        ("\n\n", "no requests"),
    ] {
        std::fs::write(&b, body).unwrap();
        let o = run(&[
            "generate",
            "-m",
            model.to_str().unwrap(),
            "--batch",
            b.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ]);
        assert_fails_with(&o, &[needle]);
        assert!(!out.exists());
    }
    let o = run(&[
        "generate",
        "-m",
        "x.gguf",
        "--batch",
        "nope.jsonl",
        "--json",
    ]);
    assert!(!o.status.success());
}
