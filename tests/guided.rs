//! Slot decoding under a grammar (`engine/src/decode/guided.rs`) against the same steps
//! recomputed the slow way: every forward runs the whole sequence (prompt, committed answer,
//! draft, masks) through a fresh cache, so nothing depends on which entries the decoder kept,
//! dropped or fed again. The trained tiny model at f32, its held-out JSON questions under a
//! schema, a GBNF grammar and a lazy tool-call grammar; alone and through the scheduler.

mod common;

use std::sync::Arc;

use common::*;
use refusion_engine::chat::template::{ChatTemplate, Message};
use refusion_engine::chat::Tokenizer;
use refusion_engine::constrain::{tools, Constraint, Format, Guide};
use refusion_engine::decode::{argmax, generate, prob, DecodeParams, Event, Kind};
use refusion_engine::kv::{CacheType, KvCache};
use refusion_engine::model::{Batch, Forward, LogitsFor, Qwen3};
use refusion_gguf::GgufFile;
use serde_json::{json, Value};

/// The arg-max of `row` among what `c` allows, and `tok`'s probability over it.
fn masked(c: &mut Constraint, row: &[f32], eos: u32, tok: Option<u32>) -> (u32, f32) {
    let mut buf = Vec::new();
    let m = c.masked(row, eos, &mut buf).unwrap();
    let t = tok.unwrap_or(argmax(m) as u32);
    (t, prob(m, t as usize))
}

fn accept(c: &mut Constraint, tok: u32, eos: u32) {
    if tok != eos {
        c.accept(tok).unwrap();
    }
}

/// The forced text after what is committed, and the end where the grammar is complete.
fn force(c: &mut Constraint, answer: &mut Vec<u32>, eos: u32) -> bool {
    let forced = c.forced().unwrap();
    let any = !forced.is_empty();
    answer.extend(forced);
    if c.finished() {
        answer.push(eos);
    }
    any
}

/// The guided decode restated over fresh forwards: the committed answer and the forwards.
fn recomputed(m: &Qwen3, guide: &Guide, prompt: &[u32], p: &DecodeParams) -> (Vec<u32>, usize) {
    let (eos, k, gen) = (p.eos_id, p.slot_size as usize, p.gen_length as usize);
    let mut c = guide.start();
    let mut answer = Vec::new();
    let mut draft: Vec<u32> = Vec::new();
    let mut forwards = 0;
    force(&mut c, &mut answer, eos);
    let over = |a: &Vec<u32>| a.contains(&eos) || a.len() >= gen;
    while !over(&answer) {
        let mut seq = prompt.to_vec();
        seq.extend(&answer);
        let base = seq.len();
        seq.extend(&draft);
        seq.extend(std::iter::repeat_n(p.mask_id, k));
        let mut cache = KvCache::new(m.cache_shape(seq.len()), CacheType::F32).unwrap();
        let mut b = Batch::default();
        for (i, &t) in seq.iter().enumerate() {
            b.push(t, i as u32, 0);
        }
        b.logits_for = LogitsFor::All;
        let logits = m.forward(&b, &mut cache).unwrap();
        forwards += 1;
        let mut passed = 0;
        for (j, &t) in draft.iter().enumerate() {
            let (_, pr) = masked(&mut c, logits.row(base + j - 1), eos, Some(t));
            if pr <= p.token_threshold {
                break;
            }
            accept(&mut c, t, eos);
            passed += 1;
        }
        answer.extend(&draft[..passed]);
        let whole = passed == draft.len();
        let first_mask = base + draft.len();
        draft.clear();
        if over(&answer) || force(&mut c, &mut answer, eos) || over(&answer) {
            continue;
        }
        let row = if whole { first_mask } else { base + passed - 1 };
        let (tok, _) = masked(&mut c, logits.row(row), eos, None);
        accept(&mut c, tok, eos);
        answer.push(tok);
        if over(&answer) || force(&mut c, &mut answer, eos) || !whole {
            continue;
        }
        let mut took = 0;
        for r in first_mask + 1..first_mask + k {
            if c.finished() || answer.len() + draft.len() >= gen {
                break;
            }
            let (t, _) = masked(&mut c, logits.row(r), eos, None);
            draft.push(t);
            if t == eos {
                break;
            }
            c.accept(t).unwrap();
            took += 1;
        }
        c.rollback(took).unwrap();
    }
    answer.truncate(gen);
    (answer, forwards)
}

#[test]
fn guided_decoding_is_its_steps_recomputed_from_scratch() {
    let tmp = tempfile::tempdir().unwrap();
    let path = trained_tiny_gguf(tmp.path(), "f32");
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let tok = Tokenizer::from_gguf(&file.header).unwrap();
    let m = Qwen3::load_offloaded(file.clone(), None).unwrap();
    let questions = heldout_json_questions(8);
    let add = [tools::Tool {
        name: "add".into(),
        parameters: json!({"type": "object", "properties": {"a": {"type": "integer"},
                           "b": {"type": "integer"}}, "required": ["a", "b"]}),
    }];
    let calls = tools::grammar(&add, None, false).unwrap();
    let guides = tok.guides().unwrap();
    let source = file
        .header
        .get("tokenizer.chat_template")
        .and_then(|v| v.as_str());
    let template = ChatTemplate::new(source.unwrap()).unwrap();
    let render = |q: &str, tools: Option<&Value>| -> Vec<u32> {
        let user = Message {
            role: "user".into(),
            content: q.into(),
            ..Default::default()
        };
        tok.encode(&template.render_with_tools(&[user], tools, true).unwrap())
            .unwrap()
    };
    let mut cases: Vec<(String, Vec<u32>, Guide)> = Vec::new();
    for h in &questions {
        let want: Value = serde_json::from_str(h["response"].as_str().unwrap()).unwrap();
        let q = h["messages"][0]["content"].as_str().unwrap();
        let schema = guides
            .compile(&Format::JsonSchema(answer_schema(&want)))
            .unwrap();
        cases.push((q.into(), render(q, None), schema));
    }
    let gbnf = Format::Gbnf("root ::= \"The answer is \" [0-9]+ \".\"".into());
    let q = "What is 47 + 38?";
    cases.push((q.into(), render(q, None), guides.compile(&gbnf).unwrap()));
    // A call the model opens, and an answer in text beside tools.
    let listed = json!([{"type": "function", "function": {"name": "add", "description": "Add two numbers",
        "parameters": add[0].parameters.clone()}}]);
    for q in ["With the add tool, add 12 and 420.", "What is 12 + 9?"] {
        let lazy = guides.compile_calls(&calls).unwrap();
        cases.push((q.into(), render(q, Some(&listed)), lazy));
    }
    let mut total = (0, 0);
    let mut opened = false;
    for (q, prompt, guide) in cases {
        let guide = Arc::new(guide);
        for (slot_size, threshold) in [(4, 0.3), (8, 0.9)] {
            let mut p = DecodeParams::new(
                Default::default(),
                tok.eos_id.unwrap(),
                tok.mask_id.unwrap(),
            );
            (p.gen_length, p.slot_size, p.token_threshold) = (48, slot_size, threshold);
            p.serial_blocks = 1;
            let p = p.with_guide(guide.clone());
            assert_eq!(p.strategy, Kind::Slots);
            let (want, want_forwards) = recomputed(&m, &guide, &prompt, &p);
            let mut cache = KvCache::new(m.cache_shape(prompt.len() + 64), CacheType::F32).unwrap();
            let mut streamed = Vec::new();
            let r = generate(&m, &mut cache, &prompt, &p, &mut |ev| {
                if let Event::Committed { tokens, positions } = ev {
                    streamed.extend(tokens.iter().copied().zip(positions.iter().copied()));
                }
            })
            .unwrap();
            let case = format!(
                "{q} k{slot_size}: {:?}",
                tok.decode(&r.tokens, false).unwrap()
            );
            assert_eq!(r.tokens, want, "{case}");
            assert_eq!(r.forward_calls, want_forwards, "{case}");
            // Streamed in order, each at its position.
            let first = prompt.len() as u32;
            let at: Vec<(u32, u32)> = want.iter().copied().zip(first..).collect();
            assert_eq!(streamed, at, "{case}");
            opened |= guide.is_lazy() && case.contains("<tool_call>");
            total = (total.0 + r.forward_calls, total.1 + want.len());
        }
    }
    // Drafts pass: fewer forwards than tokens.
    assert!(total.0 < total.1, "{total:?}");
    assert!(
        opened,
        "the model opened no tool call under the lazy grammar"
    );
}
