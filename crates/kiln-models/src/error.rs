use kiln_core::BackendError;
use kiln_gguf::GgufError;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Tokenizer(#[from] kiln_tokenizer::TokenizerError),
    #[error("unsupported architecture '{0}' (kiln supports llama (also with experts, as Mixtral), qwen2, qwen3, qwen3moe, qwen35, qwen35moe, gemma3, gemma4, gpt-oss)")]
    UnsupportedArch(String),
    #[error("model has no tensor '{0}'")]
    MissingTensor(String),
    #[error("tensor '{name}' has shape {found:?}, expected {expected:?}")]
    WrongShape { name: String, expected: Vec<u64>, found: Vec<u64> },
    #[error("tensor '{name}' has type {ty}, which cannot be used as {role}")]
    WrongType { name: String, ty: kiln_quant::GgmlType, role: &'static str },
    #[error("hyper-parameter {key}: {reason}")]
    BadHparam { key: String, reason: String },
    #[error("context overflow: {needed} positions needed, the context holds {n_ctx} (raise -c)")]
    ContextOverflow { needed: usize, n_ctx: usize },
    #[error("out of KV cache blocks: {needed} needed, {available} of {capacity} available (raise --kv-mem or lower -np)")]
    OutOfKvBlocks { needed: usize, available: usize, capacity: usize },
    #[error("KV block bookkeeping: {0}")]
    BadKvBlock(String),
    #[error("cannot split the model over {ranks} ranks (tensor parallelism): {reason}")]
    Unshardable { ranks: usize, reason: String },
    #[error("token id {id} is outside the vocabulary of {n_vocab}")]
    BadToken { id: u32, n_vocab: usize },
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
