//! The seams technique crates plug into, on the CPU backend: the `SaveSite` of every op that
//! saves, the autocast scope (casts, the parameter cache, backward with autocast off),
//! backward-end callbacks, the non-finite check with zero host synchronisations, and an unpack
//! hook that recomputes its tensor with grad mode on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use headroom_autograd_core::{
    autocast, autocast_disabled, autocast_stats, cat, cross_entropy, dropout, embedding,
    found_non_finite, is_grad_enabled, layer_norm, no_grad, non_finite_check_, on_backward_end,
    queue_backward_end_callback, saved_tensor_hooks, scaled_dot_product_attention,
    set_grad_enabled, AutocastPolicy, BackendRef, CastPolicy, DType, Device, Generator, Packed,
    Reduction, SaveRole, SaveSite, Tensor, TensorError,
};
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::counting::HostReadCounter;
use headroom_testkit::memory::allocated;

fn leaf(cpu: &BackendRef, shape: &[usize], dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let values: Vec<f64> = (0..n).map(|i| 0.1 + 0.01 * i as f64).collect();
    let res = Tensor::from_f64s(cpu, &values, shape, dtype).unwrap();
    res.requires_grad_(true).unwrap();
    res
}

fn constant(cpu: &BackendRef, values: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_f64s(cpu, values, shape, DType::F32).unwrap()
}

/// The sites of every save `f` makes, in order.
fn sites_of(f: impl FnOnce()) -> Vec<SaveSite> {
    let sites = Arc::new(Mutex::new(Vec::new()));
    {
        let seen = Arc::clone(&sites);
        let _hooks = saved_tensor_hooks(
            move |site, tensor| {
                seen.lock().unwrap().push(site.clone());
                Ok(Box::new(tensor) as Packed)
            },
            |packed| Ok(packed.downcast_ref::<Tensor>().expect("a tensor").clone()),
        );
        f();
    }
    let sites = sites.lock().unwrap().clone();
    sites
}

/// Checks op, role, shape and dtype of each site, that bytes are numel × dtype size, and that the
/// numbers are consecutive.
fn check_sites(sites: &[SaveSite], expected: &[(&str, SaveRole, &[usize], DType)]) {
    let got: Vec<_> = sites
        .iter()
        .map(|s| (s.op, s.role, s.shape.to_vec(), s.dtype))
        .collect();
    let want: Vec<_> = expected
        .iter()
        .map(|&(op, role, shape, dtype)| (op, role, shape.to_vec(), dtype))
        .collect();
    assert_eq!(got, want);
    for site in sites {
        let numel: usize = site.shape.iter().product();
        assert_eq!(site.bytes, (numel * site.dtype.size_in_bytes()) as u64);
        assert_eq!(site.device, Device::Cpu);
    }
    for pair in sites.windows(2) {
        assert_eq!(pair[1].seq, pair[0].seq + 1, "{pair:?}");
    }
}

#[test]
fn every_op_that_saves_describes_what_it_saves() {
    use SaveRole::{Input, Intermediate, Output};
    let cpu = CpuBackend::new_ref();
    let f32 = DType::F32;
    let (a, b) = (leaf(&cpu, &[2, 3], f32), leaf(&cpu, &[2, 3], f32));
    let c = constant(&cpu, &[2.0; 6], &[2, 3]);
    let elementwise = sites_of(|| {
        a.mul(&b).unwrap();
        a.mul(&c).unwrap(); // c needs no gradient: only c is saved
        a.div(&b).unwrap();
        a.pow(&b).unwrap();
        for op in [
            Tensor::exp,
            Tensor::sqrt,
            Tensor::rsqrt,
            Tensor::tanh,
            Tensor::relu,
        ] {
            op(&a).unwrap();
        }
        for op in [Tensor::log, Tensor::gelu, Tensor::gelu_tanh] {
            op(&a).unwrap();
        }
        a.pow_scalar(3.0).unwrap();
    });
    let s = &[2usize, 3][..];
    check_sites(
        &elementwise,
        &[
            ("mul", Input(0), s, f32),
            ("mul", Input(1), s, f32),
            ("mul", Input(1), s, f32),
            ("div", Input(0), s, f32),
            ("div", Input(1), s, f32),
            ("pow", Input(0), s, f32),
            ("pow", Input(1), s, f32),
            ("pow", Output(0), s, f32),
            ("exp", Output(0), s, f32),
            ("sqrt", Output(0), s, f32),
            ("rsqrt", Output(0), s, f32),
            ("tanh", Output(0), s, f32),
            ("relu", Output(0), s, f32),
            ("log", Input(0), s, f32),
            ("gelu", Input(0), s, f32),
            ("gelu_tanh", Input(0), s, f32),
            ("pow_scalar", Input(0), s, f32),
        ],
    );

    let x = leaf(&cpu, &[4, 3], f32);
    let (w, bias) = (leaf(&cpu, &[5, 3], f32), leaf(&cpu, &[5], f32));
    let ln_w = leaf(&cpu, &[3], f32);
    let target = Tensor::from_slice(&cpu, &[0i64, 2, 1, 0], &[4]).unwrap();
    let mask = Tensor::from_slice(&cpu, &[1u8, 0, 0], &[3]).unwrap();
    let index = Tensor::from_slice(&cpu, &[1i64, 0, 2, 2], &[4, 1]).unwrap();
    let rows = Tensor::from_slice(&cpu, &[3i64, 0], &[2]).unwrap();
    let nn_ops = sites_of(|| {
        x.matmul(&w.t().unwrap()).unwrap();
        x.linear(&w, Some(&bias)).unwrap();
        x.linear_gelu(&w, Some(&bias)).unwrap();
        x.softmax(-1).unwrap();
        x.log_softmax(-1).unwrap();
        x.masked_fill(&mask, 0.0).unwrap();
        layer_norm(&x, &[3], Some(&ln_w), None, 1e-5).unwrap();
        cross_entropy(&x, &target, -100, Reduction::Mean).unwrap();
        dropout(&x, 0.5, true, &Generator::new(7)).unwrap();
        x.max_dim(-1, false).unwrap();
        x.gather(1, &index).unwrap();
        embedding(&w, &rows).unwrap();
    });
    let i64_ = DType::I64;
    check_sites(
        &nn_ops,
        &[
            ("matmul", Input(0), &[4, 3], f32),
            ("matmul", Input(1), &[3, 5], f32),
            ("linear", Input(0), &[4, 3], f32),
            ("linear", Input(1), &[5, 3], f32),
            ("linear", Input(0), &[4, 3], f32),
            ("linear", Input(1), &[5, 3], f32),
            ("gelu", Input(0), &[4, 5], f32),
            ("softmax", Output(0), &[4, 3], f32),
            ("log_softmax", Output(0), &[4, 3], f32),
            ("masked_fill", Input(1), &[4, 3], DType::U8),
            ("layer_norm", Input(0), &[4, 3], f32),
            ("layer_norm", Intermediate("mean"), &[4], f32),
            ("layer_norm", Intermediate("rstd"), &[4], f32),
            ("layer_norm", Input(1), &[3], f32),
            ("cross_entropy", Input(0), &[4, 3], f32),
            ("cross_entropy", Input(1), &[4], i64_),
            ("cross_entropy", Intermediate("lse"), &[4], f32),
            ("dropout", Intermediate("mask"), &[4, 3], DType::Bool),
            ("max", Output(1), &[4], i64_),
            ("gather", Input(1), &[4, 1], i64_),
            ("embedding", Input(1), &[2, 3], i64_),
        ],
    );

    let (q, k, v) = (
        leaf(&cpu, &[1, 2, 4, 8], f32),
        leaf(&cpu, &[1, 2, 5, 8], f32),
        leaf(&cpu, &[1, 2, 5, 8], f32),
    );
    let attention = sites_of(|| {
        scaled_dot_product_attention(&q, &k, &v, false, None).unwrap();
    });
    let op = "scaled_dot_product_attention";
    check_sites(
        &attention,
        &[
            (op, Input(0), &[1, 2, 4, 8], f32),
            (op, Input(1), &[1, 2, 5, 8], f32),
            (op, Input(2), &[1, 2, 5, 8], f32),
            (op, Output(0), &[1, 2, 4, 8], f32),
            (op, Intermediate("lse"), &[1, 2, 4], f32),
        ],
    );

    // The fp8 linear keeps its input as E4M3 codes (one byte each) and its inverse scale, and the
    // weight.
    let float8 = sites_of(|| {
        x.linear_float8(&w, Some(&bias)).unwrap();
    });
    let op = "linear_float8";
    check_sites(
        &float8,
        &[
            (op, Intermediate("input_float8"), &[4, 3], DType::F8E4M3),
            (op, Intermediate("input_inverse_scale"), &[], f32),
            (op, Input(1), &[5, 3], f32),
        ],
    );

    // In-place ops on a non-leaf: mul_ saves the old value when the other operand needs grad.
    let inplace = sites_of(|| {
        let y = a.add_scalar(1.0).unwrap();
        y.mul_(&b).unwrap();
        let z = a.add_scalar(1.0).unwrap();
        z.div_(&c).unwrap();
    });
    check_sites(
        &inplace,
        &[
            ("mul_", Intermediate("old_self"), s, f32),
            ("mul_", Input(1), s, f32),
            ("div_", Input(1), s, f32),
        ],
    );
}

#[test]
fn a_save_of_a_leaf_that_requires_grad_is_marked_a_parameter() {
    let cpu = CpuBackend::new_ref();
    let weight = leaf(&cpu, &[4, 3], DType::F32);
    let input = leaf(&cpu, &[2, 3], DType::F32);
    let activation = input.exp().unwrap();
    let constant = constant(&cpu, &[1.0; 12], &[4, 3]);
    let sites = sites_of(|| {
        activation.linear(&weight, None).unwrap();
        activation.linear(&constant, None).unwrap();
    });
    let marks: Vec<_> = sites.iter().map(|s| (s.role, s.is_parameter)).collect();
    // The second linear saves only its weight operand (a constant needs no gradient, so the
    // activation is not saved), which is no parameter either.
    assert_eq!(
        marks,
        [
            (SaveRole::Input(0), false),
            (SaveRole::Input(1), true),
            (SaveRole::Input(1), false)
        ]
    );
}

#[test]
fn save_numbers_start_again_after_each_backward() {
    let cpu = CpuBackend::new_ref();
    let x = leaf(&cpu, &[3], DType::F32);
    let step = || {
        let mut loss = None;
        let sites = sites_of(|| {
            let y = x.exp().unwrap().tanh().unwrap();
            loss = Some(y.mul(&y).unwrap().sum_all().unwrap());
        });
        loss.unwrap().backward().unwrap();
        sites.iter().map(|s| s.seq).collect::<Vec<_>>()
    };
    // A backward first, so this thread's numbering is at a known start.
    leaf(&cpu, &[1], DType::F32)
        .exp()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(step(), vec![0, 1, 2, 3]);
    assert_eq!(step(), vec![0, 1, 2, 3]);
}

#[test]
fn a_save_says_whether_its_storage_is_a_parameters() {
    let cpu = CpuBackend::new_ref();
    let weight = leaf(&cpu, &[4, 3], DType::F32);
    let conv1d_weight = leaf(&cpu, &[3, 4], DType::F32);
    let marked_input = leaf(&cpu, &[2, 3], DType::F32);
    let sites = sites_of(|| {
        // An activation (saves nothing), then nn's Linear, GPT-2's Conv1D (its weight
        // transposed: a view of the parameter), a product with a new storage made from a
        // parameter, and an input the user marked.
        let x = marked_input.mul_scalar(2.0).unwrap();
        x.linear(&weight, None).unwrap();
        x.linear(&conv1d_weight.t().unwrap(), None).unwrap();
        let doubled = weight.mul_scalar(2.0).unwrap();
        x.linear(&doubled.t().unwrap().t().unwrap(), None).unwrap();
        marked_input.log().unwrap();
    });
    let parameter: Vec<_> = sites
        .iter()
        .map(|s| (s.op, s.role, s.is_parameter))
        .collect();
    use SaveRole::Input;
    assert_eq!(
        parameter,
        [
            ("linear", Input(0), false),
            ("linear", Input(1), true),
            ("linear", Input(0), false),
            ("linear", Input(1), true),
            ("linear", Input(0), false),
            ("linear", Input(1), false),
            ("log", Input(0), true),
        ]
    );
}

/// A policy in the shape of PyTorch's CUDA lists, for the ops these tests use.
#[derive(Debug)]
struct TestPolicy(DType);

impl AutocastPolicy for TestPolicy {
    fn lower_precision(&self) -> DType {
        self.0
    }

    fn cast_policy(&self, op: &'static str, _device: Device) -> CastPolicy {
        match op {
            "matmul" | "linear" | "linear_gelu" | "scaled_dot_product_attention" => {
                CastPolicy::LowerPrecision
            }
            "softmax" | "log_softmax" | "layer_norm" | "cross_entropy" | "sum" | "exp" => {
                CastPolicy::Float32
            }
            "add" | "mul" | "cat" => CastPolicy::Promote,
            _ => CastPolicy::Keep,
        }
    }
}

#[test]
fn autocast_casts_by_policy_and_caches_each_parameter_once_per_scope() {
    let cpu = CpuBackend::new_ref();
    let x = Tensor::from_f64s(&cpu, &[0.5; 8], &[2, 4], DType::F32).unwrap();
    let (w, b) = (
        leaf(&cpu, &[3, 4], DType::F32),
        leaf(&cpu, &[3], DType::F32),
    );
    let before = allocated(&cpu);
    let policy = Arc::new(TestPolicy(DType::BF16));
    {
        let _scope = autocast(policy.clone());
        let h = x.linear(&w, Some(&b)).unwrap();
        assert_eq!(h.dtype(), DType::BF16);
        // x is not a parameter: cast, not cached; w and b: cast and cached.
        let stats = autocast_stats();
        assert_eq!(
            (stats.casts, stats.cache_hits, stats.cached_tensors),
            (3, 0, 2)
        );
        assert_eq!(stats.cached_bytes, (12 + 3) * 2);
        let h2 = x.linear(&w, Some(&b)).unwrap();
        let stats = autocast_stats();
        assert_eq!(
            (stats.casts, stats.cache_hits, stats.cached_tensors),
            (4, 2, 2)
        );
        // The fp32 list: a bf16 input goes back to f32.
        assert_eq!(h2.softmax(-1).unwrap().dtype(), DType::F32);
        // Promote: bf16 + f32 is f32 (without autocast a dtype mismatch).
        assert_eq!(
            h.add(&x.sum(&[1], true).unwrap()).unwrap().dtype(),
            DType::F32
        );
        // Keep: relu stays bf16; f64 is never cast.
        assert_eq!(h.relu().unwrap().dtype(), DType::BF16);
        let x64 = Tensor::from_f64s(&cpu, &[1.0; 4], &[2, 2], DType::F64).unwrap();
        assert_eq!(x64.matmul(&x64).unwrap().dtype(), DType::F64);
        {
            let _off = autocast_disabled();
            assert_eq!(x.linear(&w, Some(&b)).unwrap().dtype(), DType::F32);
        }
        // A cast made under no_grad does not serve a forward that records.
        {
            let _no_grad = no_grad();
            x.matmul(&w.t().unwrap()).unwrap();
        }
        assert_eq!(
            autocast_stats().cached_tensors,
            2,
            "w.t() is a view: not cached"
        );
        {
            let _no_grad = no_grad();
            x.linear(&w, None).unwrap();
        }
        assert_eq!(
            autocast_stats().cached_tensors,
            3,
            "w under no_grad has its own entry"
        );
    }
    assert_eq!(autocast_stats(), Default::default());
    assert_eq!(
        allocated(&cpu),
        before,
        "the cast cache is freed when the scope ends"
    );
    let err = x.add(&x.to_dtype(DType::BF16).unwrap()).unwrap_err();
    assert!(matches!(err, TensorError::DtypeMismatch { .. }), "{err}");
}

#[test]
fn gradients_flow_back_to_f32_parameters_and_backward_runs_without_autocast() {
    let cpu = CpuBackend::new_ref();
    let x = Tensor::from_f64s(&cpu, &[0.25, -0.5, 1.0, 2.0], &[2, 2], DType::F32).unwrap();
    let w = leaf(&cpu, &[3, 2], DType::F32);
    let expected = {
        let wc = w.to_dtype(DType::BF16).unwrap();
        let h = x.to_dtype(DType::BF16).unwrap().linear(&wc, None).unwrap();
        h.to_dtype(DType::F32)
            .unwrap()
            .exp()
            .unwrap()
            .sum_all()
            .unwrap()
    };
    expected.backward().unwrap();
    let expected_grad = w.take_grad().unwrap().to_vec_f64().unwrap();
    let loss = {
        let _scope = autocast(Arc::new(TestPolicy(DType::BF16)));
        let h = x.linear(&w, None).unwrap();
        let loss = h.exp().unwrap().sum_all().unwrap();
        let casts = autocast_stats().casts;
        // Inside the scope too, backward's own matmuls are not cast.
        loss.backward().unwrap();
        assert_eq!(autocast_stats().casts, casts);
        loss
    };
    assert_eq!(loss.dtype(), DType::F32);
    let grad = w.grad().unwrap();
    assert_eq!(grad.dtype(), DType::F32);
    assert_eq!(grad.to_vec_f64().unwrap(), expected_grad);
}

#[test]
fn backward_end_callbacks_run_once_per_backward_in_order() {
    let cpu = CpuBackend::new_ref();
    let log = Arc::new(Mutex::new(Vec::<String>::new()));
    let x = leaf(&cpu, &[2], DType::F32);
    let y = leaf(&cpu, &[2], DType::F32);
    for (name, param) in [("x", &x), ("y", &y)] {
        let log = Arc::clone(&log);
        param
            .register_post_accumulate_grad_hook(move |_| {
                log.lock().unwrap().push(format!("accumulated {name}"));
                let (first, second) = (Arc::clone(&log), Arc::clone(&log));
                queue_backward_end_callback(move || {
                    first.lock().unwrap().push(format!("queued by {name}"));
                    // A callback may queue another; it runs in the same pass.
                    queue_backward_end_callback(move || {
                        second
                            .lock()
                            .unwrap()
                            .push(format!("queued by the {name} callback"));
                        Ok(())
                    })
                })
            })
            .unwrap();
    }
    let handle = {
        let log = Arc::clone(&log);
        on_backward_end(move || {
            log.lock().unwrap().push("end hook".into());
            Ok(())
        })
    };
    let run = || {
        x.mul(&y).unwrap().sum_all().unwrap().backward().unwrap();
        std::mem::take(&mut *log.lock().unwrap())
    };
    let expected = [
        "accumulated x",
        "accumulated y",
        "queued by x",
        "queued by y",
        "queued by the x callback",
        "queued by the y callback",
        "end hook",
    ];
    assert_eq!(run(), expected);
    assert_eq!(run(), expected, "once per backward, every backward");
    handle.remove();
    assert_eq!(run(), expected[..6]);

    let err = queue_backward_end_callback(|| Ok(())).unwrap_err();
    assert!(matches!(err, TensorError::Autograd { .. }), "{err}");
}

#[test]
fn a_failed_backward_drops_its_callbacks_and_a_nested_one_keeps_its_own() {
    let cpu = CpuBackend::new_ref();
    let ran = Arc::new(AtomicU64::new(0));
    let x = leaf(&cpu, &[2], DType::F32);
    {
        let ran = Arc::clone(&ran);
        x.register_hook(move |_| {
            let ran = Arc::clone(&ran);
            queue_backward_end_callback(move || {
                ran.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })?;
            Err(TensorError::InvalidArgument {
                op: "test hook",
                reason: "fails on purpose".into(),
            })
        })
        .unwrap();
    }
    assert!(x.exp().unwrap().sum_all().unwrap().backward().is_err());
    assert_eq!(ran.load(Ordering::SeqCst), 0);

    // A backward inside a hook: its callbacks run when it ends, the end hooks only once, for the
    // outer pass.
    let log = Arc::new(Mutex::new(Vec::<&str>::new()));
    let (a, b) = (leaf(&cpu, &[2], DType::F32), leaf(&cpu, &[2], DType::F32));
    {
        let log = Arc::clone(&log);
        let b = b.clone();
        a.register_post_accumulate_grad_hook(move |_| {
            let inner_log = Arc::clone(&log);
            // Hooks run with grad mode off, as backward does: record the inner graph explicitly.
            let _grad = set_grad_enabled(true);
            let inner = b.exp()?.sum_all()?;
            let log_end = Arc::clone(&log);
            queue_backward_end_callback(move || {
                log_end.lock().unwrap().push("outer callback");
                Ok(())
            })?;
            let nested = leaf(inner.backend(), &[1], DType::F32);
            nested.register_post_accumulate_grad_hook(move |_| {
                let log = Arc::clone(&inner_log);
                queue_backward_end_callback(move || {
                    log.lock().unwrap().push("inner callback");
                    Ok(())
                })
            })?;
            inner.add(&nested.sum_all()?)?.backward()?;
            log.lock().unwrap().push("after the inner backward");
            Ok(())
        })
        .unwrap();
    }
    let _end = {
        let log = Arc::clone(&log);
        on_backward_end(move || {
            log.lock().unwrap().push("end hook");
            Ok(())
        })
    };
    a.exp().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(
        *log.lock().unwrap(),
        [
            "inner callback",
            "after the inner backward",
            "outer callback",
            "end hook"
        ]
    );
    assert!(b.grad().is_some());
}

/// Large tensors are reduced as rows and then across them (with a tail that fills no row): an
/// infinity or NaN anywhere — in a row, in the tail — is found, and a clean one is not.
#[test]
fn the_non_finite_check_finds_values_in_the_rows_and_tail_of_large_tensors() {
    let cpu = CpuBackend::new_ref();
    for (n, dtype) in [
        (100_003, DType::F32),
        (3 * 4096 * 5, DType::BF16),
        (1 << 15, DType::F16),
    ] {
        let values: Vec<f64> = (0..n).map(|j| (j as f64 * 0.01).sin()).collect();
        let clean = Tensor::from_f64s(&cpu, &values, &[n], dtype).unwrap();
        assert_eq!(
            found_non_finite(&[&clean], &clean)
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
            [0.0]
        );
        for (at, value) in [
            (0, f64::NAN),
            (n / 2, f64::INFINITY),
            (n - 1, f64::NEG_INFINITY),
        ] {
            let mut poisoned = values.clone();
            poisoned[at] = value;
            let bad = Tensor::from_f64s(&cpu, &poisoned, &[n], dtype).unwrap();
            let found = found_non_finite(&[&clean, &bad], &clean).unwrap();
            assert_eq!(
                found.to_vec::<f32>().unwrap(),
                [1.0],
                "{value} at {at} of {n}"
            );
        }
    }
}

#[test]
fn the_read_counter_counts_a_wait_for_the_device_as_a_read() {
    let counting = HostReadCounter::wrap(CpuBackend::new_ref());
    let backend: BackendRef = counting.clone();
    let tensor = Tensor::zeros(&backend, &[3], DType::F32).unwrap();
    assert_eq!(counting.host_reads(), 0);
    backend.synchronize().unwrap();
    assert_eq!(counting.host_reads(), 1);
    assert_eq!(tensor.to_vec::<f32>().unwrap(), [0.0; 3]);
    assert_eq!(counting.host_reads(), 2);
    // The allocator seen through the decorator is the wrapped backend's.
    assert_eq!(backend.allocator_view().memory_allocated(), 512);
}

#[test]
fn the_non_finite_check_over_1000_tensors_never_reads_back_to_the_host() {
    let counting = HostReadCounter::wrap(CpuBackend::new_ref());
    let backend: BackendRef = counting.clone();
    let dtypes = [DType::F32, DType::BF16, DType::F16];
    let tensors: Vec<Tensor> = (0..1000)
        .map(|i| {
            let n = 1 + (i * 37) % 300;
            let values: Vec<f64> = (0..n).map(|j| ((i * 7 + j) as f64).sin() * 1e3).collect();
            Tensor::from_f64s(&backend, &values, &[n], dtypes[i % 3]).unwrap()
        })
        .collect();
    let empty = Tensor::zeros(&backend, &[0], DType::F32).unwrap();
    let strided = Tensor::zeros(&backend, &[4, 6], DType::F32).unwrap();
    let column = strided.narrow(1, 2, 1).unwrap();
    let all: Vec<&Tensor> = tensors.iter().chain([&empty, &column]).collect();
    let reads_before = counting.host_reads();
    let clear = found_non_finite(&all, &tensors[0]).unwrap();
    assert_eq!(counting.host_reads(), reads_before);
    assert_eq!(clear.to_vec::<f32>().unwrap(), [0.0]);

    for (idx, value) in [
        (17, f64::INFINITY),
        (500, f64::NEG_INFINITY),
        (998, f64::NAN),
    ] {
        let bad = &tensors[idx];
        let saved = bad.to_vec_f64().unwrap();
        let mut poisoned = saved.clone();
        poisoned[bad.numel() / 2] = value;
        let reads_before = counting.host_reads();
        bad.copy_(&Tensor::from_f64s(&backend, &poisoned, bad.shape(), DType::F64).unwrap())
            .unwrap();
        let found = found_non_finite(&all, bad).unwrap();
        assert_eq!(counting.host_reads(), reads_before);
        assert_eq!(
            found.to_vec::<f32>().unwrap(),
            [1.0],
            "{value} in tensor {idx}"
        );
        // The flag accumulates: a later clean check leaves it set.
        let clean = [&tensors[1]];
        non_finite_check_(&clean, &found).unwrap();
        assert_eq!(found.to_vec::<f32>().unwrap(), [1.0]);
        bad.copy_(&Tensor::from_f64s(&backend, &saved, bad.shape(), DType::F64).unwrap())
            .unwrap();
    }
    // A non-finite value in a strided view is found.
    strided
        .narrow(1, 2, 1)
        .unwrap()
        .narrow(0, 3, 1)
        .unwrap()
        .fill_(f64::NAN)
        .unwrap();
    let found = found_non_finite(&all, &tensors[0]).unwrap();
    assert_eq!(found.to_vec::<f32>().unwrap(), [1.0]);

    let ints = Tensor::zeros(&backend, &[2], DType::I64).unwrap();
    let err = found_non_finite(&[&ints], &tensors[0]).unwrap_err();
    assert!(matches!(err, TensorError::UnsupportedDtype { .. }), "{err}");
}

#[test]
fn an_unpack_hook_can_recompute_its_tensor_with_grad_mode_on() {
    let cpu = CpuBackend::new_ref();
    let x = leaf(&cpu, &[4], DType::F64);
    let plain = {
        let y = x.exp().unwrap().tanh().unwrap().mul_scalar(3.0).unwrap();
        y.sum_all().unwrap().backward().unwrap();
        x.take_grad().unwrap().to_vec_f64().unwrap()
    };
    // Keep nothing at save time: each saved tensor is rebuilt from the region's input by running
    // the region again, with grad mode on, so the rebuilt tensors have their own graph.
    let region = |input: &Tensor| -> headroom_autograd_core::Result<Vec<Tensor>> {
        let e = input.exp()?;
        let t = e.tanh()?;
        Ok(vec![e, t])
    };
    let input = x.detach();
    let rebuilt_with_grad = Arc::new(AtomicU64::new(0));
    let loss = {
        let counter = Arc::clone(&rebuilt_with_grad);
        let input = input.clone();
        let _hooks = saved_tensor_hooks(
            |site, _tensor| Ok(Box::new(site.seq) as Packed),
            move |packed| {
                let seq = *packed.downcast_ref::<u64>().expect("a number");
                assert!(!is_grad_enabled(), "unpack starts with grad mode off");
                let _grad = set_grad_enabled(true);
                input.requires_grad_(true)?;
                let rebuilt = region(&input)?;
                if rebuilt.iter().all(Tensor::requires_grad) {
                    counter.fetch_add(1, Ordering::SeqCst);
                }
                Ok(rebuilt[seq as usize].detach())
            },
        );
        let outputs = region(&x).unwrap();
        outputs[1].mul_scalar(3.0).unwrap().sum_all().unwrap()
    };
    loss.backward().unwrap();
    assert_eq!(rebuilt_with_grad.load(Ordering::SeqCst), 2);
    assert_eq!(x.grad().unwrap().to_vec_f64().unwrap(), plain);
}

#[test]
fn cat_promotes_under_autocast() {
    let cpu = CpuBackend::new_ref();
    let a = Tensor::from_f64s(&cpu, &[1.0, 2.0], &[2], DType::F32).unwrap();
    let b = Tensor::from_f64s(&cpu, &[3.0], &[1], DType::BF16).unwrap();
    assert!(cat(&[&a, &b], 0).is_err());
    let _scope = autocast(Arc::new(TestPolicy(DType::F16)));
    let joined = cat(&[&a, &b], 0).unwrap();
    assert_eq!(joined.dtype(), DType::F32);
    assert_eq!(joined.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0]);
}
