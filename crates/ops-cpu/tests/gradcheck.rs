//! Float64 finite-difference gradient checks for every differentiable op, on the CPU backend.
//!
//! One harness, [`check_gradients`], and one line per case: the case names its input shapes
//! (and value ranges, away from kinks and poles) and the function of those inputs. The harness
//! reduces the output to a scalar with fixed random weights, runs backward, and compares each
//! input's gradient with central differences.

use headroom_autograd_core::{
    cat, cross_entropy, cross_entropy_f32, dropout, embedding, layer_norm, no_grad,
    patch_embedding, scaled_dot_product_attention, scaled_dot_product_attention_varlen, BackendRef,
    DType, Generator, PackedSequences, Reduction, Result, Tensor,
};
use headroom_autograd_core::{layer_norm_linear, rms_norm, rotary_embedding, swiglu};
use headroom_ops_cpu::CpuBackend;

/// Deterministic values in `[low, high)`.
fn values(n: usize, low: f64, high: f64, seed: u64) -> Vec<f64> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            low + (high - low) * ((state >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect()
}

/// An input of a case: its shape and the range its values are drawn from.
struct Input {
    shape: Vec<usize>,
    low: f64,
    high: f64,
}

fn input(shape: &[usize]) -> Input {
    Input {
        shape: shape.to_vec(),
        low: -2.0,
        high: 2.0,
    }
}

fn positive(shape: &[usize]) -> Input {
    Input {
        shape: shape.to_vec(),
        low: 0.5,
        high: 2.0,
    }
}

type CaseFn = dyn Fn(&BackendRef, &[Tensor]) -> Result<Tensor>;

/// Checks the gradients of `f` at random inputs against central differences.
fn check_gradients(name: &str, inputs: &[Input], f: &CaseFn) {
    let cpu = CpuBackend::new_ref();
    let data: Vec<Vec<f64>> = inputs
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            values(
                spec.shape.iter().product(),
                spec.low,
                spec.high,
                17 + i as u64,
            )
        })
        .collect();
    let build = |data: &[Vec<f64>]| -> Vec<Tensor> {
        data.iter()
            .zip(inputs)
            .map(|(values, spec)| Tensor::from_f64s(&cpu, values, &spec.shape, DType::F64).unwrap())
            .collect()
    };
    let leaves = build(&data);
    for leaf in &leaves {
        leaf.requires_grad_(true).unwrap();
    }
    let out = f(&cpu, &leaves).unwrap_or_else(|e| panic!("{name}: forward failed: {e}"));
    let weights = Tensor::from_f64s(
        &cpu,
        &values(out.numel(), -1.0, 1.0, 99),
        out.shape(),
        DType::F64,
    )
    .unwrap();
    out.mul(&weights)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap_or_else(|e| panic!("{name}: backward failed: {e}"));

    let objective = |data: &[Vec<f64>]| -> f64 {
        let _guard = no_grad();
        let out = f(&cpu, &build(data)).unwrap();
        out.mul(&weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .item()
            .unwrap()
    };
    let eps = 1e-6;
    for (input_idx, leaf) in leaves.iter().enumerate() {
        let analytic = match leaf.grad() {
            Some(grad) => grad.to_vec_f64().unwrap(),
            None => vec![0.0; leaf.numel()],
        };
        for elem in 0..leaf.numel() {
            let mut plus = data.clone();
            plus[input_idx][elem] += eps;
            let mut minus = data.clone();
            minus[input_idx][elem] -= eps;
            let numeric = (objective(&plus) - objective(&minus)) / (2.0 * eps);
            let err = (numeric - analytic[elem]).abs();
            assert!(
                err <= 1e-6 + 1e-5 * numeric.abs(),
                "{name}: input {input_idx} element {elem}: analytic {} vs numeric {numeric}",
                analytic[elem]
            );
        }
    }
}

fn i64s(cpu: &BackendRef, values: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_slice(cpu, values, shape).unwrap()
}

fn mask(cpu: &BackendRef, values: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_f64s(cpu, values, shape, DType::Bool).unwrap()
}

#[test]
fn elementwise_arithmetic() {
    check_gradients("add", &[input(&[2, 3]), input(&[3])], &|_, x| {
        x[0].add(&x[1])
    });
    check_gradients("sub", &[input(&[2, 1, 3]), input(&[4, 1])], &|_, x| {
        x[0].sub(&x[1])
    });
    check_gradients("mul", &[input(&[2, 3]), input(&[2, 1])], &|_, x| {
        x[0].mul(&x[1])
    });
    check_gradients("div", &[input(&[3, 2]), positive(&[2])], &|_, x| {
        x[0].div(&x[1])
    });
    check_gradients("neg", &[input(&[4])], &|_, x| x[0].neg());
    check_gradients("pow", &[positive(&[2, 3]), input(&[3])], &|_, x| {
        x[0].pow(&x[1])
    });
    check_gradients("pow_scalar", &[positive(&[5])], &|_, x| {
        x[0].pow_scalar(2.5)
    });
    check_gradients("add_scalar", &[input(&[3])], &|_, x| x[0].add_scalar(1.5));
    check_gradients("mul_scalar", &[input(&[3])], &|_, x| x[0].mul_scalar(-0.7));
    check_gradients("div_scalar", &[input(&[3])], &|_, x| x[0].div_scalar(3.0));
    check_gradients("same input twice", &[input(&[3])], &|_, x| x[0].mul(&x[0]));
}

#[test]
fn math_and_activations() {
    check_gradients("exp", &[input(&[2, 3])], &|_, x| x[0].exp());
    check_gradients("log", &[positive(&[2, 3])], &|_, x| x[0].log());
    check_gradients("sqrt", &[positive(&[4])], &|_, x| x[0].sqrt());
    check_gradients("rsqrt", &[positive(&[4])], &|_, x| x[0].rsqrt());
    check_gradients("tanh", &[input(&[2, 3])], &|_, x| x[0].tanh());
    check_gradients("relu", &[input(&[3, 4])], &|_, x| x[0].relu());
    check_gradients("gelu", &[input(&[3, 4])], &|_, x| x[0].gelu());
    check_gradients("gelu_tanh", &[input(&[3, 4])], &|_, x| x[0].gelu_tanh());
    check_gradients("softmax last", &[input(&[3, 4])], &|_, x| x[0].softmax(-1));
    check_gradients("softmax dim 0", &[input(&[3, 4])], &|_, x| x[0].softmax(0));
    check_gradients("log_softmax", &[input(&[2, 5])], &|_, x| {
        x[0].log_softmax(1)
    });
    check_gradients("softmax of a transpose", &[input(&[3, 4])], &|_, x| {
        x[0].t()?.softmax(-1)
    });
}

#[test]
fn linear_algebra() {
    check_gradients("matmul 2d", &[input(&[3, 4]), input(&[4, 2])], &|_, x| {
        x[0].matmul(&x[1])
    });
    check_gradients(
        "matmul batched by matrix",
        &[input(&[2, 3, 4]), input(&[4, 5])],
        &|_, x| x[0].matmul(&x[1]),
    );
    check_gradients(
        "matmul broadcast batch",
        &[input(&[2, 1, 3, 4]), input(&[3, 4, 2])],
        &|_, x| x[0].matmul(&x[1]),
    );
    check_gradients(
        "matmul transposed operand",
        &[input(&[2, 3, 4]), input(&[2, 5, 4])],
        &|_, x| x[0].matmul(&x[1].transpose(-1, -2)?),
    );
    check_gradients("matmul vector", &[input(&[4]), input(&[4, 3])], &|_, x| {
        x[0].matmul(&x[1])
    });
    check_gradients("matrix vector", &[input(&[2, 4]), input(&[4])], &|_, x| {
        x[0].matmul(&x[1])
    });
    check_gradients(
        "linear",
        &[input(&[2, 3, 4]), input(&[5, 4]), input(&[5])],
        &|_, x| x[0].linear(&x[1], Some(&x[2])),
    );
    check_gradients(
        "linear no bias",
        &[input(&[3, 4]), input(&[2, 4])],
        &|_, x| x[0].linear(&x[1], None),
    );
    check_gradients(
        "linear of a view",
        &[input(&[4, 3]), input(&[2, 4])],
        &|_, x| x[0].t()?.linear(&x[1], None),
    );
    check_gradients(
        "linear_gelu",
        &[input(&[2, 3, 4]), input(&[5, 4]), input(&[5])],
        &|_, x| x[0].linear_gelu(&x[1], Some(&x[2])),
    );
    check_gradients(
        "linear_gelu no bias, of a view",
        &[input(&[4, 3]), input(&[2, 4])],
        &|_, x| x[0].t()?.linear_gelu(&x[1], None),
    );
    check_gradients(
        "gelu_linear",
        &[input(&[2, 3, 4]), input(&[5, 4]), input(&[5])],
        &|_, x| x[0].gelu_linear(&x[1], Some(&x[2])),
    );
    check_gradients(
        "gelu_tanh_linear no bias, of a view",
        &[input(&[4, 3]), input(&[2, 4])],
        &|_, x| x[0].t()?.gelu_tanh_linear(&x[1], None),
    );
    check_gradients(
        "layer_norm_linear",
        &[
            input(&[2, 3, 4]),
            input(&[4]),
            input(&[4]),
            input(&[5, 4]),
            input(&[5]),
        ],
        &|_, x| {
            layer_norm_linear(
                &x[0],
                &[4],
                Some(&x[1]),
                Some(&x[2]),
                1e-5,
                &x[3],
                Some(&x[4]),
            )
        },
    );
    check_gradients(
        "layer_norm_linear without affine or bias, of a view",
        &[input(&[4, 3]), input(&[2, 4])],
        &|_, x| layer_norm_linear(&x[0].t()?, &[4], None, None, 1e-5, &x[1], None),
    );
    check_gradients(
        "patch embedding",
        &[input(&[2, 2, 4, 4]), input(&[3, 2, 2, 2]), input(&[3])],
        &|_, x| patch_embedding(&x[0], &x[1], Some(&x[2]), 2),
    );
}

#[test]
fn fused_attention() {
    // (case, shapes of q, k and v, causal, scale)
    let separate_heads = [
        (
            "attention",
            [[2, 2, 3, 4], [2, 2, 5, 4], [2, 2, 5, 4]],
            false,
            None,
        ),
        (
            "causal attention, explicit scale",
            [[1, 2, 4, 3]; 3],
            true,
            Some(0.7),
        ),
        (
            "grouped-query causal attention (4 query heads on 2 key/value heads)",
            [[1, 4, 5, 3], [1, 2, 5, 3], [1, 2, 5, 3]],
            true,
            None,
        ),
    ];
    for (name, shapes, causal, scale) in separate_heads {
        check_gradients(name, &shapes.map(|shape| input(&shape)), &move |_, x| {
            scaled_dot_product_attention(&x[0], &x[1], &x[2], causal, scale)
        });
    }
    check_gradients(
        "packed sequences (lengths 3, 0 and 4), grouped heads",
        &[
            input(&[1, 2, 7, 3]),
            input(&[1, 1, 7, 3]),
            input(&[1, 1, 7, 3]),
        ],
        &|backend, x| {
            let packed = PackedSequences::new(backend, &[0, 3, 3, 7])?;
            scaled_dot_product_attention_varlen(&x[0], &x[1], &x[2], &packed, true, None)
        },
    );
    // Heads as strided views of one packed projection, as attention layers pass them.
    check_gradients(
        "attention of packed heads",
        &[input(&[2, 3, 12])],
        &|_, x| {
            let qkv = x[0].split(4, -1)?;
            let heads = |t: &Tensor| t.reshape(&[2, 3, 2, 2])?.permute(&[0, 2, 1, 3]);
            scaled_dot_product_attention(
                &heads(&qkv[0])?,
                &heads(&qkv[1])?,
                &heads(&qkv[2])?,
                true,
                None,
            )
        },
    );
}

#[test]
fn reductions() {
    check_gradients("sum dims", &[input(&[2, 3, 4])], &|_, x| {
        x[0].sum(&[0, 2], false)
    });
    check_gradients("sum keepdim", &[input(&[2, 3])], &|_, x| {
        x[0].sum(&[-1], true)
    });
    check_gradients("sum all", &[input(&[2, 3])], &|_, x| x[0].sum_all());
    check_gradients("mean dims", &[input(&[2, 3, 4])], &|_, x| {
        x[0].mean(&[1], false)
    });
    check_gradients("mean all", &[input(&[3, 2])], &|_, x| x[0].mean_all());
    check_gradients("max dim", &[input(&[3, 4])], &|_, x| {
        Ok(x[0].max_dim(1, false)?.0)
    });
    check_gradients("max dim 0 keepdim", &[input(&[3, 4])], &|_, x| {
        Ok(x[0].max_dim(0, true)?.0)
    });
}

#[test]
fn views() {
    check_gradients("reshape", &[input(&[2, 6])], &|_, x| x[0].reshape(&[3, 4]));
    check_gradients(
        "reshape of a transpose copies",
        &[input(&[2, 3])],
        &|_, x| x[0].t()?.reshape(&[6]),
    );
    check_gradients("permute", &[input(&[2, 3, 4])], &|_, x| {
        x[0].permute(&[2, 0, 1])
    });
    check_gradients("transpose then contiguous", &[input(&[2, 3])], &|_, x| {
        x[0].transpose(0, 1)?.contiguous()
    });
    check_gradients("narrow", &[input(&[4, 3])], &|_, x| x[0].narrow(0, 1, 2));
    check_gradients("expand", &[input(&[3, 1])], &|_, x| x[0].expand(&[2, 3, 4]));
    check_gradients("unsqueeze squeeze", &[input(&[3])], &|_, x| {
        x[0].unsqueeze(0)?.unsqueeze(-1)?.squeeze_dim(0)
    });
    check_gradients("flatten", &[input(&[2, 3, 2])], &|_, x| x[0].flatten(1, 2));
    check_gradients("view", &[input(&[2, 3])], &|_, x| x[0].view_shape(&[3, 2]));
    check_gradients("cast round trip", &[input(&[3])], &|_, x| {
        x[0].to_dtype(DType::F64)
    });
}

#[test]
fn indexing() {
    check_gradients("cat", &[input(&[2, 3]), input(&[1, 3])], &|_, x| {
        cat(&[&x[0], &x[1]], 0)
    });
    check_gradients(
        "cat last dim",
        &[input(&[2, 1]), input(&[2, 3])],
        &|_, x| cat(&[&x[0], &x[1], &x[0]], -1),
    );
    check_gradients("split", &[input(&[5, 2])], &|_, x| {
        let pieces = x[0].split(2, 0)?;
        cat(&[&pieces[2], &pieces[0].mul_scalar(3.0)?], 0)
    });
    check_gradients("split unused piece", &[input(&[4, 3])], &|_, x| {
        Ok(x[0].split_with_sizes(&[1, 2], 1)?[1].clone())
    });
    check_gradients("embedding", &[input(&[5, 3])], &|cpu, x| {
        embedding(&x[0], &i64s(cpu, &[4, 0, 4, 2], &[2, 2]))
    });
    check_gradients("gather", &[input(&[3, 4])], &|cpu, x| {
        x[0].gather(1, &i64s(cpu, &[0, 3, 3, 1, 2, 0], &[3, 2]))
    });
    check_gradients("masked_fill", &[input(&[2, 3])], &|cpu, x| {
        x[0].masked_fill(&mask(cpu, &[1.0, 0.0, 1.0], &[3]), -5.0)
    });
}

#[test]
fn normalization_and_losses() {
    check_gradients(
        "layer_norm affine",
        &[input(&[3, 4]), input(&[4]), input(&[4])],
        &|_, x| layer_norm(&x[0], &[4], Some(&x[1]), Some(&x[2]), 1e-5),
    );
    check_gradients("layer_norm plain", &[input(&[2, 2, 3])], &|_, x| {
        layer_norm(&x[0], &[2, 3], None, None, 1e-5)
    });
    check_gradients(
        "layer_norm of a transpose",
        &[input(&[4, 3]), input(&[4])],
        &|_, x| layer_norm(&x[0].t()?, &[4], Some(&x[1]), None, 1e-5),
    );
    check_gradients("cross_entropy mean ignore", &[input(&[4, 5])], &|cpu, x| {
        cross_entropy(
            &x[0],
            &i64s(cpu, &[1, -100, 4, 0], &[4]),
            -100,
            Reduction::Mean,
        )
    });
    check_gradients("cross_entropy sum", &[input(&[3, 2])], &|cpu, x| {
        cross_entropy(&x[0], &i64s(cpu, &[1, 0, 1], &[3]), -100, Reduction::Sum)
    });
    check_gradients("dropout", &[input(&[4, 5])], &|_, x| {
        dropout(&x[0], 0.3, true, &Generator::new(5))
    });
}

#[test]
fn inplace_ops_in_the_graph() {
    check_gradients(
        "add_ into a non-leaf",
        &[input(&[3]), input(&[3])],
        &|_, x| {
            let t = x[0].mul_scalar(2.0)?;
            t.add_(&x[1])?;
            Ok(t)
        },
    );
    check_gradients(
        "mul_ by a broadcast tensor",
        &[input(&[2, 3]), input(&[3])],
        &|_, x| {
            let t = x[0].exp()?.add_scalar(0.0)?;
            t.mul_(&x[1])?;
            Ok(t)
        },
    );
    check_gradients("div_", &[input(&[3]), positive(&[3])], &|_, x| {
        let t = x[0].mul_scalar(1.0)?;
        t.div_(&x[1])?;
        Ok(t)
    });
    check_gradients("copy_", &[input(&[2, 3]), input(&[3])], &|_, x| {
        let t = x[0].mul_scalar(1.0)?;
        t.copy_(&x[1])?;
        t.mul(&x[0])
    });
}

/// `cross_entropy_f32` of f16/bf16 logits is `cross_entropy` of their f32 copy: the same f32 loss,
/// and the same gradient once the copy's backward rounds it to the logits' dtype.
#[test]
fn cross_entropy_f32_is_the_loss_of_the_upcast_logits() {
    let cpu = CpuBackend::new_ref();
    let (rows, classes) = (6, 11);
    let target = i64s(&cpu, &[1, -100, 10, 0, 5, 7], &[rows]);
    for dtype in [DType::BF16, DType::F16] {
        let run = |upcast_inside: bool| {
            let logits = Tensor::from_f64s(
                &cpu,
                &values(rows * classes, -4.0, 4.0, 9),
                &[rows, classes],
                dtype,
            )
            .unwrap();
            logits.requires_grad_(true).unwrap();
            let loss = if upcast_inside {
                cross_entropy_f32(&logits, &target, -100, Reduction::Mean).unwrap()
            } else {
                let copy = logits.to_dtype(DType::F32).unwrap();
                cross_entropy(&copy, &target, -100, Reduction::Mean).unwrap()
            };
            assert_eq!(loss.dtype(), DType::F32);
            loss.backward().unwrap();
            let grad = logits.grad().unwrap();
            assert_eq!(grad.dtype(), dtype);
            (loss.to_vec_f64().unwrap(), grad.to_vec_f64().unwrap())
        };
        assert_eq!(run(true), run(false), "{dtype:?}");
    }
}

#[test]
fn llama_ops() {
    check_gradients("rms_norm", &[input(&[3, 5]), input(&[5])], &|_, x| {
        rms_norm(&x[0], &x[1], 1e-6)
    });
    check_gradients(
        "rms_norm of a transpose",
        &[input(&[5, 3]), input(&[5])],
        &|_, x| rms_norm(&x[0].t()?, &x[1], 1e-6),
    );
    check_gradients(
        "swiglu",
        &[input(&[2, 3, 4]), input(&[2, 3, 4])],
        &|_, x| swiglu(&x[0], &x[1]),
    );
    check_gradients(
        "swiglu of a packed projection",
        &[input(&[3, 8])],
        &|_, x| swiglu(&x[0].narrow(-1, 0, 4)?, &x[0].narrow(-1, 4, 4)?),
    );
    // Any tables (not only cosines and sines): the backward is the exact transpose.
    check_gradients(
        "rotary_embedding of heads",
        &[input(&[2, 3, 2, 4])],
        &|cpu, x| {
            let table =
                |seed| Tensor::from_f64s(cpu, &values(12, -1.0, 1.0, seed), &[3, 4], DType::F64);
            rotary_embedding(&x[0].permute(&[0, 2, 1, 3])?, &table(5)?, &table(6)?)
        },
    );
}
