//! One-token decode straight from the shipped Q4_1 (and Q8_0) blocks.
//!
//! Decode is memory-bound: in f32 each token reads 540 MB of weights. Here each weight is
//! read as 5 bits (20-byte blocks of 32) and rebuilt in registers with exactly the arithmetic
//! of the load-time dequantization, `(q as f32) * d + m` (a multiply, then an add), so the
//! weights are bit-identical to the f32 path; only the order of the dot product's additions
//! differs from the f32 matrix multiply.
//!
//! Block layout (GGML Q4_1): `d: f16`, `m: f16`, `qs: [u8; 16]`; weight `j` of the block is the
//! low nibble of `qs[j]` for `j < 16` and the high nibble of `qs[j - 16]` otherwise.

use rayon::prelude::*;

use super::kernels::simd;

const BLOCK: usize = 32;
const BLOCK_BYTES: usize = 20;
const Q8_BLOCK_BYTES: usize = 34;

/// The GGML block formats read directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `d: f16, m: f16, qs: [u8; 16]` (nibbles); weight = `q * d + m`.
    Q4_1,
    /// `d: f16, qs: [i8; 32]`; weight = `q * d`.
    Q8_0,
}

/// A `(rows, cols)` quantized matrix, rows contiguous: the quantized values of each block, and
/// its scale (and Q4_1 minimum) converted to f32 at load (exactly: f16 → f32 is lossless).
pub struct Q4Matrix {
    format: Format,
    qs: Vec<u8>,
    d: Vec<f32>,
    m: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

fn f16_to_f32(lo: u8, hi: u8) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
}

impl Q4Matrix {
    pub fn new(format: Format, data: &[u8], rows: usize, cols: usize) -> Option<Self> {
        let (bytes, head, q_len) = match format {
            Format::Q4_1 => (BLOCK_BYTES, 4, 16),
            Format::Q8_0 => (Q8_BLOCK_BYTES, 2, 32),
        };
        if !cols.is_multiple_of(BLOCK) || data.len() != rows * cols / BLOCK * bytes {
            return None;
        }
        let blocks = data.len() / bytes;
        let mut qs = Vec::with_capacity(blocks * q_len);
        let mut d = Vec::with_capacity(blocks);
        let mut m = Vec::with_capacity(blocks);
        for b in data.chunks_exact(bytes) {
            d.push(f16_to_f32(b[0], b[1]));
            m.push(if format == Format::Q4_1 {
                f16_to_f32(b[2], b[3])
            } else {
                0.0
            });
            qs.extend_from_slice(&b[head..]);
        }
        Some(Self {
            format,
            qs,
            d,
            m,
            rows,
            cols,
        })
    }

    fn row(&self, r: usize) -> Row<'_> {
        let nb = self.cols / BLOCK;
        let q = if self.format == Format::Q4_1 { 16 } else { 32 };
        Row {
            qs: &self.qs[r * nb * q..(r + 1) * nb * q],
            d: &self.d[r * nb..(r + 1) * nb],
            m: &self.m[r * nb..(r + 1) * nb],
        }
    }

    /// `y = W · x`.
    pub fn matvec(&self, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), self.cols);
        assert_eq!(y.len(), self.rows);
        let simd = simd();
        y.par_chunks_mut(256).enumerate().for_each(|(chunk, out)| {
            for (k, o) in out.iter_mut().enumerate() {
                *o = self.dot(&self.row(chunk * 256 + k), x, simd);
            }
        });
    }

    /// One weight row · `x`, with AVX2/FMA when `simd` (detected by the caller) is true.
    fn dot(&self, row: &Row<'_>, x: &[f32], simd: bool) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: the caller detected AVX2 and FMA on this CPU.
            return unsafe {
                match self.format {
                    Format::Q4_1 => dot_avx2(row, x),
                    Format::Q8_0 => dot_q8_avx2(row, x),
                }
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = simd;
        match self.format {
            Format::Q4_1 => dot_scalar(row, x),
            Format::Q8_0 => dot_q8_scalar(row, x),
        }
    }

    /// `Y = X · Wᵀ` for a few rows: `x` is `(m × cols)`, the result `(m × rows)`. Each block
    /// of weights is rebuilt in registers once per 8 rows of `x` and used for all of them.
    pub fn matmul_rows(&self, x: &[f32], m: usize) -> Vec<f32> {
        assert_eq!(x.len(), m * self.cols);
        let simd = simd();
        const CHUNK: usize = 64;
        // Output transposed (`rows × m`) so that each task owns a contiguous slice.
        let mut yt = vec![0f32; self.rows * m];
        yt.par_chunks_mut(CHUNK * m)
            .enumerate()
            .for_each(|(chunk, out)| {
                for (k, o) in out.chunks_exact_mut(m).enumerate() {
                    let row = self.row(chunk * CHUNK + k);
                    let mut r = 0;
                    #[cfg(target_arch = "x86_64")]
                    if simd {
                        while r + ROWS <= m {
                            let xs = &x[r * self.cols..(r + ROWS) * self.cols];
                            // SAFETY: AVX2 and FMA were detected; `xs` holds `ROWS` rows of
                            // `cols` floats and `row` is one row of this matrix.
                            o[r..r + ROWS].copy_from_slice(&unsafe {
                                match self.format {
                                    Format::Q4_1 => dot_rows_avx2::<false>(&row, xs, self.cols),
                                    Format::Q8_0 => dot_rows_avx2::<true>(&row, xs, self.cols),
                                }
                            });
                            r += ROWS;
                        }
                    }
                    for (i, v) in o.iter_mut().enumerate().skip(r) {
                        *v = self.dot(&row, &x[i * self.cols..(i + 1) * self.cols], simd);
                    }
                }
            });
        let mut y = vec![0f32; m * self.rows];
        for (j, col) in yt.chunks_exact(m).enumerate() {
            for (i, v) in col.iter().enumerate() {
                y[i * self.rows + j] = *v;
            }
        }
        y
    }
}

/// Rows of `x` per register-tiled call of [`dot_rows_avx2`].
const ROWS: usize = 8;

/// One weight row against `ROWS` rows of `x` (`xs`, `ROWS × cols`): each block's weights are
/// rebuilt once, exactly as [`dot_avx2`] / [`dot_q8_avx2`] rebuild them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_rows_avx2<const Q8: bool>(row: &Row<'_>, xs: &[f32], cols: usize) -> [f32; ROWS] {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); ROWS];
    let nibbles = _mm_set1_epi8(0x0F);
    for b in 0..cols / BLOCK {
        let d = _mm256_set1_ps(row.d[b]);
        // SAFETY (whole block): block `b` of the row has 16 (Q4_1) or 32 (Q8_0) bytes, and
        // every row of `xs` has `cols` floats, so `b * 32 + 31 < cols` is in bounds.
        unsafe {
            let w: [__m256; 4] = if Q8 {
                let q = row.qs.as_ptr().add(b * 32);
                let f = |k: usize| {
                    let v = _mm_loadl_epi64(q.add(k * 8) as *const __m128i);
                    _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d)
                };
                [f(0), f(1), f(2), f(3)]
            } else {
                let m = _mm256_set1_ps(row.m[b]);
                let qs = _mm_loadu_si128(row.qs.as_ptr().add(b * 16) as *const __m128i);
                let lo = _mm_and_si128(qs, nibbles);
                let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), nibbles);
                let f = |q: __m128i| {
                    _mm256_add_ps(
                        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), d),
                        m,
                    )
                };
                [
                    f(lo),
                    f(_mm_srli_si128(lo, 8)),
                    f(hi),
                    f(_mm_srli_si128(hi, 8)),
                ]
            };
            for (r, a) in acc.iter_mut().enumerate() {
                let xp = xs.as_ptr().add(r * cols + b * BLOCK);
                *a = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xp), *a);
                *a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xp.add(8)), *a);
                *a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xp.add(16)), *a);
                *a = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xp.add(24)), *a);
            }
        }
    }
    let mut out = [0f32; ROWS];
    for (o, a) in out.iter_mut().zip(acc) {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds exactly 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), a) };
        *o = lanes.iter().sum();
    }
    out
}

struct Row<'a> {
    qs: &'a [u8],
    d: &'a [f32],
    m: &'a [f32],
}

fn dot_scalar(row: &Row<'_>, x: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for (b, q16) in row.qs.chunks_exact(16).enumerate() {
        let (d, m) = (row.d[b], row.m[b]);
        let xs = &x[b * BLOCK..(b + 1) * BLOCK];
        for j in 0..16 {
            acc += ((q16[j] & 0x0F) as f32 * d + m) * xs[j];
            acc += ((q16[j] >> 4) as f32 * d + m) * xs[j + 16];
        }
    }
    acc
}

fn dot_q8_scalar(row: &Row<'_>, x: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for (b, q32) in row.qs.chunks_exact(32).enumerate() {
        let d = row.d[b];
        for (j, &q) in q32.iter().enumerate() {
            acc += (q as i8 as f32 * d) * x[b * BLOCK + j];
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_q8_avx2(row: &Row<'_>, x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    for (b, q32) in row.qs.chunks_exact(32).enumerate() {
        let d = _mm256_set1_ps(row.d[b]);
        // SAFETY: `q32` has 32 bytes (four 8-byte loads); `x` has 32 floats from `b * 32`.
        unsafe {
            let xp = x.as_ptr().add(b * BLOCK);
            for k in 0..4 {
                let q = _mm_loadl_epi64(q32.as_ptr().add(k * 8) as *const __m128i);
                // Weight = q * d exactly as dequantized, then FMA with x.
                let w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
                if k % 2 == 0 {
                    acc0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(xp.add(k * 8)), acc0);
                } else {
                    acc1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(xp.add(k * 8)), acc1);
                }
            }
        }
    }
    let acc = _mm256_add_ps(acc0, acc1);
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds exactly 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    lanes.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(row: &Row<'_>, x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mask = _mm_set1_epi8(0x0F);
    for (b, q16) in row.qs.chunks_exact(16).enumerate() {
        let d = _mm256_set1_ps(row.d[b]);
        let m = _mm256_set1_ps(row.m[b]);
        // SAFETY: `q16` has 16 bytes for the 16-byte load; `x` has 32 floats from `b * 32`
        // (cols is a multiple of 32 and x.len() == cols).
        unsafe {
            let qs = _mm_loadu_si128(q16.as_ptr() as *const __m128i);
            let lo = _mm_and_si128(qs, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
            let xp = x.as_ptr().add(b * BLOCK);
            // Weight = q * d + m, as a separate multiply and add (no fusion), then FMA with x.
            let w = |q: __m128i| {
                _mm256_add_ps(
                    _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), d),
                    m,
                )
            };
            acc0 = _mm256_fmadd_ps(w(lo), _mm256_loadu_ps(xp), acc0);
            acc1 = _mm256_fmadd_ps(w(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(xp.add(8)), acc1);
            acc0 = _mm256_fmadd_ps(w(hi), _mm256_loadu_ps(xp.add(16)), acc0);
            acc1 = _mm256_fmadd_ps(w(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(xp.add(24)), acc1);
        }
    }
    let acc = _mm256_add_ps(acc0, acc1);
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds exactly 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    lanes.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    #[test]
    fn matches_dequantized_f32_matvec() {
        for (dtype, format) in [
            (GgmlDType::Q4_1, Format::Q4_1),
            (GgmlDType::Q8_0, Format::Q8_0),
        ] {
            check(dtype, format);
        }
    }

    fn check(dtype: GgmlDType, format: Format) {
        let (rows, cols) = (70, 96);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 104729 % 997) as f32 / 498.0) - 1.0)
            .collect();
        let wt = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&wt, dtype).unwrap();
        let deq = q.dequantize(&Device::Cpu).unwrap();
        let xt = Tensor::from_slice(&x, (cols, 1), &Device::Cpu).unwrap();
        let want: Vec<f32> = deq
            .matmul(&xt)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let m = Q4Matrix::new(format, &q.data().unwrap(), rows, cols).unwrap();
        let mut got = vec![0.0; rows];
        m.matvec(&x, &mut got);
        // Eleven rows of x: one register-tiled group of eight and three single rows.
        let xs: Vec<f32> = (0..11)
            .flat_map(|i| x.iter().map(move |v| v * (1.0 + i as f32 * 0.1)))
            .collect();
        let many = m.matmul_rows(&xs, 11);
        let mut scalar = vec![0.0; rows];
        for (r, s) in scalar.iter_mut().enumerate() {
            *s = if format == Format::Q4_1 {
                dot_scalar(&m.row(r), &x)
            } else {
                dot_q8_scalar(&m.row(r), &x)
            };
        }
        for i in 0..11 {
            for r in 0..rows {
                let w = want[r] * (1.0 + i as f32 * 0.1);
                let g = many[i * rows + r];
                assert!((g - w).abs() < 2e-4, "x row {i}, row {r}: {g} vs {w}");
            }
        }
        for r in 0..rows {
            assert!(
                (got[r] - want[r]).abs() < 1e-4,
                "row {r}: {} vs {}",
                got[r],
                want[r]
            );
            assert!(
                (scalar[r] - want[r]).abs() < 1e-4,
                "row {r}: {} vs {}",
                scalar[r],
                want[r]
            );
        }
    }
}
