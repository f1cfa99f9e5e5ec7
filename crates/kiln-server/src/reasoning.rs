//! A chat answer's reasoning split from its content, as llama-server's `--reasoning-format auto`
//! and vLLM's reasoning parsers split it: `<think>...</think>` at the start of the answer (Qwen3,
//! Qwen3.5, DeepSeek-R1, SmolLM3; already open where the prompt ends with `<think>`), Gemma 4's
//! `<|channel>thought...<channel|>` likewise, or the
//! harmony channels of gpt-oss (`analysis` is reasoning, a message to `functions.NAME` a tool
//! call, every other channel content). Text arrives in pieces; anything that may be the start
//! of a marker is held until it is decided.

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
    /// Gemma 4's thought channel.
    GemmaThought,
    Harmony,
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const GEMMA_THOUGHT_OPEN: &str = "<|channel>thought";
const GEMMA_THOUGHT_CLOSE: &str = "<channel|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const END: &str = "<|end|>";
const START: &str = "<|start|>";
const RECIPIENT: &str = "to=";

impl ReasoningSyntax {
    /// The syntax a chat template's source writes, if any.
    pub fn of_template(source: &str) -> Option<ReasoningSyntax> {
        if source.contains(CHANNEL) {
            Some(ReasoningSyntax::Harmony)
        } else if source.contains(GEMMA_THOUGHT_OPEN) {
            Some(ReasoningSyntax::GemmaThought)
        } else if source.contains(THINK_OPEN) || source.contains(THINK_CLOSE) {
            Some(ReasoningSyntax::Think)
        } else {
            None
        }
    }

    /// A splitter for the answer to `prompt` (the rendered chat prompt).
    pub fn splitter(self, prompt: &str) -> ReasoningSplitter {
        let [open, close] = match self {
            ReasoningSyntax::GemmaThought => [GEMMA_THOUGHT_OPEN, GEMMA_THOUGHT_CLOSE],
            _ => [THINK_OPEN, THINK_CLOSE],
        };
        let state = match self {
            ReasoningSyntax::Harmony => State::HarmonyStart,
            _ if prompt.trim_end().ends_with(open) => State::ThinkStart,
            _ => State::Start,
        };
        ReasoningSplitter { state, open, close, held: String::new(), calls: Vec::new() }
    }

    /// The markers the answer must show to be split (special tokens in some vocabularies).
    pub fn markers(self) -> &'static [&'static str] {
        match self {
            ReasoningSyntax::Think => &[THINK_OPEN, THINK_CLOSE],
            ReasoningSyntax::GemmaThought => &["<|channel>", GEMMA_THOUGHT_CLOSE],
            ReasoningSyntax::Harmony => &[CHANNEL, MESSAGE, END, START],
        }
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
    Message(Sink),
    /// After `<|end|>`: the next message's `<|start|>`.
    BetweenMessages,
}

/// Where a harmony message's text goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sink {
    Reasoning,
    Content,
    /// The arguments of `calls[i]`.
    Call(usize),
}

/// Splits one answer, piece by piece.
#[derive(Clone)]
pub struct ReasoningSplitter {
    state: State,
    /// The thinking block's markers (`<think>`, `</think>` or Gemma's).
    open: &'static str,
    close: &'static str,
    held: String,
    /// Harmony tool calls: (function name, arguments as sent).
    calls: Vec<(String, String)>,
}

/// The length of the longest end of `text` that begins one of `markers` without holding all of it.
pub(crate) fn partial_marker_len(text: &str, markers: &[&str]) -> usize {
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

/// The word that starts `text` (up to a blank or a marker).
fn first_word(text: &str) -> &str {
    text.trim_start().split(|c: char| c.is_whitespace() || c == '<').next().unwrap_or("")
}

/// Where a harmony header sends its message: a function it names as recipient
/// (`to=functions.NAME`, before or after the channel), else by the channel.
fn header_sink(header: &str, calls: &mut Vec<(String, String)>) -> Sink {
    if let Some(name) = header.split(RECIPIENT).nth(1).map(first_word).and_then(|to| to.strip_prefix("functions.")) {
        calls.push((name.to_string(), String::new()));
        return Sink::Call(calls.len() - 1);
    }
    match header.split(CHANNEL).nth(1).map(first_word) {
        Some("analysis") => Sink::Reasoning,
        _ => Sink::Content,
    }
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
            State::Start | State::HarmonyStart | State::Content | State::Message(Sink::Content) | State::BetweenMessages => out.content.push_str(&self.held),
            State::ThinkStart | State::Think | State::Message(Sink::Reasoning) => out.reasoning.push_str(self.held.trim_end()),
            State::Message(Sink::Call(i)) => self.calls[i].1.push_str(&self.held),
            // An unfinished header, or blanks after the reasoning, hold nothing to show.
            State::Header | State::ThinkEnded => {}
        }
        self.held.clear();
        out
    }

    /// The harmony tool calls of the answer so far: (function name, arguments as sent).
    pub fn take_calls(&mut self) -> Vec<(String, String)> {
        std::mem::take(&mut self.calls)
    }

    /// One move of the state machine; false when it needs more text.
    fn step(&mut self, out: &mut Split, at_end: bool) -> bool {
        let held = std::mem::take(&mut self.held);
        let (next, rest, more) = match self.state {
            State::Start => {
                let trimmed = held.trim_start();
                if let Some(after) = trimmed.strip_prefix(self.open) {
                    (State::ThinkStart, after.to_string(), true)
                } else if self.open.starts_with(trimmed) && !at_end {
                    (State::Start, held, false)
                } else {
                    (State::Content, held, true)
                }
            }
            // A header opens with its channel or its recipient.
            State::HarmonyStart => {
                let trimmed = held.trim_start();
                if trimmed.starts_with(CHANNEL) || trimmed.starts_with(RECIPIENT) {
                    (State::Header, trimmed.to_string(), true)
                } else if (CHANNEL.starts_with(trimmed) || RECIPIENT.starts_with(trimmed)) && !at_end {
                    (State::HarmonyStart, held, false)
                } else {
                    (State::Message(Sink::Content), held, true)
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
            State::Think => match held.find(self.close) {
                Some(i) => {
                    out.reasoning.push_str(held[..i].trim_end());
                    (State::ThinkEnded, held[i + self.close.len()..].to_string(), true)
                }
                None => {
                    // Blanks before a possible `</think>` are held: the reasoning is trimmed.
                    let keep = partial_marker_len(&held, &[self.close]);
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
                Some(i) => (State::Message(header_sink(&held[..i], &mut self.calls)), held[i + MESSAGE.len()..].to_string(), true),
                None => (State::Header, held, false),
            },
            State::Message(sink) => {
                let part = match sink {
                    Sink::Reasoning => &mut out.reasoning,
                    Sink::Content => &mut out.content,
                    Sink::Call(i) => &mut self.calls[i].1,
                };
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
                    (State::Message(Sink::Content), held, true)
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
    fn gemma_thought_channels_are_reasoning() {
        let gemma = ReasoningSyntax::GemmaThought;
        let thinking = "<|turn>user\nhi<turn|>\n<|turn>model\n";
        assert_eq!(split_every_way(gemma, thinking, "<|channel>thought\nThe user greets.<channel|>Hello!"), pair("The user greets.", "Hello!"));
        // Thinking off: the prompt holds an empty thought; the answer is content.
        let off = "<|turn>model\n<|channel>thought\n<channel|>";
        assert_eq!(split_every_way(gemma, off, "Hello <|channel>x"), pair("", "Hello <|channel>x"));
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
        let preamble = "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>";
        assert_eq!(split_every_way(harmony, prompt, preamble), pair("a", "Checking."));
        // Cut off in the middle of a header: the header shows nowhere.
        assert_eq!(split_every_way(harmony, prompt, "<|channel|>analysis<|message|>x<|end|><|start|>assist"), pair("x", ""));
        // No harmony at all: plain content.
        assert_eq!(split_every_way(harmony, prompt, "just <|end text"), pair("", "just <|end text"));
    }

    #[test]
    fn harmony_messages_to_functions_are_tool_calls() {
        let prompt = "<|start|>assistant";
        let answer = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}";
        for size in [1, 3, answer.len()] {
            let mut s = ReasoningSyntax::Harmony.splitter(prompt);
            let mut split = Split::default();
            for piece in answer.as_bytes().chunks(size) {
                let part = s.push(std::str::from_utf8(piece).unwrap());
                split.reasoning += &part.reasoning;
                split.content += &part.content;
            }
            let rest = s.finish();
            assert_eq!((split.reasoning + &rest.reasoning, split.content + &rest.content), pair("Need weather.", ""));
            assert_eq!(s.take_calls(), vec![("get_weather".to_string(), "{\"city\": \"Oslo\"}".to_string())], "pieces of {size}");
        }
        // The recipient may come before the channel, in the answer's first header too.
        for answer in [
            "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{}",
            " to=functions.lookup<|channel|>commentary json<|message|>{}",
        ] {
            let mut s = ReasoningSyntax::Harmony.splitter(prompt);
            s.push(answer);
            s.finish();
            assert_eq!(s.take_calls(), vec![("lookup".to_string(), "{}".to_string())], "{answer}");
        }
    }

    #[test]
    fn the_syntax_follows_the_template() {
        assert_eq!(ReasoningSyntax::of_template("{{ '<|start|>assistant<|channel|>final<|message|>' }}"), Some(ReasoningSyntax::Harmony));
        assert_eq!(ReasoningSyntax::of_template("{%- if '</think>' in content %}"), Some(ReasoningSyntax::Think));
        assert_eq!(ReasoningSyntax::of_template("{{- '<|channel>thought\\n<channel|>' -}}"), Some(ReasoningSyntax::GemmaThought));
        assert_eq!(ReasoningSyntax::of_template("{{ '<|im_start|>assistant\\n' }}"), None);
    }
}
