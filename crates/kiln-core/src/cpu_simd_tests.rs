//! Every vector kernel against the scalar reference, at every level this CPU has (so on an
//! AVX-512 machine the AVX2 kernels run too), over odd lengths that exercise every tail.
//!
//! Tolerances: `U` is f32's unit roundoff. Two sums of the same `n` products in different
//! orders each err by at most `(n + 2) U sum|a b|` (Higham's bound for recursive summation;
//! the +2 covers the products and q8_0's extra `d * q` rounding), so they differ by at most
//! twice that. An fma `y + a x` differs from the rounded `y + round(a x)` by at most
//! `2 U (|y| + |a x|)`. The vector exp is within a few ulp of libm's, checked at 1e-6 relative.

use half::f16;

use super::{scalar, KvRow, Simd, SimdLevel};

const U: f32 = f32::EPSILON / 2.0;
const LENGTHS: [usize; 14] = [0, 1, 7, 8, 15, 16, 17, 31, 32, 33, 64, 127, 128, 4099];

/// The vector levels this CPU supports.
fn levels() -> Vec<Simd> {
    SimdLevel::ALL.into_iter().filter(|&l| l != SimdLevel::Scalar).filter_map(Simd::at).collect()
}

/// Deterministic values in [-1, 1).
pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn q8_row(x: &[f32]) -> Vec<u8> {
    let mut bytes = vec![0u8; x.len() / 32 * 34];
    kiln_quant::quantize(kiln_quant::GgmlType::Q8_0, x, &mut bytes).unwrap();
    bytes
}

fn dot_bound(n: usize, a: &[f32], b: impl Iterator<Item = f32>) -> f32 {
    2.0 * (n + 2) as f32 * U * a.iter().zip(b).map(|(x, y)| (x * y).abs()).sum::<f32>() + f32::MIN_POSITIVE
}

#[test]
fn detection_picks_the_widest_supported_level() {
    let best = Simd::best();
    assert_eq!(Simd::at(best.level()), Some(best));
    assert!(levels().iter().all(|l| l.level() <= best.level()));
    assert_eq!(Simd::at(SimdLevel::Scalar).map(Simd::level), Some(SimdLevel::Scalar));
}

#[test]
fn dots_match_the_reference() {
    for simd in levels() {
        for n in LENGTHS {
            let (a, b) = (values(n, 1), values(n, 2));
            let (got, want) = (simd.dot(&a, &b), scalar::dot(&a, &b));
            assert!((got - want).abs() <= dot_bound(n, &a, b.iter().copied()), "{simd:?} dot {n}: {got} vs {want}");
            let h: Vec<f16> = b.iter().map(|&v| f16::from_f32(v)).collect();
            let (got, want) = (simd.dot_f16(&a, &h), scalar::dot_f16(&a, &h));
            assert!((got - want).abs() <= dot_bound(n, &a, h.iter().map(|v| v.to_f32())), "{simd:?} dot_f16 {n}: {got} vs {want}");
            let (got, want) = (simd.sum_squares(&a), scalar::sum_squares(&a));
            assert!((got - want).abs() <= dot_bound(n, &a, a.iter().copied()), "{simd:?} sum_squares {n}: {got} vs {want}");
        }
    }
}

#[test]
fn q8_0_rows_match_the_reference() {
    // A row of 8 blocks; heads at every block-aligned and some unaligned offsets.
    let row: Vec<f32> = values(256, 3).iter().map(|v| v * 3.0).collect();
    let blocks = q8_row(&row);
    for simd in levels().into_iter().chain(Simd::at(SimdLevel::Scalar)) {
        for (col, len) in [(0, 256), (32, 64), (64, 128), (96, 32), (5, 40), (0, 7), (200, 56)] {
            let a = values(len, 4);
            let deq: Vec<f32> = {
                let mut d = vec![0f32; 256];
                kiln_quant::dequantize(kiln_quant::GgmlType::Q8_0, &blocks, &mut d).unwrap();
                d[col..col + len].to_vec()
            };
            let (got, want) = (simd.dot_kv(&a, KvRow::Q8 { blocks: &blocks, col }), scalar::dot(&a, &deq));
            assert!((got - want).abs() <= dot_bound(len, &a, deq.iter().copied()), "{simd:?} dot_q8 {col}+{len}: {got} vs {want}");
            let y0 = values(len, 5);
            let (mut got, mut want) = (y0.clone(), y0.clone());
            simd.axpy_kv(-0.7, KvRow::Q8 { blocks: &blocks, col }, &mut got);
            scalar::axpy(-0.7, &deq, &mut want);
            for i in 0..len {
                let tol = 2.0 * U * (y0[i].abs() + (0.7 * deq[i]).abs()) * 2.0;
                assert!((got[i] - want[i]).abs() <= tol, "{simd:?} axpy_q8 {col}+{len} [{i}]: {} vs {}", got[i], want[i]);
            }
        }
    }
}

#[test]
fn axpys_match_the_reference() {
    for simd in levels() {
        for n in LENGTHS {
            let (x, y0) = (values(n, 6), values(n, 7));
            let a = 1.37;
            let h: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
            let (mut got, mut want) = (y0.clone(), y0.clone());
            simd.axpy(a, &x, &mut got);
            scalar::axpy(a, &x, &mut want);
            let (mut got_h, mut want_h) = (y0.clone(), y0.clone());
            simd.axpy_kv(a, KvRow::F16(&h), &mut got_h);
            scalar::axpy_f16(a, &h, &mut want_h);
            for i in 0..n {
                assert!((got[i] - want[i]).abs() <= 2.0 * U * (y0[i].abs() + (a * x[i]).abs()), "{simd:?} axpy {n} [{i}]");
                let xh = h[i].to_f32();
                assert!((got_h[i] - want_h[i]).abs() <= 2.0 * U * (y0[i].abs() + (a * xh).abs()), "{simd:?} axpy_f16 {n} [{i}]");
            }
        }
    }
}

#[test]
fn matrix_products_match_the_reference() {
    // Row tiles of 1 to 4 and many, column tails at both widths, strided rows.
    for simd in levels() {
        for (m, n, depth) in [(1, 1, 1), (3, 7, 5), (4, 32, 128), (5, 33, 17), (9, 64, 3), (2, 16, 1), (7, 47, 40), (32, 128, 128)] {
            let (lda, ldb, ldc) = (depth + 3, n + 5, n + 2);
            let (a, b, c0) = (values(m * lda, 12), values(depth * ldb, 13), values(m * ldc, 14));
            let (mut got, mut want) = (c0.clone(), c0.clone());
            simd.matmul_add(m, n, depth, &a, lda, &b, ldb, &mut got, ldc);
            scalar::matmul_add(m, n, depth, &a, lda, &b, ldb, &mut want, ldc);
            for r in 0..m {
                for j in 0..ldc {
                    let (g, w) = (got[r * ldc + j], want[r * ldc + j]);
                    if j >= n {
                        assert_eq!(g, c0[r * ldc + j], "{simd:?} {m}x{n}x{depth}: wrote past the row at ({r}, {j})");
                        continue;
                    }
                    let terms = (0..depth).map(|i| b[i * ldb + j]);
                    let bound = dot_bound(depth + 1, &a[r * lda..r * lda + depth], terms) + 2.0 * (depth + 3) as f32 * U * c0[r * ldc + j].abs();
                    assert!((g - w).abs() <= bound, "{simd:?} {m}x{n}x{depth} ({r}, {j}): {g} vs {w}");
                }
            }
        }
    }
}

#[test]
fn softmax_pieces_match_the_reference() {
    for simd in levels() {
        for n in LENGTHS {
            // Scores over exp's range down past the underflow cut; sums stay finite.
            let x: Vec<f32> = values(n, 8).iter().map(|v| v * 90.0 - 10.0).collect();
            assert_eq!(simd.max(&x), scalar::max(&x), "{simd:?} max {n}");
            for sub in [0.0, scalar::max(&x)] {
                let (mut got, mut want) = (x.clone(), x.clone());
                let (total, want_total) = (simd.exp_sum(&mut got, sub), scalar::exp_sum(&mut want, sub));
                for i in 0..n {
                    assert!((got[i] - want[i]).abs() <= 1e-6 * want[i].abs() + 2e-38, "{simd:?} exp({}) = {} vs {}", x[i] - sub, got[i], want[i]);
                }
                assert!((total - want_total).abs() <= (1e-6 + 2.0 * (n + 2) as f32 * U) * want_total, "{simd:?} exp sum {n}: {total} vs {want_total}");
            }
        }
        // Sixteen values, so they go through the vector lanes at both widths.
        let mut special = [f32::NEG_INFINITY, -1e30, -87.5, 0.0, f32::NAN, 1.0, -0.5, -200.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        simd.exp_sum(&mut special, 0.0);
        assert_eq!(&special[..4], &[0.0, 0.0, 0.0, 1.0]);
        assert!(special[4].is_nan());
        assert_eq!(special[7], 0.0);
    }
}

#[test]
fn element_wise_ops_match_the_reference() {
    for simd in levels() {
        for n in LENGTHS {
            let (g, u, w) = (values(n, 9), values(n, 10), values(n, 11));
            // Gates past exp's clamps at both ends.
            let g: Vec<f32> = g.iter().enumerate().map(|(i, v)| if i % 13 == 5 { v * 200.0 } else { v * 12.0 }).collect();
            let (mut got, mut want) = (vec![0f32; n], vec![0f32; n]);
            simd.rms_apply(&g, 0.37, &w, &mut got);
            scalar::rms_apply(&g, 0.37, &w, &mut want);
            assert_eq!(got, want, "{simd:?} rms_apply {n}: same operations in the same order");
            simd.swiglu(&g, &u, &mut got);
            scalar::swiglu(&g, &u, &mut want);
            for i in 0..n {
                // exp's 1e-6 carries through 1 + exp and the division.
                assert!((got[i] - want[i]).abs() <= 2e-6 * want[i].abs() + 1e-30, "{simd:?} swiglu({}) = {} vs {}", g[i], got[i], want[i]);
            }
            simd.geglu(&g, &u, &mut got);
            scalar::geglu(&g, &u, &mut want);
            for i in 0..n {
                // tanh from exp errs by ~1e-6 absolute, scaled by |0.5 g u|; libm's tanh has the
                // same cancellation in 1 + tanh for negative gates.
                let tol = 1e-6 * (g[i] * u[i]).abs() + 1e-6 * want[i].abs();
                assert!((got[i] - want[i]).abs() <= tol, "{simd:?} geglu({}) = {} vs {}", g[i], got[i], want[i]);
            }
        }
    }
}
