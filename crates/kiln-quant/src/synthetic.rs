//! Random-weight models in the shapes of real ones, for benchmarks and tests.
//!
//! The model is what `kiln quantize` makes from an F16 original holding these
//! random values: the same metadata, tensor plan and quantization code.
//! Values are N(0, 1/fan_in) (norm weights about 1), generated per row from a
//! seed, so any row can be recomputed independently and in parallel.

mod archs;

use std::path::Path;

use kiln_gguf::{TensorInfo, Value, ValueType};

use crate::file::{
    output_metadata, plan_tensors, write_planned, FileType, Progress, QuantHparams, QuantizeError, QuantizeOptions, Result, TensorPlan, TensorSource,
    WriteSummary,
};
use crate::GgmlType;

pub use archs::{Gemma4, GptOss, Moe, Qwen35};

/// What a shape has beyond a dense llama/qwen3 stack.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ShapeKind {
    Dense,
    /// Qwen3-MoE: every FFN a mixture of experts.
    Moe(Moe),
    Gemma4(Gemma4),
    Qwen35(Qwen35),
    GptOss(GptOss),
}

/// Tokenizer families of the synthetic vocabularies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerStyle {
    /// gpt2 BPE with the llama-bpe pre-tokenizer and Llama 3 special tokens.
    Llama3,
    /// gpt2 BPE with the qwen2 pre-tokenizer and Qwen special tokens.
    Qwen2,
}

/// The hyper-parameters of a model family member.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelShape {
    pub name: &'static str,
    pub arch: &'static str,
    pub n_embd: u64,
    pub n_layer: u64,
    pub n_head: u64,
    pub n_head_kv: u64,
    pub head_dim: u64,
    pub n_ff: u64,
    pub n_vocab: u64,
    /// Control tokens at the end of the vocabulary.
    pub n_special: u64,
    pub n_ctx: u64,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub tied_embeddings: bool,
    /// Per-head RMSNorm of q and k (qwen3).
    pub qk_norm: bool,
    /// Biases on the q, k and v projections (qwen2).
    pub qkv_bias: bool,
    pub tokenizer: TokenizerStyle,
    pub kind: ShapeKind,
}

impl ModelShape {
    /// The file type its real release is usually run in: MXFP4 experts for gpt-oss.
    pub fn default_file_type(&self) -> FileType {
        match self.kind {
            ShapeKind::GptOss(_) => FileType::MXFP4_MOE,
            _ => FileType::Q4_K_M,
        }
    }
}

const LLAMA3_8B: ModelShape = ModelShape {
    name: "llama3-8b",
    arch: "llama",
    n_embd: 4096,
    n_layer: 32,
    n_head: 32,
    n_head_kv: 8,
    head_dim: 128,
    n_ff: 14336,
    n_vocab: 128256,
    n_special: 256,
    n_ctx: 8192,
    rope_base: 500000.0,
    rms_eps: 1e-5,
    tied_embeddings: false,
    qk_norm: false,
    qkv_bias: false,
    tokenizer: TokenizerStyle::Llama3,
    kind: ShapeKind::Dense,
};

const QWEN3_8B: ModelShape = ModelShape {
    name: "qwen3-8b",
    arch: "qwen3",
    n_embd: 4096,
    n_layer: 36,
    n_head: 32,
    n_head_kv: 8,
    head_dim: 128,
    n_ff: 12288,
    n_vocab: 151936,
    n_special: 293,
    n_ctx: 40960,
    rope_base: 1000000.0,
    rms_eps: 1e-6,
    tied_embeddings: false,
    qk_norm: true,
    qkv_bias: false,
    tokenizer: TokenizerStyle::Qwen2,
    kind: ShapeKind::Dense,
};

/// Qwen2.5-7B: biases on q, k and v, 7 query heads a KV head.
const QWEN25_7B: ModelShape = ModelShape {
    name: "qwen2.5-7b",
    arch: "qwen2",
    n_embd: 3584,
    n_layer: 28,
    n_head: 28,
    n_head_kv: 4,
    n_ff: 18944,
    n_vocab: 152064,
    // The control tokens start at 151643, as in Qwen3's vocabulary.
    n_special: 421,
    n_ctx: 32768,
    qk_norm: false,
    qkv_bias: true,
    ..QWEN3_8B
};

/// `base` scaled down to the sizes of shared/testdata's tiny models.
const fn tiny(name: &'static str, base: ModelShape) -> ModelShape {
    ModelShape { name, n_embd: 256, n_layer: 2, n_head: 4, n_head_kv: 2, head_dim: 64, n_ff: 512, n_vocab: 512, n_special: 8, n_ctx: 2048, ..base }
}

/// Every shape `random-model` knows.
pub const SHAPES: &[ModelShape] = &[
    LLAMA3_8B,
    // Llama-3-70B: the tensor-parallel benchmark shape (about 42.5 GB in Q4_K_M).
    ModelShape { name: "llama3-70b", n_embd: 8192, n_layer: 80, n_head: 64, n_ff: 28672, ..LLAMA3_8B },
    QWEN3_8B,
    QWEN25_7B,
    ModelShape { name: "qwen3-0.6b", n_embd: 1024, n_layer: 28, n_head: 16, n_ff: 3072, tied_embeddings: true, ..QWEN3_8B },
    ModelShape { rope_base: 10000.0, ..tiny("tiny-llama", LLAMA3_8B) },
    ModelShape { tied_embeddings: true, ..tiny("tiny-qwen3", QWEN3_8B) },
    tiny("tiny-qwen2", QWEN25_7B),
    archs::QWEN3_30B_A3B,
    archs::GEMMA4_26B_A4B,
    archs::QWEN35_35B_A3B,
    archs::GPT_OSS_20B,
];

pub fn find_shape(name: &str) -> Option<ModelShape> {
    SHAPES.iter().find(|s| s.name.eq_ignore_ascii_case(name)).copied()
}

/// GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves,
/// the others are moved to U+0100 and up, in byte order.
fn byte_to_unicode(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return b as char;
    }
    let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + shifted).expect("U+0100.. are valid chars")
}

/// A few real-looking merges ("Ġ" is the byte-level space), so encoding
/// exercises the merge loop; every result is a token of the vocabulary.
const MERGES: &[&str] = &[
    "Ġ t", "h e", "i n", "e r", "a n", "Ġ a", "o n", "r e", "Ġ s", "e d", "Ġ w", "o r", "e n", "Ġ o", "i s", "a t", "Ġ c", "e s", "Ġ b", "Ġt he", "in g",
    "Ġ f", "Ġ m", "Ġ d",
];

struct Vocabulary {
    tokens: Vec<String>,
    types: Vec<i32>,
    bos: u64,
    eos: u64,
}

const TOKEN_NORMAL: i32 = 1;
const TOKEN_CONTROL: i32 = 3;

fn vocabulary(shape: &ModelShape) -> Vocabulary {
    let special_base = shape.n_vocab - shape.n_special;
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_to_unicode(b).to_string()).collect();
    tokens.extend(MERGES.iter().map(|m| m.replace(' ', "")));
    let fillers = tokens.len() as u64..special_base;
    tokens.extend(fillers.map(|i| format!("tok{i}")));
    let named: &[&str] = match shape.tokenizer {
        TokenizerStyle::Llama3 => &["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        TokenizerStyle::Qwen2 => &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    };
    for k in 0..shape.n_special {
        tokens.push(match (named.get(k as usize), shape.tokenizer) {
            (Some(name), _) => name.to_string(),
            (None, TokenizerStyle::Llama3) => format!("<|reserved_special_token_{k}|>"),
            (None, TokenizerStyle::Qwen2) => format!("[PAD{}]", special_base + k),
        });
    }
    let types = (0..shape.n_vocab).map(|i| if i < special_base { TOKEN_NORMAL } else { TOKEN_CONTROL }).collect();
    let (bos, eos) = match shape.tokenizer {
        TokenizerStyle::Llama3 => (special_base, special_base + 1),
        TokenizerStyle::Qwen2 => (special_base, special_base + 2),
    };
    Vocabulary { tokens, types, bos, eos }
}

fn string_array(items: Vec<String>) -> Value {
    Value::Array(ValueType::String, items.into_iter().map(Value::String).collect())
}

/// What a tensor holds, which decides its type in the F16 original and its values.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Init {
    /// A weight matrix, stored in F16: N(0, 1/fan_in).
    Matrix,
    /// A matrix the converter keeps in F32 (routers, conv kernels).
    FloatMatrix,
    /// Norm weights and scales: about 1.
    Norm,
    /// Biases: about 0.
    Bias,
    /// Negative values (Gated DeltaNet's `ssm_a` = -exp(A_log)), so the state decays.
    Negative,
    /// Gemma 4's proportional rope: factor 1 on the first pairs, 1e30 (no rotation) after.
    RopeFreqs { rotated_pairs: u64 },
}

/// How the values of one tensor are drawn.
#[derive(Clone, Copy, Debug)]
struct Distribution {
    mean: f32,
    std: f32,
    /// Round to f16, as the F16 original stores them.
    f16: bool,
}

impl Init {
    fn distribution(self, dims: &[u64]) -> Distribution {
        let fan_in = 1.0 / (dims[0] as f32).sqrt();
        match self {
            Init::Matrix => Distribution { mean: 0.0, std: fan_in, f16: true },
            Init::FloatMatrix => Distribution { mean: 0.0, std: fan_in, f16: false },
            Init::Norm | Init::RopeFreqs { .. } => Distribution { mean: 1.0, std: 0.1, f16: false },
            Init::Bias => Distribution { mean: 0.0, std: 0.1, f16: false },
            Init::Negative => Distribution { mean: -2.0, std: 0.5, f16: false },
        }
    }
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a, so a tensor's values depend on its name, not on its position.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// Fills `out` with approximately normal values: each is the sum of four
/// 16-bit uniforms from one xorshift64* step (Irwin-Hall: the requested mean
/// and standard deviation to within 1e-4 relative, tails cut at 3.46 sigma),
/// several times cheaper than Box-Muller and plenty for random weights.
fn fill_normal(seed: u64, dist: Distribution, out: &mut [f32]) {
    let mut state = splitmix64(seed) | 1;
    // Four uniforms on [0, 1) have mean 2 and variance 1/3.
    let scale = dist.std * 3f32.sqrt() / 65536.0;
    let center = 2.0 * 65536.0;
    for v in out.iter_mut() {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let r = state.wrapping_mul(0x2545_F491_4F6C_DD1D);
        let sum = (r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48);
        let x = dist.mean + (sum as f32 - center) * scale;
        *v = if dist.f16 { half::f16::from_f32(x).to_f32() } else { x };
    }
}

/// A random model of one shape: its metadata, tensors and values.
pub struct RandomModel {
    shape: ModelShape,
    seed: u64,
    /// Weight matrices repeat their first this many rows (see [`RandomModel::with_distinct_rows`]).
    distinct_rows: Option<usize>,
    tensors: Vec<TensorInfo>,
    inits: Vec<Init>,
}

impl RandomModel {
    pub fn new(shape: ModelShape, seed: u64) -> RandomModel {
        let s = &shape;
        let (q_width, kv_width) = (s.n_head * s.head_dim, s.n_head_kv * s.head_dim);
        let mut tensors = Vec::new();
        let mut inits = Vec::new();
        let mut add_init = |name: String, dims: Vec<u64>, init: Init| {
            let ty = if init == Init::Matrix { GgmlType::F16 } else { GgmlType::F32 };
            tensors.push(TensorInfo { name, dims, ty, offset: 0, n_bytes: 0 });
            inits.push(init);
        };
        // The order convert_hf_to_gguf.py writes a Hugging Face checkpoint in.
        add_init("token_embd.weight".into(), vec![s.n_embd, s.n_vocab], Init::Matrix);
        archs::global_tensors(s, &mut add_init);
        for l in 0..s.n_layer {
            if archs::layer_tensors(s, l, &mut add_init) {
                continue;
            }
            let mut add = |name: String, dims: Vec<u64>| {
                let init = if dims.len() == 2 { Init::Matrix } else { Init::Norm };
                add_init(name, dims, init)
            };
            let n = |suffix: &str| format!("blk.{l}.{suffix}");
            add(n("attn_norm.weight"), vec![s.n_embd]);
            add(n("ffn_down.weight"), vec![s.n_ff, s.n_embd]);
            add(n("ffn_gate.weight"), vec![s.n_embd, s.n_ff]);
            add(n("ffn_up.weight"), vec![s.n_embd, s.n_ff]);
            add(n("ffn_norm.weight"), vec![s.n_embd]);
            if s.qk_norm {
                add(n("attn_k_norm.weight"), vec![s.head_dim]);
            }
            add(n("attn_k.weight"), vec![s.n_embd, kv_width]);
            add(n("attn_output.weight"), vec![q_width, s.n_embd]);
            if s.qk_norm {
                add(n("attn_q_norm.weight"), vec![s.head_dim]);
            }
            add(n("attn_q.weight"), vec![s.n_embd, q_width]);
            add(n("attn_v.weight"), vec![s.n_embd, kv_width]);
            if s.qkv_bias {
                for (name, len) in [("attn_q.bias", q_width), ("attn_k.bias", kv_width), ("attn_v.bias", kv_width)] {
                    add_init(n(name), vec![len], Init::Bias);
                }
            }
        }
        add_init("output_norm.weight".into(), vec![s.n_embd], Init::Norm);
        if !s.tied_embeddings {
            add_init("output.weight".into(), vec![s.n_embd, s.n_vocab], Init::Matrix);
        }
        RandomModel { shape, seed, distinct_rows: None, tensors, inits }
    }

    /// Every weight matrix repeats its first `rows` rows (routers and other F32 matrices keep
    /// all theirs, so routing is unchanged): a file for speed measurements, written in a small
    /// fraction of the time, with the same bytes per token to read.
    pub fn with_distinct_rows(mut self, rows: usize) -> RandomModel {
        self.distinct_rows = Some(rows.max(1));
        self
    }

    fn period(&self, index: usize) -> Option<usize> {
        self.distinct_rows.filter(|_| self.inits[index] == Init::Matrix)
    }

    pub fn shape(&self) -> &ModelShape {
        &self.shape
    }

    /// The tensors of the F16 original (2-D weights F16, norms F32).
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Metadata of the F16 original, tokenizer included.
    pub fn metadata(&self) -> Vec<(String, Value)> {
        let s = &self.shape;
        let a = s.arch;
        let u32v = |v: u64| Value::U32(v as u32);
        let vocab = vocabulary(s);
        let mut m: Vec<(String, Value)> = vec![
            ("general.architecture".into(), Value::String(a.into())),
            ("general.type".into(), Value::String("model".into())),
            ("general.name".into(), Value::String(format!("kiln random {} (seed {})", s.name, self.seed))),
            (format!("{a}.block_count"), u32v(s.n_layer)),
            (format!("{a}.context_length"), u32v(s.n_ctx)),
            (format!("{a}.embedding_length"), u32v(s.n_embd)),
            (format!("{a}.feed_forward_length"), u32v(s.n_ff)),
            (format!("{a}.attention.head_count"), u32v(s.n_head)),
            (format!("{a}.attention.head_count_kv"), u32v(s.n_head_kv)),
            (format!("{a}.rope.freq_base"), Value::F32(s.rope_base)),
            (format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(s.rms_eps)),
            (format!("{a}.attention.key_length"), u32v(s.head_dim)),
            (format!("{a}.attention.value_length"), u32v(s.head_dim)),
        ];
        archs::metadata(s, &mut m);
        if a == "llama" {
            m.push((format!("{a}.rope.dimension_count"), u32v(s.head_dim)));
            m.push((format!("{a}.vocab_size"), u32v(s.n_vocab)));
        }
        m.push(("general.file_type".into(), Value::U32(FileType::F16.id())));
        let (pre, add_bos) = match s.tokenizer {
            TokenizerStyle::Llama3 => ("llama-bpe", true),
            TokenizerStyle::Qwen2 => ("qwen2", false),
        };
        m.extend([
            ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
            ("tokenizer.ggml.pre".into(), Value::String(pre.into())),
            ("tokenizer.ggml.tokens".into(), string_array(vocab.tokens)),
            ("tokenizer.ggml.token_type".into(), Value::Array(ValueType::I32, vocab.types.into_iter().map(Value::I32).collect())),
            ("tokenizer.ggml.merges".into(), string_array(MERGES.iter().map(|m| m.to_string()).collect())),
            ("tokenizer.ggml.bos_token_id".into(), u32v(vocab.bos)),
            ("tokenizer.ggml.eos_token_id".into(), u32v(vocab.eos)),
            ("tokenizer.ggml.add_bos_token".into(), Value::Bool(add_bos)),
        ]);
        m
    }

    /// Row `row` of tensor `index` as the F16 original holds it.
    pub fn original_row(&self, index: usize, row: usize, out: &mut [f32]) {
        let t = &self.tensors[index];
        if let Init::RopeFreqs { rotated_pairs } = self.inits[index] {
            for (i, v) in out.iter_mut().enumerate() {
                *v = if (i as u64) < rotated_pairs { 1.0 } else { 1e30 };
            }
            return;
        }
        let row = self.period(index).map_or(row, |p| row % p);
        let seed = self.seed ^ splitmix64(name_hash(&t.name) ^ splitmix64(row as u64));
        fill_normal(seed, self.inits[index].distribution(&t.dims), out);
    }

    /// Each tensor's name, shape and the type `write` would give it.
    pub fn plan(&self, options: &QuantizeOptions) -> Result<Vec<TensorPlan>> {
        let hparams = QuantHparams::from_metadata(&self.metadata())?;
        plan_tensors(&hparams, &self.tensors, options)
    }

    /// Bytes of tensor data `write` would produce (the file adds metadata and alignment).
    pub fn tensor_bytes(&self, options: &QuantizeOptions) -> Result<u64> {
        let mut total = 0;
        for p in self.plan(options)? {
            total += crate::quantized_size(p.dst_type, p.n_elements() as usize).map_err(|e| QuantizeError::Quant { tensor: p.name.clone(), source: e })? as u64;
        }
        Ok(total)
    }

    /// Writes the model quantized as `options` asks, exactly as `kiln
    /// quantize` would convert the F16 original.
    pub fn write(&self, path: &Path, options: &QuantizeOptions, progress: &dyn Progress) -> Result<WriteSummary> {
        let original = self.metadata();
        let hparams = QuantHparams::from_metadata(&original)?;
        let plans = plan_tensors(&hparams, &self.tensors, options)?;
        write_planned(path, output_metadata(&original, options.ftype), &plans, self, progress)
    }
}

impl TensorSource for RandomModel {
    fn stored_bytes(&self, _index: usize) -> Option<&[u8]> {
        None
    }

    fn row_f32(&self, index: usize, row: usize, out: &mut [f32]) -> Result<()> {
        self.original_row(index, row, out);
        Ok(())
    }

    fn row_period(&self, index: usize) -> Option<usize> {
        self.period(index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_is_a_bijection_onto_256_chars() {
        let chars: std::collections::HashSet<char> = (0..=255u8).map(byte_to_unicode).collect();
        assert_eq!(chars.len(), 256);
        assert_eq!(byte_to_unicode(b' '), 'Ġ');
        assert_eq!(byte_to_unicode(b'\n'), 'Ċ');
        assert_eq!(byte_to_unicode(b'a'), 'a');
    }

    #[test]
    fn vocabulary_is_unique_and_sized() {
        for shape in SHAPES {
            let v = vocabulary(shape);
            assert_eq!(v.tokens.len() as u64, shape.n_vocab, "{}", shape.name);
            assert_eq!(v.types.len() as u64, shape.n_vocab);
            let unique: std::collections::HashSet<&String> = v.tokens.iter().collect();
            assert_eq!(unique.len(), v.tokens.len(), "{}: duplicate tokens", shape.name);
            assert_eq!(v.types[v.bos as usize], TOKEN_CONTROL);
            for m in MERGES {
                let (l, r) = m.split_once(' ').unwrap();
                for part in [l.to_string(), r.to_string(), format!("{l}{r}")] {
                    assert!(v.tokens.contains(&part), "merge {m}: {part} is not a token");
                }
            }
        }
        assert_eq!(vocabulary(&LLAMA3_8B).tokens[128000], "<|begin_of_text|>");
        assert_eq!(vocabulary(&QWEN3_8B).tokens[151645], "<|im_end|>");
    }

    #[test]
    fn random_values_have_the_requested_moments() {
        let mut row = vec![0f32; 1 << 16];
        let dist = Distribution { mean: 0.5, std: 0.25, f16: false };
        fill_normal(7, dist, &mut row);
        let n = row.len() as f64;
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        // Standard errors at n = 65536: mean 0.001, std about 0.0007.
        assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
        assert!((var.sqrt() - 0.25).abs() < 0.005, "std {}", var.sqrt());
        let mut other = vec![0f32; 1 << 16];
        fill_normal(8, dist, &mut other);
        assert_ne!(row, other);
    }
}
