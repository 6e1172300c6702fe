//! Tool calls in the format Qwen3's chat template teaches the model:
//! `<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>`.
//! Reading them out of an answer ([`parse`]), and the grammar that makes the model write them
//! ([`grammar`]) when a caller requires a call (`tool_choice: "required"` or a named function).

use serde_json::{json, Value as Json};

use super::Format;

pub(crate) const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// A function the caller offers: its name and its parameters' JSON Schema.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub parameters: Json,
}

/// A call the model wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub name: String,
    /// The arguments object.
    pub arguments: Json,
}

/// An answer read for tool calls: its text outside them, and the calls in order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<Call>,
}

/// Whether `text` may be the start of a tool call (so a stream holds it back until it knows).
pub fn may_open(text: &str) -> Option<usize> {
    if let Some(i) = text.find(OPEN) {
        return Some(i);
    }
    (1..OPEN.len())
        .rev()
        .find(|&k| text.ends_with(&OPEN[..k]))
        .map(|k| text.len() - k)
}

/// The tool calls in `answer`. A malformed one (no closing tag, not JSON, no name, arguments
/// not an object) is an error naming what is wrong: it is never passed off as text.
pub fn parse(answer: &str) -> Result<Parsed, String> {
    let mut out = Parsed::default();
    let mut rest = answer;
    let mut text = String::new();
    while let Some(start) = rest.find(OPEN) {
        text.push_str(&rest[..start]);
        let after = &rest[start + OPEN.len()..];
        let Some(end) = after.find(CLOSE) else {
            return Err(format!(
                "tool call {} has no closing {CLOSE}",
                out.calls.len() + 1
            ));
        };
        out.calls
            .push(call(after[..end].trim(), out.calls.len() + 1)?);
        rest = &after[end + CLOSE.len()..];
    }
    text.push_str(rest);
    if text.contains(CLOSE) {
        return Err(format!("{CLOSE} without {OPEN}"));
    }
    out.content = text.trim().to_string();
    Ok(out)
}

fn call(body: &str, n: usize) -> Result<Call, String> {
    let v: Json =
        serde_json::from_str(body).map_err(|e| format!("tool call {n} is not JSON ({e})"))?;
    let Some(name) = v.get("name").and_then(Json::as_str) else {
        return Err(format!("tool call {n} has no \"name\" string"));
    };
    let arguments = match v.get("arguments") {
        Some(a @ Json::Object(_)) => a.clone(),
        // Some models write the arguments as a JSON string.
        Some(Json::String(s)) => match serde_json::from_str::<Json>(s) {
            Ok(a @ Json::Object(_)) => a,
            _ => return Err(format!("tool call {n}'s \"arguments\" is not an object")),
        },
        None | Some(Json::Null) => json!({}),
        Some(_) => return Err(format!("tool call {n}'s \"arguments\" is not an object")),
    };
    Ok(Call {
        name: name.to_string(),
        arguments,
    })
}

/// The grammar of an answer that is tool calls only: one (or, with `parallel`, one or more),
/// each to one of `tools` (or only to `only`), its arguments valid against the tool's
/// parameters. `None` when `only` names no tool.
pub fn grammar(tools: &[Tool], only: Option<&str>, parallel: bool) -> Option<Format> {
    let chosen: Vec<&Tool> = tools
        .iter()
        .filter(|t| only.is_none_or(|n| t.name == n))
        .collect();
    if chosen.is_empty() {
        return None;
    }
    let mut lark = String::from(if parallel {
        "start: call (\"\\n\" call)*\ncall: "
    } else {
        "start: call\ncall: "
    });
    let alts: Vec<String> = (0..chosen.len()).map(|i| format!("c{i}")).collect();
    lark.push_str(&alts.join(" | "));
    lark.push('\n');
    for (i, t) in chosen.iter().enumerate() {
        let params = match &t.parameters {
            Json::Object(o) if !o.is_empty() => t.parameters.clone(),
            _ => json!({"type": "object"}),
        };
        let schema = super::styled(&json!({
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        }));
        lark.push_str(&format!(
            "c{i}: \"<tool_call>\\n\" %json {schema} \"\\n</tool_call>\"\n"
        ));
    }
    Some(Format::Lark(lark))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_read_out_of_the_answer() {
        let a = "Let me look.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": \"{}\"}\n</tool_call>";
        let p = parse(a).unwrap();
        assert_eq!(p.content, "Let me look.");
        assert_eq!(p.calls.len(), 2);
        assert_eq!(p.calls[0].name, "add");
        assert_eq!(p.calls[0].arguments, json!({"a": 1, "b": 2}));
        assert_eq!(p.calls[1].arguments, json!({}));
        assert_eq!(parse("plain text").unwrap().calls, vec![]);
    }

    #[test]
    fn malformed_calls_are_errors() {
        for (a, want) in [
            ("<tool_call>\n{\"name\": \"add\"", "no closing"),
            ("<tool_call>{\"name\": add}</tool_call>", "not JSON"),
            ("<tool_call>{\"arguments\": {}}</tool_call>", "no \"name\""),
            (
                "<tool_call>{\"name\": \"a\", \"arguments\": 3}</tool_call>",
                "not an object",
            ),
            ("text</tool_call>", "without"),
        ] {
            let e = parse(a).unwrap_err();
            assert!(e.contains(want), "{a}: {e}");
        }
    }

    #[test]
    fn a_stream_holds_back_what_may_open_a_call() {
        assert_eq!(may_open("hello <tool"), Some(6));
        assert_eq!(may_open("hello <tool_call>{"), Some(6));
        assert_eq!(may_open("hello"), None);
        assert_eq!(may_open("a <b"), None);
        assert_eq!(may_open("a <"), Some(2));
    }
}
