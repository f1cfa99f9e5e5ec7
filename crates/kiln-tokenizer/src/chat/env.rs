//! The Jinja environment `transformers` renders chat templates in, rebuilt on minijinja:
//! trim_blocks and lstrip_blocks, `raise_exception`, `strftime_now`, Python string and dict
//! methods, `tojson` as `json.dumps`, and Python's way of printing and stripping values.

use std::fmt::Write as _;
use std::io;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Output, State};

use super::time::strftime;

/// Context variable holding `strftime_now`'s instant (Unix seconds); absent: the real clock.
pub(super) const NOW_VAR: &str = "__kiln_strftime_now";
/// The function [`guard_loops`] wraps around every `for` loop's iterable.
const ITERABLE_FN: &str = "__kiln_iterable";

/// The message of a `raise_exception()` call, carried as the render error's source so it can be
/// told apart from the engine's own errors.
#[derive(Debug)]
pub(super) struct Raised(pub String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

pub(super) fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(python_methods);
    env.set_formatter(python_formatter);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_function(ITERABLE_FN, iterable);
    env.add_filter("tojson", tojson);
    env.add_filter("trim", trim);
    env.add_filter("string", string);
    env.add_test("iterable", is_iterable);
    env.add_test("sequence", is_sequence);
    env.add_test("number", is_number);
    env
}

/// Jinja2's `iterable`: `iter(value)` works, which it does for undefined but not for `None`.
fn is_iterable(value: &Value) -> bool {
    !value.is_none() && value.try_iter().is_ok()
}

/// Jinja2's `sequence`: the value has `len()` and `[]`, so strings, lists, dicts and undefined.
fn is_sequence(value: &Value) -> bool {
    matches!(value.kind(), ValueKind::String | ValueKind::Seq | ValueKind::Map | ValueKind::Bytes | ValueKind::Undefined)
}

/// Jinja2's `number`: Python bools are numbers too.
fn is_number(value: &Value) -> bool {
    matches!(value.kind(), ValueKind::Number | ValueKind::Bool)
}

/// Python's `str.isspace()`: Unicode white space plus the separators U+001C..U+001F.
fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.strip`, `lstrip` and `rstrip`: white space, or the characters of `chars`.
fn py_strip<'s>(s: &'s str, chars: Option<&str>, left: bool, right: bool) -> &'s str {
    let strip = |c: char| match chars {
        Some(set) => set.contains(c),
        None => is_py_space(c),
    };
    let s = if left { s.trim_start_matches(strip) } else { s };
    if right {
        s.trim_end_matches(strip)
    } else {
        s
    }
}

/// pycompat's methods, with Python's white space for the strip family.
fn python_methods(state: &State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let (Some(s), "strip" | "lstrip" | "rstrip") = (value.as_str(), method) {
        let chars = match args {
            [] => None,
            [a] if a.is_none() => None,
            [a] => Some(a.as_str().ok_or_else(|| Error::new(ErrorKind::InvalidOperation, format!("{method} arg must be None or str")))?),
            _ => return Err(Error::new(ErrorKind::TooManyArguments, format!("{method} takes at most one argument"))),
        };
        return Ok(Value::from(py_strip(s, chars, method != "rstrip", method != "lstrip")));
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// `{{ value }}` as Jinja2 prints it: `str(value)`, so `True`, `None` and Python list/dict reprs.
fn python_formatter(out: &mut Output, state: &State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Bool | ValueKind::None | ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            py_repr(value, &mut text);
            out.write_str(&text).map_err(Error::from)
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `repr()` of a string: single quotes unless the text has one and no double quote.
fn py_repr_str(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `repr()` of a template value.
fn py_repr(value: &Value, out: &mut String) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::String => py_repr_str(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in value.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&item, out);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&key, out);
                out.push_str(": ");
                py_repr(&value.get_item(&key).unwrap_or_default(), out);
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Jinja2's `string` filter: Python's `str()`.
fn string(value: &Value) -> Value {
    match value.kind() {
        ValueKind::String => value.clone(),
        ValueKind::Undefined => Value::from(""),
        ValueKind::Bool | ValueKind::None | ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            py_repr(value, &mut text);
            Value::from(text)
        }
        _ => Value::from(value.to_string()),
    }
}

/// Jinja2's `trim`: Python's `str.strip(chars)`.
fn trim(value: &Value, chars: Option<String>) -> Value {
    let text = match value.as_str() {
        Some(s) => s.to_string(),
        None => string(value).to_string(),
    };
    Value::from(py_strip(&text, chars.as_deref(), true, true))
}

/// Python's `json.dumps` default spacing: ", " between items, ": " after keys.
struct PythonJsonSpacing;

impl serde_json::ser::Formatter for PythonJsonSpacing {
    fn begin_array_value<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

/// `tojson` as `transformers` defines it (no HTML escaping, non-ASCII kept, keys in order).
fn tojson(value: &Value, indent: Option<usize>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = indent.or(kwargs.get::<Option<usize>>("indent")?);
    // Accepted for compatibility; output is always non-ASCII-preserving, unsorted.
    for ignored in ["ensure_ascii", "separators", "sort_keys"] {
        let _: Option<Value> = kwargs.get(ignored)?;
    }
    kwargs.assert_all_used()?;
    let mut buf = Vec::new();
    let result = match indent {
        Some(n) => {
            let spaces = vec![b' '; n];
            let fmt = serde_json::ser::PrettyFormatter::with_indent(&spaces);
            serde::Serialize::serialize(value, &mut serde_json::Serializer::with_formatter(&mut buf, fmt))
        }
        None => serde::Serialize::serialize(value, &mut serde_json::Serializer::with_formatter(&mut buf, PythonJsonSpacing)),
    };
    result.map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let text = String::from_utf8(buf).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(text))
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

fn strftime_now(state: &State, format: String) -> String {
    let pinned = state.lookup(NOW_VAR).and_then(|v| i64::try_from(v).ok());
    let now = pinned.unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64));
    strftime(&format, now)
}

/// Jinja2 raises `TypeError` when a loop iterates `None`; minijinja would iterate nothing.
fn iterable(value: Value) -> Result<Value, Error> {
    if value.is_none() {
        Err(Error::new(ErrorKind::InvalidOperation, "'NoneType' object is not iterable"))
    } else {
        Ok(value)
    }
}

/// Wraps the iterable of every `{% for ... in EXPR %}` as `__kiln_iterable(EXPR)`, so that
/// iterating `none` fails as in Jinja2. The filter (`if ...`) and `recursive` stay outside.
/// A source the lexer rejects is returned as is, for the parser to report.
pub(super) fn guard_loops(source: &str) -> String {
    use minijinja::machinery::{tokenize, Token, WhitespaceConfig};
    let Ok(tokens) = tokenize(source, false, Default::default(), WhitespaceConfig::default()).collect::<Result<Vec<_>, _>>() else {
        return source.to_string();
    };
    let nesting = |t: &Token| match t {
        Token::ParenOpen | Token::BracketOpen | Token::BraceOpen => 1,
        Token::ParenClose | Token::BracketClose | Token::BraceClose => -1,
        _ => 0,
    };
    // The index of the first token from `from` at bracket depth 0 that `stop` accepts.
    let find = |from: usize, stop: &dyn Fn(&Token) -> bool| {
        let mut depth = 0i32;
        for (i, (t, _)) in tokens.iter().enumerate().skip(from) {
            if depth == 0 && (stop(t) || matches!(t, Token::BlockEnd)) {
                return i;
            }
            depth += nesting(t);
        }
        tokens.len()
    };
    let mut inserts = Vec::new();
    let mut i = 0;
    while i + 1 < tokens.len() {
        if !(matches!(tokens[i].0, Token::BlockStart) && matches!(tokens[i + 1].0, Token::Ident("for"))) {
            i += 1;
            continue;
        }
        let at_in = find(i + 2, &|t| matches!(t, Token::Ident("in")));
        if !matches!(tokens.get(at_in), Some((Token::Ident("in"), _))) {
            i = at_in;
            continue;
        }
        let end = find(at_in + 1, &|t| matches!(t, Token::Ident("if" | "recursive")));
        if end > at_in + 1 {
            inserts.push((tokens[at_in + 1].1.start_offset as usize, true));
            inserts.push((tokens[end - 1].1.end_offset as usize, false));
        }
        i = end;
    }
    let mut out = String::with_capacity(source.len() + inserts.len() * 12);
    let mut last = 0;
    for (at, open) in inserts {
        out.push_str(&source[last..at]);
        if open {
            out.push_str(ITERABLE_FN);
            out.push('(');
        } else {
            out.push(')');
        }
        last = at;
    }
    out.push_str(&source[last..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loops_get_guarded_iterables() {
        let src = "{%- for k, v in (a|items) if v recursive %}{{ x }}{% endfor %}{% for m in messages[1:] %}{% endfor %}{{ 'for x in y' }}";
        assert_eq!(
            guard_loops(src),
            "{%- for k, v in __kiln_iterable((a|items)) if v recursive %}{{ x }}{% endfor %}{% for m in __kiln_iterable(messages[1:]) %}{% endfor %}{{ 'for x in y' }}"
        );
        assert_eq!(guard_loops("{% for %}"), "{% for %}");
    }

    #[test]
    fn python_strip_and_repr() {
        assert_eq!(py_strip("\u{1c} a\u{a0}\n", None, true, true), "a");
        assert_eq!(py_strip("xxaxx", Some("x"), true, false), "axx");
        let mut out = String::new();
        py_repr(&Value::from_serialize(serde_json::json!({"a": [true, null, "it's", 1.5]})), &mut out);
        assert_eq!(out, "{'a': [True, None, \"it's\", 1.5]}");
    }

    #[test]
    fn type_tests_follow_jinja2() {
        let mut env = environment();
        env.add_template("t", "{{ none is iterable }} {{ x is iterable }} {{ 'a' is sequence }} {{ x is sequence }} {{ 3 is sequence }} {{ true is number }}")
            .unwrap();
        assert_eq!(env.get_template("t").unwrap().render(()).unwrap(), "False True True True False True");
    }
}
