//! Byte-level BPE pre-tokenizers: the regex sequences llama.cpp uses for
//! each `tokenizer.ggml.pre` name, and the splitter that applies them.

use fancy_regex::Regex;

use crate::TokenizerError;

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
// The case-insensitive contractions are spelled out as llama.cpp does.
const LLAMA3: &str =
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const JAIS2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}";
const QWEN2: &str =
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35: &str =
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const SEED_CODER: &str =
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+";
const BAILINGMOE: &str = r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";
const UFAKZEKA: &str = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const MINICPM5: &str =
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const EXAONE_MOE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+";
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const PORO: &str = r" ?[^(\s|.,!?…。，、।۔،)]+";
const CJK_HANGUL: &str = r"[一-龥ࠀ-一가-퟿]+";
// Cased letters, as code points: an editor's Unicode normalization would silently
// change some of them (e.g. U+1F7D, U+2126, U+212A).
const DEEPSEEK_LLM_LETTERS: &str = r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+";
const DEEPSEEK3_MAIN: &str =
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;

/// How one family of `tokenizer.ggml.pre` names tokenizes and detokenizes.
pub(crate) struct PreDef {
    pub names: &'static [&'static str],
    /// Applied in sequence: each regex splits the pieces the previous one produced.
    pub regexes: &'static [&'static str],
    /// A whole pre-token that is itself a vocabulary entry is emitted as is.
    pub ignore_merges: bool,
    /// llama.cpp's `clean_spaces` (drop the space in " ?", " 's", ... on decode).
    pub clean_spaces: bool,
    /// The default of `add_bos_token` when the key is absent.
    pub add_bos: bool,
    pub add_sep: bool,
    /// The family has no BOS token unless the GGUF names one.
    pub no_default_bos: bool,
}

const fn def(names: &'static [&'static str], regexes: &'static [&'static str], clean_spaces: bool) -> PreDef {
    PreDef { names, regexes, ignore_merges: false, clean_spaces, add_bos: false, add_sep: false, no_default_bos: false }
}

/// Pre-tokenizer families, as mapped in llama.cpp's llama-vocab.cpp.
/// "gpt2" is accepted as an alias of "gpt-2".
pub(crate) static PRE_DEFS: &[PreDef] = &[
    def(&["default"], &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"], true),
    PreDef {
        ignore_merges: true,
        add_bos: true,
        ..def(&["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"], &[LLAMA3], true)
    },
    def(&["dbrx", "smaug-bpe"], &[LLAMA3], true),
    def(&["jais-2"], &[JAIS2], true),
    def(&["deepseek-llm"], &[r"[\r\n]", DEEPSEEK_LLM_LETTERS, r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$", CJK_HANGUL, r"\p{N}+"], false),
    def(&["deepseek-coder"], &[r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK_HANGUL, r"\p{N}"], false),
    def(&["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], &[r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", DEEPSEEK3_MAIN], false),
    def(&["falcon"], &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"], true),
    def(&["starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"], &[r"\p{N}", GPT2], true),
    def(&["command-r", "smollm"], &[r"\p{N}", GPT2], false),
    def(
        &[
            "gpt-2",
            "gpt2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "exaone4",
            "mpt",
            "olmo",
            "jais",
        ],
        &[GPT2],
        true,
    ),
    def(&["trillion", "granite-docling"], &[GPT2], false),
    PreDef { add_sep: true, ..def(&["jina-v1-en", "jina-v2-code", "roberta-bpe"], &[GPT2], true) },
    def(&["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open", "grok-2"], &[QWEN2], false),
    def(&["megrez", "stablelm2"], &[QWEN2], true),
    def(&["qwen35"], &[QWEN35], false),
    def(&["poro-chat"], &[PORO], false),
    def(&["bloom", "gpt3-finnish"], &[PORO], true),
    def(&["viking"], &[PORO, r"\p{N}"], false),
    PreDef { no_default_bos: true, ..def(&["glm4", "chatglm-bpe"], &[LLAMA3], true) },
    PreDef { ignore_merges: true, add_bos: true, ..def(&["tekken"], &[TEKKEN], false) },
    PreDef {
        add_bos: true,
        ..def(
            &["chameleon"],
            &[r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", GPT2],
            false,
        )
    },
    def(&["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], &[GPT4O], false),
    def(&["seed-coder"], &[SEED_CODER], false),
    def(&["bailingmoe", "bailingmoe2", "llada-moe"], &[BAILINGMOE], false),
    def(&["ufakzeka"], &[UFAKZEKA], false),
    def(&["laguna"], &[r"[^\n]+|[\n]+", QWEN2], false),
    def(&["exaone-moe"], &[EXAONE_MOE], false),
    PreDef { ignore_merges: true, ..def(&["minicpm5"], &[r"\p{N}{1,3}", MINICPM5], true) },
];

pub(crate) fn find_pre(name: &str) -> Option<&'static PreDef> {
    PRE_DEFS.iter().find(|d| d.names.contains(&name))
}

pub(crate) fn compile(name: &str, def: &PreDef) -> Result<Vec<Regex>, TokenizerError> {
    def.regexes
        .iter()
        .map(|re| {
            // A large budget: the supported patterns backtrack at most a few steps per char.
            fancy_regex::RegexBuilder::new(re)
                .backtrack_limit(100_000_000)
                .build()
                .map_err(|e| TokenizerError::UnsupportedPre(format!("{name}: regex {re:?} does not compile: {e}")))
        })
        .collect()
}

/// Splits `text` into pre-tokens. Each regex splits every current piece into
/// its matches and the gaps between them (gaps are kept, as in llama.cpp).
pub(crate) fn split<'t>(text: &'t str, regexes: &[Regex]) -> Vec<&'t str> {
    let mut pieces = vec![text];
    for re in regexes {
        let mut next = Vec::with_capacity(pieces.len() * 2);
        for piece in pieces {
            let mut last = 0;
            for m in re.find_iter(piece) {
                // Only a blown backtrack budget errors; the rest of the piece then stays whole.
                let Ok(m) = m else { break };
                if m.start() > last {
                    next.push(&piece[last..m.start()]);
                }
                if m.end() > m.start() {
                    next.push(m.as_str());
                }
                last = m.end();
            }
            if last < piece.len() {
                next.push(&piece[last..]);
            }
        }
        pieces = next;
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pre_definition_compiles() {
        for d in PRE_DEFS {
            compile(d.names[0], d).unwrap();
        }
    }

    #[test]
    fn names_are_unique() {
        let mut all: Vec<&str> = PRE_DEFS.iter().flat_map(|d| d.names.iter().copied()).collect();
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n);
    }

    fn split_with(pre: &str, text: &str) -> Vec<String> {
        let res = compile(pre, find_pre(pre).unwrap()).unwrap();
        split(text, &res).into_iter().map(str::to_string).collect()
    }

    #[test]
    fn gpt2_keeps_trailing_space_run_before_word() {
        // "\s+(?!\S)" leaves the last space to start the next word.
        assert_eq!(split_with("gpt-2", "a   b"), ["a", "  ", " b"]);
        assert_eq!(split_with("gpt-2", "I've 33"), ["I", "'ve", " 33"]);
    }

    #[test]
    fn llama3_groups_digits_by_three_and_newlines() {
        assert_eq!(split_with("llama-bpe", "1234567 x\n\n y"), ["123", "456", "7", " x", "\n\n", " y"]);
    }

    #[test]
    fn sequential_regexes_split_previous_pieces() {
        // starcoder first isolates every digit, then applies the GPT-2 regex inside each gap.
        assert_eq!(split_with("starcoder", "ab12 c"), ["ab", "1", "2", " c"]);
        // falcon: punctuation runs first, then GPT-2, then digit triples.
        assert_eq!(split_with("falcon", "x!!12345"), ["x", "!!", "123", "45"]);
    }
}
