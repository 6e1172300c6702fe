//! Chat templates, rendered with minijinja the way transformers' `apply_chat_template` renders
//! them with Jinja2: `trim_blocks` and `lstrip_blocks`, loop controls, Python string methods
//! (minijinja-contrib's pycompat), a `tojson` that writes what Python's `json.dumps` writes,
//! and `raise_exception`. Templates come from model files, so rendering is bounded (fuel and
//! output size).

use minijinja::value::{Kwargs, Value as JValue};
use minijinja::{Environment, Error as JError, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Instructions a template may run before it is stopped (an endless loop, say).
const FUEL: u64 = 50_000_000;
/// Largest rendered prompt accepted.
const MAX_OUTPUT: usize = 64 << 20;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An assistant turn's tool calls, as OpenAI writes them (`{"type": "function",
    /// "function": {"name", "arguments"}}`); the template renders them in the model's format.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A tool turn's answer to this call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool turn's function name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.to_string(),
            content: content.to_string(),
            ..Message::default()
        }
    }
}

/// A writer that refuses to grow past [`MAX_OUTPUT`] bytes.
struct Bounded(Vec<u8>);

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_OUTPUT {
            return Err(std::io::Error::other(format!(
                "the chat template output exceeds {MAX_OUTPUT} bytes"
            )));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
}

/// `v` as Python's `json.dumps(v, ensure_ascii=False)` writes it: how the chat template's
/// `tojson` writes a value, so how a model trained on its prompts has seen it.
pub fn to_python_json(v: &serde_json::Value) -> String {
    let mut out = String::new();
    python_json(v, None, 0, &mut out);
    out
}

/// Python's `json.dumps(x, ensure_ascii=False)` (separators ", " and ": ", or with `indent`).
fn python_json(v: &serde_json::Value, indent: Option<usize>, level: usize, out: &mut String) {
    use serde_json::Value as J;
    let (nl, pad, pad_in) = match indent {
        Some(n) => ("\n", " ".repeat(n * level), " ".repeat(n * (level + 1))),
        None => ("", String::new(), String::new()),
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                out.push_str(nl);
                out.push_str(&pad_in);
                python_json(x, indent, level + 1, out);
            }
            out.push_str(nl);
            out.push_str(&pad);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, x)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                out.push_str(nl);
                out.push_str(&pad_in);
                out.push_str(&serde_json::to_string(k).unwrap_or_default());
                out.push_str(": ");
                python_json(x, indent, level + 1, out);
            }
            out.push_str(nl);
            out.push_str(&pad);
            out.push('}');
        }
        J::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or(0.0);
            // Python writes floats with a fractional part (1.0, not 1).
            if f.fract() == 0.0 && f.abs() < 1e16 {
                out.push_str(&format!("{f:.1}"));
            } else {
                out.push_str(&n.to_string());
            }
        }
        other => out.push_str(&serde_json::to_string(other).unwrap_or_default()),
    }
}

fn tojson(value: JValue, kwargs: Kwargs) -> std::result::Result<JValue, JError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| JError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    python_json(&json, indent, 0, &mut out);
    Ok(JValue::from_safe_string(out))
}

fn raise_exception(message: String) -> std::result::Result<JValue, JError> {
    Err(JError::new(ErrorKind::InvalidOperation, message))
}

impl ChatTemplate {
    pub fn new(source: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::model(format!("template syntax: {e}")))?;
        env.set_syntax(syntax);
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| Error::model(format!("the chat template does not parse: {e}")))?;
        Ok(ChatTemplate { env })
    }

    /// Renders `messages`, ending with the assistant's turn opener when `add_generation_prompt`.
    /// ReFusion is run with thinking "enabled", which in the Qwen3 template means no empty
    /// think block is added.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// [`Self::render`] with the functions the model may call (OpenAI's `tools` list, as
    /// sent): the template writes them into the system turn.
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| Error::model(format!("chat template: {e}")))?;
        let ctx = minijinja::context! {
            messages => JValue::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            tools => match tools {
                Some(t) => JValue::from(minijinja::value::Serde(t)),
                None => JValue::from(()),
            },
            documents => JValue::from(()),
            enable_thinking => true,
        };
        // Render into a bounded buffer: a hostile template cannot grow the output past the limit.
        let mut out = Bounded(Vec::new());
        tmpl.render_captured_to(ctx, &mut out)
            .map_err(|e| Error::model(format!("rendering the chat template: {e}")))?;
        String::from_utf8(out.0)
            .map_err(|_| Error::model("the chat template produced invalid UTF-8"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_style_json() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{"a": [1, 2.0, "é"], "b": {}}"#).unwrap();
        let mut s = String::new();
        python_json(&v, None, 0, &mut s);
        assert_eq!(s, r#"{"a": [1, 2.0, "é"], "b": {}}"#);
    }

    #[test]
    fn endless_templates_run_out_of_fuel() {
        let t = ChatTemplate::new(
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        )
        .unwrap();
        let e = t.render(&[], true).unwrap_err();
        assert!(e.to_string().contains("fuel"), "{e}");
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}").unwrap();
        assert!(t
            .render(&[], true)
            .unwrap_err()
            .to_string()
            .contains("no system role"));
        assert!(ChatTemplate::new("{% if %}").is_err());
    }
}

#[cfg(test)]
mod hostile {
    use super::*;

    #[test]
    fn huge_outputs_are_refused() {
        for src in [
            "{{ 'a' * 1000000000 }}",
            "{% set x = 'ab' * 100000 %}{% for i in range(100000) %}{{ x }}{% endfor %}",
            "{{ range(1000000000) | list | length }}",
        ] {
            let t = ChatTemplate::new(src).unwrap();
            let start = std::time::Instant::now();
            let r = t.render(&[], true);
            assert!(
                r.is_err(),
                "{src}: rendered {} bytes",
                r.map(|s| s.len()).unwrap_or(0)
            );
            assert!(start.elapsed().as_secs() < 5, "{src} took too long");
        }
    }
}
