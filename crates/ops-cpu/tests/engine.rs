//! The autograd engine on the CPU backend: hooks, in-place checks, graph lifetime, typed
//! errors, and memory released during backward (exact byte counts from the allocator).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use headroom_autograd_core::{
    dropout, no_grad, saved_tensor_hooks, BackendRef, BackwardOptions, DType, Distribution,
    Generator, Packed, RandomDraw, Tensor, TensorError,
};
use headroom_caching_allocator::HistoryOptions;
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::memory::allocated;

fn tensor(cpu: &BackendRef, values: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_f64s(cpu, values, shape, DType::F64).unwrap()
}

fn leaf(cpu: &BackendRef, values: &[f64], shape: &[usize]) -> Tensor {
    let res = tensor(cpu, values, shape);
    res.requires_grad_(true).unwrap();
    res
}

#[test]
fn using_a_saved_tensor_modified_in_place_is_an_error_naming_the_op() {
    let cpu = CpuBackend::new_ref();
    let x = leaf(&cpu, &[0.5, 1.0], &[2]);
    let y = x.exp().unwrap();
    y.add_(&tensor(&cpu, &[1.0], &[1])).unwrap();
    let err = y.sum_all().unwrap().backward().unwrap_err();
    assert!(
        matches!(
            err,
            TensorError::ModifiedInPlace {
                op: "exp",
                saved_version: 0,
                current_version: 1
            }
        ),
        "{err}"
    );
    assert!(err
        .to_string()
        .starts_with("exp: a tensor saved for backward was modified"));

    // A leaf that requires grad cannot be written in place while recording, but can under no_grad.
    let err = x.mul_(&tensor(&cpu, &[2.0], &[1])).unwrap_err();
    assert!(
        matches!(err, TensorError::Autograd { op: "mul_", .. }),
        "{err}"
    );
    {
        let _guard = no_grad();
        x.mul_(&tensor(&cpu, &[2.0], &[1])).unwrap();
    }
    assert_eq!(x.to_vec_f64().unwrap(), vec![1.0, 2.0]);
    assert_eq!(x.version(), 1);

    // out= refuses inputs that need grad.
    let out = tensor(&cpu, &[0.0, 0.0], &[2]);
    let err = x.add_out(&x, &out).unwrap_err();
    assert!(
        matches!(err, TensorError::Autograd { op: "add_out", .. }),
        "{err}"
    );
}

#[test]
fn inplace_and_out_forms_compute_the_same_values() {
    let cpu = CpuBackend::new_ref();
    let x = tensor(&cpu, &[1.0, 2.0, 3.0], &[3]);
    let reference = x.add(&x.tanh().unwrap()).unwrap().to_vec_f64().unwrap();
    let out = Tensor::zeros(&cpu, &[3], DType::F64).unwrap();
    x.add_out(&x.tanh().unwrap(), &out).unwrap();
    assert_eq!(out.to_vec_f64().unwrap(), reference);
    x.add_(&x.tanh().unwrap()).unwrap();
    assert_eq!(x.to_vec_f64().unwrap(), reference);
    x.fill_(4.0).unwrap();
    x.copy_(&tensor(&cpu, &[7.0], &[1])).unwrap();
    assert_eq!(x.to_vec_f64().unwrap(), vec![7.0; 3]);
    assert_eq!(x.version(), 3);
}

#[test]
fn a_gradient_hook_replaces_the_gradient() {
    let cpu = CpuBackend::new_ref();
    let x = leaf(&cpu, &[1.0, 2.0], &[2]);
    let y = x.mul_scalar(2.0).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen_in_hook = Arc::clone(&seen);
    y.register_hook(move |grad| {
        seen_in_hook.lock().unwrap().push(grad.to_vec_f64()?);
        Ok(Some(grad.mul_scalar(10.0)?))
    })
    .unwrap();
    x.register_hook(|grad| Ok(Some(grad.add_scalar(1.0)?)))
        .unwrap();
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![vec![1.0, 1.0]]);
    // dy = 1 -> hook: 10 -> through mul_scalar: 20 -> leaf hook: 21.
    assert_eq!(x.grad().unwrap().to_vec_f64().unwrap(), vec![21.0, 21.0]);

    // A removed hook no longer runs.
    let handle = x
        .register_hook(|grad| Ok(Some(grad.mul_scalar(0.0)?)))
        .unwrap();
    handle.remove();
    x.zero_grad(true).unwrap();
    x.mul_scalar(3.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(x.grad().unwrap().to_vec_f64().unwrap(), vec![4.0, 4.0]);
}

#[test]
fn a_post_accumulate_hook_sees_the_final_gradient_once_per_backward() {
    let cpu = CpuBackend::new_ref();
    let w = leaf(&cpu, &[1.0, 2.0], &[2]);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen_in_hook = Arc::clone(&seen);
    w.register_post_accumulate_grad_hook(move |param| {
        let grad = param.grad().expect("the hook runs after accumulation");
        seen_in_hook.lock().unwrap().push(grad.to_vec_f64()?);
        Ok(())
    })
    .unwrap();
    // w reaches the loss along three paths: d/dw (3w + w*w) = 3 + 2w.
    let loss = || {
        w.mul_scalar(3.0)
            .unwrap()
            .add(&w.mul(&w).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
    };
    loss().backward().unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![vec![5.0, 7.0]]);
    loss().backward().unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        vec![vec![5.0, 7.0], vec![10.0, 14.0]]
    );
}

#[test]
fn a_post_accumulate_hook_may_take_the_gradient() {
    let cpu = CpuBackend::new_ref();
    let w = leaf(&cpu, &[1.0, -1.0], &[2]);
    let taken = Arc::new(Mutex::new(Vec::new()));
    let taken_in_hook = Arc::clone(&taken);
    w.register_post_accumulate_grad_hook(move |param| {
        // An optimizer step in backward: w -= 0.5 * grad, then drop the gradient.
        let grad = param.take_grad().expect("final gradient");
        param.sub_(&grad.mul_scalar(0.5)?)?;
        taken_in_hook.lock().unwrap().push(grad.to_vec_f64()?);
        Ok(())
    })
    .unwrap();
    w.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(w.grad().is_none());
    assert_eq!(*taken.lock().unwrap(), vec![vec![2.0, -2.0]]);
    assert_eq!(w.to_vec_f64().unwrap(), vec![0.0, 0.0]);
}

#[test]
fn saved_tensor_hooks_pack_once_per_saved_tensor_and_unpack_on_use() {
    let cpu = CpuBackend::new_ref();
    let x = leaf(&cpu, &[0.1, 0.2, 0.3], &[3]);
    let w = leaf(&cpu, &[1.0, 2.0, 3.0], &[3]);
    let (packs, unpacks) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let inner_packs = Arc::new(AtomicUsize::new(0));
    let loss = {
        let (p, u) = (Arc::clone(&packs), Arc::clone(&unpacks));
        // "Offload": keep the values on the host and rebuild the tensor on unpack.
        let backend = Arc::clone(&cpu);
        let _outer = saved_tensor_hooks(
            move |_site, tensor| {
                p.fetch_add(1, Ordering::SeqCst);
                Ok(Box::new((tensor.to_vec_f64()?, tensor.shape().to_vec())) as Packed)
            },
            move |packed| {
                u.fetch_add(1, Ordering::SeqCst);
                let (values, shape) = packed
                    .downcast_ref::<(Vec<f64>, Vec<usize>)>()
                    .expect("packed by this pair");
                Tensor::from_f64s(&backend, values, shape, DType::F64)
            },
        );
        let y = x.mul(&w).unwrap(); // saves x and w
        let z = {
            let counter = Arc::clone(&inner_packs);
            let _inner = saved_tensor_hooks(
                move |_site, tensor| {
                    counter.fetch_add(1, Ordering::SeqCst);
                    Ok(Box::new(tensor) as Packed)
                },
                |packed| Ok(packed.downcast_ref::<Tensor>().expect("a tensor").clone()),
            );
            y.exp().unwrap() // saves its output, through the inner pair
        };
        z.tanh().unwrap().sum_all().unwrap() // tanh saves its output, through the outer pair again
    };
    assert_eq!(packs.load(Ordering::SeqCst), 3);
    assert_eq!(inner_packs.load(Ordering::SeqCst), 1);
    assert_eq!(unpacks.load(Ordering::SeqCst), 0);
    loss.backward().unwrap();
    assert_eq!(unpacks.load(Ordering::SeqCst), 3);
    // Hooks do not change the gradient: d/dx tanh(exp(xw)) = (1 - tanh²) exp(xw) w.
    let grad = x.grad().unwrap().to_vec_f64().unwrap();
    for (i, g) in grad.iter().enumerate() {
        let (xv, wv) = (0.1 * (i + 1) as f64, (i + 1) as f64);
        let e = (xv * wv).exp();
        let expected = (1.0 - e.tanh().powi(2)) * e * wv;
        assert!((g - expected).abs() < 1e-12, "{g} vs {expected}");
    }
}

#[test]
fn retain_graph_allows_a_second_backward_and_without_it_the_graph_is_freed() {
    let cpu = CpuBackend::new_ref();
    let x = leaf(&cpu, &[1.0, 3.0], &[2]);
    let loss = x.mul(&x).unwrap().sum_all().unwrap();
    loss.backward_with(None, BackwardOptions { retain_graph: true })
        .unwrap();
    loss.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec_f64().unwrap(), vec![4.0, 12.0]);
    let err = loss.backward().unwrap_err();
    assert!(
        matches!(err, TensorError::GraphFreed { op: "sum" }),
        "{err}"
    );
}

#[test]
fn no_grad_detach_requires_grad_and_zero_grad() {
    let cpu = CpuBackend::new_ref();
    let x = leaf(&cpu, &[1.0, 2.0], &[2]);
    {
        let _guard = no_grad();
        let y = x.mul_scalar(2.0).unwrap();
        assert!(!y.requires_grad() && y.is_leaf());
    }
    let y = x.mul_scalar(2.0).unwrap();
    assert_eq!(y.grad_fn_name(), Some("mul_scalar"));
    assert!(matches!(
        y.requires_grad_(false),
        Err(TensorError::Autograd { .. })
    ));
    let detached = y.detach();
    assert!(!detached.requires_grad());
    assert!(Arc::ptr_eq(detached.buffer(), y.buffer()));
    let err = detached.sum_all().unwrap().backward().unwrap_err();
    assert!(
        matches!(err, TensorError::Autograd { op: "backward", .. }),
        "{err}"
    );
    let err = y.backward().unwrap_err();
    assert!(
        matches!(err, TensorError::Autograd { op: "backward", .. }),
        "{err}"
    );

    y.sum_all().unwrap().backward().unwrap();
    x.zero_grad(false).unwrap();
    assert_eq!(x.grad().unwrap().to_vec_f64().unwrap(), vec![0.0, 0.0]);
    x.zero_grad(true).unwrap();
    assert!(x.grad().is_none());
}

#[test]
fn errors_name_the_op_and_the_shapes() {
    let cpu = CpuBackend::new_ref();
    let a = tensor(&cpu, &[0.0; 6], &[2, 3]);
    let b = tensor(&cpu, &[0.0; 4], &[4]);
    let err = a.add(&b).unwrap_err();
    assert_eq!(
        err.to_string(),
        "add: shape mismatch between [2, 3] and [4]"
    );
    let err = a.matmul(&a).unwrap_err();
    assert_eq!(
        err.to_string(),
        "matmul: shape mismatch between [2, 3] and [2, 3]"
    );
    let c = Tensor::zeros(&cpu, &[2, 3], DType::F32).unwrap();
    let err = a.mul(&c).unwrap_err();
    assert_eq!(err.to_string(), "mul: dtype mismatch between F64 and F32");
    let idx = Tensor::from_slice(&cpu, &[7i64], &[1]).unwrap();
    let err = headroom_autograd_core::embedding(&a, &idx).unwrap_err();
    assert_eq!(
        err.to_string(),
        "gather: index 7 is out of bounds for size 2"
    );
}

#[test]
fn dropout_masks_repeat_after_restoring_the_generator_state() {
    let cpu = CpuBackend::new_ref();
    let x = Tensor::ones(&cpu, &[1000], DType::F32).unwrap();
    let generator = Generator::new(1234);
    let state = generator.state();
    let first = dropout(&x, 0.25, true, &generator)
        .unwrap()
        .to_vec_f64()
        .unwrap();
    let second = dropout(&x, 0.25, true, &generator)
        .unwrap()
        .to_vec_f64()
        .unwrap();
    assert_ne!(first, second);
    generator.set_state(state);
    assert_eq!(
        dropout(&x, 0.25, true, &generator)
            .unwrap()
            .to_vec_f64()
            .unwrap(),
        first
    );
    let kept = first.iter().filter(|&&v| v != 0.0).count();
    assert!((700..800).contains(&kept), "{kept} of 1000 kept");
    assert!(first
        .iter()
        .all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-6));
    assert!(dropout(&x, 0.25, false, &generator)
        .unwrap()
        .same_tensor(&x));
}

/// `random_` writes element i (row-major in the view, whatever its strides) as the draw's value
/// i, advances the generator by the counters it used, refuses integer tensors and a leaf that
/// requires grad while recording.
#[test]
fn random_fills_follow_the_view_order_and_advance_the_generator() {
    let cpu = CpuBackend::new_ref();
    let generator = Generator::new(99);
    let normal = Distribution::Normal {
        mean: 1.0,
        std: 0.5,
    };
    let base = Tensor::zeros(&cpu, &[7, 5], DType::F64).unwrap();
    let transposed = base.t().unwrap();
    transposed.random_(normal, &generator).unwrap();
    assert_eq!(generator.state().offset, 2 * 35);
    let draw = RandomDraw {
        distribution: normal,
        seed: 99,
        offset: 0,
    };
    let want: Vec<f64> = (0..35).map(|i| draw.value(i)).collect();
    assert_eq!(transposed.contiguous().unwrap().to_vec_f64().unwrap(), want);
    let values = base.to_vec_f64().unwrap();
    let (mean, spread) = (values.iter().sum::<f64>() / 35.0, values[0] - values[1]);
    assert!((mean - 1.0).abs() < 0.3 && spread != 0.0, "{mean}");

    let uniform = Distribution::Uniform {
        low: 2.0,
        high: 3.0,
    };
    let f32s = Tensor::zeros(&cpu, &[1000], DType::F32).unwrap();
    f32s.random_(uniform, &generator).unwrap();
    assert_eq!(generator.state().offset, 70 + 1000);
    assert!(f32s
        .to_vec_f64()
        .unwrap()
        .iter()
        .all(|v| (2.0..3.0).contains(v)));

    let ints = Tensor::zeros(&cpu, &[4], DType::I64).unwrap();
    assert!(ints.random_(uniform, &generator).is_err());
    let leaf = Tensor::zeros(&cpu, &[4], DType::F32).unwrap();
    leaf.requires_grad_(true).unwrap();
    let refused = leaf.random_(uniform, &generator).unwrap_err().to_string();
    assert!(refused.contains("random_"), "{refused}");
}

#[test]
fn reduced_precision_dtypes_compute_in_f32() {
    let cpu = CpuBackend::new_ref();
    let values: Vec<f64> = (0..12).map(|i| i as f64 / 4.0 - 1.0).collect();
    let reference = tensor(&cpu, &values, &[3, 4]);
    let expected = reference
        .matmul(&reference.t().unwrap())
        .unwrap()
        .softmax(-1)
        .unwrap()
        .to_vec_f64()
        .unwrap();
    for (dtype, tolerance) in [(DType::F32, 1e-6), (DType::F16, 1e-2), (DType::BF16, 2e-2)] {
        let x = reference.to_dtype(dtype).unwrap();
        let res = x.matmul(&x.t().unwrap()).unwrap().softmax(-1).unwrap();
        assert_eq!(res.dtype(), dtype);
        for (got, want) in res.to_vec_f64().unwrap().iter().zip(&expected) {
            assert!(
                (got - want).abs() <= tolerance,
                "{dtype:?}: {got} vs {want}"
            );
        }
    }
    // Casts carry gradients back to the source dtype.
    let x = leaf(&cpu, &[1.5, -2.0], &[2]);
    x.to_dtype(DType::F32)
        .unwrap()
        .mul_scalar(2.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let grad = x.grad().unwrap();
    assert_eq!(grad.dtype(), DType::F64);
    assert_eq!(grad.to_vec_f64().unwrap(), vec![2.0, 2.0]);
}

/// Memory read from post-accumulate hooks of a deep ReLU MLP, per layer, last layer first.
fn mlp_memory_during_backward(take_grads: bool) -> (Vec<i64>, i64, i64) {
    const LAYERS: usize = 6;
    const BATCH: usize = 64;
    const WIDTH: usize = 16;
    let cpu = CpuBackend::new_ref();
    let weights: Vec<Tensor> = (0..LAYERS)
        .map(|layer| {
            let values: Vec<f64> = (0..WIDTH * WIDTH)
                .map(|i| ((i * 7 + layer) % 13) as f64 / 13.0 - 0.4)
                .collect();
            let w = Tensor::from_f64s(&cpu, &values, &[WIDTH, WIDTH], DType::F32).unwrap();
            w.requires_grad_(true).unwrap();
            w
        })
        .collect();
    let readings = Arc::new(Mutex::new(Vec::new()));
    for w in &weights {
        let (readings, backend) = (Arc::clone(&readings), Arc::clone(&cpu));
        w.register_post_accumulate_grad_hook(move |param| {
            readings.lock().unwrap().push(allocated(&backend));
            if take_grads {
                drop(param.take_grad());
            }
            Ok(())
        })
        .unwrap();
    }
    let x = Tensor::ones(&cpu, &[BATCH, WIDTH], DType::F32).unwrap();
    let mut h = x.clone();
    for w in &weights {
        h = h.linear(w, None).unwrap().relu().unwrap();
    }
    let loss = h.sum_all().unwrap();
    drop(h);
    let before = allocated(&cpu);
    loss.backward().unwrap();
    let after = allocated(&cpu);
    let readings = readings.lock().unwrap().clone();
    (readings, before, after)
}

#[test]
fn activations_are_freed_during_backward() {
    // Byte sizes (every one a multiple of the allocator's 512-byte rounding).
    let activation = 64 * 16 * 4; // one [64, 16] f32 ReLU output, saved by relu and the next linear
    let weight = 16 * 16 * 4;
    let scalar = 512; // the loss (4 bytes, rounded)
    let layers = 6;

    let (readings, before, after) = mlp_memory_during_backward(true);
    // Before backward: weights, the input, six saved activations, the loss.
    assert_eq!(
        before,
        layers * weight + activation + layers * activation + scalar
    );
    assert_eq!(readings.len(), 6);
    // At layer i's hook (i = 6 first): weights, input, loss, activations 1..i-1 still saved by
    // earlier nodes, the gradient flowing into layer i-1 (none at layer 1, whose input needs no
    // gradient) and this layer's weight gradient.
    let expected: Vec<i64> = (1..=layers)
        .rev()
        .map(|i| {
            layers * weight
                + activation
                + scalar
                + (i - 1) * activation
                + if i > 1 { activation } else { 0 }
                + weight
        })
        .collect();
    assert_eq!(readings, expected);
    // Layer by layer, memory falls by exactly one activation (the last step also drops the
    // flowing gradient, since layer 1's input needs none).
    let steps: Vec<i64> = readings.windows(2).map(|w| w[1] - w[0]).collect();
    assert_eq!(
        steps,
        vec![
            -activation,
            -activation,
            -activation,
            -activation,
            -2 * activation
        ]
    );
    // After backward: weights, input and loss only (every gradient was taken by a hook).
    assert_eq!(after, layers * weight + activation + scalar);

    // Keeping the gradients, each step still falls by an activation minus one weight gradient.
    let (readings, _, after) = mlp_memory_during_backward(false);
    let steps: Vec<i64> = readings.windows(2).map(|w| w[1] - w[0]).collect();
    assert_eq!(
        steps,
        vec![
            weight - activation,
            weight - activation,
            weight - activation,
            weight - activation,
            weight - 2 * activation
        ]
    );
    assert_eq!(after, 2 * layers * weight + activation + scalar);
}

#[test]
fn views_share_storage_and_its_version_counter() {
    let cpu = CpuBackend::new_ref();
    let base = tensor(&cpu, &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], &[2, 3]);
    let before = allocated(&cpu);
    let transposed = base.t().unwrap();
    let narrowed = transposed.narrow(0, 1, 2).unwrap();
    let expanded = base.narrow(0, 0, 1).unwrap().expand(&[4, 3]).unwrap();
    assert_eq!(allocated(&cpu), before, "views allocate nothing");
    assert!(
        Arc::ptr_eq(narrowed.buffer(), base.buffer())
            && narrowed.is_view()
            && !narrowed.is_contiguous()
    );
    assert_eq!(narrowed.to_vec_f64().unwrap(), vec![1.0, 4.0, 2.0, 5.0]);
    assert_eq!(expanded.strides(), &[0, 1]);
    narrowed.fill_(9.0).unwrap();
    assert_eq!(
        base.to_vec_f64().unwrap(),
        vec![0.0, 9.0, 9.0, 3.0, 9.0, 9.0]
    );
    assert_eq!((base.version(), expanded.version()), (1, 1));
    // reshape of a non-viewable layout copies; of a viewable one, does not.
    assert!(Arc::ptr_eq(
        base.reshape(&[3, 2]).unwrap().buffer(),
        base.buffer()
    ));
    assert!(!Arc::ptr_eq(
        transposed.reshape(&[6]).unwrap().buffer(),
        base.buffer()
    ));
    assert!(matches!(
        transposed.view_shape(&[6]),
        Err(TensorError::InvalidArgument { op: "view", .. })
    ));
}

#[test]
fn writing_through_a_view_invalidates_what_was_saved_from_its_base() {
    let cpu = CpuBackend::new_ref();
    let x = leaf(&cpu, &[0.1, 0.2, 0.3, 0.4], &[4]);
    let y = x.tanh().unwrap(); // saves its output
    let part = y.narrow(0, 0, 2).unwrap();
    let err = part.mul_(&tensor(&cpu, &[2.0], &[1])).unwrap_err();
    assert!(
        matches!(err, TensorError::Autograd { op: "mul_", .. }),
        "{err}"
    );
    {
        let _guard = no_grad();
        part.mul_(&tensor(&cpu, &[2.0], &[1])).unwrap();
    }
    let err = y.sum_all().unwrap().backward().unwrap_err();
    assert!(
        matches!(err, TensorError::ModifiedInPlace { op: "tanh", .. }),
        "{err}"
    );
}

#[test]
fn split_and_cat_round_trip_and_split_costs_one_gradient() {
    let cpu = CpuBackend::new_ref();
    let x = leaf(&cpu, &(0..12).map(f64::from).collect::<Vec<_>>(), &[3, 4]);
    let pieces = x.split_with_sizes(&[1, 3], 1).unwrap();
    assert_eq!(
        pieces[1].to_vec_f64().unwrap(),
        vec![1.0, 2.0, 3.0, 5.0, 6.0, 7.0, 9.0, 10.0, 11.0]
    );
    let joined = headroom_autograd_core::cat(&[&pieces[1], &pieces[0]], 1).unwrap();
    assert_eq!(joined.to_vec_f64().unwrap()[..4], [1.0, 2.0, 3.0, 0.0]);
    pieces[1].sum_all().unwrap().backward().unwrap();
    assert_eq!(
        x.grad().unwrap().to_vec_f64().unwrap(),
        vec![0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    );
}

#[test]
fn compact_copies_a_row_out_of_its_batch_and_passes_the_gradient_back() {
    let cpu = CpuBackend::new_ref();
    let batch = leaf(&cpu, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2]);
    let hidden = batch.mul(&tensor(&cpu, &[2.0], &[1])).unwrap();
    // One row: contiguous, yet a view of the whole [3, 2] buffer.
    let row = hidden.narrow(0, 1, 1).unwrap();
    assert!(row.is_contiguous());
    assert!(row.contiguous().unwrap().same_tensor(&row));
    let compacted = row.compact().unwrap();
    assert_eq!(compacted.buffer().len_bytes(), 2 * 8);
    assert_eq!(compacted.to_vec::<f64>().unwrap(), [6.0, 8.0]);
    // A tensor that owns its dense buffer is returned as it is.
    assert!(compacted.compact().unwrap().same_tensor(&compacted));
    // The batch's buffer is released with its last handles: the compacted row does not hold it.
    let before = allocated(&cpu);
    drop(hidden);
    drop(row);
    assert!(allocated(&cpu) < before);
    let loss = compacted
        .mul(&compacted)
        .unwrap()
        .sum(&[0, 1], false)
        .unwrap();
    loss.backward().unwrap();
    assert_eq!(
        batch.grad().unwrap().to_vec::<f64>().unwrap(),
        [0.0, 0.0, 24.0, 32.0, 0.0, 0.0]
    );
}

/// The CPU backend's allocator seen through the trait: what tensors hold, the peak and its
/// reset, history with context labels, emptying the cache; `synchronize` has nothing to wait
/// for.
#[test]
fn the_allocator_view_reads_and_resets_what_tensors_hold() {
    let cpu = CpuBackend::new_ref();
    let view = cpu.allocator_view();
    view.record_history(Some(HistoryOptions {
        max_entries: 64,
        record_context: true,
    }));
    assert_eq!(view.memory_allocated(), 0);
    let tensor = {
        let _label = view.push_context("made here");
        Tensor::zeros(&cpu, &[1000], DType::F32).unwrap()
    };
    assert_eq!(view.memory_allocated(), 4096); // 4000 bytes, rounded to 512
    assert_eq!(view.memory_reserved(), 2 << 20); // one small-pool segment
    drop(tensor);
    assert_eq!(view.memory_allocated(), 0);
    assert_eq!(view.max_memory_allocated(), 4096);
    assert_eq!(cpu.memory_stats().allocated_bytes.all.peak, 4096);
    view.reset_peak_stats();
    assert_eq!(view.max_memory_allocated(), 0);
    let labelled = view
        .snapshot()
        .device_traces
        .into_iter()
        .flatten()
        .filter(|entry| entry.frames.iter().any(|frame| frame.name == "made here"))
        .count();
    assert!(labelled >= 1, "the allocation carries its context label");
    view.empty_cache().unwrap();
    assert_eq!(
        (view.memory_reserved(), view.max_memory_reserved()),
        (0, 2 << 20)
    );
    cpu.synchronize().unwrap();
}
