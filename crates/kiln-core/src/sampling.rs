//! Token sampling: the settings, a counter-based random source that GPU
//! kernels reproduce exactly, and the host reference sampler.
//!
//! The chain follows llama.cpp's default order: repetition penalty, top-k,
//! top-p, min-p, temperature, then a draw. `temperature <= 0` is greedy.

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p`; 1.0 is off.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 is off.
    pub min_p: f32,
    /// Divides positive (multiplies negative) logits of recent tokens; 1.0 is off.
    pub repeat_penalty: f32,
    /// How many recent tokens the penalties look at.
    pub repeat_last_n: usize,
    /// Subtracted once from the logit of every token among the recent ones; 0 is off.
    pub presence_penalty: f32,
    /// Subtracted from a recent token's logit once per occurrence; 0 is off.
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    /// llama.cpp's defaults.
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Default::default() }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform number in [0, 1) for draw number `draw` of a run seeded `seed`.
/// Stateless, so a GPU kernel computes the same value from the same inputs.
pub fn uniform(seed: u64, draw: u64) -> f32 {
    let bits = splitmix64(seed ^ splitmix64(draw));
    (bits >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

/// Whether any penalty changes logits.
pub fn penalizes(params: &SamplingParams) -> bool {
    params.repeat_last_n != 0 && (params.repeat_penalty != 1.0 || params.presence_penalty != 0.0 || params.frequency_penalty != 0.0)
}

/// Applies the penalties to `logits` in place, as llama.cpp's penalties sampler: once per
/// distinct token among the last `repeat_last_n` of `history`, the repetition penalty, then
/// minus `count * frequency_penalty + presence_penalty`. The GPU sampler computes the same
/// expressions in the same order, unfused.
pub fn apply_repeat_penalty(logits: &mut [f32], history: &[u32], params: &SamplingParams) {
    if !penalizes(params) {
        return;
    }
    let recent = &history[history.len().saturating_sub(params.repeat_last_n)..];
    for (i, &tok) in recent.iter().enumerate() {
        let t = tok as usize;
        if t >= logits.len() || recent[..i].contains(&tok) {
            continue;
        }
        let count = recent[i..].iter().filter(|&&x| x == tok).count() as f32;
        let l = &mut logits[t];
        *l = if *l > 0.0 { *l / params.repeat_penalty } else { *l * params.repeat_penalty };
        *l -= count * params.frequency_penalty + params.presence_penalty;
    }
}

/// The first index of the largest value (ties go to the lower id).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Host reference sampler. `logits` is modified (penalty); `scratch` must
/// have room for `logits.len()` candidates and is reused across calls so the
/// generation loop does not allocate.
pub fn sample(logits: &mut [f32], history: &[u32], params: &SamplingParams, draw: u64, scratch: &mut Vec<(f32, u32)>) -> u32 {
    apply_repeat_penalty(logits, history, params);
    if params.is_greedy() {
        return argmax(logits);
    }
    scratch.clear();
    scratch.extend(logits.iter().enumerate().map(|(i, &l)| (l, i as u32)));
    let by_logit_desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    let k = if params.top_k == 0 { scratch.len() } else { params.top_k.min(scratch.len()) };
    if k < scratch.len() {
        scratch.select_nth_unstable_by(k - 1, by_logit_desc);
        scratch.truncate(k);
    }
    scratch.sort_unstable_by(by_logit_desc);

    // Probabilities at temperature 1 decide top-p and min-p, as in llama.cpp.
    let max = scratch[0].0;
    let total: f32 = scratch.iter().map(|c| (c.0 - max).exp()).sum();
    if params.top_p < 1.0 {
        let mut cum = 0.0;
        let mut keep = scratch.len();
        for (i, c) in scratch.iter().enumerate() {
            cum += (c.0 - max).exp() / total;
            if cum >= params.top_p {
                keep = i + 1;
                break;
            }
        }
        scratch.truncate(keep);
    }
    if params.min_p > 0.0 {
        let floor = max + params.min_p.ln();
        let keep = scratch.iter().take_while(|c| c.0 >= floor).count().max(1);
        scratch.truncate(keep);
    }

    let inv_t = 1.0 / params.temperature;
    let weight_total: f32 = scratch.iter().map(|c| ((c.0 - max) * inv_t).exp()).sum();
    let target = uniform(params.seed, draw) * weight_total;
    let mut cum = 0.0;
    for c in scratch.iter() {
        cum += ((c.0 - max) * inv_t).exp();
        if cum > target {
            return c.1;
        }
    }
    scratch.last().map(|c| c.1).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits(n: usize, seed: u64) -> Vec<f32> {
        (0..n).map(|i| (uniform(seed, i as u64) - 0.5) * 10.0).collect()
    }

    #[test]
    fn greedy_is_argmax() {
        let mut l = logits(1000, 3);
        let want = argmax(&l);
        let got = sample(&mut l, &[], &SamplingParams::greedy(), 0, &mut Vec::new());
        assert_eq!(got, want);
        assert!(l.iter().all(|&x| x <= l[want as usize]));
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let base = logits(500, 9);
        let p = SamplingParams { top_k: 1, temperature: 5.0, ..Default::default() };
        for draw in 0..50 {
            assert_eq!(sample(&mut base.clone(), &[], &p, draw, &mut Vec::new()), argmax(&base));
        }
    }

    #[test]
    fn draws_follow_the_distribution() {
        // Three tokens with probabilities 0.5, 0.3, 0.2 at temperature 1.
        let base = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let p = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 42, ..Default::default() };
        let mut counts = [0usize; 3];
        let n = 20000;
        for draw in 0..n {
            counts[sample(&mut base.clone(), &[], &p, draw, &mut Vec::new()) as usize] += 1;
        }
        // Binomial sd at n=20000 is below 0.0036, so 0.015 is over 4 sd.
        for (c, want) in counts.iter().zip([0.5, 0.3, 0.2]) {
            assert!((*c as f64 / n as f64 - want).abs() < 0.015, "{counts:?}");
        }
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        let base = [0.6f32.ln(), 0.3f32.ln(), 0.07f32.ln(), 0.03f32.ln()];
        let top_p = SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.85, min_p: 0.0, ..Default::default() };
        let min_p = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.2, ..Default::default() };
        for draw in 0..2000 {
            assert!(sample(&mut base.clone(), &[], &top_p, draw, &mut Vec::new()) < 2);
            assert!(sample(&mut base.clone(), &[], &min_p, draw, &mut Vec::new()) < 2);
        }
    }

    #[test]
    fn repeat_penalty_applies_once_per_token() {
        let mut l = vec![2.0, -2.0, 1.0];
        let p = SamplingParams { repeat_penalty: 2.0, ..SamplingParams::greedy() };
        apply_repeat_penalty(&mut l, &[0, 1, 0, 0], &p);
        assert_eq!(l, vec![1.0, -4.0, 1.0]);
    }

    #[test]
    fn presence_and_frequency_penalties_follow_counts() {
        let mut l = vec![2.0, -2.0, 1.0, 0.5];
        let p = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..SamplingParams::greedy() };
        apply_repeat_penalty(&mut l, &[0, 1, 0, 0], &p);
        assert_eq!(l, vec![2.0 - 0.75 - 0.5, -2.0 - 0.25 - 0.5, 1.0, 0.5]);
        let both = SamplingParams { repeat_penalty: 2.0, frequency_penalty: 1.0, repeat_last_n: 2, ..SamplingParams::greedy() };
        let mut l = vec![2.0, -2.0, 1.0];
        apply_repeat_penalty(&mut l, &[0, 1, 0, 0], &both);
        assert_eq!(l, vec![2.0 / 2.0 - 2.0, -2.0, 1.0]);
        assert!(!penalizes(&SamplingParams { presence_penalty: 1.0, repeat_last_n: 0, ..SamplingParams::greedy() }));
    }

    #[test]
    fn same_seed_same_draws() {
        let a: Vec<f32> = (0..100).map(|d| uniform(7, d)).collect();
        let b: Vec<f32> = (0..100).map(|d| uniform(7, d)).collect();
        let c: Vec<f32> = (0..100).map(|d| uniform(8, d)).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|&u| (0.0..1.0).contains(&u)));
    }
}
