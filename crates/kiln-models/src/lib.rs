//! Transformer architectures written once over `kiln_core::Backend`, the KV
//! cache, and the generation loop.

pub mod config;
pub mod error;
pub mod generate;
pub mod model;
pub mod quantize;
pub mod synthetic;

pub use config::{Arch, ModelConfig};
pub use error::ModelError;
pub use generate::{generate, GenerateParams, GenerationStats, StopReason};
pub use model::{Logits, Model, ModelOptions};
