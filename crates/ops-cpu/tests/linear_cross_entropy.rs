//! The fused linear + cross-entropy (`linear_cross_entropy`) on the CPU backend against the
//! unfused `cross_entropy_f32(linear(..))` and against a loss composed of ordinary ops (label
//! smoothing, z-loss, `reduction: None`): values and gradients in f64, f32 and bf16, chunk sizes
//! that do not divide the token count, tied weights, autocast, gradient hooks, typed errors, the
//! saved tensors and the peak of allocated bytes.

use std::sync::{Arc, Mutex};

use headroom_autograd_core::{
    autocast, cross_entropy, cross_entropy_f32, embedding, linear_cross_entropy,
    saved_tensor_hooks, BackendRef, BackwardOptions, DType, LinearCrossEntropyOptions, Packed,
    Reduction, Result, Tensor, TensorError,
};
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::inputs::uniform_f64;
use headroom_testkit::loss_fixtures::{OneOpInBf16, IGNORE_INDEX};
use headroom_testkit::memory::{allocated, peak};
use headroom_testkit::worst::nan_max;

/// Tokens `[batch, seq]`, features and classes of the small head most tests use: 2 × 7 = 14
/// tokens, so chunks of 3 or 4 rows do not divide them.
const BATCH: usize = 2;
const SEQ: usize = 7;
const FEATURES: usize = 6;
const CLASSES: usize = 11;

/// A head's operands: hidden `[BATCH, SEQ, FEATURES]`, weight, optional bias, labels (two
/// ignored), all leaves that require grad (but labels).
struct Head {
    hidden: Tensor,
    weight: Tensor,
    bias: Option<Tensor>,
    labels: Tensor,
}

fn leaf(cpu: &BackendRef, values: &[f64], shape: &[usize], dtype: DType) -> Tensor {
    let t = Tensor::from_f64s(cpu, values, shape, dtype).unwrap();
    t.requires_grad_(true).unwrap();
    t
}

fn head(cpu: &BackendRef, dtype: DType, with_bias: bool, seed: u64) -> Head {
    let rows = BATCH * SEQ;
    let labels: Vec<i64> = (0..rows)
        .map(|i| {
            if i % 5 == 3 {
                IGNORE_INDEX
            } else {
                ((i * 7 + seed as usize) % CLASSES) as i64
            }
        })
        .collect();
    Head {
        hidden: leaf(
            cpu,
            &uniform_f64(rows * FEATURES, -2.0, 2.0, seed),
            &[BATCH, SEQ, FEATURES],
            dtype,
        ),
        weight: leaf(
            cpu,
            &uniform_f64(CLASSES * FEATURES, -1.0, 1.0, seed + 1),
            &[CLASSES, FEATURES],
            dtype,
        ),
        bias: with_bias.then(|| {
            leaf(
                cpu,
                &uniform_f64(CLASSES, -0.5, 0.5, seed + 2),
                &[CLASSES],
                dtype,
            )
        }),
        labels: Tensor::from_slice(cpu, &labels, &[BATCH, SEQ]).unwrap(),
    }
}

impl Head {
    /// The same values as leaves of another dtype.
    fn cast(&self, dtype: DType) -> Head {
        let cast = |t: &Tensor| {
            let c = t.to_dtype(dtype).unwrap().detach();
            c.requires_grad_(true).unwrap();
            c
        };
        Head {
            hidden: cast(&self.hidden),
            weight: cast(&self.weight),
            bias: self.bias.as_ref().map(cast),
            labels: self.labels.clone(),
        }
    }

    fn params(&self) -> Vec<&Tensor> {
        let mut params = vec![&self.hidden, &self.weight];
        params.extend(&self.bias);
        params
    }

    /// The fused loss and the gradients of hidden, weight (and bias), as f64 values.
    fn fused(&self, options: &LinearCrossEntropyOptions) -> (Vec<f64>, Vec<Vec<f64>>) {
        let loss = linear_cross_entropy(
            &self.hidden,
            &self.weight,
            self.bias.as_ref(),
            &self.labels,
            options,
        )
        .unwrap();
        self.backward(loss)
    }

    /// `linear` then the cross-entropy, the loss the fused op stands for.
    fn unfused(&self, reduction: Reduction) -> (Vec<f64>, Vec<Vec<f64>>) {
        let loss = unfused_loss(
            &self.hidden,
            &self.weight,
            self.bias.as_ref(),
            &self.labels,
            reduction,
        );
        self.backward(loss)
    }

    /// The loss composed of ordinary ops, with smoothing `ε`, z-loss `λ` and any reduction:
    /// `Σ_j −q_j log p_j + λ lse²` per token, `q = (1 − ε) onehot + ε / classes`.
    fn composed(&self, options: &LinearCrossEntropyOptions) -> (Vec<f64>, Vec<Vec<f64>>) {
        let cpu = self.hidden.backend();
        let rows = BATCH * SEQ;
        let labels = self.labels.to_vec::<i64>().unwrap();
        let eps = options.label_smoothing;
        let mut target = vec![eps / CLASSES as f64; rows * CLASSES];
        let mut valid = vec![0.0; rows];
        for (row, &label) in labels.iter().enumerate() {
            if label != IGNORE_INDEX {
                target[row * CLASSES + label as usize] += 1.0 - eps;
                valid[row] = 1.0;
            } else {
                target[row * CLASSES..(row + 1) * CLASSES].fill(0.0);
            }
        }
        let dtype = self.hidden.dtype();
        let target = Tensor::from_f64s(cpu, &target, &[rows, CLASSES], dtype).unwrap();
        let valid = Tensor::from_f64s(cpu, &valid, &[rows], dtype).unwrap();
        let logits = self
            .hidden
            .linear(&self.weight, self.bias.as_ref())
            .unwrap()
            .reshape(&[rows, CLASSES])
            .unwrap();
        let log_p = logits.log_softmax(-1).unwrap();
        let lse = logits
            .sub(&log_p)
            .unwrap()
            .narrow(1, 0, 1)
            .unwrap()
            .reshape(&[rows])
            .unwrap();
        let per_row = log_p
            .mul(&target)
            .unwrap()
            .sum(&[1], false)
            .unwrap()
            .neg()
            .unwrap();
        let per_row = per_row
            .add(
                &lse.mul(&lse)
                    .unwrap()
                    .mul_scalar(options.z_loss)
                    .unwrap()
                    .mul(&valid)
                    .unwrap(),
            )
            .unwrap();
        let count = valid.to_vec_f64().unwrap().iter().sum::<f64>();
        let loss = match options.reduction {
            Some(Reduction::Mean) => per_row.sum_all().unwrap().div_scalar(count).unwrap(),
            Some(Reduction::Sum) => per_row.sum_all().unwrap(),
            None => per_row.reshape(&[BATCH, SEQ]).unwrap(),
        };
        self.backward(loss)
    }

    /// The loss's values and the parameters' gradients after backward (a fixed, uneven output
    /// gradient for a per-token loss).
    fn backward(&self, loss: Tensor) -> (Vec<f64>, Vec<Vec<f64>>) {
        for param in self.params() {
            param.zero_grad(true).unwrap();
        }
        let values = loss.to_vec_f64().unwrap();
        if loss.ndim() == 0 {
            loss.backward().unwrap();
        } else {
            let grad: Vec<f64> = (0..loss.numel()).map(|i| 0.5 + i as f64 / 10.0).collect();
            let grad =
                Tensor::from_f64s(loss.backend(), &grad, loss.shape(), loss.dtype()).unwrap();
            loss.backward_with(
                Some(grad),
                BackwardOptions {
                    retain_graph: false,
                },
            )
            .unwrap();
        }
        let grads = self
            .params()
            .iter()
            .map(|p| p.grad().unwrap().to_vec_f64().unwrap())
            .collect();
        (values, grads)
    }
}

/// `cross_entropy_f32(linear(..))` (`cross_entropy` for f64, which `cross_entropy_f32` would
/// round to f32): what the fused op computes without its logits.
fn unfused_loss(
    hidden: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    labels: &Tensor,
    reduction: Reduction,
) -> Tensor {
    let logits = hidden.linear(weight, bias).unwrap();
    let classes = weight.shape()[0];
    let logits = logits
        .reshape(&[logits.numel() / classes, classes])
        .unwrap();
    let labels = labels.reshape(&[labels.numel()]).unwrap();
    let loss = if hidden.dtype() == DType::F64 {
        cross_entropy(&logits, &labels, IGNORE_INDEX, reduction)
    } else {
        cross_entropy_f32(&logits, &labels, IGNORE_INDEX, reduction)
    };
    loss.unwrap()
}

/// Options with a chunk budget of about `rows` rows of this head's logits (f64: 8 B a logit).
fn chunked(rows: usize) -> LinearCrossEntropyOptions {
    LinearCrossEntropyOptions {
        chunk_bytes: rows * (CLASSES * 8 + 64),
        ..LinearCrossEntropyOptions::default()
    }
}

/// The largest `|a − b| / max(|b|, floor)` over two value lists.
fn max_relative(a: &[f64], b: &[f64], floor: f64) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(floor))
        .fold(0.0, nan_max)
}

#[test]
fn f64_equals_the_unfused_loss_within_a_few_ulps_for_every_chunking_and_reduction() {
    let cpu = CpuBackend::new_ref();
    for with_bias in [false, true] {
        let head = head(&cpu, DType::F64, with_bias, 3);
        for reduction in [Reduction::Mean, Reduction::Sum] {
            let (loss, grads) = head.unfused(reduction);
            for rows in [1, 3, 4, 14, 100] {
                let options = LinearCrossEntropyOptions {
                    reduction: Some(reduction),
                    ..chunked(rows)
                };
                let (fused_loss, fused_grads) = head.fused(&options);
                assert!(
                    max_relative(&fused_loss, &loss, 1e-300) < 1e-15,
                    "loss, {rows} rows"
                );
                for (fused, unfused) in fused_grads.iter().zip(&grads) {
                    // A few ulps: the unfused backward computes the softmax in one kernel, the
                    // fused one from exp and products, and sums the weight gradient per chunk.
                    assert!(
                        max_relative(fused, unfused, 1e-12) < 1e-13,
                        "gradient, {rows} rows: {}",
                        max_relative(fused, unfused, 1e-12)
                    );
                }
            }
        }
    }
}

#[test]
fn label_smoothing_z_loss_and_every_reduction_equal_the_composed_loss_in_f64() {
    let cpu = CpuBackend::new_ref();
    let head = head(&cpu, DType::F64, true, 5);
    for reduction in [Some(Reduction::Mean), Some(Reduction::Sum), None] {
        for (label_smoothing, z_loss) in [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-2), (0.25, 1e-3)] {
            let options = LinearCrossEntropyOptions {
                reduction,
                label_smoothing,
                z_loss,
                ..chunked(4)
            };
            let (loss, grads) = head.composed(&options);
            let (fused_loss, fused_grads) = head.fused(&options);
            let case = format!("{reduction:?}, ε {label_smoothing}, z {z_loss}");
            assert!(
                max_relative(&fused_loss, &loss, 1e-12) < 1e-13,
                "loss, {case}"
            );
            for (fused, composed) in fused_grads.iter().zip(&grads) {
                assert!(
                    max_relative(fused, composed, 1e-12) < 1e-12,
                    "gradient, {case}"
                );
            }
            if reduction.is_none() {
                // Ignored tokens (every fifth from the fourth) have loss 0.
                assert_eq!(
                    (fused_loss[3], fused_loss[8], fused_loss[13]),
                    (0.0, 0.0, 0.0)
                );
            }
        }
    }
}

#[test]
fn f32_loss_is_within_1e_6_of_the_f64_reference_and_gradients_within_1e_5() {
    let cpu = CpuBackend::new_ref();
    let reference = head(&cpu, DType::F64, true, 7);
    let single = reference.cast(DType::F32);
    for (label_smoothing, z_loss) in [(0.0, 0.0), (0.1, 1e-3)] {
        let options = LinearCrossEntropyOptions {
            label_smoothing,
            z_loss,
            ..chunked(3)
        };
        let (loss, grads) = reference.fused(&options);
        let (f32_loss, f32_grads) = single.fused(&options);
        assert!(max_relative(&f32_loss, &loss, 1e-30) < 1e-6);
        for (ours, exact) in f32_grads.iter().zip(&grads) {
            assert!(max_relative(ours, exact, 1e-3) < 1e-5);
        }
    }
}

#[test]
fn bf16_gradients_are_as_close_to_the_f32_reference_as_the_unfused_bf16_ones() {
    let cpu = CpuBackend::new_ref();
    let low = head(&cpu, DType::BF16, true, 11);
    // The reference: the bf16 values exactly, in f32.
    let reference = low.cast(DType::F32);
    let (loss, grads) = reference.unfused(Reduction::Mean);
    let (unfused_loss, unfused_grads) = low.unfused(Reduction::Mean);
    // A budget below the fixed costs: blocks of one row, tiles of every class.
    let options = LinearCrossEntropyOptions {
        chunk_bytes: 3 * (CLASSES * 6 + 64),
        ..Default::default()
    };
    let (fused_loss, fused_grads) = low.fused(&options);
    assert_eq!(fused_loss.len(), 1);
    // The same bf16 logits give the unfused loss up to the f32 sum of the chunks' sums.
    let loss_error = max_relative(&fused_loss, &unfused_loss, 1e-30);
    assert!(
        loss_error < 1e-6,
        "{fused_loss:?} vs unfused {unfused_loss:?}"
    );
    println!(
        "bf16 loss: error vs f32 {:.3e} (unfused bf16: {:.3e})",
        max_relative(&fused_loss, &loss, 1e-30),
        max_relative(&unfused_loss, &loss, 1e-30)
    );
    for ((name, fused), (unfused, exact)) in ["hidden", "weight", "bias"]
        .iter()
        .zip(&fused_grads)
        .zip(unfused_grads.iter().zip(&grads))
    {
        let (ours, theirs) = (
            max_relative(fused, exact, 1e-2),
            max_relative(unfused, exact, 1e-2),
        );
        println!(
            "bf16 {name} gradient: largest error vs f32 {ours:.3e} (unfused bf16: {theirs:.3e}), vs unfused bf16 {:.3e}",
            max_relative(fused, unfused, 1e-2)
        );
        // The hidden and bias gradients are each rounded once from an f32 accumulation, as the
        // unfused products are: bit for bit the same on the CPU. The weight gradient is
        // rounded once per block of rows (here many: a budget below the fixed costs gives
        // blocks of one row), so it differs by those roundings, within the bound below.
        if *name != "weight" {
            assert_eq!(fused, unfused, "{name}");
        }
        // bf16 keeps 8 significant bits: one rounding is at most 2^-9 relative; the logits'
        // and their gradient's roundings add a few more, as in the unfused path.
        assert!(
            ours <= nan_max(theirs, 2f64.powi(-8)) * 1.5,
            "{name}: {ours} vs unfused {theirs}"
        );
    }
}

#[test]
fn a_tied_weight_accumulates_the_embedding_and_the_loss_gradients() {
    let cpu = CpuBackend::new_ref();
    let head = head(&cpu, DType::F64, false, 13);
    let ids = Tensor::from_slice(&cpu, &[1i64, 4, 4, 9], &[4]).unwrap();
    let tied_step = |fused: bool| {
        head.weight.zero_grad(true).unwrap();
        let embedded = embedding(&head.weight, &ids).unwrap().sum_all().unwrap();
        let loss = if fused {
            linear_cross_entropy(&head.hidden, &head.weight, None, &head.labels, &chunked(3))
                .unwrap()
        } else {
            unfused_loss(
                &head.hidden,
                &head.weight,
                None,
                &head.labels,
                Reduction::Mean,
            )
        };
        loss.add(&embedded).unwrap().backward().unwrap();
        head.weight.grad().unwrap().to_vec_f64().unwrap()
    };
    let (fused, unfused) = (tied_step(true), tied_step(false));
    assert!(max_relative(&fused, &unfused, 1e-12) < 1e-14);
    // Row 4 of the weight is embedded twice: its gradient carries 2 on top of the loss's.
    let loss_only = head.fused(&chunked(3)).1[1].clone();
    assert!((fused[4 * FEATURES] - loss_only[4 * FEATURES] - 2.0).abs() < 1e-12);
}

#[test]
fn autocast_runs_it_as_a_linear_and_hooks_see_the_weight_gradient() {
    let cpu = CpuBackend::new_ref();
    let head = head(&cpu, DType::F32, false, 17);
    let hooked = Arc::new(Mutex::new(None));
    let seen = Arc::clone(&hooked);
    let _handle = head
        .weight
        .register_post_accumulate_grad_hook(move |param: &Tensor| {
            *seen.lock().unwrap() = Some(param.grad().expect("accumulated").to_vec_f64()?);
            Ok(())
        })
        .unwrap();
    let loss = {
        let _scope = autocast(Arc::new(OneOpInBf16("linear")));
        linear_cross_entropy(&head.hidden, &head.weight, None, &head.labels, &chunked(3)).unwrap()
    };
    let low = head.cast(DType::BF16);
    let expected =
        linear_cross_entropy(&low.hidden, &low.weight, None, &low.labels, &chunked(3)).unwrap();
    assert_eq!(
        (loss.dtype(), loss.item().unwrap()),
        (DType::F32, expected.item().unwrap())
    );
    loss.backward().unwrap();
    expected.backward().unwrap();
    let grad = head.weight.grad().unwrap();
    assert_eq!(grad.dtype(), DType::F32); // through the cast's backward, into the f32 parameter
    let low_grad = low.weight.grad().unwrap().to_vec_f64().unwrap();
    assert_eq!(grad.to_vec_f64().unwrap(), low_grad);
    assert_eq!(hooked.lock().unwrap().as_ref(), Some(&low_grad));
}

#[test]
fn it_saves_only_hidden_weight_bias_labels_and_an_f32_log_sum_exp_per_token() {
    let cpu = CpuBackend::new_ref();
    let head = head(&cpu, DType::BF16, true, 19);
    let saved = Arc::new(Mutex::new(Vec::new()));
    let sites = Arc::clone(&saved);
    let loss = {
        let _hooks = saved_tensor_hooks(
            move |site, tensor| {
                sites
                    .lock()
                    .unwrap()
                    .push((format!("{:?}", site.role), site.dtype, site.bytes));
                Ok(Box::new(tensor) as Packed)
            },
            |packed| Ok(packed.downcast_ref::<Tensor>().expect("a tensor").clone()),
        );
        linear_cross_entropy(
            &head.hidden,
            &head.weight,
            head.bias.as_ref(),
            &head.labels,
            &chunked(3),
        )
        .unwrap()
    };
    let rows = (BATCH * SEQ) as u64;
    let expected = vec![
        (
            "Input(0)".to_string(),
            DType::BF16,
            rows * FEATURES as u64 * 2,
        ),
        (
            "Input(1)".to_string(),
            DType::BF16,
            (CLASSES * FEATURES) as u64 * 2,
        ),
        ("Input(2)".to_string(), DType::BF16, CLASSES as u64 * 2),
        ("Input(3)".to_string(), DType::I64, rows * 8),
        ("Intermediate(\"lse\")".to_string(), DType::F32, rows * 4),
    ];
    assert_eq!(*saved.lock().unwrap(), expected);
    loss.backward().unwrap();
}

#[test]
fn bad_operands_and_options_are_typed_errors() {
    let cpu = CpuBackend::new_ref();
    let head = head(&cpu, DType::F32, false, 23);
    let options = LinearCrossEntropyOptions::default();
    let run = |hidden: &Tensor,
               weight: &Tensor,
               bias: Option<&Tensor>,
               labels: &Tensor,
               options: &LinearCrossEntropyOptions| {
        linear_cross_entropy(hidden, weight, bias, labels, options).map(|_| ())
    };
    let shape = |e: Result<()>| {
        matches!(
            e,
            Err(TensorError::ShapeMismatch {
                op: "linear_cross_entropy",
                ..
            })
        )
    };
    let invalid = |e: Result<()>| {
        matches!(
            e,
            Err(TensorError::InvalidArgument {
                op: "linear_cross_entropy",
                ..
            })
        )
    };
    let wrong_weight = Tensor::zeros(&cpu, &[CLASSES, FEATURES + 1], DType::F32).unwrap();
    assert!(shape(run(
        &head.hidden,
        &wrong_weight,
        None,
        &head.labels,
        &options
    )));
    let wrong_labels = Tensor::zeros(&cpu, &[BATCH * SEQ], DType::I64).unwrap();
    assert!(shape(run(
        &head.hidden,
        &head.weight,
        None,
        &wrong_labels,
        &options
    )));
    let wrong_bias = Tensor::zeros(&cpu, &[CLASSES + 1], DType::F32).unwrap();
    assert!(shape(run(
        &head.hidden,
        &head.weight,
        Some(&wrong_bias),
        &head.labels,
        &options
    )));
    let scalar = Tensor::scalar(&cpu, 1.0, DType::F32).unwrap();
    assert!(shape(run(
        &scalar,
        &head.weight,
        None,
        &head.labels,
        &options
    )));
    let f64_weight = head.weight.to_dtype(DType::F64).unwrap();
    assert!(matches!(
        run(&head.hidden, &f64_weight, None, &head.labels, &options),
        Err(TensorError::DtypeMismatch { .. })
    ));
    let float_labels = head.labels.to_dtype(DType::F32).unwrap();
    assert!(matches!(
        run(&head.hidden, &head.weight, None, &float_labels, &options),
        Err(TensorError::DtypeMismatch { .. })
    ));
    let int_hidden = head.hidden.to_dtype(DType::I64).unwrap();
    let int_weight = head.weight.to_dtype(DType::I64).unwrap();
    assert!(matches!(
        run(&int_hidden, &int_weight, None, &head.labels, &options),
        Err(TensorError::UnsupportedDtype { .. })
    ));
    for bad in [CLASSES as i64, -1] {
        let labels = Tensor::from_slice(&cpu, &[bad; BATCH * SEQ], &[BATCH, SEQ]).unwrap();
        let err = run(&head.hidden, &head.weight, None, &labels, &options).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("linear_cross_entropy: label {bad} is out of bounds for {CLASSES} classes")
        );
    }
    let empty = Tensor::zeros(&cpu, &[0, FEATURES], DType::F32).unwrap();
    assert!(invalid(run(
        &head.hidden,
        &empty,
        None,
        &head.labels,
        &options
    )));
    for bad in [
        LinearCrossEntropyOptions {
            label_smoothing: 1.5,
            ..options
        },
        LinearCrossEntropyOptions {
            label_smoothing: f64::NAN,
            ..options
        },
        LinearCrossEntropyOptions {
            z_loss: -1.0,
            ..options
        },
        LinearCrossEntropyOptions {
            z_loss: f64::INFINITY,
            ..options
        },
        LinearCrossEntropyOptions {
            chunk_bytes: 0,
            ..options
        },
    ] {
        assert!(
            invalid(run(&head.hidden, &head.weight, None, &head.labels, &bad)),
            "{bad:?}"
        );
    }
}

/// The peak of allocated bytes above `before` while `step` runs.
fn peak_above(cpu: &BackendRef, step: impl FnOnce()) -> i64 {
    cpu.allocator_view().reset_peak_stats();
    let before = allocated(cpu);
    step();
    peak(cpu) - before
}

#[test]
fn the_peak_beyond_the_gradients_stays_within_one_chunk_budget() {
    let cpu = CpuBackend::new_ref();
    let (rows, features, classes) = (256, 32, 4000);
    let hidden = leaf(
        &cpu,
        &uniform_f64(rows * features, -1.0, 1.0, 29),
        &[rows, features],
        DType::F32,
    );
    let weight = leaf(
        &cpu,
        &uniform_f64(classes * features, -1.0, 1.0, 31),
        &[classes, features],
        DType::F32,
    );
    let labels: Vec<i64> = (0..rows as i64)
        .map(|i| (i * 37) % classes as i64)
        .collect();
    let labels = Tensor::from_slice(&cpu, &labels, &[rows]).unwrap();
    let chunk_bytes = 256 << 10; // 16 rows of 4000 f32 logits, the whole logits being 4 MB
    let options = LinearCrossEntropyOptions {
        chunk_bytes,
        ..Default::default()
    };
    let grads = ((rows + classes) * features * 4) as i64;
    let fused = peak_above(&cpu, || {
        let loss = linear_cross_entropy(&hidden, &weight, None, &labels, &options).unwrap();
        loss.backward().unwrap();
    });
    let (hidden_grad, weight_grad) = (hidden.take_grad(), weight.take_grad());
    let unfused = peak_above(&cpu, || {
        let loss = cross_entropy_f32(
            &hidden.linear(&weight, None).unwrap(),
            &labels,
            IGNORE_INDEX,
            Reduction::Mean,
        )
        .unwrap();
        loss.backward().unwrap();
    });
    drop((hidden_grad, weight_grad));
    println!("peak above the inputs: fused {fused} B, unfused {unfused} B, gradients {grads} B");
    // The gradients, one chunk's logits (and their per-row vectors), the per-token log-sum-exp.
    let lse = (rows * 4) as i64;
    assert!(fused <= grads + chunk_bytes as i64 + lse + 4096, "{fused}");
    assert!(unfused >= grads + (rows * classes * 4) as i64);
}
