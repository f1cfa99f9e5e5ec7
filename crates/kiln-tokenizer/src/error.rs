/// Everything that can go wrong building or using a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("unsupported tokenizer model {0:?} (tokenizer.ggml.model); supported: llama (SentencePiece), gpt2 (byte-level BPE), bert (WordPiece)")]
    UnsupportedModel(String),

    #[error("unsupported BPE pre-tokenizer {0:?} (tokenizer.ggml.pre)")]
    UnsupportedPre(String),

    #[error("missing GGUF key {0}")]
    MissingKey(String),

    #[error("GGUF key {key}: expected {expected}")]
    WrongType { key: String, expected: &'static str },

    #[error("bad vocabulary: {0}")]
    BadVocab(String),

    /// A chat template that does not compile or fails to render, or bad render inputs.
    #[error("chat template: {0}")]
    Template(String),

    /// The template called `raise_exception(message)` (transformers' `TemplateError`).
    #[error("chat template: {0}")]
    TemplateException(String),

    /// No `--chat-template` and no `tokenizer.chat_template`; holds the built-in names.
    #[error("the model has no chat template (tokenizer.chat_template): pass --chat-template NAME|FILE, a Jinja file or one of the built-in templates: {0}")]
    NoChatTemplate(String),

    #[error(transparent)]
    Gguf(#[from] kiln_gguf::GgufError),
}
