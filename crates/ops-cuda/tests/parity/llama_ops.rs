//! The fused Llama ops on the GPU against the CPU, through autograd-core's ops (so the forward
//! and backward primitives both run): RMSNorm at Llama shapes (4096 rows of 2048, and 2117 and 1
//! rows) and at widths that take each kernel (1, 2 and 4 vectors a thread; not whole vectors;
//! too wide for registers), also with dx or the weight gradient alone; SwiGLU dense and on the
//! halves of a packed projection; and the rotary embedding on the strided heads of a projection
//! and at a head width of no whole vector. Output and input gradients (from `sum(out ·
//! weights)`) are compared within each dtype's tolerance.

use headroom_autograd_core::{rms_norm, rotary_embedding, swiglu, BackendRef, DType, Tensor};
use headroom_testkit::inputs::Xorshift;

use super::{backends, compare, FLOATS};

/// A leaf's values and shape.
type Leaf = (Vec<f64>, Vec<usize>);

/// Values in `[low, high)`.
fn values(random: &mut Xorshift, n: usize, low: f64, high: f64) -> Vec<f64> {
    (0..n).map(|_| random.next_f64_in(low, high)).collect()
}

/// The output of `op` on leaves made of `inputs`, then the leaves' gradients of
/// `sum(out · weights)`, all as f64.
fn output_and_grads(
    backend: &BackendRef,
    dtype: DType,
    inputs: &[Leaf],
    weights: &[f64],
    op: &dyn Fn(&[Tensor]) -> Tensor,
) -> Vec<f64> {
    let trainable = vec![true; inputs.len()];
    output_and_some_grads(backend, dtype, inputs, &trainable, weights, op)
}

/// [`output_and_grads`] with only the leaves marked in `trainable` requiring a gradient (and
/// only their gradients returned).
fn output_and_some_grads(
    backend: &BackendRef,
    dtype: DType,
    inputs: &[Leaf],
    trainable: &[bool],
    weights: &[f64],
    op: &dyn Fn(&[Tensor]) -> Tensor,
) -> Vec<f64> {
    let leaves: Vec<Tensor> = inputs
        .iter()
        .zip(trainable)
        .map(|((values, shape), &wants_grad)| {
            let leaf = Tensor::from_f64s(backend, values, shape, dtype).unwrap();
            leaf.requires_grad_(wants_grad).unwrap();
            leaf
        })
        .collect();
    let out = op(&leaves);
    let w = Tensor::from_f64s(backend, weights, out.shape(), dtype).unwrap();
    out.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    let mut res = out.to_vec_f64().unwrap();
    for (leaf, _) in leaves.iter().zip(trainable).filter(|(_, &wants)| wants) {
        res.extend(leaf.grad().unwrap().to_vec_f64().unwrap());
    }
    res
}

/// RMSNorm's leaves for `rows` rows of `n` (x in `[-2, 2)`, the weight in `[0.5, 1.5)`), then
/// the output's weights, drawn in that order.
fn rms_norm_inputs(random: &mut Xorshift, rows: usize, n: usize) -> ([Leaf; 2], Vec<f64>) {
    let inputs = [
        (values(random, rows * n, -2.0, 2.0), vec![rows, n]),
        (values(random, n, 0.5, 1.5), vec![n]),
    ];
    (inputs, values(random, rows * n, -1.0, 1.0))
}

#[test]
#[ignore = "needs a CUDA device"]
fn rms_norm_matches_the_cpu() {
    let Some((gpu, cpu)) = backends() else { return };
    let mut random = Xorshift::from_state(0x11a3_a000_0000_0001);
    // 2048: Llama-3.2-1B (4096 rows: whole passes of 8 or 4 rows a block; 2117: more passes
    // than blocks with a last pass of a few rows; 1: a single row); 256 / 1000 / 4096: 1, 2 and
    // 4 vectors a thread (bf16) or the row kernel; 300 and 2051: no whole number of vectors;
    // 8192: f32 too wide for registers.
    for (rows, n) in [
        (4096, 2048),
        (2117, 2048),
        (1, 2048),
        (7, 256),
        (9, 1000),
        (5, 4096),
        (11, 300),
        (3, 2051),
        (6, 8192),
    ] {
        for dtype in FLOATS {
            let (inputs, weights) = rms_norm_inputs(&mut random, rows, n);
            compare("rms_norm", dtype, &gpu, &cpu, |backend| {
                output_and_grads(backend, dtype, &inputs, &weights, &|t| {
                    rms_norm(&t[0], &t[1], 1e-5).unwrap()
                })
            });
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn rms_norm_with_one_gradient_matches_the_cpu() {
    let Some((gpu, cpu)) = backends() else { return };
    let mut random = Xorshift::from_state(0x11a3_a000_0000_0004);
    // The backward writing dx alone (a frozen weight) and the weight gradient alone (x a
    // constant), in the vectorised kernel (2048) and the row kernel (300 in 16-bit types).
    for (rows, n) in [(37, 2048), (13, 300)] {
        for dtype in FLOATS {
            let (inputs, weights) = rms_norm_inputs(&mut random, rows, n);
            for trainable in [[true, false], [false, true]] {
                compare("rms_norm, one gradient", dtype, &gpu, &cpu, |backend| {
                    output_and_some_grads(backend, dtype, &inputs, &trainable, &weights, &|t| {
                        rms_norm(&t[0], &t[1], 1e-5).unwrap()
                    })
                });
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn swiglu_matches_the_cpu_dense_and_packed() {
    let Some((gpu, cpu)) = backends() else { return };
    let mut random = Xorshift::from_state(0x5a19_1100_0000_0002);
    for (rows, n) in [(4096, 2048), (13, 1001), (3, 8)] {
        for dtype in FLOATS {
            let dense = [
                (values(&mut random, rows * n, -6.0, 6.0), vec![rows, n]),
                (values(&mut random, rows * n, -2.0, 2.0), vec![rows, n]),
            ];
            let packed = [(
                values(&mut random, rows * 2 * n, -6.0, 6.0),
                vec![rows, 2 * n],
            )];
            let weights = values(&mut random, rows * n, -1.0, 1.0);
            compare("swiglu", dtype, &gpu, &cpu, |backend| {
                output_and_grads(backend, dtype, &dense, &weights, &|t| {
                    swiglu(&t[0], &t[1]).unwrap()
                })
            });
            compare("swiglu of packed halves", dtype, &gpu, &cpu, |backend| {
                output_and_grads(backend, dtype, &packed, &weights, &|t| {
                    let (gate, up) = (
                        t[0].narrow(-1, 0, n).unwrap(),
                        t[0].narrow(-1, n, n).unwrap(),
                    );
                    swiglu(&gate, &up).unwrap()
                })
            });
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn rotary_embedding_matches_the_cpu_on_strided_heads() {
    let Some((gpu, cpu)) = backends() else { return };
    let mut random = Xorshift::from_state(0x7074_a700_0000_0003);
    // [batch, seq, heads, head_dim]: 64 (Llama-3.2-1B's heads), 6 (no whole vector).
    for (batch, seq, heads, head_dim) in [(2, 128, 8, 64), (3, 5, 2, 6)] {
        for dtype in FLOATS {
            let n = batch * seq * heads * head_dim;
            let angles = values(&mut random, seq * head_dim, 0.0, 6.0);
            let cos: Vec<f64> = angles.iter().map(|a| a.cos()).collect();
            let sin: Vec<f64> = angles.iter().map(|a| a.sin()).collect();
            let inputs = [(
                values(&mut random, n, -2.0, 2.0),
                vec![batch, seq, heads, head_dim],
            )];
            let weights = values(&mut random, n, -1.0, 1.0);
            compare("rotary_embedding", dtype, &gpu, &cpu, |backend| {
                let table =
                    |v: &[f64]| Tensor::from_f64s(backend, v, &[seq, head_dim], dtype).unwrap();
                let (cos, sin) = (table(&cos), table(&sin));
                output_and_grads(backend, dtype, &inputs, &weights, &|t| {
                    let heads_view = t[0].permute(&[0, 2, 1, 3]).unwrap();
                    rotary_embedding(&heads_view, &cos, &sin).unwrap()
                })
            });
        }
    }
}
