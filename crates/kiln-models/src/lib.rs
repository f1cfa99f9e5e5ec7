//! Transformer architectures written once over `kiln_core::Backend`, the KV
//! cache, and the generation loop.

pub mod checks;
pub mod config;
pub mod engine;
pub mod error;
mod forward;
pub mod generate;
pub mod kv_pool;
mod layout;
mod loader;
pub mod model;
mod recurrent;
pub mod tensor_parallel;
pub mod weights;
pub mod window_kv;

pub use config::{
    Activation, Arch, AttentionConfig, BlockStyle, DeltaNetConfig, FfnConfig, KvCacheLayout, KvSource, LayerConfig, Mixer, ModelConfig, MoeConfig, RopeConfig,
};
pub use engine::{Engine, EngineOptions, SeqWork, Sequence};
pub use error::ModelError;
pub use generate::{generate, GenerateParams, GenerationStats, StopReason};
pub use kv_pool::{BlockAllocator, KvBudget, KvPool};
pub use model::{Logits, Model, ModelOptions};
pub use tensor_parallel::Shard;
pub use weights::{
    AttentionWeights, DeltaNetWeights, DenseBeside, DenseFfn, FfnWeights, LayerWeights, MixerWeights, MoeWeights, PerLayerInputs, PerLayerWeights,
    SharedExpert, Weights,
};
