//! The 4-bit code thresholds (`code_thresholds`, `threshold_code`) against torchao's search
//! (`code_4bit`) on both code tables: every f32 near each threshold and each table entry, the
//! special values, and 2^22 bit patterns spread over every exponent. With
//! `HEADROOM_CODE_THRESHOLDS_EXHAUSTIVE=1` (a release build: about a minute) all 2^32 patterns.
//! The CUDA kernel quantises by the thresholds, so this is what keeps its codes torchao's.

use headroom_optim::kernels::{code_4bit, code_thresholds, qmap4, threshold_code, Qmap4};
use headroom_testkit::inputs::Xorshift;

fn check(qmap: &Qmap4, thresholds: &[f32; 16], y: f32) {
    assert_eq!(
        threshold_code(thresholds, y),
        code_4bit(qmap, y),
        "y = {y:e} ({:#010x})",
        y.to_bits()
    );
}

/// The f32s within `ulps` of `x` on either side (through zero and its sign).
fn around(x: f32, ulps: i64) -> impl Iterator<Item = f32> {
    let key = |v: f32| -> i64 {
        let bits = v.to_bits() as i64;
        if bits >> 31 == 1 {
            -(bits & 0x7fff_ffff)
        } else {
            bits
        }
    };
    let centre = key(x);
    (centre - ulps..=centre + ulps).map(|k| {
        if k < 0 {
            f32::from_bits((-k) as u32 | 0x8000_0000)
        } else {
            f32::from_bits(k as u32)
        }
    })
}

#[test]
fn thresholds_give_torchao_codes() {
    for signed in [true, false] {
        let qmap = qmap4(signed);
        let thresholds = code_thresholds(&qmap);
        assert!(
            thresholds[1..].windows(2).all(|w| w[0] <= w[1]),
            "{thresholds:?}"
        );
        let midpoints = qmap.windows(2).map(|w| (w[0] + w[1]) * 0.5);
        let anchors = thresholds[1..]
            .iter()
            .chain(&qmap)
            .copied()
            .chain(midpoints);
        for anchor in anchors.collect::<Vec<_>>() {
            around(anchor, 4096).for_each(|y| check(&qmap, &thresholds, y));
        }
        let specials = [
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            f32::from_bits(1),
            f32::from_bits(0x8000_0001),
            f32::MAX,
            f32::MIN,
            1.0,
            -1.0,
        ];
        specials.iter().for_each(|&y| check(&qmap, &thresholds, y));
        let mut stream = Xorshift::from_state(0x5eed_4b17);
        for _ in 0..1 << 22 {
            check(
                &qmap,
                &thresholds,
                f32::from_bits((stream.next_u64() >> 32) as u32),
            );
        }
        if std::env::var_os("HEADROOM_CODE_THRESHOLDS_EXHAUSTIVE").is_some() {
            (0..=u32::MAX).for_each(|bits| check(&qmap, &thresholds, f32::from_bits(bits)));
        }
    }
}
