//! A decode's result as the Python dict `Model.decode` returns (docs/python.md): the answer's
//! text and tokens, why it ended, the reference's figures, and what was asked for besides
//! (log-probabilities, the prompt's scores, the decode's steps).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use refusion_engine::chat::Tokenizer;
use refusion_engine::decode::{shortest_f64, DecodeResult, TokenLogprob};

/// One step's changed cells: (answer index, state, token).
pub type Step = Vec<(u32, &'static str, Option<u32>)>;

/// A token's (token, logprob, [(alternative, logprob)]).
type Entry = (u32, f64, Vec<(u32, f64)>);

pub fn result<'py>(
    py: Python<'py>,
    tok: &Tokenizer,
    prompt: &[u32],
    r: &DecodeResult,
    steps: Vec<Step>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let answer = r.answer();
    let text = tok
        .decode(answer, true)
        .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))?;
    d.set_item("text", text)?;
    d.set_item("tokens", answer.to_vec())?;
    d.set_item("finish_reason", if r.stopped() { "stop" } else { "length" })?;
    d.set_item("prompt_tokens", prompt.len())?;
    d.set_item("completion_tokens", r.completion_tokens())?;
    d.set_item("tpf", r.tpf)?;
    d.set_item("forwards", r.forward_calls)?;
    d.set_item("forward_tokens", r.forward_tokens)?;
    let n = answer.len();
    let lps = (!r.logprobs.is_empty()).then(|| logprobs(&r.logprobs[..n.min(r.logprobs.len())]));
    d.set_item("logprobs", lps)?;
    // The end-of-sequence token that ended the answer before its limit (`/v1/completions`
    // lists it, with no text).
    let eos = r
        .eos_index
        .filter(|&i| i == n && i < r.limit)
        .and_then(|i| r.logprobs.get(i))
        .map(|l| logprobs(std::slice::from_ref(l)).remove(0));
    d.set_item("eos_logprob", eos)?;
    let scored = (!r.prompt_logprobs.is_empty()).then(|| logprobs(&r.prompt_logprobs));
    d.set_item("prompt_logprobs", scored)?;
    d.set_item("steps", (!steps.is_empty()).then_some(steps))?;
    // A template's fills, as `generate --json` gives them.
    let gaps = match &r.filled {
        Some(f) => {
            let mut out = Vec::with_capacity(f.gaps.len());
            for g in &f.gaps {
                let gap = PyDict::new(py);
                gap.set_item("start", g.start)?;
                gap.set_item("text", g.text_of(&tok.bytes_of(&g.tokens)))?;
                gap.set_item("tokens", g.tokens.clone())?;
                gap.set_item("eos", g.eos)?;
                gap.set_item("truncated", g.truncated)?;
                out.push(gap);
            }
            Some(out)
        }
        None => None,
    };
    d.set_item("gaps", gaps)?;
    Ok(d)
}

/// Each token's (token, logprob, [(alternative, logprob)]), each figure the float its
/// shortest decimal reads (as the server's JSON gives it: -0.25, not -0.2500000037).
fn logprobs(lps: &[TokenLogprob]) -> Vec<Entry> {
    lps.iter()
        .map(|l| {
            let top = l.top.iter().map(|&(t, p)| (t, shortest_f64(p))).collect();
            (l.token, shortest_f64(l.logprob), top)
        })
        .collect()
}
