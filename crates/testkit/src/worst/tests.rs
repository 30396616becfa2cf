//! worst's tests: a NaN anywhere in a fold is its result and fails `worst <= bound`, as an
//! infinite difference does; without NaN the fold is the maximum.

use super::*;

#[test]
fn nan_propagates_wherever_it_is_in_the_fold() {
    for position in 0..4 {
        let mut errors = [0.5, 2.0, 1.0, 0.25];
        errors[position] = f64::NAN;
        assert!(errors.iter().copied().fold(0.0, nan_max).is_nan());
        let narrow = errors.map(|e| e as f32);
        assert!(narrow.iter().copied().fold(0.0, nan_max_f32).is_nan());
        // What the fold replaces drops it.
        assert!(!errors.iter().copied().fold(0.0, f64::max).is_nan());
    }
    assert!(nan_max(f64::NAN, 1.0).is_nan() && nan_max_f32(f32::NAN, 1.0).is_nan());
}

#[test]
fn without_nan_it_is_the_maximum_and_infinity_stays() {
    assert_eq!([0.5, 2.0, 1.0].iter().copied().fold(0.0, nan_max), 2.0);
    assert_eq!(nan_max(f64::INFINITY, 1.0), f64::INFINITY);
    assert_eq!(abs_difference(&[], &[]), 0.0);
    assert_eq!(abs_difference(&[1.0, -2.0], &[1.5, 1.0]), 3.0);
    assert_eq!(abs_difference_f32(&[1.0, -2.0], &[1.5, 1.0]), 3.0);
}

#[test]
#[allow(
    clippy::neg_cmp_op_on_partial_ord,
    reason = "the negations are what is shown"
)]
fn a_nan_or_infinite_error_fails_the_bound() {
    let bound = 1e-6;
    let worst = abs_difference(&[1.0, f64::NAN], &[1.0, 1.0]);
    assert!(
        !(worst <= bound) && !(worst < bound),
        "`worst <= bound` fails on NaN"
    );
    assert!(
        !(worst > bound),
        "the form that passes on NaN, which checks must not use"
    );
    assert!(abs_difference_f32(&[f32::NAN], &[0.0]).is_nan());
    assert!(!(abs_difference(&[f64::INFINITY], &[1.0]) <= bound));
    assert!(!(abs_difference(&[f64::INFINITY], &[f64::INFINITY]) <= bound));
}

#[test]
fn slices_of_different_lengths_are_a_failure() {
    assert!(std::panic::catch_unwind(|| abs_difference(&[1.0], &[1.0, 2.0])).is_err());
    assert!(std::panic::catch_unwind(|| abs_difference_f32(&[1.0, 2.0], &[1.0])).is_err());
}
