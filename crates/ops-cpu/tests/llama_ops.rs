//! The fused Llama ops on the CPU against their composed references, in every float dtype:
//! RMSNorm against Hugging Face's `LlamaRMSNorm` written with autograd-core's generic ops,
//! SwiGLU against its f64 formula rounded once, the rotary embedding against
//! `x · cos + rotate_half(x) · sin` composed; forward and backward. Also what each op saves for
//! backward, and the typed errors of bad calls.
//!
//! Bounds are stated per dtype as a fraction of the reference's largest magnitude: bitwise where
//! the arithmetic is the same, else the rounding the two orders of operations can differ by.

use std::sync::{Arc, Mutex};

use headroom_autograd_core::{
    cat, rms_norm, rotary_embedding, saved_tensor_hooks, swiglu, BackendRef, BackwardOptions,
    DType, Packed, RmsNormForward, SaveRole, Tensor, TensorError,
};
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::inputs::uniform_f64;
use headroom_testkit::worst::nan_max;

const FLOATS: [DType; 4] = [DType::F64, DType::F32, DType::F16, DType::BF16];

/// `values` as a `dtype` tensor of `shape` that requires grad.
fn leaf(cpu: &BackendRef, values: &[f64], shape: &[usize], dtype: DType) -> Tensor {
    let t = Tensor::from_f64s(cpu, values, shape, dtype).unwrap();
    t.requires_grad_(true).unwrap();
    t
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

/// `max |ours − theirs| / max |theirs|`.
fn relative(ours: &[f64], theirs: &[f64]) -> f64 {
    assert_eq!(ours.len(), theirs.len());
    let scale = theirs.iter().fold(1e-300f64, |m, v| nan_max(m, v.abs()));
    let diff = ours
        .iter()
        .zip(theirs)
        .fold(0.0f64, |m, (a, b)| nan_max(m, (a - b).abs()));
    diff / scale
}

/// Rounding bound of `dtype`, relative to the largest magnitude: `ulps` units in the last place.
fn ulps(dtype: DType, ulps: f64) -> f64 {
    let epsilon = match dtype {
        DType::F64 => f64::EPSILON,
        DType::F32 => f64::from(f32::EPSILON),
        DType::F16 => 2f64.powi(-10),
        _ => 2f64.powi(-7),
    };
    ulps * epsilon
}

/// `sum(out · weights)` backward, then the gradients of `inputs` as f64.
fn grads_of(out: &Tensor, weights: &[f64], inputs: &[&Tensor]) -> Vec<Vec<f64>> {
    let cpu = out.backend().clone();
    let w = Tensor::from_f64s(&cpu, weights, out.shape(), out.dtype()).unwrap();
    out.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    inputs.iter().map(|t| f64s(&t.grad().unwrap())).collect()
}

/// Hugging Face's `LlamaRMSNorm.forward` in autograd-core's generic ops.
fn composed_rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    let compute = match x.dtype() {
        DType::F16 | DType::BF16 => DType::F32,
        other => other,
    };
    let h = x.to_dtype(compute).unwrap();
    let variance = h.pow_scalar(2.0).unwrap().mean(&[-1], true).unwrap();
    let rstd = variance.add_scalar(eps).unwrap().rsqrt().unwrap();
    let normed = h.mul(&rstd).unwrap().to_dtype(x.dtype()).unwrap();
    weight.mul(&normed).unwrap()
}

#[test]
fn rms_norm_matches_hugging_face_composed_in_every_dtype() {
    let cpu = CpuBackend::new_ref();
    let (rows, n, eps) = (6, 37, 1e-6);
    let xs = uniform_f64(rows * n, -2.0, 2.0, 1);
    let ws = uniform_f64(n, 0.5, 1.5, 2);
    let dys = uniform_f64(rows * n, -1.0, 1.0, 3);
    for dtype in FLOATS {
        let run = |fused: bool, dtype: DType| {
            let (x, w) = (
                leaf(&cpu, &xs, &[2, 3, n], dtype),
                leaf(&cpu, &ws, &[n], dtype),
            );
            let out = if fused {
                rms_norm(&x, &w, eps).unwrap()
            } else {
                composed_rms_norm(&x, &w, eps)
            };
            let values = f64s(&out);
            (values, grads_of(&out, &dys, &[&x, &w]))
        };
        let (fused, fused_grads) = run(true, dtype);
        let (composed, composed_grads) = run(false, dtype);
        // Forward: the same roundings but for rstd (f64 then rounded, against f32 steps).
        let forward = relative(&fused, &composed);
        assert!(
            forward <= ulps(dtype, 4.0),
            "{dtype:?}: forward {forward:e}"
        );
        // Backward: the fused one rounds once; against the composed one in f64 for 16-bit
        // types (whose composed backward rounds at every step), in the dtype otherwise.
        let (_, reference) = run(
            false,
            if dtype.size_in_bytes() == 2 {
                DType::F64
            } else {
                dtype
            },
        );
        for (k, name) in ["dx", "dweight"].into_iter().enumerate() {
            let bound = if dtype.size_in_bytes() == 2 {
                ulps(dtype, 4.0)
            } else {
                ulps(dtype, 64.0)
            };
            let error = relative(&fused_grads[k], &reference[k]);
            assert!(error <= bound, "{dtype:?}: {name} {error:e} > {bound:e}");
            if dtype.size_in_bytes() > 2 {
                let against_composed = relative(&fused_grads[k], &composed_grads[k]);
                assert!(
                    against_composed <= bound,
                    "{dtype:?}: {name} {against_composed:e}"
                );
            }
        }
    }
}

fn sigmoid(g: f64) -> f64 {
    1.0 / (1.0 + (-g).exp())
}

#[test]
fn swiglu_is_its_f64_formula_rounded_once_in_every_dtype() {
    let cpu = CpuBackend::new_ref();
    let (rows, n) = (5, 19);
    let gs = uniform_f64(rows * n, -6.0, 6.0, 4);
    let us = uniform_f64(rows * n, -2.0, 2.0, 5);
    let douts = uniform_f64(rows * n, -1.0, 1.0, 6);
    for dtype in FLOATS {
        // The reference reads the inputs as the dtype holds them.
        let as_stored = |v: &[f64]| f64s(&Tensor::from_f64s(&cpu, v, &[v.len()], dtype).unwrap());
        let (g, u, d) = (as_stored(&gs), as_stored(&us), as_stored(&douts));
        let round = |v: Vec<f64>| as_stored(&v);
        let out_ref = round((0..g.len()).map(|i| g[i] * sigmoid(g[i]) * u[i]).collect());
        let dgate_ref = round(
            (0..g.len())
                .map(|i| {
                    let s = sigmoid(g[i]);
                    d[i] * u[i] * s * (1.0 + g[i] * (1.0 - s))
                })
                .collect(),
        );
        let dup_ref = round((0..g.len()).map(|i| d[i] * g[i] * sigmoid(g[i])).collect());

        let (gate, up) = (
            leaf(&cpu, &gs, &[rows, n], dtype),
            leaf(&cpu, &us, &[rows, n], dtype),
        );
        let out = swiglu(&gate, &up).unwrap();
        assert_eq!(f64s(&out), out_ref, "{dtype:?}: forward");
        let dout = Tensor::from_f64s(&cpu, &douts, &[rows, n], dtype).unwrap();
        out.backward_with(
            Some(dout),
            BackwardOptions {
                retain_graph: false,
            },
        )
        .unwrap();
        assert_eq!(f64s(&gate.grad().unwrap()), dgate_ref, "{dtype:?}: dgate");
        assert_eq!(f64s(&up.grad().unwrap()), dup_ref, "{dtype:?}: dup");
    }
}

#[test]
fn swiglu_reads_the_halves_of_a_packed_projection_in_place() {
    let cpu = CpuBackend::new_ref();
    let packed_values = uniform_f64(4 * 10, -3.0, 3.0, 7);
    let packed = leaf(&cpu, &packed_values, &[4, 10], DType::F32);
    let (gate, up) = (
        packed.narrow(-1, 0, 5).unwrap(),
        packed.narrow(-1, 5, 5).unwrap(),
    );
    let out = swiglu(&gate, &up).unwrap();
    let dense = |t: &Tensor| t.contiguous().unwrap().detach();
    let (g2, u2) = (dense(&gate), dense(&up));
    g2.requires_grad_(true).unwrap();
    u2.requires_grad_(true).unwrap();
    let expected = swiglu(&g2, &u2).unwrap();
    assert_eq!(f64s(&out), f64s(&expected));
    let weights = uniform_f64(20, -1.0, 1.0, 8);
    let packed_grad = grads_of(&out, &weights, &[&packed]).remove(0);
    let dense_grads = grads_of(&expected, &weights, &[&g2, &u2]);
    let joined = cat(
        &[
            &Tensor::from_f64s(&cpu, &dense_grads[0], &[4, 5], DType::F64).unwrap(),
            &Tensor::from_f64s(&cpu, &dense_grads[1], &[4, 5], DType::F64).unwrap(),
        ],
        -1,
    )
    .unwrap();
    assert_eq!(packed_grad, f64s(&joined));
}

/// `x · cos + rotate_half(x) · sin` in autograd-core's generic ops (the tables in `x`'s dtype).
fn composed_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.shape()[x.ndim() - 1] / 2;
    let first = x.narrow(-1, 0, half).unwrap();
    let second = x.narrow(-1, half, half).unwrap();
    let rotated = cat(&[&second.neg().unwrap(), &first], -1).unwrap();
    x.mul(cos).unwrap().add(&rotated.mul(sin).unwrap()).unwrap()
}

#[test]
fn rotary_embedding_matches_the_composed_rotation_on_strided_heads() {
    let cpu = CpuBackend::new_ref();
    let (batch, seq, heads, head_dim) = (2, 5, 3, 8);
    let xs = uniform_f64(batch * seq * heads * head_dim, -2.0, 2.0, 9);
    let angles = uniform_f64(seq * head_dim / 2, 0.0, 6.0, 10);
    let table = |f: fn(f64) -> f64| -> Vec<f64> {
        (0..seq)
            .flat_map(|s| {
                let row = &angles[s * head_dim / 2..(s + 1) * head_dim / 2];
                row.iter().chain(row).map(|&a| f(a)).collect::<Vec<_>>()
            })
            .collect()
    };
    let dys = uniform_f64(xs.len(), -1.0, 1.0, 11);
    for dtype in FLOATS {
        let run = |fused: bool| {
            // The heads of a [batch, seq, heads · head_dim] projection: a strided view.
            let x = leaf(&cpu, &xs, &[batch, seq, heads, head_dim], dtype);
            let heads_view = x.permute(&[0, 2, 1, 3]).unwrap();
            let cos = Tensor::from_f64s(&cpu, &table(f64::cos), &[seq, head_dim], dtype).unwrap();
            let sin = Tensor::from_f64s(&cpu, &table(f64::sin), &[seq, head_dim], dtype).unwrap();
            let out = if fused {
                rotary_embedding(&heads_view, &cos, &sin).unwrap()
            } else {
                composed_rotary(&heads_view, &cos, &sin)
            };
            (f64s(&out), grads_of(&out, &dys, &[&x]).remove(0), out)
        };
        let (fused, fused_grad, out) = run(true);
        let (composed, composed_grad, _) = run(false);
        // Laid out like the projection: [batch, seq, heads, head_dim] in memory.
        assert_eq!(
            out.strides(),
            [seq * heads * head_dim, head_dim, heads * head_dim, 1]
        );
        // f64: the same products and sum, so bitwise; otherwise one rounding against three.
        let bound = if dtype == DType::F64 {
            0.0
        } else {
            ulps(dtype, 2.0)
        };
        let forward = relative(&fused, &composed);
        let backward = relative(&fused_grad, &composed_grad);
        assert!(forward <= bound, "{dtype:?}: forward {forward:e}");
        assert!(backward <= bound, "{dtype:?}: backward {backward:e}");
    }
}

/// The saves (op, role, bytes) of `f`, through saved-tensor hooks.
fn saves_of(f: impl FnOnce() -> Tensor) -> (Tensor, Vec<(&'static str, SaveRole, u64)>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let _hooks = saved_tensor_hooks(
        move |site, tensor| {
            record
                .lock()
                .unwrap()
                .push((site.op, site.role, site.bytes));
            Ok(Box::new(tensor) as Packed)
        },
        |packed| Ok(packed.downcast_ref::<Tensor>().expect("a tensor").clone()),
    );
    let out = f();
    let saves = seen.lock().unwrap().clone();
    (out, saves)
}

#[test]
fn each_op_saves_only_what_its_backward_needs() {
    let cpu = CpuBackend::new_ref();
    let x = leaf(
        &cpu,
        &uniform_f64(4 * 8, -1.0, 1.0, 12),
        &[4, 8],
        DType::F32,
    );
    let w = leaf(&cpu, &[1.0; 8], &[8], DType::F32);
    let (_, saves) = saves_of(|| rms_norm(&x, &w, 1e-5).unwrap());
    let expected = [
        ("rms_norm", SaveRole::Input(0), 4 * 8 * 4),
        ("rms_norm", SaveRole::Input(1), 8 * 4),
        ("rms_norm", SaveRole::Intermediate("rstd"), 4 * 4),
    ];
    assert_eq!(saves, expected);

    let (gate, up) = (x.mul_scalar(2.0).unwrap(), x.mul_scalar(3.0).unwrap());
    let (_, saves) = saves_of(|| swiglu(&gate, &up).unwrap());
    let expected = [
        ("swiglu", SaveRole::Input(0), 4 * 8 * 4),
        ("swiglu", SaveRole::Input(1), 4 * 8 * 4),
    ];
    assert_eq!(saves, expected, "no silu(gate), no output");

    // The rotary embedding saves its tables only, so its input is freed once dropped (sizes
    // are whole 512-byte blocks of the allocator).
    let cos = Tensor::full(&cpu, &[8, 16], 0.5, DType::F32).unwrap();
    let sin = Tensor::full(&cpu, &[8, 16], 0.25, DType::F32).unwrap();
    let allocated = || cpu.memory_stats().allocated_bytes.all.current;
    let heads = leaf(&cpu, &[0.5; 2 * 8 * 16], &[2, 8, 16], DType::F32);
    let projected = heads.mul_scalar(2.0).unwrap();
    let before = allocated();
    let (rotated, saves) = saves_of(|| rotary_embedding(&projected, &cos, &sin).unwrap());
    let expected = [
        ("rotary_embedding", SaveRole::Input(1), 512),
        ("rotary_embedding", SaveRole::Input(2), 512),
    ];
    assert_eq!(saves, expected);
    assert_eq!(allocated() - before, 1024, "the rotated output alone");
    drop(projected);
    assert_eq!(
        allocated(),
        before,
        "the projection freed, the rotated output in its place"
    );
    drop(rotated);
}

#[test]
fn bad_calls_are_typed_errors() {
    let cpu = CpuBackend::new_ref();
    let x = Tensor::zeros(&cpu, &[2, 4], DType::F32).unwrap();
    let w3 = Tensor::zeros(&cpu, &[3], DType::F32).unwrap();
    let w4_f64 = Tensor::zeros(&cpu, &[4], DType::F64).unwrap();
    let ids = Tensor::zeros(&cpu, &[2, 4], DType::I64).unwrap();
    assert!(matches!(
        rms_norm(&x, &w3, 1e-5),
        Err(TensorError::ShapeMismatch { op: "rms_norm", .. })
    ));
    assert!(matches!(
        rms_norm(&x, &w4_f64, 1e-5),
        Err(TensorError::DtypeMismatch { op: "rms_norm", .. })
    ));
    assert!(matches!(
        rms_norm(&ids, &w3, 1e-5),
        Err(TensorError::UnsupportedDtype { op: "rms_norm", .. })
    ));

    let y = Tensor::zeros(&cpu, &[2, 3], DType::F32).unwrap();
    assert!(matches!(
        swiglu(&x, &y),
        Err(TensorError::ShapeMismatch { op: "swiglu", .. })
    ));
    let x64 = x.to_dtype(DType::F64).unwrap();
    assert!(matches!(
        swiglu(&x, &x64),
        Err(TensorError::DtypeMismatch { op: "swiglu", .. })
    ));

    let table = Tensor::zeros(&cpu, &[2, 4], DType::F32).unwrap();
    let odd = Tensor::zeros(&cpu, &[2, 3], DType::F32).unwrap();
    let five_d = Tensor::zeros(&cpu, &[1, 1, 1, 2, 4], DType::F32).unwrap();
    for (input, table) in [(&x, &odd), (&odd, &odd), (&five_d, &table)] {
        assert!(matches!(
            rotary_embedding(input, table, table),
            Err(TensorError::ShapeMismatch {
                op: "rotary_embedding",
                ..
            })
        ));
    }

    // The backend checks a direct call too: a strided input, an rstd of the wrong dtype.
    let out = Tensor::zeros(&cpu, &[4, 2], DType::F32).unwrap();
    let rstd = Tensor::zeros(&cpu, &[4], DType::F32).unwrap();
    let rstd_f64 = Tensor::zeros(&cpu, &[4], DType::F64).unwrap();
    let w2 = Tensor::zeros(&cpu, &[2], DType::F32).unwrap();
    let transposed = x.t().unwrap();
    let call = |x: &Tensor, rstd: &Tensor| {
        cpu.rms_norm(RmsNormForward {
            x: x.view(),
            weight: w2.view(),
            eps: 1e-5,
            out: out.view(),
            rstd: rstd.view(),
        })
    };
    assert!(matches!(
        call(&transposed, &rstd),
        Err(TensorError::InvalidArgument { op: "rms_norm", .. })
    ));
    let dense = transposed.contiguous().unwrap();
    assert!(matches!(
        call(&dense, &rstd_f64),
        Err(TensorError::DtypeMismatch { op: "rms_norm", .. })
    ));
    assert!(call(&dense, &rstd).is_ok());
}
