//! Tool calls on the chat endpoints (OpenAI's and ollama's): the `tools` list checked and
//! given to the chat template, `tool_choice` turned into what the decode does (nothing, read
//! the calls the model writes, or a grammar that makes it write one), and the calls read out
//! of the answer in each API's shape.

use axum::http::StatusCode;
use serde_json::{json, Value as Json};

use crate::api::ApiError;
use refusion_engine::chat::template::to_python_json;
use refusion_engine::constrain::tools::{self, Call, Parsed, Tool};
use refusion_engine::constrain::Format;

/// What a request's tools ask of the decode.
#[derive(Debug, Default)]
pub struct ToolPlan {
    /// The list for the chat template (none: the model is not told of tools).
    pub tools: Option<Json>,
    /// Read `<tool_call>` blocks out of the answer.
    pub read_calls: bool,
    /// A call is required (`tool_choice: "required"` or a named function): the grammar of one.
    pub forced: Option<Format>,
    /// The model may call (`tool_choice: "auto"`): the grammar of its calls, held from where
    /// it opens one (`<tool_call>`) on.
    pub calls: Option<Format>,
}

fn bad(message: String, field: &str) -> ApiError {
    ApiError::bad_request(message).param(field)
}

/// The functions in `tools` (OpenAI's list, which ollama shares), checked.
fn functions(list: &Json) -> Result<Vec<Tool>, ApiError> {
    let Some(items) = list.as_array() else {
        return Err(bad("tools must be a list".into(), "tools"));
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, t) in items.iter().enumerate() {
        let kind = t.get("type").and_then(Json::as_str).unwrap_or("function");
        if kind != "function" {
            return Err(bad(
                format!("tools[{i}].type '{kind}' is not supported (only \"function\")"),
                "tools",
            ));
        }
        let f = t.get("function").unwrap_or(&Json::Null);
        let Some(name) = f
            .get("name")
            .and_then(Json::as_str)
            .filter(|n| !n.is_empty())
        else {
            return Err(bad(
                format!("tools[{i}].function.name is required"),
                "tools",
            ));
        };
        let parameters = f.get("parameters").cloned().unwrap_or(Json::Null);
        if !(parameters.is_null() || parameters.is_object()) {
            return Err(bad(
                format!("tools[{i}].function.parameters must be a JSON Schema object"),
                "tools",
            ));
        }
        out.push(Tool {
            name: name.to_string(),
            parameters,
        });
    }
    Ok(out)
}

/// The plan for `tools`, `tool_choice` and `parallel_tool_calls`.
pub fn plan(
    list: Option<&Json>,
    choice: Option<&Json>,
    parallel: Option<bool>,
) -> Result<ToolPlan, ApiError> {
    let list = list.filter(|l| !l.is_null() && l.as_array().is_none_or(|a| !a.is_empty()));
    let choice = choice.filter(|c| !c.is_null());
    let Some(list) = list else {
        return match choice.and_then(Json::as_str) {
            None | Some("none") | Some("auto") if choice.is_none_or(Json::is_string) => {
                Ok(ToolPlan::default())
            }
            _ => Err(bad(
                "tool_choice asks for a call, but tools is empty".into(),
                "tool_choice",
            )),
        };
    };
    let fns = functions(list)?;
    let named = |name: &str| -> Result<ToolPlan, ApiError> {
        let forced = tools::grammar(&fns, Some(name), false).ok_or_else(|| {
            bad(
                format!("tool_choice names '{name}', which is not in tools"),
                "tool_choice",
            )
        })?;
        Ok(ToolPlan {
            tools: Some(list.clone()),
            read_calls: true,
            forced: Some(forced),
            calls: None,
        })
    };
    match choice {
        None => {}
        Some(Json::String(s)) => match s.as_str() {
            "auto" => {}
            "none" => return Ok(ToolPlan::default()),
            "required" => {
                return Ok(ToolPlan {
                    tools: Some(list.clone()),
                    read_calls: true,
                    forced: tools::grammar(&fns, None, parallel.unwrap_or(true)),
                    calls: None,
                })
            }
            other => {
                return Err(bad(
                    format!("tool_choice '{other}' is not one of none, auto, required"),
                    "tool_choice",
                ))
            }
        },
        Some(c) => {
            let name = c.pointer("/function/name").and_then(Json::as_str);
            return match name {
                Some(n) => named(n),
                None => Err(bad(
                    "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}".into(),
                    "tool_choice",
                )),
            };
        }
    }
    Ok(ToolPlan {
        tools: Some(list.clone()),
        read_calls: true,
        forced: None,
        calls: tools::grammar(&fns, None, parallel.unwrap_or(true)),
    })
}

/// The calls in `answer`; a malformed one is the server's error, said to the client.
pub fn read(answer: &str, cut: bool) -> Result<Parsed, ApiError> {
    tools::parse(answer).map_err(|e| {
        let why = if cut {
            format!("{e} (the answer reached max_tokens inside it)")
        } else {
            e
        };
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("the model wrote a malformed tool call: {why}"),
        )
    })
}

/// OpenAI's `tool_calls`: ids `call_<request>_<n>`, arguments as a JSON string written as the
/// chat template writes JSON (`{"a": 1, "b": 2}`), so that a client sending the call back gives
/// the model the text it was trained on.
pub fn openai_calls<'a>(calls: impl IntoIterator<Item = (usize, &'a Call)>, request: &str) -> Json {
    Json::Array(
        calls
            .into_iter()
            .map(|(i, c)| {
                json!({"index": i, "id": format!("call_{request}_{i}"), "type": "function",
                       "function": {"name": c.name, "arguments": to_python_json(&c.arguments)}})
            })
            .collect(),
    )
}

/// ollama's `tool_calls`: arguments as an object.
pub fn ollama_calls(calls: &[Call]) -> Json {
    Json::Array(
        calls
            .iter()
            .map(|c| json!({"function": {"name": c.name, "arguments": c.arguments}}))
            .collect(),
    )
}

/// A streamed answer watched for tool calls, as ollama streams them: its text goes out until a
/// call may begin; from there it is held back, and the calls go out whole at the end (OpenAI's
/// stream sends them as they are written: [`crate::tool_stream`]).
#[derive(Debug, Default)]
pub struct CallWatch {
    all: String,
    sent: usize,
    in_call: bool,
}

impl CallWatch {
    /// The text that can go out now that `delta` came.
    pub fn push(&mut self, delta: &str) -> String {
        self.all.push_str(delta);
        if self.in_call {
            return String::new();
        }
        let unsent = &self.all[self.sent..];
        let upto = match tools::may_open(unsent) {
            Some(i) => {
                self.in_call = unsent[i..].starts_with("<tool_call>");
                i
            }
            None => unsent.len(),
        };
        let out = unsent[..upto].to_string();
        self.sent += upto;
        out
    }

    /// At the end (`cut`: by max_tokens): the calls, or the text still held back when there
    /// are none.
    pub fn finish(&self, cut: bool) -> Result<(String, Vec<Call>), ApiError> {
        let parsed = read(&self.all, cut)?;
        if parsed.calls.is_empty() {
            Ok((self.all[self.sent..].to_string(), Vec::new()))
        } else {
            Ok((String::new(), parsed.calls))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add() -> Json {
        json!([{"type": "function", "function": {"name": "add", "parameters": {"type": "object",
               "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}])
    }

    #[test]
    fn tool_choice_decides_what_the_decode_does() {
        let p = plan(Some(&add()), None, None).unwrap();
        assert!(p.read_calls && p.tools.is_some() && p.forced.is_none());
        let p = plan(Some(&add()), Some(&json!("none")), None).unwrap();
        assert!(!p.read_calls && p.tools.is_none());
        let p = plan(Some(&add()), Some(&json!("required")), None).unwrap();
        assert!(matches!(p.forced, Some(Format::Lark(_))));
        let named = json!({"type": "function", "function": {"name": "add"}});
        assert!(plan(Some(&add()), Some(&named), None)
            .unwrap()
            .forced
            .is_some());
        assert!(plan(None, None, None).unwrap().tools.is_none());
        assert!(plan(Some(&json!([])), Some(&json!("auto")), None).is_ok());
    }

    #[test]
    fn a_stream_sends_text_until_a_call_may_begin() {
        let mut w = CallWatch::default();
        assert_eq!(w.push("Let me add. <to"), "Let me add. ");
        assert_eq!(w.push("ol_call>\n{\"name\": \"add\", "), "");
        assert_eq!(w.push("\"arguments\": {}}\n</tool_call>"), "");
        let (rest, calls) = w.finish(false).unwrap();
        assert_eq!((rest.as_str(), calls.len()), ("", 1));
        let mut w = CallWatch::default();
        assert_eq!(w.push("a <"), "a ");
        assert_eq!(w.push("b"), "<b");
        assert_eq!(w.push(" <tool"), " ");
        assert_eq!(w.finish(false).unwrap(), ("<tool".to_string(), vec![]));
        let mut w = CallWatch::default();
        w.push("<tool_call>{\"name\": ");
        assert!(w.finish(true).unwrap_err().message().contains("max_tokens"));
    }

    #[test]
    fn mistakes_name_their_field() {
        for (tools, choice, field) in [
            (
                Some(add()),
                Some(json!({"type": "function", "function": {"name": "mul"}})),
                "tool_choice",
            ),
            (Some(add()), Some(json!("always")), "tool_choice"),
            (None, Some(json!("required")), "tool_choice"),
            (Some(json!({"a": 1})), None, "tools"),
            (
                Some(json!([{"type": "function", "function": {}}])),
                None,
                "tools",
            ),
            (Some(json!([{"type": "retrieval"}])), None, "tools"),
        ] {
            let e = plan(tools.as_ref(), choice.as_ref(), None).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{e:?}");
        }
    }
}
