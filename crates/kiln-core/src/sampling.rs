//! Token sampling: the settings, a counter-based random source that GPU
//! kernels reproduce exactly, and the host reference sampler.
//!
//! The chain follows llama.cpp's default order: repetition penalty, top-k,
//! top-p, min-p, temperature, then a draw. `temperature <= 0` is greedy, and so is one too
//! small for its inverse to be finite (below the smallest normal f32), or NaN.

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

    /// Greedy also where 1 / temperature would overflow: the draw would then pick the least
    /// likely candidate, where the limit of such a temperature is the most likely one.
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature < f32::MIN_POSITIVE
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
        // A penalty so small that the quotient overflows leaves the largest finite logit, which
        // the sampler can rank (an infinite one would make every weight NaN).
        *l = if *l > 0.0 { (*l / params.repeat_penalty).min(f32::MAX) } else { *l * params.repeat_penalty };
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
    let inv_t = 1.0 / params.temperature;
    if keeps_whole_row(params, logits.len()) {
        return draw_from_whole_row(logits, inv_t, uniform(params.seed, draw), scratch);
    }
    let max = keep_candidates(logits, params, scratch);
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

/// Whether no cut applies (temperature alone): top-k, top-p and min-p all off, as
/// keep_candidates reads them.
fn keeps_whole_row(params: &SamplingParams, n: usize) -> bool {
    let cuts = params.top_p < 1.0 || params.min_p > 0.0;
    (params.top_k == 0 || params.top_k >= n) && !cuts
}

/// Temperature alone: the target `u` of the whole row's weight (summed in f64), then the
/// ranking sorted only as far as the walk to it goes: 1,024 tokens, then 4x more at a time.
fn draw_from_whole_row(logits: &[f32], inv_t: f32, u: f32, scratch: &mut Vec<(f32, u32)>) -> u32 {
    let max = logits.iter().copied().max_by(f32::total_cmp).unwrap_or(0.0);
    let weight = |l: f32| ((l - max) * inv_t).exp();
    let target = u * logits.iter().map(|&l| f64::from(weight(l))).sum::<f64>() as f32;
    scratch.clear();
    scratch.extend(logits.iter().enumerate().map(|(i, &l)| (l, i as u32)));
    let (mut ranked, mut cum) = (0, 0.0f32);
    while ranked < scratch.len() {
        let walked = ranked;
        ranked = rank_further(scratch, ranked);
        for c in &scratch[walked..ranked] {
            cum += weight(c.0);
            if cum > target {
                return c.1;
            }
        }
    }
    scratch.last().map_or(0, |c| c.1)
}

/// Descending logit, ties to the lower id: the order every cut is a prefix of.
fn by_logit_desc(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// How much of a whole-row ranking is sorted first; it grows 4x until it holds what is needed.
const FIRST_RANKED: usize = 1024;

/// Sorts the next stretch of the ranking behind the `ranked` tokens already in order at the
/// front of `scratch` (FIRST_RANKED tokens, then 4x as many in all) and returns the new length.
fn rank_further(scratch: &mut [(f32, u32)], ranked: usize) -> usize {
    let n = scratch.len();
    let end = if ranked == 0 { FIRST_RANKED } else { ranked * 4 }.min(n);
    if end < n {
        scratch[ranked..].select_nth_unstable_by(end - ranked - 1, by_logit_desc);
    }
    scratch[ranked..end].sort_unstable_by(by_logit_desc);
    end
}

/// Leaves in `scratch`, in ranking order, the tokens top-k, top-p and min-p keep, and returns
/// the largest logit. Probabilities at temperature 1 decide top-p and min-p, as in llama.cpp;
/// top-p's total runs over the top-k list. Without a top-k only as long a prefix of the ranking
/// is sorted as holds both cuts (the total is summed over the row in f64 instead).
fn keep_candidates(logits: &[f32], params: &SamplingParams, scratch: &mut Vec<(f32, u32)>) -> f32 {
    scratch.clear();
    scratch.extend(logits.iter().enumerate().map(|(i, &l)| (l, i as u32)));
    let n = scratch.len();
    let k = if params.top_k == 0 { n } else { params.top_k.min(n) };
    let top_p = params.top_p < 1.0;
    let (max, total) = if k < n {
        scratch.select_nth_unstable_by(k - 1, by_logit_desc);
        scratch.truncate(k);
        scratch.sort_unstable_by(by_logit_desc);
        let max = scratch[0].0;
        (max, if top_p { scratch.iter().map(|c| (c.0 - max).exp()).sum() } else { 1.0 })
    } else {
        let max = logits.iter().copied().max_by(f32::total_cmp).unwrap_or(0.0);
        let total = if top_p { row_total(logits, max) } else { 1.0 };
        let mut ranked = 0;
        loop {
            ranked = rank_further(scratch, ranked);
            if ranked == n || cuts_within(&scratch[..ranked], max, total, params) {
                scratch.truncate(ranked);
                break;
            }
        }
        (max, total)
    };
    if top_p {
        let keep = nucleus_end(scratch, max, total, params.top_p).unwrap_or(scratch.len());
        scratch.truncate(keep);
    }
    if params.min_p > 0.0 {
        let floor = max + params.min_p.ln();
        let keep = scratch.iter().take_while(|c| c.0 >= floor).count().max(1);
        scratch.truncate(keep);
    }
    max
}

/// Sum of exp(l - max) over a whole row, in f64 (then in any order the same f32).
fn row_total(logits: &[f32], max: f32) -> f32 {
    logits.iter().map(|&l| f64::from((l - max).exp())).sum::<f64>() as f32
}

/// The length of the shortest prefix of `ranked` whose probability reaches `top_p`, if any.
fn nucleus_end(ranked: &[(f32, u32)], max: f32, total: f32, top_p: f32) -> Option<usize> {
    let mut cum = 0.0;
    ranked
        .iter()
        .position(|c| {
            cum += (c.0 - max).exp() / total;
            cum >= top_p
        })
        .map(|i| i + 1)
}

/// Whether a sorted prefix of the whole row's ranking ends past one of its cuts: the nucleus
/// reached, or a token under the min-p floor.
fn cuts_within(ranked: &[(f32, u32)], max: f32, total: f32, params: &SamplingParams) -> bool {
    (params.top_p < 1.0 && nucleus_end(ranked, max, total, params.top_p).is_some())
        || (params.min_p > 0.0 && ranked.last().is_some_and(|c| c.0 < max + params.min_p.ln()))
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
    fn temperatures_without_a_finite_inverse_are_greedy() {
        let base = logits(500, 3);
        for temperature in [1e-45, 1e-39, f32::NAN, -0.0] {
            for top_k in [0, 40] {
                let p = SamplingParams { temperature, top_k, ..Default::default() };
                for draw in 0..20 {
                    assert_eq!(sample(&mut base.clone(), &[], &p, draw, &mut Vec::new()), argmax(&base), "{temperature} top-k {top_k}");
                }
            }
        }
        assert!(!SamplingParams { temperature: 1e-30, ..Default::default() }.is_greedy());
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

    /// keep_candidates's result by a full sort of the row, with the same totals.
    fn kept_by_full_sort(logits: &[f32], p: &SamplingParams) -> Vec<(f32, u32)> {
        let mut ranked: Vec<(f32, u32)> = logits.iter().enumerate().map(|(i, &l)| (l, i as u32)).collect();
        ranked.sort_by(by_logit_desc);
        let whole = p.top_k == 0 || p.top_k >= ranked.len();
        ranked.truncate(if whole { ranked.len() } else { p.top_k });
        let max = ranked[0].0;
        let total = if whole { row_total(logits, max) } else { ranked.iter().map(|c| (c.0 - max).exp()).sum() };
        let mut cum = 0.0f32;
        let keep = ranked.iter().position(|c| {
            cum += (c.0 - max).exp() / total;
            p.top_p < 1.0 && cum >= p.top_p
        });
        ranked.truncate(keep.map_or(ranked.len(), |i| i + 1));
        let floor = max + p.min_p.ln();
        let keep = ranked.iter().take_while(|c| p.min_p <= 0.0 || c.0 >= floor).count().max(1);
        ranked.truncate(keep);
        ranked
    }

    #[test]
    fn whole_row_cuts_match_a_full_sort() {
        // Without a top-k only a growing prefix of the ranking is sorted: 1,024, then 4x more
        // until the nucleus or the min-p floor falls inside it. Rows where the cuts end in the
        // first prefix (peaked), past it (flat), on ties, and with masked (-inf) tokens.
        let peaked: Vec<f32> = (0..50_000).map(|i| if i % 97 == 0 { 9.0 + 8.0 * uniform(1, i) } else { (uniform(2, i) - 0.5) * 8.0 }).collect();
        let flat = logits(5_000, 3);
        let ties: Vec<f32> = logits(20_000, 4).iter().map(|l| (l * 2.0).round() / 2.0).collect();
        let mut masked = peaked.clone();
        masked[10_000..].fill(f32::NEG_INFINITY);
        let base = SamplingParams { top_k: 0, temperature: 1.0, ..Default::default() };
        let settings = [
            base,
            SamplingParams { top_p: 0.9, min_p: 0.0, ..base },
            SamplingParams { top_p: 1.0, min_p: 0.1, ..base },
            SamplingParams { top_p: 1.0, min_p: 0.0, ..base },
            SamplingParams { top_p: 0.999, min_p: 0.0, ..base },
            SamplingParams { top_k: 3000, top_p: 0.8, ..base },
        ];
        for (r, row) in [&peaked, &flat, &ties, &masked, &logits(10, 5)].into_iter().enumerate() {
            for p in &settings {
                let mut scratch = Vec::new();
                let max = keep_candidates(row, p, &mut scratch);
                assert_eq!(scratch, kept_by_full_sort(row, p), "row {r}, {p:?}");
                assert_eq!(max, scratch[0].0);
            }
        }
    }

    #[test]
    fn temperature_alone_draws_match_a_full_sort() {
        // Only the prefix of the ranking the walk reaches is sorted; a reference that sorts the
        // whole row and walks it to the same target must draw the same token every time. Flat
        // rows at a high temperature walk past the first 1,024 tokens.
        let peaked: Vec<f32> = (0..30_000).map(|i| if i % 97 == 0 { 9.0 + 8.0 * uniform(1, i) } else { (uniform(2, i) - 0.5) * 8.0 }).collect();
        let ties: Vec<f32> = logits(20_000, 4).iter().map(|l| (l * 2.0).round() / 2.0).collect();
        let mut masked = peaked.clone();
        masked[10_000..].fill(f32::NEG_INFINITY);
        let mut walked_far = 0;
        for (r, row) in [&peaked, &logits(5_000, 3), &ties, &masked, &logits(10, 5)].into_iter().enumerate() {
            for temperature in [0.3f32, 1.0, 4.0] {
                let p = SamplingParams { temperature, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 11, ..Default::default() };
                let mut ranked: Vec<(f32, u32)> = row.iter().enumerate().map(|(i, &l)| (l, i as u32)).collect();
                ranked.sort_by(by_logit_desc);
                let max = ranked[0].0;
                let weight = |l: f32| ((l - max) * (1.0 / temperature)).exp();
                let total = row.iter().map(|&l| f64::from(weight(l))).sum::<f64>() as f32;
                for draw in 0..200 {
                    let target = uniform(p.seed, draw) * total;
                    let mut cum = 0.0f32;
                    let at = ranked.iter().position(|c| {
                        cum += weight(c.0);
                        cum > target
                    });
                    let want = ranked[at.unwrap_or(ranked.len() - 1)].1;
                    walked_far += usize::from(at.is_none_or(|i| i >= FIRST_RANKED));
                    assert_eq!(sample(&mut row.clone(), &[], &p, draw, &mut Vec::new()), want, "row {r}, temperature {temperature}, draw {draw}");
                }
            }
        }
        assert!(walked_far > 100, "only {walked_far} draws walked past the first prefix");
    }

    #[test]
    fn repeat_penalty_applies_once_per_token() {
        let mut l = vec![2.0, -2.0, 1.0];
        let p = SamplingParams { repeat_penalty: 2.0, ..SamplingParams::greedy() };
        apply_repeat_penalty(&mut l, &[0, 1, 0, 0], &p);
        assert_eq!(l, vec![1.0, -4.0, 1.0]);
    }

    #[test]
    fn a_penalty_that_overflows_leaves_a_finite_logit() {
        let p = SamplingParams { repeat_penalty: 1e-40, ..SamplingParams::default() };
        let mut l = vec![2.0, -2.0, 1.0, 3.0];
        apply_repeat_penalty(&mut l, &[0, 1, 2], &p);
        assert_eq!(l[..3], [f32::MAX, -2.0 * p.repeat_penalty, f32::MAX]);
        for draw in 0..20 {
            let token = sample(&mut [2.0, -2.0, 1.0, 3.0], &[0, 1, 2], &p, draw, &mut Vec::new());
            assert!(token == 0 || token == 2, "draw {draw}: token {token}");
        }
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
