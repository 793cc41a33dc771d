//! The element types KV is stored in, and their codec.
//!
//! A block's K and V are stored as *vectors*: one token's keys (or values) for one KV head,
//! `head_dim` elements. Each dtype encodes a vector on its own, so a token's stored form never
//! depends on its neighbours, and a block cut anywhere (a breakpoint's tail) stores exactly
//! what a longer block stores for the same tokens.
//!
//! - `f32`: 4 bytes an element, little endian (exact).
//! - `f16`, `bf16`: 2 bytes an element, IEEE half / bfloat16, rounded to nearest even.
//! - `int8`: one signed byte an element, symmetric, with a per-vector scale stored as an
//!   IEEE half ahead of the elements: the smallest half at least `max|x| / 127` (at least
//!   half's smallest normal), so the absolute maximum maps to ±127.
//! - `fp8`: one FP8 E4M3 byte an element (as vLLM's `kv_cache_dtype=fp8`), with a per-vector
//!   scale `2^e` ahead (the absolute maximum maps into 224..=448, E4M3's top binade).
//!
//! Scales are chosen so that the codec is *idempotent*: a vector rounded once
//! ([`KvDtype::round_trip`]) is stored and loaded again bit for bit (an int8 element times a
//! half scale is exact in f32, and a rounded vector's maximum gives back the same scale; a
//! power of two scales fp8 exactly). The engine rounds every token's K and V as it computes
//! them and attends over the rounded values, so a cached prefix gives attention, bit for bit,
//! the values the request that computed it attended over. (The
//! tokens after the prefix are computed in another batch shape than in a full recomputation,
//! as with f32, and float noise there can move an element by one quantization step: logits
//! differ by up to ~0.03 in int8 against ~1e-5 in f32. Greedy answers agreed on every test
//! prompt and dtype: engine/tests/kv_dtypes.rs.)

use std::sync::LazyLock;

/// The element type of stored K/V.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F32,
    F16,
    Bf16,
    Int8,
    Fp8,
}

impl KvDtype {
    /// Every dtype, widest first.
    pub const ALL: [KvDtype; 5] = [
        KvDtype::F32,
        KvDtype::F16,
        KvDtype::Bf16,
        KvDtype::Int8,
        KvDtype::Fp8,
    ];

    /// The name used in configuration, block keys and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::Int8 => "int8",
            KvDtype::Fp8 => "fp8",
        }
    }

    /// Reads [`KvDtype::as_str`]'s names (`fp8_e4m3` is accepted for `fp8`).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "fp8_e4m3" => Ok(KvDtype::Fp8),
            _ => KvDtype::ALL
                .into_iter()
                .find(|d| d.as_str() == s)
                .ok_or_else(|| {
                    format!("{s:?} is not a KV dtype; available: f32, f16, bf16, int8, fp8")
                }),
        }
    }

    /// Bytes one stored vector of `head_dim` elements takes, its scale included.
    pub fn vector_bytes(self, head_dim: usize) -> usize {
        match self {
            KvDtype::F32 => 4 * head_dim,
            KvDtype::F16 | KvDtype::Bf16 => 2 * head_dim,
            KvDtype::Int8 => head_dim + 2,
            KvDtype::Fp8 => head_dim + 1,
        }
    }

    /// Round one vector in place to the values storing it keeps.
    pub fn round_trip(self, v: &mut [f32]) {
        match self {
            KvDtype::F32 => {}
            KvDtype::F16 => v
                .iter_mut()
                .for_each(|x| *x = half::f16::from_f32(*x).to_f32()),
            KvDtype::Bf16 => v
                .iter_mut()
                .for_each(|x| *x = half::bf16::from_f32(*x).to_f32()),
            KvDtype::Int8 => {
                let s = int8_scale(v).to_f32();
                v.iter_mut().for_each(|x| *x = int8(*x / s) as f32 * s);
            }
            KvDtype::Fp8 => {
                let s = pow2(scale_exp(v, FP8_MAX));
                v.iter_mut()
                    .for_each(|x| *x = FP8_VALUES[fp8(*x / s) as usize] * s);
            }
        }
    }

    /// Append one vector's stored form to `out`.
    pub fn encode(self, v: &[f32], out: &mut Vec<u8>) {
        match self {
            KvDtype::F32 => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            KvDtype::F16 => v.iter().for_each(|x| {
                out.extend_from_slice(&half::f16::from_f32(*x).to_le_bytes());
            }),
            KvDtype::Bf16 => v.iter().for_each(|x| {
                out.extend_from_slice(&half::bf16::from_f32(*x).to_le_bytes());
            }),
            KvDtype::Int8 => {
                let scale = int8_scale(v);
                let s = scale.to_f32();
                out.extend_from_slice(&scale.to_le_bytes());
                out.extend(v.iter().map(|x| int8(*x / s) as u8));
            }
            KvDtype::Fp8 => {
                let e = scale_exp(v, FP8_MAX);
                let s = pow2(e);
                out.push(e as u8);
                out.extend(v.iter().map(|x| fp8(*x / s)));
            }
        }
    }

    /// Append the vector stored in `src` (exactly [`KvDtype::vector_bytes`] long) to `out`.
    pub fn decode(self, src: &[u8], out: &mut Vec<f32>) {
        match self {
            KvDtype::F32 => out.extend(
                src.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
            KvDtype::F16 => out.extend(
                src.chunks_exact(2)
                    .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
            ),
            KvDtype::Bf16 => out.extend(
                src.chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
            ),
            KvDtype::Int8 => {
                if src.len() < 2 {
                    return;
                }
                let (scale, q) = src.split_at(2);
                let s = half::f16::from_le_bytes([scale[0], scale[1]]).to_f32();
                out.extend(q.iter().map(|&b| b as i8 as f32 * s));
            }
            KvDtype::Fp8 => {
                let Some((&e, q)) = src.split_first() else {
                    return;
                };
                let s = pow2(e as i8 as i32);
                out.extend(q.iter().map(|&b| FP8_VALUES[b as usize] * s));
            }
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

const INT8_MAX: f32 = 127.0;
/// E4M3's largest finite value.
const FP8_MAX: f32 = 448.0;

/// int8's scale for `v`: the smallest half at least `max|v| / 127`, clamped to half's
/// normal range (so a rounded vector's maximum, 127 × scale exactly, gives it back).
fn int8_scale(v: &[f32]) -> half::f16 {
    let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    let want = amax / INT8_MAX;
    if want.is_nan() || want <= half::f16::MIN_POSITIVE.to_f32() {
        // Zero, tiny, or NaN: the smallest normal scale.
        return half::f16::MIN_POSITIVE;
    }
    if want >= half::f16::MAX.to_f32() {
        return half::f16::MAX;
    }
    let s = half::f16::from_f32(want);
    if s.to_f32() >= want {
        s
    } else {
        half::f16::from_bits(s.to_bits() + 1)
    }
}

/// The smallest `e` with `max|v| / 2^e <= limit`, within the exponents a normal f32 scale
/// can have (a vector of zeros, or one too small to matter, gets the smallest).
fn scale_exp(v: &[f32], limit: f32) -> i32 {
    let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    if !amax.is_finite() || amax == 0.0 {
        return MIN_EXP;
    }
    let mut e = (amax / limit).log2().ceil() as i32;
    // log2 is not exact at every input: settle the boundary exactly.
    while e < MAX_EXP && amax / pow2(e) > limit {
        e += 1;
    }
    while e > MIN_EXP && amax / pow2(e - 1) <= limit {
        e -= 1;
    }
    e.clamp(MIN_EXP, MAX_EXP)
}

const MIN_EXP: i32 = -126;
const MAX_EXP: i32 = 127;

/// `2^e` for a normal exponent, exactly.
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e.clamp(MIN_EXP, MAX_EXP) + 127) as u32) << 23)
}

fn int8(x: f32) -> i8 {
    x.round().clamp(-INT8_MAX, INT8_MAX) as i8
}

fn fp8(x: f32) -> u8 {
    float8::F8E4M3::from_f32(x).to_bits()
}

/// Every E4M3 byte's value (decoding is a table lookup).
static FP8_VALUES: LazyLock<[f32; 256]> = LazyLock::new(|| {
    let mut t = [0f32; 256];
    for (b, v) in t.iter_mut().enumerate() {
        let x = float8::F8E4M3::from_bits(b as u8).to_f32();
        // 0x7F and 0xFF are NaN; the encoder saturates, so they never occur.
        *v = if x.is_finite() { x } else { 0.0 };
    }
    t
});

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stored(d: KvDtype, v: &[f32]) -> Vec<f32> {
        let mut bytes = Vec::new();
        d.encode(v, &mut bytes);
        assert_eq!(bytes.len(), d.vector_bytes(v.len()));
        let mut out = Vec::new();
        d.decode(&bytes, &mut out);
        out
    }

    proptest! {
        /// Storing a vector keeps exactly what rounding it keeps, and storing a rounded
        /// vector again changes nothing: cached and fresh tokens attend over the same values.
        #[test]
        fn storing_is_rounding_and_idempotent(
            v in proptest::collection::vec(-1.0e4f32..1.0e4, 1..96),
            tiny in any::<bool>(),
        ) {
            let v: Vec<f32> = if tiny { v.iter().map(|x| x * 1e-30).collect() } else { v };
            for d in KvDtype::ALL {
                let mut r = v.clone();
                d.round_trip(&mut r);
                let s = stored(d, &v);
                prop_assert_eq!(
                    s.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    r.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "{}", d
                );
                let mut again = r.clone();
                d.round_trip(&mut again);
                prop_assert_eq!(
                    stored(d, &r).iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    r.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "{} stored twice", d
                );
                prop_assert_eq!(&again, &r, "{} rounded twice", d);
                // Relative error bounded by the format's precision (per-vector scale).
                let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
                let bound = match d {
                    KvDtype::F32 => 0.0,
                    KvDtype::F16 => 1e-3 * amax + 1e-4,
                    KvDtype::Bf16 => 4e-3 * amax,
                    KvDtype::Int8 => amax / 200.0 + 4e-5,
                    KvDtype::Fp8 => amax / 14.0,
                };
                for (a, b) in v.iter().zip(&r) {
                    prop_assert!((a - b).abs() <= bound, "{} {} -> {} (bound {})", d, a, b, bound);
                }
            }
        }
    }

    #[test]
    fn names_parse_and_sizes_follow_the_dtype() {
        for d in KvDtype::ALL {
            assert_eq!(KvDtype::parse(d.as_str()), Ok(d));
        }
        assert_eq!(KvDtype::parse("fp8_e4m3"), Ok(KvDtype::Fp8));
        assert!(KvDtype::parse("int4").is_err());
        let sizes: Vec<usize> = KvDtype::ALL.iter().map(|d| d.vector_bytes(64)).collect();
        assert_eq!(sizes, vec![256, 128, 128, 66, 65]);
    }

    #[test]
    fn zeros_and_extremes_never_panic() {
        for d in KvDtype::ALL {
            for v in [
                vec![0.0; 8],
                vec![f32::MAX, -f32::MAX, 1.0],
                vec![f32::MIN_POSITIVE, 0.0],
                vec![f32::NAN, 1.0],
                vec![f32::INFINITY, 1.0],
            ] {
                let mut r = v.clone();
                d.round_trip(&mut r);
                let _ = stored(d, &v);
            }
        }
    }
}
