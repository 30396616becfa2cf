//! The arithmetic of `div_by` in `kernels/adam4bit.cu` on the host: `x / d` rounded to nearest
//! from `inv_d`, the reciprocal of `d` rounded to nearest, by Markstein's correction
//! (`q = x·inv_d`, `q + (x − q·d)·inv_d` in two fmas) where `x` and `q` lie in `[2^-100, 2^100]`,
//! `x·inv_d` for zeros and the division itself elsewhere. The 4-bit kernel divides by the bias
//! corrections, the gradient scale and each block's new scales this way, and its results must
//! be the division's to the bit (the CPU kernel divides). Rust's `mul_add` is the fused
//! multiply-add the GPU's `__fmaf_rn` is.
//!
//! The test compares against `/` on random pairs of the ranges the kernel sees (a scale or bias
//! correction and values up to it in magnitude, down to 2^-40 of it) and of every exponent, and on
//! the special values; `HEADROOM_DIVISION_SAMPLES` sets the number of pairs (2e9 passed on the
//! development machine; the default keeps CI's debug build quick).

/// The kernel's `div_by`.
fn div_by(x: f32, d: f32, inv_d: f32) -> f32 {
    let q = x * inv_d;
    let (aq, ax) = (q.abs(), x.abs());
    let (low, high) = (2f32.powi(-100), 2f32.powi(100));
    if aq >= low && aq <= high && ax >= low && ax <= high {
        return (-q).mul_add(d, x).mul_add(inv_d, q);
    }
    if x == 0.0 {
        q
    } else {
        x / d
    }
}

/// xorshift64.
struct Bits(u64);

impl Bits {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// A float of exponent `low..=high` (unbiased), any mantissa, positive.
    fn float_of_exponent(&mut self, low: i32, high: i32) -> f32 {
        let span = (high - low + 1) as u64;
        let exponent = (low + (self.next() % span) as i32 + 127) as u32;
        f32::from_bits(exponent << 23 | (self.next() as u32 & 0x7f_ffff))
    }
}

fn same(want: f32, got: f32) -> bool {
    want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan())
}

#[test]
fn division_by_a_rounded_reciprocal_with_one_correction_is_the_division_to_the_bit() {
    let samples: u64 = std::env::var("HEADROOM_DIVISION_SAMPLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2_000_000);
    let mut bits = Bits(0x9e37_79b9_7f4a_7c15);
    let per_divisor = 1000;
    let mut wrong = Vec::new();
    for round in 0..samples / per_divisor {
        let d = match round % 4 {
            // Bias corrections: just below 1.
            0 => 1.0 - (bits.next() % 1_000_000) as f32 * 2f32.powi(-20) * 0.999,
            // A block's absmax or a gradient scale.
            1 => bits.float_of_exponent(-80, 40),
            2 => bits.float_of_exponent(-126, 127),
            _ => 1.0 + (bits.next() % 64) as f32 * f32::EPSILON,
        };
        let inv_d = 1.0 / d;
        for i in 0..per_divisor {
            let x = match i % 3 {
                // Up to d in magnitude, as a moment against its block's absmax.
                0 => {
                    let fraction = (bits.next() >> 40) as f32 / (1u64 << 24) as f32;
                    d * fraction * 2f32.powi(-((bits.next() % 40) as i32))
                }
                1 => bits.float_of_exponent(-60, 60),
                _ => f32::from_bits(bits.next() as u32),
            };
            let x = if bits.next() & 1 == 1 { -x } else { x };
            let (want, got) = (x / d, div_by(x, d, inv_d));
            if !same(want, got) && wrong.len() < 10 {
                wrong.push((x, d, want, got));
            }
        }
    }
    assert!(wrong.is_empty(), "x, d, x / d, div_by: {wrong:?}");
}

#[test]
fn division_by_a_rounded_reciprocal_keeps_the_special_values() {
    let values = [
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(1),
        -f32::from_bits(1),
        f32::MIN_POSITIVE,
        f32::MAX,
        -f32::MAX,
        1.0,
        -1.0,
        2f32.powi(-100),
        2f32.powi(100),
    ];
    let divisors = [
        1e-12,
        1.0,
        0.1,
        1e-3,
        1e30,
        f32::INFINITY,
        f32::NAN,
        0.0,
        f32::MIN_POSITIVE,
        2f32.powi(-100),
    ];
    for &x in &values {
        for &d in &divisors {
            assert!(same(x / d, div_by(x, d, 1.0 / d)), "{x:e} / {d:e}");
        }
    }
}
