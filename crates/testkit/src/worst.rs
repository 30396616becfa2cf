//! The worst of a comparison's errors, keeping NaN: the reductions a test folds its differences
//! (or its relative errors, or a scale over values the code under test produced) with before it
//! holds the result to a tolerance.
//!
//! `f64::max` and `f32::max` return the other operand when one is NaN, so
//! `errors.fold(0.0, f64::max)` drops every NaN error: a kernel returning NaN gives a worst error
//! of 0 and passes `assert!(worst <= bound)`. [`nan_max`] (and [`nan_max_f32`]) is the same fold
//! step, except that a NaN on either side is the result, and stays the result for the rest of
//! the fold; an infinite error stays infinite, as with `f64::max`. Then `worst <= bound` is
//! false, and the assertion fails.
//!
//! ```
//! use headroom_testkit::worst::{abs_difference, nan_max};
//!
//! let (ours, theirs) = ([1.0, f64::NAN, 3.0], [1.0, 2.0, 3.0]);
//! let blind = ours.iter().zip(&theirs).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
//! assert_eq!(blind, 0.0); // what the NaN-blind fold reports
//! let worst = ours.iter().zip(&theirs).map(|(a, b)| (a - b).abs()).fold(0.0, nan_max);
//! assert!(worst.is_nan());
//! assert!(!(worst <= 1e-6)); // so `assert!(worst <= bound)` fails
//! assert!(abs_difference(&ours, &theirs).is_nan());
//! ```
//!
//! Write the check as `assert!(worst <= bound)` (or `<`): false for NaN. `assert!(!(worst >
//! bound))` and `if worst > bound { fail }` pass on NaN.

/// The larger of `m` and `x`, or NaN where either is NaN: a fold step (`.fold(0.0, nan_max)`)
/// for errors that must not drop a NaN (see the module's documentation).
pub fn nan_max(m: f64, x: f64) -> f64 {
    if x.is_nan() || x > m {
        x
    } else {
        m
    }
}

/// [`nan_max`] for f32.
pub fn nan_max_f32(m: f32, x: f32) -> f32 {
    if x.is_nan() || x > m {
        x
    } else {
        m
    }
}

/// `max |a - b|` position by position (0 for empty slices), NaN where any difference is NaN.
/// Panics when the lengths differ: that is a failed comparison, not a difference.
pub fn abs_difference(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "compared slices differ in length");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, nan_max)
}

/// [`abs_difference`] for f32.
pub fn abs_difference_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "compared slices differ in length");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, nan_max_f32)
}

#[cfg(test)]
mod tests;
