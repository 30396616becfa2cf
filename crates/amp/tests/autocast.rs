//! Autocast with PyTorch's lists: the output dtype of every op Headroom has equals PyTorch 2.11's
//! under `torch.autocast("cuda")` (`testdata/autocast_dtypes.json`, made on an H200), for f32
//! inputs, inputs already in the autocast dtype and mixed inputs, in f16 and bf16; overrides
//! change exactly what they name; and a parameter is cast once per region, the cast copies
//! holding exactly two bytes per element until the region ends; under a `Float8Policy` the
//! listed linears run in fp8 on their operands as they come and the others as the base says.

use std::sync::Arc;

use headroom_amp::{AmpPolicy, AutocastLists, Float8Policy, TorchList};
use headroom_autograd_core::{
    autocast_stats, cat, cross_entropy, dropout, embedding, layer_norm, patch_embedding,
    scaled_dot_product_attention, BackendRef, CastPolicy, DType, Float8History, Float8Recipe,
    Float8Role, Generator, Reduction, Tensor, AUTOCAST_OPS,
};
use headroom_nn::{Activation, Dropout, Mlp, Module};
use headroom_ops_cpu::CpuBackend;

type Make<'a> = dyn Fn(&[usize]) -> Tensor + 'a;

fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F64 => "float64",
        _ => "other",
    }
}

/// Headroom's counterpart of a row of the table, on tensors made by `t`.
fn run_op(name: &str, cpu: &BackendRef, t: &Make<'_>) -> Option<Tensor> {
    let ids = |values: &[i64], shape: &[usize]| Tensor::from_slice(cpu, values, shape).unwrap();
    let res = match name {
        "matmul" => t(&[4, 8]).matmul(&t(&[8, 3])),
        "linear" => t(&[4, 8]).linear(&t(&[3, 8]), Some(&t(&[3]))),
        "linear_gelu" => t(&[4, 8]).linear_gelu(&t(&[3, 8]), Some(&t(&[3]))),
        "scaled_dot_product_attention" => {
            let (q, k, v) = (t(&[2, 2, 5, 8]), t(&[2, 2, 5, 8]), t(&[2, 2, 5, 8]));
            scaled_dot_product_attention(&q, &k, &v, false, None)
        }
        "patch_embedding" => {
            patch_embedding(&t(&[1, 3, 32, 32]), &t(&[8, 3, 16, 16]), Some(&t(&[8])), 16)
        }
        "softmax" => t(&[4, 8]).softmax(-1),
        "log_softmax" => t(&[4, 8]).log_softmax(-1),
        "layer_norm" => layer_norm(&t(&[4, 8]), &[8], Some(&t(&[8])), Some(&t(&[8])), 1e-5),
        "cross_entropy" => cross_entropy(
            &t(&[4, 8]),
            &ids(&[1, 2, 3, 0], &[4]),
            -100,
            Reduction::Mean,
        ),
        "sum" => t(&[4, 8]).sum_all(),
        "sum_dim" => t(&[4, 8]).sum(&[-1], false),
        "mean" => t(&[4, 8]).mean_all(),
        "max_dim" => t(&[4, 8]).max_dim(-1, false).map(|(values, _)| values),
        "exp" => t(&[4, 8]).exp(),
        "log" => t(&[4, 8]).log(),
        "pow_scalar" => t(&[4, 8]).pow_scalar(2.0),
        "pow" => t(&[4, 8]).pow(&t(&[4, 8])),
        "sqrt" => t(&[4, 8]).sqrt(),
        "rsqrt" => t(&[4, 8]).rsqrt(),
        "tanh" => t(&[4, 8]).tanh(),
        "relu" => t(&[4, 8]).relu(),
        "gelu" => t(&[4, 8]).gelu(),
        "gelu_tanh" => t(&[4, 8]).gelu_tanh(),
        "neg" => t(&[4, 8]).neg(),
        "add" => t(&[4, 8]).add(&t(&[4, 8])),
        "sub" => t(&[4, 8]).sub(&t(&[4, 8])),
        "mul" => t(&[4, 8]).mul(&t(&[4, 8])),
        "div" => t(&[4, 8]).div(&t(&[4, 8])),
        "add_scalar" => t(&[4, 8]).add_scalar(1.5),
        "embedding" => embedding(&t(&[10, 8]), &ids(&[1, 2], &[2])),
        "dropout" => dropout(&t(&[4, 8]), 0.1, true, &Generator::new(0)),
        "cat" => cat(&[&t(&[4, 8]), &t(&[4, 8])], 0),
        "gather" => t(&[4, 8]).gather(1, &ids(&[0; 8], &[4, 2])),
        "masked_fill" => {
            let mask = Tensor::zeros(cpu, &[4, 8], DType::Bool).unwrap();
            t(&[4, 8]).masked_fill(&mask, 0.0)
        }
        "transpose" => Ok(t(&[4, 8]).t().unwrap()),
        "reshape" => t(&[4, 8]).reshape(&[8, 4]),
        _ => return None,
    };
    Some(res.unwrap_or_else(|e| panic!("{name}: {e}")))
}

/// The mixed-input rows: an f32 and a low-precision input, as the table's script combines them.
fn run_mixed(name: &str, f32s: &Make<'_>, lows: &Make<'_>) -> Option<Tensor> {
    let res = match name {
        "cat" => cat(&[&f32s(&[4, 8]), &lows(&[4, 8])], 0),
        "add" => f32s(&[4, 8]).add(&lows(&[4, 8])),
        "mul" => f32s(&[4, 8]).mul(&lows(&[4, 8])),
        "matmul" => f32s(&[4, 8]).matmul(&lows(&[8, 3])),
        "linear" => lows(&[4, 8]).linear(&f32s(&[3, 8]), Some(&f32s(&[3]))),
        _ => return None,
    };
    Some(res.unwrap_or_else(|e| panic!("{name} (mixed): {e}")))
}

/// Rows of the table whose op Headroom does not have (so nothing can differ).
const ABSENT: &[&str] = &["min_dim", "scatter_add"];

fn table() -> serde_json::Value {
    serde_json::from_str(include_str!("../../../testdata/autocast_dtypes.json")).unwrap()
}

#[test]
fn every_op_has_pytorchs_output_dtype() {
    let cpu = CpuBackend::new_ref();
    let table = table();
    assert_eq!(table["torch"], "2.11.0+cu130");
    let rows = table["ops"].as_object().unwrap();
    let mut checked = 0;
    let mut mismatches = Vec::new();
    for (name, row) in rows {
        if ABSENT.contains(&name.as_str()) {
            continue;
        }
        for (key, expected) in row.as_object().unwrap() {
            let (low_name, inputs) = key.split_once('/').unwrap();
            let low = if low_name == "float16" {
                DType::F16
            } else {
                DType::BF16
            };
            let policy = AmpPolicy::torch_cuda(low).unwrap();
            let make = |dtype: DType| {
                let cpu = cpu.clone();
                move |shape: &[usize]| Tensor::full(&cpu, shape, 0.5, dtype).unwrap()
            };
            let _autocast = policy.enter();
            let out = match inputs {
                "mixed" => run_mixed(name, &make(DType::F32), &make(low)),
                "float32" => run_op(name, &cpu, &make(DType::F32)),
                _ => run_op(name, &cpu, &make(low)),
            }
            .unwrap_or_else(|| panic!("no Headroom counterpart for {name} ({key})"));
            checked += 1;
            if dtype_name(out.dtype()) != expected.as_str().unwrap() {
                mismatches.push(format!(
                    "{name} {key}: ours {:?}, PyTorch {expected}",
                    out.dtype()
                ));
            }
        }
    }
    assert!(mismatches.is_empty(), "{mismatches:#?}");
    assert_eq!(checked, 36 * 4 + 5 * 2, "rows checked");
}

/// Every op that consults autocast has a row (under its own name or its table name).
#[test]
fn the_table_covers_every_autocast_op() {
    let table = table();
    let rows = table["ops"].as_object().unwrap();
    for op in AUTOCAST_OPS {
        let row = match *op {
            "max" => "max_dim",
            other => other,
        };
        assert!(
            rows.contains_key(row),
            "{op} has no row in autocast_dtypes.json"
        );
    }
}

#[test]
fn lists_and_overrides_decide_the_policy() {
    let lists = AutocastLists::torch_cuda();
    assert_eq!(lists.list_of("linear"), TorchList::LowerPrecision);
    assert_eq!(lists.list_of("softmax"), TorchList::Fp32SetOptDtype);
    assert_eq!(lists.list_of("layer_norm"), TorchList::Fp32);
    assert_eq!(lists.list_of("scatter_add"), TorchList::Promote);
    assert_eq!(lists.list_of("binary_cross_entropy"), TorchList::Banned);
    assert_eq!(lists.list_of("relu"), TorchList::Unlisted);

    let cpu = CpuBackend::new_ref();
    let x = Tensor::full(&cpu, &[4, 8], 0.5, DType::F32).unwrap();
    let w = Tensor::full(&cpu, &[3, 8], 0.5, DType::F32).unwrap();
    // Edited lists: layer_norm moved to lower precision.
    let mut edited = AutocastLists::torch_cuda();
    edited.fp32.retain(|op| *op != "layer_norm");
    edited.lower_precision.push("layer_norm");
    let policy = AmpPolicy::new(DType::BF16, edited).unwrap();
    assert_eq!(
        policy.cast_policy_of("layer_norm"),
        CastPolicy::LowerPrecision
    );
    {
        let _autocast = policy.enter();
        let y = layer_norm(&x, &[8], None, None, 1e-5).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
    }
    // A per-op override: linear kept in f32, everything else as the lists say.
    let policy = AmpPolicy::torch_cuda(DType::F16)
        .unwrap()
        .with_override("linear", CastPolicy::Keep)
        .unwrap();
    {
        let _autocast = policy.enter();
        assert_eq!(x.linear(&w, None).unwrap().dtype(), DType::F32);
        assert_eq!(x.matmul(&w.t().unwrap()).unwrap().dtype(), DType::F16);
    }
    let err = AmpPolicy::torch_cuda(DType::F16)
        .unwrap()
        .with_override("conv3d", CastPolicy::Keep)
        .unwrap_err();
    assert!(err.to_string().contains("AUTOCAST_OPS"), "{err}");
    assert!(AmpPolicy::torch_cuda(DType::F32).is_err());
}

/// A parameter is cast once per region: the second forward hits the cache for every weight, the
/// cache holds exactly 2 bytes per parameter element, and both it and every byte of the region
/// are gone when the region ends.
#[test]
fn parameters_are_cast_once_per_region_and_freed_at_its_end() {
    let cpu = Arc::new(CpuBackend::default());
    let backend: BackendRef = cpu.clone();
    let generator = Arc::new(Generator::new(3));
    let mlp = Mlp::new(
        &backend,
        64,
        256,
        Activation::Gelu,
        Dropout::new(0.0, Arc::clone(&generator)),
        DType::F32,
        &generator,
    )
    .unwrap();
    let params = mlp.parameters();
    let n_elements: usize = params.iter().map(Tensor::numel).sum();
    assert_eq!(n_elements, 64 * 256 + 256 + 256 * 64 + 64);
    let x = Tensor::full(&backend, &[8, 64], 0.25, DType::F32).unwrap();
    let before = cpu.allocator().memory_allocated();
    let policy = AmpPolicy::torch_cuda(DType::BF16).unwrap();
    {
        let _autocast = policy.enter();
        let first = mlp.forward(&x).unwrap();
        let after_first = autocast_stats();
        assert_eq!(after_first.cached_tensors, params.len());
        assert_eq!(after_first.cached_bytes, 2 * n_elements as u64);
        assert_eq!(after_first.cache_hits, 0);
        let second = mlp.forward(&x).unwrap();
        let after_second = autocast_stats();
        assert_eq!(after_second.cache_hits, params.len() as u64);
        assert_eq!(after_second.cached_bytes, 2 * n_elements as u64);
        // Only the inputs were cast again (the input of each forward, not the weights).
        assert_eq!(after_second.casts, after_first.casts + 1);
        assert_eq!(first.dtype(), DType::BF16);
        let loss = second.to_dtype(DType::F32).unwrap().sum_all().unwrap();
        loss.backward().unwrap();
    }
    assert_eq!(autocast_stats().cached_bytes, 0);
    for param in &params {
        assert_eq!(param.grad().unwrap().dtype(), DType::F32);
        param.zero_grad(true).unwrap();
    }
    assert_eq!(cpu.allocator().memory_allocated(), before);
}

/// The listed linear is `linear_float8` on its f32 operands as they come, its output in the
/// base policy's bf16 (to the bit), with no bf16 copy of its weight in the cast cache, and its
/// gradient reaching the f32 weight; an unlisted one equals the base policy's own; with no base,
/// the output stays f32.
#[test]
fn a_float8_policy_runs_its_linears_in_fp8_inside_the_base_casts() {
    let cpu = CpuBackend::new_ref();
    let values = |n: usize, step: f64| (0..n).map(|i| (i as f64 * step).sin()).collect::<Vec<_>>();
    let x = Tensor::from_f64s(&cpu, &values(4 * 16, 0.37), &[4, 16], DType::F32).unwrap();
    let w1 = Tensor::from_f64s(&cpu, &values(8 * 16, 0.11), &[8, 16], DType::F32).unwrap();
    let w2 = Tensor::from_f64s(&cpu, &values(8 * 8, 0.23), &[8, 8], DType::F32).unwrap();
    for w in [&w1, &w2] {
        w.requires_grad_(true).unwrap();
    }
    let names = [("fc.weight", &w1), ("head.weight", &w2)];
    let bf16 = AmpPolicy::torch_cuda(DType::BF16).unwrap();
    let policy = Float8Policy::new(Some(bf16.clone()))
        .with_linears(names.iter().map(|&(n, t)| (n, t)), |name| {
            name.starts_with("fc")
        });
    assert_eq!(policy.linears(), 1);
    let (h, y, cached) = {
        let _fp8 = policy.enter();
        let h = x.linear(&w1, None).unwrap();
        let y = h.linear(&w2, None).unwrap();
        (h, y, autocast_stats().cached_bytes)
    };
    assert_eq!(
        cached,
        8 * 8 * 2,
        "only the unlisted weight is cast to bf16"
    );
    let want_h = x
        .linear_float8(&w1.detach(), None)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    assert_eq!(h.dtype(), DType::BF16);
    assert_eq!(h.to_vec_f64().unwrap(), want_h.to_vec_f64().unwrap());
    let want_y = {
        let _bf16 = bf16.enter();
        want_h.linear(&w2, None).unwrap()
    };
    assert_eq!(y.to_vec_f64().unwrap(), want_y.to_vec_f64().unwrap());
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(w1.grad().unwrap().dtype(), DType::F32);
    assert_eq!(w1.grad().unwrap().shape(), &[8, 16]);

    // An f32 bias is added in the output's dtype; its gradient comes back in f32.
    let b1 = Tensor::from_f64s(&cpu, &values(8, 0.5), &[8], DType::F32).unwrap();
    b1.requires_grad_(true).unwrap();
    let z = {
        let _fp8 = policy.enter();
        x.linear(&w1, Some(&b1)).unwrap()
    };
    assert_eq!(z.dtype(), DType::BF16);
    z.sum_all().unwrap().backward().unwrap();
    assert_eq!(b1.grad().unwrap().dtype(), DType::F32);
    assert_eq!(b1.grad().unwrap().to_vec_f64().unwrap(), [4.0; 8]);

    let plain = Float8Policy::new(None::<AmpPolicy>).with_weight(&w1);
    let h = {
        let _fp8 = plain.enter();
        x.linear(&w1, None).unwrap()
    };
    assert_eq!(h.dtype(), DType::F32);
    let want = x.linear_float8(&w1.detach(), None).unwrap();
    assert_eq!(h.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());

    // A weight stored `[in, out]` (GPT-2's Conv1D) is listed as itself and reaches `linear` as
    // its transpose, a view: the view runs in fp8 too, and a copy of the transpose does not.
    let stored = w1.detach().t().unwrap().contiguous().unwrap();
    let conv1d = Float8Policy::new(None::<AmpPolicy>).with_weight(&stored);
    let (h, copied) = {
        let _fp8 = conv1d.enter();
        let h = x.linear(&stored.t().unwrap(), None).unwrap();
        let copy = stored.t().unwrap().contiguous().unwrap();
        (h, x.linear(&copy, None).unwrap())
    };
    assert_eq!(h.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    assert_ne!(copied.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());

    // The policy's recipe reaches the linear: rowwise, power-of-two scales, E4M3 gradients.
    let rowwise = plain.clone().with_recipe(Float8Recipe::ROWWISE);
    assert_eq!(rowwise.recipe(), Float8Recipe::ROWWISE);
    assert_eq!(plain.recipe(), Float8Recipe::TENSORWISE);
    let h = {
        let _fp8 = rowwise.enter();
        x.linear(&w1, None).unwrap()
    };
    let want = x
        .linear_float8_with(&w1.detach(), None, Float8Recipe::ROWWISE)
        .unwrap();
    assert_eq!(h.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    assert_ne!(
        h.to_vec_f64().unwrap(),
        x.linear_float8(&w1.detach(), None)
            .unwrap()
            .to_vec_f64()
            .unwrap()
    );

    // Delayed scaling: one history per listed linear, filled by its casts, the same outputs as
    // linear_float8_delayed with a history of its own.
    let delayed = plain.clone().with_delayed_scaling(4).unwrap();
    let history = delayed.history(&w1).expect("a listed linear has a history");
    assert!(delayed.history(&w2).is_none() && plain.history(&w1).is_none());
    let twin = Float8History::new(4).unwrap();
    for scale in [1.0, 3.0] {
        let xs = x.mul_scalar(scale).unwrap();
        let h = {
            let _fp8 = delayed.enter();
            xs.linear(&w1, None).unwrap()
        };
        let want = xs.linear_float8_delayed(&w1.detach(), None, &twin).unwrap();
        assert_eq!(h.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    }
    assert_eq!(history.amaxes(Float8Role::Input).unwrap().len(), 2);
    assert!(matches!(
        plain.clone().with_delayed_scaling(0),
        Err(headroom_amp::AmpError::Tensor(_))
    ));
}

/// A listed linear behind GELU (`gelu_linear`, `gelu_tanh_linear`: GPT-2's and ViT's MLP
/// projection down) runs in fp8 as one op that keeps only its input: the activation, its codes
/// and the product equal the pair `gelu()` then the fp8 linear bit for bit, forward and backward,
/// with current and delayed scales, while it keeps the codes' bytes fewer and caches no bf16 copy
/// of the weight.
#[test]
fn an_fp8_linear_behind_gelu_keeps_only_its_input() {
    let cpu = CpuBackend::new_ref();
    let allocated = || cpu.memory_stats().allocated_bytes.all.current;
    let values = |n: usize, step: f64| (0..n).map(|i| (i as f64 * step).sin()).collect::<Vec<_>>();
    let (rows, k, n) = (32, 64, 16);
    let leaf = |v: Vec<f64>, shape: &[usize]| {
        let t = Tensor::from_f64s(&cpu, &v, shape, DType::F32).unwrap();
        t.requires_grad_(true).unwrap();
        t
    };
    let w = leaf(values(n * k, 0.11), &[n, k]);
    let b = leaf(values(n, 0.5), &[n]);
    for tanh in [false, true] {
        for delayed in [false, true] {
            for base in [None, Some(AmpPolicy::torch_cuda(DType::BF16).unwrap())] {
                let policy = || {
                    let p = Float8Policy::new(base.clone()).with_weight(&w);
                    if delayed {
                        p.with_delayed_scaling(4).unwrap()
                    } else {
                        p
                    }
                };
                let (fused_policy, pair_policy) = (policy(), policy());
                let mut results = Vec::new();
                for (fused, policy) in [(true, &fused_policy), (false, &pair_policy)] {
                    let mut run = Vec::new();
                    for step in 0..2 {
                        let h = leaf(values(rows * k, 0.37 + step as f64), &[rows, k]);
                        let before = allocated();
                        let y = {
                            let _fp8 = policy.enter();
                            assert_eq!(autocast_stats().cached_bytes, 0);
                            match (fused, tanh) {
                                (true, false) => h.gelu_linear(&w, Some(&b)).unwrap(),
                                (true, true) => h.gelu_tanh_linear(&w, Some(&b)).unwrap(),
                                (false, false) => h.gelu().unwrap().linear(&w, Some(&b)).unwrap(),
                                (false, true) => {
                                    h.gelu_tanh().unwrap().linear(&w, Some(&b)).unwrap()
                                }
                            }
                        };
                        let kept = allocated() - before;
                        y.sum_all().unwrap().backward().unwrap();
                        run.push((
                            kept,
                            y.to_vec_f64().unwrap(),
                            h.grad().unwrap().to_vec_f64().unwrap(),
                        ));
                        run.push((
                            0,
                            w.take_grad().unwrap().to_vec_f64().unwrap(),
                            b.take_grad().unwrap().to_vec_f64().unwrap(),
                        ));
                    }
                    results.push(run);
                }
                let case = (tanh, delayed, base.is_some());
                for (f, p) in results[0].iter().zip(&results[1]) {
                    assert_eq!((&f.1, &f.2), (&p.1, &p.2), "{case:?}");
                }
                // Forward steps: the fused op keeps the output and nothing of the activation.
                let codes_bytes = (rows * k) as i64;
                assert!(
                    results[0][0].0 + codes_bytes <= results[1][0].0,
                    "{case:?}: {} against {}",
                    results[0][0].0,
                    results[1][0].0
                );
            }
        }
    }
}
