//! The fused `linear_cross_entropy` and the unfused `cross_entropy(linear(..))` on the CPU
//! backend against PyTorch: `testdata/linear_cross_entropy_golden.safetensors` (made by
//! `scripts/golden/linear_cross_entropy.py`, provenance in `testdata/README.md`) holds
//! `F.cross_entropy(hidden @ weightᵀ + bias, labels, ignore_index, reduction, label_smoothing)`
//! plus PaLM's z-loss (`z_loss · lse²` per token not ignored, combined by the same reduction),
//! its value and torch autograd's gradients of hidden, weight and bias, in f64, for a head of 37
//! tokens × 16 features × 301 classes with a bias: every reduction (mean, sum, none) × label
//! smoothing (0, 0.1, 1) × z-loss (0, 0.001) with `ignore_index` −100 (5 of the 37 tokens
//! ignored, 3 labelled 7), and two cases with `ignore_index` 7, a valid class, on labels whose
//! 8 tokens of class 7 are ignored (mean with 0.1 and 0.001, sum with neither). For
//! `reduction: None` the gradients are of `Σ loss_i · w_i` (`w_i = 0.5 + i / 10`, the file's
//! `input.loss_weights`), and ignored tokens must have a loss and a hidden gradient of exactly 0.
//!
//! Every case runs in f64 and in f32 (the inputs cast), each with the default chunk budget
//! (64 MiB: the whole head in one tile) and with `chunk_bytes: 1` (one row a block and 256
//! classes a tile, the op's floor: 37 blocks × 2 tiles, the second one 45 classes wide). The
//! unfused op runs the cases its options can express (no smoothing, no z-loss, mean or sum).
//!
//! The metric, per tensor (the loss, the gradients of hidden, weight and bias):
//! `max |ours − torch| / max |torch|` (`headroom_testkit::golden::relative_error`). Bounds and
//! the worst errors measured over all cases and both budgets (2 rayon threads, debug build):
//!
//! | run | bound: loss | bound: gradients | measured: loss | measured: gradients |
//! |---|---|---|---|---|
//! | fused, f64 (20 cases × 2 budgets) | 1e-12 | 1e-12 | 4.5e-16 | 8.6e-16 (dhidden) |
//! | unfused, f64 (3 cases) | 1e-12 | 1e-12 | 1.2e-16 | 4.6e-16 (dhidden) |
//! | fused, f32 (20 cases × 2 budgets) | 1e-6 | 3e-6 | 1.1e-7 | 7.6e-7 (dhidden) |
//! | unfused, f32 (3 cases) | 1e-6 | 3e-6 | 2.5e-8 | 4.7e-7 (dhidden) |
//!
//! On the three cases both ops run, fused and unfused have the same errors in f64 and, for the
//! gradients of hidden and weight, in f32. The f32 errors are f32 arithmetic's, of PyTorch's
//! order: casting the inputs to f32 alone moves torch's f64 result of `mean.ls0.z0.ignore-100`
//! by at most 5.1e-8, and PyTorch's own f32 run of that case is 9.5e-8 (loss), 4.2e-7
//! (dhidden), 1.6e-7 (dweight) and 6.4e-8 (dbias) from its f64 (ours: 2.5e-8, 4.7e-7, 2.3e-7,
//! 1.4e-7).
//!
//! Per case, the fused op's worst of the two budgets (the `sum` rows with `ignore_index` −100
//! are left out: they have the `mean` rows' relative errors, one loss being the other scaled by
//! the 32 tokens not ignored):
//!
//! | case | f64: loss | f64: dh, dW, db | f32: loss | f32: dh, dW, db |
//! |---|---|---|---|---|
//! | `mean.ls0.z0.ignore-100` | 1.1e-16 | 3.0e-16, 2.2e-16, 1.1e-16 | 2.5e-8 | 4.7e-7, 2.3e-7, 1.4e-7 |
//! | `mean.ls0.z0.001.ignore-100` | 2.2e-16 | 3.6e-16, 2.5e-16, 1.9e-16 | 8.0e-8 | 6.5e-7, 3.1e-7, 1.7e-7 |
//! | `mean.ls0.1.z0.ignore-100` | 4.5e-16 | 4.0e-16, 3.6e-16, 1.7e-16 | 4.6e-8 | 5.2e-7, 2.5e-7, 2.0e-7 |
//! | `mean.ls0.1.z0.001.ignore-100` | 2.2e-16 | 3.9e-16, 2.4e-16, 2.5e-16 | 5.0e-8 | 5.4e-7, 2.2e-7, 1.3e-7 |
//! | `mean.ls1.z0.ignore-100` | 2.3e-16 | 8.6e-16, 6.1e-16, 7.7e-16 | 1.0e-7 | 5.2e-7, 5.0e-7, 2.9e-7 |
//! | `mean.ls1.z0.001.ignore-100` | 1.1e-16 | 6.3e-16, 6.0e-16, 7.5e-16 | 2.4e-8 | 5.5e-7, 2.6e-7, 2.5e-7 |
//! | `none.ls0.z0.ignore-100` | 1.1e-16 | 5.4e-16, 2.4e-16, 2.2e-16 | 9.4e-8 | 5.9e-7, 2.1e-7, 1.9e-7 |
//! | `none.ls0.z0.001.ignore-100` | 2.2e-16 | 4.0e-16, 3.2e-16, 2.5e-16 | 1.1e-7 | 5.2e-7, 3.5e-7, 2.3e-7 |
//! | `none.ls0.1.z0.ignore-100` | 2.3e-16 | 6.2e-16, 3.6e-16, 2.8e-16 | 8.4e-8 | 6.8e-7, 3.9e-7, 2.8e-7 |
//! | `none.ls0.1.z0.001.ignore-100` | 2.3e-16 | 6.8e-16, 3.6e-16, 2.8e-16 | 9.6e-8 | 7.6e-7, 2.5e-7, 2.5e-7 |
//! | `none.ls1.z0.ignore-100` | 2.5e-16 | 4.7e-16, 2.6e-16, 2.1e-16 | 8.9e-8 | 7.6e-7, 4.8e-7, 4.6e-7 |
//! | `none.ls1.z0.001.ignore-100` | 2.4e-16 | 4.2e-16, 4.0e-16, 3.6e-16 | 1.1e-7 | 5.2e-7, 4.3e-7, 2.8e-7 |
//! | `mean.ls0.1.z0.001.ignore7` | 3.4e-16 | 4.9e-16, 4.4e-16, 3.8e-16 | 4.9e-8 | 3.8e-7, 2.5e-7, 2.0e-7 |
//! | `sum.ls0.z0.ignore7` | 1.2e-16 | 4.6e-16, 2.2e-16, 3.1e-16 | 4.9e-8 | 4.2e-7, 2.0e-7, 2.4e-7 |

use std::collections::HashMap;

use headroom_autograd_core::{
    cross_entropy, linear_cross_entropy, BackendRef, BackwardOptions, DType,
    LinearCrossEntropyOptions, Reduction, Tensor,
};
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::golden::{relative_error, testdata};
use headroom_testkit::worst::nan_max;
use safetensors::{Dtype, SafeTensors};

/// Bounds on a run's relative errors: of the loss, and of each gradient.
#[derive(Debug, Clone, Copy)]
struct Bounds {
    loss: f64,
    gradients: f64,
}

/// An f64 run's bounds.
const F64_BOUNDS: Bounds = Bounds {
    loss: 1e-12,
    gradients: 1e-12,
};

/// An f32 run's bounds: the gradients' a few times the worst measured (7.6e-7).
const F32_BOUNDS: Bounds = Bounds {
    loss: 1e-6,
    gradients: 3e-6,
};

/// The two chunk budgets: the default (one tile) and 1 byte (the smallest tiles).
const BUDGETS: [(&str, usize); 2] = [("default", 64 << 20), ("1 B", 1)];

/// One case of the golden file: the options torch's loss was computed with.
#[derive(Debug, Clone, Copy)]
struct Case {
    reduction: Option<Reduction>,
    label_smoothing: f64,
    z_loss: f64,
    ignore_index: i64,
}

impl Case {
    /// The file's cases, in its order.
    fn all() -> Vec<Case> {
        let mut cases = Vec::new();
        for reduction in [Some(Reduction::Mean), Some(Reduction::Sum), None] {
            for label_smoothing in [0.0, 0.1, 1.0] {
                for z_loss in [0.0, 1e-3] {
                    cases.push(Case {
                        reduction,
                        label_smoothing,
                        z_loss,
                        ignore_index: -100,
                    });
                }
            }
        }
        cases.push(Case {
            reduction: Some(Reduction::Mean),
            label_smoothing: 0.1,
            z_loss: 1e-3,
            ignore_index: 7,
        });
        cases.push(Case {
            reduction: Some(Reduction::Sum),
            label_smoothing: 0.0,
            z_loss: 0.0,
            ignore_index: 7,
        });
        cases
    }

    /// The file's name for the case, `<reduction>.ls<ε>.z<z_loss>.ignore<index>`.
    fn name(&self) -> String {
        let reduction = match self.reduction {
            Some(Reduction::Mean) => "mean",
            Some(Reduction::Sum) => "sum",
            None => "none",
        };
        format!(
            "{reduction}.ls{}.z{}.ignore{}",
            self.label_smoothing, self.z_loss, self.ignore_index
        )
    }

    fn labels_key(&self) -> &'static str {
        if self.ignore_index == -100 {
            "input.labels"
        } else {
            "input.labels_ignore7"
        }
    }

    fn options(&self, chunk_bytes: usize) -> LinearCrossEntropyOptions {
        LinearCrossEntropyOptions {
            ignore_index: self.ignore_index,
            reduction: self.reduction,
            label_smoothing: self.label_smoothing,
            z_loss: self.z_loss,
            chunk_bytes,
        }
    }
}

/// The golden file's tensors (f64 and i64 values with their shapes) and its metadata.
struct Golden {
    floats: HashMap<String, (Vec<usize>, Vec<f64>)>,
    ints: HashMap<String, (Vec<usize>, Vec<i64>)>,
    metadata: HashMap<String, String>,
}

impl Golden {
    fn load() -> Golden {
        let bytes = testdata("linear_cross_entropy_golden.safetensors");
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let (mut floats, mut ints) = (HashMap::new(), HashMap::new());
        for (name, view) in file.tensors() {
            let shape = view.shape().to_vec();
            let words = view.data().chunks_exact(8).map(|b| b.try_into().unwrap());
            match view.dtype() {
                Dtype::F64 => {
                    floats.insert(name, (shape, words.map(f64::from_le_bytes).collect()));
                }
                Dtype::I64 => {
                    ints.insert(name, (shape, words.map(i64::from_le_bytes).collect()));
                }
                other => panic!("{name}: unexpected dtype {other:?}"),
            }
        }
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        let metadata = header.metadata().clone().expect("a metadata header");
        Golden {
            floats,
            ints,
            metadata,
        }
    }

    /// The f64 tensor `name` as a tensor of `dtype`.
    fn tensor(&self, cpu: &BackendRef, name: &str, dtype: DType) -> Tensor {
        let (shape, values) = self.floats.get(name).unwrap_or_else(|| panic!("no {name}"));
        Tensor::from_f64s(cpu, values, shape, dtype).unwrap()
    }

    /// `name` as a leaf of `dtype` that requires grad.
    fn leaf(&self, cpu: &BackendRef, name: &str, dtype: DType) -> Tensor {
        let leaf = self.tensor(cpu, name, dtype);
        leaf.requires_grad_(true).unwrap();
        leaf
    }

    fn labels(&self, cpu: &BackendRef, case: &Case) -> Tensor {
        let (shape, values) = &self.ints[case.labels_key()];
        Tensor::from_slice(cpu, values, shape).unwrap()
    }
}

/// A run's relative errors against torch: the loss and the gradients of hidden, weight, bias.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Errors {
    loss: f64,
    hidden: f64,
    weight: f64,
    bias: f64,
}

impl Errors {
    fn gradients(&self) -> f64 {
        nan_max(nan_max(self.hidden, self.weight), self.bias)
    }

    fn max(self, other: Errors) -> Errors {
        Errors {
            loss: nan_max(self.loss, other.loss),
            hidden: nan_max(self.hidden, other.hidden),
            weight: nan_max(self.weight, other.weight),
            bias: nan_max(self.bias, other.bias),
        }
    }
}

/// How a run computes the loss from hidden, weight, bias and labels.
type LossOf<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> Tensor;

/// Runs `loss_of` on the golden inputs cast to `dtype`, then backward (for `reduction: None`
/// with the file's per-token weights as the output gradient), and measures the loss and the
/// three gradients against torch's. Returns the errors and, for checks of their own, the loss
/// and the hidden gradient as f64 values.
fn against_torch(
    golden: &Golden,
    case: &Case,
    dtype: DType,
    loss_of: LossOf<'_>,
) -> (Errors, Vec<f64>, Vec<f64>) {
    let cpu = CpuBackend::new_ref();
    let hidden = golden.leaf(&cpu, "input.hidden", dtype);
    let weight = golden.leaf(&cpu, "input.weight", dtype);
    let bias = golden.leaf(&cpu, "input.bias", dtype);
    let labels = golden.labels(&cpu, case);
    let loss = loss_of(&hidden, &weight, &bias, &labels);
    if case.reduction.is_some() {
        loss.backward().unwrap();
    } else {
        let weights = golden.tensor(&cpu, "input.loss_weights", loss.dtype());
        loss.backward_with(
            Some(weights),
            BackwardOptions {
                retain_graph: false,
            },
        )
        .unwrap();
    }
    let name = case.name();
    let torch = |what: &str| golden.tensor(&cpu, &format!("{name}.{what}"), DType::F64);
    let grad = |param: &Tensor| param.grad().expect("a gradient");
    let errors = Errors {
        loss: relative_error(&loss, &torch("loss"), &format!("{name} loss")),
        hidden: relative_error(&grad(&hidden), &torch("grad.hidden"), &format!("{name} dh")),
        weight: relative_error(&grad(&weight), &torch("grad.weight"), &format!("{name} dw")),
        bias: relative_error(&grad(&bias), &torch("grad.bias"), &format!("{name} db")),
    };
    let dhidden = grad(&hidden).to_vec_f64().unwrap();
    (errors, loss.to_vec_f64().unwrap(), dhidden)
}

/// Runs every case through `linear_cross_entropy` in `dtype` with both budgets, prints the
/// errors, asserts the bounds and returns the worst errors.
fn fused_against_torch(dtype: DType, bounds: Bounds) -> Errors {
    let golden = Golden::load();
    let mut worst = Errors::default();
    for case in Case::all() {
        for (budget, chunk_bytes) in BUDGETS {
            let options = case.options(chunk_bytes);
            let fused = |h: &Tensor, w: &Tensor, b: &Tensor, labels: &Tensor| {
                linear_cross_entropy(h, w, Some(b), labels, &options).unwrap()
            };
            let (errors, loss, dhidden) = against_torch(&golden, &case, dtype, &fused);
            report("fused", dtype, &case, budget, errors, bounds);
            if case.reduction.is_none() {
                ignored_tokens_are_zero(&golden, &case, &loss, &dhidden);
            }
            worst = worst.max(errors);
        }
    }
    worst
}

/// Runs the cases the unfused op can express (no smoothing, no z-loss, mean or sum) through
/// `cross_entropy(linear(..))` in `dtype`, prints the errors, asserts the bounds and returns the
/// worst errors.
fn unfused_against_torch(dtype: DType, bounds: Bounds) -> Errors {
    let golden = Golden::load();
    let mut worst = Errors::default();
    let mut runs = 0;
    for case in Case::all() {
        let Some(reduction) = case.reduction else {
            continue;
        };
        if case.label_smoothing != 0.0 || case.z_loss != 0.0 {
            continue;
        }
        let unfused = |h: &Tensor, w: &Tensor, b: &Tensor, labels: &Tensor| {
            let logits = h.linear(w, Some(b)).unwrap();
            cross_entropy(&logits, labels, case.ignore_index, reduction).unwrap()
        };
        let (errors, _, _) = against_torch(&golden, &case, dtype, &unfused);
        report("unfused", dtype, &case, "-", errors, bounds);
        worst = worst.max(errors);
        runs += 1;
    }
    assert_eq!(runs, 3, "mean and sum with ignore_index -100, sum with 7");
    worst
}

/// Prints one run's errors and asserts its bounds.
fn report(op: &str, dtype: DType, case: &Case, budget: &str, errors: Errors, bounds: Bounds) {
    println!(
        "{op} {dtype:?} {:<28} budget {budget:<7}: loss {:.2e}, dhidden {:.2e}, dweight {:.2e}, \
         dbias {:.2e}",
        case.name(),
        errors.loss,
        errors.hidden,
        errors.weight,
        errors.bias
    );
    assert!(
        errors.loss <= bounds.loss,
        "{op} {dtype:?} {} ({budget}): loss {:e} > {bounds:?}",
        case.name(),
        errors.loss
    );
    assert!(
        errors.gradients() <= bounds.gradients,
        "{op} {dtype:?} {} ({budget}): gradients {errors:?} > {bounds:?}",
        case.name()
    );
}

/// With `reduction: None`, ignored tokens have a loss of exactly 0 and a hidden gradient of
/// exactly 0 (and so do torch's).
fn ignored_tokens_are_zero(golden: &Golden, case: &Case, loss: &[f64], dhidden: &[f64]) {
    let (_, labels) = &golden.ints[case.labels_key()];
    let features = dhidden.len() / labels.len();
    let ignored: Vec<usize> = (0..labels.len())
        .filter(|&i| labels[i] == case.ignore_index)
        .collect();
    assert!(!ignored.is_empty());
    for i in ignored {
        assert_eq!(loss[i], 0.0, "{}: token {i}'s loss", case.name());
        let row = &dhidden[i * features..(i + 1) * features];
        assert!(row.iter().all(|&g| g == 0.0), "{}: token {i}", case.name());
    }
}

#[test]
fn golden_file_holds_the_cases_this_test_runs() {
    let golden = Golden::load();
    let names: Vec<String> = Case::all().iter().map(Case::name).collect();
    assert_eq!(golden.metadata["cases"], names.join(","));
    assert!(golden.metadata["torch"].starts_with("2.11"));
    let (shape, labels) = &golden.ints["input.labels"];
    assert_eq!(shape, &[37]);
    let tokens = |labels: &[i64], label: i64| -> Vec<usize> {
        (0..labels.len()).filter(|&i| labels[i] == label).collect()
    };
    assert_eq!(tokens(labels, -100), [3, 10, 11, 20, 36]);
    assert_eq!(tokens(labels, 7), [5, 23, 29]);
    let (_, labels_ignore7) = &golden.ints["input.labels_ignore7"];
    assert!(tokens(labels_ignore7, -100).is_empty());
    assert_eq!(tokens(labels_ignore7, 7), [3, 5, 10, 11, 20, 23, 29, 36]);
    assert_eq!(golden.floats["input.weight"].0, [301, 16]);
}

#[test]
fn fused_f64_matches_torch_within_1e_12() {
    let worst = fused_against_torch(DType::F64, F64_BOUNDS);
    println!("fused f64, worst: {worst:?}");
}

#[test]
fn unfused_f64_matches_torch_within_1e_12() {
    let worst = unfused_against_torch(DType::F64, F64_BOUNDS);
    println!("unfused f64, worst: {worst:?}");
}

#[test]
fn fused_f32_matches_torch() {
    let worst = fused_against_torch(DType::F32, F32_BOUNDS);
    println!("fused f32, worst: {worst:?}");
}

#[test]
fn unfused_f32_matches_torch() {
    let worst = unfused_against_torch(DType::F32, F32_BOUNDS);
    println!("unfused f32, worst: {worst:?}");
}
