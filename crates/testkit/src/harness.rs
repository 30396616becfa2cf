//! The central check: training with a technique gives the parameters training without it gives.
//!
//! [`check_technique`] trains a case twice from the same initial weights and batches — with
//! [`Baseline`], then with the technique — and compares every parameter by name under the case's
//! [`Tolerance`]. A failure names the parameter, the element, both values and their distance in
//! ulps; the report carries both runs' per-step losses.

use std::fmt;

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_nn::Module;

use crate::case::{Tolerance, TrainCase};
use crate::inputs::Xorshift;
use crate::technique::{Baseline, Technique, TrainRun};
use crate::Result;

/// What a run of a case leaves behind.
#[derive(Debug)]
pub struct Trained {
    /// Every parameter after the last step, by name, in the model's order.
    pub parameters: Vec<(String, Tensor)>,
    /// The loss of each step.
    pub losses: Vec<f64>,
}

/// A technique that passed [`check_technique`], and how close it came.
#[derive(Debug, Clone, PartialEq)]
pub struct TechniqueReport {
    /// The case's name.
    pub case: &'static str,
    /// The technique's name.
    pub technique: String,
    /// The plain loop's loss at each step.
    pub baseline_losses: Vec<f64>,
    /// The technique's loss at each step.
    pub technique_losses: Vec<f64>,
    /// The largest distance in ulps between the two runs over every element of every parameter.
    pub max_ulps: u64,
    /// The largest per-parameter relative error (`max |Δ| / max |baseline|`).
    pub max_relative: f64,
}

/// Why the harness failed a run (errors of the model, the optimizer or the technique pass
/// through as they are).
#[derive(Debug, Clone, PartialEq)]
pub enum HarnessError {
    /// A parameter is not within the case's tolerance of the baseline's.
    Mismatch {
        /// The case's name.
        case: &'static str,
        /// The technique's name.
        technique: String,
        /// The tolerance that was not met.
        tolerance: Tolerance,
        /// The first parameter (in the model's order) outside the tolerance.
        parameter: String,
        /// Its element farthest from the baseline, row-major.
        index: usize,
        /// That element after the plain loop.
        baseline: f64,
        /// That element after the technique.
        value: f64,
        /// Their distance in units in the last place of the parameter's dtype (`u64::MAX`
        /// when one is NaN).
        ulps: u64,
        /// The parameter's relative error (`max |Δ| / max |baseline|`).
        relative: f64,
        /// Parameters outside the tolerance.
        n_differ: usize,
        /// Parameters compared.
        n_parameters: usize,
    },
    /// The technique's run ended with other parameter names or shapes than the baseline's.
    Parameters {
        /// The case's name.
        case: &'static str,
        /// The technique's name.
        technique: String,
        /// The first difference.
        detail: String,
    },
    /// The plain loop produced a non-finite loss or parameter: the case proves nothing.
    Diverged {
        /// The case's name.
        case: &'static str,
        /// What went non-finite.
        detail: String,
    },
    /// [`TrainRun::optimizer_mut`] after the technique took the optimizer.
    OptimizerTaken,
}

/// Trains `case` on `backend` with `technique`: builds the model and the case's optimizer,
/// calls [`Technique::prepare`], one [`Technique::step`] per batch, [`Technique::finish`].
pub fn train(
    backend: &BackendRef,
    case: &TrainCase,
    technique: &mut dyn Technique,
) -> Result<Trained> {
    let model = case.build_model(backend)?;
    let optimizer = case.optimizer.build(model.parameters())?;
    let mut run = TrainRun {
        backend: backend.clone(),
        model,
        optimizer: Some(optimizer),
        optim_spec: case.optimizer.clone(),
        step: 0,
    };
    technique.prepare(&mut run)?;
    let mut random = Xorshift::new(case.seed);
    let mut losses = Vec::with_capacity(case.steps);
    for step in 0..case.steps {
        let batch = case
            .model
            .batch(backend, case.dtype, case.batch, &mut random)?;
        run.step = step;
        let loss = technique.step(&mut run, &batch)?;
        losses.push(loss.item()?);
    }
    technique.finish(&mut run)?;
    Ok(Trained {
        parameters: run.model.named_parameters(),
        losses,
    })
}

/// Trains `case` with [`Baseline`] and with `technique` from the same weights and batches, and
/// checks every parameter against the case's tolerance. An `Err` holding a
/// [`HarnessError::Mismatch`] names the first parameter outside it.
pub fn check_technique(
    backend: &BackendRef,
    case: &TrainCase,
    technique: &mut dyn Technique,
) -> Result<TechniqueReport> {
    let baseline = train(backend, case, &mut Baseline)?;
    check_finite(case, &baseline)?;
    let trained = train(backend, case, technique)?;
    let name = technique.name().to_owned();
    let (max_ulps, max_relative) = compare(case, &name, &baseline, &trained)?;
    Ok(TechniqueReport {
        case: case.name,
        technique: name,
        baseline_losses: baseline.losses,
        technique_losses: trained.losses,
        max_ulps,
        max_relative,
    })
}

/// One element as the comparison sees it.
#[derive(Debug, Clone, Copy)]
struct Element {
    value: f64,
    bits: u64,
    /// The bits as a signed magnitude, so that neighbouring floats are neighbouring integers.
    ordered: i64,
}

/// How one parameter compares: its worst element and its relative error.
#[derive(Debug)]
struct ParameterDiff {
    index: usize,
    baseline: f64,
    value: f64,
    ulps: u64,
    relative: f64,
    within: bool,
}

fn check_finite(case: &TrainCase, baseline: &Trained) -> Result<()> {
    let diverged = |detail: String| HarnessError::Diverged {
        case: case.name,
        detail,
    };
    if let Some(step) = baseline.losses.iter().position(|loss| !loss.is_finite()) {
        let loss = baseline.losses[step];
        return Err(diverged(format!("the loss of step {step} is {loss}")).into());
    }
    for (name, tensor) in &baseline.parameters {
        if let Some(index) = tensor.to_vec_f64()?.iter().position(|v| !v.is_finite()) {
            return Err(
                diverged(format!("parameter `{name}` element {index} is not finite")).into(),
            );
        }
    }
    Ok(())
}

/// The largest ulps and relative error over all parameters, or the first mismatch.
fn compare(
    case: &TrainCase,
    technique: &str,
    baseline: &Trained,
    trained: &Trained,
) -> Result<(u64, f64)> {
    let parameters_differ = |detail: String| HarnessError::Parameters {
        case: case.name,
        technique: technique.to_owned(),
        detail,
    };
    if baseline.parameters.len() != trained.parameters.len() {
        let (ours, theirs) = (baseline.parameters.len(), trained.parameters.len());
        return Err(parameters_differ(format!("{theirs} parameters, not {ours}")).into());
    }
    let (mut max_ulps, mut max_relative) = (0u64, 0f64);
    let mut first: Option<(&str, ParameterDiff)> = None;
    let mut n_differ = 0;
    for ((name, ours), (their_name, theirs)) in baseline.parameters.iter().zip(&trained.parameters)
    {
        if name != their_name || ours.shape() != theirs.shape() {
            return Err(parameters_differ(format!(
                "`{their_name}` {:?} where the baseline has `{name}` {:?}",
                theirs.shape(),
                ours.shape()
            ))
            .into());
        }
        let diff = compare_parameter(&elements(ours)?, &elements(theirs)?, case.tolerance);
        max_ulps = max_ulps.max(diff.ulps);
        max_relative = max_relative.max(diff.relative);
        if !diff.within {
            n_differ += 1;
            first.get_or_insert((name, diff));
        }
    }
    let Some((parameter, diff)) = first else {
        return Ok((max_ulps, max_relative));
    };
    Err(HarnessError::Mismatch {
        case: case.name,
        technique: technique.to_owned(),
        tolerance: case.tolerance,
        parameter: parameter.to_owned(),
        index: diff.index,
        baseline: diff.baseline,
        value: diff.value,
        ulps: diff.ulps,
        relative: diff.relative,
        n_differ,
        n_parameters: baseline.parameters.len(),
    }
    .into())
}

/// The worst element of one parameter (by ulps, or by |Δ| for a relative tolerance) and whether
/// the parameter is within `tolerance`.
fn compare_parameter(ours: &[Element], theirs: &[Element], tolerance: Tolerance) -> ParameterDiff {
    let mut worst = ParameterDiff {
        index: 0,
        baseline: ours.first().map_or(0.0, |e| e.value),
        value: theirs.first().map_or(0.0, |e| e.value),
        ulps: 0,
        relative: 0.0,
        within: true,
    };
    let (mut scale, mut max_diff, mut worst_diff) = (0f64, 0f64, -1f64);
    let mut bits_differ = false;
    for (index, (a, b)) in ours.iter().zip(theirs).enumerate() {
        scale = scale.max(a.value.abs());
        let ulps = ulp_distance(*a, *b);
        let diff = if ulps == u64::MAX {
            f64::INFINITY
        } else {
            (a.value - b.value).abs()
        };
        max_diff = max_diff.max(diff);
        bits_differ |= a.bits != b.bits;
        let key = match tolerance {
            Tolerance::Relative { .. } => diff,
            Tolerance::Bitwise { .. } | Tolerance::Ulps { .. } => ulps as f64,
        };
        if key > worst_diff {
            worst_diff = key;
            worst = ParameterDiff {
                index,
                baseline: a.value,
                value: b.value,
                ulps,
                ..worst
            };
        }
    }
    worst.relative = if max_diff == 0.0 {
        0.0
    } else if scale == 0.0 || max_diff.is_infinite() {
        f64::INFINITY
    } else {
        max_diff / scale
    };
    worst.within = match tolerance {
        Tolerance::Bitwise { .. } => !bits_differ,
        Tolerance::Ulps { max, .. } => worst.ulps <= max,
        Tolerance::Relative { max, .. } => worst.relative <= max,
    };
    worst
}

/// Distance in ulps: 0 for the same bits (and for +0 against -0), `u64::MAX` when exactly one
/// side is NaN or their NaN bits differ.
fn ulp_distance(a: Element, b: Element) -> u64 {
    if a.bits == b.bits {
        0
    } else if a.value.is_nan() || b.value.is_nan() {
        u64::MAX
    } else {
        a.ordered.abs_diff(b.ordered)
    }
}

/// A floating-point tensor's elements with their bits, read in the tensor's own dtype.
fn elements(tensor: &Tensor) -> Result<Vec<Element>> {
    Ok(match tensor.dtype() {
        DType::F32 => tensor
            .to_vec::<f32>()?
            .into_iter()
            .map(|v| element(v.into(), v.to_bits().into(), 32))
            .collect(),
        DType::F64 => tensor
            .to_vec::<f64>()?
            .into_iter()
            .map(|v| element(v, v.to_bits(), 64))
            .collect(),
        DType::F16 => tensor
            .to_vec::<half::f16>()?
            .into_iter()
            .map(|v| element(v.into(), v.to_bits().into(), 16))
            .collect(),
        DType::BF16 => tensor
            .to_vec::<half::bf16>()?
            .into_iter()
            .map(|v| element(v.into(), v.to_bits().into(), 16))
            .collect(),
        dtype => return Err(format!("a {dtype:?} parameter cannot be compared in ulps").into()),
    })
}

/// An element of a float type `width` bits wide.
fn element(value: f64, bits: u64, width: u32) -> Element {
    let sign = 1u64 << (width - 1);
    let magnitude = (bits & (sign - 1)) as i64;
    let ordered = if bits & sign == 0 {
        magnitude
    } else {
        -magnitude
    };
    Element {
        value,
        bits,
        ordered,
    }
}

impl fmt::Display for HarnessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HarnessError::Mismatch {
                case,
                technique,
                tolerance,
                parameter,
                index,
                baseline,
                value,
                ulps,
                relative,
                n_differ,
                n_parameters,
            } => {
                let distance = if *ulps == u64::MAX {
                    "not comparable (NaN)".to_owned()
                } else {
                    format!("{ulps} ulps apart")
                };
                write!(
                    f,
                    "case `{case}`: `{technique}` is not within {tolerance} of the baseline: \
                     parameter `{parameter}` element {index}: baseline {baseline:e}, \
                     {technique} {value:e}, {distance} (the parameter's relative error \
                     {relative:e}); {n_differ} of {n_parameters} parameters differ"
                )
            }
            HarnessError::Parameters {
                case,
                technique,
                detail,
            } => write!(
                f,
                "case `{case}`: `{technique}` changed the parameters: {detail}"
            ),
            HarnessError::Diverged { case, detail } => write!(
                f,
                "case `{case}`: the baseline diverged ({detail}), so it proves nothing"
            ),
            HarnessError::OptimizerTaken => write!(
                f,
                "the technique took the optimizer, so the plain step cannot use it"
            ),
        }
    }
}

impl std::error::Error for HarnessError {}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(values: &[f32]) -> Vec<Element> {
        values
            .iter()
            .map(|&v| element(v.into(), v.to_bits().into(), 32))
            .collect()
    }

    const BITWISE: Tolerance = Tolerance::Bitwise { why: "test" };

    #[test]
    fn ulps_count_neighbouring_floats_across_zero() {
        let tiny = f32::from_bits(1);
        let [a, b, c, d, e] = f32s(&[1.0, 1.0 + f32::EPSILON, -tiny, tiny, -0.0])[..] else {
            unreachable!()
        };
        assert_eq!(ulp_distance(a, b), 1);
        assert_eq!(ulp_distance(c, d), 2);
        assert_eq!(ulp_distance(e, f32s(&[0.0])[0]), 0);
        assert_eq!(ulp_distance(a, f32s(&[f32::NAN])[0]), u64::MAX);
    }

    #[test]
    fn each_tolerance_judges_the_worst_element() {
        let ours = f32s(&[1.0, -2.0, 4.0]);
        let theirs = f32s(&[1.0, -2.0 - 2.0 * f32::EPSILON, 4.0]);
        let diff = compare_parameter(&ours, &theirs, BITWISE);
        assert!(!diff.within);
        assert_eq!((diff.index, diff.ulps), (1, 1));
        let ulps = |max| Tolerance::Ulps { max, why: "test" };
        assert!(compare_parameter(&ours, &theirs, ulps(1)).within);
        assert!(!compare_parameter(&ours, &theirs, ulps(0)).within);
        let relative = |max| Tolerance::Relative { max, why: "test" };
        let diff = compare_parameter(&ours, &theirs, relative(1e-6));
        assert!(diff.within);
        assert_eq!(diff.relative, 2.0 * f64::from(f32::EPSILON) / 4.0);
        assert!(!compare_parameter(&ours, &theirs, relative(1e-8)).within);
        // Signed zeros are one value to ulps and relative error, two to bitwise equality.
        let zeros = (f32s(&[0.0]), f32s(&[-0.0]));
        assert!(!compare_parameter(&zeros.0, &zeros.1, BITWISE).within);
        assert!(compare_parameter(&zeros.0, &zeros.1, ulps(0)).within);
    }
}
