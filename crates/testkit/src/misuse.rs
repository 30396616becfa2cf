//! The misuse suites' checker: a table of named cases, each a function that calls an API the
//! wrong way and checks its answer (a typed error, or an exact checked result), run together so
//! that one run reports every broken case.
//!
//! A case that panics fails like one that returns an error (a user's bad input must never
//! panic). Cases listed as known bugs must fail, so fixing a bug fails the suite until its entry
//! goes. It knows nothing of the APIs under test.

use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// A named misuse and the check of the API's answer: `Ok` when the API answered as it must,
/// else what it did instead.
#[derive(Debug, Clone, Copy)]
pub struct MisuseCase<E> {
    /// The case's name, unique in its suite (`adam_with_negative_lr_is_invalid_argument`).
    pub name: &'static str,
    /// The misuse and its check.
    pub run: fn() -> Result<(), E>,
}

/// A table of [`MisuseCase`]s, one `name => check` row each: the name is the case's (an
/// identifier, so a row reads as a sentence: `adam_with_negative_lr_is_invalid_argument =>
/// refused(..)`), the check an expression (a block where it needs statements) returning the
/// case's outcome.
///
/// ```
/// use headroom_testkit::misuse::{check_misuse, MisuseCase};
/// use headroom_testkit::misuse_cases;
///
/// let cases: Vec<MisuseCase<String>> = misuse_cases![
///     parsing_a_word_as_a_number_is_an_error => match "seven".parse::<u32>() {
///         Err(_) => Ok(()),
///         Ok(n) => Err(format!("parsed {n}")),
///     },
///     zero_has_no_inverse => {
///         let inverse = 1u32.checked_div(0);
///         if inverse.is_none() { Ok(()) } else { Err("divided by zero".to_owned()) }
///     },
/// ];
/// assert_eq!(cases[1].name, "zero_has_no_inverse");
/// check_misuse(&cases, &[], 2);
/// ```
#[macro_export]
macro_rules! misuse_cases {
    ($($name:ident => $check:expr),* $(,)?) => {
        vec![$($crate::misuse::MisuseCase { name: stringify!($name), run: || $check }),*]
    };
}

/// Runs every case in table order, each under `catch_unwind`, and panics once naming every
/// failure: a case not in `known_bugs` that fails or panics, or one in it that passes (its bug
/// was fixed). Also panics on duplicate names, on a known bug that names no case, and on fewer
/// than `min_cases` cases (a case lost from the table).
pub fn check_misuse<E: Display>(cases: &[MisuseCase<E>], known_bugs: &[&str], min_cases: usize) {
    let mut names: Vec<&str> = cases.iter().map(|case| case.name).collect();
    names.sort_unstable();
    let duplicates: Vec<&str> = names
        .windows(2)
        .filter(|pair| pair[0] == pair[1])
        .map(|pair| pair[0])
        .collect();
    assert!(duplicates.is_empty(), "cases named twice: {duplicates:?}");
    for bug in known_bugs {
        assert!(names.contains(bug), "the known bugs name no case {bug}");
    }
    assert!(
        cases.len() >= min_cases,
        "{} cases, at least {min_cases} expected",
        cases.len()
    );
    let mut failures = Vec::new();
    for case in cases {
        let outcome = match catch_unwind(AssertUnwindSafe(case.run)) {
            Ok(outcome) => outcome.map_err(|err| err.to_string()),
            Err(payload) => Err(format!("panicked: {}", panic_message(&*payload))),
        };
        match (outcome, known_bugs.contains(&case.name)) {
            (Ok(()), false) => {}
            (Ok(()), true) => failures.push(format!(
                "{}: passes, but is listed as a known bug (remove it: the bug is fixed)",
                case.name
            )),
            (Err(err), false) => failures.push(format!("{}: {err}", case.name)),
            (Err(err), true) => println!("known bug {}: {err}", case.name),
        }
    }
    println!(
        "{} misuse cases, {} known bugs",
        cases.len(),
        known_bugs.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} misuse cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// The text of a panic's payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "a non-string payload".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fine() -> Result<(), String> {
        Ok(())
    }

    fn broken() -> Result<(), String> {
        Err("answered 0".into())
    }

    fn panics() -> Result<(), String> {
        panic!("index out of bounds")
    }

    fn failure_of(cases: &[MisuseCase<String>], known: &[&str]) -> String {
        let payload = catch_unwind(|| check_misuse(cases, known, 1)).expect_err("must fail");
        panic_message(&*payload)
    }

    #[test]
    fn failures_panics_and_fixed_bugs_are_all_named() {
        let cases = [
            MisuseCase {
                name: "fine",
                run: fine,
            },
            MisuseCase {
                name: "broken",
                run: broken,
            },
            MisuseCase {
                name: "panics",
                run: panics,
            },
            MisuseCase {
                name: "fixed",
                run: fine,
            },
        ];
        let message = failure_of(&cases, &["fixed"]);
        assert_eq!(
            message,
            "3 of 4 misuse cases failed:\nbroken: answered 0\npanics: panicked: index out of \
             bounds\nfixed: passes, but is listed as a known bug (remove it: the bug is fixed)"
        );
        check_misuse(&cases[..1], &[], 1);
        check_misuse(
            &[MisuseCase {
                name: "bug",
                run: broken,
            }],
            &["bug"],
            1,
        );
    }

    #[test]
    fn duplicate_names_and_lost_cases_fail() {
        let twice = [
            MisuseCase {
                name: "a",
                run: fine,
            },
            MisuseCase {
                name: "a",
                run: fine,
            },
        ];
        assert!(failure_of(&twice, &[]).contains("cases named twice"));
        let payload = catch_unwind(|| check_misuse(&twice[..1], &[], 2)).unwrap_err();
        assert_eq!(panic_message(&*payload), "1 cases, at least 2 expected");
    }
}
