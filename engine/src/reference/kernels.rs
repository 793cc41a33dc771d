//! CPU kernels for the short forward passes of a cached prompt: the few tokens after an
//! imported prefix (16 in the benchmark) attend over thousands of cached positions.
//!
//! - [`matmul_small`]: `(m × k) · (k × n)` for small `m`, register-tiled over the weights'
//!   `(in, out)` layout. A general GEMM packs the whole weight matrix on every call; at a
//!   handful of rows that packing costs as much as the arithmetic.
//! - [`causal_softmax_rows`]: scale, causal mask and softmax of attention scores in one pass,
//!   in place, with a vectorized `exp`; masked positions are never exponentiated.
//!
//! Every output element is one sequential fused multiply-add chain over `k`, so results do
//! not depend on the thread count or the tiling.

use rayon::prelude::*;

/// Rows handled by one micro-kernel call.
const MR: usize = 4;
/// Columns handled by one micro-kernel call (three AVX2 vectors).
const NR: usize = 24;
/// Columns per parallel task.
const STRIP: usize = 8 * NR;

/// Row counts up to this use [`matmul_small`]; larger batches go to the general GEMM.
pub const SMALL_M: usize = 32;

/// Whether this CPU has AVX2 and FMA (the vector kernels' instruction sets).
pub(super) fn simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out = x · w`, with `x` `(m × k)`, `w` `(k × n)` and `out` `(m × n)`, all row-major.
pub fn matmul_small(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    assert_eq!(x.len(), m * k);
    assert_eq!(w.len(), k * n);
    let simd = simd();
    let strips: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(STRIP))
        .into_par_iter()
        .map(|s| {
            let (j0, j1) = (s * STRIP, ((s + 1) * STRIP).min(n));
            let width = j1 - j0;
            let mut local = vec![0f32; m * width];
            let mut j = j0;
            while j < j1 {
                let nr = (j1 - j).min(NR);
                let mut r = 0;
                while r < m {
                    let mr = (m - r).min(MR);
                    #[cfg(target_arch = "x86_64")]
                    if simd && mr == MR && nr == NR {
                        // SAFETY: AVX2 and FMA were detected; the tile lies inside `x`, `w`
                        // and `local` (r + 4 ≤ m, j + 24 ≤ j1 ≤ n).
                        unsafe { tile_avx2(x, w, &mut local, r, j, j0, width, k, n) };
                        r += mr;
                        continue;
                    }
                    tile_scalar(x, w, &mut local, (r, mr), (j, nr), j0, width, k, n);
                    r += mr;
                }
                j += nr;
            }
            (j0, local)
        })
        .collect();
    let mut out = vec![0f32; m * n];
    for (j0, local) in strips {
        let width = local.len() / m.max(1);
        for r in 0..m {
            out[r * n + j0..r * n + j0 + width].copy_from_slice(&local[r * width..(r + 1) * width]);
        }
    }
    out
}

// The tile kernels take their geometry as plain numbers on purpose: they are the hot loop,
// called per tile with values the caller already holds in registers, and a struct would only
// be unpacked again at the top of each.
#[allow(clippy::too_many_arguments)]
fn tile_scalar(
    x: &[f32],
    w: &[f32],
    local: &mut [f32],
    (r0, mr): (usize, usize),
    (j0, nr): (usize, usize),
    strip0: usize,
    width: usize,
    k: usize,
    n: usize,
) {
    for r in r0..r0 + mr {
        for j in j0..j0 + nr {
            let mut acc = 0f32;
            for kk in 0..k {
                acc = x[r * k + kk].mul_add(w[kk * n + j], acc);
            }
            local[r * width + (j - strip0)] = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_avx2(
    x: &[f32],
    w: &[f32],
    local: &mut [f32],
    r0: usize,
    j0: usize,
    strip0: usize,
    width: usize,
    k: usize,
    n: usize,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 3]; MR];
    let xp = x.as_ptr();
    let wp = w.as_ptr();
    for kk in 0..k {
        // SAFETY (whole block): kk < k, r0 + 3 < m and j0 + 23 < n, as the caller checked.
        unsafe {
            let row = wp.add(kk * n + j0);
            let w0 = _mm256_loadu_ps(row);
            let w1 = _mm256_loadu_ps(row.add(8));
            let w2 = _mm256_loadu_ps(row.add(16));
            for (r, a) in acc.iter_mut().enumerate() {
                let xv = _mm256_broadcast_ss(&*xp.add((r0 + r) * k + kk));
                a[0] = _mm256_fmadd_ps(xv, w0, a[0]);
                a[1] = _mm256_fmadd_ps(xv, w1, a[1]);
                a[2] = _mm256_fmadd_ps(xv, w2, a[2]);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        let base = (r0 + r) * width + (j0 - strip0);
        let dst = &mut local[base..base + NR];
        // SAFETY: `dst` holds exactly 24 floats.
        unsafe {
            _mm256_storeu_ps(dst.as_mut_ptr(), a[0]);
            _mm256_storeu_ps(dst.as_mut_ptr().add(8), a[1]);
            _mm256_storeu_ps(dst.as_mut_ptr().add(16), a[2]);
        }
    }
}

/// Softmax of attention score rows in place: each row `r` of `scores` (`rows × ctx`) belongs
/// to query `r % n` of a batch at positions `past..past + n`, so it sees positions
/// `0..=past + r % n`; the rest become 0. Scores are multiplied by `scale` first.
pub fn causal_softmax_rows(scores: &mut [f32], ctx: usize, n: usize, past: usize, scale: f32) {
    assert!(ctx > 0 && scores.len().is_multiple_of(ctx));
    let simd = simd();
    scores.par_chunks_mut(ctx).enumerate().for_each(|(row, s)| {
        let visible = (past + row % n + 1).min(ctx);
        let (live, masked) = s.split_at_mut(visible);
        masked.fill(0.0);
        let mut max = f32::NEG_INFINITY;
        for v in live.iter_mut() {
            *v *= scale;
            max = max.max(*v);
        }
        #[cfg(target_arch = "x86_64")]
        let sum = if simd {
            // SAFETY: AVX2 and FMA were detected.
            unsafe { exp_sub_sum_avx2(live, max) }
        } else {
            exp_sub_sum_scalar(live, max)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let sum = {
            let _ = simd;
            exp_sub_sum_scalar(live, max)
        };
        let inv = 1.0 / sum;
        for v in live.iter_mut() {
            *v *= inv;
        }
    });
}

/// `v = exp(v - max)` for every element; returns the sum.
fn exp_sub_sum_scalar(v: &mut [f32], max: f32) -> f32 {
    let mut sum = 0.0;
    for x in v.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_sub_sum_avx2(v: &mut [f32], max: f32) -> f32 {
    use std::arch::x86_64::*;
    let m = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    let mut chunks = v.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: `c` holds exactly 8 floats.
        unsafe {
            let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, e);
        }
    }
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds exactly 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    let mut sum: f32 = lanes.iter().sum();
    sum += exp_sub_sum_scalar(chunks.into_remainder(), max);
    sum
}

/// `exp` of 8 lanes for arguments `≤ 0` (softmax after subtracting the maximum): range
/// reduction by `ln 2` in two parts and a degree-6 polynomial; relative error about 2e-7 over
/// the range, underflowing to 0 below about -87.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp256(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
    let n = _mm256_round_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    // r = x - n·ln2, with ln2 split into an exactly representable high part and the rest.
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
    // exp(r) on |r| ≤ ln2/2 by its Taylor polynomial (Horner).
    let mut p = _mm256_set1_ps(1.0 / 720.0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0 / 120.0));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0 / 24.0));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0 / 6.0));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0));
    // 2^n through the exponent bits (n ≥ -126 after the clamp above).
    let bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
        23,
    );
    _mm256_mul_ps(p, _mm256_castsi256_ps(bits))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn small_matmul_matches_a_plain_triple_loop() {
        let mut seed = 7;
        for (m, k, n) in [
            (16, 576, 1536),
            (5, 64, 50),
            (4, 8, 24),
            (1, 3, 7),
            (33, 16, 200),
        ] {
            let x: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
            let w: Vec<f32> = (0..k * n).map(|_| lcg(&mut seed)).collect();
            let got = matmul_small(&x, &w, m, k, n);
            for r in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|kk| x[r * k + kk] as f64 * w[kk * n + j] as f64)
                        .sum();
                    let g = got[r * n + j] as f64;
                    assert!(
                        (g - want).abs() < 1e-4,
                        "({m},{k},{n}) [{r},{j}]: {g} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn causal_softmax_matches_the_definition() {
        let mut seed = 3;
        let (n, past, ctx) = (5, 37, 42);
        let rows = 3 * n;
        let raw: Vec<f32> = (0..rows * ctx).map(|_| lcg(&mut seed) * 30.0).collect();
        let mut got = raw.clone();
        causal_softmax_rows(&mut got, ctx, n, past, 0.125);
        for r in 0..rows {
            let visible = past + r % n + 1;
            let row = &raw[r * ctx..(r + 1) * ctx];
            let max = row[..visible]
                .iter()
                .map(|v| (v * 0.125) as f64)
                .fold(f64::MIN, f64::max);
            let sum: f64 = row[..visible]
                .iter()
                .map(|v| ((v * 0.125) as f64 - max).exp())
                .sum();
            for j in 0..ctx {
                let want = if j < visible {
                    ((row[j] * 0.125) as f64 - max).exp() / sum
                } else {
                    0.0
                };
                let g = got[r * ctx + j] as f64;
                assert!((g - want).abs() < 1e-6, "row {r} col {j}: {g} vs {want}");
            }
        }
    }

    #[test]
    fn vector_exp_is_accurate_down_to_underflow() {
        if !simd() {
            return;
        }
        let xs: Vec<f32> = (0..4000).map(|i| -(i as f32) * 0.025).collect();
        let mut v = xs.clone();
        // SAFETY: AVX2 and FMA are present (checked above).
        let sum = unsafe { exp_sub_sum_avx2(&mut v, 0.0) };
        let mut want_sum = 0f64;
        for (x, e) in xs.iter().zip(&v) {
            let want = (*x as f64).exp();
            want_sum += want;
            assert!(
                (*e as f64 - want).abs() <= 1e-6 * want + 1e-37,
                "exp({x}) = {e}, want {want}"
            );
        }
        assert!((sum as f64 - want_sum).abs() < 1e-5 * want_sum);
    }
}
