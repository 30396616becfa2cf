//! How far apart two f32 results are, in units in the last place: the distance along the f32
//! number line (the bits ordered so that `-0.0` sits just below `+0.0`), 0 only for the same
//! bits — or two NaNs, whatever their payload — and `u32::MAX` when exactly one side is NaN.
//! The technique harness compares whole parameter sets itself (in their own dtypes); these are
//! for tests that compare two runs' f32 values directly.

/// The distance between `a` and `b` in ulps (see the module's documentation).
///
/// ```
/// use headroom_testkit::ulps::ulps;
///
/// assert_eq!(ulps(1.0, 1.0), 0);
/// assert_eq!(ulps(1.0, f32::from_bits(1.0f32.to_bits() + 3)), 3);
/// assert_eq!(ulps(0.0, -0.0), 1);
/// assert_eq!(ulps(f32::from_bits(1), -f32::from_bits(1)), 3);
/// assert_eq!(ulps(f32::NAN, -f32::NAN), 0);
/// assert_eq!(ulps(f32::NAN, 1.0), u32::MAX);
/// ```
pub fn ulps(a: f32, b: f32) -> u32 {
    if a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()) {
        0
    } else if a.is_nan() || b.is_nan() {
        u32::MAX
    } else {
        u32::try_from(ordered(a).abs_diff(ordered(b))).unwrap_or(u32::MAX)
    }
}

/// The largest [`ulps`] between the elements of `a` and `b`, position by position (0 for empty
/// slices). Panics when the lengths differ: that is a failed comparison, not a distance.
pub fn max_ulps(a: &[f32], b: &[f32]) -> u32 {
    assert_eq!(a.len(), b.len(), "compared slices differ in length");
    a.iter()
        .zip(b)
        .map(|(&x, &y)| ulps(x, y))
        .max()
        .unwrap_or(0)
}

/// `x`'s position on the f32 number line: consecutive floats are consecutive integers, and
/// `-0.0` is one below `+0.0`.
fn ordered(x: f32) -> i64 {
    let bits = x.to_bits();
    let magnitude = i64::from(bits & 0x7fff_ffff);
    if bits >> 31 == 1 {
        -magnitude - 1
    } else {
        magnitude
    }
}
