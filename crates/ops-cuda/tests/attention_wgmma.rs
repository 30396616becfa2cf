//! Hopper attention (`kernels/attention_wgmma_sm90a.cu`, issue 35) against the CPU: with
//! `HEADROOM_ATTENTION_WGMMA=1` (set here, before this binary's first attention) an f16 or bf16
//! forward and backward on a compute capability 9.0 device run on wgmma; the output and the three
//! gradients match the CPU's (f64 sums) within the dtype's rounding, for head dims 64 and 128
//! (and ones padded to them), causal and not, grouped heads, more keys than queries, partial
//! tiles, packed sequences and (bf16) dropout replayed from the same draw as the CPU's mask; the
//! launches are counted (`CudaBackend::attention_wgmma_forwards`, `_backwards`). Then the same
//! cases with `HEADROOM_ATTENTION_WGMMA=ws`, `ws-overlap` and `ws-pingpong`: the warp-specialised
//! kernels (`kernels/attention_ws_sm90a.cu`, counted by `attention_ws_forwards` and
//! `_backwards`, a backward's dQ and dK/dV kernels counted once) take the forwards and backwards
//! without dropout or packing, the wgmma kernels the rest. Then the default (the variable unset:
//! the warp-specialised forward and backward where they apply, wgmma for the rest) and `0` (the
//! mma.sync kernels, which
//! no other test runs on this device). Its own binary, so
//! the variable is set before any other test reads it. Marked `#[ignore = "needs a CUDA device"]`.
#![cfg(feature = "cuda")]

use headroom_autograd_core::{
    scaled_dot_product_attention, scaled_dot_product_attention_dropout,
    scaled_dot_product_attention_varlen, scaled_dot_product_attention_varlen_dropout, BackendRef,
    DType, Generator, PackedSequences, Tensor,
};
use headroom_ops_cpu::CpuBackend;
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::gpu::cuda_or_skip;
use headroom_testkit::inputs::Xorshift;
use headroom_testkit::worst::{abs_difference, nan_max};

/// What a case asks of the attention besides its sizes: causal, packed sequences' boundaries
/// (one batch row of their tokens), dropout's probability (drawn from a generator seeded 7).
#[derive(Debug, Clone, Copy)]
struct Mask<'a> {
    causal: bool,
    packed: Option<&'a [i32]>,
    dropout: Option<f64>,
}

/// Output and q, k, v gradients of attention on `backend` for the given values.
fn run(
    backend: &BackendRef,
    dtype: DType,
    shapes: ([usize; 4], [usize; 4]),
    values: &[Vec<f64>; 4],
    mask: Mask<'_>,
) -> [Vec<f64>; 4] {
    let leaf = |values: &[f64], shape: &[usize]| {
        let t = Tensor::from_f64s(backend, values, shape, dtype).unwrap();
        t.requires_grad_(true).unwrap();
        t
    };
    let (q_shape, kv_shape) = shapes;
    let (q, k, v) = (
        leaf(&values[0], &q_shape),
        leaf(&values[1], &kv_shape),
        leaf(&values[2], &kv_shape),
    );
    let dout = Tensor::from_f64s(backend, &values[3], &q_shape, dtype).unwrap();
    let generator = Generator::new(7);
    let causal = mask.causal;
    let packed = mask
        .packed
        .map(|bounds| PackedSequences::new(backend, bounds).unwrap());
    let out = match (&packed, mask.dropout) {
        (None, None) => scaled_dot_product_attention(&q, &k, &v, causal, None),
        (None, Some(p)) => {
            scaled_dot_product_attention_dropout(&q, &k, &v, causal, None, p, &generator)
        }
        (Some(packed), None) => {
            scaled_dot_product_attention_varlen(&q, &k, &v, packed, causal, None)
        }
        (Some(packed), Some(p)) => scaled_dot_product_attention_varlen_dropout(
            &q, &k, &v, packed, causal, None, p, &generator,
        ),
    }
    .unwrap();
    out.mul(&dout)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let grad = |t: &Tensor| t.grad().unwrap().to_vec_f64().unwrap();
    [out.to_vec_f64().unwrap(), grad(&q), grad(&k), grad(&v)]
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_wgmma_forward_matches_the_cpu() {
    // SAFETY: this binary's only test sets the variable before it starts any thread or
    // attention, so no other thread reads the environment meanwhile.
    unsafe { std::env::set_var("HEADROOM_ATTENTION_WGMMA", "1") };
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    if cuda.compute_capability() != (9, 0) {
        headroom_testkit::gpu::skip("the wgmma kernels need compute capability 9.0");
        return;
    }
    let gpu: BackendRef = cuda.clone();
    let cpu: BackendRef = CpuBackend::new_ref();
    let mut random = Xorshift::from_state(0x3a09_9a11_0035_0001);
    let plain = |causal| Mask {
        causal,
        packed: None,
        dropout: None,
    };
    // Sequences of 37, 64, 1, 90, 0 and 29 tokens (221), and of 5, 200 and 31 (236).
    let uneven: &[i32] = &[0, 37, 101, 102, 192, 192, 221];
    let three: &[i32] = &[0, 5, 205, 236];
    let packed = |bounds, causal, dropout| Mask {
        causal,
        packed: Some(bounds),
        dropout,
    };
    let dropping = |causal, p| Mask {
        causal,
        packed: None,
        dropout: Some(p),
    };
    let cases: [Case<'_>; 15] = [
        (2, 4, 4, 128, 128, 64, plain(false)),
        (1, 4, 2, 197, 197, 64, plain(true)),
        (2, 2, 1, 70, 130, 64, plain(false)),
        (1, 8, 2, 256, 256, 128, plain(true)),
        (1, 2, 2, 65, 65, 128, plain(false)),
        (1, 3, 3, 100, 100, 40, plain(true)),
        (1, 2, 1, 129, 129, 96, plain(true)),
        (1, 4, 2, 221, 221, 64, packed(uneven, true, None)),
        (1, 2, 1, 236, 236, 128, packed(three, false, None)),
        (1, 4, 2, 221, 221, 64, packed(uneven, true, Some(0.1))),
        (2, 3, 3, 70, 70, 64, dropping(false, 0.1)),
        (1, 2, 2, 197, 197, 64, dropping(true, 0.5)),
        (1, 2, 2, 33, 45, 80, dropping(false, 0.3)),
        (2, 8, 2, 70, 70, 128, dropping(true, 0.2)),
        // Two tiles of the warp-specialised kernel's 128 queries, three of its 128 keys.
        (1, 4, 1, 256, 300, 128, plain(false)),
    ];
    for dtype in [DType::BF16, DType::F16] {
        for &case in &cases {
            if dtype == DType::F16 && case.6.dropout.is_some() {
                // f16 has no dropout build (a typed error on every GPU: parity's test).
                continue;
            }
            let before = counts(&cuda);
            if let Err(mismatch) = compare(&gpu, &cpu, &mut random, dtype, case) {
                panic!("{mismatch}");
            }
            let after = counts(&cuda);
            assert_eq!(
                after,
                [before[0] + 1, before[1] + 1, before[2], before[3]],
                "ran on wgmma"
            );
        }
    }

    // The warp-specialised forward (`ws`, `ws-overlap`, `ws-pingpong`) takes the cases without
    // dropout or packing, and their backward (dQ, then dK/dV); the others run as with
    // `1`. Every build and case runs before the test fails, so one run names every mismatch
    // (each build's start goes to stderr: a kernel that never finishes shows where under
    // `--nocapture`).
    // Then the default (`None`: the variable unset), which routes as `ws-pingpong` at head dims
    // above 64 and `ws` below, and `0`, the mma.sync kernels, which count on neither.
    let mut mismatches = Vec::new();
    for (value, dtype) in [
        Some("ws"),
        Some("ws-overlap"),
        Some("ws-pingpong"),
        None,
        Some("0"),
    ]
    .into_iter()
    .flat_map(|value| [(value, DType::BF16), (value, DType::F16)])
    {
        let name = value.unwrap_or("unset");
        eprintln!("HEADROOM_ATTENTION_WGMMA={name}, {dtype:?}");
        // SAFETY: as above: this test alone runs in the binary, and no attention is under way.
        unsafe {
            match value {
                Some(value) => std::env::set_var("HEADROOM_ATTENTION_WGMMA", value),
                None => std::env::remove_var("HEADROOM_ATTENTION_WGMMA"),
            }
        };
        for &case in &cases {
            let mask = case.6;
            if dtype == DType::F16 && mask.dropout.is_some() {
                continue;
            }
            let before = counts(&cuda);
            if let Err(mismatch) = compare(&gpu, &cpu, &mut random, dtype, case) {
                mismatches.push(format!("{name}: {mismatch}"));
            }
            let after = counts(&cuda);
            let warp_specialized = mask.dropout.is_none() && mask.packed.is_none();
            let expected = match value {
                Some("0") => before,
                _ if warp_specialized => [before[0], before[1], before[2] + 1, before[3] + 1],
                _ => [before[0] + 1, before[1] + 1, before[2], before[3]],
            };
            assert_eq!(after, expected, "{name}: {dtype:?} {case:?}");
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
}

/// (batch, heads, kv_heads, queries, keys, head_dim, mask)
type Case<'a> = (usize, usize, usize, usize, usize, usize, Mask<'a>);

/// Forwards and backwards counted on the wgmma kernels, then forwards and backwards on the
/// warp-specialised ones.
fn counts(cuda: &CudaBackend) -> [u64; 4] {
    [
        cuda.attention_wgmma_forwards(),
        cuda.attention_wgmma_backwards(),
        cuda.attention_ws_forwards(),
        cuda.attention_ws_backwards(),
    ]
}

/// One case on the GPU and the CPU from the same random values: the output and the three
/// gradients agree within the dtype's rounding, or the error names each that does not.
fn compare(
    gpu: &BackendRef,
    cpu: &BackendRef,
    random: &mut Xorshift,
    dtype: DType,
    case: Case<'_>,
) -> Result<(), String> {
    let (batch, heads, kv_heads, queries, keys, head_dim, mask) = case;
    let causal = mask.causal;
    let q_shape = [batch, heads, queries, head_dim];
    let kv_shape = [batch, kv_heads, keys, head_dim];
    let mut draw =
        |n: usize| -> Vec<f64> { (0..n).map(|_| random.next_f64_in(-2.0, 2.0)).collect() };
    let (nq, nkv) = (q_shape.iter().product(), kv_shape.iter().product());
    let values = [draw(nq), draw(nkv), draw(nkv), draw(nq)];
    let on_gpu = run(gpu, dtype, (q_shape, kv_shape), &values, mask);
    let on_cpu = run(cpu, dtype, (q_shape, kv_shape), &values, mask);
    let mut mismatches = Vec::new();
    for (name, (g, c)) in ["out", "dq", "dk", "dv"]
        .iter()
        .zip(on_gpu.iter().zip(&on_cpu))
    {
        let largest = c.iter().fold(1e-30f64, |m, v| nan_max(m, v.abs()));
        let worst = abs_difference(g, c);
        // The output within a few units of the dtype's last place of the largest; the
        // gradients (sums over many rounded probabilities) within twice that.
        let bound = if *name == "out" {
            2f64.powi(-6)
        } else {
            2f64.powi(-5)
        };
        // A NaN fails too.
        if worst.is_nan() || worst > bound * largest {
            mismatches.push(format!("{name}: {worst} against {largest}"));
        }
    }
    if mismatches.is_empty() {
        return Ok(());
    }
    Err(format!(
        "{dtype:?} b{batch} h{heads}/{kv_heads} {queries}x{keys} d{head_dim} causal={causal} \
         packed={:?} dropout={:?}: {}",
        mask.packed,
        mask.dropout,
        mismatches.join(", ")
    ))
}
