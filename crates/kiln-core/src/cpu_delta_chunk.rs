//! The gated delta rule over a prompt's span in chunks of tokens (the WY / UT-transform form of
//! Yang, Kautz & Hatamizadeh's "Gated Delta Networks"): what the token-by-token recurrence
//! computes, with the state read and written once per chunk instead of every token.
//!
//! Within a chunk of tokens 0..c starting from state S₀ (`[k index][v index]`), with
//! `b_t = g_0 + ... + g_t` and `Γ_t = exp(b_t)`, the recurrence's state after token t is
//! `S_t = Γ_t S₀ + Σ_{s≤t} exp(b_t - b_s) k_s u_sᵀ`, where
//! `u_t = β_t (v_t - (exp(g_t) S_{t-1})ᵀ k_t)` is the value token t writes. Expanding `S_{t-1}`
//! in `u_t`:
//!
//! ```text
//! u_t + β_t Σ_{s<t} exp(b_t - b_s) (k_t·k_s) u_s = β_t (v_t - Γ_t S₀ᵀ k_t)
//! ```
//!
//! a unit lower-triangular system `(I + A) U = R`, solved by forward substitution. Then
//! `out_t = S_tᵀ q_t = Γ_t S₀ᵀ q_t + Σ_{s≤t} exp(b_t - b_s) (q_t·k_s) u_s` and the state leaves
//! the chunk as `Γ_{c-1} S₀ + Σ_s exp(b_{c-1} - b_s) k_s u_sᵀ`.
//!
//! Every decay factor is the exp of a difference `b_t - b_s` with `s ≤ t`, which is never
//! positive (g ≤ 0), so nothing overflows and nothing is divided by a decay that may have
//! underflowed.
//! The sums `b` are kept in f64: their differences are then exact to f32 precision even when a
//! fast-decaying head has run `b` up to hundreds.

use crate::cpu::with_scratch;
use crate::cpu_recurrent::HeadSpan;
use crate::cpu_simd::Simd;

/// Tokens per chunk. A chunk costs 3 d² multiply-adds per token in its products with the state
/// whatever its length c, plus about 2.5 c d in its triangular parts (Gram matrices,
/// substitution, intra-chunk outputs), so short chunks do less work, down to where the products
/// have too few rows to fill the 4-row tiles well. Measured at head_dim 128 (one thread,
/// AVX-512): 8 to 24 tokens within 5% of each other, 32 10% slower, 64 40%; at head_dim 64, 8
/// best and 16 15% slower. 16 is at the flat bottom for Qwen3.5's head_dim 128.
pub(crate) const CHUNK: usize = 16;

/// Decay factors below `exp(-DECAY_CUTOFF)` (1e-26) count as 0. A fast-decaying head's factors
/// across a chunk reach far below f32's normal range, and products with them go subnormal, which
/// the CPU computes a hundred times slower (measured: the whole chunk 4x slower at c = 32). A
/// term this much smaller than its undecayed self is below f32 resolution next to any
/// other term of the sum but the tiniest.
const DECAY_CUTOFF: f64 = 60.0;

/// `exp(log_decay)`, flushed to 0 below the cutoff.
fn decay(log_decay: f64) -> f32 {
    if log_decay < -DECAY_CUTOFF {
        0.0
    } else {
        log_decay.exp() as f32
    }
}

/// The longest chunk [`chunked`] takes (its f64 decay sums live on the stack).
const MAX_CHUNK: usize = 128;

/// The chunk's working buffers, each sized for the longest chunk; matrices of a chunk of c
/// tokens are laid out for c (rows of c values, or c rows).
struct Chunk<'a> {
    /// Keys then queries, `[t][i]` (2c rows), so that one product reads the state for both.
    kq: &'a mut [f32],
    /// `S₀ᵀ k_t` then `S₀ᵀ q_t`, `[t][j]` (2c rows); the second half becomes the outputs.
    kq_state: &'a mut [f32],
    /// `[t][j]`: the values written, `u` above.
    u: &'a mut [f32],
    /// `[i][s]`: `exp(b_{c-1} - b_s) k_s[i]`, the keys decayed to the chunk's end, transposed.
    k_to_end: &'a mut [f32],
    /// `[t][s]`: `A` (strictly lower) and the decayed `q_t·k_s` (lower, diagonal included,
    /// zero above).
    a: &'a mut [f32],
    qk: &'a mut [f32],
    /// `exp(b_t - b_s)` for one row t.
    decay_row: &'a mut [f32],
    /// `Γ_t`.
    decay_from_start: &'a mut [f32],
}

/// The span's outputs and final state, chunk after chunk, exactly as [`recurrence`] defines
/// them up to f32 rounding.
///
/// [`recurrence`]: crate::cpu_recurrent::recurrence
pub(crate) fn chunked(simd: Simd, span: &HeadSpan, state: &mut [f32], chunk: usize) {
    assert!((1..=MAX_CHUNK).contains(&chunk), "chunk of {chunk} tokens");
    let (d, c) = (span.p.head_dim, chunk.min(span.tokens.len()));
    if c == 0 {
        return;
    }
    with_scratch(6 * c * d + 2 * c * c + 2 * c, |scratch| {
        let (kq, rest) = scratch.split_at_mut(2 * c * d);
        let (kq_state, rest) = rest.split_at_mut(2 * c * d);
        let (u, rest) = rest.split_at_mut(c * d);
        let (k_to_end, rest) = rest.split_at_mut(c * d);
        let (a, rest) = rest.split_at_mut(c * c);
        let (qk, rest) = rest.split_at_mut(c * c);
        let (decay_row, decay_from_start) = rest.split_at_mut(c);
        let mut bufs = Chunk { kq, kq_state, u, k_to_end, a, qk, decay_row, decay_from_start };
        for first in span.tokens.clone().step_by(c) {
            one_chunk(simd, span, first, c.min(span.tokens.end - first), state, &mut bufs);
        }
    })
}

/// Tokens `first..first + c` of the span, from `state` and leaving it there.
fn one_chunk(simd: Simd, span: &HeadSpan, first: usize, c: usize, state: &mut [f32], w: &mut Chunk) {
    let d = span.p.head_dim;
    let row = |t: usize| t * d..(t + 1) * d;
    let mut log_decay = [0f64; MAX_CHUNK];
    let mut sum = 0f64;
    let (k, q) = w.kq[..2 * c * d].split_at_mut(c * d);
    for t in 0..c {
        span.query_key(first + t, &mut q[row(t)], &mut k[row(t)]);
        sum += span.gates(first + t).0 as f64;
        log_decay[t] = sum;
        w.decay_from_start[t] = decay(sum);
    }
    let kq = &w.kq[..2 * c * d];
    let (k, q) = kq.split_at(c * d);

    // The decayed Gram matrices: A[t][s] = β_t exp(b_t - b_s) k_t·k_s for s < t, and
    // QK[t][s] = exp(b_t - b_s) q_t·k_s for s ≤ t.
    w.qk[..c * c].fill(0.0);
    for t in 0..c {
        let beta = span.gates(first + t).1;
        let decays = &mut w.decay_row[..=t];
        for (e, b) in decays.iter_mut().zip(&log_decay) {
            let diff = log_decay[t] - b;
            *e = if diff < -DECAY_CUTOFF { f32::NEG_INFINITY } else { diff as f32 };
        }
        simd.exp_sum(decays, 0.0);
        let (kt, qt) = (&k[row(t)], &q[row(t)]);
        for (s, e) in decays.iter().enumerate() {
            if s < t {
                w.a[t * c + s] = beta * e * simd.dot(kt, &k[row(s)]);
            }
            w.qk[t * c + s] = e * simd.dot(qt, &k[row(s)]);
        }
    }

    // S₀ᵀ k_t and S₀ᵀ q_t for the whole chunk in one product.
    let kq_state = &mut w.kq_state[..2 * c * d];
    kq_state.fill(0.0);
    simd.matmul_add(2 * c, d, d, kq, d, state, d, kq_state, d);
    let (k_state, out) = kq_state.split_at_mut(c * d);

    // Forward substitution for u: u_t = β_t (v_t - Γ_t S₀ᵀ k_t) - Σ_{s<t} A[t][s] u_s.
    for t in 0..c {
        let (beta, gamma) = (span.gates(first + t).1, w.decay_from_start[t]);
        let (done, rest) = w.u.split_at_mut(t * d);
        let ut = &mut rest[..d];
        for ((uj, vj), sj) in ut.iter_mut().zip(span.value(first + t)).zip(&k_state[row(t)]) {
            *uj = beta * (vj - gamma * sj);
        }
        for (s, us) in done.chunks_exact(d).enumerate() {
            simd.axpy(-w.a[t * c + s], us, ut);
        }
    }

    // out_t = Γ_t S₀ᵀ q_t + Σ_{s≤t} QK[t][s] u_s.
    for (t, o) in out.chunks_exact_mut(d).enumerate() {
        let gamma = w.decay_from_start[t];
        o.iter_mut().for_each(|e| *e *= gamma);
    }
    simd.matmul_add(c, d, c, w.qk, c, w.u, d, out, d);
    for (t, o) in out.chunks_exact(d).enumerate() {
        // SAFETY: this task owns the head's outputs and holds no other slice of the row.
        unsafe { span.out_row(first + t) }.copy_from_slice(o);
    }

    // The state at the chunk's end: S₀ decayed over the chunk plus every token's write, decayed
    // from its token to the end.
    for s in 0..c {
        let to_end = decay(log_decay[c - 1] - log_decay[s]);
        for (i, ki) in k[row(s)].iter().enumerate() {
            w.k_to_end[i * c + s] = to_end * ki;
        }
    }
    let chunk_decay = w.decay_from_start[c - 1];
    state.iter_mut().for_each(|e| *e *= chunk_decay);
    simd.matmul_add(d, d, c, w.k_to_end, c, w.u, d, state, d);
}

#[cfg(test)]
#[path = "cpu_delta_chunk_tests.rs"]
mod tests;
