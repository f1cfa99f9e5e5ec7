//! A chat answer's reasoning split from its content, as llama-server's `--reasoning-format auto`
//! and vLLM's reasoning parsers split it: `<think>...</think>` at the start of the answer (Qwen3,
//! Qwen3.5, DeepSeek-R1, SmolLM3; already open where the prompt ends with `<think>`), or the
//! harmony channels of gpt-oss (`analysis` is reasoning, every other channel content). Text
//! arrives in pieces; anything that may be the start of a marker is held until it is decided.

/// Whether chat answers come split (`reasoning_content` beside `content`) or raw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// Split where the chat template has a known reasoning syntax.
    #[default]
    Auto,
    /// The answer's text as generated, markers included.
    None,
}

impl ReasoningFormat {
    /// A request's `reasoning_format` (llama-server's names; `deepseek` splits as `auto` does).
    pub fn parse(name: &str) -> Option<ReasoningFormat> {
        match name {
            "auto" | "deepseek" => Some(ReasoningFormat::Auto),
            "none" => Some(ReasoningFormat::None),
            _ => None,
        }
    }
}

/// How a template's model marks its reasoning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningSyntax {
    Think,
    Harmony,
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const END: &str = "<|end|>";
const START: &str = "<|start|>";

impl ReasoningSyntax {
    /// The syntax a chat template's source writes, if any.
    pub fn of_template(source: &str) -> Option<ReasoningSyntax> {
        if source.contains(CHANNEL) {
            Some(ReasoningSyntax::Harmony)
        } else if source.contains(THINK_OPEN) || source.contains(THINK_CLOSE) {
            Some(ReasoningSyntax::Think)
        } else {
            None
        }
    }

    /// A splitter for the answer to `prompt` (the rendered chat prompt).
    pub fn splitter(self, prompt: &str) -> ReasoningSplitter {
        let state = match self {
            ReasoningSyntax::Think if prompt.trim_end().ends_with(THINK_OPEN) => State::ThinkStart,
            ReasoningSyntax::Think => State::Start,
            ReasoningSyntax::Harmony => State::HarmonyStart,
        };
        ReasoningSplitter { state, held: String::new() }
    }
}

/// What a piece of the answer added to each part.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

impl Split {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Before the answer's first text: `<think>` may open it.
    Start,
    /// Inside `<think>`, before its first non-blank text.
    ThinkStart,
    Think,
    /// After `</think>`, before the content's first non-blank text.
    ThinkEnded,
    Content,
    /// Before the answer's first text: a harmony header may open it.
    HarmonyStart,
    /// A harmony header (`<|channel|>NAME ...`), up to `<|message|>`.
    Header,
    /// A harmony message's text, up to `<|end|>` or `<|start|>`.
    Message {
        reasoning: bool,
    },
    /// After `<|end|>`: the next message's `<|start|>`.
    BetweenMessages,
}

/// Splits one answer, piece by piece.
pub struct ReasoningSplitter {
    state: State,
    held: String,
}

/// The length of the longest end of `text` that begins one of `markers` without holding all of it.
fn partial_marker_len(text: &str, markers: &[&str]) -> usize {
    markers
        .iter()
        .flat_map(|m| (1..m.len().min(text.len() + 1)).rev().find(|&n| text.is_char_boundary(text.len() - n) && m.starts_with(&text[text.len() - n..])))
        .max()
        .unwrap_or(0)
}

/// The earliest of `markers` in `text`: (position, marker).
fn first_marker<'m>(text: &str, markers: &[&'m str]) -> Option<(usize, &'m str)> {
    markers.iter().filter_map(|m| text.find(m).map(|i| (i, *m))).min_by_key(|&(i, _)| i)
}

/// The channel a harmony header names.
fn header_is_reasoning(header: &str) -> bool {
    header.split(CHANNEL).nth(1).is_some_and(|rest| rest.trim_start().split(|c: char| c.is_whitespace() || c == '<').next() == Some("analysis"))
}

impl ReasoningSplitter {
    /// Adds a piece of the answer; returns what is decided so far.
    pub fn push(&mut self, text: &str) -> Split {
        self.held.push_str(text);
        let mut out = Split::default();
        while self.step(&mut out, false) {}
        out
    }

    /// The rest, at the answer's end: what was held goes where its state says.
    pub fn finish(&mut self) -> Split {
        let mut out = Split::default();
        while self.step(&mut out, true) {}
        match self.state {
            State::Start | State::HarmonyStart | State::Content | State::Message { reasoning: false } | State::BetweenMessages => {
                out.content.push_str(&self.held)
            }
            State::ThinkStart | State::Think | State::Message { reasoning: true } => out.reasoning.push_str(self.held.trim_end()),
            // An unfinished header, or blanks after the reasoning, hold nothing to show.
            State::Header | State::ThinkEnded => {}
        }
        self.held.clear();
        out
    }

    /// One move of the state machine; false when it needs more text.
    fn step(&mut self, out: &mut Split, at_end: bool) -> bool {
        let held = std::mem::take(&mut self.held);
        let (next, rest, more) = match self.state {
            State::Start | State::HarmonyStart => {
                let (open, inside) = if self.state == State::Start { (THINK_OPEN, State::ThinkStart) } else { (CHANNEL, State::Header) };
                let trimmed = held.trim_start();
                if let Some(after) = trimmed.strip_prefix(open) {
                    let rest = if inside == State::Header { format!("{open}{after}") } else { after.to_string() };
                    (inside, rest, true)
                } else if open.starts_with(trimmed) && !at_end {
                    (self.state, held, false)
                } else {
                    let content = if self.state == State::Start { State::Content } else { State::Message { reasoning: false } };
                    (content, held, true)
                }
            }
            State::ThinkStart | State::ThinkEnded => {
                let trimmed = held.trim_start();
                if trimmed.is_empty() {
                    (self.state, String::new(), false)
                } else {
                    (if self.state == State::ThinkStart { State::Think } else { State::Content }, trimmed.to_string(), true)
                }
            }
            State::Think => match held.find(THINK_CLOSE) {
                Some(i) => {
                    out.reasoning.push_str(held[..i].trim_end());
                    (State::ThinkEnded, held[i + THINK_CLOSE.len()..].to_string(), true)
                }
                None => {
                    // Blanks before a possible `</think>` are held: the reasoning is trimmed.
                    let keep = partial_marker_len(&held, &[THINK_CLOSE]);
                    let decided = held[..held.len() - keep].trim_end().len();
                    out.reasoning.push_str(&held[..decided]);
                    (State::Think, held[decided..].to_string(), false)
                }
            },
            State::Content => {
                out.content.push_str(&held);
                (State::Content, String::new(), false)
            }
            State::Header => match held.find(MESSAGE) {
                Some(i) => (State::Message { reasoning: header_is_reasoning(&held[..i]) }, held[i + MESSAGE.len()..].to_string(), true),
                None => (State::Header, held, false),
            },
            State::Message { reasoning } => {
                let part = if reasoning { &mut out.reasoning } else { &mut out.content };
                match first_marker(&held, &[END, START]) {
                    Some((i, marker)) => {
                        part.push_str(&held[..i]);
                        let next = if marker == END { State::BetweenMessages } else { State::Header };
                        (next, held[i + marker.len()..].to_string(), true)
                    }
                    None => {
                        let keep = partial_marker_len(&held, &[END, START]);
                        part.push_str(&held[..held.len() - keep]);
                        (self.state, held[held.len() - keep..].to_string(), false)
                    }
                }
            }
            State::BetweenMessages => {
                let trimmed = held.trim_start();
                if let Some(after) = trimmed.strip_prefix(START) {
                    (State::Header, after.to_string(), true)
                } else if START.starts_with(trimmed) && !at_end {
                    (State::BetweenMessages, held, false)
                } else {
                    (State::Message { reasoning: false }, held, true)
                }
            }
        };
        self.state = next;
        self.held = rest;
        more
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The answer fed in pieces of every size from 1 to 7 characters, and whole.
    fn split_every_way(syntax: ReasoningSyntax, prompt: &str, answer: &str) -> (String, String) {
        let whole = {
            let mut s = syntax.splitter(prompt);
            let (a, b) = (s.push(answer), s.finish());
            (a.reasoning + &b.reasoning, a.content + &b.content)
        };
        let chars: Vec<char> = answer.chars().collect();
        for size in 1..=7 {
            let mut s = syntax.splitter(prompt);
            let (mut reasoning, mut content) = (String::new(), String::new());
            for piece in chars.chunks(size) {
                let split = s.push(&piece.iter().collect::<String>());
                reasoning += &split.reasoning;
                content += &split.content;
            }
            let split = s.finish();
            reasoning += &split.reasoning;
            content += &split.content;
            assert_eq!((&reasoning, &content), (&whole.0, &whole.1), "pieces of {size} of {answer:?}");
        }
        whole
    }

    fn pair(reasoning: &str, content: &str) -> (String, String) {
        (reasoning.to_string(), content.to_string())
    }

    #[test]
    fn think_blocks_are_reasoning() {
        let think = ReasoningSyntax::Think;
        let qwen3 = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(split_every_way(think, qwen3, "<think>\nLet me see.\n</think>\n\nHello!"), pair("Let me see.", "Hello!"));
        assert_eq!(split_every_way(think, qwen3, "  <think>a < b </thin k</think>x</think>"), pair("a < b </thin k", "x</think>"));
        assert_eq!(split_every_way(think, qwen3, "Hello <think> there"), pair("", "Hello <think> there"));
        assert_eq!(split_every_way(think, qwen3, "<thin"), pair("", "<thin"));
        // Cut off while thinking: all of it is reasoning.
        assert_eq!(split_every_way(think, qwen3, "<think>\nstill going \n</thi"), pair("still going \n</thi", ""));
        // Thinking turned off: the prompt closed the block, the answer is content.
        let closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
        assert_eq!(split_every_way(think, closed, "Sure."), pair("", "Sure."));
    }

    #[test]
    fn a_prompt_ending_in_think_opens_the_block() {
        let think = ReasoningSyntax::Think;
        let r1 = "<｜User｜>hi<｜Assistant｜><think>\n";
        assert_eq!(split_every_way(think, r1, "Okay, so.\n</think>\n\nHi there."), pair("Okay, so.", "Hi there."));
        assert_eq!(split_every_way(think, r1, "\n\n</think>\n\nHi."), pair("", "Hi."));
        assert_eq!(split_every_way(think, r1, "never closed"), pair("never closed", ""));
    }

    #[test]
    fn harmony_analysis_is_reasoning_and_other_channels_content() {
        let harmony = ReasoningSyntax::Harmony;
        let prompt = "<|start|>user<|message|>hi<|end|><|start|>assistant";
        let answer = "<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello!";
        assert_eq!(split_every_way(harmony, prompt, answer), pair("User says hi.", "Hello!"));
        let preamble = "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}";
        assert_eq!(split_every_way(harmony, prompt, preamble), pair("a", "{}"));
        // Cut off in the middle of a header: the header shows nowhere.
        assert_eq!(split_every_way(harmony, prompt, "<|channel|>analysis<|message|>x<|end|><|start|>assist"), pair("x", ""));
        // No harmony at all: plain content.
        assert_eq!(split_every_way(harmony, prompt, "just <|end text"), pair("", "just <|end text"));
    }

    #[test]
    fn the_syntax_follows_the_template() {
        assert_eq!(ReasoningSyntax::of_template("{{ '<|start|>assistant<|channel|>final<|message|>' }}"), Some(ReasoningSyntax::Harmony));
        assert_eq!(ReasoningSyntax::of_template("{%- if '</think>' in content %}"), Some(ReasoningSyntax::Think));
        assert_eq!(ReasoningSyntax::of_template("{{ '<|im_start|>assistant\\n' }}"), None);
    }
}
