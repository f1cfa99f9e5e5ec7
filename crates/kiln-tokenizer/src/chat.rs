//! Chat templates: Hugging Face-style Jinja templates rendered with minijinja
//! in the environment `transformers` uses (trim_blocks, lstrip_blocks,
//! `raise_exception`, `strftime_now`, Python string/dict methods, `tojson`).

use std::io;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value};
use minijinja::{context, Environment, Error, ErrorKind};

use crate::TokenizerError;

/// One chat turn.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// ChatML, the template llama.cpp falls back to when a model has none.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

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

/// `tojson` as `transformers` defines it (no HTML escaping, non-ASCII kept).
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
    Ok(Value::from_safe_string(String::from_utf8(buf).expect("serde_json writes UTF-8")))
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

const MONTHS: [&str; 12] = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
const WEEKDAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// C `strftime` for the directives chat templates use, at `unix_secs` (UTC).
fn strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    // 1970-01-01 was a Thursday.
    let weekday = WEEKDAYS[(days + 3).rem_euclid(7) as usize];
    let month_name = MONTHS[month as usize - 1];
    let day_of_year = days - civil_days_before_year(year) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year.rem_euclid(100)),
            Some('m') => out += &format!("{month:02}"),
            Some('d') => out += &format!("{day:02}"),
            Some('e') => out += &format!("{day:2}"),
            Some('-') => match chars.next() {
                // glibc's "no padding" flag, common in templates ("%-d").
                Some('d') => out += &day.to_string(),
                Some('m') => out += &month.to_string(),
                Some(other) => out.extend(['%', '-', other]),
                None => out += "%-",
            },
            Some('B') => out += month_name,
            Some('b') | Some('h') => out += &month_name[..3],
            Some('A') => out += weekday,
            Some('a') => out += &weekday[..3],
            Some('H') => out += &format!("{hour:02}"),
            Some('I') => out += &format!("{:02}", (hour + 11) % 12 + 1),
            Some('p') => out += if hour < 12 { "AM" } else { "PM" },
            Some('M') => out += &format!("{minute:02}"),
            Some('S') => out += &format!("{second:02}"),
            Some('j') => out += &format!("{day_of_year:03}"),
            Some('%') => out.push('%'),
            Some(other) => out.extend(['%', other]),
            None => out.push('%'),
        }
    }
    out
}

/// Days from 1970-01-01 to January 1st of `year`.
fn civil_days_before_year(year: i64) -> i64 {
    let y = year - 1;
    let leap_days = |y: i64| y.div_euclid(4) - y.div_euclid(100) + y.div_euclid(400);
    365 * (year - 1970) + leap_days(y) - leap_days(1969)
}

fn strftime_now(format: String) -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    strftime(&format, now)
}

/// Renders a chat template with `messages`, `add_generation_prompt`,
/// `bos_token` and `eos_token` in scope.
pub fn render_chat_template(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, TokenizerError> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    let render = || {
        env.template_from_str(template)?.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        })
    };
    render().map_err(|e| {
        let mut msg = e.to_string();
        if let Some(detail) = e.detail() {
            if !msg.contains(detail) {
                msg = format!("{msg}: {detail}");
            }
        }
        TokenizerError::Template(msg)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_instant() {
        // 2024-02-29T13:05:09Z, a Thursday, day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(strftime("%d %b %Y, %A %a %B %j %I%p %-d/%-m %%", t), "29 Feb 2024, Thursday Thu February 060 01PM 29/2 %");
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(strftime("%Y-%m-%d %j", 951_782_400), "2000-02-29 060");
    }

    #[test]
    fn tojson_uses_python_spacing_without_html_escaping() {
        let msgs = [ChatMessage::new("user", "<b>é</b>")];
        let out = render_chat_template("{{ messages|tojson }}|{{ {'a': [1, 2]}|tojson(indent=2) }}", &msgs, false, "", "").unwrap();
        assert_eq!(out, "[{\"role\": \"user\", \"content\": \"<b>é</b>\"}]|{\n  \"a\": [\n    1,\n    2\n  ]\n}");
    }

    #[test]
    fn raise_exception_becomes_template_error() {
        let err = render_chat_template("{{ raise_exception('only user and assistant') }}", &[], false, "", "").unwrap_err();
        assert!(matches!(&err, TokenizerError::Template(m) if m.contains("only user and assistant")), "{err}");
    }

    #[test]
    fn python_string_methods_and_block_trimming() {
        let msgs = [ChatMessage::new("user", "  hi  ")];
        // lstrip_blocks removes the indentation before block tags, trim_blocks the newline after them.
        let t = "{% for m in messages %}\n    {% if m.role.startswith('us') %}\n{{ m['content'].strip() }}!\n    {% endif %}\n{% endfor %}";
        assert_eq!(render_chat_template(t, &msgs, false, "", "").unwrap(), "hi!\n");
    }

    #[test]
    fn syntax_error_is_reported() {
        let err = render_chat_template("{% if %}", &[], false, "", "").unwrap_err();
        assert!(matches!(err, TokenizerError::Template(_)));
    }
}
