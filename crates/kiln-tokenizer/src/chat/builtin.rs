//! Built-in chat templates for `--chat-template NAME`: short templates of the standard
//! prompt formats, for models whose GGUF has no template (or a broken one). They cover plain
//! conversations (system, user, assistant), not tools.

use super::CHATML_TEMPLATE;

/// Sets `bos`/`eos` to the tokens, or to empty strings when they are undefined.
macro_rules! with_special_tokens {
    ($body:literal) => {
        concat!("{%- set bos = bos_token if bos_token is defined else '' -%}\n", "{%- set eos = eos_token if eos_token is defined else '' -%}\n", $body)
    };
}

/// Qwen2 / Qwen2.5 without tools: ChatML with a default system message.
const QWEN2: &str = r#"{%- if not messages or messages[0]['role'] != 'system' -%}
{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"#;

/// Qwen3: ChatML; earlier answers lose their `<think>` part; `enable_thinking=false` opens
/// the answer with an empty think block.
const QWEN3: &str = r#"{%- for m in messages -%}
{%- set content = m['content'] -%}
{%- if m['role'] == 'assistant' and '</think>' in content -%}
{%- set content = content.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
{{- '<|im_start|>' + m['role'] + '\n' + content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}"#;

/// Llama 3.x: header tokens, trimmed content, `<|eot_id|>` after each turn.
const LLAMA3: &str = with_special_tokens!(
    r#"{{- bos -}}
{%- for m in messages -%}
{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"#
);

/// Llama 2 chat: `[INST]` turns, the system message in `<<SYS>>` inside the first one.
const LLAMA2: &str = with_special_tokens!(
    r#"{%- set system = '' -%}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set system = '<<SYS>>\n' + messages[0]['content'] | trim + '\n<</SYS>>\n\n' -%}
{%- set messages = messages[1:] -%}
{%- endif -%}
{%- for m in messages -%}
{%- if m['role'] == 'user' -%}
{{- bos + '[INST] ' + (system if loop.first else '') + m['content'] | trim + ' [/INST]' -}}
{%- elif m['role'] == 'assistant' -%}
{{- ' ' + m['content'] | trim + ' ' + eos -}}
{%- endif -%}
{%- endfor -%}"#
);

/// Gemma 2 / 3: `<start_of_turn>` turns, `model` for the assistant, the system message at the
/// start of the first user turn.
const GEMMA: &str = with_special_tokens!(
    r#"{%- set prefix = '' -%}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set prefix = messages[0]['content'] | trim + '\n\n' -%}
{%- set messages = messages[1:] -%}
{%- endif -%}
{{- bos -}}
{%- for m in messages -%}
{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}
{{- '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + m['content'] | trim + '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"#
);

/// Mistral v7 with the Tekken tokenizer (Mistral Small 3.x, Magistral): `[SYSTEM_PROMPT]`,
/// `[INST]` turns without spaces, `</s>` after answers. `[/INST]` is the generation prompt.
const MISTRAL: &str = with_special_tokens!(
    r#"{{- bos -}}
{%- for m in messages -%}
{%- if m['role'] == 'system' -%}
{{- '[SYSTEM_PROMPT]' + m['content'] + '[/SYSTEM_PROMPT]' -}}
{%- elif m['role'] == 'user' -%}
{{- '[INST]' + m['content'] + '[/INST]' -}}
{%- elif m['role'] == 'assistant' -%}
{{- m['content'] + eos -}}
{%- endif -%}
{%- endfor -%}"#
);

/// Phi-3 / Phi-3.5: `<|role|>` turns ended by `<|end|>`.
const PHI3: &str = r#"{%- for m in messages -%}
{{- '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"#;

/// DeepSeek-R1 (and its distills): system text first, `<｜User｜>` / `<｜Assistant｜>`, earlier
/// answers without their thinking, the answer opened with `<think>`.
const DEEPSEEK_R1: &str = with_special_tokens!(
    r#"{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] -%}{%- endif -%}
{%- endfor -%}
{{- bos + ns.system -}}
{%- for m in messages -%}
{%- if m['role'] == 'user' -%}
{{- '<｜User｜>' + m['content'] -}}
{%- elif m['role'] == 'assistant' -%}
{%- set content = m['content'] -%}
{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}
{{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<｜Assistant｜><think>\n' -}}{%- endif -%}"#
);

/// gpt-oss (OpenAI harmony): a system header with the date and reasoning effort, system
/// messages as developer instructions, answers on the `final` channel.
const GPT_OSS: &str = r#"{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: ' + strftime_now('%Y-%m-%d') -}}
{{- '\n\nReasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium') -}}
{{- '\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>' -}}
{%- for m in messages -%}
{%- if m['role'] == 'system' or m['role'] == 'developer' -%}
{{- '<|start|>developer<|message|># Instructions\n\n' + m['content'] + '\n\n<|end|>' -}}
{%- elif m['role'] == 'user' -%}
{{- '<|start|>user<|message|>' + m['content'] + '<|end|>' -}}
{%- elif m['role'] == 'assistant' -%}
{{- '<|start|>assistant<|channel|>final<|message|>' + m['content'] + '<|end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"#;

/// SmolLM3: ChatML with a metadata system block; `/think` or `/no_think` in the system message,
/// else `enable_thinking`, picks the reasoning mode.
const SMOLLM3: &str = r#"{%- set think = not (enable_thinking is defined and enable_thinking is false) -%}
{%- set system = '' -%}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set system = messages[0]['content'] -%}
{%- set messages = messages[1:] -%}
{%- if '/no_think' in system -%}{%- set think = false -%}{%- elif '/think' in system -%}{%- set think = true -%}{%- endif -%}
{%- set system = system.replace('/no_think', '').replace('/think', '') | trim -%}
{%- endif -%}
{{- '<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nReasoning Mode: ' + ('/think' if think else '/no_think') -}}
{{- '\n\n## Custom Instructions\n\n' + (system or 'You are a helpful AI assistant named SmolLM, trained by Hugging Face.') + '\n\n<|im_end|>\n' -}}
{%- for m in messages -%}
{%- set content = m['content'] -%}
{%- if m['role'] == 'assistant' and '</think>' in content -%}{%- set content = content.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}
{{- '<|im_start|>' + m['role'] + '\n' + content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' + ('' if think else '<think>\n\n</think>\n') -}}
{%- endif -%}"#;

/// The names `--chat-template` accepts, in the order errors list them.
pub const BUILTIN_TEMPLATES: [&str; 11] = ["chatml", "qwen2", "qwen3", "llama3", "llama2", "gemma", "mistral", "phi3", "deepseek-r1", "gpt-oss", "smollm3"];

/// The Jinja text of a built-in template.
pub fn builtin_template(name: &str) -> Option<&'static str> {
    Some(match name {
        "chatml" => CHATML_TEMPLATE,
        "qwen2" => QWEN2,
        "qwen3" => QWEN3,
        "llama3" => LLAMA3,
        "llama2" => LLAMA2,
        "gemma" => GEMMA,
        "mistral" => MISTRAL,
        "phi3" => PHI3,
        "deepseek-r1" => DEEPSEEK_R1,
        "gpt-oss" => GPT_OSS,
        "smollm3" => SMOLLM3,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::{ChatInputs, ChatTemplate};

    fn two_turns(name: &str, add_generation_prompt: bool) -> String {
        let messages = serde_json::json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ]);
        let template = ChatTemplate::new(builtin_template(name).unwrap()).unwrap();
        let inputs = ChatInputs { messages: &messages, add_generation_prompt, bos_token: Some("<BOS>"), eos_token: Some("<EOS>"), ..Default::default() };
        template.render(&inputs).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    #[test]
    fn every_builtin_renders_a_two_turn_conversation() {
        for name in BUILTIN_TEMPLATES {
            let (with, without) = (two_turns(name, true), two_turns(name, false));
            let mut at = 0;
            for text in ["Be brief.", "Hi", "Hello!", "Bye"] {
                let found = with[at..].find(text).unwrap_or_else(|| panic!("{name}: {text:?} missing or out of order in {with:?}"));
                at += found + text.len();
            }
            // `[/INST]` is the generation prompt of the Mistral and Llama 2 formats; the others add one.
            assert_eq!(with == without, ["mistral", "llama2"].contains(&name), "{name}: generation prompt in {with:?}");
            assert!(with.starts_with(&without), "{name}");
        }
    }

    #[test]
    fn llama_formats() {
        assert_eq!(
            two_turns("llama3", true),
            "<BOS><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        assert_eq!(two_turns("llama2", true), "<BOS>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! <EOS><BOS>[INST] Bye [/INST]");
        assert_eq!(two_turns("gemma", true), "<BOS><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n");
    }

    #[test]
    fn unknown_names_are_none() {
        assert!(builtin_template("chatml").is_some());
        assert!(builtin_template("ChatML").is_none());
    }
}
