//! llama.cpp's GBNF grammars (what llama-server's `grammar` field and `--grammar` take), read
//! and written out as the Lark grammar llguidance compiles. Written by hand: llguidance reads
//! Lark, llama.cpp's clients send GBNF, and no crate translates one into the other.
//!
//! GBNF is a grammar over characters; Lark's terminals are lexemes. So that the two languages
//! are the same (a greedy lexeme would change which strings match: `[a-z]* "ing"`), every
//! terminal is written as a one-character lexeme, and the sequences, choices and repetitions
//! as Lark rules over them.

/// A GBNF expression.
#[derive(Debug, Clone, PartialEq)]
enum Node {
    Seq(Vec<Node>),
    Alt(Vec<Node>),
    /// A string literal (its characters in order).
    Lit(Vec<char>),
    /// A character class: `[a-z_]`, negated with `^`.
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
    /// `.`: any character.
    Any,
    Ref(String),
    /// `x*`, `x+`, `x?`, `x{m}`, `x{m,}`, `x{m,n}`.
    Repeat(Box<Node>, u32, Option<u32>),
}

/// The largest `{m,n}` bound accepted (a grammar is not a way to ask for unbounded work).
const MAX_REPEAT: u32 = 10_000;

struct Reader<'a> {
    s: &'a [char],
    i: usize,
}

type Res<T> = Result<T, String>;

impl Reader<'_> {
    fn peek(&self) -> Option<char> {
        self.s.get(self.i).copied()
    }

    fn at(&self, text: &str) -> bool {
        text.chars()
            .enumerate()
            .all(|(k, c)| self.s.get(self.i + k) == Some(&c))
    }

    /// Line and column of the reading position, for messages.
    fn place(&self) -> String {
        let before = &self.s[..self.i.min(self.s.len())];
        let line = before.iter().filter(|&&c| c == '\n').count() + 1;
        let col = before.iter().rev().take_while(|&&c| c != '\n').count() + 1;
        format!("line {line}, column {col}")
    }

    fn fail<T>(&self, what: &str) -> Res<T> {
        Err(format!("{what} at {}", self.place()))
    }

    /// Spaces and comments; newlines too inside parentheses or after `|` (`newlines`).
    fn space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' => self.i += 1,
                '\r' | '\n' if newlines => self.i += 1,
                '#' => {
                    while self.peek().is_some_and(|c| c != '\n') {
                        self.i += 1;
                    }
                }
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Res<String> {
        let start = self.i;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            self.i += 1;
        }
        if self.i == start {
            return self.fail("expected a rule name");
        }
        Ok(self.s[start..self.i].iter().collect())
    }

    fn hex(&mut self, digits: usize) -> Res<char> {
        let mut v = 0u32;
        for _ in 0..digits {
            let Some(d) = self.peek().and_then(|c| c.to_digit(16)) else {
                return self.fail(&format!("expected {digits} hex digits"));
            };
            v = v * 16 + d;
            self.i += 1;
        }
        match char::from_u32(v) {
            Some(c) => Ok(c),
            None => self.fail(&format!("\\u{v:x} is not a character")),
        }
    }

    /// One character of a literal or class, escapes read.
    fn char(&mut self) -> Res<char> {
        let Some(c) = self.peek() else {
            return self.fail("unexpected end of the grammar");
        };
        self.i += 1;
        if c != '\\' {
            return Ok(c);
        }
        let Some(e) = self.peek() else {
            return self.fail("unexpected end after '\\'");
        };
        self.i += 1;
        match e {
            'x' => self.hex(2),
            'u' => self.hex(4),
            'U' => self.hex(8),
            'n' => Ok('\n'),
            't' => Ok('\t'),
            'r' => Ok('\r'),
            '\\' | '"' | '[' | ']' | '-' | '^' => Ok(e),
            _ => {
                self.i -= 1;
                self.fail(&format!("unknown escape '\\{e}'"))
            }
        }
    }

    fn literal(&mut self) -> Res<Node> {
        self.i += 1; // "
        let mut chars = Vec::new();
        loop {
            match self.peek() {
                None | Some('\n') => return self.fail("unterminated string literal"),
                Some('"') => {
                    self.i += 1;
                    return Ok(Node::Lit(chars));
                }
                _ => chars.push(self.char()?),
            }
        }
    }

    fn class(&mut self) -> Res<Node> {
        self.i += 1; // [
        let negated = self.peek() == Some('^');
        if negated {
            self.i += 1;
        }
        let mut ranges = Vec::new();
        loop {
            match self.peek() {
                None | Some('\n') => return self.fail("unterminated character class"),
                Some(']') => {
                    self.i += 1;
                    return Ok(Node::Class { negated, ranges });
                }
                _ => {
                    let lo = self.char()?;
                    let mut hi = lo;
                    if self.peek() == Some('-') && self.s.get(self.i + 1) != Some(&']') {
                        self.i += 1;
                        hi = self.char()?;
                    }
                    if hi < lo {
                        return self.fail(&format!("range {lo:?}-{hi:?} is backwards"));
                    }
                    ranges.push((lo, hi));
                }
            }
        }
    }

    fn number(&mut self) -> Res<Option<u32>> {
        let start = self.i;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.i += 1;
        }
        if self.i == start {
            return Ok(None);
        }
        let n: String = self.s[start..self.i].iter().collect();
        match n.parse::<u32>() {
            Ok(v) if v <= MAX_REPEAT => Ok(Some(v)),
            _ => self.fail(&format!("repetition bound {n} exceeds {MAX_REPEAT}")),
        }
    }

    /// `{m}`, `{m,}`, `{m,n}` or `{,n}` after an item.
    fn braces(&mut self) -> Res<(u32, Option<u32>)> {
        self.i += 1; // {
        self.space(false);
        let lo = self.number()?;
        self.space(false);
        let bounds = if self.peek() == Some(',') {
            self.i += 1;
            self.space(false);
            let hi = self.number()?;
            (lo.unwrap_or(0), hi)
        } else {
            match lo {
                Some(m) => (m, Some(m)),
                None => return self.fail("expected a number in '{...}'"),
            }
        };
        self.space(false);
        if self.peek() != Some('}') {
            return self.fail("expected '}'");
        }
        self.i += 1;
        if bounds.1.is_some_and(|hi| hi < bounds.0) {
            return self.fail("repetition {m,n} with n < m");
        }
        Ok(bounds)
    }

    fn sequence(&mut self, nested: bool) -> Res<Node> {
        let mut items: Vec<Node> = Vec::new();
        loop {
            let item = match self.peek() {
                None | Some('|') | Some(')') | Some('\n') | Some('\r') => break,
                Some('"') => self.literal()?,
                Some('[') => self.class()?,
                Some('.') => {
                    self.i += 1;
                    Node::Any
                }
                Some('(') => {
                    self.i += 1;
                    self.space(true);
                    let inner = self.alternates(true)?;
                    if self.peek() != Some(')') {
                        return self.fail("expected ')'");
                    }
                    self.i += 1;
                    inner
                }
                Some('*' | '+' | '?' | '{') => {
                    let Some(last) = items.pop() else {
                        return self.fail("a repetition with nothing before it");
                    };
                    let (lo, hi) = match self.peek() {
                        Some('*') => (0, None),
                        Some('+') => (1, None),
                        Some('?') => (0, Some(1)),
                        _ => {
                            let b = self.braces()?;
                            self.i -= 1;
                            b
                        }
                    };
                    self.i += 1;
                    Node::Repeat(Box::new(last), lo, hi)
                }
                Some('<') => {
                    return self.fail("token references (<...>) are not supported; write the text")
                }
                Some(c) if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                    Node::Ref(self.name()?)
                }
                Some(c) => return self.fail(&format!("unexpected '{c}'")),
            };
            items.push(item);
            self.space(nested);
        }
        Ok(if items.len() == 1 {
            items.remove(0)
        } else {
            Node::Seq(items)
        })
    }

    fn alternates(&mut self, nested: bool) -> Res<Node> {
        let mut alts = vec![self.sequence(nested)?];
        while self.peek() == Some('|') {
            self.i += 1;
            self.space(true);
            alts.push(self.sequence(nested)?);
        }
        Ok(if alts.len() == 1 {
            alts.remove(0)
        } else {
            Node::Alt(alts)
        })
    }
}

/// The rules of a GBNF grammar, in order.
fn parse(src: &str) -> Res<Vec<(String, Node)>> {
    let chars: Vec<char> = src.chars().collect();
    let mut r = Reader { s: &chars, i: 0 };
    let mut rules: Vec<(String, Node)> = Vec::new();
    loop {
        r.space(true);
        if r.peek().is_none() {
            break;
        }
        let name = r.name()?;
        r.space(false);
        if !r.at("::=") {
            return r.fail(&format!("expected '::=' after '{name}'"));
        }
        r.i += 3;
        r.space(true);
        let body = r.alternates(false)?;
        if rules.iter().any(|(n, _)| *n == name) {
            return Err(format!("rule '{name}' is defined twice"));
        }
        rules.push((name, body));
        if !matches!(r.peek(), None | Some('\n') | Some('\r')) {
            return r.fail("expected the end of the rule");
        }
    }
    Ok(rules)
}

/// A character as a Lark regex lexeme's escape.
fn esc(c: char) -> String {
    format!("\\x{{{:x}}}", c as u32)
}

fn write(node: &Node, names: &dyn Fn(&str) -> Res<String>, out: &mut String) -> Res<()> {
    match node {
        Node::Seq(items) if items.is_empty() => out.push_str("\"\""),
        Node::Seq(items) => {
            out.push('(');
            for (k, it) in items.iter().enumerate() {
                if k > 0 {
                    out.push(' ');
                }
                write(it, names, out)?;
            }
            out.push(')');
        }
        Node::Alt(alts) => {
            out.push('(');
            for (k, a) in alts.iter().enumerate() {
                if k > 0 {
                    out.push_str(" | ");
                }
                write(a, names, out)?;
            }
            out.push(')');
        }
        Node::Lit(chars) if chars.is_empty() => out.push_str("\"\""),
        Node::Lit(chars) => {
            out.push('(');
            for (k, &c) in chars.iter().enumerate() {
                if k > 0 {
                    out.push(' ');
                }
                out.push('/');
                out.push_str(&esc(c));
                out.push('/');
            }
            out.push(')');
        }
        Node::Class { negated, ranges } => {
            if ranges.is_empty() {
                // `[]` matches nothing; `[^]` anything.
                out.push_str(if *negated {
                    "/(?s:.)/"
                } else {
                    "/[^\\x{0}-\\x{10ffff}]/"
                });
                return Ok(());
            }
            out.push_str(if *negated { "/[^" } else { "/[" });
            for &(lo, hi) in ranges {
                out.push_str(&esc(lo));
                if hi != lo {
                    out.push('-');
                    out.push_str(&esc(hi));
                }
            }
            out.push_str("]/");
        }
        Node::Any => out.push_str("/(?s:.)/"),
        Node::Ref(n) => out.push_str(&names(n)?),
        Node::Repeat(inner, lo, hi) => {
            if matches!(**inner, Node::Repeat(..)) {
                out.push('(');
                write(inner, names, out)?;
                out.push(')');
            } else {
                write(inner, names, out)?;
            }
            match (lo, hi) {
                (0, None) => out.push('*'),
                (1, None) => out.push('+'),
                (0, Some(1)) => out.push('?'),
                (m, None) => out.push_str(&format!("{{{m},}}")),
                (m, Some(n)) => out.push_str(&format!("{{{m},{n}}}")),
            }
        }
    }
    Ok(())
}

/// The Lark grammar (llguidance's dialect) for a GBNF grammar, whose `root` rule is the start.
/// The error names the problem and where it is.
pub fn to_lark(src: &str) -> Res<String> {
    let rules = parse(src)?;
    if !rules.iter().any(|(n, _)| n == "root") {
        return Err("the grammar has no 'root' rule".into());
    }
    // Lark's rule names are lower case; GBNF's may hold capitals and dashes. Each is numbered
    // so that two GBNF names never meet in one Lark name.
    let lark_name = |i: usize, n: &str| {
        let clean: String = n
            .chars()
            .map(|c| {
                if c == '-' {
                    '_'
                } else {
                    c.to_ascii_lowercase()
                }
            })
            .collect();
        format!("g{i}_{clean}")
    };
    let names = |n: &str| -> Res<String> {
        rules
            .iter()
            .position(|(m, _)| m == n)
            .map(|i| lark_name(i, n))
            .ok_or_else(|| format!("rule '{n}' is used but not defined"))
    };
    let mut out = format!("start: {}\n", names("root")?);
    for (i, (n, body)) in rules.iter().enumerate() {
        out.push_str(&lark_name(i, n));
        out.push_str(": ");
        write(body, &names, &mut out)?;
        out.push('\n');
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_read_as_llama_cpp_reads_them() {
        let g = "root ::= \"a\" x-y # comment\nx-y ::= [a-c]+ | (\"b\"\n  \"c\"){2,3}\n";
        let lark = to_lark(g).unwrap();
        assert_eq!(
            lark,
            "start: g0_root\ng0_root: ((/\\x{61}/) g1_x_y)\n\
             g1_x_y: (/[\\x{61}-\\x{63}]/+ | ((/\\x{62}/) (/\\x{63}/)){2,3})\n"
        );
    }

    #[test]
    fn mistakes_are_named_with_their_place() {
        for (g, want) in [
            ("root ::= x", "rule 'x' is used but not defined"),
            ("item ::= \"a\"", "no 'root' rule"),
            ("root ::= \"a", "unterminated string literal at line 1"),
            ("root ::= [b-a]", "backwards"),
            ("root ::= \"a\"{3,2}", "n < m"),
            ("root ::= \"a\"\nroot ::= \"b\"", "defined twice"),
            ("root ::= <think>", "token references"),
            ("root = \"a\"", "expected '::='"),
            ("root ::= \"\\q\"", "unknown escape"),
            ("root ::= \"a\"{99999}", "exceeds"),
        ] {
            let e = to_lark(g).unwrap_err();
            assert!(e.contains(want), "{g:?}: {e}");
        }
    }

    #[test]
    fn escapes_and_classes() {
        let lark = to_lark(r#"root ::= [^"\\\x7F\x00-\x1F] "\u00e9\n" ."#).unwrap();
        assert!(
            lark.contains(r"/[^\x{22}\x{5c}\x{7f}\x{0}-\x{1f}]/"),
            "{lark}"
        );
        assert!(lark.contains(r"(/\x{e9}/ /\x{a}/)"), "{lark}");
        assert!(lark.contains("/(?s:.)/"), "{lark}");
    }
}
