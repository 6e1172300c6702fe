//! Whether an answer to one of the trained tiny model's held-out questions is right: the exact
//! final answer, as `train/corpus.py`'s `extract` judges it (the same rule `train/evaluate.py`
//! applies to llama.cpp's answers). Written out by hand: two patterns do not need a regex crate.

/// The exact answer a response gives: for code, its first ```python block with the function's
/// parameter renamed `arg` (the questions do not name it); otherwise what follows the first
/// "The answer is", less a final period.
pub fn extract(kind: &str, text: &str) -> Option<String> {
    if kind == "code" {
        let start = text.find("```python\n")?;
        let body = &text[start + "```python\n".len()..];
        let end = body.find("\n```")?;
        let block = &text[start..start + "```python\n".len() + end + "\n```".len()];
        return Some(canonical_code(block));
    }
    let text = text.trim();
    let at = text.find("The answer is")?;
    let rest = &text[at + "The answer is".len()..];
    // Python's `The answer is (.+?)\.?\s*$`: one character at least, then a final period dropped.
    if rest.is_empty() {
        return None;
    }
    let rest = rest
        .strip_suffix('.')
        .filter(|r| !r.is_empty())
        .unwrap_or(rest);
    Some(rest.trim().to_string())
}

/// Whether `text` answers as `answer` (a held-out question's reference answer) does.
pub fn is_right(kind: &str, text: &str, answer: &str) -> bool {
    let want = if kind == "code" {
        extract(kind, answer)
    } else {
        Some(answer.trim().to_string())
    };
    want.is_some() && extract(kind, text) == want
}

fn is_word(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `def name(param):` with every whole-word `param` renamed `arg`.
fn canonical_code(code: &str) -> String {
    let Some(param) = first_param(code) else {
        return code.to_string();
    };
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(i) = rest.find(param) {
        let before = rest[..i].chars().next_back();
        let after = rest[i + param.len()..].chars().next();
        out.push_str(&rest[..i]);
        if before.is_some_and(is_word) || after.is_some_and(is_word) {
            out.push_str(param);
        } else {
            out.push_str("arg");
        }
        rest = &rest[i + param.len()..];
    }
    out.push_str(rest);
    out
}

/// The single parameter of the first `def name(param):`.
fn first_param(code: &str) -> Option<&str> {
    let mut rest = code;
    while let Some(i) = rest.find("def ") {
        let after = &rest[i + 4..];
        let name_end = after.find(|c: char| !is_word(c)).unwrap_or(after.len());
        let tail = &after[name_end..];
        if name_end > 0 && tail.starts_with('(') {
            let close = tail.find("):")?;
            let param = &tail[1..close];
            if !param.is_empty() && param.chars().all(is_word) {
                return Some(param);
            }
        }
        rest = after;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_answers_as_the_python_rule_reads_them() {
        let t = "So 23 + 16 = 39.\nThe answer is 39.";
        assert_eq!(extract("add", t).as_deref(), Some("39"));
        assert_eq!(
            extract("list", "The answer is [1, 2].").as_deref(),
            Some("[1, 2]")
        );
        assert_eq!(extract("add", "no answer"), None);
        assert!(is_right("story", "Kai has 1.\nThe answer is 1.", "1"));
        assert!(!is_right("story", "The answer is 12.", "1"));
    }

    #[test]
    fn code_is_compared_with_its_parameter_renamed() {
        let ours = "Here.\n```python\ndef f(xs):\n    return [x * 2 for x in xs]\n```";
        let want = "```python\ndef f(items):\n    return [x * 2 for x in items]\n```";
        assert!(is_right("code", ours, want));
        let wrong = "```python\ndef f(items):\n    return [x * 2 for x in xs]\n```";
        assert!(!is_right("code", wrong, want));
    }
}
