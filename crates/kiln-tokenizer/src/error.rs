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

    #[error("chat template: {0}")]
    Template(String),

    #[error(transparent)]
    Gguf(#[from] kiln_gguf::GgufError),
}
