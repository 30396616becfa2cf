//! The Llama cases of the kernels bench: RMSNorm and SwiGLU forward and backward, and the rotary
//! embedding (forward, and its transpose, the backward) on Llama-3.2-1B shapes: 8192 tokens
//! (4 sequences of 2048) of width 2048, an MLP of width 8192, 32 query heads of 64, in bf16 and
//! f32. Each case declares the bytes an ideal pass moves, so the table puts it beside the copy
//! ceiling.

use headroom_autograd_core::{
    DType, GateUp, RmsNormBackward, RmsNormForward, RotaryArgs, SwiGluBackward, SwiGluForward,
};
use headroom_ops_cuda::CudaStream;

use super::{Bench, Work};

/// Llama-3.2-1B's widths: hidden 2048, MLP 8192, 32 query heads of 64; 4 sequences of 2048.
const HIDDEN: usize = 2048;
const MLP: usize = 4 * HIDDEN;
const HEAD_DIM: usize = 64;
const HEADS: usize = HIDDEN / HEAD_DIM;
const SEQ: usize = 2048;
const TOKENS: usize = 4 * SEQ;

pub(super) fn llama(bench: &mut Bench, compute: &CudaStream) {
    for (dtype, suffix) in [(DType::BF16, "bf16"), (DType::F32, "f32")] {
        rms_norm(bench, compute, dtype, suffix);
        swiglu(bench, compute, dtype, suffix);
        rotary(bench, compute, dtype, suffix);
    }
}

fn rms_norm(bench: &mut Bench, compute: &CudaStream, dtype: DType, suffix: &str) {
    let gpu = bench.gpu.clone();
    let size = dtype.size_in_bytes();
    let (rows_bytes, param_bytes) = (TOKENS * HIDDEN * size, HIDDEN * size);
    let x = bench.tensor(&[TOKENS, HIDDEN], dtype, 31);
    let weight = bench.tensor(&[HIDDEN], dtype, 32);
    let out = bench.empty(&[TOKENS, HIDDEN], dtype);
    let rstd = bench.empty(&[TOKENS], DType::F32);
    bench.case(
        "rms_norm",
        &format!("fwd_{suffix}_{TOKENS}x{HIDDEN}"),
        Work::bytes(2 * rows_bytes + param_bytes + 4 * TOKENS),
        compute,
        || {
            gpu.rms_norm(RmsNormForward {
                x: x.view(),
                weight: weight.view(),
                eps: 1e-5,
                out: out.view(),
                rstd: rstd.view(),
            })
            .expect("rms norm")
        },
    );
    let dy = bench.tensor(&[TOKENS, HIDDEN], dtype, 33);
    let dx = bench.empty(&[TOKENS, HIDDEN], dtype);
    let dweight = bench.empty(&[HIDDEN], dtype);
    bench.case(
        "rms_norm",
        &format!("bwd_{suffix}_{TOKENS}x{HIDDEN}"),
        Work::bytes(3 * rows_bytes + 2 * param_bytes + 4 * TOKENS),
        compute,
        || {
            gpu.rms_norm_backward(RmsNormBackward {
                dy: dy.view(),
                x: x.view(),
                rstd: rstd.view(),
                weight: weight.view(),
                dx: Some(dx.view()),
                dweight: Some(dweight.view()),
            })
            .expect("rms norm backward")
        },
    );
}

fn swiglu(bench: &mut Bench, compute: &CudaStream, dtype: DType, suffix: &str) {
    let gpu = bench.gpu.clone();
    let bytes = TOKENS * MLP * dtype.size_in_bytes();
    let gate = bench.tensor(&[TOKENS, MLP], dtype, 34);
    let up = bench.tensor(&[TOKENS, MLP], dtype, 35);
    let out = bench.empty(&[TOKENS, MLP], dtype);
    bench.case(
        "swiglu",
        &format!("fwd_{suffix}_{TOKENS}x{MLP}"),
        Work::bytes(3 * bytes),
        compute,
        || {
            gpu.swiglu(SwiGluForward {
                inputs: GateUp {
                    gate: gate.view(),
                    up: up.view(),
                },
                out: out.view(),
            })
            .expect("swiglu")
        },
    );
    let (dgate, dup) = (
        bench.empty(&[TOKENS, MLP], dtype),
        bench.empty(&[TOKENS, MLP], dtype),
    );
    bench.case(
        "swiglu",
        &format!("bwd_{suffix}_{TOKENS}x{MLP}"),
        Work::bytes(5 * bytes),
        compute,
        || {
            gpu.swiglu_backward(SwiGluBackward {
                inputs: GateUp {
                    gate: gate.view(),
                    up: up.view(),
                },
                dout: out.view(),
                grads: GateUp {
                    gate: dgate.view(),
                    up: dup.view(),
                },
            })
            .expect("swiglu backward")
        },
    );
}

/// The queries of 4 × 2048 tokens as attention sees them: `[4, 32, 2048, 64]` heads strided out
/// of the `[4, 2048, 32 · 64]` projection, rotated into the same layout.
fn rotary(bench: &mut Bench, compute: &CudaStream, dtype: DType, suffix: &str) {
    let gpu = bench.gpu.clone();
    let batch = TOKENS / SEQ;
    let size = dtype.size_in_bytes();
    let heads_of =
        |t: headroom_autograd_core::Tensor| t.permute(&[0, 2, 1, 3]).expect("heads view");
    let x = heads_of(bench.tensor(&[batch, SEQ, HEADS, HEAD_DIM], dtype, 36));
    let out = heads_of(bench.empty(&[batch, SEQ, HEADS, HEAD_DIM], dtype));
    let cos = bench.tensor(&[SEQ, HEAD_DIM], dtype, 37);
    let sin = bench.tensor(&[SEQ, HEAD_DIM], dtype, 38);
    let work = Work::bytes(2 * TOKENS * HEADS * HEAD_DIM * size + 2 * SEQ * HEAD_DIM * size);
    for (direction, transpose) in [("fwd", false), ("bwd", true)] {
        bench.case(
            "rotary",
            &format!("{direction}_{suffix}_{batch}x{HEADS}x{SEQ}x{HEAD_DIM}"),
            work,
            compute,
            || {
                gpu.rotary_embedding(RotaryArgs {
                    x: x.view(),
                    cos: cos.view(),
                    sin: sin.view(),
                    transpose,
                    out: out.view(),
                })
                .expect("rotary embedding")
            },
        );
    }
}
