//! Bad input through the public API, as a new user would try it: every case is a typed error
//! (or, for threads, a claim that keeps two threads off one storage), never undefined
//! behaviour or a silently wrong result. Each test is the regression test of one finding of the
//! soundness review (issue 14): writes into views that alias themselves or partially alias an
//! input, sizes and strides that overflow, views and buffers handed straight to a backend, and
//! two threads writing one CPU storage.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use headroom_autograd_core::{BackendRef, DType, Layout, Overlap, Tensor, TensorError, View};
use headroom_ops_cpu::CpuBackend;

fn ramp(cpu: &BackendRef, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
    Tensor::from_slice(cpu, &values, shape).unwrap()
}

/// `zeros([4096]).expand([64, 4096]).fill_(1.0)` was accepted: 64 rayon tasks wrote each element
/// at once. A written view that reaches an element twice is now an error, for every writer.
#[test]
fn writing_into_an_expanded_view_is_an_overlap_error() {
    let cpu = CpuBackend::new_ref();
    let base = Tensor::zeros(&cpu, &[4096], DType::F32).unwrap();
    let expanded = base.expand(&[64, 4096]).unwrap();
    let ones = Tensor::ones(&cpu, &[64, 4096], DType::F32).unwrap();
    let diagonal = base.as_strided(&[64, 64], &[1, 1], 0).unwrap();
    let attempts = [
        ("fill_", expanded.fill_(1.0).map(|_| ())),
        ("copy_", expanded.copy_(&ones).map(|_| ())),
        ("add_", expanded.add_(&ones).map(|_| ())),
        ("add_out", ones.add_out(&ones, &expanded)),
        ("fill_ (as_strided)", diagonal.fill_(1.0).map(|_| ())),
    ];
    for (what, attempt) in attempts {
        assert!(
            matches!(attempt, Err(TensorError::Overlap { .. })),
            "{what}: {attempt:?}"
        );
    }
    // Nothing was written, and reading the same views is fine.
    assert!(base.to_vec::<f32>().unwrap().iter().all(|&v| v == 0.0));
    assert_eq!(expanded.sum_all().unwrap().item().unwrap(), 0.0);
    // The backend refuses the same write when called directly.
    let direct = cpu.fill(expanded.view(), 1.0);
    assert!(
        matches!(direct, Err(TensorError::Overlap { op: "fill", .. })),
        "{direct:?}"
    );
}

/// `x.add_(&x.t())` on 1024×1024 was accepted and left 523,767 wrong elements: the output
/// partially overlaps the input. It is an error now (PyTorch's rule); the same view is fine.
#[test]
fn an_in_place_op_whose_input_partially_overlaps_its_output_is_an_error() {
    let cpu = CpuBackend::new_ref();
    let x = ramp(&cpu, &[1024, 1024]);
    let before = x.to_vec::<f32>().unwrap();
    let err = x.add_(&x.t().unwrap()).unwrap_err();
    assert!(
        matches!(err, TensorError::Overlap { op: "add_", .. }),
        "{err}"
    );
    assert!(err.to_string().contains("clone()"), "{err}");
    assert_eq!(x.to_vec::<f32>().unwrap(), before, "nothing written");
    // What the user is told to do gives PyTorch's answer.
    let t = x.t().unwrap().contiguous().unwrap();
    x.add_(&t).unwrap();
    let sum = x.to_vec::<f32>().unwrap();
    for (idx, &value) in sum.iter().enumerate() {
        let (row, col) = (idx / 1024, idx % 1024);
        assert_eq!(
            value,
            (row * 1024 + col + col * 1024 + row) as f32,
            "{row},{col}"
        );
    }
    // The same view in and out is the one overlap allowed.
    x.add_(&x).unwrap();
    assert_eq!(x.to_vec::<f32>().unwrap()[1025], 2.0 * sum[1025]);
    // Other writers follow the same rule: copy_, out=, a shifted row of the same storage.
    let row0 = x.narrow(0, 0, 2).unwrap();
    let row1 = x.narrow(0, 1, 2).unwrap();
    assert!(matches!(
        row0.copy_(&row1),
        Err(TensorError::Overlap { .. })
    ));
    assert!(matches!(
        row1.add_out(&row1, &row0),
        Err(TensorError::Overlap { .. })
    ));
    // Disjoint views of one storage are fine: the even and odd columns.
    let even = x.as_strided(&[1024, 512], &[1024, 2], 0).unwrap();
    let odd = x.as_strided(&[1024, 512], &[1024, 2], 1).unwrap();
    even.copy_(&odd).unwrap();
    let after = x.to_vec::<f32>().unwrap();
    assert_eq!(after[0], after[1]);
    assert_eq!(after[1024 * 7 + 10], after[1024 * 7 + 11]);
}

/// `as_strided([5], [1 << 62], 0)` was accepted and could be read: the extent wrapped in
/// release builds. Sizes, strides and byte counts are checked arithmetic in every profile.
#[test]
fn sizes_and_strides_that_overflow_are_typed_errors() {
    let cpu = CpuBackend::new_ref();
    let x = Tensor::zeros(&cpu, &[8], DType::F32).unwrap();
    let strided = x.as_strided(&[5], &[1 << 62], 0);
    assert!(
        matches!(strided, Err(TensorError::SizeOverflow { .. })),
        "{strided:?}"
    );
    let huge_offset = x.as_strided(&[2], &[1], usize::MAX);
    assert!(matches!(huge_offset, Err(TensorError::SizeOverflow { .. })));
    let outside = x.as_strided(&[3], &[4], 0);
    assert!(matches!(outside, Err(TensorError::InvalidArgument { .. })));
    let mismatched = x.as_strided(&[2, 2], &[1], 0);
    assert!(matches!(
        mismatched,
        Err(TensorError::InvalidArgument { .. })
    ));

    // `empty(&[1 << 40, 1 << 30], F32)` was accepted: the byte count overflowed.
    for shape in [&[1 << 40, 1 << 30][..], &[1 << 62, 8], &[usize::MAX, 2, 0]] {
        let empty = Tensor::empty(&cpu, shape, DType::F32);
        assert!(
            matches!(empty, Err(TensorError::SizeOverflow { .. })),
            "{shape:?}: {empty:?}"
        );
    }
    let zeros = Tensor::zeros(&cpu, &[1 << 62, 2], DType::F64);
    assert!(matches!(zeros, Err(TensorError::SizeOverflow { .. })));
    let from_slice = Tensor::from_slice::<f32>(&cpu, &[], &[1 << 32, 1 << 32, 0]);
    assert!(matches!(from_slice, Err(TensorError::SizeOverflow { .. })));

    // Views: an expand to more elements than usize holds, a narrow past the end, a reshape
    // whose product wraps to the element count (3 · 12297829382473034411 ≡ 1 mod 2^64).
    let one = Tensor::ones(&cpu, &[1, 1], DType::F32).unwrap();
    assert!(matches!(
        one.expand(&[1 << 40, 1 << 40]),
        Err(TensorError::SizeOverflow { .. })
    ));
    assert!(matches!(
        x.narrow(0, usize::MAX, 2),
        Err(TensorError::InvalidArgument { .. })
    ));
    let scalar = Tensor::ones(&cpu, &[1], DType::F32).unwrap();
    assert!(scalar.reshape(&[3, 12_297_829_382_473_034_411]).is_err());
    assert!(scalar.view_shape(&[3, 12_297_829_382_473_034_411]).is_err());
    assert!(scalar.reshape_inferred(&[-1, isize::MAX, 4]).is_err());
    assert!(scalar.split_with_sizes(&[usize::MAX, 2], 0).is_err());
    let wide = one.expand(&[1, 1 << 62]).unwrap();
    assert!(matches!(
        headroom_autograd_core::cat(&[&wide, &wide, &wide, &wide], 1),
        Err(TensorError::SizeOverflow { .. })
    ));
    // Layouts themselves.
    assert!(matches!(
        Layout::from_parts(&[4], &[usize::MAX / 2], 0),
        Err(TensorError::SizeOverflow { .. })
    ));
    assert!(matches!(
        Layout::try_contiguous(&[1 << 33, 1 << 33]),
        Err(TensorError::SizeOverflow { .. })
    ));
}

/// `View` has public fields and the `Backend` trait is safe, so a backend cannot trust a view:
/// one that leaves its buffer, or a buffer another backend's allocator handed out, is refused at
/// the primitive's entry.
#[test]
fn a_backend_refuses_views_outside_their_buffer_and_buffers_of_another_backend() {
    let cpu = CpuBackend::new_ref();
    let other = CpuBackend::new_ref();
    let x = Tensor::zeros(&cpu, &[4], DType::F32).unwrap();
    let foreign = Tensor::ones(&other, &[4], DType::F32).unwrap();

    let too_long = Layout::contiguous(&[5]);
    let past_the_end = View {
        layout: &too_long,
        ..x.view()
    };
    let err = cpu.fill(past_the_end, 1.0).unwrap_err();
    assert!(
        matches!(err, TensorError::InvalidArgument { op: "fill", .. }),
        "{err}"
    );
    let as_f64 = View {
        dtype: DType::F64,
        ..x.view()
    };
    assert!(
        cpu.fill(as_f64, 1.0).is_err(),
        "32 bytes of f64 in a 16-byte buffer"
    );

    let err = cpu.copy(foreign.view(), x.view()).unwrap_err();
    assert!(
        matches!(err, TensorError::InvalidArgument { op: "copy", .. }),
        "{err}"
    );
    assert!(err.to_string().contains("another backend"), "{err}");
    assert!(
        x.copy_(&foreign).is_err(),
        "the op path reaches the same check"
    );
    let mut out = [0u8; 4];
    assert!(cpu.read_host(foreign.buffer(), 0, &mut out).is_err());
    assert!(cpu.write_host(foreign.buffer(), 0, &out).is_err());
    assert!(foreign.to_vec::<f32>().unwrap().iter().all(|&v| v == 1.0));

    // Two outputs of one primitive may not share memory either.
    let pair = Tensor::zeros(&cpu, &[2], DType::I64).unwrap();
    let as_values = View {
        dtype: DType::F32,
        ..pair.view()
    };
    let rows = x.reshape(&[2, 2]).unwrap();
    let err = cpu
        .reduce_with_index(headroom_autograd_core::ReduceWithIndex {
            op: headroom_autograd_core::ReduceOp::Max,
            x: rows.view(),
            values: as_values,
            indices: pair.view(),
        })
        .unwrap_err();
    assert!(matches!(err, TensorError::Overlap { .. }), "{err}");
}

/// Views of one storage: PyTorch's classification from strides, O(ndim).
#[test]
fn overlap_is_classified_from_layouts() {
    let cpu = CpuBackend::new_ref();
    let x = Tensor::zeros(&cpu, &[4, 6], DType::F32).unwrap();
    let o = |a: &Tensor, b: &Tensor| headroom_autograd_core::overlap(&a.view(), &b.view());
    let left = x.narrow(1, 0, 3).unwrap();
    let right = x.narrow(1, 3, 3).unwrap();
    assert_eq!(o(&left, &right), Overlap::Disjoint, "columns");
    assert_eq!(o(&x, &x.reshape(&[24]).unwrap()), Overlap::Partial);
    assert_eq!(o(&x, &x.detach()), Overlap::Same);
    assert_eq!(o(&x, &x.t().unwrap()), Overlap::Partial);
    let other = Tensor::zeros(&cpu, &[4, 6], DType::F32).unwrap();
    assert_eq!(o(&x, &other), Overlap::Disjoint, "another buffer");
    // q, k and v of a packed [batch, seq, 3, heads, dim] projection.
    let qkv = Tensor::zeros(&cpu, &[2, 5, 3, 4, 8], DType::F32).unwrap();
    let q = qkv.narrow(2, 0, 1).unwrap();
    let k = qkv.narrow(2, 1, 1).unwrap();
    assert_eq!(o(&q, &k), Overlap::Disjoint);
    q.fill_(3.0).unwrap();
    k.copy_(&q).unwrap();
    assert_eq!(
        k.sum_all().unwrap().item().unwrap(),
        3.0 * 2.0 * 5.0 * 4.0 * 8.0
    );
    assert_eq!(
        qkv.sum_all().unwrap().item().unwrap(),
        2.0 * 3.0 * 2.0 * 5.0 * 4.0 * 8.0
    );
}

/// `Tensor` is `Send + Sync` and CPU kernels write host memory through raw pointers: two threads
/// writing one storage raced (one fill's rayon tasks interleaved with the other's), and a reader
/// saw half of each. A host claim per kernel makes every write whole: a conflicting call is a
/// `ConcurrentAccess` error, so a reader sees one fill or the other, never a mix.
#[test]
fn two_threads_writing_one_storage_never_interleave() {
    let cpu = CpuBackend::new_ref();
    let n = 1 << 18;
    let x = Tensor::zeros(&cpu, &[n], DType::F32).unwrap();
    let writers_left = Arc::new(AtomicUsize::new(2));
    let writers: Vec<_> = [1.0, 2.0]
        .into_iter()
        .map(|value| {
            let (x, left) = (x.clone(), writers_left.clone());
            std::thread::spawn(move || {
                let mut done = 0;
                while done < 40 {
                    match x.fill_(value) {
                        Ok(_) => done += 1,
                        Err(TensorError::ConcurrentAccess { .. }) => {}
                        Err(err) => panic!("{err}"),
                    }
                    // Leave the reader a window between fills.
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
                left.fetch_sub(1, Ordering::Release);
            })
        })
        .collect();
    let (mut reads, mut mixed) = (0, 0);
    while writers_left.load(Ordering::Acquire) > 0 {
        match x.to_vec::<f32>() {
            Ok(values) => {
                reads += 1;
                if values.iter().any(|&v| v != values[0]) {
                    mixed += 1;
                }
            }
            Err(TensorError::ConcurrentAccess { .. }) => std::thread::yield_now(),
            Err(err) => panic!("{err}"),
        }
    }
    for writer in writers {
        writer.join().unwrap();
    }
    assert_eq!(mixed, 0, "{mixed} of {reads} reads saw two fills at once");
    let last = x.to_vec::<f32>().unwrap();
    assert!(last.iter().all(|&v| v == last[0]) && (last[0] == 1.0 || last[0] == 2.0));
}
