//! Reading a GGUF file's tensors into the backend: shapes checked, 3-D expert tensors as
//! per-expert matrices, each layer's weights as its settings ask.

use std::ops::Range;
use std::sync::Arc;

use kiln_core::{Backend, WeightSource};
use kiln_gguf::GgufFile;

use crate::config::{Arch, AttentionConfig, BlockStyle, DeltaNetConfig, FfnConfig, KvSource, LayerConfig, Mixer, ModelConfig, MoeConfig};
use crate::error::{ModelError, Result};
use crate::tensor_parallel::{kv_rows, q_rows, Shard};
use crate::weights::{
    AttentionWeights, DeltaNetWeights, DenseBeside, DenseFfn, FfnWeights, LayerWeights, MixerWeights, MoeWeights, PerLayerWeights, SharedExpert,
};

/// Bytes of one tensor of a shared GGUF file.
struct TensorBytes {
    file: Arc<GgufFile>,
    index: usize,
}

impl AsRef<[u8]> for TensorBytes {
    fn as_ref(&self) -> &[u8] {
        self.file.tensor_data(&self.file.tensors()[self.index])
    }
}

pub(crate) struct Loader<'a, B: Backend> {
    pub file: &'a Arc<GgufFile>,
    pub backend: &'a B,
    /// The slice of each layer this loader reads (tensor parallelism; whole by default).
    pub shard: Shard,
}

impl<B: Backend> Loader<'_, B> {
    fn find(&self, name: &str) -> Result<usize> {
        self.file.tensors().iter().position(|t| t.name == name).ok_or_else(|| ModelError::MissingTensor(name.into()))
    }

    /// A one-row matrix from a tensor stored as `[cols, 1]` or as the vector `[cols]`.
    fn row(&self, name: &str, cols: usize) -> Result<B::Weight> {
        let t = &self.file.tensors()[self.find(name)?];
        if t.dims == [cols as u64] {
            let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(TensorBytes { file: self.file.clone(), index: self.find(name)? });
            let src = WeightSource { name: name.into(), ty: t.ty, rows: 1, cols, owner, range: 0..t.n_bytes as usize };
            return Ok(self.backend.upload_weight(src)?);
        }
        self.matrix(name, cols, 1)
    }

    pub(crate) fn matrix(&self, name: &str, cols: usize, rows: usize) -> Result<B::Weight> {
        Ok(self.matrices(name, cols, rows, None)?.pop().expect("one matrix"))
    }

    /// A 3-D tensor `[cols, rows, n]` (ne order) as its `n` matrices.
    fn experts(&self, name: &str, cols: usize, rows: usize, n: usize) -> Result<Vec<B::Weight>> {
        self.matrices(name, cols, rows, Some(n))
    }

    /// Rows `part` of each of the `n` matrices of a 3-D tensor `[cols, rows, n]`.
    fn expert_rows(&self, name: &str, cols: usize, rows: usize, n: usize, part: Range<usize>) -> Result<Vec<B::Weight>> {
        self.slices(name, cols, rows, Some(n), part)
    }

    /// Rows `part` of a matrix (a column-parallel slice: whole rows, one byte range).
    fn rows_part(&self, name: &str, cols: usize, rows: usize, part: Range<usize>) -> Result<B::Weight> {
        Ok(self.slices(name, cols, rows, None, part)?.pop().expect("one matrix"))
    }

    /// Every other run of `run` rows of a matrix, the first at run `first` (0 or 1), copied out
    /// of the file: of a gated query projection (each head's query rows, then its gate's), the
    /// queries or the gates.
    fn alternate_rows(&self, name: &str, cols: usize, rows: usize, run: usize, first: usize) -> Result<B::Weight> {
        let t = &self.file.tensors()[self.find(name)?];
        if t.dims != [cols as u64, rows as u64] {
            return Err(ModelError::WrongShape { name: name.into(), expected: vec![cols as u64, rows as u64], found: t.dims.clone() });
        }
        if run == 0 || !rows.is_multiple_of(2 * run) {
            return Err(ModelError::BadHparam {
                key: "head_dim".into(),
                reason: format!("{name}'s {rows} rows are not pairs of runs of {run} (a head's queries, then its gates)"),
            });
        }
        let run_bytes = t.n_bytes as usize / rows * run;
        let data = self.file.tensor_data(t);
        let mut bytes = Vec::with_capacity(data.len() / 2);
        for chunk in data.chunks(run_bytes).skip(first).step_by(2) {
            bytes.extend_from_slice(chunk);
        }
        let range = 0..bytes.len();
        let src = WeightSource {
            name: format!("{name}[runs of {run} rows from {first}, every other]"),
            ty: t.ty,
            rows: rows / 2,
            cols,
            owner: Arc::new(bytes),
            range,
        };
        Ok(self.backend.upload_weight(src)?)
    }

    /// Columns `part` of every row of a matrix (a row-parallel slice), copied out of the file;
    /// `part` must start and end on block boundaries of the tensor's format.
    fn cols_part(&self, name: &str, cols: usize, rows: usize, part: Range<usize>) -> Result<B::Weight> {
        if part == (0..cols) {
            return self.matrix(name, cols, rows);
        }
        let t = &self.file.tensors()[self.find(name)?];
        if t.dims != [cols as u64, rows as u64] {
            return Err(ModelError::WrongShape { name: name.into(), expected: vec![cols as u64, rows as u64], found: t.dims.clone() });
        }
        let (block, block_bytes) = (t.ty.block_size(), t.ty.type_size());
        if !part.start.is_multiple_of(block) || !part.end.is_multiple_of(block) || part.end > cols {
            return Err(ModelError::Unshardable {
                ranks: self.shard.ranks,
                reason: format!("columns {part:?} of {name} are not whole {block}-value blocks of its {} rows", t.ty),
            });
        }
        let row_bytes = cols / block * block_bytes;
        let (from, to) = (part.start / block * block_bytes, part.end / block * block_bytes);
        let data = self.file.tensor_data(t);
        let mut bytes = Vec::with_capacity(rows * (to - from));
        for r in 0..rows {
            bytes.extend_from_slice(&data[r * row_bytes + from..r * row_bytes + to]);
        }
        let range = 0..bytes.len();
        let src = WeightSource { name: format!("{name}[:, {part:?}]"), ty: t.ty, rows, cols: part.len(), owner: Arc::new(bytes), range };
        Ok(self.backend.upload_weight(src)?)
    }

    fn matrices(&self, name: &str, cols: usize, rows: usize, n: Option<usize>) -> Result<Vec<B::Weight>> {
        self.slices(name, cols, rows, n, 0..rows)
    }

    fn slices(&self, name: &str, cols: usize, rows: usize, n: Option<usize>, part: Range<usize>) -> Result<Vec<B::Weight>> {
        let index = self.find(name)?;
        let t = &self.file.tensors()[index];
        let mut want = vec![cols as u64, rows as u64];
        want.extend(n.map(|n| n as u64));
        if t.dims != want {
            return Err(ModelError::WrongShape { name: name.into(), expected: want, found: t.dims.clone() });
        }
        let count = n.unwrap_or(1);
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(TensorBytes { file: self.file.clone(), index });
        // Rows are whole blocks, so each matrix and row is an equal byte slice (checked by the upload).
        let per = t.n_bytes as usize / count;
        let row_bytes = per / rows.max(1);
        (0..count)
            .map(|e| {
                let name = if n.is_some() { format!("{name}[{e}]") } else { name.to_string() };
                let range = e * per + part.start * row_bytes..e * per + part.end * row_bytes;
                let src = WeightSource { name, ty: t.ty, rows: part.len(), cols, owner: owner.clone(), range };
                Ok(self.backend.upload_weight(src)?)
            })
            .collect()
    }

    pub(crate) fn vector(&self, name: &str, len: usize) -> Result<B::Buffer> {
        self.vector_scaled(name, len, 1.0)
    }

    /// Values `part` of a vector.
    fn vector_part(&self, name: &str, len: usize, part: Range<usize>) -> Result<B::Buffer> {
        let host = self.host_values(name, &[len], "a norm or bias vector")?;
        self.upload(name, &host[part])
    }

    /// A vector times `scale`.
    fn vector_scaled(&self, name: &str, len: usize, scale: f32) -> Result<B::Buffer> {
        self.values(name, &[len], scale)
    }

    /// A 2-D tensor of `rows` rows of `cols` as one buffer (gpt-oss's per-expert biases).
    fn table(&self, name: &str, cols: usize, rows: usize) -> Result<B::Buffer> {
        self.values(name, &[cols, rows], 1.0)
    }

    fn values(&self, name: &str, dims: &[usize], scale: f32) -> Result<B::Buffer> {
        let mut host = self.host_values(name, dims, "a norm or bias vector")?;
        host.iter_mut().for_each(|v| *v *= scale);
        self.upload(name, &host)
    }

    /// A tensor of exactly `dims` dequantized on the host.
    fn host_values(&self, name: &str, dims: &[usize], role: &'static str) -> Result<Vec<f32>> {
        let t = &self.file.tensors()[self.find(name)?];
        let want: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        if t.dims != want {
            return Err(ModelError::WrongShape { name: name.into(), expected: want, found: t.dims.clone() });
        }
        let mut host = vec![0f32; dims.iter().product()];
        kiln_quant::dequantize(t.ty, self.file.tensor_data(t), &mut host).map_err(|_| ModelError::WrongType { name: name.into(), ty: t.ty, role })?;
        Ok(host)
    }

    fn upload(&self, name: &str, values: &[f32]) -> Result<B::Buffer> {
        let mut buf = self.backend.alloc(values.len(), name)?;
        self.backend.write(&mut buf, values)?;
        Ok(buf)
    }

    /// A one-element tensor, read on the host.
    fn scalar(&self, name: &str) -> Result<f32> {
        let t = &self.file.tensors()[self.find(name)?];
        let mut v = [0f32];
        if t.n_elements() != 1 || kiln_quant::dequantize(t.ty, self.file.tensor_data(t), &mut v).is_err() {
            return Err(ModelError::WrongShape { name: name.into(), expected: vec![1], found: t.dims.clone() });
        }
        Ok(v[0])
    }

    fn ones(&self, len: usize) -> Result<B::Buffer> {
        self.upload("unit norm weights", &vec![1.0; len])
    }

    fn has(&self, name: &str) -> bool {
        self.file.tensor(name).is_some()
    }

    pub(crate) fn layer(&self, c: &ModelConfig, l: usize, lc: &LayerConfig) -> Result<LayerWeights<B>> {
        let n = |s: &str| format!("blk.{l}.{s}");
        let mixer = match &lc.mixer {
            Mixer::Attention(a) => MixerWeights::Attention(self.attention(c, l, a)?),
            Mixer::DeltaNet(d) => MixerWeights::DeltaNet(self.delta_net(c, l, d)?),
        };
        let per_layer = match c.per_layer_embd {
            Some(d) => Some(PerLayerWeights {
                gate: self.matrix(&n("inp_gate.weight"), c.n_embd, d)?,
                proj: self.matrix(&n("proj.weight"), d, c.n_embd)?,
                norm: self.vector(&n("post_norm.weight"), c.n_embd)?,
            }),
            None => None,
        };
        let output_scale = if self.has(&n("layer_output_scale.weight")) { Some(self.scalar(&n("layer_output_scale.weight"))?) } else { None };
        let gemma = c.arch.block_style() == BlockStyle::Gemma;
        let post_norm = |name: &str| if gemma { self.vector(&n(name), c.n_embd).map(Some) } else { Ok(None) };
        // gpt-oss and Qwen3.5 name their FFN input norm after the attention.
        let ffn_norm = if matches!(c.arch, Arch::GptOss | Arch::Qwen35 | Arch::Qwen35Moe) { "post_attention_norm.weight" } else { "ffn_norm.weight" };
        Ok(LayerWeights {
            attn_norm: self.vector(&n("attn_norm.weight"), c.n_embd)?,
            mixer,
            post_attn_norm: post_norm("post_attention_norm.weight")?,
            ffn_norm: self.vector(&n(ffn_norm), c.n_embd)?,
            ffn: self.ffn(c, l, &lc.ffn)?,
            post_ffn_norm: post_norm("post_ffw_norm.weight")?,
            per_layer,
            output_scale,
        })
    }

    fn attention(&self, c: &ModelConfig, l: usize, a: &AttentionConfig) -> Result<AttentionWeights<B>> {
        let n = |s: &str| format!("blk.{l}.{s}");
        let (q_width, kv_width) = (a.n_head * a.head_dim, a.kv_width());
        // This rank's heads (all of them unless sharded).
        let (q_part, kv_part) = (q_rows(self.shard, a.n_head, a.head_dim), kv_rows(self.shard, a.n_head_kv, a.head_dim));
        let bias = if self.has(&n("attn_q.bias")) || c.arch == Arch::Qwen2 {
            Some([
                self.vector_part(&n("attn_q.bias"), q_width, q_part.clone())?,
                self.vector_part(&n("attn_k.bias"), kv_width, kv_part.clone())?,
                self.vector_part(&n("attn_v.bias"), kv_width, kv_part.clone())?,
            ])
        } else {
            None
        };
        let own_kv = matches!(a.kv, KvSource::Own { .. });
        let norm = |name: &str, len| if c.arch.has_qk_norm() { self.vector(&n(name), len).map(Some) } else { Ok(None) };
        let wv = match a.kv {
            KvSource::Own { v_from_k: false } => Some(self.rows_part(&n("attn_v.weight"), c.n_embd, kv_width, kv_part.clone())?),
            _ => None,
        };
        // A gated query projection (never sharded) also holds the gates: each head's query rows,
        // then its gate's.
        let (wq, q_gate) = if a.gated {
            let split = |first| self.alternate_rows(&n("attn_q.weight"), c.n_embd, 2 * q_width, a.head_dim, first);
            (split(0)?, Some(split(1)?))
        } else {
            (self.rows_part(&n("attn_q.weight"), c.n_embd, q_width, q_part.clone())?, None)
        };
        Ok(AttentionWeights {
            wq,
            q_gate,
            wk: if own_kv { Some(self.rows_part(&n("attn_k.weight"), c.n_embd, kv_width, kv_part)?) } else { None },
            wv,
            wo: self.cols_part(&n("attn_output.weight"), q_width, c.n_embd, q_part)?,
            bias,
            wo_bias: if self.has(&n("attn_output.bias")) { Some(self.vector(&n("attn_output.bias"), c.n_embd)?) } else { None },
            sinks: if self.has(&n("attn_sinks.weight")) { Some(self.vector(&n("attn_sinks.weight"), a.n_head)?) } else { None },
            q_norm: norm("attn_q_norm.weight", a.head_dim)?,
            k_norm: if own_kv { norm("attn_k_norm.weight", a.head_dim)? } else { None },
            v_norm: if c.arch == Arch::Gemma4 && own_kv { Some(self.ones(a.head_dim)?) } else { None },
        })
    }

    fn delta_net(&self, c: &ModelConfig, l: usize, d: &DeltaNetConfig) -> Result<DeltaNetWeights<B>> {
        let n = |s: &str| format!("blk.{l}.{s}");
        Ok(DeltaNetWeights {
            qkv: self.matrix(&n("attn_qkv.weight"), c.n_embd, d.conv_dim())?,
            conv: self.table(&n("ssm_conv1d.weight"), d.conv_kernel, d.conv_dim())?,
            z: self.matrix(&n("attn_gate.weight"), c.n_embd, d.v_width())?,
            alpha: self.matrix(&n("ssm_alpha.weight"), c.n_embd, d.n_v_heads)?,
            beta: self.matrix(&n("ssm_beta.weight"), c.n_embd, d.n_v_heads)?,
            a: self.vector(&n("ssm_a"), d.n_v_heads)?,
            dt_bias: self.vector(&n("ssm_dt.bias"), d.n_v_heads)?,
            norm: self.vector(&n("ssm_norm.weight"), d.head_dim)?,
            out: self.matrix(&n("ssm_out.weight"), d.v_width(), c.n_embd)?,
        })
    }

    /// Whether layer `l`'s shared expert loads as one more routed expert
    /// ([`SharedExpert::Routed`]): unsharded, as wide as the routed ones, each matrix in its
    /// routed counterpart's format (Q4_K_M files: down is Q6_K or Q4_K in both alike), its gate
    /// row in the router's, and no per-expert biases (which would need its row too).
    fn shared_expert_routes(&self, l: usize, m: &MoeConfig) -> bool {
        let ty = |s: &str| self.file.tensor(&format!("blk.{l}.{s}.weight")).map(|t| t.ty);
        let alike = |shared: &str, routed: &str| ty(shared).is_some() && ty(shared) == ty(routed);
        let biased = ["ffn_gate_inp.bias", "ffn_gate_exps.bias"].iter().any(|b| self.has(&format!("blk.{l}.{b}")));
        self.shard.is_whole()
            && !biased
            && m.shared_ff == Some(m.n_ff)
            && alike("ffn_gate_shexp", "ffn_gate_exps")
            && alike("ffn_up_shexp", "ffn_up_exps")
            && alike("ffn_down_shexp", "ffn_down_exps")
            && alike("ffn_gate_inp_shexp", "ffn_gate_inp")
    }

    /// The `rows` rows of `cols` of matrix `name` followed by the row `extra` (`[cols]` or
    /// `[cols, 1]`, of the same format) as one weight: a router with the shared expert's gate row last.
    fn rows_joined(&self, name: &str, extra: &str, cols: usize, rows: usize) -> Result<B::Weight> {
        let (t, e) = (&self.file.tensors()[self.find(name)?], &self.file.tensors()[self.find(extra)?]);
        if t.dims != [cols as u64, rows as u64] {
            return Err(ModelError::WrongShape { name: name.into(), expected: vec![cols as u64, rows as u64], found: t.dims.clone() });
        }
        // A vector, or a matrix of one row (as `row` takes it).
        if e.dims != [cols as u64] && e.dims != [cols as u64, 1] {
            return Err(ModelError::WrongShape { name: extra.into(), expected: vec![cols as u64], found: e.dims.clone() });
        }
        let bytes = [self.file.tensor_data(t), self.file.tensor_data(e)].concat();
        let range = 0..bytes.len();
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(bytes);
        let src = WeightSource { name: format!("{name} + {extra}"), ty: t.ty, rows: rows + 1, cols, owner, range };
        Ok(self.backend.upload_weight(src)?)
    }

    fn dense(&self, c: &ModelConfig, l: usize, suffix: &str, n_ff: usize) -> Result<DenseFfn<B>> {
        let n = |s: &str| format!("blk.{l}.{s}{suffix}.weight");
        let part = self.shard.part(n_ff);
        Ok(DenseFfn {
            gate: self.rows_part(&n("ffn_gate"), c.n_embd, n_ff, part.clone())?,
            up: self.rows_part(&n("ffn_up"), c.n_embd, n_ff, part.clone())?,
            down: self.cols_part(&n("ffn_down"), n_ff, c.n_embd, part)?,
        })
    }

    fn ffn(&self, c: &ModelConfig, l: usize, ffn: &FfnConfig) -> Result<FfnWeights<B>> {
        let n = |s: &str| format!("blk.{l}.{s}");
        let m = match ffn {
            FfnConfig::Dense { n_ff } => return Ok(FfnWeights::Dense(self.dense(c, l, "", *n_ff)?)),
            FfnConfig::Moe(m) => m,
        };
        // Gate and up stacked in one tensor (Gemma 4) are its first and second halves.
        let (mut gate, mut up) = if self.has(&n("ffn_gate_up_exps.weight")) {
            let name = n("ffn_gate_up_exps.weight");
            (
                self.expert_rows(&name, c.n_embd, 2 * m.n_ff, m.n_expert, 0..m.n_ff)?,
                self.expert_rows(&name, c.n_embd, 2 * m.n_ff, m.n_expert, m.n_ff..2 * m.n_ff)?,
            )
        } else {
            (self.experts(&n("ffn_gate_exps.weight"), c.n_embd, m.n_ff, m.n_expert)?, self.experts(&n("ffn_up_exps.weight"), c.n_embd, m.n_ff, m.n_expert)?)
        };
        let optional = |name: &str, len, scale| if self.has(&n(name)) { self.vector_scaled(&n(name), len, scale).map(Some) } else { Ok(None) };
        let beside = match m.dense_ff {
            Some(n_ff) => Some(DenseBeside {
                ffn: self.dense(c, l, "", n_ff)?,
                post_norm: self.vector(&n("post_ffw_norm_1.weight"), c.n_embd)?,
                moe_norm: self.vector(&n("pre_ffw_norm_2.weight"), c.n_embd)?,
                moe_post_norm: self.vector(&n("post_ffw_norm_2.weight"), c.n_embd)?,
            }),
            None => None,
        };
        let mut down = self.experts(&n("ffn_down_exps.weight"), m.n_ff, c.n_embd, m.n_expert)?;
        let routes_shared = self.shared_expert_routes(l, m);
        let router = match routes_shared {
            true => self.rows_joined(&n("ffn_gate_inp.weight"), &n("ffn_gate_inp_shexp.weight"), c.n_embd, m.n_expert)?,
            false => self.matrix(&n("ffn_gate_inp.weight"), c.n_embd, m.n_expert)?,
        };
        let shared = match m.shared_ff {
            Some(n_ff) if routes_shared => {
                gate.push(self.matrix(&n("ffn_gate_shexp.weight"), c.n_embd, n_ff)?);
                up.push(self.matrix(&n("ffn_up_shexp.weight"), c.n_embd, n_ff)?);
                down.push(self.matrix(&n("ffn_down_shexp.weight"), n_ff, c.n_embd)?);
                Some(SharedExpert::Routed)
            }
            Some(n_ff) => Some(SharedExpert::Apart { ffn: self.dense(c, l, "_shexp", n_ff)?, gate: self.row(&n("ffn_gate_inp_shexp.weight"), c.n_embd)? }),
            None => None,
        };
        let expert_bias = if self.has(&n("ffn_gate_exps.bias")) {
            Some([
                self.table(&n("ffn_gate_exps.bias"), m.n_ff, m.n_expert)?,
                self.table(&n("ffn_up_exps.bias"), m.n_ff, m.n_expert)?,
                self.table(&n("ffn_down_exps.bias"), c.n_embd, m.n_expert)?,
            ])
        } else {
            None
        };
        Ok(FfnWeights::Moe(MoeWeights {
            router,
            router_norm: optional("ffn_gate_inp.scale", c.n_embd, 1.0 / (c.n_embd as f32).sqrt())?,
            gate,
            up,
            down,
            expert_scale: optional("ffn_down_exps.scale", m.n_expert, 1.0)?,
            router_bias: optional("ffn_gate_inp.bias", m.n_expert, 1.0)?,
            expert_bias,
            beside,
            shared,
        }))
    }
}
