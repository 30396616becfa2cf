//! Misuse of headroom-autograd-core's tensor ops, on the CPU backend: shapes that do not
//! broadcast or fit, dims out of range, sizes that overflow, views past their buffer, arguments
//! out of range, dtypes an op does not take, tensors of two backends in one op. The graph's
//! misuse (backward, gradients, in-place writes, hooks) is in `autograd_graph`.

use std::sync::Arc;

use headroom_autograd_core::{
    cat, cross_entropy, dropout, embedding, layer_norm, patch_embedding,
    scaled_dot_product_attention, BackendRef, DType, Generator, Reduction, Tensor, TensorError,
};
use headroom_caching_allocator::{AllocError, AllocatorConfig, CachingAllocator, HostStorage};
use headroom_ops_cpu::CpuBackend;

use crate::{expect_eq, expect_err, f32s, Case, Outcome};
use headroom_testkit::misuse_cases;
use Refusal::{Autograd, DtypeMismatch, InvalidArgument, Overlap, ShapeMismatch, SizeOverflow};

/// The error a case expects: its [`TensorError`] variant and the op that must report it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Refusal {
    /// [`TensorError::InvalidArgument`] from the op.
    InvalidArgument(&'static str),
    /// [`TensorError::ShapeMismatch`] from the op.
    ShapeMismatch(&'static str),
    /// [`TensorError::DtypeMismatch`] from the op.
    DtypeMismatch(&'static str),
    /// [`TensorError::SizeOverflow`] from the op.
    SizeOverflow(&'static str),
    /// [`TensorError::Overlap`] from the op.
    Overlap(&'static str),
    /// [`TensorError::Autograd`] from the op.
    Autograd(&'static str),
}

impl Refusal {
    /// Whether `err` is this refusal.
    fn is(self, err: &TensorError) -> bool {
        match (self, err) {
            (InvalidArgument(op), TensorError::InvalidArgument { op: got, .. })
            | (ShapeMismatch(op), TensorError::ShapeMismatch { op: got, .. })
            | (DtypeMismatch(op), TensorError::DtypeMismatch { op: got, .. })
            | (SizeOverflow(op), TensorError::SizeOverflow { op: got, .. })
            | (Overlap(op), TensorError::Overlap { op: got, .. })
            | (Autograd(op), TensorError::Autograd { op: got, .. }) => op == *got,
            _ => false,
        }
    }
}

/// `Ok` when `result` is the error `expected`, else what it was instead.
pub(crate) fn refused<T>(result: Result<T, TensorError>, expected: Refusal) -> Outcome {
    match result {
        Err(err) if expected.is(&err) => Ok(()),
        Err(err) => Err(format!("expected {expected:?}, got {err:?}").into()),
        Ok(_) => Err(format!(
            "expected {expected:?}, got Ok({})",
            std::any::type_name::<T>()
        )
        .into()),
    }
}

/// An f32 tensor of zeros of `shape`, on a CPU backend of its own.
fn zeros(shape: &[usize]) -> Result<Tensor, TensorError> {
    Tensor::zeros(&CpuBackend::new_ref(), shape, DType::F32)
}

/// Two f32 tensors of zeros, of shapes `a` and `b`, on one CPU backend.
fn zeros_pair(a: &[usize], b: &[usize]) -> Result<(Tensor, Tensor), TensorError> {
    let cpu = CpuBackend::new_ref();
    Ok((
        Tensor::zeros(&cpu, a, DType::F32)?,
        Tensor::zeros(&cpu, b, DType::F32)?,
    ))
}

pub(crate) fn cases() -> Vec<Case> {
    misuse_cases![
        adding_unbroadcastable_shapes_is_shape_mismatch => {
            let (a, b) = zeros_pair(&[2, 3], &[4])?;
            refused(a.add(&b), ShapeMismatch("add"))
        },
        matmul_of_mismatched_inner_dims_is_shape_mismatch => {
            let (a, b) = zeros_pair(&[2, 3], &[4, 5])?;
            refused(a.matmul(&b), ShapeMismatch("matmul"))
        },
        reshape_to_another_element_count_is_invalid_argument => expect_err!(
            zeros(&[6])?.reshape(&[4]),
            TensorError::InvalidArgument { op: "reshape", .. },
            naming "6 elements"
        ),
        narrow_past_the_end_is_invalid_argument =>
            refused(zeros(&[4])?.narrow(0, 2, 5), InvalidArgument("narrow")),
        narrow_with_a_start_near_usize_max_is_invalid_argument =>
            refused(zeros(&[4])?.narrow(0, usize::MAX, 2), InvalidArgument("narrow")),
        transpose_of_a_dim_out_of_range_is_invalid_argument => expect_err!(
            zeros(&[2, 3])?.transpose(0, 5),
            TensorError::InvalidArgument { op: "transpose", .. },
            naming "dim 5"
        ),
        expand_to_an_incompatible_shape_is_shape_mismatch =>
            refused(zeros(&[3])?.expand(&[2, 4]), ShapeMismatch("expand")),
        as_strided_past_the_buffer_is_invalid_argument =>
            refused(zeros(&[4])?.as_strided(&[4], &[2], 0), InvalidArgument("as_strided")),
        softmax_over_a_dim_out_of_range_is_invalid_argument =>
            refused(zeros(&[2, 3])?.softmax(2), InvalidArgument("softmax")),
        cat_of_mismatched_shapes_is_shape_mismatch => {
            let (a, b) = zeros_pair(&[2, 3], &[2, 4])?;
            refused(cat(&[&a, &b], 0), ShapeMismatch("cat"))
        },
        adding_f32_to_f64_is_dtype_mismatch => {
            let cpu = CpuBackend::new_ref();
            let a = Tensor::zeros(&cpu, &[2], DType::F32)?;
            let b = Tensor::zeros(&cpu, &[2], DType::F64)?;
            refused(a.add(&b), DtypeMismatch("add"))
        },
        from_slice_with_too_few_elements_is_invalid_argument => refused(
            Tensor::from_slice(&CpuBackend::new_ref(), &[1.0f32, 2.0, 3.0], &[2, 2]),
            InvalidArgument("from_slice")
        ),
        a_shape_too_large_to_count_is_size_overflow =>
            expect_err!(zeros(&[usize::MAX, 2]), TensorError::SizeOverflow { .. }),
        a_tensor_past_its_backends_memory_is_alloc_out_of_memory => {
            let small: BackendRef = Arc::new(CpuBackend::new(CachingAllocator::new(
                HostStorage::with_capacity(1 << 20),
                AllocatorConfig::default(),
            )));
            expect_err!(
                Tensor::zeros(&small, &[1 << 20], DType::F32),
                TensorError::Alloc(AllocError::OutOfMemory(report))
                    if report.requested == 4 << 20
            )
        },
        tensors_of_two_backends_in_one_op_is_invalid_argument => {
            let (one, other) = (CpuBackend::new_ref(), CpuBackend::new_ref());
            let a = Tensor::ones(&one, &[2], DType::F32)?;
            let b = Tensor::ones(&other, &[2], DType::F32)?;
            expect_err!(
                a.add(&b),
                TensorError::InvalidArgument { op: "binary", .. },
                naming "another backend"
            )
        },
        writing_into_an_expanded_view_is_overlap =>
            refused(zeros(&[1])?.expand(&[4])?.fill_(1.0), Overlap("fill_")),
        dropout_with_probability_above_1_is_invalid_argument => refused(
            dropout(&zeros(&[4])?, 1.5, true, &Generator::new(0)),
            InvalidArgument("dropout")
        ),
        cross_entropy_with_a_target_past_the_classes_is_invalid_argument => {
            let logits = zeros(&[2, 3])?;
            let target = Tensor::from_slice(logits.backend(), &[0i64, 7], &[2])?;
            expect_err!(
                cross_entropy(&logits, &target, -100, Reduction::Mean),
                TensorError::InvalidArgument { op: "cross_entropy", .. },
                naming "target 7"
            )
        },
        gather_with_an_index_out_of_range_is_invalid_argument => {
            let x = zeros(&[2, 3])?;
            let index = Tensor::from_slice(x.backend(), &[0i64, 3], &[2, 1])?;
            expect_err!(
                x.gather(1, &index),
                TensorError::InvalidArgument { op: "gather", .. },
                naming "index 3"
            )
        },
        split_into_pieces_of_0_is_invalid_argument =>
            refused(zeros(&[4])?.split(0, 0), InvalidArgument("split")),
        split_with_sizes_that_miss_the_dim_is_invalid_argument =>
            refused(zeros(&[4])?.split_with_sizes(&[1, 1], 0), InvalidArgument("split")),
        permute_with_a_repeated_dim_is_invalid_argument =>
            refused(zeros(&[2, 3])?.permute(&[0, 0]), InvalidArgument("permute")),
        // PyTorch raises "dim 0 appears multiple times"; Headroom reduces the dim once.
        sum_over_a_repeated_dim_reduces_it_once => {
            let cpu = CpuBackend::new_ref();
            let x = f32s(&cpu, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
            expect_eq(x.sum(&[0, 0], false)?.to_vec::<f32>()?, vec![5.0, 7.0, 9.0])
        },
        max_over_an_empty_dim_is_shape_mismatch =>
            expect_err!(zeros(&[0, 3])?.max_dim(0, false), TensorError::ShapeMismatch { .. }),
        reshape_inferred_with_two_unknowns_is_invalid_argument =>
            refused(zeros(&[6])?.reshape_inferred(&[-1, -1]), InvalidArgument("reshape")),
        reshape_inferred_beside_a_zero_dim_is_invalid_argument =>
            refused(zeros(&[6])?.reshape_inferred(&[0, -1]), InvalidArgument("reshape")),
        reshape_inferred_with_a_negative_size_is_invalid_argument =>
            refused(zeros(&[6])?.reshape_inferred(&[-2, -3]), InvalidArgument("reshape")),
        as_strided_with_an_overflowing_stride_is_size_overflow =>
            refused(zeros(&[4])?.as_strided(&[2], &[usize::MAX], 0), SizeOverflow("as_strided")),
        expand_to_more_elements_than_usize_counts_is_size_overflow =>
            refused(zeros(&[1, 3])?.expand(&[usize::MAX, 3]), SizeOverflow("expand")),
        cat_of_no_tensors_is_invalid_argument => refused(cat(&[], 0), InvalidArgument("cat")),
        cat_along_a_dim_out_of_range_is_invalid_argument => {
            let a = zeros(&[2])?;
            refused(cat(&[&a, &a], 3), InvalidArgument("cat"))
        },
        flatten_with_start_after_end_is_invalid_argument =>
            refused(zeros(&[2, 3, 4])?.flatten(2, 0), InvalidArgument("flatten")),
        unsqueeze_past_the_last_position_is_invalid_argument =>
            refused(zeros(&[2, 3])?.unsqueeze(4), InvalidArgument("unsqueeze")),
        matmul_of_a_scalar_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let s = Tensor::scalar(&cpu, 2.0, DType::F32)?;
            let m = Tensor::ones(&cpu, &[2, 2], DType::F32)?;
            refused(s.matmul(&m), InvalidArgument("matmul"))
        },
        masked_fill_with_a_float_mask_is_unsupported_dtype => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::ones(&cpu, &[2], DType::F32)?;
            let mask = Tensor::ones(&cpu, &[2], DType::F32)?;
            expect_err!(
                x.masked_fill(&mask, 0.0),
                TensorError::UnsupportedDtype {
                    op: "masked_fill",
                    dtype: DType::F32
                }
            )
        },
        layer_norm_with_a_weight_of_another_shape_is_shape_mismatch => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::ones(&cpu, &[2, 4], DType::F32)?;
            let weight = Tensor::ones(&cpu, &[3], DType::F32)?;
            refused(
                layer_norm(&x, &[4], Some(&weight), None, 1e-5),
                ShapeMismatch("layer_norm"),
            )
        },
        layer_norm_over_a_shape_the_input_does_not_end_with_is_shape_mismatch => {
            let x = Tensor::ones(&CpuBackend::new_ref(), &[2, 4], DType::F32)?;
            refused(layer_norm(&x, &[5], None, None, 1e-5), ShapeMismatch("layer_norm"))
        },
        attention_of_mismatched_key_and_query_widths_is_shape_mismatch => {
            let cpu = CpuBackend::new_ref();
            let q = Tensor::ones(&cpu, &[1, 2, 4, 8], DType::F32)?;
            let kv = Tensor::ones(&cpu, &[1, 2, 4, 6], DType::F32)?;
            refused(
                scaled_dot_product_attention(&q, &kv, &kv, false, None),
                ShapeMismatch("attention"),
            )
        },
        patch_embedding_with_patches_of_0_is_shape_mismatch => {
            let cpu = CpuBackend::new_ref();
            let images = Tensor::ones(&cpu, &[1, 3, 4, 4], DType::F32)?;
            let weight = Tensor::ones(&cpu, &[2, 3, 2, 2], DType::F32)?;
            refused(
                patch_embedding(&images, &weight, None, 0),
                ShapeMismatch("patch_embedding"),
            )
        },
        embedding_of_a_one_dimensional_weight_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let weight = Tensor::ones(&cpu, &[4], DType::F32)?;
            let ids = Tensor::from_slice(&cpu, &[0i64, 1], &[2])?;
            refused(embedding(&weight, &ids), InvalidArgument("embedding"))
        },
        to_vec_of_another_element_type_converts_each_value => {
            let cpu = CpuBackend::new_ref();
            let x = f32s(&cpu, &[1.5, -2.0], &[2])?;
            expect_eq(x.to_vec::<f64>()?, vec![1.5, -2.0])
        },
        item_of_two_elements_is_invalid_argument =>
            refused(zeros(&[2])?.item(), InvalidArgument("item")),
        cross_entropy_with_targets_of_another_count_is_shape_mismatch => {
            let logits = zeros(&[2, 3])?;
            let target = Tensor::from_slice(logits.backend(), &[0i64, 1, 2], &[3])?;
            refused(
                cross_entropy(&logits, &target, -100, Reduction::Mean),
                ShapeMismatch("cross_entropy"),
            )
        },
        cross_entropy_with_float_targets_is_dtype_mismatch => {
            let (logits, target) = zeros_pair(&[2, 3], &[2])?;
            expect_err!(
                cross_entropy(&logits, &target, -100, Reduction::Mean),
                TensorError::DtypeMismatch {
                    op: "cross_entropy",
                    lhs: DType::I64,
                    rhs: DType::F32
                }
            )
        },
        flatten_to_a_dim_out_of_range_is_invalid_argument =>
            refused(zeros(&[2, 3, 4])?.flatten(0, 5), InvalidArgument("flatten")),
        squeeze_of_a_dim_out_of_range_is_invalid_argument =>
            refused(zeros(&[2, 1])?.squeeze_dim(5), InvalidArgument("squeeze")),
        narrow_of_a_dim_out_of_range_is_invalid_argument =>
            refused(zeros(&[2, 3])?.narrow(-3, 0, 1), InvalidArgument("narrow")),
        split_along_a_dim_out_of_range_is_invalid_argument =>
            refused(zeros(&[2, 3])?.split(1, 2), InvalidArgument("split")),
        sum_over_a_dim_out_of_range_is_invalid_argument =>
            refused(zeros(&[2, 3])?.sum(&[2], true), InvalidArgument("sum")),
        max_over_a_dim_out_of_range_is_invalid_argument =>
            refused(zeros(&[2, 3])?.max_dim(-3, false), InvalidArgument("max")),
        permute_with_too_few_dims_is_invalid_argument =>
            refused(zeros(&[2, 3])?.permute(&[0]), InvalidArgument("permute")),
        permute_with_a_dim_out_of_range_is_invalid_argument =>
            refused(zeros(&[2, 3])?.permute(&[0, 5]), InvalidArgument("permute")),
        gather_along_a_dim_out_of_range_is_invalid_argument => {
            let x = zeros(&[2, 3])?;
            let index = Tensor::from_slice(x.backend(), &[0i64, 1], &[2, 1])?;
            refused(x.gather(4, &index), InvalidArgument("gather"))
        },
        log_softmax_of_a_scalar_along_dim_1_is_invalid_argument => {
            let x = Tensor::scalar(&CpuBackend::new_ref(), 1.0, DType::F32)?;
            refused(x.log_softmax(1), InvalidArgument("log_softmax"))
        },
    ]
}
